"""The window's numbers on their way through DDP's gradient all-reduce, so an optimizer step has one collective.

:func:`data_parallel` wraps a module in ``DistributedDataParallel`` with a :class:`WindowCarrier`;
:func:`register_carrier_hook` sets one up on a module already wrapped. The accumulation window
(:mod:`stabletrain.policies.accumulation`) hands the carrier its (loss sum, count[, inputs flag]).
Where a host trainer runs the backward (the adapters), :class:`LossWatch` carries each rank's loss finiteness.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..internals import queue_backward_callback

__all__ = ["WindowCarrier", "LossWatch", "data_parallel", "register_carrier_hook"]


class WindowCarrier:
    """The window's numbers on their way through the gradient all-reduce (DDP), so a step has one collective.

    The accumulation window hands it this rank's (loss sum, count[, inputs bad]) before the last
    micro-batch's backward (:meth:`carry`); after the backward :attr:`received` holds their sum over
    the ranks. Two ways to travel, chosen by :func:`data_parallel`:

    - ``param``: a small parameter registered with DDP beside the model's (so it sits in one of DDP's
      own buckets) whose gradient is made to be the numbers. DDP's built-in all-reduce (C++, no Python
      per bucket) then averages them with the gradients: nothing is added to the step but one autograd
      node. Only for windows whose gradients hold raw sums (``sums=True``): the buckets are reduced as
      they are.
    - a comm hook (:func:`register_carrier_hook`): appends the numbers to bucket 0 and, for a window
      normalized by this rank's running count (fp16 with a GradScaler), multiplies each bucket by that
      count first, so the sum over the ranks is exact whatever each rank's share.

    :meth:`reset` before each step. :attr:`in_gradient_sync` tells a failed gradient all-reduce (a lost
    peer) from an error of the backward's graph (:func:`~.peers.is_peer_failure`). Which rank saw a non-finite
    value is read from each rank's own loss and inputs every step; a rank whose loss was finite but
    whose own gradients were not is named by the incident capture, which backpropagates the bad step on
    every rank without the all-reduce (:mod:`stabletrain.services.incidents`), so no step pays for a
    per-bucket check.
    A carrier that does neither (FSDP: ``travels`` false) only marks the step as distributed.
    """

    def __init__(self, group: Any = None, *, param: Tensor | None = None) -> None:
        self.group, self.param = group, param
        self.travels = param is not None  # also set by register_carrier_hook
        self.world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.reset()

    def reset(self) -> None:
        self.payload: Tensor | None = None
        self.scale: Tensor | None = None
        self._received: Tensor | None = None
        #: True from the moment the last backward's graph has run until DDP's reducer has its all-reduced
        #: gradients: an error out of that backward while it is True is the all-reduce's (see :meth:`carry`).
        self.in_gradient_sync = False
        if self.param is not None:
            self.param.grad = None

    def carry(self, payload: Tensor, scale: Tensor | None, loss: Tensor) -> Tensor:
        """Sum ``payload`` over the ranks with the next gradient all-reduce; return the loss to backpropagate.

        ``scale``: what the hook multiplies every bucket by first (this rank's count); None: the buckets
        hold this rank's raw sum already, as the ``param`` way needs.
        """
        if self.param is None:
            self.payload, self.scale, self._received = payload, scale, None
            out = loss
        elif scale is not None:
            raise RuntimeError("a WindowCarrier with a parameter carries only windows of raw sums (sums=True); "
                               "a window normalized by its running count needs register_carrier_hook")
        else:
            out = _CarriedGrad.apply(loss, self.param, payload)
        if out.requires_grad:
            out.register_hook(self._backward_started)
        return out

    # The engine runs a backward's final callbacks in the order they were queued, after every node of the
    # graph: this one, queued as the backward starts, runs before DDP's (queued once every bucket is ready),
    # which waits on the all-reduce and raises if it failed; the one it queues runs after DDP's has passed.
    def _backward_started(self, grad: Tensor) -> None:
        queue_backward_callback(self._graph_ran)

    def _graph_ran(self) -> None:
        self.in_gradient_sync = True
        queue_backward_callback(self._gradients_synced)

    def _gradients_synced(self) -> None:
        self.in_gradient_sync = False

    @property
    def received(self) -> Tensor | None:
        """``payload`` summed over the ranks (None until the all-reduce has run)."""
        if self.param is None:
            return self._received
        grad = self.param.grad  # DDP averaged it over the ranks
        return None if grad is None else grad * self.world

    @property
    def averaged(self) -> bool:
        """Whether the all-reduce left the gradients averaged over the ranks (DDP's own), not summed (the hook)."""
        return self.param is not None


class _CarriedGrad(torch.autograd.Function):
    """Identity on the loss; the carrier parameter's gradient is the payload (whatever the loss's gradient)."""

    @staticmethod
    def forward(ctx: Any, loss: Tensor, param: Tensor, payload: Tensor) -> Tensor:
        ctx.payload = payload.detach().to(param.dtype)
        return loss.view_as(loss)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None]:
        return grad, ctx.payload, None


_CARRIER_NAME = "_stabletrain_window_numbers"


def data_parallel(module: torch.nn.Module, device_ids: list[int] | None, *, sums: bool
                  ) -> tuple[torch.nn.parallel.DistributedDataParallel, WindowCarrier]:
    """Wrap ``module`` in DDP with a :class:`WindowCarrier`; ``sums``: the window backpropagates raw sums.

    With ``sums`` and a float32 or float64 parameter in the model, the carrier is a 3-element parameter
    of that dtype, registered on ``module`` only while DDP is built (DDP takes its parameters then) and
    removed after: ``module``'s parameters, state dict and the optimizer never see it, and DDP's own
    all-reduce carries it in the bucket of that dtype. Otherwise the comm hook carries the numbers.

    The gradients are views into DDP's buckets (``gradient_as_bucket_view``): no copy out of the buckets
    after each all-reduce, and one gradient-sized buffer less (stabletrain only changes gradients in place).
    """
    dtypes = {p.dtype for p in module.parameters() if p.requires_grad}
    dtype = next((d for d in (torch.float32, torch.float64) if d in dtypes), None)
    param = None
    if sums and dtype is not None:
        device = next(p.device for p in module.parameters() if p.dtype == dtype)
        param = torch.nn.Parameter(torch.zeros(3, dtype=dtype, device=device))
        module.register_parameter(_CARRIER_NAME, param)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=device_ids, gradient_as_bucket_view=True)
    finally:
        if param is not None:
            delattr(module, _CARRIER_NAME)  # nn.Module's own: out of module._parameters
    return ddp, (WindowCarrier(param=param) if param is not None else register_carrier_hook(ddp))


