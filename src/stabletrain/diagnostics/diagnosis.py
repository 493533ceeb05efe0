"""Diagnose one bad optimizer step from its replays: where the first non-finite value came from.

:func:`run_diagnosis` drives a *replayer* (an object that resets the model and RNG to the step's
start, runs the step's forward/backward and, optionally, its update — :class:`stabletrain.incident_replay`
builds one from the run's own :class:`~stabletrain.step.TrainStep`) under
:class:`~stabletrain.diagnostics.nonfinite.NonFiniteLocator`, and answers, in a JSON-safe dict:

- the stage where the first non-finite value appeared: inputs -> activations -> loss -> gradients
  -> update (or ``"none"``);
- the first non-finite op (aten name), forward or backward, the module that ran it, and whether it
  created the value (origin) or was handed one (propagation);
- the first parameter whose gradient is non-finite, or the parameters an optimizer step makes
  non-finite;
- the dataset indices of the samples that trigger it (bisection over the batch);
- the forward stack behind it (a replay under ``torch.autograd.detect_anomaly``);
- whether it reproduces: the same stage, op and module and bitwise-equal losses on every replay
  (a numerical problem in the model or data), or not (suspect hardware or nondeterminism), as
  Megatron-LM's rerun state machine tells the two apart.

Every replay starts from the same model state and RNG state, and the model, its gradients, its
train/eval mode and the RNG are restored when it returns. Replay only: it syncs after every op.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..console import some_of
from ..numerics import first_nonfinite_grad
from .anomaly import anomaly_trace
from .bisection import Bisection, SubsetJudge, bisect_samples
from .failure_class import WEIGHT_DRIVEN_SHARE, classify_failure
from .nonfinite import NonFiniteLocator, NonFiniteOp

__all__ = ["STAGES", "DIAGNOSIS_FIELDS", "run_diagnosis", "matches_observed", "repeat_key", "repeat_summary"]

#: The diagnosis fields an ``incident`` event carries (the whole diagnosis is in ``diagnosis.json``).
DIAGNOSIS_FIELDS = ("summary", "failure_class", "evidence", "stage", "op", "direction", "module", "origin",
                    "first_nonfinite_param", "bad_samples", "burst_samples", "reproduces", "rank")

STAGES = ("inputs", "activations", "loss", "gradients", "update", "none")


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _same_float(a: float, b: float) -> bool:
    """Bitwise equality of two floats, any NaN equal to any NaN."""
    return (math.isnan(a) and math.isnan(b)) or float(a).hex() == float(b).hex()


def _leading_rows(batch: Any, n: int) -> list[Tensor]:
    """The floating tensors of ``batch`` whose first dimension is the sample dimension (size ``n``)."""
    leaves = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]
    out = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            if leaf.is_floating_point() and leaf.dim() > 0 and leaf.shape[0] == n:
                out.append(leaf)
        elif isinstance(leaf, (dict, list, tuple)):
            out.extend(_leading_rows(leaf, n))
    return out


def _floating_leaves(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch] if batch.is_floating_point() else []
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _floating_leaves(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _floating_leaves(v)]
    return []


def _bad_inputs(micro_batches: list[tuple[list[int], Any]]) -> tuple[bool, list[int]]:
    """Return (some input is non-finite, the dataset indices of the samples whose rows hold it)."""
    any_bad, samples = False, []
    for indices, batch in micro_batches:
        if not any(not bool(torch.isfinite(t).all()) for t in _floating_leaves(batch)):
            continue
        any_bad = True
        for t in _leading_rows(batch, len(indices)):
            rows = (~torch.isfinite(t)).reshape(len(indices), -1).any(1)
            samples.extend(indices[i] for i in rows.nonzero().flatten().tolist())
    return any_bad, sorted(set(samples))


def _stage(inputs_bad: bool, first: NonFiniteOp | None, loss: float, grad_name: str | None,
           after_update: list[str]) -> str:
    if inputs_bad:
        return "inputs"
    if first is not None:
        if first.direction == "backward":
            return "gradients"
        return "loss" if first.module is None else "activations"
    if not math.isfinite(loss):
        return "loss"
    if grad_name is not None:
        return "gradients"
    return "update" if after_update else "none"


def run_diagnosis(rep: Any, micro_batches: list[tuple[list[int], Any]],
                  num_replays: int, dataset: Any, collate: Callable[[list[Any]], Any] | None,
                  observed: dict[str, Any] | None, bisect: bool, anomaly: bool,
                  history: list[dict[str, Any]] | None = None, step: int | None = None) -> dict[str, Any]:
    """Replay ``num_replays`` times under the locator, bisect the samples, replay under anomaly mode; return the record.

    ``rep``: a replayer with ``model``, ``precision``, ``step_factory`` (None: no update stage),
    ``reset()``, ``forward_backward(groups, stop_at_nonfinite_loss=False, *, forward_only=False, loss_scale=None)
    -> (loss sums, mean loss)``, ``grad_norm()``, ``update() -> (names of parameters made non-finite, grad norm)``
    and ``judging_scale`` (the fp16 loss scale subsets judged on their gradients replay at; None: the run's) (see
    :mod:`stabletrain.incident_replay`). The keys are those :func:`stabletrain.incident_replay.diagnose_step` documents.

    ``observed``: what the run saw of the step (``loss``, ``grad_norm``; either may be missing): the
    replay reproduces when its figures equal them (:func:`matches_observed`), whatever the locator
    found. ``history``, ``step``: the run's metrics rows and the step's number, for the failure class's
    divergence test (:func:`~stabletrain.diagnostics.failure_class.classify_failure`).

    What it costs, in forward/backward passes: ``num_replays`` under the locator (the first one
    follows the value to its origin and records the stack; the others, which only check that it
    reproduces, stop at the first non-finite op), one update where everything stayed finite, the
    bisection's subsets (the whole window is the first replay, unless fp16 judges subsets at another loss
    scale; where the window's loss is non-finite a subset runs its forwards only, elsewhere a subset whose
    loss is already non-finite skips its backward) and one anomaly-mode pass; ``timings`` and ``passes`` in the
    record say how much each took.
    """
    start = time.perf_counter()
    passes = {"replays": 0, "updates": 0, "bisection": 0, "bisection_forward_only": 0, "anomaly": 0}
    inputs_bad, input_samples = _bad_inputs(micro_batches)
    replays = []
    first_rec = origin_rec = None
    judging = getattr(rep, "judging_scale", None)
    scaled: dict[str, float] = {}  # the loss scale the replays run at: the run's ({}) or the judging scale
    r = 0
    while r < num_replays:
        rep.reset()
        with NonFiniteLocator(rep.model, capture_stack=r == 0, first_only=r > 0) as loc:
            sums, loss = rep.forward_backward(micro_batches, **scaled)
        passes["replays"] += 1
        if (r == 0 and not scaled and judging is not None and loc.first is not None
                and loc.first.direction == "backward" and _bad_at(rep, micro_batches, judging, passes)):
            # fp16: the first non-finite value is in a backward scaled by more than the judging scale, and the window
            # is bad at that scale too: the scaled overflow came first (the GradScaler's routine), the step's own
            # failure later. The replays run at the judging scale, where the first non-finite value is that failure.
            scaled = {"loss_scale": judging}
            continue
        grad_name = first_nonfinite_grad(rep.model)
        after_update: list[str] = []
        grad_norm = rep.grad_norm()
        if rep.step_factory is not None and grad_name is None and loc.first is None and math.isfinite(loss):
            after_update, _ = rep.update()  # the loop steps only on finite grads
            passes["updates"] += 1
        first = loc.first
        if r == 0:
            first_rec, origin_rec = loc.first, loc.first_origin
        replays.append({
            "stage": _stage(inputs_bad, first, loss, grad_name, after_update),
            "op": first.op if first else None, "direction": first.direction if first else None,
            "module": first.module if first else None, "loss": _json_float(loss), "loss_hex": float(loss).hex(),
            "micro_batch_loss_sums": [_json_float(s) for s in sums], "grad_norm": _json_float(grad_norm),
            "first_nonfinite_param": grad_name, "nonfinite_params_after_update": after_update,
            "_sums": sums,
        })
        r += 1
    head = replays[0]
    stage = head["stage"]
    keys = ("stage", "op", "direction", "module", "first_nonfinite_param", "nonfinite_params_after_update")
    same = all(all(r[k] == head[k] for k in keys) and len(r["_sums"]) == len(head["_sums"])
               and all(_same_float(a, b) for a, b in zip(r["_sums"], head["_sums"])) for r in replays[1:])
    observed = {k: v for k, v in (observed or {}).items() if k in ("loss", "grad_norm") and v is not None}
    matches = matches_observed(float.fromhex(head["loss_hex"]), float(head["grad_norm"]), observed, rep.precision.mode)
    # Reproduced: the replays agree, match what the run saw, and show a bad value (a non-finite value
    # somewhere, or only in the grad norm: a reduction that overflows from finite gradients).
    shows_bad = stage != "none" or not math.isfinite(float(head["grad_norm"])) or not math.isfinite(float(head["loss"]))
    reproduces = same and shows_bad and (matches if observed else True)
    for r in replays:
        del r["_sums"]
    replays_s = time.perf_counter() - start

    # Which samples: bisection over the window (rows holding a non-finite input are also read directly).
    bisection: Bisection | None = None
    bad_samples: list[int] | None = input_samples if stage == "inputs" and input_samples else None
    judge: SubsetJudge | None = None
    if bisect and stage in ("inputs", "activations", "loss", "gradients"):
        # A subset is bad for the failure the whole window showed: a non-finite loss (judged on the forwards alone),
        # else a non-finite gradient (a plain finiteness check, without the op-by-op locator), else any non-finite
        # value the locator sees. The whole window is not asked again where it ran as the subsets do: it was the
        # first replay (bad: it reached the loss or the gradients, or the locator saw a non-finite value at all).
        loss_bad = not math.isfinite(float(replays[0]["loss"]))
        reaches = loss_bad or replays[0]["first_nonfinite_param"] is not None
        scale = None if loss_bad else judging
        judge = SubsetJudge(rep, micro_batches, dataset, collate, "loss" if loss_bad else "gradients" if reaches
                             else "precise", scale, passes)
        known = loss_bad or scale == scaled.get("loss_scale")  # a loss is the same at any scale
        bisection = bisect_samples(judge, [i for indices, _ in micro_batches for i in indices],
                                   whole_bad=reaches or first_rec is not None if known else None)
        bisection.unjudged, bad_samples = judge.unrunnable, bisection.samples
        if not bad_samples and stage == "inputs" and input_samples:  # no op reads them (guard.check_inputs flagged them)
            bad_samples = input_samples
    bisection_s = time.perf_counter() - start - replays_s

    trace = None
    if anomaly and stage in ("inputs", "activations", "loss", "gradients"):
        rep.reset()
        # Where the replays agree on a first op in forward, the first replay's record (and stack) is the anomaly
        # pass's own: that pass then only runs anomaly mode, for the backward function it reports.
        trace = anomaly_trace(lambda: rep.forward_backward(micro_batches, **scaled), rep.model,
                              located=first_rec if same else None)
        passes["anomaly"] += 1
    anomaly_s = time.perf_counter() - start - replays_s - bisection_s

    # Masked out of its module's output in forward, as the locator read it: never where the loss itself is non-finite
    # (the bad value reached it; a module output whose tensors the locator could not read is left unknown, None).
    masked = origin_rec.masked_in_forward if origin_rec else None
    if masked and not math.isfinite(float(head["loss"])):
        masked = None
    out: dict[str, Any] = {
        "stage": stage,
        "op": first_rec.op if first_rec else None,
        "direction": first_rec.direction if first_rec else None,
        "module": first_rec.module if first_rec else None,
        "module_params": _num_params(rep.model, first_rec.module if first_rec else None),  # (0: no weights to blame)
        "origin": first_rec.origin if first_rec else None,
        "kind": first_rec.kind if first_rec else None,
        "autograd_node": first_rec.autograd_node if first_rec else None,
        # A forward origin masked out of its module's output (torch.where): where it turns non-finite in backward.
        "masked_in_forward": masked,
        "backward_node": origin_rec.backward_op.autograd_node if masked and origin_rec.backward_op else None,
        "backward_op": origin_rec.backward_op.op if masked and origin_rec.backward_op else None,
        "first_op": first_rec.to_dict() if first_rec else None,
        "first_origin_op": origin_rec.to_dict() if origin_rec and origin_rec is not first_rec else None,
        "first_nonfinite_param": head["first_nonfinite_param"],
        "nonfinite_params_after_update": head["nonfinite_params_after_update"],
        "update_checked": rep.step_factory is not None,
        "bad_samples": bad_samples,
        "bad_input_samples": input_samples,
        "bad_sample_groups": bisection.combinations if bisection else [],
        "bisection": ({"evaluations": bisection.num_evals, "whole_batch_bad": bisection.whole_bad,
                       "exhausted": bisection.exhausted, "summary": bisection.summary(), "judged_on": judge.mode,
                       "loss_scale": judge.loss_scale, **_companion_record(judge, bisection)}
                      if bisection and judge else None),
        "anomaly_trace": trace,
        "reproduces": reproduces,
        "replays_agree": same,
        "matches_observed_loss": (_same_float(float.fromhex(head["loss_hex"]), float(observed["loss"]))
                                  if "loss" in observed else None),
        "matches_observed": matches if observed else None,
        "observed": {k: _json_float(float(v)) for k, v in observed.items()},
        "replays": replays,
        "loss": head["loss"],
        "grad_norm": head["grad_norm"],
        "precision": rep.precision.mode,
        "replay_loss_scale": scaled.get("loss_scale"),  # fp16: the replays' scale where it is not the run's
        "num_micro_batches": len(micro_batches),
        "num_samples": sum(len(i) for i, _ in micro_batches),
        "timings": {"replays_s": replays_s, "bisection_s": bisection_s, "anomaly_s": anomaly_s,
                    "total_s": time.perf_counter() - start},
        "passes": passes,
    }
    out.update(classify_failure(out, history, step))
    out["summary"] = _summary(out, bisection)
    return out


#: Relative tolerance of a replayed figure against the observed one, by precision (fp32: the loss bitwise).
#: "host": an adapter's fp32 step, whose loss the host computed (its own op order, a division by a tensor count).
OBSERVED_RTOL = {"fp32": 0.0, "bf16": 1e-2, "fp16": 1e-2, "host": 1e-4}
GRAD_NORM_RTOL_FP32 = 1e-4  # the replay may accumulate a window's gradients in another order


def _num_params(model: Any, name: str | None) -> int | None:
    """The parameters of module ``name`` of ``model``, its children's too (None: no such module, or none named)."""
    try:
        return None if name is None else sum(p.numel() for p in model.get_submodule(name).parameters())
    except (AttributeError, TypeError):  # (a name the locator gave that the model does not resolve)
        return None


