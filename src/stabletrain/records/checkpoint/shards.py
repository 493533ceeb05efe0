"""Sharded, asynchronous checkpoints through ``torch.distributed.checkpoint`` (DCP), for FSDP2.

Under ``dist.strategy=fsdp`` with more than one process (and ``dist.checkpoint=sharded``, the
default) each rank writes its own shards of the model and optimizer; nothing is gathered::

    RUN_DIR/checkpoints/step_000100/
        state.pt     rank 0's small state: schedule, precision, guard, metrics, counters, callbacks, every
                     rank's RNG and data position; the model and optimizer entries are markers (their
                     non-tensor leaves, and the keys of their tensors in the DCP folder)
        meta.json    as for any checkpoint, plus "dcp": the folder, every tensor key, each shard file's
                     size and CRC32 (each rank checksums its own), the sha256 of .metadata
        dcp/.metadata, dcp/__0_0.distcp, dcp/__1_0.distcp     one shard file per rank

One save (DESIGN.md, principle 4: nothing bad is persisted)::

    every rank: model/optimizer sharded state dicts (DTensors; no collective, no copy)
    every rank: its first non-finite shard, gathered with the RNG states  # any -> withheld on every rank
    rank 0: wait for the save in flight, create step_N.tmp-<pid>/dcp, name it  # one broadcast
    every rank: dcp.async_save, process-based (dcp_process)                 # blocks for the staging copy only
    rank 0 (CheckpointManager): a helper thread waits for its DCP save; then the writer process writes
        state.pt and meta.json, verifies (.metadata names every key, every shard file it references is
        there), renames, moves LAST_GOOD (before any save in the background, a small last or first one:
        dcp.save, rank 0 writes the rest in the loop's thread: no process started for it, ~3 CPU-s each)

DCP's save gathers every rank's write results to rank 0, which writes ``.metadata`` only when every
rank's writes succeeded (a failure on any rank raises on all of them): rank 0's save completing means
every rank's shards are on disk. Each rank's shards are written by a checkpoint process of its own
(:mod:`.dcp_process`), whose collectives run on a gloo group of those processes, apart from training's;
the first save broadcasts their address on a group of its own (``dist.new_group(backend="gloo")``).

Loading never executes code: ``.metadata`` (a pickle) is read with an unpickler that accepts only
DCP's metadata classes, after its sha256 matched meta.json; tensors are read by DCP's
``torch.load(weights_only=True)``; only tensors go into the DCP folder (every other leaf is in
state.pt). A DCP checkpoint loads under FSDP at any world size (DCP reshards) and under DDP or one
process (plain tensors): the keys are the model's FQNs, the same under every strategy.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import pickle
import threading
import time
import warnings
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...config import dotted_key
from ...internals import tree_flatten_with_keys, tree_unflatten
from .saves import is_save_failure, run_now

__all__ = [
    "DCP_DIR",
    "ShardedSave",
    "ShardedSaver",
    "attach_path",
    "is_dcp_entry",
    "load_dcp_state_dicts",
    "local_tensors",
    "read_full_tensors",
    "sharded_state_dicts",
    "split_for_dcp",
    "to_full_state",
    "verify_dcp",
]

DCP_DIR = "dcp"
FORMAT = "dcp"  # the ``format`` of a model/optimizer marker in state.pt
METADATA = ".metadata"


# -- state dicts ----------------------------------------------------------------------------------------

def sharded_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return DCP's sharded model and optimizer state dicts: FQN keys, DTensor values (live views; no collective).

    An optimizer that has not stepped is returned as ``optimizer.state_dict()`` (no per-parameter state):
    torch's ``get_optimizer_state_dict`` would first run a zero-lr step to create the state, which
    advances Adam's step count (see :func:`stabletrain.distributed.fsdp.full_state_dicts`).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(model)
    if not optimizer.state:  # the same on every rank: they step together
        return model_state, optimizer.state_dict()
    return model_state, get_optimizer_state_dict(model, optimizer)


def _is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)


def _flatten(tree: Any, prefix: str) -> list[tuple[str, Any]]:
    return [(dotted_key(path, prefix), leaf) for path, leaf in tree_flatten_with_keys(tree)[0]]


def _marker(tree: Any, prefix: str, tensors: dict[str, Tensor]) -> dict[str, Any]:
    """Move ``tree``'s tensor leaves into ``tensors`` (by dotted key); return the marker that stays in state.pt."""
    leaves, spec = tree_flatten_with_keys(tree)
    keys, skeleton = [], []
    for path, leaf in leaves:
        if _is_tensor(leaf):
            key = dotted_key(path, prefix)
            tensors[key] = leaf
            keys.append(key)
            skeleton.append(None)
        else:
            skeleton.append(leaf)
    return {"format": FORMAT, "tree": tree_unflatten(skeleton, spec), "tensors": keys}


