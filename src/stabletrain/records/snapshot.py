"""The training state at a log interval's start, in host buffers reused from one interval to the next.

:class:`IntervalSnapshot` is what an incident's capture replays from (:mod:`stabletrain.services.capture`); it
stages with :class:`~stabletrain.records.staging.StateStager`.
"""

from __future__ import annotations

import weakref
from collections.abc import Collection
from typing import Any

import torch

from .staging import StateStager, tensors_in

__all__ = ["IntervalSnapshot", "order_steps_after"]


class IntervalSnapshot:
    """The training state at the start of a log interval, in host buffers reused from one interval to the next.

    A capture puts it back and replays the interval's steps up to the bad one (the built-in loop from its
    data stream, an adapter from the steps it kept), so the state from before any step of the interval is
    at hand without a copy per step. It is taken in two parts. ``side``: what changes only in the
    optimizer's step (the parameters and the optimizer's per-parameter state: nearly all the bytes); on
    CUDA its device-to-host copies run on a side stream, which the forward and backward (they only read
    it) overlap, and the optimizer's next step waits for (an optimizer step pre-hook: a device-side wait,
    no host sync). Under DDP it is the same on every rank: ``share=(rank, world)`` copies this rank's share
    (:meth:`StateStager.stage`), and the capture completes it with one broadcast per tensor. ``rest``: what
    a forward may change too (buffers, counters, RNG; small), on the compute stream; its ``fresh`` parts (state
    dicts made afresh, on the CPU) are kept as they are, not copied. ``num_bytes``: the host memory its buffers
    hold (the fresh parts' few tensors left out). While a run of flagged steps goes on, the snapshot from before it
    may be :meth:`hold`-ed (one more state in host memory, no copy: the next snapshots stage into new buffers) until
    :meth:`release`.
    """

    def __init__(self, keep_previous: bool = False) -> None:
        self._side, self._rest = StateStager(), StateStager()
        #: Keep the snapshot before this one too (one process: twice the host memory, no more copies), so a capture of
        #: a step right after an interval's start has an earlier state to replay from (:meth:`get_previous`).
        self.keep_previous = keep_previous
        self.previous: tuple[Any, Any, int, list[Any]] | None = None
        self._spare = (StateStager(), StateStager())  # the previous snapshot's stagers (keep_previous)
        self.held: tuple[Any, Any, int, list[Any]] | None = None  # a snapshot from before a run of flagged steps (hold)
        self.may_hold = False  # a third state fits the host's memory budget (set by the incident recorder)
        self._held: tuple[StateStager, ...] = ()  # its stagers, out of the rotation while it is held
        self._stream: Any = None  # the side stream (CUDA)
        self._events: list[Any] = []  # CUDA events the side part's copies complete at
        self._rest_events: list[Any] = []
        self._ordered = True  # the compute stream waits for the side copies already
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()  # the optimizers whose step pre-hook orders the copies
        self.side: Any = None
        self.rest: Any = None
        self.share: tuple[int, int] | None = None
        self.step: int | None = None  # the step after which the state was taken (0: before the first)

    @property
    def num_bytes(self) -> int:
        return sum(stager.num_bytes for stager in (self._side, self._rest, *self._spare, *self._held))

    @property
    def taken(self) -> bool:
        return self.rest is not None

    def take(self, side: Any, rest: Any, step: int, *, share: tuple[int, int] | None = None,
             optimizer: torch.optim.Optimizer | None = None, fresh: Collection[str] = ()) -> None:
        """Stage ``side`` (None: everything is in ``rest``) and ``rest`` (live tensors: copied) as the state after ``step``.

        ``optimizer``: the one whose step changes ``side`` in place; on CUDA its step waits for the copies. ``fresh``: keys
        of ``rest`` whose values are fresh host copies, kept as they are (:meth:`StateStager.stage`).
        """
        self.before_update()  # the last snapshot's copies are done before its buffers are written again
        stream = None
        device = None  # the side stream's device: the first CUDA tensor's (none before CUDA was initialized)
        if side is not None and torch.cuda.is_initialized():
            device = next((t.device for t in tensors_in(side) if t.device.type == "cuda"), None)
        if device is not None and optimizer is not None:
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device)
            stream = self._stream
            if optimizer not in self._hooked:
                self._hooked.add(optimizer)
                order_steps_after(optimizer, self)
        if side is not None:
            self.side, self._events = self._side.stage(side, share=share, stream=stream)
        else:
            self.side, self._events = None, []
        self._ordered = stream is None
        self.rest, self._rest_events = self._rest.stage(rest, fresh=fresh)
        self.step, self.share = step, share

    def before_update(self) -> None:
        """Order the next in-place update of the state after the side copies (CUDA; no host sync)."""
        if not self._ordered:
            for event in self._events:
                torch.cuda.current_stream().wait_event(event)
            self._ordered = True

    def get(self) -> tuple[Any, Any]:
        """(side, rest), once their copies are complete (waits for them). DDP: ``side`` still holds others' shares withheld."""
        for event in [*self._events, *self._rest_events]:
            event.synchronize()
        self.before_update()
        return self.side, self.rest

    def clear(self) -> None:
        """Drop the snapshot (``keep_previous``: keep it as :attr:`previous`; its buffers are not written next)."""
        self.before_update()
        if self.keep_previous and self.taken and self.share is None:
            self.previous = (self.side, self.rest, self.step, [*self._events, *self._rest_events])
            self._side, self._rest, self._spare = *self._spare, (self._side, self._rest)
        else:
            self.previous = None
        self.side = self.rest = self.step = self.share = None
        self._events, self._rest_events = [], []

    def hold(self) -> None:
        """Keep this snapshot as :attr:`held` until :meth:`release` (any held before is released): its buffers leave the
        rotation and the next snapshot stages into new ones, one more state in host memory. One process only (no share)."""
        self.release()
        if self.taken and self.share is None:
            self.held = (self.side, self.rest, self.step, [*self._events, *self._rest_events])
            self._held, (self._side, self._rest) = (self._side, self._rest), (StateStager(), StateStager())

    def release(self) -> None:
        """Let go of the :attr:`held` snapshot and its buffers (nothing held: nothing to do)."""
        self.held, self._held = None, ()

    def get_held(self) -> tuple[Any, Any, int] | None:
        """(side, rest, step) of the :attr:`held` snapshot, its copies complete; or None."""
        return _completed(self.held)

    def get_previous(self) -> tuple[Any, Any, int] | None:
        """(side, rest, step) of the snapshot before this one (``keep_previous``), its copies complete; or None."""
        return _completed(self.previous)


def order_steps_after(optimizer: torch.optim.Optimizer, snapshot: IntervalSnapshot) -> None:
    """Make each step of ``optimizer`` call ``snapshot.before_update()`` first, for as long as the snapshot lives: the hook
    holds it weakly and goes once it is collected (a user's optimizer outlives a Monitor; it must not keep its host copy)."""
    ref = weakref.ref(snapshot)

    def hook(*_: Any) -> None:
        kept = ref()
        if kept is not None:
            kept.before_update()

    weakref.finalize(snapshot, optimizer.register_step_pre_hook(hook).remove)


def _completed(kept: tuple[Any, Any, int, list[Any]] | None) -> tuple[Any, Any, int] | None:
    """(side, rest, step) of a kept snapshot once its copies' CUDA events completed; None for none."""
    if kept is None:
        return None
    side, rest, step, events = kept
    for event in events:
        event.synchronize()
    return side, rest, step
