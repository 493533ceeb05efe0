"""Your optimizer: adamw/adam/sgd from the config, a task's own factory, and a replay that uses what the run used."""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
from helpers import PoisonAt, cfg, params_of, regression_task
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain import Task, Trainer
from stabletrain.callbacks import Callback
from stabletrain.config import ConfigError
from stabletrain.records.bundles import load_bundle


@pytest.mark.parametrize("name, cls, extra", [("adamw", torch.optim.AdamW, {"betas": (0.9, 0.95)}),
                                              ("adam", torch.optim.Adam, {"betas": (0.9, 0.95)}),
                                              ("sgd", torch.optim.SGD, {"momentum": 0.9, "nesterov": True})])
def test_optim_name_builds_a_fused_optimizer_that_skips_on_the_device(name, cls, extra):
    overrides = [f"optim.name={name}"] + (["optim.momentum=0.9", "optim.nesterov=true"] if name == "sgd" else [])
    trainer = Trainer(cfg(*overrides, "train.max_steps=2"), task=regression_task())
    opt = trainer.optimizer
    assert type(opt) is cls and opt.defaults["fused"] is True and opt._step_supports_amp_scaling
    for key, value in extra.items():
        assert opt.defaults[key] == value
    decays = sorted(g["weight_decay"] for g in opt.param_groups)
    assert decays == [0.0, 0.1], "weight decay on matrices only"
    trainer.fit()


def test_nesterov_needs_momentum_and_sgd_keys_are_named():
    with pytest.raises(ConfigError, match="optim.nesterov"):
        cfg("optim.name=sgd", "optim.nesterov=true")
    with pytest.raises(ConfigError, match="optim.name"):
        cfg("optim.name=lion")


def test_the_word_language_model_recipe_runs_sgd_lr_20_clip_025_constant():
    c = cfg("optim.name=sgd", "optim.lr=20", "clip.max_norm=0.25", "sched.decay=constant", "sched.warmup_steps=0",
            "optim.weight_decay=0", "train.max_steps=10", "log.every=5")
    trainer = Trainer(c)
    first = trainer.fit() and trainer.history[0]
    last = trainer.history[-1]
    assert type(trainer.optimizer) is torch.optim.SGD
    assert first["lr"] == last["lr"] == 20.0
    assert last["clip_rate"] > 0 and last["grad_norm_post_clip"] <= 0.25 * (1 + 1e-5)


def test_a_task_optimizer_factory_is_used_and_a_non_fused_one_still_skips_correctly():
    task = regression_task()
    task.model = PoisonAt(task.model, {3})  # a NaN at step 3
    seen = []

    def factory(named_params):
        seen.append([n for n, _ in named_params])
        return torch.optim.RMSprop([p for _, p in named_params], lr=1e-3)  # no fused path: one sync per step

    task.optimizer = factory
    trainer = Trainer(cfg("train.max_steps=4", "log.every=4", "train.batch_size=8"), task=task)
    assert type(trainer.optimizer) is torch.optim.RMSprop and seen == [[n for n, _ in trainer.named_params]]
    with pytest.warns(UserWarning, match="RMSprop cannot skip a step on the device"):
        trainer.train_step(trainer.stream.next_window())
        trainer.train_step(trainer.stream.next_window())
    before = params_of(trainer.module)
    out = trainer.train_step(trainer.stream.next_window())
    assert not bool(out["applied"]) and all(torch.equal(a, b) for a, b in zip(before, trainer.module.parameters()))
    assert float(trainer.schedule.applied_steps) == 2


def test_a_task_optimizer_that_is_not_an_optimizer_is_refused():
    task = regression_task()
    task.optimizer = lambda named: [p for _, p in named]
    with pytest.raises(TypeError, match="Task.optimizer returned list"):
        Trainer(cfg(), task=task)