def matches_observed(loss: float, grad_norm: float, observed: dict[str, Any], precision: str) -> bool:
    """Whether a replay's loss and grad norm are what the run observed: the same ones non-finite, the finite ones equal.

    Equal: the loss bitwise in fp32 (any NaN equal to any NaN), else within :data:`OBSERVED_RTOL`; the grad
    norm within ``max(OBSERVED_RTOL, GRAD_NORM_RTOL_FP32)``. A figure the run did not record is not compared.
    """
    rtol = OBSERVED_RTOL.get(precision, 1e-2)
    for key, value, tol in (("loss", loss, rtol), ("grad_norm", grad_norm, max(rtol, GRAD_NORM_RTOL_FP32))):
        if key not in observed:
            continue
        seen = float(observed[key])
        if math.isfinite(seen) != math.isfinite(value):
            return False
        if not math.isfinite(seen):
            continue
        if key == "loss" and tol == 0.0:
            if not _same_float(seen, value):
                return False
        elif abs(seen - value) > tol * max(abs(seen), abs(value)):
            return False
    return True


def _bad_at(rep: Any, micro_batches: list[tuple[list[int], Any]], loss_scale: float, passes: dict[str, int]) -> bool:
    """Whether the window's loss or a gradient is non-finite at ``loss_scale`` (one plain replay, counted as one)."""
    rep.reset()
    _, loss = rep.forward_backward(micro_batches, loss_scale=loss_scale)
    passes["replays"] += 1
    return not math.isfinite(loss) or first_nonfinite_grad(rep.model) is not None


