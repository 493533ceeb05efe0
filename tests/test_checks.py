"""The doctor's checks in-process: accum in training mode (dropout handled, BatchNorm warned), overfit on the one step."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from helpers import cfg, regression_task
from stabletrain import Task
from stabletrain.checks import CheckContext, format_table, run_checks


def bn_task() -> Task:
    """A small BatchNorm classifier with a (sum, count) loss: micro-batch statistics differ from the big batch's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, 0] > 0).long()
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))

    def loss(m, b):
        inputs, labels = b
        return F.cross_entropy(m(inputs), labels, reduction="sum"), torch.tensor(float(len(labels)))

    return Task(model=model, train_data=TensorDataset(x, y), loss=loss, name="bn")


def test_accum_check_warns_on_batchnorm_with_the_measured_difference():
    (result,) = run_checks(CheckContext(cfg("train.batch_size=16"), task_factory=bn_task), ["accum"])
    assert result.passed and result.warning, result.summary
    assert result.numbers["batch_stat_layers"] == 1
    assert result.numbers["max_param_diff"] > result.numbers["tolerance"]
    assert "batch statistics (1)" in result.summary and "not one big batch for this model" in result.summary
    assert "WARN" in format_table([result]) and "(1 with a warning)" in format_table([result])


def test_accum_check_passes_in_training_mode_with_dropout_switched_off_for_it():
    task = lambda: regression_task(dropout=0.5)  # noqa: E731
    (result,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=task), ["accum"])
    assert result.passed and not result.warning, result.summary
    assert any("dropout switched off for the comparison: 2" in d for d in result.details)
    assert result.numbers["max_param_diff"] <= result.numbers["tolerance"]


def test_overfit_check_runs_the_one_step_and_names_a_parameter_without_gradient():
    def frozen_out():
        task = regression_task()
        task.model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1), nn.Linear(1, 1))
        task.model[3].weight.data.zero_()  # no gradient reaches layer 2 through a zero weight
        return task

    (ok,) = run_checks(CheckContext(cfg(), task_factory=regression_task), ["overfit"])
    assert ok.passed and ok.numbers["final_loss"] <= ok.numbers["initial_loss"] / 2
    (bad,) = run_checks(CheckContext(cfg(), task_factory=frozen_out), ["overfit"])
    assert not bad.passed and "no gradient: 2.weight" in bad.details
