"""What an adapter is asked to do (:class:`AdapterOptions`), its guard, and the small helpers every adapter shares."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import math
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..callbacks.trackers import build_trackers
from ..config import GuardConfig
from ..internals import eager_module
from ..policies.guard import Guard

__all__ = ["AdapterOptions", "CONFIG_KEYS", "HOST_OPTIONS", "AdapterGuard", "StopTraining", "jsonable", "optimizer_config",
           "unwrap", "is_compiled", "compiled_methods", "eager_methods"]


class StopTraining(RuntimeError):
    """The sentinel stopped the run (``on_nonfinite="stop"`` or too many consecutive skips); ``step`` and ``reason`` say why."""

    def __init__(self, step: int, reason: str) -> None:
        self.step, self.reason = step, reason
        super().__init__(f"stabletrain stopped the run at step {step}: {reason}")


#: An adapter's options that are keys of the built-in run's config: the same meaning, default, type, range and help
#: (``stabletrain train --help`` lists them; a bad value is refused naming the option and its key).
CONFIG_KEYS = {"log_every": "log.every", "on_spike": "guard.on_spike", "capture": "capture.incidents",
               "diagnose": "capture.diagnose", "check_params": "guard.check_params", "tensorboard": "log.tensorboard",
               "top_layers": "log.top_layers", "trackers": "log.trackers"}

#: The options of a host's side that a built-in run has no key for: (default, meaning).
HOST_OPTIONS: dict[str, tuple[Any, str]] = {
    "on_nonfinite": ("skip", "a non-finite loss or grad norm: 'skip' the step on the device and go on, 'stop' (skipped, "
                             "then the host stops at the log boundary) or 'warn' (recorded and warned only; the host's "
                             "own skips, e.g. a GradScaler's, still happen)"),
    "init_check": (True, "fingerprint the init and run the signal-propagation report on the first batch"),
    "mirror": (True, "also hand each interval's figures to the host's own logger (Lightning log_dict when the trainer "
                     "has a logger, Hugging Face logs)"),
    "keep_max_mib": (1024.0, "host memory for one interval's kept micro-batches (what a capture replays): past it, that "
                             "interval's incidents are recorded but not captured"),
}


class AdapterOptions:
    """What an adapter does beyond measuring: the built-in run's config keys (:data:`CONFIG_KEYS`) and the host's own
    (:data:`HOST_OPTIONS`), by keyword, e.g. ``Monitor(..., log_every=5, on_spike="skip")``.

    ``trackers`` may also hold a configured :class:`~stabletrain.callbacks.tracker_sink.TrackerSink`
    (``MLflowTracker(tracking_uri=...)``); where the host already has that tracker, its run is written into.
    The run's :class:`~stabletrain.config.Config` is their projection (:meth:`apply`); an unknown option is a
    TypeError and a bad value a ValueError naming the option and its config key.
    """

    def __init__(self, **options: Any) -> None:
        from ..config import Config

        unknown = sorted(set(options) - set(CONFIG_KEYS) - set(HOST_OPTIONS))
        if unknown:
            raise TypeError(f"unexpected option {', '.join(map(repr, unknown))}; the options are "
                            f"{', '.join(sorted([*CONFIG_KEYS, *HOST_OPTIONS]))}")
        trackers = options.pop("trackers", ("tensorboard",))
        if isinstance(trackers, str) or not isinstance(trackers, Sequence):
            raise ValueError(f"trackers: expected a list (e.g. trackers=['tensorboard', 'mlflow']), got {trackers!r}")
        self.trackers = tuple(trackers)
        build_trackers(self.trackers)  # each known, none twice (raises naming the entry)
        for name, (default, _) in HOST_OPTIONS.items():
            setattr(self, name, options.pop(name, default))
        if self.on_nonfinite not in ("skip", "stop", "warn"):
            raise ValueError(f"on_nonfinite: expected 'skip', 'stop' or 'warn', got {self.on_nonfinite!r} (a rollback "
                             "needs the checkpoints the host trainer owns: resume it from its own checkpoint)")
        if not isinstance(self.keep_max_mib, (int, float)) or isinstance(self.keep_max_mib, bool) or self.keep_max_mib < 0:
            raise ValueError(f"keep_max_mib: expected a number >= 0, got {self.keep_max_mib!r}")
        self._cfg = self.apply(Config(), {**options, "trackers": self.tracker_names()})
        for name, key in CONFIG_KEYS.items():
            if name != "trackers":
                setattr(self, name, _get(self._cfg, key))
        if self.on_spike not in ("warn", "skip"):
            raise ValueError(f"on_spike: expected 'warn' or 'skip', got {self.on_spike!r} (config key guard.on_spike; a "
                             "rollback or a remedy needs the checkpoints the host trainer owns)")

    @staticmethod
    def apply(cfg: Any, options: dict[str, Any]) -> Any:
        """``cfg`` with the options that are config keys set, validated as the built-in run's (returned)."""
        from ..config import ConfigError

        for name, value in options.items():
            section, _, key = CONFIG_KEYS[name].partition(".")
            setattr(getattr(cfg, section), key, list(value) if isinstance(value, tuple) else value)
        try:
            return cfg.validate()
        except ConfigError as err:
            named = next((n for n, k in CONFIG_KEYS.items() if f"'{k}'" in str(err)), None)
            raise ValueError(f"{named}: {err}" if named else str(err)) from None

    def project(self, cfg: Any) -> Any:
        """``cfg`` (the session's) with these options' config keys (the log and guard sections) set and validated."""
        return self.apply(cfg, {n: _get(self._cfg, k) for n, k in CONFIG_KEYS.items()})

    def tracker_names(self) -> list[str]:
        """The trackers' names ("tensorboard", "mlflow", "wandb"), as ``log.trackers`` lists them."""
        return [t if isinstance(t, str) else t.name for t in self.trackers]


