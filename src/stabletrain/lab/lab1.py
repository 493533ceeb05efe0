"""Lab 1: how the init scheme decides whether the signal survives 12 layers, forward and backward.

One 12-layer MLP (the built-in ``mlp`` task's model: 12 Linear layers, an activation between each
two) per activation, re-initialized with each scheme (or left as torch builds it), measured at step 0
by :func:`stabletrain.diagnostics.signal_propagation.signal_report` on one fixed batch. Everything is counted in
the chapter's unit, layers (the Linear layers 1..12), not in leaf modules. The drift of a scheme is
the std at the last square Linear over the std at the first (forward), and the gradient std at the
first square Linear over the last (backward): both read in the direction the signal travels.

"Xavier" is the chapter's: ``nn.init.xavier_uniform_`` with gain 1 (and zero bias). "Kaiming" is
:func:`stabletrain.tasks.init_schemes.init_`'s, with the gain of the activation that follows (sqrt(2) for
ReLU, 5/3 for tanh). With ReLU, gain 1 loses half the second moment per layer: the std shrinks by
1/sqrt(2) per layer, which is what the gain sqrt(2) makes up for.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from pathlib import Path

from torch import nn

from ..data import fixed_batch
from ..diagnostics.signal_display import plot_signal
from ..diagnostics.signal_propagation import LayerSignal, SignalReport, signal_report
from ..seeding import seed_everything
from ..tasks.init_schemes import init_
from ..tasks.mlp import make_task
from . import Claim, LabResult

#: label -> (scheme, value) or None for torch's own default init. Schemes: ``xavier_uniform`` (value: the gain,
#: as ``nn.init.xavier_uniform_`` takes it), or one of :func:`~stabletrain.tasks.init_schemes.init_`'s (value: its std).
SCHEMES: dict[str, tuple[str, float] | None] = {
    "N(0,1)": ("normal", 1.0),
    "torch default": None,
    "Xavier": ("xavier_uniform", 1.0),
    "Kaiming": ("kaiming", 1.0),
}
ACTIVATIONS = ("relu", "tanh")
#: The claims: (activation, scheme label) that must drift, that must shrink by 1/sqrt(2) per layer, and that must hold.
DRIFTS = ("relu", "N(0,1)")
HALVES = ("relu", "Xavier")
HOLDS = (("relu", "Kaiming"), ("tanh", "Kaiming"))
DRIFT_MIN = 1e3  # "grows by orders of magnitude"
HOLD_MAX = 4.0  # "within a small factor": SignalThresholds.explode's default band
PER_LAYER_TOL = 0.1  # "about 1/sqrt(2) per layer": within 10%
_ACT_GAIN = {"relu": "sqrt(2)", "tanh": "5/3"}


def _init(model: nn.Module, spec: tuple[str, float]) -> None:
    scheme, value = spec
    if scheme == "xavier_uniform":  # the chapter's code: nn.init.xavier_uniform_(layer.weight); zeros_(layer.bias)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight, gain=value)
                nn.init.zeros_(m.bias)
    else:
        init_(model, scheme, std=value)


def _gain(spec: tuple[str, float] | None, act: str) -> str:
    """The gain column: what multiplies the fan-based std (``-`` where the std is not fan-based)."""
    if spec is None:
        return "1/sqrt(3)"  # kaiming_uniform_(a=sqrt(5)): torch's Linear default
    scheme, value = spec
    if scheme == "xavier_uniform":
        return f"{value:g}"
    if scheme in ("kaiming", "xavier", "auto"):
        return _ACT_GAIN.get(act, "act")
    return "-"


def _named(label: str, spec: tuple[str, float] | None, act: str) -> str:
    gain = _gain(spec, act)
    return f"{label} (gain {gain})" if gain != "-" else label


def _layers(report: SignalReport) -> list[LayerSignal]:
    """The Linear layers, numbered 1..depth as the chapter counts them (``index``)."""
    linear = [layer for layer in report.layers if layer.kind == "Linear"]
    return [dataclasses.replace(layer, index=i) for i, layer in enumerate(linear, 1)]


def _by_layer(report: SignalReport) -> SignalReport:
    """``report`` with its Linear layers only, numbered 1..depth: what the plots and the flagged count show."""
    return dataclasses.replace(report, layers=_layers(report))


def _measure(report: SignalReport, width: int) -> dict[str, float]:
    layers = _layers(report)
    hidden = [layer for layer in layers if layer.in_shape == (width,) and layer.out_shape == (width,)]
    first, last = hidden[0], hidden[-1]
    span = last.index - first.index
    fwd = last.out_std / first.out_std
    return {"fwd_first": first.out_std, "fwd_last": last.out_std, "fwd_drift": fwd,
            "fwd_per_layer": fwd ** (1 / span) if math.isfinite(fwd) and fwd > 0 else math.nan,
            "bwd_last": last.grad_std, "bwd_first": first.grad_std, "bwd_drift": first.grad_std / last.grad_std,
            "flagged": sum(layer.flagged for layer in layers), "layers": len(layers), "loss": report.loss,
            "span": span, "first_layer": first.index, "last_layer": last.index}


def _within(x: float, band: float) -> bool:
    return math.isfinite(x) and 1 / band <= x <= band


def run(out_dir: Path | None = None, seed: int = 0, *, schemes: dict[str, tuple[str, float] | None] | None = None,
        activations: tuple[str, ...] = ACTIVATIONS, depth: int = 12, width: int = 64, batch_size: int = 256) -> LabResult:
    """Measure std by layer for every (activation, scheme); check N(0,1)+ReLU drifts, Xavier (gain 1)+ReLU shrinks
    by 1/sqrt(2) per layer, Kaiming holds with ReLU and tanh.

    ``schemes`` maps a label to ``(scheme, value)`` or None (torch's default); swapping what a label means
    (e.g. ``{"Kaiming": ("normal", 1.0)}``) breaks the claim made about that label.
    """
    schemes = {**SCHEMES, **(schemes or {})}
    measured: dict[tuple[str, str], dict[str, float]] = {}
    stds: dict[tuple[str, str], float] = {}
    reports: dict[str, list[SignalReport]] = {}
    for act in activations:
        seed_everything(seed)
        task = make_task(num_samples=batch_size, in_dim=width, width=width, depth=depth, activation=act)
        _, batch = fixed_batch(task, batch_size)
        reports[act] = []
        for label, spec in schemes.items():
            model = copy.deepcopy(task.model)
            seed_everything(seed)
            if spec is not None:
                _init(model, spec)
            report = signal_report(model, batch, task.loss, label=f"{_named(label, spec, act)}, {act}")
            reports[act].append(_by_layer(report))
            measured[act, label] = _measure(report, width)
            stds[act, label] = float(model[2].weight.detach().std())  # the second Linear's weight, as drawn

    first, last = next(iter(measured.values()))["first_layer"], next(iter(measured.values()))["last_layer"]
    rows = [[act, label, _gain(schemes[label], act), f"{stds[act, label]:.3g}", m["fwd_first"], m["fwd_last"],
             m["fwd_drift"], m["fwd_per_layer"], m["bwd_last"], m["bwd_first"], m["bwd_drift"], m["flagged"], m["loss"]]
            for (act, label), m in measured.items()]
    columns = ["act", "init", "gain", "w std", f"fwd std @{first}", f"fwd std @{last}", "fwd drift", "per layer",
               f"grad std @{last}", f"grad std @{first}", "bwd drift", f"layers flagged (of {depth})", "loss@0"]

    claims = []
    d_act, d_label = DRIFTS
    if (d_act, d_label) in measured:
        m = measured[d_act, d_label]
        claims.append(Claim(f"{d_label} with {d_act}: forward std grows by orders of magnitude (layer {first} -> {last})",
                            f"{m['fwd_drift']:.3g}x", f">= {DRIFT_MIN:g}x",
                            math.isinf(m["fwd_drift"]) or m["fwd_drift"] >= DRIFT_MIN))
    h_act, h_label = HALVES
    if (h_act, h_label) in measured:
        m, target = measured[h_act, h_label], 1 / math.sqrt(2)
        claims.append(Claim(f"{_named(h_label, schemes[h_label], h_act)} with {h_act}: forward std shrinks by about "
                            f"1/sqrt(2) per layer (layer {first} -> {last})",
                            f"{m['fwd_per_layer']:.3g}x per layer ({m['fwd_drift']:.3g}x over {m['span']} layers)",
                            f"{target:.3g} +- {PER_LAYER_TOL:.0%}",
                            abs(m["fwd_per_layer"] - target) <= PER_LAYER_TOL * target))
    for act, label in HOLDS:
        if (act, label) not in measured:
            continue
        m = measured[act, label]
        held = _within(m["fwd_drift"], HOLD_MAX) and _within(m["bwd_drift"], HOLD_MAX) and m["flagged"] == 0
        claims.append(Claim(f"{_named(label, schemes[label], act)} with {act}: std holds forward and backward, "
                            "no layer flagged by signal_report",
                            f"fwd {m['fwd_drift']:.3g}x, bwd {m['bwd_drift']:.3g}x, {m['flagged']} flagged",
                            f"within 1/{HOLD_MAX:g}..{HOLD_MAX:g}x, 0 flagged", held))

    plots = []
    if out_dir is not None:
        for act, rs in reports.items():
            plots.append(plot_signal(rs, out_dir / f"lab1_{act}.png", xlabel=f"layer (Linear 1..{depth})"))

    setup = (f"{depth}-layer MLP (the mlp task's make_mlp: {depth} Linear layers), width {width}, activations "
             f"{', '.join(activations)}; each scheme ({', '.join(schemes)}; Xavier as in the chapter: xavier_uniform_, "
             f"gain 1); signal_report on one batch of {batch_size} at step 0, seed {seed}; the table's drifts are over "
             f"the hidden layers, {first} to {last} ({width} in, {width} out; the others map to and from the data's "
             "dimensions), the plots show all of them")
    numbers = {f"{act}/{label}/{k}": v for (act, label), m in measured.items() for k, v in m.items()}
    return LabResult("1", setup, columns, rows, claims, _explain(measured, stds, width, depth), plots, numbers)


def _explain(measured: dict[tuple[str, str], dict[str, float]], stds: dict[tuple[str, str], float],
             width: int, depth: int) -> list[str]:
    out = []
    relu_normal = measured.get(("relu", "N(0,1)"))
    if relu_normal is not None:
        g, span, per = relu_normal["fwd_drift"], relu_normal["span"], relu_normal["fwd_per_layer"]
        theory = math.sqrt(width / 2)
        s = (f"With ReLU, N(0,1) weights multiplied the activation std by {g:.3g} over {span} layers, {per:.2f}x per "
             f"layer, where the variance argument predicts sqrt(fan_in/2) = {theory:.2f} for width {width}: each layer "
             f"sums {width} products of unit-variance weights and ReLU keeps half the second moment.")
        if relu_normal["loss"] > 10 * math.log(10):
            s += (f" The loss at step 0 is already {relu_normal['loss']:.3g} (a fresh 10-class model should sit near "
                  f"ln 10 = 2.30): the logits are so large that the softmax is saturated before training starts.")
        out.append(s)
    xavier = measured.get(("relu", "Xavier"))
    if xavier is not None:
        s = (f"The chapter's Xavier (xavier_uniform_ with gain 1: std {stds[('relu', 'Xavier')]:.3g} = "
             f"sqrt(2/({width}+{width}))) shrank the std {xavier['fwd_per_layer']:.3g}x per layer with ReLU, "
             f"{xavier['fwd_drift']:.3g}x over {xavier['span']} layers ({xavier['flagged']} of {depth} layers flagged), "
             f"against 1/sqrt(2) = {1 / math.sqrt(2):.3g} predicted: ReLU zeroes half the pre-activations, so each "
             "layer passes on half the second moment, and gain 1 does not give it back. Gain 1 suits a layer with "
             "no activation, or one with slope 1 around zero (tanh), not ReLU.")
        out.append(s)
    kaiming = measured.get(("relu", "Kaiming"))
    if kaiming is not None:
        holds = _within(kaiming["fwd_drift"], HOLD_MAX) and _within(kaiming["bwd_drift"], HOLD_MAX)
        std = stds.get(("relu", "Kaiming"))
        out.append(f"Kaiming (gain sqrt(2): std {std:.3g} = sqrt(2/{width})) {'kept' if holds else 'did not keep'} it: "
                   f"{kaiming['fwd_drift']:.3g}x forward and {kaiming['bwd_drift']:.3g}x backward over the same layers, "
                   "because the gain sqrt(2) (2 in the variance) exactly undoes ReLU's halving, in both directions for "
                   "square layers. On these square layers Xavier with the same gain would draw the very same std: what "
                   "separates the two rows is the gain, 1 against sqrt(2).")
    default = measured.get(("relu", "torch default"))
    if default is not None:
        fwd, bwd = default["fwd_drift"], default["bwd_drift"]
        verdict = ("vanishes" if bwd < 1 / HOLD_MAX else "grows" if bwd > HOLD_MAX else "holds")
        out.append(f"torch's default Linear init (std {stds[('relu', 'torch default')]:.3g}, about 1/sqrt(3 fan_in)) "
                   f"{verdict} with ReLU: forward {fwd:.3g}x, backward {bwd:.3g}x; "
                   + ("its biases keep the forward std from reaching zero, but the gradient reaching the first layers "
                      "shrinks with every layer, so those layers barely learn." if bwd < 1 / HOLD_MAX else
                      "for this depth it is usable, but it is not tuned to the activation."))
    kaiming_tanh, xavier_tanh = measured.get(("tanh", "Kaiming")), measured.get(("tanh", "Xavier"))
    normal_tanh = measured.get(("tanh", "N(0,1)"))
    if kaiming_tanh is not None:
        s = (f"With tanh, the gain 5/3 (std {stds[('tanh', 'Kaiming')]:.3g}; torch's calculate_gain('tanh'), the same "
             f"std Xavier draws with that gain on square layers) {'held' if kaiming_tanh['flagged'] == 0 else 'drifted'}: "
             f"{kaiming_tanh['fwd_drift']:.3g}x forward, {kaiming_tanh['bwd_drift']:.3g}x backward")
        if xavier_tanh is not None:
            s += (f"; Xavier's gain 1 came close but shrank {xavier_tanh['fwd_per_layer']:.3g}x per layer "
                  f"({xavier_tanh['fwd_drift']:.3g}x over {xavier_tanh['span']} layers): tanh's slope is 1 only at 0, "
                  "so it passes on a little less than it receives")
        if normal_tanh is not None:
            s += (f"; N(0,1) did not explode forward ({normal_tanh['fwd_drift']:.3g}x, tanh bounds the output, so every "
                  f"pre-activation sits at std {normal_tanh['fwd_last']:.3g}, deep in saturation) but its gradient changed "
                  f"{normal_tanh['bwd_drift']:.3g}x on the way back ({normal_tanh['flagged']} of {depth} layers flagged)")
        out.append(s + ".")
    return out
