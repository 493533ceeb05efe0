"""init_ schemes (gain and fan mode from the following activation, residual scaling) and InitFingerprint."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch
from models_init import CustomInit, FunctionalReLUStack, MixedActivations, ResidualStack, single_thread  # noqa: F401
from torch import nn

from stabletrain.console import StableTrainWarning
from stabletrain.diagnostics.initialization import InitChange, InitFingerprint
from stabletrain.tasks import gpt as gpt_task
from stabletrain.tasks.gpt import GPT
from stabletrain.tasks.init_schemes import ActivationTrace, activation_gain, init_, recommend_scheme
from stabletrain.tasks.mlp import make_mlp

pytestmark = pytest.mark.usefixtures("single_thread")


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def test_kaiming_reads_relu_after_each_layer_and_gain_one_for_the_output_layer():
    torch.manual_seed(0)
    model = make_mlp(32, 256, 4, 10, "relu")
    decisions = init_(model, "kaiming")
    linears = _linears(model)
    assert [d.activation for d in decisions] == ["relu", "relu", "relu", "linear"]
    assert [d.fan_mode for d in decisions] == ["fan_in"] * 4
    expected = [math.sqrt(2 / 32), math.sqrt(2 / 256), math.sqrt(2 / 256), 1 / math.sqrt(256)]
    for layer, d, want in zip(linears, decisions, expected):
        assert d.std == pytest.approx(want, rel=1e-12)
        assert layer.weight.std().item() == pytest.approx(want, rel=0.05)  # >= 2560 draws: ~1.4% sampling error
        assert torch.count_nonzero(layer.bias).item() == 0


def test_xavier_on_tanh_uses_gain_5_over_3_and_fan_avg():
    torch.manual_seed(0)
    model = make_mlp(64, 256, 3, 10, "tanh")
    decisions = init_(model, "xavier")
    assert [(d.activation, d.gain, d.fan_mode) for d in decisions] == [
        ("tanh", 5 / 3, "fan_avg"), ("tanh", 5 / 3, "fan_avg"), ("linear", 1.0, "fan_avg")]
    assert decisions[0].std == pytest.approx(5 / 3 * math.sqrt(2 / (64 + 256)), rel=1e-12)
    assert _linears(model)[1].weight.std().item() == pytest.approx(5 / 3 * math.sqrt(2 / 512), rel=0.05)


def test_auto_picks_xavier_before_tanh_and_kaiming_elsewhere():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Dropout(0.1), nn.GELU(), nn.Linear(16, 4))
    decisions = init_(model, "auto")
    assert [(d.name, d.scheme, d.activation) for d in decisions] == [
        ("0", "xavier", "tanh"), ("2", "kaiming", "gelu"), ("5", "kaiming", "linear")]  # Dropout is looked through
    # GELU's second-moment gain: 1 / sqrt(E[gelu(z)^2]) with E[gelu(z)^2] = 0.42522 for z ~ N(0, 1).
    assert decisions[1].gain == pytest.approx(1 / math.sqrt(0.42522), rel=1e-4)
    assert activation_gain(nn.ReLU()) == pytest.approx(math.sqrt(2))
    assert activation_gain(nn.LeakyReLU(0.2)) == pytest.approx(math.sqrt(2 / (1 + 0.2**2)))


def test_residual_branch_outputs_are_scaled_by_one_over_sqrt_of_the_number_of_branches():
    torch.manual_seed(0)
    model = ResidualStack(width=128, depth=8)
    decisions = {d.name: d for d in init_(model, "kaiming")}
    assert decisions["blocks.3.out"].residual_scale == pytest.approx(1 / math.sqrt(8))
    assert decisions["blocks.3.out"].std == pytest.approx(1 / math.sqrt(128) / math.sqrt(8))
    assert decisions["blocks.3.fc"].residual_scale == 1.0
    assert model.blocks[3].out.weight.std().item() == pytest.approx(1 / math.sqrt(128 * 8), rel=0.05)
    # Naming the branches works without the marker attribute; num_residual_branches overrides the count.
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    decisions = init_(plain, "kaiming", residual=["2"], num_residual_branches=4)
    assert decisions[1].residual_scale == pytest.approx(0.5)


def test_gpt_task_model_is_built_with_gpt2_init_bitwise(monkeypatch):
    """GPT() through init_ draws exactly what GPT-2's init (the former init_gpt_) draws from the same seed."""

    def gpt2_init_(model: nn.Module, n_layer: int, std: float = 0.02) -> None:
        for module in model.modules():
            if isinstance(module, nn.Linear):
                scale = 1 / math.sqrt(2 * n_layer) if getattr(module, "residual_branch_out", False) else 1.0
                nn.init.normal_(module.weight, 0.0, std * scale)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)

    torch.manual_seed(0)
    model = GPT(256, 16, n_layer=3, n_head=2, n_embd=64)
    monkeypatch.setattr(gpt_task, "init_", lambda m, *args, **kwargs: gpt2_init_(m, 3))
    torch.manual_seed(0)
    reference = GPT(256, 16, n_layer=3, n_head=2, n_embd=64)
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name
    assert model.head.weight is model.wte.weight  # still tied
    assert torch.count_nonzero(model.blocks[1].mlp.fc.bias).item() == 0
    assert model.blocks[1].mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.blocks[1].mlp.proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(2 * 3), rel=0.05)


