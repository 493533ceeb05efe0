"""signal_report: per-layer verdicts on deep MLPs and residual stacks, the update ratios, the init check."""

from __future__ import annotations

import json
import math

import pytest
import torch
from models_init import (  # noqa: F401
    FunctionalReLUStack,
    ResidualStack,
    RNNModel,
    classification_batch,
    classification_loss,
    lm_batch,
    lm_loss,
    make_lm_task,
    single_thread,
)
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain.checks import CheckContext, run_checks
from stabletrain.config import load_config
from stabletrain.diagnostics.signal_display import format_comparison, format_report, format_updates, plot_signal
from stabletrain.diagnostics.signal_propagation import SignalThresholds, signal_report
from stabletrain.tasks import Task
from stabletrain.tasks.init_schemes import init_
from stabletrain.tasks.mlp import make_mlp

pytestmark = pytest.mark.usefixtures("single_thread")

WIDTH, DEPTH = 128, 12


def _mlp_report(activation: str, scheme: str | None, seed: int = 0, **init_kwargs):
    """The chapter's exercise: a 12-layer MLP (32 -> 11 x 128 -> 10); scheme None keeps PyTorch's default init."""
    torch.manual_seed(seed)
    model = make_mlp(32, WIDTH, DEPTH, 10, activation)
    if scheme is not None:
        init_(model, scheme, **init_kwargs)
    return signal_report(model, classification_batch(), classification_loss, label=str(scheme))


def _layer(report, name):
    return next(layer for layer in report.layers if layer.name == name)


def test_relu_mlp_with_n01_init_explodes_forward_at_the_second_hidden_layer():
    # Each Linear with N(0, 1) weights multiplies the std of a ReLU net by sqrt(fan_in / 2) = 8: the first
    # activation compared with its reference ('1', the first ReLU) past the 4x threshold is '3', at ~8x.
    report = _mlp_report("relu", "normal")
    assert len(report.layers) == 2 * DEPTH - 1
    first = report.first_forward
    assert (first.index, first.name, first.kind, first.forward) == (3, "3", "ReLU", "exploding")
    assert first.forward_ratio == pytest.approx(math.sqrt(WIDTH / 2), rel=0.15)
    # Backward, the gradient grows by the same factor per layer going down: the first ReLU reached is '19'.
    back = report.first_backward
    assert (back.name, back.backward) == ("19", "exploding")
    assert back.backward_ratio == pytest.approx(math.sqrt(WIDTH / 2), rel=0.15)
    assert 0.5 < _layer(report, "21").forward_ratio / 8.0**10 < 2  # ten more layers of 8x: ~1e9
    assert not report.passed


def test_tanh_mlp_with_n01_init_saturates_forward_and_explodes_backward():
    # tanh bounds the forward signal (no flag), but through saturated units (pre-activation std ~11) each
    # layer multiplies the gradient by sqrt(128 * E[tanh'(h)^2]) ~ 2.5: the 2nd tanh below the top is flagged.
    report = _mlp_report("tanh", "normal")
    assert report.first_forward is None
    assert all(abs(layer.out_mean) <= 1 for layer in report.layers if layer.kind == "Tanh")
    assert 2.0 < _layer(report, "19").backward_ratio < 3.2
    back = report.first_backward
    assert (back.index, back.name, back.kind, back.backward) == (17, "17", "Tanh", "exploding")
    assert back.backward_ratio == pytest.approx(_layer(report, "19").backward_ratio ** 2, rel=0.2)


@pytest.mark.parametrize("activation, scheme", [("tanh", "xavier"), ("relu", "kaiming"), ("relu", "auto"),
                                                ("tanh", "auto")])
def test_the_matching_scheme_holds_for_twelve_layers(activation, scheme):
    report = _mlp_report(activation, scheme)
    assert report.passed, report.summary("forward") + " / " + report.summary("backward")
    hidden = [layer for layer in report.layers if layer.kind == "Linear"][1:-1]
    assert max(abs(math.log(layer.forward_ratio)) for layer in hidden) < math.log(2)  # within 2x of the reference
    assert report.recommended == ("kaiming" if activation == "relu" else "xavier")


def test_pytorch_default_linear_init_shrinks_a_deep_relu_mlp():
    # nn.Linear's default weight variance is 1 / (3 fan_in): through a ReLU each layer keeps 1/6 of the
    # variance, so the gradient std shrinks by 1/sqrt(6) = 0.408 per layer on the way down (no floor), and
    # the activation std follows v' = v / 6 + 1 / (3 fan_in) (the default bias's variance is its floor).
    report = _mlp_report("relu", None)
    relus = [layer for layer in report.layers if layer.kind == "ReLU"]
    per_layer = (relus[0].backward_ratio / relus[-1].backward_ratio) ** (1 / (len(relus) - 1))
    assert per_layer == pytest.approx(1 / math.sqrt(6), rel=0.05)
    linears = [layer for layer in report.layers if layer.kind == "Linear"][:-1]
    variance = linears[0].out_std ** 2
    for layer in linears[1:]:
        variance = variance / 6 + 1 / (3 * WIDTH)
        assert layer.out_std == pytest.approx(math.sqrt(variance), rel=0.15), layer.name
    assert (report.first_forward.name, report.first_forward.forward) == ("5", "vanishing")
    assert (report.first_backward.name, report.first_backward.backward) == ("17", "vanishing")
    assert report.recommended == "kaiming"


def test_residual_stack_grows_as_sqrt_depth_without_branch_scaling_and_holds_with_it():
    depth = 32
    torch.manual_seed(0)
    model = ResidualStack(width=128, depth=depth)
    init_(model, "kaiming", num_residual_branches=1)  # no branch scaling
    report = signal_report(model, classification_batch(in_dim=16), classification_loss)
    stream = [layer for layer in report.layers if layer.name.endswith(".norm") and layer.name.startswith("blocks")]
    # Every block adds a branch of about the stream's initial variance: the std entering block l is sqrt(1 + l) x.
    assert stream[-1].forward_ratio == pytest.approx(math.sqrt(depth), rel=0.15)
    first = report.first_forward
    assert first.kind == "LayerNorm" and first.forward == "exploding"
    assert first.name in {f"blocks.{i}.norm" for i in range(15, 21)}  # sqrt(1 + l) passes 4 at l = 15
    assert "residual_branch_out" in report.advice()

    torch.manual_seed(0)
    scaled = ResidualStack(width=128, depth=depth)
    init_(scaled, "kaiming")  # branch outputs x 1/sqrt(32): the stream's variance at most doubles
    report = signal_report(scaled, classification_batch(in_dim=16), classification_loss)
    assert report.passed
    stream = [layer for layer in report.layers if layer.name.endswith(".norm") and layer.name.startswith("blocks")]
    assert stream[-1].forward_ratio == pytest.approx(math.sqrt(2), rel=0.15)


