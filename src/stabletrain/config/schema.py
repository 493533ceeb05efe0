"""The config's keys: sections, types, defaults, help and the rules a value must meet.

Every field carries its meaning in ``metadata["help"]``; ``stabletrain train --help`` prints them all
with their defaults (:func:`describe_keys`). :meth:`Config.validate` checks every key's type, then
its range (:data:`RANGES`, one rule per key, which the policies that take the same value apply too:
:func:`check_range`), then the rules that tie keys together.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from ..errors import brief
from ..tasks.arguments import BUILTIN_TASKS  # torch-free: a task that is neither built in nor 'module:function' is refused here
from .values import ConfigError, check_types, type_hints

__all__ = ["Config", "TrainConfig", "AccumConfig", "ClipConfig", "OptimConfig", "SchedConfig", "DataConfig", "MlflowConfig",
           "WandbConfig", "LogConfig", "EvalConfig", "CkptConfig", "GuardConfig", "CaptureConfig", "RemedyConfig",
           "DistConfig", "RunConfig", "TRACKERS", "RANGES", "check_range", "describe_keys", "check_remedy_capture"]


def _f(default: Any, help: str, **kw: Any) -> Any:
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


def _section(cls: type, help: str) -> Any:
    return field(default_factory=cls, metadata={"help": help})


@dataclass
class TrainConfig:
    max_steps: int = _f(300, "optimizer steps to run (a skipped step counts)")
    batch_size: int = _f(16, "samples per micro-batch per process")
    gc_freeze: bool = _f(True, "keep the objects alive at fit() start out of the garbage collector's full scans (gc.freeze)")
    compile: bool = _f(False, "torch.compile the model the step calls (the step, guard and metrics stay eager); not resume-safe")


@dataclass
class AccumConfig:
    steps: int = _f(1, "micro-batches per optimizer step (fewer in the last window of an epoch)")


@dataclass
class ClipConfig:
    max_norm: float | None = _f(1.0, "global L2 grad-norm threshold; null turns clipping off (the norm is still measured)")


@dataclass
class OptimConfig:
    name: Literal["adamw", "adam", "sgd"] = _f("adamw", "the optimizer, built fused (a skip stays on the device): "
                                                        "adamw, adam or sgd")
    lr: float = _f(1e-3, "peak learning rate")
    weight_decay: float = _f(0.1, "weight decay on matrices, never on biases and norms (adamw: decoupled; adam, sgd: L2)")
    beta1: float = _f(0.9, "adam/adamw beta1")
    beta2: float = _f(0.95, "adam/adamw beta2")
    eps: float = _f(1e-8, "adam/adamw epsilon")
    momentum: float = _f(0.0, "sgd momentum, in [0, 1) (sgd only)")
    nesterov: bool = _f(False, "sgd Nesterov momentum (sgd only; needs optim.momentum > 0)")


@dataclass
class SchedConfig:
    warmup_steps: int = _f(20, "linear warmup from 0 to optim.lr over this many applied steps")
    decay: Literal["cosine", "constant"] = _f("cosine", "after warmup: cosine to min_lr_ratio at train.max_steps, or constant")
    min_lr_ratio: float = _f(0.1, "final LR as a fraction of optim.lr (cosine decay)")


@dataclass
class DataConfig:
    shuffle: bool = _f(True, "reshuffle the sample order every epoch (seeded by seed and epoch)")
    workers: int = _f(0, "DataLoader worker processes (seeded from seed)")


#: What ``log.trackers`` may list: TensorBoard (RUN_DIR/tb) and the trackers of :mod:`stabletrain.callbacks.trackers`.
TRACKERS: tuple[str, ...] = ("tensorboard", "mlflow", "wandb")


@dataclass
class MlflowConfig:
    tracking_uri: str | None = _f(None, "MLflow tracking URI; null = MLflow's default (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    experiment: str = _f("stabletrain", "the MLflow experiment the run is logged in (created when missing)")
    run_name: str | None = _f(None, "the MLflow run's name; null = the run directory's name")


@dataclass
class WandbConfig:
    mode: Literal["offline", "online"] = _f("offline", "offline: files under log.wandb.dir only, no network; "
                                                       "online: also streamed")
    project: str = _f("stabletrain", "the W&B project")
    entity: str | None = _f(None, "the W&B entity (team or user); null = your default")
    dir: str | None = _f(None, "where W&B writes its files (DIR/wandb/offline-run-*); null = the run directory")
    run_name: str | None = _f(None, "the W&B run's display name; null = the run directory's name")


@dataclass
class LogConfig:
    every: int = _f(10, "steps per log interval: metrics are reduced on the host once per interval")
    trackers: list[Literal[TRACKERS]] = _f(["tensorboard"], "where each interval's metrics go besides metrics.jsonl: "
                                                            "tensorboard, mlflow, wandb")
    mlflow: MlflowConfig = _section(MlflowConfig, "MLflow, when log.trackers lists mlflow")
    wandb: WandbConfig = _section(WandbConfig, "Weights & Biases, when log.trackers lists wandb")
    tensorboard: bool = _f(True, "write TensorBoard event files to RUN_DIR/tb when log.trackers lists tensorboard")
    progress: bool = _f(True, "show progress on stderr: a bar on a terminal, else one line per log interval")
    top_layers: int = _f(3, "how many parameters to name as dominating the grad norm at each log")
    init_signal: bool | Literal["auto"] = _f("auto", "report which layers vanish or explode on a new run's first batch "
                                                     "(auto: when a copy of the model fits)")


@dataclass
class EvalConfig:
    every: int = _f(100, "steps between validation passes (0 = only at the end; each ends its log interval); needs val_data")
    batches: int = _f(8, "validation micro-batches per pass (0 = the whole validation set)")


@dataclass
class CkptConfig:
    every: int = _f(100, "steps between checkpoints (0 = only at the end and on SIGTERM/SIGINT); healthy states only")
    keep: int = _f(3, "how many newest checkpoints to keep (LAST_GOOD's and the newest before a run of skips: never deleted)")
    max_failures: int = _f(3, "stop the run after this many failed checkpoint saves in a row (0 = never stop)")


@dataclass
class GuardConfig:
    on_nonfinite: Literal["skip", "stop", "rollback", "remedy"] = _f(
        "skip", "a non-finite loss, grad norm or parameter: skip the step, stop, roll back, or apply a verified remedy")
    on_spike: Literal["warn", "skip", "rollback", "remedy"] = _f(
        "warn", "a loss spike: record it, skip the step, roll back, or skip it and apply a verified remedy")
    spike_window: int = _f(50, "recent finite, non-spike losses the spike rule compares against (and its rarity bar's steps)")
    spike_ratio: float = _f(2.0, "spike rule: loss > spike_ratio x median of the window ...")
    spike_zscore: float = _f(6.0, "... and (loss - mean) / std > spike_zscore; or robust z past ratio^5 x median (5x past ^2)")
    max_consecutive_skips: int = _f(20, "stop the run after this many skipped steps in a row (fp16 back-offs not counted)")
    stall_steps: int = _f(20, "stalled: no gradient of this many recent steps reached the parameters (see guard.on_stall)")
    on_stall: Literal["stop", "warn"] = _f("stop", "a stalled run: stop with one line saying what to do, or warn once")
    max_rollbacks: int = _f(3, "stop the run after this many rollbacks")
    check_params: bool = _f(True, "check on each log interval's last step that the parameters are finite (no sync)")
    check_inputs: bool = _f(False, "check floating-point inputs of every micro-batch for NaN/Inf")
    precursor: bool = _f(True, "warn before a loss spike: a layer whose update/weight ratio departs from its history")
    precursor_window: int = _f(20, "precursor: the history a layer is compared with, in log intervals (an EMA)")
    precursor_zscore: float = _f(3.0, "precursor: departs when log(update/weight) is this many stds above its mean ...")
    precursor_ratio: float = _f(2.0, "... and its ratio is more than this many times its history's geometric mean")
    precursor_warmup: int = _f(5, "precursor: log intervals of a layer's history before it can warn")


@dataclass
class CaptureConfig:
    incidents: bool = _f(True, "capture the first bad step of an interval into RUN_DIR/incidents/step_N, replayed")
    spikes: bool = _f(True, "capture a loss spike as an incident too, its cause found by counterfactual replays")
    max_spikes: int = _f(5, "capture at most this many spikes in a run (later ones are still events)")
    memory_snapshot: bool | Literal["auto"] = _f("auto", "stage the state in host memory at each interval's start "
                                                         "(auto: when it fits); false: replay from LAST_GOOD")
    snapshot_memory_fraction: float = _f(0.25, "capture.memory_snapshot=auto: the share of the host's memory the "
                                               "snapshots may take")
    diagnose: bool = _f(True, "diagnose a captured incident right away (replay under the precise tools)")


@dataclass
class RemedyConfig:
    apply: str | None = _f(None, "apply one verified remedy by hand: INCIDENT_DIR:NAME (or :N, its row) of its remedy.json")
    steps: int = _f(20, "guard.on_*=remedy: windows each candidate is replayed over after the incident's (to max_steps; 1+)")
    fallback: Literal["skip", "stop", "rollback"] = _f("skip", "guard.on_*=remedy: what to do when no candidate cures")
    max_applied: int = _f(3, "guard.on_*=remedy: apply at most this many remedies in a run; then remedy.fallback")


@dataclass
class DistConfig:
    nproc: int = _f(1, "processes to start on this machine: > 1 launches torchrun (--standalone) with this many")
    backend: Literal["auto", "gloo", "nccl"] = _f("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU")
    strategy: Literal["ddp", "fsdp"] = _f("ddp", "with more than one process: ddp (DistributedDataParallel) or fsdp (FSDP2)")
    reshard_after_forward: bool = _f(True, "fsdp only: free each block's gathered parameters after its forward")
    checkpoint: Literal["sharded", "full"] = _f("sharded", "fsdp: each rank writes its shards (DCP), or rank 0 one full file")
    timeout_s: float = _f(120.0, "seconds a collective waits for the other ranks before the run fails with a clear line")


@dataclass
class RunConfig:
    dir: str | None = _f(None, "the run directory; default runs/<task>-<timestamp>")
    overwrite: bool = _f(False, "allow writing into a run directory that already holds a run")
    resume: Literal["never", "auto"] = _f("never", "auto: continue run.dir from its LAST_GOOD when it holds one, else start it")
    max_restarts: int = _f(0, "restart from LAST_GOOD by itself at most this many times when a process dies (0: never)")
    max_repeats: int = _f(2, "restarts in a row that may meet the same failure before the run stops")


@dataclass
class Config:
    """The whole run configuration; ``config.yaml`` in the run dir is this, fully resolved."""

    task: str = _f("gpt", "built-in task name (gpt, mlp) or a user factory 'module:function' returning a Task")
    task_args: dict = _f({}, "keyword arguments for the task factory (e.g. task_args.n_layer=6 for gpt)")
    seed: int = _f(0, "seed for python, numpy, torch (all devices) and dataloader workers")
    deterministic: bool = _f(False, "deterministic algorithms and cuDNN while fit() runs (put back after)")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto", "auto = bf16 on CUDA where supported, else fp32; "
                                                                    "fp16 uses a GradScaler")
    device: str = _f("auto", "auto = cuda if available, else cpu; or an explicit torch device string")
    train: TrainConfig = _section(TrainConfig, "training length and batch")
    accum: AccumConfig = _section(AccumConfig, "gradient accumulation")
    clip: ClipConfig = _section(ClipConfig, "gradient clipping")
    optim: OptimConfig = _section(OptimConfig, "optimizer: fused AdamW (default), Adam or SGD; a task may bring its own")
    sched: SchedConfig = _section(SchedConfig, "learning-rate schedule (device-side; held on skipped steps)")
    data: DataConfig = _section(DataConfig, "data order and loading")
    log: LogConfig = _section(LogConfig, "metrics and sinks")
    eval: EvalConfig = _section(EvalConfig, "validation")
    run: RunConfig = _section(RunConfig, "run directory")
    ckpt: CkptConfig = _section(CkptConfig, "checkpoints")
    guard: GuardConfig = _section(GuardConfig, "the NaN/Inf sentinel, loss spikes, stalls and skips")
    capture: CaptureConfig = _section(CaptureConfig, "the incident snapshot, capture and diagnosis")
    remedy: RemedyConfig = _section(RemedyConfig, "verified remedies: by hand, or the search and its fallback")
    dist: DistConfig = _section(DistConfig, "more than one process (DDP or FSDP2, launched by torchrun)")
    resume: str | None = _f(None, "a run directory to continue from its LAST_GOOD checkpoint (same as --resume)")
    callbacks: list[str] = _f([], "your callbacks: 'module:Class' entries, each built with no arguments")

    def validate(self) -> "Config":
        """Check the type of every key, then value ranges; raise ConfigError naming the dotted key and the value seen.

        Works on a Config built in Python as on one loaded from YAML. In place: an int where a float is
        declared becomes that float, a tuple where a list is declared becomes a list. Returns ``self``.
        """
        check_types(self, type(self))
        for key in RANGES:
            value = self
            for part in key.split("."):
                value = getattr(value, part)
            check_range(key, value)
        if self.task not in BUILTIN_TASKS and ":" not in self.task:  # a factory is imported later, with torch
            raise ConfigError(f"config key 'task': expected a built-in task ({', '.join(BUILTIN_TASKS)}) or "
                              f"'module:function', got {self.task!r}")
        optim = self.optim
        if optim.name != "sgd" and (optim.momentum or optim.nesterov):
            key, value = ("optim.momentum", optim.momentum) if optim.momentum else ("optim.nesterov", optim.nesterov)
            raise ConfigError(f"config key '{key}': applies to optim.name=sgd only, got {brief(value)} "
                              f"with optim.name={optim.name} (remove it, or set optim.name=sgd)")
        if optim.nesterov and optim.momentum <= 0:
            raise ConfigError(f"config key 'optim.nesterov': Nesterov momentum needs optim.momentum > 0, got "
                              f"optim.nesterov=true with optim.momentum={optim.momentum!r}")
        if self.run.resume == "auto" and not self.run.dir:
            raise ConfigError("config key 'run.resume': auto continues or starts run.dir, but run.dir is not set "
                              "(set run.dir=DIR)")
        for i, name in enumerate(self.log.trackers):
            if name in self.log.trackers[:i]:
                raise ConfigError(f"config key 'log.trackers[{i}]': {name} is listed twice, got {brief(self.log.trackers)}")
        for i, entry in enumerate(self.callbacks):
            if not _CALLBACK_ENTRY.fullmatch(entry):
                raise ConfigError(f"config key 'callbacks[{i}]': expected 'module:Class' (e.g. mypkg.callbacks:LogGrads), "
                                  f"got {entry!r}")
        return self


def check_remedy_capture(cfg: Config) -> None:
    """A remedy is searched from the incident's capture: ``guard.on_spike``/``on_nonfinite=remedy`` without it is a
    ConfigError naming both keys (every incident would fall back, said one by one). For the configs a run is started
    or resumed with (:func:`~.loading.load_config`), not for one read back from a saved run or bundle."""
    off = [(k, "false", "true") for k, on in (("capture.incidents", cfg.capture.incidents),
                                              ("capture.spikes", cfg.capture.spikes)) if not on]
    if not cfg.capture.max_spikes:  # no spike is ever captured, as with capture.spikes=false
        off.append(("capture.max_spikes", "0", "1 or more"))
    for key, value, needs in (("guard.on_nonfinite", cfg.guard.on_nonfinite, off[:1] if not cfg.capture.incidents else []),
                              ("guard.on_spike", cfg.guard.on_spike, off)):
        if value == "remedy" and needs:
            (what, seen, fix), *_ = needs
            raise ConfigError(f"config key '{key}': remedy is searched from the incident's capture, but {what}={seen} "
                              f"(set {what}={fix}, or {key}=skip)", key=key)


_CALLBACK_ENTRY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


#: The range of each numeric key, checked after its type: dotted key -> (test, what a value must be).
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "seed": (lambda v: v >= 0, "an integer >= 0"),
    "train.max_steps": (lambda v: v >= 1, "an integer >= 1"),
    "train.batch_size": (lambda v: v >= 1, "an integer >= 1"),
    "accum.steps": (lambda v: v >= 1, "an integer >= 1"),
    "clip.max_norm": (lambda v: v is None or v > 0, "a number > 0 or null"),
    # (the optimizer holds it in float32: 1e39 is inf there, and the first update makes every weight inf; a trial)
    "optim.lr": (lambda v: 0 < v <= 3.4e38, "a number > 0 that float32 holds (at most 3.4e38)"),
    "optim.weight_decay": (lambda v: v >= 0, "a number >= 0"),
    "optim.beta1": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "optim.beta2": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "optim.eps": (lambda v: v > 0, "a number > 0"),
    "optim.momentum": (lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "sched.warmup_steps": (lambda v: v >= 0, "an integer >= 0"),
    "sched.min_lr_ratio": (lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "data.workers": (lambda v: v >= 0, "an integer >= 0"),
    "log.every": (lambda v: v >= 1, "an integer >= 1"),
    "log.top_layers": (lambda v: v >= 0, "an integer >= 0"),
    "eval.every": (lambda v: v >= 0, "an integer >= 0"),
    "eval.batches": (lambda v: v >= 0, "an integer >= 0"),
    "ckpt.every": (lambda v: v >= 0, "an integer >= 0"),
    "ckpt.keep": (lambda v: v >= 1, "an integer >= 1"),
    "ckpt.max_failures": (lambda v: v >= 0, "an integer >= 0"),
    # (at most 10,000: the window is a device tensor the rule takes a median of each interval; 1e9 took 24 GB)
    "guard.spike_window": (lambda v: 4 <= v <= 10_000, "an integer in [4, 10000]"),
    # (infinity turns the spike rule off unsaid: refused, as nan is)
    "guard.spike_ratio": (lambda v: 1 < v < float("inf"), "a finite number > 1"),
    "guard.spike_zscore": (lambda v: 0 < v < float("inf"), "a finite number > 0"),
    "guard.max_consecutive_skips": (lambda v: v >= 1, "an integer >= 1"),
    "guard.stall_steps": (lambda v: v >= 2, "an integer >= 2"),
    "guard.max_rollbacks": (lambda v: v >= 0, "an integer >= 0"),
    "remedy.steps": (lambda v: v >= 1, "an integer >= 1"),
    "remedy.max_applied": (lambda v: v >= 0, "an integer >= 0"),
    "capture.max_spikes": (lambda v: v >= 0, "an integer >= 0"),
    "capture.snapshot_memory_fraction": (lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "guard.precursor_window": (lambda v: v >= 2, "an integer >= 2"),
    "guard.precursor_zscore": (lambda v: v > 0, "a number > 0"),
    "guard.precursor_ratio": (lambda v: v >= 1, "a number >= 1"),
    "guard.precursor_warmup": (lambda v: v >= 2, "an integer >= 2"),
    "dist.nproc": (lambda v: v >= 1, "an integer >= 1"),
    "dist.timeout_s": (lambda v: v > 0, "a number > 0"),
    "run.max_restarts": (lambda v: v >= 0, "an integer >= 0"),
    "run.max_repeats": (lambda v: v >= 1, "an integer >= 1"),
}


def check_range(key: str, value: Any) -> Any:
    """Return ``value`` when it meets ``key``'s rule in :data:`RANGES`; else raise ConfigError naming the key and the value."""
    test, want = RANGES[key]
    if not test(value):
        raise ConfigError(f"config key '{key}': expected {want}, got {brief(value)}")
    return value


def describe_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """Return (dotted key, default, help) for every leaf key, in declaration order."""
    rows: list[tuple[str, str, str]] = []
    hints = type_hints(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            rows.extend(describe_keys(tp, key + "."))
        else:
            value = getattr(default, f.name)
            rows.append((key, "null" if value is None else json.dumps(value) if not isinstance(value, str) else value,
                         f.metadata.get("help", "")))
    return rows
