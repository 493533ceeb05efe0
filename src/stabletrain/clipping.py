"""Global-norm gradient clipping that measures first, acts second and keeps the measurement.

The per-parameter norms that the total norm is built from are kept too (summed in squares over
each log interval) so the layers that dominate the norm can be named at no extra pass.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .numerics import grad_norms

__all__ = ["grad_norms", "GradClipper"]  # grad_norms lives in numerics; re-exported here


class GradClipper:
    """Clip grads to ``max_norm`` given a precomputed total norm; never "clip" a non-finite norm.

    ``max_norm=None`` measures without clipping. :meth:`clip_` returns the clipped flag as a device bool.
    """

    def __init__(self, max_norm: float | None) -> None:
        if max_norm is not None and not max_norm > 0:
            raise ValueError(f"config key 'clip.max_norm': expected a number > 0 or null, got {max_norm!r}")
        self.max_norm = max_norm

    def clip_(self, params: list[Tensor], total_norm: Tensor, finite: Tensor, grad_scale: Tensor | None = None) -> Tensor:
        """Scale grads in place so their total norm is at most max_norm; return whether it fired.

        A non-finite norm leaves the grads as they are (the step is skipped and reported instead):
        scaling by max_norm/inf would zero them and hide the incident. ``grad_scale``: a device scalar
        the grads still need multiplying by (DDP: 1 / the window's global count, see
        :mod:`stabletrain.accumulation`), applied in the same pass; ``total_norm`` is then the norm of
        the scaled grads. Without clipping that multiply is the only pass.
        """
        if self.max_norm is None and grad_scale is None:
            return torch.zeros((), dtype=torch.bool, device=total_norm.device)
        safe_norm = torch.where(finite, total_norm, torch.zeros_like(total_norm))  # coef clamps to 1 at norm 0
        if grad_scale is None:
            torch.nn.utils.clip_grads_with_norm_(params, self.max_norm, safe_norm)
        else:
            coef = grad_scale
            if self.max_norm is not None:  # clip_grads_with_norm_'s coefficient, times the scale
                coef = coef * torch.clamp(self.max_norm / (safe_norm + 1e-6), max=1.0)
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, coef.to(grads[0].device))
        if self.max_norm is None:
            return torch.zeros((), dtype=torch.bool, device=total_norm.device)
        return finite & (total_norm > self.max_norm)

    def post_clip_norm(self, total_norm: Tensor) -> Tensor:
        """Return the total norm after clipping, computed from the pre-clip norm (no second pass)."""
        if self.max_norm is None:
            return total_norm
        return total_norm * torch.clamp(self.max_norm / (total_norm + 1e-6), max=1.0)

    def state_dict(self) -> dict:
        return {"max_norm": self.max_norm}

    def load_state_dict(self, state: dict) -> None:
        self.max_norm = state["max_norm"]
