"""The run configuration: a tree of dataclasses, loaded from YAML, overridden by dotted ``key=value``.

Every field carries its meaning in ``metadata["help"]``; ``stabletrain train --help`` prints them all
with their defaults. Unknown keys and bad values raise :class:`ConfigError`, naming the dotted key and
the value seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

__all__ = ["Config", "ConfigError", "load_config", "config_to_dict", "config_hash", "describe_keys"]


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
    lr: float = _f(1e-3, "peak learning rate of AdamW")
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay on matrices (never on biases and norms)")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.95, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")


@dataclass
class SchedConfig:
    warmup_steps: int = _f(20, "linear warmup from 0 to optim.lr over this many applied steps")
    decay: Literal["cosine", "constant"] = _f("cosine", "shape after warmup: cosine to min_lr_ratio at train.max_steps, or constant")
    min_lr_ratio: float = _f(0.1, "final LR as a fraction of optim.lr (cosine decay)")


@dataclass
class DataConfig:
    shuffle: bool = _f(True, "reshuffle the sample order every epoch (seeded by seed and epoch)")
    workers: int = _f(0, "DataLoader worker processes (seeded from seed)")


@dataclass
class LogConfig:
    every: int = _f(10, "steps per log interval: metrics are reduced on the host once per interval")
    tensorboard: bool = _f(True, "write TensorBoard event files to RUN_DIR/tb")
    progress: bool = _f(True, "show a console progress bar with the latest figures")
    top_layers: int = _f(3, "how many parameters to name as dominating the grad norm at each log")


@dataclass
class EvalConfig:
    every: int = _f(100, "steps between validation passes (0 = only at the end); needs val_data")
    batches: int = _f(8, "validation micro-batches per pass (0 = the whole validation set)")


@dataclass
class CkptConfig:
    every: int = _f(100, "steps between checkpoints (0 = only at the end and on SIGTERM/SIGINT); written only from a healthy state")
    keep: int = _f(3, "how many newest checkpoints to keep (the one LAST_GOOD names is never deleted)")


@dataclass
class GuardConfig:
    on_nonfinite: Literal["skip", "stop", "rollback"] = _f("skip", "a non-finite loss/grad norm/parameter: skip the step, stop cleanly, or roll back to the last good checkpoint and skip that data window")
    on_spike: Literal["warn", "skip", "rollback"] = _f("warn", "a loss spike: record an event, skip the step (decided on the device), or roll back and skip the window")
    spike_window: int = _f(50, "recent finite, non-spike losses the spike rule compares against")
    spike_ratio: float = _f(2.0, "spike rule: loss > spike_ratio x median of the window ...")
    spike_zscore: float = _f(6.0, "... and (loss - mean) / std of the window > spike_zscore (after spike_window/2 steps)")
    max_consecutive_skips: int = _f(20, "stop the run after this many skipped steps in a row")
    max_rollbacks: int = _f(3, "stop the run after this many rollbacks")
    check_params: bool = _f(True, "check after every update that the parameters are finite (one fused pass, no sync)")
    check_inputs: bool = _f(False, "check floating-point inputs of every micro-batch for NaN/Inf")
    capture: bool = _f(True, "capture an incident bundle (RUN_DIR/incidents/step_N) for the first bad step of an interval, by replaying from LAST_GOOD")
    memory_snapshot: bool = _f(False, "also keep a copy of the state at every log interval in memory, so a capture replays at most log.every steps (costs a state copy per interval and the memory of model + optimizer)")
    diagnose: bool = _f(True, "diagnose a captured incident right away (replay under the precise tools)")


@dataclass
class DistConfig:
    nproc: int = _f(1, "processes to start on this machine: > 1 launches torchrun (--standalone) with this many; under torchrun it must be 1 or equal the world size")
    backend: Literal["auto", "gloo", "nccl"] = _f("auto", "torch.distributed backend: auto = nccl on CUDA, gloo on CPU")
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
    deterministic: bool = _f(False, "torch.use_deterministic_algorithms(True) and deterministic cuDNN")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = _f("auto", "auto = bf16 on CUDA where supported, else fp32; fp16 uses a GradScaler (CUDA only)")
    device: str = _f("auto", "auto = cuda if available, else cpu; or an explicit torch device string")
    train: TrainConfig = _section(TrainConfig, "training length and batch")
    accum: AccumConfig = _section(AccumConfig, "gradient accumulation")
    clip: ClipConfig = _section(ClipConfig, "gradient clipping")
    optim: OptimConfig = _section(OptimConfig, "optimizer (fused AdamW)")
    sched: SchedConfig = _section(SchedConfig, "learning-rate schedule (device-side; held on skipped steps)")
    data: DataConfig = _section(DataConfig, "data order and loading")
    log: LogConfig = _section(LogConfig, "metrics and sinks")
    eval: EvalConfig = _section(EvalConfig, "validation")
    run: RunConfig = _section(RunConfig, "run directory")
    ckpt: CkptConfig = _section(CkptConfig, "checkpoints")
    guard: GuardConfig = _section(GuardConfig, "NaN/Inf sentinel, loss-spike detection and what to do about them")
    dist: DistConfig = _section(DistConfig, "distributed data parallel (DDP over torch.distributed, launched by torchrun); global batch = train.batch_size x accum.steps x world size")
    resume: str | None = _f(None, "a run directory to continue from its LAST_GOOD checkpoint (same as --resume)")

    def validate(self) -> "Config":
        """Check value ranges; raise ConfigError naming the dotted key and the value seen."""
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
            ("sched.warmup_steps", self.sched.warmup_steps, self.sched.warmup_steps >= 0, "an integer >= 0"),
            ("sched.min_lr_ratio", self.sched.min_lr_ratio, 0 <= self.sched.min_lr_ratio <= 1, "a number in [0, 1]"),
            ("data.workers", self.data.workers, self.data.workers >= 0, "an integer >= 0"),
            ("log.every", self.log.every, self.log.every >= 1, "an integer >= 1"),
            ("log.top_layers", self.log.top_layers, self.log.top_layers >= 0, "an integer >= 0"),
            ("eval.every", self.eval.every, self.eval.every >= 0, "an integer >= 0"),
            ("eval.batches", self.eval.batches, self.eval.batches >= 0, "an integer >= 0"),
            ("ckpt.every", self.ckpt.every, self.ckpt.every >= 0, "an integer >= 0"),
            ("ckpt.keep", self.ckpt.keep, self.ckpt.keep >= 1, "an integer >= 1"),
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
                raise ConfigError(f"config key '{key}': expected {want}, got {value!r}")
        if not self.task:
            raise ConfigError("config key 'task': expected a built-in task name or 'module:function', got ''")
        return self


# ---------------------------------------------------------------------------------------------
# Conversion between plain data (YAML, overrides) and the dataclass tree.


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to the annotated type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"config key '{key}': expected one of {', '.join(map(str, choices))}, got {value!r}")
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
        raise ConfigError(f"config key '{key}': expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}': expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"config key '{key}': expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key '{key}': expected a string, got {value!r}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"config key '{key}': expected a mapping, got {value!r}")
    raise AssertionError(f"unsupported config type {tp!r} for {key}")


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, raising ConfigError on unknown keys and bad values."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': expected a mapping, got {data!r}")
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


def _parse_value(text: str) -> Any:
    # YAML scalars: 3e-4 -> float, true -> bool, null -> None, [1, 2] -> list. PyYAML reads '3e-4'
    # as a string (YAML 1.1 wants a dot), so numbers get a second chance through float().
    value = yaml.safe_load(text) if text != "" else ""
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".e") else int(value)
        except ValueError:
            return value
    return value


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
    node[parts[-1]] = _parse_value(text)


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
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {str(p)!r}: not valid YAML ({str(err).splitlines()[0]})") from None
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
