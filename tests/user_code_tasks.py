"""User tasks whose own code raises (a loss, a dataset item, a collate, a model forward, the factory), importable as
``user_code_tasks:NAME``: the CLI must name the part of the task that raised and show these lines."""

import torch
from helpers import regression_task
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset


def unpack_loss_task():
    """A loss that unpacks three values from a two-item batch."""
    task = regression_task()

    def loss(model, batch):
        x, y, w = batch  # the user's bug: the batch is (x, y)
        return F.mse_loss(model(x), y)

    task.loss = loss
    return task


class Words(Dataset):
    """A dataset of strings: default_collate keeps them as a list, which no nn.Linear takes."""

    def __init__(self, n: int = 64) -> None:
        self.words = [f"word{i}" for i in range(n)]

    def __len__(self) -> int:
        return len(self.words)

    def __getitem__(self, i):
        return self.words[i], torch.zeros(1)


def string_data_task():
    """Strings reach the model: nn.Linear raises inside the model's forward, called from the loss."""
    task = regression_task()
    task.train_data = Words()
    return task


class BadItem(Words):
    def __getitem__(self, i):
        return torch.tensor([float(self.words[i])]), torch.zeros(1)  # the user's bug: float("word0")


def bad_item_task():
    """The dataset's __getitem__ raises."""
    task = regression_task()
    task.train_data = BadItem()
    return task


def stack_words(samples):
    words, ys = zip(*samples)
    return torch.stack(words), torch.stack(ys)  # the user's bug: torch.stack of strings


def bad_collate_task():
    """The task's collate raises."""
    task = regression_task()
    task.train_data = Words()
    task.collate = stack_words
    return task


class Reshaper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x):
        return self.linear(x.view(-1, 3))  # the user's bug: 4 features, not 3


def bad_forward_task():
    """The user's own module raises in forward."""
    task = regression_task()
    task.model = Reshaper()
    return task


def bad_factory_task(width: int = 16):
    """The factory itself raises."""
    sizes = {"small": 8}
    return regression_task(n=sizes["large"])


class Ragged(Dataset):
    """Samples of different lengths: torch's default_collate cannot stack them (no user frame raises)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return torch.zeros(4 + i % 3), torch.zeros(1)


def ragged_data_task():
    task = regression_task()
    task.train_data = Ragged()
    return task


class OneOdd(Dataset):
    """Every item (4,) but item 5, (4, 3): the data's fault, which default_collate reports as a stack of unequal sizes."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return torch.zeros(4, 3) if i == 5 else torch.zeros(4), torch.zeros(1)


def one_odd_item_task():
    task = regression_task()
    task.train_data = OneOdd()
    return task


def bad_val_item_task():
    """Training works; the validation dataset's __getitem__ raises."""
    task = regression_task()
    task.val_data = BadItem()
    return task


def eval_only_loss_task():
    """The loss raises only in eval mode: during the validation pass."""
    task = regression_task()

    def loss(model, batch):
        if not model.training:
            raise KeyError("metric 'accuracy' is not computed yet")
        return F.mse_loss(model(batch[0]), batch[1])

    task.loss = loss
    task.val_data = task.train_data
    return task


def loss_raises_when_asked_task(bad_index: int = 37):
    """A NaN input at ``bad_index`` (an incident to diagnose); the loss raises when STABLETRAIN_TEST_RAISE is set."""
    import os

    from helpers import nan_sample_task

    task = nan_sample_task(bad_index=bad_index)
    inner = task.loss

    def loss(model, batch):
        if os.environ.get("STABLETRAIN_TEST_RAISE"):
            raise ValueError("the loss was asked to raise")
        return inner(model, batch)

    task.loss = loss
    return task


def loss_not_scalar_task():
    """A loss that forgets to reduce: the task contract (a scalar mean or a (sum, count) pair) is broken."""
    task = regression_task()
    task.loss = lambda model, batch: (model(batch[0]) - batch[1]) ** 2  # the user's bug: no .mean()
    return task


def loss_detached_task():
    """A loss cut from the graph: nothing to backpropagate."""
    task = regression_task()
    task.loss = lambda model, batch: F.mse_loss(model(batch[0]), batch[1]).detach()  # the user's bug: .detach()
    return task


def loss_int_task():
    """A loss cast to an integer tensor (which has no gradient)."""
    task = regression_task()
    task.loss = lambda model, batch: F.mse_loss(model(batch[0]), batch[1]).long()  # the user's bug: .long()
    return task


def loss_swapped_pair_task():
    """A (count, sum) pair where the contract is (sum, count)."""
    task = regression_task()
    task.loss = lambda model, batch: (torch.tensor(float(len(batch[0]))),  # the user's bug: the count first
                                      F.mse_loss(model(batch[0]), batch[1], reduction="sum"))
    return task


def loss_zero_count_task():
    """A (sum, count) pair whose count is a plain 0: every window would divide by zero."""
    task = regression_task()
    task.loss = lambda model, batch: (F.mse_loss(model(batch[0]), batch[1], reduction="sum"), 0)  # the user's bug: 0
    return task
