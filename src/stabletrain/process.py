"""What a fit changes in the whole process while it runs, and puts back when it returns or raises.

Torch's deterministic algorithms are :func:`stabletrain.seeding.deterministic_mode` (``deterministic``);
the garbage collector's frozen generation is :func:`gc_frozen` (``train.gc_freeze``). What Linux says of a
process (its state, parent, start time) is :func:`stat_fields`; its children, :func:`children`.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator
from pathlib import Path

__all__ = ["gc_frozen", "stat_fields", "parent_pid", "children"]


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (0: state, 1: parent pid, 19: start time in clock ticks
    after boot); None where there is no such process or no ``/proc``."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid`` (``/proc``), or None."""
    fields = stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (``/proc``; empty where there is none)."""
    procs = Path("/proc").glob("[0-9]*") if Path("/proc").is_dir() else []
    return [int(e.name) for e in procs if parent_pid(int(e.name)) == pid]


@contextlib.contextmanager
def gc_frozen(enabled: bool = True) -> Iterator[None]:
    """Keep the objects alive at the start out of the garbage collector's full scans while the block runs.

    A full (generation 2) collection walks every tracked object, and torch's imports alone leave hundreds
    of thousands of them: it stalls the step at a moment no one chooses, and under DDP every rank then
    waits for the stalled one at the next collective. :func:`gc.freeze` moves the objects that exist now to
    a generation the collector does not scan; objects made during the block are collected as usual. At the
    end they are unfrozen again, unless something had frozen objects before (the caller's freeze then stays
    as it was, with these added). ``enabled=False``: nothing is changed.
    """
    if not enabled:
        yield
        return
    already = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not already:
            gc.unfreeze()
