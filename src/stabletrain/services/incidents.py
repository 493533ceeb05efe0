"""The incident recorder: the built-in loop's steps as the source of the one capture (:mod:`stabletrain.services.capture`).

At each interval start (``capture.memory_snapshot``, the default) the capture stages the whole state into
host buffers that are reused from one interval to the next (from CUDA pinned and non-blocking, so device
memory does not double and the step does not wait; the run's strategy says how: under DDP each rank
copies its share of the parameters and optimizer state, which every rank holds alike, and under FSDP its
own shards). A capture replays from that snapshot to just before the bad step, on every rank together,
with the same :class:`~stabletrain.step.TrainStep` the run uses (collectives included): at most
``log.every - 1`` steps, wherever the incident falls and however far the last checkpoint is. Without
the snapshot (``capture.memory_snapshot=false``) it replays from LAST_GOOD instead, up to ``ckpt.every``
steps. The bundle holds the model and optimizer state before the step (FSDP: every rank writes its own
shards with DCP into the bundle's ``dcp/`` folder); the diagnosis replays that step on one process under
the precise tools (:func:`stabletrain.incident_replay.diagnose_incident`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from .. import console
from ..config import config_to_dict
from ..records.checkpoint.files import CheckpointError
from ..records.checkpoint.manager import step_of
from ..records.checkpoint.shards import is_dcp_entry
from ..records.jsonl import read_jsonl
from ..records.staging import StateStager, equal_states, snapshot_fits
from ..runstate import FRESH_KEYS, RunState
from ..seeding import rng_state
from .capture import IncidentCapture, staged_now
from .checkpoints import CheckpointKeeper
from .spike_reference import LEVEL_INTERVALS

__all__ = ["IncidentRecorder", "LoopSteps"]

#: How many checkpoints a spike's capture reads at most looking for an older state (:meth:`LoopSteps.reference_state`).
MAX_REFERENCE_LOADS = 3
RECENT = 12  # windows a spike's capture looks through for ordinary ones (before it, then after it)
MAX_BURST = 3  # the flagged steps right after a spike whose windows its diagnosis weighs too (one process)


class LoopSteps:
    """The built-in loop as a :class:`~stabletrain.services.capture.StepSource`: its data stream and its step."""

    def __init__(self, recorder: IncidentRecorder) -> None:
        self.recorder = recorder
        self.fit: RunState | None = None
        self._window: Any = None
        self._recent: list[list[list[int]]] = []  # the last replayed windows' indices (a spike's ordinary windows)
        self._previous: dict[str, Any] | None = None  # a spike's: the state before the step before it
        self._skip: set = set()

    state = property(lambda self: self.recorder.state)
    strategy = property(lambda self: self.state.strategy)
    module = property(lambda self: self.state.module)
    optimizer = property(lambda self: self.state.optimizer)
    diagnose = property(lambda self: bool(self.fit is not None and self.fit.cfg.capture.diagnose))
    global_spikes = True  # a DDP/FSDP spike's bundle holds the step's whole batch (every rank's window)

    @property
    def fresh_parts(self) -> Collection[str]:
        """The parts of the state whose state dicts are fresh copies (:data:`~stabletrain.runstate.FRESH_KEYS`): on the
        CPU the snapshot keeps them as they are (staging them cost a third of the snapshot on a small model)."""
        return FRESH_KEYS if self.state.device.type == "cpu" else ()

    @property
    def run_dir(self) -> Path | None:
        ckpt = self.fit.ckpt if self.fit is not None else None  # every rank with a run directory has its manager
        return ckpt.root.parent if ckpt is not None else None

    def capturing(self, fit: RunState) -> bool:
        self.fit = fit
        return bool(fit.cfg.capture.incidents and (fit.ckpt is not None or self.recorder.engine.snapshot.taken))

    def live_state(self) -> dict[str, Any]:
        return self.state.state_dict(local=True)  # FSDP: this rank's shards (no collective)

    def load_live_state(self, state: dict[str, Any]) -> None:
        stream = self.state.stream
        skip = set(stream.skip)
        self.state.load_state_dict(state)
        stream.skip = skip  # windows a rollback skipped after that state was saved stay skipped

    def fallback_state(self, fit: RunState) -> tuple[dict[str, Any], int] | None:
        loaded = self.recorder.keeper.load_last_good()
        return (loaded.state, int(loaded.state["counters"]["step"])) if loaded is not None else None

    def why_not(self, step: int, start: int | None) -> str | None:
        return None

    def interval_started(self, retired: int | None, step: int) -> None:
        return None  # the stream replays any window; the schedule writes a step's lr before it

    def stretch_lrs(self, start: int, step: int) -> None:
        return None  # the schedule's, replayed as the run stepped

    def reference_state(self, fit: RunState, before: int, unlike: dict[str, Any], oldest: int = 0
                        ) -> tuple[dict[str, Any] | None, int, dict[str, Any] | None] | None:
        """The newest verified checkpoint before step ``before`` (LAST_GOOD or older) whose model differs from
        ``unlike``: a spike after skipped steps, or on the run's first steps, is weighed against it (the issue's
        "an older checkpoint"). At most :data:`MAX_REFERENCE_LOADS` are read; a sharded one gives None; one older than
        step ``oldest`` is not read: (None, its step, None)."""
        ckpt = fit.ckpt
        if ckpt is not None:
            ckpt.wait()  # a save still in flight (the first one starts its writer: a second or so) is the newest
        for path in ckpt.good_before(before)[:MAX_REFERENCE_LOADS] if ckpt is not None else []:
            if step_of(path) < oldest:  # newest first: every later one is older still
                return None, step_of(path), None
            try:
                loaded = ckpt.load(path)
            except CheckpointError:
                continue
            model = loaded.state["model"]
            if is_dcp_entry(model):
                return None
            if not equal_states(model, unlike):
                return model, int(loaded.state["counters"]["step"]), loaded.state.get("optimizer")
        return None

    def replay_to(self, fit: RunState, step: int, start: int, locate: tuple[int, int] | None,
                  rows: list[Any] = (), keep_previous: bool = False) -> tuple[int, dict | None]:
        """Replay from the loaded state to just before ``step``; pin an update that broke the parameters.

        ``locate`` (lo, hi): the parameters were found non-finite at step hi's check; from step lo on each
        replayed step's parameters are checked (one host read each) with the state before it staged, and
        at the first that fails the state goes back to before it. Returns that step with its loss and grad
        norm (the replay's, bitwise the run's), or None.
        """
        stager = StateStager() if locate is not None else None
        replayed = 0
        self._recent, self._previous = [], None
        while fit.step < step - 1:
            if keep_previous and fit.step == step - 2:  # the state before the step before the spike (FSDP: shards)
                live = self.live_state()
                if self.strategy.one_process_model(live["model"]) is not None:
                    self._previous = staged_now(live)
            before = None
            if stager is not None and fit.step + 1 >= locate[0]:
                before, ready = stager.stage(self.live_state())
                for event in ready:
                    event.synchronize()
            window = fit.stream.next_window()
            self._recent = [*self._recent[-RECENT + 1:], (fit.step + 1, window.indices)]
            self._last = (window.epoch, window.start)
            out = self.state.train_step(window)
            fit.step += 1
            replayed += 1
            if before is not None and "params_finite" in out and not bool(out["params_finite"]):
                found = {"step": fit.step, "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"])}
                self.load_live_state(before)  # its buffers are the state's now: the stager is not used again
                return replayed, found
        return replayed, None

    def record(self, fit: RunState, step: int, context: int = 0, avoid: Collection[int] = (), seen: int | None = None
               ) -> dict[str, Any]:
        rng = rng_state()
        self._window = window = fit.stream.next_window()
        ordinary = [w for s, w in self._recent if s not in avoid][-context:] if context else []
        after, last = step, min(step + RECENT, seen if seen is not None else step + RECENT)
        # A spike's burst (one process): the flagged steps right after it, whose windows its diagnosis weighs too.
        burst: list[list[Any]] = []
        bursting = bool(context) and not fit.dist.enabled
        while after < last and (len(ordinary) < context or bursting and after + 1 in avoid and len(burst) < MAX_BURST):
            after += 1  # a spike early in its interval: the windows after it that the interval saw as ordinary (the
            later = fit.stream.next_window().indices  # stream is put back); none it never trained (a run stopped)
            if after not in avoid:
                bursting = False
                if len(ordinary) < context:
                    ordinary.append(later)
            elif bursting and len(burst) < MAX_BURST:  # (the loop may go on for the context: the cap holds anyway)
                burst.append([after, later])
        return {"rank": fit.dist.rank, "rng": rng, "context": ordinary, **({"burst": burst} if burst else {}),
                "window": {"epoch": window.epoch, "start": window.start, "indices": window.indices},
                "previous_window": self._recent[-1][1] if self._recent else None}

    def blame(self, fit: RunState, spike: bool = False) -> list[int] | None:
        ranks = self.strategy.spike_ranks if spike else self.strategy.nonfinite_gradient_ranks
        return ranks(fit.module, fit.task, fit.precision, self._window)

    def bundle_state(self, **kwargs: Any) -> dict[str, Any]:
        return self.state.state_dict(**kwargs)

    def bundle(self, fit: RunState, step: int, record: dict[str, Any], before: dict[str, Any],
               info: dict[str, Any]) -> dict[str, Any]:
        interval_loss = fit.history[-1].get("loss") if fit.history else None
        prev = self._previous
        previous = ({"step": step - 1, "window": record.get("previous_window") or self._recent[-1][1], "epoch": self._last[0],
                     "start": self._last[1],
                     **{k: prev[k] for k in ("model", "optimizer", "schedule", "precision", "rng")}}
                    if prev is not None and self._recent else None)
        return {"previous": previous, "model": before["model"], "optimizer": before["optimizer"], "step": step,
                "rank": record["rank"],
                "world_size": fit.dist.world, "config": config_to_dict(fit.cfg), "window": record["window"],
                "rng": record["rng"], "schedule": before["schedule"], "precision": before["precision"],
                "observed": {"after_update": info["after_update"], "interval_loss": interval_loss,
                             **({"context": record["context"]} if record.get("context") else {}),
                             **({"burst": record["burst"]} if record.get("burst") else {}),
                             "ranks": info["ranks"], "grad_norm": info.get("grad_norm"),
                             # The step's loss as the run saw it; the replay compares it bitwise (one process:
                             # under DDP the run's loss is the global one, a replay sees one rank's batch).
                             **({"loss": info.get("loss")} if not fit.dist.enabled else {})}}

    def diagnosis(self, bundle: dict[str, Any]) -> tuple[Any, contextlib.AbstractContextManager, tuple[str, ...]]:
        fit = self.fit
        return self.strategy.replay_task(fit.task, fit.named_params), contextlib.nullcontext(), ()

    def replaying(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class IncidentRecorder:
    """On an incident, write ``incidents/step_N/bundle.pt`` and (``capture.diagnose``) its ``diagnosis.json``.

    A service the loop calls by name (:meth:`mark_interval_start` at fit start and at every log boundary,
    :meth:`capture` on an incident); ``state`` is the run's :class:`~stabletrain.runstate.RunState` (its parts
    and its step). Every rank takes part (the replay has collectives); rank 0
    writes. The bundle holds the window and RNG state of the rank that saw the bad value, so its diagnosis
    replays on that rank's batch.
    """

    def __init__(self, state: RunState, keeper: CheckpointKeeper) -> None:
        self.state, self.keeper = state, keeper
        self.source = LoopSteps(self)
        self.engine = IncidentCapture(self.source)
        self._enabled: bool | None = None  # capture.memory_snapshot=auto: decided once, at plan_snapshot

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The state at the interval's start in host buffers (None: no snapshot this interval; DDP: others' shares withheld)."""
        return self.engine.state

    @property
    def replayed_steps(self) -> int | None:
        """Steps the last capture replayed (None: no capture yet)."""
        return self.engine.replayed_steps

    def resume(self, run_dir: Path) -> None:
        """What the run's earlier launches knew when it resumes (every rank calls it; rank 0 reads the record): the
        interval records a spike's diagnosis weighs its step sizes against, the samples earlier spikes named (a spike
        they carry again comes back) and the last spike whose update was applied (a later one may be its
        aftershock), up to the step resumed from (:meth:`IncidentCapture.remember`)."""
        step = self.state.step

        def read() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
            def upto(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
                return [r for r in records if isinstance(r.get("step"), int) and r["step"] <= step]

            spikes = [e for e in upto(read_jsonl(run_dir / "events.jsonl")[0])
                      if e.get("kind") == "incident" and e.get("anomaly") == "spike"]
            return upto(read_jsonl(run_dir / "metrics.jsonl")[0])[-LEVEL_INTERVALS:], spikes

        history, spikes = self.state.dist.on_main(read)
        self.engine.remember(history, spikes, applied=self.state.cfg.guard.on_spike == "warn")

    def plan_snapshot(self) -> None:
        """Decide once, when the run directory opens, whether the intervals are snapshot (every rank calls it).

        ``capture.memory_snapshot=auto``: rank 0 decides for every rank (one broadcast, here, so no interval's
        snapshot needs a collective): whether the snapshots on this host fit ``capture.snapshot_memory_fraction``
        of the host memory available now (:func:`~stabletrain.records.staging.host_memory_available`). A
        snapshot is this process's state (DDP: its share of the parameters and optimizer state, and its own
        rest; FSDP: its shards), the optimizer's state estimated before its first step made it; the processes
        on this host are ``LOCAL_WORLD_SIZE``. When they do not fit: off, and one warning line says so and
        what an incident then costs.
        """
        state = self.state
        capture = state.cfg.capture
        if capture.memory_snapshot == "auto" and capture.incidents:
            self._enabled = state.dist.on_main(self._fits)
        else:
            self._enabled = bool(capture.memory_snapshot)
        if self._enabled and capture.spikes and not state.dist.enabled:  # one process, twice the bytes fit: a spike on
            # its interval's first step replays from the snapshot before (IncidentCapture._replay)
            one = self._snapshot_bytes()
            self.engine.snapshot.keep_previous = snapshot_fits(2 * one, capture.snapshot_memory_fraction)[0]
            # and thrice: the snapshot from before a run of flagged steps is held while it goes on (IncidentCapture)
            self.engine.snapshot.may_hold = snapshot_fits(3 * one, capture.snapshot_memory_fraction)[0]

    def _snapshot_bytes(self) -> int:
        """The bytes one interval snapshot of this process takes (the strategy's count)."""
        state = self.state
        return state.strategy.snapshot_bytes(state.state_dict(local=True), state.module, state.optimizer)

    def _fits(self) -> bool:
        state = self.state
        per_process = self._snapshot_bytes()
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if state.dist.enabled else 1
        fraction = state.cfg.capture.snapshot_memory_fraction
        fits, budget = snapshot_fits(per_process, fraction, processes=processes)
        if not fits:
            mib = 2 ** 20
            console.warn(f"capture.memory_snapshot=auto: the incident snapshot is off: {per_process / mib:.0f} MiB per "
                         f"process x {processes} process(es) on this host exceed capture.snapshot_memory_fraction="
                         f"{fraction:g} of the host memory available at start ({budget / mib:.0f} MiB); an incident "
                         f"then replays from the last checkpoint (LAST_GOOD, up to ckpt.every={state.cfg.ckpt.every} "
                         f"steps) instead of the interval's start (at most log.every={state.cfg.log.every}); set "
                         "capture.memory_snapshot=true to take it anyway")
        return fits

    def mark_interval_start(self) -> None:
        """A new interval starts: stage the state into the snapshot's host buffers (``capture.memory_snapshot``)."""
        state = self.state
        capture = state.cfg.capture
        self.engine.mark_interval_start(state.step, bool(capture.incidents and capture.memory_snapshot
                                                         and state.ckpt is not None and self._enabled),
                                        state.guard.unordinary if state.guard is not None else ())

    def capture(self, state: RunState, info: dict[str, Any], rows: list[Any] = ()) -> dict[str, Any]:
        """Capture ``info["step"]`` (:meth:`IncidentCapture.capture`): every rank calls it; rank 0 writes."""
        return self.engine.capture(state, info, rows)
