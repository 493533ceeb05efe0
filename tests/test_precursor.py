"""The precursor: each layer's update/weight ratio against its own history, a warning before the spike."""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import cfg
from integration_models import Net, batches, loss_fn
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain import Monitor, Task, Trainer, load_config
from stabletrain.config import ConfigError, GuardConfig
from stabletrain.distributed.fsdp import ShardedNumerics
from stabletrain.numerics import update_norm, update_norms
from stabletrain.policies.metrics import StepMetrics, interval_record
from stabletrain.policies.precursor import Precursor
from stabletrain.records.jsonl import read_jsonl
from stabletrain.syncs import SyncCounter

NAMES = ["a.weight", "b.weight", "c.bias"]


def feed(precursor, updates, weights, *, every=10, spike_at=None, start=0):
    """Feed one interval per row of per-layer (update, weight) norms; return the warnings ([(step, warning)])."""
    out = []
    for k, (ups, ws) in enumerate(zip(updates, weights), start=start):
        step = (k + 1) * every
        rows = [SimpleNamespace(step=s, values={"loss": 1.0, "finite": 1.0, "spike": float(s == spike_at)})
                for s in range(step - every + 1, step + 1)]
        summary = {"step": step, "interval_param_update_norms": list(ups), "interval_param_norms": list(ws),
                   "interval_finite_steps": every}
        warning = precursor.observe(step, summary, [1.0] * len(ups), rows)
        if warning is not None:
            out.append((step, warning))
    return out


def noisy(n, seed, level=(1e-3, 2e-3, 5e-4), sigma=0.15, trend=lambda k: 1.0):
    """Per-layer update norms: ``level`` x ``trend(k)`` x log-normal noise."""
    rng = random.Random(seed)
    return [[v * trend(k) * math.exp(rng.gauss(0.0, sigma)) for v in level] for k in range(n)]


def precursor(**keys):
    return Precursor(GuardConfig(**keys), NAMES)


@pytest.mark.parametrize("seed", range(5))
def test_no_warning_on_a_noisy_flat_a_declining_or_a_warming_up_series(seed):
    weights = [[1.0, 2.0, 0.1]] * 300
    flat = noisy(300, seed)
    cosine = noisy(300, seed, trend=lambda k: 0.1 + 0.9 * (1 + math.cos(math.pi * k / 300)) / 2)
    warmup = noisy(300, seed, trend=lambda k: min(1.0, (k + 1) / 100))  # a linear LR warmup over 100 intervals
    for updates in (flat, cosine, warmup):
        assert feed(precursor(), updates, weights) == []


def test_a_warning_intervals_before_a_constructed_blow_up_names_the_layer_that_departs():
    weights = [[1.0, 2.0, 0.1]] * 40
    updates = noisy(40, 0, sigma=0.1)
    for k in range(30, 40):  # from interval 30 on, layer b's update grows 1.8x per interval
        updates[k][1] *= 1.8 ** (k - 29)
    spike = 365  # the loss spikes in interval 36 (steps 361-370)
    got = feed(precursor(), updates, weights, spike_at=spike)
    assert [step for step, _ in got] == [320]  # its 2nd interval of growth (1.8^2 = 3.2x > 2x); not again after
    step, warning = got[0]
    assert spike - step == 45  # the lead: 4 intervals and a half
    assert [layer["name"] for layer in warning.layers] == ["b.weight"]
    layer = warning.layers[0]
    assert layer["ratio"] == pytest.approx(updates[31][1] / 2.0)
    assert 3.0 < layer["factor"] < 4.5 and layer["z"] > 10 and layer["update_factor"] == pytest.approx(layer["factor"])
    assert warning.line.startswith("precursor at step 320: update/weight ratio departs from its recent history in "
                                   "b.weight (")
    assert f"{layer['factor']:.2g}x its typical" in warning.reason
    assert json.loads(json.dumps(warning.fields()))["layers"][0]["name"] == "b.weight"


def test_no_warning_once_the_loss_has_departed_nor_when_only_the_weight_shrank():
    weights = [[1.0, 2.0, 0.1]] * 40
    updates = noisy(40, 1, sigma=0.1)
    for k in range(30, 40):
        updates[k][1] *= 1.8 ** (k - 29)
    assert feed(precursor(), updates, weights, spike_at=315) == []  # the departing interval already spiked
    shrinking = [list(w) for w in weights]
    for k in range(30, 40):  # a one-element bias crossing zero: the ratio departs, the update does not
        shrinking[k][2] = 0.1 * 0.3 ** (k - 29)
    assert feed(precursor(), noisy(40, 1, sigma=0.1), shrinking) == []


