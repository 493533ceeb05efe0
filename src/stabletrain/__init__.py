"""stabletrain: make PyTorch training stable, observable and debuggable."""

from ._version import __version__
from .policies.accumulation import AccumulationWindow, as_sum_count
from .policies.clipping import GradClipper
from .config import Config, ConfigError, diff_configs, load_config
from .console import StableTrainWarning
from .policies.metrics import StepMetrics
from .numerics import all_params_finite, first_nonfinite_grad, grad_norms, grad_total_norm
from .policies.precision import PrecisionPolicy
from .policies.schedule import LRSchedule
from .seeding import seed_everything
from .tasks import Task, resolve_task
from .step import TrainStep
from .policies.optim import build_optimizer
from .callbacks import Callback, FitState
from .loop import Trainer
from .records.checkpoint.files import CheckpointError
from .records.checkpoint.manager import CheckpointManager
from .policies.guard import Guard
from .replay import diagnose_incident, diagnose_step
from .diagnostics.initialization import InitChange, InitFingerprint
from .tasks.init_schemes import init_
from .diagnostics.bisection import Bisection, bisect_samples
from .diagnostics.anomaly import anomaly_trace
from .diagnostics.nonfinite import NonFiniteLocator, NonFiniteOp
from .diagnostics.signal_display import plot_signal
from .diagnostics.signal_propagation import SignalReport, SignalThresholds, signal_report
from .integrations.monitor import Monitor, StopTraining

__all__ = [
    "__version__",
    "AccumulationWindow",
    "as_sum_count",
    "GradClipper",
    "grad_norms",
    "Config",
    "ConfigError",
    "StableTrainWarning",
    "load_config",
    "StepMetrics",
    "all_params_finite",
    "first_nonfinite_grad",
    "grad_total_norm",
    "PrecisionPolicy",
    "LRSchedule",
    "seed_everything",
    "Task",
    "resolve_task",
    "TrainStep",
    "build_optimizer",
    "Callback",
    "FitState",
    "Trainer",
    "CheckpointError",
    "CheckpointManager",
    "diff_configs",
    "Guard",
    "diagnose_incident",
    "InitChange",
    "InitFingerprint",
    "init_",
    "Bisection",
    "NonFiniteLocator",
    "NonFiniteOp",
    "anomaly_trace",
    "bisect_samples",
    "diagnose_step",
    "SignalReport",
    "SignalThresholds",
    "plot_signal",
    "signal_report",
    "Monitor",
    "StopTraining",
]
