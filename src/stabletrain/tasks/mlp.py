"""The built-in ``mlp`` task: synthetic classification that trains in seconds (for tests and checks).

Inputs are Gaussian; labels come from a fixed random teacher network, so the task is learnable.
The loss is a scalar mean, which exercises the "mean loss" side of the task contract.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from . import Task

__all__ = ["make_mlp", "make_task"]

_ACTS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}


def make_mlp(in_dim: int, width: int, depth: int, out_dim: int, activation: str = "relu", dropout: float = 0.0) -> nn.Sequential:
    """Return ``depth`` Linear layers of ``width`` with ``activation`` (and dropout) between them."""
    if activation not in _ACTS:
        raise ValueError(f"task_args.activation: expected one of {', '.join(_ACTS)}, got {activation!r}")
    if depth < 1:
        raise ValueError(f"task_args.depth: expected an integer >= 1, got {depth!r}")
    layers: list[nn.Module] = []
    dims = [in_dim] + [width] * (depth - 1) + [out_dim]
    for i in range(depth):
        layers.append(nn.Linear(dims[i], dims[i + 1]))
        if i < depth - 1:
            layers.append(_ACTS[activation]())
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


def classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def make_task(num_samples: int = 4096, in_dim: int = 32, width: int = 128, depth: int = 3, num_classes: int = 10,
              activation: Literal["relu", "tanh", "gelu"] = "relu", dropout: float = 0.0, data_seed: int = 1234) -> Task:
    """A teacher-labelled Gaussian classification task; the data does not depend on the run's seed.

    Args:
        num_samples: training samples (and an eighth as many more for validation).
        in_dim: input features.
        width: width of the hidden layers.
        depth: Linear layers (at least 1; depth - 1 hidden layers).
        num_classes: output classes.
        activation: the activation between the Linear layers.
        dropout: dropout probability after each activation (0: none).
        data_seed: seed of the inputs and of the teacher that labels them.
    """
    g = torch.Generator().manual_seed(data_seed)
    x = torch.randn(num_samples + num_samples // 8, in_dim, generator=g)
    teacher = torch.randn(in_dim, num_classes, generator=g) / in_dim**0.5
    y = (torch.tanh(x @ teacher * 3) + 0.1 * torch.randn(x.shape[0], num_classes, generator=g)).argmax(1)
    split = num_samples
    model = make_mlp(in_dim, width, depth, num_classes, activation, dropout)
    fingerprint = hashlib.sha256(x.numpy().tobytes() + y.numpy().tobytes()).hexdigest()[:16]
    return Task(model=model, train_data=TensorDataset(x[:split], y[:split]), val_data=TensorDataset(x[split:], y[split:]),
                loss=classification_loss, name="mlp", data_fingerprint=f"synthetic:{fingerprint}", count_unit="samples")
