"""Tiny models with a planted numerical fault, shared by the NaN/Inf tests.

Each builder returns ``(model, batch)`` where the fault fires at a known module path. Every model is
a :class:`Stack`, so module paths read ``layers.<i>[.<child>]`` as ``named_modules()`` names them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset


class Stack(nn.Module):
    """Run ``layers`` in order (module paths ``layers.0``, ``layers.1``, ...)."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class LogFeatures(nn.Module):
    """log of ReLU output: -inf wherever the ReLU is zero (the classic unguarded log)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(F.relu(x))


class L2Normalize(nn.Module):
    """x / (||x|| + eps): finite forward at x = 0, but d sqrt/dx = 1/(2 sqrt(0)) makes backward NaN."""

    def forward(self, x: Tensor) -> Tensor:
        return x / (x.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)


class Standardize(nn.Module):
    """(x - mean) / std over features with no epsilon: a constant row divides zero by zero."""

    def forward(self, x: Tensor) -> Tensor:
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class HalfLinear(nn.Module):
    """A Linear computed in float16 (as a mixed-precision layer would); large activations overflow it."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_in, n_out).half()

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.half()).float()


class MaskedLog2(nn.Module):
    """``where(x > 2, log2(x), 2x)``: at x = 0 log2 gives -inf that the where masks out of the output, but
    the masked branch still gets a zero gradient, and Log2Backward0's 0 / (0 ln 2) is NaN."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.where(x > 2, torch.log2(x), 2 * x)


def _batch(n: int = 8, dim: int = 8, seed: int = 0) -> Tensor:
    return torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))


def log_of_zero() -> tuple[nn.Module, Tensor]:
    """Fault at ``layers.2`` (forward, aten.log.default)."""
    torch.manual_seed(0)
    return Stack(nn.Linear(8, 16), nn.ReLU(), LogFeatures(), nn.Linear(16, 4)), _batch()


def sqrt_at_zero(zero_row: int = 5) -> tuple[nn.Module, Tensor]:
    """Fault at ``layers.1`` (backward of sqrt): sample ``zero_row`` is all zeros, so its norm is 0."""
    torch.manual_seed(0)
    x = _batch()
    x[zero_row] = 0.0
    return Stack(nn.Linear(8, 16, bias=False), L2Normalize(), nn.Linear(16, 4)), x


def zero_std() -> tuple[nn.Module, Tensor]:
    """Fault at ``layers.1`` (forward, aten.div.Tensor): layer 0 outputs a constant row for every sample."""
    torch.manual_seed(0)
    model = Stack(nn.Linear(8, 16), Standardize(), nn.Linear(16, 4))
    with torch.no_grad():
        model.layers[0].weight.zero_()
        model.layers[0].bias.fill_(0.5)
    return model, _batch()


def masked_log2(zero_row: int = 5) -> tuple[nn.Module, Tensor]:
    """Fault at ``layers.1`` (forward aten.log2, masked; NaN in backward at Log2Backward0): inputs in [0, 4),
    sample ``zero_row`` all zeros; ``layers.0`` is an identity Linear so that the inputs have a gradient."""
    torch.manual_seed(0)
    x = torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) * 4
    x[zero_row] = 0.0
    model = Stack(nn.Linear(8, 8, bias=False), MaskedLog2(), nn.Linear(8, 4))
    with torch.no_grad():
        model.layers[0].weight.copy_(torch.eye(8))
    return model, x


def fp16_overflow() -> tuple[nn.Module, Tensor]:
    """Fault at ``layers.1.fc`` (forward, float16 addmm): outputs ~1e6 exceed float16's max of 65504."""
    torch.manual_seed(0)
    model = Stack(nn.Linear(8, 16), HalfLinear(16, 16), nn.Linear(16, 4))
    with torch.no_grad():
        model.layers[1].fc.weight.mul_(1e5)
    return model, _batch()


class Classifier(nn.Module):
    """Two-layer classifier (``body``, ``head``) for the data and optimizer faults."""

    def __init__(self, dim: int = 8, width: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(dim, width), nn.Tanh())
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


def classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def dataset_with_nan(n: int = 64, bad_index: int = 37, dim: int = 8) -> TensorDataset:
    """A classification dataset whose sample ``bad_index`` holds one NaN feature."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, dim, generator=g)
    y = torch.randint(0, 3, (n,), generator=g)
    x[bad_index, 3] = float("nan")
    return TensorDataset(x, y)


def regression_loss(model: nn.Module, batch: Tensor) -> Tensor:
    """Mean squared output: any model above maps a batch to a scalar loss with it."""
    return model(batch).float().pow(2).mean()


class LogSoftmax(nn.Module):
    """log(softmax(x)) in two ops: a logit far below its row's largest makes softmax 0 and its log -inf."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(torch.softmax(x, dim=-1))