def saturating_task() -> Task:
    """One tanh unit, output layer frozen: a huge SGD step saturates it (finite loss) until momentum overflows it."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1, generator=g)
    model = nn.Sequential(nn.Linear(1, 1), nn.Tanh(), nn.Linear(1, 1))
    model[2].requires_grad_(False)
    return Task(model=model, train_data=TensorDataset(x, 50 * torch.sign(x)),
                loss=lambda m, b: F.mse_loss(m(b[0]), b[1]), name="saturating")


class ParamsAfterStep(Callback):
    def __init__(self):
        self.params = {}

    def on_step_end(self, state, out):
        self.params[state.step] = {n: p.detach().clone() for n, p in state.module.named_parameters()}


def test_the_incident_replay_runs_the_runs_own_step_sgd_momentum_clipping_bitwise(tmp_path):
    torch.manual_seed(0)
    taps = ParamsAfterStep()
    c = cfg("optim.name=sgd", "optim.lr=3.4e38", "optim.momentum=0.9", "optim.weight_decay=0", "clip.max_norm=1.0",
            "sched.warmup_steps=4", "sched.decay=constant", "train.max_steps=12", "log.every=12", "train.batch_size=8",
            "ckpt.every=100")
    trainer = Trainer(c, task=saturating_task(), run_dir=tmp_path / "run", callbacks=[taps])
    trainer.fit()
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    bad = next(e for e in events if e["kind"] == "nonfinite" and e.get("after_update"))  # pinned by the replay
    n = bad["step"]
    assert bad.get("after_update") and n >= 3, "the update (not the forward) made the parameters non-finite"
    assert trainer.history[-1]["clip_rate"] > 0, "clipping fired on the way there"
    incident = next(e for e in events if e["kind"] == "incident")
    bundle = load_bundle(incident["path"])
    # The capture replayed steps 1..n-1 from step 0 with the run's SGD, momentum, clipping and schedule.
    for name, value in taps.params[n - 1].items():
        assert torch.equal(bundle["model"][name], value), name
    diagnosis = json.loads((tmp_path / "run" / "incidents" / f"step_{n:06d}" / "diagnosis.json").read_text())
    assert diagnosis["replays"][0]["grad_norm"] == bad["grad_norm"], "the replay measured the run's own grad norm"
    assert diagnosis["reproduces"] is True
    assert bundle["optimizer"]["state"], "SGD's momentum buffers are in the bundle"


def test_the_diagnosis_rebuilds_the_task_optimizer_the_run_used(tmp_path):
    from stabletrain.incident_replay import diagnose_incident

    task = regression_task()
    task.model = PoisonAt(task.model, {4})
    built = []

    def factory(named_params):
        opt = torch.optim.SGD([p for _, p in named_params], lr=0.1, momentum=0.5, fused=True)
        built.append(opt)
        return opt

    task.optimizer = factory
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # fused: no per-step sync warning
        Trainer(cfg("train.max_steps=6", "log.every=6", "train.batch_size=8", "capture.diagnose=false"), task=task,
                run_dir=tmp_path / "run").fit()
    d = diagnose_incident(tmp_path / "run" / "incidents" / "step_000004", task)
    assert len(built) >= 2 and all(type(o) is torch.optim.SGD for o in built)
    assert d["update_checked"] is True


def test_a_non_fused_optimizer_costs_exactly_one_host_read_per_step():
    from stabletrain.syncs import SyncCounter

    task = regression_task()
    task.optimizer = lambda named: torch.optim.SGD([p for _, p in named], lr=0.01, momentum=0.9, foreach=True)
    trainer = Trainer(cfg("train.max_steps=10", "log.every=10", "train.batch_size=8"), task=task)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with SyncCounter(lambda: trainer.step) as counter:
            trainer.fit()
    per_step = [c for c in counter.calls if "train_step" in c.where or "update" in c.where]
    assert len(per_step) == 10 and {c.op for c in per_step} == {"__bool__"}, per_step[:3]
    assert float(trainer.schedule.applied_steps) == 10
    assert trainer.schedule.lr() == pytest.approx(float(trainer.schedule.factor(torch.tensor(10.0))) * 0.01)


class BuildsItsHeadInForward(nn.Module):
    """A model whose last layer is made at the first forward (after the optimizer was built over the rest)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.head: nn.Module | None = None

    def forward(self, x):
        if self.head is None:
            self.head = nn.Linear(8, 1)
        return self.head(torch.tanh(self.body(x)))


def _task(model):
    task = regression_task()
    task.model = model
    return task


def test_parameters_made_in_the_first_forward_are_an_error_at_the_first_step(tmp_path):
    torch.manual_seed(0)
    trainer = Trainer(cfg("train.max_steps=4", "log.every=2"), task=_task(BuildsItsHeadInForward()),
                      run_dir=tmp_path / "r")
    with pytest.raises(ValueError) as err:
        trainer.fit()
    message = str(err.value)
    assert ("task 'regression': the first step created or replaced 2 trainable parameter(s) the optimizer was not "
            "built with") in message
    assert "'head.weight', 'head.bias'" in message and "2 when the optimizer was built, 4 after the first step" in message
    assert "create every layer in the model's __init__" in message
    assert trainer.step == 0  # raised at step 1, before anything trained on a half-built model was checkpointed
    crash = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines() if '"crash"' in x]
    assert crash and crash[0]["failed_step"] == 1


def test_lazy_modules_are_named_before_the_optimizer_is_built():
    model = nn.Sequential(nn.LazyLinear(8), nn.Tanh(), nn.Linear(8, 1))
    with pytest.raises(ValueError, match=r"task 'regression': the model has 2 uninitialized \(lazy\) parameter\(s\) "
                                         r"\('0.weight', '0.bias'\)"):
        Trainer(cfg("train.max_steps=2"), task=_task(model))
    model(torch.zeros(1, 4))  # materialized in the factory, as the error says: it trains
    trainer = Trainer(cfg("train.max_steps=2"), task=_task(model))
    before = params_of(model)
    trainer.fit()
    assert all(not torch.equal(a, b) for a, b in zip(before, params_of(model)))
