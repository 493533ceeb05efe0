"""The run configuration: a tree of dataclasses, loaded from YAML, overridden by dotted ``key=value``.

Every field carries its meaning in ``metadata["help"]``; ``stabletrain train --help`` prints them all
with their defaults. Unknown keys and bad values raise :class:`ConfigError`, naming the dotted key and
the value seen, whether the config comes from YAML, overrides or Python (:meth:`Config.validate`).

This module is the one source for the config's keys, types, defaults, help and validation, for
flattening and diffing configs (:func:`flatten_config`, :func:`diff_configs`), and for the keys that
may change when a run is resumed (:data:`RESUME_SAFE_KEYS`): help, README and the resume refusal all
print that list from here.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import hashlib
import json
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml
from torch.utils._pytree import GetAttrKey, KeyEntry, MappingKey, SequenceKey, tree_flatten_with_path

from .errors import brief

__all__ = [
    "Config",
    "ConfigError",
    "TRACKERS",
    "load_config",
    "load_yaml",
    "config_from_dict",
    "config_to_dict",
    "config_hash",
    "describe_keys",
    "flatten_config",
    "dotted_key",
    "diff_configs",
    "format_config_diff",
    "ConfigDiff",
    "ABSENT",
    "RESUME_SAFE_KEYS",
    "RESHARD_SAFE_KEYS",
    "resume_safe_text",
    "resume_refusal_message",
]


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message names the dotted key."""


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


@dataclass
class AccumConfig:
    steps: int = _f(1, "micro-batches per optimizer step (fewer in the last window of an epoch)")


@dataclass
class ClipConfig:
    max_norm: float | None = _f(1.0, "global L2 grad-norm threshold; null turns clipping off (the norm is still measured)")


@dataclass
class OptimConfig:
    name: Literal["adamw", "adam", "sgd"] = _f("adamw", "the optimizer, built fused so a skipped step stays on the device: adamw, adam or sgd")
    lr: float = _f(1e-3, "peak learning rate")
    weight_decay: float = _f(0.1, "weight decay on matrices (never on biases and norms), every optimizer: decoupled for adamw, L2 added to the gradient for adam and sgd")
    beta1: float = _f(0.9, "adam/adamw beta1")
    beta2: float = _f(0.95, "adam/adamw beta2")
    eps: float = _f(1e-8, "adam/adamw epsilon")
    momentum: float = _f(0.0, "sgd momentum, in [0, 1) (sgd only)")
    nesterov: bool = _f(False, "sgd Nesterov momentum (sgd only; needs optim.momentum > 0)")


@dataclass
class SchedConfig:
    warmup_steps: int = _f(20, "linear warmup from 0 to optim.lr over this many applied steps")
    decay: Literal["cosine", "constant"] = _f("cosine", "shape after warmup: cosine to min_lr_ratio at train.max_steps, or constant")
    min_lr_ratio: float = _f(0.1, "final LR as a fraction of optim.lr (cosine decay)")


@dataclass
class DataConfig:
    shuffle: bool = _f(True, "reshuffle the sample order every epoch (seeded by seed and epoch)")
    workers: int = _f(0, "DataLoader worker processes (seeded from seed)")


#: What ``log.trackers`` may list: TensorBoard (RUN_DIR/tb) and the trackers of :mod:`stabletrain.callbacks.trackers`.
TRACKERS: tuple[str, ...] = ("tensorboard", "mlflow", "wandb")


@dataclass
class MlflowConfig:
    tracking_uri: str | None = _f(None, "MLflow tracking URI; null = MLflow's own default (MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working directory); e.g. sqlite:///runs/mlflow.db, or file:./mlruns (MLflow 3 refuses a file store unless MLFLOW_ALLOW_FILE_STORE=true)")
    experiment: str = _f("stabletrain", "the MLflow experiment the run is logged in (created when missing)")
    run_name: str | None = _f(None, "the MLflow run's name; null = the run directory's name")


@dataclass
class WandbConfig:
    mode: Literal["offline", "online"] = _f("offline", "offline: W&B writes the run under log.wandb.dir only, no network (upload it later with wandb sync); online: also streamed to the W&B server (needs the network and a login)")
    project: str = _f("stabletrain", "the W&B project")
    entity: str | None = _f(None, "the W&B entity (team or user); null = your default")
    dir: str | None = _f(None, "where W&B writes its files (DIR/wandb/offline-run-*); null = the run directory")
    run_name: str | None = _f(None, "the W&B run's display name; null = the run directory's name")


