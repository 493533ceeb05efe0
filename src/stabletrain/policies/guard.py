"""The always-on sentinel and loss-spike detector: device-side decisions, host-side actions.

Per step (no host sync)::

    finite = isfinite(loss) & isfinite(grad_norm) [& inputs finite]   # the norm clipping needs anyway
    ok     = finite [& ~spike, with guard.on_spike=skip]              # the optimizer steps only if ok

Once per log interval, the loop checks on the interval's last step that the parameters are finite
(one fused pass, :func:`~stabletrain.numerics.all_params_finite`): a non-finite parameter can only come
from an applied update (a step with a non-finite loss or norm is skipped), and the capture's replay
pins the update that broke them (:attr:`GuardDecision.locate`). The host learns what happened once per
log interval (the rows of :class:`~stabletrain.policies.metrics.StepMetrics`) and then acts: events, incident
capture, stop or rollback (:meth:`Guard.decide`).

Spike rule, stated: a step's loss is a spike when it exceeds ``spike_ratio`` times the median (the lower middle value,
as ``torch.median``) of the last ``spike_window`` finite non-spike losses AND its z-score against their mean and
standard deviation exceeds ``spike_zscore`` -- or, for a loss above ``spike_ratio ** FAR`` times the median (32x with
the defaults), its robust z-score (against the median and the median absolute deviation times 1.4826) does: a window
that still holds a run's first, much larger losses has a deviation that hides a x4e4 loss (z 4 at step 51 of a loss
that fell from 2 to 6e-5), never its median and MAD; above ``spike_ratio ** ROBUST`` times the median (4x), a robust
z-score ``ROBUST_Z`` times as high does (:func:`~.spike_rule.robust_arms`). The rule is armed from :data:`EARLY_ARM`
losses on; until half the window is filled it also asks that the loss exceed ``spike_ratio`` squared times the largest
loss seen so far (but
one over ``spike_ratio ** (2 * FAR)`` times the window's median: :func:`~.spike_rule.early_largest`): a run's first
losses fall fast and a few of them make a shaky median and deviation (a small batch's loss 2.5x its window's median
and 6.0 deviations above its mean is noise at step 6), but a loss four times as high as any before it is a spike from
the fifth step on (a x1e4 loss at step 6 was missed when the rule armed only at half the window). Spikes are not added
to the window, so a run of spikes does not raise the baseline; nor is a loss ``spike_ratio ** FAR`` times every one
the window holds while the rule is not armed counted among them (:func:`~.spike_rule.early_outlier`). A spike is also
rare: its ratio to the median above ``spike_ratio`` times a high quantile of the last steps' ratios, spikes included
(:mod:`.spike_rarity`). With
``guard.on_spike=skip`` the rule runs on the device every step (the skip must be decided before the update); otherwise
the host runs the same rule on the interval's losses at the log boundary (:meth:`Guard.mark_spikes`), so the step pays
nothing for it.

Under DDP every input to these decisions is the same on every rank (the window's all-reduced loss,
the norm of the all-reduced gradients, parameters kept in lockstep), so every rank skips, stops and
rolls back together without a collective of its own; :mod:`stabletrain.distributed.group` says why a
non-finite gradient on one rank is non-finite on all.
"""

from __future__ import annotations

import bisect
import contextlib
import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ..config import GuardConfig
from ..numerics import both_finite, inputs_finite
from .spike_rarity import RarityBar
from .spike_rule import EARLY_ARM, FAR, MAD_TO_STD, armed_at, early_largest, early_outlier, far_spike, robust_arms, spike_test
from .stall import NEGLIGIBLE_GRAD, UNRECOVERABLE_SCALE, StallWatch, routine_overflow, scale_note

__all__ = ["Guard", "GuardDecision", "inputs_finite", "UNRECOVERABLE_SCALE", "EARLY_ARM", "spike_test", "NEGLIGIBLE_GRAD",
           "routine_overflow", "NEGLIGIBLE_SPIKE"]

#: A spike whose loss is below this fraction of the run's first logged loss is negligible (:attr:`GuardDecision.negligible`:
#: not captured, nothing to cure): a jump between negligible losses (Adam's wander near zero loss: 1e-8 to 5e-7) would
#: spend the run's captures (capture.max_spikes). (A regression that falls 1e4 -> 0.5 and spikes x16 to 8 is at 8e-4.)
NEGLIGIBLE_SPIKE = 1e-4