def test_the_switch_the_keys_and_their_ranges():
    weights = [[1.0, 2.0, 0.1]] * 40
    updates = noisy(40, 0, sigma=0.1)
    for k in range(30, 40):
        updates[k][1] *= 1.8 ** (k - 29)
    assert feed(precursor(precursor=False), updates, weights) == []
    assert [s for s, _ in feed(precursor(precursor_ratio=4.0), updates, weights)] == [330]  # 1.8^3 = 5.8x > 4x
    assert [s for s, _ in feed(precursor(precursor_warmup=35), updates, weights)] == [360]  # armed at interval 35
    for key, value, want in (("precursor_zscore", 0, "a number > 0"), ("precursor_ratio", 0.5, "a number >= 1"),
                             ("precursor_window", 1, "an integer >= 2"), ("precursor_warmup", 1, "an integer >= 2")):
        with pytest.raises(ConfigError, match=rf"config key 'guard.{key}': expected {want}, got {value}"):
            load_config(None, [f"guard.{key}={value}"])
        with pytest.raises(ConfigError, match=rf"'guard.{key}'"):
            precursor(**{key: value})


def test_state_dict_round_trip_warns_as_the_uninterrupted_run():
    weights = [[1.0, 2.0, 0.1]] * 60
    updates = noisy(60, 3, sigma=0.1)
    for k in range(40, 60):
        updates[k][0] *= 1.7 ** (k - 39)
    whole = precursor()
    expected = feed(whole, updates, weights)
    first = precursor()
    assert feed(first, updates[:35], weights[:35]) == []
    state = json.loads(json.dumps(first.state_dict()))  # plain values
    resumed = precursor()
    resumed.load_state_dict(state)
    got = feed(resumed, updates[35:], weights[35:], start=35)
    assert [(s, w.layers) for s, w in got] == [(s, w.layers) for s, w in expected] and [s for s, _ in got] == [420]
    assert resumed.state_dict() == whole.state_dict()
    fresh = precursor()
    fresh.load_state_dict({})  # a checkpoint from before the precursor: starts afresh
    assert fresh.state_dict() == precursor().state_dict()
    with pytest.raises(ValueError, match="covers 3 parameters, this model has 2"):
        Precursor(GuardConfig(), NAMES[:2]).load_state_dict(state)


def test_per_parameter_update_norms_one_process_and_sharded():
    torch.manual_seed(0)
    before = [torch.randn(4, 3), torch.randn(5)]
    now = [b + 0.01 * torch.randn_like(b) for b in before]
    out = update_norms(now, before)
    want = torch.stack([(n - b).norm() for n, b in zip(now, before)])
    assert torch.allclose(out["param_update_norms"], want) and torch.allclose(out["param_norms"],
                                                                              torch.stack([b.norm() for b in before]))
    assert torch.equal(out["update_norm"], update_norm(now, before)[0])
    assert out["update_ratio"] == pytest.approx(float(want.norm() / torch.cat([b.flatten() for b in before]).norm()))
    sharded = ShardedNumerics().update_norms(now, before)  # one process: the all-reduce is the identity
    for key in out:
        assert torch.allclose(sharded[key], out[key], rtol=1e-6), key


def test_the_interval_reads_each_layers_update_in_its_one_sync():
    metrics = StepMetrics(4, 2, torch.device("cpu"))
    one = torch.ones(())
    for step in range(1, 5):
        extra = {}
        if step == 4:
            extra = {"param_update_norms": torch.tensor([0.2, 0.03]), "param_norms": torch.tensor([10.0, 0.1])}
        metrics.update(step, per_param_norms=torch.tensor([1.0, 2.0]), num_samples=8, loss=one, grad_norm=one,
                       post_clip_norm=one, clipped=one * 0, applied=one, finite=one, lr=1e-3, loss_scale=1.0,
                       count=one * 8, **extra)
    state = metrics.state_dict()
    assert state["param_update"].flatten().tolist() == pytest.approx([0.2, 0.03, 10.0, 0.1])
    with SyncCounter() as counter:
        summary, rows, param_sq = metrics.reduce()
    assert len(counter.calls) == 1  # the per-parameter figures ride the interval's one read
    assert summary["interval_param_update_norms"] == pytest.approx([0.2, 0.03])
    assert summary["interval_param_norms"] == pytest.approx([10.0, 0.1]) and summary["interval_finite_steps"] == 4
    record = interval_record(summary, param_sq, ["w", "b"], 1.0, top_layers=1, progress={})
    assert record["top_update_layers"] == [{"name": "b", "ratio": pytest.approx(0.3)}]
    assert not any(k.startswith("interval_") for k in record)
    reloaded = StepMetrics(4, 2, torch.device("cpu"))
    reloaded.load_state_dict({**state, "param_update": None})
    assert reloaded.state_dict()["param_update"] is None


