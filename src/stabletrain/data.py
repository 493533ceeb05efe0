"""The data path: a seeded per-epoch sample order, sharded by rank, cut into optimizer-step windows.

The position in the data is just ``(epoch, batch index within the epoch)``: the order of an epoch is
a pure function of (seed, epoch), so a resumed run sees exactly the batches it would have seen
without iterating through the skipped ones.

Global micro-batch ``b`` of an epoch is ``order[b*B*W:(b+1)*B*W]`` (B = batch size per process,
W = world size); rank r takes its r-th share, so N processes see what one process would see with
batch size B*W.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_map
from torch.utils.data import DataLoader, Dataset, default_collate

from .seeding import seed_worker

__all__ = ["EpochOrder", "Window", "WindowStream", "move_to"]


def move_to(batch: Any, device: torch.device) -> Any:
    """Return ``batch`` with every tensor moved to ``device`` (dicts, lists, tuples, namedtuples recursed)."""
    return tree_map(lambda x: x.to(device, non_blocking=True) if isinstance(x, torch.Tensor) else x, batch)


class EpochOrder:
    """The sample order of each epoch and this rank's micro-batches in it."""

    def __init__(self, num_samples: int, batch_size: int, seed: int, shuffle: bool = True,
                 rank: int = 0, world_size: int = 1) -> None:
        if num_samples < world_size:
            raise ValueError(f"the training data has {num_samples} samples, fewer than the {world_size} processes")
        self.num_samples, self.batch_size, self.seed, self.shuffle = num_samples, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.global_batch = batch_size * world_size
        self.batches_per_epoch = math.ceil(num_samples / self.global_batch)

    def order(self, epoch: int) -> np.ndarray:
        """Return the sample order of ``epoch``: a pure function of (seed, epoch), computed on the host."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def micro_batches(self, epoch: int) -> list[list[int]]:
        """Return this rank's micro-batches (dataset indices) of ``epoch``, in order."""
        order = self.order(epoch)
        out = []
        for b in range(self.batches_per_epoch):
            chunk = order[b * self.global_batch:(b + 1) * self.global_batch]
            if len(chunk) < self.world_size:
                break  # too few samples left for every rank to get one: dropped (at most W-1 per epoch)
            # A short last chunk is split as evenly as the ranks allow.
            lo = self.rank * len(chunk) // self.world_size
            hi = (self.rank + 1) * len(chunk) // self.world_size
            out.append(chunk[lo:hi].tolist())
        return out

    def global_size(self, b: int) -> int:
        """Return how many samples global micro-batch ``b`` holds over all ranks (pure arithmetic, no order)."""
        return min(self.global_batch, self.num_samples - b * self.global_batch)


@dataclass
class Window:
    """The micro-batches of one optimizer step: their dataset indices and collated batches."""

    epoch: int
    start: int  # index of the first micro-batch within the epoch
    indices: list[list[int]]
    batches: list[Any]
    global_num_samples: int = -1  # samples of the window over all ranks (-1: this process's, world of one)

    @property
    def num_samples(self) -> int:
        return sum(len(i) for i in self.indices)

    def __post_init__(self) -> None:
        if self.global_num_samples < 0:
            self.global_num_samples = self.num_samples


class WindowStream:
    """Yield optimizer-step windows of up to ``accum_steps`` micro-batches; windows never cross epochs.

    The position (``epoch``, ``pos``) is the next micro-batch to read; it round-trips through
    ``state_dict`` so resuming skips nothing and repeats nothing.
    """

    def __init__(self, dataset: Dataset, order: EpochOrder, accum_steps: int, *,
                 collate: Callable[[list[Any]], Any] | None = None, workers: int = 0, pin_memory: bool = False) -> None:
        self.dataset, self.order, self.accum_steps = dataset, order, accum_steps
        self.collate = collate or default_collate
        self.workers, self.pin_memory = workers, pin_memory
        self.epoch, self.pos = 0, 0
        self.skip: set[tuple[int, int]] = set()  # (epoch, start) of windows never to train on (rollbacks)
        self._iter: Iterator[Any] | None = None
        self._batches: list[list[int]] = []

    def _open(self) -> None:
        self._batches = self.order.micro_batches(self.epoch)
        remaining = self._batches[self.pos:]
        # Each rank's workers draw their own streams (rank 0's are those of a single process).
        g = torch.Generator().manual_seed(self.order.seed * 7919 + self.epoch + self.order.rank * 1_000_003)
        loader = DataLoader(self.dataset, batch_sampler=remaining, collate_fn=self.collate,
                            num_workers=self.workers, worker_init_fn=seed_worker if self.workers else None,
                            generator=g, persistent_workers=False, pin_memory=self.pin_memory)
        self._iter = iter(loader)

    def next_window(self) -> Window:
        """Return the next window, moving to the next epoch when this one is used up.

        Windows listed in :attr:`skip` are read past (a rollback's offending data is not seen again).
        """
        while True:
            if self._iter is None:
                self._open()
            if self.pos >= len(self._batches):
                self.epoch, self.pos = self.epoch + 1, 0
                self._open()
            take = min(self.accum_steps, len(self._batches) - self.pos)
            indices = self._batches[self.pos:self.pos + take]
            assert self._iter is not None
            batches = [next(self._iter) for _ in range(take)]
            total = (sum(self.order.global_size(self.pos + i) for i in range(take)) if self.order.world_size > 1
                     else sum(len(i) for i in indices))
            window = Window(self.epoch, self.pos, indices, batches, total)
            self.pos += take
            if (window.epoch, window.start) not in self.skip:
                return window

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "skip": sorted(self.skip)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])
        self.skip = {(int(e), int(s)) for e, s in state.get("skip", [])}
        self._iter = None
