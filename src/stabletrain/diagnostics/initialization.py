"""Initialization, checked: a fingerprint that catches an init being overwritten before the first step.

``InitFingerprint`` is a cheap fingerprint of every parameter (std and a hash of its bytes), taken
right after the user's init and compared again before the first step: it names every parameter
whose values changed in between (a ``reset_parameters()`` call, a meta-device ``to_empty`` +
``reset_parameters`` path or a wrapper that re-creates the modules; pytorch #104187, #90465). The init
schemes themselves (``init_``) are :mod:`stabletrain.tasks.init_schemes`.

Zero-initialized layers: :func:`zero_init_layers` finds the layers of a signal report whose weight is all 0
and tells the deliberate ones (an output layer, or the last layer of a residual branch: GPT/DiT/ReZero-style
zero-init, where the model's output or the branch starts at 0 and moves from the first update on) from a zero
layer nothing gets around. A deliberate zero layer makes the signal report meaningless at step 0 (its output
is 0 and no gradient reaches the layers before it); :func:`zero_layers_small` and :func:`excluding` measure
the rest of the model without it: its weight at :data:`ZERO_INIT_SCALE` x a fan-in init, and its own rows
neither judged nor anyone's reference.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .signal_propagation import SignalReport

__all__ = ["ParamFingerprint", "InitChange", "InitFingerprint", "ZeroInitLayer", "zero_init_layers", "zero_layers_small",
           "excluding", "architectures", "fails_too", "ZERO_INIT_SCALE", "OUTPUT_LAYER", "RESIDUAL_END", "ARCHITECTURE_BAND"]


# -- the fingerprint ---------------------------------------------------------------------------------

# Prefixes that wrappers put in front of parameter names (DDP, torch.compile, FSDP1, checkpoint wrappers).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _strip_wrappers(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
        name = name.replace("._fsdp_wrapped_module.", ".").replace("._checkpoint_wrapped_module.", ".")
    return name


@dataclass(frozen=True)
class ParamFingerprint:
    """One parameter's fingerprint: shape, dtype, std and a 64-bit BLAKE2 hash of its bytes."""

    shape: tuple[int, ...]
    dtype: str
    std: float
    digest: str


@dataclass
class InitChange:
    """A parameter whose values differ from its fingerprint: its name, old and new std and why."""

    name: str
    old_std: float | None
    new_std: float | None
    why: str  # values changed | shape changed | dtype changed | missing | new

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "old_std": self.old_std, "new_std": self.new_std, "why": self.why}


def _fingerprints(model: nn.Module) -> tuple[dict[str, ParamFingerprint], list[str]]:
    named = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
    skipped = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if not named:
        return {}, skipped
    # All stds in one host sync; an empty or one-element parameter has std 0.
    stds = torch.stack([p.detach().double().std() if p.numel() > 1 else p.new_zeros((), dtype=torch.float64)
                        for _, p in named]).cpu().tolist()
    out = {}
    for (name, p), std in zip(named, stds):
        raw = p.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()  # once per run: a copy is fine
        digest = hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest()
        out[_strip_wrappers(name)] = ParamFingerprint(tuple(p.shape), str(p.dtype).replace("torch.", ""), std, digest)
    return out, skipped


