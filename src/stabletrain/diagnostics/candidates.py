"""Which cures (:mod:`stabletrain.diagnostics.cures`) fit an incident: by its failure class, and for a loss spike by the
class its counterfactual replays found (:mod:`stabletrain.diagnostics.spike`). Pure: reads a diagnosis."""

from __future__ import annotations

import re
from typing import Any

import torch

from .cures import (
    AdamEps,
    EpsGuard,
    LowerLR,
    ModuleFP32,
    Precision,
    Remedy,
    RollbackLR,
    Scaler,
    SkipSamples,
    SkipStep,
    TighterClip,
    UpdateClip,
    guarded_op,
)
from .nonfinite import DOMAIN_OPS

__all__ = ["candidates_for", "why_not_offered"]


def _user_line(diagnosis: dict[str, Any]) -> str:
    """file:line of the innermost user frame behind the first bad op (its forward stack, else the anomaly trace)."""
    for text in ((diagnosis.get("first_op") or {}).get("stack"), diagnosis.get("anomaly_trace")):
        found = re.findall(r'File "([^"]+)", line (\d+)', str(text or ""))
        if found:
            return f"{found[-1][0]}:{found[-1][1]}"
    return ""


def candidates_for(diagnosis: dict[str, Any], precision: str, history: list[dict[str, Any]],
                   rollback_steps: list[int], clip: float | None = None) -> list[Remedy]:
    """The candidates that fit ``diagnosis``'s failure class, the skip-step baseline first (alone when not reproducible).

    A lower LR (x0.5, x0.1) is tried for every class: it is the usual first guess, and its verdict says
    whether the class needs it. ``rollback_steps``: the steps of the checkpoints the run kept before the
    incident (a rollback goes to the newest one at or before the growth's start, else the oldest). ``clip``: the
    run's own ``clip.max_norm``: a tighter clip is below it (half of it at most; one from the grad norms alone was
    looser than a host's gradient_clip_val=1.0: 4.14).
    """
    cls = diagnosis.get("failure_class")
    precision = diagnosis.get("precision") or precision  # the mode the run trained in (the config's may read auto)
    samples = tuple(diagnosis.get("bad_samples") or ())
    module = diagnosis.get("blamed_module") or diagnosis.get("module")
    out: list[Remedy] = [SkipStep()]
    if cls == "not reproducible":  # the replay shows nothing to cure: the baseline's verdict says whether a skip does
        return out
    if diagnosis.get("anomaly") == "spike":
        return out + _spike_candidates(diagnosis, precision, history, rollback_steps, clip)
    # (a diagnosis.json from before "weight_driven" was kept: its evidence says "N of M samples go bad through it")
    weight_driven = diagnosis.get("weight_driven", "samples go bad through it" in str(diagnosis.get("evidence", "")))
    # Most of the window going bad through one computation (outside any module too: no module to blame) is not the
    # samples': dropping them all is no cure to offer
    if (cls == "data" or cls == "op" and not weight_driven) and samples and not diagnosis.get("blamed_module") and not (
            diagnosis.get("param_input")):
        out.append(SkipSamples(samples, positions=_positions(diagnosis)))
    if cls == "op" and module is not None:
        op = guarded_op(diagnosis.get("op"), diagnosis.get("autograd_node"))
        if op is not None and not _out_of_domain(op, diagnosis):
            out.append(EpsGuard(module, op, 1e-12 if op != "div" else 1e-6, _user_line(diagnosis)))
    if cls == "overflow" and samples and not weight_driven:  # pinned to a few samples (one scaled
        # x400): dropping them, as for data (not where most of the window overflows through the module: its weights')
        out.append(SkipSamples(samples, positions=_positions(diagnosis)))
    if cls == "overflow" and module:
        out.append(ModuleFP32(module))
    if cls == "overflow" and precision == "fp16":  # run-wide: they need no module (one outside any module, a loss x1e6)
        out += [Precision("bf16"), Scaler()]
    out += [LowerLR(0.5), LowerLR(0.1)]
    before = [t for t in rollback_steps if t < int(diagnosis.get("step") or 0)]
    # A parameter the updates moved out of the op's domain, or most samples going bad through the op (a state the updates
    # made: one SGD step at too high an LR sent every output below a log's 0): back before them, slower
    if cls == "op" and (diagnosis.get("param_input") or weight_driven) and before:
        out += [RollbackLR(0.5, step=max(before)), RollbackLR(0.1, step=max(before))]
    if cls == "divergence":
        grew = diagnosis.get("growth") or {}
        since = grew.get("since_step")
        if rollback_steps:
            before = [s for s in rollback_steps if since is None or s <= since]
            at = max(before) if before else min(rollback_steps)
            out += [RollbackLR(0.5, step=at), RollbackLR(0.1, step=at)]
        healthy = [r for r in history if isinstance(r.get("grad_norm"), (int, float)) and r["grad_norm"] == r["grad_norm"]
                   and (since is None or r.get("step", 0) <= since)]
        if healthy:
            out.append(TighterClip(_tighter(float(healthy[-1]["grad_norm"]), clip)))
    return out


