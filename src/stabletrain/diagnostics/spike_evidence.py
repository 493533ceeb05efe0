"""A loss spike's evidence, from the tensors and per-module statistics its replays measured (pure: no replay, no state).

What :func:`~stabletrain.diagnostics.spike.classify_spike` weighs: Adam's surging coordinates (:func:`adam_surges`,
:func:`surge_rows`), where each module's output departs from the older state's or from fp32 (:func:`departures`,
:func:`precision_departures`), which layers' gradients jumped (:func:`jumps`), the sets of samples worth dropping
(:func:`outlier_sets`) and the LR's change between two states (:func:`lr_change`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["adam_surges", "surge_rows", "departures", "precision_departures", "jumps", "max_outliers", "outlier_sets",
           "lr_change", "lr_groups", "SURGE_FACTOR", "MIN_WHOLE", "PRECISION_ERROR", "MOSTLY_CARRIED"]

SURGE_FACTOR = 10.0  #: A coordinate's gradient this many times sqrt(v) (Adam's second moment, bias-corrected) is a surge.
MIN_WHOLE = 8  #: A layer of fewer coordinates (a bias of a few, a scalar) surging whole is not told from the whole step's.
PRECISION_ERROR = 0.05  #: A module whose low-precision output differs from fp32's by this share (relative L2) departs.


def adam_surges(named_params: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer,
                grads: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, float]]:
    """Per parameter with Adam state: the coordinates whose gradient surges past sqrt(v) (:data:`SURGE_FACTOR`).

    ``optimizer``: an Adam/AdamW holding the state before the step; ``grads``: the step's true (unscaled) gradients by name.
    Returns name -> (bool mask, the median sqrt(v) of the other coordinates, the median sqrt(v) of all its coordinates)
    (empty for an optimizer without ``exp_avg_sq``). A
    coordinate whose gradients were tiny (or zero) for long has a tiny sqrt(v): its first large gradient makes an update of
    about lr x sqrt(t) times (1 - beta1) / sqrt(1 - beta2)-ish where a steady coordinate's is about lr.
    """
    out = {}
    by_param = {id(p): n for n, p in named_params}
    for group in optimizer.param_groups:
        b2 = group.get("betas", (0.9, 0.999))[1]
        eps = float(group.get("eps", 1e-8))
        for p in group["params"]:
            st, name = optimizer.state.get(p, {}), by_param.get(id(p))
            g = grads.get(name) if name is not None else None
            if g is None or "exp_avg_sq" not in st:
                continue
            t = float(st["step"]) if "step" in st else 0.0
            v_hat = st["exp_avg_sq"].detach().float() / (1 - b2 ** t) if t >= 1 else st["exp_avg_sq"].detach().float()
            g = g.detach().float().to(v_hat.device)
            root = v_hat.sqrt()
            mask = (g.abs() > SURGE_FACTOR * (root + eps)) & (g.abs() > 10 * eps)
            rest = root[~mask]
            out[name] = (mask, float(rest.median()) if rest.numel() else 0.0, float(root.median()))
    return out


def surge_rows(masks: dict[str, tuple[torch.Tensor, float, float]], moved: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Per parameter with surging coordinates: their share, and how far they moved against the parameter's others.

    ``moved``: name -> |theta_after - theta_before| of the step. Returns ``[{"name", "numel", "surge_share", "coord_factor",
    "typical_sqrt_v", "whole"}, ...]`` where coord_factor = mean move of the surging coordinates / mean move of the rest.

    Most of a layer surging is the whole step's (every layer's gradients rose), unless the layer was silent for long
    as a whole (a rare feature's own weights, a rarely routed expert): its second moment (median sqrt(v) over all its
    coordinates, the mask's third figure) a :data:`SURGE_FACTOR`-th of the other layers' or less, in a layer of
    :data:`MIN_WHOLE` coordinates or more, while such layers hold a minority of the model. That one is ``whole``,
    measured against the other layers' steady coordinates (their mean move, their median sqrt(v)), its own having no
    steady ones to stand for them."""
    counts = {name: (v[0].numel(), int(v[0].sum())) for name, v in masks.items() if name in moved}
    broad = {name for name, (n, k) in counts.items() if k * 2 > n}
    steady_sum = steady_n = 0.0  # the other layers' steady coordinates: a whole layer's measure
    roots = []
    for name, (mask, typical, *_) in masks.items():
        if name in counts and name not in broad:
            d = moved[name].detach().float().to(mask.device)[~mask]
            steady_sum, steady_n = steady_sum + float(d.sum()), steady_n + d.numel()
            roots.append(typical)
    steady, root = (steady_sum / steady_n if steady_n else 0.0), (sorted(roots)[len(roots) // 2] if roots else 0.0)
    silent = {name for name in broad if counts[name][0] >= MIN_WHOLE and root > 0
              and (masks[name][2] if len(masks[name]) > 2 else masks[name][1]) <= root / SURGE_FACTOR}
    if sum(counts[name][0] for name in silent) * 2 > sum(n for n, _ in counts.values()):
        silent = set()  # (most of the model: the whole step's)
    rows = []
    for name, (mask, typical, *_) in masks.items():
        n, k = counts.get(name, (0, 0))
        if not k or (name in broad and name not in silent):
            continue
        d = moved[name].detach().float().to(mask.device)
        whole = name in silent
        base = steady if whole else (float(d[~mask].mean()) if k < n else 0.0)
        surging = float(d[mask].mean())
        if math.isfinite(surging) and surging > 0:  # (nothing moved: a skipped step, an fp16 overflow: no surge)
            rows.append({"name": name, "numel": n, "surge_share": k / n, "typical_sqrt_v": root if whole else typical,
                         "coord_factor": surging / base if base > 0 else float("inf"), "whole": whole})
    return rows


def departures(current: dict[str, float], older: dict[str, float], order: list[str]) -> dict[str, Any]:
    """Which module's output magnitude departs most from the same module's under the older state.

    ``current``/``older``: module name -> output RMS on the spike's window; ``order``: the modules in forward
    order. Returns ``{"first", "first_factor", "largest", "largest_factor", "top"}``: the first module (in forward
    order) within half (in log terms) of the largest departure, the largest itself, the top five as
    ``[name, factor]`` (factor = current / older RMS), and ``upstream``: the two modules that ran just before the
    first (nearest first), where a value that only shows downstream (low bits lost) may have been made.
    """
    logs = {}
    for name in order:
        a, b = current.get(name), older.get(name)
        if a is None or b is None or not (a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)):
            continue
        logs[name] = math.log(a / b)
    if not logs:
        return {"first": None, "first_factor": None, "largest": None, "largest_factor": None, "top": [], "upstream": []}
    largest = max(logs, key=lambda k: abs(logs[k]))
    bar = abs(logs[largest]) / 2
    first = next(k for k in order if k in logs and abs(logs[k]) >= bar)
    top = sorted(logs, key=lambda k: -abs(logs[k]))[:5]
    before = [k for k in order[:order.index(first)] if "." not in k or not first.startswith(k + ".")]
    return {"first": first, "first_factor": math.exp(logs[first]), "largest": largest,
            "largest_factor": math.exp(logs[largest]), "top": [[k, math.exp(logs[k])] for k in top],
            "upstream": before[-2:][::-1]}


def precision_departures(errors: dict[str, float], order: list[str]) -> dict[str, Any]:
    """Where a low-precision forward first parts from fp32's: the first module (in the order they ran) whose output's
    relative error against its fp32 output is at least :data:`PRECISION_ERROR` (else the largest error's), the
    largest, the top five as ``[name, error]``, and ``upstream``: the two modules that ran just before the first
    (nearest first, its own parents left out), where a value whose lost low bits only show downstream may have been
    made (an offset that rounds away the signal and cancels later has a small error of its own).
    """
    ran = [k for k in order if k in errors]
    if not ran:
        return {"first": None, "first_error": None, "largest": None, "largest_error": None, "top": [], "upstream": []}
    largest = max(ran, key=lambda k: errors[k])
    first = next((k for k in ran if errors[k] >= PRECISION_ERROR), largest)
    before = [k for k in ran[:ran.index(first)] if not first.startswith(k + ".")]
    return {"first": first, "first_error": errors[first], "largest": largest, "largest_error": errors[largest],
            "top": [[k, errors[k]] for k in sorted(ran, key=lambda k: -errors[k])[:5]], "upstream": before[-2:][::-1]}


def jumps(spike: dict[str, float], ordinary: dict[str, float], top: int = 3) -> list[list[Any]]:
    """The ``top`` names whose figure on the spike's window is the most times its figure on an ordinary window:
    ``[[name, factor, spike value, ordinary value], ...]`` (factor >= 1 only)."""
    rows = []
    for name, value in spike.items():
        base = ordinary.get(name)
        if base is None or not (base > 0) or not math.isfinite(value):
            continue
        rows.append([name, value / base, value, base])
    rows.sort(key=lambda r: -r[1])
    return [r for r in rows[:top] if r[1] >= 1.0]


#: How a sample search's note begins when the window's largest losses carry most of it yet dropping the most it may name
#: (:func:`max_outliers`) leaves no normal step: more samples are bad than a "few" (the diagnosis says so, not "no set").
MOSTLY_CARRIED = "without samples "


def max_outliers(n: int) -> int:
    """How many of a window's ``n`` samples a data spike's set may hold: a quarter of them, at least 3 (3 of 8 bad
    labels were never named under a bar of 2) but never more than half (more is no "few"), 16 at most. The samples
    above a gap of x10 or more may be more, up to half the window (``spike_samples``: 5 relabelled of 16, x345 apart)."""
    return max(1, min(max(3, min(16, n // 4)), n // 2))


def outlier_sets(rows: list[dict[str, Any]], normal: Callable[[float], bool]) -> Iterator[list[int]]:
    """The sets of a window's samples worth dropping to make its step normal, fewest first.

    ``rows``: one per sample, ``{"sample", "loss_sum", "count"}`` (a sample's loss as a sum over its items, as the
    step sums them). Yields the samples with a non-finite loss, with the k largest losses after them (k = 0, 1, ...,
    at most :func:`max_outliers`; never splitting a tie), each set whose rest's mean loss ``normal`` accepts; nothing when
    no such set leaves a sample. A caller verifies a set by replaying the step without it.
    """
    bad = [r for r in rows if not math.isfinite(r["loss_sum"])]
    good = sorted((r for r in rows if math.isfinite(r["loss_sum"])), key=lambda r: -r["loss_sum"])
    limit = max_outliers(len(rows))
    for k in range(0 if bad else 1, min(limit, len(good) - 1) + 1):
        if k and math.isclose(good[k - 1]["loss_sum"], good[k]["loss_sum"], rel_tol=1e-6):
            continue  # a set that leaves out a sample as high as its last names clean samples by a tie's order
        rest = good[k:]
        count = sum(r["count"] for r in rest)
        if count and normal(sum(r["loss_sum"] for r in rest) / count):
            yield [r["sample"] for r in bad + good[:k]]


def lr_change(then: Any, now: Any) -> dict[str, float] | None:
    """The learning rate in two optimizer ``state_dict``s: ``{"then", "now"}`` of the param group whose LR rose the most
    (by ratio), or None where either holds none (a sharded entry, no optimizer)."""
    a, b = _group_lrs(then), _group_lrs(now)
    if a is None or b is None or len(a) != len(b):
        return None
    pairs = [(x, y) for x, y in zip(a, b) if x > 0 and y > 0]
    if not pairs:
        return None
    x, y = max(pairs, key=lambda p: p[1] / p[0])  # the largest rise (a fall in one group must not hide it)
    return {"then": x, "now": y}


def lr_groups(state: Any) -> dict[str, Any] | None:
    """What :func:`lr_change` reads of an optimizer ``state_dict``, alone (a bundle's older state keeps only this)."""
    lrs = _group_lrs(state)
    return None if lrs is None else {"param_groups": [{"lr": lr} for lr in lrs]}


def _group_lrs(state: Any) -> list[float] | None:
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) and "lr" in g for g in groups):
        return None
    try:
        return [float(g["lr"]) for g in groups]
    except (TypeError, ValueError, RuntimeError):
        return None
