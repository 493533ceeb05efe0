"""User tasks with planted mistakes, for the doctor's tests (importable as ``broken_tasks:NAME``)."""

import torch
from helpers import regression_task
from torch import nn


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


def half_model_float_inputs_task():
    """The same cast model fed its float32 batches as they come (the commoner form of the mistake): its forward fails."""
    task = regression_task()
    task.model = task.model.half()
    return task


class CountingModel(nn.Module):
    """A model whose output depends on a Python attribute that is not in its state_dict."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, x):
        self.calls += 1
        return self.inner(x) * (1.0 + 0.01 * self.calls)


def hidden_counter_task():
    task = regression_task()
    task.model = CountingModel(task.model)
    return task


class NoisyData(torch.utils.data.Dataset):
    """Augmentation from an unseeded generator: no two runs see the same inputs."""

    def __init__(self, inner):
        self.inner, self.rng = inner, __import__("random").SystemRandom()

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        x, y = self.inner[i]
        return x + self.rng.random(), y


def unseeded_noise_task():
    task = regression_task()
    task.train_data = NoisyData(task.train_data)
    return task


def iterable_data_task():
    """A dataset without __len__ and __getitem__ (an IterableDataset): the task contract refuses it."""
    task = regression_task()

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(task.train_data)

    task.train_data = Stream()
    return task


def fp16_hopeless_task():
    """Targets of 1e15: the loss (reduced in fp32) is finite, its fp16 gradients overflow at every loss scale."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from stabletrain import Task

    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 16, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    return Task(model=model, train_data=TensorDataset(x, torch.full((128, 1), 1e15)), name="fp16-hopeless",
                loss=lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]))


def meta_device_task():
    """A model built on the meta device (no storage; a new user's case): train crashed in torch's copy to the device."""
    task = regression_task()
    task.model = torch.nn.Linear(8, 1, device="meta")
    return task


def frozen_model_task():
    """Every parameter frozen: nothing to train (check's overfit showed torch's 'optimizer got an empty parameter list')."""
    task = regression_task()
    task.model.requires_grad_(False)
    return task


def chatty_task():
    """A factory that prints as it builds (a user's progress print; a check's own runs print lines too)."""
    print("building the model")
    return regression_task()