def test_init_errors_name_the_value():
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="expected one of auto, xavier, kaiming, normal, got 'he'"):
        init_(model, "he")
    with pytest.raises(ValueError, match=r"residual=\['blocks.\*.proj'\]: no module name matches"):
        init_(model, "kaiming", residual=["blocks.*.proj"])
    with pytest.raises(ValueError, match="init std: expected a positive number, got -1"):
        init_(model, "normal", std=-1)


def test_kaiming_on_a_model_whose_relus_are_functions_assumes_relu_and_auto_warns_it_sees_none():
    """torch.relu in forward, no activation module: 'kaiming' used to give gain 1 (std 1/8 = 0.125 at width 64), the same
    as xavier and auto on square layers; Kaiming is sqrt(2 / 64) = 0.177."""
    torch.manual_seed(0)
    model = FunctionalReLUStack(depth=8, width=64)
    decisions = init_(model, "kaiming")
    assert all(d.assumed and d.activation == "relu" and d.gain == pytest.approx(math.sqrt(2)) for d in decisions)
    assert model.layers[0].weight.std().item() == pytest.approx(math.sqrt(2 / 64), rel=0.05)
    with pytest.warns(StableTrainWarning, match="saw no activation after any of its 9 layers.*pass trace="):
        decisions = init_(model, "auto")
    assert {(d.gain, d.assumed) for d in decisions} == {(1.0, False)}
    x = torch.randn(16, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # traced: nothing to warn about
        decisions = init_(model, "auto", trace=lambda m: m(x))
    assert [(d.activation, d.scheme) for d in decisions] == [("relu", "kaiming")] * 8 + [("linear", "kaiming")]
    assert [d.std for d in decisions] == pytest.approx([math.sqrt(2 / 64)] * 8 + [1 / 8])
    assert not any(d.assumed for d in decisions)


def test_activation_trace_reads_each_layers_activation_as_the_forward_applies_it():
    model = MixedActivations()
    with ActivationTrace(model) as trace:
        model(torch.randn(2, 8))
    followers = trace.followers()
    # a: h * sigmoid(h) goes into two ops, so it is left out; d: the GELU module is registered after it, but d's output
    # goes into a residual sum; c: looked through F.dropout to F.leaky_relu(0.2).
    assert sorted(followers) == ["b", "c", "d"] and followers["d"] is None
    assert type(followers["b"]) is nn.ReLU and followers["c"].negative_slope == 0.2
    assert trace.functional == [("torch.sigmoid", "sigmoid"), ("Tensor.relu", "relu"), ("F.leaky_relu", "leaky_relu")]
    decisions = {d.name: d for d in init_(model, "kaiming", trace=lambda m: m(torch.randn(2, 8)))}
    assert [decisions[n].activation for n in "abcd"] == ["linear", "relu", "leaky_relu", "linear"]
    assert decisions["c"].gain == pytest.approx(math.sqrt(2 / (1 + 0.2**2)))
    assert [d.activation for d in init_(model, "kaiming")][2:4] == ["linear", "gelu"]  # registration order alone


def test_recommend_scheme_from_activations():
    assert recommend_scheme(["relu", "relu", None]) == "kaiming"
    assert recommend_scheme(["tanh", "sigmoid"]) == "xavier"
    assert recommend_scheme(["tanh", "gelu"]) == "auto"
    assert recommend_scheme([None, "linear"]) == "auto"


# -- the fingerprint ---------------------------------------------------------------------------------


def test_reset_parameters_overwriting_a_custom_init_is_reported_by_name():
    torch.manual_seed(0)
    model = CustomInit(width=256)
    fingerprint = InitFingerprint.take(model)
    model.proj.reset_parameters()  # what a wrapper or a meta-device to_empty() path does behind the user's back
    changes = fingerprint.compare(model)
    assert [(c.name, c.why) for c in changes] == [("proj.weight", "values changed"), ("proj.bias", "values changed")]
    assert changes[0].old_std == pytest.approx(0.02, rel=0.02)
    # nn.Linear's reset_parameters: kaiming_uniform(a=sqrt(5)) -> U(-1/sqrt(fan_in), 1/sqrt(fan_in)), std 1/sqrt(3 * 256)
    assert changes[0].new_std == pytest.approx(1 / math.sqrt(3 * 256), rel=0.02)
    assert changes[1].old_std == 0.0
    reason = InitFingerprint.describe(changes)
    assert reason.startswith("2 parameter(s) changed between the model's init and the first step: proj.weight (std 0.02")
    assert "reset_parameters()" in reason
    assert "or a load_state_dict): a deliberate load of trained weights is fine" in reason  # (it said "re-initialized")


def test_fingerprint_ignores_wrapping_and_same_values_and_reports_new_and_missing():
    torch.manual_seed(0)
    model = CustomInit(width=8)
    fingerprint = InitFingerprint.take(model)
    wrapper = nn.Module()
    wrapper.module = model  # DDP-style prefix "module."
    assert fingerprint.compare(wrapper) == []
    assert fingerprint.compare(model.double()) == []  # a cast changes the bytes, not the std
    model.float()
    model.extra = nn.Linear(2, 2)
    changes = fingerprint.compare(model)
    assert [(c.name, c.why, c.old_std) for c in changes] == [("extra.weight", "new", None), ("extra.bias", "new", None)]
    assert InitChange("a", 1.0, None, "missing").as_dict() == {"name": "a", "old_std": 1.0, "new_std": None, "why": "missing"}


def test_fingerprint_state_dict_round_trips_and_skips_meta_parameters():
    torch.manual_seed(0)
    model = CustomInit(width=8)
    fingerprint = InitFingerprint.take(model)
    restored = InitFingerprint({})
    restored.load_state_dict(fingerprint.state_dict())
    assert restored.params == fingerprint.params
    with torch.no_grad():
        model.proj.weight[0, 0] += 1e-3
    assert [c.name for c in restored.compare(model)] == ["proj.weight"]
    meta = CustomInit(width=8).to("meta")
    assert InitFingerprint.take(meta).skipped == ["proj.weight", "proj.bias"]


def test_a_new_run_reports_its_init_at_step_0_and_trains_bitwise_as_without_it(tmp_path):
    import json

    from helpers import cfg

    from stabletrain import Trainer

    trained = {}
    for on in ("true", "false"):  # dropout: the report's forward must not move the run's RNG streams
        trainer = Trainer(cfg("task_args.dropout=0.1", "train.max_steps=4", f"log.init_signal={on}"),
                          run_dir=tmp_path / on)
        trainer.fit()
        trained[on] = trainer.module.state_dict()
    line = json.loads((tmp_path / "true" / "snapshot.json").read_text())["init_signal"]
    assert line["passed"] is True and line["summary"] == ["forward: ok", "backward: ok"] and line["flagged"] == []
    layers = json.loads((tmp_path / "true" / "init_signal.json").read_text())["layers"]
    assert [layer["name"] for layer in layers][:2] == ["0", "1"] and all(layer["out_std"] > 0 for layer in layers)
    assert not (tmp_path / "false" / "init_signal.json").exists()
    assert "init_signal" not in json.loads((tmp_path / "false" / "snapshot.json").read_text())
    for name, value in trained["true"].items():
        assert torch.equal(value, trained["false"][name]), name  # bitwise: the report left the run as it found it


def test_a_deep_relu_mlp_whose_signal_vanishes_is_told_at_step_0_with_the_init_to_use(tmp_path, capfd):
    from helpers import cfg

    from stabletrain import Trainer

    Trainer(cfg("task_args.depth=12", "train.max_steps=1"), run_dir=tmp_path / "run").fit()
    lines = [line for line in capfd.readouterr().out.splitlines() if "init at step 0" in line]
    assert len(lines) == 1 and lines[0].startswith("stabletrain: init at step 0: forward: vanishes at #5"), lines
    assert "recommended init: init_(model, 'kaiming')" in lines[0] and lines[0].endswith("(init_signal.json)")


def test_a_first_batch_whose_backward_is_not_finite_gets_no_init_advice_at_step_0(tmp_path, capfd):
    """A trial: a first window of no item (the user's masked mean 0/0: the backward NaN) got 'init_(model, 'kaiming'),
    the scheme for these activations, fails here too (... backward exploding at #3 head (infx)) ... in a residual
    network, mark each branch's output layer ...': the re-init was tried on a NaN no init explains. Said as check init
    says it; its flagged layer is 'non-finite', not 'exploding (infx)'."""
    from helpers import cfg
    from models_init import all_masked_first_task

    from stabletrain import Trainer
    from stabletrain.checks import CheckContext, run_checks

    Trainer(cfg("train.max_steps=1", "log.init_signal=true", "data.shuffle=false", "train.batch_size=8", "eval.every=0"),
            task=all_masked_first_task(), run_dir=tmp_path / "run").fit()
    (line,) = [x for x in capfd.readouterr().out.splitlines() if "init at step 0" in x]
    assert line == ("stabletrain: init at step 0: forward: ok; backward: non-finite at #4 '4' (Linear) on this batch (grad "
                    "std nan): a sample or an op makes it, not the init's scale; no init advice: this batch makes "
                    "non-finite values, which no init's scale explains (the step's own incident names the sample or the "
                    "op) (init_signal.json)"), line
    ctx = CheckContext(cfg("data.shuffle=false", "train.batch_size=8"), task_factory=all_masked_first_task,
                       options={"out_dir": str(tmp_path / "check")})
    (init,) = run_checks(ctx, ["init"])
    assert init.summary == "5 of 5 layers flagged: forward ok, backward non-finite at #4 4", init.summary


def test_auto_reports_a_users_task_too_unless_its_copy_would_crowd_the_memory(tmp_path, monkeypatch):
    from helpers import cfg, regression_task

    from stabletrain import Trainer
    from stabletrain.services import init_signal

    calls = []
    task = regression_task()
    loss = task.loss
    task.loss = lambda model, batch: calls.append(1) or loss(model, batch)
    Trainer(cfg("train.max_steps=1", "log.init_signal=auto"), task=task, run_dir=tmp_path / "auto").fit()
    assert json.loads((tmp_path / "auto" / "init_signal.json").read_text())["layers"]
    # the report's forward, its forward without dropout and the loss at init's (on a copy of the model), the step's
    assert len(calls) == 4
    size = sum(p.numel() * p.element_size() for p in task.model.parameters())
    assert init_signal.copy_fits(task.model, torch.device("cpu"), free=16 * size)  # 4 x its bytes in a quarter
    assert not init_signal.copy_fits(task.model, torch.device("cpu"), free=16 * size - 1)
    monkeypatch.setattr(init_signal, "host_memory_available", lambda: 16 * size - 1)  # a host with too little free
    for mode in ("auto", "true"):  # true: whatever it takes
        Trainer(cfg("train.max_steps=1", f"log.init_signal={mode}"), task=regression_task(),
                run_dir=tmp_path / mode / "small").fit()
    assert [(tmp_path / m / "small" / "init_signal.json").exists() for m in ("auto", "true")] == [False, True]


def test_auto_passes_quietly_over_a_model_its_loss_never_calls(tmp_path):
    """A loss that reads the parameters without calling the model (no leaf module's output to measure): auto passes
    it over without a warning; log.init_signal=true says the report failed."""
    import warnings

    from helpers import cfg, regression_task

    from stabletrain import Trainer
    from stabletrain.console import StableTrainWarning

    def task():
        t = regression_task()
        t.model = nn.Linear(4, 1)
        t.loss = lambda m, b: ((b[0] @ m.weight.T + m.bias - b[1]) ** 2).mean()
        return t

    for mode in ("auto", "true"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            Trainer(cfg("train.max_steps=1", f"log.init_signal={mode}"), task=task(), run_dir=tmp_path / mode).fit()
        said = [str(w.message) for w in seen if issubclass(w.category, StableTrainWarning) and "signal" in str(w.message)]
        assert said == ([] if mode == "auto" else [said[0]]) and not (tmp_path / mode / "init_signal.json").exists()
    assert "no leaf module produced a floating-point tensor" in said[0]


def test_the_trace_reads_an_activation_module_it_has_no_function_for_and_looks_through_shape_ops():
    """A review: nn.PReLU (F.prelu is no activation function the trace names) and a ReLU after .unsqueeze().squeeze()
    read as 'nothing follows' (gain 1) with trace=; a manual swish and a sigmoid in the loss counted as functional
    activations of the model (recommending xavier)."""

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.act_a, self.b, self.act_b, self.c = nn.Linear(8, 8), nn.PReLU(), nn.Linear(8, 8), nn.ReLU(), \
                nn.Linear(8, 1)

        def forward(self, x):
            h = self.act_a(self.a(x))
            h = self.act_b(self.b(h).unsqueeze(1).squeeze(1))
            return self.c(h * torch.sigmoid(h))  # a swish on the input of c, not on a layer's output

    model = Net()
    with ActivationTrace(model) as trace:
        torch.sigmoid(model(torch.randn(4, 8)))  # the loss's own sigmoid
    followers = trace.followers()
    # (the swish is on an activation's output, not a layer's: not counted; the loss's sigmoid is on c's: c's activation)
    assert followers["a"] is model.act_a and followers["b"] is model.act_b
    assert trace.functional == [("torch.sigmoid", "sigmoid")] and type(followers["c"]) is nn.Sigmoid
    traced = {d.name: d for d in init_(model, "kaiming", trace=lambda m: m(torch.randn(4, 8)))}
    plain = {d.name: d for d in init_(model, "kaiming")}
    assert [traced[n].gain for n in "ab"] == pytest.approx([plain[n].gain for n in "ab"]) and traced["b"].gain == \
        pytest.approx(math.sqrt(2))


def test_an_init_a_users_callback_overwrites_at_fit_start_is_reported(tmp_path):
    """A trial: a callback re-initializing every Linear in on_fit_start gave no init_overwritten event (the watch ran
    its check before the user's callbacks)."""
    from helpers import cfg

    from stabletrain import Callback, Trainer
    from stabletrain.records.jsonl import read_jsonl

    class Reinit(Callback):
        def on_fit_start(self, state):
            with torch.no_grad():
                for m in state.module.modules():
                    if isinstance(m, nn.Linear):
                        m.weight.normal_(0, 1.0)

    Trainer(cfg("train.max_steps=2", "log.every=2"), run_dir=tmp_path / "run", callbacks=[Reinit()]).fit()
    events = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl")[0] if e["kind"] == "init_overwritten"]
    assert events and all(p["why"] == "values changed" for p in events[0]["params"]), events


def test_zero_initialized_layers_are_told_apart_output_residual_end_or_nothing_around_it():
    from models_init import classification_batch, classification_loss

    from stabletrain.diagnostics.initialization import OUTPUT_LAYER, RESIDUAL_END, excluding, zero_init_layers, zero_layers_small
    from stabletrain.diagnostics.signal_propagation import signal_report

    torch.manual_seed(0)
    model = ResidualStack(in_dim=16, width=32, depth=3, num_classes=10)
    for block in model.blocks:  # every branch end at 0 (GPT-style), and the classifier
        nn.init.zeros_(block.out.weight)
    nn.init.zeros_(model.head.weight)
    batch = classification_batch(num=32, in_dim=16)
    built = signal_report(model, batch, classification_loss)
    zero = zero_init_layers(model, built)
    assert [(z.name, z.param, z.role) for z in zero] == [("blocks.0.out", "blocks.0.out.weight", RESIDUAL_END),
                                                          ("blocks.1.out", "blocks.1.out.weight", RESIDUAL_END),
                                                          ("blocks.2.out", "blocks.2.out.weight", RESIDUAL_END),
                                                          ("head", "head.weight", OUTPUT_LAYER)]
    with torch.no_grad():  # the stream past blocks.0: embed's output + the zero layer's bias (its default init)
        assert zero[0].around == pytest.approx(float((model.embed(batch[0]) + model.blocks[0].out.bias).std()), rel=1e-4)
    probe = zero_layers_small(model, zero, seed=0)
    assert float(probe.head.weight.detach().std()) == pytest.approx(1e-3 / math.sqrt(32), rel=0.1)
    assert not model.head.weight.any() and model.blocks[0].out.bias.equal(probe.blocks[0].out.bias)  # weights only
    judged = excluding(signal_report(probe, batch, classification_loss), zero, label="x", as_built=built)
    rows = {layer.name: layer for layer in judged.layers}
    assert all(rows[n].forward_ratio is None and rows[n].backward_ratio is None for n in ("blocks.0.out", "head"))
    assert rows["blocks.0.fc"].param_grad_std > 0 and rows["blocks.0.fc"].ref_backward == "blocks.2.fc"  # a gradient now
    assert 0.9 < rows["blocks.0.fc"].backward_ratio < 1.1 and rows["blocks.2.norm"].ref_forward == "blocks.0.norm"
    assert judged.passed and {u.name: u.ratio for u in judged.updates}["head.weight"] is None  # as built: 0, no ratio

    chain = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 10))
    nn.init.zeros_(chain[2].weight)
    nn.init.zeros_(chain[2].bias)
    [middle] = zero_init_layers(chain, signal_report(chain, batch, classification_loss))
    assert (middle.name, middle.role, middle.deliberate) == ("2", "", False)  # the next layer's input std is 0


