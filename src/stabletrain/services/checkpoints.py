"""The checkpoint keeper: periodic saves from healthy states, LAST_GOOD, resume and rollback.

Storage (atomic write, verification, LAST_GOOD, pruning) is :class:`~stabletrain.records.checkpoint.CheckpointManager`;
this callback decides when and from what state. Under DDP rank 0 picks the checkpoint to load and writes; every rank
sends it its RNG state and data position.

Saves run off the critical path (:meth:`CheckpointManager.save_async`): training waits only for the staging copy into
shared memory; the writer process checks the copy's finiteness, writes, verifies, moves LAST_GOOD and prunes. At most
one save is in flight. Until a writer runs, the first save (when small: :data:`INLINE_FIRST_BYTES`) and a save the loop
waits for anyway are written in the loop's thread. What needs LAST_GOOD (a rollback, an incident replay from it, the
run's last checkpoint, the end of the fit) waits for it first. A save's outcome (``checkpoint``, ``checkpoint_withheld``
from a non-finite copy, or ``checkpoint_failed`` when the write failed or the writer died) is handed to the loop by
:meth:`CheckpointKeeper.finished` once it is known, so rank 0's main thread records the event, with what the save cost
training (blocked, the writer's wall and CPU, the steps' time while it was written against before it).

The checkpoint's format is the strategy's (:meth:`~stabletrain.distributed.strategy.Strategy.save_checkpoint`): one
whole state, or under FSDP with ``dist.checkpoint=sharded`` every rank's own shards through DCP beside rank 0's rest (a
non-finite shard on any rank withholds the checkpoint on every rank); the keeper writes what it makes. A resume under
another world size is resharded (the event says so, with both world sizes and global batches).
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path
from typing import Any

from .. import console
from ..config import (
    RESHARD_SAFE_KEYS,
    RESUME_SAFE_KEYS,
    ConfigError,
    config_hash,
    config_to_dict,
    diff_configs,
    move_old_keys,
    resume_refusal_message,
)
from ..distributed.launch import resume_command
from ..policies.optim import optimizer_change
from ..records.checkpoint.files import CheckpointError
from ..records.checkpoint.manager import SKIPS_RUN, LoadedCheckpoint
from ..records.checkpoint.saves import PendingSave, SaveCosts
from ..records.checkpoint.writer import WriterDied, running_writer, writer
from ..records.jsonl import read_jsonl
from ..records.provenance import other_task
from ..records.staging import state_bytes
from ..runstate import RunState

__all__ = ["CheckpointKeeper", "schedule_change_note", "resume_diffs", "INLINE_FIRST_BYTES"]

#: While no writer process runs, a run's first save of at most this many bytes of tensors is written in the loop's
#: thread (a few ms to ~0.2 s), as is a save the loop waits for anyway (the run's last): a run that never saves in
#: the background (a short one, ckpt.every beyond its end) starts no process (~1.3 CPU-seconds: a fresh
#: interpreter importing torch), and its last save does not wait for one to start. A run with a periodic save
#: ahead starts its writer right after that first save, so the process starts beside the steps instead of
#: holding up the next saves (bench/goodput.py: a launch's checkpoint stalls 2.2 s -> 0.7 s); a save of this size
#: that comes before the writer's imports are done is written here too (it was handed over and the next save waited
#: ~2 s for the writer to start: its checkpoint not durable meanwhile, a restart going back further).
INLINE_FIRST_BYTES = 64 << 20


def schedule_change_note(cfg: Any, old_max_steps: int, step: int, lr: float | None = None) -> str:
    """Say how a new ``train.max_steps`` on resume reshapes the cosine schedule, with the LR at ``step`` both ways.

    The schedule follows the new horizon (the decay stretches or shrinks from here on); the note gives the numbers so the
    change is never silent. ``lr``: the peak LR the run's schedule holds (its first group's: a task's own optimizer sets
    it, not ``optim.lr``); ``optim.lr`` when not given.
    """
    import torch

    from ..policies.schedule import lr_factor

    s, lr = cfg.sched, cfg.optim.lr if lr is None else lr
    n = torch.tensor(float(step))  # applied steps ~ steps (a skipped step holds the LR)
    before = float(lr_factor(n, s.warmup_steps, old_max_steps, s.decay, s.min_lr_ratio)) * lr
    after = float(lr_factor(n, s.warmup_steps, cfg.train.max_steps, s.decay, s.min_lr_ratio)) * lr
    now = (f"the LR at step {step} is {after:.3g} (it was {before:.3g} on the old horizon)" if f"{after:.3g}" != f"{before:.3g}"
           else f"the LR at step {step} is {after:.3g} on both horizons")  # (it read "5e-05 (it was 5e-05 ...)")
    return (f"train.max_steps changed from {old_max_steps} to {cfg.train.max_steps} on resume: the {s.decay} schedule "
            f"now decays over {cfg.train.max_steps} steps; {now}")


def resume_diffs(saved_cfg: dict[str, Any], cfg: Any, trained: str | None, resolved: str, resharded: bool = False) -> list[Any]:
    """The changes between a checkpoint's config ``saved_cfg`` and ``cfg`` that a resume refuses (``resharded``: into another
    world size, which may change more). precision=auto and the mode it resolved to are one precision (auto -> fp32 on a
    CPU): the mode the run trained in (``trained``: its checkpoint's) against the one this launch resolves (``resolved``)."""
    diffs = diff_configs(saved_cfg, config_to_dict(cfg), RESUME_SAFE_KEYS + (RESHARD_SAFE_KEYS if resharded else ()))
    return [d for d in diffs if d.key != "precision" or "auto" not in (d.saved, d.current) or trained != resolved]


class CheckpointKeeper:
    """Checkpoint at step 0, every ``ckpt.every`` steps, at the end and on a signal; never from a bad state.

    A service the loop calls by name. Saves are written in the background (see the module docstring);
    :meth:`finished` hands over their outcomes, :meth:`count_outcome` counts the failed ones. ``state``: the
    run's :class:`~stabletrain.runstate.RunState` (what it saves, restores and reads its counters from).
    """

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.resumed_from: Path | None = None
        self.problems: list[str] = []
        self.schedule_change: str | None = None  # set on a resume that changed train.max_steps
        self.reshard: dict[str, Any] | None = None  # set on a resume under another world size (the event's fields)
        self.reshard_note: str | None = None
        self._pending: PendingSave | None = None  # rank 0: the save started and not yet reported
        self.failures_in_a_row = 0  # rank 0: saves that failed since the last one written
        self._last_failure: dict[str, Any] | None = None
        self._costs = SaveCosts()  # each save's wall cost to the steps while it is written (its event's fields)
        self._marking = False  # from the first save on, each boundary marks its step (the saves' costs)
        self._saved = False  # a save was made: the next is not the first
        # (every rank alike) a save came (written or withheld): the next is not the first; one withheld as non-finite, said
        self._asked, self._said_withheld = False, not state.dist.is_main  # (rank 0 says it)
        self.dropped_by_rollbacks: set[int] = set()  # samples a rollback's data diagnosis named: never trained on again

    # -- resume ---------------------------------------------------------------------------------

    def resume(self, run_dir: Path) -> None:
        """Restore LAST_GOOD (or the newest checkpoint that verifies) into ``state``; refuse a changed config.

        Raises ValueError naming every differing key: only ``RESUME_SAFE_KEYS`` may change, and
        ``RESHARD_SAFE_KEYS`` too when the world size differs from the checkpoint's. A resume under
        another world size is resharded (see :meth:`Trainer.load_state_dict`): :attr:`reshard` then
        holds the old and new world size and global batch, and :attr:`reshard_note` says so in a line.
        """
        state = self.state
        if not (run_dir / "checkpoints").is_dir():
            raise FileNotFoundError(f"resume {str(run_dir)!r}: no checkpoints/ there; is it a stabletrain run directory?")
        ckpt = state.ckpt
        chosen: list[LoadedCheckpoint] = []

        def choose() -> str:
            chosen.append(ckpt.load(on_problem=self.problems.append))
            return str(chosen[0].path)

        path = state.dist.on_main(choose)
        loaded = chosen[0] if chosen else ckpt.load(path, verified=True)  # rank 0 verified it: memory-mapped here
        saved_cfg = copy.deepcopy(loaded.meta.get("config", {}))
        move_old_keys(saved_cfg, "the checkpoint's config")  # a run from before a key moved: compared at its new place
        saved_world = int(loaded.meta.get("world_size", 1))
        resharded = saved_world != state.dist.world
        trained = (loaded.state.get("precision") or {}).get("mode") if isinstance(loaded.state, dict) else None
        diffs = resume_diffs(saved_cfg, state.cfg, trained, state.precision, resharded)
        if diffs:  # (a ConfigError: every rank reads the same checkpoint, rank 0 says it)
            raise ConfigError(resume_refusal_message(run_dir, diffs))
        changed = optimizer_change(loaded.state.get("optimizer"), state.optimizer)  # a task's own: no config key says it
        if changed is not None:
            raise ValueError(f"resume {str(run_dir)!r}: the task's optimizer is not the one the run trained with: {changed}; "
                             "the checkpoint would put its own back: resume with the optimizer it was trained with, or "
                             "start a new run")
        try:
            self.state.load_state_dict(loaded.state)
        except RuntimeError as err:  # the model does not fit: a Task handed to the Trainer as an object, not its config's?
            why = other_task(run_dir, state.task, state.cfg.task)
            if why is None:
                raise
            raise ValueError(f"resume {str(run_dir)!r}: {why}; resume with that task: Trainer(cfg, task=..., "
                             "run_dir=..., resume=True)") from err
        self._keep_rollbacks(run_dir)
        self.resumed_from = loaded.path
        if resharded:
            self.reshard, self.reshard_note = _reshard_info(saved_cfg, saved_world, state)
        old = int(saved_cfg.get("train", {}).get("max_steps", state.cfg.train.max_steps))
        if old != state.cfg.train.max_steps and state.cfg.sched.decay != "constant":
            self.schedule_change = schedule_change_note(state.cfg, old, state.step, state.schedule.base_lrs[0])

    def _keep_rollbacks(self, run_dir: Path) -> None:
        """What the run's rollbacks decided outlives a checkpoint written before them: the data windows they skipped
        stay skipped, the samples they dropped dropped, and they count toward ``guard.max_rollbacks`` (a restart from
        LAST_GOOD would train into the same spike again, and roll back without limit). Rank 0 reads ``events.jsonl``;
        every rank applies it."""
        state = self.state

        def read() -> tuple[list[list[int]], list[int], int]:
            rollbacks = [e for e in read_jsonl(run_dir / "events.jsonl")[0] if e.get("kind") == "rollback"]
            return ([w for e in rollbacks for w in e.get("skipped_windows") or []],
                    [i for e in rollbacks for i in e.get("dropped_samples") or []], len(rollbacks))

        windows, samples, count = state.dist.on_main(read)
        state.stream.skip |= {(int(epoch), int(start)) for epoch, start in windows}
        if samples:  # (on every rank: each weighs every rank's share of a window, stabletrain.data)
            self.dropped_by_rollbacks |= {int(i) for i in samples}
            state.stream.drop |= self.dropped_by_rollbacks
        if state.guard is not None:
            state.guard.num_rollbacks = max(state.guard.num_rollbacks, count)

    def announce_resume(self) -> None:
        """Say where the run resumed from (rank 0, run directory open): the events and the console lines.

        Each checkpoint skipped on the way is a ``checkpoint_skipped`` event and a warning; the ``resume``
        event and line say the checkpoint, the world size and how many saved steps will be trained again;
        metrics lines after the resumed step are superseded; a reshard and a changed schedule are said too.
        """
        state = self.state
        run, ckpt, step = state.run, state.ckpt, state.step
        for problem in self.problems:
            run.event(step, "checkpoint_skipped", problem)
            console.warn(f"resume skipped a checkpoint in {ckpt.root}: {problem}")
        line = f"resumed from step {step} (checkpoint {self.resumed_from}, world size {state.dist.world})"
        # (the one LAST_GOOD names too: a deleted newest checkpoint's steps are trained again as a corrupted one's)
        newest = max([*(int(d.name.removeprefix("step_")) for d in ckpt.checkpoints()), ckpt.named_step() or 0, step])
        if self.problems and newest > step:
            line += f"; the newest checkpoint (step {newest}) was skipped: {newest - step} step(s) will be trained again"
        console.say(line)
        (dropped, aside), note = run.supersede_after(step, state.cfg.remedy.apply), self.reshard_note
        run.event(step, "resume", f"resumed from {self.resumed_from} at step {step}" + (f"; {note}" if note else "")
                  + (f"; {dropped} metrics line(s) after it superseded" if dropped else "")
                  + (f"; the incidents after it set aside: {', '.join(aside)}" if aside else ""), path=str(self.resumed_from),
                  superseded_metrics=dropped, auto=state.cfg.run.resume == "auto", superseded_incidents=aside,
                  **(self.reshard or {}))
        if note:
            console.say(note)
        if self.schedule_change is not None:
            run.event(step, "schedule_changed", self.schedule_change, max_steps=state.cfg.train.max_steps)
            console.warn(self.schedule_change)

    # -- acting ---------------------------------------------------------------------------------

    def needs_first(self) -> bool:
        """Whether there is no verified checkpoint yet (the loop then saves step 0, so rollback and resume
        always have a state to return to). The same answer on every rank."""
        state = self.state
        ckpt = state.ckpt

        def none_yet() -> bool:
            self._join()
            return ckpt.latest_good() is None

        return ckpt is not None and bool(state.dist.on_main(none_yet))

    def save(self, healthy: bool, *, wait: bool = False) -> list[dict[str, Any]]:
        """Start a checkpoint from a healthy state (never from inside an incident); return the outcomes to record.

        Blocks for the previous save in flight (at most one), then for the staging copy; the check and
        the write run in the writer process (``wait=True``: waits for it too, as the run's
        last checkpoint does). Every rank must call this (DDP: one all_gather_object of RNG states and
        data positions); only rank 0 writes. Returns the ``{"step", "kind", "reason", "fields"}`` of
        each save whose outcome is now known: the previous one, and this one when it was withheld or
        waited for; the others come from :meth:`finished`. Nothing without a run directory. The time spent
        here is the save's ``blocked_s`` (and left out of the step times its cost is measured with).
        """
        state = self.state
        self._marking = True
        self._costs.mark(state.step)
        with self._costs.blocked():
            return self._save(healthy, wait)

    def _save(self, healthy: bool, wait: bool) -> list[dict[str, Any]]:
        state = self.state
        ckpt = state.ckpt
        if ckpt is None:
            return []
        # The previous save first: LAST_GOOD may be about to move (say where it really is), its directory be reused.
        done = self.finished(wait=True)
        # A run of skipped steps up to a periodic save (a divergence's non-finite or spiking steps) is no state known to
        # have recovered: LAST_GOOD stays before it, so that a resume or a rollback starts from a state that trained well
        # (one skip alone, a bad sample's, leaves the state as the last applied step made it: saved). The saves a run
        # waits for are not withheld: its last (a finished run must read as finished) and a stop signal's (a preemption)
        skips = state.guard.consecutive_skips if state.guard is not None else 0
        unproven = (f"its last {skips} steps were skipped, none applied since: the run is not known to have recovered"
                    if healthy and skips >= SKIPS_RUN and not wait else None)
        # A sharded save's part that may be written before save_checkpoint returns (every rank alike), if small: one waited
        # for, or a first one with no periodic save ahead (with one, its processes start now, beside the steps)
        cfg = state.cfg
        periodic = bool(cfg.ckpt.every) and state.step + cfg.ckpt.every < cfg.train.max_steps
        inline, self._asked = INLINE_FIRST_BYTES if wait or not (self._asked or periodic) else -1, True
        save = (state.strategy.save_checkpoint(state.state_dict, ckpt, state.step, inline) if healthy and unproven is None
                else None)  # may gather
        why, fields = ((unproven or "inside an incident", {"skipped_in_a_row": skips} if unproven else {}) if save is None
                       else (save.withheld, save.fields))
        if why is not None:  # the same verdict on every rank: none writes anything
            good = ckpt.latest_good()
            return done + [{"step": state.step, "kind": "checkpoint_withheld", "fields": fields,
                            "reason": f"checkpoint at step {state.step} withheld: {why}; LAST_GOOD stays "
                                      f"at {good.name if good else 'none'}"}]
        if state.run is None:  # only rank 0 writes (a strategy's own part of it, if any, in the background)
            if wait:
                state.strategy.wait_for_checkpoint()
            return []
        whole = save.whole
        meta = {"config": config_to_dict(state.cfg), "config_hash": config_hash(state.cfg), "precision": state.precision,
                "after_skips": skips, **save.meta}  # (precision: the mode it trained in, which config's auto resolved to;
        # after_skips: the skipped steps in a row it was saved after: pruning keeps the newest saved after none)
        first, self._saved = not self._saved, True
        running = running_writer()
        if save.inline_ok and not (running is not None and running.ready) and (
                wait or ((first or running is not None) and state_bytes(whole) <= INLINE_FIRST_BYTES)):
            try:  # no writer serving yet: a save waited for anyway, or a small first one (or one before the writer's
                # imports are done: it would wait for them), is written here
                result = ckpt.save(whole, state.step, meta, shards=save.shards)
            except Exception as err:  # the previous checkpoint is intact
                return done + [_failed(state.step, err)]
            if not wait and running is None and periodic:
                with contextlib.suppress(WriterDied):  # a periodic save follows: its writer starts beside the steps
                    writer()  # (not blocking; a writer that cannot start is the next save's failure to report)
            return done + [{"step": result.step, "kind": result.kind, "reason": result.reason,
                            "fields": result.event_fields()}]
        try:
            self._pending = ckpt.save_async(whole, state.step, meta, shards=save.shards)
        except Exception as err:  # the staging copy or the hand-over failed; the previous checkpoint is intact
            state.strategy.wait_for_checkpoint()
            return done + [_failed(state.step, err)]
        self._costs.started(state.step)
        return done + self.finished(wait=wait)

    def finished(self, *, wait: bool = False) -> list[dict[str, Any]]:
        """Return the outcome of the save in flight once it is known (``[]`` while it runs, or with none).

        ``wait``: wait for it (and for this rank's own part of it, the strategy's). Each outcome is returned once; the loop
        records it (rank 0) and fires ``on_checkpoint``. A background write that failed is a
        ``checkpoint_failed`` outcome. A written one's fields add what it cost the steps it was written
        beside (:class:`~stabletrain.records.checkpoint.saves.SaveCosts`), and ``waited_s`` when the loop
        waited here for it.
        """
        now = self.state.step if self._marking else None
        if now is not None:
            self._costs.mark(now)
        if wait:
            self.state.strategy.wait_for_checkpoint()
        pending = self._pending
        if pending is None or not (wait or pending.done()):
            return []
        self._pending = None
        with self._costs.blocked() as waited:
            try:
                result = pending.result()
            except Exception as err:  # the previous checkpoint and LAST_GOOD are intact; say so and keep training
                return [_failed(pending.step, err)]
        fields = result.event_fields()
        if not result.withheld:
            fields.update(self._costs.fields(result.step, result.step if now is None else now))
            if waited.seconds >= 1e-4:
                fields["waited_s"] = round(waited.seconds, 4)
        return [{"step": result.step, "kind": result.kind, "reason": result.reason, "fields": fields}]

    def _join(self) -> None:
        """Wait for the save in flight without taking its outcome (:meth:`finished` still reports it)."""
        self.state.strategy.wait_for_checkpoint()
        if self._pending is not None:
            self._pending.join()

    def load_last_good(self) -> LoadedCheckpoint | None:
        """Load LAST_GOOD on every rank (rank 0 picks it, after the save in flight), or return None when there is none."""
        state = self.state
        ckpt = state.ckpt
        chosen: list[LoadedCheckpoint] = []
        self.state.strategy.wait_for_checkpoint()  # every rank: no save of its own may run beside the load's collectives

        def choose() -> str | None:
            self._join()  # a save in flight may be about to move LAST_GOOD
            if ckpt is None or ckpt.latest_good() is None:
                return None
            chosen.append(ckpt.load())
            return str(chosen[0].path)

        path = state.dist.on_main(choose)
        if path is None or ckpt is None:
            return None
        return chosen[0] if chosen else ckpt.load(path, verified=True)  # rank 0 verified it: memory-mapped here

    def rollback(self, decision: Any, restore_counters: Any, found: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Restore LAST_GOOD and never train on the bad steps' data windows again; record the ``rollback`` event.

        ``decision``: the guard's (its bad steps, and its spikes under ``guard.on_spike=rollback``).
        ``restore_counters(loaded_state)`` puts back the run-wide counters a rollback must not undo
        (incidents, rollbacks, spikes). ``found``: the incident's capture; when its diagnosis is ``data`` with the
        samples named (a spike's verified by their removal), those samples are never trained on again either (they
        come back every epoch, in other windows: the data stream's drop, on every rank, see :mod:`stabletrain.data`).
        Returns
        the rollback info, or None (and sets ``state.stop_reason``)
        when there is no checkpoint to go back to.
        """
        state = self.state
        # (a spike's remedy that fell back on a rollback too: its window again would spike again, the same RNG and data)
        spikes = decision.spike_steps if state.cfg.guard.on_spike in ("rollback", "remedy") else []
        bad_steps, reason = sorted(set(decision.bad_steps) | set(spikes)), decision.reason
        windows = {state.positions[s] for s in bad_steps if s in state.positions}
        loaded = self.load_last_good()
        if loaded is None:
            state.stop_reason = f"{reason}; no checkpoint to roll back to"
            return None
        from_step = state.step
        skip = state.stream.skip | windows
        diagnosis = (found or {}).get("diagnosis") or {}  # (rank 0's: it diagnosed the capture)
        named = [*(diagnosis.get("bad_samples") or []),  # (and the burst's later windows')
                 *(i for b in diagnosis.get("burst_samples") or [] for i in b["samples"])]
        # An op that a few of the window's samples reach (a log of one sample's 0) is theirs too: met again each epoch
        # (a trial's rollbacks ran out on it); one that most samples reach is the op's or the weights', not theirs
        of = ((found or {}).get("diagnosis_record") or {}).get("num_samples") or 0
        few = diagnosis.get("failure_class") == "op" and 0 < 2 * len(named) <= of
        samples = state.dist.on_main(lambda: sorted({int(i) for i in named} if diagnosis.get("failure_class") == "data"
                                                    or few else set()))
        self.dropped_by_rollbacks |= set(samples)
        with restore_counters():
            self.state.load_state_dict(loaded.state)
        state.stream.skip = skip  # (a remedy's drops after the checkpoint go with the remedy the load undid)
        state.stream.drop |= self.dropped_by_rollbacks
        # The rolled-back steps' lines go to metrics.superseded.jsonl (kept, as a resume keeps them): one line per step.
        dropped = state.run.drop_metrics_after(state.step, by="rollback") if state.run is not None else 0
        info = {"from_step": from_step, "to_step": state.step, "path": str(loaded.path), "skipped_windows": sorted(windows),
                "superseded_metrics": dropped, "dropped_samples": samples,
                "reason": f"{reason}: rolled back from step {from_step} to {loaded.path.name}; "
                          f"{_never_again(bad_steps, state.positions)}"
                          + (f"; nor on sample{'s' * (len(samples) > 1)} {', '.join(map(str, samples))}, which the "
                             f"diagnosis named ({'they come' if len(samples) > 1 else 'it comes'} back every epoch)"
                             if samples else "") + _not_the_data(diagnosis.get("failure_class"))}
        state.event(state.step, "rollback", info["reason"], **{k: v for k, v in info.items() if k != "reason"})
        if state.dist.is_main:  # the run changed course: said, as an incident is
            console.say(info["reason"])
        return info

    # -- failed saves ----------------------------------------------------------------------------

    def count_outcome(self, info: dict[str, Any]) -> None:
        """Count the saves that failed in a row (a written one resets the count) and print each failure."""
        state = self.state
        if info["kind"] == "checkpoint":
            self.failures_in_a_row, self._last_failure = 0, None
        elif info["kind"] == "checkpoint_failed":
            self.failures_in_a_row += 1
            self._last_failure = info
            good = state.ckpt.latest_good() if state.ckpt is not None else None
            limit = state.cfg.ckpt.max_failures
            stop = (f"; the run stops at {limit} in a row (ckpt.max_failures)" if limit
                    else "; training goes on (ckpt.max_failures=0)")
            said = "LAST_GOOD" in info["reason"] or "no checkpoint was written" in info["reason"]
            where = "" if said else f"; LAST_GOOD stays at {good.name if good else 'none'}"
            console.warn(f"{info['reason']}{where} ({self.failures_in_a_row} failed in a row{stop})")
        elif info["kind"] == "checkpoint_withheld" and "(NaN/Inf)" in info["reason"] and not self._said_withheld:
            self._said_withheld = True  # (a state left non-finite: withheld was in events.jsonl only, a new user's trial)
            console.warn(f"{info['reason']} (said once: each withheld save is in events.jsonl)")

    def check_failures(self) -> None:
        """Raise CheckpointError on every rank once ``ckpt.max_failures`` saves in a row have failed (0: never).

        Rank 0 knows the outcomes; one broadcast tells the others (every rank calls this at the same point).
        The error says where LAST_GOOD is (intact: a failed save never touches it) and how to resume.
        """
        state = self.state
        limit = state.cfg.ckpt.max_failures
        if state.ckpt is None or not limit:
            return
        ckpt = state.ckpt

        def verdict() -> None:
            if self.failures_in_a_row < limit:
                return
            good = ckpt.latest_good()
            last = self._last_failure or {"step": "?", "reason": "?"}
            where = (f"LAST_GOOD is {good.name}, intact: free space on the disk of {ckpt.root} (or fix it), then resume "
                     f"with: {resume_command(ckpt.root.parent)}" if good else "no checkpoint was ever written")
            raise CheckpointError(f"{self.failures_in_a_row} checkpoint saves in a row failed (ckpt.max_failures="
                                  f"{limit}), the run stops here; the last: {last['reason']}. {where}", ckpt.root)

        state.dist.on_main(verdict)


def _reshard_info(saved_cfg: dict[str, Any], saved_world: int, state: RunState) -> tuple[dict[str, Any], str]:
    """Return (the resume event's fields, a one-line note) for a resume under another world size."""
    train, accum = saved_cfg.get("train", {}), saved_cfg.get("accum", {})
    b_old = int(train.get("batch_size", state.cfg.train.batch_size))
    k_old = int(accum.get("steps", state.cfg.accum.steps))
    b_new, k_new, world = state.cfg.train.batch_size, state.cfg.accum.steps, state.dist.world
    stream = state.stream
    fields = {"resharded": True, "old_world_size": saved_world, "new_world_size": world,
              "old_global_batch": b_old * k_old * saved_world, "new_global_batch": b_new * k_new * world,
              "epoch": stream.epoch, "sample_offset": stream.sample_offset(), "bitwise_expected": False}
    note = (f"resharded from {saved_world} to {world} process(es): global batch {b_old}x{k_old}x{saved_world} = "
            f"{fields['old_global_batch']} -> {b_new}x{k_new}x{world} = {fields['new_global_batch']} samples per step; "
            f"the data continues from sample {fields['sample_offset']} of epoch {stream.epoch}; bitwise equality "
            "with the uninterrupted run is not expected (the reductions add in another order)")
    return fields, note


def _failed(step: int, err: BaseException) -> dict[str, Any]:
    return {"step": step, "kind": "checkpoint_failed", "fields": {"error": type(err).__name__},
            "reason": f"checkpoint at step {step} failed: {err}"}


def _not_the_data(failure_class: Any) -> str:
    """The rollback line's warning when the diagnosis blames the model or optimizer state, not the skipped data."""
    if failure_class not in ("state", "divergence", "optimizer-state"):
        return ""
    return (f"; the diagnosis names the {failure_class}, not this data: going back without changing the LR, the clip or "
            "Adam's epsilon may meet it again (guard.on_spike/on_nonfinite=remedy tries those, verified by replay)")


def _never_again(steps: list[int], positions: dict[int, tuple[int, int]]) -> str:
    """"never training on the data of step 65 again (data windows [(0, 64)]: (epoch, the number of the window's first
    micro-batch in that epoch))" for a rollback's line: a window is named by its epoch and the number of its first
    micro-batch there, not a sample."""
    known = [s for s in steps if s in positions]
    if not known:
        return "no data window to skip (the bad steps' windows are not known)"
    which = f"step {known[0]}" if len(known) == 1 else f"steps {', '.join(map(str, known))}"
    windows = sorted({positions[s] for s in known})
    return (f"never training on the data of {which} again (data windows {windows}: (epoch, the number of the window's first "
            "micro-batch in that epoch))")
