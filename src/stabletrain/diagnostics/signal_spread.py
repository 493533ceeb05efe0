"""How much a layer's output varies across the batch: the signal of its input it carries, apart from its offsets.

A layer's std over all its elements counts a feature's offset that is the same for every sample (a bias, a mean carried
through) as signal: a deep ReLU net under PyTorch's default init held a std of 0.07 at every depth while its outputs
were 2e-5 apart from one sample to another. :func:`spread` measures each feature's variation across the batch, and
:func:`spreads_by_call` every leaf call's, from a forward with dropout off (its draw varies a constant across the batch).
:mod:`.signal_propagation` calls a weighted layer whose output varies by less than :data:`COLLAPSE` of its std, where its
input varies, vanishing.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..numerics import buffers_kept
from ..policies.dropout import dropout_off

__all__ = ["COLLAPSE", "first_tensor", "spread", "spreads_by_call", "std"]

#: A weighted layer whose output varies across the batch by less than this share of its std carries no signal of its input.
COLLAPSE = 1e-2


def std(x: Tensor) -> Tensor:
    """``x``'s std over all its elements (detached, float32); 0 for a single element."""
    x = x.detach().float()
    return x.std() if x.numel() > 1 else torch.zeros((), device=x.device)


def spread(x: Tensor) -> Tensor:
    """How much each of ``x``'s features varies across the batch (its first axis), their RMS; one sample: its std."""
    return x.detach().float().var(dim=0, unbiased=False).mean().sqrt() if x.dim() >= 2 and x.shape[0] > 1 else std(x)


def first_tensor(x: Any) -> Tensor | None:
    """The first floating-point tensor in ``x`` (tuples, lists and dicts walked in order), or None."""
    if isinstance(x, Tensor):
        return x if x.is_floating_point() else None
    items = x.values() if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else ()
    return next((t for t in map(first_tensor, items) if t is not None), None)


def spreads_by_call(model: nn.Module, batch: Any, loss: Callable[[nn.Module, Any], Any], leaves: list) -> dict:
    """Each leaf call's output and input spread (:func:`spread`; NaN: no input), by (module, its call number), from a
    forward without dropout (its draw varies a constant across the batch: no signal of the input); the model's buffers
    put back. Gradients stay on (a loss may take one: a gradient penalty); a forward that fails measures nothing."""
    out: dict[tuple[int, int], Tensor] = {}
    nth: Counter[int] = Counter()

    def hook(module: nn.Module, inputs: tuple, output: Any) -> None:
        t, x = first_tensor(output), first_tensor(inputs)
        if t is not None and t.numel():  # (the calls the report numbers: a floating, non-empty output)
            nth[id(module)] += 1
            out[(id(module), nth[id(module)])] = torch.stack(
                [spread(t), spread(x).to(t.device) if x is not None and x.numel() else torch.tensor(math.nan, device=t.device)])

    handles = [m.register_forward_hook(hook) for _, m in leaves]
    try:
        with buffers_kept(model), dropout_off(model):
            loss(model, batch)
    except Exception:  # noqa: BLE001  (the report itself ran this loss; what differs here is dropout alone)
        return {}
    finally:
        for h in handles:
            h.remove()
    return out