def test_a_zero_initialized_head_is_not_told_at_step_0_as_a_vanishing_signal(tmp_path, capfd):
    """The run's own step-0 report judges a deliberate zero layer (an output head at 0, as GPT/DiT/ReZero do) as check
    init does: without it. It said 'init at step 0: forward: vanishes at #4 head' on every such run."""
    from helpers import cfg
    from models_init import zero_head_task

    from stabletrain import Trainer

    Trainer(cfg("train.max_steps=1", "log.init_signal=true"), task=zero_head_task(), run_dir=tmp_path / "run").fit()
    assert "init at step 0" not in capfd.readouterr().out
    report = json.loads((tmp_path / "run" / "init_signal.json").read_text())
    assert report["passed"] is True
    head = [layer for layer in report["layers"] if layer["name"].startswith("head")]
    assert head and all(layer.get("forward_ratio") is None for layer in head)  # no verdict on the zero layer


@pytest.mark.parametrize("signal", ["false", "true"])
def test_an_init_a_lazy_first_forward_overwrites_is_reported_once(tmp_path, capfd, signal):
    """A new user's model zero-inits its head on purpose, then calls reset_parameters() on it inside its first forward
    (a lazy re-init): the watch compared before the first forward, and nothing was said."""
    from helpers import cfg, regression_task

    from stabletrain import Trainer
    from stabletrain.records.jsonl import read_jsonl

    class LazyReset(nn.Module):
        def __init__(self):
            super().__init__()
            self.l1, self.l2, self.done = nn.Linear(4, 16), nn.Linear(16, 1), False
            nn.init.zeros_(self.l2.weight)

        def forward(self, x):
            if not self.done:
                self.done = True
                self.l2.reset_parameters()
            return self.l2(torch.tanh(self.l1(x)))

    def task():
        t = regression_task()
        t.model = LazyReset()
        return t

    Trainer(cfg("train.max_steps=4", "log.every=2", f"log.init_signal={signal}"), task=task(), run_dir=tmp_path / "run").fit()
    events = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl")[0] if e["kind"] == "init_overwritten"]
    assert len(events) == 1 and [p["name"] for p in events[0]["params"]] == ["l2.weight", "l2.bias"], events
    assert events[0]["reason"].startswith("init overwritten in the model's first forward: "), events[0]["reason"]
    assert "stabletrain: init overwritten in the model's first forward: " in capfd.readouterr().out
    # (a trial: the step-0 line before it recommended an init that this forward wipes, and nothing said so)
    assert "no init applied before that forward survives it, the step-0 init line's advice included" in events[0]["reason"]
