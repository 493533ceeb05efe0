"""The guard in the loop: planted faults end in the right events, incidents, stops, rollbacks and checkpoints."""

import json
import math
import random
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from helpers import PoisonAt, cfg, nan_sample_task, regression_task
from multiproc import env as child_env
from remedy_tasks import fp16_stall_task

from stabletrain import Trainer
from stabletrain.cli import main
from stabletrain.config import GuardConfig
from stabletrain.data import EpochOrder
from stabletrain.policies.guard import Guard, spike_test
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.report import load_run

BAD = 37  # the dataset index holding a NaN in nan_sample_task


def _events(run_dir):
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def _step_of_sample(index, n=64, batch=8, seed=0):
    batches = EpochOrder(n, batch, seed).micro_batches(0)
    return next(i + 1 for i, b in enumerate(batches) if index in b)


def _trainer(run_dir, *overrides, task=None):
    torch.manual_seed(0)
    c = cfg("train.batch_size=8", "train.max_steps=8", "log.every=2", "ckpt.every=2", *overrides)
    return Trainer(c, task=task or nan_sample_task(BAD), run_dir=run_dir)


@pytest.mark.slow
def test_nan_sample_is_skipped_captured_and_diagnosed_down_to_the_dataset_index(tmp_path):
    bad_step = _step_of_sample(BAD)
    trainer = _trainer(tmp_path / "run")
    trainer.fit()
    assert trainer.step == 8 and trainer.stop_reason is None
    events = _events(tmp_path / "run")
    assert [e["step"] for e in events if e["kind"] == "skip"] == [bad_step]
    incident = next(e for e in events if e["kind"] == "incident")
    assert incident["step"] == bad_step
    d = incident["diagnosis"]
    assert d["bad_samples"] == [BAD] and d["stage"] == "inputs" and d["reproduces"] is True
    assert d["module"] == "0" and d["op"] == "aten.addmm.default" and d["direction"] == "forward" and d["origin"] is False
    bundle_dir = Path(incident["path"])
    assert (bundle_dir / "bundle.pt").exists() and (bundle_dir / "diagnosis.json").exists()
    # The same diagnosis from a fresh process, as a user runs it.
    (tmp_path / "run" / "config.yaml").write_text((tmp_path / "run" / "config.yaml").read_text().replace(
        "task: mlp", "task: helpers:nan_sample_task"))
    bundle = torch.load(bundle_dir / "bundle.pt", weights_only=True)
    bundle["config"]["task"] = "helpers:nan_sample_task"
    torch.save(bundle, bundle_dir / "bundle.pt")
    res = subprocess.run([sys.executable, "-m", "stabletrain", "diagnose", str(bundle_dir), "--json"], capture_output=True,
                         text=True, env=child_env(), timeout=300)
    assert res.returncode == 0, res.stderr
    fresh = json.loads(res.stdout)
    assert fresh["step"] == bad_step and fresh["bad_samples"] == [BAD] and fresh["rank"] == 0
    # Every checkpoint is finite; the skipped step left no trace in the parameters.
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_stop_policy_writes_no_checkpoint_after_the_incident_and_resume_continues_from_the_last_good(tmp_path):
    bad_step = _step_of_sample(BAD)
    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir, "guard.on_nonfinite=stop")
    trainer.fit()
    assert trainer.stop_reason and f"step {bad_step}" in trainer.stop_reason
    saved = [e["step"] for e in _events(run_dir) if e["kind"] == "checkpoint"]
    assert saved and max(saved) < bad_step
    last_good = CheckpointManager(run_dir / "checkpoints").load().meta["step"]
    assert last_good == max(saved)
    resumed = Trainer(trainer.cfg, task=nan_sample_task(BAD), run_dir=run_dir, resume=True)
    assert resumed.step == last_good
    resumed.fit()  # the same data reproduces the same incident, and it stops again at the same step
    assert resumed.stop_reason and f"step {bad_step}" in resumed.stop_reason
    assert max(e["step"] for e in _events(run_dir) if e["kind"] == "checkpoint") == last_good


def test_rollback_restores_last_good_and_skips_the_offending_window(tmp_path, capsys):
    bad_step = _step_of_sample(BAD)
    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir, "guard.on_nonfinite=rollback")
    trainer.fit()
    said = [line for line in capsys.readouterr().out.splitlines() if "rolled back" in line]
    assert len(said) == 1 and said[0].startswith("stabletrain: ") and (
        f"never training on the data of step {bad_step} again (data windows [(0, {bad_step - 1})]: (epoch, the number "
        "of the window's first micro-batch in that epoch))" in said[0])
    assert trainer.step == 8 and trainer.stop_reason is None
    events = _events(run_dir)
    rollback = next(e for e in events if e["kind"] == "rollback")
    assert rollback["to_step"] < bad_step <= rollback["from_step"]
    assert rollback["skipped_windows"] == [[0, bad_step - 1]]
    assert (0, bad_step - 1) in trainer.stream.skip
    # After the rollback, training never saw the NaN sample again and ended finite.
    assert [e["step"] for e in events if e["kind"] == "skip"] == [bad_step]
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
    assert trainer.history[-1]["num_rollbacks"] == 1
    # metrics.jsonl holds each step once (the stretch trained again); the rolled-back lines are kept aside
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    aside = [json.loads(x)["step"] for x in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 8 and aside and min(aside) > rollback["to_step"]
    assert rollback["superseded_metrics"] == len(aside)
    assert {json.loads(x)["superseded_by"] for x in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()} == {
        "rollback"}  # (the report draws a rollback's lines faded; a resume's repeats are not drawn)
    assert [r["step"] for r in load_run(run_dir).abandoned] == aside


def test_a_rollbacks_skipped_window_and_count_outlive_a_resume_from_a_checkpoint_before_it(tmp_path):
    """A restart (or a resume) from a checkpoint written before a rollback: the window the rollback skipped stays
    skipped, and the rollback counts toward guard.max_rollbacks (else the run trains into it and rolls back again)."""
    bad_step = _step_of_sample(BAD)
    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir, "guard.on_nonfinite=rollback", "ckpt.keep=10")
    trainer.fit()
    rollback = next(e for e in _events(run_dir) if e["kind"] == "rollback")
    ckpt = CheckpointManager(run_dir / "checkpoints")
    for path in sorted(ckpt.checkpoints(), reverse=True):  # as if killed before a checkpoint after the rollback was written
        if int(path.name.removeprefix("step_")) > rollback["to_step"]:
            ckpt.set_aside(path, folder="later")
    resumed = Trainer(trainer.cfg, task=nan_sample_task(BAD), run_dir=run_dir, resume=True)
    assert resumed.step == rollback["to_step"] and (0, bad_step - 1) in resumed.stream.skip
    assert resumed.guard.num_rollbacks == 1
    resumed.fit()
    assert [e["kind"] for e in _events(run_dir)].count("rollback") == 1 and resumed.stop_reason is None
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())


def test_a_run_that_ends_on_a_skipped_step_checkpoints_it_and_a_resume_continues_from_there(tmp_path):
    """A skipped step leaves the pre-step state, which is healthy: the last save is not withheld."""
    bad_step = _step_of_sample(BAD)
    assert bad_step > 2
    run_dir = tmp_path / "run"
    trainer = _trainer(run_dir, f"train.max_steps={bad_step}", "ckpt.every=100")
    trainer.fit()
    assert trainer.step == bad_step and trainer.stop_reason is None
    events = _events(run_dir)
    assert [e["step"] for e in events if e["kind"] == "skip"] == [bad_step]
    assert not [e for e in events if e["kind"] == "checkpoint_withheld"]
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [0, bad_step]
    last_good = CheckpointManager(run_dir / "checkpoints").load()
    assert last_good.meta["step"] == bad_step
    assert (run_dir / "checkpoints" / "LAST_GOOD").read_text().strip() == f"step_{bad_step:06d}"
    for name, p in trainer.module.state_dict().items():
        assert torch.equal(last_good.state["model"][name], p), name
    c = cfg("train.batch_size=8", f"train.max_steps={bad_step + 3}", "log.every=2", "ckpt.every=100")
    resumed = Trainer(c, task=nan_sample_task(BAD), run_dir=run_dir, resume=True)
    assert resumed.step == bad_step
    resumed.fit()
    assert resumed.step == bad_step + 3 and resumed.stop_reason is None
    assert CheckpointManager(run_dir / "checkpoints").load().meta["step"] == bad_step + 3
    assert [e["step"] for e in _events(run_dir) if e["kind"] == "skip"] == [bad_step]  # not replayed


