"""Where a launch's wall time goes: ``RUN_DIR/goodput.jsonl``, one line per log interval, written by rank 0.

The ledger :mod:`stabletrain.report.goodput` reads to say what share of a run's wall time, over every
launch (restarts included), went into steps that were kept. Each line is a JSON object with ``kind``:

==========  ==========================================================================================
launch      the fit starts: ``start`` (the launch's first process started, seconds since the epoch),
            ``ready`` (now: imports, process group, task, restore and compile's set-up are behind),
            ``step`` (resumed from), ``run_id`` (torchrun's), ``world_size``
interval    a log interval ended: ``t``, ``step``, ``steps`` in it, ``wall_s`` since the last line,
            ``eval_s`` (validation), ``checkpoint_s`` (the loop blocked by saves, or waiting for one), ``incident_s`` (capture
            and diagnosis), ``skipped`` (steps whose update was skipped); the built-in loop's first, ``startup_s`` (the
            fit's set-up before its first step: the step-0 signal report and the step-0 save)
rollback    the guard went back: ``from``, ``to``
end         the fit ended (normally, by a stop or a crash): ``t``, ``step``, ``max_steps`` (the train.max_steps it ran
            to), ``wall_s`` since the last line and the ``checkpoint_s``, ``incident_s`` (and, before a first interval,
            ``startup_s``) in it (a process killed outright writes none)
==========  ==========================================================================================

The interval's steps took ``wall_s - eval_s - checkpoint_s - incident_s - startup_s``. A live remedy's search (and the
rollback it makes) counts as the incident's; the host work of a boundary as steps. One line per interval,
flushed, not fsynced (as metrics.jsonl).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..distributed.launch import LAUNCH_START_ENV, RESTART_ENV
from ..process import process_start_time
from ..records.jsonl import JsonlWriter, read_jsonl
from ..records.launches import LEDGER_FILE  # (the ledger's file in the run directory; the launchers read it too)
from . import Callback, RunState

__all__ = ["GoodputClock", "LEDGER_FILE", "launch_record"]

_launches_here = 0  # launches this process recorded: only its first started with the process


def launch_record(run_dir: Path | None = None) -> dict[str, Any]:
    """This launch as the ledger records it: when it started (seconds since the epoch) and torchrun's run id.

    The start is the outermost stabletrain process's (:data:`~stabletrain.distributed.launch.LAUNCH_START_ENV`,
    imports and all) for a launch a command started; a restarted process's own start otherwise (the wait before
    it is the restart's). ``run_dir``: where to look for an earlier launch, whose start a stale variable would be.
    A second Trainer in the same process starts now (after its task was built): the process's start, the first
    fit and whatever ran between are not its start-up.
    """
    global _launches_here
    _launches_here += 1
    if _launches_here > 1:  # a later Trainer of this process (a resume after a first fit): from its own set-up on
        return {"start": round(time.time(), 3), "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}
    start = process_start_time()
    given = os.environ.get(LAUNCH_START_ENV)
    if given and RESTART_ENV not in os.environ and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        earlier = [r for r in read_jsonl(run_dir / LEDGER_FILE)[0] if r.get("kind") == "launch"] if run_dir else []
        if not earlier or float(given) > float(earlier[-1].get("ready") or 0):
            start = float(given)
    return {"start": round(start, 3) if start else None, "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}


class GoodputClock(Callback):
    """Write the goodput ledger (module docstring) of this launch: ``launch`` holds its ``start`` and ``run_id``.

    A no-op on the ranks without a run directory (only rank 0 writes). No host-device sync: it reads the
    interval's record and the checkpoint outcomes the loop already has.
    """

    def __init__(self, path: str | Path, launch: dict[str, Any]) -> None:
        self.path, self.launch = Path(path), dict(launch)
        self._file: JsonlWriter | None = None
        self._t = 0.0
        self._step = 0
        self._checkpoint_s = self._incident_s = 0.0
        self._incident_at: float | None = None  # when the last on_incident came, until the next boundary
        self._remedy_mark = 0.0  # the remedy applier's seconds already booked
        self._first = False  # the launch's first interval not logged yet (its set-up before the first step: startup_s)
        self._launch_save: int | None = None  # the step of the launch's own save (step 0's), in that set-up

    def _write(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write({"kind": kind, **{k: round(v, 4) if isinstance(v, float) else v for k, v in fields.items()}})

    def on_fit_start(self, state: RunState) -> None:
        if state.run is None:
            return
        self._file = JsonlWriter(self.path)
        self._t, self._step = time.time(), state.step
        self._checkpoint_s = self._incident_s = 0.0
        self._first, self._launch_save = True, state.step
        self._remedy_mark = float(getattr(state.remedies, "seconds", 0.0) or 0.0)
        start = self.launch.get("start")
        self._write("launch", start=start if start is not None else self._t, ready=self._t, step=state.step,
                    run_id=self.launch.get("run_id"), world_size=state.dist.world)

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        if self._file is None:
            return
        now = time.time()
        steps = state.step - self._step
        wall = now - self._t
        # the loop's interval time: validation, captures and remedy searches left out (a save's blocked time kept in)
        stepping = float(record.get("step_time_s") or 0.0) * steps
        self._incident_s += self._remedy_seconds(state)  # a live remedy's search, unless a rollback booked it already
        checkpoint, incident = self._within(wall)
        setup = self._setup(state, wall - stepping - incident)
        self._first = False
        self._write("interval", t=now, step=state.step, steps=steps, wall_s=wall,
                    eval_s=max(0.0, wall - stepping - incident - setup), checkpoint_s=checkpoint, incident_s=incident,
                    skipped=int(record.get("num_skipped") or 0), **({"startup_s": setup} if setup else {}))
        self._t, self._step = now, state.step
        self._checkpoint_s = self._incident_s = 0.0
        self._incident_at = None

    def _setup(self, state: RunState, room: float) -> float:
        """The built-in loop's set-up from fit start to its first step (the step-0 report and save), booked to start-up
        on the launch's first line (0 after it, and for an adapter: its first interval starts before on_fit_start);
        ``room``: the line's seconds not otherwise booked."""
        if not self._first or state.steps_from is None:
            return 0.0
        return min(max(0.0, state.steps_from - self._t), max(0.0, room))

    def _within(self, wall: float) -> tuple[float, float]:
        """(checkpoint, incident) seconds of a line whose wall time is ``wall``, together within it: a save's blocked
        time is counted when its outcome is known (the next boundary, or the run's end: the line after the one it
        blocked in), and a save waited for inside a rollback is in both (the incident's is what the save's leaves)."""
        checkpoint = min(self._checkpoint_s, wall)
        return checkpoint, min(self._incident_s, max(0.0, wall - checkpoint))

    def _remedy_seconds(self, state: RunState) -> float:
        """Seconds the run's remedy applier spent since the last call (``guard.on_*=remedy``; 0 without one)."""
        total = float(getattr(state.remedies, "seconds", 0.0) or 0.0)
        spent, self._remedy_mark = max(0.0, total - self._remedy_mark), total
        return spent

    def on_incident(self, state: RunState, info: dict[str, Any]) -> None:
        self._incident_at = time.time()
        self._incident_s += max(0.0, self._incident_at - self._t)  # the capture and diagnosis ran since on_log

    def on_checkpoint(self, state: RunState, info: dict[str, Any]) -> None:
        fields = info.get("fields") or {}  # the save itself, and a wait for the one before it
        blocked = float(fields.get("blocked_s") or 0.0)
        if self._launch_save is not None and info.get("step") == self._launch_save:  # (its blocked time: startup_s's)
            self._launch_save, blocked = None, 0.0
        self._checkpoint_s += blocked + float(fields.get("waited_s") or 0.0)  # (a wait for it: a stall where it fell)

    def on_rollback(self, state: RunState, info: dict[str, Any]) -> None:
        now = time.time()
        if self._incident_at is not None:  # the rollback follows the incident at once: its remedy search, its load
            self._incident_s += max(0.0, now - self._incident_at)
            self._incident_at = None
            self._remedy_seconds(state)  # (that search is in it)
        self._write("rollback", t=now, **{"from": info.get("from_step"), "to": info.get("to_step")})
        self._step = state.step

    def on_fit_end(self, state: RunState, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        now = time.time()
        self._incident_s += self._remedy_seconds(state)
        checkpoint, incident = self._within(now - self._t)
        setup = self._setup(state, now - self._t - checkpoint - incident)  # (a fit that ended before its first interval)
        self._write("end", t=now, step=state.step, max_steps=state.cfg.train.max_steps, wall_s=now - self._t,
                    checkpoint_s=checkpoint, incident_s=incident, **({"startup_s": setup} if setup else {}))
        self._file.close()
        self._file = None
