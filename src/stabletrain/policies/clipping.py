"""Global-norm gradient clipping that measures first, acts second and keeps the measurement.

The per-parameter norms that the total norm is built from are kept too (summed in squares over
each log interval) so the layers that dominate the norm can be named at no extra pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..config import check_range
from ..numerics import constant

__all__ = ["GradClipper"]


class GradClipper:
    """Clip grads to ``max_norm`` given a precomputed total norm; never "clip" a non-finite norm.

    ``max_norm=None`` measures without clipping; otherwise it must be > 0, the rule of config key
    ``clip.max_norm`` (a ConfigError, a ValueError, naming that key). :meth:`clip_` returns the clipped flag
    as a device bool.
    """

    def __init__(self, max_norm: float | None) -> None:
        self.max_norm = check_range("clip.max_norm", max_norm)
        self._factor: Tensor | None = None  # the last clip_'s min(1, max_norm / norm), reused by post_clip_norm
        self._devices_key: tuple[int, int] | None = None
        self._single = True

    def clip_(self, params: list[Tensor], total_norm: Tensor, finite: Tensor, grad_scale: Tensor | None = None) -> Tensor:
        """Scale grads in place so their total norm is at most max_norm; return whether it fired.

        A non-finite norm leaves the grads as they are (the step is skipped and reported instead):
        scaling by max_norm/inf would zero them and hide the incident. ``grad_scale``: a device scalar
        the grads still need multiplying by (DDP: 1 / the window's global count, see
        :mod:`stabletrain.policies.accumulation`), applied in the same pass; ``total_norm`` is then the norm of
        the scaled grads. Without clipping that multiply is the only pass.
        """
        self._factor = None
        device = total_norm.device
        if self.max_norm is None and grad_scale is None:
            return constant(False, device, torch.bool)
        coef, safe_norm = grad_scale, None
        if self.max_norm is not None:  # clip_grads_with_norm_'s coefficient, max_norm / (norm + 1e-6), times the scale
            safe_norm = torch.where(finite, total_norm, constant(0.0, device))  # the factor clamps to 1 at norm 0
            # Its arithmetic as torch does it (a number over a tensor is reciprocal, then multiply), with constants:
            self._factor = torch.clamp(torch.reciprocal(safe_norm + constant(1e-6, device)) * constant(self.max_norm, device),
                                       max=constant(1.0, device))
            coef = self._factor if coef is None else coef * self._factor
        grads = [p.grad for p in params if p.grad is not None]
        if grads and grads[0].device == grads[-1].device == coef.device and self._one_device(params):
            torch._foreach_mul_(grads, coef)  # one fused multiply (dtypes may mix)
        elif grads:
            by_device: dict[torch.device, list[Tensor]] = {}
            for g in grads:
                by_device.setdefault(g.device, []).append(g)
            for dev, group in by_device.items():  # one fused multiply per device
                torch._foreach_mul_(group, coef.to(dev))
        if safe_norm is None:
            return constant(False, device, torch.bool)
        # finite & (norm > max_norm) in one op: the safe norm is 0 where the norm is not finite, and max_norm > 0
        return safe_norm > constant(self.max_norm, device)

    def _one_device(self, params: list[Tensor]) -> bool:
        """Whether every parameter is on one device (decided once per parameter list: parameters do not move)."""
        key = (id(params), len(params))
        if self._devices_key != key:
            self._devices_key, self._single = key, len({p.device for p in params}) <= 1
        return self._single

    def post_clip_norm(self, total_norm: Tensor, after_clip: bool = False) -> Tensor:
        """Return the total norm after clipping, computed from the pre-clip norm (no second pass).

        ``after_clip``: :meth:`clip_` just ran on this norm, so its factor is reused (a non-finite norm then
        stays as it is: it was not clipped).
        """
        if self.max_norm is None:
            return total_norm
        if after_clip and self._factor is not None:
            return total_norm * self._factor
        return total_norm * torch.clamp(self.max_norm / (total_norm + 1e-6), max=1.0)

    def state_dict(self) -> dict:
        return {"max_norm": self.max_norm}

    def load_state_dict(self, state: dict) -> None:
        self.max_norm = state["max_norm"]
