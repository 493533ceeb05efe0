"""The precision policy: fp16 + GradScaler on CPU, the guard's verdict as a real skip, growth, resume with the scaler."""

import json
import warnings

import pytest
import torch
from helpers import PoisonAt, cfg, params_of, regression_task

from stabletrain import Trainer
from stabletrain.callbacks import Callback
from stabletrain.policies import precision as precision_module
from stabletrain.policies.precision import PrecisionPolicy

CPU = torch.device("cpu")


def fp16_policy(**scaler_kw) -> PrecisionPolicy:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = PrecisionPolicy("fp16", CPU)
    if scaler_kw:
        p.scaler = torch.amp.GradScaler("cpu", **scaler_kw)
    return p


def test_fp16_on_cpu_runs_with_a_scaler_and_warns_once_that_it_is_for_testing(monkeypatch):
    monkeypatch.setattr(precision_module, "_warned_fp16_cpu", False)
    with pytest.warns(UserWarning, match="fp16 on CPU.*meant for testing"):
        p = PrecisionPolicy("fp16", CPU)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second policy (a replay, a check) does not warn again
        PrecisionPolicy("fp16", CPU)
    assert p.scaler is not None and p.dtype == torch.float16
    with p.autocast():
        y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == torch.float16


def _one_param_step(policy: PrecisionPolicy, grad: float, ok: bool):
    w = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([w], lr=0.1, fused=True)
    policy.backward((w * grad).sum())
    policy.unscale_(opt)
    applied = policy.step(opt, torch.tensor(ok))
    return w, applied


def test_a_guard_skip_is_a_real_skip_under_a_scaler_and_does_not_back_off_the_scale():
    policy = fp16_policy(init_scale=2.0**8, growth_interval=1000)
    w, applied = _one_param_step(policy, grad=1.0, ok=False)
    assert not bool(applied)
    assert torch.equal(w.detach(), torch.ones(3)), "the guard said skip: the weights must not move"
    assert float(policy.loss_scale()) == 2.0**8, "a guard skip is not an overflow: the scale stays"


def test_an_overflow_skips_halves_the_scale_and_the_scale_grows_back_after_growth_interval():
    policy = fp16_policy(init_scale=2.0**8, growth_interval=3)
    w, applied = _one_param_step(policy, grad=float("inf"), ok=True)  # the caller saw nothing; the scaler did
    assert not bool(applied) and torch.equal(w.detach(), torch.ones(3))
    assert float(policy.loss_scale()) == 2.0**7
    scales = []
    for _ in range(3):
        w, applied = _one_param_step(policy, grad=1.0, ok=True)
        assert bool(applied) and not torch.equal(w.detach(), torch.ones(3))
        scales.append(float(policy.loss_scale()))
    assert scales == [2.0**7, 2.0**7, 2.0**8]


class StateTaps(Callback):
    """Record parameters, optimizer state and lr after every step (a test-only observer; it clones)."""

    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref, self.after = trainer_ref, {}

    def on_step_end(self, state, out):
        trainer = self.trainer_ref[0]
        opt_state = [{k: v.clone() for k, v in trainer.optimizer.state[p].items()} for p in trainer.params]
        self.after[state.step] = (params_of(state.module), opt_state, float(trainer.schedule.lr()),
                                  float(trainer.precision.loss_scale()))


