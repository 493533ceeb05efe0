"""A spike window is weighed against ordinary windows under the same older state, or against what truly stands for them.

A new-user trial (an LR x60 inside SGD at step 55, every window a spike from then on) read 'data: the whole window is high
under the state of step 0 too (0.5397 vs 0.2158, the rule's median) ... the data moved to a new level': the window under
the untrained weights of step 0 against the run's trained level. These runs (tests/spike_tasks.py: lr_jump_task) and the
pure rules behind them (stabletrain.diagnostics.spike: ordinary_stand_in, classify_spike) pin what may stand for ordinary
windows there, and what the evidence says when nothing does.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import cfg
from spike_tasks import lr_jump_task, one_step_jump_task, scaled_rows_classifier_task

from stabletrain import Trainer
from stabletrain.diagnostics.spike import classify_spike
from stabletrain.records.jsonl import read_jsonl
from stabletrain.records.snapshot import IntervalSnapshot
from stabletrain.services.capture import IncidentCapture

RUN = ("train.batch_size=16", "log.every=10", "sched.warmup_steps=5", "sched.decay=constant")


def _diagnosis(run_dir, step):
    return json.loads((run_dir / "incidents" / f"step_{step:06d}" / "diagnosis.json").read_text())


def test_a_divergence_weighed_only_under_step_0s_weights_is_no_data_spike(tmp_path):
    """The trial's run: the capture at step 61 (its interval's first, every window near it flagged since step 56) had only
    the step-0 checkpoint as its older state, older than the 50 losses of its full rule window (it was 'data ... the data
    moved to a new level', then 'the updates since step 0 raised this window's loss x3.01'). A checkpoint out of the
    rule window's reach is no older state now (a DDP trial's data spike on an interval's first step was called state
    against step 0's weights): the spike is the state's, by the update of step 60 that grew x61 at the same LR."""
    run_dir = tmp_path / "run"
    Trainer(cfg(*RUN, "train.max_steps=70"), task=lr_jump_task(), run_dir=run_dir).fit()
    d = _diagnosis(run_dir, 61)
    assert d["reproduces"] and d["failure_class"] == "state", d["summary"]
    assert "level_shift" not in d and "new level" not in d["evidence"] and "outlier" not in d["evidence"], d["evidence"]
    # (the reach: the rule window's 50 losses before the flagged steps 56-60, and the state before the oldest of them)
    assert d["older"] is None and d["observed"]["reference_out_of_reach"] == {"step": 0, "reach": 56}
    assert d["evidence"].startswith("the model or optimizer state drifted (a divergence onset, or an LR too high); the "
                                    "update of step 60 (its interval's measured one) was x61 the run's before it at the "
                                    "same LR"), d["evidence"]
    assert "step 0" not in d["evidence"] and "LR rose" not in d["evidence"], d["evidence"]


def test_a_divergence_under_skip_names_its_step_growth_and_labels_the_rules_median(tmp_path):
    """The count in the optimizer's state (a replay sees the x60), guard.on_spike=skip: steps 59-78 all spike, and the
    capture at step 71 has no ordinary window and only step 0's weights. It read 'ordinary windows are at 0.2158 under
    this one (vs 0.2158)' (the rule's median for both, unsaid) and 'the LR rose x5 since step 0' (the warmup) while the
    x60 in the optimizer that steps 59 and 61 named was gone: now the median is labelled, the LR is the run's at step 50,
    and the spike's own step says how far the optimizer's steps grew (the older state is step 50's now: see below)."""
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg(*RUN, "train.max_steps=80", "guard.on_spike=skip"), task=lr_jump_task(in_state=True),
                      run_dir=run_dir)
    trainer.fit()
    # the stop's advice names what sets the LR here: the task's own optimizer (optim.lr does nothing for it)
    assert "a divergence, not a new level: lower the LR (the lr of the task's own optimizer)" in trainer.state.stop_reason
    d = _diagnosis(run_dir, 71)
    assert d["reproduces"] and d["failure_class"] == "state", d["summary"]
    assert "under this one (vs" not in d["evidence"] and "LR rose" not in d["evidence"], d["evidence"]
    assert ("the optimizer's steps grew x59.9 at the same LR: update/weight 0.4 on the spike's own window (no ordinary one "
            "at hand: its gradient counts too) under this state against 0.0066 in the run's intervals up to step 50"
            ) in d["evidence"], d["evidence"]
    assert "the rule's median, the run's level before it, stands for ordinary windows under this state (0.2158)" in (
        d["evidence"])
    # (the older state is step 50's own now, held from before the flagged steps: its LR is step 50's, no record's since)
    assert d["steps"]["own"] is True and d["older"]["step"] == 50 and d["older"]["lr"] == {"then": 0.05, "now": 0.05}
    # with ordinary windows at hand (step 59's capture) the growth is measured on them, as before
    assert "update/weight 0.4 on ordinary windows under this state" in _diagnosis(run_dir, 59)["evidence"]


