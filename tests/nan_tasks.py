"""A user's own model for the NaN diagnosis tests: keyword batches, a per-sample weight through a log, an output object.

``WeightedNet`` returns its loss inside an object, as Hugging Face models do: a ``types.SimpleNamespace``, a
dataclass or a dict (``output``). A sample whose weight ``w`` is negative makes ``log(w)`` NaN in the root module's
forward, and the loss NaN: that sample alone is bad. Importable by module path, so that ``stabletrain diagnose``
rebuilds the model and the loss in a fresh process.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass
class Output:
    loss: Tensor
    logits: Tensor


class Opaque:
    """An output whose tensors no walk can read (slots, no ``__dict__``): only ``.loss`` tells."""

    __slots__ = ("loss", "logits")

    def __init__(self, loss: Tensor, logits: Tensor) -> None:
        self.loss, self.logits = loss, logits


class WeightedNet(nn.Module):
    """Linear -> BatchNorm1d (or Identity) -> ReLU -> Linear; loss = mean((out - y)^2 * exp(log w)), returned in a
    ``"namespace"``, ``"dataclass"``, ``"dict"`` or ``"opaque"`` output (:class:`Opaque`)."""

    def __init__(self, batch_norm: bool = True, output: str = "namespace") -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 16), nn.Linear(16, 1)
        self.bn = nn.BatchNorm1d(16) if batch_norm else nn.Identity()
        self.output = output

    def forward(self, x: Tensor, y: Tensor, w: Tensor) -> object:
        out = self.l2(torch.relu(self.bn(self.l1(x)))).float()
        loss = ((out - y) ** 2 * torch.log(w).unsqueeze(-1).exp()).mean()
        if self.output == "dict":
            return {"loss": loss, "logits": out}
        if self.output == "dataclass":
            return Output(loss, out)
        if self.output == "opaque":
            return Opaque(loss, out)
        return types.SimpleNamespace(loss=loss, logits=out)


def weighted_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    out = model(**batch)
    return out["loss"] if isinstance(out, dict) else out.loss


def weighted_batches(num: int, size: int = 8, seed: int = 1) -> list[dict[str, Tensor]]:
    """``num`` batches of ``size`` samples: x, y = 0.3 * sum(x), w = 1."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        x = torch.randn(size, 8, generator=g)
        out.append({"x": x, "y": x.sum(1, keepdim=True) * 0.3, "w": torch.ones(size)})
    return out
