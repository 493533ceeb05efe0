"""What a checkpoint save returns: :class:`SaveResult`, and :class:`PendingSave` for one the writer process runs.

And :class:`SaveCosts`: what each save cost training in wall time, measured where the keeper runs; :func:`run_now`,
a save made at once as a finished future (a sharded one's, read as ``dcp.async_save``'s).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["SaveResult", "PendingSave", "SaveCosts", "run_now", "is_save_failure"]


def is_save_failure(err: BaseException) -> bool:
    """Whether ``err`` is a save that failed, to report as one (DCP's ``CheckpointException``, which every rank raises
    for one rank's failed write, is a BaseException), not an interrupt or an exit to pass on."""
    return not isinstance(err, (KeyboardInterrupt, SystemExit, GeneratorExit))


def run_now(save: Callable[[], Any]) -> Any:
    """``save()`` made now: a finished future holding its result, or the failure it raised (:func:`is_save_failure`)."""
    from concurrent.futures import Future

    future: Future = Future()
    try:
        future.set_result(save())
    except BaseException as err:
        if not is_save_failure(err):
            raise
        future.set_exception(err)
    return future


@dataclass(frozen=True)
class SaveResult:
    """What :meth:`CheckpointManager.save` did; ``kind``, ``reason`` and ``event_fields()`` make its event."""

    step: int
    path: Path | None  # the checkpoint directory; None when withheld
    withheld: bool
    reason: str  # one line: what was written, or why nothing was
    num_bytes: int = 0  # size of state.pt (and of the DCP shards)
    # [stage_s, send_s,] check_s, write_s, verify_s, prune_s (save_async: the first two in the caller's process, the
    # rest in the writer's); a sharded save adds shard_check_s, shard_stage_s, shard_write_s
    timings: dict[str, float] = field(default_factory=dict)
    pruned: tuple[Path, ...] = ()
    # CPU seconds the writer spent on this save (save_async: the writer process's, kernel time included, which
    # competes with training for the cores; save: the calling thread's); not part of ``timings``' sum
    write_cpu_s: float = 0.0
    # wall seconds from the writer taking the save to its reply (write, verify, install, prune); 0 for save()
    write_wall_s: float = 0.0

    @property
    def kind(self) -> str:
        return "checkpoint_withheld" if self.withheld else "checkpoint"

    def event_fields(self) -> dict[str, Any]:
        if self.withheld:
            return {}
        return {"path": str(self.path), "size_mib": round(self.num_bytes / 2**20, 3),
                "seconds": round(sum(self.timings.values()), 4), "blocked_s": round(self.blocked_s, 4),
                "write_s": round(self.write_wall_s, 4), "write_cpu_s": round(self.write_cpu_s, 4),
                "pruned": [p.name for p in self.pruned]}

    @property
    def blocked_s(self) -> float:
        """How long the caller waited: the staging copies and the hand-over (``save_async``), or everything (``save``)."""
        if "stage_s" in self.timings:
            return sum(self.timings.get(k, 0.0) for k in ("stage_s", "send_s", "shard_check_s", "shard_stage_s"))
        return sum(self.timings.values())


class PendingSave:
    """A save handed to the writer process (:mod:`.writer`): ask :meth:`done`, or wait with :meth:`result`.

    ``prepare`` (optional) runs first in a helper thread of this process: it waits for what the writer must
    not read before it is complete (CUDA copies, the DCP shards) and returns what the request still needs;
    otherwise the request is sent at once, and nothing in this process runs for the save until its reply is
    asked for. ``finish`` turns the writer's reply into the :class:`SaveResult` (or raises its error).
    """

    def __init__(self, step: int, result: SaveResult | None = None) -> None:
        self.step = step
        self._result = result
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._channel: Any = None
        self._rid: int | None = None
        self._finish: Callable[[dict[str, Any]], SaveResult] | None = None
        self._fail: Callable[[BaseException], BaseException] = lambda err: err

    def start(self, channel: Any, request: dict[str, Any], finish: Callable[[dict[str, Any]], SaveResult],
              prepare: Callable[[], dict[str, Any]] | None = None,
              fail: Callable[[BaseException], BaseException] = lambda err: err) -> None:
        """Send ``request`` to ``channel`` (a :class:`~.writer.Writer`) now, or after ``prepare`` in a helper thread.

        ``fail`` makes the error the save raises out of the writer's death (:class:`~.writer.WriterDied`).
        """
        self._channel, self._finish, self._fail = channel, finish, fail
        if prepare is None:
            self._rid = channel.submit(request)
            return

        def run() -> None:
            try:
                self._rid = channel.submit({**request, **prepare()})
            except BaseException as err:  # noqa: BLE001  (handed to whoever asks for the result)
                self._error = err

        self._thread = threading.Thread(target=run, name=f"stabletrain-checkpoint-{self.step}", daemon=False)
        self._thread.start()

    def done(self) -> bool:
        """Whether the save has finished (written and installed, withheld, or failed). Never blocks."""
        if self._result is not None or self._error is not None:
            return True
        if self._thread is not None and self._thread.is_alive():
            return False
        if self._error is not None or self._rid is None:
            return True
        try:
            reply = self._channel.poll(self._rid)
        except Exception as err:  # noqa: BLE001  (the writer died: the save failed)
            self._error = self._fail(err)
            return True
        if reply is not None:
            self._take(reply)
        return reply is not None

    def join(self) -> None:
        """Wait for the save to finish; raise nothing."""
        if self._thread is not None:
            self._thread.join()
        if self._result is None and self._error is None and self._rid is not None:
            try:
                reply = self._channel.wait(self._rid)
            except Exception as err:  # noqa: BLE001  (the writer died: the save failed)
                self._error = self._fail(err)
                return
            self._take(reply)

    def _take(self, reply: dict[str, Any]) -> None:
        assert self._finish is not None
        try:
            self._result = self._finish(reply)
        except Exception as err:  # noqa: BLE001
            self._error = err

    def result(self) -> SaveResult:
        """Wait for the save; return its :class:`SaveResult` or raise what it raised (e.g. CheckpointError)."""
        self.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


class SaveCosts:
    """What each background save cost training: the wall time per step while it was written against before it.

    The keeper calls :meth:`mark` at every boundary it sees (after the interval's work), and brackets the
    time it blocks the loop (the save itself, a wait for one) with :meth:`blocked`; that time is reported
    apart (``blocked_s``, ``waited_s``) and left out of the step times. A save started at step ``s`` whose
    outcome is taken at step ``e`` (the first boundary at which its writer is done) was written while steps
    ``s+1..e`` trained: :meth:`fields` compares their mean wall time per step (``step_time_s_after``) with
    the same number of steps before ``s`` (``step_time_s_before``, from the marks at hand), as ``slowdown``.
    Wall time: whatever else ran in those steps (validation, an incident's replay) counts too.
    """

    def __init__(self, history: int = 64) -> None:
        self._marks: list[tuple[int, float]] = []  # (step, training clock) at the first mark of each step
        self._history = history
        self._blocked = 0.0  # seconds spent in blocked(): not training's
        self._started: dict[int, float] = {}  # step of a save in flight -> training clock when it began

    def _clock(self) -> float:
        return time.perf_counter() - self._blocked

    def mark(self, step: int) -> None:
        """Note the time at ``step`` (only the first call per step counts)."""
        if not self._marks or self._marks[-1][0] != step:
            if self._marks and self._marks[-1][0] > step:  # a rollback or resume: earlier marks no longer precede it
                self._marks = [m for m in self._marks if m[0] < step]
            self._marks.append((step, self._clock()))
            del self._marks[:-self._history]

    def blocked(self) -> _Blocked:
        """A context manager: the time inside is the loop blocked by checkpoints, not training."""
        return _Blocked(self)

    def started(self, step: int) -> None:
        """A background save of ``step`` began (after :meth:`mark` at ``step``)."""
        self._started[step] = self._clock()

    def fields(self, step: int, now: int) -> dict[str, Any]:
        """The event fields of the save of ``step``, whose outcome is taken at step ``now``; {} when not measurable."""
        began = self._started.pop(step, None)
        n = now - step
        if began is None or n <= 0:
            return {}
        self.mark(now)
        after = (self._clock() - began) / n
        if after <= 0:  # the blocked time taken off exceeds the window (a crash's wait for the save): not measurable
            return {}
        before_marks = [m for m in self._marks if m[0] < step]
        if not before_marks:
            return {"steps_after": n, "step_time_s_after": round(after, 6)}
        older = [m for m in before_marks if m[0] <= step - n]
        first = older[-1] if older else before_marks[0]  # n steps back, or as far back as the marks go
        at = next((t for s, t in self._marks if s == step), None)
        if at is None:
            return {"steps_after": n, "step_time_s_after": round(after, 6)}
        before = (at - first[1]) / (step - first[0])
        return {"steps_after": n, "step_time_s_after": round(after, 6), "steps_before": step - first[0],
                "step_time_s_before": round(before, 6), "slowdown": round(after / before, 4) if before > 0 else None}


class _Blocked:
    def __init__(self, costs: SaveCosts) -> None:
        self.costs, self.seconds = costs, 0.0

    def __enter__(self) -> _Blocked:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.seconds = time.perf_counter() - self._t0
        self.costs._blocked += self.seconds

