"""Init schemes that read the activation after each layer (what a task's model factory calls).

``init_`` re-initializes a model in place. For every Linear / Conv layer it looks at the activation
module that follows it (the next leaf module in registration order, skipping Dropout and Identity)
and picks the gain and fan mode from it; biases are zeroed; normalization layers get weight 1 and
bias 0; the output projections of residual branches are scaled by ``1/sqrt(number of residual
branches)`` so that the residual stream does not grow with depth (GPT-2's ``1/sqrt(2 * n_layer)``:
a transformer block has two branches). A residual branch's output projection is marked by the
attribute ``residual_branch_out = True`` on the module, or named in ``init_(..., residual=[...])``.

It lives beside the tasks (the bottom layer) because the built-in tasks build their models with it;
:mod:`stabletrain.diagnostics.initialization` checks that an init survives until the first step.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = [
    "SCHEMES",
    "RESIDUAL_MARKER",
    "InitDecision",
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
_TRANSPARENT = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Identity, nn.Flatten,
                nn.Unflatten)
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


@dataclass
class InitDecision:
    """What ``init_`` did to one module: the scheme, the activation it read, the std it drew from."""

    name: str
    kind: str
    scheme: str  # xavier | kaiming | normal | norm (weight 1, bias 0) | kept (not a layer init_ knows)
    activation: str | None = None  # the activation that follows ("linear" when none)
    gain: float | None = None
    fan_mode: str | None = None  # fan_in | fan_avg
    std: float | None = None  # of the weight, after the residual scale
    residual_scale: float = 1.0

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
        if isinstance(module, _TRANSPARENT):
            continue
        return module if activation_name(module) is not None else None
    return None


def _is_residual_out(name: str, module: nn.Module, patterns: list[str]) -> bool:
    return bool(getattr(module, RESIDUAL_MARKER, False)) or any(fnmatch.fnmatchcase(name, p) for p in patterns)


@torch.no_grad()
def init_(model: nn.Module, scheme: str = "auto", *, std: float = 1.0, residual: Iterable[str] = (),
          num_residual_branches: int | None = None) -> list[InitDecision]:
    """Re-initialize ``model`` in place with ``scheme``; return what was done to each module.

    Schemes (weights drawn from a normal distribution, biases zeroed, norms set to weight 1, bias 0):

    - ``kaiming``: std = gain / sqrt(fan_in), gain from the activation that follows.
    - ``xavier``: std = gain * sqrt(2 / (fan_in + fan_out)), gain from the activation that follows.
    - ``auto``: xavier for layers followed by a saturating activation (tanh, sigmoid, softsign),
      kaiming for every other layer (ReLU-like activations, and none, where it is LeCun's 1/sqrt(fan_in)).
    - ``normal``: N(0, std^2) for every weight, whatever follows (``std=0.02`` is GPT-2's).

    The activation that follows a layer is the next leaf module in registration order, skipping
    Dropout / Identity / Flatten; an activation called functionally in ``forward`` cannot be seen,
    and such a layer is treated as followed by none (gain 1). Embeddings (a lookup: fan-in 1) get
    N(0, 1), or N(0, std^2) under ``normal``. Residual branch outputs (``residual_branch_out = True``
    or a name matching a glob in ``residual``) get their std times ``1/sqrt(num_residual_branches)``
    (default: the number of such modules). A weight shared by several modules (tied embeddings) is
    left as the last of them initializes it. Modules with parameters that are none of these are
    left as they are (``scheme="kept"``). Draws from torch's global RNG.
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

    decisions: list[InitDecision] = []
    for i, (name, module) in enumerate(leaves):
        kind = type(module).__name__
        weight = getattr(module, "weight", None)
        bias = getattr(module, "bias", None)
        if isinstance(module, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d,
                               nn.ConvTranspose3d)):
            follower = _following(leaves, i)
            act = activation_name(follower) if follower is not None else "linear"
            scale = residual_scale if name in residual_outs else 1.0
            if scheme == "normal":
                decision = InitDecision(name, kind, "normal", act, std=std * scale, residual_scale=scale)
            else:
                chosen = scheme if scheme != "auto" else ("xavier" if act in SATURATING else "kaiming")
                gain = activation_gain(follower)
                fan_in, fan_out = _fans(module, weight)
                base = gain / math.sqrt(fan_in) if chosen == "kaiming" else gain * math.sqrt(2.0 / (fan_in + fan_out))
                decision = InitDecision(name, kind, chosen, act, gain, "fan_in" if chosen == "kaiming" else "fan_avg",
                                        base * scale, scale)
            nn.init.normal_(weight, 0.0, decision.std)
            if bias is not None:
                nn.init.zeros_(bias)
        elif isinstance(module, nn.Embedding):
            decision = InitDecision(name, kind, "normal", std=std if scheme == "normal" else 1.0)
            nn.init.normal_(weight, 0.0, decision.std)
            if module.padding_idx is not None:
                weight[module.padding_idx].zero_()
        elif is_norm(module) and list(module.parameters(recurse=False)):
            decision = InitDecision(name, kind, "norm")
            if isinstance(weight, Tensor):
                nn.init.ones_(weight)
            if isinstance(bias, Tensor):
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
