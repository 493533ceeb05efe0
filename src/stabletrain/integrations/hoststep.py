"""What stabletrain adds to a step that a host trainer runs itself (Lightning, the Hugging Face Trainer).

The host runs forward, backward, its clipping and its optimizer step; the adapter hands :class:`HostStep`
the step's loss and pre-clip norms just before the host's optimizer step, and asks for the step's
figures once the host has stepped::

    before_step(loss, norm, per_param)   the sentinel (guard.observe); the skip, on the device: a fused
                                         optimizer reads it as found_inf (under a GradScaler, joined with
                                         the scaler's own in a step pre-hook); a non-fused one under a
                                         GradScaler: joined into the scaler's inf check; any other optimizer:
                                         the grads are dropped (one host read per step, warned once).
                                         stabletrain's own clipping where the host cannot clip
                                         (``clip_max_norm``); the interval snapshot's copies come first
    [the host clips and steps]
    after_step(count) -> out             applied, the parameter check, ||update|| on the interval's last step;
                                         a skip of stabletrain's alone does not back off the host's loss scale

No host sync on the way, except the one documented for an optimizer that cannot skip on the device.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..internals import (
    clear_found_inf,
    found_inf_set,
    join_found_inf,
    join_scaler_found_inf,
    scaler_scale,
    scaler_state,
    set_found_inf,
    set_scaler_state,
    skips_on_device,
)
from ..numerics import all_params_finite, grad_norms
from ..policies.accumulation import AccumulationWindow
from ..policies.clipping import GradClipper
from ..policies.precision import PrecisionPolicy
from ..step import TrainStep

__all__ = ["HostStep"]


class HostStep:
    """Measure, guard, skip and record a host trainer's own optimizer step. See the module docstring.

    Args:
        session: the adapter's :class:`~stabletrain.integrations.core.RunSession`.
        optimizer: the torch optimizer the host steps (not its wrapper).
        scaler: the host's GradScaler (fp16), else None.
        host_clip: the host's own global-norm clipping threshold (None: it does not clip by norm).
        own_clip: stabletrain clips to this norm itself (where the host cannot clip); None: it does not.
        skip_hint: how to get an optimizer that skips on the device in this host (for the one-time warning).
    """

    def __init__(self, session: Any, optimizer: torch.optim.Optimizer, scaler: Any, *, host_clip: float | None,
                 own_clip: float | None, skip_hint: str) -> None:
        self.session, self.optimizer, self.scaler = session, optimizer, scaler
        self.host_clip, self.own_clip, self.skip_hint = host_clip, own_clip, skip_hint
        # The built-in step's judging half (guard, clip, overflow) over the host's gradients; the host applies.
        precision = PrecisionPolicy("fp32", session.device)  # autocast is the host's; its GradScaler is read
        precision.scaler = scaler
        self.judge = TrainStep(session.model, optimizer, precision, guard=session.guard, params=session.params,
                               clipper=GradClipper(own_clip if own_clip is not None else host_clip),
                               window=AccumulationWindow(session.params), check_params=False).judge
        self.fused = skips_on_device(optimizer)
        opts = session.options
        self.may_skip = opts.on_nonfinite != "warn" or opts.on_spike == "skip"
        self.pending: dict[str, Any] | None = None
        self._hooks = [optimizer.register_step_pre_hook(self._pre_step),
                       optimizer.register_step_post_hook(self._post_step)]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def unscale(self, value: Tensor) -> Tensor:
        """``value`` (a loss or norm of scaled grads) divided by the host's loss scale (no sync)."""
        scale = scaler_scale(self.scaler) if self.scaler is not None else None
        return value if scale is None else value / scale.to(value.device)

    def before_step(self, loss: Tensor | None, norm: Tensor, per_param: Tensor, *, grads_scaled: bool) -> None:
        """The guard's verdict on the step and the skip it implies, before the host's optimizer step (no sync).

        ``norm``/``per_param``: the pre-clip norms of the step's gradients; ``grads_scaled``: they still hold
        the loss scale (they are divided by it here).
        """
        session = self.session
        if grads_scaled:
            norm, per_param = self.unscale(norm), self.unscale(per_param)
        if loss is None:
            loss = torch.full((), float("nan"), device=norm.device)
        judged = self.judge(loss=loss, norms=(norm, per_param), unscale=False, clip=self.own_clip is not None)
        ok = judged["ok"]
        own_found, ours, scale_before = None, False, None
        if self.scaler is not None:  # the host unscaled already (its clipping): our verdict joins the scaler's
            scale_before = scaler_state(self.scaler)
            own_found = join_scaler_found_inf(self.scaler, self.optimizer, ~ok)
        if own_found is None and self.fused and self.scaler is None:
            set_found_inf(self.optimizer, ~ok)  # read by the fused step (inside the host's step, after this)
            ours = True
        elif own_found is None and not self.fused and self.may_skip:
            session.skip_on_host(ok, self.skip_hint)
        self.pending = {**judged, "own_found": own_found, "ours": ours, "scale_before": scale_before}
        session.before_update()

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Under a GradScaler, ``scaler.step`` sets the fused optimizer's found_inf, then steps: ours joins it."""
        p = self.pending
        if p is None or not self.fused or p["ours"] or found_inf_set(optimizer) is None:
            return
        join_found_inf(optimizer, ~p["ok"])

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.pending is not None and self.pending["ours"]:
            clear_found_inf(optimizer)
            self.pending["ours"] = False

    def after_step(self, count: Tensor | float, *, value_clipped: bool = False) -> dict[str, Tensor] | None:
        """The step's device tensors once the host stepped (None when no step was measured: a micro-batch).

        ``value_clipped``: the host clipped by value; the post-clip norm is measured on the grads it stepped with.
        """
        p, session = self.pending, self.session
        if p is None:
            return None
        self.pending = None
        if p["ours"]:  # the host's step did not run (e.g. it skipped by itself): drop our flag all the same
            clear_found_inf(self.optimizer)
        device = p["grad_norm"].device
        applied = p["ok"] if p["own_found"] is None else p["ok"] & ~p["own_found"]
        if self.scaler is not None and p["own_found"] is not None:
            # Only we skipped (the scaler found no inf): its update() backed off the scale; put it back.
            set_scaler_state(self.scaler, p["scale_before"], where=~p["ok"] & ~p["own_found"])
        if value_clipped:
            post, _ = grad_norms(session.params)
            p["post_clip_norm"], p["clipped"] = post, p["finite"] & (post < p["grad_norm"])
        out = {"loss": p["loss"], "grad_norm": p["grad_norm"], "post_clip_norm": p["post_clip_norm"],
               "clipped": p["clipped"], "applied": applied, "finite": p["finite"], "spike": p["spike"],
               "overflow": p["overflow"], "per_param_norms": p["per_param_norms"],
               "count": (count.detach().float().reshape(()).to(device) if isinstance(count, Tensor)
                         else torch.full((), float(count), device=device))}
        if session.options.check_params:
            out["params_finite"] = all_params_finite(session.params)
        session.after_update(out)
        return out

    def loss_scale(self) -> Tensor | float:
        scale = scaler_scale(self.scaler) if self.scaler is not None else None
        return scale if scale is not None else 1.0
