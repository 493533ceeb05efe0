"""How far one optimizer step moves each parameter: ``||update|| / ||weight||``, against a band per optimizer.

After one optimizer step on a copy of the state, every parameter's update/weight ratio is judged
against a band calibrated to the optimizer (SGD-like: lr x |g| / |w| in 1e-4..1e-2 around the ~1e-3
rule of thumb; Adam-like: each element moves by about lr, so the ratio is about lr / rms(w), ``small``
below a tenth of that, ``large`` above 0.1). The bands are
:class:`~stabletrain.diagnostics.signal_propagation.SignalThresholds`'.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["UpdateRatio", "is_adaptive", "update_ratios"]


@dataclass
class UpdateRatio:
    """One parameter's ``||update|| / ||weight||`` after one optimizer step (None for a zero weight), and its band."""

    name: str
    weight_rms: float
    update_rms: float
    ratio: float | None
    low: float | None = None
    high: float | None = None

    @property
    def mark(self) -> str:
        """Return "large" above the band, "small" below it, else ""."""
        if self.ratio is None or self.low is None or self.high is None:
            return ""
        return "large" if self.ratio > self.high else "small" if self.ratio < self.low else ""


def is_adaptive(optimizer: torch.optim.Optimizer) -> bool:
    """Return True for an Adam-like optimizer: its first step moves each element by about lr, whatever the gradient.

    Adam, AdamW, Adamax, NAdam, Adagrad, Lion and classes named like them (fused or 8-bit variants);
    not RAdam, whose first steps are un-adapted momentum steps.
    """
    name = type(optimizer).__name__.lower()
    return ("adam" in name and "radam" not in name) or "lion" in name or name == "adagrad"


def update_ratios(model: nn.Module, params: list[nn.Parameter],
                  make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None,
                  band: Callable[[bool, float | None, float], tuple[float, float]]
                  ) -> tuple[list[UpdateRatio], str, bool]:
    """Take one optimizer step, measure ||update|| / ||weight|| per parameter and its band, then undo the step.

    ``make_optimizer(params)``: default AdamW, lr 1e-3. ``band(adaptive, lr, weight_rms)``: the (low, high)
    band of a parameter. Returns (the ratios, the optimizer's name and lr, whether it is Adam-like); the
    parameters the step moved are copied back, but their ``.grad`` and the optimizer's state are the
    caller's to restore or drop. One host-device sync.
    """
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return [], "", False
    optimizer = make_optimizer(with_grad) if make_optimizer is not None else torch.optim.AdamW(with_grad, lr=1e-3)
    adaptive = is_adaptive(optimizer)
    group_lr = {id(p): g.get("lr") for g in optimizer.param_groups for p in g["params"]}
    lr = optimizer.param_groups[0].get("lr")
    opt_name = f"{type(optimizer).__name__}(lr={float(lr):.3g})" if lr is not None else type(optimizer).__name__
    before = [p.detach().clone() for p in with_grad]
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    with torch.no_grad():
        rms = torch.stack([torch.stack([b.float().pow(2).mean().sqrt(), (p.detach().float() - b.float()).pow(2).mean().sqrt()])
                           .to(before[0].device) for p, b in zip(with_grad, before)]).cpu().tolist()
        for p, b in zip(with_grad, before):
            p.copy_(b)
    updates = []
    for p, (w, u) in zip(with_grad, rms):
        lr = group_lr.get(id(p))
        low, high = band(adaptive, None if lr is None else float(lr), w)
        updates.append(UpdateRatio(names.get(id(p), "?"), w, u, (u / w) if w > 0 else None,
                                   low if w > 0 else None, high if w > 0 else None))
    return updates, opt_name, adaptive
