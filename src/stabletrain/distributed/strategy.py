"""The strategy: one process, DDP or FSDP2 — how the model is wrapped, what the step is built with, the state format.

The loop never branches on how many processes train or how: it asks its strategy, chosen once from the
config and the process group (:func:`strategy_for`)::

    parts = strategy.wrap(module, task, fingerprint)   # the model the step calls, its parameters, precision,
                                                       # accumulation window, DDP carrier, FSDP numerics
    optimizer = strategy.optimizer(parts.named_params, task)
    model_state, optim_state = strategy.state(module, optimizer, named_params, local=..., dcp=...)
    strategy.load_state(module, optimizer, named_params, model_state, optim_state)

============  ===============================================================================================
single        the model as it is; state dicts as torch makes them (``train.compile``: every strategy's step calls
              ``torch.compile`` of its wrapped model; the state stays the eager module's)
ddp           ``DistributedDataParallel`` (:func:`~stabletrain.distributed.ddp.data_parallel`: the window's
              numbers ride the gradient all-reduce); every rank holds the same parameters and optimizer state
              (``replicated``), so state dicts are one process's
fsdp          FSDP2 ``fully_shard`` per block and at the root (:mod:`~stabletrain.distributed.fsdp`); parameters
              are DTensor shards (``sharded``); the state is gathered whole for a full checkpoint (a collective),
              read as this rank's shards for the incident snapshot (``local``), or as DCP's sharded state dicts
              (``dcp``) for a sharded checkpoint
============  ===============================================================================================

A sharded (DCP) checkpoint loads under any strategy and world size; a full one too (FSDP: rank 0's full
state is broadcast and each rank keeps its shards).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from ..internals import eager_module
from ..numerics import unique_params
from ..policies.accumulation import AccumulationWindow, sums_safe
from ..policies.optim import build_optimizer
from ..policies.precision import PrecisionPolicy
from ..seeding import seed_everything

__all__ = ["Strategy", "DDPStrategy", "FSDPStrategy", "Parts", "strategy_for"]


@dataclass
class Parts:
    """What a strategy makes of the task's model: what the step is built from."""

    model: nn.Module  # what the step calls: the DDP wrapper, or the module itself
    named_params: list[tuple[str, nn.Parameter]]
    precision: PrecisionPolicy
    window: AccumulationWindow
    carrier: Any = None  # DDP, FSDP: the WindowCarrier (stabletrain.distributed.ddp)
    numerics: Any = None  # FSDP: ShardedNumerics (norms and checks over DTensor shards)


