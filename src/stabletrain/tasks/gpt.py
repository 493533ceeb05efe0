"""The built-in ``gpt`` task: a small byte-level decoder-only transformer trained on the bytes of the
Python standard library's own ``.py`` sources — real text that every Python install carries.

The sources are found at run time (``sysconfig``), read in sorted path order up to ``max_bytes``, and
split by file into train and validation (a file goes to validation when a hash of its path says so),
so the split is deterministic and no file leaks across it. The data fingerprint is a SHA-256 over the
paths and bytes used.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from . import Task
from .init_schemes import init_

__all__ = ["GPT", "ByteChunks", "stdlib_sources", "make_task"]


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"task_args.n_embd ({n_embd}) must be divisible by task_args.n_head ({n_head})")
        self.n_head, self.dropout = n_head, dropout
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.proj.residual_branch_out = True  # a residual branch's output: init_ scales it by 1/sqrt(2 * n_layer)
        self.resid_dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.resid_dropout(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * n_embd, n_embd)
        self.proj.residual_branch_out = True
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class GPT(nn.Module):
    """Decoder-only transformer over bytes (vocab 256) with tied input/output embeddings."""

    def __init__(self, vocab_size: int = 256, seq_len: int = 128, n_layer: int = 4, n_head: int = 4,
                 n_embd: int = 128, dropout: float = 0.0) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(seq_len, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab_size, bias=False)
        self.head.weight = self.wte.weight  # tied embeddings
        # GPT-2's init: N(0, 0.02) weights, zero biases, residual outputs scaled by 1/sqrt(2 * n_layer).
        init_(self, "normal", std=0.02, num_residual_branches=2 * n_layer)

    def forward(self, idx: Tensor) -> Tensor:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence of length {t} is longer than the model's seq_len {self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


_PACKAGE_DIRS = ("site-packages", "dist-packages")


def _sorted_py_files(root: Path) -> Iterator[Path]:
    """Yield the ``*.py`` under ``root`` (not in site-/dist-packages) in sorted path order, as they are found.

    The order of ``sorted(root.rglob("*.py"))``, without walking the whole tree first: a directory's entries in
    sorted name order, each one's subtree right after it, is the order of the paths' parts compared one by one;
    so the caller, which stops after ``max_bytes``, walks only that far (start-up: the whole stdlib's walk took
    ~0.5 s of every rank's start). Symlinked directories are not entered (as rglob); one that cannot be read is
    passed over.
    """
    if any(part in _PACKAGE_DIRS for part in root.parts):
        return
    try:
        with os.scandir(root) as it:
            entries = sorted(it, key=lambda entry: entry.name)
    except OSError:
        return
    for entry in entries:
        if entry.name in _PACKAGE_DIRS:
            continue
        if entry.name.endswith(".py"):
            yield root / entry.name
        try:
            walk = entry.is_dir() and not entry.is_symlink()
        except OSError:
            walk = False
        if walk:
            yield from _sorted_py_files(root / entry.name)


def stdlib_sources(max_bytes: int, val_every: int = 20) -> tuple[bytes, bytes, str, int]:
    """Return (train bytes, val bytes, sha256 fingerprint, number of files) of the stdlib's .py files.

    Files are taken in sorted relative-path order until ``max_bytes`` are collected; a file is held
    out for validation when the first byte of the SHA-256 of its path is divisible by ``val_every``.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha256()
    train, val, total, used, found = [], [], 0, 0, False
    for path in _sorted_py_files(root):
        found = True
        rel = path.relative_to(root).as_posix()
        try:
            data = path.read_bytes()
        except OSError:
            continue
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        (val if hashlib.sha256(rel.encode()).digest()[0] % val_every == 0 else train).append(data)
        total += len(data)
        used += 1
        if total >= max_bytes:
            break
    if not found:
        raise RuntimeError(f"no .py files found under the standard library at {root}")
    if not val and len(train) > 1:  # a small max_bytes may pick no held-out file: hold out the last one
        val.append(train.pop())
    return b"".join(train), b"".join(val), digest.hexdigest(), used


class ByteChunks(Dataset):
    """Non-overlapping chunks of ``seq_len + 1`` bytes: sample i is (x, y) with y shifted by one."""

    def __init__(self, data: bytes, seq_len: int) -> None:
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)
        self.seq_len = seq_len
        self.n = max((len(self.data) - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        chunk = self.data[i * self.seq_len:(i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


def lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> tuple[Tensor, int]:
    """Return (summed next-byte cross-entropy in fp32, number of target tokens)."""
    x, y = batch
    logits = model(x)
    loss_sum = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum")
    return loss_sum, y.numel()


def make_task(n_layer: int = 4, n_head: int = 4, n_embd: int = 128, seq_len: int = 128, dropout: float = 0.0,
              max_bytes: int = 4_000_000) -> Task:
    """The default task: a byte-level GPT on the standard library's sources.

    Args:
        n_layer: transformer blocks.
        n_head: attention heads per block (must divide n_embd).
        n_embd: width of the residual stream.
        seq_len: bytes per training sequence (the context length).
        dropout: dropout probability on embeddings, attention and residual branches.
        max_bytes: bytes of standard-library sources to read (train and validation together).
    """
    train, val, fingerprint, num_files = stdlib_sources(max_bytes)
    model = GPT(256, seq_len, n_layer, n_head, n_embd, dropout)
    return Task(model=model, train_data=ByteChunks(train, seq_len), val_data=ByteChunks(val, seq_len), loss=lm_loss,
                name="gpt", data_fingerprint=f"stdlib-py:{fingerprint[:16]}", count_unit="tokens",
                info={"num_files": num_files, "train_bytes": len(train), "val_bytes": len(val)})