#: An input below -this x its largest magnitude is out of a root's domain, not a rounding below 0 (a variance as
#: E[x^2] - E[x]^2 cancels to -1e-3 of itself in float32 where the mean is large); a log's input, rarely made by such a
#: cancellation, is out below -2 eps of its dtype (at least :data:`LOG_OUT_OF_DOMAIN`) x its largest magnitude.
OUT_OF_DOMAIN = 1e-3
LOG_OUT_OF_DOMAIN = 1e-6


def _out_of_domain(op: str, diagnosis: dict[str, Any]) -> bool:
    """Whether the op (a log or a root) made a NaN in its forward of finite inputs clearly below 0: a bad value (a -0.5
    in the data), which an eps guard would hide as log(1e-12) = -27.6; a variance rounded to -1e-7 is no such value (the
    guard is its cure). Unknown input range (a record from before it was kept): not said to be out."""
    first = diagnosis.get("first_op") or {}
    low, big = (first.get("input_range") or (None, None))[:2]
    dtypes = first.get("input_dtypes") or ["float32"]
    try:  # a rounding's size: its dtype's (an input of noise alone, +-1e-7 in float32, is no bad value either)
        eps = torch.finfo(getattr(torch, str(dtypes[0]))).eps
    except (AttributeError, TypeError):
        eps = torch.finfo(torch.float32).eps
    return (op in DOMAIN_OPS and diagnosis.get("direction") == "forward"
            and "nan" in str(diagnosis.get("kind")) and not first.get("nonfinite_inputs")
            and isinstance(low, (int, float))
            and low < -(max(OUT_OF_DOMAIN, eps) if "sqrt" in op else max(LOG_OUT_OF_DOMAIN, 2 * eps)) * float(big or 0.0)
            and float(big or 0.0) > 10 * eps)


def _tighter(limit: float, clip: float | None) -> float:
    """A clip threshold from the grad norms (``limit``), no looser than half the run's own ``clip`` where it has one."""
    return min(limit, 0.5 * clip) if clip else limit


def _positions(diagnosis: dict[str, Any]) -> bool:
    """Whether the diagnosis names samples by their place in the step's batch (an adapter's), not by dataset index."""
    return diagnosis.get("sample_unit", "dataset index") != "dataset index"