def test_an_lr_that_breaks_the_parameters_in_the_update_is_caught_after_the_update(tmp_path, capsys):
    run_dir = tmp_path / "run"
    torch.manual_seed(0)
    # 3.4e38 is just below float32's max: the lr is finite, the update overflows the parameters.
    trainer = Trainer(cfg("optim.lr=3.4e38", "sched.warmup_steps=0", "train.max_steps=6", "log.every=2", "ckpt.every=2",
                          "train.batch_size=8"), task=regression_task(), run_dir=run_dir)
    trainer.fit()
    events = _events(run_dir)
    # The parameters are checked once per interval (step 2, where the loss is NaN too); the capture's replay
    # pins the update of step 1 that broke them.
    checked = [e for e in events if e["kind"] == "nonfinite" and e["step"] == 2]
    assert checked and "loss" in checked[0]["reason"]
    pinned = next(e for e in events if e["kind"] == "nonfinite" and e.get("after_update"))
    assert pinned["step"] == 1 and pinned["pinned_by_replay"] is True and math.isfinite(pinned["loss"])
    assert "a skip cannot make non-finite parameters finite again" in trainer.stop_reason and "at step 1" in trainer.stop_reason
    incident = next(e for e in events if e["kind"] == "incident")
    assert incident["step"] == 1 and incident["after_update"] is True
    # the interval's other non-finite step, said with the capture the replay pinned (a trial: 'at step 1 ... step 2's')
    assert ("1 more non-finite step in the interval to step 2, at step 2: not captured (one capture per interval: "
            "step 1's; events.jsonl)") in capsys.readouterr().out
    assert incident["diagnosis"]["stage"] == "update"
    # The state after step 1 is never checkpointed: LAST_GOOD stays at step 0.
    assert [e["step"] for e in events if e["kind"] == "checkpoint"] == [0]
    assert CheckpointManager(run_dir / "checkpoints").load().meta["step"] == 0


def test_no_good_state_means_no_capture_and_says_why(tmp_path):
    run_dir = tmp_path / "run"
    torch.manual_seed(0)
    # Replaying from LAST_GOOD (capture.memory_snapshot=false): there is none. (The interval's in-memory snapshot
    # would replay from the step-0 state, its inf weight included: it is never persisted, only replayed.)
    task = regression_task()
    with torch.no_grad():
        task.model[0].weight[0, 0] = float("inf")  # (a model loaded broken; optim.lr=1e39 did it before config refused it)
    trainer = Trainer(cfg("sched.warmup_steps=0", "train.max_steps=4", "log.every=2", "train.batch_size=8",
                          "capture.memory_snapshot=false", "log.init_signal=false"), task=task, run_dir=run_dir)
    trainer.fit()
    events = _events(run_dir)
    withheld = [e for e in events if e["kind"] == "checkpoint_withheld"]
    assert withheld and "0.weight" in withheld[0]["reason"], withheld  # not even the step-0 state is checkpointed
    incident = next(e for e in events if e["kind"] == "incident")
    assert "not captured: no good state to replay from" in incident["reason"]
    assert not (run_dir / "incidents").exists()


def test_spike_rule_events_and_on_device_skip(tmp_path):
    torch.manual_seed(0)
    task = regression_task(n=512)
    task.model = PoisonAt(task.model, {30}, 40.0)  # one forward 40x off: a loss spike at step 30
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("train.batch_size=8", "train.max_steps=40", "log.every=10", "guard.on_spike=skip",
                          "guard.spike_window=20", "optim.lr=0.003"), task=task, run_dir=run_dir)
    trainer.fit()
    events = _events(run_dir)
    assert [e["step"] for e in events if e["kind"] == "spike"] == [30]
    assert [e["step"] for e in events if e["kind"] == "skip"] == [30]
    assert "spike" in next(e for e in events if e["kind"] == "skip")["reason"]
    assert float(trainer.schedule.applied_steps) == 39
    assert sum(r["num_spikes"] for r in trainer.history) == 1


def test_consecutive_skips_stop_the_run_with_a_clear_reason(tmp_path):
    torch.manual_seed(0)
    task = regression_task()
    task.model = PoisonAt(task.model, set(range(3, 100)))  # NaN from step 3 on: the run cannot recover
    trainer = Trainer(cfg("train.batch_size=8", "train.max_steps=50", "log.every=5", "guard.max_consecutive_skips=6"),
                      task=task, run_dir=tmp_path / "run")
    trainer.fit()
    assert trainer.step == 10 and "6 consecutive skipped steps" in trainer.stop_reason
    assert next(e for e in _events(tmp_path / "run") if e["kind"] == "stop")["step"] == 10


def test_guard_state_roundtrip_and_spike_rule_numbers():
    g = Guard(GuardConfig(spike_window=8, on_spike="skip"), torch.device("cpu"))
    flags = [g.observe(torch.tensor(v), torch.tensor(1.0)) for v in [1.0, 1.1, 0.9, 1.0, 1.05, 0.95, 1.0]]
    assert not any(bool(s) for _, _, s in flags)
    ok, finite, spike = g.observe(torch.tensor(5.0), torch.tensor(1.0))
    assert bool(spike) and not bool(ok) and bool(finite)  # on_spike=skip: decided on the device, skipped
    ok, finite, spike = g.observe(torch.tensor(1.0), torch.tensor(float("nan")))
    assert not bool(ok) and not bool(finite) and not bool(spike)
    clone = Guard(GuardConfig(spike_window=8, on_spike="skip"), torch.device("cpu"))
    clone.load_state_dict(g.state_dict())
    assert torch.equal(clone.window.nan_to_num(-1), g.window.nan_to_num(-1)) and int(clone.num_seen) == 7
    with pytest.raises(KeyError, match="window"):
        Guard(GuardConfig(spike_window=8), torch.device("cpu")).load_state_dict({})


def _rows(values, finite):
    return [SimpleNamespace(step=i + 1, values={"loss": v, "finite": 1.0 if f else 0.0, "spike": 0.0})
            for i, (v, f) in enumerate(zip(values, finite))]


@pytest.mark.parametrize("window", [8, 50])
def test_the_host_spike_rule_flags_exactly_the_steps_the_device_rule_does(window):
    """on_spike=warn runs the rule on the host at the boundary; it must agree with the device rule step for step."""
    gen = torch.Generator().manual_seed(window)
    n = 400
    losses = (2.0 + 0.1 * torch.randn(n, generator=gen)).tolist()
    for i in range(30, n, 37):
        losses[i] *= 4.0  # planted spikes
    for i in range(50, n, 61):
        losses[i] = float("nan")
    finite = [math.isfinite(v) and i % 97 != 5 for i, v in enumerate(losses)]  # some finite losses with a bad norm
    device = Guard(GuardConfig(spike_window=window, on_spike="skip"), torch.device("cpu"))
    on_device = [bool(device.observe(torch.tensor(v), torch.tensor(1.0 if f else float("inf")))[2])
                 for v, f in zip(losses, finite)]
    host = Guard(GuardConfig(spike_window=window, on_spike="warn"), torch.device("cpu"))
    assert not host.on_device and not bool(host.observe(torch.tensor(9.0), torch.tensor(1.0))[2])
    rows = _rows(losses, finite)
    for i in range(0, n, 10):  # interval by interval, as at log boundaries
        host.mark_spikes(rows[i:i + 10])
    on_host = [r.values["spike"] > 0.5 for r in rows]
    assert sum(on_device) >= 5 and on_host == on_device
    assert torch.equal(host.window.nan_to_num(-1), device.window.nan_to_num(-1))
    assert int(host.num_seen) == int(device.num_seen)
    clone = Guard(GuardConfig(spike_window=window), torch.device("cpu"))  # a resumed run goes on with the same window
    clone.load_state_dict(host.state_dict())
    more = _rows([2.0, 9.0], [True, True])
    clone.mark_spikes(more)
    assert [r.values["spike"] for r in more] == [0.0, 1.0]