def _allreduce_carrying(state, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP comm hook: all-reduce the bucket, with the window's numbers if any.

    Without carried numbers: DDP's default (divide by the world size, sum). With them (see
    :mod:`stabletrain.policies.accumulation`): sum (after multiplying by this rank's count, unless the grads hold
    its raw sum already), and append the numbers to bucket 0 (the first launched, and the smallest: DDP
    caps it at 1 MiB), so they cost no collective of their own. A bucket in a low-precision dtype cannot
    hold a count exactly: its numbers go in a second all-reduce, launched at once in float64, never
    waited for here.
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    if state.payload is None:
        return allreduce_hook(state.group, bucket)
    buf = bucket.buffer()
    group = state.group if state.group is not None else dist.group.WORLD
    if state.scale is not None:  # None: the grads hold this rank's raw sum already (a window with sums=True)
        buf.mul_(state.scale)
    if bucket.index() != 0:
        return dist.all_reduce(buf, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0])
    if buf.dtype in (torch.float32, torch.float64):
        n = buf.numel()
        joint = torch.cat([buf, state.payload.to(buf.dtype)])
        state._received = joint[n:]  # summed in place by the all-reduce below
        return dist.all_reduce(joint, group=group, async_op=True).get_future().then(lambda fut: fut.value()[0][:n])
    stats = state.payload.double()
    state._received = stats
    fut_stats = dist.all_reduce(stats, group=group, async_op=True).get_future()
    fut_grads = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return torch.futures.collect_all([fut_grads, fut_stats]).then(lambda fut: fut.value()[0].value()[0])


def register_carrier_hook(ddp_model: torch.nn.parallel.DistributedDataParallel) -> WindowCarrier:
    """Install the comm hook (DDP's all-reduce, carrying the window's numbers) on a DDP model; return its carrier."""
    carrier = WindowCarrier()
    ddp_model.register_comm_hook(carrier, _allreduce_carrying)
    carrier.travels = True
    return carrier


class LossWatch:
    """A rank's non-finite loss through the gradient all-reduce of a backward a host trainer runs (DDP; no sync).

    A gradient hook on the smallest parameter adds ``loss * 0`` (0, or NaN when the loss is not finite) to its
    gradient before DDP all-reduces it: the all-reduced grad norm, which every rank's verdict reads, is then
    non-finite on every rank, and every rank skips the step. No collective of its own.
    """

    def __init__(self, params: list[Tensor]) -> None:
        self.poison: Tensor | None = None  # this step's loss * 0 (None: nothing to add)
        self._hook = min(params, key=lambda p: p.numel()).register_hook(self._add)

    def _add(self, grad: Tensor) -> Tensor:
        return grad if self.poison is None else grad + self.poison.to(grad.dtype)

    def watch(self, loss: Tensor) -> None:
        """Before the host backpropagates a micro-batch's ``loss``."""
        self.poison = loss.detach().float().reshape(()) * 0

    def remove(self) -> None:
        self._hook.remove()