def _companion_record(judge: SubsetJudge, bisection: Bisection) -> dict[str, Any]:
    """What the bisection record says of subsets the model could not run alone (see :class:`SubsetJudge`)."""
    if judge.error is None:
        return {}
    return {"cannot_run_alone": judge.error, "unrunnable_subsets": len(judge.unrunnable),
            "judged_with": {str(i): judge.companions[(i,)] for i in bisection.samples if (i,) in judge.companions}}


def _alone_reason(error: str) -> str:
    """Why a subset cannot run, for the summary (the record keeps the error)."""
    if "more than 1 value per channel" in error:
        return "BatchNorm in training mode needs more than one value per channel"
    return error


def repeat_key(d: dict[str, Any]) -> tuple[Any, ...] | None:
    """What two non-finite diagnoses that found the same failure share (its class, stage, op, direction, module), or None
    where there is nothing to compare (a spike's, one that did not reproduce, one with no op located)."""
    if d.get("anomaly") == "spike" or not d.get("reproduces") or not d.get("op"):
        return None
    samples, num = d.get("bad_samples") or [], d.get("num_samples") or 0  # (the weights' or a few samples': two causes)
    weights = bool(d.get("blamed_module") and num > 1 and len(samples) >= WEIGHT_DRIVEN_SHARE * num)
    return (*(d.get(k) for k in ("failure_class", "stage", "op", "direction", "module", "origin", "kind",
                                 "masked_in_forward", "weight_driven")), bool(d.get("param_input")), weights)


