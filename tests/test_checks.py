"""The doctor's checks in-process: accum in training mode (dropout handled, BatchNorm warned), overfit over its steps,
init and determinism on a zero-initialized head and unseeded data randomness."""

import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F
from broken_tasks import frozen_layer_task
from helpers import cfg, regression_task
from models_init import all_masked_first_task, augmented_task, zero_head_task
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain import Task
from stabletrain.checks import CheckContext, format_table, run_checks
from stabletrain.checks.accum import apart
from stabletrain.checks.resume import DATA_COMPONENT


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
    [advice] = [d for d in result.details if d.startswith("to make k micro-batches match one batch")]
    assert "GroupNorm/LayerNorm instead of BatchNorm" in advice and "SyncBatchNorm pools them across ranks, not" in advice


def test_accum_check_passes_in_training_mode_with_dropout_switched_off_for_it():
    task = lambda: regression_task(dropout=0.5)  # noqa: E731
    (result,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=task), ["accum"])
    assert result.passed and not result.warning, result.summary
    assert any("dropout switched off for the comparison: 2" in d for d in result.details)
    assert result.numbers["max_param_diff"] <= result.numbers["tolerance"]


def test_accum_check_on_too_few_samples_for_a_short_tail_warns_that_its_pass_proves_little():
    """A new user's 5 samples: micro-batches [1, 1, 1, 1], where the naive mean of means is the same as the window's
    normalization for a per-sample loss: it read PASS, proving nothing. A WARN that says so; 20 samples keep a tail."""
    (tiny,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=lambda: regression_task(n=5)), ["accum"])
    assert tiny.passed and tiny.warning and tiny.numbers["naive_max_param_diff"] <= tiny.numbers["tolerance"]
    assert any(d.startswith("the naive mean of means passes too (") and "micro-batches of sizes [1, 1, 1, 1]" in d
               and "a dataset of 8 samples or more" in d for d in tiny.details), tiny.details
    (small,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=lambda: regression_task(n=20)), ["accum"])
    assert small.passed and not small.warning and "sizes [5, 5, 5, 2]" in small.summary, small.summary
    (one,) = run_checks(CheckContext(cfg("train.batch_size=1"), task_factory=regression_task), ["accum"])
    assert one.warning and any("train.batch_size=2 or more gives the check a short tail" in d for d in one.details)


def test_overfit_check_names_a_parameter_that_never_gets_a_gradient_not_one_behind_a_zero_weight():
    def zero_out():
        task = regression_task()
        task.model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1), nn.Linear(1, 1))
        task.model[3].weight.data.zero_()  # no gradient reaches layers 0 and 2 at step 0; from step 1 on it does
        return task

    (ok,) = run_checks(CheckContext(cfg(), task_factory=regression_task), ["overfit"])
    assert ok.passed and ok.numbers["final_loss"] <= ok.numbers["initial_loss"] / 2
    assert ok.numbers["num_params_with_late_grad"] == 0 and len(ok.details) == 0
    (late,) = run_checks(CheckContext(cfg(), task_factory=zero_out), ["overfit"])
    assert late.passed, late.summary
    assert (late.numbers["num_params_without_grad"], late.numbers["num_params_with_late_grad"]) == (0, 4)
    [note] = late.details
    assert note.startswith("4 parameter(s) got no gradient at the first step and got one later: 0.weight (step 1), "
                           "0.bias (step 1), 2.weight (step 1), 2.bias (step 1); zero at init: 3.weight"), note
    (bad,) = run_checks(CheckContext(cfg(), task_factory=frozen_layer_task), ["overfit"])  # layer 0's output detached
    assert not bad.passed and bad.details[:2] == ["no gradient: 0.weight", "no gradient: 0.bias"], bad.details
    assert bad.summary.endswith(f"; 2 parameter(s) got no gradient in any of the {bad.numbers['steps'] + 1} steps")


def test_a_model_cast_wholesale_to_half_precision_is_named_by_the_checks_it_fails(tmp_path):
    """A trial: on a .half()-cast model accum blamed 'in-batch negatives' (then 'another unit than samples'), clip failed
    with no reason given, overfit said 'precision=fp32'; only amp named the cast."""
    from broken_tasks import half_model_task

    accum, clip = run_checks(CheckContext(cfg("train.batch_size=16"), task_factory=half_model_task), ["accum", "clip"])
    assert not accum.passed and accum.summary.endswith("; the weights are stored in half precision (cast wholesale): their "
                                                       "rounding, not the loss"), accum.summary
    assert accum.details[-1].startswith("4 of 4 parameters are stored in bfloat16 (e.g. 0.weight): the model was cast "
                                        "wholesale") and not any("unit than samples" in d for d in accum.details)
    assert not clip.passed and clip.details[0].startswith("the norm after clipping, ") and clip.details[1].startswith(
        "4 of 4 parameters are stored in bfloat16"), clip.details
    (healthy,) = run_checks(CheckContext(cfg("train.batch_size=16"), task_factory=regression_task), ["clip"])
    assert healthy.passed and healthy.details == []


