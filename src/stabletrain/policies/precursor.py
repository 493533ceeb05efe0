"""A warning before the spike: each layer's update/weight ratio against its own recent history.

Large runs see a layer's Adam update grow before the loss moves (Marin's 32B run: update-norm spikes came
first; a rarely seen embedding row whose second moment is tiny takes an update many times its usual size).
Once per log interval, on the host, from figures the interval's one sync already read (no per-step work):

    r_l = ||update_l|| / ||theta_l||   at the interval's last step (the step that measures the update)
    g_l = sqrt(mean over the interval's finite steps of ||grad_l||^2)

For each parameter tensor l, ``log r_l`` and ``log g_l`` are compared with an exponential moving mean and
variance of their own past values, as ZClip compares the grad norm (Kumar et al. 2025: an EMA of the mean
and variance, a z-score, an outlier entering the history clipped to the threshold); here per layer, in
log space (a ratio departs by a factor, whatever its scale), once per interval. A layer *departs* when

    z_l = (log r_l - mean_l) / std_l > guard.precursor_zscore   and   r_l > guard.precursor_ratio x exp(mean_l)
    and ||update_l|| > guard.precursor_ratio x its own typical (geometric mean) update norm

after ``guard.precursor_warmup`` intervals of its history, for the parameters of :data:`MIN_NUMEL` elements or
more. The factor keeps a smooth trend (an LR warmup's
ramp) and a very steady layer's small wobbles from counting; the update's own factor keeps a weight whose
norm shrinks (a one-element bias crossing zero) from counting as an update that grew. The grad norm is
evidence beside it, not a trigger: per layer it moves several-fold in healthy runs (bench/precursor.py).
The first interval in which a layer departs gives one :class:`PrecursorWarning` (a ``precursor`` event and
one console line) naming the layers, their ratios and how far they depart, with the grad norm's own
z-score beside each; no new warning until an interval in which no layer departs. An interval whose loss
already spiked or went non-finite gives none:
the warning is for what comes before. The weight of a new interval is ``1 / min(n, guard.precursor_window)``
(n: intervals seen), so the first intervals are an exact mean and variance and later ones an EMA.

:meth:`Precursor.state_dict` round-trips the history, so a resumed run warns as the uninterrupted one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import GuardConfig, check_range

__all__ = ["Precursor", "PrecursorWarning", "layer_figures", "MIN_NUMEL"]

#: The smallest standard deviation (of a natural log) a z-score divides by: a layer whose ratio has not moved
#: by 1% in its whole history is not "thousands of deviations" away when it moves by 20%.
MIN_STD = 0.01
#: A parameter with fewer elements is not watched: a scalar's or a tiny bias's update/weight ratio swings by orders of
#: magnitude as it crosses zero (a regression head's one-element bias warned at "1.9e3x its typical"). LayerNorm gains
#: are watched: the default gpt's warnings before its spikes came from them (bench/precursor.py).
MIN_NUMEL = 8


@dataclass
class PrecursorWarning:
    """The layers whose update departs from their history at ``step`` (each a dict: name, ratio, typical, factor,
    z, update_factor, grad_norm, grad_factor, grad_z), the most departing first."""

    step: int
    layers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def reason(self) -> str:
        """One sentence: the layers, each ratio and how far it departs (events.jsonl's ``reason``)."""
        shown = ", ".join(_describe(layer) for layer in self.layers[:3])
        more = f" and {len(self.layers) - 3} more" if len(self.layers) > 3 else ""
        return f"update/weight ratio departs from its recent history in {shown}{more}"

    @property
    def line(self) -> str:
        """The console line (:func:`stabletrain.console.say` puts ``stabletrain:`` before it)."""
        return (f"precursor at step {self.step}: {self.reason}; a loss spike may follow (if it does and the class is "
                "state: a lower LR or a longer warmup; guard.precursor=false silences this)")

    def fields(self) -> dict[str, Any]:
        """The event's fields besides step, kind and reason."""
        return {"layers": [dict(layer) for layer in self.layers]}


def _describe(layer: dict[str, Any]) -> str:
    """One layer's part of the warning. The gradient grew with the update where its z-score is high, or where it grew by
    half the update's factor or more (a noisy layer's z stays low: under a constant-LR SGD, whose update is lr x grad, a
    grad 2x its typical at z 1.1 read 'not the gradient: the step size grew')."""
    grew = layer.get("grad_z") is not None and (layer["grad_z"] > 2 or layer["grad_factor"] >= max(1.5, layer["factor"] / 2))
    grad = (f"; its grad norm {layer['grad_factor']:.2g}x its typical, z {layer['grad_z']:.1f}: "
            f"{'the gradient grew with it' if grew else 'not the gradient: the step size grew'}"
            if layer.get("grad_z") is not None else "")
    return (f"{layer['name']} (update/weight {layer['ratio']:.3g}, {layer['factor']:.2g}x its typical {layer['typical']:.3g}, "
            f"z {layer['z']:.1f} standard deviations above its history{grad})")


def layer_figures(summary: dict[str, Any], param_sq: Sequence[float]) -> tuple[list[float], list[float], list[float]]:
    """(each parameter's update norm, its update/weight ratio, its RMS grad norm over the interval) from
    :meth:`~stabletrain.policies.metrics.StepMetrics.reduce` (host values). Empty updates and ratios when no
    update was measured; NaN where a figure is missing (no finite step, a zero weight)."""
    ups, ws = summary.get("interval_param_update_norms") or [], summary.get("interval_param_norms") or []
    ratios = [u / w if w > 0 else math.nan for u, w in zip(ups, ws)]
    n = summary.get("interval_finite_steps", 0)
    grads = [math.sqrt(sq / n) if n else math.nan for sq in param_sq]
    return list(ups), ratios, grads


class _History:
    """An exponentially weighted mean and variance per layer (weight 1/min(n, window) on the n-th value)."""

    def __init__(self, num: int) -> None:
        self.mean = [0.0] * num
        self.var = [0.0] * num
        self.count = [0] * num

    def armed(self, i: int, warmup: int) -> bool:
        """Whether layer ``i``'s history holds ``warmup`` values."""
        return self.count[i] >= warmup

    def z(self, i: int, x: float) -> tuple[float, float]:
        """(z-score of ``x``, ``x`` - mean) against layer ``i``'s history."""
        d = x - self.mean[i]
        return d / self.std(i), d

    def std(self, i: int) -> float:
        return max(math.sqrt(self.var[i]), MIN_STD)

    def add(self, i: int, x: float, window: int, clip: float | None = None) -> None:
        """Take ``x`` into layer ``i``'s history; ``clip``: at most that many deviations above the mean (ZClip's
        rule: an outlier enters the history at the threshold, so a departure does not become the norm at once)."""
        if clip is not None:
            x = min(x, self.mean[i] + clip * self.std(i))
        self.count[i] += 1
        w = 1.0 / min(self.count[i], window)
        d = x - self.mean[i]
        self.mean[i] += w * d
        self.var[i] = (1.0 - w) * (self.var[i] + w * d * d)

    def state_dict(self) -> dict[str, Any]:
        return {"mean": list(self.mean), "var": list(self.var), "count": list(self.count)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if len(state["mean"]) != len(self.mean):
            raise ValueError(f"the precursor's saved history covers {len(state['mean'])} parameters, this model has "
                             f"{len(self.mean)}")
        self.mean, self.var = [float(v) for v in state["mean"]], [float(v) for v in state["var"]]
        self.count = [int(v) for v in state["count"]]


class Precursor:
    """The per-layer update-ratio watch (see the module docstring); host values only, once per log interval.

    ``names``: the parameter names, in the order of the interval's per-parameter figures.
    """

    def __init__(self, cfg: GuardConfig, names: Sequence[str], sizes: Sequence[int] | None = None) -> None:
        self.enabled = bool(cfg.precursor)
        # (``sizes``: each parameter's element count; those under MIN_NUMEL are not watched)
        self.watched = [n >= MIN_NUMEL for n in sizes] if sizes is not None else [True] * len(names)
        self.window = check_range("guard.precursor_window", cfg.precursor_window)
        self.zscore = check_range("guard.precursor_zscore", cfg.precursor_zscore)
        self.ratio = check_range("guard.precursor_ratio", cfg.precursor_ratio)
        self.warmup = check_range("guard.precursor_warmup", cfg.precursor_warmup)
        self.names = list(names)
        num = len(self.names)
        self.ratios, self.updates, self.grads = _History(num), _History(num), _History(num)
        self.departing = False  # some layer departed at the last interval: no new warning until none does
        self.num_warnings = 0
        self._before: tuple[list[float], list[int]] = ([], [])  # the ratios' history before the last interval observed

    def observe(self, step: int, summary: dict[str, Any], param_sq: Sequence[float],
                rows: Sequence[Any] = ()) -> PrecursorWarning | None:
        """Read one interval's figures (after :meth:`StepMetrics.reduce`); return a warning, or None.

        ``rows``: the interval's per-step rows; one with a spike or a non-finite value means the loss has
        already departed (no warning). An interval that measured no update (or whose last step was skipped:
        a zero update) leaves the histories as they were.
        """
        if not self.enabled or not summary:
            return None
        self._before = (self.ratios.mean[:], self.ratios.count[:])
        updates, ratios, grads = layer_figures(summary, param_sq)
        if len(ratios) != len(self.names) or not any(u > 0 for u in updates):
            return None
        departed: list[dict[str, Any]] = []
        bound = math.log(self.ratio)
        for i, name in enumerate(self.names):
            x, ux = _log(ratios[i]), _log(updates[i])
            gx = _log(grads[i]) if i < len(grads) else None
            armed = self.ratios.armed(i, self.warmup) and self.updates.armed(i, self.warmup) and self.watched[i]
            if x is not None and ux is not None and armed:
                z, d = self.ratios.z(i, x)
                _, ud = self.updates.z(i, ux)
                if z > self.zscore and d > bound and ud > bound:
                    departed.append(self._layer(i, name, ratios[i], z, d, ud, grads[i], gx))
            for history, value in ((self.ratios, x), (self.updates, ux), (self.grads, gx)):
                if value is not None:
                    history.add(i, value, self.window, self.zscore if history.armed(i, self.warmup) else None)
        was_departing, self.departing = self.departing, bool(departed)
        loss_departed = any(r.values.get("spike", 0.0) > 0.5 or r.values.get("finite", 1.0) < 0.5 for r in rows)
        if not departed or was_departing or loss_departed:
            return None
        self.num_warnings += 1
        departed.sort(key=lambda layer: -layer["z"])
        return PrecursorWarning(step, departed)

    def _layer(self, i: int, name: str, ratio: float, z: float, d: float, ud: float, grad: float,
               gx: float | None) -> dict[str, Any]:
        """What the warning says of layer ``i`` (before its history takes this interval in)."""
        out: dict[str, Any] = {"name": name, "ratio": ratio, "typical": math.exp(self.ratios.mean[i]),
                               "factor": math.exp(d), "z": z, "update_factor": math.exp(ud), "grad_norm": grad,
                               "grad_factor": None, "grad_z": None}
        if gx is not None and self.grads.armed(i, self.warmup):
            gz, gd = self.grads.z(i, gx)
            out["grad_factor"], out["grad_z"] = math.exp(gd), gz
        return out

    def typical_ratios(self) -> dict[str, float]:
        """Each parameter's typical update/weight ratio before the last interval observed (its history's geometric mean
        then): what it usually moves by, not what a surge in that interval made it. Only parameters with a history of
        ``guard.precursor_warmup`` intervals, or as long as the longest (a run's first intervals): a layer that moved in
        fewer (silent for long, then one surging update) has no usual of its own."""
        mean, count = self._before
        need = max(min(self.warmup, max(count, default=0)), 1)
        return {n: math.exp(m) for n, m, c in zip(self.names, mean, count) if c >= need}

    def state_dict(self) -> dict[str, Any]:
        """The histories, the departing flag and the warning count (plain values)."""
        return {"ratios": self.ratios.state_dict(), "updates": self.updates.state_dict(), "grads": self.grads.state_dict(),
                "departing": self.departing, "num_warnings": self.num_warnings}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; an empty dict (a checkpoint from before the precursor) starts afresh."""
        if not state:
            return
        self.ratios.load_state_dict(state["ratios"])
        self.updates.load_state_dict(state["updates"])
        self.grads.load_state_dict(state["grads"])
        self.departing = bool(state["departing"])
        self.num_warnings = int(state["num_warnings"])


def _log(x: float) -> float | None:
    """log(x) for a finite x > 0, else None (no figure: not taken into the history)."""
    return math.log(x) if x > 0 and math.isfinite(x) else None
