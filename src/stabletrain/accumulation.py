"""Gradient accumulation windows normalized by what the window really holds.

A window is the k micro-batches of one optimizer step (fewer at the end of an epoch). Its gradient
must be ``sum of per-item losses / items in the whole window`` (all ranks), not the mean of
per-micro-batch means: that is wrong for a short tail window and for variable-length batches.

The item count of a micro-batch is only known after its forward pass, so the window keeps the grads
normalized by the running count: before micro-batch i's backward it rescales the grads accumulated
so far by ``D_{i-1} / D_i`` and backpropagates ``loss_sum_i / D_i``. On the last micro-batch under
DDP, ``D`` is the global count divided by the world size, so DDP's averaging lands on the exact
global mean. All of it stays on the device.

Under DDP the window's one all-reduce also carries the inputs-finite flag when the guard checks
inputs, so every rank skips a step whose inputs were bad on any rank. A non-finite loss on one rank
needs nothing extra: the summed loss is then non-finite on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["AccumulationWindow", "as_sum_count"]


def as_sum_count(out: Any, num_samples: int) -> tuple[Tensor, Tensor]:
    """Return (fp32 loss sum, fp32 count) from a task loss: a scalar mean or a ``(sum, count)`` pair."""
    if isinstance(out, Tensor):
        if out.dim() != 0:
            raise ValueError(f"task loss returned a tensor of shape {tuple(out.shape)}; return a scalar mean or a (sum, count) pair")
        return out.float() * num_samples, torch.full((), float(num_samples), device=out.device)
    if isinstance(out, (tuple, list)) and len(out) == 2:
        loss_sum, count = out
        if not isinstance(loss_sum, Tensor) or loss_sum.dim() != 0:
            raise ValueError("task loss returned a pair whose first element is not a scalar tensor (the loss sum)")
        if isinstance(count, Tensor):
            count = count.to(device=loss_sum.device, dtype=torch.float32).reshape(())
        else:  # a host number: fill on the device rather than copy from host memory
            count = torch.full((), float(count), dtype=torch.float32, device=loss_sum.device)
        return loss_sum.float(), count.float()
    raise ValueError(f"task loss returned {type(out).__name__}; return a scalar mean or a (sum, count) pair")


class AccumulationWindow:
    """Normalize one window's micro-batch losses by the window's real item count (no host sync).

    Call :meth:`begin` before the window, :meth:`normalize` on each micro-batch's (sum, count) to get
    the loss to backpropagate, and read :attr:`loss_sum` / :attr:`count` afterwards (detached, local).
    """

    def __init__(self, params: list[Tensor], process_group: Any = None) -> None:
        self.params = list(params)
        self.process_group = process_group
        self.begin()

    def begin(self) -> None:
        self.loss_sum: Tensor | float = 0.0
        self.count: Tensor | float = 0.0
        self._denominator: Tensor | None = None
        self.num_micro_batches = 0
        self.inputs_ok: Tensor | None = None

    def _world(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        return 1

    def normalize(self, loss_sum: Tensor, count: Tensor, last: bool, inputs_ok: Tensor | None = None) -> Tensor:
        """Return the loss to backpropagate for this micro-batch; rescale grads accumulated so far in place.

        ``inputs_ok`` (on the last micro-batch): whether this rank's inputs of the whole window were
        finite; afterwards :attr:`inputs_ok` holds it for all ranks (None when not given).
        """
        self.loss_sum = self.loss_sum + loss_sum.detach()
        self.count = self.count + count
        denominator = self.count
        world = self._world()
        if last and world > 1:
            parts = [self.loss_sum, self.count] + ([(~inputs_ok).float()] if inputs_ok is not None else [])
            stats = torch.stack(parts).double()
            dist.all_reduce(stats, group=self.process_group)  # once per window, on the device
            self.global_loss_sum, self.global_count = stats[0].float(), stats[1].float()
            self.inputs_ok = stats[2] == 0 if inputs_ok is not None else None
            denominator = self.global_count / world
        elif last:
            self.global_loss_sum, self.global_count = self.loss_sum, self.count
            self.inputs_ok = inputs_ok
        if self._denominator is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, (self._denominator / denominator).to(grads[0].device))
        self._denominator = denominator
        self.num_micro_batches += 1
        return loss_sum / denominator

    @property
    def mean_loss(self) -> Tensor:
        """The window's unscaled per-item mean loss over all ranks (valid after the last micro-batch)."""
        return self.global_loss_sum / self.global_count
