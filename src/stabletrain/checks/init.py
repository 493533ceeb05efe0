"""``stabletrain check init``: does the signal survive the model's depth at step 0, forward and backward?

Runs :func:`stabletrain.diagnostics.signal_propagation.signal_report` on the task's model as built, on one batch of
``train.batch_size`` samples; with ``--compare normal,xavier,kaiming`` also on copies of that model
re-initialized by :func:`stabletrain.tasks.init_schemes.init_` with each scheme, traced on the same batch (so an
activation the forward calls as a function, ``torch.relu``, sets the gain as a module would). Writes the per-layer
std plot (``init_signal.png``) and the full per-layer numbers (``init_signal.json``) to ``--out DIR`` (default:
``stabletrain-check/``; see :meth:`CheckContext.output_path`). Passes when no layer of the model as built is flagged.
With ``--compare``, the scheme recommended (the text, ``recommended`` in the numbers and in ``init_signal.json``) is
one that passed here: the one for the activations seen if it passed, else the first compared that did.

A zero-initialized output layer, or a zero-initialized last layer of a residual branch (GPT/DiT/ReZero-style), is
taken as deliberate (:func:`stabletrain.diagnostics.initialization.zero_init_layers`): it is said so, and the
layers around it are judged without it, on a copy whose zero weights are at 1e-3 x a fan-in init (about their
first update: the forward is as built, and the gradient reaches the layers before them), those layers' own rows
neither judged nor anyone's reference. As built, such a layer reads "forward vanishing (0x)" and the layers
before it "backward vanishing (0x)": what a zero layer does at step 0, not a fault. A zero layer nothing gets
around (the middle of a plain chain) is judged as built, and said so.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..data import fixed_batch
from ..diagnostics.initialization import (
    OUTPUT_LAYER,
    ZERO_INIT_SCALE,
    InitFingerprint,
    ZeroInitLayer,
    architectures,
    excluding,
    zero_init_layers,
    zero_layers_small,
)
from ..diagnostics.signal_display import format_comparison, format_report, plot_signal
from ..diagnostics.signal_propagation import EXPLODING, SignalReport, signal_report
from ..numerics import buffers_kept
from ..policies.accumulation import as_sum_count
from ..policies.optim import optimizer_factory
from ..records.batches import batch_size
from ..seeding import seed_everything
from ..tasks.init_schemes import SCHEMES, init_
from . import CheckContext, CheckResult, register

__all__ = ["check_init", "compare_schemes", "uninformed_loss", "uniform_classes", "LOSS_AT_INIT_LIMIT"]

AS_BUILT = "as built"
#: A classifier's first loss this many times a uniform guess's (its logits set to 0: ln C) fails the check: the output
#: starts confidently wrong (Karpathy's "verify the loss at init"). Healthy heads start within ~1.1x (the mlp 1.02x,
#: the gpt 0.99x; init_(model, 'kaiming') on a ReLU MLP of ten classes 1.6x, its head at gain 1); a head tied to an
#: embedding of std 1 reaches 2.2x (tanh features) to 16x.
LOSS_AT_INIT_LIMIT = 2.0


def compare_schemes(option: object) -> list[str]:
    """The init schemes ``--compare`` names (a comma-separated string or a list); an unknown one is a ValueError."""
    if option is None:
        return []
    names = [s.strip() for s in option.split(",")] if isinstance(option, str) else [str(s).strip() for s in option]
    names = [n for n in names if n]
    bad = [n for n in names if n not in SCHEMES]
    if bad:
        raise ValueError(f"--compare: unknown init scheme {bad[0]!r} in {option!r}; known: {', '.join(SCHEMES)}")
    return names


def _where(report: SignalReport, direction: str) -> str:
    first = report.first_forward if direction == "forward" else report.first_backward
    if first is None:
        return "ok"
    ratio = first.forward_ratio if direction == "forward" else first.backward_ratio
    verdict = first.forward if direction == "forward" else first.backward
    return f"{verdict} at #{first.index} {first.name} ({'-' if ratio is None else f'{ratio:.3g}x'})"


def _compare_advice(built: SignalReport, by_scheme: dict[str, SignalReport]) -> tuple[str, str]:
    """Return (the scheme a comparison recommends, its advice line): never a scheme that failed this same test.

    The scheme is the one for the activations seen (``built.recommended``) when it passes here, else the first
    compared scheme that passes; None where no compared scheme passes (a trial: the numbers said kaiming beside 'fails
    here too'), and, for a model that passes as built, ``built.recommended`` unless it failed here.
    """
    seen = ", ".join(f"{n} x{c}" for n, c in built.activations.items()) or "no activation module or function"
    passing = [s for s, r in by_scheme.items() if r.passed]
    failing = [s for s, r in by_scheme.items() if not r.passed]
    suggested = built.recommended
    failed_note = f"; init_(model, {suggested!r}), the scheme for these activations, fails here too" \
        if suggested in failing else ""
    if built.passed:  # (the scheme for these activations is named only where it did not fail here)
        return None if failed_note else suggested, f"init holds as built: keep it (saw {seen}){failed_note}"
    if suggested in passing:
        return suggested, f"recommended init: init_(model, {suggested!r}) (it passes here; saw {seen})"
    if passing:
        return passing[0], (f"recommended init: init_(model, {passing[0]!r}), the first scheme that passes here "
                            f"(saw {seen}){failed_note}")
    untried = "" if suggested in by_scheme else f"; init_(model, {suggested!r}) was not compared (--compare {suggested})"
    if not built.activations and "kaiming" not in by_scheme:  # kaiming assumes ReLU where none is seen
        untried += "; init_(model, 'kaiming') (ReLU assumed) was not compared (--compare kaiming)"
    return None, (f"no init scheme compared passes ({', '.join(f'init_(model, {s!r})' for s in failing)} fail "
                       f"too): none is recommended; look at the first flagged layer above, the init alone does not fix "
                       f"it{untried}")


def uninformed_loss(model: nn.Module, batch: Any, loss: Any, autocast: Any = None) -> tuple[float, float, int] | None:
    """(the loss with the model's output set to 0, the output's std as built, its last dim), or None where the loss does
    not call the model once for one floating-point tensor (an HF ``ModelOutput``, a tuple; a loss that calls submodules),
    or the probe's forward fails (a probe, not the check: the check's own forward says what fails).

    A zero output is the uninformed guess: a uniform distribution for a classifier's logits (the loss is ln C), 0 for a
    regression. One forward without grad (under ``autocast``, a context manager: the run's precision); the model's
    buffers (BatchNorm's running statistics) are put back.
    """
    seen: list[tuple[float, int] | None] = []

    def zero(module: nn.Module, args: Any, out: Any) -> Any:
        if isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel() > 1:
            seen.append((float(out.detach().float().std()), out.shape[-1] if out.dim() else 1))
            return torch.zeros_like(out)
        seen.append(None)
        return None

    handle = model.register_forward_hook(zero)
    try:
        with torch.no_grad(), buffers_kept(model), autocast if autocast is not None else contextlib.nullcontext():
            total, count = as_sum_count(loss(model, batch), 1)
            value = float(total / count)
    except Exception:  # noqa: BLE001  (the probe is an aside: no bar rather than a check that crashed)
        return None
    finally:
        handle.remove()
    if len(seen) != 1 or seen[0] is None or not math.isfinite(value):
        return None
    return value, *seen[0]


def uniform_classes(zero: float, classes: int) -> int | None:
    """C where an uninformed output's loss ``zero`` (:func:`uninformed_loss`, its output's last dim ``classes``) is a
    uniform guess's over C classes, ln C (or ln 2: a binary or multi-label one on logits); else None (a regression)."""
    return next((c for c in (classes, 2) if c > 1 and math.isclose(zero, math.log(c), rel_tol=1e-3)), None)


def _summed(zero: float, classes: int, items: Sequence[int]) -> tuple[int, int] | None:
    """(n, C) where an uninformed output's loss ``zero`` is n x ln C for n one of ``items`` (the batch's samples, its
    targets' elements): a cross-entropy summed over them, not averaged (a regression's loss is no such exact multiple)."""
    for c in (classes, 2):
        for n in items:
            if c > 1 and n > 1 and math.isclose(zero, n * math.log(c), rel_tol=1e-4):
                return n, c
    return None


#: A model input whose std at step 0 is beyond this factor of 1 (either way) brings a scale no layer's init corrects.
INPUT_SCALE = 100.0


def _loss_at_init(first: float, probe: tuple[float, float, int] | None, exploding: str | None = None,
                  input_std: float | None = None, items: Sequence[int] = ()) -> tuple[dict[str, float], str | None, bool]:
    """(the numbers, the line, whether it fails) of the first loss against an uninformed output's (no probe: why not).
    ``exploding``: where the forward explodes before the output (the output's scale is then its input's, not its own);
    ``input_std``: the first layer's input's std (beyond :data:`INPUT_SCALE` of 1: the data's scale is the fix);
    ``items``: the counts a loss summed instead of averaged would be ln C times (:func:`_summed`).

    Judged only where the uninformed loss is a uniform guess's, ln C over the output's last dim of C classes (a
    cross-entropy on logits) or ln 2 (a binary or multi-label one on logits): a regression's scale is its targets'.
    """
    if probe is None:
        return {}, ("the loss at init is not verified: the loss does not call the model once for one floating-point "
                    "tensor (its output is a tuple or an HF ModelOutput, or the loss calls its submodules)"), False
    zero, std, classes = probe
    numbers = {"first_loss": first, "uninformed_loss": zero, "output_std": std}
    uniform = uniform_classes(zero, classes)
    ratio = f"{first / zero:.3g}x" if zero > 0 else "vs"
    head = f"the first loss {first:.4g} is {ratio} an uninformed output's {zero:.4g} (the model's output set to 0"
    if uniform is None and (summed := _summed(zero, classes, items)) is not None:
        n, c = summed
        return numbers, (f"{head}; not judged: {n} x ln {c}, a cross-entropy summed over {n} items instead of averaged; "
                         "the check judges a mean)"), False
    if uniform is None:
        return numbers, f"{head}; not judged: not a uniform guess's ln C, the loss is not a cross-entropy on logits)", False
    head += f": a uniform guess over {uniform} classes, ln {uniform})"
    if not math.isfinite(first):
        return numbers, f"{head}: the first loss is non-finite (a NaN/Inf in the forward or the loss at init)", True
    if first < LOSS_AT_INIT_LIMIT * zero:
        return numbers, f"{head}: ok, the output (std {std:.3g}) starts near an uninformed guess", False
    if input_std is not None and math.isfinite(input_std) and not 1 / INPUT_SCALE <= input_std <= INPUT_SCALE:
        return numbers, (f"{head}: the output starts confidently wrong, its std {std:.3g} at step 0, and the model's input "
                         f"has std {input_std:.3g} (the first layer's): standardize the inputs (or scale them to std ~1) "
                         "first; no layer's init corrects a scale the data brings"), True
    if exploding is not None:  # (scaling the head down leaves the layers before it exploding)
        return numbers, (f"{head}: the output starts confidently wrong, its std {std:.3g} at step 0, because the forward "
                         f"explodes before it ({exploding}): fix the init of the layers before it (the verdicts above), not the "
                         "output layer alone"), True
    return numbers, (f"{head}: the output starts confidently wrong, its std {std:.3g} at step 0. Scale the output layer's "
                     "init down (std ~0.02, or zero-init it); a head tied to an embedding of std 1 gives logits of std "
                     "~sqrt(width): init the embedding at std ~0.02"), True


def _names(zero: list[ZeroInitLayer], limit: int = 3) -> str:
    return ", ".join(z.name for z in zero[:limit]) + (f" and {len(zero) - limit} more" if len(zero) > limit else "")


def _excluded(deliberate: list[ZeroInitLayer]) -> str:
    """Return the summary's note on the deliberate zero layers the verdict was judged without ('' when none)."""
    if not deliberate:
        return ""
    out = [z for z in deliberate if z.role == OUTPUT_LAYER]
    ends = [z for z in deliberate if z.role != OUTPUT_LAYER]
    parts = ([f"the output layer {_names(out)}"] if out else []) + (
        [f"the last layer of {len(ends)} residual branch(es): {_names(ends)}"] if ends else [])
    return f" (zero-initialized on purpose, judged without {'; '.join(parts)})"


def _zero_notes(zero: list[ZeroInitLayer], built: SignalReport) -> list[str]:
    """Return the lines on the zero-initialized layers: deliberate (and how they are judged) or not, and what they do."""
    lines = []
    out = [z for z in zero if z.role == OUTPUT_LAYER]
    ends = [z for z in zero if z.deliberate and z.role != OUTPUT_LAYER]
    if out:
        lines.append(f"{_names(out)}: zero-initialized output layer ({', '.join(z.param for z in out[:3])} all 0), taken as "
                     "deliberate (GPT/DiT-style zero-init head): at step 0 the output is 0 and no gradient reaches the "
                     "layers before it; they get one from the first update on")
    if ends:
        stream = sorted(z.around for z in ends if z.around is not None)
        lines.append(f"{_names(ends)}: zero-initialized last layer of {len(ends)} residual branch(es) (weight all 0; the "
                     f"signal goes around it: the next layer's input std is {stream[0]:.3g}"
                     f"{f'..{stream[-1]:.3g}' if stream[-1] != stream[0] else ''}), taken as deliberate "
                     "(GPT/DiT/ReZero-style): a branch adds 0 at step 0 and its layers get a gradient from the first "
                     "update on")
    for z in zero:
        if not z.deliberate:
            lines.append(f"{z.name}: {z.param} is all 0 and nothing gets around it (neither the output layer nor the last "
                         "layer of a residual branch): the layers after it get no input signal and those before it no "
                         "gradient at step 0; zero-init only an output layer or a residual branch's last layer")
    if out or ends:
        lines.append(f"judged without them: measured with the zero weights at {ZERO_INIT_SCALE:g} x a fan-in init (about "
                     "their first update: the forward is as built and the gradient reaches the layers before them); "
                     "their own rows are neither judged nor any layer's reference (no ratio). As built (weight 0): "
                     f"{len(built.flagged)} of {len(built.layers)} layers flagged: forward {_where(built, 'forward')}, "
                     f"backward {_where(built, 'backward')}")
    return lines


@register("init", order=50)
def check_init(ctx: CheckContext) -> CheckResult:
    """Report per-layer signal propagation at step 0 (and per init scheme with ``compare``); pass if nothing is flagged."""
    schemes = compare_schemes(ctx.options.get("compare"))
    task = ctx.make_task()
    device = ctx.device
    _, batch = fixed_batch(task, ctx.cfg.train.batch_size, device)

    base = task.model.to(device)
    own = getattr(task, "optimizer", None)  # the run's optimizer, at its peak lr, for the update ratios
    try:
        before = InitFingerprint.take(base)
    except (ValueError, RuntimeError):  # a lazy module's parameters have no values before its first forward
        before = None
    reports = [signal_report(base, batch, task.loss, label=AS_BUILT,
                             make_optimizer=optimizer_factory(base, ctx.cfg.optim, device, own))]
    # The measuring forward and backward change no parameter: one that did was re-drawn by the model's own forward (a
    # lazy init on the first call). What was measured is that init, and no scheme applied before it survives it. An
    # embedding's max_norm renormalizes its rows in the forward by design: not counted.
    renormed = {f"{m}.weight".lstrip(".") for m, mod in base.named_modules()
                if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.max_norm is not None}
    overwritten = [c for c in before.compare(base) if c.name not in renormed] if before is not None else []
    zero = zero_init_layers(base, reports[0])
    deliberate = [z for z in zero if z.deliberate]
    if deliberate:  # judged without them: on a copy where their weight is small, not 0
        probe = zero_layers_small(base, deliberate, seed=ctx.cfg.seed)
        measured = signal_report(probe, batch, task.loss, label=AS_BUILT,
                                 make_optimizer=optimizer_factory(probe, ctx.cfg.optim, device, own))
        del probe
        reports.append(excluding(measured, deliberate, label=f"{AS_BUILT}, zero-init layers excluded", as_built=reports[0]))
    judged = reports[-1]

    gains: dict[str, dict[str, float]] = {}  # scheme -> the activations its layers read -> their gain

    def reinitialized(scheme: str) -> SignalReport:
        """The report of a copy of the model re-initialized with ``scheme``, traced on the same batch."""
        model = copy.deepcopy(base)  # keeps tied weights tied
        seed_everything(ctx.cfg.seed)
        decisions = init_(model, scheme, trace=lambda m: task.loss(m, batch))  # reads activations called as functions too
        gains[scheme] = {d.activation or "linear": d.gain for d in decisions if d.gain is not None}
        return signal_report(model, batch, task.loss, label=f"init_({scheme!r})",
                             make_optimizer=optimizer_factory(model, ctx.cfg.optim, device, own))

    by_scheme: dict[str, SignalReport] = {}
    for scheme in schemes:
        by_scheme[scheme] = reinitialized(scheme)
        reports.append(by_scheme[scheme])

    built = judged  # the model as built: without its deliberate zero layers, if it has any
    architecture = None  # a flag that the recommended scheme leaves as it is: the architecture's (a BN ResNet's backward)
    if not built.passed and not deliberate:
        # (not compared: measured now, on a copy re-initialized as the advice would have it)
        architecture = architectures(built, by_scheme.get(built.recommended) or reinitialized(built.recommended))
    first = built.first_forward
    exploding = _where(built, "forward") if first is not None and first.forward == EXPLODING else None
    head = built.layers[0] if built.layers else None  # (an embedding's input is token ids: no scale of the data's)
    input_std = (head.in_std if head is not None and head.role != "embedding" and not head.is_norm and not head.call
                 else None)  # (a norm first: the data's scale is normalized already)
    targets = batch[-1] if isinstance(batch, (tuple, list)) and batch and isinstance(batch[-1], torch.Tensor) else None
    items = sorted({batch_size(batch), *([targets.numel()] if targets is not None else [])})
    loss_numbers, loss_line, loss_fails = _loss_at_init(reports[0].loss, uninformed_loss(base, batch, task.loss), exploding,
                                                        input_std, items)
    # With a comparison, the scheme it recommends (one that passed here) is what the JSON, numbers and text all name.
    recommended, advice = _compare_advice(built, by_scheme) if schemes else (built.recommended, "")
    # No scheme where the forward draws again, or where the flag is the architecture's (the JSON says it too)
    recommended = None if overwritten or architecture is not None else recommended
    plot = plot_signal(reports, ctx.output_path("init_signal.png"))
    data = ctx.output_path("init_signal.json")
    data.write_text(json.dumps([{**r.to_dict(), "recommended": recommended} for r in reports], indent=1, default=str))

    numbers: dict[str, object] = {"layers": len(built.layers), "flagged": len(built.flagged),
                                  "forward": _where(built, "forward"), "backward": _where(built, "backward"), **loss_numbers}
    if zero:
        numbers["zero_init"] = [f"{z.name} ({z.role or 'nothing gets around it'})" for z in zero]
    excluded = _excluded(deliberate)
    notes = _zero_notes(zero, reports[0])
    if schemes:
        for r in by_scheme.values():
            numbers[f"{r.label}.flagged"] = len(r.flagged)
        details = [*notes, *format_comparison([built, *by_scheme.values()])]
        passing = [r.label for r in by_scheme.values() if r.passed]
        gained = {a: g for a, g in gains.get("xavier", {}).items() if not math.isclose(g, 1.0)}
        if gained:  # (lab 1's Xavier is gain 1: it shrinks a ReLU stack this one holds)
            way = "shrinks" if all(g > 1 for g in gained.values()) else "grows" if all(g < 1 for g in gained.values()) \
                else "changes"
            details.append("init_('xavier') takes each layer's gain from the activation after it ("
                           + ", ".join(f"{a} {g:.3g}" for a, g in gained.items()) + f"): Xavier with gain 1, the "
                           f"textbook's, {way} the signal by that factor per layer (stabletrain lab 1)")
        details.append(advice)
        summary = (f"as built: {'ok' if built.passed else f'{len(built.flagged)} layer(s) flagged'}{excluded}; "
                   f"schemes without a flagged layer: {', '.join(passing) or 'none'}")
    else:
        details = [*notes, *format_report(built)]
        summary = ("no layer flagged: the signal holds forward and backward" if built.passed else
                   f"{len(built.flagged)} of {len(built.layers)} layers flagged: forward {numbers['forward']}, "
                   f"backward {numbers['backward']}") + excluded
    if architecture is not None:  # no init advice: the architecture's (passes, with a warning)
        details = [d for d in details if not d.startswith("recommended init:")] + [architecture]
        whose = "the frozen weights'" if "are frozen" in architecture else "the architecture's"
        summary = f"no init's fault: {architecture.split(' whatever the init')[0]} whatever the init ({whose})"
        numbers["architecture"] = architecture
    if loss_line is not None:  # (before a comparison's advice, which stays the last line)
        details.insert(len(details) - 1 if schemes else len(details), loss_line)
    if overwritten:  # (the scheme advice would change nothing: the forward draws again)
        text = InitFingerprint.describe(overwritten)
        details = [d for d in details if not d.startswith("recommended init:")] + [
            f"init overwritten in the model's first forward: {text}; the layers above were measured with the weights it "
            "left, and no init applied before the forward survives it: remove the re-initialization (a lazy init on the "
            "first call) or the in-place change of the weights from the forward, then compare schemes"]
        summary = f"the model's first forward changed {len(overwritten)} parameter(s); " + summary
        numbers["init_overwritten"] = [c.as_dict() for c in overwritten]
    if loss_fails:
        summary += (f"; and so {loss_line.split(' (the model')[0]}" if exploding is not None
                    else f"; but {loss_line.split(' (the model')[0]}: the output starts confidently wrong")
    numbers.update({"recommended": recommended, "plot": str(plot), "json": str(data)})
    return CheckResult("init", (built.passed or architecture is not None) and not loss_fails and not overwritten, summary,
                       numbers=numbers,
                       details=details, warning=architecture is not None)
