"""Signal propagation at step 0: does the signal survive the depth of the model, forward and backward?

:func:`signal_report` runs one forward and one backward pass and records, for every leaf module in
execution order, its output mean / std / abs-max, the std of the gradient with respect to its output,
and its weight's std and gradient std. Each layer is compared with a *reference*: the same layer at
the shallowest depth, found by dropping list indices from its name (``blocks.7.mlp.fc`` is compared
with ``blocks.0.mlp.fc``; in an ``nn.Sequential`` every Linear with the first Linear, every ReLU
with the first ReLU); a layer with no such counterpart is compared with the first layer of its class
and shapes that has none either, in the same module (``fc1``, ``fc2``, ``fc3`` of one model; a
one-block GPT-2's ``ln_1`` is not compared with its final ``ln_f``). A trainable layer whose output's
gradient is exactly 0 while others' are not (the layers before a zero-initialized head) vanishes
(0x) in any group; one no gradient reaches at all is named on the backward line. Forward, the
reference is the shallowest one; backward, the deepest (where the gradient arrives first). A
normalization layer's output std is 1 by construction, so its forward verdict reads its *input*
(for a pre-norm residual network, the residual stream).

Layers are measured per *call*: a module called several times is one layer per call, named
``drop#0``, ``drop#1``. Its calls are counterparts only when it is part of a unit applied repeatedly
(every module called between two of its calls is called as often: a weight-shared block in a loop);
a module reused in different roles (word_language_model's Dropout, before and after the LSTM) is
compared with no other layer. Some layers are judged by what they are:

- an embedding is a source: its output std is its init and there is no input signal to preserve,
  so it gets no forward verdict;
- a recurrent layer (``nn.RNN`` / ``LSTM`` / ``GRU``) sets its output scale with its gates and is a
  boundary: other layers are compared only with layers between the same recurrent layers (a
  layer before an LSTM is never the reference of one after it). The recurrent layer itself is judged
  through time, not depth: forward, its output std at the last time step vs the middle one;
  backward, the grad std at its input's first time step vs the middle one. The middle step keeps
  out the zero initial state (forward) and the last steps' short future (backward): a stable
  LSTM reads ~1x at any depth. With a loss at every step, each step's own gradient hides a
  vanishing gradient through time; an exploding one shows. A cell (``nn.LSTMCell``) called once per
  time step is a repeated unit: its calls are compared, which is the same question.

A layer is ``exploding`` when its std ratio to its reference is above ``SignalThresholds.explode`` (or not
finite), ``vanishing`` when below ``1 / SignalThresholds.explode``, else ``ok``; a layer with no forward signal
(its output all 0, dead units, or constant because its input is) is ``vanishing`` (0x) even when its reference
has none either (the first ReLU of a net whose ReLUs are all dead is its own reference). The report names the first
layer where the signal leaves that band, forward (scanning from the input) and backward (scanning
from the loss), and by how much; after one optimizer step on a copy of the state it gives every
parameter's update/weight ratio (:mod:`.update_ratio`), and it recommends an init scheme from the
activations it saw. :mod:`.signal_display` shows a report as text tables and a plot.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..numerics import unique_params
from ..policies.accumulation import as_sum_count
from ..tasks.init_schemes import ActivationTrace, activation_name, is_norm, recommend_scheme
from .signal_spread import COLLAPSE, first_tensor, spreads_by_call, std
from .signal_verdicts import OWN_INPUT, assign_references
from .update_ratio import UpdateRatio, update_ratios

__all__ = ["NothingToMeasure", "SignalThresholds", "LayerSignal", "SignalReport", "signal_report", "assign_references"]

OK, VANISHING, EXPLODING = "ok", "vanishing", "exploding"


@dataclass(frozen=True)
class SignalThresholds:
    """When a layer's std ratio to its reference is flagged.

    Attributes:
        explode: a ratio above this is ``exploding``, below ``1 / explode`` is ``vanishing``.
        update_high: with an SGD-like optimizer (update = lr x grad), an update/weight ratio above this
            after one step is marked ``large`` (the ~1e-3 rule of thumb is the middle of the band).
        update_low: ... and below this ``small``.
        adaptive_high: with an Adam-like optimizer (each element moves by about lr on the first step,
            whatever its gradient), a ratio above this is ``large``: the first step is its largest
            relative move (later ``|m / sqrt(v)| < 1``), hence 10x the SGD band's top.
        adaptive_low: ... and a ratio below this times ``lr / rms(w)`` (what the first step gives a weight
            whose every element has a gradient) is ``small``: most of its elements got no gradient, or one below
            the optimizer's eps. Where ``lr / rms(w)`` is above ``adaptive_high`` (a weight of rms below 10 x lr: its
            normal first step is already ``large``), the low bound is ``adaptive_low x adaptive_high``: the band
            was empty or inverted (0.0995..0.1, 0.101..0.1).
    """

    explode: float = 4.0
    update_high: float = 1e-2
    update_low: float = 1e-4
    adaptive_high: float = 1e-1
    adaptive_low: float = 1e-1

    def __post_init__(self) -> None:
        if not self.explode > 1:
            raise ValueError(f"SignalThresholds.explode: expected a number > 1, got {self.explode!r}")

    def verdict(self, ratio: float | None) -> str:
        if ratio is not None and (not math.isfinite(ratio) or ratio > self.explode):
            return EXPLODING
        return VANISHING if ratio is not None and ratio < 1 / self.explode else OK

    def update_band(self, adaptive: bool, lr: float | None, weight_rms: float) -> tuple[float, float]:
        """Return the (low, high) update/weight band after one step, for an Adam-like optimizer or not."""
        if adaptive and lr is not None and weight_rms > 0:
            return self.adaptive_low * min(lr / weight_rms, self.adaptive_high), self.adaptive_high
        return self.update_low, self.update_high

    def describe(self) -> str:
        return (f"verdicts: exploding when a layer's std is more than {self.explode:g}x its reference's, vanishing "
                f"when less than 1/{self.explode:g}; reference = the same layer at the shallowest depth (forward) "
                "or the deepest (backward); norm layers are judged on their input")


@dataclass
class LayerSignal:
    """One leaf-module call: its activation and gradient statistics, ratios and verdicts."""

    index: int
    name: str
    kind: str
    out_mean: float
    out_std: float
    out_absmax: float
    in_std: float | None = None
    grad_std: float | None = None  # std of d loss / d output
    grad_absmax: float | None = None  # its largest |element|: 0 where the gradient is exactly 0 (a std of 0 may be constant)
    param_name: str | None = None  # the parameter the next two describe (the weight)
    param_std: float | None = None
    param_grad_std: float | None = None
    activation: str | None = None  # set when the module is an activation
    is_norm: bool = False
    role: str = ""  # "embedding" (a source: no forward verdict) | "recurrent" (judged through time) | ""
    call: int | None = None  # which call of its module this is, when the module is called more than once
    own_reference: bool = False  # a module reused in different roles: each call is compared with no other layer
    segment: int = 0  # how many recurrent layers ran before it; layers are compared within their segment
    time_out_mid: float | None = None  # recurrent: output std at its middle time step
    time_out_last: float | None = None  # recurrent: ... and at its last
    time_grad_first: float | None = None  # recurrent: grad std at its input's first time step
    time_grad_mid: float | None = None  # recurrent: ... and at its middle one
    in_shape: tuple[int, ...] | None = None  # without the leading (batch) dimension
    out_shape: tuple[int, ...] = ()
    lead: int | None = None  # the output's leading (batch) size: a broadcast one (GPT-2's wpe, 1) no full batch's peer
    out_spread: float | None = None  # how much the output varies across the batch (:func:`~.signal_spread.spread`)
    in_spread: float | None = None  # ... and its input
    frozen: bool = False  # its weight does not train (requires_grad=False)
    ref_forward: str = ""
    ref_backward: str = ""
    forward_ratio: float | None = None
    backward_ratio: float | None = None
    param_std_ratio: float | None = None
    param_grad_ratio: float | None = None
    forward: str = OK
    backward: str = OK

    @property
    def signal_std(self) -> float:
        """The forward std the verdict reads: the input for a normalization layer, else the output."""
        return self.in_std if self.is_norm and self.in_std is not None else self.out_std

    @property
    def flagged(self) -> bool:
        return self.forward != OK or self.backward != OK

    @property
    def cut_off(self) -> bool:
        """A trainable layer whose weight got no gradient from any call (a second call under ``no_grad``, a DQN target's,
        is no cut): the loss does not depend on it (a ``.detach()``, ``no_grad``, an output left unused); its
        parameters never train, whatever the init."""
        return self.param_name is not None and not self.frozen and self.param_grad_std is None  # (no call of it got one)

    @property
    def collapsed(self) -> bool:
        """Its output barely varies across the batch against its std (:data:`COLLAPSE`) where its input does: offsets,
        not its input, make it (an input the same for every sample by design, learned queries or a conditioning vector,
        is none)."""
        return (self.param_name is not None and not self.is_norm and not self.role and None not in (self.out_spread,
                self.in_spread, self.in_std) and self.out_std > 0 and self.out_spread < COLLAPSE * self.out_std
                and self.in_spread >= COLLAPSE * self.in_std > 0)

    @property
    def silent(self) -> bool:
        """No forward signal: its output is all 0 (dead units), or constant because its input is."""
        return self.signal_std == 0 and (self.out_absmax == 0 or self.in_std == 0)


@dataclass
class SignalReport:
    """Per-layer signal statistics of one forward/backward pass, their verdicts and a summary."""

    label: str
    layers: list[LayerSignal]
    thresholds: SignalThresholds
    loss: float
    updates: list[UpdateRatio] = field(default_factory=list)
    optimizer: str = ""
    recommended: str = "auto"
    activations: dict[str, int] = field(default_factory=dict)  # module class or function call (torch.relu) -> times seen
    adaptive: bool = False  # the optimizer is Adam-like: the update bands are relative to lr / rms(w)

    @property
    def flagged(self) -> list[LayerSignal]:
        return [layer for layer in self.layers if layer.flagged]

    @property
    def passed(self) -> bool:
        return not self.flagged

    @property
    def first_forward(self) -> LayerSignal | None:
        """The first layer from the input whose forward signal is flagged."""
        return next((layer for layer in self.layers if layer.forward != OK), None)

    @property
    def first_backward(self) -> LayerSignal | None:
        """The first layer from the loss whose gradient is flagged."""
        return next((layer for layer in reversed(self.layers) if layer.backward != OK), None)

    @property
    def cut_off(self) -> list[LayerSignal]:
        """The trainable layers no gradient reached, where one reached others (:attr:`LayerSignal.cut_off`)."""
        reached = any(layer.param_grad_std is not None for layer in self.layers)
        return [layer for layer in self.layers if layer.cut_off] if reached else []

    def summary(self, direction: str) -> str:
        """Return one line: where the ``forward`` or ``backward`` signal first leaves the band, and by how much."""
        line = self._summary(direction)
        cut = self.cut_off if direction == "backward" else []
        if cut:  # (a trial: 'backward: ok' for a model whose first layer's output was detached, its grad std shown '-')
            line += (f"{' where a gradient flows' if line.endswith(': ok') else ''}; none reaches #{cut[0].index} "
                     f"{cut[0].name!r} ({cut[0].kind}){f' and {len(cut) - 1} more' if len(cut) > 1 else ''}: the loss does "
                     "not depend on its output (a .detach(), torch.no_grad, an output left unused), so its parameters "
                     "never train, whatever the init")
        return line

    def _summary(self, direction: str) -> str:
        first = self.first_forward if direction == "forward" else self.first_backward
        if first is None:
            return f"{direction}: ok"
        attr = "forward_ratio" if direction == "forward" else "backward_ratio"
        verdict = first.forward if direction == "forward" else first.backward
        ratios = [(getattr(layer, attr), layer) for layer in self.layers if getattr(layer, attr) is not None]
        extreme = (max(ratios, key=lambda r: _log_ratio(r[0])) if verdict == EXPLODING
                   else min(ratios, key=lambda r: _log_ratio(r[0])))
        what = "std" if direction == "forward" else "grad std"
        ref = first.ref_forward if direction == "forward" else first.ref_backward
        ref = f"of {ref}" if ref == OWN_INPUT else repr(ref)
        value = first.signal_std if direction == "forward" else first.grad_std
        if direction == "forward" and first.role == "recurrent" and first.time_out_mid is not None:
            what, value, ref = "through time: output std at its last time step", first.time_out_last, "at its middle one"
        if direction == "backward" and first.role == "recurrent" and first.time_grad_first is not None:
            what, value, ref = ("through time: grad std at its input's first time step", first.time_grad_first,
                                "at its middle one")
        if value is not None and not math.isfinite(value):  # a NaN/inf of the batch (a sample, an op): no init's scale
            return (f"{direction}: non-finite at #{first.index} {first.name!r} ({first.kind}) on this batch ({what} "
                    f"{value:.3g}): a sample or an op makes it, not the init's scale")
        if direction == "forward" and first.collapsed and self.thresholds.verdict(first.forward_ratio) == OK:
            return (f"forward: vanishes at #{first.index} {first.name!r} ({first.kind}): its output barely varies across "
                    f"the batch (by {first.out_spread:.3g}, {_x(first.out_spread / first.out_std)} its std {first.out_std:.3g}"
                    "): constant offsets (a bias, a mean carried through) make its std, no signal of its input goes past it")
        if direction == "forward" and first.silent:  # 0, whatever its reference: no ratio says more
            what = (f"its output is all 0{' (dead units)' if first.activation else ''}" if first.out_absmax == 0
                    else "its output is constant (its input is)")
            return f"forward: vanishes (0) at #{first.index} {first.name!r} ({first.kind}): {what}, no signal goes past it"
        verb = "explodes" if verdict == EXPLODING else "vanishes"
        return (f"{direction}: {verb} at #{first.index} {first.name!r} ({first.kind}): {what} {value:.3g} = "
                f"{_x(getattr(first, attr))} that {'of ' if ref.startswith(chr(39)) else ''}{ref}; most extreme "
                f"{_x(extreme[0])} at #{extreme[1].index} {extreme[1].name!r}")

    def lost_in_frozen(self) -> bool:
        """Whether each first flagged layer (forward, backward) is frozen, or follows a frozen weighted layer."""
        firsts = [f for f in (self.first_forward, self.first_backward) if f is not None]
        weighted = [[x for x in self.layers[:f.index + 1] if x.param_name] for f in firsts]
        return bool(firsts) and all(w and w[-1].frozen for w in weighted)

    @property
    def nonfinite(self) -> bool:
        """Whether the batch made a non-finite value in the forward or the backward (a sample or an op: no init's scale)."""
        return any(x is not None and not math.isfinite(x) for layer in self.layers for x in (layer.signal_std, layer.grad_std))

    def advice(self) -> str:
        """Return one line recommending an init scheme from the activations seen."""
        seen = ", ".join(f"{n} x{c}" for n, c in self.activations.items()) or "no activation module or function"
        if self.nonfinite:
            return ("no init advice: this batch makes non-finite values, which no init's scale explains (the step's own "
                    "incident names the sample or the op)")
        if self.passed:
            line = f"init holds as built: keep it (saw {seen})"  # (the scheme for them may break it: a residual net's)
        else:
            line = f"recommended init: init_(model, {self.recommended!r}) (saw {seen})"
        if any("." in kind for kind in self.activations):  # torch.relu & co: no module for init_ to read
            line += "; init_ reads activations called as functions with trace=lambda m: m(example_input)"
        dead = self.first_forward
        if dead is not None and dead.silent:
            line += (f"; every unit of #{dead.index} {dead.name!r} ({dead.kind}) is off on this batch: its input is below "
                     "the activation's threshold everywhere (look at the biases and the scale of the layer before it; "
                     "init_ zeroes biases)" if dead.activation and dead.out_absmax == 0 else
                     f"; #{dead.index} {dead.name!r} ({dead.kind}) outputs no signal: a weight of 0, or an input of 0")
        if self.lost_in_frozen():
            line += ("; the signal leaves the band in layers whose weights are frozen (requires_grad=False, pretrained?): "
                     "no init applies to them, and init_ leaves them as they are")
        if any(layer.is_norm and layer.forward == EXPLODING for layer in self.layers):
            line += ("; the input of normalization layers grows with depth: mark the residual branches' output "
                     "projections (residual_branch_out = True) so init_ scales them by 1/sqrt(number of branches)")
        return line

    def rules(self) -> list[str]:
        """Return the lines saying how the layers that are not judged by the plain depth rule were judged."""
        lines = []
        if any(layer.role == "embedding" for layer in self.layers):
            lines.append("embeddings are sources: their output std is their init (no input signal to preserve), "
                         "so they get no forward verdict")
        if any(layer.role == "recurrent" for layer in self.layers):
            lines.append("a recurrent layer (RNN/LSTM/GRU) sets its output scale with its gates: layers are compared "
                         "only with layers between the same recurrent layers, and a recurrent layer is judged through "
                         "time: forward its output std at the last time step vs the middle one, backward the grad std "
                         "at its input's first time step vs the middle one (with a loss at every step, each step's "
                         "direct gradient hides a vanishing one; an exploding one shows)")
        if any(layer.call is not None for layer in self.layers):
            lines.append("a module called several times is one layer per call (name#call); its calls are compared "
                         "with each other only when it is part of a unit applied repeatedly (a weight-shared block)")
        return lines

    def to_dict(self) -> dict[str, Any]:
        first_f, first_b = self.first_forward, self.first_backward
        return {
            "label": self.label, "passed": self.passed, "loss": self.loss, "thresholds": asdict(self.thresholds),
            "first_forward": None if first_f is None else {"index": first_f.index, "name": first_f.name,
                                                           "verdict": first_f.forward, "ratio": first_f.forward_ratio},
            "first_backward": None if first_b is None else {"index": first_b.index, "name": first_b.name,
                                                            "verdict": first_b.backward, "ratio": first_b.backward_ratio},
            "summary": [self.summary("forward"), self.summary("backward")],
            "recommended": self.recommended, "activations": dict(self.activations),
            "layers": [asdict(layer) for layer in self.layers],
            "optimizer": self.optimizer, "adaptive": self.adaptive,
            "updates": [{**asdict(u), "mark": u.mark} for u in self.updates],
        }


def _log_ratio(r: float) -> float:
    return math.inf if r is None or math.isnan(r) else math.log(r) if r > 0 else -math.inf


def _x(r: float | None) -> str:
    return "-" if r is None else f"{r:.3g}x"


# -- measuring ----------------------------------------------------------------------------------------


def _main_param(module: nn.Module) -> tuple[str, nn.Parameter] | None:
    """Return the parameter that describes a layer: its ``weight``, else its largest own parameter."""
    own = list(module.named_parameters(recurse=False))
    return next(((n, p) for n, p in own if n == "weight"), max(own, key=lambda np_: np_[1].numel()) if own else None)


class NothingToMeasure(ValueError):
    """No leaf module of the model produced a floating-point tensor in the loss's forward (nothing to report on)."""


def signal_report(model: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], Any], *, label: str = "",
                  make_optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
                  thresholds: SignalThresholds = SignalThresholds()) -> SignalReport:
    """Run one forward and backward of ``loss(model, batch)``; return the per-layer signal report.

    ``loss`` returns a scalar mean or a ``(sum, count)`` pair (the task contract); the report
    backpropagates the mean. Then one step of ``make_optimizer(params)`` (default: AdamW, lr 1e-3)
    gives each parameter's update/weight ratio. The model runs in the mode it is in, and is left as
    it was found: parameters, their ``.grad`` and buffers (BatchNorm statistics) are restored. Forces
    one host-device sync for all the statistics (and one for the updates).
    """
    params = [p for _, p in unique_params(model)]
    saved_grads = [p.grad for p in params]
    saved_buffers = [b.detach().clone() for b in model.buffers()]
    try:
        for p in params:
            p.grad = None
        layers, loss_value, functional = _measure(model, batch, loss)
        updates, opt_name, adaptive = update_ratios(model, params, make_optimizer, thresholds.update_band)
    finally:
        for p, g in zip(params, saved_grads):
            p.grad = g
        with torch.no_grad():
            for b, saved in zip(model.buffers(), saved_buffers):
                b.copy_(saved)
    assign_references(layers, thresholds)
    activations = dict(Counter([layer.kind for layer in layers if layer.activation is not None] + [c for c, _ in functional]))
    recommended = recommend_scheme([layer.activation for layer in layers] + [name for _, name in functional])
    return SignalReport(label, layers, thresholds, loss_value, updates, opt_name, recommended, activations, adaptive)