def test_report_leaves_the_model_as_it_was_and_measures_one_sgd_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 10))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = classification_batch()
    report = signal_report(model, batch, classification_loss,
                           make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # weights and BatchNorm running stats
    assert all(p.grad is None for p in model.parameters())
    classification_loss(model, batch).backward()
    w = model[0].weight
    expected = (0.1 * w.grad).norm() / w.norm()  # SGD: update = lr * grad
    ratio = next(u for u in report.updates if u.name == "0.weight")
    assert ratio.ratio == pytest.approx(expected.item(), rel=1e-4)
    assert report.optimizer == "SGD(lr=0.1)"
    assert next(u for u in report.updates if u.name == "3.bias").ratio == pytest.approx(
        (0.1 * model[3].bias.grad).norm().item() / model[3].bias.norm().item(), rel=1e-4)
    assert report.loss == pytest.approx(classification_loss(model, batch).item(), rel=1e-6)

    def broken_loss(m, b):
        m(b[0])
        raise RuntimeError("planted")

    model.zero_grad(set_to_none=False)
    with pytest.raises(RuntimeError, match="planted"):
        signal_report(model, batch, broken_loss)
    assert all(p.grad is not None and torch.count_nonzero(p.grad) == 0 for p in model.parameters())  # grads put back


def test_sum_count_loss_and_repeated_modules_and_nonfinite_output():
    torch.manual_seed(0)
    block = nn.Linear(8, 8)
    model = nn.Sequential(block, nn.Tanh(), block)  # one module called twice

    def loss(m, batch):
        return (m(batch) ** 2).sum(), batch.shape[0]  # (sum, count): the report backpropagates sum / count

    report = signal_report(model, torch.randn(4, 8), loss)
    assert [layer.name for layer in report.layers] == ["0#0", "1", "0#1"]
    assert [layer.call for layer in report.layers] == [0, None, 1]
    # Used in two roles (before and after the Tanh): each call is its own reference, never the other's.
    assert [layer.ref_forward for layer in report.layers] == ["0#0", "1", "0#1"]
    assert [layer.param_name for layer in report.layers] == ["0.weight", None, "0.weight"]

    class Looped(nn.Module):  # a weight-shared block applied in a loop: its calls are compared across depth
        def __init__(self) -> None:
            super().__init__()
            self.block, self.act = nn.Linear(8, 8), nn.ReLU()

        def forward(self, x):
            for _ in range(3):
                x = self.act(self.block(x))
            return x

    looped = signal_report(Looped(), torch.randn(4, 8), loss)
    assert [layer.name for layer in looped.layers] == ["block#0", "act#0", "block#1", "act#1", "block#2", "act#2"]
    assert [layer.ref_forward for layer in looped.layers] == ["block#0", "act#0"] * 3
    assert [layer.ref_backward for layer in looped.layers] == ["block#2", "act#2"] * 3
    bad = signal_report(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), torch.full((4, 8), math.inf), loss)
    assert bad.layers[1].forward == "exploding"


def test_thresholds_are_stated_and_validated():
    assert "more than 4x" in SignalThresholds().describe() and "less than 1/4" in SignalThresholds().describe()
    with pytest.raises(ValueError, match="SignalThresholds.explode: expected a number > 1, got 0.5"):
        SignalThresholds(explode=0.5)
    report = _mlp_report("relu", "kaiming")
    lines = format_report(report)
    assert lines[0] == SignalThresholds().describe()
    assert lines[1].split()[:4] == ["#", "layer", "type", "in"]
    assert len([line for line in lines if line.split()[0].isdigit()]) == 2 * DEPTH - 1


