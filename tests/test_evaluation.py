"""Validation loss and the modules' modes: what the user froze in eval mode stays frozen."""

import torch
import torch.nn.functional as F
from helpers import cfg
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain import Task, Trainer
from stabletrain.distributed.group import DistContext
from stabletrain.evaluation import validation_loss
from stabletrain.policies.precision import PrecisionPolicy


def frozen_bn_task() -> Task:
    """A regression MLP whose BatchNorm the user froze (``bn.eval()``: running stats fixed, not updated)."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g) * 3 + 1  # far from the BN's initial stats (mean 0, var 1)
    y = x.sum(1, keepdim=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))
    model[1].eval()
    return Task(model=model, train_data=TensorDataset(x, y), val_data=TensorDataset(x[:16], y[:16]),
                loss=lambda m, b: F.mse_loss(m(b[0]), b[1]), name="frozen_bn")


def test_validation_gives_each_module_back_its_own_mode():
    task = frozen_bn_task()
    out = validation_loss(task, task.model, PrecisionPolicy("fp32", "cpu"), 8, 0, DistContext.current())
    assert out["val_loss"] > 0
    assert [m.training for m in task.model] == [True, False, True, True] and task.model.training


def test_a_frozen_batchnorm_stays_frozen_across_validation_in_training():
    task = frozen_bn_task()
    bn = task.model[1]
    mean, var, batches = bn.running_mean.clone(), bn.running_var.clone(), int(bn.num_batches_tracked)
    trainer = Trainer(cfg("train.max_steps=6", "train.batch_size=8", "eval.every=2", "log.every=2"), task=task)
    trainer.fit()
    assert "val_loss" in trainer.history[0] and not bn.training and trainer.module.training
    assert torch.equal(bn.running_mean, mean) and torch.equal(bn.running_var, var)
    assert int(bn.num_batches_tracked) == batches == 0


def test_a_validation_loss_that_counts_no_item_is_nan_and_said_not_a_perfect_zero():
    """A new-user trial: a loss returning (sum * 0, 0) read 'val_loss=0' (loss_sum / max(count, 1)): a masking bug
    in the validation set looked like a perfect model."""
    import math

    import pytest

    from stabletrain.console import StableTrainWarning

    task = frozen_bn_task()
    task.loss = lambda m, b: (F.mse_loss(m(b[0]), b[1], reduction="sum") * 0, torch.tensor(0.0))
    with pytest.warns(StableTrainWarning, match="the validation loss counted no item .*val_loss is NaN"):
        out = validation_loss(task, task.model, PrecisionPolicy("fp32", "cpu"), 8, 0, DistContext.current())
    assert math.isnan(out["val_loss"])