def test_a_cast_model_whose_forward_fails_on_float32_inputs_is_named_by_the_checks_and_by_train(tmp_path, capsys):
    """A trial: the commoner form of the mistake, `.half()` on the model and float32 batches: every check failed with
    'mat1 and mat2 must have the same dtype, but got Float and Half' and no word of the cast; nor did train."""
    from broken_tasks import half_model_float_inputs_task

    from stabletrain.cli import main

    said = "4 of 4 parameters are stored in float16 (e.g. 0.weight): the model was cast wholesale (.half()/.bfloat16()) " \
           "and meets float32 inputs: keep float32 weights and let autocast choose (precision=bf16)"
    overfit, accum = run_checks(CheckContext(cfg("train.batch_size=16"), task_factory=half_model_float_inputs_task),
                                ["overfit", "accum"])
    assert not overfit.passed and overfit.summary.startswith("RuntimeError in the task's model forward at "), overfit.summary
    assert overfit.details[0] == said, overfit.details
    assert not accum.passed and accum.summary.endswith("(the same error as in the overfit check: traceback there)")
    assert main(["train", "task=broken_tasks:half_model_float_inputs_task", "log.progress=false",
                 f"run.dir={tmp_path / 'run'}"]) == 1
    err = capsys.readouterr().err.splitlines()  # (after the warning that the model is cast wholesale, said at its wrap)
    at = next(i for i, x in enumerate(err) if x.startswith("stabletrain: error: "))
    assert err[at + 1] == said and "a model cast wholesale (.half())" in err[0], err


def test_init_says_which_layers_are_frozen(tmp_path):
    """A trial: a frozen middle layer showed a '-' for its weight's gradient, as an activation does, and no line of the
    check's text said it was frozen (init_signal.json did)."""
    def frozen_head():
        task = regression_task()
        task.model[2].requires_grad_(False)
        return task

    (init,) = run_checks(CheckContext(cfg("train.batch_size=16"), task_factory=frozen_head,
                                      options={"out_dir": str(tmp_path)}), ["init"])
    row = next(d for d in init.details if d.split()[:2] == ["2", "2"])
    assert "frozen" in row.split(), row  # (the weight's gradient column: not '-', an activation's)
    assert "frozen (requires_grad=False): #2 '2': its weights do not train; gradients still pass through to the layers " \
           "before" in init.details, init.details
    (healthy,) = run_checks(CheckContext(cfg("train.batch_size=16"), task_factory=regression_task,
                                         options={"out_dir": str(tmp_path)}), ["init"])
    assert not any("frozen" in d for d in healthy.details)


def test_init_names_a_trainable_layer_no_gradient_reaches(tmp_path):
    """A trial: check init said 'backward: ok' for a model whose first layer's output is detached (its grad std shown
    '-'); overfit caught it. No init fixes it: a warning naming the layer, its backward line saying why."""
    ctx = CheckContext(cfg("train.batch_size=16"), task_factory=frozen_layer_task, options={"out_dir": str(tmp_path)})
    (init,) = run_checks(ctx, ["init"])
    assert init.passed and init.warning and init.numbers["no_gradient"] == ["0"], init.summary
    assert init.summary.endswith("; no gradient reaches '0'"), init.summary
    assert any(d.startswith("backward: ok where a gradient flows; none reaches #0 '0' (Linear): the loss does not depend "
                            "on its output") for d in init.details), init.details
    (healthy,) = run_checks(CheckContext(cfg("train.batch_size=16"), task_factory=regression_task,
                                         options={"out_dir": str(tmp_path)}), ["init"])
    assert not healthy.warning and "no_gradient" not in healthy.numbers


def test_a_zero_initialized_output_layer_passes_overfit_and_init_with_a_note(tmp_path):
    """GPT/DiT-style zero head: as built, init read 'forward vanishing at head (0x), backward vanishing at body.0 (0x)'
    and overfit 'embed.weight, body.0.* got no gradient' (from the first backward alone)."""
    ctx = CheckContext(cfg("train.batch_size=16"), task_factory=zero_head_task, options={"out_dir": str(tmp_path)})
    overfit, init = run_checks(ctx, ["overfit", "init"])
    assert overfit.passed and overfit.numbers["num_params_without_grad"] == 0, overfit.summary
    assert overfit.numbers["num_params_with_late_grad"] == 3  # embed.weight, body.0.weight, body.0.bias: from step 1
    assert overfit.details[0].endswith("zero at init: head.weight (a zero-initialized layer passes no gradient to the "
                                       "layers before it until its weight moves)")
    assert init.passed and not init.warning, init.summary
    assert init.summary == ("no layer flagged: the signal holds forward and backward (zero-initialized on purpose, "
                            "judged without the output layer head)")
    assert init.numbers["zero_init"] == ["head (the output layer)"] and init.numbers["flagged"] == 0
    assert init.details[0].startswith("head: zero-initialized output layer (head.weight all 0), taken as deliberate")
    # (as built, no gradient reaches the trainable layers before the zero head: each is flagged, embed too)
    assert init.details[1].endswith("As built (weight 0): 3 of 4 layers flagged: forward vanishing at #3 head (0x), "
                                    "backward vanishing at #1 body.0 (0x)"), init.details[1]
    rows = {d.split()[1]: d.split() for d in init.details if d.split()[0].isdigit()}
    assert rows["head"][7] == rows["head"][9] == "-" and rows["body.0"][9] == "1x"  # head: no ratio; body.0: its own ref
    saved = json.loads((tmp_path / "init_signal.json").read_text())
    assert [r["label"] for r in saved] == ["as built", "as built, zero-init layers excluded"]
    assert not saved[0]["passed"] and saved[1]["passed"]


