"""A task that diverges: linear regression whose learning rate is too high for its data's scale.

With SGD at lr 2.5 (no clipping) the loss grows about x10 per step once the warmup passes lr ~1, until
the grad norm's sum of squares overflows float32 while every gradient is still finite. Try::

    stabletrain train task=examples.diverging_task:make_task optim.name=sgd optim.lr=2.5 optim.weight_decay=0 \\
        clip.max_norm=null sched.decay=constant train.batch_size=8 train.max_steps=60 log.every=5 ckpt.every=10 \\
        data.shuffle=false run.dir=runs/diverge
    stabletrain remedy runs/diverge --steps 4
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import stabletrain


def make_task(n: int = 64, scale: float = 1.0) -> stabletrain.Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g) * scale
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(0)
    return stabletrain.Task(model=nn.Sequential(nn.Linear(8, 1)), train_data=TensorDataset(x, y), name="diverging",
                            loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