#: The flagged steps (spikes, non-finite steps) the guard remembers: a spike's capture takes no ordinary window among them.
UNORDINARY_KEPT = 64


@dataclass
class GuardDecision:
    """What the host does after an interval: the events to record and the action to take."""

    action: str = "continue"  # continue | stop | rollback
    reason: str = ""
    bad_steps: list[int] = field(default_factory=list)  # steps with a non-finite loss/norm/params
    spike_steps: list[int] = field(default_factory=list)
    first_incident: int | None = None  # the step to capture
    after_update: bool = False  # the first bad value appeared only in the parameters after the update
    #: (lo, hi): the parameters were checked non-finite at step hi and last seen finite before step lo, so the
    #: update that broke them is one of steps lo..hi; the capture's replay pins it (:meth:`pin`). None: exact.
    locate: tuple[int, int] | None = None
    params_bad_at: int | None = None  # the first step whose post-update check found a non-finite parameter
    stall: str | None = None  # guard.on_stall=warn: why the run is not learning (said once)
    negligible: bool = False  # the interval's spikes were all between negligible losses: not captured, nothing to cure
    _policy: str | None = None  # how a non-finite reason names the action taken (None: not such a decision)

    def pin(self, step: int) -> None:
        """The capture found that step ``step``'s update broke the parameters: it is the first incident."""
        self.first_incident, self.after_update, self.locate = step, True, None
        if step not in self.bad_steps:
            self.bad_steps = sorted([*self.bad_steps, step])
        if self._policy is not None:
            self.reason = _nonfinite_reason(self)


def _nonfinite_reason(d: GuardDecision) -> str:
    if d.after_update and d.locate is not None:
        where = f"in the parameters after an update of steps {d.locate[0]}-{d.locate[1]}"
    else:
        where = "in the parameters after the update" if d.after_update else "in the loss or grad norm"
        where += f" at step {d.first_incident}"
        if not d.after_update and d.params_bad_at is not None:
            where += f", and in the parameters at step {d.params_bad_at}"
    return f"non-finite value {where}{d._policy or ''}"


#: What sets the LR under each adapter's host, in its own terms (a stop's advice; the built-in loop names optim.lr).
HOST_LR = {"transformers": "TrainingArguments.learning_rate", "lightning": "the lr configure_optimizers gives the optimizer",
           "monitor": "the optimizer's lr"}