@dataclass
class LogConfig:
    every: int = _f(10, "steps per log interval: metrics are reduced on the host once per interval")
    trackers: list[Literal[TRACKERS]] = _f(["tensorboard"], "where each interval's metrics go besides metrics.jsonl (rank 0, once per log interval): tensorboard (RUN_DIR/tb), mlflow (log.mlflow.*), wandb (log.wandb.*); the trackers also get the config, incident/skip/rollback/stop/crash tags and the incidents' diagnosis.json; e.g. log.trackers=[tensorboard,mlflow]")
    mlflow: MlflowConfig = _section(MlflowConfig, "MLflow, when log.trackers lists mlflow")
    wandb: WandbConfig = _section(WandbConfig, "Weights & Biases, when log.trackers lists wandb")
    tensorboard: bool = _f(True, "write TensorBoard event files to RUN_DIR/tb when log.trackers lists tensorboard (the default); false turns TensorBoard off")
    progress: bool = _f(True, "show progress with the latest figures: a bar when stderr is a terminal, else one line per log interval (step, loss, grad norm, lr, items/s, ETA) on stderr")
    top_layers: int = _f(3, "how many parameters to name as dominating the grad norm at each log")


@dataclass
class EvalConfig:
    every: int = _f(100, "steps between validation passes (0 = only at the end); needs val_data")
    batches: int = _f(8, "validation micro-batches per pass (0 = the whole validation set)")


@dataclass
class CkptConfig:
    every: int = _f(100, "steps between checkpoints (0 = only at the end and on SIGTERM/SIGINT); written only from a healthy state")
    keep: int = _f(3, "how many newest checkpoints to keep (the one LAST_GOOD names is never deleted)")
    max_failures: int = _f(3, "stop the run with an error after this many checkpoint saves in a row failed (disk full, I/O error; each is printed, LAST_GOOD stays intact); 0 = never stop")


@dataclass
class GuardConfig:
    on_nonfinite: Literal["skip", "stop", "rollback"] = _f("skip", "a non-finite loss/grad norm/parameter: skip the step, stop cleanly, or roll back to the last good checkpoint and skip that data window")
    on_spike: Literal["warn", "skip", "rollback"] = _f("warn", "a loss spike: record an event, skip the step (decided on the device every step), or roll back and skip the window (warn, rollback: the rule runs on the host at the log boundary)")
    spike_window: int = _f(50, "recent finite, non-spike losses the spike rule compares against")
    spike_ratio: float = _f(2.0, "spike rule: loss > spike_ratio x median of the window ...")
    spike_zscore: float = _f(6.0, "... and (loss - mean) / std of the window > spike_zscore (after spike_window/2 steps)")
    max_consecutive_skips: int = _f(20, "stop the run after this many skipped steps in a row")
    max_rollbacks: int = _f(3, "stop the run after this many rollbacks")
    check_params: bool = _f(True, "check on each log interval's last step that the parameters are finite (one fused pass, no sync); when a check fails, the capture's replay pins the update that broke them")
    check_inputs: bool = _f(False, "check floating-point inputs of every micro-batch for NaN/Inf")
    capture: bool = _f(True, "capture an incident bundle (RUN_DIR/incidents/step_N) for the first bad step of an interval, by replaying from the interval's snapshot (guard.memory_snapshot) or else from LAST_GOOD")
    memory_snapshot: bool = _f(True, "copy the state into reused host buffers at every log interval's start (pinned, non-blocking from CUDA), so a capture replays at most log.every steps wherever the incident falls (costs one copy per interval and host memory for model + optimizer); false: replay from LAST_GOOD, up to ckpt.every steps")
    diagnose: bool = _f(True, "diagnose a captured incident right away (replay under the precise tools)")


