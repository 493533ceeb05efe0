"""A task whose run spikes for a reason in the optimizer's state: a rare token's embedding row under Adam.

Token 31 appears only in the samples of steps 74 and 75 (batch 8, in order). Its embedding row had no
gradient before, so Adam's second moment there is 0 and its first gradient, however small, moves it many
times as far as any other row (with beta1 = 0, as RMSprop-like setups run; with the default 0.9 the first
moment passes on a tenth of that gradient and this small task shows no spike): the next step's loss spikes. Try::

    stabletrain train task=examples.spike_task:make_task train.batch_size=8 train.max_steps=80 log.every=10 \\
        data.shuffle=false sched.warmup_steps=0 sched.decay=constant run.dir=runs/spike
    stabletrain remedy runs/spike --steps 6
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import stabletrain


class BagOfTokens(nn.Module):
    """The mean of a sequence's token embeddings, then a linear head; the rare token's row starts at zero."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, 1)
        with torch.no_grad():
            self.embed.weight[vocab - 1] = 0.0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


def make_task(n: int = 640, lr: float = 0.03) -> stabletrain.Task:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 31, (n, 8), generator=g)
    values = torch.randn(32, generator=g)
    values[31] = 0.0  # the target ignores the rare token: its zero row fits those samples as well as any
    tokens[588:596, :6] = 31  # steps 74 and 75
    y = values[tokens].mean(1, keepdim=True)
    torch.manual_seed(0)
    return stabletrain.Task(
        model=BagOfTokens(), train_data=TensorDataset(tokens, y), name="rare-token",
        loss=lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]),
        optimizer=lambda named: torch.optim.AdamW([p for _, p in named], lr=lr, betas=(0.0, 0.999), weight_decay=0.0,
                                                  fused=True))
