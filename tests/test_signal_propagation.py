"""signal_report: per-layer verdicts on deep MLPs and residual stacks, the update ratios, the init check."""

from __future__ import annotations

import json
import math

import pytest
import torch
from models_init import ResidualStack, classification_batch, classification_loss, single_thread  # noqa: F401
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain.checks import CheckContext, run_checks
from stabletrain.config import load_config
from stabletrain.initialization import init_
from stabletrain.signal_propagation import SignalThresholds, format_comparison, format_report, plot_signal, signal_report
from stabletrain.tasks import Task
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
    assert [layer.name for layer in report.layers] == ["0", "1", "0#2"]
    assert report.layers[2].ref_forward == "0"
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
