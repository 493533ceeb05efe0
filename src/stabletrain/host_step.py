"""The one step's judging half over an optimizer step that a host trainer applies itself (Lightning, Hugging Face).

:class:`~stabletrain.step.TrainStep` runs the whole step; a host trainer runs forward, backward, its clipping
and its optimizer step itself. :class:`HostStep` judges the host's step with the same
:meth:`TrainStep.judge <stabletrain.step.TrainStep.judge>` just before the host's optimizer steps, and hands the
verdict to that step, so that a bad one is skipped on the device as
:meth:`PrecisionPolicy.step <stabletrain.policies.precision.PrecisionPolicy.step>` skips the built-in one::

    before_step(loss, norm, per_param)   the sentinel (guard.observe); the skip, on the device: a fused
                                         optimizer reads it as found_inf (under a GradScaler, joined with
                                         the scaler's own in a step pre-hook); a non-fused one under a
                                         GradScaler: joined into the scaler's inf check; any other optimizer:
                                         the grads are dropped (one host read per step, warned once).
                                         stabletrain's own clipping where the host cannot clip (``own_clip``)
    [the host clips and steps]
    after_step(count) -> out             applied, the parameter check, ||update|| (when asked before the step);
                                         a skip of stabletrain's alone does not back off the host's loss scale

No host sync on the way, except the one documented for an optimizer that cannot skip on the device.
"""

from __future__ import annotations