def test_what_stands_for_ordinary_windows_under_an_older_state():
    """Only a loss the run itself had under that very state, the rule's median for a trained state from before the
    flagged steps, or an earlier capture among them that found its whole batch high; nothing for step 0's weights."""
    from stabletrain.diagnostics.spike import ordinary_stand_in

    full, median = [0.2] * 50, 0.2158
    # the trial: step 0's checkpoint, flagged since 56, a full rule window: nothing stands for them
    assert ordinary_stand_in(0, 56, full, {"step": 56, "class": "not reproducible"}, median, False) == (None, None)
    # a rule window that holds every loss since step 1 (a run flagged from step 30 on): step 1's loss was step 0's
    early = [0.93, *[0.3] * 28]
    assert ordinary_stand_in(0, 30, early, {}, 0.276, True) == ("step", 0.93)
    assert ordinary_stand_in(12, 30, early, {}, 0.276, True) == ("step", 0.3)
    assert ordinary_stand_in(0, 31, early, {}, 0.276, True) == (None, None)  # a loss left out: no entry is step 1's
    # a trained state from before the flagged steps, within the rule window's reach: its median
    assert ordinary_stand_in(50, 56, full, {}, median, False) == ("median", median)
    assert ordinary_stand_in(55, 56, full, {}, median, False) == (None, None)  # its own step's loss was flagged
    assert ordinary_stand_in(2, 56, full, {}, median, False) == (None, None)  # older than anything the window holds
    # a state among the flagged steps: an earlier capture among them that found its whole batch high (data, no sample)
    data = {"step": 31, "class": "data", "samples": []}
    assert ordinary_stand_in(30, 30, early, data, 0.74, True) == ("capture", None)
    assert ordinary_stand_in(30, 30, early, data, 0.74, False) == (None, None)  # the window rose x2+ since that state
    assert ordinary_stand_in(30, 30, early, {**data, "samples": [3]}, 0.74, True) == (None, None)
    assert ordinary_stand_in(30, 30, early, {**data, "step": 29}, 0.74, True) == (None, None)  # before these flagged steps


def test_an_unweighed_window_is_never_a_data_spike_and_a_weighed_one_says_against_what():
    base = {"reproduces": True, "loss": 1.627, "precision": "fp32", "step": 61, "samples": None, "surges": [], "where": {},
            "jumps": {}}
    unweighed = {"step": 0, "window": 0.5397, "ordinary": None, "current_ordinary": 0.2158, "ordinary_from": None,
                 "window_high": False, "ordinary_high": False, "ratio": 2.0, "no_context": True}
    out = classify_spike({**base, "older": unweighed})
    assert out["failure_class"] == "state" and "no ordinary window at hand to weigh it against there" in out["evidence"]
    # a few samples that carry it name no data spike where the window was not weighed, and say why
    samples = {"indices": [3, 7], "share": 0.8, "without": {"loss": 0.3, "ratio": 1.2}}
    named = classify_spike({**base, "older": unweighed, "samples": samples})
    assert named["failure_class"] == "state" and named["blamed_samples"] is None
    assert "but the window is weighed against no ordinary window under the older state" in named["evidence"]
    # the run's own loss at step 1 under step 0's weights: a data spike, said against what
    step = {**unweighed, "window": 10.61, "ordinary": 0.9292, "ordinary_from": "step", "ordinary_step": 1,
            "window_high": True}
    out = classify_spike({**base, "loss": 9.615, "older": step})
    assert out["failure_class"] == "data", out
    assert ("the whole window is high under the state of step 0 too (10.61 vs 0.9292, the run's own loss at step 1, under "
            "that state)") in out["evidence"], out["evidence"]
    capture = {**unweighed, "step": 30, "window": 10.74, "ordinary_from": "capture", "ordinary_step": 31, "window_high": True}
    out = classify_spike({**base, "loss": 10.49, "older": capture})
    assert out["failure_class"] == "data" and ("(10.74, no ordinary window at hand: the capture at step 31, in this run of "
                                               "flagged steps, found its whole batch high under an older state)"
                                               ) in out["evidence"], out["evidence"]


def test_a_window_under_the_rules_ratio_of_unsettled_ordinary_windows_is_not_called_no_higher():
    """A trial's 'the window is no higher than ordinary windows under the state of step 50 (5.079 vs 3.763)': 35% higher.
    The test was the rule's ratio: the evidence says so."""
    older = {"step": 50, "window": 5.079, "ordinary": 3.763, "current_ordinary": 11.47, "window_high": False,
             "ordinary_high": True, "ordinary_then_high": True, "ordinary_spike_now": True, "window_not_above_now": True,
             "ratio": 2.0, "lr": None}
    out = classify_spike({"reproduces": True, "loss": 12.0, "precision": "fp32", "step": 59, "samples": None, "surges": [],
                          "where": {}, "jumps": {}, "older": older})
    assert "no higher" not in out["evidence"], out["evidence"]
    assert ("the window is not x2 (guard.spike_ratio) above ordinary windows under the state of step 50 (5.079 vs 3.763, "
            "themselves a spike by the guard's rule there)") in out["evidence"], out["evidence"]


def test_a_divergence_under_skip_is_weighed_under_the_state_from_before_its_flagged_steps(tmp_path):
    """A user's run (guard.on_spike=skip, the divergence from step 56): by step 71 every update since step 58 was skipped,
    so the interval's starts at steps 60 and 70 are the spike's own state. Its older state was step 0's untrained
    checkpoint ('the window's loss is 0.3913 under the state of step 0, with no ordinary window at hand'); now it is the
    snapshot of step 50, held from the interval in which the flagged steps began: the window is normal there."""
    run_dir = tmp_path / "run"
    Trainer(cfg(*RUN, "train.max_steps=100", "guard.on_spike=skip"), task=lr_jump_task(in_state=True),
            run_dir=run_dir).fit()
    d = _diagnosis(run_dir, 71)
    older = d["older"]
    assert d["reproduces"] and d["failure_class"] == "state", d["summary"]
    assert (older["step"], older["from"], older["ordinary_from"], older["window_high"]) == (50, "snapshot", "median", False)
    assert "the window is normal under the state of step 50 (0.2027 vs 0.2158, the rule's median" in d["evidence"], (
        d["evidence"])
    assert "step 0" not in d["evidence"], d["evidence"]


