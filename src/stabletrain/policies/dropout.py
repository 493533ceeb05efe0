"""Dropout switched off for a comparison whose sides differ in batch shape (their masks cannot match).

``nn.Dropout`` modules, a module's own ``dropout`` (LSTM, GRU, RNN, MultiheadAttention), functional dropout in
the user's forward (``F.dropout`` and friends, ``scaled_dot_product_attention``'s ``dropout_p``) and hand-made masks
(``bernoulli_``, ``torch.bernoulli``: their expectation, e.g. timm's DropPath); every other layer (a batch norm)
behaves as in training. Used by the ``accum`` check and by a spike's removal search.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["dropout_off", "NoFunctionalDropout"]


#: Modules whose own float attribute ``dropout`` draws a mask inside their forward (not an nn.Dropout child).
_OWN_DROPOUT = (nn.RNNBase, nn.MultiheadAttention)
#: Functional dropouts; under :class:`NoFunctionalDropout` each returns its input.
_FUNCTIONAL_DROPOUT = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}


class NoFunctionalDropout(TorchFunctionMode):
    """Make the user's functional dropout the identity (and sdpa's ``dropout_p`` 0), and a hand-made mask its
    expectation (``bernoulli_(p)`` fills p, ``torch.bernoulli(probs)`` gives probs: timm's DropPath, which divides by
    the keep probability, is then the identity); count the calls that drew."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _FUNCTIONAL_DROPOUT:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and p > 0:
                self.calls += 1
                return args[0] if args else kwargs["input"]
        elif func is torch.Tensor.bernoulli_ and args and args[0].is_floating_point():  # (an integer mask: drawn)
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            self.calls += 1
            with torch.no_grad():
                return args[0].fill_(p) if isinstance(p, (int, float)) else args[0].copy_(p)
        elif func is torch.bernoulli and (kwargs.get("input", args[0] if args else None)).is_floating_point():
            source = kwargs.get("input", args[0] if args else None)
            p = kwargs.get("p", args[1] if len(args) > 1 else None)
            self.calls += 1
            return source.detach().clone() if p is None else torch.full_like(source, p)
        elif func is F.scaled_dot_product_attention:
            if len(args) > 4 and args[4]:  # (query, key, value, attn_mask, dropout_p, ...)
                self.calls += 1
                args = (*args[:4], 0.0, *args[5:])
            elif kwargs.get("dropout_p"):
                self.calls += 1
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


@contextlib.contextmanager
def dropout_off(model: nn.Module) -> Iterator[tuple[list[str], NoFunctionalDropout]]:
    """Switch every dropout off for the duration (training mode stays on); yield what was switched off (the modules
    whose p was above 0, and the functional mode, whose ``calls`` count the functional dropouts met).

    nn.Dropout modules get ``p = 0``; LSTM/GRU/RNN and MultiheadAttention get their own ``dropout = 0``;
    functional dropout runs as the identity (the yielded mode counts those calls). Everything is put back.
    """
    saved: list[tuple[nn.Module, str, float]] = []
    names = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)) and m.p:
            saved.append((m, "p", m.p))
            names.append(name)
        elif isinstance(m, _OWN_DROPOUT) and m.dropout:
            saved.append((m, "dropout", m.dropout))
            names.append(f"{name} (dropout={m.dropout:g})")
    for m, attr, _ in saved:
        setattr(m, attr, 0.0)
    mode = NoFunctionalDropout()
    try:
        with mode:
            yield names, mode
    finally:
        for m, attr, value in saved:
            setattr(m, attr, value)
