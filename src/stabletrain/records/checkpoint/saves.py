"""What a checkpoint save returns: :class:`SaveResult`, and :class:`PendingSave` for one running in a thread."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SaveResult", "PendingSave"]


@dataclass(frozen=True)
class SaveResult:
    """What :meth:`CheckpointManager.save` did; ``kind``, ``reason`` and ``event_fields()`` make its event."""

    step: int
    path: Path | None  # the checkpoint directory; None when withheld
    withheld: bool
    reason: str  # one line: what was written, or why nothing was
    num_bytes: int = 0  # size of state.pt (and of the DCP shards)
    # check_s, [stage_s,] write_s, verify_s, prune_s; a sharded save adds shard_check_s, shard_stage_s, shard_write_s
    timings: dict[str, float] = field(default_factory=dict)
    pruned: tuple[Path, ...] = ()
    # CPU seconds the write, verification, LAST_GOOD and pruning took in their own thread (save_async: the
    # background thread's work, which competes with training for the cores); not part of ``timings``' sum
    write_cpu_s: float = 0.0

    @property
    def kind(self) -> str:
        return "checkpoint_withheld" if self.withheld else "checkpoint"

    def event_fields(self) -> dict[str, Any]:
        if self.withheld:
            return {}
        return {"path": str(self.path), "size_mib": round(self.num_bytes / 2**20, 3),
                "seconds": round(sum(self.timings.values()), 4), "blocked_s": round(self.blocked_s, 4),
                "write_cpu_s": round(self.write_cpu_s, 4),
                "pruned": [p.name for p in self.pruned]}

    @property
    def blocked_s(self) -> float:
        """How long the caller waited: the checks and the staging copies (``save_async``), or everything (``save``)."""
        if "stage_s" in self.timings:
            return sum(self.timings.get(k, 0.0) for k in ("check_s", "stage_s", "shard_check_s", "shard_stage_s"))
        return sum(self.timings.values())


#: How much lower (in nice steps) the background checkpoint writer runs than training, where the OS allows it.
WRITER_NICENESS = 10


def _lower_priority() -> None:
    """Raise this thread's nice value by :data:`WRITER_NICENESS` (Linux: per thread); nothing where it cannot."""
    if not sys.platform.startswith("linux"):  # elsewhere the id is not a thread's and the call would hit the process
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + WRITER_NICENESS))
    except OSError:  # refused (a sandbox): the thread runs as any other
        pass


class PendingSave:
    """A save started by :meth:`CheckpointManager.save_async`: ask :meth:`done`, or wait with :meth:`result`."""

    def __init__(self, step: int, result: SaveResult | None = None) -> None:
        self.step = step
        self._result = result
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def start(self, write: Callable[[], SaveResult]) -> None:
        """Run ``write`` in a non-daemon thread (a normal interpreter exit finishes it); keep its result or error.

        The thread yields to training: on Linux it runs at a nice value :data:`WRITER_NICENESS` above the
        process's (``setpriority`` on its own thread id), so where the cores are busy the scheduler gives the
        step's threads the CPU first and the write takes the rest; elsewhere it runs as any thread.
        """

        def run() -> None:
            _lower_priority()
            try:
                self._result = write()
            except BaseException as err:  # noqa: BLE001  (handed to whoever asks for the result)
                self._error = err

        self._thread = threading.Thread(target=run, name=f"stabletrain-checkpoint-{self.step}", daemon=False)
        self._thread.start()

    def done(self) -> bool:
        """Whether the save has finished (written and installed, withheld, or failed). Never blocks."""
        return self._thread is None or not self._thread.is_alive()

    def join(self) -> None:
        """Wait for the save to finish; raise nothing."""
        if self._thread is not None:
            self._thread.join()

    def result(self) -> SaveResult:
        """Wait for the save; return its :class:`SaveResult` or raise what it raised (e.g. CheckpointError)."""
        self.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
