"""A user task for ``stabletrain train task=examples.my_task:make_task`` (run from the repo root).

The factory takes keyword arguments from ``task_args`` and returns a ``stabletrain.Task``. Its loss
returns ``(sum, count)`` over real tokens of variable-length sequences, so gradient accumulation
normalizes by the tokens of the whole window, not by the number of micro-batches.
"""

import torch
from torch import nn
from torch.utils.data import Dataset

import stabletrain


class Sequences(Dataset):
    """Token sequences of variable length, padded to ``max_len``; the target is the next token.

    Each sequence starts at a random token and follows a learnable rule, next = (7 * token + 3) % vocab,
    so every target is a function of its input token and the loss can fall to ~0 (chance is ln vocab).
    """

    def __init__(self, n: int, max_len: int, vocab: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.tokens = torch.empty(n, max_len + 1, dtype=torch.long)
        self.tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
        for t in range(1, max_len + 1):  # one position at a time: each token follows from the one just made
            self.tokens[:, t] = (self.tokens[:, t - 1] * 7 + 3) % vocab
        self.lengths = torch.randint(4, max_len + 1, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int):
        mask = torch.arange(self.tokens.shape[1] - 1) < self.lengths[i]
        return self.tokens[i, :-1], self.tokens[i, 1:], mask


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, vocab))

    def forward(self, x):
        return self.mlp(self.embed(x))


def loss(model: nn.Module, batch):
    x, y, mask = batch
    logits = model(x).float()  # reduce the loss in fp32 even under autocast
    per_token = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
    return (per_token * mask.flatten()).sum(), mask.sum()  # (sum, count): exact accumulation


def make_task(vocab: int = 32, width: int = 64, max_len: int = 24) -> stabletrain.Task:
    return stabletrain.Task(model=TinyLM(vocab, width), train_data=Sequences(2048, max_len, vocab, seed=0),
                            val_data=Sequences(256, max_len, vocab, seed=1), loss=loss, name="tiny-lm",
                            count_unit="tokens")
