"""ONE optimizer step: the only implementation, used by the loop, the incident replay, the doctor and the labs.

The step, in the order it runs (DESIGN.md, "the data's path")::

    optimizer.zero_grad(set_to_none=True); window.begin(samples in the window)
    for each micro-batch (DDP: no_sync on all but the last; FSDP2: set_requires_gradient_sync(last)):
        with precision.autocast(): loss_sum, count = loss_fn(model, batch)
        precision.backward(window.normalize(loss_sum, count, last))   # the raw sum (or / items so far)
    precision.unscale_(optimizer)                  # true grads before measuring and clipping
    norm, per_param = grad_norms(params)           # device tensors; the norm is also the finiteness flag
                                                   # (x window.grad_scale = 1 / items in the window, all ranks)
    ok, finite, spike = guard.observe(loss, norm)  # the sentinel (no guard: ok = finite)
    clipped = clipper.clip_(params, norm, ok)      # a non-finite norm is never "clipped"; x grad_scale in the pass
    applied = precision.step(optimizer, ok)        # skipped on the device when not ok, in every precision
    params_finite = all_params_finite(params)      # post-update check, one fused pass (on the steps asked for)
    schedule.step(applied)                         # the LR schedule holds on a skipped step

Nothing here reads a device value on the host, except where the optimizer cannot skip on the device
(:meth:`PrecisionPolicy.step` documents it). :meth:`TrainStep.forward_backward` runs the micro-batches;
:meth:`TrainStep.update` is :meth:`TrainStep.judge` (unscale, measure, guard, clip) then
:meth:`TrainStep.apply` (the optimizer step on that verdict, the schedule): an adapter whose host trainer runs its
own forward/backward calls the same update (or, where the host steps its optimizer itself, the judging half alone:
:mod:`stabletrain.host_step`), and a replay can run the parts under its tools.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .data import move_to
from .numerics import (
    all_params_finite,
    both_finite,
    grad_norms,
    restore_where_skipped,
    running_stats,
    running_stats_modules,
    snapshot_params,
    unique_params,
    update_norms,
)
from .policies.accumulation import AccumulationWindow, as_sum_count, sums_safe
from .policies.clipping import GradClipper
from .policies.guard import Guard, inputs_finite
from .policies.precision import PrecisionPolicy
from .policies.schedule import LRSchedule

__all__ = ["TrainStep", "LossFn", "STEP_KEYS", "build_step"]

LossFn = Callable[[nn.Module, Any], Any]
_NULL = contextlib.nullcontext()  # reusable: nullcontext keeps no state
#: A caller's own clip cut the gradients where the norm it left is below the pre-clip norm by more than this share
#: (float rounding of an uncut norm stays far below it).
CLIPPED_BELOW = 1e-4

#: The device tensors a step returns (``per_param_norms`` is 1-D; the rest are 0-dim). ``params_finite`` only
#: on a step whose parameters were checked (see ``check_params``).
STEP_KEYS = ("loss", "grad_norm", "post_clip_norm", "clipped", "applied", "finite", "spike", "params_finite", "overflow",
             "count", "per_param_norms")


class TrainStep:
    """One optimizer step over a window of micro-batches; returns its figures as device tensors (no sync).

    Args:
        model: what the loss calls (the DDP wrapper under DDP: its ``no_sync`` is used on all but the
            last micro-batch).
        optimizer: any torch optimizer; fused AdamW/Adam/SGD skip on the device, others cost one sync.
            None for a forward/backward-only step (a replay or check that measures without updating).
        precision: the precision policy (autocast, loss scale, skip-aware step).
        clipper: global-norm clipping (None: measure only).
        guard: the sentinel and spike rule (None: a step is applied iff its loss and grad norm are finite).
        schedule: the device-side LR schedule, held on skipped steps (None: the lr is the optimizer's).
        params: the parameters the norm, clipping and checks cover (default: the model's unique
            trainable parameters, in registration order).
        window: the accumulation window (default: one over ``params``; a replay passes a local one).
        check_inputs: also require the floating-point inputs of every micro-batch to be finite.
        check_params: check after the update that every parameter is finite (one fused pass); a call may
            ask for it on some steps only (the loop: on each log interval's last step).
        carrier: DDP, FSDP: the :class:`~stabletrain.distributed.carrier.WindowCarrier` the window's numbers travel
            with (FSDP: one that carries nothing); with it the step also returns ``local_nonfinite``,
            whether this rank's own loss or inputs were non-finite.
        numerics: where the norms and checks come from (``grad_norms``, ``all_params_finite``,
            ``snapshot(params, reuse)``, ``update_norms(params, before)``); None: :mod:`stabletrain.numerics`
            on local tensors. FSDP passes :class:`stabletrain.distributed.fsdp.ShardedNumerics` (DTensor shards,
            reduced across ranks).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: PrecisionPolicy, *,
                 clipper: GradClipper | None = None, guard: Guard | None = None, schedule: LRSchedule | None = None,
                 params: Sequence[Tensor] | None = None, window: AccumulationWindow | None = None,
                 check_inputs: bool = False, check_params: bool = True, carrier: Any = None,
                 numerics: Any = None) -> None:
        self.model, self.optimizer, self.precision = model, optimizer, precision
        self.clipper = clipper if clipper is not None else GradClipper(None)
        self.guard, self.schedule = guard, schedule
        self.params = list(params) if params is not None else [p for _, p in unique_params(model)]
        # Raw sums between forward_backward and update only when an update follows (it applies grad_scale).
        self.window = window if window is not None else AccumulationWindow(
            self.params, sums=optimizer is not None and sums_safe(self.params, precision))
        self.check_inputs, self.check_params, self.carrier = check_inputs, check_params, carrier
        self.numerics = numerics
        self._grad_norms = numerics.grad_norms if numerics is not None else grad_norms
        self._params_finite = numerics.all_params_finite if numerics is not None else all_params_finite
        self.device = precision.device
        self._inputs_ok: Tensor | None = None
        self._before: list[Tensor] | None = None
        self._flags: dict[tuple[bool, torch.device], Tensor] = {}
        self._counts: dict[tuple[int, torch.device], Tensor] = {}
        self._sync_methods: tuple[Any, Any] | None = None
        self._stat_modules: list[nn.Module] | None = None  # the modules whose running statistics a forward moves
        self._stats: list[Tensor] = []  # ... read before this window's forwards (keep_running_stats), and their copy
        self._stats_saved: list[Tensor] = []

    def __call__(self, micro_batches: Sequence[tuple[int, Any]], loss_fn: LossFn, *,
                 measure_update: bool = False, check_params: bool = True) -> dict[str, Tensor]:
        """Run the whole step on ``[(num_samples, batch), ...]``; see the module docstring."""
        self.forward_backward(micro_batches, loss_fn)
        return self.update(measure_update=measure_update, check_params=check_params)

    def forward_backward(self, micro_batches: Sequence[tuple[int, Any]], loss_fn: LossFn) -> None:
        """Zero the grads and accumulate the window's normalized gradient (DDP: reduced on the last micro-batch)."""
        model = self.model
        if not model.training:  # a per-step .train() would walk every module; switch only when needed
            model.train()
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            for p in self.params:
                p.grad = None
        if self.optimizer is not None:
            self.keep_running_stats()
        self.window.begin(num_samples=sum(n for n, _ in micro_batches))  # a mean's share, known before its forward
        if self.carrier is not None:
            self.carrier.reset()
        inputs_ok: Tensor | None = None
        for i, (num_samples, batch) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            batch = move_to(batch, self.device)
            if self.check_inputs:
                flag = inputs_finite(batch)
                inputs_ok = inputs_ok if flag is None else flag if inputs_ok is None else inputs_ok & flag
            with self._sync_context(last), self.precision.autocast():
                out = loss_fn(model, batch)
                # A mean that does not require grad takes the long way: as_sum_count says what is wrong with it.
                if isinstance(out, Tensor) and out.dim() == 0 and out.requires_grad \
                        and self.window.takes_mean(last, self.carrier):
                    loss = self.window.take_mean(out, self._count(num_samples, out.device), inputs_ok)
                else:  # DDP: the window's numbers go with the grads
                    loss_sum, count = as_sum_count(out, num_samples, backward=True)
                    loss = self.window.normalize(loss_sum, count, last, inputs_ok if last else None,
                                                 carrier=self.carrier)
            self.precision.backward(loss)
        self._inputs_ok = inputs_ok

    def update(self, *, measure_update: bool = False, check_params: bool = True, loss: Tensor | None = None,
               count: Tensor | None = None, grad_norm: Tensor | None = None) -> dict[str, Tensor]:
        """Unscale, measure, guard, clip, apply, advance the schedule; return the step's device tensors.

        :meth:`judge`, then :meth:`apply`. ``loss``/``count``: the step's unscaled per-item loss and item count
        when the gradients were not accumulated by :meth:`forward_backward` (an adapter over a host trainer's
        own backward). ``measure_update``: also return ``update_norm`` = ||theta_t - theta_{t-1}|| and
        ``update_ratio`` = update_norm / ||theta_{t-1}|| (one extra copy of the parameters on this step only), and per
        parameter ``param_update_norms`` and ``param_norms``.
        ``check_params``: False skips this step's parameter check (also skipped when built with
        ``check_params=False``); ``params_finite`` is then left out of the result. ``grad_norm``: the pre-clip
        norm of gradients the caller already clipped (its own clipping returned it): the step records it and
        the clip it implies, and does not clip again.
        """
        if self.optimizer is None:
            raise ValueError("TrainStep.update() needs an optimizer; this step was built with optimizer=None "
                             "(forward/backward only)")
        norms = post = None
        if grad_norm is not None:  # clipped by the caller: per-parameter shares are those of the pre-clip grads
            self.precision.unscale_(self.optimizer)
            post, per_param = self._grad_norms(self.params)  # the norm the caller's clip left: measured
            norms = (grad_norm.to(post.device), per_param)
        judged = self.judge(loss=loss, count=count, norms=norms, unscale=norms is None, clip=grad_norm is None, post_clip=post)
        return self.apply(judged, measure_update=measure_update, check_params=check_params)

    def judge(self, *, loss: Tensor | None = None, count: Tensor | None = None,
              norms: tuple[Tensor, Tensor] | None = None, unscale: bool = True, clip: bool = True,
              post_clip: Tensor | None = None) -> dict[str, Tensor]:
        """The judging half of the step: unscale, measure, guard, clip. No optimizer step; no sync.

        Returns the step's device tensors so far (``loss``, ``count``, ``grad_norm``, ``per_param_norms``,
        ``finite``, ``spike``, ``overflow``, ``clipped``, ``post_clip_norm``) and ``ok``, the verdict
        :meth:`apply` steps on. ``norms``: the (total, per-parameter) pre-clip norms of the true gradients,
        measured by the caller (a host trainer's); ``unscale``: divide the grads by the loss scale first;
        ``clip``: clip them at the clipper's threshold, else only record the clip that threshold implies (the
        caller, or its host trainer, clips). ``post_clip``: the norm the caller's own clip left (measured): the step
        records it and that clip (clipped where it is below the pre-clip norm), whatever ``clip.max_norm`` says.
        """
        params = self.params
        grad_scale = None
        if loss is None:
            loss, count = self.window.mean_loss, self.window.global_count
            grad_scale = self.window.grad_scale  # DDP: the grads hold the window's sum; x 1/count in the clip's pass
        elif count is None:
            count = torch.ones((), device=loss.device)
        if unscale and self.optimizer is not None:
            self.precision.unscale_(self.optimizer)
        norm, per_param = norms if norms is not None else self._grad_norms(params)  # DDP: of the all-reduced grads
        if grad_scale is not None:
            norm, per_param = norm * grad_scale, per_param * grad_scale
        inputs_ok = self.window.inputs_ok if self._inputs_ok is not None else None
        if self.guard is not None:
            ok, finite, spike = self.guard.observe(loss, norm, inputs_ok)
        else:
            finite = both_finite(loss, norm)
            if inputs_ok is not None:
                finite = finite & inputs_ok
            ok, spike = finite, self._flag(False, finite.device)
        # fp16: an overflow of the scaled grads (finite loss, non-finite norm) is the scaler's routine skip-and-
        # back-off, not an incident; a non-finite loss, or a NaN the scaler cannot fix, still is.
        overflow = (torch.isfinite(loss) & ~torch.isfinite(norm) if self.precision.scaler is not None
                    else self._flag(False, norm.device))
        if clip:  # a non-finite norm is never "clipped" (a host's warn-only verdict may let such a step through)
            clipped = self.clipper.clip_(params, norm, finite, grad_scale=grad_scale)
        elif post_clip is not None:  # the caller clipped at a threshold of its own: what it left says whether it cut
            post_clip = post_clip.to(norm.device) * grad_scale if grad_scale is not None else post_clip.to(norm.device)
            clipped = finite & (post_clip < norm * (1 - CLIPPED_BELOW))
        else:
            limit = self.clipper.max_norm
            clipped = finite & (norm > limit) if limit is not None else self._flag(False, norm.device)
        post = self.clipper.post_clip_norm(norm, after_clip=clip) if post_clip is None else post_clip
        return {"loss": loss.detach(), "grad_norm": norm, "post_clip_norm": post,
                "clipped": clipped, "ok": ok, "finite": finite, "spike": spike, "overflow": overflow, "count": count,
                "per_param_norms": per_param}

    def apply(self, judged: dict[str, Tensor], *, measure_update: bool = False, check_params: bool = True) -> dict[str, Tensor]:
        """The applying half: the optimizer step on :meth:`judge`'s verdict (skipped on the device when not ok), the
        schedule (held on a skipped step), the parameter check and ``||update||``; the step's device tensors."""
        optimizer, params = self.optimizer, self.params
        before = None
        if measure_update:
            before = (snapshot_params(params, self._before) if self.numerics is None
                      else self.numerics.snapshot(params, self._before))
            self._before = before
        # fp16: inputs that guard.check_inputs found non-finite skip the step as the guard's own verdict, with no back-off
        # (their NaN gradients are no overflow). A non-finite loss it did not trace to the inputs backs the scale off as
        # torch's GradScaler does (bitwise a hand-written loop's: tests/test_parity.py).
        hold = ~self.window.inputs_ok if self.precision.scaler is not None and self._inputs_ok is not None else None
        applied = self.precision.step(optimizer, judged["ok"], hold)
        if self._stats:  # a skipped step's forwards moved them: put back (a BatchNorm fed a skipped spike's batch)
            restore_where_skipped(self._stats, self._stats_saved, applied)
            self._stats = []  # (once: a host's own forwards, a Monitor's, are not kept)
        if self.schedule is not None:  # a host flag where the optimizer step already read it (no second read)
            on_host = self.precision.applied_on_host
            self.schedule.step(applied if on_host is None else on_host)
        out = {k: v for k, v in judged.items() if k != "ok"}
        out["applied"] = applied
        if self.check_params and check_params:
            out["params_finite"] = self._params_finite(params)
        if before is not None:  # also per parameter (param_update_norms, param_norms): the precursor's figures
            out.update(update_norms(params, before) if self.numerics is None else self.numerics.update_norms(params, before))
        if self.carrier is not None:  # DDP: did THIS rank see it (its own loss or inputs)?
            local = self.window.loss_sum * 0 != 0  # x * 0 is NaN iff x is not finite
            out["local_nonfinite"] = local if self._inputs_ok is None else local | ~self._inputs_ok
        return out

    def keep_running_stats(self) -> None:
        """Keep the model's running statistics (:func:`~stabletrain.numerics.running_stats`, read from its modules now)
        before a window's forwards: :meth:`apply` puts them back where its update is skipped. The built-in loop's
        :meth:`forward_backward` does; a host's forwards are its own (their statistics are not kept)."""
        if self._stat_modules is None:
            self._stat_modules = list(running_stats_modules(self.model).values())
        self._stats = running_stats(self._stat_modules) if self._stat_modules else []
        if not self._stats:
            return
        if [(s.shape, s.dtype, s.device) for s in self._stats_saved] != [(b.shape, b.dtype, b.device) for b in self._stats]:
            self._stats_saved = [b.detach().clone() for b in self._stats]
        else:
            torch._foreach_copy_(self._stats_saved, self._stats)

    def _count(self, num_samples: int, device: torch.device) -> Tensor:
        """The item count of a batch whose loss is a mean, as a 0-dim float32 made once per value (never written)."""
        key = (num_samples, device)
        count = self._counts.get(key)
        if count is None:
            if len(self._counts) >= 16:
                self._counts.clear()
            count = self._counts[key] = torch.full((), float(num_samples), dtype=torch.float32, device=device)
        return count

    def _flag(self, value: bool, device: torch.device) -> Tensor:
        """A constant 0-dim bool on ``device``, made once (never written: readers only stack or combine it)."""
        key = (value, device)
        flag = self._flags.get(key)
        if flag is None:
            flag = self._flags[key] = torch.full((), value, dtype=torch.bool, device=device)
        return flag

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync on all but the last micro-batch of a window; nothing on one process.

        FSDP2 reads its flag in the post-backward hook, so it is set here (False, ..., True) and left set.
        """
        if self._sync_methods is None:  # looked up once: a plain module's getattr miss walks nn.Module.__getattr__
            self._sync_methods = (getattr(self.model, "set_requires_gradient_sync", None),
                                  getattr(self.model, "no_sync", None))
        set_sync, no_sync = self._sync_methods
        if set_sync is not None:
            set_sync(last)
            return _NULL
        return no_sync() if (no_sync is not None and not last) else _NULL


def build_step(cfg: Any, model: nn.Module, optimizer: torch.optim.Optimizer | None, precision: PrecisionPolicy,
               **parts: Any) -> TrainStep:
    """The run's step as its config says: clipping at ``clip.max_norm``, the guard's input and parameter checks.

    ``parts``: the rest of :class:`TrainStep`'s arguments (guard, schedule, params, window, carrier, numerics).
    The built-in loop, the incident replay and the Monitor build their step here, so each runs the same one. An
    optimizer that holds none of the model's parameters is refused (it would step another model's, silently).
    """
    held = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    if held and not {id(p) for p in held} & {id(p) for p in model.parameters()}:
        raise ValueError(f"the optimizer ({type(optimizer).__name__}) holds none of the model's parameters ({len(held)} "
                         f"tensor(s) of another model): build it on this model's parameters (a Task.optimizer factory: on the "
                         "named_params it is given)")
    return TrainStep(model, optimizer, precision, clipper=GradClipper(cfg.clip.max_norm),
                     check_inputs=cfg.guard.check_inputs, check_params=cfg.guard.check_params, **parts)