def _device_and_host(losses, window=50, every=10):
    """The same losses through the device rule (on_spike=skip, step by step) and the host rule (warn, ``every`` rows an
    interval): the steps flagged, after asserting both flag the same steps and end with the same window and count."""
    device = Guard(GuardConfig(spike_window=window, on_spike="skip"), torch.device("cpu"))
    on_device = [bool(device.observe(torch.tensor(v), torch.tensor(1.0))[2]) for v in losses]
    host = Guard(GuardConfig(spike_window=window, on_spike="warn"), torch.device("cpu"))
    rows = _rows(losses, [True] * len(losses))
    for i in range(0, len(rows), every):
        host.mark_spikes(rows[i:i + every])
    assert [r.values["spike"] > 0.5 for r in rows] == on_device
    assert torch.equal(host.window.nan_to_num(-1), device.window.nan_to_num(-1)) and int(host.num_seen) == int(device.num_seen)
    return [i + 1 for i, s in enumerate(on_device) if s], host


@pytest.mark.parametrize("first", [[6.0, 6e4], [6e4, 6.0]])
def test_an_outlier_before_the_rule_arms_does_not_blind_it_to_the_same_loss_later(first):
    """A trial: a corrupted sample at step 2 (x6e3, before the rule arms) was kept in the window; its largest loss lifted
    the early bound (spike_ratio^2 x the largest) and the deviation, so the same corruption at step 19 passed unflagged
    (under on_spike=skip, applied). Step 2's is now left out of the window; on step 1, where no loss precedes it, it stays
    but bounds nothing (early_largest). Device and host agree, step for step and window for window."""
    gen = random.Random(len(str(first)))
    losses = [*first, *[6.0 - 0.05 * i + 0.1 * gen.random() for i in range(2, 40)]]
    losses[18] = 6.25e4  # step 19
    flagged, host = _device_and_host(losses)
    assert flagged == [19]
    kept = host.window[~host.window.isnan()]
    assert (float(kept.max()) > 1e4) is (first[0] > 1e4) and int(host.num_seen) == len(losses) - 2 + (first[0] > 1e4)
    window = [x for i, x in enumerate(losses[:18]) if x < 1e4 or i == 0]  # the window step 19 was judged against
    assert spike_test(losses[18], window, host.cfg)["spike"]


@pytest.mark.parametrize("window", [6, 50])
def test_a_run_that_settles_far_above_its_first_loss_still_arms_the_rule(window):
    """A review: with the early outlier left out of the window for good, a run whose first loss was small (0.01) and the
    rest at ~0.5 (50x) was all 'outliers' (the window held one loss): the rule never armed and a x100 spike at step 151
    passed, on the device and on the host. Outliers are held uncounted; armed_at of them in a row are a new level and
    all count (a review after that: two corrupted steps in a row, each counted against the one held before it, lifted
    the early bound again; they are held and cleared by the next ordinary loss)."""
    losses = [0.01, *[0.5 + 0.001 * i for i in range(1, 200)]]
    losses[150] *= 100
    flagged, host = _device_and_host(losses, window, every=7)
    assert flagged == [151] and int(host.num_seen) == len(losses) - 1  # (the spike at step 151 alone)
    # a corrupted pair (steps 2 and 3) is no level: held, then cleared by step 4; the same corruption at 19 is a spike
    pair = [6.0, 6e3, 5e3, *[6.0 - 0.05 * i for i in range(3, 40)]]
    pair[18] = 6.25e3
    flagged, host = _device_and_host(pair, window, every=7)
    assert flagged == [19] and float(host.window.nan_to_num(0).max()) < 10 and int(host.num_seen) == len(pair) - 3


@pytest.mark.parametrize("scale,spikes", [(1e3, [29, 59]), (1e22, [])])
def test_the_host_spike_rule_agrees_with_the_device_past_float32_silently(scale, spikes):
    """Losses near 1e22 with 1% noise: the window's squared deviations (~1e40) overflow float32 on both sides,
    so the std is inf and a x3 step is no spike there (under the robust arm's x4), as at 1e3 it is one. The host rule
    says nothing about the overflow (numpy's RuntimeWarning came from stabletrain in diverging runs)."""
    losses = [scale * (1.0 + 0.01 * math.sin(i)) * (3.0 if i % 30 == 29 else 1.0) for i in range(60)]
    device = Guard(GuardConfig(spike_window=8, on_spike="skip"), torch.device("cpu"))
    on_device = [bool(device.observe(torch.tensor(v), torch.tensor(1.0))[2]) for v in losses]
    host = Guard(GuardConfig(spike_window=8, on_spike="warn"), torch.device("cpu"))
    rows = _rows(losses, [True] * len(losses))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(0, len(rows), 10):
            host.mark_spikes(rows[i:i + 10])
    assert [r.values["spike"] > 0.5 for r in rows] == on_device
    assert [i for i, s in enumerate(on_device) if s] == spikes


@pytest.mark.parametrize("loss,spike", [(0.3, True), (0.1, False)])
def test_a_spike_hidden_by_the_bad_steps_before_it_is_flagged_by_its_robust_z(loss, spike):
    """A new user's HF Trainer run under gradient accumulation: bad rows the rule had let pass (x8 the median each) sat in
    its window, their deviation hid the next ones (z 3.6 for a loss x10 the median) and none of 15 was flagged. Past 4x
    the median a robust z-score five times spike_zscore flags it (61 here), on the host and on the device alike; under
    4x (x3.3) the plain z alone judges, as before."""
    gen = torch.Generator().manual_seed(0)
    window = (0.03 + 0.004 * torch.randn(50, generator=gen)).tolist()
    for i in (5, 13, 21, 29, 37, 45):
        window[i] = 0.25  # the passed ones
    host = spike_test(loss, window, GuardConfig())
    assert host["zscore"] < 6 and host["spike"] is spike, host
    assert (host["robust_zscore"] > 30) is spike and (host["ratio"] > 4) is spike, host
    device = Guard(GuardConfig(on_spike="skip"), torch.device("cpu"))
    device.window.copy_(torch.tensor(window))
    device.num_seen.fill_(len(window))
    assert bool(device.observe(torch.tensor(loss), torch.tensor(1.0))[2]) is spike


def test_decide_pins_the_range_of_updates_a_failed_parameter_check_covers():
    g = Guard(GuardConfig(), torch.device("cpu"))
    nan = float("nan")

    def row(step, finite=1.0, params=nan):
        return SimpleNamespace(step=step, values={"finite": finite, "params_finite": params, "applied": finite, "loss": 1.0})

    d = g.decide([row(11), row(12), row(13, finite=0.0), row(14, finite=0.0, params=0.0)])
    assert d.first_incident == 13 and not d.after_update and d.locate == (11, 14) and d.action == "stop"
    d.pin(12)
    assert d.first_incident == 12 and d.after_update and d.bad_steps == [12, 13, 14]
    assert "after the update at step 12" in d.reason and "cannot make non-finite parameters finite again" in d.reason
    d = g.decide([row(21), row(22, params=1.0), row(23), row(24, params=0.0)])
    assert d.first_incident == 24 and d.after_update and d.locate == (23, 24)
    assert "after an update of steps 23-24" in d.reason
    d = g.decide([row(31, params=1.0), row(32, params=0.0)])  # checked every step (the adapters): exact
    assert d.first_incident == 32 and d.after_update and d.locate is None
    stop = Guard(GuardConfig(on_nonfinite="stop"), torch.device("cpu")).decide([row(41), row(42, params=0.0)])
    stop.pin(41)  # the reason follows the pinned step under any policy
    assert stop.action == "stop" and stop.reason == "non-finite value in the parameters after the update at step 41"


def _unused_inf_feature_task():
    """The regression task with a fifth feature the model never reads, inf at sample ``BAD``: the loss stays finite."""
    from torch import nn
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    task = regression_task(n=64)
    x, y = task.train_data.tensors
    x = torch.cat([x, torch.zeros(64, 1)], dim=1)
    x[BAD, 4] = float("inf")  # an unused feature: the loss stays finite
    task.train_data = TensorDataset(x, y)
    inner = task.model
    task.model = nn.Sequential()
    task.model.add_module("body", inner)
    task.model.forward = lambda inp: inner(inp[:, :4])
    return task


def test_check_inputs_catches_a_bad_input_the_loss_never_sees(tmp_path):
    task = _unused_inf_feature_task()
    bad_step = _step_of_sample(BAD)
    for check, expected in (("false", []), ("true", [bad_step])):
        trainer = Trainer(cfg("train.batch_size=8", "train.max_steps=8", "log.every=4", f"guard.check_inputs={check}",
                              "capture.diagnose=false"), task=task, run_dir=tmp_path / check)
        trainer.fit()
        assert [e["step"] for e in _events(tmp_path / check) if e["kind"] == "skip"] == expected