class Strategy:
    """One process: the model as it is. The base of the others; see the module docstring."""

    name = "single"
    sharded = False  # parameters are DTensor shards (FSDP2)
    replicated = False  # every rank holds the same parameters and optimizer state (DDP over several ranks)

    def __init__(self, cfg: Any, dist: Any, device: torch.device) -> None:
        self.cfg, self.dist, self.device = cfg, dist, device

    def wrap(self, module: nn.Module, task: Any, fingerprint: Any) -> tuple[Parts, Any]:
        """Return the step's parts for ``module`` (already on the device) and the init fingerprint to compare later.

        ``train.compile``: the model the step calls is ``torch.compile`` of the wrapped one (DDP's wrapper, so
        its optimizer splits the graph at the buckets; FSDP2's root). ``module`` itself stays eager: the
        state dicts, the parameter names (no ``_orig_mod.``), validation and the incident diagnosis use it.
        """
        if eager_module(module) is not module:
            raise ValueError(f"task {self.cfg.task!r}: the model is already a torch.compile wrapper (OptimizedModule); give "
                             "the module itself and set config key 'train.compile' to true (checkpoints, diagnoses and "
                             "resume then use its own parameter names, without '_orig_mod.')")
        parts, fingerprint = self._wrap(module, task, fingerprint)
        if self.cfg.train.compile:
            parts.model = torch.compile(parts.model)
        return parts, fingerprint

    def _wrap(self, module: nn.Module, task: Any, fingerprint: Any) -> tuple[Parts, Any]:
        precision = PrecisionPolicy(self.cfg.precision, self.device)
        named = unique_params(module)
        params = [p for _, p in named]
        window = AccumulationWindow(params, sums=sums_safe(params, precision))  # raw loss sums where it is safe
        return Parts(module, named, precision, window), fingerprint

    def optimizer(self, named_params: list[tuple[str, nn.Parameter]], task: Any) -> torch.optim.Optimizer:
        return build_optimizer(named_params, self.cfg.optim, self.device, task.optimizer, sharded=self.sharded)

    def state(self, module: nn.Module, optimizer: torch.optim.Optimizer, named_params: list[tuple[str, nn.Parameter]],
              *, local: bool = False, dcp: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        """(model state, optimizer state) as a checkpoint or snapshot holds them (see the module docstring)."""
        return module.state_dict(), optimizer.state_dict()

    def load_state(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                   named_params: list[tuple[str, nn.Parameter]], model_state: Any, optim_state: Any) -> None:
        """Load what :meth:`state` returned, or a checkpoint written under any strategy and world size."""
        from ..records.checkpoint.sharded import is_dcp_entry, load_dcp_state_dicts

        if is_dcp_entry(model_state):  # a collective: DCP reads each rank's part (any world size, any strategy)
            load_dcp_state_dicts(module, optimizer, model_state, optim_state)
        else:
            module.load_state_dict(model_state)
            optimizer.load_state_dict(optim_state)

    def _seed_rank(self) -> None:
        """Each rank its own random stream, reproducible from (seed, rank), once the model is the same on all."""
        seed_everything(int(np.random.SeedSequence([self.cfg.seed, self.dist.rank]).generate_state(1)[0]))


class DDPStrategy(Strategy):
    """``DistributedDataParallel`` over the process group; see the module docstring."""

    name = "ddp"
    replicated = True

    def _wrap(self, module: nn.Module, task: Any, fingerprint: Any) -> tuple[Parts, Any]:
        from .ddp import data_parallel

        parts, fingerprint = super()._wrap(module, task, fingerprint)
        ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers; then each rank draws its own random stream.
        parts.model, parts.carrier = data_parallel(module, ids, sums=parts.window.sums)
        self._seed_rank()
        return parts, fingerprint


class FSDPStrategy(Strategy):
    """FSDP2 ``fully_shard`` per block and at the root; see the module docstring."""

    name = "fsdp"
    sharded = True

    def _wrap(self, module: nn.Module, task: Any, fingerprint: Any) -> tuple[Parts, Any]:
        from .ddp import WindowCarrier
        from .fsdp import ShardedNumerics, ShardedPrecision, ShardedWindow, shard_model

        precision = ShardedPrecision(self.cfg.precision, self.device)  # fp16: every rank agrees on an overflow
        if fingerprint is not None:  # the init watch compares plain tensors: compare now, before sharding
            changes = fingerprint.compare(module)
            fingerprint = SimpleNamespace(compare=lambda m: changes)
        shard_model(module, task.blocks, reshard_after_forward=self.cfg.dist.reshard_after_forward,
                    precision=precision.mode)
        named = unique_params(module)  # the same names, now DTensor shards
        params = [p for _, p in named]
        # The carrier carries nothing under FSDP: it names the rank whose own loss or inputs were non-finite.
        parts = Parts(module, named, precision, ShardedWindow(module, params), WindowCarrier(), ShardedNumerics())
        self._seed_rank()
        return parts, fingerprint

    def state(self, module: nn.Module, optimizer: torch.optim.Optimizer, named_params: list[tuple[str, nn.Parameter]],
              *, local: bool = False, dcp: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        if dcp:  # DCP's sharded state dicts: FQN keys, DTensor values (no collective, no copy)
            from ..records.checkpoint.sharded import sharded_state_dicts
            return sharded_state_dicts(module, optimizer)
        if local:  # this rank's own shards, live views (no collective, no copy): the incident snapshot
            from .fsdp import local_state_dicts
            return local_state_dicts(module, optimizer)
        from .fsdp import full_state_dicts  # a collective: the one-process format, as DDP's
        return full_state_dicts(module, optimizer, named_params)

    def load_state(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                   named_params: list[tuple[str, nn.Parameter]], model_state: Any, optim_state: Any) -> None:
        from .fsdp import is_local_state, load_full_state_dicts, load_local_state_dicts
        from ..records.checkpoint.sharded import is_dcp_entry

        if is_dcp_entry(model_state):
            super().load_state(module, optimizer, named_params, model_state, optim_state)
        elif is_local_state(model_state):  # this rank's own shards, copied back in place
            load_local_state_dicts(module, optimizer, model_state, optim_state)
        else:  # a collective: rank 0's full state is broadcast, each rank keeps its shards
            load_full_state_dicts(module, optimizer, named_params, model_state, optim_state)


def strategy_for(cfg: Any, dist: Any, device: torch.device) -> Strategy:
    """The run's strategy: FSDP2 or DDP under a process group of more than one rank (``dist.strategy``), else one process."""
    if not dist.enabled:
        return Strategy(cfg, dist, device)
    return (FSDPStrategy if cfg.dist.strategy == "fsdp" else DDPStrategy)(cfg, dist, device)
