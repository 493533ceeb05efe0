"""Tiny models, data and a sync counter shared by the adapter tests (Monitor, Lightning, Hugging Face)."""

from __future__ import annotations

import os
import traceback
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

import stabletrain
from stabletrain.syncs import SYNC_FUNCS

# Frames are told apart by the packages' own folders, not by a folder name in the path: a clone is named stabletrain.
PACKAGE_DIR = os.path.dirname(stabletrain.__file__) + os.sep
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep

# Never reach the network: the transformers models are built from configs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

BAD_STEP, BAD_POSITION = 7, 3


class Root(nn.Module):
    """sqrt(|h| + x0): NaN exactly for a sample whose first feature is very negative."""

    def forward(self, h, x):
        return torch.sqrt(h.abs() + x[:, :1])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.act, self.root, self.fc2 = nn.Linear(4, 16), nn.Tanh(), Root(), nn.Linear(16, 1)

    def forward(self, x):
        return self.fc2(self.root(self.act(self.fc1(x)), x))


def loss_fn(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


def outlier_pairs(n_steps, step, positions, batch_size, seed=0):
    """(x, y) of ``n_steps`` batches of random regression pairs, the samples at ``positions`` of ``step`` with a target
    of 40 (a loss spike that those samples alone carry)."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n_steps * batch_size, 4, generator=g), torch.randn(n_steps * batch_size, 1, generator=g)
    for position in positions:
        y[(step - 1) * batch_size + position] = 40.0
    return x, y


def batches(n_steps, bad_step=None, batch_size=8, seed=0):
    """One (x, y) per step; x[:, 0] >= 0, except one planted sample at ``bad_step``."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(1, n_steps + 1):
        x = torch.rand(batch_size, 4, generator=g)
        y = torch.randn(batch_size, 1, generator=g)
        if step == bad_step:
            x[BAD_POSITION, 0] = -100.0
        out.append((x, y))
    return out




class OurSyncs(TorchFunctionMode):
    """Count the host syncs stabletrain itself makes (the innermost frame outside torch is in the package).

    The host trainers sync on their own (HF's NaN filter, Lightning's progress); those are not ours.
    ``calls``: (step, function name) pairs, ``step()`` read when each happened.
    """

    def __init__(self, step):
        super().__init__()
        self.step, self.calls = step, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNC_FUNCS:
            frames = [f for f in traceback.extract_stack()[:-1] if not f.filename.startswith(TORCH_DIR)]
            if frames and frames[-1].filename.startswith(PACKAGE_DIR):  # the package's files, never the checkout's
                self.calls.append((self.step(), frames[-1].name))
        return func(*args, **(kwargs or {}))


# -- a tiny GPT-2 for the Hugging Face Trainer (random init from a config; never a download) -----------------

TRAP_TOKEN, VOCAB, SEQ = 63, 64, 16
BATCH_HF = 4  # per-device batch of the Hugging Face tests


def gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0,
                      eos_token_id=0)


class TrapEmbedding(nn.Embedding):
    """GPT-2's token embedding, except that the token TRAP_TOKEN comes out as sqrt(-1) = NaN."""

    def forward(self, ids):
        out = super().forward(ids)
        return out * torch.sqrt(1.0 - 2.0 * (ids == TRAP_TOKEN).to(out.dtype))[..., None]


def _trap_gpt2_class():
    from transformers import GPT2LMHeadModel

    class TrapGPT2(GPT2LMHeadModel):
        """GPT2LMHeadModel whose token embedding is a TrapEmbedding (same parameters, same tying)."""

        def __init__(self, config):
            super().__init__(config)
            self.transformer.wte.__class__ = TrapEmbedding

    TrapGPT2.__qualname__ = TrapGPT2.__name__ = "TrapGPT2"
    TrapGPT2.__module__ = __name__
    return TrapGPT2


def __getattr__(name):  # TrapGPT2 is made on first use: importing transformers is slow
    if name == "TrapGPT2":
        cls = _trap_gpt2_class()
        globals()["TrapGPT2"] = cls
        return cls
    raise AttributeError(name)


def gpt2(seed=0):
    torch.manual_seed(seed)
    from transformers import GPT2LMHeadModel

    return GPT2LMHeadModel(gpt2_config())


def trap_gpt2(seed=0):
    torch.manual_seed(seed)
    return __getattr__("TrapGPT2")(gpt2_config())


def token_rows(n, seed=0, trap_at=None):
    """``n`` samples {"input_ids", "labels"} of SEQ random tokens (never TRAP_TOKEN, except in sample ``trap_at``)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, TRAP_TOKEN, (n, SEQ), generator=g)
    if trap_at is not None:
        ids[trap_at, SEQ // 2] = TRAP_TOKEN
    return [{"input_ids": r, "labels": r.clone()} for r in ids]


class Pair(NamedTuple):
    """A namedtuple batch (its fields by name in the loss)."""

    x: torch.Tensor
    y: torch.Tensor


def pair_loss_fn(model, batch):
    return F.mse_loss(model(batch.x), batch.y)