@dataclass
class DistConfig:
    nproc: int = _f(1, "processes to start on this machine: > 1 launches torchrun (--standalone) with this many; under torchrun it must be 1 or equal the world size")
    backend: Literal["auto", "gloo", "nccl"] = _f("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU")
    strategy: Literal["ddp", "fsdp"] = _f("ddp", "with more than one process: ddp = DistributedDataParallel (every rank holds the whole model and optimizer); fsdp = FSDP2 fully_shard per block and at the root (parameters, grads and optimizer state sharded over the ranks; for models that do not fit one device)")
    reshard_after_forward: bool = _f(True, "fsdp only: free each block's gathered parameters after its forward and gather them again for backward (less memory, one more all-gather per block); false keeps them until backward. The root always stays gathered: backward needs it first")
    checkpoint: Literal["sharded", "full"] = _f("sharded", "fsdp with more than one process: sharded = each rank writes its own shards through torch.distributed.checkpoint (DCP), asynchronously, beside a small state file; full = rank 0 gathers the whole model and optimizer and writes one file, as DDP does. Either kind resumes under any strategy and world size")
    timeout_s: float = _f(120.0, "seconds a collective waits for the other ranks before the run fails with a clear message (a dead or hung rank); must exceed rank 0's longest pause alone: a checkpoint write or an incident diagnosis")


@dataclass
class RunConfig:
    dir: str | None = _f(None, "the run directory; default runs/<task>-<timestamp>")
    overwrite: bool = _f(False, "allow writing into a run directory that already holds a run")


