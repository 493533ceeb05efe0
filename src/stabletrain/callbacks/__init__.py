"""Callbacks: one base class with typed no-op hooks, for what observes the run and reacts through them.

Where each hook fires, in the fit loop (:meth:`stabletrain.loop.Trainer.fit`)::

    on_fit_start(state)                         # run dir open, state restored on resume
    on_resume(state, info)                      # only when the state came from a checkpoint
    while state.step < train.max_steps:
        out = step(next window)                 # ONE optimizer step (stabletrain.step)
        on_step_end(state, out)                 # out: the step's DEVICE tensors; never read them on the host
        at a log boundary (one host sync):
            on_log(state, record, rows)         # the interval's reduced record and per-step host rows
            on_incident(state, info)            # the guard saw a bad step (info: step, after_update, ranks)
            on_rollback(state, info) | on_stop(state, reason)
            on_checkpoint(state, info)          # a save's outcome is known: written, withheld or failed (info["kind"])
                                                # saves run in the background: written ones are reported at a
                                                # later boundary (info["step"] is the save's), the run's last at once
    on_fit_end(state, record)                   # also after a stop or an exception (record may be {})

A hook receives what it needs as arguments: the run's state (:class:`~stabletrain.runstate.RunState`: its
config, parts, counters and run dir; the same object the services are handed) and the event's values.
``state_dict`` / ``load_state_dict`` round-trip each callback's own state through checkpoints. What acts
on the run's state (the checkpoint keeper, the incident recorder, the signal handler) are services the loop
calls by name (:mod:`stabletrain.services`), not callbacks.

A callback that only observes must not read device tensors on the host in :meth:`Callback.on_step_end`
(``float(out["loss"])`` is a host sync per step): accumulate on the device, read at :meth:`Callback.on_log`.

The built-in callbacks (always installed by the Trainer, in this order): :class:`~.sinks.EventLog`,
:class:`~.sinks.MetricsFile`, :class:`~.sinks.TensorBoardLog`, the trackers ``log.trackers`` names
(:class:`~.trackers.MLflowTracker`, :class:`~.trackers.WandbTracker`), :class:`~.sinks.ProgressBar`; then the
user's (``Trainer(cfg, callbacks=[...])`` and the config key ``callbacks: [module:Class, ...]``); then
:class:`~.sinks.InitWatch`, last, so that an init a user's ``on_fit_start`` overwrote is seen too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from ..runstate import RunState

__all__ = ["Callback", "CallbackList", "FitState", "RunState", "load_callbacks"]


#: The name hooks were annotated with before the run's state became one object (:class:`~stabletrain.runstate.RunState`).
FitState = RunState


class Callback:
    """Base class: every hook is a no-op; override the ones you need. See the module docstring."""

    def on_fit_start(self, state: RunState) -> None:
        """The run directory is open and the state restored (on resume); no step has run in this fit."""

    def on_step_end(self, state: RunState, out: dict[str, Tensor]) -> None:
        """One optimizer step ended; ``out`` holds its device tensors (``stabletrain.step.STEP_KEYS``). No sync here."""

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        """A log interval ended: ``record`` is its metrics line, ``rows`` its per-step host values."""

    def on_incident(self, state: RunState, info: dict[str, Any]) -> None:
        """The guard saw a bad step (``info``: step, after_update, ranks; the recorder adds path, diagnosis)."""

    def on_checkpoint(self, state: RunState, info: dict[str, Any]) -> None:
        """A checkpoint was written, withheld or failed (``info``: step, kind, reason, path where written)."""

    def on_resume(self, state: RunState, info: dict[str, Any]) -> None:
        """The state was restored from a checkpoint (``info``: step, path)."""

    def on_rollback(self, state: RunState, info: dict[str, Any]) -> None:
        """The run went back to LAST_GOOD (``info``: from_step, to_step, path, skipped_windows, reason)."""

    def on_stop(self, state: RunState, reason: str) -> None:
        """The run stops early (guard or signal); a final checkpoint may follow."""

    def on_fit_end(self, state: RunState, record: dict[str, Any]) -> None:
        """The fit loop is leaving (normally, after a stop, or on an exception); release resources here."""

    def state_dict(self) -> dict[str, Any]:
        """This callback's own state, saved in checkpoints (plain values and tensors only).

        Also read at every log interval's start, for the incident snapshot (``capture.memory_snapshot``): keep it cheap.
        """
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""


_HOOKS = ("on_fit_start", "on_step_end", "on_log", "on_incident", "on_checkpoint", "on_resume", "on_rollback",
          "on_stop", "on_fit_end")


class CallbackList:
    """Fire each hook on every callback, in order; only callbacks that override a hook are called for it."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        for cb in callbacks:
            if not isinstance(cb, Callback):
                raise TypeError(f"callback {cb!r} is a {type(cb).__name__}, expected a stabletrain.callbacks.Callback "
                                "subclass instance")
        self.callbacks = list(callbacks)
        self._index()

    def _index(self) -> None:
        # Per hook, the callbacks that override it: the per-step hook then costs nothing for the others.
        self._active = {h: [getattr(cb, h) for cb in self.callbacks if getattr(type(cb), h) is not getattr(Callback, h)]
                        for h in _HOOKS}

    def append(self, callback: Callback) -> None:
        """Add a callback after the others (e.g. one that needs the built Trainer's pieces)."""
        if not isinstance(callback, Callback):
            raise TypeError(f"callback {callback!r} is a {type(callback).__name__}, expected a Callback instance")
        self.callbacks.append(callback)
        self._index()

    def fire(self, hook: str, *args: Any) -> None:
        for fn in self._active[hook]:
            fn(*args)

    def keys(self) -> list[str]:
        """A stable key per callback: its class name, with an index when the same class appears twice."""
        names = [type(cb).__qualname__ for cb in self.callbacks]
        return [n if names.count(n) == 1 else f"{n}#{names[:i].count(n)}" for i, n in enumerate(names)]

    def state_dict(self) -> dict[str, Any]:
        return {k: cb.state_dict() for k, cb in zip(self.keys(), self.callbacks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore each callback's state; a callback absent from ``state`` (added on resume) keeps its own."""
        for key, cb in zip(self.keys(), self.callbacks):
            if key in state:
                cb.load_state_dict(state[key])


def load_callbacks(specs: Sequence[str]) -> list[Callback]:
    """Instantiate the config's ``callbacks`` entries (``'module:Class'``, constructed with no arguments)."""
    from ..tasks import TaskError, import_object

    out = []
    for i, spec in enumerate(specs):
        key = f"callbacks.{i}"
        cls = import_object(spec, key, "'module:Class'", kind="class")
        if not isinstance(cls, type) or not issubclass(cls, Callback):
            raise TaskError(f"config key '{key}': {spec!r} is not a stabletrain.callbacks.Callback subclass")
        out.append(cls())
    return out