def test_an_incident_guard_check_inputs_flagged_is_diagnosed_as_the_data_not_the_check(tmp_path):
    """The replay traced the guard's own isfinite ('first used by aten.abs.default outside any module'); an input no op
    reads was 'not reproducible' (the run's loss non-finite by the check, the replay's finite)."""
    from helpers import nan_sample_task

    trainer = Trainer(cfg("train.batch_size=8", "train.max_steps=8", "log.every=4", "guard.check_inputs=true"),
                      task=nan_sample_task(BAD), run_dir=tmp_path / "used")
    trainer.fit()
    [d] = [e["diagnosis"] for e in _events(tmp_path / "used") if e["kind"] == "incident"]
    assert (d["stage"], d["op"], d["module"], d["bad_samples"], d["reproduces"]) == (
        "inputs", "aten.addmm.default", "0", [BAD], True), d
    task = _unused_inf_feature_task()
    Trainer(cfg("train.batch_size=8", "train.max_steps=8", "log.every=4", "guard.check_inputs=true"), task=task,
            run_dir=tmp_path / "unused").fit()
    [d] = [e["diagnosis"] for e in _events(tmp_path / "unused") if e["kind"] == "incident"]
    assert (d["failure_class"], d["bad_samples"], d["reproduces"]) == ("data", [BAD], True), d
    assert d["summary"].endswith("no op of the model reads it (its loss stays finite): guard.check_inputs flagged the step")


def _stall_rows(pattern, grad_norm, start=1, scale=1.0):
    """Rows of steps ``start``.. with ``applied`` from ``pattern`` (1 applied, 0 skipped) and this grad norm when applied."""
    return [SimpleNamespace(step=start + i, ranks=[], values={"loss": 1.0, "finite": 1.0, "applied": float(a),
                                                            "grad_norm": grad_norm if a else float("inf"),
                                                            "loss_scale": scale})
            for i, a in enumerate(pattern)]


def test_a_run_is_stalled_when_no_update_of_the_last_steps_moved_the_parameters():
    nine_of_ten = [0] * 9 + [1]
    for pattern, norm, stalled in (
            (nine_of_ten * 2, 0.0, True),       # the fp16 collapse: 9 of 10 skipped, the tenth a zero gradient
            (nine_of_ten * 2, 0.3, False),      # a GradScaler still calibrating: its applied steps move the parameters
            ([1] * 20, 0.0, True),              # every step applied with a zero gradient
            (nine_of_ten, 0.0, False)):         # fewer than guard.stall_steps (20) steps seen
        g = Guard(GuardConfig(on_stall="stop"), torch.device("cpu"))
        d = g.decide(_stall_rows(pattern, norm, scale=3.6e-12))
        assert (d.action == "stop" and "stalled" in d.reason) is stalled, (pattern, norm, d.reason)
    d = Guard(GuardConfig(), torch.device("cpu"), remedy=True).decide(_stall_rows(nine_of_ten * 2, 0.0, scale=3.6e-12))
    assert d.reason == ("the run is stalled at step 20: 18 of the last 20 steps were skipped and the 2 applied had a zero "
                        "gradient; the GradScaler's scale is 3.6e-12: no gradient reached the parameters (guard.stall_steps="
                        "20). Try precision=bf16 (no loss scale), the overflowing module in fp32 (where stabletrain "
                        "diagnose names one), or guard.on_nonfinite=remedy; guard.on_stall=warn trains on")
    # the skips' loss itself non-finite (a trial's regression whose output outgrew float16): the scale fell for nothing
    rows = _stall_rows(nine_of_ten * 2, 0.0, scale=1.9e-6)
    for r in rows:
        if not r.values["applied"]:
            r.values.update(loss=float("inf"), finite=0.0, overflow=1.0)
    d = Guard(GuardConfig(), torch.device("cpu"), remedy=True).decide(rows)
    assert ("had a zero gradient; the GradScaler's scale is 1.9e-06, fallen for nothing (18 of the 18 skipped steps' loss "
            "itself is non-finite in float16, an overflow in the forward, an invalid op or bad inputs, which no loss scale "
            "makes finite): no gradient reached the parameters") in d.reason, d.reason
    # (a review) most of them: said, not 'for nothing' (the others' back-off was the scaler's job); half: not said; a
    # checkpoint from before the loss was kept: nothing recorded, nothing said
    for lost, said in ((12, "; the GradScaler's scale is 1.9e-06 (12 of the 18 skipped steps' loss itself is non-finite"),
                       (9, None)):
        rows = _stall_rows(nine_of_ten * 2, 0.0, scale=1.9e-6)
        for r in [r for r in rows if not r.values["applied"]][:lost]:
            r.values.update(loss=float("inf"), finite=0.0, overflow=1.0)
        d = Guard(GuardConfig(), torch.device("cpu"), remedy=True).decide(rows)
        assert (said in d.reason) if said else "loss itself" not in d.reason, d.reason
    old = Guard(GuardConfig(on_stall="stop"), torch.device("cpu"))
    old.load_state_dict({**old.state_dict(), "recent": [[False, float("inf"), 1.9e-6]] * 19})
    d = old.decide(_stall_rows([1], 0.0, start=20, scale=1.9e-6))
    assert d.action == "stop" and "loss itself" not in d.reason, d.reason
    # an adapter's guard (remedy=False: Monitor refuses on_nonfinite="remedy") names the remedy search it can run instead
    d = Guard(GuardConfig(), torch.device("cpu")).decide(_stall_rows(nine_of_ten * 2, 0.0, scale=3.6e-12))
    assert d.reason.endswith("(where stabletrain diagnose names one), or stabletrain remedy on the incident where one was "
                             "captured (its cures, verified); guard.on_stall=warn trains on") and "on_nonfinite" not in d.reason
    warn = Guard(GuardConfig(on_stall="warn"), torch.device("cpu"))
    first, again = warn.decide(_stall_rows(nine_of_ten * 2, 0.0)), warn.decide(_stall_rows(nine_of_ten, 0.0, start=21))
    assert first.action == "continue" and first.stall.startswith("the run is stalled at step 20") and again.stall is None
    clone = Guard(GuardConfig(on_stall="stop"), torch.device("cpu"))  # the recent steps travel in checkpoints
    clone.load_state_dict(Guard(GuardConfig(on_stall="stop"), torch.device("cpu")).state_dict())
    clone.load_state_dict({**clone.state_dict(), "recent": [[False, float("inf"), 1.0]] * 19})
    assert clone.decide(_stall_rows([1], 0.0, start=20)).action == "stop"


def test_a_loss_of_zero_is_convergence_and_every_step_skipped_at_a_dead_scale_is_a_stall():
    """A hinge loss whose margins are all met: loss and gradients exactly 0 on every step; it stopped as 'stalled ...
    Try precision=bf16' at a healthy scale, its trained weights never saved. And with guard.max_consecutive_skips raised
    past them, 400 steps all skipped at a scale of 0 ended 'trained 400 steps', exit 0; at the default limit its stop
    gave no advice."""
    converged = [SimpleNamespace(**{**vars(r), "values": {**r.values, "loss": 0.0}})
                 for r in _stall_rows([1] * 20, 0.0, scale=1.6e4)]
    assert Guard(GuardConfig(on_stall="stop"), torch.device("cpu")).decide(converged).action == "continue"
    raised = Guard(GuardConfig(on_stall="stop", max_consecutive_skips=1000), torch.device("cpu"))
    d = raised.decide(_stall_rows([0] * 20, 0.0, scale=0.0))
    assert d.action == "stop" and d.reason.startswith("the run is stalled at step 20: all of the last 20 steps were "
                                                      "skipped; the GradScaler's scale is 0: no gradient reached"), d.reason
    assert Guard(GuardConfig(max_consecutive_skips=1000), torch.device("cpu")).decide(  # a healthy scale: the limit's
        _stall_rows([0] * 20, 0.0, scale=2.0**10)).action == "continue"
    d = Guard(GuardConfig(), torch.device("cpu"), remedy=True).decide(_stall_rows([0] * 20, 0.0, scale=7e-18))
    # (it said 'it cannot recover': a loss x1e6 recovered at a scale of 2^-6, two halvings past the default limit)
    assert d.action == "stop" and d.reason.endswith(
        ": the run is not recovering; the GradScaler's scale is 7e-18: the gradients overflow float16 even unscaled (a "
        "lower scale may fit them: guard.max_consecutive_skips higher lets it back off further, a skipped step each time). "
        "Try precision=bf16 (no loss scale), the overflowing module in fp32 (where stabletrain diagnose names one), or "
        "guard.on_nonfinite=remedy"), d.reason
    forward = [SimpleNamespace(**{**vars(r), "values": {**r.values, "loss": math.inf, "finite": 0.0}})
               for r in _stall_rows([0] * 20, 0.0, scale=7e-18)]
    d = Guard(GuardConfig(), torch.device("cpu")).decide(forward)  # (an adapter's: the advice it can follow)
    assert "; the loss itself is non-finite in float16 (an overflow in the forward, or an invalid op) and the " \
           "GradScaler's scale is 7e-18: no loss scale makes it finite. Try precision=bf16" in d.reason, d.reason
    assert d.reason.endswith(", or stabletrain remedy on the incident where one was captured (its cures, verified)"), d.reason


