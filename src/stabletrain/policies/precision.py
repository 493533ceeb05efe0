"""One precision policy: fp32, bf16 autocast (no scaler) or fp16 autocast with a GradScaler.

The optimizer step never reads a flag on the host when the optimizer can skip on the device: fused
AdamW/Adam/SGD take a ``found_inf`` tensor and leave parameters and state untouched when it is 1
(the path GradScaler itself uses). Other optimizers cost one documented host sync per step. Under a
GradScaler the caller's verdict joins the scaler's own overflow check, so a guard skip is a real skip
in every precision.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from typing import Any

import torch
from torch import Tensor

from .. import console
from ..console import StableTrainWarning
from ..internals import (
    clear_found_inf,
    scaler_found_inf,
    scaler_scale,
    scaler_state,
    set_found_inf,
    set_scaler_state,
    skips_on_device,
)
from ..numerics import constant

__all__ = ["PrecisionPolicy", "resolve_precision", "resolve_device"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_warned_fp16_cpu = False


def resolve_device(spec: str = "auto") -> torch.device:
    """Return the torch device for a config value: ``auto`` is cuda when available, else cpu."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"config key 'device': not a torch device, got {spec!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"config key 'device': {spec!r} asked for, but CUDA is not available on this machine; "
                         "use device=cpu or auto")
    return device


def resolve_precision(mode: str, device: torch.device) -> str:
    """Return the concrete precision (fp32, bf16, fp16) for ``mode`` on ``device``; refuse what can't run."""
    if mode == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return "bf16"
        return "fp32"
    global _warned_fp16_cpu
    if mode == "fp16" and device.type == "cpu":
        if not _warned_fp16_cpu and os.environ.get("RANK", "0") == "0":  # once per run: rank 0 says it (not each rank)
            _warned_fp16_cpu = True  # once per process: replays and checks build more policies
            warnings.warn("precision=fp16 on CPU: fp16 autocast and GradScaler('cpu') run, slowly; meant for testing the "
                      "fp16 path without a GPU (use bf16 or fp32 to train on CPU)", StableTrainWarning, stacklevel=3)
    elif mode == "fp16" and device.type != "cuda":
        raise ValueError(f"config key 'precision': fp16 needs a CUDA device or the CPU, got precision=fp16 on {device.type}; "
                         "use precision=bf16 or fp32")
    if mode == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise ValueError("config key 'precision': bf16 is not supported by this GPU; "
                         "use precision=fp16 (with a GradScaler) or fp32")
    if mode not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"config key 'precision': expected auto, fp32, bf16 or fp16, got {mode!r}")
    return mode


