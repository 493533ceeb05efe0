"""Say what kind of failure a diagnosed step is, with its evidence: op, data, overflow, divergence, not reproducible.

:func:`classify_failure` reads a diagnosis (:func:`stabletrain.diagnostics.diagnosis.run_diagnosis`'s
record) and, when there is one, the run's own per-interval metrics before the incident
(``metrics.jsonl`` rows): what the remedies (:mod:`stabletrain.diagnostics.candidates`) are chosen by.

- ``not reproducible``: the replay's figures differ from what the run observed (or the replays
  disagree with each other) — suspect hardware or nondeterminism, and nothing else.
- ``divergence``: the loss, grad norm or update norm grew geometrically over the intervals before
  the incident (:func:`growth`), or the values stayed finite and only a reduction overflowed (every
  gradient finite, their total norm Inf), or the optimizer step itself made the parameters
  non-finite. It comes before ``op``: an Inf born at a matmul or a square of huge finite values is
  the divergence's symptom, not the op's fault.
- ``data``: the batch itself holds NaN/Inf, or specific samples make it go bad with no op to blame.
- ``overflow``: a finite value that does not fit the low-precision dtype (float16/bfloat16) an op
  computed in, in a named module. When most samples overflow through that module, it is the
  module's weights, not "bad samples".
- ``op``: a non-finite value born at one op from finite inputs (sqrt/log/div/pow at a bad point, a
  masked -inf), in fp32 or at a NaN.

Pure: no replay, no state.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..console import some_of
from .nonfinite import DOMAIN_OPS

__all__ = ["FAILURE_CLASSES", "broken_before", "classify_failure", "growth", "WEIGHT_DRIVEN_SHARE", "NOT_REPRODUCED_HINT"]

FAILURE_CLASSES = ("op", "data", "overflow", "divergence", "not reproducible")
#: What a replay that differs from the run points at (it restores the model, the optimizer, the window and the RNG).
NOT_REPRODUCED_HINT = ("suspect state the replay does not restore (a loss or a data pipeline with its own state), "
                       "nondeterministic kernels or a hardware fault")

#: A module through which at least this share of the window's samples go bad is blamed, not the samples.
WEIGHT_DRIVEN_SHARE = 0.75
#: Growth over the intervals before an incident counts as divergence from this total factor, over at least
#: ``MIN_GROWTH_ROWS`` rows each larger than the last.
MIN_GROWTH_FACTOR = 10.0
MIN_GROWTH_ROWS = 3
_LOW_PRECISION = ("torch.float16", "torch.bfloat16", "float16", "bfloat16")
#: An op whose domain a parameter can leave (the input of a log or a root; a divisor), by its aten name and that input.
_DOMAIN_INPUT = ((re.compile(rf"aten\.({'|'.join(DOMAIN_OPS)}|log1p|reciprocal)_?\."), 0), (re.compile(r"aten\.div_?\."), 1))


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def growth(history: list[dict[str, Any]], before_step: int) -> dict[str, Any] | None:
    """The steepest geometric growth of ``loss`` / ``grad_norm`` / ``update_norm`` ending just before ``before_step``.

    ``history``: per-interval metrics rows (``step`` and the keys). For each key, the trailing streak of
    rows (step < ``before_step``... up to and including the incident's own row when its value is finite)
    each larger than the last; returns ``{"metric", "factor_per_step", "since_step", "until_step", "from",
    "to", "total_factor"}`` for the streak with the largest total factor, when it is at least
    :data:`MIN_GROWTH_FACTOR` over :data:`MIN_GROWTH_ROWS` rows; else None.
    """
    rows = sorted((r for r in history if isinstance(r.get("step"), int) and r["step"] <= before_step),
                  key=lambda r: r["step"])
    best = None
    for key in ("loss", "grad_norm", "update_norm"):
        # A row whose interval ends in non-finite steps (a divergence's: the rows after it are non-finite, or it is the
        # last) holds the mean of the finite steps before them: its value is dated to the last of those, not to the
        # interval's end (it made a x361 growth read as x34). Non-finite steps the run recovered from date nothing. The
        # update norm is the interval's last step's own (NaN where that step was not finite): dated to its row's step.
        # (the loss's own count of finite steps where the row has it: a step whose grad norm overflowed may still have a
        # finite loss, which its mean holds: a x7.65e5 growth read 'by step 16' of a mean up to step 20)
        series = [(r["step"] - (_unmeasured(r, key) if key != "update_norm" and (
            i + 1 == len(rows) or not _finite(rows[i + 1].get(key))) else 0), r[key],
            _mean_of_steps(r, key, r["step"] - (rows[i - 1]["step"] if i else 0)))
            for i, r in enumerate(rows) if _finite(r.get(key)) and r[key] > 0]
        if len(series) < MIN_GROWTH_ROWS:
            continue
        end = len(series) - 1
        start = end
        while start > 0 and series[start - 1][1] < series[start][1]:
            start -= 1
        if end - start + 1 < MIN_GROWTH_ROWS:
            continue
        (s0, v0, _), (s1, v1, mean) = series[start], series[end]
        total = v1 / v0
        if total < MIN_GROWTH_FACTOR or s1 <= s0:
            continue
        found = {"metric": key, "factor_per_step": total ** (1.0 / (s1 - s0)), "since_step": s0, "until_step": s1,
                 "from": v0, "to": v1, "total_factor": total, "to_is_mean": mean}
        if best is None or total > best["total_factor"]:
            best = found
    return best


def _mean_of_steps(row: dict[str, Any], key: str, span: int) -> bool:
    """Whether a history row's ``key`` is the mean of more than one step: a logged interval's (``loss_min`` marks one;
    ``span``: its steps, from the row before) with more than one finite step in it (the loss's ``loss_steps`` where the
    row has it). The update norm is its interval's last step's own; a capture's step row (no ``loss_min``), its own."""
    if key == "update_norm" or "loss_min" not in row:
        return False
    counted = row.get("loss_steps") if key == "loss" else None
    return (counted if isinstance(counted, (int, float)) else span - int(row.get("num_nonfinite") or 0)) > 1


def _unmeasured(row: dict[str, Any], key: str) -> int:
    """How many of a row's last steps its mean of ``key`` leaves out: the steps without a finite loss (``interval_steps``
    less ``loss_steps``) for the loss where the row says, else its non-finite steps."""
    if key == "loss" and isinstance(row.get("loss_steps"), (int, float)) and isinstance(row.get("interval_steps"), (int, float)):
        return max(int(row["interval_steps"]) - int(row["loss_steps"]), 0)
    return int(row.get("num_nonfinite") or 0)


def classify_failure(d: dict[str, Any], history: list[dict[str, Any]] | None = None,
                     step: int | None = None) -> dict[str, Any]:
    """Return ``{"failure_class", "evidence", "growth", "blamed_module"}`` for diagnosis ``d``.

    ``history``: the run's metrics rows before the incident at ``step`` (None: the divergence is judged
    from the step alone). ``evidence`` is one sentence for a person; ``growth`` the streak that made it a
    divergence (None otherwise); ``blamed_module`` the module an overflow or a weight-driven fault is in.
    """
    first = d.get("first_op") or {}
    grew = growth(history, step) if history and step is not None else None
    out: dict[str, Any] = {"growth": grew, "blamed_module": None}
    num, samples = d.get("num_samples") or 0, d.get("bad_samples") or []
    norm, loss = d.get("grad_norm"), d.get("loss")
    norm_bad = not _finite(norm)

    if not d.get("reproduces"):
        if not d.get("replays_agree", True):
            why = "the replays disagree with each other (nondeterministic kernels or a hardware fault)"
        elif all(k in (d.get("observed") or {}) for k in ("loss", "grad_norm")):
            why = (f"the replay's loss {loss} and grad norm {norm} differ from the observed "
                   f"{_observed(d, 'loss')} and {_observed(d, 'grad_norm')}: {NOT_REPRODUCED_HINT}")
        else:  # (a host that records one of them: the other named as not recorded, not spliced in as a value)
            seen = [f"{name} {d['observed'][k]}" for name, k in (("loss", "loss"), ("grad norm", "grad_norm"))
                    if k in (d.get("observed") or {})]
            why = (f"the replay's loss {loss} and grad norm {norm} differ from the observed {' and '.join(seen)}"
                   if seen else f"the replay's loss {loss} and grad norm {norm} are finite; the run recorded neither")
            why += f": {NOT_REPRODUCED_HINT}"
        return {**out, "failure_class": "not reproducible", "evidence": why}
    if d.get("stage") == "inputs":
        where = f"samples {', '.join(map(str, samples))}" if samples else "the batch"
        return {**out, "failure_class": "data", "evidence": f"non-finite inputs in {where}"}
    # A float16 op that overflows from finite inputs is the precision's, however the values grew before it (float32 holds
    # them: a trial's growing activations were "divergence" at step 29, "overflow" at 59, and no precision cure tried)
    fp16 = bool(first.get("origin")) and first.get("kind") == "inf" and "torch.float16" in (first.get("output_dtypes") or [])
    if grew is not None and not fp16 and (not first or first.get("kind") == "inf" or d.get("stage") in ("update", "none")):
        return {**out, "failure_class": "divergence", "evidence": _growth_text(grew)
                + (f"; then {_symptom(d, first)}" if _symptom(d, first) else "")}
    if d.get("stage") == "update" or (d.get("stage") == "none" and norm_bad):
        return {**out, "failure_class": "divergence", "evidence": _symptom(d, first)}
    module = first.get("module")
    weight_driven = num > 1 and len(samples) >= WEIGHT_DRIVEN_SHARE * num
    # Outside any module (the loss, a scale applied to the model's output) there are no weights to blame: the
    # computation itself is, whatever the samples.
    share = f"{len(samples)} of {num} samples go bad through it: " + (
        "the computation outside any module, not the samples" if module is None else
        "the module's own computation (it holds no weights), not the samples" if d.get("module_params") == 0 else
        "the module's weights or its own computation, not the samples")
    if first and first.get("origin") and first.get("kind") == "inf" and any(
            t in _LOW_PRECISION for t in first.get("output_dtypes") or []):
        out["blamed_module"] = module
        dtype = next(t for t in first["output_dtypes"] if t in _LOW_PRECISION).removeprefix("torch.")
        limit = 65504 if dtype == "float16" else 3.4e38
        text = (f"{first['op']} {_place(module, 'in')} computes in {dtype} from finite inputs and overflows it "
                f"(max {limit:g})")
        span = max((abs(float(x)) for x in first.get("input_range") or [] if isinstance(x, (int, float))), default=0.0)
        shapes = first.get("input_shapes") or [[]]  # (a record from before param_inputs: a batch-shaped input)
        of_input = 0 not in first["param_inputs"] if "param_inputs" in first else shapes[0][:1] == [num]
        if "_to_copy" in str(first.get("op")) and dtype == "float16" and span > limit and of_input:  # autocast's input cast
            return {**out, "failure_class": "overflow", "weight_driven": False, "evidence": (
                f"{first['op']} {_place(module, 'in')} casts its input to {dtype}, whose values (up to {span:.3g}) are past "
                f"its range (max {limit:g}) in {len(samples) or 'some'} of {num} samples: the input's scale (the data, what "
                "the layers before it make, or what this module computes before the cast: a division or rsqrt of a value "
                "near 0, tiny inputs whose square underflowed), not the module's weights; keep it in range (the data's "
                "scale, a larger epsilon, that computation in fp32 past the cast), or use bf16")}
        return {**out, "failure_class": "overflow", "evidence": text + (f"; {share}" if weight_driven else "") + (
            f"; before it the run's {_growth_text(grew)}" if grew is not None else ""), "weight_driven": weight_driven}
    if first and first.get("origin"):
        out["blamed_module"], out["weight_driven"] = (module if weight_driven else None), weight_driven
        node = f" ({first['autograd_node']})" if first.get("autograd_node") else ""
        article = "an" if str(first["kind"])[:1] in "aeiou" else "a"  # (an inf, a nan)
        text = (f"{first['op']}{node} in {first['direction']} {_place(module, 'of')} makes {article} {first['kind']} "
                "from finite inputs")
        param = _domain_param(first)
        if param is not None:  # (a log, a root or a divisor reads a weight itself)
            out["param_input"] = param
            return {**out, "failure_class": "op", "evidence": text + (
                f": its input is the parameter {param} itself, which an update moved out of the op's "
                "domain (a learned scale or variance below 0): a state the updates made, not the samples; keep it inside "
                "by construction (softplus, exp of a log-parameter)")}
        if weight_driven:
            text += f"; {share}"
        elif samples:
            text += f", at sample{'s' if len(samples) > 1 else ''} {', '.join(map(str, samples))}"
        return {**out, "failure_class": "op", "evidence": text}
    if samples and not weight_driven:
        return {**out, "failure_class": "data", "evidence": f"samples {', '.join(map(str, samples))} alone make the step "
                                                            "non-finite, with no op creating the value from finite inputs"}
    return {**out, "failure_class": "op" if first else "divergence",
            "evidence": _symptom(d, first) or f"first non-finite value at stage {d.get('stage')}"}


def _domain_param(first: dict[str, Any]) -> str | None:
    """The parameter a forward log, root or division takes as the input whose domain it left (a learned variance an
    update moved below 0), else None: a Linear's addmm takes its bias too, and an overflow there is no such thing."""
    if first.get("direction") != "forward" or not first.get("param_names"):
        return None
    at = next((i for pattern, i in _DOMAIN_INPUT if pattern.match(str(first.get("op")))), None)
    if at is None and re.match(r"aten\.pow_?\.Tensor_Scalar", str(first.get("op"))) and "nan" in str(first.get("kind")):
        at = 0  # (var ** 0.5 of a var below 0: a NaN; an inf from pow may be an overflow, no domain left)
    inputs = first.get("param_inputs") or []
    return first["param_names"][inputs.index(at)] if at in inputs and len(first["param_names"]) == len(inputs) else None


def _observed(d: dict[str, Any], key: str) -> Any:
    return (d.get("observed") or {}).get(key, "(not recorded)")


def _symptom(d: dict[str, Any], first: dict[str, Any]) -> str:
    """What the step itself shows of a divergence."""
    if d.get("stage") == "update":
        names = d.get("nonfinite_params_after_update") or []
        return f"the optimizer step makes {', '.join(names[:3])} non-finite from finite gradients"
    if d.get("stage") == "none" and not _finite(d.get("grad_norm")):
        return (f"every gradient is finite but their total norm is {d.get('grad_norm')} (the sum of squares "
                "overflows float32: the gradients are huge)")
    if first:
        return f"{first.get('kind')} at {first.get('op')} {_place(first.get('module'), 'in')}"
    return ""


def _place(module: str | None, preposition: str) -> str:
    """Where an op ran: 'outside any module' (None, never "module 'None'"), the root module ('') or a named one."""
    if module is None:
        return "outside any module"
    return f"{preposition} the root module" if module == "" else f"{preposition} module '{module}'"


def _growth_text(g: dict[str, Any]) -> str:
    # (the end a logged interval's mean, where the capture had no step of its own past it: a trial read a later
    # incident's '3.53e+15 by step 62', the mean of steps 61-62, beside the first one's step 62 loss of 7.06e+15)
    until = g["until_step"]
    mean = f", the mean of its interval's steps to step {until}" if g.get("to_is_mean") else f" by step {until}"
    return (f"{g['metric']} grew x{g['factor_per_step']:.3g} per step since step {g['since_step']} "
            f"({g['from']:.3g} -> {g['to']:.3g}{mean}, x{g['total_factor']:.3g})")


def broken_before(broken: list[str], step: int, summary: str | None) -> str:
    """The summary of a step whose parameters were non-finite before it (``broken``, by name), its replay's ``summary``
    after: at the run's first step the model came so (no update had been applied: a trial's GPT-2 with an inf row was
    told 'the optimizer step makes it non-finite (learning rate too high?)'); later, an update applied before it broke
    them (on_nonfinite='warn'), or something outside the optimizer's steps did (an adapter's config records 'warn' as
    'skip': the words name both)."""
    names = some_of(broken)
    if step <= 1:
        return (f"the parameters were non-finite before the first step ({names}): the model came so, no update had been "
                "applied (its init, weights it loaded, an edit before training); the replay's own reading, on those "
                "weights, is in the evidence")
    return (f"the parameters were non-finite before this step ({names}): an update applied before it broke them "
            "(on_nonfinite='warn' applies a bad step's update: the run's first incident says which), or a change outside "
            f"the optimizer's steps did (an in-place edit, a load_state_dict, a weight swap); what follows is this step's "
            f"replay on them: {summary}")
