"""An adapter's options (``Monitor(..., log_every=5)``, the host callbacks'): a projection of :class:`Config`.

The options that are keys of the built-in run's config (:data:`CONFIG_KEYS`) take their meaning, default,
type, range and help from it and are validated by it; the host's own (:data:`HOST_OPTIONS`) are the few a
built-in run has no key for.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

from ..console import StableTrainWarning
from ..errors import brief
from .schema import TRACKERS, Config
from .values import ConfigError

__all__ = ["AdapterOptions", "CONFIG_KEYS", "HOST_OPTIONS", "ARG_KEYS", "HOST_KNOBS", "in_host_terms", "clip_knob"]

#: An adapter's options that are keys of the built-in run's config: the same meaning, default, type, range and help
#: (``stabletrain train --help`` lists them; a bad value is refused naming the option and its key).
CONFIG_KEYS = {"log_every": "log.every", "on_spike": "guard.on_spike", "capture": "capture.incidents",
               "diagnose": "capture.diagnose", "check_params": "guard.check_params", "tensorboard": "log.tensorboard",
               "top_layers": "log.top_layers", "trackers": "log.trackers", "spike_window": "guard.spike_window",
               "spike_ratio": "guard.spike_ratio", "spike_zscore": "guard.spike_zscore",
               "max_consecutive_skips": "guard.max_consecutive_skips", "capture_spikes": "capture.spikes",
               "max_spikes": "capture.max_spikes"}

#: The options of a host's side that a built-in run has no key for: (default, meaning).
HOST_OPTIONS: dict[str, tuple[Any, str]] = {
    "on_nonfinite": ("skip", "a non-finite loss or grad norm: 'skip' the step on the device and go on, 'stop' (skipped, "
                             "then the host stops at the log boundary) or 'warn' (recorded and warned only; the host's "
                             "own skips, e.g. a GradScaler's, still happen)"),
    "init_check": (True, "fingerprint the init and run the signal-propagation report on the first batch"),
    "mirror": (True, "also hand the intervals' figures to the host's own logger (Lightning: each interval's, when the "
                     "trainer has a logger; Hugging Face: the latest one's, at the Trainer's own logging steps)"),
    "keep_max_mib": (1024.0, "host memory for the kept micro-batches (what a capture replays: the interval's, and the "
                             "interval before's where its snapshot is kept too, those going first): past it, that "
                             "interval's incidents are recorded but not captured"),
}


#: How each host names the settings a fix changes: its clip (the Trainer's, or where Lightning refuses that one the
#: callback's, ``clip_own``), its learning rate, and the whole run's precision by mode.
HOST_KNOBS: dict[str, dict[str, Any]] = {
    "lightning": {"clip": "Trainer(gradient_clip_val=)", "clip_own": "StableTrainCallback(clip_max_norm=)",
                  "lr": "the optimizer's lr",
                  "precision": {"fp32": 'Trainer(precision="32-true")', "bf16": 'Trainer(precision="bf16-mixed")',
                                "fp16": 'Trainer(precision="16-mixed")'}},
    "transformers": {"clip": "TrainingArguments.max_grad_norm", "lr": "TrainingArguments.learning_rate",
                     "precision": {"fp32": "TrainingArguments(fp16=False, bf16=False)",
                                   "bf16": "TrainingArguments(bf16=True, fp16=False)",
                                   "fp16": "TrainingArguments(fp16=True, bf16=False)"}},
    "monitor": {"clip": "Monitor(clip_max_norm=)", "lr": "the optimizer's lr",
                "precision": {"fp32": 'Monitor(precision="fp32"), no autocast or GradScaler of your own',
                              "bf16": 'Monitor(precision="bf16") and its autocast(), no GradScaler',
                              "fp16": 'Monitor(precision="fp16", scaler=GradScaler())'}},
}


def clip_knob(host: str | None, config: dict[str, Any]) -> str | None:
    """The clip's knob in ``host``'s terms for a run of its ``config`` (config.yaml's, flattened keys), e.g.
    ``Trainer(gradient_clip_val=)``; None for the built-in loop's. Lightning: the callback's where the Trainer set no clip
    and the callback clipped (the clip Lightning allows a fused optimizer under mixed precision; a config that does not
    record the Trainer's is taken as the Trainer's); the Trainer's by value asks for ``gradient_clip_algorithm="norm"``."""
    knobs = HOST_KNOBS.get(host or "")
    if knobs is None:
        return None
    trainer_clip = config.get("host.gradient_clip_val", "unrecorded")
    if host == "lightning" and not trainer_clip and config.get("clip.max_norm") is not None:
        return knobs["clip_own"]
    if host == "lightning" and config.get("host.gradient_clip_algorithm") == "value":
        return 'Trainer(gradient_clip_val=, gradient_clip_algorithm="norm")'
    return knobs["clip"]


def in_host_terms(host: str | None, kind: str, value: Any, config: dict[str, Any] | None = None) -> str | None:
    """A fix's run-wide setting as ``host`` spells it (None: the built-in loop's key is the host's own, or not one of
    these): ``kind`` "precision" (``value`` a mode), "clip" (a norm, on :func:`clip_knob` for the run's ``config``)."""
    knobs = HOST_KNOBS.get(host or "")
    if knobs is None:
        return None
    if kind == "precision":
        return knobs["precision"].get(value)
    if kind == "clip":
        knob = clip_knob(host, config or {}) or ""
        return knob.replace("=,", f"={value:.3g},").replace("=)", f"={value:.3g})") if "=" in knob else f"{knob}={value:.3g}"
    return None


#: An adapter constructor's own arguments that are keys of the built-in run's config (a bad value names both).
ARG_KEYS = {"clip_max_norm": "clip.max_norm", "precision": "precision"}
_FACTORY = re.compile(r"([A-Za-z_][\w.]*):[A-Za-z_][\w.]*")


class AdapterOptions:
    """What an adapter does beyond measuring: the built-in run's config keys (:data:`CONFIG_KEYS`) and the host's own
    (:data:`HOST_OPTIONS`), by keyword, e.g. ``Monitor(..., log_every=5, on_spike="skip")``.

    ``trackers`` may also hold a configured :class:`~stabletrain.callbacks.tracker_sink.TrackerSink`
    (``MLflowTracker(tracking_uri=...)``); where the host already has that tracker, its run is written into.
    The run's :class:`~stabletrain.config.Config` is their projection (:meth:`apply`); an unknown option is a
    TypeError and a bad value a ValueError naming the option and its config key.
    """

    def __init__(self, **options: Any) -> None:
        unknown = sorted(set(options) - set(CONFIG_KEYS) - set(HOST_OPTIONS))
        if unknown:  # (clip_max_norm= and precision= are the callback's in Lightning, the Monitor's: the HF Trainer's own)
            host = {"clip_max_norm": "the HF Trainer clips by TrainingArguments.max_grad_norm",
                    "precision": "the HF Trainer's precision is TrainingArguments.bf16 / fp16"}
            raise TypeError(f"unexpected option {', '.join(map(repr, unknown))}"
                            + "".join(f" ({host[k]})" for k in unknown if k in host) + "; the options are "
                            f"{', '.join(sorted([*CONFIG_KEYS, *HOST_OPTIONS]))}")
        trackers = options.pop("trackers", ("tensorboard",))
        if isinstance(trackers, str) or not isinstance(trackers, Sequence):
            raise ValueError(f"trackers: expected a list (e.g. trackers=['tensorboard', 'mlflow']), got {trackers!r}")
        self.trackers = tuple(trackers)
        _check_trackers(self.trackers)
        for name, (default, _) in HOST_OPTIONS.items():
            setattr(self, name, options.pop(name, default))
        if self.on_nonfinite not in ("skip", "stop", "warn"):  # (why not the others only where one of them was asked for)
            raise ValueError(f"on_nonfinite: expected 'skip', 'stop' or 'warn', got {self.on_nonfinite!r}"
                             + (" (a rollback needs the checkpoints the host trainer owns: resume it from its own "
                                "checkpoint)" if self.on_nonfinite in ("rollback", "remedy") else ""))
        for name in ("init_check", "mirror"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected True or False, got {brief(getattr(self, name))}")
        if not isinstance(self.keep_max_mib, (int, float)) or isinstance(self.keep_max_mib, bool) or self.keep_max_mib < 0:
            raise ValueError(f"keep_max_mib: expected a number >= 0, got {self.keep_max_mib!r}")
        if options.get("on_spike", "warn") not in ("warn", "skip"):  # (before the config's own check, which offers more)
            raise ValueError(f"on_spike: expected 'warn' or 'skip', got {options['on_spike']!r} (config key guard.on_spike"
                             + ("; a rollback or a remedy needs the checkpoints the host trainer owns"
                                if options["on_spike"] in ("rollback", "remedy") else "") + ")")
        self._cfg = self.apply(Config(), {**options, "trackers": self.tracker_names()})
        for name, key in CONFIG_KEYS.items():
            if name != "trackers":
                setattr(self, name, _get(self._cfg, key))

    def checked(self, **args: Any) -> AdapterOptions:
        """Check the adapter constructor's own arguments (``model``, ``clip_max_norm``, ``precision``, ``loss_fn``, ``count_fn``,
        ``model_factory``, ``run_dir``, ``scaler``, ``overwrite``, ``trainer``, ``callbacks``; None: not given) as the
        options are: a bad value is a ValueError naming the argument (and its config key, :data:`ARG_KEYS`), when the
        adapter is built, not at the first step or incident. Returns ``self``."""
        for name, value in args.items():
            if value is None:
                continue
            if name == "model":  # (duck-typed: torch is not imported here)
                ok, want = all(callable(getattr(value, m, None)) for m in ("parameters", "named_modules")), "a torch.nn.Module"
            elif name == "run_dir":
                ok, want = isinstance(value, (str, os.PathLike)) and str(value) != "", "a path (str or pathlib.Path) or None"
            elif name == "scaler":  # (duck-typed: torch.amp's and torch.cuda.amp's GradScaler, a subclass, a sharded one)
                ok = all(callable(getattr(value, m, None)) for m in ("scale", "unscale_", "step", "update", "is_enabled"))
                want = "a torch.amp.GradScaler or None"
            elif name == "clip_max_norm":  # (a Python number, as the config key holds: a numpy one fails its check there)
                ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0
                want = "a number > 0 or None"
            elif name == "precision":
                ok, want = value in ("auto", "fp32", "bf16", "fp16"), "'auto', 'fp32', 'bf16', 'fp16' or None"
            elif name == "overwrite":
                ok, want = isinstance(value, bool), "True or False"
            elif name == "trainer":  # (the HF callback's: duck-typed, transformers is not imported here)
                ok, want = hasattr(value, "callback_handler"), "the transformers.Trainer the callback is added to, or None"
            elif name == "callbacks":  # (a list or tuple's each checked by name: the callbacks package sits above this one;
                # another iterable, a generator, is left to the session, which checks each as it takes them)
                ok = hasattr(value, "__iter__") and not isinstance(value, (str, bytes, dict))
                want = "a list of stabletrain.callbacks.Callback instances"
                given = value if isinstance(value, (list, tuple)) else ()
                bad = next((c for c in given if not any(f"{k.__module__}.{k.__name__}" == "stabletrain.callbacks.Callback"
                                                        for k in type(c).__mro__)), None)
                if bad is not None:
                    what = (f"the class {bad.__name__}: pass an instance, {bad.__name__}()" if isinstance(bad, type) else
                            f"a{'n' if type(bad).__name__[:1] in 'aeiouAEIOU' else ''} {type(bad).__name__}")
                    raise ValueError(f"callbacks: expected stabletrain.callbacks.Callback instances, got {brief(bad)} ({what})")
            elif name == "model_factory":
                found = _FACTORY.fullmatch(value) if isinstance(value, str) else None
                ok, want = callable(value) or found is not None, "'module:function' or a function that builds the model"
                if found is not None and _no_module(found.group(1)):
                    raise ValueError(f"model_factory: no module {found.group(1)!r} (from {value!r}); is it on PYTHONPATH?")
            else:  # loss_fn, count_fn
                ok, want = callable(value), "a function"
            if not ok:
                key = f" (config key {ARG_KEYS[name]})" if name in ARG_KEYS else ""
                raise ValueError(f"{name}: expected {want}, got {brief(value)}{key}")
        scaler = args.get("scaler")  # (a disabled one, GradScaler(enabled=use_fp16)'s when False, is none)
        if scaler is not None and scaler.is_enabled() and args.get("precision") not in (None, "fp16"):
            raise ValueError(f"scaler: a GradScaler scales fp16's loss, but precision={args['precision']!r} (give "
                             "precision='fp16' or leave it out with a scaler, or drop the scaler)")
        if scaler is not None and not scaler.is_enabled() and args.get("precision") == "fp16":  # (its steps: never scaled)
            raise ValueError("scaler: a disabled GradScaler (enabled=False) scales nothing, but precision='fp16' needs one "
                             "that does (enable it, or give precision='fp32'/'bf16')")
        return self

    @staticmethod
    def apply(cfg: Config, options: dict[str, Any]) -> Config:
        """``cfg`` with the options that are config keys set, validated as the built-in run's (returned)."""
        for name, value in options.items():
            section, _, key = CONFIG_KEYS[name].partition(".")
            setattr(getattr(cfg, section), key, list(value) if isinstance(value, tuple) else value)
        try:
            return cfg.validate()
        except ConfigError as err:
            named = next((n for n, k in CONFIG_KEYS.items() if f"'{k}'" in str(err)), None)
            raise ValueError(f"{named}: {err}" if named else str(err)) from None

    def project(self, cfg: Config, world: int = 1) -> Config:
        """``cfg`` (the session's) with these options' config keys (the log and guard sections) set and validated; ``world``:
        the processes the host runs (on_spike='skip' is one process's: the rule judges each rank's own loss)."""
        if world > 1 and self.on_spike == "skip":
            raise ValueError(f"on_spike='skip' under torch.distributed (world size {world}): the spike rule runs on each "
                             "rank's own loss before the step, and the ranks would disagree on skipping it; use "
                             "on_spike='warn' (the rule runs at the log boundary on the losses every rank shares)")
        return self.apply(cfg, {n: _get(self._cfg, k) for n, k in CONFIG_KEYS.items()})

    def sections(self, cfg: Config) -> dict[str, Any]:
        """The ``log``, ``guard`` and ``capture`` sections of an adapter's ``config.yaml`` (``cfg``: its run's config)."""
        guard = {k: getattr(cfg.guard, k) for k in ("spike_window", "spike_ratio", "spike_zscore", "max_consecutive_skips")}
        return {"log": {"every": self.log_every, "tensorboard": self.tensorboard, "top_layers": self.top_layers,
                        "mirror": self.mirror, "trackers": self.tracker_names()},
                "guard": {"on_nonfinite": self.on_nonfinite, "on_spike": self.on_spike, "check_params": self.check_params,
                          "init_check": self.init_check, **guard},
                "capture": {"incidents": self.capture, "diagnose": self.diagnose}}

    def tracker_names(self) -> list[str]:
        """The trackers' names ("tensorboard", "mlflow", "wandb"), as ``log.trackers`` lists them."""
        return [t if isinstance(t, str) else t.name for t in self.trackers]


def _check_trackers(specs: Sequence[Any]) -> None:
    """Each entry a tracker's name or a configured sink (a ``TrackerSink``: it has its tracker's ``name``), none twice."""
    seen: set[str] = set()
    for i, spec in enumerate(specs):
        name = spec if isinstance(spec, str) else getattr(spec, "name", None) if hasattr(spec, "on_log") else None
        if name not in TRACKERS or (name == "tensorboard" and not isinstance(spec, str)):
            raise ValueError(f"trackers[{i}]: expected one of {', '.join(TRACKERS)} or a TrackerSink, got {brief(spec)}")
        if name in seen and name != "tensorboard":  # tensorboard twice: log.trackers' own check says so
            raise ValueError(f"trackers[{i}]: {name} is listed twice")
        seen.add(name)


def _no_module(name: str) -> bool:
    """Whether no module ``name`` can be found (its parent packages are imported to look; nothing of its own runs)."""
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):
        return True
    except Exception:  # noqa: BLE001  (a parent package that fails to import: its own error comes when it is loaded)
        return False


def _get(cfg: Config, key: str) -> Any:
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def host_precision(host: str, asked: str | None, scaler: Any, accelerator: Any, device: Any) -> str:
    """The precision a host trainer really runs ("fp16" where a GradScaler scales its loss, "bf16" where its accelerator
    runs bf16 autocast, else "fp32"), warned of where it is not the one ``asked`` for (fp16 asked on a CPU runs fp32)."""
    mode = ("fp16" if scaler is not None else "bf16" if asked == "bf16" and getattr(accelerator, "mixed_precision", "no")
            == "bf16" and getattr(accelerator, "native_amp", True) else "fp32")
    if asked in ("fp16", "bf16") and mode != asked:
        warnings.warn(f"the {host} was asked for {asked} but runs {mode} on {device} (its accelerator: mixed_precision="
                      f"{getattr(accelerator, 'mixed_precision', 'no')!r}); the run directory says {mode}",
                      StableTrainWarning, stacklevel=3)
    return mode