def test_a_run_without_flagged_steps_holds_no_snapshot(tmp_path, monkeypatch):
    """The snapshot from before a run of flagged steps costs a healthy run nothing: no boundary holds one."""
    held = []
    monkeypatch.setattr(IntervalSnapshot, "hold", lambda self: held.append(self.step))
    trainer = Trainer(cfg(*RUN, "train.max_steps=40"), task=lr_jump_task(at=1000), run_dir=tmp_path / "run")
    trainer.fit()
    assert trainer.state.guard.num_spikes == 0 and held == [] and trainer.recorder.engine.snapshot.held is None


def test_the_snapshot_before_a_run_of_flagged_steps_is_held_while_it_lasts():
    """Held at the boundary that ends the interval in which the run began, kept bitwise while the next snapshots take
    their turns (one more state in host memory), let go at the first boundary whose step is not flagged."""
    capture = IncidentCapture(source=None)
    snap = capture.snapshot
    snap.keep_previous = True  # (the recorder sets both where the host's memory budget allows two and three states)
    snap.may_hold = True

    def take(step: int) -> None:
        snap.clear()
        snap.take(None, {"w": torch.full((4,), float(step))}, step)

    take(50)
    capture._hold_before_run(50, [])  # nothing flagged: nothing held, no buffer more
    assert snap.held is None and snap.num_bytes == 16
    capture._hold_before_run(60, [56, 57, 59, 60])  # the run since step 59 began after step 50's snapshot
    take(60)
    capture._hold_before_run(70, [56, 57, *range(59, 71)])  # it goes on: the same one stays held
    for step in (70, 80):
        take(step)
    assert snap.get_held()[2] == 50 and torch.equal(snap.get_held()[1]["w"], torch.full((4,), 50.0))
    assert snap.num_bytes == 3 * 16  # the snapshot, the one before it, the held one
    capture._hold_before_run(90, [*range(59, 85)])  # step 90 was not flagged: the run ended
    assert snap.held is None and snap.num_bytes == 2 * 16
    snap.may_hold = False  # a host whose memory budget holds two states, not three: nothing is held
    take(100)
    capture._hold_before_run(110, [*range(101, 111)])
    assert snap.held is None and snap.num_bytes == 2 * 16


def _lr_jump_monitor(run_dir, jump: int, on_spike: str = "warn", steps: int = 250):
    """A new user's case: an MLP regression (sin + noise) in their own loop under Monitor; their LambdaLR multiplies the
    LR by 30 from the update of step ``jump`` on. Returns the incident events and the StopTraining, if any."""
    from torch import nn

    from stabletrain import Monitor
    from stabletrain.errors import StopTraining

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32 * steps, 16, generator=g)
    y = torch.sin(x @ torch.randn(16, 1, generator=g) / 2) + 0.1 * torch.randn(32 * steps, 1, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 30.0 if s >= jump - 1 else 1.0)

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0]), b[1])

    stopped = None
    try:
        with Monitor(model, opt, run_dir=run_dir, clip_max_norm=1.0, loss_fn=loss_fn, on_spike=on_spike, log_every=10) as mon:
            for s in range(steps):
                b = (x[s * 32:(s + 1) * 32], y[s * 32:(s + 1) * 32])
                mon.backward(loss_fn(model, b))
                mon.step(b)
                sched.step()
    except StopTraining as err:
        stopped = err
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    return {e["step"]: e for e in events if e["kind"] == "incident" and e.get("diagnosis")}, stopped


def test_an_lr_jump_is_no_data_spike_whether_it_lands_inside_an_interval_or_at_its_end(tmp_path, monkeypatch):
    """A new user's LR x30 (their scheduler) at step 130, an interval's last update: the interval's start (step 130)
    already took an update at the new LR, and the spike at 132 was 'data: samples 5, 31 carry 30%' (the top of a
    uniformly inflated window; dropping it took x2.1 to x1.87). Now the older state is the snapshot before (step 120,
    the old LR): state, the LR's rise named. At 150 the rise was 'the optimizer's steps grew x28.5 at the same LR', and
    a later spike whose older state ran 10 steps at the new LR was 'data' again. (That later spike, at 167, is one the
    rarity bar lets pass now, the burst at 153-157 making such ratios common: here the bar is off to weigh it.)"""
    spikes, _ = _lr_jump_monitor(tmp_path / "j130", 130)
    first = spikes[min(spikes)]
    assert (first["step"], first["diagnosis"]["failure_class"]) == (132, "state"), first["reason"]
    assert first["diagnosis"]["bad_samples"] is None
    assert "the LR rose x30 since step 120 (0.002 -> 0.06)" in first["diagnosis"]["evidence"], first["diagnosis"]["evidence"]
    from stabletrain.policies.spike_rarity import RarityBar

    monkeypatch.setattr(RarityBar, "host_passes", lambda self, loss, median: True)
    spikes, _ = _lr_jump_monitor(tmp_path / "j150", 150)
    assert sorted(spikes) == [153, 167] and {d["diagnosis"]["failure_class"] for d in spikes.values()} == {"state"}, {
        t: d["reason"] for t, d in spikes.items()}
    evidence = [d["diagnosis"]["evidence"] for d in spikes.values()]
    assert not any("at the same LR" in e for e in evidence), evidence
    assert any("the LR rose x30 since step 140 (0.002 -> 0.06); the optimizer's steps grew" in e and " with it: " in e
               for e in evidence), evidence
    assert any("already ran at x30 the LR of the run's intervals before it" in e for e in evidence), evidence