def regression_task(seed: int = 0) -> Task:
    """A tanh MLP regression: with Adam warmed up towards too high an LR its state drifts and its loss spikes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)) + 0.05 * torch.randn(512, 1, generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=lambda m, b: F.mse_loss(m(b[0]), b[1]),
                name="regression")


#: Adam warmed up towards an LR too high for the regression: its first spike comes at step 139.
TOO_HIGH = ("train.max_steps=160", "train.batch_size=8", "optim.lr=0.3", "sched.warmup_steps=400", "sched.decay=constant",
            "ckpt.every=0", "eval.every=0", "capture.incidents=false")


@pytest.mark.slow
def test_a_run_whose_lr_is_too_high_warns_before_its_first_spike_with_one_sync_per_interval(tmp_path, capsys):
    c = cfg(*TOO_HIGH)
    trainer = Trainer(c, task=regression_task(), run_dir=tmp_path / "run")
    with SyncCounter(lambda: trainer.step) as counter:
        trainer.fit()
    events, problems = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert not problems
    warned = [e for e in events if e["kind"] == "precursor"]
    first_spike = min(e["step"] for e in events if e["kind"] == "spike")
    before = [e for e in warned if e["step"] < first_spike]
    assert before, f"no precursor before the first spike at step {first_spike}: {warned}"
    lead = first_spike - before[-1]["step"]
    assert 10 <= lead <= 50, lead  # measured: the warning at step 120, the spike at 139
    layer = before[-1]["layers"][0]
    assert layer["factor"] > 2 and layer["z"] > 3 and layer["update_factor"] > 2 and layer["name"] in trainer.boundary.names
    assert f"stabletrain: precursor at step {before[-1]['step']}: update/weight ratio departs" in capsys.readouterr().out
    # The precursor's figures ride each interval's one sync: none between boundaries, one per boundary's log.
    assert not [(s, w) for s, _, w in counter.calls if s % 10 and "on_fit_start" not in w]
    logged = [s for s, _, where in counter.calls if "_log" in where]
    assert {s: logged.count(s) for s in set(logged)} == {s: 1 for s in range(10, 161, 10)}
    metrics, _ = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert all(len(r["top_update_layers"]) == 3 for r in metrics)
    # The state carries the precursor's history (checkpoints, rollbacks): it round-trips through a new Trainer.
    state = trainer.state_dict()
    other = Trainer(c, task=regression_task())
    other.load_state_dict(state)
    assert other.boundary.precursor.state_dict() == trainer.boundary.precursor.state_dict()
    assert state["precursor"]["num_warnings"] == len(warned)
    off = Trainer(cfg(*TOO_HIGH, "guard.precursor=false"), task=regression_task(), run_dir=tmp_path / "off")
    off.fit()
    events, _ = read_jsonl(tmp_path / "off" / "events.jsonl")
    assert [e["step"] for e in events if e["kind"] == "spike"][:1] == [first_spike]  # the same run, no warning
    assert not [e for e in events if e["kind"] == "precursor"]


def test_an_adapter_reads_the_same_figures_and_keeps_the_history_in_its_state():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with Monitor(model, optimizer, log_every=5, init_check=False, capture=False) as monitor:
        for batch in batches(30):
            monitor.backward(loss_fn(model, batch))
            monitor.step(batch)
        state = monitor.state_dict()
    session = monitor.session
    names = [n for n, _ in session.named_params]
    assert [len(r["top_update_layers"]) for r in session.history] == [3] * 6
    assert all(r["top_update_layers"][0]["name"] in names and r["top_update_layers"][0]["ratio"] > 0 for r in session.history)
    history = session.boundary.precursor.state_dict()
    assert history["ratios"]["count"] == [6] * len(names)  # one figure per interval and layer
    assert state["precursor"] == history


def test_a_parameter_of_a_few_elements_is_not_watched():
    """A one-element bias crossing zero warned at "1.9e3x its typical": the same departure of b.weight, given as a
    parameter of 4 elements, warns no more; of 32 (a LayerNorm gain: the default gpt's true warnings), it does."""
    weights = [[1.0, 2.0, 0.1]] * 40
    updates = noisy(40, 0, sigma=0.1)
    for k in range(30, 40):
        updates[k][1] *= 1.8 ** (k - 29)
    assert [s for s, _ in feed(precursor(), updates, weights)] == [320]
    assert [s for s, _ in feed(Precursor(GuardConfig(), NAMES, sizes=[64, 32, 1]), updates, weights)] == [320]
    assert feed(Precursor(GuardConfig(), NAMES, sizes=[64, 4, 64]), updates, weights) == []


def test_the_warning_says_the_gradient_grew_where_it_grew_by_half_the_updates_factor_whatever_its_z():
    """Constant-LR SGD (update = lr x grad): a grad 2x its typical at z 1.1 beside an update 2.2x read 'not the gradient:
    the step size grew'."""
    from stabletrain.policies.precursor import _describe

    layer = {"name": "fc.weight", "ratio": 0.02, "factor": 2.2, "typical": 0.009, "z": 3.4}
    assert "the gradient grew with it" in _describe({**layer, "grad_factor": 2.0, "grad_z": 1.1})
    assert "the gradient grew with it" in _describe({**layer, "grad_factor": 1.2, "grad_z": 2.5})
    assert "not the gradient: the step size grew" in _describe({**layer, "grad_factor": 1.05, "grad_z": 0.3})

