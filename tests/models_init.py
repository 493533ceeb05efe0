"""Tiny models for the initialization and signal-propagation tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ResidualBlock(nn.Module):
    """Pre-norm residual block ``x + out(relu(fc(norm(x))))``; ``out`` is the branch's output projection."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.out = nn.Linear(width, width)
        self.out.residual_branch_out = True

    def forward(self, x: Tensor) -> Tensor:
        return x + self.out(self.act(self.fc(self.norm(x))))


class ResidualStack(nn.Module):
    """``embed`` -> ``depth`` pre-norm residual blocks -> ``norm`` -> ``head`` (a classifier)."""

    def __init__(self, in_dim: int = 16, width: int = 64, depth: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CustomInit(nn.Module):
    """A layer that draws its own init in ``__init__`` (std 0.02) over nn.Linear's ``reset_parameters``."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


def classification_batch(num: int = 64, in_dim: int = 32, num_classes: int = 10, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Return a fixed (x ~ N(0, 1), random labels) batch."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num, in_dim, generator=g), torch.randint(0, num_classes, (num,), generator=g)


def classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread: tiny ops on a busy 2-core machine are much faster so."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