class InitFingerprint:
    """The std and hash of every parameter, to check that nothing re-initializes the model unseen.

    Take it right after the model is built (``InitFingerprint.take(model)``) and ``compare(model)``
    before the first optimizer step. Names are matched after dropping the prefixes wrappers add
    (``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``), so wrapping the model is not a change;
    moving it to another device is not a change either (the bytes are the same). Parameters on the
    meta device have no values and are left out (listed in ``skipped``). Each call forces one
    host-device sync and copies every parameter to the host once to hash it.
    """

    def __init__(self, params: dict[str, ParamFingerprint], skipped: list[str] | None = None) -> None:
        self.params = params
        self.skipped = list(skipped or [])

    @classmethod
    def take(cls, model: nn.Module) -> InitFingerprint:
        """Return the fingerprint of every parameter of ``model`` (tied parameters once)."""
        return cls(*_fingerprints(model))

    def compare(self, model: nn.Module, std_rtol: float = 1e-2) -> list[InitChange]:
        """Return every parameter of ``model`` whose values differ from this fingerprint (empty: none).

        A parameter whose dtype changed (the model was cast) can only be compared by its std: it is
        reported when its std moved by more than ``std_rtol`` (relative).
        """
        now, _ = _fingerprints(model)
        changes = []
        for name, old in self.params.items():
            new = now.get(name)
            if new is None:
                changes.append(InitChange(name, old.std, None, "missing"))
            elif new.shape != old.shape:
                changes.append(InitChange(name, old.std, new.std, "shape changed"))
            elif new.dtype != old.dtype:
                if abs(new.std - old.std) > std_rtol * max(abs(old.std), 1e-12):
                    changes.append(InitChange(name, old.std, new.std, "dtype changed"))
            elif new.digest != old.digest:
                changes.append(InitChange(name, old.std, new.std, "values changed"))
        changes += [InitChange(name, None, new.std, "new") for name, new in now.items() if name not in self.params]
        return changes

    @classmethod
    def before_forward(cls, model: nn.Module) -> InitFingerprint | None:
        """:meth:`take`, or None for a lazy module (its parameters have no values before its first forward)."""
        try:
            return cls.take(model)
        except (ValueError, RuntimeError):
            return None

    def redrawn(self, model: nn.Module) -> list[InitChange]:
        """The parameters a measuring forward and backward changed (they change none): re-drawn by the model's own
        forward (a lazy init on the first call). An embedding's max_norm renormalizes its rows by design: not counted."""
        renormed = {f"{m}.weight".lstrip(".") for m, mod in model.named_modules()
                    if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.max_norm is not None}
        return [c for c in self.compare(model) if c.name not in renormed]

    @staticmethod
    def describe(changes: list[InitChange], limit: int = 5) -> str:
        """Return a one-line reason for an ``init_overwritten`` event ('' when nothing changed)."""
        if not changes:
            return ""

        def one(c: InitChange) -> str:
            old = "-" if c.old_std is None else f"{c.old_std:.4g}"
            new = "-" if c.new_std is None else f"{c.new_std:.4g}"
            return f"{c.name} (std {old} -> {new}, {c.why})"

        shown = ", ".join(one(c) for c in changes[:limit])
        more = f" and {len(changes) - limit} more" if len(changes) > limit else ""
        return (f"{len(changes)} parameter(s) changed between the model's init and the first step: {shown}{more}; "
                "something overwrote them (a reset_parameters() call, to_empty() on a meta-device model, a wrapper "
                "that rebuilds modules, or a load_state_dict): a deliberate load of trained weights is fine; otherwise "
                "initialize after that, or not before it")

    def state_dict(self) -> dict[str, Any]:
        return {"params": {n: asdict(f) for n, f in self.params.items()}, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.params = {n: ParamFingerprint(tuple(f["shape"]), f["dtype"], f["std"], f["digest"])
                       for n, f in state["params"].items()}
        self.skipped = list(state["skipped"])


# -- zero-initialized layers -------------------------------------------------------------------------

#: A deliberate zero weight is measured at this fraction of a fan-in init (std scale / sqrt(fan_in); a 1-d weight:
#: filled with it): about its first update's size (Adam moves each element by about lr), small enough that the forward
#: is as built (a residual branch still adds ~nothing), nonzero so that the gradient reaches the layers before it.
ZERO_INIT_SCALE = 1e-3
OUTPUT_LAYER = "the output layer"
RESIDUAL_END = "the last layer of a residual branch"


@dataclass
class ZeroInitLayer:
    """A leaf module whose weight (the parameter a signal report describes it by) is all 0 as built.

    Attributes:
        name: the module's name.
        param: its zero parameter's name.
        layers: its calls' names in the signal report (``name``, or ``name#k`` for a module called several times).
        role: :data:`OUTPUT_LAYER` (no layer with a parameter runs after it), :data:`RESIDUAL_END` (the signal goes
            around it: the next layer's input std is more than ``SignalThresholds.explode`` x its output std, and
            nonzero), or ``""`` (neither: nothing gets around it, every call of it must be one of the two).
        around: for :data:`RESIDUAL_END`, the input std of the layer after it (the residual stream).
    """

    name: str
    param: str
    layers: list[str]
    role: str
    around: float | None = None

    @property
    def deliberate(self) -> bool:
        return bool(self.role)


def zero_init_layers(model: nn.Module, report: SignalReport) -> list[ZeroInitLayer]:
    """Return the layers of ``report`` (measured on ``model``) whose weight is all 0, in execution order."""
    from ..tasks.init_schemes import TRANSPARENT

    modules = dict(model.named_modules(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    layers = report.layers
    calls: dict[str, list[int]] = {}
    for i, layer in enumerate(layers):
        calls.setdefault(layer.name.split("#")[0], []).append(i)
    found = []
    for name, at in calls.items():
        param = params.get(layers[at[0]].param_name or "")
        if param is None or param.numel() == 0 or not param.is_floating_point() or bool(param.detach().ne(0).any()):
            continue
        roles, around = [], None
        for i in at:
            after = layers[i + 1:]
            if not any(layer.param_name for layer in after):
                roles.append(OUTPUT_LAYER)
                continue
            nxt = next((layer for layer in after if not isinstance(modules.get(layer.name.split("#")[0]), TRANSPARENT)),
                       None)
            if (nxt is not None and nxt.in_std is not None and math.isfinite(nxt.in_std) and nxt.in_std > 0
                    and nxt.in_std > report.thresholds.explode * layers[i].out_std):
                roles.append(RESIDUAL_END)
                around = nxt.in_std if around is None else min(around, nxt.in_std)
            else:
                roles.append("")
        role = roles[0] if all(roles) and len(set(roles)) == 1 else RESIDUAL_END if all(roles) else ""
        found.append(ZeroInitLayer(name, layers[at[0]].param_name or "", [layers[i].name for i in at], role,
                                   around if role == RESIDUAL_END else None))
    return found


def zero_layers_small(model: nn.Module, zero: list[ZeroInitLayer], scale: float = ZERO_INIT_SCALE,
                      seed: int = 0) -> nn.Module:
    """Return a copy of ``model`` (tied weights stay tied) whose ``zero`` layers' weight is ``scale`` x a fan-in init:
    N(0, scale^2 / fan_in) for a weight of 2 dimensions or more, filled with ``scale`` for a 1-d one (a norm's gain).
    Drawn from a generator seeded with ``seed``: the caller's RNG is left as it was."""
    twin = copy.deepcopy(model)
    params = dict(twin.named_parameters(remove_duplicate=False))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for z in zero:
            p = params[z.param]
            if p.dim() >= 2:
                fan_in = p.numel() // p.shape[0]
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32).mul_(scale / math.sqrt(fan_in)))
            else:
                p.fill_(scale)
    return twin


def excluding(report: SignalReport, zero: list[ZeroInitLayer], *, label: str,
              as_built: SignalReport | None = None) -> SignalReport:
    """Return ``report`` judged without the ``zero`` layers: their rows get no ratio and no verdict, and no other layer
    is compared with them (a layer they were pooled with is compared with its other counterparts, or with none).
    ``as_built``: the report of the model as built, whose update ratios the zero layers' parameters keep (0 at init:
    no ratio; the measured copy's weights are not theirs)."""
    from .signal_propagation import OK
    from .signal_verdicts import assign_references

    names = {name for z in zero for name in z.layers}
    layers = copy.deepcopy(report.layers)
    for layer in layers:
        layer.ref_forward = layer.ref_backward = ""
        layer.forward_ratio = layer.backward_ratio = layer.param_std_ratio = layer.param_grad_ratio = None
        layer.forward = layer.backward = OK
        layer.own_reference = layer.own_reference or layer.name in names  # a group of its own
    assign_references(layers, report.thresholds)
    for layer in layers:
        if layer.name in names:
            layer.ref_forward = layer.ref_backward = ""
            layer.forward_ratio = layer.backward_ratio = layer.param_std_ratio = layer.param_grad_ratio = None
            layer.forward = layer.backward = OK
    updates = report.updates
    if as_built is not None:
        built = {u.name: u for u in as_built.updates}
        params = {z.param for z in zero}
        updates = [built.get(u.name, u) if u.name in params else u for u in report.updates]
    return dataclasses.replace(report, label=label, layers=layers, updates=updates)


#: A flag that a re-initialization with the recommended scheme leaves at the same layer, in the same direction, within
#: this factor of its ratio, is the architecture's, not the init's.
ARCHITECTURE_BAND = 2.0


def architectures(built: SignalReport, reinit: SignalReport) -> str | None:
    """Why ``built``'s flag is the architecture's and no init's (None: it is not): ``reinit``, the same model re-initialized
    with the recommended scheme (:attr:`SignalReport.recommended`), is flagged at the same first layer in the same
    direction within :data:`ARCHITECTURE_BAND` of its ratio. A BatchNorm ResNet's gradient grows toward the input
    through its residual additions (5.8x over 4 blocks) whatever the convolutions' init: the norms undo their scale."""
    said = []
    for direction in ("forward", "backward"):
        a = built.first_forward if direction == "forward" else built.first_backward
        if a is None:
            continue
        b = reinit.first_forward if direction == "forward" else reinit.first_backward
        x, y = getattr(a, f"{direction}_ratio"), getattr(b, f"{direction}_ratio") if b is not None else None
        if (b is None or b.name != a.name or getattr(b, direction) != getattr(a, direction) or x is None or y is None
                or not (0 < x < math.inf and 0 < y < math.inf) or max(x / y, y / x) > ARCHITECTURE_BAND):
            return None  # (a non-finite ratio: the batch's NaN/Inf, no architecture's)
        verb = "explodes" if getattr(a, direction) == "exploding" else "vanishes"
        said.append(f"{direction} {verb} at #{a.index} {a.name!r} ({x:.3g}x; init_(model, {built.recommended!r}): {y:.3g}x)")
    if not said:
        return None
    if built.lost_in_frozen():  # (pretrained weights, which init_ leaves as they are)
        return f"{' and '.join(said)} whatever the init: its weights are frozen (requires_grad=False), which no init redraws"
    norms = any(layer.is_norm for layer in built.layers)
    return (f"{' and '.join(said)} whatever the init: the architecture's, not the init's" + (
        " (residual additions grow the gradient toward the input where norm layers undo the weights' scale; "
        "zero-initializing the last norm layer's weight in each residual block, torchvision's zero_init_residual=True, "
        "starts each block as the identity)" if norms else ""))


def fails_too(built: SignalReport, reinit: SignalReport) -> str | None:
    """The advice where the scheme for ``built``'s activations fails too (``reinit``: the same model re-initialized with
    it, flagged), so it is not recommended (None: it passes). A trial: a residual net at Kaiming was told to use Kaiming.
    """
    from .loss_at_init import flagged_at

    if reinit.passed:
        return None
    where = next((f", {d} {flagged_at(reinit, d)}" for d in ("forward", "backward") if flagged_at(reinit, d) != "ok"), "")
    return (f"no init advice: init_(model, {built.recommended!r}), the scheme for these activations, fails here too "
            f"({len(reinit.flagged)} of {len(reinit.layers)} layers flagged{where}): the init alone does not fix it; in a "
            "residual network, mark each branch's output layer residual_branch_out = True and init_ scales it by "
            "1/sqrt(the number of branches) (stabletrain check init --compare tries schemes)")
