"""Init schemes that read the activation after each layer (what a task's model factory calls).

``init_`` re-initializes a model in place. For every Linear / Conv layer it looks at the activation
that follows it and picks the gain and fan mode from it: the next leaf module in registration order
(skipping Dropout and Identity) or, given ``trace=`` (a function running one forward),
the activation the forward applies to the layer's output, functional calls such as ``torch.relu``
included (:class:`ActivationTrace`). Biases are zeroed; normalization layers get weight 1 and
bias 0; the output projections of residual branches are scaled by ``1/sqrt(number of residual
branches)`` so that the residual stream does not grow with depth (GPT-2's ``1/sqrt(2 * n_layer)``:
a transformer block has two branches). A residual branch's output projection is marked by the
attribute ``residual_branch_out = True`` on the module, or named in ``init_(..., residual=[...])``.

It lives beside the tasks (the bottom layer) because the built-in tasks build their models with it;
:mod:`stabletrain.diagnostics.initialization` checks that an init survives until the first step.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import warnings
import weakref
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from ..console import StableTrainWarning

__all__ = [
    "SCHEMES",
    "RESIDUAL_MARKER",
    "InitDecision",
    "ActivationTrace",
    "TRANSPARENT",
    "init_",
    "activation_name",
    "activation_gain",
    "is_norm",
    "recommend_scheme",
]

SCHEMES = ("auto", "xavier", "kaiming", "normal")
RESIDUAL_MARKER = "residual_branch_out"

# Activation modules by the name torch.nn.init.calculate_gain knows them under (or our own name).
_ACTIVATIONS: dict[type, str] = {
    nn.ReLU: "relu", nn.ReLU6: "relu", nn.LeakyReLU: "leaky_relu", nn.PReLU: "leaky_relu", nn.RReLU: "leaky_relu",
    nn.ELU: "elu", nn.CELU: "elu", nn.SELU: "selu", nn.GELU: "gelu", nn.SiLU: "silu", nn.Mish: "mish",
    nn.Hardswish: "hardswish", nn.Softplus: "softplus",
    nn.Tanh: "tanh", nn.Hardtanh: "tanh", nn.Softsign: "softsign", nn.Sigmoid: "sigmoid", nn.Hardsigmoid: "sigmoid",
}
# Saturating activations: Glorot's analysis (fan_avg) is the one made for them.
SATURATING = frozenset({"tanh", "softsign", "sigmoid"})
# Modules that pass the signal through unchanged in scale at init (looked through when finding the activation).
TRANSPARENT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Identity, nn.Flatten,
               nn.Unflatten)
# The layers init_ draws a fan-based init for.
_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
          nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d, nn.SyncBatchNorm, nn.InstanceNorm1d,
          nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d)


def is_norm(module: nn.Module) -> bool:
    """Return True for normalization layers (torch's, or any class whose name ends in ``Norm``)."""
    return isinstance(module, _NORMS) or type(module).__name__.lower().endswith("norm")


def activation_name(module: nn.Module) -> str | None:
    """Return the activation's name (``relu``, ``tanh``, ``gelu``, ...) or None if ``module`` is not one."""
    for cls in type(module).__mro__:
        if cls in _ACTIVATIONS:
            return _ACTIVATIONS[cls]
    return None


def activation_gain(module: nn.Module | None) -> float:
    """Return the gain for the layer feeding ``module`` (None: nothing follows, gain 1).

    Uses ``torch.nn.init.calculate_gain``'s values where it has one (relu sqrt(2), tanh 5/3,
    leaky_relu with the module's slope, sigmoid 1). SELU gets 1 (LeCun init, what self-normalizing
    networks need; torch's own 3/4 is not). Any other activation gets ``1/sqrt(E[f(z)^2])`` for
    ``z ~ N(0, 1)``, the gain that keeps the second moment through it (GELU 1.53, SiLU 1.68),
    computed by Gauss-Hermite quadrature on the module itself.
    """
    name = activation_name(module) if module is not None else None
    if name is None or name == "selu":
        return 1.0
    if name == "leaky_relu":
        slope = getattr(module, "negative_slope", None)
        if slope is None and isinstance(module, nn.PReLU):
            slope = float(module.weight.detach().float().mean())
        if slope is None and isinstance(module, nn.RReLU):
            slope = (module.lower + module.upper) / 2
        return nn.init.calculate_gain("leaky_relu", slope)
    if name in ("relu", "tanh", "sigmoid"):
        return nn.init.calculate_gain(name)
    return _second_moment_gain(module)


def _second_moment_gain(module: nn.Module) -> float:
    import numpy as np

    nodes, weights = np.polynomial.hermite_e.hermegauss(80)  # exact for E[p(z)], z ~ N(0, 1), deg < 160
    z = torch.tensor(nodes, dtype=torch.float64)
    params = list(module.parameters())
    with torch.no_grad():
        fz = module(z.to(params[0].dtype) if params else z).double()
    second_moment = float((fz**2 * torch.tensor(weights, dtype=torch.float64)).sum() / math.sqrt(2 * math.pi))
    return 1.0 / math.sqrt(second_moment)


# Activation functions a forward may call on a layer's output, as the module init_ reads the gain from.
def _slope(args: tuple, kwargs: dict) -> float:
    return kwargs.get("negative_slope", args[1] if len(args) > 1 else 0.01)


_ACTIVATION_FUNCTIONS: dict[str, Callable[[tuple, dict], nn.Module]] = {
    "relu": lambda a, k: nn.ReLU(), "relu_": lambda a, k: nn.ReLU(), "relu6": lambda a, k: nn.ReLU6(),
    "leaky_relu": lambda a, k: nn.LeakyReLU(_slope(a, k)), "leaky_relu_": lambda a, k: nn.LeakyReLU(_slope(a, k)),
    "gelu": lambda a, k: nn.GELU(approximate=k.get("approximate", "none")), "silu": lambda a, k: nn.SiLU(),
    "mish": lambda a, k: nn.Mish(), "elu": lambda a, k: nn.ELU(), "elu_": lambda a, k: nn.ELU(),
    "selu": lambda a, k: nn.SELU(), "selu_": lambda a, k: nn.SELU(), "celu": lambda a, k: nn.CELU(),
    "hardswish": lambda a, k: nn.Hardswish(), "softplus": lambda a, k: nn.Softplus(),
    "tanh": lambda a, k: nn.Tanh(), "tanh_": lambda a, k: nn.Tanh(), "hardtanh": lambda a, k: nn.Hardtanh(),
    "hardtanh_": lambda a, k: nn.Hardtanh(), "softsign": lambda a, k: nn.Softsign(),
    "sigmoid": lambda a, k: nn.Sigmoid(), "sigmoid_": lambda a, k: nn.Sigmoid(), "hardsigmoid": lambda a, k: nn.Hardsigmoid(),
}
_FUNCTIONS: dict[Any, tuple[str, Callable[[tuple, dict], nn.Module]]] = {
    getattr(owner, name): (f"{prefix}.{name}", make) for name, make in _ACTIVATION_FUNCTIONS.items()
    for owner, prefix in ((Tensor, "Tensor"), (F, "F"), (torch, "torch")) if callable(getattr(owner, name, None))}
# Functions that pass a layer's output on unchanged in scale: the activation is looked for after them.
_LOOKED_THROUGH = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, torch.dropout, torch.flatten,
                   torch.reshape, torch.squeeze, torch.unsqueeze, torch.transpose, torch.permute, torch.movedim,
                   *(getattr(Tensor, n) for n in ("view", "view_as", "reshape", "reshape_as", "flatten", "unflatten",
                                                  "transpose", "permute", "movedim", "squeeze", "unsqueeze", "expand",
                                                  "expand_as", "contiguous", "to", "float", "half", "bfloat16", "type_as",
                                                  "__getitem__"))}