def test_zero_gradients_at_a_healthy_fp16_scale_are_said_to_underflow_not_to_overflow():
    """A loss x1e-14 under fp16: every applied gradient 0 at a scale of 65536; the stall said 'Try ... the overflowing
    module in fp32', of a run where nothing overflowed."""
    d = Guard(GuardConfig(on_stall="stop"), torch.device("cpu")).decide(_stall_rows([1] * 20, 0.0, scale=65536.0))
    assert d.action == "stop" and "the GradScaler's scale is 6.6e+04: in float16 the gradients underflow to 0" in d.reason
    assert "overflowing" not in d.reason and "precision=bf16 (float32's range, no loss scale)" in d.reason, d.reason


def test_a_collapsed_scale_with_tiny_applied_gradients_is_a_stall_and_a_healthy_one_is_not():
    """Issue 33 item 4: the applied gradients of a collapsed GradScaler can underflow to a tiny remainder, not exactly 0
    (an fp32 term of the loss): at a scale below 1, with most steps skipped and every applied grad norm at most 1e-3 x
    the run's earlier ones, the run is stalled too. Not when the scale is healthy, nor when the gradients still count,
    nor when fewer than half of the steps were skipped, nor with no earlier grad norm to compare with."""
    nine_of_ten, healthy = [0] * 9 + [1], _stall_rows([1] * 10, 2.6, scale=128.0)  # steps 1-10 at scale 128

    def decide(pattern, norm, scale, before=healthy):
        g = Guard(GuardConfig(on_stall="stop"), torch.device("cpu"), remedy=True)
        g.decide(before)
        return g, g.decide(_stall_rows(pattern, norm, start=len(before) + 1, scale=scale))

    _, d = decide(nine_of_ten * 2, 9.5e-6, 3.6e-12)
    assert d.action == "stop" and d.reason == (
        "the run is stalled at step 30: 18 of the last 20 steps were skipped and the 2 applied had gradient norms of at "
        "most 9.5e-06, under 0.001 x the run's earlier 2.6 (they underflowed at the loss scale); the GradScaler's scale "
        "is 3.6e-12: no gradient reached the parameters measurably (guard.stall_steps=20). Try precision=bf16 (no loss "
        "scale), the overflowing module in fp32 (where stabletrain diagnose names one), or guard.on_nonfinite=remedy; "
        "guard.on_stall=warn trains on")
    for pattern, norm, scale, before in (
            (nine_of_ten * 2, 9.5e-6, 2.0**14, healthy),   # a healthy scale: small gradients are the run's own
            (nine_of_ten * 2, 9.5e-6, 1.0, healthy),       # fp32 (scale 1): the rule is fp16's
            (nine_of_ten * 2, 0.01, 3.6e-12, healthy),     # 0.4% of the earlier norms: the updates still count
            ([0, 1] * 10, 9.5e-6, 3.6e-12, healthy),       # half the steps applied: not "most steps skipped"
            (nine_of_ten * 2, 9.5e-6, 3.6e-12, [])):       # no earlier grad norm to compare with
        _, d = decide(pattern, norm, scale, before)
        assert d.action == "continue" and d.stall is None, (pattern, norm, scale, d.reason)
    g, _ = decide(nine_of_ten, 9.5e-6, 3.6e-12)  # the earlier norms travel in checkpoints
    clone = Guard(GuardConfig(on_stall="stop"), torch.device("cpu"))
    clone.load_state_dict(g.state_dict())
    assert clone.state_dict()["norm_reference"] == [2.6] * 10
    assert clone.decide(_stall_rows(nine_of_ten, 9.5e-6, start=21, scale=3.6e-12)).action == "stop"


def _tiny_remainder_loss(model, batch):
    x, y = batch
    # A small fp32 penalty: its gradient is all that survives the fp16 path's underflow at a collapsed scale.
    return F.mse_loss(model(x).float(), y) + 1e-4 * model.layers[1].bias.float().square().sum()


@pytest.mark.slow
def test_an_fp16_run_whose_applied_gradients_underflowed_to_a_tiny_remainder_stops(tmp_path):
    """fp16_stall_task with a small fp32 term in its loss: at the collapsed scale the applied steps' grad norms are
    ~1e-5, not 0 (the old rule, "every applied gradient exactly 0", missed it and the run trained 100 steps)."""
    task = fp16_stall_task()
    task.loss = _tiny_remainder_loss
    c = cfg("precision=fp16", "train.batch_size=8", "train.max_steps=100", "log.every=10", "data.shuffle=false",
            "capture.incidents=false")
    Trainer(c, task=task, run_dir=tmp_path / "run").fit()  # (fp16 on CPU warns once a process: not asserted here)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] == 60 and 0 < rows[-1]["grad_norm"] < 1e-4 and rows[0]["grad_norm"] > 1  # tiny, not 0
    stop = next(e for e in _events(tmp_path / "run") if e["kind"] == "stop")
    assert stop["step"] == 60 and "the run is stalled at step 60: 18 of the last 20 steps were skipped and the 2 " \
        "applied had gradient norms of at most 9.5e-06, under 0.001 x the run's earlier 2.6" in stop["reason"]


@pytest.mark.slow
def test_an_fp16_run_whose_scaler_collapsed_stops_instead_of_reporting_success(tmp_path, capsys):
    """The issue's case: 9 of 10 steps of each interval skipped (the float16 forward overflows), the tenth applied
    with a gradient that underflowed to 0 under a scale of 1e-12: the parameters never move after step 40, and the
    run printed 'trained 100 steps' and exited 0. Now it stops at the first boundary that sees it, saying what to do;
    with guard.on_stall=warn it trains on, and its last line says how many steps were skipped."""
    args = ["train", "task=remedy_tasks:fp16_stall_task", "precision=fp16", "train.batch_size=8", "train.max_steps=100",
            "log.every=10", "data.shuffle=false", "capture.incidents=false", "log.progress=false", "log.tensorboard=false"]
    assert main([*args, f"run.dir={tmp_path / 'stop'}"]) == 5  # (a final exit: not restarted)
    err = capsys.readouterr().err
    assert "the run stopped early: the run is stalled at step 60: 18 of the last 20 steps were skipped" in err
    assert "Try precision=bf16" in err
    assert f"See {tmp_path / 'stop' / 'events.jsonl'}\n" in err  # (no capture: it pointed at an incidents folder it had not made)
    assert main([*args, f"run.dir={tmp_path / 'end'}", "train.max_steps=60"]) == 5  # the stop at the last boundary
    assert "the run stopped at its last step: the run is stalled at step 60" in capsys.readouterr().err
    assert main([*args, f"run.dir={tmp_path / 'warn'}", "guard.on_stall=warn"]) == 0
    out = capsys.readouterr()
    assert out.err.count("stabletrain: warning: the run is stalled at step 60") == 1
    assert "; training on (guard.on_stall=warn)" in out.err and "guard.on_stall=warn trains on" not in out.err  # (a trial)
    assert "trained 100 steps; loss=" in out.out and "; 90 of 100 steps skipped (90%: see events.jsonl)" in out.out


