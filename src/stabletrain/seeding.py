"""Seeding and RNG state of every generator a run draws from: python, numpy, torch CPU and CUDA."""

from __future__ import annotations

import contextlib
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


def rng_state() -> dict[str, Any]:
    """Return the state of every RNG (python, numpy, torch CPU, each CUDA device)."""
    # Only tensors, ints, floats, strings and tuples: loadable with torch.load(weights_only=True).
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore RNG states saved by :func:`rng_state`."""
    random.setstate(state["python"])
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
