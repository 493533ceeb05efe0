"""A learning-rate schedule computed on the device from the number of applied steps.

The optimizer's ``lr`` becomes a 0-dim tensor that is rewritten in place each step, so a skipped
(overflowed, non-finite) step holds the schedule without the host ever reading the skip flag.
Fused and capturable torch optimizers accept a tensor lr; others fall back to one sync per step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["LRSchedule"]


class LRSchedule:
    """Linear warmup to the peak lr, then cosine decay to ``min_lr_ratio * lr`` or constant.

    The lr for the n-th applied step (n from 0) is ``lr * (n + 1) / warmup_steps`` during warmup.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int, max_steps: int,
                 decay: str = "cosine", min_lr_ratio: float = 0.1) -> None:
        if decay not in ("cosine", "constant"):
            raise ValueError(f"config key 'sched.decay': expected cosine or constant, got {decay!r}")
        self.optimizer = optimizer
        self.warmup_steps, self.max_steps = warmup_steps, max_steps
        self.decay, self.min_lr_ratio = decay, min_lr_ratio
        device = optimizer.param_groups[0]["params"][0].device
        self.on_device = bool(optimizer.defaults.get("fused") or optimizer.defaults.get("capturable"))
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        self.applied_steps = torch.zeros((), dtype=torch.float32, device=device)
        # The whole schedule, once: each step is then one lookup instead of a dozen tiny kernels.
        self._table = self.factor(torch.arange(max_steps + 1, dtype=torch.float32, device=device))
        for group, base in zip(optimizer.param_groups, self.base_lrs):
            group["initial_lr"] = base
            group["lr"] = torch.tensor(base, dtype=torch.float32, device=device) if self.on_device else base
        self._write()

    def factor(self, n: Tensor) -> Tensor:
        """Return the lr multiplier for applied-step count ``n`` (a tensor)."""
        if self.warmup_steps > 0:
            warm = torch.clamp((n + 1) / self.warmup_steps, max=1.0)
        else:
            warm = torch.ones_like(n)
        if self.decay == "constant":
            return warm
        span = max(self.max_steps - self.warmup_steps, 1)
        progress = torch.clamp((n - self.warmup_steps) / span, 0.0, 1.0)
        cosine = self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress))
        return warm * cosine

    def _write(self) -> None:
        # gather with a 1-element index: a 0-dim CUDA index tensor would be read on the host (a sync).
        f = self._table.gather(0, self.applied_steps.long().clamp(max=self.max_steps).reshape(1)).reshape(())
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            if self.on_device:
                group["lr"].copy_(f * base)
            else:
                group["lr"] = float(f) * base  # host fallback: one sync per step

    def step(self, applied: Tensor) -> None:
        """Advance the schedule by one step if ``applied`` (device bool) is True; otherwise hold it."""
        self.applied_steps += applied.to(self.applied_steps.dtype)
        self._write()

    def lr(self) -> Tensor | float:
        """The current lr of the first param group (a device tensor when on_device)."""
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"applied_steps": self.applied_steps.clone(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.applied_steps.copy_(state["applied_steps"])
        self.base_lrs = list(state["base_lrs"])
        self._write()
