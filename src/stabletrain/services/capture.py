"""The one incident capture: the interval snapshot, the replay to just before the bad step, the bundle, the diagnosis.

The built-in loop and every adapter capture a bad step the same way; only where their steps come from
differs (a :class:`StepSource`: the loop's data stream and step, :class:`~stabletrain.services.incidents.LoopSteps`;
a host's kept steps and its own replay, :class:`~stabletrain.services.kept_steps.HostSteps`)::

    at each interval's start        the snapshot of source.live_state(), split by the run's strategy: the
                                    parameters and optimizer state on a CUDA side stream that the optimizer's
                                    step waits for (DDP: this rank's share of them), the rest on the compute stream
    at a boundary whose rows hold a bad step k (every rank: the replay has collectives):
        with the live state kept    load the snapshot (else source.fallback_state(): LAST_GOOD);
                                    source.replay_to(k): the steps before k, as the run took them;
                                    source.record(k): this rank's window and RNG state; the state before k,
                                    staged (FSDP: every rank writes its shards with DCP)
        rank 0                      incidents/step_k/bundle.pt (one per rank that saw it), then its diagnosis
                                    from the bundle in memory, with the run's RNG streams kept; an ``incident``
                                    event and one console line

The live state and the RNG streams are as they were before the capture when it returns, so a captured run
goes on exactly as one that was not.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, Protocol

from .. import console
from ..console import StableTrainWarning
from ..diagnostics.diagnosis import DIAGNOSIS_FIELDS, repeat_key, repeat_summary
from ..errors import user_location
from ..incident_replay import diagnose_incident, launch_history
from ..records.bundles import BUNDLE_DCP_DIR, STATE_IN, sample_ranks, write_bundle
from ..records.checkpoint.shards import is_dcp_entry
from ..records.snapshot import IntervalSnapshot
from ..records.staging import StateStager, clone_state, equal_states, join_params, state_kept
from ..runstate import RunState
from ..seeding import kept_rng
from .spike_reference import AFTERSHOCK_STEPS, DRIFT_CLASSES, MAX_CONTEXT, spike_parts

__all__ = ["IncidentCapture", "StepSource", "incident_dir", "staged_now", "global_record",
           "IN_MEMORY"]

#: What :meth:`IncidentCapture.capture` hands its caller in memory only (a live remedy's search reads them): the
#: first bundle and its whole diagnosis; no event's or ``on_incident``'s field.
IN_MEMORY = ("bundle", "diagnosis_record")


def unordinary(fit: RunState, rows: list[Any]) -> set[int]:
    """The steps whose windows are no ordinary ones: the interval's spikes, non-finite or skipped steps, and the
    steps the guard flagged before (a replay from an older state passes them)."""
    return {*(fit.guard.unordinary if fit.guard is not None else ()),
            *(r.step for r in rows if r.values.get("spike", 0.0) > 0.5 or r.values.get("finite", 1.0) < 0.5
              or r.values.get("applied", 1.0) < 0.5)}


def incident_dir(run_dir: Path, step: int) -> Path:
    """``RUN_DIR/incidents/step_N``; ``step_N.2``, ``step_N.3``, ... where the run captured step N before (a rollback
    or a resume went back past it and the run met it again): an earlier capture is never overwritten."""
    base = folder = Path(run_dir) / "incidents" / f"step_{step:06d}"
    k = 1
    while folder.exists():
        k += 1
        folder = base.with_name(f"{base.name}.{k}")
    return folder


def global_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's record of one step (rank order) as one: its window the step's whole batch (each rank's micro-batches
    in turn, ``ranks`` naming each one's rank), its ordinary windows and the window before it likewise; the RNG state,
    epoch and start rank 0's. A one-process replay of it is the step DDP took (the mean over every rank's samples)."""
    first = records[0]
    k = min(len(r.get("context") or []) for r in records)
    out = {**first, "context": [[idx for r in records for idx in r["context"][j]] for j in range(k)],
           "window": {**first["window"], "indices": [idx for r in records for idx in r["window"]["indices"]],
                      "ranks": [r["rank"] for r in records for _ in r["window"]["indices"]]}}
    if all(r.get("previous_window") is not None for r in records):
        out["previous_window"] = [idx for r in records for idx in r["previous_window"]]
    return out