def test_a_zero_layer_nothing_gets_around_still_fails_init_and_says_so(tmp_path):
    def chain():
        task = zero_head_task()
        task.model = nn.Sequential(nn.Embedding(16, 16), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                                   nn.Linear(16, 16))
        nn.init.zeros_(task.model[3].weight)  # the middle of a plain chain: layers 4 and 5 get no input signal
        return task

    (result,) = run_checks(CheckContext(cfg("train.batch_size=16"), task_factory=chain, options={"out_dir": str(tmp_path)}),
                           ["init"])
    assert not result.passed and result.numbers["zero_init"] == ["3 (nothing gets around it)"], result.summary
    assert result.details[0].startswith("3: 3.weight is all 0 and nothing gets around it (neither the output layer nor")
    assert "zero-initialized on purpose" not in result.summary


def test_unseeded_augmentation_in_the_dataset_is_named_as_the_data_and_does_not_fail_accum():
    ctx = CheckContext(cfg("train.batch_size=8"), task_factory=augmented_task)
    accum, determinism = run_checks(ctx, ["accum", "determinism"])
    assert accum.passed and not accum.warning, accum.summary  # both sides collate one fetch of the samples
    assert accum.numbers["items_random"] and not accum.numbers["collate_random"]
    assert accum.numbers["max_param_diff"] <= accum.numbers["tolerance"]
    assert any(d.startswith("the dataset returns different items for the same index") for d in accum.details)
    assert not determinism.passed
    assert determinism.numbers["diverged_component"] == DATA_COMPONENT
    assert determinism.summary.startswith("two runs from scratch differ first at step 1 in the data (the batches differ "
                                          "for the same indices: randomness in the dataset or collate not seeded by the "
                                          "run, e.g. a np.random.default_rng()"), determinism.summary
    (same,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=zero_head_task), ["determinism"])
    assert same.passed, same.summary  # the same task without the augmentation


def test_accum_check_calls_randomness_in_collate_inconclusive_not_the_loss():
    def random_collate_task():
        task = _classification()
        task.collate = lambda items: (torch.stack([x for x, _ in items]) + 0.1 * torch.randn(len(items), 8),
                                      torch.stack([y for _, y in items]))  # noise drawn per collation
        return task

    (result,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=random_collate_task), ["accum"])
    assert result.passed and result.warning, result.summary
    assert result.numbers["collate_random"] and not result.numbers["items_random"]
    assert result.summary.startswith("inconclusive: the batches differ between the two sides, not the loss "
                                     "normalization: the same samples collated twice give different batches")
    assert not any("the loss may depend on the batch" in d for d in result.details)


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