def test_plot_has_several_runs_and_the_comparison_table_one_column_per_run(tmp_path):
    reports = [_mlp_report("relu", s) for s in ("normal", "kaiming")]
    path = plot_signal(reports, tmp_path / "sub" / "init_signal.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lines = format_comparison(reports)
    cells = next(line for line in lines if line.split()[:3] == ["3", "3", "ReLU"]).split()[3:]
    assert cells == [f"{reports[0].layers[3].forward_ratio:.3g}x", f"{reports[0].layers[3].backward_ratio:.3g}x",
                     "exploding", f"{reports[1].layers[3].forward_ratio:.3g}x",
                     f"{reports[1].layers[3].backward_ratio:.3g}x", "ok"]
    assert lines[-2].startswith("normal: FAIL; forward: explodes at #3 '3' (ReLU)")
    assert lines[-1] == "kaiming: PASS; forward: ok; backward: ok"


def test_init_check_compares_schemes_on_the_12_layer_mlp(tmp_path):
    cfg = load_config(None, ["task=mlp", "task_args.depth=12", "train.batch_size=64"])
    ctx = CheckContext(cfg, options={"compare": ["normal", "xavier", "kaiming"], "out_dir": str(tmp_path)})
    [result] = run_checks(ctx, ["init"])
    n = result.numbers
    assert (n["init_('normal').flagged"], n["init_('xavier').flagged"], n["init_('kaiming').flagged"]) == (21, 0, 0)
    assert n["layers"] == 23 and n["recommended"] == "kaiming"
    assert not result.passed  # the task as built (PyTorch's default init) shrinks over 12 layers
    assert result.summary.endswith("schemes without a flagged layer: init_('xavier'), init_('kaiming')")
    assert (tmp_path / "init_signal.png").read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((tmp_path / "init_signal.json").read_text())
    assert [r["label"] for r in saved] == ["as built", "init_('normal')", "init_('xavier')", "init_('kaiming')"]
    assert saved[1]["first_forward"]["name"] == "3" and saved[1]["first_forward"]["verdict"] == "exploding"
    assert any("init_('normal'): FAIL; forward: explodes at #3" in d for d in result.details)

    with pytest.raises(ValueError, match="--compare: unknown init scheme 'he'"):
        from stabletrain.checks.init import check_init
        check_init(CheckContext(cfg, options={"compare": ["he"], "out_dir": str(tmp_path)}))


def test_init_check_passes_on_a_user_task_with_kaiming_init(tmp_path):
    def make_task() -> Task:
        model = make_mlp(32, 64, 8, 10, "relu")
        init_(model, "kaiming")
        x, y = classification_batch(num=256)
        return Task(model=model, train_data=TensorDataset(x, y), loss=classification_loss)

    cfg = load_config(None, ["task=mypkg:make_task"])
    [result] = run_checks(CheckContext(cfg, task_factory=make_task, options={"out_dir": str(tmp_path)}), ["init"])
    assert result.passed, result.summary
    assert result.summary == "no layer flagged: the signal holds forward and backward"
    assert (result.numbers["flagged"], result.numbers["forward"], result.numbers["backward"]) == (0, "ok", "ok")
    assert result.numbers["plot"] == str(tmp_path / "init_signal.png")
    assert result.details[0].startswith("verdicts: exploding when a layer's std is more than 4x")
    assert any(d.startswith("update/weight (rms) after one AdamW(lr=0.001) step") for d in result.details)


# -- reused modules, embeddings and recurrent layers (word_language_model) -------------------------------


@pytest.mark.parametrize("tie_weights", [False, True])
def test_word_language_model_passes_the_init_check_with_its_dropout_reused_around_the_lstm(tmp_path, tie_weights):
    # pytorch/examples word_language_model: drop(encoder(x)) -> LSTM -> drop(out) -> decoder, one Dropout
    # module called twice. Compared with itself, its first call's gradient was 0.045x its second's (the
    # LSTM in between attenuates it): "backward vanishing at #1 drop". Per call, each is its own layer.
    cfg = load_config(None, ["task=wlm:make_task", "train.batch_size=20"])
    ctx = CheckContext(cfg, task_factory=lambda: make_lm_task(tie_weights), options={"out_dir": str(tmp_path)})
    [result] = run_checks(ctx, ["init"])
    assert result.passed, result.summary
    rows = [d.split() for d in result.details if d.split()[0].isdigit()]
    assert [row[1] for row in rows] == ["encoder", "drop#0", "rnn", "drop#1", "decoder"]
    assert all(row[-1] == "ok" for row in rows) and not any(d.endswith(("large", "small")) for d in result.details)
    saved = json.loads((tmp_path / "init_signal.json").read_text())[0]
    layers = {layer["name"]: layer for layer in saved["layers"]}
    assert list(layers) == ["encoder", "drop#0", "rnn", "drop#1", "decoder"]
    assert (layers["drop#0"]["call"], layers["drop#1"]["call"]) == (0, 1)
    assert layers["drop#0"]["ref_backward"] == "drop#0" and layers["drop#1"]["ref_backward"] == "drop#1"
    assert layers["drop#0"]["backward_ratio"] == 1.0
    assert layers["encoder"]["role"] == "embedding" and layers["encoder"]["forward_ratio"] is None
    rnn = layers["rnn"]
    assert rnn["role"] == "recurrent" and rnn["ref_backward"] == "rnn at its middle time step"
    assert 1 / 1.5 < rnn["forward_ratio"] < 1.5 and 1 / 1.5 < rnn["backward_ratio"] < 1.5  # a stable LSTM: ~1x
    assert any(d.startswith("a recurrent layer (RNN/LSTM/GRU)") for d in result.details)


def test_a_recurrent_layer_is_judged_through_time():
    # A sequence classifier reads the LSTM's last output only: with PyTorch's default LSTM init (forget gate
    # ~0.5) the gradient reaching the first of 50 steps is ~1e-5 of the middle one's: really vanishing. A ReLU
    # RNN with recurrent weights 1.3 I explodes both ways. word_language_model's LSTM (loss at every step)
    # stays within 1.5x, and stacking 4 layers does not change that.
    class SeqClassifier(nn.Module):
        def __init__(self, rnn: nn.Module) -> None:
            super().__init__()
            self.proj, self.rnn, self.head = nn.Linear(8, 8), rnn, nn.Linear(32, 2)

        def forward(self, x):
            return self.head(self.rnn(self.proj(x))[0][:, -1])

    torch.manual_seed(0)
    batch = (torch.randn(16, 50, 8), torch.randint(0, 2, (16,)))
    report = signal_report(SeqClassifier(nn.LSTM(8, 32, batch_first=True)), batch, classification_loss)
    back = report.first_backward
    assert (back.name, back.backward, report.first_forward) == ("rnn", "vanishing", None)
    assert back.backward_ratio < 1e-3
    assert report.summary("backward").startswith(
        "backward: vanishes at #1 'rnn' (LSTM): through time: grad std at its input's first time step")

    relu_rnn = nn.RNN(8, 32, batch_first=True, nonlinearity="relu")
    with torch.no_grad():
        relu_rnn.weight_hh_l0.copy_(1.3 * torch.eye(32))
        relu_rnn.bias_hh_l0.fill_(0.1)
    report = signal_report(SeqClassifier(relu_rnn), batch, classification_loss)
    assert (report.first_forward.name, report.first_forward.forward) == ("rnn", "exploding")
    assert (report.first_backward.name, report.first_backward.backward) == ("rnn", "exploding")
    assert report.first_forward.forward_ratio > 100 and report.first_backward.backward_ratio > 100

    torch.manual_seed(0)
    deep = signal_report(RNNModel(nlayers=4), lm_batch(), lm_loss)
    assert deep.passed and 1 / 1.5 < deep.layers[2].backward_ratio < 1.5


class _Times(nn.Module):
    """Multiplies by a constant: no init can undo it."""

    def forward(self, x):
        return 8 * x


def test_compare_never_recommends_a_scheme_that_failed(tmp_path):
    def make_task() -> Task:
        model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(32, 32), nn.ReLU(), _Times())], nn.Linear(32, 10))
        x, y = classification_batch(num=64)
        return Task(model=model, train_data=TensorDataset(x, y), loss=classification_loss)

    cfg = load_config(None, ["task=mypkg:make_task"])
    options = {"compare": ["kaiming", "xavier"], "out_dir": str(tmp_path)}
    [result] = run_checks(CheckContext(cfg, task_factory=make_task, options=options), ["init"])
    assert (result.numbers["init_('kaiming').flagged"] > 0, result.numbers["init_('xavier').flagged"] > 0) == (True, True)
    assert result.numbers["recommended"] is None  # kaiming, what the activations call for, failed: not recommended
    assert not any("recommended init" in d for d in result.details)  # (a trial: the numbers said kaiming beside it)
    assert {r["recommended"] for r in json.loads((tmp_path / "init_signal.json").read_text())} == {None}
    assert result.details[-1] == ("no init scheme compared passes (init_(model, 'kaiming'), init_(model, 'xavier') fail "
                                  "too): none is recommended; look at the first flagged layer above, the init alone "
                                  "does not fix it")