@dataclass
class Config:
    """The whole run configuration; ``config.yaml`` in the run dir is this, fully resolved."""

    task: str = _f("gpt", "built-in task name (gpt, mlp) or a user factory 'module:function' returning a stabletrain.Task")
    task_args: dict = _f({}, "keyword arguments for the task factory (e.g. task_args.n_layer=6 for gpt)")
    seed: int = _f(0, "seed for python, numpy, torch (all devices) and dataloader workers")
    deterministic: bool = _f(False, "torch.use_deterministic_algorithms(True) and deterministic cuDNN while fit() "
                                    "runs (put back after it); false: no global torch setting is touched")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto", "auto = bf16 on CUDA where supported, else fp32; fp16 uses a GradScaler (allowed on CPU for testing the fp16 path: slow, and warned)")
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
    guard: GuardConfig = _section(GuardConfig, "NaN/Inf sentinel, loss-spike detection and what to do about them")
    dist: DistConfig = _section(DistConfig, "more than one process (DDP or FSDP2 over torch.distributed, launched by torchrun; see dist.strategy); global batch = train.batch_size x accum.steps x world size")
    resume: str | None = _f(None, "a run directory to continue from its LAST_GOOD checkpoint (same as --resume)")
    callbacks: list[str] = _f([], "your callbacks: a list of 'module:Class' entries, each built with no arguments (e.g. callbacks=[mypkg.cbs:LogGrads])")

    def validate(self) -> "Config":
        """Check the type of every key, then value ranges; raise ConfigError naming the dotted key and the value seen.

        Works on a Config built in Python as on one loaded from YAML. In place: an int where a float is
        declared becomes that float, a tuple where a list is declared becomes a list. Returns ``self``.
        """
        _check_types(self, type(self))
        checks = [
            ("seed", self.seed, self.seed >= 0, "an integer >= 0"),
            ("train.max_steps", self.train.max_steps, self.train.max_steps >= 1, "an integer >= 1"),
            ("train.batch_size", self.train.batch_size, self.train.batch_size >= 1, "an integer >= 1"),
            ("accum.steps", self.accum.steps, self.accum.steps >= 1, "an integer >= 1"),
            ("clip.max_norm", self.clip.max_norm, self.clip.max_norm is None or self.clip.max_norm > 0, "a number > 0 or null"),
            ("optim.lr", self.optim.lr, self.optim.lr > 0, "a number > 0"),
            ("optim.weight_decay", self.optim.weight_decay, self.optim.weight_decay >= 0, "a number >= 0"),
            ("optim.beta1", self.optim.beta1, 0 <= self.optim.beta1 < 1, "a number in [0, 1)"),
            ("optim.beta2", self.optim.beta2, 0 <= self.optim.beta2 < 1, "a number in [0, 1)"),
            ("optim.eps", self.optim.eps, self.optim.eps > 0, "a number > 0"),
            ("optim.momentum", self.optim.momentum, 0 <= self.optim.momentum < 1, "a number in [0, 1)"),
            ("sched.warmup_steps", self.sched.warmup_steps, self.sched.warmup_steps >= 0, "an integer >= 0"),
            ("sched.min_lr_ratio", self.sched.min_lr_ratio, 0 <= self.sched.min_lr_ratio <= 1, "a number in [0, 1]"),
            ("data.workers", self.data.workers, self.data.workers >= 0, "an integer >= 0"),
            ("log.every", self.log.every, self.log.every >= 1, "an integer >= 1"),
            ("log.top_layers", self.log.top_layers, self.log.top_layers >= 0, "an integer >= 0"),
            ("eval.every", self.eval.every, self.eval.every >= 0, "an integer >= 0"),
            ("eval.batches", self.eval.batches, self.eval.batches >= 0, "an integer >= 0"),
            ("ckpt.every", self.ckpt.every, self.ckpt.every >= 0, "an integer >= 0"),
            ("ckpt.keep", self.ckpt.keep, self.ckpt.keep >= 1, "an integer >= 1"),
            ("ckpt.max_failures", self.ckpt.max_failures, self.ckpt.max_failures >= 0, "an integer >= 0"),
            ("guard.spike_window", self.guard.spike_window, self.guard.spike_window >= 4, "an integer >= 4"),
            ("guard.spike_ratio", self.guard.spike_ratio, self.guard.spike_ratio > 1, "a number > 1"),
            ("guard.spike_zscore", self.guard.spike_zscore, self.guard.spike_zscore > 0, "a number > 0"),
            ("guard.max_consecutive_skips", self.guard.max_consecutive_skips, self.guard.max_consecutive_skips >= 1, "an integer >= 1"),
            ("guard.max_rollbacks", self.guard.max_rollbacks, self.guard.max_rollbacks >= 0, "an integer >= 0"),
            ("dist.nproc", self.dist.nproc, self.dist.nproc >= 1, "an integer >= 1"),
            ("dist.timeout_s", self.dist.timeout_s, self.dist.timeout_s > 0, "a number > 0"),
        ]
        for key, value, ok, want in checks:
            if not ok:
                raise ConfigError(f"config key '{key}': expected {want}, got {brief(value)}")
        if not self.task:
            raise ConfigError("config key 'task': expected a built-in task name or 'module:function', got ''")
        optim = self.optim
        if optim.name != "sgd" and (optim.momentum or optim.nesterov):
            key, value = ("optim.momentum", optim.momentum) if optim.momentum else ("optim.nesterov", optim.nesterov)
            raise ConfigError(f"config key '{key}': applies to optim.name=sgd only, got {brief(value)} with optim.name={optim.name} "
                              f"(remove it, or set optim.name=sgd)")
        if optim.nesterov and optim.momentum <= 0:
            raise ConfigError(f"config key 'optim.nesterov': Nesterov momentum needs optim.momentum > 0, got "
                              f"optim.nesterov=true with optim.momentum={optim.momentum!r}")
        for i, name in enumerate(self.log.trackers):
            if name in self.log.trackers[:i]:
                raise ConfigError(f"config key 'log.trackers[{i}]': {name} is listed twice, got {brief(self.log.trackers)}")
        for i, entry in enumerate(self.callbacks):
            if not _CALLBACK_ENTRY.fullmatch(entry):
                raise ConfigError(f"config key 'callbacks[{i}]': expected 'module:Class' (e.g. mypkg.callbacks:LogGrads), "
                                  f"got {entry!r}")
        return self


_CALLBACK_ENTRY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def _check_types(node: Any, cls: type, prefix: str = "") -> None:
    """Check every leaf of the dataclass ``node`` against its annotation (through :func:`_coerce`), in place."""
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        key, value, tp = f"{prefix}{f.name}", getattr(node, f.name), hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, tp):
                raise ConfigError(f"config key '{key}': expected a section ({tp.__name__}), got {brief(value)}")
            _check_types(value, tp, key + ".")
        else:
            setattr(node, f.name, _coerce(key, value, tp))


