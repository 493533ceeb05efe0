"""One checkpoint directory's files: state.pt and meta.json, how they are written, checked and loaded.

``state.pt`` is written by :func:`~.checksummed.save_checksummed`, which takes the CRC32 of the bytes as
they pass, so its checksum and size go into meta.json without reading the file back. Loading never executes code: every file goes
through ``torch.load(weights_only=True)``, and a file that needs more (a pickled class or function)
is refused with a message saying so. :func:`load_checked` is the one definition of a good
checkpoint directory: what verification and loading both apply.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import pickle
import re
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..._version import __version__
from ...config import dotted_key
from ...fileio import atomic_write
from ...internals import tree_flatten_with_keys
from ..staging import state_bytes
from .checksummed import save_checksummed
from .shards import attach_path, verify_dcp

__all__ = ["CheckpointError", "dir_name", "first_nonfinite", "only_plain", "load_state_file", "load_checked", "write_files",
           "checked_meta", "STATE_FILE", "META_FILE", "FORMAT_VERSION"]

#: meta.json's "format". 2: state.pt's checksum is ``state_crc32`` (zlib's CRC32, 8 hex digits); 1 recorded
#: ``state_sha256`` instead (still loaded). A newer format is refused with a line saying so.
FORMAT_VERSION = 2
STATE_FILE = "state.pt"
META_FILE = "meta.json"

_CHUNK = 8 << 20  # bytes per read when checksumming a file
_CHECKSUMS = ("crc32", "sha256")  # meta.json's state_<kind>: this format's, then format 1's

# Keys written into meta.json beside the caller's meta, which may not use them.
_RESERVED_META = ("format", "step", "time", "unix_time", "state_file", "state_crc32", "state_sha256",
                 "state_bytes", "versions")


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
    for path, leaf in tree_flatten_with_keys(obj)[0]:
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
        items = [(k, state[k]) for k in scope]
    else:
        items = list(state.items())
    if _all_finite([v for _, v in items]):  # the common case, without a key path per leaf (1.4 ms of 2.2 on a gpt)
        return None
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


def _finite_norms(groups: dict[tuple[torch.device, torch.dtype], list[Tensor]]) -> list[list[bool]]:
    """Per group, whether each tensor's L2 norm is finite: one fused kernel and one host read per group.

    The norm is finite whenever every element is, unless it overflows: it can only flag too much.
    """
    return [torch.isfinite(torch.stack(torch._foreach_norm(ts, 2, dtype=acc))).tolist()  # sync
            for (_, acc), ts in groups.items()]


def _all_finite(trees: list[Any]) -> bool:
    """Whether every float and floating tensor in ``trees`` (dicts, lists, tuples) is finite; False when unsure.

    A plain walk without key paths, for the common case; :func:`first_nonfinite` names the culprit otherwise.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    stack = list(trees)
    while stack:
        x = stack.pop()
        if isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend(x)
        elif isinstance(x, Tensor):
            if x.numel() and (x.is_floating_point() or x.is_complex()):
                t = torch.view_as_real(x.detach()) if x.is_complex() else x.detach()
                groups.setdefault((t.device, torch.float64 if t.dtype == torch.float64 else torch.float32), []).append(t)
        elif isinstance(x, float) and not math.isfinite(x):
            return False
    return all(all(flags) for flags in _finite_norms(groups))


_PLAIN_LEAVES = frozenset((int, float, bool, str, type(None)))


def only_plain(state: Any) -> bool:
    """Whether ``state`` holds only dicts, lists and tuples of plain CPU tensors, numbers, strings and None.

    Such a state's pickle names no global that ``torch.load(weights_only=True)`` refuses (the tensor rebuild
    functions, storage types and OrderedDict are admitted by design), so it need not be scanned for one.
    Anything else (a tensor subclass or one with attributes, another layout or device, bytes, an object) is
    False: the written file's pickle is then scanned. A walk over the containers, no tensor data read.
    """
    stack = [state]
    while stack:
        x = stack.pop()
        t = type(x)
        if t in _PLAIN_LEAVES:
            continue
        if t is Tensor:
            if x.device.type != "cpu" or x.layout != torch.strided or x.is_quantized or x.__dict__:
                return False
        elif t is dict or t is OrderedDict:
            if not _PLAIN_LEAVES.issuperset(map(type, x)):  # keys
                return False
            stack.extend(x.values())
        elif t is list or t is tuple:
            stack.extend(x)
        else:
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Writing


