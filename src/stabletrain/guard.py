"""The always-on sentinel and loss-spike detector: device-side decisions, host-side actions.

Per step (no host sync)::

    finite = isfinite(loss) & isfinite(grad_norm) [& inputs finite]   # the norm clipping needs anyway
    spike  = enough history & loss > spike_ratio * median(window) & zscore(loss) > spike_zscore
    ok     = finite & ~(spike & on_spike == "skip")                    # the optimizer steps only if ok

After the update, :meth:`Guard.params_finite` checks the parameters in one fused pass. The host learns
what happened once per log interval (the rows of :class:`~stabletrain.metrics.StepMetrics`) and then
acts: events, incident capture, stop or rollback (:meth:`Guard.decide`).

Under DDP every input to these decisions is the same on every rank (the window's all-reduced loss,
the norm of the all-reduced gradients, parameters kept in lockstep), so every rank skips, stops and
rolls back together without a collective of its own; :mod:`stabletrain.distributed` says why a
non-finite gradient on one rank is non-finite on all.

Spike rule, stated: a step's loss is a spike when it exceeds ``spike_ratio`` times the median of the
last ``spike_window`` finite non-spike losses AND its z-score against their mean and standard
deviation exceeds ``spike_zscore``; the rule is armed once half the window is filled. Spikes are not
added to the window, so a run of spikes does not raise the baseline.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .config import GuardConfig
from .numerics import all_params_finite

__all__ = ["Guard", "GuardDecision", "inputs_finite"]


def inputs_finite(batch: Any) -> Tensor | None:
    """Return a device bool: every floating-point tensor in ``batch`` is finite (None if there is none)."""
    flags: list[Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, Tensor):
            if x.is_floating_point():
                flags.append(torch.isfinite(x).all())
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(batch)
    return torch.stack(flags).all() if flags else None


@dataclass
class GuardDecision:
    """What the host does after an interval: the events to record and the action to take."""

    action: str = "continue"  # continue | stop | rollback
    reason: str = ""
    bad_steps: list[int] = field(default_factory=list)  # steps with a non-finite loss/norm/params
    spike_steps: list[int] = field(default_factory=list)
    first_incident: int | None = None  # the step to capture
    after_update: bool = False  # the first bad value appeared only in the parameters after the update


class Guard:
    """Sentinel + spike detection on the device; consecutive-skip and rollback accounting on the host."""

    def __init__(self, cfg: GuardConfig, device: torch.device) -> None:
        self.cfg = cfg
        self.window = torch.full((cfg.spike_window,), float("nan"), device=device)
        self.num_seen = torch.zeros((), dtype=torch.long, device=device)
        self.consecutive_skips = 0
        self.num_rollbacks = 0
        self.num_incidents = 0
        self.num_spikes = 0

    def observe(self, loss: Tensor, grad_norm: Tensor, inputs_ok: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """Return (ok, finite, spike) as device bools for this step; update the spike window. No sync."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if inputs_ok is not None:
            finite = finite & inputs_ok
        w = self.window
        armed = self.num_seen >= max(self.cfg.spike_window // 2, 2)
        median = torch.nanmedian(w)
        mean = torch.nanmean(w)
        std = torch.sqrt(torch.nanmean((w - mean) ** 2))
        z = (loss - mean) / (std + 1e-12)
        spike = armed & finite & (loss > self.cfg.spike_ratio * median) & (z > self.cfg.spike_zscore)
        ok = finite & ~spike if self.cfg.on_spike == "skip" else finite
        keep = finite & ~spike
        # 1-element index tensors, never a 0-dim one: indexing with a 0-dim CUDA tensor reads it on the host.
        slot = (self.num_seen % self.cfg.spike_window).reshape(1)
        w.index_put_((slot,), torch.where(keep, loss.detach().float(), w.gather(0, slot)))
        self.num_seen += keep.long()
        return ok, finite, spike

    params_finite = staticmethod(all_params_finite)  # the cheap post-update check

    def decide(self, rows: list[Any]) -> GuardDecision:
        """Read one interval's per-step rows (host values) and return what to do. Updates the counters."""
        d = GuardDecision()
        for row in rows:
            v = row.values
            overflow = v.get("overflow", 0.0) > 0.5  # fp16: the scaler's routine skip, not an incident
            bad = (v["finite"] < 0.5 and not overflow) or v.get("params_finite", 1.0) < 0.5
            if bad:
                d.bad_steps.append(row.step)
                if d.first_incident is None:
                    d.first_incident = row.step
                    d.after_update = v["finite"] >= 0.5 and v.get("params_finite", 1.0) < 0.5
            if v.get("spike", 0.0) > 0.5:
                d.spike_steps.append(row.step)
            self.consecutive_skips = self.consecutive_skips + 1 if v["applied"] < 0.5 else 0
            if self.consecutive_skips >= self.cfg.max_consecutive_skips and d.action == "continue":
                d.action, d.reason = "stop", (f"{self.consecutive_skips} consecutive skipped steps (guard.max_consecutive_skips="
                                              f"{self.cfg.max_consecutive_skips}) at step {row.step}: the run is not recovering")
        self.num_incidents += 1 if d.bad_steps else 0
        self.num_spikes += len(d.spike_steps)
        if d.action == "stop":
            return d
        if d.bad_steps and (self.cfg.on_nonfinite != "skip" or d.after_update):
            policy = self.cfg.on_nonfinite if self.cfg.on_nonfinite != "skip" else "stop"
            where = "in the parameters after the update" if d.after_update else "in the loss or grad norm"
            if policy == "rollback" and self.num_rollbacks >= self.cfg.max_rollbacks:
                policy = "stop"
                where += f", after {self.num_rollbacks} rollbacks (guard.max_rollbacks)"
            skip_note = " (a skip cannot undo an applied update)" if d.after_update and self.cfg.on_nonfinite == "skip" else ""
            d.action, d.reason = policy, f"non-finite value {where} at step {d.first_incident}{skip_note}"
        elif d.spike_steps and self.cfg.on_spike == "rollback":
            if self.num_rollbacks >= self.cfg.max_rollbacks:
                d.action, d.reason = "stop", f"loss spike at step {d.spike_steps[0]} after {self.num_rollbacks} rollbacks"
            else:
                d.action, d.reason = "rollback", f"loss spike at step {d.spike_steps[0]}"
        if d.action == "rollback":
            self.num_rollbacks += 1
        return d

    @contextlib.contextmanager
    def counters_kept(self) -> Iterator[None]:
        """Keep the run-wide counters (rollbacks, incidents, spikes) across a state restore inside the block.

        A rollback restores an older state; what happened since (the incident that caused it) still happened.
        """
        kept = (self.num_rollbacks, self.num_incidents, self.num_spikes)
        yield
        self.num_rollbacks, self.num_incidents, self.num_spikes = kept

    def state_dict(self) -> dict[str, Any]:
        return {"window": self.window.clone(), "num_seen": self.num_seen.clone(), "consecutive_skips": self.consecutive_skips,
                "num_rollbacks": self.num_rollbacks, "num_incidents": self.num_incidents, "num_spikes": self.num_spikes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.window.copy_(state["window"])
        self.num_seen.copy_(state["num_seen"])
        self.consecutive_skips = int(state["consecutive_skips"])
        self.num_rollbacks = int(state["num_rollbacks"])
        self.num_incidents = int(state["num_incidents"])
        self.num_spikes = int(state["num_spikes"])
