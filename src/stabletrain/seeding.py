"""Seeding and RNG state of every generator a run draws from: python, numpy, torch CPU and CUDA."""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

__all__ = ["seed_everything", "deterministic_mode", "seed_worker", "rng_state", "set_rng_state", "kept_rng"]


def seed_everything(seed: int) -> None:
    """Seed python's ``random``, numpy and torch (CPU and every CUDA device)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


@contextlib.contextmanager
def deterministic_mode(enabled: bool) -> Iterator[None]:
    """Run the block with torch's deterministic algorithms and deterministic cuDNN/cuBLAS; then put the settings back.

    ``enabled=False`` changes nothing: the process's own settings stand (they are global, and the
    process may be someone else's). Put back on exit, also on an exception:
    ``torch.use_deterministic_algorithms`` (mode and ``warn_only``), ``cudnn.deterministic``,
    ``cudnn.benchmark`` and the ``CUBLAS_WORKSPACE_CONFIG`` environment variable.
    """
    if not enabled:
        yield
        return
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
    # cuBLAS needs this workspace setting to be deterministic; it is read at the process's first CUDA matmul.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False  # benchmarking picks by timing
    try:
        yield
    finally:
        mode, warn_only, cudnn_deterministic, benchmark, workspace = saved
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, benchmark
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace


def seed_worker(worker_id: int) -> None:
    """DataLoader ``worker_init_fn``: seed python and numpy from the torch seed DataLoader gave this worker."""
    worker_seed = torch.initial_seed() % 2**32
    np.random.seed(worker_seed)
    random.seed(worker_seed)


_MT_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos
_numpy_read: list[Any] | None = []  # [the raw key and pos, the state rng_state() made of them] at the last full read
_numpy_mismatches = 0  # full reads whose raw bytes were not the state get_state() gave (3: the raw read is off)


def _mt_raw() -> bytes | None:
    """The key and position of numpy's global MT19937 as raw bytes (a copy of its state struct, about a microsecond), or
    None where it cannot be read so (another bit generator, a numpy before 1.25, a layout full reads disproved)."""
    get = getattr(np.random, "get_bit_generator", None)  # numpy >= 1.25
    bitgen = get() if get is not None and _numpy_read is not None else None
    if type(bitgen) is not np.random.MT19937:
        return None
    return ctypes.string_at(bitgen.ctypes.state_address, _MT_BYTES)


def _numpy_state() -> tuple[str, torch.Tensor, int, int, float]:
    """numpy's global RNG state as :func:`rng_state` keeps it; unchanged since the last read, that read's tuple.

    ``np.random.get_state()`` costs ~70 us (it copies the 624-word key one element at a time; 93 us of the mlp's 487 us
    interval snapshot went to the RNG states). The raw key and position are read first: where they equal the last full
    read's and that read held no cached Gaussian, the state is that read's (a cached Gaussian is the one part of the
    state a draw may change without moving the key: its flag, 1 to 0). :func:`set_rng_state` forgets the last read.
    What no read can see: ``np.random.set_state`` called by other code to put back the same key and position with a
    cached Gaussian where the last read had none (it spent it, without a draw, between the state's save and its restore).
    """
    global _numpy_read, _numpy_mismatches
    raw = _mt_raw()
    if raw is not None and _numpy_read and _numpy_read[0] == raw and _numpy_read[1][3] == 0:
        return _numpy_read[1]
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached))
    if raw is not None:  # the raw bytes are the struct numpy 1.17-2.x lay out; else (or a thread drew between the reads)
        if raw == keys.astype("<u4").tobytes() + int(pos).to_bytes(4, "little", signed=True):
            _numpy_read = [raw, state]
        else:
            _numpy_mismatches += 1
            _numpy_read = [] if _numpy_mismatches < 3 else None
    return state


def rng_state() -> dict[str, Any]:
    """Return the state of every RNG (python, numpy, torch CPU, each CUDA device)."""
    # Only tensors, ints, floats, strings and tuples: loadable with torch.load(weights_only=True).
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": _numpy_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states saved by :func:`rng_state`."""
    random.setstate(state["python"])
    if _numpy_read:
        _numpy_read.clear()
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def kept_rng() -> Iterator[None]:
    """Let the block draw from every RNG (python, numpy, torch CPU and CUDA); on exit, also on an exception, put
    back the states they had on entry, so code after the block draws the same numbers as if it had not run.

    The block may set another state itself (a replay from a saved one): the run's own comes back at exit.
    """
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)
