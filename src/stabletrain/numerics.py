"""Pure functions over tensors and modules: norms, finiteness, statistics. No state, no syncs.

Every function here returns device tensors; none calls ``.item()`` unless its docstring says so.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

__all__ = [
    "unique_params",
    "grads_of",
    "grad_total_norm",
    "per_param_grad_norms",
    "top_grad_norms",
    "is_finite",
    "all_params_finite",
    "first_nonfinite_grad",
    "tensor_stats",
]


def unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Return the trainable (name, parameter) pairs, each parameter once (tied weights appear once)."""
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def grads_of(params: Iterable[Tensor]) -> list[Tensor]:
    """Return the ``.grad`` of each parameter that has one (the order of ``params``)."""
    return [p.grad for p in params if p.grad is not None]


def grad_total_norm(params: Iterable[Tensor], norm_type: float = 2.0) -> Tensor:
    """Return the global gradient norm as a 0-dim fp32 device tensor (no host sync).

    A non-finite result doubles as the "some gradient is NaN/Inf" flag, so the sentinel costs nothing
    beyond the norm that clipping needs anyway. With no gradients it returns ``tensor(0.)``.
    """
    grads = grads_of(params)
    if not grads:
        return torch.zeros((), dtype=torch.float32)
    return torch.nn.utils.get_total_norm(grads, norm_type=norm_type).float()


def per_param_grad_norms(params: Iterable[Tensor]) -> Tensor:
    """Return a 1-D fp32 tensor of each parameter's grad L2 norm (0 where a grad is missing)."""
    params = list(params)
    with_grad = [p.grad for p in params if p.grad is not None]
    if not with_grad:
        return torch.zeros(len(params))
    norms = iter(torch._foreach_norm(with_grad))
    device = with_grad[0].device
    return torch.stack([next(norms).float().to(device) if p.grad is not None else torch.zeros((), device=device) for p in params])


def top_grad_norms(named_params: list[tuple[str, Tensor]], k: int) -> list[tuple[str, float, float]]:
    """Return the ``k`` parameters with the largest grad norm as (name, norm, share of norm**2).

    Forces a host-device sync (it returns Python floats): call it at log boundaries only.
    """
    if k <= 0 or not named_params:
        return []
    norms = per_param_grad_norms([p for _, p in named_params])
    sq = norms.double() ** 2
    total = sq.sum()
    vals, idx = torch.topk(norms, min(k, len(named_params)))
    shares = (sq[idx] / total.clamp_min(1e-300)).tolist()
    return [(named_params[i][0], v, s) for i, v, s in zip(idx.tolist(), vals.tolist(), shares)]


def is_finite(x: Tensor) -> Tensor:
    """Return a 0-dim bool device tensor: every element of ``x`` is finite."""
    return torch.isfinite(x).all()


def all_params_finite(params: Iterable[Tensor]) -> Tensor:
    """Return a 0-dim bool device tensor: every parameter is finite (one fused pass, no sync)."""
    params = [p.detach() for p in params]
    if not params:
        return torch.ones((), dtype=torch.bool)
    # The norm of the norms is finite iff every element is; _foreach_norm is one fused kernel.
    norms = torch._foreach_norm(params)
    return torch.isfinite(torch.stack([n.float() for n in norms])).all()


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


def tensor_stats(x: Tensor) -> Tensor:
    """Return ``[mean, std, abs_max]`` of ``x`` in fp32 as one device tensor (std 0 for one element)."""
    x = x.detach().float()
    std = x.std() if x.numel() > 1 else torch.zeros((), device=x.device)
    return torch.stack([x.mean(), std, x.abs().max()])
