"""Count host-device syncs: every conversion of a tensor to a Python value while a block runs.

On a GPU each of these (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``, ``int(t)``, indexing
with a tensor, ``.numpy()``) waits for the device to finish the queued work; on CPU they cost
nothing but are counted the same way, so a test on CPU catches a sync the GPU would pay for::

    with SyncCounter(lambda: trainer.step) as counter:
        trainer.fit()
    per_step = [c for c in counter.calls if c.step % log_every]   # syncs between log boundaries
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SYNC_FUNCS", "SyncCall", "SyncCounter"]

#: The Tensor methods that hand a value to the host.
SYNC_FUNCS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
                        torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.numpy})


class SyncCall(NamedTuple):
    """One counted conversion: the step it happened at (None without a step function), the method, the callers."""

    step: int | None
    op: str
    where: list[str]  # function names of the innermost frames, outermost first


class SyncCounter(TorchFunctionMode):
    """Record each tensor -> host conversion made while the context is active.

    Args:
        step: returns the current step (e.g. ``lambda: trainer.step``), stored with each call.
        depth: how many innermost stack frames to keep in :attr:`SyncCall.where`.
        ignore: path fragments of files whose conversions are not syncs. By default the DataLoader's:
            it draws its workers' base seed from a CPU generator with ``.item()`` when an epoch's loader
            opens, which reads host memory and never waits for a device.

    Attributes:
        calls: the :class:`SyncCall` records, in order.
    """

    def __init__(self, step: Callable[[], int] | None = None, *, depth: int = 8,
                 ignore: Iterable[str] = ("torch/utils/data",)) -> None:
        super().__init__()
        self.step, self.depth, self.ignore = step, depth, tuple(ignore)
        self.calls: list[SyncCall] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in SYNC_FUNCS:
            stack = traceback.extract_stack()[-self.depth:]
            if not any(part in f.filename for f in stack for part in self.ignore):
                self.calls.append(SyncCall(self.step() if self.step is not None else None, func.__name__,
                                           [f.name for f in stack]))
        return func(*args, **(kwargs or {}))

    def __len__(self) -> int:
        return len(self.calls)