def _token_mean_task() -> Task:
    """Sequences of 2 to 16 tokens (padding 0 masked out) and a loss averaged over this batch's tokens, returned as a
    scalar: under accumulation each micro-batch is weighed by its samples, not its tokens."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 16, (64, 16), generator=g)
    lengths = torch.randint(2, 17, (64,), generator=g)
    tokens[torch.arange(16)[None, :] >= lengths[:, None]] = 0
    model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))

    def loss(m, batch):
        (t,) = batch if isinstance(batch, (list, tuple)) else (batch,)
        per = F.cross_entropy(m(t[:, :-1]).flatten(0, 1), t[:, 1:].flatten(), reduction="none")
        mask = (t[:, 1:] != 0).flatten().float()
        return (per * mask).sum() / mask.sum()

    return Task(model=model, train_data=TensorDataset(tokens), loss=loss, count_unit="tokens", name="token-mean")


def test_accum_check_names_a_scalar_mean_over_tokens_and_says_to_return_sum_and_count():
    (result,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=_token_mean_task), ["accum"])
    assert not result.passed and result.summary.endswith(
        "; the scalar loss is a mean over another unit than samples (tokens?): return (sum, count)"), result.summary
    [cause] = [d for d in result.details if d.startswith("the scalar loss is ")]
    assert "averages over another unit than samples" in cause and cause.endswith("weighs each by what it holds")
    # the two figures in as many digits as tell them apart (a trial's read '3.486 ... while ... give 3.486')
    assert apart(3.48601, 3.48612) == ("3.486", "3.4861") and apart(2.0, 3.0) == ("2", "3")
    shown = re.match(r"the scalar loss is (\S+) on the batch of \d+, while its micro-batches' losses weighed by their samples "
                     r"give (\S+):", cause)
    assert shown and shown[1] != shown[2], cause


def _alike_token_mean_task() -> Task:
    """The token-mean task with its output layer initialized small: every token's loss near ln 16 at step 0, so the
    whole batch's mean is off its micro-batches' sample-weighted mean by 5e-4 only (a tiny GPT at init: 8e-4)."""
    task = _token_mean_task()
    with torch.no_grad():
        task.model[1].weight.mul_(0.1)
        task.model[1].bias.zero_()
    return task


def test_accum_check_names_a_token_mean_whose_losses_are_still_alike_at_init():
    (result,) = run_checks(CheckContext(cfg("train.batch_size=8"), task_factory=_alike_token_mean_task), ["accum"])
    assert not result.passed and result.summary.endswith(
        "; the scalar loss is a mean over another unit than samples (tokens?): return (sum, count)"), result.summary


def _dead_relu_task() -> Task:
    """A ReLU stack whose hidden biases are -5: every ReLU is off at step 0."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 2))
    for layer in list(model)[:-1]:
        if isinstance(layer, nn.Linear):
            nn.init.constant_(layer.bias, -5.0)
    return Task(model=model, train_data=TensorDataset(x, (x[:, 0] > 0).long()), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def test_init_check_fails_a_net_whose_relus_are_all_dead_at_the_first_relu(tmp_path):
    """Every ReLU output 0: the first ReLU, dead too, was their reference (0 / 0: no ratio) and init said 'forward: ok'."""
    ctx = CheckContext(cfg("train.batch_size=16"), task_factory=_dead_relu_task, options={"out_dir": str(tmp_path)})
    [init] = run_checks(ctx, ["init"])
    assert not init.passed and init.numbers["forward"] == "vanishing at #1 1 (0x)", init.summary
    assert "forward: vanishes (0) at #1 '1' (ReLU): its output is all 0 (dead units), no signal goes past it" in init.details


class _TiedLM(nn.Module):
    """An embedding of std ``std`` whose transpose is the head: logits of std ~ std**2 * sqrt(width)."""

    def __init__(self, vocab: int = 32, width: int = 64, std: float = 1.0) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        nn.init.normal_(self.emb.weight, std=std)
        self.mix = nn.Linear(width, width)

    def forward(self, x):
        return torch.tanh(self.mix(self.emb(x))) @ self.emb.weight.T


def _tied_task(std: float) -> Task:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 32, (64, 8), generator=g)
    torch.manual_seed(0)
    return Task(model=_TiedLM(std=std), train_data=TensorDataset(x, x.roll(1, dims=1)),
                loss=lambda m, b: F.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten()))


def test_init_check_fails_a_first_loss_far_above_an_uninformed_guess_and_passes_a_head_near_it(tmp_path):
    """A head tied to an embedding of std 1 starts at ~2.2x ln 32; the same model at std 0.02 starts at ln 32."""
    bad = CheckContext(cfg("train.batch_size=16"), task_factory=lambda: _tied_task(1.0), options={"out_dir": str(tmp_path)})
    [init] = run_checks(bad, ["init"])
    n = init.numbers
    assert n["flagged"] == 0 and not init.passed, init.summary
    assert abs(n["uninformed_loss"] - math.log(32)) < 1e-5 and n["first_loss"] > 2 * math.log(32), n
    assert init.summary.endswith(f"; but the first loss {n['first_loss']:.4g} is {n['first_loss'] / math.log(32):.3g}x an "
                                 f"uninformed output's {math.log(32):.4g}: the output starts confidently wrong"), init.summary
    assert any("init the embedding at std ~0.02" in d for d in init.details)
    assert not any(d.startswith("init holds") for d in init.details), init.details  # (a trial: a FAIL said it holds)
    good = CheckContext(cfg("train.batch_size=16"), task_factory=lambda: _tied_task(0.02), options={"out_dir": str(tmp_path)})
    [init] = run_checks(good, ["init"])
    assert init.passed and abs(init.numbers["first_loss"] - math.log(32)) < 0.01, init.numbers
    assert any(d.startswith(f"the first loss {init.numbers['first_loss']:.4g} is "
                            f"{init.numbers['first_loss'] / init.numbers['uninformed_loss']:.3g}x an uninformed output's") and
               d.endswith("starts near an uninformed guess") for d in init.details), init.details


