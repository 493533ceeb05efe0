"""Gradient accumulation windows normalized by what the window really holds.

A window is the k micro-batches of one optimizer step (fewer at the end of an epoch). Its gradient
must be ``sum of per-item losses / items in the whole window`` (all ranks), not the mean of
per-micro-batch means: that is wrong for a short tail window and for variable-length batches.

The item count of a micro-batch is only known after its forward pass, so nothing is divided until the
window's count is known, all of it on the device. Without a GradScaler (fp32, bf16; parameters not
in fp16) every micro-batch backpropagates its raw loss sum (``sums=True``, what the built-in step
uses): the gradients hold the window's sum, and :attr:`AccumulationWindow.grad_scale` = 1 / count is
applied in the pass that clipping makes anyway. With a GradScaler the gradients stay normalized by the
running count (a raw sum of many items times the loss scale would overflow fp16 far more often, and
each overflow costs a skipped step): before micro-batch i's backward the window rescales the grads
accumulated so far by ``D_{i-1} / D_i`` and backpropagates ``loss_sum_i / D_i``.

Where the loss returns a per-item mean, the item counts are the micro-batches' sample counts, known before
any forward pass. A window told their total ``N`` (``begin(num_samples=N)``) and without raw sums (a GradScaler)
backpropagates each mean as its share of the window, ``mean_i / (N / n_i)``: a plain loop's
``loss / accum_steps`` for equal micro-batches, bitwise, with nothing to rescale. (The running count
backpropagates the first of k micro-batches k times larger than its share, so fp16 overflows at a loss
scale k times smaller than in a plain loop, and each ``D_{i-1} / D_i`` rounds the grads once more.)

Under DDP the global count is known only once the ranks have talked. In the built-in loop this rank's
(loss sum, count[, inputs flag]) travel with the gradients through DDP's own all-reduce, so a step has
ONE collective (how: :class:`~stabletrain.distributed.carrier.WindowCarrier`); :attr:`grad_scale` then turns
the reduced gradients into the exact global mean, whatever each rank's share (a short tail, variable
lengths, none at all).

Without a carrier (a user's own DDP loop, FSDP) the last micro-batch all-reduces (loss sum, count
[, inputs flag]) itself before its backward and backpropagates by ``global count / world``, so DDP's
averaging lands on the exact global mean: a second collective, blocking.

Either way the inputs-finite flag is reduced too when the guard checks inputs, so every rank skips a
step whose inputs were bad on any rank. A non-finite loss on one rank needs nothing extra: the summed
loss is then non-finite on every rank.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..errors import caller_loss_note
from ..numerics import constant

__all__ = ["AccumulationWindow", "LossContractError", "as_sum_count", "loss_sums", "sums_safe"]


class LossContractError(ValueError):
    """A task's loss returned something other than a scalar mean or a ``(sum, count)`` pair (its message names where
    the user defined it)."""


def as_sum_count(out: Any, num_samples: int, *, backward: bool = False) -> tuple[Tensor, Tensor]:
    """Return (fp32 loss sum, fp32 count) from a task loss: a scalar mean or a ``(sum, count)`` pair.

    ``backward``: the sum is about to be backpropagated (the step's): while grad is enabled, a loss that cannot be (an
    integer tensor, one that does not require grad) is a :class:`LossContractError` here, not autograd's error at the
    backward. Off by default: a loss only evaluated (a validation pass, which may run with grad enabled) is not checked.
    A plain-number count must be finite and positive; a tensor count is not checked (reading it would be a host sync
    per call). Attribute reads only.
    """
    if isinstance(out, Tensor):
        if out.dim() != 0:
            raise LossContractError(f"task loss{caller_loss_note()} returned a tensor of shape {tuple(out.shape)}; "
                             "return a scalar mean or a (sum, count) pair")
        problem = _not_backpropagatable(out) if backward else None
        if problem:
            raise LossContractError(f"task loss{caller_loss_note()} returned {problem}; {_COMPUTE_IT}")
        return out.float() * num_samples, torch.full((), float(num_samples), device=out.device)
    if isinstance(out, (tuple, list)) and len(out) == 2:
        loss_sum, count = out
        if not isinstance(loss_sum, Tensor) or loss_sum.dim() != 0:
            raise LossContractError(f"task loss{caller_loss_note()} returned a pair whose first element is not a scalar tensor "
                             "(the loss sum)")
        problem = _not_backpropagatable(loss_sum) if backward else None
        if problem and isinstance(count, Tensor) and count.requires_grad:  # the count is what carries the graph
            raise LossContractError(f"task loss{caller_loss_note()} returned a pair whose first element (the sum) is "
                                    f"{problem.split(' (')[0]} while its second requires grad: that looks like (count, sum); "
                                    "return (sum, count)")
        if problem:
            raise LossContractError(f"task loss{caller_loss_note()} returned a pair whose first element (the sum) is "
                                    f"{problem}; {_COMPUTE_IT}")
        if isinstance(count, Tensor):
            count = count.to(device=loss_sum.device, dtype=torch.float32).reshape(())
        elif not isinstance(count, numbers.Real):
            raise LossContractError(f"task loss{caller_loss_note()} returned a pair whose second element (the count) is "
                                    f"{type(count).__name__}; return (sum, count), count a number or a scalar tensor")
        elif not (math.isfinite(count) and count > 0):  # the sum / count division would be 0/0, inf or negative
            raise LossContractError(f"task loss{caller_loss_note()} returned a pair whose count (the second element) is "
                                    f"{count!r}; return (sum, count), count the number of items the sum covers (> 0; "
                                    "a micro-batch that covers none: its count as a tensor)")
        else:  # a host number: fill on the device rather than copy from host memory
            count = torch.full((), float(count), dtype=torch.float32, device=loss_sum.device)
        return loss_sum.float(), count.float()
    raise LossContractError(f"task loss{caller_loss_note()} returned {type(out).__name__}; return a scalar mean or a "
                            "(sum, count) pair")


_COMPUTE_IT = ("return a floating-point scalar mean or (sum, count) pair computed from the model's output (no .detach(), "
               ".item(), integer cast or torch.no_grad() on the way)")


def _not_backpropagatable(loss: Tensor) -> str | None:
    """Why ``loss`` cannot be backpropagated ("an int64 tensor", ...), or None; only while grad is enabled."""
    if not torch.is_grad_enabled():
        return None
    if not loss.is_floating_point():
        name = str(loss.dtype).removeprefix("torch.")
        return f"{'an' if name.startswith('int') else 'a'} {name} tensor"
    if not loss.requires_grad:
        return "a tensor that does not require grad (detached, or not computed from the model's parameters)"
    return None


def loss_sums(loss: Any, model: Any, groups: Any, autocast: Any) -> list[tuple[float, float]]:
    """(loss sum, item count) of each ``(indices, batch)`` of ``groups`` under ``model``: forward only, no gradients, in
    the ``autocast`` context given (a precision's); one host read each. What a replay weighs windows and samples with."""
    out = []
    with torch.no_grad(), autocast:
        for indices, batch in groups:
            loss_sum, count = as_sum_count(loss(model, batch), len(indices))
            out.append((float(loss_sum), float(count)))
    return out


def sums_safe(params: list[Tensor], precision: Any) -> bool:
    """Whether a window may backpropagate raw loss sums (``sums=True``): no GradScaler, no fp16 parameters."""
    return precision.scaler is None and all(p.dtype != torch.float16 for p in params)


class AccumulationWindow:
    """Normalize one window's micro-batch losses by the window's real item count (no host sync).

    Call :meth:`begin` before the window, :meth:`normalize` on each micro-batch's (sum, count) to get
    the loss to backpropagate, and read :attr:`loss_sum` / :attr:`count` afterwards (detached, local).
    After the last micro-batch's backward: :attr:`global_loss_sum`, :attr:`global_count`,
    :attr:`mean_loss`, :attr:`inputs_ok` (over all ranks) and :attr:`grad_scale`.
    """

    def __init__(self, params: list[Tensor], process_group: Any = None, *, sums: bool = False) -> None:
        self.params = list(params)
        self.process_group = process_group
        self.sums = sums  # one process or DDP through the hook: backpropagate raw sums (see the module docstring)
        self.begin()

    def begin(self, num_samples: int | None = None) -> None:
        """Start a window; ``num_samples``: the samples its micro-batches hold, where known before their forward.

        With it (and without raw sums) a loss's per-item mean is backpropagated as its share of the window
        (:meth:`take_mean`); see the module docstring.
        """
        self.loss_sum: Tensor | float = 0.0
        self.count: Tensor | float = 0.0
        self._denominator: Tensor | None = None
        self.num_micro_batches = 0
        self._global: tuple[Tensor, Tensor, Tensor | None] | None = None
        self._carrier: Any = None
        self._carried_inputs = False
        self._summed = False  # the grads hold the window's sum (grad_scale = 1 / count)
        self._mean: Tensor | None = None  # the window's mean as the loss returned it (one micro-batch, one process)
        self._planned = num_samples or None  # the window's samples, known up front
        self._shares = False  # its micro-batches' means went in as shares of _planned
        self._world_size = self._world()

    def _world(self) -> int:
        if dist.is_available() and dist.is_initialized():
            return dist.get_world_size(self.process_group)
        return 1

    def normalize(self, loss_sum: Tensor, count: Tensor, last: bool, inputs_ok: Tensor | None = None,
                  carrier: Any = None) -> Tensor:
        """Return the loss to backpropagate for this micro-batch; rescale grads accumulated so far in place.

        ``inputs_ok`` (on the last micro-batch): whether this rank's inputs of the whole window were
        finite; afterwards :attr:`inputs_ok` holds it for all ranks (None when not given).
        ``carrier`` (DDP): the :class:`~stabletrain.distributed.carrier.WindowCarrier` the window's numbers travel
        with through the gradient all-reduce (see the module docstring); then the last backward must go
        through that DDP model, and :attr:`grad_scale` must be applied to the gradients. One that carries
        nothing (``travels`` false) is ignored.
        """
        if self._shares:
            raise ValueError("task loss: a per-item mean and then a (sum, count) pair in one accumulation window; "
                             "return the same kind for every micro-batch")
        if self.num_micro_batches == 0:  # the first: nothing to add to (two device ops fewer per step)
            self.loss_sum, self.count = loss_sum.detach(), count
        else:
            self.loss_sum = self.loss_sum + loss_sum.detach()
            self.count = self.count + count
        # No items so far (a first micro-batch masked out): its zeros backpropagated by 1, not by 0/0 (NaN gradients)
        denominator = torch.where(self.count > 0, self.count, 1) if isinstance(self.count, Tensor) else max(self.count, 1)
        world = self._world_size
        carried = carrier is not None and carrier.travels and world > 1
        if self.sums and (carried or world == 1):  # the raw sum: no rescale, the all-reduce takes buckets as they are
            if last:
                if carried:
                    loss_sum = carrier.carry(self._numbers(inputs_ok), None, loss_sum)
                    self._carrier, self._carried_inputs = carrier, inputs_ok is not None
                else:
                    self._global = (self.loss_sum, self.count, inputs_ok)
                self._summed = True
            self.num_micro_batches += 1
            return loss_sum
        if carried:
            if last:  # (by this rank's own count)
                loss_sum = carrier.carry(self._numbers(inputs_ok), denominator, loss_sum)  # the hook: with bucket 0
                self._carrier, self._carried_inputs = carrier, inputs_ok is not None
        elif last and world > 1:
            stats = self._numbers(inputs_ok).double()
            dist.all_reduce(stats, group=self.process_group)  # once per window, on the device, before the backward
            self._global = (stats[0].float(), stats[1].float(), stats[2] == 0 if inputs_ok is not None else None)
            denominator = self._global[1] / world
        elif last:
            self._global = (self.loss_sum, self.count, inputs_ok)
        if self._denominator is not None:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, (self._denominator / denominator).to(grads[0].device))
        self._denominator = denominator
        self.num_micro_batches += 1
        return loss_sum / denominator

    def takes_mean(self, last: bool, carrier: Any = None) -> bool:
        """Whether :meth:`take_mean` may take this micro-batch's per-item mean (one process, no carrier).

        With raw sums: the only micro-batch of its window. Without (a GradScaler): any micro-batch of a window
        whose sample count :meth:`begin` was given, unless an earlier one went through :meth:`normalize`.
        """
        if self._world_size != 1 or carrier is not None:
            return False
        if self.sums:
            return last and self.num_micro_batches == 0
        return self._planned is not None and (self.num_micro_batches == 0 or self._shares)

    def take_mean(self, mean: Tensor, count: Tensor, inputs_ok: Tensor | None = None) -> Tensor:
        """The per-item ``mean`` the loss returned for ``count`` samples, as the loss to backpropagate.

        With raw sums, the window's one micro-batch: its mean is the window's already, what a plain loop
        backpropagates; no 1 / count is left for the gradients (:attr:`grad_scale` is None) and the sum is made
        only if asked for (:attr:`loss_sum`). Without: ``mean / (N / count)``, its share of the window's ``N``
        samples (the module docstring). Only where :meth:`takes_mean` says so.
        """
        if not self.sums:
            return self._take_share(mean, count, inputs_ok)
        self.count, self.num_micro_batches, self._loss_sum = count, 1, None
        self._mean = mean.detach().float()
        self._global = (None, count, inputs_ok)
        return mean.float()

    def _take_share(self, mean: Tensor, count: Tensor, inputs_ok: Tensor | None) -> Tensor:
        loss_sum = mean.detach().float() * count
        if self.num_micro_batches == 0:
            self.loss_sum, self.count = loss_sum, count
        else:
            self.loss_sum, self.count = self.loss_sum + loss_sum, self.count + count
        self.num_micro_batches += 1
        self._shares = True
        self._global = (self.loss_sum, self.count, inputs_ok)  # the window's, once its last micro-batch is in
        return mean.float() / (constant(float(self._planned), count.device) / count)  # N / n: k for equal parts

    @property
    def loss_sum(self) -> Tensor | float:
        """This rank's loss sum over the window so far (detached)."""
        if self._loss_sum is None:  # a mean taken as it is (take_mean): the sum, made now
            self._loss_sum = self._mean * self.count
        return self._loss_sum

    @loss_sum.setter
    def loss_sum(self, value: Tensor | float) -> None:
        self._loss_sum = value

    def _numbers(self, inputs_ok: Tensor | None) -> Tensor:
        """This rank's (loss sum, count, inputs bad) of the window, as the ranks sum them (0: inputs not checked)."""
        bad = (~inputs_ok).float() if inputs_ok is not None else torch.zeros_like(self.count)
        return torch.stack([self.loss_sum, self.count, bad])

    def _reduced(self) -> tuple[Tensor, Tensor, Tensor | None]:
        if self._global is None and self._carrier is not None:
            stats = self._carrier.received  # the sum over the ranks, filled during the last backward
            if stats is None:
                raise RuntimeError("the accumulation window's numbers were not reduced: no gradient all-reduce ran "
                                   "after the last micro-batch (the backward must go through the DDP model that "
                                   "stabletrain.distributed.carrier.data_parallel or register_carrier_hook set up)")
            self._global = (stats[0].float(), stats[1].float(), stats[2] == 0 if self._carried_inputs else None)
        if self._global is None:
            raise RuntimeError("the accumulation window's totals are known only after its last micro-batch")
        return self._global

    @property
    def global_loss_sum(self) -> Tensor:
        """The window's loss sum over all ranks."""
        total = self._reduced()[0]
        return self.loss_sum if total is None else total  # None: one process, a mean taken as it is

    @property
    def global_count(self) -> Tensor:
        """The window's item count over all ranks."""
        return self._reduced()[1]

    @property
    def inputs_ok(self) -> Tensor | None:
        """Whether every rank's inputs of the window were finite (None when not checked)."""
        return self._reduced()[2] if (self._global is not None or self._carrier is not None) else None

    @property
    def mean_loss(self) -> Tensor:
        """The window's unscaled per-item mean loss over all ranks (valid after the last micro-batch)."""
        if self._mean is not None:
            return self._mean
        return self.global_loss_sum / self.global_count

    @property
    def grad_scale(self) -> Tensor | None:
        """What the gradients must still be multiplied by, or None when they are already the window's mean.

        With a ``carrier`` or ``sums`` the gradients hold the window's global SUM, and this is
        1 / :attr:`global_count` (a device scalar; valid after the last backward); world size / global count
        where DDP's own all-reduce averaged the sums over the ranks (``carrier.averaged``).
        """
        if self._carrier is not None and self._carrier.averaged:
            return self._carrier.world / self.global_count
        return 1.0 / self.global_count if (self._carrier is not None or self._summed) else None