def repeat_summary(d: dict[str, Any], first: int) -> str:
    """The console's words for a diagnosis that found what the one of step ``first`` did (:func:`repeat_key`): that
    step named, where, and this step's samples (a run's fp16 overflow captured each interval said all of it each time)."""
    module = d.get("module")
    where = f"{d['op']} in {d['direction']} " + ("outside any module" if module is None else "of the root module"
                                                 if module == "" else f"of module '{module}'")
    samples = d.get("bad_samples") or (d.get("bad_input_samples") if d.get("stage") == "inputs" else None) or []
    named = (f", at sample{'s' * (len(samples) > 1)} {', '.join(map(str, samples[:4]))}{', ...' if len(samples) > 4 else ''}"
             if samples and d["failure_class"] != "divergence" and not repeat_key(d)[-1] else "")  # (the weights': not theirs)
    return f"{d['failure_class']}: as at step {first} ({where}){named}; reproduces on replay"


def _summary(d: dict[str, Any], bisection: Bisection | None) -> str:
    """One sentence for a person: what went non-finite first, where, for which samples, and whether it reproduces.

    A fault in a module's weights (most samples go bad through it) leads with that verdict; its samples are
    evidence, not the headline. A divergence names no samples (every window goes bad once the weights are huge).
    """
    samples, num = d.get("bad_samples") or [], d.get("num_samples") or 0
    if d.get("blamed_module") and num > 1 and len(samples) >= WEIGHT_DRIVEN_SHARE * num:
        return f"{d['failure_class']}: {d['evidence']}; {_where(d, bisection, samples=False, evidence=False)}"
    return f"{d['failure_class']}: {_where(d, bisection, samples=d['failure_class'] != 'divergence')}"