def test_the_final_line_counts_skips_a_rollback_went_back_past_apart(tmp_path, capsys):
    """guard.on_nonfinite=rollback: the NaN step's skip was rolled back past and that stretch trained again; the final
    line says no step is skipped, and that one was before the rollback (it said '1 of 8 steps skipped', and a resume
    of the same run then 'no step skipped')."""
    from stabletrain.cli import main

    run_dir = tmp_path / "run"
    args = ["task=helpers:nan_sample_task", "train.batch_size=8", "data.shuffle=false", "log.every=2", "ckpt.every=2",
            "capture.incidents=false", "log.progress=false", "log.tensorboard=false", "guard.on_nonfinite=rollback"]
    assert main(["train", *args, "train.max_steps=8", f"run.dir={run_dir}"]) == 0
    out = capsys.readouterr().out
    assert ("; no step skipped (1 before a rollback went back past it: trained again); rolled back once (events.jsonl); "
            "run directory") in out, out


def test_the_final_line_counts_the_steps_an_earlier_launch_skipped(tmp_path, capsys):
    """A run resumed after a skipped step ends with a line that says so (it said 'no step skipped': this launch's)."""
    from stabletrain.cli import main

    run_dir = tmp_path / "run"
    args = ["task=helpers:nan_sample_task", "train.batch_size=8", "data.shuffle=false", "log.every=4", "ckpt.every=4",
            "capture.incidents=false", "log.progress=false", "log.tensorboard=false"]
    assert main(["train", *args, "train.max_steps=8", f"run.dir={run_dir}"]) == 0  # sample 37: step 5
    assert "trained 8 steps; " in (out := capsys.readouterr().out) and "; 1 of 8 steps skipped" in out
    assert main(["train", "--resume", str(run_dir), "train.max_steps=12"]) == 0
    out = capsys.readouterr().out
    assert "trained 12 steps; " in out and "; 1 of 12 steps skipped (8%: see events.jsonl)" in out, out
    record = {name: (run_dir / name).read_text() for name in ("config.yaml", "events.jsonl", "metrics.jsonl")}
    for steps in (12, 10):  # at or past train.max_steps: nothing to train, said so (it said 'trained 12 steps; ; ...')
        assert main(["train", "--resume", str(run_dir), f"train.max_steps={steps}"]) == 0
        out = capsys.readouterr().out
        assert f"stabletrain: nothing to train: the run is at step 12 and train.max_steps={steps} (raise " in out, out
        assert "trained" not in out and "schedule" not in out, out
        # and the run's record as it was (it rewrote config.yaml to max_steps 10 and added resume and schedule_changed
        # events: the report then said 'Reached step 12 of 10')
        assert {name: (run_dir / name).read_text() for name in record} == record
    # precision=fp32 spelled out where the run said auto (fp32 on a CPU): the one precision the resume takes, so a
    # finished run all the same (the finished check compared the configs without the resume's auto rule: rewritten)
    assert main(["train", "--resume", str(run_dir), "train.max_steps=12", "precision=fp32"]) == 0
    assert "stabletrain: nothing to train: the run is at step 12" in capsys.readouterr().out
    assert {name: (run_dir / name).read_text() for name in record} == record


def test_a_huge_loss_after_a_fast_fall_is_a_spike_that_the_windows_deviation_hid_on_every_side():
    """A loss that fell from 2 to 6e-5 over the window's 50 steps: the early losses make its deviation ~0.5, so a loss
    of 2.3 (x4e4 the median) had a z-score of 4 and was no spike. Past spike_ratio ** 5 (32x) times the median the
    robust z-score (median, MAD) decides too; the device rule, the host's interval rule and spike_test agree, and
    ordinary noise on the same fall (x2) is still none."""
    fall = [2.0 * (3e-5 ** (i / 49)) for i in range(50)]
    cfg = GuardConfig(spike_window=50, on_spike="skip")
    before = spike_test(2.33, fall, cfg)
    assert before["spike"] and before["zscore"] < cfg.spike_zscore < before["robust_zscore"], before
    assert not spike_test(2.0 * fall[-1], fall, cfg)["spike"]
    for loss, want in ((2.33, True), (2.0 * fall[-1], False), (20 * fall[-1], False)):
        verdicts, _ = _three_rules(fall, loss)
        assert verdicts == (want,) * 3, loss


def _three_rules(window, loss, spike_window=50):
    """((the device rule, the host's interval rule, spike_test) on ``loss`` after ``window``, whether the host rule
    flagged any of the window's own losses)."""
    cfg = GuardConfig(spike_window=spike_window, on_spike="skip")
    device = Guard(cfg, torch.device("cpu"))
    for v in window:
        device.observe(torch.tensor(v), torch.tensor(1.0))
    host = Guard(GuardConfig(spike_window=spike_window, on_spike="warn"), torch.device("cpu"))
    rows = _rows([*window, loss], [True] * (len(window) + 1))
    host.mark_spikes(rows)
    on_device = bool(device.observe(torch.tensor(loss), torch.tensor(1.0))[2])
    verdicts = (on_device, rows[-1].values["spike"] > 0.5, spike_test(loss, window, cfg)["spike"])
    return verdicts, any(r.values["spike"] > 0.5 for r in rows[:-1])


def test_a_window_whose_median_is_zero_or_below_makes_no_far_spike():
    """A hinge loss is 0 on most steps (an NLL can be negative): '32x the median' then holds for any loss, and a MAD of
    0 made every positive loss a robust-z spike (1182 of 3000 healthy hinge draws). The far path needs a positive
    median; the ordinary z-score still decides, on every side alike."""
    hinge = [0.0 if i % 3 else 0.05 + 0.001 * i for i in range(50)]  # two thirds 0: median 0, MAD 0
    verdicts, window_flagged = _three_rules(hinge, 0.1)
    assert not window_flagged  # the window itself is all in the rule's window
    assert verdicts == (False,) * 3, hinge
    cfg = GuardConfig(spike_window=50)
    assert spike_test(0.1, hinge, cfg)["robust_zscore"] > cfg.spike_zscore  # the far path alone would have fired


def test_fp16_overflows_are_not_hidden_behind_no_non_finite_steps_in_the_report(tmp_path):
    """A loss x1e6 under fp16: its gradients overflow until the GradScaler backs off below 1 (the loss stays finite).
    The report said 'No non-finite losses or grad norms' beside every grad norm NaN: the overflows are named."""
    from stabletrain import Trainer
    from stabletrain.report import health_summary, load_run

    task = regression_task()
    loss = task.loss
    task.loss = lambda model, batch: loss(model, batch) * 1e6
    Trainer(cfg("precision=fp16", "train.max_steps=30", "log.every=10", "guard.max_consecutive_skips=40",
                "guard.on_stall=warn", "capture.incidents=false"), task=task, run_dir=tmp_path / "run").fit()
    text = health_summary(load_run(tmp_path / "run")).text
    skipped = [e for e in _events(tmp_path / "run") if e["kind"] == "skip"]
    assert skipped and all("fp16 overflow" in e["reason"] for e in skipped)
    # each with its norm: NaN is an overflow's too (inf - inf), and a bad sample's at any scale (a trial): not "overflow" alone
    assert all(e["reason"].endswith(("fp16 overflow (grad norm inf; GradScaler backs off the loss scale)",
                                     "fp16 overflow or NaN (grad norm nan; GradScaler backs off the loss scale)"))
               for e in skipped), {e["reason"] for e in skipped}
    assert f"No non-finite losses or grad norms besides {len(skipped)} fp16 overflows (skipped, above)." in text, text