class Guard:
    """Sentinel + spike detection; consecutive-skip and rollback accounting on the host.

    ``on_device``: whether the spike rule runs on the device every step (``guard.on_spike=skip``); else
    :meth:`mark_spikes` runs it on the host once per interval and the per-step work is the finite check.
    """

    def __init__(self, cfg: GuardConfig, device: torch.device, *, enforce: bool = True, scaled: bool = False,
                 remedy: bool = False, lr_key: str | None = None, host: str | None = None) -> None:
        self.cfg = cfg
        # Its keys and what sets the LR in the user's terms: the built-in loop's config keys (guard.on_spike, optim.lr or
        # the task's optimizer), or an adapter's (``host``) options (on_spike=) and its host's LR.
        self.key = (lambda name: f"guard.{name}") if host is None else (lambda name: name)
        self.lr_key = lr_key or HOST_LR.get(host or "", "the optimizer's lr")
        self.remedy = remedy  # guard.on_nonfinite=remedy is a choice here (the built-in loop's): what a stop's advice names
        self.enforce = enforce  # False: an adapter's on_nonfinite="warn" (no skip of its own; the host's still happen)
        # fp16 with a GradScaler: a step whose gradients overflow (grad norm inf) has a finite loss the spike rule tests
        self.scaled = scaled
        self.on_device = cfg.on_spike in ("skip", "remedy")  # the spike must be skipped before its update
        where = device if self.on_device else torch.device("cpu")
        self.window = torch.full((cfg.spike_window,), float("nan"), device=where)
        self.num_seen, self._slots = torch.zeros((), dtype=torch.long, device=where), torch.arange(cfg.spike_window, device=where)
        # Off the device: the host rule's window is a numpy view of the CPU tensor; its count a plain int.
        self._host_window = None if self.on_device else self.window.numpy()
        self.rarity = RarityBar(cfg, where, self.on_device)  # ... and the last losses, spikes too: the bar of a rare one
        self._host_seen = 0
        self.consecutive_skips = 0
        self.spike_skips = 0  # of them, how many in a row were spikes (a loss at a new level: every step a spike)
        self.last_scale = math.inf  # the loss scale after the last step seen (a routine overflow brings it down)
        self.num_rollbacks = 0
        self.num_incidents = 0
        self.num_spikes = 0
        self.num_spike_captures = 0
        self.spike_class: tuple[int, str] | None = None  # the last captured spike's (step, class), set by the boundary
        self.first_loss: float | None = None  # the run's first logged interval loss: what 'negligible' is of (decide)
        self._no_spike: Tensor | None = None
        self._start: tuple[Any, int] | None = None  # the host window and count at the last interval's start
        # On the device: (window, count) at the last two boundaries: the current interval's start, the next's
        self._device_starts: tuple[Any, Any] = (None, None)
        self._device_starts_from_here()
        # the last stall_steps: a run not learning
        self.stall = StallWatch(cfg.stall_steps, remedy, keys=host is None, warns=cfg.on_stall == "warn")
        self.stall_warned = False
        # Why a restart from LAST_GOOD would meet the guard's stop again (a final exit, never restarted), or None:
        # guard.on_stall=stop's stall, or a run of skips no fp16 loss scale makes finite (the same steps skip again).
        self.final_stop: str | None = None
        self.unordinary: deque[int] = deque(maxlen=UNORDINARY_KEPT)  # the last steps flagged (spikes, bad steps)

    @property
    def _armed_at(self) -> int:
        return armed_at(self.cfg)

    @property
    def _full_at(self) -> int:  # below it the rule also asks for a loss above spike_ratio x the window's largest
        return max(self.cfg.spike_window // 2, 2)

    def observe(self, loss: Tensor, grad_norm: Tensor, inputs_ok: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Return (ok, finite, spike) as device bools for this step. No sync.

        Off the device (``on_spike`` warn or rollback) ``spike`` is a constant False here: the host
        decides it from the interval's rows (:meth:`mark_spikes`). Not ``enforce``: ``ok`` skips only a spike,
        and only under ``on_spike=skip``.
        """
        ok, finite, spike = self._judge(loss, grad_norm, inputs_ok)
        if not self.enforce:
            ok = ~spike if self.cfg.on_spike == "skip" else torch.ones_like(finite)
        return ok, finite, spike

    def _judge(self, loss: Tensor, grad_norm: Tensor, inputs_ok: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        finite = both_finite(loss, grad_norm)
        if inputs_ok is not None:
            finite = finite & inputs_ok
        if not self.on_device:
            if self._no_spike is None or self._no_spike.device != finite.device:
                self._no_spike = torch.zeros((), dtype=torch.bool, device=finite.device)
            return finite, finite, self._no_spike
        w = self.window
        armed = self.num_seen >= self._armed_at
        median = torch.nanmedian(w)
        mean = torch.nanmean(w)
        std = torch.sqrt(torch.nanmean((w - mean) ** 2))
        z = (loss - mean) / (std + 1e-12)
        robust = (loss - median) / (MAD_TO_STD * torch.nanmedian((w - median).abs()) + 1e-12)
        far = robust_arms(loss, median, robust, self.cfg)
        # fp16: a large spike's gradients overflow: its loss is tested still (the host rule tests the overflow rows too)
        testable = finite | (torch.isfinite(loss) & ~torch.isfinite(grad_norm)) if self.scaled else finite
        spike = armed & testable & (loss > self.cfg.spike_ratio * median) & ((z > self.cfg.spike_zscore) | far)
        early = self.num_seen < self._full_at
        none = torch.full_like(w, float("-inf"))
        # (early_largest: the largest within spike_ratio ** (2 * FAR) x a positive median)
        largest = torch.where(torch.isnan(w) | ((median > 0) & (w > self.cfg.spike_ratio ** (2 * FAR) * median)), none, w).max()
        spike = self.rarity.judge(loss, median, armed, spike & (~early | (loss > self.cfg.spike_ratio ** 2 * largest)))
        ok = finite & ~spike
        keep = finite & ~spike
        idx = self._slots  # (before the rule arms, early outliers are held after the counted losses, uncounted: _early)
        pre = self.num_seen < self._armed_at
        top = torch.where((idx < self.num_seen) & ~torch.isnan(w), w, none).max()
        held = pre & (idx >= self.num_seen) & ~torch.isnan(w)
        h = held.sum()
        outlier = keep & pre & (self.num_seen > 0) & (top > 0) & (loss.detach().float() > self.cfg.spike_ratio ** FAR * top)
        # 1-element index tensors, never a 0-dim one: indexing with a 0-dim CUDA tensor reads it on the host.
        slot = ((self.num_seen + torch.where(outlier, h, 0)) % self.cfg.spike_window).reshape(1)
        w.index_put_((slot,), torch.where(keep, loss.detach().float(), w.gather(0, slot)))
        w.masked_fill_(keep & ~outlier & held & (idx > self.num_seen), float("nan"))
        self.num_seen += torch.where(outlier, torch.where(h + 1 >= self._armed_at, h + 1, 0), keep.long())
        return ok, finite, spike

    def mark_spikes(self, rows: list[Any]) -> None:
        """Run the spike rule on the host over an interval's rows (step order), setting each row's ``spike``.

        The same rule as :meth:`observe` on the device, in float32: the lower median, the mean and the
        population standard deviation of the window's finite values. Nothing to do when the rule ran
        on the device (``guard.on_spike=skip``).
        """
        if self.on_device:  # the window as this interval ends starts the next: window_before rebuilds from it
            self._device_starts = (self._device_starts[1], (self.window.clone(), self.num_seen.clone()))
            self.rarity.mark_start()
            return
        w = self._host_window  # a view: the tensor (and so state_dict) follows
        seen = self._host_seen
        self._start = (w.copy(), seen)  # the interval's starting window (window_before), 50 floats
        self.rarity.mark_start()
        n = self.cfg.spike_window
        ratio, zscore = np.float32(self.cfg.spike_ratio), np.float32(self.cfg.spike_zscore)
        kept = sorted(w[~np.isnan(w)].tolist())  # the window's values in order (float32 values, exact as floats)
        losses = np.asarray([r.values["loss"] for r in rows], dtype=np.float32)  # each loss in float32, at once
        updates: dict[int, float] = {}  # slot -> loss, written into the window once at the end

        def put(slot: int, value: float) -> None:  # a slot's new value, in the kept order too
            old = updates.get(slot, float(w[slot]))
            if not math.isnan(old):
                del kept[bisect.bisect_left(kept, old)]
            updates[slot] = value
            if not math.isnan(value):
                bisect.insort(kept, value)

        for row, loss in zip(rows, losses.tolist()):
            v = row.values
            finite = v["finite"] > 0.5 and math.isfinite(loss)
            # fp16: a step the GradScaler skipped for overflow has a finite loss, and a large spike overflows: tested too
            testable = finite or (v.get("overflow", 0.0) > 0.5 and math.isfinite(loss))
            spike, median = False, kept[(len(kept) - 1) // 2] if seen >= self._armed_at and kept else None
            # The ratio test first, on the kept order (a bisect per step, not a sort): most steps stop there. In
            # float64 it decides every loss clear of the float32 product; one within a float32 step is tested exactly.
            if testable and median is not None:
                bound = float(ratio) * median
                if loss > bound * (1 - 1e-6) and np.float32(loss) > ratio * np.float32(median):
                    window = np.asarray(kept, dtype=np.float32)
                    # A diverging window overflows float32 (std inf: no spike), as the device rule does, silently.
                    with np.errstate(over="ignore", invalid="ignore"):
                        mean = window.mean(dtype=np.float32)
                        std = np.sqrt(((window - mean) ** 2).mean(dtype=np.float32))
                        z = (np.float32(loss) - mean) / (std + np.float32(1e-12))
                        spike = bool(z > zscore) or far_spike(loss, window, median, self.cfg)
                    if spike and seen < self._full_at:  # early: also above spike_ratio^2 x the largest loss so far
                        spike = bool(np.float32(loss) > np.float32(self.cfg.spike_ratio ** 2)
                                     * np.float32(early_largest(kept, self.cfg)))
            spike = spike and self.rarity.host_passes(loss, median)
            self.rarity.host_update(loss, median, spike)
            v["spike"] = 1.0 if spike else 0.0
            if finite and not spike and seen < self._armed_at:  # (early outliers held uncounted: as _judge)
                seen = self._early(loss, seen, lambda i: updates.get(i, float(w[i])), put)
            elif finite and not spike:
                put(seen % n, loss)
                seen += 1
        if updates:
            w[list(updates)] = list(updates.values())
        self._host_seen = seen
        self.num_seen.fill_(seen)
        self.rarity.host_done()

    def _device_starts_from_here(self) -> None:
        """The next interval starts from the window as it is now (at the start, after a load)."""
        if self.on_device:
            self._device_starts = (None, (self.window.clone(), self.num_seen.clone()))
            self.rarity.starts = (None, self.rarity.snapshot())

    def window_before(self, step: int, rows: list[Any]) -> list[float]:
        """The finite non-spike losses the rule held when it judged step ``step``: the window at the interval's
        start, then the interval's rows before ``step`` (host rule). With the rule on the device
        (``guard.on_spike=skip``) the window as it is now: a capture reads it once its replay stands just before
        ``step`` (the exact window); where the window is still the boundary's (an adapter's replay does not run the
        rule: it would hold the interval's later losses too), the one rebuilt from the interval's start as the host
        rule does. One small read, made only for a spike's capture.
        """
        self.rarity.live = self.on_device  # (and the rarity bar's ratios, as this window: RarityBar.before)
        if self.on_device:
            now = self.window.detach().cpu().numpy()
            start = self._device_starts[0]
            if start is not None:  # a replay that did not run the rule (an adapter's) left the boundary's window: rebuild
                w, seen = start[0].cpu().numpy(), int(start[1])
                before, end = self._kept(w, seen, rows, step), self._kept(w, seen, rows, None)
                if np.array_equal(end, now, equal_nan=True):
                    self.rarity.live = False
                    return [float(x) for x in before.tolist() if not math.isnan(x)]
            return [float(v) for v in now.tolist() if not math.isnan(v)]
        if self._start is None:
            return [float(v) for v in self.window.detach().cpu().tolist() if not math.isnan(v)]
        return [float(x) for x in self._kept(*self._start, rows, step).tolist() if not math.isnan(x)]

    def _early(self, loss: float, seen: int, value: Callable[[int], float], put: Callable[[int, float], None]) -> int:
        """Keep ``loss`` before the rule arms (``seen`` < armed_at), as :meth:`_judge` does on the device; return the new
        count. An early outlier (:func:`~.spike_rule.early_outlier` against the counted losses) is held in the slot after
        the ones held before it, uncounted; a loss that is none takes the first held slot and clears the others; the one
        that makes armed_at outliers in a row counts them all (a run that settled at a new level)."""
        n = self.cfg.spike_window
        held = [i for i in range(seen, n) if not math.isnan(value(i))]
        top = max((value(i) for i in range(seen)), default=0.0)
        if seen and early_outlier(loss, top, seen, self.cfg):
            put(seen + len(held), loss)
            return seen + len(held) + 1 if len(held) + 1 >= self._armed_at else seen
        put(seen, loss)
        for i in held[1:] if held and held[0] == seen else held:
            put(i, float("nan"))
        return seen + 1

    def _kept(self, window: Any, seen: int, rows: list[Any], step: int | None) -> Any:
        """``window`` (with ``seen`` losses kept so far) after the rows before ``step`` (None: all), as the rule keeps
        them: the finite non-spike losses but an early outlier (:func:`early_outlier`), in float32."""
        w = window.copy()
        for row in rows:
            if step is not None and row.step >= step:
                break
            v = row.values
            loss = float(np.float32(v["loss"]))
            if v["finite"] > 0.5 and math.isfinite(loss) and v.get("spike", 0.0) < 0.5:
                if seen < self._armed_at:
                    seen = self._early(loss, seen, lambda i: float(w[i]), w.__setitem__)
                else:
                    w[seen % len(w)] = loss
                    seen += 1
        return w

    def decide(self, rows: list[Any]) -> GuardDecision:
        """Read one interval's per-step rows (host values) and return what to do. Updates the counters.

        A row's ``params_finite`` is NaN where the parameters were not checked after that step (the loop
        checks on an interval's last step): a failed check then sets :attr:`GuardDecision.locate`, the
        steps since the last check that found them finite.
        """
        d = GuardDecision()
        crossed = None  # the step at which the skips in a row reached guard.max_consecutive_skips
        applied_since = False  # a step applied after it
        checked_from = rows[0].step if rows else 0  # the first step whose update no check has cleared yet
        params_bad_at = None
        for row in rows:
            v = row.values
            overflow = routine_overflow(v.get("overflow", 0.0) > 0.5, v.get("loss_scale", 1.0))
            loss_bad = v["finite"] < 0.5 and not overflow
            checked = v.get("params_finite", 1.0)
            params_bad = checked < 0.5
            if loss_bad or params_bad:
                d.bad_steps.append(row.step)
            if params_bad and params_bad_at is None:
                params_bad_at = d.params_bad_at = row.step
                if checked_from < row.step:
                    d.locate = (checked_from, row.step)
            elif checked >= 0.5:  # checked and finite
                checked_from = row.step + 1
            if d.first_incident is None and (loss_bad or params_bad):
                d.first_incident, d.after_update = row.step, not loss_bad
            if v.get("spike", 0.0) > 0.5:
                d.spike_steps.append(row.step)
            # A routine fp16 overflow that brought the scale down (the GradScaler backing off, bounded: below
            # UNRECOVERABLE_SCALE it is an incident) is no sign of a run that is not recovering: 44 of them in a row bring
            # a scale of 2**60 down to 2**16. One that left it where it was (our skip alone, a scale held) counts.
            scale = float(v.get("loss_scale", 1.0))
            if v["applied"] >= 0.5:
                self.consecutive_skips = 0
                applied_since = crossed is not None
            elif not (overflow and scale < self.last_scale):
                self.consecutive_skips += 1
            self.last_scale = scale
            self.spike_skips = self.spike_skips + 1 if v["applied"] < 0.5 and v.get("spike", 0.0) > 0.5 else 0
            if self.consecutive_skips >= self.cfg.max_consecutive_skips and d.action == "continue":
                crossed, fp16 = row.step, scale_note(scale, float(v.get("loss", math.nan)), self.remedy, self.stall.keys)
                d.action, d.reason = "stop", (f"{self.consecutive_skips} consecutive skipped steps ("
                                              f"{self.key('max_consecutive_skips')}={self.cfg.max_consecutive_skips}) at step "
                                              f"{row.step}: the run is not recovering"
                                              + self._level_note(row.step) + fp16)
                if fp16:  # (deterministic: the same steps overflow again after a restart)
                    self.final_stop = (f"no loss scale the GradScaler reaches within {self.key('max_consecutive_skips')}="
                                       f"{self.cfg.max_consecutive_skips} makes these steps finite: a restart would skip "
                                       "them again")
            self.stall.record(v["applied"] >= 0.5, float(v.get("grad_norm", math.nan)), scale, float(v.get("loss", math.nan)))
        if crossed is not None and rows[-1].step > crossed:  # the guard reads at the log boundary: the run trained on to it
            d.reason += (f" (the run went on to its log boundary, step {rows[-1].step}: " + (
                f"{self.consecutive_skips} skipped in a row by then)" if self.consecutive_skips and not applied_since else
                "it applied a step again before it)" if not self.consecutive_skips else
                f"it applied a step again before it, then skipped {self.consecutive_skips} more)"))
        if d.locate is not None and d.first_incident < d.locate[0]:
            d.locate = None  # an earlier loss incident comes first; the broken update is a later one
        losses = {r.step: r.values["loss"] for r in rows}
        if self.first_loss is None:  # the run's first logged loss (its interval's mean over finite steps, as recorded)
            finite = [x for x in losses.values() if math.isfinite(x)]
            self.first_loss = sum(finite) / len(finite) if finite and sum(finite) > 0 else None
        floor = NEGLIGIBLE_SPIKE * self.first_loss if self.first_loss is not None else 0.0
        d.negligible = bool(d.spike_steps) and all(losses.get(s, 0.0) < floor for s in d.spike_steps)  # (NaN: not below)
        self.unordinary.extend(sorted({*d.spike_steps, *d.bad_steps}))
        self.num_incidents += 1 if d.bad_steps or d.spike_steps else 0  # an interval's non-finite steps or spikes
        self.num_spikes += len(d.spike_steps)
        if d.action == "stop":
            return d
        stalled = self.stall.stalled(rows[-1].step if rows else 0)
        if stalled is not None and self.cfg.on_stall == "stop":
            d.action, d.reason = "stop", stalled
            self.final_stop = "its checkpoints hold the stalled state, a restart would stall again"
            return d
        if stalled is not None and not self.stall_warned:
            d.stall, self.stall_warned = stalled, True  # guard.on_stall=warn: said once
        if d.bad_steps and (self.cfg.on_nonfinite != "skip" or params_bad_at is not None):
            policy = self.cfg.on_nonfinite if self.cfg.on_nonfinite != "skip" else "stop"
            d._policy = ""
            if policy == "rollback" and self.num_rollbacks >= self.cfg.max_rollbacks:
                policy = "stop"
                d._policy = f", after {self.num_rollbacks} rollbacks (guard.max_rollbacks)"
            if params_bad_at is not None and self.cfg.on_nonfinite == "skip":
                d._policy += " (a skip cannot make non-finite parameters finite again)"
            d.action, d.reason = policy, _nonfinite_reason(d)
        elif d.spike_steps and self.cfg.on_spike == "remedy":
            d.action, d.reason = "remedy", f"loss spike at step {d.spike_steps[0]}"
        elif d.spike_steps and self.cfg.on_spike == "rollback":
            if self.num_rollbacks >= self.cfg.max_rollbacks:
                d.action, d.reason = "stop", f"loss spike at step {d.spike_steps[0]} after {self.num_rollbacks} rollbacks"
            else:
                d.action, d.reason = "rollback", f"loss spike at step {d.spike_steps[0]}"
        if d.action == "rollback":
            self.num_rollbacks += 1
        return d

    def _level_note(self, step: int) -> str:
        """What a stop after consecutive skips says where every one of them was a spike: the loss is at a new level."""
        if self.spike_skips < self.consecutive_skips:
            return ""
        since = step - self.spike_skips + 1
        note = f"; every one of them was a loss spike against the level before step {since}"
        if (self.spike_class is not None and self.spike_class[1] in ("state", "optimizer-state")
                and self.spike_class[0] >= since):  # (a capture of this run of spikes, not an older one's)
            return (f"{note}, and the capture at step {self.spike_class[0]} found the state drifted ({self.spike_class[1]}): "
                    f"a divergence, not a new level: lower the LR ({self.lr_key}), from a checkpoint before step {since}")
        return (f"{note}: the loss moved to a new level and stayed (a change in the data, or a divergence: stabletrain "
                f"diagnose names which); {self.key('on_spike')}=warn trains on at the new level")

    @contextlib.contextmanager
    def counters_kept(self) -> Iterator[None]:
        """Keep the run-wide counters (rollbacks, incidents, spikes) across a state restore inside the block.

        A rollback restores an older state; what happened since (the incident that caused it) still happened.
        """
        kept = (self.num_rollbacks, self.num_incidents, self.num_spikes, self.num_spike_captures)
        yield
        self.num_rollbacks, self.num_incidents, self.num_spikes, self.num_spike_captures = kept

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window.clone(), "num_seen": self.num_seen.clone(), "consecutive_skips": self.consecutive_skips,
                "spike_skips": self.spike_skips, "last_scale": self.last_scale,
                "num_rollbacks": self.num_rollbacks, "num_incidents": self.num_incidents, "num_spikes": self.num_spikes,
                "num_spike_captures": self.num_spike_captures, **self.stall.state_dict(),
                "stall_warned": self.stall_warned, "unordinary": list(self.unordinary), "first_loss": self.first_loss,
                **self.rarity.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window.copy_(state["window"])
        self.num_seen.copy_(state["num_seen"])
        self.rarity.load_state_dict(state)
        if not self.on_device:
            self._host_seen = int(self.num_seen)
        self.consecutive_skips = int(state["consecutive_skips"])
        self.spike_skips = int(state.get("spike_skips", 0))  # (older checkpoints: none)
        self.last_scale = float(state.get("last_scale", math.inf))
        self.num_rollbacks = int(state["num_rollbacks"])
        self.num_incidents = int(state["num_incidents"])
        self.num_spikes = int(state["num_spikes"])
        self.num_spike_captures = int(state.get("num_spike_captures", 0))  # checkpoints from before spike captures
        self.stall.load_state_dict(state)
        self.stall_warned = bool(state.get("stall_warned", False))
        self._device_starts_from_here()
        self.unordinary.clear()
        self.unordinary.extend(int(s) for s in state.get("unordinary", []))
        self.first_loss = state.get("first_loss")  # (older checkpoints: none; the first interval logged after it)