def test_fp16_spike_step_chosen_by_the_guard_is_skipped_bitwise_with_the_lr_held(tmp_path):
    torch.manual_seed(0)
    task = regression_task()
    task.model = PoisonAt(task.model, {12}, 30.0)  # forward call 12 = step 12: a loss ~900x, fp16 grads finite
    c = cfg("precision=fp16", "train.batch_size=8", "train.max_steps=14", "log.every=7", "sched.warmup_steps=0",
            "sched.decay=cosine", "guard.on_spike=skip", "guard.spike_window=8", "clip.max_norm=null")
    ref: list = []
    taps = StateTaps(ref)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(c, task=task, run_dir=tmp_path / "run", callbacks=[taps])
    ref.append(trainer)
    trainer.precision.scaler = torch.amp.GradScaler("cpu", init_scale=4.0, growth_interval=10_000)  # no overflow
    trainer.fit()
    p11, s11, lr11, scale11 = taps.after[11]
    p12, s12, lr12, scale12 = taps.after[12]
    assert all(torch.equal(a, b) for a, b in zip(p11, p12)), "parameters moved on the skipped spike step"
    assert all(torch.equal(a[k], b[k]) for a, b in zip(s11, s12) for k in a), "optimizer state moved"
    assert lr12 == lr11 and taps.after[13][2] != lr12, "the LR holds on the skipped step, then advances"
    assert scale12 == scale11, "a spike is not an overflow: the loss scale stays"
    assert float(trainer.schedule.applied_steps) == 13
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    skip = [e for e in events if e["kind"] == "skip"]
    assert [e["step"] for e in skip] == [12] and "loss spike" in skip[0]["reason"]
    assert [e["step"] for e in events if e["kind"] == "spike"] == [12]