def test_compare_on_a_model_calling_torch_relu_traces_it_and_recommends_kaiming(tmp_path):
    """A ModuleList of Linear(64, 64) + torch.relu at N(0, 0.02^2): init_ saw no activation module, so auto, xavier and
    kaiming all drew std 1/8 and failed alike (7 flagged layers each, 'the init alone does not fix it')."""
    def make_task() -> Task:
        x, y = classification_batch(num=64, in_dim=64)
        return Task(model=FunctionalReLUStack(depth=8, width=64), train_data=TensorDataset(x, y), loss=classification_loss)

    cfg = load_config(None, ["task=mypkg:make_task"])
    options = {"compare": ["auto", "xavier", "kaiming"], "out_dir": str(tmp_path)}
    [result] = run_checks(CheckContext(cfg, task_factory=make_task, options=options), ["init"])
    n = result.numbers
    assert n["flagged"] == 8 and n["recommended"] == "kaiming"
    assert (n["init_('auto').flagged"], n["init_('xavier').flagged"], n["init_('kaiming').flagged"]) == (0, 0, 0)
    assert result.details[-1] == "recommended init: init_(model, 'kaiming') (it passes here; saw torch.relu x8)"
    saved = json.loads((tmp_path / "init_signal.json").read_text())
    assert saved[0]["activations"] == {"torch.relu": 8}


# -- update/weight ratios, calibrated to the optimizer ---------------------------------------------------


def test_adamw_update_ratios_are_judged_against_lr_over_weight_rms_not_the_sgd_band():
    # AdamW's first step moves each element by lr (m / sqrt(v) = g / |g|): on a Kaiming MLP of width 512 the
    # hidden weights have rms sqrt(2 / 512) = 0.0625 -> ratio 1e-3 / 0.0625 = 0.016, "large" by the SGD band
    # (above 0.01; the 0.014-0.016). Against the AdamW band (0.1 x lr/rms(w) .. 0.1) nothing is.
    torch.manual_seed(0)
    model = make_mlp(32, 512, 4, 10, "relu")
    init_(model, "kaiming")
    report = signal_report(model, classification_batch(), classification_loss,
                           make_optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    assert report.adaptive
    weights = [u for u in report.updates if u.name.endswith("weight")]
    for u in weights:  # within 10%: the rows of a few dead ReLU units get no gradient and do not move
        assert 0.9 < u.ratio / (1e-3 / u.weight_rms) <= 1.0 + 1e-4, u.name
        assert (u.low, u.high, u.mark) == (pytest.approx(0.1 * 1e-3 / u.weight_rms), 0.1, "")
    assert max(u.ratio for u in weights) > SignalThresholds().update_high  # "large" by the SGD band
    lines = format_updates(report)
    assert lines[0].startswith("update/weight (rms) after one AdamW(lr=0.001) step: an Adam-like first step moves")
    first = next(line for line in lines if line.split()[0] == "0.weight")
    assert first.split()[1:] == [f"{weights[0].ratio:.3g}", "band", f"{weights[0].low:.3g}..0.1"]

    # lr 0.1 moves these weights by more than half their size: every weight is large.
    big = signal_report(model, classification_batch(), classification_loss,
                        make_optimizer=lambda p: torch.optim.AdamW(p, lr=0.1))
    assert all(u.mark == "large" for u in big.updates if u.ratio is not None)
    # the rows above the band are said under the table (a new user read 'PASS' beside 8 'large' rows of the default gpt)
    large = sum(u.mark == "large" for u in big.updates if u.ratio is not None)
    assert format_updates(big)[-1].startswith(f"  {large} above the band: one step moves those weights by more than the "
                                              "band's top (lr is large for their scale)")
    assert "above the band" not in " ".join(lines)  # (none at lr 1e-3: no such line)


def test_adam_marks_small_a_parameter_most_of_whose_elements_got_no_gradient():
    # An embedding of 1000 rows seen through 4 token ids: 4 rows move by lr, so rms(update) = lr sqrt(4/1000).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 16), nn.Flatten(), nn.Linear(16 * 4, 10))
    batch = (torch.tensor([[1, 2, 3, 4]] * 8), torch.arange(8))
    report = signal_report(model, batch, classification_loss, make_optimizer=lambda p: torch.optim.Adam(p, lr=1e-3))
    emb = next(u for u in report.updates if u.name == "0.weight")
    assert emb.ratio == pytest.approx(1e-3 * math.sqrt(4 / 1000) / emb.weight_rms, rel=0.02)
    assert emb.mark == "small" and next(u for u in report.updates if u.name == "2.weight").mark == ""


def test_sgd_update_ratios_use_the_fixed_band():
    torch.manual_seed(0)
    model = make_mlp(32, 64, 3, 10, "relu")
    report = signal_report(model, classification_batch(), classification_loss,
                           make_optimizer=lambda p: torch.optim.SGD(p, lr=100.0))
    assert not report.adaptive
    assert all((u.low, u.high) == (1e-4, 1e-2) for u in report.updates if u.ratio is not None)
    assert all(u.mark == "large" for u in report.updates if u.ratio is not None)
    assert format_updates(report)[0].startswith("update/weight (rms) after one SGD(lr=100) step (lr x |grad| / |w|): "
                                                "band 0.0001 to 0.01")


class _Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_a_first_batch_with_a_non_finite_value_gets_no_init_verdict():
    """One sample of the first batch makes a NaN at a log: the report said 'explodes at #1 ... std nan = infx ...,
    recommended init: init_(model, 'auto')', blaming the init for the data (the step's incident names the sample)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), _Log(), nn.Linear(8, 1))
    x = torch.rand(8, 4)
    with torch.no_grad():
        model[0].bias.fill_(0.1)
    x[3] = -100.0  # relu(...) is 0 there: log(0) = -inf
    report = signal_report(model, (x, torch.randn(8, 1)), lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    assert report.summary("forward") == ("forward: non-finite at #2 '2' (_Log) on this batch (std nan): a sample or an "
                                         "op makes it, not the init's scale")
    assert report.advice().startswith("no init advice: this batch makes non-finite values"), report.advice()
    assert "recommended init" not in report.advice()


# -- dead units; the scheme a comparison recommends ---------------------------------------------------------


def _relu_stack(hidden_bias: float) -> nn.Sequential:
    """32 -> 5 x 64 ReLU -> 10, kaiming weights, every hidden bias ``hidden_bias`` (-10: every ReLU is off)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for i in range(5) for m in (nn.Linear(64 if i else 32, 64), nn.ReLU())], nn.Linear(64, 10))
    init_(model, "kaiming")
    for layer in list(model)[:-1]:
        if isinstance(layer, nn.Linear):
            nn.init.constant_(layer.bias, hidden_bias)
    return model


