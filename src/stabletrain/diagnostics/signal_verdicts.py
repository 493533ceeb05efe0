"""Each layer's reference and verdict in a :class:`~stabletrain.diagnostics.signal_propagation.SignalReport`.

A layer is compared with its counterparts (the same class, name pattern, shapes and leading size, in the same
recurrent segment): forward with the shallowest, backward with the deepest; a norm layer on its input; a recurrent
layer through time. A layer with no counterpart at all (one attention block, one head) is its own reference, which
no depth comparison can flag: it is judged against its own input instead, exploding where a weighted layer's output
std is more than :data:`GAIN_LIMIT` times its input's (a 30x ``in_proj_weight`` made one attention block 386x), vanishing
where it is less than 1/GAIN_LIMIT of it (a trial's MLP of three differently shaped layers, every weight N(0, 1e-3):
its signal fell 1e7-fold and each layer, with no counterpart, passed), but for the output layer and attention, which
may shrink it by design (a policy head at gain 0.01, attention averaging the tokens at init).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["assign_references", "GAIN_LIMIT", "OWN_INPUT"]

#: A weighted layer with no counterpart whose output std is more than this many times its input's explodes, less than
#: 1/this vanishes (PyTorch's default Linear/Conv init gives ~0.6x, Kaiming ~1.4x; N(0, 1) weights of fan-in 256 ~16x).
GAIN_LIMIT = 16.0
OWN_INPUT = "its own input"  # the reference of a layer judged against its input


def _group_key(layer: Any) -> tuple:
    """Return (class, name with list indices as '*', input shape, output shape, segment): a layer's counterparts.

    A recurrent layer's counterparts are the recurrent layers of any segment; a call of a module reused
    in different roles has none (its key is its own).
    """
    out = (layer.out_shape, layer.lead)
    if layer.own_reference:
        return layer.kind, layer.name, layer.in_shape, out, layer.index
    pattern = ".".join("*" if part.isdigit() else part for part in layer.name.split("#")[0].split("."))
    return layer.kind, pattern, layer.in_shape, out, None if layer.role == "recurrent" else layer.segment


def assign_references(layers: list[Any], thresholds: Any) -> None:
    """Set each :class:`~.signal_propagation.LayerSignal`'s references, ratios and verdicts (module docstring) under
    ``thresholds`` (:class:`~.signal_propagation.SignalThresholds`)."""
    groups: dict[tuple, list[Any]] = {}
    for layer in layers:
        groups.setdefault(_group_key(layer), []).append(layer)
    pooled: dict[tuple, list[Any]] = {}
    for key, members in groups.items():  # a layer with no counterpart joins the others of its class and shapes under the
        alone = len(members) == 1 and not members[0].own_reference  # same parent (fc1, fc2, fc3 of one model; not a
        # 1-block GPT-2's final LayerNorm and its block's ln_1, nor the embeddings' dropout and an attention branch's)
        pooled.setdefault((key[0], _parent(members[0]), *key[2:]) if alone else key, []).extend(members)
    # (the output layer and sequence-mixing attention may shrink their input's std by design: a policy head at gain 0.01,
    # a one-output regression's small weight, attention averaging tokens at init: not judged vanishing against it)
    output = max((layer.index for layer in layers if layer.param_name is not None), default=None)
    for members in pooled.values():
        members.sort(key=lambda layer: layer.index)
        fwd_ref = members[0]
        with_grad = [m for m in members if m.grad_std]  # (a std of 0, a constant gradient's (a mean loss), is no reference)
        bwd_ref = with_grad[-1] if with_grad else None
        for layer in members:
            if layer.role != "embedding":  # a lookup: its output scale is its init, there is no input to preserve
                layer.ref_forward = fwd_ref.name
                layer.forward_ratio = _ratio(layer.signal_std, fwd_ref.signal_std)
            layer.param_std_ratio = _ratio(layer.param_std, fwd_ref.param_std)
            if bwd_ref is not None and layer.grad_std is not None:
                layer.param_grad_ratio = _ratio(layer.param_grad_std, bwd_ref.param_grad_std)
                if layer.role != "recurrent" and (layer.grad_std or not layer.grad_absmax):  # (a constant gradient: its
                    layer.ref_backward = bwd_ref.name  # std of 0 is no vanishing; an all-0 one is, said below too)
                    layer.backward_ratio = _ratio(layer.grad_std, bwd_ref.grad_std)
            # Through time, not through depth: the output at the last time step vs the middle one, and the
            # gradient reaching the input's first time step vs the middle one. The middle (not the other end)
            # keeps out the zero initial state forward and the last steps' short future backward.
            if layer.role == "recurrent" and layer.time_out_mid is not None:
                layer.ref_forward = f"{layer.name} at its middle time step"
                layer.forward_ratio = _ratio(layer.time_out_last, layer.time_out_mid)
            if layer.role == "recurrent" and layer.time_grad_first is not None:
                layer.ref_backward = f"{layer.name} at its middle time step"
                layer.backward_ratio = _ratio(layer.time_grad_first, layer.time_grad_mid)
            if layer.forward_ratio is None and layer.ref_forward and layer.silent and not _own_function(layer):
                layer.forward_ratio = 0.0  # 0 vs a reference of 0 (dead too)
            gain = _ratio(layer.out_std, layer.in_std) if layer.in_std else None  # (an input of 0: no gain to speak of)
            shrinks = gain is not None and gain < 1 / GAIN_LIMIT and layer.index != output and "Attention" not in layer.kind
            if (len(members) == 1 and not layer.role and not layer.is_norm and layer.param_name is not None
                    and gain is not None and (gain > GAIN_LIMIT or shrinks)):  # no counterpart: against its own input
                layer.ref_forward, layer.forward_ratio = OWN_INPUT, gain
            if layer.in_std == 0 and not layer.silent and layer.forward_ratio is not None and layer.ref_forward != OWN_INPUT:
                layer.forward_ratio = None  # a constant input (a call on zeros): its output is its offsets, no signal of
                # any input's, and no init's doing (a trial's lin(x + s) - lin(s) at s = 0 'vanished' at lin#1)
            layer.forward = thresholds.verdict(layer.forward_ratio)
            if layer.forward == "ok" and layer.collapsed:  # its std is its offsets': the input's signal is gone
                layer.forward = "vanishing"
            layer.backward = thresholds.verdict(layer.backward_ratio)
    # A trainable layer whose output's gradient is exactly 0 (every element) where others' are not: vanished, in any
    # group (the layers before a zero-initialized head; not a constant gradient's std of 0, a WGAN critic's mean)
    reached = [layer for layer in layers if layer.grad_absmax and layer.grad_std]
    for layer in layers:
        if (reached and layer.grad_absmax == 0 and layer.param_name is not None and not layer.frozen
                and layer.backward == "ok" and layer.role != "recurrent"):
            layer.ref_backward, layer.backward_ratio = reached[-1].name, 0.0
            layer.backward = thresholds.verdict(0.0)


def _parent(layer: Any) -> str:
    """The pattern of the module a layer sits in (list indices as '*'): where it plays the same role as its siblings."""
    parts = layer.name.split("#")[0].split(".")[:-1]
    return ".".join("*" if part.isdigit() else part for part in parts)


def _own_function(layer: Any) -> bool:
    """Whether a layer's output is a function of its input no init can scale: no parameter, not an activation (whose dead
    units the layer before sets) nor a norm (a user's ``torch.log`` of a feature that is 1 everywhere is 0 by design)."""
    return layer.param_name is None and not layer.activation and not layer.is_norm


def _ratio(value: float | None, ref: float | None) -> float | None:
    if value is None or ref is None:
        return None
    if not (math.isfinite(value) and math.isfinite(ref)):
        return math.inf
    if ref == 0:
        return None if value == 0 else math.inf
    return value / ref