def _measure(model: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], Any]) -> tuple[list[LayerSignal], float, list]:
    """Run forward and backward with hooks on every leaf module; return the layers (no ratios yet), the loss and the
    activations the forward called as functions (:attr:`ActivationTrace.functional`)."""
    # nn.MultiheadAttention is a leaf here: its forward is a function of its own weights (out_proj is never called)
    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children()) or isinstance(m, nn.MultiheadAttention)]
    calls: list[tuple[str, nn.Module, tuple | None, tuple, int | None]] = []  # name, module, in/out shape, out's lead
    stats: list[dict[str, Tensor]] = []

    def on_forward(name: str) -> Callable:
        def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
            out = first_tensor(output)
            if out is None or out.numel() == 0:
                return
            x = first_tensor(inputs)
            row = {"out": torch.stack([out.detach().float().mean(), std(out), out.detach().float().abs().max()])}
            if x is not None and x.numel() > 0:
                row["in_std"] = std(x)
            if out.requires_grad:
                def grad_hook(g: Tensor, row: dict = row) -> None:
                    row["grad"] = torch.stack([std(g), g.detach().float().abs().max()])
                out.register_hook(grad_hook)
            seq = inputs[0] if inputs and isinstance(module, nn.RNNBase) else None  # not a PackedSequence
            if isinstance(seq, Tensor) and seq.dim() in (2, 3) and out.dim() == seq.dim():
                t_axis = 1 if seq.dim() == 3 and module.batch_first else 0
                mid = seq.shape[t_axis] // 2
                if mid > 0:  # through time: the output's last step vs the middle one, the input grad's first vs middle
                    row["time_out"] = torch.stack([std(out.select(t_axis, mid)), std(out.select(t_axis, -1))])
                    if seq.requires_grad:
                        def time_hook(g: Tensor, row: dict = row, t_axis: int = t_axis, mid: int = mid) -> None:
                            row["time_grad"] = torch.stack([std(g.select(t_axis, 0)), std(g.select(t_axis, mid))])
                        seq.register_hook(time_hook)
            calls.append((name, module, None if x is None else tuple(x.shape[1:]), tuple(out.shape[1:]),
                          out.shape[0] if out.dim() else None))
            stats.append(row)
        return hook

    handles = [m.register_forward_hook(on_forward(n)) for n, m in leaves]
    try:
        with ActivationTrace(model) as trace:
            loss_sum, count = as_sum_count(loss(model, batch), 1, backward=True)  # (a detached loss: the contract's line)
        mean_loss = loss_sum / count
        mean_loss.backward()
    finally:
        for h in handles:
            h.remove()
    if not calls:
        raise NothingToMeasure("signal_report: no leaf module produced a floating-point tensor; "
                               "is the model called in loss(model, batch)?")

    spreads, nth = spreads_by_call(model, batch, loss, leaves), Counter()
    for (_, module, *_), row in zip(calls, stats):  # (by module and call: a path that depends on a draw may differ)
        nth[id(module)] += 1
        if (id(module), nth[id(module)]) in spreads:
            row["spread"] = spreads[(id(module), nth[id(module)])]
    mains = [_main_param(call[1]) for call in calls]
    for main, row in zip(mains, stats):
        if main is not None:
            row["param_std"] = std(main[1])
            if main[1].grad is not None:
                row["param_grad_std"] = std(main[1].grad)
    # One host-device sync for every statistic of every layer.
    keys = [(i, k) for i, row in enumerate(stats) for k in row]
    device = stats[0]["out"].device
    flat = torch.cat([stats[i][k].reshape(-1).to(device) for i, k in keys] + [mean_loss.detach().reshape(1).to(device)])
    values = iter(flat.cpu().tolist())
    got: list[dict[str, Any]] = [{} for _ in stats]
    for i, k in keys:
        got[i][k] = [next(values) for _ in range(stats[i][k].numel())] if stats[i][k].dim() else next(values)
    loss_value = next(values)

    ids = [id(call[1]) for call in calls]
    num_calls = Counter(ids)
    seen: dict[int, int] = {}
    segment = 0
    layers = []
    for i, ((name, module, in_shape, out_shape, lead), main, row) in enumerate(zip(calls, mains, got)):
        param_name = None if main is None else ".".join(filter(None, (name, main[0])))
        call = seen[ids[i]] = seen.get(ids[i], -1) + 1
        reused = num_calls[ids[i]] > 1
        recurrent = isinstance(module, nn.RNNBase)
        time_out, time_grad = row.get("time_out") or (None, None), row.get("time_grad") or (None, None)
        layers.append(LayerSignal(
            index=i, name=f"{name}#{call}" if reused else name, kind=type(module).__name__, out_mean=row["out"][0],
            out_std=row["out"][1], out_absmax=row["out"][2], in_std=row.get("in_std"), grad_std=(row.get("grad") or [None])[0],
            grad_absmax=(row.get("grad") or [None, None])[1],
            param_name=param_name, param_std=row.get("param_std"), param_grad_std=row.get("param_grad_std"),
            activation=activation_name(module), is_norm=is_norm(module),
            role="recurrent" if recurrent else "embedding" if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) else "",
            call=call if reused else None, own_reference=reused and not _repeated_unit(ids, ids[i], num_calls),
            segment=segment, time_out_mid=time_out[0], time_out_last=time_out[1], time_grad_first=time_grad[0],
            time_grad_mid=time_grad[1],
            in_shape=in_shape, out_shape=out_shape, lead=lead, out_spread=(row.get("spread") or [None])[0],
            in_spread=next((v for v in (row.get("spread") or [None, None])[1:] if v == v), None),
            frozen=main is not None and not main[1].requires_grad))
        segment += recurrent
    return layers, loss_value, trace.functional


def _repeated_unit(ids: list[int], key: int, num_calls: dict[int, int]) -> bool:
    """Return True when the module ``key`` is part of a unit applied repeatedly (a weight-shared block in a loop).

    That is: every module called between two of its calls is called as many times as it is. A module
    reused in different roles (word_language_model's Dropout, before and after the LSTM) is not.
    """
    at = [i for i, k in enumerate(ids) if k == key]
    return all(num_calls[k] == num_calls[key] for a, b in zip(at, at[1:]) for k in ids[a + 1:b])