def is_dcp_entry(entry: Any) -> bool:
    """Whether a state dict's ``model`` or ``optimizer`` entry is a marker of tensors kept in a DCP folder."""
    return isinstance(entry, dict) and entry.get("format") == FORMAT and "tensors" in entry


def split_for_dcp(state: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """Return (the model and optimizer tensors by dotted key, for DCP; ``state`` with markers in their place).

    An unstepped optimizer's plain ``state_dict()`` (see :func:`sharded_state_dicts`) stays in the state as it is.
    """
    tensors: dict[str, Tensor] = {}
    out = {**state, "model": _marker(state["model"], "model", tensors)}
    optim = state["optimizer"]
    if optim.get("state"):  # FQN-keyed, from get_optimizer_state_dict
        out["optimizer"] = _marker(optim, "optimizer", tensors)
    return tensors, out


def local_tensors(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Return ``tensors`` with each DTensor replaced by this rank's local shard (a view): for a check without collectives."""
    return {k: (t.to_local() if hasattr(t, "to_local") else t) for k, t in tensors.items()}


# -- saving ---------------------------------------------------------------------------------------------

#: The slowest read a rank's shard checksum is waited for at (bytes per second; beside ``dist.timeout_s``).
CRC_READ_BYTES_S = 50e6


class ShardedSave:
    """One rank's DCP save in flight: ``tmp`` (the checkpoint's temporary directory), its future and timings.

    Each rank checksums its own shard files once its write is done (a thread: :meth:`checksum`) and leaves their CRC32s
    beside them; rank 0 gathers those into meta.json (:meth:`finish`): no process reads every rank's shards back.
    """

    def __init__(self, step: int, tmp: Path, keys: list[str], future: Any, timings: dict[str, float],
                 rank: int = 0, world: int = 1, timeout_s: float = 120.0, written: bool = False) -> None:
        self.step, self.tmp, self.keys, self.future, self.timings = step, tmp, keys, future, timings
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.written = written  # written before the save started (dcp.save): rank 0 may write the rest in its loop
        self.checksums = threading.Thread(target=self.checksum, name=f"stabletrain-shard-crc32-{rank}", daemon=True)
        self.checksums.start()

    def checksum(self) -> None:
        """Wait for this rank's write; then write the CRC32 of each of its shard files (DCP's ``__RANK_N``) to
        ``dcp/.crc32.RANK.json``. A failed write leaves none (its failure is rank 0's outcome)."""
        try:
            self.future.result()
        except BaseException:  # noqa: BLE001  (DCP's CheckpointException is one: saves.is_save_failure)
            return
        folder = self.tmp / DCP_DIR
        with contextlib.suppress(OSError):  # (the save failed on rank 0 and its directory is gone)
            crcs = {p.name: _crc32(p) for p in sorted(folder.glob(f"__{self.rank}_*.distcp"))}
            part = folder / f".crc32.{self.rank}.json.tmp"
            part.write_text(json.dumps(crcs))
            os.replace(part, folder / f".crc32.{self.rank}.json")

    def _gathered(self, folder: Path, nbytes: int) -> dict[str, str]:
        """Every rank's shard CRC32s (:meth:`checksum`), waited for up to ``timeout_s`` and the time to read ``nbytes``
        at :data:`CRC_READ_BYTES_S` (a large shard out of the page cache, on a network file system); their files removed."""
        start = time.monotonic()
        deadline, out = start + self.timeout_s + nbytes / CRC_READ_BYTES_S, {}
        for rank in range(self.world):
            path = folder / f".crc32.{rank}.json"
            while not path.is_file():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank}'s shard checksums did not arrive within {deadline - start:,.1f} s")
                time.sleep(0.005)
            out.update(json.loads(path.read_text()))
            path.unlink()
        return out

    def finish(self, timings: dict[str, float]) -> dict[str, Any]:
        """Wait for the save (rank 0: every rank's shards written and .metadata complete); return meta.json's "dcp".

        Raises what DCP raised (a rank's write failed), or RuntimeError naming what is missing.
        """
        t0 = time.perf_counter()
        self.future.result()
        timings["shard_write_s"] = time.perf_counter() - t0
        folder = self.tmp / DCP_DIR
        if not (folder / METADATA).is_file():
            raise RuntimeError(f"{DCP_DIR}/{METADATA} is missing after the sharded save finished")
        metadata = read_metadata(folder / METADATA)
        files: dict[str, int] = {}
        for info in metadata.storage_data.values():
            files[info.relative_path] = (folder / info.relative_path).stat().st_size
        crcs = self._gathered(folder, sum(files.values()))  # (each shard's bytes, as state.pt's; by the rank that wrote it)
        return {"dir": DCP_DIR, "keys": self.keys, "files": dict(sorted(files.items())),
                "bytes": sum(files.values()), "metadata_sha256": _sha256(folder / METADATA),
                "crc32": {name: crcs[name] for name in sorted(files) if name in crcs}}


class ShardedSaver:
    """Every rank's side of DCP saves: a dedicated gloo group, a reused staging copy, at most one save in flight.

    Creating it is a collective (``dist.new_group``): every rank constructs it at the same point.
    ``timeout_s`` bounds how long a save waits for a peer (``dist.timeout_s``: a dead rank fails it).
    """

    def __init__(self, timeout_s: float = 120.0) -> None:
        import datetime

        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError as err:  # torch < 2.9; the rest of stabletrain needs 2.6 (pyproject.toml)
            raise ValueError(f"config key 'dist.checkpoint': sharded needs torch>=2.9 (DCP's DefaultStager), and this "
                             f"is torch {torch.__version__}; upgrade torch or use dist.checkpoint=full") from err

        # async_save's first save broadcasts its checkpoint processes' address on it (their own gloo group does the
        # rest): a group of its own keeps that apart from training's collectives.
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.timeout_s = timeout_s
        # Reused across saves: the staging buffers of the same tensors are copied into, not reallocated; in shared
        # memory, which DCP's checkpoint process (dcp_process) reads them from.
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                                                   use_async_staging=False, use_non_blocking_copy=False))
        self.in_flight: ShardedSave | None = None
        self.synchronous = False  # DCP's background staging failed once: each save is written before start returns
        self.background = False  # a save went to DCP's checkpoint processes (started by the first)

    def start(self, tensors: dict[str, Tensor], tmp: Path, step: int, *, inline_bytes: int = -1) -> ShardedSave:
        """Stage ``tensors`` (blocking) and write them to ``tmp/dcp``, in the background unless small; every rank calls it.

        Waits for this rank's save in flight first. Before any save in the background, tensors of at most ``inline_bytes``
        (in all: the same on every rank) are written before this returns (``ShardedSave.written``), no process started."""
        import torch.distributed.checkpoint as dcp

        from .dcp_process import PROCESS, planner

        self.wait()
        t0 = time.perf_counter()
        writer = dcp.FileSystemWriter(str(tmp / DCP_DIR))
        written = self.synchronous or (not self.background and  # (a DTensor's size: the whole tensor's)
                                       sum(t.numel() * t.element_size() for t in tensors.values()) <= inline_bytes)
        if written:
            future = run_now(lambda: dcp.save(tensors, storage_writer=writer, process_group=self.group, planner=planner()))
        else:
            try:
                self.background = True
                future = dcp.async_save(tensors, storage_writer=writer, process_group=self.group,
                                        async_stager=self.stager, planner=planner(), async_checkpointer_type=PROCESS)
            except (KeyError, TypeError) as err:  # DCP's staging copy failed (every rank alike) before any collective
                # torch 2.11's stager cannot deep-copy a CUDA DTensor's pickled form (KeyError: <class 'type'>): save
                # in the loop's thread from now on (training waits for the write), said once
                from ...console import StableTrainWarning

                self.synchronous = True
                warnings.warn(f"sharded checkpoints: DCP's background staging failed on torch {torch.__version__} "
                              f"({type(err).__name__}: {err}); they are written synchronously from now on (training "
                              "waits for each write)", StableTrainWarning, stacklevel=2)
                future = run_now(lambda: dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(tmp / DCP_DIR)),
                                                  process_group=self.group, planner=planner()))
        timings = {"shard_stage_s": time.perf_counter() - t0}
        self.in_flight = ShardedSave(step, tmp, sorted(tensors), future, timings, rank=dist.get_rank(self.group),
                                     world=dist.get_world_size(self.group), timeout_s=self.timeout_s, written=written)
        return self.in_flight

    def wait(self) -> None:
        """Wait for this rank's save in flight, if any. Raises nothing: rank 0's outcome reports a failure."""
        pending, self.in_flight = self.in_flight, None
        if pending is not None:
            try:
                pending.future.result()
            except BaseException as err:  # (the same failure reaches rank 0, which records it)
                if not is_save_failure(err):
                    raise
            pending.checksums.join()  # (rank 0's outcome waits for this rank's checksums)


