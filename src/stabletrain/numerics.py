"""Pure functions over tensors and modules: norms, finiteness, statistics. No state, no syncs.

Every function here returns device tensors; none calls ``.item()`` unless its docstring says so.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "unique_params",
    "running_stats_modules",
    "applied_only",
    "buffers_kept",
    "grad_norms",
    "grad_total_norm",
    "all_params_finite",
    "both_finite",
    "inputs_finite",
    "first_nonfinite_grad",
    "nonfinite_params",
    "snapshot_params",
    "update_norm",
    "update_norms",
    "param_update_norms",
    "update_totals",
    "modes_kept",
    "constant",
    "is_constant",
]

_CONSTANTS: dict[tuple[float, torch.dtype, torch.device], Tensor] = {}
_CONSTANT_IDS: set[int] = set()


def constant(value: float, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """A 0-dim tensor holding ``value``, made once per (value, dtype, device): read only, never written.

    An op with a Python number (``x * 0``, ``x > 1.0``) wraps the number in a tensor first: on CPU such an op
    costs two to three times one between tensors, so the per-step arithmetic takes its constants from here.
    """
    key = (value, dtype, device)
    t = _CONSTANTS.get(key)
    if t is None:
        if len(_CONSTANTS) >= 256:  # a bound, not a cache of every value ever asked for
            _CONSTANTS.clear()
            _CONSTANT_IDS.clear()
        t = _CONSTANTS[key] = torch.full((), value, dtype=dtype, device=device)
        _CONSTANT_IDS.add(id(t))
    return t


def is_constant(t: Tensor) -> bool:
    """Whether ``t`` is one of :func:`constant`'s tensors (never written: a reader need not copy it)."""
    return id(t) in _CONSTANT_IDS  # the ids of live tensors only: the table keeps every one it lists alive


def running_stats_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that keep running statistics (``track_running_stats``: BatchNorm's, InstanceNorm's when asked), by name
    ("(the model)" for the root): buffers a forward writes, which no skipped step undoes and FSDP does not sync."""
    return {n or "(the model)": m for n, m in model.named_modules()
            if getattr(m, "track_running_stats", False) and callable(getattr(m, "reset_running_stats", None))}


def unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Return the trainable (name, parameter) pairs, each parameter once (tied weights appear once)."""
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


@contextlib.contextmanager
def modes_kept(model: nn.Module) -> Iterator[None]:
    """Give every submodule of ``model`` back its own train/eval mode when the block ends (also on an exception).

    ``model.train(was_training)`` would set one mode on all of them and unfreeze what the user put in eval
    mode (a frozen BatchNorm would then update its running statistics). Modes are set attribute by
    attribute, as they were, without calling any module's ``train()``.
    """
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def buffers_kept(model: nn.Module) -> Iterator[None]:
    """Give ``model``'s buffers back the values they had on entry when the block ends (also on an exception): a probe's
    forward in training mode moves a BatchNorm's statistics and a spectral norm's vectors."""
    saved = {name: (b, b.detach().clone()) for name, b in model.named_buffers()}
    try:
        yield
    finally:
        with torch.no_grad():
            for name in [n for n, _ in model.named_buffers()]:
                if name not in saved:  # one the forward filled (a cache built on first use, registered as None): None again
                    owner, _, attr = name.rpartition(".")
                    setattr(model.get_submodule(owner), attr, None)
            for name, (was, value) in saved.items():
                owner, _, attr = name.rpartition(".")
                module = model.get_submodule(owner)
                if getattr(module, attr, None) is not was:  # the forward replaced it (a mask cache grown to a new shape)
                    setattr(module, attr, was)
                was.copy_(value)


def running_stats(modules: list[nn.Module]) -> list[Tensor]:
    """The running statistics a training-mode forward of ``modules`` (:func:`running_stats_modules`'s) moves, read from
    them now (a load with ``assign=True`` or a ``.to()`` puts new tensors there): a BatchNorm's mean, variance and count,
    not yet materialized ones (a LazyBatchNorm's before its first forward) left out."""
    return [b for m in modules for b in (getattr(m, name, None) for name in ("running_mean", "running_var",
                                                                           "num_batches_tracked"))
            if isinstance(b, Tensor) and not isinstance(b, nn.parameter.UninitializedBuffer)]


