"""The optimizer step: unscale before norm and clip, skip on non-finite, hold the schedule, record it all."""

import json
import math
import warnings

import pytest
import torch
from helpers import PoisonAt, cfg, params_of, regression_task

from stabletrain import Trainer
from stabletrain.numerics import grad_norms
from stabletrain.policies.clipping import GradClipper
from stabletrain.policies.precision import PrecisionPolicy
from stabletrain.policies.schedule import LRSchedule


def _trainer(*overrides, poison=(), value=float("nan"), scaler=False, run_dir=None, scaled_mode="bf16"):
    torch.manual_seed(0)
    task = regression_task()
    if poison:
        task.model = PoisonAt(task.model, set(poison), value)
    c = cfg("train.batch_size=8", "log.every=5", "sched.warmup_steps=0", "sched.decay=cosine", "train.max_steps=5",
            *([f"precision={scaled_mode}"] if scaler else []), *overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU warns that it is for testing
        trainer = Trainer(c, task=task, run_dir=run_dir)
    if scaler:  # a small growth-free scale; on a bf16 policy (against a bf16 reference) the same scaler path
        trainer.precision.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    return trainer


def test_nonfinite_norm_skips_the_step_and_leaves_parameters_and_optimizer_state_unchanged():
    trainer = _trainer(poison=[2])
    trainer.train_step(trainer.stream.next_window())  # step 1: fine
    before = params_of(trainer.model)
    state_before = {k: v.clone() for k, v in trainer.optimizer.state[trainer.params[0]].items()}
    out = trainer.train_step(trainer.stream.next_window())  # step 2: NaN output
    assert not out["finite"] and not out["applied"] and not out["clipped"]
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
    for k, v in trainer.optimizer.state[trainer.params[0]].items():
        assert torch.equal(v, state_before[k]), k
    # The grads were not "clipped" (scaled towards zero) as if that fixed them.
    assert any(not torch.isfinite(p.grad).all() for p in trainer.params)


def test_schedule_holds_on_a_skipped_step_and_events_name_the_step(tmp_path):
    trainer = _trainer(poison=[3], run_dir=tmp_path / "run")
    lrs = []
    for _ in range(5):
        trainer.train_step(trainer.stream.next_window())
        lrs.append(float(trainer.schedule.lr()))
    assert float(trainer.schedule.applied_steps) == 4
    assert lrs[2] == lrs[1], "the lr must not advance on the skipped step 3"
    expected = [float(trainer.schedule.factor(torch.tensor(float(n)))) * 1e-3 for n in (1, 2, 2, 3, 4)]
    assert lrs == pytest.approx(expected, rel=1e-6)
    trainer = _trainer(poison=[3], run_dir=tmp_path / "run2")
    trainer.fit()
    events = [json.loads(line) for line in (tmp_path / "run2" / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["kind"]) for e in events if e["kind"] in ("nonfinite", "skip")] == [(3, "nonfinite"), (3, "skip")]
    # A fault that happened once (the poison fires on one forward call) does not reproduce on replay.
    incident = next(e for e in events if e["kind"] == "incident")
    assert incident["step"] == 3 and incident["diagnosis"]["reproduces"] is False
    record = json.loads((tmp_path / "run2" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["num_skipped"] == 1 and record["num_nonfinite"] == 1


def test_grads_are_unscaled_before_the_norm_and_clipping():
    # Reference: the same step without a scaler. With the scaler, the measured norm must be the true one.
    ref = _trainer("precision=bf16", "clip.max_norm=0.05")
    out_ref = ref.train_step(ref.stream.next_window())
    scaled = _trainer("clip.max_norm=0.05", scaler=True)
    out = scaled.train_step(scaled.stream.next_window())
    assert float(scaled.precision.loss_scale()) == 2.0**10
    assert float(out["grad_norm"]) == pytest.approx(float(out_ref["grad_norm"]), rel=1e-3)
    assert bool(out["clipped"])
    for a, b in zip(ref.model.parameters(), scaled.model.parameters()):
        assert torch.allclose(a, b, atol=1e-6), (a - b).abs().max()


def test_scaler_overflow_is_skipped_recorded_and_holds_the_schedule(tmp_path):
    # x300 at step 3: a finite loss whose scaled fp16 gradient overflows (the scaler's case, not a NaN).
    trainer = _trainer(poison=[3], value=300.0, scaler=True, run_dir=tmp_path / "run", scaled_mode="fp16")
    trainer.fit()
    assert float(trainer.schedule.applied_steps) == 4
    rows = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    skip = [e for e in rows if e["kind"] == "skip"]
    assert [e["step"] for e in skip] == [3] and "GradScaler" in skip[0]["reason"]
    assert skip[0]["loss_scale"] == 2.0**9  # backed off once
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["loss_scale"] == 2.0**9 and record["num_skipped"] == 1


def test_clipping_telemetry_in_metrics():
    trainer = _trainer("clip.max_norm=0.01", "train.max_steps=10")
    record = trainer.fit()
    assert record["clip_rate"] == 1.0
    assert record["grad_norm_post_clip"] == pytest.approx(0.01, rel=1e-3)
    assert record["grad_norm"] > 0.01
    assert {r["name"] for r in record["top_grad_layers"]} <= {n for n, _ in trainer.named_params}
    assert sum(r["share"] for r in record["top_grad_layers"]) <= 1.0 + 1e-9


def test_clipper_bound_and_nonfinite_untouched():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(10)) for _ in range(3)]
    for p in params:
        p.grad = torch.randn(10) * 5
    norm, per = grad_norms(params)
    assert torch.allclose(norm, torch.linalg.vector_norm(torch.cat([p.grad for p in params])))
    assert torch.allclose(per, torch.stack([p.grad.norm() for p in params]))
    clipper = GradClipper(1.0)
    assert bool(clipper.clip_(params, norm, torch.isfinite(norm)))
    assert float(grad_norms(params)[0]) <= 1.0 + 1e-5
    assert float(clipper.post_clip_norm(norm)) == pytest.approx(float(grad_norms(params)[0]), rel=1e-5)
    before = [p.grad.clone() for p in params]
    assert not bool(clipper.clip_(params, torch.tensor(math.nan), torch.tensor(False)))
    assert all(torch.equal(a, p.grad) for a, p in zip(before, params))
    with pytest.raises(ValueError, match="clip.max_norm"):
        GradClipper(0.0)


def test_precision_resolution_and_refusals():
    cpu = torch.device("cpu")
    assert PrecisionPolicy("auto", cpu).mode == "fp32"
    assert PrecisionPolicy("bf16", cpu).scaler is None
    with pytest.raises(ValueError, match="expected auto, fp32, bf16 or fp16"):
        PrecisionPolicy("fp8", cpu)
    p = PrecisionPolicy("bf16", cpu)
    with p.autocast():
        y = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert y.dtype == torch.bfloat16
    p.load_state_dict(p.state_dict())
    with pytest.raises(ValueError, match="saved with mode"):
        p.load_state_dict({"mode": "fp32", "scaler": None})


def test_schedule_shape_and_state_roundtrip():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0, fused=True)
    s = LRSchedule(opt, warmup_steps=4, max_steps=12, decay="cosine", min_lr_ratio=0.1)
    seen = []
    for _ in range(12):
        seen.append(float(s.lr()))
        s.step(torch.tensor(True))
    assert seen[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert seen[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)), rel=1e-6)
    s2 = LRSchedule(torch.optim.AdamW(model.parameters(), lr=1.0, fused=True), 4, 12)
    s2.load_state_dict(s.state_dict())
    assert float(s2.lr()) == float(s.lr())
    with pytest.raises(ValueError, match="sched.decay"):
        LRSchedule(opt, 1, 2, decay="linear")