def _get(cfg: Any, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


class AdapterGuard(Guard):
    """The built-in guard, plus ``on_nonfinite="warn"``: no skip of its own (the host's own skips still happen)."""

    def __init__(self, cfg: GuardConfig, device: torch.device, *, enforce: bool = True) -> None:
        super().__init__(cfg, device)
        self.enforce = enforce

    def observe(self, loss: Tensor, grad_norm: Tensor, inputs_ok: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Return (ok, finite, spike) as device bools; no sync."""
        ok, finite, spike = super().observe(loss, grad_norm, inputs_ok)
        if not self.enforce:  # warn: only a spike skip when asked
            ok = ~spike if self.cfg.on_spike == "skip" else torch.ones_like(finite)
        return ok, finite, spike


def unwrap(model: nn.Module) -> nn.Module:
    """The model itself inside ``DistributedDataParallel`` and ``torch.compile`` wrappers, in either order (the model when none).

    A host that compiled its model (``torch.compile``: an ``OptimizedModule``) trains the compiled one; the
    adapter names, checks, snapshots and replays the module inside it, so names carry no ``_orig_mod.`` and
    the diagnosis runs eagerly on the same weights.
    """
    model = eager_module(model)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = eager_module(model.module)
    return model


def is_compiled(model: nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (``OptimizedModule``), outside or inside a DDP wrapper, or
    a module whose own methods were compiled in place (:func:`compiled_methods`: Lightning's way)."""
    if eager_module(model) is not model:
        return True
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and eager_module(model.module) is not model.module:
        return True
    return bool(compiled_methods(unwrap(model)))


def compiled_methods(model: nn.Module) -> list[str]:
    """The names of ``model``'s own methods that ``torch.compile`` wrapped in place, on the instance.

    Lightning's ``trainer.fit(torch.compile(module))`` trains the LightningModule itself with compiled wrappers of
    its ``forward``, ``training_step``, ... set as instance attributes. Each is a function of torch's dynamo that
    wraps (``__wrapped__``) this very module's method of the same name. A deep copy keeps the wrappers, so it
    would run the live module's compiled methods on the live module's parameters
    (:func:`eager_methods` hides them).
    """
    cls, names = type(model), []
    for name, fn in vars(model).items():
        inner = getattr(fn, "__wrapped__", None)
        if (getattr(inner, "__self__", None) is model and getattr(inner, "__func__", None) is getattr(cls, name, None)
                and "_dynamo" in getattr(getattr(fn, "__code__", None), "co_filename", "")):
            names.append(name)
    return names


@contextlib.contextmanager
def eager_methods(model: nn.Module) -> Iterator[None]:
    """``model`` with its in-place compiled methods (:func:`compiled_methods`) hidden meanwhile: its class's own
    run, eagerly, on the parameters of whatever module calls them (a deep copy made meanwhile: its own)."""
    saved = {name: vars(model).pop(name) for name in compiled_methods(model)}
    try:
        yield
    finally:
        vars(model).update(saved)


def jsonable(value: Any) -> Any:
    """A config value as YAML/JSON can hold it (numbers, strings, lists, dicts; anything else by its repr)."""
    if isinstance(value, enum.Enum):  # e.g. HF's SchedulerType (a str subclass YAML cannot write)
        return jsonable(value.value)
    if isinstance(value, (bool, int, str)) or value is None:
        return type(value)(value) if value is not None else None
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, Tensor) and value.numel() == 1:
        return float(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return jsonable(dataclasses.asdict(value))
    return repr(value)


def optimizer_config(optimizer: Any) -> dict[str, Any]:
    """The optimizer's class and default hyperparameters, for ``config.yaml``."""
    inner = getattr(optimizer, "optimizer", optimizer)  # an accelerate / Lightning wrapper holds the torch one
    return {"name": type(inner).__name__, **{k: jsonable(v) for k, v in getattr(inner, "defaults", {}).items()}}