def test_a_net_whose_relus_are_all_dead_vanishes_forward_at_the_first_relu():
    """Hidden biases -10: every output from the first ReLU on is 0 (the first ReLU, itself dead, is the others' reference:
    0 / 0, no ratio), and the report read 'forward: ok'."""
    report = signal_report(_relu_stack(-10.0), classification_batch(), classification_loss)
    first = report.first_forward
    assert (first.index, first.name, first.forward, first.forward_ratio, first.out_absmax) == (1, "1", "vanishing", 0.0, 0.0)
    assert [layer.forward for layer in report.layers] == ["ok"] + ["vanishing"] * 10  # 2..8: a constant -10; 10: 0
    assert report.summary("forward") == ("forward: vanishes (0) at #1 '1' (ReLU): its output is all 0 (dead units), no "
                                         "signal goes past it")
    assert not report.passed and "; every unit of #1 '1' (ReLU) is off on this batch" in report.advice()
    healthy = signal_report(_relu_stack(0.0), classification_batch(), classification_loss)
    assert healthy.passed and healthy.summary("forward") == "forward: ok"
    assert "is off on this batch" not in healthy.advice()


class _LogFeature(nn.Module):
    """log of the input's last feature: 0 where that feature is 1, by design (no parameter an init could scale)."""

    def forward(self, x):
        return torch.log(x[:, -1:])


class _WithLogFeature(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
        self.logf = _LogFeature()

    def forward(self, x):
        return self.net(x) + 1e-3 * self.logf(x)


def test_a_parameterless_module_whose_output_is_0_by_design_is_no_init_verdict():
    """A new user's trial: net(x) + 1e-3 * log(s) with s = 1 everywhere: 'vanishes (0) at #3 logf (LogFeature) ...
    recommended init: xavier', at fit start and in the report's health. No init scales a parameterless function of
    its input; a dead ReLU (its input the layer before's) still vanishes (above)."""
    torch.manual_seed(0)
    model = _WithLogFeature()
    init_(model, "xavier")
    x, y = classification_batch()
    x = x.clone()
    x[:, -1] = 1.0
    report = signal_report(model, (x, y), classification_loss)
    logf = next(layer for layer in report.layers if layer.name == "logf")
    assert logf.out_absmax == 0.0 and logf.forward == "ok", logf
    assert report.passed and report.summary("forward") == "forward: ok"


class _Fold(nn.Module):
    """Sums the 4 quarters of the features, / 2: keeps the std of independent features, and a layer's fan-out 4x its
    fan-in, so that xavier (fan average) draws a weight std 0.63x kaiming's (fan-in)."""

    def forward(self, x):
        return x.unflatten(-1, (4, -1)).sum(-2) / 2


def test_compare_names_the_scheme_that_passed_in_the_numbers_the_json_and_the_text(tmp_path):
    """A tanh net whose layers expand 4x: xavier, the scheme for tanh, shrinks it (16 layers flagged); kaiming holds.
    The text recommended kaiming, but the numbers and every report of init_signal.json said 'xavier'."""
    def make_task() -> Task:
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 128), _Fold(), nn.Tanh())], nn.Linear(32, 10))
        x, y = classification_batch(num=64)
        return Task(model=model, train_data=TensorDataset(x, y), loss=classification_loss)

    cfg = load_config(None, ["task=mypkg:make_task"])
    options = {"compare": ["xavier", "kaiming"], "out_dir": str(tmp_path)}
    [result] = run_checks(CheckContext(cfg, task_factory=make_task, options=options), ["init"])
    n = result.numbers
    assert (n["init_('xavier').flagged"], n["init_('kaiming').flagged"]) == (16, 0)
    assert n["recommended"] == "kaiming"
    assert result.details[-1] == ("recommended init: init_(model, 'kaiming'), the first scheme that passes here (saw Tanh "
                                  "x6); init_(model, 'xavier'), the scheme for these activations, fails here too")
    saved = json.loads((tmp_path / "init_signal.json").read_text())
    assert [r["recommended"] for r in saved] == ["kaiming"] * 3


