"""The process group and the few collectives the loop needs (launching: :mod:`.launch`; a lost peer: :mod:`.peers`).

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
``dist.timeout_s`` raises :class:`~.peers.PeerLostError` with one clear line; checkpoints are atomic, so the
last one written stays loadable.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from .. import console
from ..internals import InternalMissing, end_dcp_process
from ..process import die_with_parent
from .launch import LAUNCHER_ENV, leave_word, under_torchrun

__all__ = ["DistContext", "process_group"]

T = TypeVar("T")


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
        if backend == "nccl" and not torch.cuda.is_available() and not dist.is_initialized():  # (refused on several)
            console.warn("config key 'dist.backend': nccl, but CUDA is not available: one process makes no process "
                         "group, so it is ignored here (several processes refuse it; gloo or auto runs them)")
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
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get("LOCAL_WORLD_SIZE") == str(world):
        # A user's own torchrun on one machine shares its agent's store with the ranks, and it outlives a restart, with
        # the process group's keys of the attempt before: restarted ranks read those addresses and fail to connect, or
        # hang in the group's set-up (pytorch/pytorch#135712; a trial with `torchrun --max-restarts=2` and a rank
        # killed). Each attempt's group gets keys of its own, by the one agent's restart count (several machines'
        # agents count their own restarts, which may differ: there TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is needed).
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timeout)
        kwargs.update(store=dist.PrefixStore(f"stabletrain/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                                             store), rank=int(os.environ["RANK"]), world_size=world)
    dist.init_process_group(chosen, timeout=timeout, **kwargs)
    try:
        yield DistContext.current()
    except BaseException as err:
        leave_word(err)  # for torchrun's agent: why this rank ends (stabletrain.distributed.elastic passes it on)
        with contextlib.suppress(Exception):  # a dead peer must not turn a clear error into a second one
            dist.destroy_process_group()
        _end_checkpoint_process()
        raise
    else:
        # No rank tears its process group down while another still has a collective in flight: gloo's
        # background thread would see the connection close and abort that process (std::terminate).
        with contextlib.suppress(Exception):
            dist.barrier()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        _end_checkpoint_process()


def _end_checkpoint_process() -> None:
    """End DCP's checkpoint process of this rank (sharded checkpoints), its last save already waited for.

    Left to the rank's exit it would read a closed pipe and die on an EOFError traceback on the console.
    """
    with contextlib.suppress(InternalMissing):  # a torch without it: only that traceback at exit
        end_dcp_process()
