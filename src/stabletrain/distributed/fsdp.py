"""FSDP2 (``dist.strategy=fsdp``): shard the model per block, and the step's measurements over DTensor shards.

Under ``fully_shard`` every parameter is a DTensor sharded along dim 0 over the ranks, and so is its
gradient after the reduce-scatter. The step keeps every guarantee of the DDP path with these pieces:

==========================  ======================================================================
sharding                    :func:`shard_model`: ``fully_shard`` on each block (``Task.blocks``, else
                            the children of every top-level ``nn.ModuleList``) and at the root
accumulation                :class:`ShardedWindow`: gradient sync only on the last micro-batch
                            (``set_requires_gradient_sync(False)`` before the others); the window is
                            normalized by the global item count exactly as under DDP
norms                       :meth:`ShardedNumerics.grad_norms`: squared norms of the local shards,
                            ONE all-reduce of the per-parameter vector, then the square root: the
                            global norm and each parameter's global share, the same on every rank
                            (no ``full_tensor()``), so the skip is decided identically everywhere
post-update check           :meth:`ShardedNumerics.all_params_finite`: local shards, one 1-element
                            all-reduce
precision                   bf16: FSDP2's ``MixedPrecisionPolicy`` (bf16 compute, fp32 reduce);
                            fp16: :class:`ShardedPrecision` agrees on the scaler's overflow flag
incident snapshot           :func:`local_state_dicts` / :func:`load_local_state_dicts`: each rank's
                            own shards, staged to host memory at every log interval and copied
                            back in place (no collective); the capture replays on every rank
                            together and each rank writes its shards of the bundle with DCP
checkpoints                 :func:`full_state_dicts` / :func:`load_full_state_dicts`: full (unsharded)
                            model and optimizer state dicts on CPU, so checkpoints are the same
                            files as under DDP or one process
==========================  ======================================================================

None of it reads a device value on the host. A NaN in one rank's shard makes the all-reduced sum of
squares NaN on every rank (a sum with NaN is NaN), so every rank skips the step together.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from ..internals import fsdp_param_records, fsdp_pending_grads, scaler_found_inf
from ..numerics import running_stats_modules, update_totals
from ..policies.accumulation import AccumulationWindow
from ..policies.precision import PrecisionPolicy

__all__ = [
    "ShardedNumerics",
    "ShardedPrecision",
    "ShardedWindow",
    "default_blocks",
    "full_state_dicts",
    "is_local_state",
    "load_full_state_dicts",
    "load_local_state_dicts",
    "local_state_dicts",
    "running_stats_note",
    "shard_model",
]


def _fsdp():
    from torch.distributed.fsdp import FSDPModule, fully_shard

    return FSDPModule, fully_shard


def default_blocks(model: nn.Module) -> list[nn.Module]:
    """Return the children of every outermost ``nn.ModuleList`` in ``model`` (a transformer's blocks).

    Empty when the model has no ModuleList: the root is then the only FSDP unit.
    """
    blocks: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if isinstance(child, nn.ModuleList):
                blocks.extend(m for m in child if any(p.requires_grad for p in m.parameters()))
            else:
                visit(child)

    visit(model)
    return blocks


def shard_model(model: nn.Module, blocks: Sequence[nn.Module] | None = None, *, reshard_after_forward: bool = True,
                precision: str = "fp32") -> nn.Module:
    """Apply ``fully_shard`` to each block, then to the root; return the (same, now sharded) root module.

    Rank 0's parameters and buffers are broadcast first (as DDP does), so every rank shards the same
    model whatever its own random init. In place: the module's parameters become DTensors (same names).
    ``precision="bf16"``: FSDP2's ``MixedPrecisionPolicy`` gathers the parameters in bf16 for compute
    and reduces the gradients in fp32; the shards, their gradients and the optimizer stay fp32.
    """
    _, fully_shard = _fsdp()
    blocks = default_blocks(model) if blocks is None else list(blocks)
    inside = {id(m) for m in model.modules()}
    for block in blocks:
        if id(block) not in inside or block is model:
            raise ValueError(f"Task.blocks: {type(block).__name__} is not a submodule of the task's model (or is the "
                             "model itself); name the blocks as modules of Task.model")
    if dist.is_initialized() and dist.get_world_size() > 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
    kwargs: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if precision == "bf16":
        from torch.distributed.fsdp import MixedPrecisionPolicy

        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, **kwargs)
    # The root stays gathered after forward whatever the blocks do (torch's own default for a root): its
    # parameters (embeddings, the head) are the first the backward needs, so resharding them would cost
    # one more all-gather per step with nothing to overlap it.
    fully_shard(model, **{**kwargs, "reshard_after_forward": False})
    return model


class ShardedWindow(AccumulationWindow):
    """The accumulation window under FSDP2: rescales the unsharded gradients FSDP holds between syncs.

    Between reduce-scatters FSDP2 accumulates each parameter's full gradient outside ``param.grad``
    (on its unsharded parameter, or in the reduce dtype under a mixed-precision policy); the window's
    running renormalization (``D_{i-1} / D_i``, see :mod:`stabletrain.policies.accumulation`) must scale those.
    """

    def __init__(self, model: nn.Module, params: list[Tensor], process_group: Any = None) -> None:
        self.model = model
        self._records = fsdp_param_records(model)  # fixed once sharded: no module walk per micro-batch
        if not self._records and any(True for _ in model.parameters()):
            raise RuntimeError("ShardedWindow: no FSDP2 parameter groups found under the model; shard it with "
                               "stabletrain.distributed.fsdp.shard_model first")
        super().__init__(params, process_group)

    @property
    def params(self) -> list[Any]:  # what AccumulationWindow.normalize rescales: anything with a .grad
        return [SimpleNamespace(grad=grad) for grad in fsdp_pending_grads(self._records)]

    @params.setter
    def params(self, value: list[Tensor]) -> None:
        self._sharded = value


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (its storage: writing to it writes the DTensor), else ``t``."""
    if not isinstance(t, DTensor):
        return t
    if torch.is_grad_enabled():  # to_local() under grad mode would record an autograd node per call
        with torch.no_grad():
            return t.to_local()
    return t.to_local()


def _replicated(t: Tensor) -> bool:
    return not isinstance(t, DTensor)


class ShardedNumerics:
    """The step's norms and checks over DTensor shards, each reduced across ranks in one collective.

    Pass to :class:`~stabletrain.step.TrainStep` as ``numerics=``. Every method returns device
    tensors and reads nothing on the host; each issues exactly one all-reduce over ``group``.
    A parameter that is not a DTensor (replicated on every rank) counts once, not once per rank.
    """

    def __init__(self, group: Any = None) -> None:
        self.group = group

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group) if dist.is_initialized() else 1

    def _all_reduce(self, t: Tensor) -> Tensor:
        if self.world > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def _weights(self, params: Sequence[Tensor], device: torch.device) -> Tensor | None:
        """Per-parameter 1/world for replicated (non-DTensor) tensors, so their all-reduced square counts once."""
        if all(not _replicated(p) for p in params):
            return None
        return torch.tensor([1.0 / self.world if _replicated(p) else 1.0 for p in params], device=device)

    def grad_norms(self, params: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """Return (global L2 grad norm, per-parameter global L2 grad norms), fp32 device tensors, the same on every rank.

        Squared norms of the local shards, ONE all-reduce (sum) of the per-parameter vector, then the
        square root. A parameter without a grad counts as zero; an empty local shard adds zero.
        """
        device = _local(params[0]).device if params else torch.device("cpu")
        sq = torch.zeros(len(params), dtype=torch.float32, device=device)
        idx = [i for i, p in enumerate(params) if p.grad is not None]
        if idx:
            norms = torch.stack(torch._foreach_norm([_local(params[i].grad) for i in idx])).float()
            if len(idx) == len(params):  # the common case: no scatter
                sq = norms * norms
            else:
                sq = sq.index_copy(0, torch.tensor(idx, device=device), norms * norms)
        weights = self._weights(params, device)
        if weights is not None:
            sq = sq * weights
        per = self._all_reduce(sq).sqrt()
        return torch.linalg.vector_norm(per), per

    @torch.no_grad()
    def all_params_finite(self, params: Iterable[Tensor]) -> Tensor:
        """Return a 0-dim bool device tensor: every shard on every rank is finite (one 1-element all-reduce)."""
        local = [_local(p).detach() for p in params]  # the local tensor first: no DTensor dispatch per parameter
        local = [t for t in local if t.numel() > 0]
        device = local[0].device if local else torch.device("cpu")
        if not local:
            bad = torch.zeros(1, device=device)
        elif device.type == "cpu":  # as numerics.all_params_finite: aminmax is the cheapest exact check on CPU
            bad = (~torch.isfinite(torch.stack([v for t in local for v in torch.aminmax(t)])).all()).float().reshape(1)
        else:
            bad = (~torch.isfinite(torch.stack(torch._foreach_norm(local, ord=math.inf))).all()).float().reshape(1)
        return self._all_reduce(bad)[0] == 0

    @torch.no_grad()
    def snapshot(self, params: Sequence[Tensor], reuse: list[Tensor] | None = None) -> list[Tensor]:
        """Return copies of this rank's shards of ``params`` (into ``reuse`` when it fits), for :meth:`update_norm`."""
        local = [_local(p).detach() for p in params]  # the local tensor first: no DTensor dispatch per parameter
        if reuse is None or len(reuse) != len(local) or any(r.shape != t.shape for r, t in zip(reuse, local)):
            return [t.clone() for t in local]
        torch._foreach_copy_(reuse, local)
        return reuse

    @torch.no_grad()
    def update_norms(self, params: Sequence[Tensor], before: Sequence[Tensor]) -> dict[str, Tensor]:
        """:func:`~stabletrain.numerics.update_norms` over all shards: per-parameter squares, ONE all-reduce."""
        now = [_local(p).detach().float() for p in params]
        old = [_local(b).float() for b in before]
        deltas = torch._foreach_sub(now, old)
        d = torch.stack(torch._foreach_norm(deltas)).float() ** 2
        w = torch.stack(torch._foreach_norm(old)).float() ** 2
        weights = self._weights(params, d.device)
        if weights is not None:
            d, w = d * weights, w * weights
        per = self._all_reduce(torch.stack([d, w])).sqrt()
        return update_totals(per[0], per[1])

    def update_norm(self, params: Sequence[Tensor], before: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
        """Return (||theta_t - theta_{t-1}||, its ratio to ||theta_{t-1}||) over all shards (one all-reduce)."""
        out = self.update_norms(params, before)
        return out["update_norm"], out["update_ratio"]


# -- precision ----------------------------------------------------------------------------------------

class ShardedPrecision(PrecisionPolicy):
    """The precision policy under FSDP2: fp16's overflow check is agreed on by every rank.

    Each rank's GradScaler inspects only its own gradient shards, so an overflow in one shard would
    back off the loss scale on that rank alone. After unscaling, the scaler's ``found_inf`` is
    all-reduced (max) in place, on the device: the skip and the scale update are the same on every
    rank. One 1-element all-reduce per step, in fp16 only.
    """

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        first = self.scaler is not None and id(optimizer) not in self._unscaled
        super().unscale_(optimizer)
        if first and dist.is_initialized() and dist.get_world_size() > 1:
            for found in scaler_found_inf(self.scaler, optimizer):
                dist.all_reduce(found, op=dist.ReduceOp.MAX)


# -- this rank's own shards (the incident snapshot) ---------------------------------------------------

#: The ``format`` of :func:`local_state_dicts`' dicts (what :meth:`Trainer.load_state_dict` recognizes).
LOCAL_SHARDS = "local_shards"


def _optimizer_params(optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The optimizer's parameters in ``optimizer.state_dict()``'s integer-id order."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def local_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return this rank's own shards of the model and optimizer state: live views, no collective, no copy.

    The counterpart of :func:`full_state_dicts` for a snapshot that stays on each rank (the incident
    recorder's, taken at every log interval): stage the result into host buffers
    (:class:`~stabletrain.records.staging.StateStager`) before the run changes it, and put a staged copy
    back with :func:`load_local_state_dicts`. The model dict holds every parameter's and buffer's local
    tensor by name; the optimizer dict holds the per-parameter state (integer ids in parameter-group
    order, DTensor values as their local tensors; ``where`` says which were DTensors) and the
    groups' hyperparameters. Only a rank of the same world size and sharding can load it back.
    """
    tensors = {name: _local(t).detach() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    state: dict[int, dict[str, Any]] = {}
    where: dict[int, dict[str, str]] = {}  # per state tensor: "dtensor", or the device of a plain one
    for i, p in enumerate(_optimizer_params(optimizer)):
        if optimizer.state.get(p):
            entries = optimizer.state[p]
            state[i] = {k: _local(v.detach()) if isinstance(v, Tensor) else v for k, v in entries.items()}
            where[i] = {k: str(v.device) if _replicated(v) else "dtensor" for k, v in entries.items()
                        if isinstance(v, Tensor)}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return ({"format": LOCAL_SHARDS, "tensors": tensors},
            {"format": LOCAL_SHARDS, "state": state, "where": where, "param_groups": groups})


def is_local_state(entry: Any) -> bool:
    """Whether a state dict's ``model`` or ``optimizer`` entry is :func:`local_state_dicts`' (not a full one)."""
    return isinstance(entry, dict) and isinstance(entry.get("format"), str) and entry["format"] == LOCAL_SHARDS


def _copy_(dst: Tensor, src: Tensor, what: str) -> None:
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise RuntimeError(f"load_local_state_dicts: {what} is {tuple(dst.shape)} {dst.dtype} on this rank and "
                           f"{tuple(src.shape)} {src.dtype} in the snapshot; a local-shard snapshot only loads "
                           "into the same model, sharded the same way, on the same rank")
    dst.copy_(src)


@torch.no_grad()
def load_local_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                           optim_state: dict[str, Any]) -> None:
    """Copy a (staged) :func:`local_state_dicts` snapshot back into this rank's shards, in place; no collective.

    The DTensors keep their storage: the parameters' local tensors and the optimizer's existing state
    tensors are written into, so device memory does not grow. An optimizer state the snapshot does
    not have (it was taken before the first step) is dropped; one the optimizer does not have yet
    (it has not stepped since) is created like its parameter (``torch.zeros_like``) and filled.
    """
    live = dict([*model.named_parameters(), *model.named_buffers()])
    if live.keys() != model_state["tensors"].keys():
        raise RuntimeError(f"load_local_state_dicts: the snapshot names {sorted(model_state['tensors'])[:4]}..., the "
                           f"model {sorted(live)[:4]}...; it only loads into the model it was taken from")
    for name, saved in model_state["tensors"].items():
        _copy_(_local(live[name].detach()), saved, name)
    params = _optimizer_params(optimizer)
    for i, p in enumerate(params):
        saved = optim_state["state"].get(i)
        if saved is None:
            optimizer.state.pop(p, None)
            continue
        entries = optimizer.state[p]
        for k, v in saved.items():
            if not isinstance(v, Tensor):
                entries[k] = v
                continue
            if k not in entries:  # the optimizer's own layout: a DTensor like the parameter, or a plain tensor
                place = optim_state["where"][i][k]
                entries[k] = torch.zeros_like(p.detach()) if place == "dtensor" else torch.empty_like(v, device=place)
            _copy_(_local(entries[k]), v, f"optimizer state {k!r} of parameter {i}")
        for k in [k for k in entries if k not in saved]:
            del entries[k]
    for group, saved_group in zip(optimizer.param_groups, optim_state["param_groups"]):
        for k, v in saved_group.items():
            if isinstance(v, Tensor) and isinstance(group.get(k), Tensor):
                group[k].copy_(v)  # a tensor lr is rewritten in place (a fused step holds on to it)
            else:
                group[k] = v


# -- checkpoints -----------------------------------------------------------------------------------

def _options(**kwargs: Any) -> Any:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kwargs)


def _param_order(optimizer: torch.optim.Optimizer, named_params: Sequence[tuple[str, Tensor]]) -> list[str]:
    """The name of each optimizer parameter, in ``optimizer.state_dict()``'s integer-id order."""
    name_of = {id(p): n for n, p in named_params}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def _rekey(optim_state: dict[str, Any], key: Any) -> dict[str, Any]:
    return {"state": {key(k): v for k, v in optim_state["state"].items()},
            "param_groups": [{**g, "params": [key(k) for k in g["params"]]} for g in optim_state["param_groups"]]}


def full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer,
                     named_params: Sequence[tuple[str, Tensor]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Return the full (unsharded) model and optimizer state dicts on CPU, as one process would write them.

    The optimizer's state is keyed by integer id in parameter-group order, as ``optimizer.state_dict()``,
    so a checkpoint has the same format under FSDP, DDP and one process. A collective: every rank must
    call it; only rank 0 receives the tensors (the other ranks get empty dicts). An optimizer that has
    not stepped yet is read as it is: torch's state-dict helpers would first run a zero-lr step to
    create its state, which advances Adam's step count and changes every later update.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model_state = get_model_state_dict(model, options=_options(cpu_offload=True))
    if not optimizer.state:  # the same on every rank: they step together
        return model_state, optimizer.state_dict()
    optim_state = get_optimizer_state_dict(model, optimizer, options=_options(cpu_offload=True))
    if not optim_state:
        return model_state, optim_state
    index = {name: i for i, name in enumerate(_param_order(optimizer, named_params))}
    return model_state, _rekey(optim_state, index.__getitem__)


def load_full_state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer, named_params: Sequence[tuple[str, Tensor]],
                          model_state: dict[str, Any], optim_state: dict[str, Any]) -> None:
    """Load full model and optimizer state dicts (as :func:`full_state_dicts` returns them) into the shards.

    A collective: rank 0's tensors are broadcast and each rank keeps its shards (the other ranks' dicts
    are not read). The dicts are those of ``module.state_dict()`` / ``optimizer.state_dict()``, so a
    checkpoint written under any world size, by DDP, FSDP or one process, loads. An optimizer state
    with no per-parameter state yet (a step-0 checkpoint) is loaded as it is (see :func:`full_state_dicts`).
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    set_model_state_dict(model, model_state, options=_options(broadcast_from_rank0=True))
    if not optim_state["state"]:
        optimizer.load_state_dict(optim_state)
        return
    names = _param_order(optimizer, named_params)
    set_optimizer_state_dict(model, optimizer, _rekey(optim_state, names.__getitem__),
                             options=_options(broadcast_from_rank0=True))


def running_stats_note(module: nn.Module) -> str | None:
    """What a run under FSDP is told of ``module``'s running statistics (BatchNorm's), or None where it keeps none: each
    rank's are its own (FSDP2 does not sync buffers), so a checkpoint holds one rank's."""
    stats = [n for n, m in running_stats_modules(module).items() if not isinstance(m, nn.SyncBatchNorm)]  # (synced)
    if not stats:
        return None
    return (f"dist.strategy=fsdp: the running statistics of {', '.join(stats[:3])}{' ...' * (len(stats) > 3)} are each "
            "rank's own (FSDP does not sync buffers; DDP keeps rank 0's on every rank): a checkpoint holds one rank's, so "
            "a resume is not exact for them and evaluation differs by rank; GroupNorm or LayerNorm keeps no running "
            "statistics")
