"""What a fit changes in the whole process while it runs, and puts back when it returns or raises.

Torch's deterministic algorithms are :func:`stabletrain.seeding.deterministic_mode` (``deterministic``);
the garbage collector's frozen generation is :func:`gc_frozen` (``train.gc_freeze``). What Linux says of a
process (its state, parent, start time) is :func:`stat_fields`; its children, :func:`children`; its start,
:func:`process_start_time`; its death with its parent's, :func:`die_with_parent`.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = ["gc_frozen", "stat_fields", "parent_pid", "children", "die_with_parent", "arm_death_signal", "process_start_time"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


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


def arm_death_signal() -> bool:
    """Have the kernel SIGKILL this process when the thread that started it exits (Linux ``PR_SET_PDEATHSIG``); return
    whether it is armed (elsewhere than Linux: False)."""
    if not sys.platform.startswith("linux"):
        return False
    return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0


def die_with_parent(parent: int | None = None, grandparent: int | None = None) -> bool:
    """Have the kernel SIGKILL this process when its parent exits (Linux ``PR_SET_PDEATHSIG``); return whether armed.

    A launcher killed with SIGKILL cannot take its children along, and torchrun starts each rank in a session of its
    own, out of reach of a process-group kill: armed in each, the launcher's death takes torchrun, and torchrun's its
    ranks, at once (checkpoints are atomic: a resume continues from the last). A parent that exited before the call
    would never signal: ``parent`` (the pid it had) or ``grandparent`` (its parent's pid) no longer matching, or a
    parent of pid 1, then kills this process right away. Elsewhere than Linux: nothing (False).
    """
    if not arm_death_signal():
        return False
    now = os.getppid()  # read after arming: a parent that exits from here on signals
    if now == 1 or (parent is not None and now != parent) or (grandparent is not None and parent_pid(now) != grandparent):
        os.kill(os.getpid(), signal.SIGKILL)  # orphaned already: go as the parent's death would have made us
    return True


def process_start_time(pid: int | None = None) -> float | None:
    """When process ``pid`` (default: this one) started, in seconds since the epoch (Linux ``/proc``); else None."""
    fields = stat_fields(pid or os.getpid())
    try:  # its start in clock ticks after boot, against the boot clock now (/proc/stat's btime is whole seconds)
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (TypeError, ValueError, AttributeError, OSError):
        return None


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