def _tensors(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return [t for item in items for t in _tensors(item)]


class ActivationTrace(TorchFunctionMode):
    """Record, during a forward, which activation each Linear / Conv layer's output goes through.

    ``with ActivationTrace(model) as trace: loss(model, batch)``; then ``trace.followers()`` maps each
    layer's name to the activation module its output went through (a module built for a functional
    call: ``torch.relu(x)`` gives ``nn.ReLU()``), or None when it went into anything else (a linear op, a
    residual sum, the loss). A layer is left out when its output went both into an activation and into
    something else (``x * torch.sigmoid(x)``: not sigmoid), or into nothing. Dropout, reshapes and casts
    are looked through. ``functional`` lists the activations called as functions outside any activation
    module (``[("torch.relu", "relu"), ...]``, one per call). Reads no device value (no sync).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.functional: list[tuple[str, str]] = []  # (the call as written, the activation's name)
        self._pending: dict[int, tuple[weakref.ref, str]] = {}  # a layer's output (or a view of it) -> the layer
        self._seen: dict[str, set[Any]] = {}  # layer -> what its outputs went into (an activation module's class, or None)
        self._made: dict[str, nn.Module] = {}
        self._active: list[nn.Module] = []  # the activation modules running now (innermost last)
        self._handles: list[Any] = []

    def __enter__(self) -> ActivationTrace:  # noqa: PYI034 (typing.Self needs Python 3.11)
        for name, module in self.model.named_modules():
            if isinstance(module, _LAYERS):
                self._handles.append(module.register_forward_hook(self._on_layer(name)))
            elif activation_name(module) is not None:  # what runs inside it (F.relu, F.prelu) is the module's
                self._handles += [module.register_forward_pre_hook(self._enter), module.register_forward_hook(self._leave)]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()

    def _enter(self, module: nn.Module, *_: Any) -> None:
        self._active.append(module)

    def _leave(self, *_: Any) -> None:  # (returns None: the module's own output stands)
        self._active.pop()

    def _on_layer(self, name: str) -> Callable:
        def hook(module: nn.Module, inputs: Any, output: Any) -> None:
            for t in _tensors(output)[:1]:
                self._pending[id(t)] = (weakref.ref(t), name)  # weak: a no-grad forward frees its activations
        return hook

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        known = None if self._active else _FUNCTIONS.get(func)  # (inside an activation module: the module's)
        results = _tensors(out)
        if not results:  # .shape, .dim(), .item(): reads, not a use of the value
            return out
        for t in _tensors((args, kwargs)):
            pending = self._pending.get(id(t))
            if pending is None or pending[0]() is not t:
                continue
            layer = pending[1]
            if func in _LOOKED_THROUGH:
                for r in results:
                    if id(r) not in self._pending or self._pending[id(r)][0]() is None:
                        self._pending[id(r)] = (weakref.ref(r), layer)
                continue
            if self._active or known is not None:  # an activation module's op, or one called as a function
                module = self._active[-1] if self._active else known[1](args, kwargs)
                if not self._active:  # the user's own functional call on a layer's output
                    self.functional.append((known[0], activation_name(module) or ""))
                self._made.setdefault(layer, module)
                self._seen.setdefault(layer, set()).add(type(module))
                if any(r is t for r in results):  # in place: what flows on is the activation's output
                    del self._pending[id(t)]
            else:
                self._seen.setdefault(layer, set()).add(None)
        return out

    def followers(self) -> dict[str, nn.Module | None]:
        """Return layer name -> the activation its output went through (None: none); see the class docstring."""
        out: dict[str, nn.Module | None] = {}
        for layer, kinds in self._seen.items():
            if kinds == {None}:
                out[layer] = None
            elif len(kinds) == 1:
                out[layer] = self._made[layer]
        return out


def trace_activations(model: nn.Module, run: Callable[[nn.Module], Any]) -> dict[str, nn.Module | None]:
    """Run ``run(model)`` once (no grad) under :class:`ActivationTrace`; return its ``followers()``.

    The model's buffers (BatchNorm statistics) are put back after the forward.
    """
    saved = [b.detach().clone() for b in model.buffers()]
    try:
        with torch.no_grad(), ActivationTrace(model) as trace:
            run(model)
    finally:
        with torch.no_grad():
            for b, value in zip(model.buffers(), saved):
                b.copy_(value)
    return trace.followers()


@dataclass
class InitDecision:
    """What ``init_`` did to one module: the scheme, the activation it read, the std it drew from."""

    name: str
    kind: str
    scheme: str  # xavier | kaiming | normal | norm (weight 1, bias 0) | kept (not a layer init_ knows) | frozen (left)
    activation: str | None = None  # the activation that follows ("linear" when none)
    gain: float | None = None
    fan_mode: str | None = None  # fan_in | fan_avg
    std: float | None = None  # of the weight, after the residual scale
    residual_scale: float = 1.0
    assumed: bool = False  # kaiming on a model where no activation was seen: ReLU assumed (He et al.'s, torch's default)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fans(module: nn.Module, weight: Tensor) -> tuple[int, int]:
    receptive = math.prod(weight.shape[2:]) if weight.dim() > 2 else 1
    fan_a, fan_b = weight.shape[1] * receptive, weight.shape[0] * receptive
    if getattr(module, "transposed", False):  # ConvTranspose stores (in, out / groups, *k)
        fan_b, fan_a = fan_a, weight.shape[0] * receptive
    return fan_a, fan_b  # fan_in, fan_out


def _following(leaves: list[tuple[str, nn.Module]], i: int) -> nn.Module | None:
    """Return the activation module after leaves[i] (registration order), or None when none follows."""
    for _, module in leaves[i + 1:]:
        if isinstance(module, TRANSPARENT):
            continue
        return module if activation_name(module) is not None else None
    return None


def _is_residual_out(name: str, module: nn.Module, patterns: list[str]) -> bool:
    return bool(getattr(module, RESIDUAL_MARKER, False)) or any(fnmatch.fnmatchcase(name, p) for p in patterns)


@torch.no_grad()
def init_(model: nn.Module, scheme: str = "auto", *, std: float = 1.0, residual: Iterable[str] = (),
          num_residual_branches: int | None = None, trace: Callable[[nn.Module], Any] | None = None) -> list[InitDecision]:
    """Re-initialize ``model`` in place with ``scheme``; return what was done to each module.

    Schemes (weights drawn from a normal distribution, biases zeroed, norms set to weight 1, bias 0):

    - ``kaiming``: std = gain / sqrt(fan_in), gain from the activation that follows.
    - ``xavier``: std = gain * sqrt(2 / (fan_in + fan_out)), gain from the activation that follows.
    - ``auto``: xavier for layers followed by a saturating activation (tanh, sigmoid, softsign),
      kaiming for every other layer (ReLU-like activations, and none, where it is LeCun's 1/sqrt(fan_in)).
    - ``normal``: N(0, std^2) for every weight, whatever follows (``std=0.02`` is GPT-2's).

    The activation that follows a layer is the next leaf module in registration order, skipping
    Dropout / Identity / Flatten. An activation called as a function in ``forward`` (``torch.relu``,
    ``F.gelu``) is no module: pass ``trace``, a function that runs one forward (``lambda m: m(x)``), and
    each layer gets the activation its output goes through in that forward (:class:`ActivationTrace`;
    a layer the trace says nothing about keeps the registration-order answer). Where no activation is
    seen at all (no module, nothing traced), ``kaiming`` assumes ReLU after every layer (gain sqrt(2),
    torch's ``kaiming_normal_`` default; ``assumed=True`` in the decision), while ``auto`` and ``xavier``
    use gain 1, and warn when not traced (a model without activations is rarely deep). Embeddings (a lookup: fan-in 1) get
    N(0, 1), or N(0, std^2) under ``normal``. Residual branch outputs (``residual_branch_out = True``
    or a name matching a glob in ``residual``) get their std times ``1/sqrt(num_residual_branches)``
    (default: the number of such modules). A weight shared by several modules (tied embeddings) is
    left as the last of them initializes it. Modules with parameters that are none of these are
    left as they are (``scheme="kept"``), and so is every frozen parameter (``requires_grad=False``: pretrained weights;
    a module whose parameters all are: ``scheme="frozen"``). Draws from torch's global RNG.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"init scheme: expected one of {', '.join(SCHEMES)}, got {scheme!r}")
    if not std > 0:
        raise ValueError(f"init std: expected a positive number, got {std!r}")
    patterns = list(residual)
    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    residual_outs = [n for n, m in leaves if _is_residual_out(n, m, patterns)]
    if patterns and not residual_outs:
        raise ValueError(f"init residual={patterns}: no module name matches; names look like {leaves[0][0]!r}")
    branches = num_residual_branches if num_residual_branches is not None else len(residual_outs)
    if residual_outs and branches < 1:
        raise ValueError(f"init num_residual_branches: expected an integer >= 1, got {num_residual_branches!r}")
    residual_scale = 1.0 / math.sqrt(branches) if residual_outs else 1.0
    traced = trace_activations(model, trace) if trace is not None else {}
    followers = {name: traced[name] if name in traced else _following(leaves, i) for i, (name, m) in enumerate(leaves)
                 if isinstance(m, _LAYERS)}
    # No activation anywhere: functional ones init_ was not shown (trace=), or truly none.
    unseen = len(followers) > 1 and all(f is None for f in followers.values()) and \
        not any(activation_name(m) for _, m in leaves)
    if unseen and scheme in ("auto", "xavier") and trace is None:
        warnings.warn(f"init_(model, {scheme!r}): saw no activation after any of its {len(followers)} layers, so every "
                      "layer gets gain 1; if forward calls one as a function (torch.relu, F.gelu), pass trace=lambda m: "
                      "m(example_input) to read it, or use 'kaiming' (assumes ReLU)", StableTrainWarning, stacklevel=3)

    decisions: list[InitDecision] = []
    for name, module in leaves:
        kind = type(module).__name__
        # a frozen parameter (requires_grad=False: pretrained) is never redrawn, a module's or one beside a trainable one
        weight, bias = (getattr(module, attr, None) for attr in ("weight", "bias"))
        weight, bias = (t if isinstance(t, Tensor) and t.requires_grad else None for t in (weight, bias))
        own = list(module.parameters(recurse=False))
        if own and not any(p.requires_grad for p in own):  # frozen (pretrained): never redrawn
            decisions.append(InitDecision(name, kind, "frozen"))
            continue
        if isinstance(module, _LAYERS):
            follower = followers[name]
            assumed = unseen and scheme == "kaiming"
            if assumed:
                follower = nn.ReLU()
            act = activation_name(follower) if follower is not None else "linear"
            scale = residual_scale if name in residual_outs else 1.0
            if scheme == "normal":
                decision = InitDecision(name, kind, "normal", act, std=std * scale, residual_scale=scale)
            else:
                chosen = scheme if scheme != "auto" else ("xavier" if act in SATURATING else "kaiming")
                gain = activation_gain(follower)
                fan_in, fan_out = _fans(module, module.weight)
                base = gain / math.sqrt(fan_in) if chosen == "kaiming" else gain * math.sqrt(2.0 / (fan_in + fan_out))
                decision = InitDecision(name, kind, chosen, act, gain, "fan_in" if chosen == "kaiming" else "fan_avg",
                                        base * scale, scale, assumed)
            if weight is not None:
                nn.init.normal_(weight, 0.0, decision.std)
            else:  # (frozen: no std was drawn from)
                decision = dataclasses.replace(decision, std=None)
            if bias is not None:
                nn.init.zeros_(bias)
        elif isinstance(module, nn.Embedding):
            decision = InitDecision(name, kind, "normal", std=std if scheme == "normal" else 1.0)
            if weight is not None:
                nn.init.normal_(weight, 0.0, decision.std)
                if module.padding_idx is not None:
                    weight[module.padding_idx].zero_()
        elif is_norm(module) and list(module.parameters(recurse=False)):
            decision = InitDecision(name, kind, "norm")
            if weight is not None:
                nn.init.ones_(weight)
            if bias is not None:
                nn.init.zeros_(bias)
        elif list(module.parameters(recurse=False)):
            decision = InitDecision(name, kind, "kept")
        else:
            continue
        decisions.append(decision)
    for name, module in model.named_modules():  # parameters held by non-leaf modules (e.g. MultiheadAttention)
        if list(module.children()) and list(module.parameters(recurse=False)):
            decisions.append(InitDecision(name, type(module).__name__, "kept"))
    return decisions


def recommend_scheme(activations: Iterable[str | None]) -> str:
    """Return the scheme for a model whose layers are followed by ``activations`` (names or None).

    ``kaiming`` when every activation is ReLU-like, ``xavier`` when every one saturates (tanh,
    sigmoid), ``auto`` when both kinds are present or none was seen (auto picks per layer).
    """
    seen = {a for a in activations if a not in (None, "linear")}
    if not seen:
        return "auto"
    if seen <= SATURATING:
        return "xavier"
    if not seen & SATURATING:
        return "kaiming"
    return "auto"
