"""stabletrain: make PyTorch training stable, observable and debuggable.

Every public name is imported when first used (PEP 562 ``__getattr__``): ``import stabletrain`` and the
command line's ``--version``, ``--help`` and config errors do not import torch; ``from stabletrain import
Trainer`` works as always. The names, and the module each comes from, are listed once, in ``_EXPORTS``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

# name -> the module (relative to this package) that defines it
_EXPORTS: dict[str, str] = {
    "AccumulationWindow": ".policies.accumulation",
    "as_sum_count": ".policies.accumulation",
    "GradClipper": ".policies.clipping",
    "Config": ".config",
    "ConfigError": ".config",
    "diff_configs": ".config",
    "load_config": ".config",
    "StableTrainWarning": ".console",
    "StepMetrics": ".policies.metrics",
    "all_params_finite": ".numerics",
    "first_nonfinite_grad": ".numerics",
    "grad_norms": ".numerics",
    "grad_total_norm": ".numerics",
    "PrecisionPolicy": ".policies.precision",
    "LRSchedule": ".policies.schedule",
    "seed_everything": ".seeding",
    "Task": ".tasks",
    "resolve_task": ".tasks",
    "TrainStep": ".step",
    "build_optimizer": ".policies.optim",
    "Callback": ".callbacks",
    "FitState": ".callbacks",
    "RunState": ".runstate",
    "Trainer": ".loop",
    "CheckpointError": ".records.checkpoint.files",
    "CheckpointManager": ".records.checkpoint.manager",
    "Guard": ".policies.guard",
    "diagnose_incident": ".incident_replay",
    "diagnose_step": ".incident_replay",
    "InitChange": ".diagnostics.initialization",
    "InitFingerprint": ".diagnostics.initialization",
    "init_": ".tasks.init_schemes",
    "Bisection": ".diagnostics.bisection",
    "bisect_samples": ".diagnostics.bisection",
    "anomaly_trace": ".diagnostics.anomaly",
    "NonFiniteLocator": ".diagnostics.nonfinite",
    "NonFiniteOp": ".diagnostics.nonfinite",
    "plot_signal": ".diagnostics.signal_display",
    "SignalReport": ".diagnostics.signal_propagation",
    "SignalThresholds": ".diagnostics.signal_propagation",
    "signal_report": ".diagnostics.signal_propagation",
    "Monitor": ".integrations.monitor",
    "StopTraining": ".errors",
}

if TYPE_CHECKING:  # what a type checker and an IDE see: the same names, imported eagerly
    from .callbacks import Callback, FitState
    from .config import Config, ConfigError, diff_configs, load_config
    from .console import StableTrainWarning
    from .diagnostics.anomaly import anomaly_trace
    from .diagnostics.bisection import Bisection, bisect_samples
    from .diagnostics.initialization import InitChange, InitFingerprint
    from .diagnostics.nonfinite import NonFiniteLocator, NonFiniteOp
    from .diagnostics.signal_display import plot_signal
    from .diagnostics.signal_propagation import SignalReport, SignalThresholds, signal_report
    from .incident_replay import diagnose_incident, diagnose_step
    from .integrations.monitor import Monitor, StopTraining
    from .loop import Trainer
    from .numerics import all_params_finite, first_nonfinite_grad, grad_norms, grad_total_norm
    from .policies.accumulation import AccumulationWindow, as_sum_count
    from .policies.clipping import GradClipper
    from .policies.guard import Guard
    from .policies.metrics import StepMetrics
    from .policies.optim import build_optimizer
    from .policies.precision import PrecisionPolicy
    from .policies.schedule import LRSchedule
    from .records.checkpoint.files import CheckpointError
    from .records.checkpoint.manager import CheckpointManager
    from .runstate import RunState
    from .seeding import seed_everything
    from .step import TrainStep
    from .tasks import Task, resolve_task
    from .tasks.init_schemes import init_


def __getattr__(name: str) -> Any:
    """Import ``name`` from the module that defines it, the first time it is asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # asked once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = ["__version__", *_EXPORTS]