def test_a_stop_after_spike_skips_of_a_diverging_run_says_divergence_not_a_new_level(tmp_path):
    """Under guard.on_spike=skip an LR x30 makes every step a spike; the stop said 'the loss moved to a new level ...
    guard.on_spike=warn trains on at the new level' while every capture had said state."""
    spikes, stopped = _lr_jump_monitor(tmp_path / "skip", 150, "skip", 200)
    assert stopped is not None and {d["diagnosis"]["failure_class"] for d in spikes.values()} == {"state"}
    text = str(stopped)
    assert "found the state drifted (state): a divergence, not a new level: lower the LR (the optimizer's lr)" in text, text
    assert "consecutive skipped steps (max_consecutive_skips=" in text and "guard." not in text, text  # (Monitor's options)
    assert "trains on at the new level" not in text, text


def test_one_huge_update_inside_the_optimizer_is_state_and_named_at_an_intervals_end_or_inside_it(tmp_path):
    """A new-user trial: an AdamW subclass that takes its 60th step at x200 its LR (the interval's last, the update its
    record measures). The spike at 64 read 'data: samples 1018, 1020 carry 90% of the window's loss ... the window is high
    under the state of step 60 too (4.768 vs 1.349)': that state already held the update, and ordinary windows were x4
    the run's level there. Now the older state is step 50's (before the jump) and the verdict state, naming the update.
    At step 55 (inside an interval, no record measured it) the weights' move since step 50 names it."""
    run = ("train.batch_size=16", "log.every=10", "sched.warmup_steps=0", "sched.decay=constant", "data.shuffle=false",
           "guard.precursor=false", "train.max_steps=70")
    Trainer(cfg(*run), task=one_step_jump_task(60), run_dir=tmp_path / "j60").fit()
    found = sorted((tmp_path / "j60" / "incidents").glob("step_*/diagnosis.json"))
    assert found, "no spike captured"
    d = json.loads(found[0].read_text())
    assert d["failure_class"] == "state" and d["bad_samples"] is None, d["summary"]
    assert d["older"]["step"] == 50, d["older"]
    assert "the update of step 60 (its interval's measured one) was x" in d["evidence"], d["evidence"]
    assert "the run's before it at the same LR" in d["evidence"], d["evidence"]
    # the cause before the weighing: the console's line (its first clauses that fit) names the update (it said only
    # "the updates since step 0 raised this window's loss ...; the window is normal under ...; ...", a new user's trial)
    from stabletrain.console import brief

    assert "the update of step 60 (its interval's measured one) was x" in brief(d["summary"]), brief(d["summary"])
    Trainer(cfg(*run), task=one_step_jump_task(55), run_dir=tmp_path / "j55").fit()
    d = json.loads(sorted((tmp_path / "j55" / "incidents").glob("step_*/diagnosis.json"))[0].read_text())
    assert d["failure_class"] == "state" and d["bad_samples"] is None and d["older"]["step"] == 50, d["summary"]
    gap = d["step"] - 51
    assert "the weights moved" in d["evidence"] and f"in the {gap} updates since step 50" in d["evidence"], d["evidence"]


def test_a_window_high_under_an_older_state_names_no_batch_where_ordinary_windows_are_far_above_the_runs_level():
    """The trial's numbers where no snapshot before the jump is kept (the older state is step 60's, which holds it):
    ordinary windows at x4 the rule's median under it and x3.8 under this one. The window's being high there names no
    batch (it read 'data'); with ordinary windows at the run's level the same window is data, its samples named."""
    samples = {"indices": [1018, 1020], "share": 0.9, "without": {"loss": 0.5356, "ratio": 1.58}}
    older = {"step": 60, "window": 4.768, "ordinary": 1.349, "current_ordinary": 1.288, "ordinary_from": "windows",
             "window_high": True, "ordinary_high": False, "ordinary_spike_now": False, "window_not_above_now": False,
             "ratio": 2.0, "levels": [3.98, 3.8], "median": 0.339, "span": 50}  # (the rule's window: 50 losses)
    base = {"reproduces": True, "loss": 4.591, "precision": "fp32", "step": 64, "samples": samples, "surges": [],
            "where": {}, "jumps": {}}
    out = classify_spike({**base, "older": older})
    assert out["failure_class"] == "state" and out["blamed_samples"] is None, out
    assert "x3.8 the run's level before the spike under this one (0.339, the rule's median; x3.98 under that state)" in (
        out["evidence"]), out["evidence"]
    assert "but ordinary windows are far above the run's level before under this state too: the state drifted" in (
        out["evidence"]), out["evidence"]
    calm = classify_spike({**base, "older": {**older, "ordinary": 0.33, "current_ordinary": 0.35, "levels": [0.97, 1.03]}})
    assert calm["failure_class"] == "data" and calm["blamed_samples"] == [1018, 1020], calm
    # a loss whose median is 0 or below (an NLL): every ratio to it is inf and says nothing of a level (the rule's own
    # ratio test is off there): the window high under the older state names the batch, as before
    nll = classify_spike({**base, "older": {**older, "levels": [float("inf"), float("inf")], "median": -3.2}})
    assert nll["failure_class"] == "data" and nll["blamed_samples"] == [1018, 1020], nll
    # under step 0's state, or one the rule's median does not reach back to, ordinary windows above the median are a
    # loss that fell since (or a just-armed rule's noisy few): no drift, the window high there too names the batch
    for other in ({"step": 0, "from": "checkpoint"}, {"span": 3}):
        fell = classify_spike({**base, "older": {**older, **other}})
        assert fell["failure_class"] == "data" and fell["blamed_samples"] == [1018, 1020], (other, fell)
    # (a checkpoint within the rule window's reach, as a DDP spike opening its interval gets, reads as the snapshot)
    assert classify_spike({**base, "older": {**older, "from": "checkpoint"}})["failure_class"] == "state"


