"""The data path: a seeded per-epoch sample order, sharded by rank, cut into optimizer-step windows.

The position in the data is just ``(epoch, batch index within the epoch)``: the order of an epoch is
a pure function of (seed, epoch), so a resumed run sees exactly the batches it would have seen
without iterating through the skipped ones.

Global micro-batch ``b`` of an epoch is ``order[b*B*W:(b+1)*B*W]`` (B = batch size per process,
W = world size); rank r takes its r-th share, so N processes see what one process would see with
batch size B*W.

**Resuming under another layout** (another world size, batch size or accumulation; a resharded
resume): the data continues from the same *global sample position*. The saved position (epoch e,
micro-batch p of the old layout B'*W') is the sample offset ``o = p*B'*W'`` within epoch e (the
epoch's size when the old layout had finished it); the rest of epoch e is cut from there:
global micro-batch b of the new layout is ``order[o + b*B*W : o + (b+1)*B*W]`` (the stream's
``origin`` is o); the next epoch starts at 0 as usual. So with the same global batch per step
(2 ranks x B -> 1 rank x B x accum 2) the resumed run trains on exactly the samples, step by step,
that the uninterrupted run would have. A chunk of fewer than W samples at an epoch's end is
dropped under each layout's own W (at most W-1 samples, as always), so around an epoch's tail the
two layouts may differ by those few samples. The windows a rollback said never to train on again
(``skip``) are mapped, conservatively: every window of the new layout that shares a sample with a
skipped window of the old one is skipped; skipped windows already behind the position are dropped.

Samples a remedy said never to train on again (``drop``, dataset indices: ``stabletrain remedy``'s
skip-samples) are taken out of every window they fall in (the rest re-collated; a window left empty is
read past); they need no mapping under another layout.

With DataLoader workers (``data.workers``) each sample is fetched with torch, numpy and python seeded from (seed,
epoch, its index) (a dataset's batched ``__getitems__``: each micro-batch from its first sample's): what it draws (an
augmentation) does not depend on which worker fetched it, so a resume or a rollback from any position sees the same
samples bitwise, under any number of workers or ranks. Without workers the fetch draws from the process's own
streams, which checkpoints hold. An incident's replays fetch their samples in their own process, without either:
a sample drawn at random at each fetch is not replayed as the run drew it.
"""

from __future__ import annotations

import copy
import math
import random
from collections import UserDict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate

from . import console
from .internals import tree_map
from .seeding import kept_rng, seed_worker

__all__ = ["EpochOrder", "Window", "WindowStream", "move_to", "fixed_batch"]


_SCALARS = frozenset((int, float, bool, str, bytes, type(None)))


