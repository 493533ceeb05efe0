"""Which processes run on a run directory (its ``launch.json``), so a second launch on it is refused."""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..process import stat_fields

__all__ = ["last_launch", "unfinished_note", "LAUNCH_FILE", "is_running", "refuse_if_running", "running_launch", "this_process",
           "started_over", "PARENT_ENV", "as_parent", "launch_parent", "LEDGER_FILE", "reached_training",
           "noted_run_dir", "stop_note", "note_stop", "asked_stop", "stopped_outside_line", "final_note", "note_final",
           "final_exit", "drop_notes"]

#: The run's goodput ledger (written by :mod:`stabletrain.callbacks.goodput_clock`): a ``launch`` line per launch.
LEDGER_FILE = "goodput.jsonl"

#: when the run opens, removed when it closes. What a SIGKILL leaves behind names processes that are gone.
LAUNCH_FILE = "launch.json"
#: The process that restarts the run's (stabletrain's supervisor, or the launcher of torchrun's agent), as
#: :func:`this_process` records it, in its children's environment (:func:`as_parent`): recorded in :data:`LAUNCH_FILE`
#: with them and kept there when they end by an error, so that while it waits to restart them the directory is in use.
PARENT_ENV = "STABLETRAIN_RUN_PARENT"


def last_launch(run_dir: Path) -> dict[str, Any]:
    """The run's last launch as ``snapshot.json`` records it: its newest ``resumes`` entry, else the first launch's own
    fields ({}: no snapshot, or not readable)."""
    try:
        snapshot = json.loads((Path(run_dir) / "snapshot.json").read_text(encoding="utf-8"))
        last = (snapshot.get("resumes") or [snapshot])[-1]
    except (OSError, ValueError, AttributeError, LookupError, TypeError):  # (resumes a dict: a KeyError)
        return {}
    return last if isinstance(last, dict) else {}


def as_parent() -> dict[str, str]:
    """The environment that makes this process the run's parent (:data:`PARENT_ENV`) for the processes it starts."""
    return {PARENT_ENV: json.dumps(this_process())}


def reached_training(run_dir: Path | None, since: float) -> bool:
    """Whether a launch that started at ``since`` or later got through its start-up: its ``launch`` line is in the
    ledger (:data:`LEDGER_FILE`, written when its fit began), ready at or after ``since``."""
    from .jsonl import read_jsonl

    rows = read_jsonl(run_dir / LEDGER_FILE)[0] if run_dir is not None else []
    return any(r.get("kind") == "launch" and float(r.get("ready") or 0) >= since for r in rows)


def noted_run_dir(note: Path | None) -> Path | None:
    """The run directory a rank wrote into the launcher's ``note`` file (``distributed.launch.note_run_dir``; None before
    it did, or when it is gone)."""
    try:
        noted = note.read_text(encoding="utf-8").strip() if note is not None else ""
    except OSError:
        return None
    return Path(noted) if noted and Path(noted).is_dir() else None


def launch_parent() -> list[dict[str, Any]]:
    """This process's launcher that restarts it (:data:`PARENT_ENV`): ``[its record]``, or ``[]``."""
    try:
        proc = json.loads(os.environ.get(PARENT_ENV) or "null")
    except ValueError:
        return []
    return [proc] if isinstance(proc, dict) and isinstance(proc.get("pid"), int) else []


def this_process() -> dict[str, Any]:
    """This process as :data:`LAUNCH_FILE` records it: host, pid and start time (which tells a reused pid apart)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (Linux ``/proc``); None where unknown, gone or a zombie."""
    fields = stat_fields(pid)
    return int(fields[19]) if fields is not None and fields[0] != "Z" else None


