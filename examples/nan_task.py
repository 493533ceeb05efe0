"""A task with a planted fault, to watch the NaN sentinel and the diagnosis work.

Sample 37 of the training data is negative, and the model takes the log of its input in the middle
layer: the step whose batch holds sample 37 turns NaN. Try::

    stabletrain train task=examples.nan_task:make_task train.max_steps=20 log.every=5 run.dir=runs/nan
    stabletrain diagnose runs/nan/incidents/step_000007
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

import stabletrain


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.log = Log()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.log(x + 0.0 * self.embed(x)))


def make_task(bad_index: int = 37) -> stabletrain.Task:
    g = torch.Generator().manual_seed(0)
    x = torch.rand(256, 8, generator=g) + 0.5
    x[bad_index] = -1.0
    y = torch.randn(256, 1, generator=g)
    return stabletrain.Task(model=Model(), train_data=TensorDataset(x, y), name="nan-demo",
                            loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