def restore_where_skipped(stats: list[Tensor], saved: list[Tensor], applied: Tensor) -> None:
    """Put ``stats`` back to ``saved`` where the step was not ``applied`` (a device bool: no sync)."""
    with torch.no_grad():
        for now, was in zip(stats, saved):
            now.copy_(torch.where(applied if applied.device == now.device else applied.to(now.device), now, was))


def grad_norms(params: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Return (total L2 grad norm, per-parameter L2 grad norms) as fp32 device tensors (no sync).

    Parameters without a grad count as zero. One fused ``_foreach_norm`` pass gives both.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        zero = torch.zeros((), device=params[0].device if params else "cpu")
        return zero, torch.zeros(len(params), device=zero.device)
    norms = torch._foreach_norm(grads)
    if len(grads) == len(params):  # the common case: one stack, no per-parameter casts
        per = torch.stack(norms).float()
    else:
        it, device = iter(norms), grads[0].device
        per = torch.stack([next(it).float().to(device) if p.grad is not None else torch.zeros((), device=device)
                           for p in params])
    return torch.linalg.vector_norm(per), per


def both_finite(a: Tensor, b: Tensor) -> Tensor:
    """Return a 0-dim bool device tensor: the scalars ``a`` and ``b`` are both finite. No sync.

    ``x * 0`` is 0 for a finite ``x`` and NaN for an Inf or a NaN, so ``a * 0 + b * 0 == 0`` says it in three
    tiny ops (``addcmul`` makes the second product and the sum), where ``isfinite(a) & isfinite(b)`` takes nine
    on CPU (each isfinite is abs, ne, eq, and).
    """
    zero = constant(0.0, a.device, a.dtype)
    return torch.addcmul(a * zero, b, zero) == zero


def grad_total_norm(params: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """Return the global gradient norm as a 0-dim fp32 device tensor (no host sync).

    A non-finite result doubles as the "some gradient is NaN/Inf" flag, so the sentinel costs nothing
    beyond the norm that clipping needs anyway. With no gradients it returns ``tensor(0.)``.
    """
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.nn.utils.get_total_norm(grads, norm_type=norm_type).float()


@torch.no_grad()
def all_params_finite(params: Iterable[Tensor]) -> Tensor:
    """Return a 0-dim bool device tensor: every parameter is finite (no NaN, no Inf). No sync.

    Reads each tensor's largest magnitude, which is finite iff every element is and, unlike an L2
    norm, cannot overflow (the squares of finite fp32 values above ~1.8e19 do; bf16 weights near 1e35
    read as "non-finite" that way). On CUDA (and any non-CPU device) that is one fused
    ``_foreach_norm(ord=inf)`` pass (NaN-propagating max of ``|x|``); on CPU, where foreach ops are a
    loop over tensors anyway, one ``aminmax`` per tensor: the cheapest exact check there (the inf norm
    and a multiply-by-zero + norm each read every value more than once).
    With no parameters it returns ``tensor(True)``.
    """
    params = [p for p in params if p.numel() > 0]
    if not params:
        return torch.ones((), dtype=torch.bool)
    if params[0].device.type == "cpu":
        extremes = [v for p in params for v in torch.aminmax(p)]  # (under no_grad: no detach needed)
    else:
        extremes = torch._foreach_norm(params, ord=math.inf)
    return torch.isfinite(torch.stack(extremes)).all()

@torch.no_grad()  # (to_local() under grad mode records an autograd node)
def nonfinite_params(named: Iterable[tuple[str, Tensor]]) -> list[str]:
    """The names of the parameters holding a NaN/Inf (this rank's shard of a sharded one). One host sync."""
    named = [(n, p.to_local() if hasattr(p, "to_local") else p) for n, p in named]
    if not named:
        return []
    flags = torch.stack([torch.isfinite(p).all() for _, p in named]).tolist()
    return [n for (n, _), ok in zip(named, flags) if not ok]


def inputs_finite(batch: Any) -> Tensor | None:
    """Return a device bool: every floating-point tensor in ``batch`` is finite (None if there is none)."""
    flags: list[Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, Tensor):
            if x.is_floating_point():
                flags.append(torch.isfinite(x).all())
        elif isinstance(x, Mapping):  # (a UserDict too: a Hugging Face BatchEncoding)
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(batch)
    return torch.stack(flags).all() if flags else None


def first_nonfinite_grad(model: nn.Module) -> str | None:
    """Return the name of the first parameter (registration order) whose grad has a NaN/Inf, or None.

    Forces one host-device sync.
    """
    named = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None]
    if not named:
        return None
    flags = torch.stack([torch.isfinite(g).all() for _, g in named])
    bad = (~flags).nonzero()
    return named[int(bad[0])][0] if bad.numel() else None




@torch.no_grad()
def snapshot_params(params: list[Tensor], into: list[Tensor] | None = None) -> list[Tensor]:
    """Return a copy of ``params`` (device tensors), reusing the buffers of ``into`` when they match. No sync."""
    if into is not None and len(into) == len(params) and all(a.shape == b.shape and a.dtype == b.dtype
                                                             for a, b in zip(into, params)):
        torch._foreach_copy_(into, [p.detach() for p in params])
        return into
    return [p.detach().clone() for p in params]


@torch.no_grad()
def param_update_norms(params: list[Tensor], before: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Return per-parameter (||theta - before||, ||before||) as 1-D fp32 device tensors, in ``params`` order. No sync."""
    if not params:
        empty = torch.zeros(0)
        return empty, empty
    now, was = [p.detach() for p in params], list(before)
    if any(t.dtype != torch.float32 for t in (*now, *was)):  # norms of the float32 values (a no-op for float32 ones)
        now, was = [t.float() for t in now], [t.float() for t in was]
    return torch.stack(torch._foreach_norm(torch._foreach_sub(now, was))), torch.stack(torch._foreach_norm(was))


def update_totals(per_update: Tensor, per_weight: Tensor) -> dict[str, Tensor]:
    """The step's update figures from the per-parameter norms of :func:`param_update_norms` (device tensors, no sync).

    ``update_norm`` = ||theta_t - theta_{t-1}||, ``update_ratio`` = that over ||theta_{t-1}||, and the per-parameter
    vectors themselves as ``param_update_norms`` and ``param_norms`` (the precursor reads each layer's ratio).
    """
    delta, weight = torch.linalg.vector_norm(per_update), torch.linalg.vector_norm(per_weight)
    return {"update_norm": delta, "update_ratio": delta / weight.clamp_min(1e-12), "param_update_norms": per_update,
            "param_norms": per_weight}


def applied_only(update: dict[str, Tensor], applied: Tensor | bool) -> dict[str, Tensor]:
    """``update`` (:func:`update_totals`) with its update figures NaN where the step was not ``applied`` (a skipped step
    made no update: its 0 read as a run that stopped moving; NaN is "not measured"). No sync."""
    tensors = [v for v in update.values() if isinstance(v, Tensor)]
    if applied is True or not tensors:
        return update
    keep = torch.as_tensor(applied, device=tensors[0].device) != 0  # (a bool or a 0/1 float flag)
    return {k: torch.where(keep, v, torch.full_like(v, math.nan)) if k != "param_norms" else v for k, v in update.items()}


def update_norms(params: list[Tensor], before: list[Tensor]) -> dict[str, Tensor]:
    """Return :func:`update_totals` of the update from ``before`` to ``params`` (device tensors). No sync."""
    return update_totals(*param_update_norms(params, before))


def update_norm(params: list[Tensor], before: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Return (||theta - before||, that over ||before||) as fp32 device tensors: the norm of the last update. No sync."""
    if not params:
        zero = torch.zeros(())
        return zero, zero
    out = update_norms(params, before)
    return out["update_norm"], out["update_ratio"]
