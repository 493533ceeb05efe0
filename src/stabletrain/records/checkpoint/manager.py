"""The checkpoints of a run: which one is good (LAST_GOOD), writing new ones, pruning, rollback, loading.

:meth:`CheckpointManager.save` does a whole save in the caller's thread. :meth:`CheckpointManager.save_async`
blocks only for the finiteness check and one copy of the state into shared memory (:mod:`.arena`; from
CUDA page-locked and non-blocking, so the device queue is not drained), then the writer process
(:mod:`.writer`) writes, verifies, installs and prunes with the same code (:meth:`CheckpointManager.write_staged`);
at most one save is in flight (the next one waits for it), and :meth:`CheckpointManager.wait` waits for
it. Whatever reads LAST_GOOD to act on it (resume, rollback, an incident replay) waits first.

A crash at any point, in either process, leaves ``LAST_GOOD`` naming a complete, verified checkpoint; the
debris (``*.tmp-<pid>``, ``*.replaced-<pid>``, ``*.trash-<pid>``) is cleaned up by the next save.

Under FSDP2 the model's and optimizer's shards are written by every rank into the checkpoint's ``dcp/``
folder first (:meth:`CheckpointManager.begin_sharded`); the writer gets the rest only once they are
whole (``save_async(shards=...)``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...fileio import atomic_write, fsync_dir
from ...process import stat_fields
from .background import BackgroundSaves, shards_written
from .files import META_FILE, CheckpointError, checked_meta, dir_name, first_nonfinite, load_checked, only_plain, write_files
from .saves import PendingSave, SaveResult
from .shards import DCP_DIR, ShardedSave, to_full_state

__all__ = ["CheckpointManager", "LoadedCheckpoint", "LAST_GOOD", "SKIPS_RUN", "step_of"]

LAST_GOOD = "LAST_GOOD"
#: Skipped steps in a row that make a run of them: a periodic save after one is withheld (the keeper), the newest
#: checkpoint written before one is kept past ``keep`` (:meth:`CheckpointManager.prune`).
SKIPS_RUN = 2

_FINAL = re.compile(r"^step_(\d+)$")
_DEBRIS = re.compile(r"^(step_\d+|LAST_GOOD)\.(tmp|replaced|trash)-(\d+)$")


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
    fields = stat_fields(pid)  # a zombie (a killed writer that init has not reaped yet) writes nothing more
    return fields is None or fields[0] != "Z"


@dataclass
class LoadedCheckpoint:
    """A verified checkpoint: its state (CPU tensors by default), meta.json, directory and what was skipped."""

    state: dict[str, Any]
    meta: dict[str, Any]
    path: Path
    problems: list[str]  # one line per checkpoint (or LAST_GOOD) that was reported and skipped


class CheckpointManager:
    """Write, verify, prune and load the checkpoints in ``root`` (normally ``RUN_DIR/checkpoints``).

    ``keep``: how many of the newest checkpoints to keep (the one ``LAST_GOOD`` names is always kept, and the newest
    written before a run of skipped steps: :meth:`prune`).
    ``require_finite``: top-level state keys whose tensors must all be finite for a save (and a load)
    to go ahead; None means every floating tensor. The default leaves out the metrics buffers, which
    record a skipped step's NaN loss by design.
    Only one process (rank 0) should write to a ``root``; loading from several is fine.
    """

    def __init__(self, root: str | Path, keep: int = 3, *,
                 require_finite: Sequence[str] | None = ("model", "optimizer")) -> None:
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 1:
            raise ValueError(f"keep: expected an integer >= 1 (how many checkpoints to keep), got {keep!r}")
        self.root = Path(root).absolute()  # the writer process keeps the cwd it started in
        self.keep = keep
        self.require_finite = tuple(require_finite) if require_finite is not None else None
        self._background = BackgroundSaves(self)
        self._in_flight: PendingSave | None = None
        self._written: tuple[Path, bool] | None = None  # (the directory a save has just written, only_plain),
                                                        # while it verifies it

    # -- saving -----------------------------------------------------------------------------

    def save(self, state: dict[str, Any], step: int, meta: dict[str, Any] | None = None, *,
             shards: ShardedSave | None = None) -> SaveResult:
        """Write ``state`` as the checkpoint of ``step`` unless it is non-finite; move LAST_GOOD; prune.

        ``meta`` (JSON-able; e.g. ``{"config": config_to_dict(cfg), "config_hash": ...}``) goes into
        meta.json beside the manager's own keys. Returns ``withheld=True`` (writing nothing) when a
        tensor in ``require_finite`` is NaN/Inf; ``reason`` names its key path. Raises CheckpointError
        when writing or verifying fails (disk full, bytes read back differ); the previous checkpoint
        and LAST_GOOD are then untouched. Waits for a save in flight first. Forces one host-device sync
        for the finiteness check, and torch.save copies device tensors to the host. ``shards``: a sharded save's DCP
        part, written (``shards.written``): state.pt goes beside it, as :meth:`save_async` has the writer do.
        """
        self.wait()
        meta = checked_meta(step, meta)
        timings: dict[str, float] = dict(shards.timings) if shards is not None else {}
        if shards is not None:
            dcp = shards_written(shards, self.root / dir_name(step), timings)
            return self.write_staged(state, step, meta, timings, tmp=shards.tmp, dcp=dcp, check=True)
        withheld = self._check(state, step, timings)
        return withheld if withheld is not None else self.write_staged(state, step, meta, timings)

    def save_async(self, state: dict[str, Any], step: int, meta: dict[str, Any] | None = None, *,
                   shards: ShardedSave | None = None) -> PendingSave:
        """:meth:`save`, blocking only for the staging copy; the writer process checks, writes and installs it.

        Waits first for the save in flight (one at a time). Then copies ``state`` into the manager's shared
        block (:class:`~.arena.SharedStager`; from CUDA page-locked and non-blocking: no host-device sync)
        and hands it to the writer process (:mod:`.writer`, started by the first save), which checks the
        copy (a non-finite one is withheld there: nothing is written), writes, verifies, moves LAST_GOOD
        and prunes. ``state`` may change as soon as this returns. ``result()`` of the returned
        :class:`PendingSave` gives the :class:`SaveResult` or raises the CheckpointError :meth:`save` would
        have raised (or one saying the writer died: LAST_GOOD is then where the writer left it, a whole
        checkpoint); its timings add ``stage_s`` and ``send_s``. A writer that cannot start is a
        CheckpointError here.

        ``shards``: the DCP save of the model and optimizer into :meth:`begin_sharded`'s directory (its
        ``state`` entries are markers); a helper thread waits for it and checks it before the writer is asked
        to write state.pt beside it.
        """
        if shards is None:
            self.wait()
        elif self._in_flight is not None:
            raise RuntimeError("save_async(shards=...): a save is still in flight; begin_sharded waits for it")
        meta = checked_meta(step, meta)
        timings: dict[str, float] = dict(shards.timings) if shards is not None else {}
        self._in_flight = pending = self._background.start(state, step, meta, timings, shards)
        return pending

    def begin_sharded(self, step: int) -> Path:
        """Return the empty temporary directory of ``step``'s checkpoint, with its ``dcp/`` folder, for the shards.

        Waits for the save in flight and cleans up debris first. Every rank writes its shards into
        ``dcp/``; then :meth:`save_async` with ``shards=`` finishes the checkpoint there.
        """
        self.wait()
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean_debris()
        tmp = self.root / f"{dir_name(step)}.tmp-{os.getpid()}"
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
        """Host memory held by :meth:`save_async`'s shared block (a copy of the last state it saved)."""
        return self._background.num_bytes

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

    def write_staged(self, state: dict[str, Any], step: int, meta: dict[str, Any], timings: dict[str, float], *,
                     tmp: str | Path | None = None, dcp: dict[str, Any] | None = None, check: bool = False) -> SaveResult:
        """Write ``state`` (never changing meanwhile), verify, install, point LAST_GOOD, prune.

        What :meth:`save` does after its check, and what the writer process does for :meth:`save_async`
        (``check``: the finiteness check first; a non-finite state is withheld, its ``tmp`` removed).
        ``tmp`` and ``dcp``: a sharded save's directory (from :meth:`begin_sharded`, its shards complete)
        and meta.json's "dcp" for it.
        """
        if check:
            withheld = self._check(state, step, timings)
            if withheld is not None:
                if tmp is not None:
                    shutil.rmtree(tmp, ignore_errors=True)
                return withheld
        cpu0 = time.thread_time()
        if tmp is None:  # (begin_sharded did this before the shards were written)
            self.root.mkdir(parents=True, exist_ok=True)
            self.clean_debris()
        name = dir_name(step)
        final = self.root / name
        tmp = Path(tmp) if tmp is not None else self.root / f"{name}.tmp-{os.getpid()}"
        aside: Path | None = None
        installed = False
        try:
            if dcp is None:
                tmp.mkdir()
            else:
                meta = {**meta, "dcp": dcp}
            t0 = time.perf_counter()
            num_bytes = write_files(tmp, state, step, meta)
            timings["write_s"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            self._written = (tmp, only_plain(state))  # checksummed as written, checked finite before: verify() skips those
            try:
                problems = self.verify(tmp)
            finally:
                self._written = None
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
                if installed:
                    raise CheckpointError(f"checkpoint {final} was written and verified, but LAST_GOOD could not be moved to "
                                          f"it ({err}); LAST_GOOD still names {good.name if good else 'nothing'}", final) from err
                raise CheckpointError(f"writing checkpoint {final} failed: {err}; " + (
                    f"the previous checkpoint ({good.name}) and LAST_GOOD are untouched" if good else
                    "no checkpoint was written before it"), final) from err
            raise
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        t0 = time.perf_counter()
        pruned = self.prune()
        timings["prune_s"] = time.perf_counter() - t0
        size = num_bytes + int(meta.get("dcp", {}).get("bytes", 0))
        return SaveResult(step, final, False,
                          f"saved {name} ({f'{size / 2**20:.1f} MiB' if size >= 2**20 else f'{size / 2**10:.1f} KiB'}, "
                          f"verified); LAST_GOOD -> {name}",
                          num_bytes=size, timings=timings, pruned=tuple(pruned), write_cpu_s=time.thread_time() - cpu0)

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

        Never deletes the one LAST_GOOD names, nor the newest written before a run of skipped steps (its meta.json's
        ``after_skips`` below 2) where the newer ones were written after one (a run that diverged to its end: its last
        save is LAST_GOOD, the state before the divergence is kept). Checkpoints newer than LAST_GOOD (never marked
        good, e.g. from a crash between rename and LAST_GOOD, or from before a rollback) are left alone and not
        counted; :meth:`discard_after` removes them.
        """
        good = self.latest_good()
        if good is None:
            return []
        limit = step_of(good)
        ranked = [d for d in self.checkpoints() if step_of(d) <= limit]
        before_skips = next((d for d in ranked if _after_skips(d) < SKIPS_RUN), None)  # (ranked: newest first)
        removed = []
        for d in ranked[self.keep:]:
            if d != good and d != before_skips:
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
        keep = [d for d in self.checkpoints() if step_of(d) <= step]
        target = next((d for d in keep if not self.verify(d)), None)
        if target is None:
            raise CheckpointError(f"no checkpoint at or before step {step} in {self.root} verifies; nothing discarded",
                                  self.root)
        self._point_last_good(target.name)
        removed = [d for d in self.checkpoints() if step_of(d) > step]
        for d in removed:
            _remove_tree(d)
        fsync_dir(self.root)
        return removed

    def set_aside(self, path: str | Path, folder: str = "distrusted") -> tuple[Path, Path]:
        """Take checkpoint ``path`` out of use, kept whole in ``root/folder/``; LAST_GOOD moves to the newest older
        one that verifies. Return (where ``path`` went, the new LAST_GOOD).

        Raises CheckpointError, changing nothing, when no older checkpoint verifies. Waits for a save in flight.
        """
        self.wait()
        path = Path(path)
        older = next((d for d in self.checkpoints() if step_of(d) < step_of(path) and not self.verify(d)), None)
        if older is None:
            raise CheckpointError(f"no checkpoint older than {path.name} in {self.root} verifies", self.root)
        self._point_last_good(older.name)  # first: a crash before the move leaves path newer than LAST_GOOD, unused
        dest = self.root / folder / path.name
        while dest.exists():
            dest = dest.with_name(dest.name + "+")
        dest.parent.mkdir(exist_ok=True)
        os.replace(path, dest)
        fsync_dir(self.root)
        return dest, older

    # -- reading ----------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Return the checkpoint directories (``step_N``), newest (highest step) first. Verifies nothing."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if _FINAL.match(p.name) and p.is_dir()]
        return sorted(found, key=step_of, reverse=True)

    def good_before(self, step: int) -> list[Path]:
        """Return the checkpoint directories before ``step`` that LAST_GOOD covers (none newer than it), newest
        first; [] without a LAST_GOOD. Verifies nothing (:meth:`load` each)."""
        good = self.latest_good()
        if good is None:
            return []
        limit = step_of(good)
        return [d for d in self.checkpoints() if step_of(d) <= limit and step_of(d) < step]

    def latest_good(self) -> Path | None:
        """Return the directory LAST_GOOD names, or None (no LAST_GOOD, or it names no directory).

        Verifies nothing and does not wait for a save in flight (:meth:`wait` first to see its outcome).
        """
        name, _ = self._read_last_good()
        return self.root / name if name is not None and (self.root / name).is_dir() else None

    def named_step(self) -> int | None:
        """The step of the checkpoint LAST_GOOD names, whether or not its directory is there (None: it names none)."""
        try:
            found = _FINAL.match((self.root / LAST_GOOD).read_text(encoding="utf-8").strip())
        except (OSError, UnicodeDecodeError):
            return None
        return int(found.group(1)) if found else None

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
        """Return the problems of checkpoint directory ``path``; empty when it is good (see :func:`.files.load_checked`).

        Reads the whole state.pt twice (its CRC32, then a memory-mapped load); of the DCP folder ``.metadata``, the
        file sizes and each shard's CRC32. The directory a save has just written (in the save's own thread)
        is checked without the checksums and the finiteness pass (``load_checked(written=True)``), and without
        the pickle scan when its state was plain tensors, numbers and containers (``plain=True``).
        """
        try:
            written = self._written is not None and Path(path) == self._written[0]
            load_checked(Path(path), self.require_finite, mmap=True, written=written,
                         plain=written and self._written[1])
        except CheckpointError as err:
            return err.problems or [str(err)]
        return []

    def load(self, path: str | Path | None = None, *, map_location: Any = "cpu",
             on_problem: Callable[[str], None] | None = None, full: bool = False,
             verified: bool = False) -> LoadedCheckpoint:
        """Load and verify a checkpoint: ``path`` if given, else LAST_GOOD, falling back to older ones.

        Each checkpoint skipped (truncated, corrupted, refused, non-finite) is reported to
        ``on_problem`` and listed in the result's ``problems``. Checkpoints newer than LAST_GOOD were
        never marked good and are not used. An explicit ``path`` that fails, or no checkpoint that
        verifies, raises CheckpointError naming the directory and every problem. Without ``path``, waits
        for a save in flight first (LAST_GOOD may be about to move). ``full``: a sharded (DCP) checkpoint's
        model and optimizer are read whole, in this process, into the format of a full checkpoint
        (otherwise its state holds markers that :meth:`Trainer.load_state_dict` reads shard by shard).
        ``verified``: ``path`` was verified whole just now by another process (rank 0, which chose it):
        state.pt is memory-mapped and only its meta.json and size are checked (``load_checked(verified=True)``),
        so its tensors are read from the page cache only where this process uses them (under FSDP2, none of
        the model's and optimizer's: rank 0 broadcasts them), not copied into this process's memory whole.
        """
        problems: list[str] = []

        def report(problem: str) -> None:
            problems.append(problem)
            if on_problem is not None:
                on_problem(problem)

        if path is not None:
            path = Path(path)
            if verified and map_location != "cpu":
                raise ValueError(f"load(verified=True) memory-maps state.pt on the CPU; got map_location={map_location!r}")
            state, meta = load_checked(path, self.require_finite, map_location, mmap=verified, verified=verified)
            return LoadedCheckpoint(to_full_state(state) if full else state, meta, path, problems)
        self.wait()

        all_dirs = self.checkpoints()
        name, problem = self._read_last_good()
        if problem is not None and (all_dirs or (self.root / LAST_GOOD).exists()):
            report(problem + "; trying the newest checkpoints")
        if name is not None:
            good = self.root / name
            limit = step_of(good)
            for d in all_dirs:
                if step_of(d) > limit:
                    report(f"{d.name}: newer than LAST_GOOD ({name}); not used (written by a save that crashed "
                           "before LAST_GOOD moved, or left from before a rollback)")
            candidates = [good] + [d for d in all_dirs if step_of(d) < limit]
        else:
            candidates = all_dirs
        for d in candidates:
            try:
                state, meta = load_checked(d, self.require_finite, map_location)
            except CheckpointError as err:
                report(err.problems[0] if err.problems else str(err))
                continue
            return LoadedCheckpoint(to_full_state(state) if full else state, meta, d, problems)
        if not candidates:
            raise CheckpointError(f"no checkpoint in {self.root}" + (f" ({'; '.join(problems)})" if problems else ""),
                                  self.root, problems)
        raise CheckpointError(f"no checkpoint in {self.root} verifies:\n  " + "\n  ".join(problems)
                              + "\nresume from another run directory or start a new run", self.root, problems)


def _after_skips(path: Path) -> int:
    """How many skipped steps in a row a checkpoint was saved after (its meta.json's ``after_skips``; 0 when unrecorded)."""
    try:
        return int(json.loads((path / META_FILE).read_text(encoding="utf-8")).get("after_skips") or 0)
    except (OSError, ValueError, TypeError, AttributeError):  # (unreadable, or not the dict it should be: no run)
        return 0


def step_of(path: Path) -> int:
    """The step of a checkpoint directory ``step_000100`` (or one set aside, ``step_000100.replaced-7``): 100."""
    return int(path.name.split(".", 1)[0].removeprefix("step_"))

