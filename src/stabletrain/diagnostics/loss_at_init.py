"""The loss at init (Karpathy's "verify loss @ init"): the first loss against an uninformed output's.

The same batch's loss with the model's output set to 0 (:func:`uninformed_loss`) is the uninformed guess: a uniform
distribution for a classifier's logits, ln C. Where the loss is such a cross-entropy, a first loss at
:data:`LOSS_AT_INIT_LIMIT` times it or more fails: the output starts confidently wrong (a head tied to an embedding of
std 1). :func:`judge_loss_at_init` says it for a signal report (:mod:`.signal_propagation`): ``stabletrain check
init`` and a run's step-0 report (:mod:`stabletrain.services.init_signal`) both read it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..numerics import buffers_kept
from ..policies.accumulation import as_sum_count
from ..records.batches import batch_size
from .signal_propagation import EXPLODING, SignalReport

__all__ = ["LOSS_AT_INIT_LIMIT", "INPUT_SCALE", "uninformed_loss", "uniform_classes", "loss_at_init", "judge_loss_at_init",
           "flagged_at"]

#: A classifier's first loss this many times a uniform guess's (its logits set to 0: ln C) fails the check: the output
#: starts confidently wrong (Karpathy's "verify the loss at init"). Healthy heads start within ~1.1x (the mlp 1.02x,
#: the gpt 0.99x; init_(model, 'kaiming') on a ReLU MLP of ten classes 1.6x, its head at gain 1); a head tied to an
#: embedding of std 1 reaches 2.2x (tanh features) to 16x.
LOSS_AT_INIT_LIMIT = 2.0


def flagged_at(report: SignalReport, direction: str) -> str:
    first = report.first_forward if direction == "forward" else report.first_backward
    if first is None:
        return "ok"
    ratio = first.forward_ratio if direction == "forward" else first.backward_ratio
    verdict = first.forward if direction == "forward" else first.backward
    value = first.signal_std if direction == "forward" else first.grad_std
    if value is not None and not math.isfinite(value):  # (a NaN's ratio is no explosion: a sample or an op made it)
        return f"non-finite at #{first.index} {first.name}"
    return f"{verdict} at #{first.index} {first.name} ({'-' if ratio is None else f'{ratio:.3g}x'})"


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


def loss_at_init(first: float, probe: tuple[float, float, int] | None, exploding: str | None = None,
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
                         f"explodes before it ({exploding}): fix what makes it explode there (each layer's std is in the "
                         "step-0 report), not the output layer alone"), True
    return numbers, (f"{head}: the output starts confidently wrong, its std {std:.3g} at step 0. Scale the output layer's "
                     "init down (std ~0.02, or zero-init it); a head tied to an embedding of std 1 gives logits of std "
                     "~sqrt(width): init the embedding at std ~0.02"), True


def judge_loss_at_init(report: SignalReport, first: float, probe: tuple[float, float, int] | None, batch: Any
                       ) -> tuple[dict[str, float], str | None, bool]:
    """:func:`loss_at_init` for a signal report's model (``report``: as judged; ``first``: the first loss as built):
    where its forward explodes, its first layer's input's std, and the batch's item counts."""
    start = report.first_forward
    exploding = flagged_at(report, "forward") if start is not None and start.forward == EXPLODING else None
    head = report.layers[0] if report.layers else None  # (an embedding's input is token ids: no scale of the data's)
    input_std = (head.in_std if head is not None and head.role != "embedding" and not head.is_norm and not head.call
                 else None)  # (a norm first: the data's scale is normalized already)
    targets = batch[-1] if isinstance(batch, (tuple, list)) and batch and isinstance(batch[-1], torch.Tensor) else None
    items = sorted({batch_size(batch), *([targets.numel()] if targets is not None else [])})
    return loss_at_init(first, probe, exploding, input_std, items)