def test_a_data_spikes_samples_are_every_outlier_of_the_window_not_the_fewest_that_pass_the_bar(tmp_path):
    """A new-user trial: 8 of 32 samples planted, the step 'normal (verified: x1.92 the median)' without the 4 largest and
    4 planted ones left unnamed. Here 8 shifted targets (losses 15-35 against ~1): the fewest that pass the bar are 7; the
    outliers as a group, above the widest gap in the window's largest losses, are the 8, their removal verified."""
    from spike_tasks import outlier_samples_task

    bad = list(range(608, 640, 4))  # step 20 at batch 32
    task = outlier_samples_task(bad=(), n=1024)
    task.train_data.tensors[1][bad] += 5.0
    run = ("train.batch_size=32", "train.max_steps=21", "log.every=10", "data.shuffle=false", "sched.warmup_steps=0",
           "sched.decay=constant", "guard.precursor=false")
    Trainer(cfg(*run), task=task, run_dir=tmp_path / "run").fit()
    d = _diagnosis(tmp_path / "run", 20)
    assert d["failure_class"] == "data" and d["bad_samples"] == bad, d["summary"]
    assert d["samples"]["without"]["ratio"] < 1.0, d["samples"]  # (without the 7 it was x1.52: under the bar, not normal)


def test_the_outliers_as_a_group_never_reach_below_the_windows_own_level():
    """A review: the widest gap among the largest losses may sit at their low end (a trained model's near-0 losses):
    losses 5.0, 0.9, 0.8, 0.002 put 0.9 and 0.8 (ordinary) in the group. Each must be an outlier of the window too."""
    from stabletrain.spike_samples import _alike

    rows = [{"sample": i, "loss": v} for i, v in enumerate([5.0, 0.9, 0.8, 0.002, 0.7, 0.85, 0.75, 0.8])]
    assert _alike(rows, [0], 3, 2.0) is None
    planted = [{"sample": i, "loss": v} for i, v in enumerate([40.0, 30.0, 20.0, 0.9, 0.8, 0.85, 0.7, 0.75])]
    assert _alike(planted, [0, 1], 3, 2.0) == [0, 1, 2]


def test_the_update_jump_named_is_the_last_before_the_spike_not_the_first():
    """Update/weight ratios 1e-3, 1e-3, 5e-3, 5e-3, 1e-1 at steps 10-50: the run's early x5 jump (step 30) was what the
    evidence named, and step 50's x33, the one that made the spike's state, was not seen as a jump at all."""
    from stabletrain.services.spike_reference import update_jump, update_jumped_at

    history = [[10 * (i + 1), 1e-3, r] for i, r in enumerate((1e-3, 1e-3, 5e-3, 5e-3, 1e-1))]
    jump = update_jump(history)
    assert jump["step"] == 50 and jump["ratio"] / jump["typical"] == pytest.approx(1e-1 / 3e-3)
    assert update_jumped_at(history, 50) and update_jumped_at(history, 30)
    assert update_jump(history, at=30)["step"] == 30 and update_jump(history, at=20) is None
    assert not update_jumped_at([r for r in history if r[0] != 50] + [[50, 1e-3, 4e-3]], 50)  # x1.3: no jump
    # An update that jumped at step 30 and stayed there: step 40 is high against the lagging median, but it is step 30's
    stays = [[10 * (i + 1), 1e-3, r] for i, r in enumerate((1e-3, 1e-3, 1e-2, 1e-2))]
    assert update_jump(stays)["step"] == 30 and not update_jumped_at(stays, 40) and update_jumped_at(stays, 30)


def test_the_steps_growth_says_the_lr_rise_with_no_older_state_at_hand():
    """A new user's trial (Lightning, on_spike=skip, the LR x30 from step 82, a spike at the interval's first step: no
    older state): 'the optimizer's steps grew x44.5' with neither 'with the LR' nor 'at the same LR', though the bundle
    held the LR it stepped at (0.3) and the intervals' (0.01)."""
    from stabletrain.diagnostics.spike import _steps_grew

    sizes = {"now": 0.19, "before": 0.0042, "upto": 80, "lr": 0.01, "lr_now": 0.3}
    assert "grew x45.2 with the LR (x30: 0.01 -> 0.3): update/weight" in _steps_grew(sizes, None)
    assert "grew x45.2 at the same LR: update/weight" in _steps_grew({**sizes, "lr_now": 0.01}, None)
    assert "grew x45.2: update/weight" in _steps_grew({k: v for k, v in sizes.items() if k != "lr_now"}, None)


