"""The strategy: one process, DDP or FSDP2 — how the model is wrapped, what the step is built with, the state format.

The loop never branches on how many processes train or how: it asks its strategy, chosen once from the
config and the process group (:func:`strategy_for`)::

    parts = strategy.wrap(module, task, fingerprint)   # the model the step calls, its parameters, precision,
                                                       # accumulation window, DDP carrier, FSDP numerics
    optimizer = strategy.optimizer(parts.named_params, task)
    model_state, optim_state = strategy.state(module, optimizer, named_params, local=..., dcp=...)
    strategy.load_state(module, optimizer, named_params, model_state, optim_state)
    save = strategy.save_checkpoint(state_dict, ckpt, step)   # a checkpoint in its format (the keeper writes it)

============  ===============================================================================================
single        the model as it is; state dicts as torch makes them (``train.compile``: every strategy's step calls
              ``torch.compile`` of its wrapped model; the state stays the eager module's)
ddp           ``DistributedDataParallel`` (:func:`~stabletrain.distributed.carrier.data_parallel`: the window's
              numbers ride the gradient all-reduce); every rank holds the same parameters and optimizer state,
              so state dicts are one process's
fsdp          FSDP2 ``fully_shard`` per block and at the root (:mod:`~stabletrain.distributed.fsdp`); parameters
              are DTensor shards (``sharded``); the state is gathered whole for a full checkpoint (a collective),
              read as this rank's shards for the incident snapshot (``local``), or as DCP's sharded state dicts
              (``dcp``) for a sharded checkpoint
============  ===============================================================================================

A checkpoint is one whole state that rank 0 writes (under DDP with every rank's RNG state and data position),
except FSDP's under ``dist.checkpoint=sharded``: every rank writes its own shards through DCP and rank 0 the
rest (:meth:`Strategy.save_checkpoint`). A sharded (DCP) checkpoint loads under any strategy and world size
(:meth:`Strategy.load_state`); a full one too (FSDP: rank 0's full state is broadcast and each rank keeps its shards).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import console
from ..console import StableTrainWarning
from ..errors import half_params
from ..internals import eager_module
from ..numerics import unique_params
from ..policies.accumulation import AccumulationWindow, sums_safe
from ..policies.optim import build_optimizer, check_optimizer_holds
from ..policies.precision import PrecisionPolicy
from ..records.staging import StateStager, fill_withheld, split_params, state_bytes
from ..seeding import seed_everything

__all__ = ["Strategy", "DDPStrategy", "FSDPStrategy", "Parts", "CheckpointSave", "strategy_for"]


@dataclass
class Parts:
    """What a strategy makes of the task's model: what the step is built from."""

    model: nn.Module  # what the step calls: the DDP wrapper, or the module itself
    named_params: list[tuple[str, nn.Parameter]]
    precision: PrecisionPolicy
    window: AccumulationWindow
    carrier: Any = None  # DDP, FSDP: the WindowCarrier (stabletrain.distributed.carrier)
    numerics: Any = None  # FSDP: ShardedNumerics (norms and checks over DTensor shards)


@dataclass
class CheckpointSave:
    """One checkpoint as a strategy makes it (:meth:`Strategy.save_checkpoint`), for the keeper to write."""

    whole: dict[str, Any]  # what rank 0 writes as the checkpoint's state (DCP: markers for the model and optimizer)
    meta: dict[str, Any] = field(default_factory=dict)  # meta.json's keys from the strategy (world_size)
    shards: Any = None  # this rank's part (DCP's ShardedSave), written in the background unless shards.written
    withheld: str | None = None  # why nothing is written (the same on every rank), else None
    fields: dict[str, Any] = field(default_factory=dict)  # the withheld event's fields

    @property
    def inline_ok(self) -> bool:
        """Whether the keeper may write it in the loop's thread (a part written in the background needs the writer)."""
        return self.shards is None or self.shards.written


