"""Distributed data parallel: the process group and the few collectives the loop needs (launching: :mod:`.launch`).

The same loop runs on one process or on N under ``torchrun`` (DDP; gloo on CPU, NCCL on CUDA)::

    torchrun --nproc_per_node=2 -m stabletrain train ...     # any torchrun setup, one or many machines
    stabletrain train dist.nproc=2 ...                        # the same on this machine: launches torchrun

Global batch = ``train.batch_size`` x ``accum.steps`` x world size. Where the ranks talk, and why:

==========================  ======================================================================
every optimizer step        DDP's gradient all-reduce on the last micro-batch (no_sync before it); it
                            also carries the window's (loss sum, count[, inputs flag]) (WindowCarrier,
                            accumulation.py): one collective per bucket, nothing else
every log interval          one all-gather of each rank's per-step "saw a non-finite value" flags
                            and pending signal (metrics.py); everything else is already global
validation                  one all-reduce of the (loss sum, count) of each rank's share of batches
checkpoint / incident       all_gather_object of each rank's RNG state and data position / window
start, resume, rollback     rank 0 decides (run dir, checkpoint to load) and broadcasts the decision
==========================  ======================================================================

Every decision is the same on every rank because it is made from values that are identical on every
rank: the all-reduced window loss, the grad norm of the all-reduced gradients, the parameters DDP
keeps in lockstep. A non-finite gradient on one rank is non-finite on all after the all-reduce (a sum
with NaN is NaN, Inf + finite is Inf), so every rank skips the step together.

Only rank 0 writes the run directory. A collective that fails because a peer exited or hangs past
``dist.timeout_s`` raises :class:`PeerLostError` with one clear line; checkpoints are atomic, so the
last one written stays loadable.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ..internals import queue_backward_callback
from .launch import LAUNCHER_ENV, die_with_parent, launch, leave_word, under_torchrun

__all__ = [
    "DistContext",
    "PeerLostError",
    "WindowCarrier",
    "data_parallel",
    "die_with_parent",
    "is_peer_failure",
    "launch",
    "process_group",
    "register_carrier_hook",
    "under_torchrun",
]

T = TypeVar("T")


class PeerLostError(RuntimeError):
    """A collective failed: another rank exited, crashed or did not answer within ``dist.timeout_s``."""

    def __init__(self, rank: int, where: str, step: int, last_good: str | None, cause: str,
                 run_dir: str | None = None) -> None:
        self.rank, self.where, self.step, self.last_good, self.cause = rank, where, step, last_good, cause
        saved = (f"no checkpoint was written after {last_good} (LAST_GOOD)" if last_good else "no checkpoint was written")
        hint = f"; resume with: stabletrain train --resume {run_dir}" if run_dir and last_good else ""
        super().__init__(f"rank {rank}: another rank exited or became unreachable during {where} after step {step}; "
                         f"{saved}{hint} ({short_cause(cause)})")


def short_cause(message: str) -> str:
    """Return the gist of a gloo/NCCL error: its first line without source paths and boilerplate."""
    import re

    line = message.strip().splitlines()[0] if message.strip() else "no message"
    line = re.sub(r"\[[^\]]*\.(cpp|cc|h|hpp):\d+\]\s*", "", line)
    line = line.split(". This is typically caused by")[0]
    line = re.sub(r"^Got the following error when running the callback:\s*", "", line)
    return line[:200]


_DIST_DIR = os.path.dirname(dist.__file__) + os.sep
_ENGINE_FILE = os.path.normcase(os.path.abspath(torch.autograd.graph.__file__))


def is_peer_failure(err: BaseException, *, in_gradient_sync: bool = False) -> bool:
    """Return whether ``err`` is a collective failing for want of a peer (another rank exited, hung, is unreachable).

    Decided from the exception's type, where it arose and the process group's state, never from its
    message (a ``DataLoader timed out`` or a user's own "connection reset" is not a lost peer):

    - no process group is initialized: False;
    - a :class:`torch.distributed.DistError` (``DistBackendError``: NCCL's failed or timed-out
      collectives; ``DistNetworkError``; ``DistStoreError``): c10d's own types for a failed communication;
    - a plain ``RuntimeError`` (gloo's failures are exactly that) raised inside a collective: its
      innermost frame is in ``torch.distributed`` (an explicit collective, FSDP's, DCP's), or it came out
      of the autograd engine while DDP waited on its gradient all-reduce, after the backward's graph had
      run (``in_gradient_sync``: :attr:`WindowCarrier.in_gradient_sync`). An error of the graph itself
      (an in-place modification, a user's backward) arises before that and is the user's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    if isinstance(err, dist.DistError):
        return True
    if type(err) is not RuntimeError or err.__traceback__ is None:
        return False
    innermost = os.path.normcase(os.path.abspath(traceback.extract_tb(err.__traceback__)[-1].filename))
    return innermost.startswith(os.path.normcase(_DIST_DIR)) or (in_gradient_sync and innermost == _ENGINE_FILE)


@dataclass
class DistContext:
    """This process's place in the run: rank, world size, and the few collectives the loop uses.

    With ``world == 1`` every method is a plain local call (no collective, no overhead).
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    group: Any = None

    @classmethod
    def current(cls) -> DistContext:
        """Return the context of the initialized default process group, or a world of one."""
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            return cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
        return cls()

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def on_main(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on rank 0 only and return its result on every rank (an exception is raised on all).

        One broadcast of a pickled object: for one-time decisions (run dir, checkpoint to load), never per step.
        """
        if self.world == 1:
            return fn()
        payload: list[Any] = [None]
        error: BaseException | None = None
        if self.rank == 0:
            try:
                payload = [("ok", fn())]
            except Exception as err:  # every rank raises it, so none waits on a collective that never comes
                error = err
                payload = [("error", type(err), str(err))]
        dist.broadcast_object_list(payload, src=0, group=self.group)
        if payload[0][0] == "error":
            if error is not None:
                raise error
            _, kind, message = payload[0]
            try:
                raise kind(message)
            except TypeError:  # an exception type that needs more arguments than a message
                raise RuntimeError(message) from None
        return payload[0][1]

    def gather_objects(self, obj: Any) -> list[Any]:
        """Return every rank's ``obj`` (pickled), in rank order, on every rank. Syncs; not for the step path."""
        if self.world == 1:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_reduce_(self, tensor: Tensor) -> Tensor:
        """Sum ``tensor`` over the ranks in place (on its device, no host sync of its own); return it."""
        if self.world > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_gather(self, tensor: Tensor) -> Tensor:
        """Return the ranks' ``tensor``s stacked along a new first dimension (``[world, ...]``)."""
        if self.world == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.world)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)


def _backend(choice: str) -> str:
    if choice != "auto":
        if choice == "nccl" and not torch.cuda.is_available():
            raise ValueError("config key 'dist.backend': nccl asked for, but CUDA is not available; use gloo or auto")
        return choice
    return "nccl" if torch.cuda.is_available() else "gloo"


@contextlib.contextmanager
def process_group(backend: str = "auto", timeout_s: float = 120.0, nproc: int = 1) -> Iterator[DistContext]:
    """Initialize the default process group from torchrun's environment; destroy it on the way out.

    Outside torchrun (no ``WORLD_SIZE`` > 1 in the environment) this yields a world of one and does
    nothing. On CUDA each process uses ``cuda:LOCAL_RANK``. ``timeout_s`` bounds how long a collective
    waits for a peer (a dead or hung rank then raises instead of hanging). ``nproc`` (``dist.nproc``)
    must be 1 or the world size torchrun started.
    """
    if not under_torchrun() or (dist.is_initialized() and dist.get_world_size() > 1):
        yield DistContext.current()
        return
    if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank of torchrun's: it goes when torchrun does (and so with a launcher)
        launcher = os.environ.pop(LAUNCHER_ENV, None)  # popped: this rank's own children are not ranks
        die_with_parent(grandparent=int(launcher) if launcher else None)
    world = int(os.environ["WORLD_SIZE"])
    if nproc not in (1, world):
        raise ValueError(f"config key 'dist.nproc': {nproc}, but torchrun started {world} processes; "
                         f"drop dist.nproc under torchrun or make them agree")
    chosen = _backend(backend)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if chosen == "nccl":
        torch.cuda.set_device(local_rank)
        # A failed NCCL collective aborts the communicator (the watchdog then raises) instead of hanging.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    kwargs: dict[str, Any] = {"device_id": torch.device("cuda", local_rank)} if chosen == "nccl" else {}
    dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    try:
        yield DistContext.current()
    except BaseException as err:
        leave_word(err)  # for torchrun's agent: why this rank ends (stabletrain.distributed.elastic passes it on)
        with contextlib.suppress(Exception):  # a dead peer must not turn a clear error into a second one
            dist.destroy_process_group()
        raise
    else:
        # No rank tears its process group down while another still has a collective in flight: gloo's
        # background thread would see the connection close and abort that process (std::terminate).
        with contextlib.suppress(Exception):
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


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
    peer) from an error of the backward's graph (:func:`is_peer_failure`). Which rank saw a non-finite
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
