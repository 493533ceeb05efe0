"""Tasks and a torchrun worker for the FSDP2 tests (``dist.strategy=fsdp``).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/fsdp_tasks.py OUT_DIR key=value ...

Each rank writes ``OUT_DIR/rank_R.pt``: the full (gathered) parameters it ended with, the kind of its
parameters (DTensor or not), its metrics history and its step.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch
from helpers import VarLenSequences, varlen_loss
from torch import nn

from stabletrain import Task


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return x + torch.tanh(self.fc(self.norm(x)))


class BlockNet(nn.Module):
    """A stem, a ModuleList of residual blocks (the FSDP units by default) and a head: per-token outputs."""

    def __init__(self, dim: int = 3, width: int = 10, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, width)
        self.layers = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def blocks_task(seed: int = 0, depth: int = 3, named_blocks: bool = False) -> Task:
    """Variable-length sequences (a token-count loss) through :class:`BlockNet`; ``named_blocks`` sets ``Task.blocks``."""
    torch.manual_seed(seed)
    model = BlockNet(depth=depth)
    return Task(model=model, train_data=VarLenSequences(n=60, seed=seed), loss=varlen_loss, name="blocks",
                count_unit="tokens", blocks=[model.stem, *model.layers] if named_blocks else None)


def nan_blocks_task(bad_index: int = 37) -> Task:
    """:func:`blocks_task` with one NaN input at dataset index ``bad_index``."""
    task = blocks_task()
    task.train_data.x[bad_index, 0, 1] = float("nan")
    return task


class TanhStemNet(nn.Module):
    """A stem whose output a tanh squashes: an inf input makes the stem's output inf, the tanh 1, the loss finite, and
    only the stem's gradient NaN (d tanh = 0 times the inf input)."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(2))
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        h = torch.tanh(self.stem(x))
        for layer in self.layers:
            h = h + layer(h)
        return self.head(h)


def grads_only_nan_task(bad_index: int = 91, n: int = 256) -> Task:
    """A regression whose sample ``bad_index`` holds an inf feature: a finite loss, NaN gradients (:class:`TanhStemNet`)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g)
    x[bad_index, 3] = float("inf")
    torch.manual_seed(0)
    return Task(model=TanhStemNet(), train_data=torch.utils.data.TensorDataset(x, y), name="grads-only-nan",
                loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))


def two_nan_task(first: int = 83, second: int = 91, n: int = 256) -> Task:
    """:func:`grads_only_nan_task`'s model with a NaN feature at ``first`` and ``second``: at batch 8 a rank, in order,
    both in step 6, one on each of 2 ranks."""
    task = grads_only_nan_task(bad_index=0, n=n)
    x = task.train_data.tensors[0]
    x[0, 3] = x[1, 3]  # (the inf the other task planted: gone)
    x[first, 3] = x[second, 3] = float("nan")
    return task


def main(argv: list[str]) -> None:
    from stabletrain import Trainer, load_config
    from stabletrain.distributed.group import process_group

    out = Path(argv[0])
    cfg = load_config(None, argv[1:])
    with process_group(cfg.dist.backend, cfg.dist.timeout_s) as ctx:
        trainer = Trainer(cfg, run_dir=cfg.run.dir)
        trainer.fit()
        kinds = sorted({type(p).__name__ for p in trainer.module.parameters()})
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in trainer.module.named_parameters()}
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"params": full, "kinds": kinds, "history": trainer.history, "world": ctx.world,
                    "step": trainer.step}, out / f"rank_{ctx.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])


class DropoutBlockNet(BlockNet):
    """:class:`BlockNet` with dropout after the stem: every step draws from the rank's RNG."""

    def __init__(self, p: float = 0.2, **kwargs) -> None:
        super().__init__(**kwargs)
        self.drop = nn.Dropout(p)

    def forward(self, x):
        x = self.drop(self.stem(x))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def nan_dropout_blocks_task(bad_index: int = 37, p: float = 0.2) -> Task:
    """:func:`nan_blocks_task` through :class:`DropoutBlockNet` (a NaN input stays NaN through dropout)."""
    task = nan_blocks_task(bad_index)
    torch.manual_seed(0)
    task.model = DropoutBlockNet(p)
    return task