class Strategy:
    """One process: the model as it is. The base of the others; see the module docstring."""

    name = "single"
    sharded = False  # parameters are DTensor shards (FSDP2): what build_optimizer is told (fused SGD has no DTensor rule)

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
        half = half_params(module)
        if half is not None:  # (a trial's .half() model trained silently, its report saying "precision fp32")
            bf16 = "bfloat16" in half[0]  # (its range is float32's: nothing underflows, but 8 bits of mantissa round)
            warnings.warn(f"task {self.cfg.task!r}: {half[0]}, a model cast wholesale (.half()): precision="
                          f"{parts.precision.mode} trains those weights in their own dtype, with no float32 master copy" + (
                              ": an update under ~1/256 of its weight rounds away (pure-bf16 training needs stochastic "
                              "rounding or Kahan summation in the optimizer). Keep the model in float32 and set "
                              "precision=bf16 (autocast)" if bf16 else
                              " and no loss scaling: small updates round away and small gradients underflow to 0. Keep the "
                              "model in float32 and set precision=bf16 or fp16 (autocast, and a GradScaler for fp16)"),
                          StableTrainWarning, stacklevel=console.user_stacklevel())
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
        from ..records.checkpoint.shards import is_dcp_entry, load_dcp_state_dicts

        if is_dcp_entry(model_state):  # a collective: DCP reads each rank's part (any world size, any strategy)
            load_dcp_state_dicts(module, optimizer, model_state, optim_state)
        else:
            module.load_state_dict(model_state)
            optimizer.load_state_dict(optim_state)

    # -- the incident snapshot and bundle (stabletrain.services.capture) ------------------------------------------

    def check_after_first_step(self, module: nn.Module, optimizer: torch.optim.Optimizer, built_with: int,
                               task_name: str) -> None:
        """After the run's first step: the optimizer holds every parameter the model has now (a layer its first
        forward made would never train: :func:`~stabletrain.policies.optim.check_optimizer_holds`)."""
        check_optimizer_holds(module, optimizer, built_with, task_name)

    def snapshot_parts(self, local: dict[str, Any], module: nn.Module) -> tuple[Any, Any, tuple[int, int] | None]:
        """(side, rest, share) of this rank's state for :class:`~stabletrain.records.snapshot.IntervalSnapshot`: the
        parameters and optimizer state apart from the rest (:func:`~stabletrain.records.staging.split_params`)."""
        return (*split_params(local, self._param_names(module, local)), None)

    def complete_snapshot(self, side: Any) -> Any:
        """The snapshot's side part as a whole (a collective where each rank holds a share: every rank calls it)."""
        return side

    def snapshot_bytes(self, local: dict[str, Any], module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Host bytes one interval snapshot of this rank takes (the optimizer's state estimated before its first step)."""
        side, rest, share = self.snapshot_parts(local, module)
        side_bytes = state_bytes(side or {}, share=share[1] if share else 1)
        if not optimizer.state:  # before the first step: the state the optimizer will make, estimated
            side_bytes *= 1 + _optimizer_slots(optimizer)
        return side_bytes + state_bytes(rest)

    def bundle_state(self, state_dict: Any, folder: Path | None) -> dict[str, Any] | None:
        """The state before an incident's step, in host memory, as its bundle holds it (``state_dict(**kw)``: the run's).

        Every rank calls it; this one-process format is staged on rank 0 alone (others return None).
        """
        if not self.dist.is_main:
            return None
        staged, ready = StateStager().stage(state_dict())
        for event in ready:
            event.synchronize()
        return staged

    # -- checkpoints (stabletrain.services.checkpoints) ------------------------------------------------------------

    def save_checkpoint(self, state_dict: Any, ckpt: Any, step: int, inline_bytes: int = -1) -> CheckpointSave:
        """The checkpoint of the run's state at ``step`` in this strategy's format; every rank calls it.

        One whole state in the one-process format (``state_dict()``: the run's), which rank 0 writes; under DDP
        with every rank's RNG state and data position (one gather). ``ckpt``: the run's CheckpointManager;
        ``inline_bytes``: a part of at most this size may be written before this returns (the keeper's rule).
        """
        whole, meta = state_dict(), {}
        if self.dist.enabled:
            whole["ranks"] = self.dist.gather_objects({"rng": whole["rng"], "stream": whole["stream"]})
            whole["world_size"] = meta["world_size"] = self.dist.world
        return CheckpointSave(whole, meta)

    def wait_for_checkpoint(self) -> None:
        """Wait for this rank's own part of the checkpoint save in flight, if any (none here). Raises nothing."""

    def one_process_model(self, model_state: Any) -> Any:
        """A snapshot's model state in the one-process format (None where it holds only this rank's shards)."""
        return model_state

    def nonfinite_gradient_ranks(self, module: nn.Module, task: Any, precision: str, window: Any) -> list[int] | None:
        """The ranks whose own gradients for ``window`` are non-finite, where the step's gradients mixed the ranks'
        (a collective under DDP); None: nothing to tell apart."""
        return None

    def spike_ranks(self, module: nn.Module, task: Any, precision: str, window: Any) -> list[int] | None:
        """The rank whose own loss on ``window`` (its micro-batches, the state before the step) is the largest: the one
        that carried a finite spike the step's loss averaged over the ranks. A forward per micro-batch under the run's
        autocast, no gradients, the RNG put back; one collective (FSDP's forward gathers too: every rank calls it).
        None on one process."""
        if not self.dist.enabled:
            return None
        from ..data import move_to
        from ..policies.accumulation import loss_sums

        def own() -> float:
            groups = [(i, move_to(b, self.device)) for i, b in zip(window.indices, window.batches)]
            sums = loss_sums(task.loss, module, groups, PrecisionPolicy(precision, self.device).autocast())
            count = sum(c for _, c in sums)
            return sum(s for s, _ in sums) / count if count else float("nan")

        from .blame import own_loss_rank

        return own_loss_rank(self.dist, own)

    def replay_task(self, task: Any, named_params: list[tuple[str, nn.Parameter]]) -> Any:
        """The task a one-process diagnosis replays (the run's own; FSDP: a model the task factory builds)."""
        return task

    def _param_names(self, module: nn.Module, local: dict[str, Any]) -> set[str]:
        key = (id(module), tuple(local["model"]))
        cache = self.__dict__.setdefault("_names", {})
        names = cache.get(key)
        if names is None:  # a walk of the module per interval otherwise
            cache.clear()
            names = cache[key] = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        return names

    def _seed_rank(self) -> None:
        """Each rank its own random stream, reproducible from (seed, rank), once the model is the same on all."""
        seed_everything(int(np.random.SeedSequence([self.cfg.seed, self.dist.rank]).generate_state(1)[0]))


class DDPStrategy(Strategy):
    """``DistributedDataParallel`` over the process group; see the module docstring."""

    name = "ddp"

    def _wrap(self, module: nn.Module, task: Any, fingerprint: Any) -> tuple[Parts, Any]:
        from .carrier import data_parallel

        parts, fingerprint = super()._wrap(module, task, fingerprint)
        ids = [self.device.index] if self.device.type == "cuda" else None
        # DDP broadcasts rank 0's parameters and buffers; then each rank draws its own random stream.
        parts.model, parts.carrier = data_parallel(module, ids, sums=parts.window.sums)
        self._seed_rank()
        return parts, fingerprint

    def snapshot_parts(self, local: dict[str, Any], module: nn.Module) -> tuple[Any, Any, tuple[int, int] | None]:
        side, rest, _ = super().snapshot_parts(local, module)
        return side, rest, (self.dist.rank, self.dist.world)  # the same on every rank: each copies its share

    def complete_snapshot(self, side: Any) -> Any:
        import torch.distributed as dist

        # One broadcast per tensor from its owner (NCCL: through this rank's device, one tensor at a time).
        return fill_withheld(side, self.device if dist.get_backend() == "nccl" else torch.device("cpu"))

    def nonfinite_gradient_ranks(self, module: nn.Module, task: Any, precision: str, window: Any) -> list[int] | None:
        """Every rank's loss was finite but the all-reduced grad norm was not: whose own gradients are non-finite?
        (:func:`~.blame.own_gradients_bad`: one collective, every rank answers)."""
        from .blame import answered_ranks, own_gradients_bad

        return answered_ranks(self.dist, lambda: own_gradients_bad(module, task, PrecisionPolicy(precision, self.device),
                                                                   window, self.device))


class FSDPStrategy(Strategy):
    """FSDP2 ``fully_shard`` per block and at the root; see the module docstring."""

    name = "fsdp"
    sharded = True
    _saver: Any = None  # dist.checkpoint=sharded: DCP's ShardedSaver, made at the first save

    def check_after_first_step(self, module: nn.Module, optimizer: torch.optim.Optimizer, built_with: int,
                               task_name: str) -> None:
        """Nothing to check: sharding needs every parameter built before the optimizer is (``check_materialized``)."""

    def nonfinite_gradient_ranks(self, module: nn.Module, task: Any, precision: str, window: Any) -> list[int] | None:
        """:meth:`DDPStrategy.nonfinite_gradient_ranks` where no rank's parameter gradients are its own (reduce-scattered
        as they are made): :func:`~.blame.own_outputs_bad` (every rank runs every forward and backward)."""
        from .blame import answered_ranks, own_outputs_bad

        return answered_ranks(self.dist, lambda: own_outputs_bad(module, task, PrecisionPolicy(precision, self.device),
                                                                 window, self.device))

    def _wrap(self, module: nn.Module, task: Any, fingerprint: Any) -> tuple[Parts, Any]:
        from .carrier import WindowCarrier
        from .fsdp import ShardedNumerics, ShardedPrecision, ShardedWindow, running_stats_note, shard_model

        precision = ShardedPrecision(self.cfg.precision, self.device)  # fp16: every rank agrees on an overflow
        if fingerprint is not None:  # the init watch compares plain tensors: compare now, before sharding
            changes = fingerprint.compare(module)
            fingerprint = SimpleNamespace(compare=lambda m: changes)
        note = running_stats_note(module)  # (a new user's BatchNorm model: its resume was off by 5e-3, unsaid)
        if note is not None and self.dist.is_main:
            console.warn(note)
        shard_model(module, task.blocks, reshard_after_forward=self.cfg.dist.reshard_after_forward, precision=precision.mode)
        named = unique_params(module)  # the same names, now DTensor shards
        params = [p for _, p in named]
        # The carrier carries nothing under FSDP: it names the rank whose own loss or inputs were non-finite.
        parts = Parts(module, named, precision, ShardedWindow(module, params), WindowCarrier(), ShardedNumerics())
        self._seed_rank()
        return parts, fingerprint

    def state(self, module: nn.Module, optimizer: torch.optim.Optimizer, named_params: list[tuple[str, nn.Parameter]],
              *, local: bool = False, dcp: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
        if dcp:  # DCP's sharded state dicts: FQN keys, DTensor values (no collective, no copy)
            from ..records.checkpoint.shards import sharded_state_dicts
            return sharded_state_dicts(module, optimizer)
        if local:  # this rank's own shards, live views (no collective, no copy): the incident snapshot
            from .fsdp import local_state_dicts
            return local_state_dicts(module, optimizer)
        from .fsdp import full_state_dicts  # a collective: the one-process format, as DDP's
        return full_state_dicts(module, optimizer, named_params)

    def load_state(self, module: nn.Module, optimizer: torch.optim.Optimizer,
                   named_params: list[tuple[str, nn.Parameter]], model_state: Any, optim_state: Any) -> None:
        from ..records.checkpoint.shards import is_dcp_entry
        from .fsdp import is_local_state, load_full_state_dicts, load_local_state_dicts

        if is_dcp_entry(model_state):
            super().load_state(module, optimizer, named_params, model_state, optim_state)
        elif is_local_state(model_state):  # this rank's own shards, copied back in place
            load_local_state_dicts(module, optimizer, model_state, optim_state)
        else:  # a collective: rank 0's full state is broadcast, each rank keeps its shards
            load_full_state_dicts(module, optimizer, named_params, model_state, optim_state)


    def snapshot_parts(self, local: dict[str, Any], module: nn.Module) -> tuple[Any, Any, tuple[int, int] | None]:
        return None, local, None  # this rank's own shards, all on the compute stream

    def save_checkpoint(self, state_dict: Any, ckpt: Any, step: int, inline_bytes: int = -1) -> CheckpointSave:
        """``dist.checkpoint=sharded``: every rank writes its own shards of the model and optimizer through DCP
        (:mod:`stabletrain.records.checkpoint.shards`), in the background, and rank 0 the rest; else a full state.

        Every rank checks its shards; the verdicts travel with the RNG states and data positions (the one
        all_gather_object), so every rank withholds the same checkpoint, before anything is staged. The first
        save makes DCP's saver (a process group: every rank reaches it together).
        """
        if self.cfg.dist.checkpoint != "sharded":
            return super().save_checkpoint(state_dict, ckpt, step, inline_bytes)
        from ..records.checkpoint.files import first_nonfinite
        from ..records.checkpoint.shards import ShardedSaver, local_tensors, split_for_dcp

        if self._saver is None:
            self._saver = ShardedSaver(self.cfg.dist.timeout_s)
        t0 = time.perf_counter()
        tensors, whole = split_for_dcp(state_dict(dcp=True))
        bad = first_nonfinite(local_tensors(tensors))  # this rank's shards only: no collective
        check_s = time.perf_counter() - t0
        gathered = self.dist.gather_objects({"rng": whole["rng"], "stream": whole["stream"], "nonfinite": bad})
        whole["ranks"] = [{"rng": g["rng"], "stream": g["stream"]} for g in gathered]
        whole["world_size"] = self.dist.world
        meta = {"world_size": self.dist.world}
        bad_ranks = [(r, g["nonfinite"]) for r, g in enumerate(gathered) if g["nonfinite"] is not None]
        if bad_ranks:  # the same list on every rank: none writes anything
            rank, key = bad_ranks[0]
            return CheckpointSave(whole, meta, withheld=f"rank {rank}'s shard of {key} is not finite (NaN/Inf)",
                                  fields={"rank": rank, "key": key})
        tmp = Path(self.dist.on_main(lambda: str(ckpt.begin_sharded(step))))
        shards = self._saver.start(tensors, tmp, step, inline_bytes=inline_bytes)  # blocks for the staging copy (or writes)
        shards.timings["shard_check_s"] = check_s
        return CheckpointSave(whole, meta, shards=shards)

    def wait_for_checkpoint(self) -> None:
        """Wait for this rank's DCP shards of the save in flight, if any. Raises nothing (rank 0's outcome says it)."""
        if self._saver is not None:
            self._saver.wait()

    def one_process_model(self, model_state: Any) -> Any:
        return None  # this rank's shards

    def bundle_state(self, state_dict: Any, folder: Path | None) -> dict[str, Any] | None:
        """Every rank writes its shards of the pre-step model and optimizer into ``folder`` with DCP (a collective).

        Returns the rest of the state in host memory, with DCP markers in place of the model and the optimizer
        (:func:`~stabletrain.records.checkpoint.shards.split_for_dcp`): what rank 0's bundle holds. No rank holds
        more than its shards: :func:`~stabletrain.records.bundles.load_bundle` reads them whole for the
        one-process diagnosis. None without a folder (no run directory).
        """
        import torch.distributed.checkpoint as dcp

        from ..records.checkpoint.shards import split_for_dcp

        if folder is None:
            return None
        tensors, whole = split_for_dcp(state_dict(dcp=True))  # live views of this rank's shards
        folder.mkdir(parents=True, exist_ok=True)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(folder)))  # written before the state moves on
        staged, ready = StateStager().stage(whole)
        for event in ready:
            event.synchronize()
        return staged

    def replay_task(self, task: Any, named_params: list[tuple[str, nn.Parameter]]) -> Any:
        """A sharded model cannot run on one process: the task factory (config key ``task``) builds a fresh one,
        which the bundle's full state then fills; its parameters must be the run's, by name (``fully_shard``
        keeps every parameter's name). The data stays the run's own."""
        import dataclasses

        from ..tasks import resolve_task

        model = resolve_task(self.cfg.task, self.cfg.task_args).model
        names, want = [n for n, _ in unique_params(model)], [n for n, _ in named_params]
        if names != want:
            raise ValueError(f"config key 'task' ({self.cfg.task!r}) builds a model whose parameters "
                             f"({', '.join(names[:3])}, ...) are not the run's ({', '.join(want[:3])}, ...); under "
                             "dist.strategy=fsdp the diagnosis rebuilds the model from the task factory: name the task "
                             "by config key 'task' (module:function), or diagnose the bundle with "
                             "stabletrain.incident_replay.diagnose_incident(INCIDENT_DIR, task) and an unsharded task")
        return dataclasses.replace(task, model=model)


def _optimizer_slots(optimizer: torch.optim.Optimizer) -> int:
    """Tensors the size of a parameter the optimizer's state will hold per parameter (SGD: 1 with momentum, else 0; 2 else).

    Adam and AdamW hold two (exp_avg, exp_avg_sq); 2 is assumed for any other optimizer.
    """
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(group.get("momentum") for group in optimizer.param_groups) else 0
    return 2


def strategy_for(cfg: Any, dist: Any, device: torch.device) -> Strategy:
    """The run's strategy: FSDP2 or DDP under a process group of more than one rank (``dist.strategy``), else one process."""
    if not dist.enabled:
        return Strategy(cfg, dist, device)
    return (FSDPStrategy if cfg.dist.strategy == "fsdp" else DDPStrategy)(cfg, dist, device)