# -- verifying and loading ------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickle DCP's ``.metadata`` accepting only its metadata classes (no code runs from the file)."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and obj.__module__ == module:
                return obj
        elif module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):
            return super().find_class(module, name)
        elif module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused: {METADATA} pickles the global {module}.{name}, which is not DCP "
                                     "metadata; loading it could execute code")


def read_metadata(path: Path) -> Any:
    """Return DCP's Metadata from ``path`` (see :class:`_MetadataUnpickler`)."""
    with open(path, "rb") as fh:
        return _MetadataUnpickler(fh).load()


def verify_dcp(checkpoint: Path, info: dict[str, Any], *, checksums: bool = True) -> list[str]:
    """Return the problems of the DCP folder of checkpoint directory ``checkpoint``; empty when it is complete.

    ``info`` is meta.json's "dcp". Complete means: ``.metadata`` present, matching its sha256, naming
    every model/optimizer tensor key; every shard file it references present, as large as the
    extents it references and of the size and (``checksums``) the CRC32 meta.json recorded.
    """
    folder = checkpoint / info.get("dir", DCP_DIR)
    where = folder.name
    md_path = folder / METADATA
    if not md_path.is_file():
        return [f"{where}/{METADATA} is missing (the sharded save did not finish?)"]
    if _sha256(md_path) != info.get("metadata_sha256"):
        return [f"{where}/{METADATA} does not match its sha256 in meta.json (corrupted or overwritten)"]
    try:
        metadata = read_metadata(md_path)
    except Exception as err:  # noqa: BLE001  (a refused global, a truncated pickle)
        return [f"{where}/{METADATA} is unreadable ({str(err).splitlines()[0]})"]
    problems = []
    missing = [k for k in info.get("keys", []) if k not in metadata.state_dict_metadata]
    if missing:
        problems.append(f"{where}/{METADATA} does not name {missing[0]}" + (f" (and {len(missing) - 1} more keys)"
                                                                          if len(missing) > 1 else ""))
    extents: dict[str, int] = {}
    for item in metadata.storage_data.values():
        extents[item.relative_path] = max(extents.get(item.relative_path, 0), item.offset + item.length)
    recorded = info.get("files", {})
    for name in sorted(set(extents) | set(recorded)):
        path = folder / name
        if not path.is_file():
            problems.append(f"{where}/{name} is missing (a shard file of the sharded checkpoint)")
            continue
        size = path.stat().st_size
        if size < extents.get(name, 0):
            problems.append(f"{where}/{name} is {size} bytes, shorter than the {extents[name]} {METADATA} references")
        elif name in recorded and size != recorded[name]:
            problems.append(f"{where}/{name} is {size} bytes, meta.json says {recorded[name]} (truncated or overwritten)")
        elif checksums and name in info.get("crc32", {}) and _crc32(path) != info["crc32"][name]:  # (before: sizes only)
            problems.append(f"{where}/{name} does not match its crc32 in meta.json (corrupted)")
    return problems


