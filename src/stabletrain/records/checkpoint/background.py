"""A background save's hand-over: the state staged into shared memory and sent to the writer process.

:meth:`~.manager.CheckpointManager.save_async` checks the state, then :class:`BackgroundSaves` copies it
into the manager's shared block (:mod:`.arena`), hands the block to the writer process once (:mod:`.writer`)
and sends the request: the skeleton, the layout when it changed, the step and meta. What the writer must
not read before it is complete (CUDA copies, a sharded save's DCP shards) is waited for in a helper
thread of this process first. The writer's reply becomes the :class:`~.saves.SaveResult` (with this
process's timings: check, stage, send); its error, or its death, a CheckpointError.
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
import time
import weakref
from pathlib import Path
from typing import Any

from ...errors import short_cause
from .arena import SharedStager, Staged
from .files import CheckpointError, dir_name
from .saves import PendingSave, SaveResult, is_save_failure
from .shards import ShardedSave
from .writer import Writer, WriterDied, writer

__all__ = ["BackgroundSaves", "shards_written"]


class BackgroundSaves:
    """One manager's background saves: its shared block, and the id the writer knows it by."""

    def __init__(self, manager: Any) -> None:  # its CheckpointManager (root, keep, require_finite, latest_good)
        self._manager = weakref.proxy(manager)  # (the manager owns this; no cycle keeps it alive)
        self._stager = SharedStager()
        # (the writer, the id it knows our shared block by): re-sent when the writer or the block is new
        self._remote: list[tuple[Writer, int] | None] = [None]
        weakref.finalize(self, _forget_block, self._remote)

    @property
    def num_bytes(self) -> int:
        """Host memory the shared block holds."""
        return self._stager.num_bytes

    def start(self, state: dict[str, Any], step: int, meta: dict[str, Any], timings: dict[str, float],
              shards: ShardedSave | None) -> PendingSave:
        """Stage ``state`` (checked finite) and send it to the writer; return the save in flight. See the module docstring."""
        manager = self._manager
        final = manager.root / dir_name(step)
        try:
            channel = writer()
        except WriterDied as err:
            raise CheckpointError(f"checkpoint at step {step}: {err}; the previous checkpoint and LAST_GOOD are "
                                  "untouched", manager.root) from err
        t0 = time.perf_counter()
        try:
            staged = self._stager.stage(state)
        except OSError as err:  # the shared block could not be made (no memory, a file-size limit)
            good = manager.latest_good()
            raise CheckpointError(f"staging checkpoint {final} failed: {err}; " + (
                f"the previous checkpoint ({good.name}) and LAST_GOOD are untouched" if good else
                "no checkpoint was written before it"), manager.root) from err
        skeleton = pickle.dumps(staged.skeleton, protocol=pickle.HIGHEST_PROTOCOL)  # a snapshot: state may change now
        timings["stage_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        request = {"skeleton": skeleton, "root": str(manager.root), "keep": manager.keep, "step": step, "meta": meta,
                   "require_finite": manager.require_finite, "timings": {}, **self._block_for(channel, staged)}

        def prepare() -> dict[str, Any]:  # in a helper thread: what the writer must not read before it is whole
            for event in staged.events:
                event.synchronize()
            return {} if shards is None else {"tmp": str(shards.tmp), "dcp": shards_written(shards, final, timings)}

        def died(err: BaseException) -> CheckpointError:
            good = manager.latest_good()
            return CheckpointError(f"{err} while writing {final.name} (LAST_GOOD names "
                                   f"{good.name if good else 'no checkpoint'}; the next save starts a new writer)",
                                   manager.root)

        pending = PendingSave(step)
        try:
            pending.start(channel, request, lambda reply: _result(reply, step, timings),
                          prepare if staged.events or shards is not None else None, died)
        except WriterDied as err:  # gone since writer() found it
            raise died(err) from err
        timings["send_s"] = time.perf_counter() - t0
        return pending

    def _block_for(self, channel: Writer, staged: Staged) -> dict[str, Any]:
        """The request's ``block`` and ``specs``: our shared block handed to ``channel`` first if it is new to it."""
        remote = self._remote[0]
        block = self._stager.block
        if block is None:  # nothing staged yet, and no tensor now (a sharded save's small state may hold none)
            return {"block": None, "specs": []}
        if remote is None or remote[0] is not channel or staged.block is not None:
            if remote is not None and remote[0] is channel:
                channel.drop_block(remote[1])
            self._remote[0] = remote = (channel, channel.add_block(block.size, block.fd))
            return {"block": remote[1], "specs": self._stager.specs}  # a new block (or writer): the whole layout
        return {"block": remote[1], "specs": staged.specs}


def shards_written(shards: ShardedSave, final: Path, timings: dict[str, float]) -> dict[str, Any]:
    """Wait for every rank's DCP shards of ``final`` (:meth:`ShardedSave.finish`); return meta.json's "dcp". A failed
    save is a CheckpointError, its temporary directory removed."""
    try:
        return shards.finish(timings)  # every rank's shards written, .metadata complete
    except BaseException as err:  # (DCP's CheckpointException is one)
        if not is_save_failure(err):
            raise
        shutil.rmtree(shards.tmp, ignore_errors=True)
        failures = getattr(err, "failures", None)  # DCP's CheckpointException: {rank: (its error, its stack)}
        said = ("; ".join(f"rank {rank}: {type(e[0]).__name__}: {short_cause(str(e[0]))}" for rank, e in sorted(failures.items()))
                if isinstance(failures, dict) and failures and all(isinstance(e, tuple) for e in failures.values())
                else f"{type(err).__name__}: {short_cause(str(err))}")  # (a gloo error: its gist, no source path)
        raise CheckpointError(f"sharded checkpoint {final}: the DCP save failed ({said}); the previous checkpoint and "
                              "LAST_GOOD are untouched", final) from err


def _result(reply: dict[str, Any], step: int, timings: dict[str, float]) -> SaveResult:
    """The writer's reply as the SaveResult (with this process's timings), or its error raised here."""
    if "error" in reply:
        path = Path(reply["path"]) if reply["path"] else None
        if reply["checkpoint_error"]:
            raise CheckpointError(reply["message"], path, reply["problems"])
        raise CheckpointError(f"checkpoint at step {step}: the writer process raised {reply['error']}: "
                              f"{reply['message']}", path)
    result: SaveResult = reply["result"]
    return dataclasses.replace(result, timings={**timings, **result.timings}, write_cpu_s=reply["cpu_s"],
                               write_wall_s=reply["wall_s"])


def _forget_block(remote: list[tuple[Writer, int] | None]) -> None:
    """A finalizer: let the writer unmap the shared block (never blocks)."""
    if remote[0] is not None:
        remote[0][0].drop_block(remote[0][1])