def is_running(proc: dict[str, Any]) -> bool:
    """Whether a process :func:`this_process` recorded still runs (on another host: False, it cannot be seen).

    The same pid must hold the same process (its start time); without ``/proc`` (not Linux) the pid alone tells.
    """
    if proc.get("host") != socket.gethostname() or not isinstance(proc.get("pid"), int):
        return False
    if Path("/proc/self/stat").exists():
        start = _start_time(proc["pid"])
        return start is not None and proc.get("start") in (None, start)
    try:
        os.kill(proc["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_launch(run_dir: str | Path, exclude: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The processes :data:`LAUNCH_FILE` in ``run_dir`` records that still run, but those in ``exclude`` (this launch's)."""
    try:
        recorded = json.loads((Path(run_dir) / LAUNCH_FILE).read_text(encoding="utf-8"))["processes"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    mine = {(p["host"], p["pid"]) for p in [*exclude, *launch_parent()]}  # (this launch's own launcher too)
    return [p for p in recorded if isinstance(p, dict) and (p.get("host"), p.get("pid")) not in mine and is_running(p)]


def refuse_if_running(run_dir: str | Path, exclude: Sequence[dict[str, Any]] = ()) -> None:
    """Raise ValueError while processes of an earlier launch still run on ``run_dir`` (two would write one run)."""
    running = running_launch(run_dir, exclude)
    if running:
        pids = " ".join(str(p["pid"]) for p in running)
        raise ValueError(f"run directory {str(run_dir)!r} is in use: {len(running)} process(es) of an earlier launch "
                         f"still run on it (pid {pids} on {running[0]['host']}); stop them (kill {pids}) or wait for "
                         "them to end, then start again")


def unfinished_note(run_dir: str | Path) -> str:
    """What a run that logged short of its last step and recorded no stop or crash is: still running (its launch's
    processes live), gone without a word (killed: they no longer run), or unknown (no launch record)."""
    if not (Path(run_dir) / LAUNCH_FILE).exists():
        return "still running, or stopped early"
    if running_launch(run_dir):
        return "still running"
    return (f"its processes are gone with no stop or crash recorded: killed? stabletrain train --resume {run_dir} "
            "continues it")


def started_over(event: dict[str, Any]) -> bool:
    """Whether a ``restart`` event (its fields, ``step`` with them) started the run again from step 0: its
    ``started_over``, or, in a run directory written before that field, no checkpoint at step 0."""
    return bool(event.get("started_over")) or ("started_over" not in event and event.get("checkpoint") is None
                                                and event.get("step") == 0)


def stop_note(note: Path) -> Path:
    """Where a launcher writes the signal it passed on to its ranks (beside its run-dir note, ``note``): their agent
    tells a rank that died of it in its start-up (before it takes signals) from a death, and restarts none."""
    return note.with_name(note.name + ".stop")


def note_stop(note: Path, signum: int) -> None:
    """Add ``signum`` to :func:`stop_note` (a full /tmp: the stop still goes on, unwritten)."""
    with contextlib.suppress(OSError), stop_note(note).open("a") as fh:
        fh.write(f"{signum}\n")


def final_note(note: Path) -> Path:
    """Where a process of the run writes, as it exits, the exit code stabletrain decided (beside its launcher's run-dir
    note, ``note``): its pid and the code (:func:`note_final`). A reserved code (2: input refused, 3: a restart refused,
    4, 5) not written there is the task's own (a library's ``sys.exit(3)``): a crash the launchers restart."""
    return note.with_name(note.name + ".final")


def note_final(note: str | None, code: int) -> None:
    """Record in :func:`final_note` that this process exits with ``code``, returned by stabletrain's command (``python -m
    stabletrain``: not a ``sys.exit`` or ``os._exit`` of the task's). Nothing without a launcher's note; never raises."""
    if note:
        with contextlib.suppress(OSError), final_note(Path(note)).open("a", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()} {code}\n")


def final_exit(note: Path | str | None, pid: int | None, code: int) -> bool:
    """Whether the process ``pid``, which exited with ``code``, recorded that exit as stabletrain's own
    decision (:func:`note_final`); 0 always is (it finished, or checkpointed and stopped on a signal)."""
    if code == 0:
        return True
    try:
        return note is not None and f"{pid} {code}" in final_note(Path(note)).read_text(encoding="utf-8").splitlines()
    except OSError:
        return False


def drop_notes(note: Path) -> None:
    """Remove a launcher's run-dir note and the notes beside it (:func:`stop_note`, :func:`final_note`, the ranks' last
    lines: ``distributed.last_line``) as its run ends."""
    for path in (note, stop_note(note), final_note(note), *note.parent.glob(f"{note.name}.line-*")):
        path.unlink(missing_ok=True)


def asked_stop(note: Path | None) -> set[int]:
    """The signals :func:`stop_note` holds (empty: no stop asked for)."""
    try:
        return {int(x) for x in stop_note(note).read_text().split()} if note is not None else set()
    except (OSError, ValueError):
        return set()


def stopped_outside_line(signum: int, ranks: bool) -> str:
    """The line for a stop asked for that killed the run's processes outside their training loop (their start-up or
    end, where no handler of theirs takes it): a stop, not a death, and not restarted (both launchers say it)."""
    import signal

    who = "the ranks' training loop (their start-up or end), where they" if ranks else ("the run's training loop (its "
                                                                                       "start-up or its end), where it")
    return f"stopped by {signal.Signals(signum).name} outside {who} cannot take a stop: not restarted"
