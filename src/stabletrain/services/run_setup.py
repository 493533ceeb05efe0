"""Opening the run directory: one launch at a time, the resume, ``config.yaml``, ``snapshot.json``, the goodput ledger."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .. import console
from ..callbacks.goodput_clock import LEDGER_FILE, GoodputClock, launch_record
from ..distributed.launch import default_run_dir, note_run_dir
from ..records.checkpoint.manager import CheckpointManager
from ..records.launches import refuse_if_running, this_process
from ..records.provenance import build_snapshot, launch_snapshot, optimizer_names, threads_changed
from ..records.rundir import RunDir

__all__ = ["open_run", "default_run_dir", "DEFAULT_RUN_DIR"]

#: ``Trainer(run_dir=DEFAULT_RUN_DIR)``: ``runs/<Task.name>-<timestamp>`` (what ``stabletrain train`` uses).
DEFAULT_RUN_DIR = "<default run dir>"


def open_run(state: Any, keeper: Any, recorder: Any, run_dir: Path, resume: bool) -> None:
    """Open ``run_dir`` for the run whose :class:`~stabletrain.runstate.RunState` is ``state`` (every rank calls it;
    rank 0 writes); ``keeper`` and ``recorder``: its checkpoint and incident services.

    Refuses a run directory an earlier launch still runs on; restores the checkpoint to resume from
    (the keeper: :meth:`~stabletrain.services.checkpoints.CheckpointKeeper.resume`); writes the resolved
    config, and the snapshot of a new run or the resume's events and lines; records this launch's processes;
    adds the :class:`~stabletrain.callbacks.goodput_clock.GoodputClock` that writes this launch's goodput ledger.
    """
    dist, cfg = state.dist, state.cfg
    launch = dist.gather_objects(this_process())  # recorded in the run dir while this launch runs
    dist.on_main(lambda: refuse_if_running(run_dir, exclude=launch))  # never two launches on one run
    state.ckpt = CheckpointManager(run_dir / "checkpoints", keep=cfg.ckpt.keep)
    state.run_dir = run_dir
    if resume:
        keeper.resume(run_dir)
        recorder.resume(run_dir)  # what the launches before knew of the run's spikes and intervals

    def write() -> None:
        run = state.run = RunDir(run_dir, resume=resume, overwrite=cfg.run.overwrite)
        note_run_dir(run_dir)  # for a launcher that restarts the run: where to record a death it does not restart
        run.write_config(cfg)
        if resume:  # snapshot.json keeps the run's first launch; each resume's own (it may differ) is added to its list
            keeper.announce_resume()
            if (changed := threads_changed(run_dir, state.device, dist.world)) is not None:
                console.warn(changed)
            run.append_to_snapshot("resumes", {"step": state.step, **launch_snapshot(state.device, state.precision, cfg.task),
                                               "world_size": dist.world})
            return
        task = state.task
        extra: dict[str, Any] = {"task_info": task.info, "task_name": task.name, "count_unit": task.count_unit,
                                 **optimizer_names(state.optimizer),
                                 **({"world_size": dist.world} if dist.enabled else {})}
        run.write_snapshot(build_snapshot(cfg, state.device, state.precision, task.data_fingerprint, extra))

    dist.on_main(write)
    if state.run is not None:
        state.run.record_launch(launch)
    state.callbacks.append(GoodputClock(run_dir / LEDGER_FILE, launch_record(run_dir if state.run is not None else None)))
    recorder.plan_snapshot()  # capture.memory_snapshot=auto: decided once, here (a broadcast)