def staged_now(state: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``state`` in fresh host buffers, complete when it returns (a source keeps a state a replay moves past)."""
    staged, ready = StateStager().stage(state)
    for event in ready:
        event.synchronize()
    return staged


class StepSource(Protocol):
    """Where a capture's steps come from (see the module docstring)."""

    strategy: Any  # the run's Strategy: how the snapshot splits, completes, and how the bundle's state is written
    module: Any  # the model itself (not a wrapper)
    optimizer: Any  # the run's torch optimizer (its step waits for the snapshot's side copies)
    run_dir: Path | None  # the run directory, known on every rank (None: nothing is written)
    diagnose: bool  # diagnose a captured step right away
    #: (optional) its records of a step on every rank join into one global window: a DDP/FSDP spike is weighed on the
    #: step's whole batch (:func:`global_record`), not on the one rank whose own loss was the largest
    global_spikes: bool
    #: (optional) keys of live_state() whose values are made afresh on each call, on the CPU: the snapshot keeps them
    fresh_parts: Collection[str]

    def capturing(self, fit: RunState) -> bool:
        """Whether a capture is asked for and can be written."""

    def live_state(self) -> dict[str, Any]:
        """This rank's live state (the snapshot's, and what the capture puts back after it)."""

    def load_live_state(self, state: dict[str, Any]) -> None:
        """Load what :meth:`live_state` returned (or the snapshot)."""

    def fallback_state(self, fit: RunState) -> tuple[dict[str, Any], int] | None:
        """(state, its step) to replay from when there is no snapshot; None: none."""

    def why_not(self, step: int, start: int | None) -> str | None:
        """Why step ``step`` cannot be replayed from step ``start`` (None: it can; ``start`` None: no state to start from)."""

    def interval_started(self, retired: int | None, step: int) -> list[float] | None:
        """A new interval starts after ``step``; no replay needs step ``retired`` or any before it (what the source kept
        of them can go). Returns the param groups' lrs step ``step`` ran at, where the live optimizer's show the next
        step's (a host's scheduler steps before the boundary); ``[]``: not known; None: the optimizer's are it."""

    def stretch_lrs(self, start: int, step: int) -> list[list[float]] | None:
        """``[[t, lr], ...]``: the LR (the highest of the param groups') each step from ``start`` up to before ``step``
        ran at, where the host set it (its steps kept); None: the run's schedule (replayed as it ran)."""

    def reference_state(self, fit: RunState, before: int, unlike: dict[str, Any], oldest: int = 0
                        ) -> tuple[dict[str, Any] | None, int, dict[str, Any] | None] | None:
        """(a one-process model state older than step ``before`` whose weights differ from ``unlike``, its step, the
        optimizer state saved with it): a spike's older state when its interval holds none (the run's newest such
        checkpoint); None: none; (None, its step, None): the newest is older than step ``oldest`` (none loaded)."""

    def replay_to(self, fit: RunState, step: int, start: int, locate: tuple[int, int] | None,
                  rows: list[Any], keep_previous: bool = False) -> tuple[int, dict | None]:
        """Replay the steps after ``start`` up to just before ``step``: (steps replayed, the update it pinned or None).

        ``keep_previous``: stage the state before the last step replayed, for :meth:`bundle` (a spike's ``previous``).
        """

    def record(self, fit: RunState, step: int, context: int = 0, avoid: Collection[int] = (), seen: int | None = None
               ) -> dict[str, Any]:
        """This rank's record of step ``step`` for its bundle (its window, its RNG state), the state being before it;
        ``context``: also up to that many ordinary windows (``context``) that :meth:`bundle` puts in ``observed``,
        none of the steps in ``avoid`` (the interval's spikes and skipped steps: no ordinary windows) nor after ``seen``
        (the last step the run trained: a window it never saw is no ordinary one)."""

    def blame(self, fit: RunState, spike: bool = False) -> list[int] | None:
        """The ranks whose own gradients of the recorded step are non-finite (a collective), or None; ``spike``: the
        rank whose own loss on it is the largest (a finite spike's)."""

    def bundle_state(self, **kwargs: Any) -> dict[str, Any]:
        """The run's state before the step, in the one-process format the bundle holds (``dcp=True``: as DCP's)."""

    def bundle(self, fit: RunState, step: int, record: dict[str, Any], before: dict[str, Any],
               info: dict[str, Any]) -> dict[str, Any]:
        """The bundle of ``record``'s rank (``before``: :meth:`bundle_state`, staged)."""

    def diagnosis(self, bundle: dict[str, Any]) -> tuple[Any, contextlib.AbstractContextManager, dict[str, Any]]:
        """(the task the diagnosis replays, the context it runs in, extra event fields); raises when it cannot."""

    def replaying(self) -> contextlib.AbstractContextManager:
        """The source's own hooks and the host's logging off, while the capture replays."""


class IncidentCapture:
    """The interval snapshot and the capture of a bad step, for any :class:`StepSource` (module docstring)."""

    def __init__(self, source: StepSource) -> None:
        self.source = source
        self.snapshot = IntervalSnapshot()
        self.replayed_steps: int | None = None  # steps the last capture replayed (None: no capture yet)
        self.replaying = False  # a capture is replaying: the source's own per-step hooks stand by
        self.warned = False  # a step that could not be captured was said once
        self.last_spike: dict[str, Any] | None = None  # the last captured spike whose update was applied
        # A chain of spikes (applied or skipped) from one diagnosed as the state's or the optimizer's, each at most
        # AFTERSHOCK_STEPS after the one before: {"onset", "last"}. While it lasts a later one is weighed under a state before it.
        self.drift: dict[str, int] | None = None
        #: The samples earlier spikes' diagnoses named (dataset index -> the spike's step): a spike they carry again is
        #: theirs coming back, however many spikes came in between.
        self.spiked_samples: dict[int, int] = {}
        self.start_lrs: list[float] | None = None  # the lrs the snapshot's step ran at, where the optimizer's are the next's
        self.held_lrs: list[float] | None = None  # the same for the snapshot held before a run of flagged steps
        self.history: list[dict[str, Any]] = []  # interval records of the launches before a resume (:meth:`remember`)
        self.told: dict[tuple[Any, ...], int] = {}  # a non-finite failure said on the console -> its first step
        # A source's wish to keep the snapshot before the interval's too (HostSteps.wants_previous), asked at the first
        # interval start it snapshots (its optimizer's state is there, or estimated); the built-in loop's sets it itself.
        self._wants_previous = getattr(source, "wants_previous", None)

    def remember(self, history: list[dict[str, Any]], spikes: list[dict[str, Any]], applied: bool) -> None:
        """On a resume, what the launches before knew: their last interval ``history`` records, and their captured
        ``spikes`` (``incident`` events, oldest first): the samples each named and, where a spike's update was applied
        (``applied``: guard.on_spike=warn), the last one's step, class and samples."""
        self.history = list(history)
        for i, e in enumerate(spikes):
            self._note_spike(int(e["step"]), e.get("diagnosis"), applied=applied and i == len(spikes) - 1)

    def _note_spike(self, step: int, diagnosis: dict[str, Any] | None, applied: bool) -> None:
        """A captured spike's diagnosis: the samples it named (by dataset index), where its update was ``applied`` itself
        as the spike a later one may be the aftershock of, and a drift's course, applied or skipped (the updates before a
        state spike drifted the state: skipping its own undoes none of them; a too-high LR's later spikes, weighed under
        a snapshot inside the drift, read as data)."""
        d, unit = diagnosis or {}, (diagnosis or {}).get("sample_unit", "dataset index")
        if unit == "dataset index":
            self.spiked_samples.update((int(i), step) for i in d.get("bad_samples") or [])
        if applied:
            self.last_spike = {"step": step, "class": d.get("failure_class"), "samples": list(d.get("bad_samples") or []),
                               "sample_unit": unit}
        if (chain := self.drift_at(step)) is not None:  # (a spike of any class in a drift's course carries it on)
            chain["last"] = step
        elif d.get("failure_class") in DRIFT_CLASSES:
            self.drift = {"onset": step, "last": step}

    def drift_at(self, step: int) -> dict[str, int] | None:
        """The chain of drifting spikes (:attr:`drift`) step ``step`` is in the course of (at most AFTERSHOCK_STEPS after its
        last spike), or None."""
        chain = self.drift
        return chain if chain is not None and chain["onset"] <= step and step - chain["last"] <= AFTERSHOCK_STEPS else None

    # -- per interval ------------------------------------------------------------------------------

    def mark_interval_start(self, step: int, enabled: bool, flagged: Collection[int] = ()) -> None:
        """A new interval starts after ``step``: stage the state into the snapshot's host buffers (``enabled``).

        On CUDA the copies are queued (pinned, non-blocking; the parameters and optimizer state on a side
        stream) and waited for only by a capture; on CPU it is one copy of the state per interval (under DDP,
        of this rank's share of what every rank holds). ``flagged``: the steps the guard flagged lately
        (``guard.unordinary``): while a run of them goes on past ``step``, the snapshot from before it is held
        (:meth:`_hold_before_run`).
        """
        if enabled and self._wants_previous is not None:
            self.snapshot.keep_previous, self._wants_previous = bool(self._wants_previous()), None
        self._hold_before_run(step, flagged)  # (before interval_started: start_lrs are still the snapshot's)
        # What the next replays need: the steps after the snapshot they start from (this one; the one before it too,
        # kept where twice the snapshot fits) and the MAX_CONTEXT steps before it (a spike's ordinary windows).
        oldest = self.snapshot.step if self.snapshot.keep_previous and self.snapshot.taken else step
        self.start_lrs = self.source.interval_started(None if oldest is None else oldest - MAX_CONTEXT, step)
        self.snapshot.clear()
        if self.last_spike is not None and step < self.last_spike["step"]:  # a rollback went back past it: undone
            self.last_spike = None
        if self.drift is not None and step < self.drift["onset"]:
            self.drift = None
        if enabled:
            src = self.source
            side, rest, share = src.strategy.snapshot_parts(src.live_state(), src.module)
            self.snapshot.take(side, rest, step, share=share, optimizer=src.optimizer, fresh=getattr(src, "fresh_parts", ()))

    def _hold_before_run(self, step: int, flagged: Collection[int]) -> None:
        """Hold the last snapshot taken before the run of flagged steps that ``step`` ends, while it goes on (let go once a
        boundary's step is not flagged): under guard.on_spike=skip a divergence's every step may be skipped, and the state
        a spike's window is weighed under (:func:`~.spike_reference.spike_parts`) is the trained one from before the run,
        not step 0's checkpoint. One process, where thrice the snapshot fits the memory budget (``may_hold``)."""
        snap = self.snapshot
        chain = self.drift_at(step)  # (a drift's chain of spikes holds the snapshot from before its onset too)
        if step not in flagged and chain is None:
            snap.release()
            return
        flagged = set(flagged)
        since = step  # the run's first step
        while since in flagged and since - 1 in flagged:
            since -= 1
        if chain is not None:
            since = min(since, chain["onset"])
        if snap.may_hold and snap.taken and snap.step < since:  # the run began in the interval just ended
            snap.hold()
            self.held_lrs = self.start_lrs
        elif snap.held is not None and snap.held[2] >= since:  # (held from after the run began: a rollback)
            snap.release()

    @property
    def state(self) -> dict[str, Any] | None:
        """The state at the interval's start in host buffers (None: no snapshot; not waited for; DDP: shares withheld)."""
        snap = self.snapshot
        return join_params(snap.side, snap.rest) if snap.taken else None

    def _start(self, fit: RunState) -> tuple[dict[str, Any], int] | None:
        """(a copy of the state to replay from, its step): the snapshot (DDP: completed, a collective) or the fallback."""
        snap = self.source.strategy
        if self.snapshot.taken:
            side, rest = self.snapshot.get()
            side = snap.complete_snapshot(side) if side is not None else None
            # A copy: whatever loads it may keep its tensors (an optimizer on CPU), and the snapshot stays intact.
            return clone_state(join_params(side, rest)), int(self.snapshot.step)
        return self.source.fallback_state(fit)

    @contextlib.contextmanager
    def _replaying(self) -> Iterator[None]:
        self.replaying = True
        try:
            with self.source.replaying():
                yield
        finally:
            self.replaying = False

    # -- at a boundary with a bad step -------------------------------------------------------------

    def capture(self, fit: RunState, info: dict[str, Any], rows: list[Any] = ()) -> dict[str, Any]:
        """:meth:`_capture`; on one process a capture that fails is an incident not captured (a warning the first
        time, then a line; the live state put back), never the end of the run (an adapter's host trains on). Under
        DDP every rank is in the replay's collectives: it is raised, as a training step's error is."""
        try:
            return self._capture(fit, info, rows)
        except Exception as err:
            if fit.dist.enabled:
                raise
            where = user_location(err)
            text = (str(err).strip().splitlines() or [""])[0][:200]
            why = f"its replay failed ({type(err).__name__}: {text}{f', at {where}' if where else ''})"
            self._not_captured(fit, info, sorted(info.get("ranks") or []), why)
            return {}

    def _capture(self, fit: RunState, info: dict[str, Any], rows: list[Any] = ()) -> dict[str, Any]:
        """Replay to just before ``info["step"]``, write its bundle, diagnose it, record the ``incident`` event.

        Every rank calls it. Returns what it found, for the boundary and the ``on_incident`` callbacks:
        ``pinned`` (the step whose update broke the parameters, when the replay pinned one), ``ranks``,
        ``path``, ``replayed_steps``, ``diagnosis`` or ``diagnosis_error`` ({} when nothing was captured); and, for a
        live remedy's search, ``bundle`` and ``diagnosis_record``: the first bundle and its whole diagnosis as this
        process holds them (what bundle.pt and diagnosis.json record; None where it holds no whole bundle or diagnosis).
        ``rows``: the interval's per-step rows (a host's skipped steps are not replayed).
        """
        src, found = self.source, {}
        if not src.capturing(fit):
            return found
        step, after_update = info["step"], info["after_update"]
        ranks = sorted(info.get("ranks") or [])
        start = self._start(fit)
        why = src.why_not(step, None if start is None else start[1]) or (None if start is not None else
               "no good state to replay from (no verified checkpoint yet; was the state non-finite from the start?)")
        if why is not None:
            self._not_captured(fit, info, ranks, why)
            return found
        t0 = time.perf_counter()
        avoid = unordinary(fit, rows)  # before the replay loads an older state (the guard's included)
        with state_kept(src.live_state, src.load_live_state), self._replaying():
            spike = info.get("anomaly") == "spike"  # its diagnosis also replays the step before it: keep that state
            start, pinned = self._replay(fit, step, start, info, rows, spike)
            if fit.guard is not None and fit.guard.on_device:  # the rule's window just before the step (a spike's too), as
                # the replay left it (the boundary's holds the interval's later losses, and has let go of older ones)
                info = {**info, "spike_window": fit.guard.window_before(step, rows), "rarity": fit.guard.rarity.before()}
            if pinned is None and info.get("locate") is not None and after_update:
                pinned = {"step": step}  # no earlier update broke them: the checked step's own did
            if pinned is not None:
                step, after_update = pinned["step"], True
                found.update(pinned, pinned=step, after_update=True)
                if step < info["locate"][1]:  # the check's own row has its event already
                    fit.event(step, "nonfinite", f"parameters became non-finite in the update of step {step} (its "
                              f"loss and grad norm were finite; the check at step {info['locate'][1]} found them, "
                              "the capture's replay pinned the step)", after_update=True, pinned_by_replay=True,
                              **{k: v for k, v in pinned.items() if k != "step"})
            record = src.record(fit, step, context=MAX_CONTEXT if spike else 0, avoid=avoid,
                                seen=rows[-1].step if rows else None)
            if fit.dist.enabled and not ranks and not after_update:
                blamed = src.blame(fit, spike)  # every rank's loss was finite: whose own gradients (or loss) were bad?
                if blamed is not None:
                    ranks = found["ranks"] = blamed
            seen = ranks or [0]
            # every rank's window: a spike's, and a step several ranks saw go bad (each one's samples named, not the first's)
            whole = (spike or len(seen) > 1) and fit.dist.enabled and bool(getattr(src, "global_spikes", False))
            # Rank 0 names the folder (the first free step_N[.k]) and every rank gets its name in the same gather (a
            # rank on another node may see another listing of a shared filesystem); nobody writes it before the gather.
            name = incident_dir(src.run_dir, step) if src.run_dir is not None and fit.dist.rank == 0 else None
            gathered = fit.dist.gather_objects((record if whole or fit.dist.rank in seen else None, name and str(name)))
            records = [r for r, _ in gathered]
            if whole and fit.dist.rank == 0:
                records, seen = [global_record(records)], [0]
            folder = (Path(gathered[0][1]) if gathered[0][1] is not None else incident_dir(src.run_dir, step)
                      ) if src.run_dir is not None else None
            before = src.strategy.bundle_state(src.bundle_state, folder / BUNDLE_DCP_DIR if folder else None)
        replay_s = time.perf_counter() - t0
        if fit.run is None or before is None:
            return found
        fields: dict[str, Any] = {"path": str(folder), "after_update": after_update,
                                  "replayed_steps": self.replayed_steps, "replay_s": round(replay_s, 4)}
        if fit.dist.enabled:
            fields["ranks"] = ranks
        info = {**info, **found, "step": step, "after_update": after_update, "ranks": ranks}
        bundles = self._write_bundles(fit, folder, info, [records[r] for r in seen], before, rows, start, spike)
        if spike:
            fields["anomaly"] = "spike"
        label = f"{info.get('label') or ('spike' if spike else 'incident')} at step {step}{info.get('step_note', '')}"
        in_memory = None if is_dcp_entry(bundles[0].get("model")) else bundles[0]  # FSDP: read whole from its shards
        diagnosis = None
        if src.diagnose:
            event_fields, diagnosis = self._diagnose(fit, folder, bundles[0], in_memory, step, seen[0], label)
            if diagnosis is not None and fit.dist.enabled and "ranks" in bundles[0]["window"]:
                ranks = fields["ranks"] = sorted(set(sample_ranks(bundles[0]["window"], diagnosis).values()) or ranks)
            fields.update(event_fields)
        if spike:  # (applied: a spike soon after may be its aftershock)
            self._note_spike(step, diagnosis, applied=fit.cfg.guard.on_spike == "warn" and any(
                r.step == step and r.values.get("applied", 1.0) >= 0.5 for r in rows))
        if "diagnosis" not in fields:  # every incident reaches the console in one line
            why_not = (f"its diagnosis failed: {fields['diagnosis_error']}" if fields.get("diagnosis_error")
                       else "not diagnosed: the diagnosis is off; stabletrain diagnose replays it")
            console.say(f"{label} captured into {folder} ({why_not})")
        found.update(fields)
        seen_note = f" (seen on rank(s) {ranks})" if fit.dist.enabled and ranks else ""
        what = f"the loss spike at step {step}" if spike else f"step {step}"
        fit.event(step, "incident", f"captured {what}{seen_note} into {folder}", **fields)
        found.update(zip(IN_MEMORY, (in_memory, diagnosis)))  # not the event's: held in memory for a remedy
        return found

    def _write_bundles(self, fit: RunState, folder: Path, info: dict[str, Any], records: list[dict[str, Any]],
                       before: dict[str, Any], rows: list[Any], start: tuple[dict[str, Any], int], spike: bool
                       ) -> list[dict[str, Any]]:
        """Write a bundle per rank that saw the incident (``records``, in the order of ``info["ranks"]`` or rank 0's
        alone): the first into ``folder`` with the model and optimizer, each later one into ``rank_R`` naming it."""
        src, step = self.source, info["step"]
        seen = info["ranks"] or [0]
        bundles = []
        for n, (r, record) in enumerate(zip(seen, records)):
            bundle = src.bundle(fit, step, record, before, info)
            # The interval's steps before it, as the run saw them (a divergence's growth within it; the records hold means)
            keep = ("live_nonfinite", "spike_window", "rarity")  # (and the rule's window: what a remedy's replay judges by)
            bundle["observed"].update(recent=[[row.step, row.values["loss"], row.values["grad_norm"]] for row in rows
                                              if row.step < step], **{k: info[k] for k in keep if info.get(k)})
            if spike:  # what the spike's counterfactual replays need: the rule's window, the older state, the run's steps
                spike_parts(self, fit, bundle, step, start, info, first=n == 0)
                lrs = src.stretch_lrs(start[1], step)  # (a host's one-step LR burst: named, not only "the weights moved")
                if lrs:
                    bundle["observed"]["stretch_lrs"] = lrs
            flagged = unordinary(fit, rows)  # the flagged steps right before it: a burst, a level shift (replay_rule)
            run = next((k for k in range(step) if step - 1 - k not in flagged), step)
            if run:
                bundle["observed"]["flagged_before"] = {"since": step - run, "steps": run}
            if n > 0:  # the model and optimizer (the same on every rank) once, in the first bundle; a later one names it
                bundle = {**{k: v for k, v in bundle.items() if k not in ("model", "optimizer")}, STATE_IN: ".."}
            write_bundle(folder if n == 0 else folder / f"rank_{r}", bundle)
            bundles.append(bundle)
        return bundles

    def _not_captured(self, fit: RunState, info: dict[str, Any], ranks: list[int], why: str) -> None:
        """Record and say why the incident at ``info["step"]`` was not captured: a warning the first time it matters
        (what to do about it), then one line each, as a captured one gets."""
        step = info["step"]
        fit.event(step, "incident", f"step {step} not captured: {why}", after_update=info["after_update"],
                  **({"ranks": ranks} if fit.dist.enabled else {}))
        what = info.get("label") or ("spike" if info.get("anomaly") == "spike" else "incident")  # (a skipped spike's too)
        if not self.warned and fit.dist.is_main:
            self.warned = True
            warnings.warn(f"the {what} at step {step} was not captured: {why}", StableTrainWarning,
                          stacklevel=console.user_stacklevel())
        elif fit.dist.is_main:
            console.say(f"{what} at step {step} (loss {info.get('loss', float('nan')):.4g}) not captured: {why}")

    def _replay(self, fit: RunState, step: int, start: tuple[dict[str, Any], int], info: dict[str, Any], rows: list[Any],
                spike: bool) -> tuple[tuple[dict[str, Any], int], dict[str, Any] | None]:
        """Load ``start`` and replay to just before ``step``; return ((state, step) the replay began from, what it
        pinned: :meth:`StepSource.replay_to`'s).

        A spike on its interval's first step has no step before it in the interval, nor an older state to weigh its
        window under: it replays from the snapshot before (:meth:`IntervalSnapshot.get_previous`), kept only if
        that replay comes back bitwise to the interval's own snapshot (no rollback or remedy in between).
        """
        src, locate = self.source, info.get("locate")
        earlier = self.snapshot.get_previous() if spike and start[1] >= step - 1 else None
        if earlier is not None and earlier[2] < start[1]:  # (after a rollback the one before may be later)
            side, rest, at = earlier
            src.load_live_state(clone_state(join_params(side, rest)))
            replayed, pinned = src.replay_to(fit, step, at, locate, rows, keep_previous=True)
            live = src.live_state()
            if equal_states({k: live[k] for k in ("model", "optimizer")}, {k: start[0][k] for k in ("model", "optimizer")}):
                self.replayed_steps = replayed
                return (clone_state(join_params(side, rest)), at), pinned
        src.load_live_state(start[0])
        self.replayed_steps, pinned = src.replay_to(fit, step, start[1], locate, rows, keep_previous=spike)
        return start, pinned

    def _diagnose(self, fit: RunState, folder: Path, bundle: dict[str, Any], in_memory: dict[str, Any] | None, step: int,
                  rank: int, label: str) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """Diagnose the first bundle on this process, with the run's RNG streams kept: (the event's fields, the whole
        diagnosis or None). ``in_memory``: the bundle whole (None: read from ``folder``)."""
        # The diagnosis (and the task it replays: FSDP builds a model) seeds and draws: the run's own streams must not notice.
        with kept_rng():
            try:
                task, context, extra = self.source.diagnosis(bundle)
                with self._replaying(), context:  # the run's own history in memory: its newest rows may not be on disk yet
                    diagnosis = diagnose_incident(folder, task, device=str(fit.device), bundle=in_memory,
                                                  history=launch_history(folder, list(fit.history)))
                on_rank = f" (rank {rank})" if fit.dist.enabled else ""
                if fit.dist.enabled and "ranks" in bundle["window"]:  # the step's whole batch: each named sample's rank
                    where = sample_ranks(bundle["window"], diagnosis)
                    on_rank = (" (every rank's batch: " + "; ".join(
                        f"rank {r}: {', '.join(str(i) for i, at in where.items() if at == r)}" for r in sorted(set(
                            where.values()))) + ")") if where else " (every rank's batch)"
                key, said = repeat_key(diagnosis), str(diagnosis.get("summary"))  # (a failure met again: said short)
                said = repeat_summary(diagnosis, self.told[key]) if key in self.told else said
                self.told.setdefault(key, step) if key is not None else None
                console.say(f"{label}{on_rank}: " + console.brief(said, more=f"(all of it: stabletrain diagnose {folder})"))
                return {"diagnosis": {**{k: diagnosis.get(k) for k in DIAGNOSIS_FIELDS},
                                      **{k: diagnosis.get(k) for k in extra}}}, diagnosis
            except Exception as err:  # a diagnosis that fails must not take the run down with it
                text = str(err).strip()
                return {"diagnosis_error": f"{type(err).__name__}: {text.splitlines()[0] if text else ''}"}, None
