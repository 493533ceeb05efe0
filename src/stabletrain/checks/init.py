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

import copy
import json
import math

from ..data import fixed_batch
from ..diagnostics.initialization import (
    OUTPUT_LAYER,
    ZERO_INIT_SCALE,
    InitFingerprint,
    ZeroInitLayer,
    architectures,
    excluding,
    fails_too,
    zero_init_layers,
    zero_layers_small,
)
from ..diagnostics.loss_at_init import flagged_at, judge_loss_at_init, uninformed_loss
from ..diagnostics.signal_display import format_comparison, format_report, plot_signal
from ..diagnostics.signal_propagation import EXPLODING, SignalReport, signal_report
from ..policies.optim import optimizer_factory
from ..seeding import seed_everything
from ..tasks.init_schemes import SCHEMES, init_
from . import CheckContext, CheckResult, register

__all__ = ["check_init", "compare_schemes"]

AS_BUILT = "as built"


def compare_schemes(option: object) -> list[str]:
    """The init schemes ``--compare`` names (a comma-separated string or a list); an unknown one is a ValueError."""
    if option is None:
        return []
    names = [s.strip() for s in option.split(",")] if isinstance(option, str) else [str(s).strip() for s in option]
    names = [n for n in names if n]
    if not names and option:  # ("--compare ,": a list that lost its names)
        raise ValueError(f"--compare: no init scheme named in {option!r}; give one or more of: {', '.join(SCHEMES)}")
    bad = [n for n in names if n not in SCHEMES]
    if bad:
        raise ValueError(f"--compare: unknown init scheme {bad[0]!r} in {option!r}; known: {', '.join(SCHEMES)}")
    return names


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
                     f"{len(built.flagged)} of {len(built.layers)} layers flagged: forward {flagged_at(built, 'forward')}, "
                     f"backward {flagged_at(built, 'backward')}")
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
    before = InitFingerprint.before_forward(base)
    reports = [signal_report(base, batch, task.loss, label=AS_BUILT,
                             make_optimizer=optimizer_factory(base, ctx.cfg.optim, device, own))]
    # What was measured is the init a forward that re-draws left, and no scheme applied before it survives it.
    overwritten = before.redrawn(base) if before is not None else []
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
    refused = None  # the scheme for the activations fails too: not recommended
    if not built.passed and not deliberate:
        # (not compared: measured now, on a copy re-initialized as the advice would have it)
        reinit = by_scheme.get(built.recommended) or reinitialized(built.recommended)
        architecture = architectures(built, reinit)
        refused = fails_too(built, reinit) if architecture is None and not schemes else None
    first = built.first_forward
    exploding = flagged_at(built, "forward") if first is not None and first.forward == EXPLODING else None
    loss_numbers, loss_line, loss_fails = judge_loss_at_init(built, reports[0].loss, uninformed_loss(base, batch, task.loss),
                                                             batch)
    # With a comparison, the scheme it recommends (one that passed here) is what the JSON, numbers and text all name.
    recommended, advice = _compare_advice(built, by_scheme) if schemes else (None if built.passed else built.recommended, "")
    # No scheme where the forward draws again, where the flag is the architecture's, or it fails too (the JSON says it too)
    recommended = None if overwritten or architecture is not None or refused else recommended
    plot = plot_signal(reports, ctx.output_path("init_signal.png"))
    data = ctx.output_path("init_signal.json")
    data.write_text(json.dumps([{**r.to_dict(), "recommended": recommended} for r in reports], indent=1, default=str))

    numbers: dict[str, object] = {"layers": len(built.layers), "flagged": len(built.flagged), **loss_numbers,
                                  "forward": flagged_at(built, "forward"), "backward": flagged_at(built, "backward")}
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
        if built.cut_off:  # (not the init's: a warning, the details' backward line says why)
            summary += f"; no gradient reaches {', '.join(repr(layer.name) for layer in built.cut_off)}"
            numbers["no_gradient"] = [layer.name for layer in built.cut_off]
    if refused is not None:
        details = [refused if d.startswith("recommended init:") else d for d in details]
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
    if loss_fails or overwritten:  # (a FAIL says no "init holds": the loss at init or the re-drawing forward is why)
        details = [d for d in details if not d.startswith("init holds")]
    numbers.update({"recommended": recommended, "plot": str(plot), "json": str(data)})
    return CheckResult("init", (built.passed or architecture is not None) and not loss_fails and not overwritten, summary,
                       numbers=numbers,
                       details=details, warning=architecture is not None or bool(built.cut_off))
