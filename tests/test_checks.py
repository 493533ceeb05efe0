"""The doctor's checks in-process: accum in training mode (dropout handled, BatchNorm warned), overfit on the one step."""

import math

import torch
import torch.nn.functional as F
from helpers import cfg, regression_task
from torch import nn
from torch.utils.data import TensorDataset

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


class _LSTMLM(nn.Module):
    """word_language_model in small: embedding -> 2-layer LSTM whose own ``dropout`` is 0.2 -> linear."""

    def __init__(self, rnn: str = "lstm", functional_p: float = 0.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.rnn = {"lstm": nn.LSTM, "gru": nn.GRU}[rnn](8, 12, num_layers=2, dropout=0.2, batch_first=True)
        self.attn = nn.MultiheadAttention(12, 2, dropout=0.3, batch_first=True)
        self.functional_p = functional_p
        self.out = nn.Linear(12, 16)

    def forward(self, x):
        h, _ = self.rnn(self.emb(x))
        h = h + self.attn(h, h, h, need_weights=False)[0]
        q = h[:, None]
        h = h + F.scaled_dot_product_attention(q, q, q, dropout_p=0.25 if self.training else 0.0)[:, 0]
        h = F.dropout(h, self.functional_p, training=self.training)  # a user's own functional dropout
        return self.out(h)


def lstm_task(rnn: str = "lstm") -> Task:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (64, 7), generator=g)

    def loss(m, b):
        (x,) = b
        logits = m(x[:, :-1])
        return (F.cross_entropy(logits.reshape(-1, 16), x[:, 1:].reshape(-1), reduction="sum"),
                torch.tensor(float(x[:, 1:].numel())))

    return Task(model=_LSTMLM(rnn, functional_p=0.1), train_data=TensorDataset(tokens), loss=loss, name=rnn)


def test_accum_check_switches_off_a_modules_own_dropout_lstm_gru_attention_and_functional():
    for rnn in ("lstm", "gru"):
        (result,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=lambda rnn=rnn: lstm_task(rnn)), ["accum"])
        assert result.passed and not result.warning, (rnn, result.summary, result.details)
        assert result.numbers["max_param_diff"] <= result.numbers["tolerance"]
        off = next(d for d in result.details if d.startswith("dropout switched off"))
        assert "rnn (dropout=0.2)" in off and "attn (dropout=0.3)" in off, off
        assert off.endswith("functional dropout calls in one forward: 2"), off  # F.dropout(p=0.1) and sdpa(dropout_p=0.25)
        assert result.numbers["residual_randomness"] == 0.0


def test_accum_check_never_blames_the_loss_when_randomness_it_cannot_switch_off_remains():
    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x):  # a feature mask drawn by hand per call: nothing named dropout to switch off
            return self.lin(x * (torch.rand(x.shape[-1]) > 0.3))

    def noisy_task():
        task = regression_task()
        task.model = Noisy()
        return task

    (result,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=noisy_task), ["accum"])
    assert result.passed and result.warning, result.summary
    assert "inconclusive" in result.summary and "randomness" in result.summary, result.summary
    assert result.numbers["residual_randomness"] > result.numbers["tolerance"]
    assert not any("the loss may depend on the batch" in d for d in result.details)


def _classification(loss_reduction: str = "mean", model: nn.Module | None = None) -> Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    y = (x[:, 0] > 0).long()
    model = model or nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return Task(model=model, train_data=TensorDataset(x, y),
                loss=lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction=loss_reduction), name="cls")


def test_accum_check_names_a_scalar_loss_that_sums_over_the_batch():
    """reduction='sum' returned as a scalar: the check blamed in-batch negatives or an inconsistent (sum, count)."""
    (result,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=lambda: _classification("sum")), ["accum"])
    assert not result.passed and result.summary.endswith("the scalar loss sums over the batch instead of averaging")
    assert result.numbers["max_param_diff"] > 100 * result.numbers["tolerance"]
    [cause] = [d for d in result.details if d.startswith("the scalar loss scales with the batch size")]
    assert cause.endswith("it sums instead of averaging; use reduction='mean', or return (sum, count)")
    assert not any("in-batch negatives" in d for d in result.details)
    (mean,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=_classification), ["accum"])
    assert mean.passed and not mean.warning, mean.summary


class _Counter(nn.Module):
    """A forward that changes with a Python call counter (no randomness): state outside the inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x) * (1.0 + 0.01 * self.calls)


def test_accum_check_says_two_identical_forwards_differ_without_claiming_randomness():
    task = lambda: _classification(model=_Counter())  # noqa: E731
    (result,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=task), ["accum"])
    assert result.passed and result.warning, result.summary
    assert result.summary.startswith("inconclusive: two identical forward/backward passes (the same batch, the same RNG "
                                     "state) differ by"), result.summary
    assert result.numbers["repeat_diff"] > result.numbers["tolerance"]
    assert "randomness" not in result.summary
    assert any(d.startswith("the forward depends on something besides its inputs") and "a counter" in d
               for d in result.details)


def _fp16_overflow() -> Task:
    """Every parameter x 1000: the fp16 forward overflows (inf) in the second Linear ('2'); finite in fp32."""
    task = regression_task()
    task.model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        for p in task.model.parameters():
            p.mul_(1000.0)
    return task


def test_amp_check_fails_when_the_fp16_forward_overflows_and_names_the_module():
    (result,) = run_checks(CheckContext(cfg("precision=fp16", "train.batch_size=8"), task_factory=_fp16_overflow), ["amp"])
    assert not result.passed and result.summary.startswith("the loss is not finite under fp16 autocast (")
    [why] = [d for d in result.details if d.startswith("the loss is ")]
    assert "in fp32: the forward exceeds fp16's range (max 65504)" in why, why
    assert "aten.addmm.default in forward of module '2' (origin: inputs finite" in why, why
    (ok,) = run_checks(CheckContext(cfg("precision=fp16", "train.batch_size=8"), task_factory=regression_task), ["amp"])
    assert ok.passed and math.isfinite(ok.numbers["loss"])


def test_overfit_check_says_the_loss_is_not_finite_not_that_gradients_are_missing():
    (result,) = run_checks(CheckContext(cfg("precision=fp16"), task_factory=_fp16_overflow), ["overfit"])
    assert not result.passed
    assert result.numbers["num_params_without_grad"] == 0  # NaN gradients are gradients
    assert result.numbers["num_nonfinite_losses"] == result.numbers["num_skipped_steps"] == 5  # stopped early
    assert not any("detached graph" in d or d.startswith("no gradient") for d in result.details)
    [why] = [d for d in result.details if d.startswith("the loss is ")]
    assert "from step 0 on (precision=fp16): non-finite values, not a missing gradient" in why
    assert "in the forward: aten.addmm.default in forward of module '2'" in why, why