def move_to(batch: Any, device: torch.device) -> Any:
    """Return ``batch`` with every tensor moved to ``device`` (dicts, lists, tuples, namedtuples recursed).

    Plain tuples, lists and dicts are walked directly (a pytree flatten and unflatten cost more than the
    rest of this, per micro-batch); a tensor already on ``device`` is returned as it is.
    """
    t = type(batch)
    if isinstance(batch, torch.Tensor):
        return batch if batch.device == device else batch.to(device, non_blocking=True)
    if t is tuple or t is list:
        return t([move_to(x, device) for x in batch])
    if t is dict:
        return {k: move_to(v, device) for k, v in batch.items()}
    if t in _SCALARS:
        return batch
    if isinstance(batch, UserDict):  # (a Hugging Face BatchEncoding: a copy keeps its other attributes, its encodings)
        out = copy.copy(batch)
        out.data = {k: move_to(v, device) for k, v in batch.data.items()}
        return out
    if isinstance(batch, Mapping) and not isinstance(batch, dict):  # (another Mapping: a pytree leaf)
        try:
            return t({k: move_to(v, device) for k, v in batch.items()})
        except TypeError:
            pass
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
        self._kept: tuple[int, np.ndarray] | None = None  # the last epoch's order (a permutation is O(samples))
        self._said_tail = False

    def order(self, epoch: int) -> np.ndarray:
        """Return the sample order of ``epoch``: a pure function of (seed, epoch), computed on the host (the last
        epoch's kept)."""
        if not self.shuffle:
            return np.arange(self.num_samples)
        if self._kept is None or self._kept[0] != epoch:
            self._kept = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.num_samples))
        return self._kept[1]

    def micro_batches(self, epoch: int, origin: int = 0) -> list[list[int]]:
        """Return this rank's micro-batches (dataset indices) of ``epoch``, in order, cut from sample ``origin`` on."""
        order = self.order(epoch)[origin:]
        out = []
        for b in range(math.ceil(len(order) / self.global_batch)):
            chunk = order[b * self.global_batch:(b + 1) * self.global_batch]
            if len(chunk) < self.world_size:  # too few samples left for every rank to get one: dropped (at most W-1 per epoch)
                if self.rank == 0 and not self._said_tail:  # (said once: a new user's DDP run lost its tail without a word)
                    self._said_tail = True
                    console.warn(f"data: the last {len(chunk)} sample(s) of epoch {epoch} are not trained on: fewer than the "
                                 f"{self.world_size} ranks, each of which needs one (so at the end of every epoch whose tail "
                                 "is that short; one process would train on them)")
                break
            out.append(self._share(chunk, self.rank).tolist())
        return out

    def shares(self, epoch: int, b: int, origin: int = 0) -> list[list[int]]:
        """Every rank's share of global micro-batch ``b`` of ``epoch`` (counted from sample ``origin``)."""
        chunk = self.order(epoch)[origin + b * self.global_batch:origin + (b + 1) * self.global_batch]
        return [self._share(chunk, r).tolist() for r in range(self.world_size)]

    def _share(self, chunk: np.ndarray, rank: int) -> np.ndarray:
        # A short last chunk is split as evenly as the ranks allow.
        return chunk[rank * len(chunk) // self.world_size:(rank + 1) * len(chunk) // self.world_size]

    def global_size(self, b: int, origin: int = 0) -> int:
        """Return how many samples global micro-batch ``b`` (counted from ``origin``) holds over all ranks (arithmetic)."""
        return min(self.global_batch, self.num_samples - origin - b * self.global_batch)


def _num_chunks(num_samples: int, global_batch: int, world_size: int) -> int:
    """Global micro-batches of ``num_samples`` samples: full ones, and a short last one if every rank gets a sample."""
    full, rest = divmod(max(num_samples, 0), global_batch)
    return full + int(rest > 0 and rest >= world_size)


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


class _SeededSamples(Dataset):
    """``dataset``, each item fetched by ``(epoch, index)`` with torch, numpy and python seeded from (seed, epoch, index)
    (in a DataLoader worker: its own streams)."""

    def __init__(self, dataset: Dataset, seed: int) -> None:
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def _seeded(self, epoch: int, index: int) -> None:
        seed = ((self.seed * 1_000_003 + epoch) * 2_147_483_647 + index) % 2**63
        torch.default_generator.manual_seed(seed)  # (the CPU's: torch.manual_seed queues CUDA's too, per sample)
        np.random.seed(seed % 2**32)
        random.seed(seed)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        self._seeded(*key)
        return self.dataset[key[1]]


class _SeededBatches(_SeededSamples):
    """:class:`_SeededSamples` of a dataset that fetches a micro-batch at once (``__getitems__``: a Hugging Face dataset's
    one read per batch), seeded from the micro-batch's first key."""

    def __getitems__(self, keys: list[tuple[int, int]]) -> Any:
        self._seeded(*keys[0])
        return self.dataset.__getitems__([i for _, i in keys])  # type: ignore[attr-defined]


#: Whole epochs in a row that give no window once the dropped samples are taken out, before the stream says so.
EMPTY_EPOCHS = 3


class WindowStream:
    """Yield optimizer-step windows of up to ``accum_steps`` micro-batches; windows never cross epochs.

    The position (``epoch``, ``pos``) is the next micro-batch to read, counted from sample ``origin``
    of the epoch (0 except in the epoch a resharded resume continued); it round-trips through
    ``state_dict`` so resuming skips nothing and repeats nothing. The state also records the layout
    (global micro-batch, world size, accumulation), so a state saved under another layout continues
    from the same global sample position (see the module docstring).
    """

    def __init__(self, dataset: Dataset, order: EpochOrder, accum_steps: int, *,
                 collate: Callable[[list[Any]], Any] | None = None, workers: int = 0, pin_memory: bool = False) -> None:
        self.dataset, self.order, self.accum_steps = dataset, order, accum_steps
        self.collate = collate or default_collate
        self.workers, self.pin_memory = workers, pin_memory
        self.epoch, self.pos, self.origin = 0, 0, 0
        self.skip: set[tuple[int, int]] = set()  # (epoch, start) of windows never to train on (rollbacks)
        self.drop: set[int] = set()  # dataset indices never to train on (a remedy's skipped samples)
        self._iter: Iterator[Any] | None = None
        self._batches: list[list[int]] = []
        # A TensorDataset read in this process with torch's own collate: one gather per tensor, bitwise what
        # default_collate stacks from its rows, without a DataLoader's per-sample __getitem__ (~8x the time at 64 rows).
        plain = (isinstance(dataset, TensorDataset) and type(dataset).__getitem__ is TensorDataset.__getitem__
                 and collate is None and not workers and not pin_memory)
        self._tensors: tuple[torch.Tensor, ...] | None = dataset.tensors if plain else None
        self._index: tuple[torch.Tensor, ...] = ()  # the epoch's micro-batches' indices (a gathered TensorDataset)

    def _fetch(self, b: int) -> list[torch.Tensor]:
        """Micro-batch ``b`` of the epoch, gathered (contiguous, as torch.stack makes it)."""
        return [torch.index_select(t, 0, self._index[b]).contiguous() for t in self._tensors]

    def _open(self) -> None:
        self._batches = self.order.micro_batches(self.epoch, self.origin)
        if self._tensors is not None:  # opened: the windows are gathered (_fetch), each by its view of one index
            self._iter = iter(())
            flat = torch.as_tensor([i for b in self._batches for i in b], dtype=torch.long)
            self._index = flat.split([len(b) for b in self._batches])
            return
        remaining = self._batches[self.pos:]
        dataset, batches = self.dataset, remaining
        if self.workers:  # each sample seeded by (seed, epoch, index), whichever worker fetches it (module docstring)
            own = getattr(type(self.dataset), "__getitems__", None)  # (a dataset's own batched read; not torch's Subset's)
            seeded = _SeededBatches if own is not None and not own.__module__.startswith("torch.") else _SeededSamples
            dataset, batches = seeded(self.dataset, self.order.seed), [[(self.epoch, i) for i in b] for b in remaining]
        g = torch.Generator().manual_seed(self.order.seed * 7919 + self.epoch + self.order.rank * 1_000_003)
        loader = DataLoader(dataset, batch_sampler=batches, collate_fn=self.collate,
                            num_workers=self.workers, worker_init_fn=seed_worker if self.workers else None,
                            generator=g, persistent_workers=False, pin_memory=self.pin_memory)
        self._iter = iter(loader)

    def next_window(self) -> Window:
        """Return the next window, moving to the next epoch when this one is used up.

        Windows listed in :attr:`skip` are read past (a rollback's offending data is not seen again). Whole epochs that
        give no window because of :attr:`drop` alone, :data:`EMPTY_EPOCHS` in a row: ValueError, not a loop without end
        (one such epoch is not enough: a reshuffled epoch may group the samples left into windows every rank can train
        on, and an epoch read from a resharded resume's origin, or with a rollback's skipped windows, is not whole).
        """
        whole, skipped, empty = self.pos == 0 and self.origin == 0, False, 0
        while True:
            if self._iter is None:
                self._open()
            if self.pos >= len(self._batches):
                empty = empty + 1 if whole and not skipped and self.drop else 0
                if empty == EMPTY_EPOCHS:
                    raise ValueError(f"data: no window of epochs {self.epoch - EMPTY_EPOCHS + 1}-{self.epoch} is left to "
                                     f"train on once the {len(self.drop)} dropped samples (skip-samples remedies, the data "
                                     "diagnoses of rollbacks) are taken out")
                self.epoch, self.pos, self.origin, whole, skipped = self.epoch + 1, 0, 0, True, False
                self._open()
            take = min(self.accum_steps, len(self._batches) - self.pos)
            indices = self._batches[self.pos:self.pos + take]
            assert self._iter is not None
            batches = ([self._fetch(self.pos + j) for j in range(take)] if self._tensors is not None
                       else [next(self._iter) for _ in range(take)])
            total = (sum(self.order.global_size(self.pos + i, self.origin) for i in range(take)) if self.order.world_size > 1
                     else sum(len(i) for i in indices))
            window = Window(self.epoch, self.pos, indices, batches, total)
            self.pos += take
            if (window.epoch, window.start) in self.skip:
                skipped = True
                continue
            if self.drop:
                window = self._without_dropped(window)
            if window.indices:
                return window

    def _without_dropped(self, window: Window) -> Window:
        """``window`` without the samples in :attr:`drop` (their micro-batches re-collated; empty ones left out).

        Under DDP every rank weighs every rank's share of the window from the epoch's order (no collective): the
        window's global count is what the ranks keep, and where a rank would keep nothing of a micro-batch (it could
        not run the forward the others' gradient all-reduce waits for) every rank reads past the whole window.
        """
        kept = [[i for i in group if i not in self.drop] for group in window.indices]
        total = -1
        if self.order.world_size > 1:
            shares = [self.order.shares(window.epoch, window.start + j, self.origin) for j in range(len(window.indices))]
            left = [[len([i for i in share if i not in self.drop]) for share in ranks] for ranks in shares]
            if any(n == 0 for ranks in left for n in ranks):
                return Window(window.epoch, window.start, [], [])
            total = sum(map(sum, left))
        if kept == window.indices and total in (-1, window.global_num_samples):
            return window
        batches = [b if k == g else self.collate(self._samples(window.epoch, k))
                   for k, g, b in zip(kept, window.indices, window.batches) if k]
        return Window(window.epoch, window.start, [k for k in kept if k], batches, total)

    def _samples(self, epoch: int, indices: list[int]) -> list[Any]:
        """The samples, fetched here as the workers fetch them (seeded by (seed, epoch, index) where there are workers:
        the process's own streams put back after)."""
        if not self.workers:
            return [self.dataset[i] for i in indices]
        seeded = _SeededSamples(self.dataset, self.order.seed)
        with kept_rng():
            return [seeded[(epoch, i)] for i in indices]

    def _layout(self) -> dict[str, int]:
        return {"global_batch": self.order.global_batch, "world_size": self.order.world_size,
                "accum_steps": self.accum_steps}

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "origin": self.origin, "skip": sorted(self.skip),
                "drop": sorted(self.drop), **self._layout()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; a state saved under another layout continues from its global sample position.

        A state without layout keys (written before they were recorded) is read as this layout's.
        """
        self.epoch, self.pos, self.origin = int(state["epoch"]), int(state["pos"]), int(state.get("origin", 0))
        self.skip = {(int(e), int(s)) for e, s in state.get("skip", [])}
        self.drop = {int(i) for i in state.get("drop", [])}
        self._iter = None
        old = {k: int(state.get(k, v)) for k, v in self._layout().items()}
        if old != self._layout():
            self._relayout(old)

    def sample_offset(self, global_batch: int | None = None, world_size: int | None = None) -> int:
        """Return the global sample offset, within the current epoch, of the next micro-batch to read.

        The epoch's size when the position is past its last micro-batch. ``global_batch`` and
        ``world_size``: of the layout the position was counted in (default: this stream's).
        """
        g = self.order.global_batch if global_batch is None else global_batch
        w = self.order.world_size if world_size is None else world_size
        if self.pos >= _num_chunks(self.order.num_samples - self.origin, g, w):
            return self.order.num_samples
        return self.origin + self.pos * g

    def _relayout(self, old: dict[str, int]) -> None:
        """Move the position (and the skipped windows) counted in layout ``old`` into this stream's layout."""
        n, g_old, k_old = self.order.num_samples, old["global_batch"], old["accum_steps"]
        offset = self.sample_offset(g_old, old["world_size"])
        ranges = []  # (epoch, first sample, end) of each skipped window still ahead
        for e, s in self.skip:
            if e < self.epoch or (e == self.epoch and s < self.pos):
                continue  # behind the position: never read again anyway
            base = self.origin if e == self.epoch else 0
            lo, hi = base + s * g_old, min(base + (s + k_old) * g_old, n)
            if lo < hi:
                ranges.append((e, lo, hi))
        self.pos, self.origin = 0, offset
        g, k = self.order.global_batch, self.accum_steps
        self.skip = set()
        for e, lo, hi in ranges:
            base = self.origin if e == self.epoch else 0
            first, last = (lo - base) // g, (hi - base - 1) // g  # the new micro-batches holding its samples
            self.skip |= {(e, j * k) for j in range(first // k, last // k + 1)}


def fixed_batch(task: Any, num_samples: int, device: torch.device | None = None, start: int = 0) -> tuple[list[int], Any]:
    """Return (dataset indices, collated batch) of ``num_samples`` consecutive training samples of ``task``."""
    n = min(num_samples, len(task.train_data) - start)
    indices = list(range(start, start + n))
    collate = task.collate or default_collate
    batch = collate([task.train_data[i] for i in indices])
    return indices, (move_to(batch, device) if device is not None else batch)
