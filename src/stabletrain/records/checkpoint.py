"""Checkpoints that are never written from a bad state and never leave a run without a good one.

Layout (DESIGN.md, "Run directory")::

    RUN_DIR/checkpoints/
        step_000100/state.pt    the whole state (``Trainer.state_dict()``); loads with torch.load(weights_only=True)
        step_000100/meta.json   step, time, sha256 and size of state.pt, versions, and the caller's meta (config)
        LAST_GOOD               one line: the name of the newest verified checkpoint directory

One save (DESIGN.md, principle 4: nothing bad is persisted)::

    check the model and optimizer state are finite    # one fused pass, one host read; else write nothing
    [save_async: stage a copy into reused host buffers; training goes on, the rest runs in a thread]
    write step_000100.tmp-<pid>/state.pt, meta.json   # each with fileio.atomic_write: fsynced, then the directory
    verify the temporary copy                         # sha256, loads with weights_only=True, finite
    rename it to step_000100                          # an existing step_000100 is moved aside, deleted last
    point LAST_GOOD at it                             # tmp file, fsync, os.replace, fsync of the directory
    prune to the ``keep`` newest                      # never the one LAST_GOOD names

:meth:`CheckpointManager.save` does it all in the caller's thread. :meth:`CheckpointManager.save_async`
blocks only for the check and the staging copy (pinned host buffers and non-blocking copies from
CUDA, so the device queue is not drained), then writes in a background thread; at most one save is
in flight (the next one waits for it), and :meth:`CheckpointManager.wait` waits for it. Whatever
reads LAST_GOOD to act on it (resume, rollback, an incident replay) waits first.

A crash at any point, in either thread, leaves ``LAST_GOOD`` naming a complete, verified checkpoint;
the debris (``*.tmp-<pid>``, ``*.replaced-<pid>``, ``*.trash-<pid>``) is cleaned up by the next save.

Loading never executes code: every file goes through ``torch.load(weights_only=True)``, and a file
that needs more (a pickled class or function) is refused with a message saying so.

Under FSDP2 a checkpoint directory may also hold a ``dcp/`` folder: each rank's shards of the model
and optimizer, written by ``torch.distributed.checkpoint`` (:mod:`stabletrain.distributed.sharded_checkpoint`),
while state.pt holds the rest. The manager then waits for the shards before writing state.pt
(:meth:`CheckpointManager.begin_sharded`, ``save_async(shards=...)``), and verification also checks
the folder: ``.metadata`` complete and naming every key, every shard file it references present.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import pickle
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten_with_path

from .._version import __version__
from ..config import dotted_key
from ..fileio import atomic_write, fsync_dir
from ..distributed.sharded_checkpoint import DCP_DIR, ShardedSave, attach_path, to_full_state, verify_dcp
from .staging import StateStager  # the staging copy; re-exported here, where it used to live

__all__ = [
    "CheckpointManager",
    "CheckpointError",
    "PendingSave",
    "SaveResult",
    "StateStager",
    "LoadedCheckpoint",
    "first_nonfinite",
    "load_state_file",
]

FORMAT_VERSION = 1
STATE_FILE = "state.pt"
META_FILE = "meta.json"
LAST_GOOD = "LAST_GOOD"

_FINAL = re.compile(r"^step_(\d+)$")
_DEBRIS = re.compile(r"^(step_\d+|LAST_GOOD)\.(tmp|replaced|trash)-(\d+)$")
_CHUNK = 8 << 20  # bytes per read when hashing a file

# Keys the manager writes into meta.json; the caller's meta may not use them.
_RESERVED_META = ("format", "step", "time", "unix_time", "state_file", "state_sha256", "state_bytes", "versions")


class CheckpointError(RuntimeError):
    """No checkpoint could be written or loaded. ``path`` is the directory, ``problems`` what went wrong."""

    def __init__(self, message: str, path: Path | None = None, problems: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.path = path
        self.problems = list(problems)


# ---------------------------------------------------------------------------------------------
# Finiteness


def _leaves(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    """Yield (dotted key path, leaf) of nested dicts, lists and tuples, in insertion order."""
    for path, leaf in tree_flatten_with_path(obj)[0]:
        yield dotted_key(path, prefix), leaf


def first_nonfinite(state: dict[str, Any], scope: Sequence[str] | None = None) -> str | None:
    """Return the dotted key path of the first NaN/Inf tensor or float in ``state``, or None if all are finite.

    ``scope`` limits the check to these top-level keys (e.g. ``("model", "optimizer")``); None checks
    everything. A scope key missing from ``state`` is a ValueError. Forces one host-device sync per
    device holding tensors (fp64 ones apart), plus one more where a tensor's norm is not finite.
    """
    if scope is not None:
        missing = [k for k in scope if k not in state]
        if missing:
            raise ValueError(f"the state has no key {missing[0]!r} to check for finiteness "
                             f"(its keys: {', '.join(map(str, state))})")
        items = ((k, state[k]) for k in scope)
    else:
        items = iter(state.items())
    order: list[str] = []  # key paths of the checked leaves, in walk order
    bad: list[int] = []
    groups: dict[tuple[torch.device, torch.dtype], list[tuple[int, Tensor]]] = {}
    for top, value in items:
        for path, leaf in _leaves(value, str(top)):
            if isinstance(leaf, float) and not math.isfinite(leaf):
                bad.append(len(order))
                order.append(path)
            elif isinstance(leaf, Tensor) and leaf.numel() and (leaf.is_floating_point() or leaf.is_complex()):
                t = leaf.detach()
                t = torch.view_as_real(t) if t.is_complex() else t
                acc = torch.float64 if t.dtype == torch.float64 else torch.float32  # norm dtype: never narrowing
                groups.setdefault((t.device, acc), []).append((len(order), t))
                order.append(path)
    for (_, acc), pairs in groups.items():
        tensors = [t for _, t in pairs]
        # The L2 norm is one fused kernel and is finite whenever every element is, unless it overflows;
        # so it can only flag too much, and the few tensors it flags are checked exactly.
        norms = torch._foreach_norm(tensors, 2, dtype=acc)
        flagged = [k for k, ok in enumerate(torch.isfinite(torch.stack(norms)).tolist()) if not ok]  # sync
        if flagged:
            exact = torch.stack([torch.isfinite(tensors[k]).all() for k in flagged]).tolist()  # sync, rare
            bad.extend(pairs[k][0] for k, ok in zip(flagged, exact) if not ok)
    return order[min(bad)] if bad else None


# ---------------------------------------------------------------------------------------------
# Files


class _HashingWriter:
    """A write-only file wrapper that hashes and counts what passes through (torch.save writes to it)."""

    def __init__(self, fh: Any) -> None:
        self.fh, self.sha, self.num_bytes = fh, hashlib.sha256(), 0
        self.error: OSError | None = None  # what the file raised (torch's zip writer reports only a position mismatch)

    def write(self, data: Any) -> int:
        self.sha.update(data)
        try:
            n = self.fh.write(data)
        except OSError as err:
            self.error = err
            raise
        self.num_bytes += n
        return n

    def flush(self) -> None:
        self.fh.flush()


def _sha256_of(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb", buffering=0) as fh:
        buf = memoryview(bytearray(_CHUNK))
        while n := fh.readinto(buf):
            sha.update(buf[:n])
    return sha.hexdigest()


def _remove_tree(path: Path) -> None:
    """Delete a directory: renamed to ``*.trash-<pid>`` first, so a crash never leaves half of it under its name."""
    trash = path.with_name(f"{path.name}.trash-{os.getpid()}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return False  # one save at a time in a process: our own debris is from an earlier, failed save
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # exists, owned by someone else
    return True


def load_state_file(path: str | Path, map_location: Any = "cpu", *, mmap: bool = False) -> Any:
    """Return ``torch.load(path, weights_only=True)``; a file that would need more is a CheckpointError.

    Never executes code from the file. ``map_location="cpu"`` keeps device memory untouched (the
    trainer's ``load_state_dict`` moves tensors where they belong).
    """
    path = Path(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        text = str(err)
        if "Weights only load failed" not in text:
            detail = f"not a readable checkpoint ({text.splitlines()[0]})"
            raise CheckpointError(f"{path}: {detail}", path, [detail]) from None
        found = re.search(r"Unsupported global: GLOBAL (\S+)", text)
        what = f"the global {found.group(1)}" if found else "an object other than tensors and plain containers"
        detail = (f"refused: it pickles {what}, so loading it would execute code; stabletrain loads only tensors, "
                  "numbers, strings and containers (torch.load(weights_only=True)). If you wrote this file and "
                  "trust it, re-save its contents as plain tensors and containers")
        raise CheckpointError(f"{path}: {detail}", path, [detail]) from None


# ---------------------------------------------------------------------------------------------
# Staging and the background save

class PendingSave:
    """A save started by :meth:`CheckpointManager.save_async`: ask :meth:`done`, or wait with :meth:`result`."""

    def __init__(self, step: int, result: SaveResult | None = None) -> None:
        self.step = step
        self._result = result
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def _start(self, write: Callable[[], SaveResult]) -> None:
        def run() -> None:
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


# ---------------------------------------------------------------------------------------------
# The manager


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

    @property
    def kind(self) -> str:
        return "checkpoint_withheld" if self.withheld else "checkpoint"

    def event_fields(self) -> dict[str, Any]:
        if self.withheld:
            return {}
        return {"path": str(self.path), "size_mib": round(self.num_bytes / 2**20, 3),
                "seconds": round(sum(self.timings.values()), 4), "blocked_s": round(self.blocked_s, 4),
                "pruned": [p.name for p in self.pruned]}

    @property
    def blocked_s(self) -> float:
        """How long the caller waited: the checks and the staging copies (``save_async``), or everything (``save``)."""
        if "stage_s" in self.timings:
            return sum(self.timings.get(k, 0.0) for k in ("check_s", "stage_s", "shard_check_s", "shard_stage_s"))
        return sum(self.timings.values())


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint: its state (CPU tensors by default), meta.json, directory and what was skipped."""

    state: dict[str, Any]
    meta: dict[str, Any]
    path: Path
    problems: list[str]  # one line per checkpoint (or LAST_GOOD) that was reported and skipped


class CheckpointManager:
    """Write, verify, prune and load the checkpoints in ``root`` (normally ``RUN_DIR/checkpoints``).

    ``keep``: how many of the newest checkpoints to keep (the one ``LAST_GOOD`` names is always kept).
    ``require_finite``: top-level state keys whose tensors must all be finite for a save (and a load)
    to go ahead; None means every floating tensor. The default leaves out the metrics buffers, which
    record a skipped step's NaN loss by design.
    Only one process (rank 0) should write to a ``root``; loading from several is fine.
    """

    def __init__(self, root: str | Path, keep: int = 3, *,
                 require_finite: Sequence[str] | None = ("model", "optimizer")) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep: expected an integer >= 1 (how many checkpoints to keep), got {keep!r}")
        self.root = Path(root)
        self.keep = keep
        self.require_finite = tuple(require_finite) if require_finite is not None else None
        self._stager = StateStager()
        self._in_flight: PendingSave | None = None

    # -- saving -----------------------------------------------------------------------------

    def save(self, state: dict[str, Any], step: int, meta: dict[str, Any] | None = None) -> SaveResult:
        """Write ``state`` as the checkpoint of ``step`` unless it is non-finite; move LAST_GOOD; prune.

        ``meta`` (JSON-able; e.g. ``{"config": config_to_dict(cfg), "config_hash": ...}``) goes into
        meta.json beside the manager's own keys. Returns ``withheld=True`` (writing nothing) when a
        tensor in ``require_finite`` is NaN/Inf; ``reason`` names its key path. Raises CheckpointError
        when writing or verifying fails (disk full, bytes read back differ); the previous checkpoint
        and LAST_GOOD are then untouched. Waits for a save in flight first. Forces one host-device sync
        for the finiteness check, and torch.save copies device tensors to the host.
        """
        self.wait()
        meta = _checked_meta(step, meta)
        timings: dict[str, float] = {}
        withheld = self._check(state, step, timings)
        return withheld if withheld is not None else self._write(state, step, meta, timings)

    def save_async(self, state: dict[str, Any], step: int, meta: dict[str, Any] | None = None, *,
                   shards: ShardedSave | None = None) -> PendingSave:
        """:meth:`save`, blocking only for the finiteness check and the staging copy; the rest runs in a thread.

        Waits first for the save in flight (one at a time). Then checks ``state`` (a non-finite one is
        withheld: the returned save is already done), copies it into the manager's reused host buffers
        (:class:`StateStager`; from CUDA pinned and non-blocking), and returns while a background thread
        writes, verifies, moves LAST_GOOD and prunes. ``state`` may change as soon as this returns.
        ``result()`` of the returned :class:`PendingSave` gives the :class:`SaveResult` or raises the
        CheckpointError :meth:`save` would have raised; its timings add ``stage_s``. The thread is not a
        daemon: a normal interpreter exit finishes the save; a crash leaves LAST_GOOD where it was.

        ``shards``: the DCP save of the model and optimizer into :meth:`begin_sharded`'s directory (its
        ``state`` entries are markers); the thread waits for it and checks it before writing state.pt.
        """
        if shards is None:
            self.wait()
        elif self._in_flight is not None:
            raise RuntimeError("save_async(shards=...): a save is still in flight; begin_sharded waits for it")
        meta = _checked_meta(step, meta)
        timings: dict[str, float] = dict(shards.timings) if shards is not None else {}
        withheld = self._check(state, step, timings)
        if withheld is not None:
            return PendingSave(step, withheld)
        t0 = time.perf_counter()
        staged, events = self._stager.stage(state)
        timings["stage_s"] = time.perf_counter() - t0
        pending = PendingSave(step)
        pending._start(lambda: self._write(staged, step, meta, timings, events, shards))
        self._in_flight = pending
        return pending

    def begin_sharded(self, step: int) -> Path:
        """Return the empty temporary directory of ``step``'s checkpoint, with its ``dcp/`` folder, for the shards.

        Waits for the save in flight and cleans up debris first. Every rank writes its shards into
        ``dcp/``; then :meth:`save_async` with ``shards=`` finishes the checkpoint there.
        """
        self.wait()
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean_debris()
        tmp = self.root / f"{_dir_name(step)}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / DCP_DIR).mkdir(parents=True)
        return tmp

    def wait(self) -> PendingSave | None:
        """Wait for the save in flight, if any, and return it (its ``result()`` no longer blocks). Raises nothing."""
        pending, self._in_flight = self._in_flight, None
        if pending is not None:
            pending.join()
        return pending

    @property
    def in_flight(self) -> PendingSave | None:
        """The background save still running, or None. Never blocks."""
        pending = self._in_flight
        return pending if pending is not None and not pending.done() else None

    @property
    def staging_bytes(self) -> int:
        """Host memory held by :meth:`save_async`'s staging buffers (a copy of the last state it saved)."""
        return self._stager.num_bytes

    def _check(self, state: dict[str, Any], step: int, timings: dict[str, float]) -> SaveResult | None:
        """Return the withheld result when a ``require_finite`` tensor is NaN/Inf, else None. One sync."""
        t0 = time.perf_counter()
        bad = first_nonfinite(state, self.require_finite)
        timings["check_s"] = time.perf_counter() - t0
        if bad is None:
            return None
        good = self.latest_good()
        return SaveResult(step, None, True, f"checkpoint at step {step} withheld: {bad} is not finite (NaN/Inf); "
                          f"LAST_GOOD stays at {good.name if good else 'no checkpoint'}", timings=timings)

    def _write(self, state: dict[str, Any], step: int, meta: dict[str, Any], timings: dict[str, float],
               ready: Sequence[Any] = (), shards: ShardedSave | None = None) -> SaveResult:
        """Write, verify, install, point LAST_GOOD, prune (after waiting on the ``ready`` CUDA events, and ``shards``)."""
        for event in ready:
            event.synchronize()
        if shards is None:  # (begin_sharded did this before the shards were written)
            self.root.mkdir(parents=True, exist_ok=True)
            self.clean_debris()
        name = _dir_name(step)
        final, tmp = self.root / name, self.root / f"{name}.tmp-{os.getpid()}"
        aside: Path | None = None
        installed = False
        try:
            if shards is None:
                tmp.mkdir()
            else:
                assert shards.tmp == tmp, (shards.tmp, tmp)
                try:
                    meta = {**meta, "dcp": shards.finish(timings)}  # every rank's shards written, .metadata complete
                except Exception as err:
                    raise CheckpointError(f"sharded checkpoint {final}: the DCP save failed ({type(err).__name__}: "
                                          f"{str(err).splitlines()[0] if str(err) else ''}); the previous checkpoint "
                                          "and LAST_GOOD are untouched", final) from err
            t0 = time.perf_counter()
            writer: list[_HashingWriter] = []

            def write_state(fh: Any) -> None:
                writer.append(_HashingWriter(fh))
                try:
                    torch.save(state, writer[0])
                except Exception:
                    if writer[0].error is not None:  # the disk's own error (ENOSPC, EIO, EFBIG), not torch's rewording
                        raise writer[0].error from None
                    raise

            atomic_write(tmp / STATE_FILE, write_state)
            full_meta = {
                "format": FORMAT_VERSION, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "unix_time": round(time.time(), 3), "state_file": STATE_FILE,
                "state_sha256": writer[0].sha.hexdigest(), "state_bytes": writer[0].num_bytes,
                "versions": _versions(), **meta,
            }
            atomic_write(tmp / META_FILE, json.dumps(full_meta, indent=2, default=str) + "\n")  # also fsyncs tmp/
            timings["write_s"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            problems = self.verify(tmp)
            timings["verify_s"] = time.perf_counter() - t0
            if problems:
                raise CheckpointError(f"checkpoint {tmp} failed verification right after writing: {'; '.join(problems)} "
                                      "(the disk returned different bytes?); nothing was replaced", tmp, problems)
            if final.exists():  # a re-save of this step (e.g. after a rollback): keep the old one until LAST_GOOD moves
                aside = final.with_name(f"{name}.replaced-{os.getpid()}")
                if aside.exists():
                    shutil.rmtree(aside)
                os.replace(final, aside)
            os.replace(tmp, final)
            installed = True
            fsync_dir(self.root)
            self._point_last_good(name)
        except BaseException as err:
            shutil.rmtree(tmp, ignore_errors=True)
            if aside is not None and aside.exists() and not final.exists():
                os.replace(aside, final)  # put the previous checkpoint back under its name
            if isinstance(err, OSError):
                good = self.latest_good()
                good_name = good.name if good else "no checkpoint"
                if installed:
                    raise CheckpointError(f"checkpoint {final} was written and verified, but LAST_GOOD could not be "
                                          f"moved to it ({err}); LAST_GOOD still names {good_name}", final) from err
                raise CheckpointError(f"writing checkpoint {final} failed: {err}; the previous checkpoint "
                                      f"({good_name}) and LAST_GOOD are untouched", final) from err
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        t0 = time.perf_counter()
        pruned = self.prune()
        timings["prune_s"] = time.perf_counter() - t0
        size = writer[0].num_bytes + int(meta.get("dcp", {}).get("bytes", 0))
        return SaveResult(step, final, False, f"saved {name} ({size / 2**20:.1f} MiB, verified); LAST_GOOD -> {name}",
                          num_bytes=size, timings=timings, pruned=tuple(pruned))

    def _point_last_good(self, name: str) -> None:
        atomic_write(self.root / LAST_GOOD, f"{name}\n")  # via LAST_GOOD.tmp-<pid>, which clean_debris knows

    def clean_debris(self) -> list[Path]:
        """Remove what crashed writers left (``*.tmp-<pid>``, ``*.trash-<pid>``); return what was removed.

        A ``step_N.replaced-<pid>`` (a crash during a re-save of step N) is renamed back to ``step_N``
        when that name is missing, else removed. Debris of a live process is left alone.
        """
        removed = []
        if not self.root.is_dir():
            return removed
        for entry in sorted(self.root.iterdir()):
            m = _DEBRIS.match(entry.name)
            if m is None or _pid_alive(int(m.group(3))):
                continue
            base = self.root / m.group(1)
            if m.group(2) == "replaced" and not base.exists():
                os.replace(entry, base)
                fsync_dir(self.root)
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
        return removed

    def prune(self) -> list[Path]:
        """Delete all but the ``keep`` newest checkpoints up to LAST_GOOD's step; return the deleted directories.

        Never deletes the one LAST_GOOD names. Checkpoints newer than it (never marked good, e.g. from a
        crash between rename and LAST_GOOD, or from before a rollback) are left alone and not counted;
        :meth:`discard_after` removes them.
        """
        good = self.latest_good()
        if good is None:
            return []
        limit = _step_of(good)
        ranked = [d for d in self.checkpoints() if _step_of(d) <= limit]
        removed = []
        for d in ranked[self.keep:]:
            if d != good:
                _remove_tree(d)
                removed.append(d)
        if removed:
            fsync_dir(self.root)
        return removed

    def discard_after(self, step: int) -> list[Path]:
        """Delete every checkpoint newer than ``step`` (a rollback); LAST_GOOD first moves to the newest that
        verifies at or before ``step``. Raises CheckpointError, deleting nothing, when none verifies.
        Waits for a save in flight first.
        """
        self.wait()
        keep = [d for d in self.checkpoints() if _step_of(d) <= step]
        target = next((d for d in keep if not self.verify(d)), None)
        if target is None:
            raise CheckpointError(f"no checkpoint at or before step {step} in {self.root} verifies; nothing discarded",
                                  self.root)
        self._point_last_good(target.name)
        removed = [d for d in self.checkpoints() if _step_of(d) > step]
        for d in removed:
            _remove_tree(d)
        fsync_dir(self.root)
        return removed

    # -- reading ----------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Return the checkpoint directories (``step_N``), newest (highest step) first. Verifies nothing."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _FINAL.match(p.name) and p.is_dir()]
        return sorted(found, key=_step_of, reverse=True)

    def latest_good(self) -> Path | None:
        """Return the directory LAST_GOOD names, or None (no LAST_GOOD, or it names no directory).

        Verifies nothing and does not wait for a save in flight (:meth:`wait` first to see its outcome).
        """
        name, _ = self._read_last_good()
        return self.root / name if name is not None and (self.root / name).is_dir() else None

    def _read_last_good(self) -> tuple[str | None, str | None]:
        """Return (the name in LAST_GOOD, or None; a problem line, or None)."""
        path = self.root / LAST_GOOD
        try:
            name = path.read_text(encoding="utf-8").strip()
        except FileNotFoundError:
            return None, f"{LAST_GOOD}: missing"
        except (OSError, UnicodeDecodeError) as err:
            return None, f"{LAST_GOOD}: unreadable ({err})"
        if not _FINAL.match(name):
            return None, f"{LAST_GOOD}: does not name a checkpoint directory (it holds {name[:80]!r})"
        if not (self.root / name).is_dir():
            replaced = sorted(self.root.glob(f"{name}.replaced-*"))
            if replaced:  # a crash in the middle of a re-save of this step: the previous copy is still here
                return replaced[0].relative_to(self.root).as_posix(), None
            return None, f"{LAST_GOOD}: names {name}, which does not exist"
        return name, None

    def verify(self, path: str | Path) -> list[str]:
        """Return the problems of checkpoint directory ``path``; empty when it is good.

        Good means: meta.json readable, state.pt of the recorded size and sha256, loadable with
        ``weights_only=True``, and the ``require_finite`` tensors finite; a sharded checkpoint's DCP
        folder complete (:func:`~stabletrain.distributed.sharded_checkpoint.verify_dcp`). Reads the whole state.pt
        twice (hash, then a memory-mapped load); of the DCP folder only ``.metadata`` and the file sizes.
        """
        try:
            self._load_checked(Path(path), mmap=True)
        except CheckpointError as err:
            return err.problems or [str(err)]
        return []

    def _load_checked(self, path: Path, map_location: Any = "cpu", mmap: bool = False) -> tuple[Any, dict[str, Any]]:
        def fail(problem: str) -> CheckpointError:
            return CheckpointError(f"checkpoint {path}: {problem}", path, [f"{path.name}: {problem}"])

        try:
            meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise fail(f"{META_FILE} is missing (the write did not finish?)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise fail(f"{META_FILE} is unreadable ({err})") from None
        if not isinstance(meta, dict) or not {"state_sha256", "state_bytes", "step"} <= meta.keys():
            raise fail(f"{META_FILE} lacks step, state_sha256 or state_bytes")
        state_path = path / STATE_FILE
        try:
            size = state_path.stat().st_size
        except FileNotFoundError:
            raise fail(f"{STATE_FILE} is missing") from None
        if size != meta["state_bytes"]:
            raise fail(f"{STATE_FILE} is {size} bytes, {META_FILE} says {meta['state_bytes']} (truncated or overwritten)")
        if _sha256_of(state_path) != meta["state_sha256"]:
            raise fail(f"{STATE_FILE} does not match its sha256 in {META_FILE} (corrupted on disk or in transfer)")
        try:
            state = load_state_file(state_path, map_location, mmap=mmap)
        except CheckpointError as err:
            raise fail(f"{STATE_FILE} {err.problems[0]}") from None
        except Exception as err:  # noqa: BLE001  (torch raises RuntimeError, EOFError, ... on bad archives)
            raise fail(f"{STATE_FILE} cannot be loaded ({type(err).__name__}: {str(err).splitlines()[0]})") from None
        if not isinstance(state, dict):
            raise fail(f"{STATE_FILE} holds a {type(state).__name__}, expected a dict")
        try:
            bad = first_nonfinite(state, self.require_finite)
        except ValueError as err:
            raise fail(str(err)) from None
        if bad is not None:
            raise fail(f"{bad} is not finite (NaN/Inf)")
        if "dcp" in meta:  # the model's and optimizer's shards, in the DCP folder beside state.pt
            problems = verify_dcp(path, meta["dcp"])
            if problems:
                raise fail("; ".join(problems))
            attach_path(state, path, meta["dcp"])
        return state, meta

    def load(self, path: str | Path | None = None, *, map_location: Any = "cpu",
             on_problem: Callable[[str], None] | None = None, full: bool = False) -> LoadedCheckpoint:
        """Load and verify a checkpoint: ``path`` if given, else LAST_GOOD, falling back to older ones.

        Each checkpoint skipped (truncated, corrupted, refused, non-finite) is reported to
        ``on_problem`` and listed in the result's ``problems``. Checkpoints newer than LAST_GOOD were
        never marked good and are not used. An explicit ``path`` that fails, or no checkpoint that
        verifies, raises CheckpointError naming the directory and every problem. Without ``path``, waits
        for a save in flight first (LAST_GOOD may be about to move). ``full``: a sharded (DCP) checkpoint's
        model and optimizer are read whole, in this process, into the format of a full checkpoint
        (otherwise its state holds markers that :meth:`Trainer.load_state_dict` reads shard by shard).
        """
        problems: list[str] = []

        def report(problem: str) -> None:
            problems.append(problem)
            if on_problem is not None:
                on_problem(problem)

        if path is not None:
            path = Path(path)
            state, meta = self._load_checked(path, map_location)
            return LoadedCheckpoint(to_full_state(state) if full else state, meta, path, problems)
        self.wait()

        all_dirs = self.checkpoints()
        name, problem = self._read_last_good()
        if problem is not None and (all_dirs or (self.root / LAST_GOOD).exists()):
            report(problem + "; trying the newest checkpoints")
        if name is not None:
            good = self.root / name
            limit = _step_of(good)
            for d in all_dirs:
                if _step_of(d) > limit:
                    report(f"{d.name}: newer than LAST_GOOD ({name}); not used (written by a save that crashed "
                           "before LAST_GOOD moved, or left from before a rollback)")
            candidates = [good] + [d for d in all_dirs if _step_of(d) < limit]
        else:
            candidates = all_dirs
        for d in candidates:
            try:
                state, meta = self._load_checked(d, map_location)
            except CheckpointError as err:
                report(err.problems[0] if err.problems else str(err))
                continue
            return LoadedCheckpoint(to_full_state(state) if full else state, meta, d, problems)
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.root}" + (f" ({'; '.join(problems)})" if problems else ""),
                                  self.root, problems)
        raise CheckpointError(f"no checkpoint in {self.root} verifies:\n  " + "\n  ".join(problems)
                              + "\nresume from another run directory or start a new run", self.root, problems)


def _checked_meta(step: int, meta: dict[str, Any] | None) -> dict[str, Any]:
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step: expected an integer >= 0, got {step!r}")
    meta = dict(meta or {})
    clash = [k for k in _RESERVED_META if k in meta]
    if clash:
        raise ValueError(f"meta: keys {', '.join(clash)} are written by the checkpoint manager; rename them")
    return meta


def _dir_name(step: int) -> str:
    return f"step_{step:06d}"


def _step_of(path: Path) -> int:
    return int(path.name.split(".", 1)[0].removeprefix("step_"))


def _versions() -> dict[str, str]:
    return {"torch": torch.__version__, "stabletrain": __version__}