class PrecisionPolicy:
    """Autocast, loss scaling, unscaling and a skip-aware optimizer step for one precision mode.

    Usage in a user's own loop::

        policy = PrecisionPolicy("auto", device)
        with policy.autocast():
            loss = model(x).float().mean()
        policy.backward(loss)
        policy.unscale_(optimizer)                  # before measuring or clipping grads
        norm = grad_total_norm(model.parameters())
        applied = policy.step(optimizer, torch.isfinite(norm))   # device bool; no sync if fused
    """

    def __init__(self, mode: str = "auto", device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.mode = resolve_precision(mode, self.device)
        self.dtype = _DTYPES.get(self.mode, torch.float32)
        # Only fp16 needs a scaler: bf16 has fp32's exponent range, so small grads do not underflow.
        self.scaler = torch.amp.GradScaler(self.device.type) if self.mode == "fp16" else None
        self._warned_sync = False
        self._unscaled: set[int] = set()  # id() of optimizers unscaled since their last step
        #: After :meth:`step` with an optimizer that cannot skip on the device: the flag it read (else None).
        self.applied_on_host: bool | None = None

    @property
    def autocast_enabled(self) -> bool:
        return self.mode != "fp32"

    def autocast(self) -> contextlib.AbstractContextManager:
        """Return the autocast context for this mode (a no-op context in fp32)."""
        if not self.autocast_enabled:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def backward(self, loss: Tensor) -> None:
        """Backpropagate ``loss``, multiplied by the loss scale in fp16."""
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the grads by the loss scale in place (fp16 only), so norms and clipping see true values."""
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            if not scaler_found_inf(self.scaler, optimizer):  # the caller's own code may have unscaled already
                self.scaler.unscale_(optimizer)  # records the scaler's own inf check for update()
            self._unscaled.add(id(optimizer))

    def loss_scale(self) -> Tensor:
        """Return the current loss scale as a device tensor (1.0 without a scaler: a :func:`constant`); no sync."""
        scale = scaler_scale(self.scaler) if self.scaler is not None else None
        if scale is not None:
            return scale.detach().float().reshape(())
        return constant(1.0, self.device)

    def step(self, optimizer: torch.optim.Optimizer, ok: Tensor, hold: Tensor | None = None) -> Tensor:
        """Step the optimizer unless ``ok`` (0-dim bool tensor) is False; return the applied flag (device bool).

        ``hold`` (device bool): keep the loss scale where it is True (the guard traced the step's non-finite values to
        its inputs, which no scale cures: their NaN gradients are no overflow to back off for).

        The caller's verdict (the guard's ``ok``: finite, no spike to skip, inputs finite) is a real skip
        in every precision. Under a GradScaler it joins the scaler's own ``found_inf``: the optimizer
        steps only if both allow it, while the scale backs off only on the scaler's overflow (a guard
        skip is not an overflow). A fused optimizer (AdamW, Adam, SGD with ``fused=True``) skips on the
        device through ``found_inf``; any other optimizer costs one host sync here, once per step
        (warned once).
        """
        self.applied_on_host = None
        found_inf = None
        if self.scaler is not None:
            self.unscale_(optimizer)  # a no-op when the caller already unscaled (it must, before clipping)
            # The inf check unscale_ recorded (a device tensor per device); read without a sync.
            found = [t.to(ok.device) for t in scaler_found_inf(self.scaler, optimizer)]
            found_inf = torch.stack(found).sum() > 0 if found else None
        applied = ok if found_inf is None else ok & ~found_inf
        if skips_on_device(optimizer):
            # The skip flag as the float found_inf the fused kernel reads: one op into a buffer kept for it.
            skip = self.__dict__.get("_skip")
            if skip is None or skip.device != applied.device:
                skip = self._skip = torch.zeros((), dtype=torch.float32, device=applied.device)
            set_found_inf(optimizer, torch.logical_not(applied, out=skip))  # the grads are unscaled already
            try:
                optimizer.step()
            finally:
                clear_found_inf(optimizer)
        else:
            if not self._warned_sync:
                warnings.warn(
                    f"{type(optimizer).__name__} cannot skip a step on the device; stabletrain reads the skip flag "
                    "on the host once per step (a sync). A fused optimizer avoids it (AdamW, Adam, SGD with fused=True; "
                    "under FSDP2 only AdamW and Adam: torch has no DTensor rule for fused SGD).",
                    StableTrainWarning,
                    stacklevel=console.user_stacklevel(),
                )
                self._warned_sync = True
            self.applied_on_host = bool(applied)  # the one documented per-step sync for such optimizers
            if self.applied_on_host:
                optimizer.step()
        if self.scaler is not None:
            held = scaler_state(self.scaler) if hold is not None else None
            self.scaler.update()  # backs off on the scaler's found_inf only; grows after growth_interval clean steps
            set_scaler_state(self.scaler, held, where=hold)
            self._unscaled.discard(id(optimizer))
        return applied

    def state_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    @classmethod
    def from_state(cls, state: dict[str, Any], device: torch.device | str) -> PrecisionPolicy:
        """A new policy on ``device`` in the mode and scaler state of :meth:`state_dict` (a replay's own copy)."""
        policy = cls(state["mode"], device)
        policy.load_state_dict(state)
        return policy

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["mode"] != self.mode:
            raise ValueError(f"precision state was saved with mode {state['mode']!r}, this policy is {self.mode!r}")
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