def test_multihead_attention_is_measured_as_a_layer_and_an_overscaled_one_is_named():
    """nn.MultiheadAttention computes from its own weights (its out_proj is never called): it was invisible to the report;
    an attention whose in_proj_weight is 30x too large is now the first forward explosion, by name."""
    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(32, 64)
            layer = nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True)
            self.enc = nn.TransformerEncoder(layer, 3, enable_nested_tensor=False)
            self.head = nn.Linear(64, 32)

        def forward(self, x):
            return self.head(self.enc(self.emb(x)))

    torch.manual_seed(0)
    model, x = Encoder(), torch.randint(0, 32, (8, 16))
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1), b[1].flatten())  # noqa: E731
    report = signal_report(model, (x, x), loss)
    attn = [layer for layer in report.layers if layer.kind == "MultiheadAttention"]
    assert [a.param_name for a in attn] == [f"enc.layers.{i}.self_attn.in_proj_weight" for i in range(3)] and report.passed
    with torch.no_grad():
        model.enc.layers[1].self_attn.in_proj_weight.mul_(30)
    report = signal_report(model, (x, x), loss)
    first = report.first_forward
    assert (first.name, first.forward) == ("enc.layers.1.self_attn", "exploding") and first.forward_ratio > 10, first


def test_a_broadcast_position_embedding_is_no_backward_reference_for_the_token_embedding():
    """GPT-2's wpe runs on positions of shape (1, T): its output gradient is summed over the batch, and as the token
    embedding's backward reference it made wte 'vanishing' at 1/sqrt(batch) (0.248x at 16, 0.126x at 64)."""
    class PosLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.wpe, self.head = nn.Embedding(32, 16), nn.Embedding(8, 16), nn.Linear(16, 32)

        def forward(self, x):
            return self.head(self.wte(x) + self.wpe(torch.arange(x.shape[1])[None]))

    torch.manual_seed(0)
    x = torch.randint(0, 32, (64, 8))
    report = signal_report(PosLM(), (x, x), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]).flatten(0, 1),
                                                                                        b[1].flatten()))
    wte, wpe = report.layers[0], report.layers[1]
    assert (wte.name, wte.lead, wpe.name, wpe.lead) == ("wte", 64, "wpe", 1)
    assert report.passed and wte.ref_backward != "wpe" and wte.backward == "ok", report.summary("backward")


def test_a_layer_with_no_counterpart_is_judged_against_its_own_input():
    """One attention block with in_proj and out_proj x30 made the signal 390x its input; with itself as its only
    reference nothing was flagged (and the LayerNorm after it took the 390x in silence)."""
    class OneBlock(nn.Module):
        def __init__(self, k: float):
            super().__init__()
            self.attn, self.norm, self.head = nn.MultiheadAttention(32, 4, batch_first=True), nn.LayerNorm(32), nn.Linear(32, 5)
            with torch.no_grad():
                self.attn.in_proj_weight.mul_(k)
                self.attn.out_proj.weight.mul_(k)

        def forward(self, x):
            return self.head(self.norm(x + self.attn(x, x, x, need_weights=False)[0])).mean(1)

    def report(k: float):
        torch.manual_seed(0)
        x, y = torch.randn(8, 10, 32), torch.randint(0, 5, (8,))
        return signal_report(OneBlock(k), (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))

    assert report(1.0).passed
    bad = report(30.0)
    assert not bad.passed and bad.first_forward.name == "attn" and bad.first_forward.forward_ratio > 100
    assert bad.summary("forward").startswith("forward: explodes at #0 'attn' (MultiheadAttention): std ")
    assert "x that of its own input;" in bad.summary("forward")


def test_layers_with_no_counterpart_whose_signal_falls_are_judged_vanishing_against_their_own_input():
    """A trial's MLP of three differently shaped Linear layers, every weight N(0, 1e-3): the signal fell 1e7-fold (std 0.94
    in, 7.8e-8 out) and `check init` passed it, 'init holds as built: keep it' (no layer had a counterpart). Each lone
    layer is judged against its own input both ways now; PyTorch's default init (~0.6x its input) passes."""
    def report(std: float | None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 4))
        if std is not None:
            for m in model:
                if isinstance(m, nn.Linear):
                    nn.init.normal_(m.weight, 0.0, std)
                    nn.init.normal_(m.bias, 0.0, std)
        x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
        return signal_report(model, (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))

    assert report(None).passed
    bad = report(1e-3)
    assert not bad.passed and bad.first_forward.name == "0" and bad.first_forward.forward_ratio < 0.01, bad.summary("forward")
    assert bad.summary("forward").startswith("forward: vanishes at #0 '0' (Linear): std ") and (
        "x that of its own input;" in bad.summary("forward"))
    # Not the output layer nor attention, which may shrink their input by design (a review): a PPO actor's policy head
    # at gain 0.01, a one-output regression's small default weight (any seed), attention averaging 256 tokens at init
    torch.manual_seed(0)
    actor = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 2))
    for m, gain in zip(actor[::2], (2 ** 0.5, 2 ** 0.5, 0.01)):
        nn.init.orthogonal_(m.weight, gain)
        nn.init.zeros_(m.bias)
    x = torch.randn(64, 4)
    assert signal_report(actor, (x, torch.randint(0, 2, (64,))),
                         lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])).passed
    for seed in range(40):
        torch.manual_seed(seed)
        x = torch.randn(32, 1)
        assert signal_report(nn.Linear(1, 1), (x, 3 * x + 1), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])).passed

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.attn = nn.Embedding(50, 32), nn.MultiheadAttention(32, 4, batch_first=True)
            self.head = nn.Linear(32, 5)

        def forward(self, t):
            e = self.emb(t)
            return self.head(self.attn(e, e, e, need_weights=False)[0].mean(1))

    torch.manual_seed(0)
    tokens = torch.randint(0, 50, (4, 256))
    assert signal_report(Mixer(), (tokens, torch.randint(0, 5, (4,))),
                         lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])).passed


def test_a_layer_with_no_counterpart_and_an_input_of_zero_is_not_judged_against_it():
    """A lone weighted layer fed zeros (a zero conditioning vector) has an output std from its bias alone: no gain."""
    class Cond(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.cond, self.head = nn.Linear(8, 8), nn.Linear(4, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.head(self.body(x) + self.cond(torch.zeros(x.shape[0], 4)))

    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randint(0, 3, (16,))
    report = signal_report(Cond(), (x, y), lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]))
    cond = next(layer for layer in report.layers if layer.name == "cond")
    assert cond.in_std == 0 and cond.forward == "ok" and report.passed, report.summary("forward")