def _spike_candidates(diagnosis: dict[str, Any], precision: str, history: list[dict[str, Any]],
                      rollback_steps: list[int], clip: float | None = None) -> list[Remedy]:
    """A finite spike's candidates by its class (:mod:`stabletrain.diagnostics.spike`), after the skip-step baseline.

    ``precision``: the run's mode; a ``precision`` spike (the same step normal in fp32) gets the run-wide modes above
    it too (fp16: bf16, fp32; bf16: fp32), the module named or not: the module first departing need not be the one
    whose rounding carries the spike."""
    cls, out = diagnosis.get("failure_class"), []
    if cls == "data" and diagnosis.get("bad_samples"):
        out.append(SkipSamples(tuple(diagnosis["bad_samples"]), positions=_positions(diagnosis)))
    if cls == "precision" and diagnosis.get("blamed_module"):  # the module named, the first departing and the two
        where = diagnosis.get("where") or {}  # before it, each once
        for module in dict.fromkeys([diagnosis["blamed_module"], *filter(None, [where.get("first")]),
                                     *(where.get("upstream") or [])]):
            out.append(ModuleFP32(module))
    if cls == "precision":
        out += [Precision(mode) for mode in {"fp16": ("bf16", "fp32"), "bf16": ("fp32",)}.get(precision, ())]
    layer = diagnosis.get("blamed_layer")
    if cls == "optimizer-state" and layer:
        # The smaller of the layer's update on ordinary windows under this state (which the surging second moment may
        # have inflated too: an update clip sized from it alone held nothing) and its usual one before the spike's interval.
        rows = [r for r in diagnosis.get("surges") or [] if r.get("name") == layer]
        ordinary = {r[0]: r[3] for r in (diagnosis.get("jumps") or {}).get("update_ratio") or []}
        now = ordinary.get(layer) or next((r["ordinary_ratio"] for r in rows if r.get("ordinary_ratio")), None)
        typical = min(filter(None, [now, next((r["typical_ratio"] for r in rows if r.get("typical_ratio")), None)]),
                      default=None)
        if typical:
            out.append(UpdateClip(layer, 2.0 * typical))
        root = next((r.get("typical_sqrt_v") for r in rows), None)
        out.append(AdamEps(layer, float(root) if root else 1e-4))
    if cls != "precision":  # (its fp32 step is normal: a lower LR only moves the weights off the rounding's edge, by chance;
        out += [LowerLR(0.5), LowerLR(0.1)]  # a trial's bf16 spike 'cured' by lr-x0.1, made x5.7 worse by lr-x0.5)
    if cls in ("state", "optimizer-state"):
        # Back to a checkpoint before what a lower LR from the step before cannot undo: the surging update (its state
        # before it), or the step before the spike (a lower LR from there is a candidate of its own).
        step = diagnosis.get("step", 0)
        surge = min((r["step"] for r in diagnosis.get("surges") or [] if r.get("name") == layer
                     and isinstance(r.get("step"), int) and r["step"] < step), default=None)
        limit = surge if cls == "optimizer-state" and surge is not None else step - 1
        before = [s for s in rollback_steps if s < limit]
        if before:
            out += [RollbackLR(0.5, step=max(before)), RollbackLR(0.1, step=max(before))]
        norms = [r["grad_norm"] for r in history if isinstance(r.get("grad_norm"), (int, float))
                 and r["grad_norm"] == r["grad_norm"]]
        if norms:
            out.append(TighterClip(_tighter(float(sorted(norms)[len(norms) // 2]), clip)))
    return out


def why_not_offered(name: str, diagnosis: dict[str, Any]) -> str | None:
    """Why candidate ``name`` is not among an incident's (a reason a person can act on), where one is known; else None."""
    if name == "eps-guard" and diagnosis.get("failure_class") == "op":
        op = guarded_op(diagnosis.get("op"), diagnosis.get("autograd_node"))
        if op is not None and _out_of_domain(op, diagnosis):
            low = ((diagnosis.get("first_op") or {}).get("input_range") or [None])[0]
            return (f"eps-guard: the {op}'s input is out of its domain (as low as {low:.3g}), not a value rounded near 0: a "
                    "guard would only turn the NaN into a huge loss; the value itself is the bug")
        if op is None:
            return f"eps-guard: {diagnosis.get('op')} is no op a guard can keep in its domain (a log, a root, a division)"
    if name == "skip-samples" and diagnosis.get("failure_class") == "op" and diagnosis.get("weight_driven"):
        return ("skip-samples: most of the window's samples go bad through the op (the model's computation at this state, "
                "not a few samples): dropping them all is no cure; a rollback with a lower LR is offered instead")
    if name in ("lr-x0.5", "lr-x0.1") and diagnosis.get("failure_class") == "precision":
        return (f"{name}: the same step is normal in fp32, so the rounding, not the updates, makes the spike: a lower LR "
                "could only move the weights off the rounding's edge, by chance (a module or the run in fp32 is offered)")
    return None