def test_a_surge_in_a_run_already_far_above_its_level_is_a_symptom_of_the_drift_not_adams_second_moment():
    """A trial (LR 0.3 after a 40-step warm-up, clean data): the spike at step 28 was classed optimizer-state, Adam's
    second moment of 4.weight, while ordinary windows ran at x4.77 the run's level under the interval's start (step 20)
    and x2.35 under this state (the rule's z-score passed them: its window's spread had grown with the swings), and the
    remedy search found only a lower LR to cure it (adam-eps and update-clip failed). The numbers are the trial's."""
    older = {"step": 20, "from": "snapshot", "window": 9.403, "ordinary": 3.354, "current_ordinary": 1.656,
             "ordinary_from": "windows", "lr": {"then": 0.1575, "now": 0.21}, "window_high": True,
             "ordinary_spike_now": False, "ordinary_then_high": False, "levels": [4.766, 2.354], "median": 0.7037,
             "span": 27, "ordinary_high": False, "window_not_above_now": False, "ratio": 2.0, "moved": 0.4463}
    surge = {"name": "4.weight", "numel": 640, "surge_share": 0.0828, "typical_sqrt_v": 0.011, "coord_factor": 3.279,
             "whole": False, "step": 27, "ordinary_ratio": 0.0451}
    m = {"reproduces": True, "loss": 23.09, "precision": "fp32", "step": 28, "samples": None, "surges": [surge],
         "where": {"first": "2", "first_factor": 1.451}, "jumps": {}, "older": older,
         "steps": {"now": 0.0704, "before": 0.1045, "upto": 20, "lr": 0.12, "lr_now": 0.21}}
    out = classify_spike(m)
    assert out["failure_class"] == "state" and out["blamed_layer"] is None, out
    assert "a divergence onset, or an LR too high" in out["evidence"], out["evidence"]
    assert ("4.weight's coordinates surged in the update of step 27 (x3.28 as far as its others) in a run already off its "
            "level: ordinary windows ran at x4.77 the run's level before the spike (0.7037, the rule's median) under the "
            "state of step 20, before that update") in out["evidence"], out["evidence"]
    # the same surge where ordinary windows are at the run's level under both states: Adam's second moment, as before
    calm = {**older, "levels": [1.1, 1.05], "ordinary": 0.77, "current_ordinary": 0.74, "window": 9.403}
    assert classify_spike({**m, "older": calm})["failure_class"] == "optimizer-state"
    # nor does an untrained or older state's level acquit it (a checkpoint's, the run's first snapshot, a snapshot older
    # than the rule window reaches back), nor a level against a median at or below 0 (the ratio is inf there)
    for other in ({"from": "checkpoint", "step": 0}, {"step": 0}, {"span": 7}, {"median": -0.8, "levels": [math.inf] * 2}):
        assert classify_spike({**m, "older": {**older, **other}})["failure_class"] == "optimizer-state", other


def test_a_checkpoint_out_of_the_rule_windows_reach_is_not_even_read(tmp_path):
    """A spike's capture looked for an older state by loading up to 3 checkpoints and only then checked whether the
    newest was within the rule window's reach (out of it, none is used): now one out of reach is not read at all. The
    checkpoint of step 5 is damaged here: read, it would be passed over for step 0's; out of reach, it is named unread."""
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("train.max_steps=10", "ckpt.every=5"), run_dir=run_dir)
    trainer.fit()
    fit, source = trainer.state, trainer.recorder.source
    (run_dir / "checkpoints" / "step_000005" / "state.pt").write_bytes(b"damaged")
    now = trainer.state.module.state_dict()
    assert source.reference_state(fit, 8, now, 6) == (None, 5, None)
    found = source.reference_state(fit, 8, now, 0)  # within reach: the damaged one is read, refused, and step 0's taken
    assert found is not None and found[0] is not None and found[1] == 0


def test_a_surge_after_ordinary_windows_were_already_high_is_the_aftershock_of_an_applied_spike_not_adams():
    """A new user's own loop (Monitor, AdamW, labels of two rows x40 at step 120, guard.on_spike=warn): step 120 was
    named data, then step 128 was classed optimizer-state, Adam's second moment of 0.weight (one coordinate of 256,
    moved x3.59), while the same loop skipping step 120 has no spike after it. The state before that surging update,
    replayed, already finds ordinary windows high: the surge is no cause. The numbers are the trial's."""
    older = {"step": 110, "from": "snapshot", "window": 0.03951, "ordinary": 0.05337, "current_ordinary": 0.1709,
             "ordinary_from": "windows", "lr": {"then": 0.01, "now": 0.01, "since": 120}, "window_high": False,
             "ordinary_spike_now": False, "ordinary_then_high": False, "levels": [0.9547, 3.058], "median": 0.05591,
             "span": 50, "ordinary_high": True, "window_not_above_now": True, "ratio": 2.0, "moved": 0.1778}
    surge = {"name": "0.weight", "numel": 256, "surge_share": 0.0039, "typical_sqrt_v": 0.014, "coord_factor": 3.593,
             "whole": False, "step": 127}
    m = {"reproduces": True, "loss": 0.2283, "precision": "fp32", "step": 128, "samples": None, "surges": [surge],
         "where": {}, "jumps": {}, "older": older,
         "steps": {"now": 0.01593, "before": 0.005421, "upto": 120, "lr": 0.01, "lr_now": 0.01}}
    assert classify_spike(m)["failure_class"] == "optimizer-state"  # (without the state before the surging update)
    out = classify_spike({**m, "older": {**older, "ordinary_previous": 0.1655}})
    assert out["failure_class"] == "state" and out["blamed_layer"] is None, out
    assert ("0.weight's coordinates surged in the update of step 127 (x3.59 as far as its others), but ordinary windows "
            "were already at 0.1655 under the state just before that update, x3.1 their 0.05337 under the state of step "
            "110: the state was off before it") in out["evidence"], out["evidence"]
    # where the surging update itself raised them (ordinary windows normal just before it): Adam's second moment
    assert classify_spike({**m, "older": {**older, "ordinary_previous": 0.06}})["failure_class"] == "optimizer-state"
    # nor is a window high under the older state too then an outlier batch: the state was off (a review's case)
    high = {**older, "window": 0.2, "window_high": True, "window_not_above_now": False, "ordinary_previous": 0.1655}
    out = classify_spike({**m, "older": high, "loss": 0.9})
    assert out["failure_class"] == "state" and "the state was off before it" in out["evidence"], out