def dir_name(step: int) -> str:
    """The name of ``step``'s checkpoint directory (``step_000100``)."""
    return f"step_{step:06d}"


def checked_meta(step: int, meta: dict[str, Any] | None) -> dict[str, Any]:
    """Return a copy of the caller's ``meta``; a bad ``step`` or a key meta.json reserves is a ValueError."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step: expected an integer >= 0, got {step!r}")
    meta = dict(meta or {})
    clash = [k for k in _RESERVED_META if k in meta]
    if clash:
        raise ValueError(f"meta: keys {', '.join(clash)} are written by the checkpoint manager; rename them")
    return meta


def write_files(folder: Path, state: dict[str, Any], step: int, meta: dict[str, Any]) -> int:
    """Write ``state`` to ``folder``/state.pt and its meta.json (each atomically, fsynced); return state.pt's size.

    meta.json holds the step, the time, state.pt's CRC32 and size, the versions, and ``meta``. An
    OSError is the disk's own (ENOSPC, EIO, EFBIG), not torch's rewording of it. A state whose tensors alone
    exceed the space left is refused with ENOSPC before a byte is written: a partial file would take the
    last of it from the run's own logs while it is written (by the writer process, beside the training loop).
    """
    need, stat = state_bytes(state), os.statvfs(folder)
    if need > stat.f_bavail * stat.f_frsize:
        raise OSError(errno.ENOSPC, f"{os.strerror(errno.ENOSPC)} ({need / 2**20:.2f} MiB of tensors, "
                                    f"{stat.f_bavail * stat.f_frsize / 2**20:.2f} MiB free)", str(folder / STATE_FILE))
    written: list[tuple[int, int]] = []
    atomic_write(folder / STATE_FILE, lambda fh: written.append(save_checksummed(state, fh)))
    crc, num_bytes = written[0]
    full_meta = {
        "format": FORMAT_VERSION, "step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "unix_time": round(time.time(), 3), "state_file": STATE_FILE,
        "state_crc32": f"{crc:08x}", "state_bytes": num_bytes,
        "versions": {"torch": torch.__version__, "stabletrain": __version__}, **meta,
    }
    atomic_write(folder / META_FILE, json.dumps(full_meta, indent=2, default=str) + "\n")  # also fsyncs folder/
    return num_bytes


# ---------------------------------------------------------------------------------------------
# Reading


def _checksum_of(path: Path, kind: str) -> str:
    """Return the ``kind`` ("crc32" or "sha256") of the file at ``path`` as meta.json writes it (hex digits)."""
    crc, sha = 0, hashlib.sha256() if kind == "sha256" else None
    with open(path, "rb", buffering=0) as fh:
        buf = memoryview(bytearray(_CHUNK))
        while n := fh.readinto(buf):
            if sha is not None:
                sha.update(buf[:n])
            else:
                crc = zlib.crc32(buf[:n], crc)
    return sha.hexdigest() if sha is not None else f"{crc:08x}"


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
        detail = _refusal(what)
        raise CheckpointError(f"{path}: {detail}", path, [detail]) from None


def _check_archive(state_path: Path, fail: Any) -> None:
    """Raise ``fail(problem)`` unless state.pt is an archive whose pickle ``weights_only`` admits (tensors not read)."""
    try:
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(state_path))
    except Exception as err:  # noqa: BLE001  (a bad archive: torch raises RuntimeError, ValueError, ...)
        raise fail(f"{STATE_FILE} cannot be loaded ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if unsafe:
        raise fail(f"{STATE_FILE} {_refusal(f'the global {unsafe[0]}')}")


def _refusal(what: str) -> str:
    return (f"refused: it pickles {what}, so loading it would execute code; stabletrain loads only tensors, "
            "numbers, strings and containers (torch.load(weights_only=True)). If you wrote this file and "
            "trust it, re-save its contents as plain tensors and containers")


def load_checked(path: Path, require_finite: Sequence[str] | None, map_location: Any = "cpu",
                 mmap: bool = False, *, written: bool = False, plain: bool = False,
                 verified: bool = False) -> tuple[Any, dict[str, Any]]:
    """Load checkpoint directory ``path`` and return (state, meta) if it is good, else raise CheckpointError.

    Good means: meta.json readable (a format this version reads), state.pt of the recorded size and
    checksum (CRC32; a format-1 checkpoint's sha256), loadable with
    ``weights_only=True``, and the ``require_finite`` tensors finite (None: every one); a sharded
    checkpoint's DCP folder complete (:func:`~stabletrain.records.checkpoint.shards.verify_dcp`).
    The error's ``problems`` holds one line, prefixed with the directory's name.

    ``written``: ``path`` was just written by :func:`write_files` in this process, from a state whose
    ``require_finite`` tensors were checked before: its CRC32 is that of the bytes as they were written,
    so neither the checksum nor the finiteness is taken again (a second full read of state.pt, and a pass over
    every tensor), and instead of loading it the archive's pickle is scanned for what ``weights_only``
    refuses (``torch.serialization.get_unsafe_globals_in_checkpoint``: a tenth of the load's time on a
    model's state); meta.json, the size and the DCP folder are checked as always. Returns (None, meta).
    Every later load (resume, rollback) checks it whole. ``plain`` (with ``written``): that state was
    :func:`only_plain`, so its pickle is not scanned either.

    ``verified``: another process checked ``path`` whole just now (rank 0, which chose it): meta.json and
    the size are checked again, the checksum and the finiteness not (with ``mmap``, a tensor's bytes are then
    read only where it is used).
    """
    def fail(problem: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {problem}", path, [f"{path.name}: {problem}"])

    try:
        meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise fail(f"{META_FILE} is missing (the write did not finish?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise fail(f"{META_FILE} is unreadable ({err})") from None
    kind = next((k for k in _CHECKSUMS if isinstance(meta, dict) and f"state_{k}" in meta), None)
    if kind is None or not {"state_bytes", "step"} <= meta.keys():
        raise fail(f"{META_FILE} lacks step, state_bytes or a checksum (state_crc32; format 1: state_sha256)")
    if not isinstance(meta.get("format", 1), int) or meta.get("format", 1) > FORMAT_VERSION:
        raise fail(f"{META_FILE} is format {meta.get('format')!r}, newer than this stabletrain reads "
                   f"({FORMAT_VERSION}, stabletrain {__version__}); load it with the version that wrote it "
                   f"({meta.get('versions', {}).get('stabletrain', 'see versions in meta.json')})")
    state_path = path / STATE_FILE
    try:
        size = state_path.stat().st_size
    except FileNotFoundError:
        raise fail(f"{STATE_FILE} is missing") from None
    if size != meta["state_bytes"]:
        raise fail(f"{STATE_FILE} is {size} bytes, {META_FILE} says {meta['state_bytes']} (truncated or overwritten)")
    if written:
        if not plain:
            _check_archive(state_path, fail)
        if "dcp" in meta:  # (its shards' CRC32s were taken from the files just written: not read again)
            problems = verify_dcp(path, meta["dcp"], checksums=False)
            if problems:
                raise fail("; ".join(problems))
        return None, meta
    if not verified and _checksum_of(state_path, kind) != meta[f"state_{kind}"]:
        raise fail(f"{STATE_FILE} does not match its {kind} in {META_FILE} (corrupted on disk or in transfer)")
    try:
        state = load_state_file(state_path, map_location, mmap=mmap)
    except CheckpointError as err:
        raise fail(f"{STATE_FILE} {err.problems[0]}") from None
    except Exception as err:  # noqa: BLE001  (torch raises RuntimeError, EOFError, ... on bad archives)
        raise fail(f"{STATE_FILE} cannot be loaded ({type(err).__name__}: {str(err).splitlines()[0]})") from None
    if not isinstance(state, dict):
        raise fail(f"{STATE_FILE} holds a {type(state).__name__}, expected a dict")
    try:
        bad = None if verified else first_nonfinite(state, require_finite)
    except ValueError as err:
        raise fail(str(err)) from None
    if bad is not None:
        raise fail(f"{bad} is not finite (NaN/Inf)")
    if "dcp" in meta:  # the model's and optimizer's shards, in the DCP folder beside state.pt (CRC32s: unless verified)
        problems = verify_dcp(path, meta["dcp"], checksums=not verified)
        if problems:
            raise fail("; ".join(problems))
        attach_path(state, path, meta["dcp"])
    return state, meta