def attach_path(state: dict[str, Any], checkpoint: Path, info: dict[str, Any]) -> None:
    """Point the model/optimizer markers of a loaded state at their DCP folder (in place)."""
    for key in ("model", "optimizer"):
        if is_dcp_entry(state.get(key)):
            state[key]["path"] = str(checkpoint / info.get("dir", DCP_DIR))


def _fill(marker: dict[str, Any], prefix: str, loaded: dict[str, Tensor]) -> Any:
    """Rebuild a marker's tree with the loaded tensors in place of its tensor leaves."""
    leaves, spec = tree_flatten_with_keys(marker["tree"])
    wanted = set(marker["tensors"])
    out = []
    for path, leaf in leaves:
        key = dotted_key(path, prefix)
        out.append(loaded[key] if key in wanted else leaf)
    return tree_unflatten(out, spec)


def load_dcp_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_entry: dict[str, Any],
                         optim_entry: dict[str, Any], process_group: Any = None) -> None:
    """Load a DCP checkpoint's model and optimizer (markers from :func:`attach_path`) into ``model`` and ``optimizer``.

    A collective when a process group is initialized (every rank calls it; nothing may be in flight on
    ``process_group``). DTensor shards (FSDP2) take their part of each saved tensor at any world size;
    plain tensors (DDP, one process) the whole of it. An optimizer entry that is not a marker (saved
    before the first step) is loaded as ``optimizer.state_dict()`` format.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    targets: dict[str, Tensor] = {}
    model_now = get_model_state_dict(model)
    targets.update((k, v) for k, v in _flatten(model_now, "model") if _is_tensor(v))
    stepped = is_dcp_entry(optim_entry)
    if stepped:  # an optimizer without state gets one here (torch's zero-lr step); every value is then overwritten
        targets.update((k, v) for k, v in _flatten(get_optimizer_state_dict(model, optimizer), "optimizer")
                       if _is_tensor(v))
    wanted = [*model_entry["tensors"], *(optim_entry["tensors"] if stepped else [])]
    missing = [k for k in wanted if k not in targets]
    if missing:
        raise ValueError(f"sharded checkpoint {model_entry['path']}: it holds {missing[0]}, which this model and "
                         f"optimizer do not have ({len(missing)} such key(s)); load it into the model it was saved from")
    reader = _safe_reader_class()(model_entry["path"])
    with _single_process():
        dcp.load({k: targets[k] for k in wanted}, storage_reader=reader, process_group=process_group)
    set_model_state_dict(model, _fill(model_entry, "model", targets))
    if stepped:
        set_optimizer_state_dict(model, optimizer, _fill(optim_entry, "optimizer", targets))
    else:
        optimizer.load_state_dict(optim_entry)


def read_full_tensors(folder: str | Path) -> dict[str, Tensor]:
    """Return every tensor of a DCP folder, whole (unsharded), by its key; in this process, no collective.

    For inspecting a sharded checkpoint (``step_N/dcp``) without its model: ``model.<FQN>`` and
    ``optimizer.state.<FQN>.<name>`` keys, CPU tensors.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    folder = Path(folder)
    metadata = read_metadata(folder / METADATA)
    out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
           if isinstance(m, TensorStorageMetadata)}
    with _single_process():
        dcp.load(out, storage_reader=_safe_reader_class()(str(folder)), no_dist=True)
    return out


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """Silence DCP's warning that a load without a process group is a single-process one: here it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def to_full_state(state: dict[str, Any]) -> dict[str, Any]:
    """Return a loaded DCP checkpoint's state in the full format: whole tensors, as a DDP or one-process checkpoint.

    ``model`` becomes ``{FQN: tensor}``; ``optimizer`` becomes ``optimizer.state_dict()``'s format
    (integer ids in parameter-group order). Reads every shard in this process (no collective). A state
    without DCP markers is returned as it is.
    """
    if not is_dcp_entry(state.get("model")):
        return state
    tensors = read_full_tensors(state["model"]["path"])
    out = {**state, "model": _fill(state["model"], "model", tensors)}
    if is_dcp_entry(state.get("optimizer")):
        named = _fill(state["optimizer"], "optimizer", tensors)
        index = {name: i for i, name in enumerate(n for g in named["param_groups"] for n in g["params"])}
        out["optimizer"] = {"state": {index[n]: v for n, v in named["state"].items()},
                            "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in named["param_groups"]]}
    return out


@functools.cache
def _safe_reader_class() -> type:  # built on first use: DCP's imports stay lazy
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        """DCP's FileSystemReader, reading ``.metadata`` with :class:`_MetadataUnpickler`."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


