"""Validation loss: a fixed set of batches, reduced once (one host sync, one all-reduce under DDP)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
from torch import nn

from .console import StableTrainWarning
from .data import EpochOrder, move_to
from .numerics import modes_kept
from .policies.accumulation import as_sum_count
from .policies.precision import PrecisionPolicy

__all__ = ["validation_loss", "check_val_data"]


@torch.no_grad()
def check_val_data(task: Any) -> None:
    """Warn (once, at the start) when the task has validation data that is empty: no validation loss would show."""
    if task.val_data is not None and len(task.val_data) == 0:
        warnings.warn(f"task {task.name!r}: Task.val_data is empty; no validation loss will be reported "
                      "(pass val_data=None to say so)", StableTrainWarning, stacklevel=3)


def validation_loss(task: Any, module: nn.Module, precision: PrecisionPolicy, batch_size: int, max_batches: int,
                    dist: Any) -> dict[str, float]:
    """Return ``{"val_loss": mean loss per item}`` over the first ``max_batches`` (0 = all) validation batches.

    The batches are the same on every run (no shuffle); under DDP each rank takes its share and one
    all-reduce sums the (loss sum, count) pairs. ``module`` is the model itself, not a DDP wrapper (a
    forward through DDP could broadcast buffers). The forward runs in eval mode; then every submodule
    gets its own mode back (one the user froze in eval mode stays so). One host sync.
    """
    if task.val_data is None or len(task.val_data) == 0:
        return {}
    with modes_kept(module):
        module.eval()
        total = _loss_sum_count(task, module, precision, batch_size, max_batches, dist)
    loss_sum, count = dist.all_reduce_(total).tolist()  # the one sync (and one all-reduce)
    if count <= 0:  # the loss counted no item (a mask that drops everything): no loss, not a perfect 0
        warnings.warn(f"task {task.name!r}: the validation loss counted no item (its count is {count:g}): val_loss is "
                      "NaN; check the loss's count (a mask or an ignore_index that drops every item)", StableTrainWarning,
                      stacklevel=2)  # (the same line each evaluation: Python's filter shows it once)
        return {"val_loss": math.nan}
    return {"val_loss": loss_sum / count}


def _loss_sum_count(task: Any, module: nn.Module, precision: PrecisionPolicy, batch_size: int, max_batches: int,
                    dist: Any) -> torch.Tensor:
    """This rank's (loss sum, count) over its share of the validation batches, as a device tensor (no sync)."""
    batches = EpochOrder(len(task.val_data), batch_size, seed=0, shuffle=False).micro_batches(0)
    if max_batches:
        batches = batches[:max_batches]
    mine = batches[dist.rank::dist.world]
    # FSDP2: every forward all-gathers, so each rank runs as many as the busiest one; a rank short of
    # batches repeats its first (or the first) and counts nothing from it.
    rounds = -(-len(batches) // dist.world) if hasattr(module, "set_requires_gradient_sync") else len(mine)
    collate = task.collate or torch.utils.data.default_collate
    device = precision.device
    total = torch.zeros(2, device=device)
    for r in range(rounds):
        indices = mine[r] if r < len(mine) else (mine or batches)[0]
        batch = move_to(collate([task.val_data[i] for i in indices]), device)
        with precision.autocast():
            loss_sum, count = as_sum_count(task.loss(module, batch), len(indices))
        if r < len(mine):
            total += torch.stack([loss_sum.detach(), count])
    return total
