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

__all__ = ["LRSchedule", "lr_factor"]


def lr_factor(n: Tensor, warmup_steps: int, max_steps: int, decay: str = "cosine", min_lr_ratio: float = 0.1) -> Tensor:
    """Return the lr multiplier after ``n`` applied steps (a tensor): linear warmup, then cosine or constant."""
    if warmup_steps > 0:
        warm = torch.clamp((n + 1) / warmup_steps, max=1.0)
    else:
        warm = torch.ones_like(n)
    if decay == "constant":
        return warm
    span = max(max_steps - warmup_steps, 1)
    progress = torch.clamp((n - warmup_steps) / span, 0.0, 1.0)
    return warm * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + torch.cos(math.pi * progress)))


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
        # The count as a 1-element long: the index of the lookup as it is (a 0-dim CUDA index would be read on the
        # host). A checkpoint of an older version (a 0-dim float) loads into it.
        self.applied_steps = torch.zeros(1, dtype=torch.long, device=device)
        # The whole schedule, once: each step is then one lookup instead of a dozen tiny kernels. In float64 on the
        # host, as a Python scheduler computes it: each group's device lr is the float32 nearest lr x factor (one
        # rounding, the same on every device), what a loop filling a float32 tensor lr with that product holds.
        self._device = device
        self._table = self.factor(torch.arange(max_steps + 1, dtype=torch.float64))
        self._host_table = self._table.tolist() if not self.on_device else []
        self._host_count = 0
        # On the device every group's lr is a view of one (1, groups) tensor that one index_select writes.
        self._lrs = torch.zeros(1, len(self.base_lrs), dtype=torch.float32, device=device)
        self._views = [self._lrs[0, g] for g in range(len(self.base_lrs))]
        self._last = torch.full((1,), max_steps, dtype=torch.long, device=device)  # the table's last row
        self._group_table = self._lr_table()
        for group, base in zip(optimizer.param_groups, self.base_lrs):
            group["initial_lr"] = base
        self._write()

    def _lr_table(self) -> Tensor | None:
        """Each group's lr per applied-step count (factor x base lr), one column per group: one lookup per step."""
        if not self.on_device:
            return None
        lrs = self._table[:, None] * torch.tensor(self.base_lrs, dtype=torch.float64)
        return lrs.to(device=self._device, dtype=torch.float32)

    def factor(self, n: Tensor) -> Tensor:
        """Return the lr multiplier for applied-step count ``n`` (a tensor)."""
        return lr_factor(n, self.warmup_steps, self.max_steps, self.decay, self.min_lr_ratio)

    def _write(self, host_count: int | None = None) -> None:
        if not self.on_device:  # host fallback: a float lr from the host copy of the table
            if host_count is None:
                host_count = int(self.applied_steps)  # a sync, only where the caller has no host count
            self._host_count = host_count
            f_host = self._host_table[min(host_count, self.max_steps)]
            for group, base in zip(self.optimizer.param_groups, self.base_lrs):
                group["lr"] = f_host * base
            return
        # Three device ops per step, whatever the number of groups: the count's add (in step), its clamp, the lookup.
        torch.index_select(self._group_table, 0, torch.minimum(self.applied_steps, self._last), out=self._lrs)
        for group, view in zip(self.optimizer.param_groups, self._views):
            if group["lr"] is not view:  # set once (an optimizer's load_state_dict puts its saved lr back)
                group["lr"] = view

    def step(self, applied: Tensor | bool) -> None:
        """Advance the schedule by one step if ``applied`` is True; otherwise hold it.

        ``applied``: a device bool (no sync), or a host bool where the optimizer step already read it
        (a non-fused optimizer): the host-lr fallback then needs no read of its own.
        """
        if isinstance(applied, bool):
            self.applied_steps += int(applied)
            self._write(self._host_count + int(applied) if not self.on_device else None)
            return
        self.applied_steps.add_(applied)  # a bool adds as 0 or 1
        self._write()

    def scale(self, factor: float) -> None:
        """Multiply every group's peak lr by ``factor`` from now on (a remedy's lower LR); kept in ``state_dict``.

        The schedule's shape (warmup, decay, the applied-step count) is unchanged. One sync off the device.
        """
        if not factor > 0:
            raise ValueError(f"lr factor: expected a number > 0, got {factor!r}")
        self.base_lrs = [b * factor for b in self.base_lrs]
        self._group_table = self._lr_table()
        self._write()

    def lr(self) -> Tensor | float:
        """The current lr of the first param group (a device tensor when on_device)."""
        return self.optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"applied_steps": self.applied_steps.clone(), "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.applied_steps.copy_(state["applied_steps"].reshape(1))  # an older checkpoint's: 0-dim float
        self.base_lrs = list(state["base_lrs"])
        self._group_table = self._lr_table()
        self._write()