def test_the_aftershock_of_an_applied_data_spike_in_a_users_own_loop_is_said_first_and_blames_no_layer(tmp_path):
    """The trial's loop itself (Monitor): the spike at step 120 names the two rows; the spike its applied update left,
    at step 128, is the state's, and the console line leads with the aftershock (it was cut before it)."""
    _users_loop(tmp_path / "run", 130, [119])
    first, after = (_diagnosis(tmp_path / "run", s) for s in (120, 128))
    assert (first["failure_class"], first["blamed_samples"]) == ("data", [2, 9]), first["summary"]
    assert after["failure_class"] == "state" and after["blamed_layer"] is None, after["summary"]
    assert after["summary"].startswith("state: 8 steps after the spike at step 120 (data), whose update was applied: this "
                                       "may be its aftershock; the model or optimizer state drifted"), after["summary"]


def test_a_host_spikes_step_before_is_replayed_on_its_own_batch_where_that_step_was_flagged_too(tmp_path):
    """A spike's bundle replays the step before it from its own state (the surges of that update): under an adapter its
    window was the newest *ordinary* window, so where the step before was itself flagged (no ordinary window) another
    step's batch ran from that state (a review). Rows 2 and 9 x40 at steps 121 and 122 (warn): the capture at step 131
    (the interval's first) replays from the snapshot before, and step 130, flagged, gets its own batch."""
    data = _users_loop(tmp_path / "run", 140, [120, 121])
    bundle = torch.load(tmp_path / "run" / "incidents" / "step_000131" / "bundle.pt", weights_only=False)
    previous, batches = bundle["previous"], bundle["config"]["task_args"]["batches"]
    assert previous["step"] == 130 and any(e["kind"] == "spike" and e["step"] == 130 for e in
                                           read_jsonl(tmp_path / "run" / "events.jsonl")[0])
    rows = [i for group in previous["window"] for i in group]
    sizes = [len(b[0]) for b in batches]
    start = rows[0]
    (m,) = [k for k in range(len(batches)) if sum(sizes[:k]) == start]  # the micro-batch those rows are
    assert rows == list(range(start, start + 16)) and torch.equal(batches[m][0], data[129][0])


def _users_loop(run_dir, steps, outliers):
    """A new user's own loop (Monitor, AdamW, no clip): rows 2 and 9 of the batches at ``outliers`` (0-based) x40."""
    from stabletrain import Monitor

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(8, 1, generator=g)
    data = []
    for i in range(steps):
        x = torch.randn(16, 8, generator=g)
        y = torch.tanh(x @ w)
        if i in outliers:
            y[[2, 9]] = 40.0
        data.append((x, y))

    def loss_fn(model, batch):
        return torch.nn.functional.mse_loss(model(batch[0]), batch[1])

    with Monitor(model, opt, run_dir=run_dir, loss_fn=loss_fn, log_every=10) as monitor:
        for batch in data:
            monitor.backward(loss_fn(model, batch))
            monitor.step(batch)
    return data


def test_a_rise_of_the_optimizers_steps_to_a_level_that_stays_is_placed_at_its_own_record():
    """update_level_jump (a review): a flat x8 rise at step 70 was placed at step 40 (the median of every record from a
    candidate on ties across the records before the rise); two high records at the end are no level that stayed; an LR
    that rose past x1.5 explains the rise; noisy records find the rise's own record."""
    import random

    from stabletrain.services.spike_reference import update_level_jump

    def hist(ratios, lrs=None):
        return [[10 * (i + 1), (lrs or [1e-3] * len(ratios))[i], r] for i, r in enumerate(ratios)]

    flat = [1e-3] * 6 + [8e-3] * 6  # the rise at the 7th record: step 70
    found = update_level_jump(hist(flat))
    assert found["step"] == 70 and found["level"] / found["before"] == pytest.approx(8.0)
    assert update_level_jump(hist([1e-3] * 10 + [5e-3, 6e-3])) is None  # two records: a burst, not a level
    assert update_level_jump(hist(flat, [1e-3] * 6 + [2e-3] * 6)) is None  # the LR doubled with it
    assert update_level_jump(hist(flat, [1e-3] * 6 + [5e-4] * 6))["step"] == 70  # a falling LR: still the steps' own rise
    rng = random.Random(0)
    for at in (4, 7, 9):  # the rise at record `at` (0-based), each record x(1 +- 20%)
        for _ in range(50):
            noisy = [(1e-3 if i < at else 8e-3) * (1 + rng.uniform(-0.2, 0.2)) for i in range(12)]
            assert update_level_jump(hist(noisy))["step"] == 10 * (at + 1), noisy
    assert update_level_jump(hist([1e-3, float("nan"), None, 0.0] * 3)) is None  # nothing finite and positive enough