class CrashAt(Callback):
    """Raise after step ``n`` (a crash between two checkpoints; the one before it must be resumed from)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def on_step_end(self, state, out):
        if state.step == self.n:
            raise RuntimeError(f"planted crash after step {self.n}")


def test_fp16_resume_restores_the_scaler_and_ends_bitwise_equal(tmp_path):
    def trainer(run_dir, resume=False, callbacks=()):
        torch.manual_seed(0)
        c = cfg("precision=fp16", "train.batch_size=8", "log.every=3", "ckpt.every=3", "sched.warmup_steps=2",
                "train.max_steps=9")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = Trainer(c, task=regression_task(), run_dir=run_dir, resume=resume, callbacks=callbacks)
        t.precision.scaler.set_growth_interval(2)  # the scale changes within the run, so its state matters
        return t

    straight = trainer(tmp_path / "a")
    straight.fit()
    with pytest.raises(RuntimeError, match="planted crash after step 7"):
        trainer(tmp_path / "b", callbacks=[CrashAt(7)]).fit()  # LAST_GOOD: step 6
    resumed = trainer(tmp_path / "b", resume=True)
    assert resumed.step == 6
    resumed.fit()
    assert float(straight.precision.loss_scale()) == float(resumed.precision.loss_scale()) != 2.0**16
    for a, b in zip(straight.module.parameters(), resumed.module.parameters()):
        assert torch.equal(a, b)


def test_the_fp16_on_cpu_warning_is_said_by_rank_0_only(monkeypatch):
    """Under dist.nproc=2 each rank printed it: the same line twice."""
    import warnings

    import stabletrain.policies.precision as precision_module

    for rank, expected in (("1", 0), ("0", 1)):
        monkeypatch.setattr(precision_module, "_warned_fp16_cpu", False)
        monkeypatch.setenv("RANK", rank)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            precision_module.resolve_precision("fp16", torch.device("cpu"))
        assert sum("precision=fp16 on CPU" in str(w.message) for w in caught) == expected, rank


class _Grows(torch.nn.Module):
    """An output trained toward 2e5 through exp(s) * 100: it outgrows float16 (65504) partway through a run."""

    def __init__(self):
        super().__init__()
        self.lin, self.s = torch.nn.Linear(16, 1), torch.nn.Parameter(torch.zeros(()))

    def forward(self, x):
        return self.lin(x) * torch.exp(self.s).to(x.dtype) * 100.0


def test_an_fp16_output_that_outgrows_float16_mid_run_stops_with_the_fp16_advice(tmp_path):
    """A new user's run: the loss fell, then the forward overflowed float16 every step; the loss scale stayed at 65536
    (the scaler backs off on its gradients' overflow only) and the stop after 20 skips said nothing of fp16."""
    from stabletrain.tasks import Task

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 16, generator=g)
    torch.manual_seed(0)
    task = Task(model=_Grows(), train_data=torch.utils.data.TensorDataset(x, torch.full((1024, 1), 2e5)),
                loss=lambda m, b: torch.nn.functional.l1_loss(m(b[0]).float(), b[1]) / 1e4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (fp16 on CPU is for testing: said once)
        trainer = Trainer(cfg("precision=fp16", "optim.lr=0.05", "sched.warmup_steps=0", "sched.decay=constant",
                              "clip.max_norm=null", "train.max_steps=300", "log.every=20", "capture.incidents=false"),
                          task=task, run_dir=tmp_path / "run")
        trainer.fit()
    reason = trainer.stop_reason or ""
    assert "consecutive skipped steps" in reason and "GradScaler's scale is 6.6e+04" in reason, reason
    assert "the loss itself is non-finite in float16" in reason and "Try precision=bf16" in reason, reason


def test_fp16_inputs_check_inputs_finds_non_finite_skip_the_step_without_backing_off_the_loss_scale(tmp_path):
    """A new-user trial: a NaN input sample under guard.check_inputs=true, seen at steps 6 and 38, halved the scale each
    time (32768 -> 16384 -> 8192), where the docs say a step the guard skips for bad inputs backs nothing off. Without
    the check the NaN loss's gradients back it off as torch's GradScaler does (bitwise a hand-written loop's)."""
    from stabletrain.records.jsonl import read_jsonl
    from stabletrain.tasks import Task

    def run(check: str) -> dict:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g)
        x[37, 0] = float("nan")  # in step 5 and step 13 (batch 8, no shuffle)
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        task = Task(model=model, train_data=torch.utils.data.TensorDataset(x, y),
                    loss=lambda m, b: torch.nn.functional.mse_loss(m(b[0]).float(), b[1]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (fp16 on CPU is for testing: said once)
            Trainer(cfg("precision=fp16", "train.batch_size=8", "data.shuffle=false", "train.max_steps=16", "log.every=1",
                        "capture.incidents=false", f"guard.check_inputs={check}"), task=task, run_dir=tmp_path / check).fit()
        return {r["step"]: r for r in read_jsonl(tmp_path / check / "metrics.jsonl")[0]}

    rows = run("true")
    assert [s for s, r in rows.items() if r["loss"] == "nan"] == [5, 13]
    assert rows[5]["num_skipped"] == rows[13]["num_skipped"] == 1
    assert rows[5]["loss_scale"] == rows[4]["loss_scale"] and rows[13]["loss_scale"] == rows[12]["loss_scale"], rows
    assert rows[8]["loss_scale"] == rows[7]["loss_scale"] / 2 and rows[8]["loss"] != "nan"  # a routine overflow backs off
    plain = run("false")  # torch's GradScaler's own way: the NaN gradients back it off
    assert plain[5]["loss_scale"] == plain[4]["loss_scale"] / 2, plain


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_model_cast_wholesale_is_warned_of_once_with_what_to_do_instead(tmp_path, precision):
    """A new user's trial: a .half() model trained silently under `stabletrain train`, its report saying "precision fp32":
    its weights trained in half precision with no float32 master copy and no loss scaling. A model kept in float32 is not
    warned of."""
    from broken_tasks import half_model_task

    from stabletrain.console import StableTrainWarning

    with pytest.warns(StableTrainWarning, match="cast wholesale") as seen:
        Trainer(cfg("train.max_steps=2", f"precision={precision}"), task=half_model_task(), run_dir=tmp_path / "half").fit()
    said = [str(w.message) for w in seen if "cast wholesale" in str(w.message)]
    assert len(said) == 1 and f"4 of 4 parameters are stored in bfloat16 (e.g. 0.weight), a model cast wholesale (.half()): " \
        f"precision={precision} trains those weights in their own dtype" in said[0], said
    # bfloat16 has float32's range: its trouble is rounding, never underflow (a trial read 'underflow' for a pure-bf16 run)
    assert "an update under ~1/256 of its weight rounds away" in said[0] and "underflow" not in said[0], said
    with warnings.catch_warnings(record=True) as plain:
        warnings.simplefilter("always")
        Trainer(cfg("train.max_steps=2", f"precision={precision}"), task=regression_task(), run_dir=tmp_path / "fp32").fit()
    assert not [w for w in plain if "cast wholesale" in str(w.message)]