import contextlib
import numbers
import warnings
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from . import console
from .console import StableTrainWarning
from .internals import (
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
from .numerics import all_params_finite, buffers_kept, grad_norms, snapshot_params, update_norms
from .policies.accumulation import AccumulationWindow
from .policies.clipping import GradClipper
from .policies.guard import Guard
from .policies.precision import PrecisionPolicy
from .seeding import kept_rng
from .step import TrainStep

__all__ = ["HostStep", "MonitorUse", "as_backpropagated", "backpropagated_parts", "clip_as_judged", "redo_user_clip",
           "items_ignored", "given_loss"]


class HostStep:
    """Judge a host trainer's own optimizer step and skip it on the device when bad. See the module docstring.

    Args:
        model, guard, params: the model itself, the run's guard and the parameters the step covers.
        optimizer: the torch optimizer the host steps (not its wrapper).
        scaler: the host's GradScaler (fp16), else None.
        host_clip: the host's own global-norm clipping threshold (None: it does not clip by norm).
        own_clip: stabletrain clips to this norm itself (where the host cannot clip); None: it does not.
        may_skip: whether a verdict may skip a step (False: ``on_nonfinite="warn"`` without spike skips).
        check_params: check the parameters after the host's step (one fused pass).
        skip_hint: how to get an optimizer that skips on the device in this host (for the one-time warning).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scaler: Any, guard: Guard,
                 params: Sequence[Tensor], *, host_clip: float | None, own_clip: float | None, may_skip: bool,
                 check_params: bool, skip_hint: str) -> None:
        self.optimizer, self.scaler, self.params = optimizer, scaler, list(params)
        self.host_clip, self.own_clip, self.skip_hint = host_clip, own_clip, skip_hint
        self.may_skip, self.check_params = may_skip, check_params
        # The built-in step's judging half (guard, clip, overflow) over the host's gradients; the host applies.
        precision = PrecisionPolicy("fp32", self.params[0].device)  # autocast is the host's; its GradScaler is read
        precision.scaler = scaler
        self.judge = TrainStep(model, optimizer, precision, guard=guard, params=self.params,
                               clipper=GradClipper(own_clip if own_clip is not None else host_clip),
                               window=AccumulationWindow(self.params), check_params=False).judge
        self.fused = skips_on_device(optimizer)
        self.pending: dict[str, Any] | None = None
        self._before: list[Tensor] | None = None  # the parameters before the step, for ||update|| (reused)
        self._warned_sync = False
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

    def loss_scale(self) -> Tensor | float:
        scale = scaler_scale(self.scaler) if self.scaler is not None else None
        return scale if scale is not None else 1.0

    def before_step(self, loss: Tensor | None, norm: Tensor, per_param: Tensor, *, grads_scaled: bool,
                    measure_update: bool = False) -> None:
        """The guard's verdict on the step and the skip it implies, before the host's optimizer step (no sync).

        ``norm``/``per_param``: the pre-clip norms of the step's gradients; ``grads_scaled``: they still hold
        the loss scale (they are divided by it here). ``measure_update``: copy the parameters, so that
        :meth:`after_step` returns ``update_norm`` and ``update_ratio`` as :meth:`TrainStep.apply
        <stabletrain.step.TrainStep.apply>` does (one copy, on this step only).
        """
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
        self.pending = {**judged, "own_found": own_found, "ours": ours, "scale_before": scale_before,
                        "measure": measure_update, "host_skip": own_found is None and not self.fused and self.may_skip}
        if self.pending["host_skip"] and self.scaler is None:
            self._skip_on_host(ok)
            self.pending["host_skip"] = False
        if measure_update:
            self._before = snapshot_params(self.params, self._before)

    def _skip_on_host(self, ok: Tensor) -> None:
        """An optimizer that cannot skip on the device: drop a bad step's grads (one host read per step, warned once).

        torch's optimizers skip a parameter without a grad: no update, no state change.
        """
        if not self._warned_sync:
            warnings.warn(f"this optimizer cannot skip a step on the device ({self.skip_hint}); the verdict is read on "
                          "the host once per step (a sync)", StableTrainWarning, stacklevel=console.user_stacklevel())
            self._warned_sync = True
        if not bool(ok):  # the one documented per-step sync for a non-fused optimizer without a GradScaler
            for p in self.params:
                p.grad = None

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Under a GradScaler, ``scaler.step`` sets the fused optimizer's found_inf, then steps: ours joins it. A non-fused
        one whose scaler had not unscaled by the verdict (no inf check to join yet): its grads are dropped here, after
        ``scaler.step``'s own inf check (dropped before it, that step raised 'No inf checks were recorded')."""
        p = self.pending
        if p is not None and p["host_skip"]:
            p["host_skip"] = False
            self._skip_on_host(p["ok"])
        if p is None or not self.fused or p["ours"] or found_inf_set(optimizer) is None:
            return
        join_found_inf(optimizer, ~p["ok"])

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.pending is not None and self.pending["ours"]:
            clear_found_inf(optimizer)
            self.pending["ours"] = False

    def after_step(self, count: Tensor | float, *, value_clipped: bool = False) -> dict[str, Tensor] | None:
        """The step's device tensors once the host stepped (None when no step was judged: a micro-batch).

        ``value_clipped``: the host clipped by value; the post-clip norm is measured on the grads it stepped with.
        """
        p = self.pending
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
            post, _ = grad_norms(self.params)
            p["post_clip_norm"], p["clipped"] = post, p["finite"] & (post < p["grad_norm"])
        out = {"loss": p["loss"], "grad_norm": p["grad_norm"], "post_clip_norm": p["post_clip_norm"],
               "clipped": p["clipped"], "applied": applied, "finite": p["finite"], "spike": p["spike"],
               "overflow": p["overflow"], "per_param_norms": p["per_param_norms"],
               "count": (count.detach().float().reshape(()).to(device) if isinstance(count, Tensor)
                         else torch.full((), float(count), device=device))}
        if self.check_params:
            out["params_finite"] = all_params_finite(self.params)
        if p["measure"]:  # also per parameter: the precursor's figures
            out.update(update_norms(self.params, self._before))
        return out


def given_loss(loss: Any, device: torch.device | str) -> Tensor:
    """The loss a host hands over (``Monitor.step(loss=...)``) as a 0-dim float tensor on ``device``: a number, or a tensor of
    one element; anything else is a ValueError that names what it got (a per-sample loss: reduce it first)."""
    if isinstance(loss, Tensor) and loss.numel() == 1 and not loss.is_complex():
        return torch.as_tensor(loss, device=device).detach().float().reshape(())
    if (isinstance(loss, numbers.Real) and not isinstance(loss, bool)) or (isinstance(loss, np.ndarray) and loss.size == 1
                                                                          and loss.dtype.kind in "fiu"):
        value = float(loss.item() if isinstance(loss, np.ndarray) else loss)  # (a Fraction, numpy's 0-d array)
        return torch.tensor(value, dtype=torch.float32, device=device)
    got = (f"a tensor of shape {tuple(loss.shape)} (reduce it first, e.g. loss.mean())" if isinstance(loss, Tensor)
           and loss.numel() > 1 else f"{type(loss).__name__} {loss!r:.40}")
    raise ValueError(f"Monitor.step(loss=...): expected the step's loss as a number or a one-element tensor, got {got}")


def as_backpropagated(loss: Tensor, backpropagated: Tensor | None, num_micro: int) -> Tensor:
    """``loss_fn``'s loss as the user backpropagated it: as it is, divided by the micro-batches, or rescaled.

    Compared bitwise on the host (a capture's replay may sync): the first two forms replay the user's
    gradients exactly; any other normalization is matched by the ratio of the two values.
    """
    if backpropagated is None:
        return loss
    if callable(backpropagated):  # (:func:`backpropagated_parts`: how the user's whole loss split)
        return backpropagated(loss)
    value, seen = loss.detach().float(), backpropagated.to(loss.device)
    if bool(torch.equal(value, seen)):
        return loss
    if bool(torch.equal((loss / num_micro).detach().float(), seen)):
        return loss / num_micro
    return loss * (seen / value).to(loss.dtype)


def backpropagated_parts(model: nn.Module, losses_of: Any, whole: Tensor) -> list[Any]:
    """Each micro-batch's loss as the user backpropagated it, where they handed the step's whole loss alone (their own
    backward over ``micro_batches=``): ``losses_of()`` computes the micro-batches' losses (here without gradients; the RNG
    and the model's buffers put back after, so the replay's own forwards draw the same). Per micro-batch, how its
    grad-mode loss is shaped for :func:`as_backpropagated`: divided by their number where ``whole`` is their mean, as it is
    where their sum, else scaled by ``whole`` / their sum."""
    with torch.no_grad(), kept_rng(), buffers_kept(model):
        values = [loss.detach().float() for loss in losses_of()]
    total, k = sum(values), len(values)
    seen = whole.detach().float().to(total.device)
    if bool(torch.isclose(total / k, seen, rtol=1e-5, atol=0.0)):
        shape = lambda loss: loss / k  # noqa: E731  (the grad-mode loss itself, as the user divided it: bitwise)
    elif bool(torch.isclose(total, seen, rtol=1e-5, atol=0.0)):
        shape = lambda loss: loss  # noqa: E731
    else:
        shape = lambda loss: loss * (seen / total).to(loss.dtype)  # noqa: E731
    return [shape] * k


def clip_as_judged(params: Sequence[Tensor], max_norm: float, scaled: HostStep | None = None) -> None:
    """A replay's clip of ``params``' gradients at ``max_norm`` as :meth:`HostStep.before_step` clipped them live
    (``own_clip``): on their total norm, divided by the host's loss scale where they still hold it (``scaled``: the
    step's :class:`HostStep`)."""
    norm = grad_norms(params)[0]
    norm = scaled.unscale(norm) if scaled is not None else norm
    GradClipper(max_norm).clip_(list(params), norm, torch.isfinite(norm))


def redo_user_clip(params: Sequence[nn.Parameter], clip: tuple[Tensor, Tensor] | None) -> None:
    """Scale ``params``' gradients as the user's own clip scaled them: ``clip`` is (the norm before it, the norm of the
    gradients it left), as kept when the step ran; None (no clip of theirs) or a clip that left them alone: nothing.
    Not bitwise: the threshold is theirs, the factor is the ratio of the two norms."""
    if clip is None:
        return
    before, after = clip
    grads = [p.grad for p in params if p.grad is not None]
    if grads and bool(after < before * (1 - 1e-6)):
        torch._foreach_mul_(grads, (after / before).to(grads[0].device))


def items_ignored(host: dict[str, Any], model: nn.Module, batch: Any, loss_for: Any) -> bool:
    """Whether a loss that a Hugging Face Trainer takes as divided by ``num_items_in_batch`` (``host["items_normalized"]``)
    ignores it: the same batch's loss is the same under twice the count (no gradients, the RNG put back, the model's
    buffers too). Such a loss is a mean over its own batch (a sequence classifier's): a part of the window is weighed
    as it is, not on the window's count. Where the Trainer accumulates, it then does not divide by the accumulation
    steps: each window's loss and gradients are the sum of its micro-batches' means, warned once.

    ``loss_for(num_items)``: ``loss(model, batch)`` as the Trainer computes it with that ``num_items_in_batch``.
    """
    items, steps = host.get("num_items_in_batch"), host.get("accumulation_steps") or 1
    if not host.get("items_normalized") or items is None:
        return False
    losses = []
    try:
        with torch.no_grad(), buffers_kept(model):  # (a BatchNorm's running stats: the forwards' own)
            for n in (items, items * 2):
                with kept_rng():  # the same dropout masks for both
                    out = loss_for(n)(model, batch)
                losses.append(float((out[0] if isinstance(out, (tuple, list)) else out).detach().float()))
    except Exception:  # a courtesy check: the step itself says what is wrong with the loss
        return False
    once, twice = losses if len(losses) == 2 else (float("nan"), float("nan"))
    if not (once == once and once != 0 and abs(once - twice) <= 1e-6 * abs(once)):  # (NaN fails ==)
        return False
    if steps > 1:
        warnings.warn(f"the loss ignores num_items_in_batch (the same batch's loss is {once:.4g} under {items} items and "
                      f"under twice as many), yet the Trainer takes it as divided by the window's items and so does not "
                      f"divide it by gradient_accumulation_steps={steps}: each window's loss and gradients are the sum of its "
                      f"{steps} micro-batches' means, that many times too large. Divide the loss's sum by num_items_in_batch "
                      "in compute_loss, or do not accept the argument (the Trainer then averages)", StableTrainWarning,
                      stacklevel=3)
    return True


class MonitorUse:
    """What a :class:`~stabletrain.Monitor` loop did that it should not, said once each as a warning at the user's line:
    the optimizer stepped outside ``monitor.step()`` (which steps it itself: each step ran twice), and at the end a
    backward never stepped or no step at all (an empty run directory, said nowhere)."""

    #: The hook of the newest MonitorUse on each optimizer: a Monitor built again on it (a notebook's cell run again)
    #: takes the earlier one's off (it would take the new one's steps for the loop's own).
    _hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __init__(self, optimizer: torch.optim.Optimizer, replaying: Any) -> None:
        self.inside, self.replaying = False, replaying  # replaying(): a capture replays the live state
        self.said_outside = self.closed = self.said_fewer = False  # each said once (the step outside, fewer batches than
        # backward calls, at close what it found)
        if optimizer in MonitorUse._hooks:
            MonitorUse._hooks[optimizer].remove()
        ref = weakref.ref(self)  # the optimizer holds no Monitor: one never closed goes, and its hook with it

        def stepped(opt: Any, args: Any, kwargs: Any) -> None:
            if (use := ref()) is not None:
                use._stepped()

        self.handle = MonitorUse._hooks[optimizer] = optimizer.register_step_post_hook(stepped)  # (every step() call)
        weakref.finalize(self, self.handle.remove)

    def _stepped(self) -> None:
        if not (self.inside or self.said_outside or self.replaying()):
            self.said_outside = True
            warnings.warn("optimizer.step() was called outside monitor.step(), which steps the optimizer itself (after "
                          "unscaling, guarding and clipping): each step ran twice; remove your optimizer.step() (and "
                          "scaler.step/update) from the loop", StableTrainWarning, stacklevel=console.user_stacklevel())

    def batches(self, backward: int, given: int) -> None:
        """At ``monitor.step()``: ``backward`` calls since the last step, ``given`` batches (a capture replays those)."""
        if 0 < given < backward and not self.said_fewer:
            self.said_fewer = True
            warnings.warn(f"monitor.step(): {backward} monitor.backward() calls since the last step but {given} "
                          f"batch{'' if given == 1 else 'es'} given: a capture replays only those (and finds the step's "
                          "loss not reproducible); pass each micro-batch to monitor.backward(loss, batch), or all to "
                          "monitor.step(micro_batches=[...])",
                          StableTrainWarning, stacklevel=console.user_stacklevel())

    @contextlib.contextmanager
    def stepping(self) -> Any:
        """Around ``monitor.step()``'s own optimizer step."""
        self.inside = True
        try:
            yield
        finally:
            self.inside = False

    def close(self, steps: int, unstepped: int, err: BaseException | None) -> None:
        """At close (``err``: the exception that ended the loop, after which nothing more is said); once."""
        self.handle.remove()
        if self.closed:  # (a close() after the with block's exit: said, or not to be said, then)
            return
        self.closed = True
        if err is not None:
            return
        if unstepped:
            warnings.warn(f"{unstepped} monitor.backward() call(s) after the last monitor.step() were never stepped: their "
                          "gradients are dropped at close (call monitor.step() after the step's last backward)",
                          StableTrainWarning, stacklevel=console.user_stacklevel())
        elif steps == 0:
            warnings.warn("the Monitor recorded no step: call monitor.step() once per optimizer step, after its "
                          "backward (monitor.step() steps the optimizer; the run directory holds no metrics)",
                          StableTrainWarning, stacklevel=console.user_stacklevel())