def test_the_adam_update_band_is_never_empty_nor_inverted_for_a_weight_as_small_as_the_lr():
    """A weight of rms <= lr (init std 0.001 at lr 1e-3) had the band 0.0995..0.1 or 0.101..0.1: nothing in it, or less."""
    from stabletrain.diagnostics.signal_propagation import SignalThresholds

    th = SignalThresholds()
    assert th.update_band(True, 1e-3, 0.05) == pytest.approx((2e-3, 0.1))  # a usual weight: 0.1 x lr/rms(w)
    for rms in (1e-2, 1.005e-3, 1e-3, 9.9e-4, 1e-5):
        low, high = th.update_band(True, 1e-3, rms)
        assert low == pytest.approx(min(0.1 * 1e-3 / rms, 0.01)) and low <= high / 10 * (1 + 1e-9), (rms, low, high)


def test_a_layer_whose_output_no_longer_varies_across_the_batch_vanishes_whatever_its_std():
    """A new user's trial: a 10-layer ReLU net under PyTorch's default init (ReLU and dropout called as functions) read
    'forward: ok', its std held at ~0.07 by the biases at every depth while its outputs were 2e-5 apart from one sample
    to another. The std over every element counts a feature's constant offset as signal; the spread across the batch
    (dropout off: its draw varies a constant) does not."""
    import torch.nn.functional as F

    class FuncMLP(nn.Module):
        def __init__(self, depth=10, width=64):
            super().__init__()
            self.inp, self.head = nn.Linear(32, width), nn.Linear(width, 10)
            self.hidden = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

        def forward(self, x):
            x = F.relu(self.inp(x))
            for layer in self.hidden:
                x = F.dropout(F.relu(layer(x)), 0.1, self.training)
            return self.head(x)

    torch.manual_seed(0)
    batch = (torch.randn(32, 32), torch.randint(0, 10, (32,)))
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    model = FuncMLP()
    report = signal_report(model, batch, loss)
    first = report.first_forward
    assert first.kind == "Linear" and first.forward_ratio > 0.25 and first.out_spread < 0.01 * first.out_std, first
    assert report.summary("forward").startswith(f"forward: vanishes at #{first.index} '{first.name}' (Linear): its output "
                                                "barely varies across the batch (by ")
    head = report.layers[-1]
    assert head.out_std > 0.05 and head.out_spread < 1e-3  # the model's output: offsets alone
    torch.manual_seed(0)
    init_(model, "kaiming")  # the fix it recommends (biases zeroed): the forward holds
    assert report.recommended == "kaiming" and signal_report(model, batch, loss).first_forward is None
    # an input of zeros by design (a conditioning vector): its layer's bias alone is no collapse (above)


def test_frozen_layers_are_never_redrawn_and_no_init_is_advised_for_them():
    """A new user's trial: a frozen (pretrained) backbone whose signal vanishes was told 'recommended init:
    init_(model, 'kaiming')', and init_ redrew the frozen weights: following the advice wiped them."""
    from stabletrain.diagnostics.initialization import architectures

    torch.manual_seed(0)
    layers = [nn.Linear(32, 64), nn.ReLU()] + [m for _ in range(9) for m in (nn.Linear(64, 64), nn.ReLU())]
    backbone = nn.Sequential(*layers).requires_grad_(False)
    model = nn.Sequential(backbone, nn.Linear(64, 10))
    batch = (torch.randn(32, 32), torch.randint(0, 10, (32,)))
    loss = lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    report = signal_report(model, batch, loss)
    assert not report.passed and report.first_forward.name.startswith("0.") and report.lost_in_frozen()
    assert "the signal leaves the band in layers whose weights are frozen" in report.advice()
    before = [p.clone() for p in backbone.parameters()]
    decisions = init_(model, "kaiming")
    assert all(torch.equal(a, b) for a, b in zip(before, backbone.parameters()))  # never redrawn
    assert {d.scheme for d in decisions if d.name.startswith("0.")} == {"frozen"} and decisions[-1].scheme == "kaiming"
    said = architectures(report, signal_report(model, batch, loss))  # (re-initialized: the same flag)
    assert said.endswith("whatever the init: its weights are frozen (requires_grad=False), which no init redraws")
    model.requires_grad_(True)  # the same model trainable: no such note
    assert not signal_report(model, batch, loss).lost_in_frozen()