def test_a_routine_overflow_counts_toward_the_skip_limit_only_where_it_held_the_scale():
    """A GradScaler backing off from 2**60 (every overflow halves the scale) is no run that is not recovering: 40 skips
    in a row go on. Overflows that leave the scale where it was (our skip where the scaler saw none: finite gradients of
    ~1e20 whose norm overflows; a scale held) are: without counting them such a run skipped forever."""
    def rows(scales):
        return [SimpleNamespace(step=i + 1, ranks=[], values={"loss": 1.0, "finite": 0.0, "applied": 0.0, "overflow": 1.0,
                                                              "grad_norm": math.inf, "loss_scale": s})
                for i, s in enumerate(scales)]

    backing_off = Guard(GuardConfig(), torch.device("cpu"))
    d = backing_off.decide(rows([2.0 ** (59 - i) for i in range(40)]))
    assert d.action == "continue" and backing_off.consecutive_skips == 0 and not d.bad_steps
    held = Guard(GuardConfig(), torch.device("cpu"))
    d = held.decide(rows([65536.0] * 25))
    assert d.action == "stop" and d.reason.startswith("20 consecutive skipped steps (guard.max_consecutive_skips=20) at "
                                                      "step 21"), d.reason
    # the guard reads at the log boundary (step 25): the line says the run went on to it (a trial: 'at step 85' beside
    # a stop event and 25 skip events at step 90)
    assert d.reason.endswith(" (the run went on to its log boundary, step 25: 24 skipped in a row by then)"), d.reason
    # one step applied after the limit, then 2 more skips (a review: read as if the first run of skips went on)
    again = Guard(GuardConfig(), torch.device("cpu"))
    steps = rows([65536.0] * 25)
    steps[21].values.update(finite=1.0, applied=1.0, overflow=0.0, grad_norm=1.0)
    d = again.decide(steps)
    assert d.reason.endswith(" (the run went on to its log boundary, step 25: it applied a step again before it, then "
                             "skipped 3 more)"), d.reason
    clone = Guard(GuardConfig(), torch.device("cpu"))  # the last scale travels in checkpoints
    clone.load_state_dict(backing_off.state_dict())
    assert clone.last_scale == 2.0 ** 20 and clone.decide(rows([2.0 ** 20] * 2)).action == "continue"
    assert clone.consecutive_skips == 2


def test_a_checkpoint_after_a_run_of_skipped_steps_is_withheld_and_last_good_stays_before_it(tmp_path):
    """A student's trial: an SGD run diverged (every step from 17 on non-finite, skipped) and each save went on moving
    LAST_GOOD (-> step_000020, -> step_000030): a resume continued from the diverged state, the good one pruned (the
    chapter's 'overwriting a good checkpoint after an anomaly'). A save whose last steps were all skipped is withheld;
    one skipped step alone (a bad sample's) is not: the state is the last applied step's."""
    from helpers import nan_samples_task

    from stabletrain import Trainer
    from stabletrain.records.checkpoint.manager import CheckpointManager

    run_dir = tmp_path / "run"  # samples 64..: steps 9-16 non-finite (batch 8); sample 5: step 1 alone
    Trainer(cfg("train.batch_size=8", "train.max_steps=16", "log.every=4", "ckpt.every=4", "ckpt.keep=1",
                "data.shuffle=false", "capture.incidents=false", "guard.max_consecutive_skips=100"),
            task=nan_samples_task([5, *range(64, 128)], n=128), run_dir=run_dir).fit()
    ckpt = CheckpointManager(run_dir / "checkpoints")
    # step 12's withheld; the run's last save (step 16) is not: a finished run must read as finished (run.resume=auto,
    # --resume); and the one before the skips, step 8's, is kept past ckpt.keep=1 (a review: pruning deleted it)
    assert [d.name for d in sorted(ckpt.checkpoints())] == ["step_000008", "step_000016"]
    assert ckpt.latest_good().name == "step_000016"
    withheld = [e for e in _events(run_dir) if e["kind"] == "checkpoint_withheld"]
    assert [(e["step"], e["skipped_in_a_row"]) for e in withheld] == [(12, 4)]
    assert withheld[0]["reason"] == ("checkpoint at step 12 withheld: its last 4 steps were skipped, none applied since: "
                                     "the run is not known to have recovered; LAST_GOOD stays at step_000008")


def test_a_grad_scaler_calibrating_down_through_1_is_no_stall():
    """A new user's trial: gradients that overflow fp16 until the scale is below 1 (a finite loss x1e6): 16 routine
    back-offs from 2**16, then 4 below 1, and the stall rule stopped the run at step 20 ('all of the last 20 steps were
    skipped; the GradScaler's scale is 0.062'), though at 0.0078 it trains on. All skipped counts as a stall only where
    every one of them was at a collapsed scale."""
    calibrating = [2.0 ** (15 - i) for i in range(20)]  # 32768 .. 0.0625, each step skipped
    rows = [SimpleNamespace(step=i + 1, ranks=[], values={"loss": 1.0, "finite": 1.0, "applied": 0.0, "overflow": 1.0,
                                                          "grad_norm": math.inf, "loss_scale": s})
            for i, s in enumerate(calibrating)]
    d = Guard(GuardConfig(on_stall="stop"), torch.device("cpu")).decide(rows)
    assert d.action == "continue" and d.stall is None, (d.action, d.reason)


def test_check_inputs_reads_a_mapping_batch_and_keeps_a_flag_across_micro_batches(tmp_path):
    """A review: inputs_finite walked real dicts only (a UserDict batch, as a Hugging Face BatchEncoding, passed unseen;
    move_to left its tensors where they were), and a later micro-batch with no float tensor overwrote an earlier one's
    flag with None: an inf in micro-batch 1 of a window went unflagged."""
    from collections import UserDict

    from torch import nn
    from torch.utils.data import Dataset

    from stabletrain import Task
    from stabletrain.data import move_to
    from stabletrain.policies.guard import inputs_finite

    class Encoding(UserDict):
        pass

    batch = Encoding(x=torch.tensor([1.0, float("inf")]), ids=torch.tensor([1, 2]))
    assert not bool(inputs_finite(batch)) and bool(inputs_finite(Encoding(x=torch.ones(2))))
    moved = move_to(batch, torch.device("meta"))
    assert type(moved) is Encoding and moved["x"].is_meta and moved["ids"].is_meta
    from transformers import BatchEncoding  # its other attributes kept (a review: rebuilt from a dict, n_sequences lost)

    encoding = BatchEncoding({"input_ids": torch.tensor([[1, 2]])}, n_sequences=2)
    moved = move_to(encoding, torch.device("meta"))
    assert type(moved) is BatchEncoding and moved.n_sequences == 2 and moved["input_ids"].is_meta
    assert not encoding["input_ids"].is_meta  # the user's batch as it was

    class Mixed(Dataset):  # items 0-3 float (item 1's unused feature inf), 4-7 integers only
        def __len__(self):
            return 8

        def __getitem__(self, i):
            x = torch.tensor([float(i), float("inf") if i == 1 else 0.0])
            return (x, torch.tensor([float(i)])) if i < 4 else (x[:1].long().repeat(2), torch.tensor([i]))

    torch.manual_seed(0)
    lin = nn.Linear(1, 1)
    task = Task(model=lin, train_data=Mixed(), name="mixed",  # (a (sum, count) pair: the window takes the flag at its end)
                loss=lambda m, b: ((m(b[0][:, :1].float()) - b[1].float()).pow(2).sum(), len(b[1])))
    Trainer(cfg("train.batch_size=4", "accum.steps=2", "train.max_steps=2", "log.every=2", "guard.check_inputs=true",
                "data.shuffle=false", "capture.diagnose=false"), task=task, run_dir=tmp_path / "run").fit()
    assert [e["step"] for e in _events(tmp_path / "run") if e["kind"] == "skip"] == [1, 2]  # the window of items 0-7


def test_a_rollback_drops_the_few_samples_an_op_incident_named(tmp_path):
    """A trial: a log of one sample's 0 (class op, the sample named) met that sample again each epoch; every rollback
    skipped its window only, until guard.max_rollbacks stopped the run. The few samples an op incident names are dropped
    as a data incident's are; one that most of the window's samples reach is not theirs (not dropped)."""
    from remedy_tasks import sqrt_zero_task

    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("train.batch_size=8", "train.max_steps=12", "log.every=2", "ckpt.every=2", "data.shuffle=false",
                          "guard.on_nonfinite=rollback"), task=sqrt_zero_task(), run_dir=run_dir)
    trainer.fit()  # sample 13: steps 2, 6 and 10 (4 windows an epoch)
    events = _events(run_dir)
    (incident,) = [e for e in events if e["kind"] == "incident"]
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    assert incident["diagnosis"]["failure_class"] == "op" and incident["diagnosis"]["bad_samples"] == [13]
    assert len(rollbacks) == 1 and rollbacks[0]["dropped_samples"] == [13], rollbacks
    assert trainer.step == 12 and trainer.state.stop_reason is None


