"""DCP's process-based asynchronous save, as the sharded checkpoints use it (imported on first use: DCP stays lazy).

``torch.distributed.checkpoint.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``
writes each rank's shards from a checkpoint process of that rank (started by the first save, one per
training process, with a gloo group of its own among the ranks' checkpoint processes), fed the staged
shards through shared memory (``StagingOptions(use_shared_memory=True)``): no pickling or writing under
training's GIL. Its planner caches the save plan (``enable_plan_caching``): from the second save on,
the ranks exchange no plans while the shards' layout stays the same.

:class:`WatchedSavePlanner` is that planner, plus one duty: unpickled in DCP's checkpoint process (it
travels with every save request) it makes that process exit when its parent, the rank, is gone. DCP's
own process leaves only at the rank's normal exit or on a closed pipe, which a rank killed outright
leaves open until a save in flight (and its collectives with the other ranks' checkpoint processes) ends.
It also quiets that process's INFO lines from then on (three per save per rank), and the traceback DCP's loop prints
when the rank it reads from is gone (``EOFError``: what the console showed of a killed rank besides its one line,
:class:`OrphanQuiet`); the rank ends the process when its process group is torn down
(:mod:`stabletrain.distributed.group`), before a closed pipe would.

DCP starts its process with multiprocessing's ``spawn``, which imports the rank's main module again: a script
that trains with sharded checkpoints must keep its training under ``if __name__ == "__main__":`` (``python -m
stabletrain`` and torchrun's own entry points do).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from .writer import exit_with_parent

__all__ = ["WatchedSavePlanner", "PROCESS", "planner", "OrphanQuiet"]

PROCESS = AsyncCheckpointerType.PROCESS
_watching: list[int] = []  # the parent this process watches, once it does


class WatchedSavePlanner(DefaultSavePlanner):
    """DCP's default save planner with plan caching; in DCP's checkpoint process it watches that process's parent."""

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if state.get("_rank_pid") not in (None, os.getpid()) and not _watching:  # unpickled in the checkpoint process
            _watching.append(state["_rank_pid"])
            exit_with_parent(state["_rank_pid"])
            logging.getLogger().addFilter(_quiet_info)
            sys.stderr = OrphanQuiet(sys.stderr, state["_rank_pid"])


def _quiet_info(record: logging.LogRecord) -> bool:
    """DCP's checkpoint process logs each request it waits for, receives and completes at INFO on the rank's console
    (it gives its root logger a handler of its own): keep its warnings and errors only, from its first request on."""
    return record.levelno >= logging.WARNING or not record.pathname.endswith("_async_process_executor.py")


class OrphanQuiet:
    """The checkpoint process's stderr: as it is, but silent from a crash report (multiprocessing's "Process ..." header
    and its traceback) that comes once ``parent``, the rank, is gone (reparented within ``wait_s``): DCP's loop reading
    the pipe of a rank that was killed raises EOFError, a traceback on the run's console beside the one line that says
    which rank died. A crash while the rank lives is printed."""

    wait_s = 0.5

    def __init__(self, real: Any, parent: int) -> None:
        self.real, self.parent, self.quiet = real, parent, False

    def write(self, text: str) -> int:
        if not self.quiet and text.startswith("Process ") and self._orphaned():
            self.quiet = True
        return len(text) if self.quiet else self.real.write(text)

    def _orphaned(self) -> bool:
        deadline = time.monotonic() + self.wait_s  # (the dying rank's pipe closes just before this process is reparented)
        while os.getppid() == self.parent and time.monotonic() < deadline:
            time.sleep(0.01)
        return os.getppid() != self.parent

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def planner() -> WatchedSavePlanner:
    """A planner for one save: plan caching on, and the pid of this process (the rank) for the checkpoint process."""
    made = WatchedSavePlanner(enable_plan_caching=True)
    made._rank_pid = os.getpid()
    return made
