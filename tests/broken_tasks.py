"""User tasks with planted mistakes, for the doctor's tests (importable as ``broken_tasks:NAME``)."""

import torch
from torch import nn

from helpers import regression_task


class DetachedFirstLayer(nn.Sequential):
    """A user bug: the first layer's output is detached, so its parameters never get a gradient."""

    def forward(self, x):
        x = self[0](x).detach()
        for layer in list(self)[1:]:
            x = layer(x)
        return x


def frozen_layer_task():
    task = regression_task()
    task.model = DetachedFirstLayer(*task.model)
    return task


def half_model_task():
    """A model cast wholesale to bfloat16 (the .half() mistake, in the dtype CPU supports)."""
    task = regression_task()
    task.model = task.model.to(torch.bfloat16)
    inner = task.loss
    task.loss = lambda m, b: inner(m, (b[0].to(torch.bfloat16), b[1].to(torch.bfloat16))).float()
    return task