def test_an_input_shared_by_the_batch_is_no_collapse_and_a_loss_that_takes_a_gradient_is_measured():
    """A review: learned queries (Perceiver's latents through a Linear without bias, expanded over the batch) are the same
    for every sample by design: their output does not vary across the batch because their input does not, and was called
    'vanishing: constant offsets (its biases)'. And the spread's forward ran without gradients: a loss that takes one
    (a gradient penalty, a PINN's du/dx) raised in it."""
    class Latents(nn.Module):
        def __init__(self):
            super().__init__()
            self.latents = nn.Parameter(torch.randn(4, 16))
            self.q, self.k = nn.Linear(16, 16, bias=False), nn.Linear(8, 16)
            self.head = nn.Linear(16, 1)

        def forward(self, x):
            q = self.q(self.latents.expand(x.shape[0], -1, -1))  # (B, 4, 16), the same for every sample
            k = self.k(x)  # (B, T, 16)
            att = torch.softmax(q @ k.transpose(1, 2) / 4, -1) @ k
            return self.head(att.mean(1))

    torch.manual_seed(0)
    x, y = torch.randn(16, 6, 8), torch.randn(16, 1)
    report = signal_report(Latents(), (x, y), lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    q = next(layer for layer in report.layers if layer.name == "q")
    assert q.out_spread == 0 and q.in_spread == 0 and not q.collapsed and q.forward == "ok", report.summary("forward")

    def penalized(model, batch):  # a gradient penalty on the input: the forward needs autograd
        inp = batch[0].requires_grad_(True)
        out = model(inp)
        (g,) = torch.autograd.grad(out.sum(), inp, create_graph=True)
        return torch.nn.functional.mse_loss(out, batch[1]) + g.pow(2).mean()

    mlp = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    measured = signal_report(mlp, (torch.randn(16, 8), torch.randn(16, 1)), penalized)
    assert all(layer.out_spread is not None for layer in measured.layers if layer.param_name)


def test_init_leaves_a_frozen_weight_beside_a_trainable_bias_as_it_is():
    """A review: BitFit (a frozen pretrained weight, its bias trainable) was redrawn whole: the skip was per module."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].weight.requires_grad_(False)
    model[2].bias.requires_grad_(False)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    trained = model[2].weight.detach().clone()
    decisions = init_(model, "kaiming")
    assert all(torch.equal(model.get_parameter(n), v) for n, v in frozen.items())
    assert bool(model[0].bias.eq(0).all()) and not torch.equal(model[2].weight, trained)  # the trainable ones redrawn
    assert [d.scheme for d in decisions] == ["kaiming", "kaiming"] and decisions[0].std is None  # (its weight not drawn)


def test_the_spread_of_each_call_lands_on_that_call_after_an_empty_one():
    """A review: the spread's forward numbered every call of a module, the report only those with a floating, non-empty
    output: after an empty call (an expert routed no tokens) each later call got the call before's spread."""
    class Routed(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.head = nn.Linear(8, 8), nn.Linear(8, 1)

        def forward(self, x):
            self.lin(x[:0])  # no token routed to it
            return self.head(self.lin(x) + self.lin(torch.zeros_like(x)))

    torch.manual_seed(0)
    report = signal_report(Routed(), (torch.randn(16, 8), torch.randn(16, 1)),
                           lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    varying, constant = (layer for layer in report.layers if layer.name.startswith("lin#"))
    assert varying.out_spread > 0.1 and constant.out_spread == 0 and constant.in_spread == 0, (varying, constant)


def test_a_saturated_tanh_stack_is_said_though_its_std_holds():
    """A trial: 20 Linear + Tanh layers at N(0, 1) weights (width 64): every Tanh's output std 0.92-0.95, its units on
    the flat ends, and the report said 'forward: ok'. A line names them; Xavier's gain for tanh leaves none."""
    def stack() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[m for i in range(8) for m in (nn.Linear(32 if i == 0 else 64, 64), nn.Tanh())],
                             nn.Linear(64, 10))

    x, y = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)), torch.randint(0, 10, (64,))
    loss = lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])  # noqa: E731
    big = stack()
    for layer in big:
        if isinstance(layer, nn.Linear):
            nn.init.normal_(layer.weight, 0.0, 1.0)
    lines = format_report(signal_report(big, (x, y), loss))
    (said,) = [line for line in lines if line.startswith("saturated: ")]
    assert "#1 '1' (Tanh, output std 0.9" in said and "init_(model, 'xavier')" in said, said
    xavier = stack()
    init_(xavier, "xavier")
    assert not [line for line in format_report(signal_report(xavier, (x, y), loss)) if line.startswith("saturated")]


@pytest.mark.parametrize("n_layer", [1, 2])
def test_an_off_the_shelf_gpt2_holds_at_init_with_one_block_or_two(n_layer):
    """A trial: a 1-block GPT-2 from its config (HF's own init) was reported as a failed init: its attention branch's
    dropout 0.151x the embeddings' dropout, its block's ln_1 gradient 0.148x the final LayerNorm's. Alone in their
    groups, layers were compared with every layer of their class and shapes; a block's are now compared only with their
    siblings (with two blocks, each block's with the other's, as before)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=n_layer, n_embd=32, n_head=2, vocab_size=64,
                                                                 n_positions=32, bos_token_id=0, eos_token_id=0))
    ids = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(1))
    report = signal_report(model, ids, lambda m, b: m(input_ids=b, labels=b).loss)
    assert report.passed, [report.summary("forward"), report.summary("backward")]


def test_a_gradient_of_exactly_zero_where_others_have_one_is_flagged_in_any_group():
    """A zero-initialized output layer passes no gradient to the layers before it: each is flagged (0x), whatever its
    group (they no longer share one with the head)."""
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    with torch.no_grad():
        model[2].weight.zero_()
    batch = (torch.randn(32, 8), torch.randn(32, 4))
    report = signal_report(model, batch, lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
    assert [(layer.name, layer.backward) for layer in report.layers] == [("0", "vanishing"), ("1", "ok"), ("2", "ok")]
    assert report.summary("backward").startswith("backward: vanishes at #0 '0' (Linear): grad std 0 = 0x that of '2'")


def test_a_gradient_constant_across_its_elements_or_a_second_call_under_no_grad_is_no_vanishing_nor_cut():
    """A review: a constant gradient (a critic's mean, a loss module's scalar output) has a std of 0 and is no vanished
    gradient; a network called again under no_grad (a DQN target) trains through its first call."""

    class Critic(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head, self.crit = nn.Linear(8, 8), nn.Linear(8, 1), nn.MSELoss()

        def forward(self, x):
            return self.head(torch.tanh(self.body(x)))

    def loss(m, b):
        with torch.no_grad():
            target = m(b)  # a second call of every layer, no gradient
        return -m(b).mean() + 0 * m.crit(target, target)

    report = signal_report(Critic(), torch.randn(16, 8), loss)
    assert report.passed and not report.cut_off, [report.summary("forward"), report.summary("backward")]
    # ... nor a reference for the layers of its group (its std of 0 made theirs 'exploding (infx)')
    torch.manual_seed(0)
    stack = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    report = signal_report(stack, torch.randn(16, 8), lambda m, b: -m(b).mean())
    assert report.passed, report.summary("backward")


class ShiftedTwice(nn.Module):
    """A trial's model: one Linear called twice, the second time on the shift alone (zeros on the first batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.head = nn.Linear(16, 32), nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = torch.zeros_like(x)
        return self.head(torch.tanh(self.lin(x + s) - self.lin(s)))


def test_a_call_on_a_constant_input_is_no_vanishing_layer():
    """'forward: vanishes at #1 lin#1 (Linear): std 0.126 = 0.229x that of lin#0': the second call's input was all 0, its
    output the bias alone; no init makes a signal of a constant input."""
    torch.manual_seed(0)
    model = ShiftedTwice()
    report = signal_report(model, (torch.randn(16, 16), torch.randn(16, 1)),
                           lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    layers = {layer.name: layer for layer in report.layers}
    assert layers["lin#1"].in_std == 0 and layers["lin#1"].forward == "ok" and layers["lin#1"].forward_ratio is None
    assert "lin#1" not in report.summary("forward"), report.summary("forward")