# ---------------------------------------------------------------------------------------------
# Conversion between plain data (YAML, overrides) and the dataclass tree.


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to the annotated type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"config key '{key}': expected one of {', '.join(map(str, choices))}, got {brief(value)}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        last: ConfigError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as err:
                last = err
        assert last is not None
        raise last
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': expected true or false, got {brief(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}': expected an integer, got {brief(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"config key '{key}': expected a number, got {brief(value)}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key '{key}': expected a string, got {brief(value)}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"config key '{key}': expected a mapping, got {brief(value)}")
    if tp is list or origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected a list (e.g. {key}=[a, b]), got {brief(value)}")
        (item,) = typing.get_args(tp) or (Any,)
        return [v if item is Any else _coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    raise AssertionError(f"unsupported config type {tp!r} for {key}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, raising ConfigError on unknown keys and bad values."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': expected a mapping, got {brief(data)}")
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown config key '{key}' (known here: {', '.join(fields)})")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, key + ".")
        else:
            kwargs[name] = _coerce(key, value, tp)
    return cls(**kwargs)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Return the config as plain nested dicts (every default written out)."""
    return dataclasses.asdict(cfg)


def config_hash(cfg: Config) -> str:
    """Return a short stable hash of the resolved config."""
    blob = json.dumps(config_to_dict(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, also reading ``3e-4`` and ``1E5`` as floats.

    PyYAML follows YAML 1.1, whose floats need a dot (``3.0e-4``): ``lr: 3e-4`` would be the string
    "3e-4". YAML 1.2 (and Python, and the command line) read it as a number; so do we.
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML ``text`` (``3e-4`` is a float); a syntax error is a ConfigError naming ``source``, line and column."""
    try:
        return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None


def _parse_value(text: str, source: str) -> Any:
    # A YAML scalar or flow collection: 3e-4 -> float, true -> bool, null -> None, [1, 2] -> list.
    return load_yaml(text, source) if text != "" else ""


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one dotted ``key=value`` override to the plain dict ``data`` in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted key=value (e.g. optim.lr=3e-4)")
    key, text = override.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {override!r}: empty key")
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{'.'.join(parts[: i + 1])}' is a value, not a section (override {override!r})")
        node = child
    node[parts[-1]] = _parse_value(text, f"override {override!r}")


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: dict[str, Any] | None = None) -> Config:
    """Load a Config from ``base`` (plain dicts), then an optional YAML file, then dotted overrides; validate it."""
    data: dict[str, Any] = dict(base or {})
    if path is not None:
        p = Path(path)
        try:
            text = p.read_text()
        except OSError as err:
            raise ConfigError(f"config file {str(p)!r}: cannot read it ({err.strerror})") from None
        loaded = load_yaml(text, f"config file {str(p)!r}")
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r}: expected a mapping at the top, got {type(loaded).__name__}")
        data = _deep_merge(data, loaded)
    overlay: dict[str, Any] = {}
    for override in overrides:
        apply_override(overlay, override)
    data = _deep_merge(data, overlay)
    return _build(Config, data).validate()


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from plain dicts (e.g. a run dir's ``config.yaml``)."""
    return _build(Config, data).validate()


def describe_keys(cls: type = Config, prefix: str = "") -> list[tuple[str, str, str]]:
    """Return (dotted key, default, help) for every leaf key, in declaration order."""
    rows: list[tuple[str, str, str]] = []
    hints = _hints(cls)
    default = cls()
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(tp):
            rows.extend(describe_keys(tp, key + "."))
        else:
            value = getattr(default, f.name)
            rows.append((key, "null" if value is None else json.dumps(value) if not isinstance(value, str) else value, f.metadata.get("help", "")))
    return rows


# ---------------------------------------------------------------------------------------------
# Flattening and comparing configs; the keys that may change on resume.

#: Config keys (exact, ``fnmatch`` globs, or a section name) that may differ when a run is resumed:
#: they change neither the math nor the data of the steps still to come. The world size may change
#: (``dist.*``): the resume is then resharded, and :data:`RESHARD_SAFE_KEYS` may change as well.
RESUME_SAFE_KEYS: tuple[str, ...] = (
    "train.max_steps", "log.*", "ckpt.every", "ckpt.keep", "ckpt.max_failures", "eval.every", "run.*", "resume",
    "data.workers",
    "guard.capture", "guard.memory_snapshot", "guard.diagnose", "dist.*", "callbacks",
)


#: Keys that may also change on a resume under another world size (a resharded resume), so a run can keep
#: its global batch ``train.batch_size x accum.steps x world size`` (2 ranks x B -> 1 rank x B x accum 2).
RESHARD_SAFE_KEYS: tuple[str, ...] = ("train.batch_size", "accum.steps")


def resume_safe_text(keys: Sequence[str] = RESUME_SAFE_KEYS, *, code: bool = False) -> str:
    """Return the resume-safe keys as one line, "train.max_steps, log.*, ..." (``code``: each in Markdown backticks)."""
    return ", ".join(f"`{k}`" if code else k for k in keys)


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


#: The value of a key that one of two compared configs does not have.
ABSENT: Any = _Absent()


class ConfigDiff(NamedTuple):
    """One key whose value differs between two configs."""

    key: str  # dotted key
    saved: Any  # value in the checkpoint's (or first) config, or ABSENT
    current: Any  # value in this run's (or second) config, or ABSENT


def dotted_key(path: Sequence[KeyEntry], prefix: str = "") -> str:
    """Return a pytree key path as a dotted key: ``optim.lr``, ``state.0.exp_avg`` (namedtuple fields by name)."""
    parts = [prefix] if prefix else []
    for k in path:
        if isinstance(k, MappingKey):
            parts.append(str(k.key))
        elif isinstance(k, SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, GetAttrKey):
            parts.append(k.name)
        else:
            parts.append(str(k))
    return ".".join(parts)


def flatten_config(cfg: Any, *, keep_empty: bool = False) -> dict[str, Any]:
    """Return a Config (or nested plain dicts) as ``{"dotted.key": value}``, in declaration order.

    Only mappings are walked; a list is one value (a tuple becomes a list, as YAML would read it). An
    empty mapping contributes no key, unless ``keep_empty`` (for showing a config: ``task_args: {}``).
    """
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = config_to_dict(cfg)
    if not isinstance(cfg, dict):
        raise TypeError(f"flatten_config: expected a Config or a mapping, got {type(cfg).__name__}")
    if not cfg:
        return {}
    leaves, _ = tree_flatten_with_path(cfg, is_leaf=lambda x: not isinstance(x, dict) or (keep_empty and not x))
    return {dotted_key(path): list(v) if isinstance(v, tuple) else v for path, v in leaves}


def diff_configs(saved: Any, current: Any, safe: Sequence[str] = RESUME_SAFE_KEYS) -> list[ConfigDiff]:
    """Return each dotted key whose value differs between two configs (Config objects or plain dicts).

    Keys matching a ``safe`` pattern (exact, ``fnmatch`` glob, or a section name) are ignored; pass
    ``safe=()`` to compare everything. A key present on one side only has ``ABSENT`` on the other.
    Order: the saved config's keys, then new ones.
    """
    a, b = flatten_config(saved), flatten_config(current)

    def is_safe(key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) or key.startswith(p + ".") for p in safe)

    keys = list(a) + [k for k in b if k not in a]
    return [ConfigDiff(k, a.get(k, ABSENT), b.get(k, ABSENT)) for k in keys
            if not is_safe(k) and (k not in a or k not in b or a[k] != b[k])]


def _show(value: Any) -> str:
    return "(absent)" if value is ABSENT else json.dumps(value, default=brief)  # a tensor: its shape, not its values


def format_config_diff(diffs: Sequence[ConfigDiff]) -> str:
    """Return one line per differing key with both values (YAML-style), under a header; "" when none."""
    if not diffs:
        return ""
    width = max(len(d.key) for d in diffs)
    lines = [f"  {d.key:<{width}}  checkpoint: {_show(d.saved)}  now: {_show(d.current)}" for d in diffs]
    noun = "key differs" if len(diffs) == 1 else "keys differ"
    return f"{len(diffs)} config {noun} from the checkpoint's:\n" + "\n".join(lines)


def resume_refusal_message(run_dir: str | Path, diffs: Sequence[ConfigDiff]) -> str:
    """Return the one-line error for resuming ``run_dir`` with a config that differs in ``diffs`` (non-empty)."""
    listed = "; ".join(f"{d.key}: checkpoint {_show(d.saved)}, now {_show(d.current)}" for d in diffs)
    noun = "key differs" if len(diffs) == 1 else "keys differ"
    return (f"resume {str(run_dir)!r}: {len(diffs)} config {noun} from the checkpoint's ({listed}); only these keys may "
            f"change on resume: {resume_safe_text()}. Under another world size {resume_safe_text(RESHARD_SAFE_KEYS)} may "
            "change too. Resume without those changes, or start a new run (another run.dir)")