def _deep_std1_task() -> Task:
    """12 Linear+ReLU layers of width 32 initialized N(0, 1): the forward explodes (x ~4 a layer), the logits with it."""
    torch.manual_seed(0)
    layers = []
    for _ in range(12):
        layers += [nn.Linear(32, 32), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(32, 10))
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.normal_(0, 1.0)
                m.bias.zero_()
    g = torch.Generator().manual_seed(0)
    return Task(model=model, train_data=TensorDataset(torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)),
                loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def test_init_check_blames_a_huge_first_loss_on_the_exploding_forward_not_the_output_layer(tmp_path):
    """Scaling the head down (the advice for a head too large) leaves the 12 layers before it exploding."""
    [init] = run_checks(CheckContext(cfg("train.batch_size=16"), task_factory=_deep_std1_task,
                                     options={"out_dir": str(tmp_path)}), ["init"])
    assert not init.passed and init.numbers["forward"].startswith("exploding at #"), init.numbers
    [line] = [d for d in init.details if d.startswith("the first loss ")]
    assert "because the forward explodes before it (exploding at #" in line and "Scale the output layer" not in line, line
    assert "; and so the first loss " in init.summary and "; but " not in init.summary, init.summary


def test_uninformed_loss_says_nothing_of_a_model_whose_output_is_not_one_tensor_and_puts_back_batchnorm_stats():
    from stabletrain.diagnostics.loss_at_init import uninformed_loss

    class Pair(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x), x.sum()

    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    assert uninformed_loss(Pair(), (x, y), lambda m, b: F.cross_entropy(m(b[0])[0], b[1])) is None
    from stabletrain.diagnostics.loss_at_init import loss_at_init as _loss_at_init
    assert _loss_at_init(1.0, None)[1].startswith("the loss at init is not verified: the loss does not call the model once")
    for first in (float("inf"), float("nan")):  # a non-finite first loss fails, never "ok"
        _, line, fails = _loss_at_init(first, (math.log(10), 1.0, 10))
        assert fails and line.endswith("the first loss is non-finite (a NaN/Inf in the forward or the loss at init)"), line
    # A student's trials: a cross-entropy summed over a batch of 16 read 'not a cross-entropy on logits'; an input of
    # std 2.8e4 (every layer's verdict ok against the others) was told to scale the output layer's init down.
    _, line, fails = _loss_at_init(16 * math.log(4), (16 * math.log(4), 1.0, 4), items=(16,))
    assert not fails and line.endswith("not judged: 16 x ln 4, a cross-entropy summed over 16 items instead of averaged; "
                                       "the check judges a mean)"), line
    for zero in (347.0, 1234.5, 16 * math.log(4) * 1.01):  # a regression's loss is no exact multiple of the batch's ln C
        assert "not a cross-entropy on logits" in _loss_at_init(zero, (zero, 1.0, 2), items=(16,))[1]
    _, line, fails = _loss_at_init(2166.0, (math.log(4), 2390.0, 4), None, 2.82e4)
    assert fails and line.endswith("and the model's input has std 2.82e+04 (the first layer's): standardize the inputs "
                                   "(or scale them to std ~1) first; no layer's init corrects a scale the data brings"), line
    assert "Scale the output layer's init down" in _loss_at_init(2166.0, (math.log(4), 2390.0, 4), None, 1.0)[1]
    bn = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 3))
    before = bn[1].running_mean.clone()
    zero, std, classes = uninformed_loss(bn, (x, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert abs(zero - math.log(3)) < 1e-6 and std > 0 and classes == 3 and torch.equal(bn[1].running_mean, before)


def test_the_loss_at_init_is_not_judged_where_an_uninformed_output_is_not_a_uniform_guess(tmp_path):
    """A regression whose output starts far above its targets: its loss's scale is the targets', not ln C: not judged."""

    def loud_regression() -> Task:
        task = regression_task()
        with torch.no_grad():
            list(task.model.parameters())[-2].mul_(30.0)
        return task

    ctx = CheckContext(cfg("train.batch_size=16"), task_factory=loud_regression, options={"out_dir": str(tmp_path)})
    [init] = run_checks(ctx, ["init"])
    n = init.numbers
    assert n["first_loss"] > 10 * n["uninformed_loss"], n
    assert any("not judged: not a uniform guess's ln C" in d for d in init.details), init.details


def test_a_bn_resnets_backward_growth_is_the_architectures_not_a_failed_init(tmp_path, capsys):
    """A textbook BN ResNet failed init (backward 5.8x toward the input over 4 blocks) and was told to re-init with
    kaiming, which fails the same (4.9x): its norms undo any conv init's scale. Now: a warning that names the
    architecture and the fix that holds (zero-init each block's last BN weight: then it passes), no init advice; and a
    run of it says nothing at step 0."""
    from models_init import bn_resnet_task

    from stabletrain import Trainer

    ctx = CheckContext(cfg("train.batch_size=16"), task_factory=bn_resnet_task, options={"out_dir": str(tmp_path)})
    [init] = run_checks(ctx, ["init"])
    assert init.passed and init.warning and init.summary.startswith("no init's fault: backward explodes at #3 'blocks.0.c1'")
    assert "whatever the init: the architecture's, not the init's" in init.numbers["architecture"]
    assert not any(d.startswith("recommended init:") for d in init.details) and "zero_init_residual=True" in init.details[-2]
    assert init.numbers["recommended"] is None  # (a trial: an LSTM's numbers said recommended=auto beside it)
    fixed = CheckContext(cfg("train.batch_size=16"), task_factory=lambda: bn_resnet_task(zero_init_residual=True),
                         options={"out_dir": str(tmp_path)})
    [init] = run_checks(fixed, ["init"])
    assert init.passed and not init.warning, init.summary
    capsys.readouterr()
    Trainer(cfg("train.max_steps=2", "log.every=2", "train.batch_size=16"), task=bn_resnet_task(), run_dir=tmp_path / "run").fit()
    assert "init at step 0" not in capsys.readouterr().out
    signal = json.loads((tmp_path / "run" / "snapshot.json").read_text())["init_signal"]
    assert not signal["passed"] and "the architecture's, not the init's" in signal["architecture"], signal


class _ConfidentlyWrong(nn.Module):
    """Logits w * c: class 0 at a margin of 1e4 over the others, w (trainable) from 0.6: the loss is ~w x 1e4 on labels
    1-3, and a uniform guess's ln 4 only once w reaches 0 (200 of the check's steps at its lr 3e-3)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.tensor(0.6))

    def forward(self, x):
        return self.w * torch.tensor([1e4, 0.0, 0.0, 0.0]).expand(len(x), 4)


def test_overfit_does_not_pass_a_loss_halved_far_above_a_uniform_guess():
    """A new-user trial: 'overfit PASS loss 2.256e+05 -> 1.045e+05' (chance: ln 4 = 1.39). Halving proves nothing
    memorized where the loss starts far above a uniform guess's: the target is below ln C too."""
    def task():
        x, y = torch.zeros(16, 3), torch.ones(16, dtype=torch.long)
        return Task(model=_ConfidentlyWrong(), train_data=TensorDataset(x, y),
                    loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

    (res,) = run_checks(CheckContext(cfg(), task_factory=task), ["overfit"])
    assert not res.passed and math.isclose(res.numbers["target"], math.log(4), rel_tol=1e-6)
    assert res.numbers["final_loss"] < res.numbers["initial_loss"] / 2
    assert "(target < 1.386 within 150: a uniform guess's ln 4, below initial/2)" in res.summary, res.summary
    assert any("but stays" in d and "a uniform guess's 1.386" in d and "check init" in d for d in res.details), res.details
    (ok,) = run_checks(CheckContext(cfg(), task_factory=regression_task), ["overfit"])  # a regression: initial/2, as before
    assert ok.passed and "(target < initial/2 within 150)" in ok.summary, ok.summary


def test_overfit_probes_the_uniform_guess_under_the_runs_autocast():
    """A bf16 model fed float inputs trains under precision=bf16's autocast; the uninformed-output probe ran without it
    and raised 'mat1 and mat2 must have the same dtype', failing the check of a model that trains."""
    def task():
        x, y = torch.randn(16, 8), torch.arange(16) % 4
        return Task(model=nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).to(torch.bfloat16),
                    train_data=TensorDataset(x, y), loss=lambda m, b: F.cross_entropy(m(b[0]).float(), b[1]))

    (res,) = run_checks(CheckContext(cfg("precision=bf16"), task_factory=task), ["overfit"])
    assert res.passed and math.isclose(res.numbers["uniform_guess"], math.log(4), rel_tol=1e-3), (res.summary, res.numbers)


class _LazyRedraw(nn.Module):
    """An MLP whose first forward re-draws its weights N(0, 1) (a lazy init): whatever init it was built with is gone."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
        for m in self.body:
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight)
        self.drawn = False

    def forward(self, x):
        if not self.drawn:
            self.drawn = True
            with torch.no_grad():
                for m in self.body:
                    if isinstance(m, nn.Linear):
                        m.weight.normal_()
        return self.body(x)


def _lazy_redraw_task() -> Task:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 8, generator=g), torch.randint(0, 4, (64,), generator=g)
    torch.manual_seed(0)
    return Task(model=_LazyRedraw(), train_data=TensorDataset(x, y), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def test_check_init_says_an_init_the_first_forward_overwrites_and_recommends_no_scheme(capsys):
    """A new-user trial: Kaiming, then the first forward re-draws N(0, 1): 'init FAIL ... recommended init: init_(model,
    'kaiming')' (the init it has), the overwrite unsaid there, and the runs' own line printed once per run of the doctor."""
    init, determinism = run_checks(CheckContext(cfg(), task_factory=_lazy_redraw_task), ["init", "determinism"])
    assert not init.passed and init.summary.startswith("the model's first forward changed 3 parameter(s); ")
    assert [c["name"] for c in init.numbers["init_overwritten"]] == ["body.0.weight", "body.2.weight", "body.4.weight"]
    assert any(d.startswith("init overwritten in the model's first forward: 3 parameter(s)") and "remove the "
               "re-initialization" in d for d in init.details), init.details
    assert not any(d.startswith(("recommended init:", "init holds")) for d in init.details), init.details
    assert init.numbers["recommended"] is None  # (a trial: the numbers still said recommended=kaiming)
    saved = json.loads(Path(init.numbers["json"]).read_text())  # (a review: init_signal.json still named it)
    assert saved and all(r["recommended"] is None for r in saved)
    printed = capsys.readouterr()
    assert (printed.out + printed.err).count("init overwritten in the model's first forward") == 1  # two runs, one line


def test_check_init_takes_a_lazy_model_and_an_embeddings_max_norm_is_no_overwritten_init():
    """A review: InitFingerprint.take raised on a lazy module (no values before its first forward), and nn.Embedding's
    max_norm, which renormalizes rows in the forward by design, read as an init the forward overwrites."""
    def lazy():
        task = regression_task()
        task.model = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.Linear(16, 1))
        return task

    (res,) = run_checks(CheckContext(cfg(), task_factory=lazy), ["init"])
    assert "the check raised" not in res.summary and "init_overwritten" not in res.numbers, res.summary

    def capped():
        g = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, 20, (64, 6), generator=g), torch.randint(0, 4, (64,), generator=g)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(20, 16, max_norm=1.0), nn.Flatten(), nn.Linear(96, 4))
        return Task(model=model, train_data=TensorDataset(x, y), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))

    (res,) = run_checks(CheckContext(cfg(), task_factory=capped), ["init"])
    assert "init_overwritten" not in res.numbers and "changed" not in res.summary, res.summary


def test_check_nan_counts_the_non_finite_gradients_rather_than_naming_a_first():
    """A new user's trial: 'first non-finite grad: wte.weight' for a NaN planted in blocks.2.attn.qkv read as 'the NaN
    reached the embedding first'; it was the first parameter in registration order (every gradient is NaN)."""
    (res,) = run_checks(CheckContext(cfg()), ["nan"])
    assert res.passed and res.summary.endswith("6 of 6 parameters' gradients are non-finite after its backward"), res.summary
    assert "first_nonfinite_grad" not in res.numbers and res.numbers["nonfinite_grads"] == 6


class _SumOfSquares(nn.Module):
    """A hand-written variance: the sum of squares of 64 features of ~100 passes fp16's 65504, so the division by its
    square root zeroes the features, and the loss stays finite."""

    def __init__(self):
        super().__init__()
        self.fc, self.head = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = self.fc(x) * 100.0
        var = (h * h).sum(-1, keepdim=True) / h.shape[-1]
        return self.head(h / torch.sqrt(var + 1e-5))


def _hidden_overflow() -> Task:
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    return Task(model=_SumOfSquares(), train_data=TensorDataset(torch.randn(64, 32, generator=g),
                                                                 torch.randint(0, 10, (64,), generator=g)),
                loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def test_an_overflow_inside_the_forward_that_the_loss_hides_fails_amp_and_overfit_says_so():
    """A new user's trial: the sum of squares is inf in fp16, the features it divides become 0 and the loss is finite:
    'amp PASS' (it listed the sum as run in fp16), then 'overfit' blamed a detached graph for the missing gradients."""
    (amp,) = run_checks(CheckContext(cfg("precision=fp16", "train.batch_size=8"), task_factory=_hidden_overflow), ["amp"])
    assert not amp.passed and "a value inside the forward is not finite under fp16 autocast (the loss is)" in amp.summary
    [why] = [d for d in amp.details if d.startswith("the loss is finite under fp16")]
    assert "aten.sum.dim_IntList in forward of the root module (origin: inputs finite" in why, why
    (fine,) = run_checks(CheckContext(cfg("precision=bf16", "train.batch_size=8"), task_factory=_hidden_overflow), ["amp"])
    assert fine.passed, fine.details  # bf16 has fp32's range
    (overfit,) = run_checks(CheckContext(cfg("precision=fp16"), task_factory=_hidden_overflow), ["overfit"])
    assert not overfit.passed and not any("look for a detached graph" in d for d in overfit.details), overfit.details
    assert any(d.startswith("under fp16 autocast a value inside the forward is not finite (in fp32 it is") for d in
               overfit.details), overfit.details


def test_a_run_says_an_output_that_starts_confidently_wrong_and_gives_no_init_advice_for_a_forward_that_redraws(tmp_path,
                                                                                                            capsys):
    """A new user's trials: a run of a head tied to an embedding of std 1 printed nothing at step 0 and its report said
    'the signal held through every layer' (check init fails its loss at init, 8x ln C); a run of a model whose first
    forward re-draws its weights recommended init_(model, 'xavier'), which that forward wipes (check init: none)."""
    from stabletrain import Trainer
    from stabletrain.report import load_run
    from stabletrain.report.health import health_summary

    def run(name, task):
        capsys.readouterr()
        Trainer(cfg("train.max_steps=2", "log.every=2", "train.batch_size=16", "log.tensorboard=false"), task=task,
                run_dir=tmp_path / name).fit()
        said = [x for x in capsys.readouterr().out.splitlines() if x.startswith("stabletrain: init at step 0")]
        return said, json.loads((tmp_path / name / "snapshot.json").read_text())["init_signal"]

    said, signal = run("tied", _tied_task(1.0))
    loss = signal["loss_at_init"]
    assert signal["passed"] and loss["fails"] and loss["first_loss"] > 2 * loss["uninformed_loss"], signal
    assert said == [f"stabletrain: init at step 0: {loss['line']}"] and "confidently wrong" in loss["line"], said
    sentences = [t for _, t in health_summary(load_run(tmp_path / "tied")).sentences if t.startswith("At step 0")]
    assert sentences == [f"At step 0 the signal held through every layer, but {loss['line']}."], sentences
    said, signal = run("small", _tied_task(0.02))
    assert not said and not signal["loss_at_init"]["fails"], (said, signal)
    said, signal = run("redraw", _lazy_redraw_task())
    assert signal["advice"].startswith("no init advice: the model's first forward re-draws 3 parameter(s) (body.0.weight"), \
        signal["advice"]
    assert not any("recommended init" in x for x in said) and signal["init_overwritten"], said


class _Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(self.act(self.fc1(x)))


def _residual_task(kaiming: bool, marked: bool = False) -> Task:
    """24 residual blocks of ReLU MLPs (no norm layers), Kaiming-initialized or as PyTorch builds them."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), *[_Block(64) for _ in range(24)], nn.Linear(64, 10))
    for block in model[1:-1]:
        block.fc2.residual_branch_out = marked
    if kaiming:
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                nn.init.zeros_(m.bias)
    return Task(model=model, train_data=TensorDataset(x, (x[:, :10]).argmax(1)), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def test_a_scheme_that_fails_too_is_not_recommended_and_a_passing_init_is_kept(tmp_path):
    """A trial: a residual net at Kaiming exploded and was told init_(model, 'kaiming'), which fails alike; the same net
    as PyTorch builds it passed and was told 'the scheme for these activations would be kaiming', which breaks it.
    Marking the branches' output layers (what the advice names) makes init_('kaiming') pass."""
    out = {"out_dir": str(tmp_path)}
    [init] = run_checks(CheckContext(cfg("train.batch_size=64"), task_factory=lambda: _residual_task(True), options=out),
                        ["init"])
    assert not init.passed and init.numbers["recommended"] is None, (init.summary, init.numbers)
    assert not any(d.startswith("recommended init:") for d in init.details), init.details
    assert any(d.startswith("no init advice: init_(model, 'kaiming'), the scheme for these activations, fails here too (")
               and "residual_branch_out = True" in d for d in init.details), init.details
    [kept] = run_checks(CheckContext(cfg("train.batch_size=64"), task_factory=lambda: _residual_task(False), options=out),
                        ["init"])
    assert kept.passed and kept.numbers["recommended"] is None
    assert any(d.startswith("init holds as built: keep it (saw ReLU x24)") for d in kept.details), kept.details
    marked = {**out, "compare": "kaiming"}
    [cured] = run_checks(CheckContext(cfg("train.batch_size=64"), task_factory=lambda: _residual_task(True, marked=True),
                                      options=marked), ["init"])
    assert cured.numbers["init_('kaiming').flagged"] == 0 and cured.numbers["recommended"] == "kaiming", cured.numbers
    # The run's own step-0 line: the same advice
    from stabletrain import Trainer

    Trainer(cfg("train.max_steps=1", "train.batch_size=64"), task=_residual_task(True), run_dir=tmp_path / "run").fit()
    signal = json.loads((tmp_path / "run" / "init_signal.json").read_text())
    assert signal["recommended"] is None and signal["advice"].startswith("no init advice: init_(model, 'kaiming'), the "
                                                                          "scheme for these activations, fails here too")


def test_overfit_on_a_batch_whose_loss_counts_no_item_says_so_not_an_op_or_late_gradients(tmp_path):
    """A trial: every token masked out, the loss (sum, 0): the check said 'no op of the forward made one (the batch or a
    parameter holds it)' and '7 parameter(s) got no gradient at the first step and got one later' (NaN gradients of
    skipped steps). The 0/0 is the mean's: said as the run's own incident says it. The user's own masked mean (its 0/0
    an op of theirs) is still traced to its op."""
    ctx = CheckContext(cfg("data.shuffle=false", "train.batch_size=8"), task_factory=lambda: all_masked_first_task(True),
                       options={"out_dir": str(tmp_path)})
    (overfit,) = run_checks(ctx, ["overfit"])
    assert not overfit.passed and overfit.details == [] and overfit.numbers["num_items"] == 0
    assert overfit.summary.startswith("the fixed batch (dataset indices 0-7) holds no item its loss counts (count 0: "), overfit
    ctx = CheckContext(cfg("data.shuffle=false", "train.batch_size=8"), task_factory=all_masked_first_task,
                       options={"out_dir": str(tmp_path)})
    (overfit,) = run_checks(ctx, ["overfit"])
    assert not overfit.passed and overfit.details[0].endswith("first non-finite value in the forward: aten.div.Tensor in "
                                                              "forward outside any module (origin: inputs finite; nan in "
                                                              "1/1 float32 elements)"), overfit.details