def _where(d: dict[str, Any], bisection: Bisection | None, *, samples: bool = True, evidence: bool = True) -> str:
    """The summary after its failure class: where the first bad value came from, and whether it reproduces.

    ``samples``: name the samples the bisection found; ``evidence``: end with the class's evidence.
    """
    stage, record = d["stage"], d.get("bisection") or {}
    if stage == "none" and d["failure_class"] == "divergence":
        return f"{d['evidence']}; reproduces on replay"
    if stage == "none":
        return ("no non-finite value on replay: the step did not reproduce (suspect a hardware fault or "
                "nondeterminism; compare the recorded loss and rerun on another device)")
    module = ""
    if d["op"] is not None:
        where = d["direction"]
        node = f" ({d['autograd_node']})" if d["autograd_node"] else ""
        module = ("outside any module" if d["module"] is None else
                  "of the root module" if d["module"] == "" else f"of module '{d['module']}'")
        how = "origin: inputs finite" if d["origin"] else "propagated from a non-finite input"
        text = f"first non-finite value ({stage}): {d['op']} in {where}{node} {module} ({how})"
        if d.get("masked_in_forward"):
            value = {"inf": "inf", "nan": "NaN"}.get(d["kind"] or "", "non-finite value")
            # (masked, or saturated: a trial's log(0) through a Linear into tanh, -1 there, read as 'masked' with
            # torch.where advice for a model without a mask)
            text += (f"; this {value} was made finite again in forward (masked, clamped or saturated) before the output "
                     f"{module}")
            if d.get("backward_node") or d.get("backward_op"):
                text += (f" and became NaN only in backward, at {d['backward_op']} in {d['backward_node']} (the gradient "
                         "still flows back to the op through what made it finite, 0 x inf: keep the op's input finite, "
                         "e.g. log2(torch.where(mask, x, 1)) where it is masked, log(x.clamp_min(eps)) where it saturates)")
    elif stage == "update":
        text = (f"first non-finite value (update): forward and backward stay finite, the optimizer step makes "
                f"{some_of(d['nonfinite_params_after_update'])} non-finite (learning rate too high?)")
    else:
        text = f"first non-finite value ({stage})"
        if d["first_nonfinite_param"]:
            text += f": gradient of {d['first_nonfinite_param']}"
    if stage == "inputs":
        samples = d["bad_samples"] or d["bad_input_samples"]
        text = "first non-finite value (inputs): the batch itself holds NaN/Inf" + (
            f" at sample{'s' if len(samples) > 1 else ''} {', '.join(map(str, samples))}" if samples else "")
        if d["op"] is not None:
            text += f", first used by {d['op']} in {d['direction']} {module}"
    elif d["bad_samples"] and len(d["bad_samples"]) == d["num_samples"] > 1 and d["failure_class"] != "divergence":
        scale = "casts its input to" in str(d.get("evidence"))  # (every sample's values past the dtype's range: the data's)
        text += f", at every sample of the step ({d['num_samples']})" + ("" if scale else ": not the data")
    elif not samples:
        pass
    elif d["bad_samples"]:
        text += f", at sample{'s' if len(d['bad_samples']) > 1 else ''} {', '.join(map(str, d['bad_samples']))}"
        paired = record.get("judged_with") or {}
        if paired:
            text += (" (judged with a sample of its micro-batch found good: " + "; ".join(
                f"{i} with {', '.join(map(str, c))}" for i, c in paired.items())
                + f"; one sample alone cannot be replayed: {_alone_reason(record['cannot_run_alone'])})")
    elif bisection is not None and bisection.combinations and bisection.unjudged:
        text += (f", smallest set found: samples {', '.join(map(str, bisection.combinations[0]))} (a smaller one cannot "
                 f"be replayed: {_alone_reason(record['cannot_run_alone'])})")
    elif bisection is not None and bisection.combinations:
        text += f", only in combination: samples {', '.join(map(str, bisection.combinations[0]))} (no single sample is bad)"
    elif bisection is not None and bisection.whole_bad:
        text += ", no single sample to blame"
    if evidence and (d["failure_class"] in ("divergence", "overflow")
                     or (d["failure_class"] == "op" and (d.get("blamed_module") or d.get("param_input")))):
        text += f" ({d['evidence']})"
    if d["reproduces"]:
        text += "; reproduces on replay"
    elif not d["replays_agree"]:
        text += "; replays disagree (nondeterministic: suspect hardware or nondeterministic kernels)"
    else:
        text += "; replays agree but differ from the recorded loss (suspect hardware or nondeterminism in the run)"
    return text