def test_a_window_high_under_the_older_state_below_the_rules_bar_is_still_the_batchs(tmp_path):
    """A new user's trial: three rows of a classifier's batch at x50 inputs. Under the interval's start the window was x1.81
    ordinary windows' loss (3.10 vs 1.71), below guard.spike_ratio=2, and x2.14 at the spike (3.41 vs 1.59): it was called
    'state: the updates since step 140 raised this window's loss', 'samples 2395 carry 43% of the loss, but only under
    the current state', no sample offered to drop. Most of the window's excess over ordinary windows was there before the
    updates: the batch's, its verified sample named."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=16", "train.max_steps=152", "log.every=10", "data.shuffle=false", "sched.warmup_steps=0",
                "sched.decay=constant", "optim.weight_decay=0.01", "optim.beta2=0.999", "ckpt.every=0"),
            task=scaled_rows_classifier_task(), run_dir=run_dir).fit()
    d = _diagnosis(run_dir, 150)
    older = d["older"]
    assert older["step"] == 140 and older["window"] < older["ratio"] * older["ordinary"], older  # (below the bar there)
    assert d["failure_class"] == "data" and d["bad_samples"] and set(d["bad_samples"]) <= {2386, 2391, 2395}, d["summary"]
    assert "the window is high under the state of step 140 too" in d["evidence"], d["evidence"]


def _older_of(window_old, ordinary_old, loss, ordinary_now, median):
    """counterfactual._older on a bench that reports these losses: the window's and ordinary windows' under the older state
    (step 140) and under the spike's (its window's: ``loss``), the rule (ratio 2) at ``median``."""
    from types import SimpleNamespace

    from stabletrain.counterfactual import _older

    model, spike, context = torch.nn.Linear(3, 3), [("window",)], [[("a",)], [("b",)]]

    def loss_of(groups, older=None):
        return (window_old if older is not None else loss) if groups is spike else (
            ordinary_old if older is not None else ordinary_now)

    bench = SimpleNamespace(replica=SimpleNamespace(model=model), loss=loss_of, module_rms=lambda s, m: ({"": 1.0}, [""]))
    bundle = {"reference": {"model": model.state_dict(), "step": 140}, "observed": {"spike_window": [median] * 20},
              "step": 150}
    rule = lambda x: {"median": median, "spike": x > 2.0 * median, "ratio": x / median}  # noqa: E731
    return _older(bench, bundle, SimpleNamespace(guard=SimpleNamespace(spike_ratio=2.0)), spike, context, rule, loss)[0]


def test_a_window_below_the_bar_under_the_older_state_is_the_batchs_only_where_ordinary_windows_held_and_nothing_surged():
    """A review of HELD_SHARE: a window x1.1 ordinary windows' loss under the older state, ordinary windows risen x1.9 since
    (under the rule's bar), was called high there, data; an Adam surge before the spike on a window x1.8 there, too. The
    share counts where ordinary windows did not rise, the window stood at sqrt(spike_ratio) x theirs or more there and is
    a spike against them now, and no surge in the update before it lifted it x1.5 or more."""
    samples = {"indices": [7], "share": 0.6, "without": {"loss": 1.2, "ratio": 1.1, "zscore": 0.5}}
    for args, held in (((3.101, 1.713, 3.408, 1.59, 1.65), 0.763),  # the trial's three rows
                       ((3.109, 1.713, 4.631, 1.589, 1.65), 0.459),  # its five rows under Lightning (46%: a third suffices)
                       ((1.5, 1.0, 3.0, 1.0, 1.0), None),  # a quarter of its excess then: the updates made the rest
                       ((3.101, 1.713, 3.7, 1.75, 1.65), 0.712),  # ordinary windows up 2% (a review: no cliff at 0%)
                       ((1.1, 1.0, 2.1, 1.9, 1.0), None),  # ordinary windows rose x1.9: a drift, not the batch
                       ((2.5, 2.0, 2.2, 1.0, 1.0), None)):  # x1.25 there: no outlier under that state
        older = _older_of(*args)
        assert (older.get("held") is None if held is None else math.isclose(older["held"], held, abs_tol=1e-3)), (args, older)
        assert older["window_high"] is (held is not None), (args, older)
        out = classify_spike({"reproduces": True, "loss": args[2], "older": older, "step": 150, "samples": samples})
        assert (out["failure_class"] == "data") is (held is not None), (args, out)
    trial = classify_spike({"reproduces": True, "loss": 3.408, "older": _older_of(3.101, 1.713, 3.408, 1.59, 1.65),
                            "step": 150, "samples": samples})
    assert "the window is high under the state of step 140 too (3.101 vs 1.713: x1.81, 76% of its excess now)" in (
        trial["evidence"]), trial["evidence"]
    # Adam's surge before the spike lifted a window x1.8 ordinary ones there to x3.2: the surge's, not the batch's
    surge = [{"step": 149, "name": "emb.weight", "surge_share": 0.01, "coord_factor": 12.0}]
    older = _older_of(1.8, 1.0, 3.2, 1.0, 1.0)
    assert older.get("held") and older["window_high"], older
    m = {"reproduces": True, "loss": 3.2, "older": older, "step": 150, "samples": samples}
    assert classify_spike({**m, "surges": surge})["failure_class"] == "optimizer-state"
    assert classify_spike(m)["failure_class"] == "data"