def test_a_skipped_steps_nan_input_does_not_leave_batchnorm_statistics_non_finite(tmp_path, capsys):
    """A new user's BatchNorm MLP with one NaN input (sample 37: step 5 at batch 8): the step was skipped, but its forward
    had written NaN into the running statistics; the validation loss was NaN for good and every checkpoint after it was
    withheld ('model.bn.running_mean is not finite'), while the run reported a success. They were reset (and said); now
    the skipped step leaves no trace in them: put back as they were before it, no reset needed."""
    from torch import nn
    from torch.utils.data import TensorDataset

    task = nan_sample_task()
    task.model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
    task.val_data = TensorDataset(*[t[:16].clone() for t in regression_task().train_data.tensors])
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("train.batch_size=8", "data.shuffle=false", "train.max_steps=10", "log.every=5", "ckpt.every=5",
                          "eval.every=10", "capture.incidents=false"), task=task, run_dir=run_dir)
    trainer.fit()
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "skip"] == [5] and not [e for e in events if e["kind"] == "buffers_reset"]
    assert "running statistics" not in capsys.readouterr().err
    bn = trainer.module[1]
    assert bool(bn.running_mean.isfinite().all()) and bool(bn.running_var.isfinite().all())
    assert math.isfinite(trainer.history[-1]["val_loss"])
    assert (run_dir / "checkpoints" / "LAST_GOOD").read_text().strip() == "step_000010"
    assert not [e for e in events if e["kind"] == "checkpoint_withheld"], [e["reason"] for e in events]


class _Tally(torch.nn.Module):
    """Adds up its inputs into a buffer of its own (no running statistics to reset): a NaN input poisons it for good."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("total", torch.zeros(()))

    def forward(self, x):
        self.total += x.detach().sum()
        return x


def test_a_buffer_a_skipped_step_left_non_finite_is_not_reset_but_its_withheld_checkpoint_is_said(tmp_path, capsys):
    """A buffer that is no running statistics (the model's own: a causal mask may hold -inf by design) is never judged
    or reset; the checkpoints withheld for it ('model.0.total is not finite') were in events.jsonl only: the first is
    said on the console."""
    from torch import nn

    task = nan_sample_task()
    task.model = nn.Sequential(_Tally(), nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "data.shuffle=false", "train.max_steps=15", "log.every=5", "ckpt.every=5",
                "capture.incidents=false"), task=task, run_dir=run_dir).fit()
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "skip"] == [5, 13]  # (sample 37 again in the second epoch)
    assert not [e for e in events if e["kind"] == "buffers_reset"]
    assert [e["step"] for e in events if e["kind"] == "checkpoint_withheld"] == [5, 10, 15]
    err = capsys.readouterr().err
    assert err.count("withheld: model.0.total is not finite (NaN/Inf)") == 1 and "running statistics" not in err, err


def test_a_stops_advice_names_the_keys_and_the_lr_in_the_users_own_terms():
    """The stop after a diverging run of spike skips said 'lower the LR (optim.lr)' and 'guard.on_spike=warn' to users of
    an adapter, who set neither (a review): each host's own terms, the built-in loop's config keys."""

    def note(**kw):
        guard = Guard(GuardConfig(), torch.device("cpu"), **kw)
        guard.spike_skips = guard.consecutive_skips = 20
        guard.spike_class = (61, "state")
        drifted = guard._level_note(78)
        guard.spike_class = None
        return drifted, guard._level_note(78)

    drifted, level = note(host="transformers")
    assert "lower the LR (TrainingArguments.learning_rate)" in drifted and "on_spike=warn trains on" in level
    assert "guard." not in drifted + level
    assert "lower the LR (optim.lr)" in note(lr_key="optim.lr")[0] and "guard.on_spike=warn trains on" in note()[1]
    assert "(the lr configure_optimizers gives the optimizer)" in note(host="lightning")[0]


def test_an_adapters_stall_and_fp16_advice_name_no_key_it_cannot_set():
    """A review: under an adapter the stall said 'guard.stall_steps=20 ... guard.on_stall=warn trains on' and the fp16
    stop 'guard.max_consecutive_skips higher': none of them an option of Monitor, Lightning's or the HF callback."""
    from stabletrain.policies.stall import StallWatch, scale_note

    def stall(remedy):
        watch = StallWatch(20, remedy=remedy, keys=remedy)
        for i in range(20):
            watch.record(i % 10 == 0, 0.0, 1.0, 0.5)
        return watch.stalled(20)

    assert stall(True).endswith("(guard.stall_steps=20). Try a look at the skip events and the loss (is it constant?), or "
                                "guard.on_nonfinite=remedy; guard.on_stall=warn trains on"), stall(True)
    adapter = stall(False)
    assert adapter.endswith("(the last 20 steps). Try a look at the skip events and the loss (is it constant?), or "
                            "stabletrain remedy on the incident where one was captured (its cures, verified)"), adapter
    assert "guard.max_consecutive_skips higher" in scale_note(0.5, 1.0, True)
    assert "guard." not in scale_note(0.5, 1.0, False, keys=False)
    assert "max_consecutive_skips higher" in scale_note(0.5, 1.0, False, keys=False)
    monitor = Guard(GuardConfig(stall_steps=20), torch.device("cpu"), host="monitor")  # (what an adapter's guard says)
    assert monitor.stall.keys is False and Guard(GuardConfig(), torch.device("cpu")).stall.keys is True


@pytest.mark.parametrize("anomaly", ["spike", "nan"])
def test_a_skipped_step_leaves_no_trace_in_a_batchnorms_running_statistics(tmp_path, anomaly):
    """A trial's CNN: a spike skipped under guard.on_spike=skip (or remedy) still moved its BatchNorm's running statistics
    (running_var x70), and the 'cured' model classified at 50% in eval mode; a NaN batch skipped would leave NaN in
    them. The statistics are kept before the window's forwards and put back, on the device, where its update is skipped:
    after the skipped step they are the step before's, bitwise (three images x100 at step 91; or one NaN image)."""
    from spike_tasks import batchnorm_scaled_task

    def stats(steps):
        task = batchnorm_scaled_task()
        if anomaly == "nan":
            task.train_data.tensors[0][720] = float("nan")
        run = Trainer(cfg("train.batch_size=8", "data.shuffle=false", "log.every=10", f"train.max_steps={steps}",
                          "optim.lr=0.003", "guard.on_spike=skip", "sched.warmup_steps=0", "sched.decay=constant",
                          "capture.incidents=false", "ckpt.every=0"), task=task, run_dir=tmp_path / f"{anomaly}{steps}")
        run.fit()
        return {k: v for k, v in run.model.state_dict().items() if "running" in k or "num_batches" in k}, run

    before, _ = stats(90)
    after, run = stats(91)
    skips = [e for e in _events(tmp_path / f"{anomaly}91") if e["kind"] == "skip"]
    assert [e["step"] for e in skips] == [91], skips
    assert all(torch.equal(after[k], before[k]) for k in before), {k: (before[k], after[k]) for k in before}


def test_the_running_statistics_a_skip_puts_back_are_read_from_the_modules_each_step():
    """A review: the statistics were found once, so a load with assign=True (new tensors on the modules) left the skip
    writing into the old ones (NaN stayed), and a LazyBatchNorm failed the step's construction. They are read from the
    modules before each window's forwards; a lazy one before its first forward is left out."""
    from stabletrain.policies.precision import PrecisionPolicy
    from stabletrain.step import TrainStep

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    step = TrainStep(model, opt, PrecisionPolicy("fp32", torch.device("cpu")), guard=Guard(GuardConfig(), torch.device("cpu")))
    loss = lambda m, b: F.mse_loss(m(b[0]), b[1])  # noqa: E731
    step([(8, (torch.randn(8, 4), torch.randn(8, 1)))], loss)  # a healthy step: applied, the statistics move
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    model.load_state_dict(state, assign=True)  # new tensors on the modules
    bad = torch.randn(8, 4)
    bad[3] = float("nan")
    out = step([(8, (bad, torch.randn(8, 1)))], loss)
    assert not bool(out["applied"]) and torch.equal(model[1].running_mean, state["1.running_mean"])
    assert torch.equal(model[1].running_var, state["1.running_var"]), model[1].running_var
    lazy = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LazyBatchNorm1d(affine=False), torch.nn.Linear(8, 1))
    lazy_step = TrainStep(lazy, torch.optim.AdamW(lazy.parameters(), lr=1e-2, fused=True),
                          PrecisionPolicy("fp32", torch.device("cpu")))
    assert bool(lazy_step([(8, (torch.randn(8, 4), torch.randn(8, 1)))], loss)["applied"])
