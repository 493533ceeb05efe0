"""The checkpoint keeper: periodic saves from healthy states, LAST_GOOD, resume and rollback.

Storage (atomic write, verification, LAST_GOOD, pruning) is :class:`~stabletrain.checkpoint.CheckpointManager`;
this callback decides when and from what state. Under DDP rank 0 picks the checkpoint to load and
writes; every rank sends it its RNG state and data position.

Saves run off the critical path (:meth:`CheckpointManager.save_async`): training waits only for the
finiteness check and the staging copy; writing, verification, LAST_GOOD and pruning finish in a
background thread. At most one save is in flight. What needs LAST_GOOD (a rollback, an incident
replay from it, the run's last checkpoint, the end of the fit) waits for it first. A save's outcome
(``checkpoint``, or ``checkpoint_failed`` when the background write failed) is handed to the loop by
:meth:`CheckpointKeeper.finished` once it is known, so rank 0's main thread records the event.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint import LoadedCheckpoint, PendingSave
from ..config import RESUME_SAFE_KEYS, config_hash, config_to_dict, diff_configs, resume_refusal_message
from . import Callback, FitState

__all__ = ["CheckpointKeeper", "schedule_change_note"]


def schedule_change_note(cfg: Any, old_max_steps: int, step: int) -> str:
    """Say how a new ``train.max_steps`` on resume reshapes the cosine schedule, with the LR at ``step`` both ways.

    The schedule follows the new horizon (the decay stretches or shrinks from here on); the note gives
    the numbers so the change is never silent.
    """
    import torch

    from ..schedule import lr_factor

    s, lr = cfg.sched, cfg.optim.lr
    n = torch.tensor(float(step))  # applied steps ~ steps (a skipped step holds the LR)
    before = float(lr_factor(n, s.warmup_steps, old_max_steps, s.decay, s.min_lr_ratio)) * lr
    after = float(lr_factor(n, s.warmup_steps, cfg.train.max_steps, s.decay, s.min_lr_ratio)) * lr
    return (f"train.max_steps changed from {old_max_steps} to {cfg.train.max_steps} on resume: the {s.decay} schedule "
            f"now decays over {cfg.train.max_steps} steps; the LR at step {step} is {after:.3g} "
            f"(it was {before:.3g} on the old horizon)")


class CheckpointKeeper(Callback):
    """Checkpoint at step 0, every ``ckpt.every`` steps, at the end and on a signal; never from a bad state.

    Saves are written in the background (see the module docstring); :meth:`finished` hands over their outcomes.
    """

    def __init__(self) -> None:
        self.resumed_from: Path | None = None
        self.problems: list[str] = []
        self.schedule_change: str | None = None  # set on a resume that changed train.max_steps
        self._pending: PendingSave | None = None  # rank 0: the save started and not yet reported

    # -- resume ---------------------------------------------------------------------------------

    def resume(self, state: FitState, run_dir: Path) -> None:
        """Restore LAST_GOOD (or the newest checkpoint that verifies) into ``state``; refuse a changed config.

        Raises ValueError naming every differing key (only ``RESUME_SAFE_KEYS`` may change) or the
        world sizes when they differ.
        """
        if not (run_dir / "checkpoints").is_dir():
            raise FileNotFoundError(f"resume {str(run_dir)!r}: no checkpoints/ there; is it a stabletrain run directory?")
        ckpt = state.ckpt
        chosen: list[LoadedCheckpoint] = []

        def choose() -> str:
            chosen.append(ckpt.load(on_problem=self.problems.append))
            return str(chosen[0].path)

        path = state.dist.on_main(choose)
        loaded = chosen[0] if chosen else ckpt.load(path)
        diffs = diff_configs(loaded.meta.get("config", {}), config_to_dict(state.cfg), RESUME_SAFE_KEYS)
        if diffs:
            raise ValueError(resume_refusal_message(run_dir, diffs))
        saved_world = int(loaded.meta.get("world_size", 1))
        if saved_world != state.dist.world:
            raise ValueError(f"resume {str(run_dir)!r}: {loaded.path.name} was written by {saved_world} process(es) and this "
                             f"run has {state.dist.world}; a checkpoint resumes only under the world size that wrote it "
                             f"(each rank's RNG stream and data shard, and the global batch train.batch_size x "
                             f"accum.steps x world size, depend on it): resume with dist.nproc={saved_world} "
                             f"(or torchrun --nproc_per_node={saved_world})")
        state.load_state_dict(loaded.state)
        self.resumed_from = loaded.path
        old = int(loaded.meta.get("config", {}).get("train", {}).get("max_steps", state.cfg.train.max_steps))
        if old != state.cfg.train.max_steps and state.cfg.sched.decay != "constant":
            self.schedule_change = schedule_change_note(state.cfg, old, state.step)

    # -- acting ---------------------------------------------------------------------------------

    def needs_first(self, state: FitState) -> bool:
        """Whether there is no verified checkpoint yet (the loop then saves step 0, so rollback and resume
        always have a state to return to). The same answer on every rank."""
        ckpt = state.ckpt

        def none_yet() -> bool:
            self._join()
            return ckpt.latest_good() is None

        return ckpt is not None and bool(state.dist.on_main(none_yet))

    def save(self, state: FitState, healthy: bool, *, wait: bool = False) -> list[dict[str, Any]]:
        """Start a checkpoint from a healthy state (never from inside an incident); return the outcomes to record.

        Blocks for the previous save in flight (at most one), then for the finiteness check and the
        staging copy; the write runs in the background (``wait=True``: waits for it too, as the run's
        last checkpoint does). Every rank must call this (DDP: one all_gather_object of RNG states and
        data positions); only rank 0 writes. Returns the ``{"step", "kind", "reason", "fields"}`` of
        each save whose outcome is now known: the previous one, and this one when it was withheld or
        waited for; the others come from :meth:`finished`. Nothing without a run directory.
        """
        ckpt = state.ckpt
        if ckpt is None:
            return []
        if not healthy:
            done = self.finished(wait=True)  # LAST_GOOD may be about to move; say where it really is
            good = ckpt.latest_good()
            return done + [{"step": state.step, "kind": "checkpoint_withheld", "fields": {},
                            "reason": f"checkpoint at step {state.step} withheld: inside an incident; LAST_GOOD stays "
                                      f"at {good.name if good else 'none'}"}]
        whole = state.state_dict()
        meta = {"config": config_to_dict(state.cfg), "config_hash": config_hash(state.cfg)}
        if state.dist.enabled:
            whole["ranks"] = state.dist.gather_objects({"rng": whole["rng"], "stream": whole["stream"]})
            whole["world_size"] = meta["world_size"] = state.dist.world
        if state.run is None:  # only rank 0 writes
            return []
        done = self.finished(wait=True)
        try:
            self._pending = ckpt.save_async(whole, state.step, meta)
        except Exception as err:  # the check or the staging copy failed; the previous checkpoint is intact
            return done + [_failed(state.step, err)]
        return done + self.finished(wait=wait)

    def finished(self, *, wait: bool = False) -> list[dict[str, Any]]:
        """Return the outcome of the save in flight once it is known (``[]`` while it runs, or with none).

        ``wait``: wait for it. Each outcome is returned once; the loop records it (rank 0) and fires
        ``on_checkpoint``. A background write that failed is a ``checkpoint_failed`` outcome.
        """
        pending = self._pending
        if pending is None or not (wait or pending.done()):
            return []
        self._pending = None
        try:
            result = pending.result()
        except Exception as err:  # the previous checkpoint and LAST_GOOD are intact; say so and keep training
            return [_failed(pending.step, err)]
        return [{"step": result.step, "kind": result.kind, "reason": result.reason, "fields": result.event_fields()}]

    def _join(self) -> None:
        """Wait for the save in flight without taking its outcome (:meth:`finished` still reports it)."""
        if self._pending is not None:
            self._pending.join()

    def load_last_good(self, state: FitState) -> LoadedCheckpoint | None:
        """Load LAST_GOOD on every rank (rank 0 picks it, after the save in flight), or return None when there is none."""
        ckpt = state.ckpt
        chosen: list[LoadedCheckpoint] = []

        def choose() -> str | None:
            self._join()  # a save in flight may be about to move LAST_GOOD
            if ckpt is None or ckpt.latest_good() is None:
                return None
            chosen.append(ckpt.load())
            return str(chosen[0].path)

        path = state.dist.on_main(choose)
        if path is None or ckpt is None:
            return None
        return chosen[0] if chosen else ckpt.load(path)

    def rollback(self, state: FitState, bad_steps: list[int], reason: str, restore_counters: Any) -> dict[str, Any] | None:
        """Restore LAST_GOOD and never train on the data windows of ``bad_steps`` again; return the rollback info.

        ``restore_counters(loaded_state)`` puts back the run-wide counters a rollback must not undo
        (incidents, rollbacks, spikes). Returns None (and sets ``state.stop_reason``) when there is no
        checkpoint to go back to.
        """
        windows = {state.positions[s] for s in bad_steps if s in state.positions}
        loaded = self.load_last_good(state)
        if loaded is None:
            state.stop_reason = f"{reason}; no checkpoint to roll back to"
            return None
        from_step = state.step
        skip = state.stream.skip | windows
        with restore_counters():
            state.load_state_dict(loaded.state)
        state.stream.skip = skip
        return {"from_step": from_step, "to_step": state.step, "path": str(loaded.path), "skipped_windows": sorted(windows),
                "reason": f"{reason}: rolled back from step {from_step} to {loaded.path.name}; skipping data windows "
                          f"{sorted(windows)}"}

    def state_dict(self) -> dict[str, Any]:
        return {}


def _failed(step: int, err: BaseException) -> dict[str, Any]:
    return {"step": step, "kind": "checkpoint_failed", "fields": {"error": type(err).__name__},
            "reason": f"checkpoint at step {step} failed: {err}"}
