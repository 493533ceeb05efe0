"""Finite loss spikes get the same doctor as NaN: captured, replayed, their cause named and verified, a cure found.

Each planted spike (tests/spike_tasks.py) is trained, captured at its log boundary, diagnosed by counterfactual
replays (stabletrain.counterfactual) and searched for a cure (stabletrain remedy): the class, the evidence the
issue asks for (the samples named and their removal verified; no sample blamed for a drifted state; the layer
named for Adam's second moment; fp32 normal for precision), and a cure that fits the class.
"""

from __future__ import annotations

import json
import math
import random
import re
import statistics
from pathlib import Path
from types import SimpleNamespace

import default_gpt_curve
import pytest
import torch
from helpers import cfg
from spike_tasks import (
    batchnorm_outlier_task,
    batchnorm_scaled_task,
    dropout_draw_task,
    first_steps_outliers_task,
    flipped_labels_task,
    graded_outliers_task,
    level_shift_task,
    mislabelled_quadrants_task,
    mislabelled_token_task,
    noisy_labels_centers,
    noisy_labels_task,
    offset_inputs_task,
    outlier_samples_task,
    rare_token_task,
    relabelled_five_task,
    sgd_regression_task,
    sgd_too_fast_task,
    silent_feature_task,
    silent_layer_task,
    steady_regression_task,
    too_high_lr_task,
    transient_spike_task,
    update_jump_task,
)

from stabletrain import Trainer
from stabletrain.config import GuardConfig, load_config
from stabletrain.diagnostics.candidates import candidates_for
from stabletrain.diagnostics.spike import classify_spike
from stabletrain.policies.guard import Guard, spike_test
from stabletrain.policies.schedule import lr_factor
from stabletrain.records.bundles import load_bundle
from stabletrain.remedy_search import search_remedies
from stabletrain.report.goodput import read_goodput
from stabletrain.services.boundary import spike_to_capture
from stabletrain.spike_samples import tail_note

#: task factory, its config, the spike's step, its class
CASES = {
    "data": (outlier_samples_task, {}, ["train.max_steps=30", "optim.lr=0.01"], 20),
    "state": (steady_regression_task, {}, ["train.max_steps=42", "optim.lr=0.5", "sched.warmup_steps=50"], 39),
    "optimizer-state": (rare_token_task, {"lr": 0.03}, ["train.max_steps=80", "sched.warmup_steps=0",
                                                        "sched.decay=constant"], 75),
    "precision": (offset_inputs_task, {}, ["train.max_steps=72", "optim.lr=0.03", "precision=fp16"], 70),
}


def _events(run_dir):
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module", params=list(CASES))
def spiked(request, tmp_path_factory):
    """(class, trainer, run dir, the spike's incident event, its diagnosis) of one planted spike's run."""
    factory, kwargs, overrides, _ = CASES[request.param]
    run_dir = tmp_path_factory.mktemp(request.param.replace(" ", "-")) / "run"
    trainer = Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", *overrides),
                      task=factory(**kwargs), run_dir=run_dir)
    trainer.fit()
    incidents = [e for e in _events(run_dir) if e["kind"] == "incident"]
    assert incidents, f"no incident captured for the {request.param} spike"
    diagnosis = json.loads((run_dir / "incidents" / f"step_{incidents[0]['step']:06d}" / "diagnosis.json").read_text())
    return request.param, trainer, run_dir, incidents[0], diagnosis


def test_the_spike_is_captured_and_its_class_named(spiked):
    cls, trainer, run_dir, incident, diagnosis = spiked
    assert incident["step"] == CASES[cls][3] and incident["anomaly"] == "spike"
    assert [e["step"] for e in _events(run_dir) if e["kind"] == "spike"][0] == incident["step"]
    assert diagnosis["anomaly"] == "spike" and diagnosis["reproduces"] is True, diagnosis["summary"]
    assert diagnosis["failure_class"] == cls, diagnosis["summary"]
    assert incident["diagnosis"]["failure_class"] == cls and incident["diagnosis"]["summary"] == diagnosis["summary"]
    bundle = load_bundle(run_dir / "incidents" / f"step_{incident['step']:06d}")
    # The rule's own window before the spike; the replayed loss is bitwise the run's (fp32) and a spike by it.
    assert len(bundle["observed"]["spike_window"]) >= 10 and diagnosis["spike_test"]["spike"] is True
    if trainer.cfg.precision == "fp32":
        assert float(diagnosis["loss"]).hex() == float(bundle["observed"]["loss"]).hex()
    assert trainer.step == trainer.cfg.train.max_steps  # the run went on (guard.on_spike=warn)


def test_each_class_carries_its_evidence(spiked):
    cls, _, _, _, d = spiked
    if cls == "data":
        assert d["bad_samples"] == [153, 157] and d["samples"]["share"] > 0.9
        assert d["samples"]["without"]["ratio"] < 2.0  # the step without them, replayed: normal by the rule
        assert d["older"]["window_high"] and "without them the step is normal (verified" in d["summary"]
        shares = {r["sample"]: r["grad_share"] for r in d["sample_losses"]}  # each sample's share of the window's gradient
        assert shares[153] + shares[157] > 0.9 and max(v for k, v in shares.items() if k not in (153, 157)) < 0.05, shares
        # against the run's other samples (the ordinary windows', a draw of the dataset), each weighed alone: none reaches
        # theirs, which are beyond the data's spread (not a batch that drew hard samples of the loss's own tail)
        assert [(r["sample"], r["reach"]) for r in d["tail"]["samples"]] == [(153, 0), (157, 0)] and d["tail"]["of"] == 248
        assert f"each is beyond all 248 other samples weighed under this state (they reach {d['tail']['largest']:.4g} " in (
            d["summary"])
    elif cls == "state":
        assert d["bad_samples"] is None and d["blamed_layer"] is None
        assert not d["older"]["window_high"] and d["older"]["ordinary_high"]
        # where: the first module (forward order) whose output departs from the older state's, and the layers whose
        # gradient and update/weight ratio jumped against an ordinary window's, by name
        assert d["where"]["first"] is not None and f"first module whose output departs: '{d['where']['first']}'" in d["summary"]
        top = d["jumps"]["update_ratio"][0]  # Adam's update did not jump: the LR's drift, not one surging layer
        assert top[1] < 1.5 and f"no layer's update/weight ratio jumped (largest: {top[0]} x{top[1]:.3g})" in d["summary"]
    elif cls == "optimizer-state":
        assert d["blamed_layer"] == "embed.weight" and d["bad_samples"] is None
        top = d["surges"][0]
        assert top["name"] == "embed.weight" and top["step"] == 74 and top["coord_factor"] > 10
        assert math.isclose(top["surge_share"], 16 / (32 * 16))  # exactly the rare token's row
    else:
        assert d["fp32"]["spike"] is False and d["fp32"]["loss"] < d["loss"] / 10
        # where it first showed ('1', which standardizes the rounded values), and where precision is lost: '0', which
        # alone in fp32 makes the step no spike (verified; it named '1', whose fp32 does not cure)
        assert d["where"]["first"] == "1" and d["where"]["upstream"] == ["0"] and d["blamed_module"] == "0"
        assert d["where"]["cured_by"] == "0" and "'0' alone in fp32 makes the step no spike (loss " in d["summary"]
        # the verified module before where it showed (a trial's console line, cut short, kept only the module that fails)
        assert d["summary"].index("'0' alone in fp32") < d["summary"].index("the first module whose output departs")


#: the candidates of which one must cure each class (cures that fit it)
CURES = {"data": {"skip-samples"}, "state": {"lr-x0.1", "lr-x0.5", "rollback-lr-x0.1", "rollback-lr-x0.5"},
         "optimizer-state": {"adam-eps", "update-clip"}, "precision": {"module-fp32"}}


def test_the_remedy_search_finds_a_cure_that_fits_the_class(spiked, tmp_path):
    cls, trainer, run_dir, incident, _ = spiked
    factory, kwargs, _, _ = CASES[cls]
    record = search_remedies(run_dir / "incidents" / f"step_{incident['step']:06d}", factory(**kwargs), steps=6)
    verdicts = {(c["name"], c["detail"]): c["verdict"] for c in record["candidates"]}
    cured = {name for (name, _), v in verdicts.items() if v == "cures"}
    assert CURES[cls] & cured, record["candidates"]
    if cls == "precision":  # the module that made the value in float16, not the one where it first showed
        assert verdicts[("module-fp32", "module '0' in fp32 (autocast off around it)")] == "cures"
        assert verdicts[("module-fp32", "module '1' in fp32 (autocast off around it)")] == "fails"
    if cls in ("state", "optimizer-state"):  # the update that led into the spike is replayed under the remedy
        lr = next(c for c in record["candidates"] if c["name"] == "lr-x0.1")
        assert lr["first_step"] == incident["step"] - 1
    assert record["anomaly"] == "spike"
    if cls == "precision":  # applied by hand on a resume past its step: refused, naming the key that applies it live (a
        # trial: 'a run with guard.on_nonfinite=remedy applies a cure at the incident', for a spike that key ignores)
        import shutil

        copy = tmp_path / "run"
        shutil.copytree(run_dir, copy)  # (the module's run stays as it is)
        row = 1 + [c["name"] for c in record["candidates"]].index("module-fp32")
        folder = copy / "incidents" / f"step_{incident['step']:06d}"
        for older in (False, True):  # a remedy.json from before it recorded the anomaly: read from diagnosis.json
            if older:
                path = folder / "remedy.json"
                path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != "anomaly"}))
            with pytest.raises(ValueError, match=r"none of its cures rolls back; a run with guard.on_spike=remedy applies a "
                                                 r"cure at the incident itself"):
                Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", *CASES[cls][2], "train.max_steps=80",
                            f"remedy.apply={folder}:{row}"), task=factory(**kwargs), run_dir=copy, resume=True).fit()




def test_an_update_clip_is_sized_from_the_layers_update_before_the_surge_not_one_the_surge_inflated(tmp_path):
    """After a surge whose small second moment lasts, an ordinary window's update of the layer under the spike's state is
    as large as the spike's own (x8 its usual): an update clip at twice that held nothing (the helper's trial: 'update-clip
    fails' with the incident's own loss). Its size is the smaller of that and the layer's usual before the interval."""
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("train.batch_size=16", "train.max_steps=170", "log.every=10", "data.shuffle=false",
                          "sched.warmup_steps=0", "sched.decay=constant", "clip.max_norm=null", "log.tensorboard=false"),
                      task=silent_feature_task(), run_dir=run_dir)
    trainer.fit()
    step = next(e["step"] for e in _events(run_dir) if e["kind"] == "incident")
    folder = run_dir / "incidents" / f"step_{step:06d}"
    d = json.loads((folder / "diagnosis.json").read_text())
    assert (d["failure_class"], d["blamed_layer"]) == ("optimizer-state", "a.weight"), d["summary"]
    row = next(r for r in d["surges"] if r["name"] == "a.weight")
    usual = load_bundle(folder)["observed"]["layer_ratios"]["a.weight"]  # the precursor's history before the interval
    assert row["typical_ratio"] == usual and row["ordinary_ratio"] > 4 * usual, row
    clip = next(c for c in candidates_for(d, "fp32", [], []) if c.kind == "update-clip")
    assert clip.ratio == pytest.approx(2 * usual)
    record = search_remedies(folder, silent_feature_task(), steps=6)
    verdict = next(c for c in record["candidates"] if c["name"] == "update-clip")
    assert verdict["verdict"] != "fails", verdict  # it holds the layer: no spike under it
    # without the history (guard.precursor=false, an older bundle): the ordinary windows' as before
    old = {**d, "surges": [{k: v for k, v in r.items() if k != "typical_ratio"} for r in d["surges"]]}
    ordinary = min(r[3] for r in d["jumps"]["update_ratio"] if r[0] == "a.weight")
    assert next(c for c in candidates_for(old, "fp32", [], []) if c.kind == "update-clip").ratio == pytest.approx(2 * ordinary)


def test_a_whole_layer_silent_for_long_is_the_layer_blamed_not_a_layer_downstream_of_it(tmp_path):
    """A new user's case: a layer of its own whose every coordinate had a second moment of 0 (its rare inputs never
    seen) surges whole at step 200, and step 201 spikes. 'Most of a layer surging is the whole step's' dropped it, and
    the verdict blamed the head downstream (22% of its coordinates), whose update clip and Adam eps then failed. The
    whole layer is blamed, measured against the other layers' steady coordinates, its update clip sized from theirs."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=16", "train.max_steps=210", "log.every=10", "data.shuffle=false", "sched.warmup_steps=0",
                "sched.decay=constant", "clip.max_norm=null", "log.tensorboard=false", "log.init_signal=false"),
            task=silent_layer_task(), run_dir=run_dir).fit()
    step = next(e["step"] for e in _events(run_dir) if e["kind"] == "incident")
    folder = run_dir / "incidents" / f"step_{step:06d}"
    d = json.loads((folder / "diagnosis.json").read_text())
    assert (step, d["failure_class"], d["blamed_layer"]) == (201, "optimizer-state", "rare.weight"), d["summary"]
    assert "100% of rare.weight's coordinates" in d["summary"] and "the other layers' steady coordinates" in d["summary"]
    row = next(r for r in d["surges"] if r["name"] == "rare.weight" and r["step"] == 200)
    assert row["whole"] and row["coord_factor"] > 20, row
    usual = load_bundle(folder)["observed"]["layer_ratios"]
    assert "rare.weight" not in usual  # one surging update is no history: the other layers' usual stands for its own
    assert row["typical_ratio"] == pytest.approx(statistics.median(usual.values()))
    clip = next(c for c in candidates_for(d, "fp32", [], []) if c.kind == "update-clip")
    assert (clip.param, clip.ratio) == ("rare.weight", pytest.approx(2 * row["typical_ratio"]))


def test_most_of_the_model_surging_whole_is_the_steps_own_not_a_layer_named():
    """surge_rows: layers surging whole are named only where their second moment was silent and they hold a minority
    of the model's coordinates (each against the other layers' steady moves); else the whole step rose: none named."""
    from stabletrain.diagnostics.spike_evidence import surge_rows

    few, none, every = torch.tensor([True] + [False] * 7), torch.zeros(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool)
    masks = {"rare": (every, 0.0, 0.0), "a": (few, 1e-3, 1e-3), "b": (none, 2e-3, 2e-3)}
    moved = {"rare": torch.full((8,), 0.5), "a": torch.tensor([0.3] + [0.01] * 7), "b": torch.full((8,), 0.01)}
    rows = {r["name"]: r for r in surge_rows(masks, moved)}
    assert rows["rare"]["whole"] and rows["rare"]["coord_factor"] == pytest.approx(50.0)  # 0.5 / the steady 0.01
    assert rows["rare"]["typical_sqrt_v"] == pytest.approx(2e-3) and not rows["a"]["whole"]
    assert rows["a"]["coord_factor"] == pytest.approx(30.0)
    # a layer surging whole whose second moment was not silent (a LayerNorm gain in a data spike's step), or one of
    # fewer than 8 coordinates (a bias, a scalar): the whole step's, not named (a review)
    for name, value in (("ln", (every, 1e-3, 1e-3)), ("scale", (torch.ones(4, dtype=torch.bool), 0.0, 0.0))):
        rows = surge_rows({**masks, name: value}, {**moved, name: torch.full(value[0].shape, 0.5)})
        assert {r["name"] for r in rows} == {"rare", "a"}, name
    masks["b"] = (every, 0.0, 0.0)  # 16 of 24 coordinates in silent layers surging whole: the step's after all
    assert [r["name"] for r in surge_rows(masks, moved)] == ["a"]


def _spike_diagnosis(task, tmp_path, *overrides):
    """(the spike incidents' steps, the first one's diagnosis) of a 30-step run of ``task`` at batch 8."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=30", "optim.lr=0.01",
                *overrides), task=task, run_dir=run_dir).fit()
    steps = [e["step"] for e in _events(run_dir) if e["kind"] == "incident"]
    return steps, json.loads((run_dir / "incidents" / f"step_{steps[0]:06d}" / "diagnosis.json").read_text())


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_spike_the_replay_does_not_reproduce_is_named_not_reproducible(tmp_path, where):
    """A transient fault in the live step (tests/spike_tasks.Glitch, once): in the forward the replay's loss is not
    the run's; in the backward of a data spike the loss is the same (bitwise) and the grad norm is not. Neither is
    blamed on samples, a layer or the state."""
    steps, d = _spike_diagnosis(transient_spike_task(where=where), tmp_path)
    assert steps == [20] and d["failure_class"] == "not reproducible" and d["reproduces"] is False, d["summary"]
    assert (d["bad_samples"], d["blamed_layer"], d["blamed_module"]) == (None, None, None)
    if where == "forward":
        assert d["evidence"].startswith("the replay's loss ") and "differs from the observed" in d["evidence"]
    else:
        assert d["evidence"].startswith("the replay's grad norm ") and "(the loss is the same): suspect state" in d["evidence"]
        assert d["grad_norm"] < d["observed"]["grad_norm"] / 100  # x1000 on one layer's gradients, live only
    assert d["evidence"].endswith(": suspect state the replay does not restore (a loss or a data pipeline with its own "
                                  "state), nondeterministic kernels or a hardware fault"), d["evidence"]  # (what to look at)


def test_remedy_refuses_an_incident_that_does_not_reproduce_where_it_runs(tmp_path):
    """A trial: a NaN made by a hook the rebuilt model lacks (a Hugging Face model's forward hook) did not reproduce in
    `stabletrain remedy`'s new process, where every candidate 'cured' it and lr-x0.5 was named best. The search replays
    the step as it ran first, and refuses a step that is no incident here (the transient glitch: its one live call)."""
    steps, d = _spike_diagnosis(transient_spike_task(), tmp_path)
    assert steps == [20]
    with pytest.raises(ValueError, match=r"replayed here as it ran, step 20 is finite and no spike \(loss [0-9.]+\): the "
                                         r"incident does not reproduce in this process, so no cure can be verified"):
        search_remedies(tmp_path / "run" / "incidents" / "step_000020", task=transient_spike_task())
    assert not (tmp_path / "run" / "incidents" / "step_000020" / "remedy.json").exists()


def test_a_batch_high_as_a_whole_under_the_older_state_is_an_outlier_batch(tmp_path):
    """Every sample of step 20's window is off (no few of them carry it): class data, no sample named, the batch
    itself the outlier, by its loss under the interval's older state."""
    steps, d = _spike_diagnosis(outlier_samples_task(bad=tuple(range(152, 160)), scale=10.0), tmp_path)
    assert steps == [20] and d["failure_class"] == "data" and d["samples"] is None and d["bad_samples"] is None
    assert d["older"]["window_high"] and d["older"]["window"] > 100 * d["older"]["ordinary"]
    # (its three largest losses carry 99% of it, and the five left still make a spike: "no small set carries it" was
    # wrong beside those figures; more than a few of its samples are bad, which the evidence says)
    assert ("its largest losses carry most of it, but more of its samples are bad than a few: without samples "
            in d["evidence"]) and "(a set names at most 3 of the window's 8 samples)" in d["evidence"], d["evidence"]



@pytest.mark.parametrize("bad", [(3170, 3190)])
def test_samples_whose_cost_a_batch_norm_spreads_over_their_window_are_found_by_their_removal(tmp_path, bad):
    """Samples with inputs x50 in a batch norm's window (step 100, batch 32; two of them in either half of it): the
    batch statistics squash every other sample, and the model refuses a batch of one in training, so no sample's own
    loss says which (the diagnosis raised 'Expected more than 1 value per channel'). Each sample dropped from the
    whole window in turn finds them, and the step without them, replayed, is normal."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=32", "log.every=10", "data.shuffle=false", "train.max_steps=110", "optim.lr=0.001"),
            task=batchnorm_outlier_task(bad=bad), run_dir=run_dir).fit()
    assert [e["step"] for e in _events(run_dir) if e["kind"] == "incident"] == [100]
    d = json.loads((run_dir / "incidents" / "step_000100" / "diagnosis.json").read_text())
    assert d["failure_class"] == "data" and d["bad_samples"] == list(bad) and d["samples"]["how"] == "removal", d["summary"]
    assert d["samples"]["why"].startswith("weighing one sample alone failed (ValueError: Expected more than 1 value")
    assert d["samples"]["without"]["ratio"] < 2.0 and "found by dropping samples from the whole window" in d["summary"]
    assert d["passes"]["forward"] < 96  # one pass per sample of the window, and a few more


def test_a_dropout_models_outliers_are_named_by_their_own_losses(tmp_path):
    """Dropout draws other masks for a sample alone than in its window: its own loss still ranks the outliers, and the
    step without them, replayed, is normal (no search by removal needed)."""
    steps, d = _spike_diagnosis(outlier_samples_task(dropout=0.1), tmp_path)
    assert steps == [20] and d["failure_class"] == "data" and d["bad_samples"] == [153, 157], d["summary"]
    assert "how" not in d["samples"] and "carry 99.9% of the window's loss; without them" in d["summary"]


def test_a_data_spike_under_bf16_autocast_is_diagnosed_as_in_fp32(tmp_path):
    """bf16 autocast (no scaler): the replay reproduces within bf16's tolerance, the fp32 step spikes too (no precision
    verdict), and the two planted samples are named and their removal verified."""
    steps, d = _spike_diagnosis(outlier_samples_task(), tmp_path, "precision=bf16")
    assert steps == [20] and d["precision"] == "bf16" and d["reproduces"] is True, d["summary"]
    assert d["fp32"]["spike"] is True and d["failure_class"] == "data" and d["bad_samples"] == [153, 157], d["summary"]
    assert d["samples"]["without"]["ratio"] < 2.0 and "how" not in d["samples"]  # ranked by the samples' own losses


def test_diagnose_and_remedy_on_a_spike_from_the_command_line(tmp_path, capsys):
    """The CLI on a spike's incident, as on a NaN's: diagnose prints its class and the verified samples, remedy the
    candidates that fit a data spike with skip-samples best."""
    from stabletrain.cli import main

    run = tmp_path / "run"
    assert main(["train", "task=spike_tasks:outliers_at_task", "train.batch_size=8", "train.max_steps=30", "log.every=10",
                 "data.shuffle=false", "optim.lr=0.01", f"run.dir={run}", "log.progress=false",
                 "log.tensorboard=false"]) == 0
    capsys.readouterr()
    assert main(["diagnose", str(run)]) == 0
    printed = capsys.readouterr().out
    assert "incidents/step_000020 (step 20, rank 0)" in printed and "failure_class                  data" in printed
    assert "bad_samples                    [153, 157]" in printed and "without them the step is normal (verified" in printed
    assert "  stage " not in printed  # (a finite spike has no non-finite stage: it printed "stage none")
    assert main(["remedy", str(run), "--steps", "5"]) == 0
    printed = capsys.readouterr().out
    rows = [line.split()[:3] for line in printed.splitlines() if line[:1].isdigit()]
    assert rows[0] == ["1", "skip-samples", "cures"] and "drop samples 153, 157" in printed, printed
    assert "best: skip-samples" in printed


def test_a_remedy_candidate_that_never_acted_on_the_spikes_step_says_so(tmp_path, capsys):
    """A rare feature's column under Adam (a new user's trial): the spike at step 126 is optimizer-state; the update clip
    of 'inp.weight' and clip.max_norm replayed to the run's own loss there (0.7798), listed as failing like any other.
    Their evidence says that the change never acted on that step; a candidate that changed the loss says nothing of it."""
    from stabletrain.cli import main

    run = tmp_path / "run"
    assert main(["train", "task=spike_tasks:rare_feature_task", "optim.lr=0.02", "optim.beta1=0.5", "clip.max_norm=null",
                 "optim.weight_decay=0", "sched.warmup_steps=0", "sched.decay=constant", "train.max_steps=130",
                 "data.shuffle=false", f"run.dir={run}", "log.progress=false", "log.tensorboard=false"]) == 0
    assert "spike at step 126: optimizer-state: " in capsys.readouterr().out
    assert main(["remedy", str(run)]) == 0
    rows = {line.split()[1]: line for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()}
    never = "the run's own loss there: the change never acted on this step"
    assert " fails " in rows["update-clip"] and never in rows["update-clip"], rows
    assert never not in rows["lr-x0.5"] and never not in rows["lr-x0.1"], rows


@pytest.mark.parametrize("cls", ["state", "optimizer-state"])
def test_a_spike_on_its_intervals_first_step_replays_from_the_snapshot_before(cls, tmp_path):
    """log.every=2 puts the spike right after a boundary: no step of its interval before it, and the interval's start
    is the spike's own pre-step state. The capture replays from the previous interval's start instead (verified to
    come back bitwise to the interval's snapshot), so the update before the spike and an older state are at hand."""
    factory, kwargs, overrides, step = CASES[cls]
    assert (step - 1) % 2 == 0
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=2", "data.shuffle=false", *overrides), task=factory(**kwargs),
            run_dir=run_dir).fit()
    incident = next(e for e in _events(run_dir) if e["kind"] == "incident")
    assert incident["step"] == step and incident["replayed_steps"] == 2  # from step - 3 to step - 1
    folder = run_dir / "incidents" / f"step_{step:06d}"
    d = json.loads((folder / "diagnosis.json").read_text())
    assert d["failure_class"] == cls and d["reproduces"] is True, d["summary"]
    bundle = load_bundle(folder)
    assert bundle["previous"]["step"] == step - 1 and bundle["reference"]["step"] == step - 3
    if cls == "optimizer-state":
        assert d["blamed_layer"] == "embed.weight" and d["surges"][0]["step"] == step - 1
    else:
        assert d["older"] is not None and not d["older"]["window_high"] and d["bad_samples"] is None
    record = search_remedies(folder, factory(**kwargs), steps=6)
    cured = {c["name"] for c in record["candidates"] if c["verdict"] == "cures"}
    assert CURES[cls] & cured, record["candidates"]
    assert next(c for c in record["candidates"] if c["name"] == "lr-x0.1")["first_step"] == step - 1


def test_on_spike_remedy_finishes_the_run_with_the_remedy_event(tmp_path):
    run_dir = tmp_path / "run"
    factory, kwargs, overrides, step = CASES["data"]
    trainer = Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "guard.on_spike=remedy",
                          "remedy.steps=5", *overrides), task=factory(**kwargs), run_dir=run_dir)
    trainer.fit()
    events = _events(run_dir)
    remedy = [e for e in events if e["kind"] == "remedy"]
    assert trainer.step == 30 and len(remedy) == 1 and remedy[0]["name"] == "skip-samples"
    assert sorted(trainer.stream.drop) == [153, 157]
    skipped = [e["step"] for e in events if e["kind"] == "skip"]
    assert skipped == [step]  # on_spike=remedy skips the spike on the device, then cures what caused it
    # The goodput ledger books the search to the incident, not to validation (it was the residual 'eval_s')
    ledger = [json.loads(x) for x in (run_dir / "goodput.jsonl").read_text().splitlines()]
    searched = trainer.state.remedies.seconds
    assert searched > 0.01 and sum(r.get("incident_s", 0.0) for r in ledger) >= searched
    assert sum(r.get("eval_s", 0.0) for r in ledger) <= 0.5 * searched  # (this task has no validation data)
    # Its report: worth a look (a remedy changed the run mid-way), not 'problems' for an incident the remedy cured.
    from stabletrain.report import health_summary, load_run

    health = health_summary(load_run(run_dir))
    assert health.level == "warn", health.sentences
    assert any(t.startswith("1 incident: at step 20") and "(cured: a remedy was applied for each, below)" in t
               for _, t in health.sentences)



def test_on_spike_remedy_puts_the_module_that_loses_precision_in_fp32_for_the_rest_of_the_run(tmp_path):
    """A precision spike under guard.on_spike=remedy: module-fp32 for the module that made the value in float16 is
    verified and applied live, so the same samples in the next epoch (step 150 at batch 8) no longer spike."""
    run_dir = tmp_path / "run"
    factory, kwargs, overrides, step = CASES["precision"]
    trainer = Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "guard.on_spike=remedy",
                          "remedy.steps=5", *overrides, "train.max_steps=160"), task=factory(**kwargs), run_dir=run_dir)
    trainer.fit()
    events = _events(run_dir)
    (remedy,) = [e for e in events if e["kind"] == "remedy"]
    assert (remedy["step"], remedy["name"], remedy["detail"]) == (step, "module-fp32",
                                                                  "module '0' in fp32 (autocast off around it)")
    assert remedy["reason"].startswith("applied module-fp32"), remedy["reason"]
    assert [e["step"] for e in events if e["kind"] == "spike"] == [step] and trainer.step == 160


def test_a_burst_of_bad_samples_over_consecutive_steps_is_cured_by_dropping_each_windows_outliers(tmp_path):
    """Bad samples in the windows of steps 20, 21 and 22: the diagnosis names step 20's, and dropping those alone
    fails at step 21 (it was 'no remedy applied', and the samples came back every epoch). The skip-samples candidate
    takes the next windows' outliers too, along the burst, and is applied: no later incident, no skipped step after."""
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "guard.on_spike=remedy",
                          "remedy.steps=5", "train.max_steps=30", "optim.lr=0.01"),
                      task=outlier_samples_task(bad=(153, 157, 165, 171)), run_dir=run_dir)
    trainer.fit()
    events = _events(run_dir)
    remedy = [e for e in events if e["kind"] == "remedy"]
    assert len(remedy) == 1 and remedy[0]["name"] == "skip-samples", remedy
    assert sorted(trainer.stream.drop) == [153, 157, 165, 171]
    assert [e["step"] for e in events if e["kind"] in ("skip", "incident")] == [20, 20]
    record = json.loads((run_dir / "incidents" / "step_000020" / "remedy.json").read_text())
    skip = next(c for c in record["candidates"] if c["name"] == "skip-samples")
    assert skip["extended"] == [{"step": 21, "samples": [165]}, {"step": 22, "samples": [171]}]
    assert skip["evidence"].endswith("with the outliers of the windows after it: sample 165 at step 21, sample 171 at step 22")


def test_a_step_met_again_after_each_rollback_keeps_every_capture_in_a_folder_of_its_own(tmp_path):
    """guard.on_spike=rollback over a burst: each rollback skips the spiking window and step 20 meets the next one. The
    three captures of step 20 went into one folder, each overwriting the one before (two diagnoses lost, and the
    events pointed the three incidents at the last); now step_000020, .2, .3, each with its own samples named."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "guard.on_spike=rollback", "ckpt.every=10",
                "train.max_steps=30", "optim.lr=0.01"), task=outlier_samples_task(bad=(153, 157, 165, 171)),
            run_dir=run_dir).fit()
    incidents = [e for e in _events(run_dir) if e["kind"] == "incident"]
    assert [Path(e["path"]).name for e in incidents] == ["step_000020", "step_000020.2", "step_000020.3"]
    named = [json.loads((Path(e["path"]) / "diagnosis.json").read_text())["bad_samples"] for e in incidents]
    assert named == [[153, 157], [165], [171]]
    from stabletrain.report import health_summary, load_run

    text = health_summary(load_run(run_dir)).text  # three incidents, not one 'met 3 times' naming the first's samples
    assert "3 incidents before the rollback" in text and "(met" not in text, text
    assert all(f"data: {s} carr" in text for s in ("samples 153, 157", "sample 165", "sample 171")), text


@pytest.mark.parametrize("further", [True, False])
def test_a_burst_extension_is_taken_only_when_it_gets_past_the_window_it_dropped_from(monkeypatch, further):
    import stabletrain.remedy_search as rs
    from stabletrain.diagnostics.cures import SkipSamples

    inc = SimpleNamespace(step=20, cfg=SimpleNamespace(guard=GuardConfig()))
    first = {"failed": {"step": 21, "kind": "spike"}, "steps_replayed": 2, "seconds": 0.5, "first_step": 20}
    rows = [{"sample": i, "loss_sum": 500.0 if i == 165 else 1.0, "count": 1.0} for i in range(160, 168)]
    replays = []

    def fake_replay(inc, remedy, num_after, probe=None):
        replays.append((remedy.samples, probe))
        if probe is not None:
            return {"probe": rows, "window": [1.0 + 0.01 * i for i in range(40)]}
        return {"failed": None if further else {"step": 21, "kind": "spike"}, "steps_replayed": 7, "seconds": 1.0,
                "first_step": 20}

    monkeypatch.setattr(rs, "_replay", fake_replay)
    out = rs._extended(inc, SkipSamples((153, 157)), first, 6)
    assert replays == [((153, 157), 21), ((153, 157, 165), None)]
    assert out["steps_replayed"] == 2 + 1 + 7 and out["seconds"] == 1.5  # every replay of the candidate counted
    if further:
        assert out["extended"] == [{"step": 21, "samples": [165]}] and out["failed"] is None
    else:  # dropping 165 too still fails at step 21: the candidate stays as it was, its failure its own
        assert "extended" not in out and out["failed"] == first["failed"]


def test_outlier_sets_come_fewest_first_with_non_finite_samples_always_in():
    from stabletrain.diagnostics.spike_evidence import outlier_sets

    rows = [{"sample": i, "loss_sum": v, "count": 1.0} for i, v in enumerate([1.0, 30.0, 1.2, 20.0, 0.9, 1.1, 1.0, 0.8])]
    normal = lambda loss: loss < 2.0  # noqa: E731
    assert list(outlier_sets(rows, normal)) == [[1, 3], [1, 3, 2]]  # the largest alone leaves 20 in; at most 3 of 8
    rows[6]["loss_sum"] = float("nan")
    assert next(outlier_sets(rows, normal)) == [6, 1, 3]
    assert next(outlier_sets(rows, lambda loss: loss < 0.5), None) is None


def test_outlier_sets_never_split_a_tie():
    """A new user's LM: one junk sample (2.98) and six clean ones at exactly 0.009025; the set that made the step normal
    took the junk one and three of the six by their order ('samples 250, 408, 793, 845'), naming clean samples."""
    from stabletrain.diagnostics.spike_evidence import outlier_sets

    losses = [2.98, *[0.009025] * 6, *[0.001] * 9]
    rows = [{"sample": i, "loss_sum": x, "count": 1} for i, x in enumerate(losses)]
    normal = lambda loss: loss < 0.0035  # noqa: E731 - the junk one alone leaves 0.0042 (the six tied ones in)
    assert list(outlier_sets(rows, normal)) == []  # every set under the limit (4 of 16) splits the tie
    assert list(outlier_sets(rows, lambda loss: loss < 0.005)) == [[0]]


def test_three_bad_samples_of_eight_are_a_few_and_larger_sets_stay_below_half():
    """3 flipped labels in a window of 8 carried 99.99% of its loss and were never named (the bar was 2 = 8 // 4)."""
    from stabletrain.diagnostics.spike_evidence import max_outliers, outlier_sets

    assert [max_outliers(n) for n in (2, 4, 6, 8, 16, 64, 256)] == [1, 2, 3, 3, 4, 16, 16]
    rows = [{"sample": i, "loss_sum": v, "count": 1.0} for i, v in enumerate([0.1, 9.0, 0.1, 8.0, 7.5, 0.1, 0.2, 0.1])]
    assert next(outlier_sets(rows, lambda loss: loss < 0.5)) == [1, 3, 4]


def test_the_device_rules_spike_window_is_the_one_it_judged_the_spike_with(tmp_path):
    """guard.on_spike=skip runs the rule on the device, whose window at the boundary holds the interval's later losses:
    the capture reads it once its replay stands just before the spike. The same window as the host rule's (on_spike=warn)
    on the same run up to the spike; the diagnosis's rule test then agrees with the run's (it reproduces)."""
    factory, kwargs, overrides, step = CASES["data"]  # the spike at step 20, its boundary at 21 (a normal step)
    windows = {}
    for action in ("warn", "skip"):
        run_dir = tmp_path / action
        Trainer(cfg("train.batch_size=8", "log.every=7", "data.shuffle=false", f"guard.on_spike={action}", *overrides),
                task=factory(**kwargs), run_dir=run_dir).fit()
        folder = run_dir / "incidents" / f"step_{step:06d}"
        windows[action] = sorted(load_bundle(folder)["observed"]["spike_window"])
        assert json.loads((folder / "diagnosis.json").read_text())["reproduces"] is True
    assert len(windows["skip"]) >= 10 and windows["skip"] == windows["warn"]


def test_a_state_spikes_evidence_names_only_gradients_that_jumped():
    m = {"reproduces": True, "loss": 2.0, "precision": "fp32", "step": 9, "samples": None, "older": None, "surges": [],
         "where": {}, "jumps": {"grad_norm": [["0.bias", 61.7, 6.17, 0.1], ["2.weight", 1.04, 1.04, 1.0]]}}
    out = classify_spike(m)
    assert out["failure_class"] == "state" and out["evidence"].endswith("; gradient jumps: 0.bias x61.7")
    m["jumps"]["grad_norm"] = [["2.bias", 1.0, 1.0, 1.0]]
    assert "gradient jumps" not in classify_spike(m)["evidence"]


def test_samples_are_verified_only_when_the_step_without_them_is_within_the_rules_ratio():
    """A noisy window keeps a step x3 its median under the rule's z-score: that is no 'normal' step. The samples are
    named only once the step without them is also within spike_ratio x the median (here: both outliers dropped)."""
    from stabletrain.spike_samples import weigh_samples as _samples

    losses = {0: 40.0, 1: 16.0, **{i: 1.0 for i in range(2, 8)}}  # per-sample losses of the window's 8 samples

    class Bench:  # the per-sample loss sums and the replayed step's mean loss of a planted window
        def groups(self, indices):
            return [(idx, None) for idx in indices]

        def sums(self, groups):
            return sum(losses[i] for idx, _ in groups for i in idx), sum(len(idx) for idx, _ in groups)

        def step(self, groups):
            s, c = self.sums(groups)
            return {"loss": s / c, "grad_norm": 1.0}

    window = [1.0] * 30 + [0.2] * 10 + [2.4] * 10  # median 1, std ~0.6: x3 is z ~3.4, no spike by the rule
    cfg = GuardConfig()

    def rule(x):
        return spike_test(x, window, cfg)

    assert not rule(3.0)["spike"] and rule(8.0)["spike"]
    bench = Bench()
    _, found, _ = _samples(bench, bench.groups([list(range(8))]), rule, None, cfg.spike_ratio)
    assert found["indices"] == [0, 1] and found["without"]["ratio"] <= cfg.spike_ratio  # [0] alone leaves x3.3
    _, loose, _ = _samples(bench, bench.groups([list(range(8))]), rule, None, math.inf)  # the rule's own bar alone
    assert loose["indices"] == [0]


def test_what_is_usual_comes_from_every_ordinary_window_not_the_first():
    """The update clip's limit is twice the layer's usual update ratio: the smallest over the ordinary windows, one
    of which may hold the surging update itself (the first of them did at log.every=1: a limit 10x too loose)."""
    from stabletrain.counterfactual import _typical

    steps = [{"grad_norms": {"embed.weight": g}, "update_ratios": {"embed.weight": r}}
             for g, r in ((3.0, 0.0617), (1.0, 0.0183), (1.2, 0.0062))]
    assert _typical(steps) == {"grad_norms": {"embed.weight": 1.2}, "update_ratios": {"embed.weight": 0.0062}}


def test_a_spikes_rollback_goes_to_a_checkpoint_before_what_caused_it():
    """optimizer-state: before the surging update (its checkpoint after it cannot undo it); state: before the step
    before the spike (a lower LR from there is its own candidate). None when no checkpoint is that old."""
    surges = [{"name": "embed.weight", "step": 75, "coord_factor": 90.0}, {"name": "embed.weight", "step": 72,
                                                                          "coord_factor": 84.0}]
    d = {"anomaly": "spike", "reproduces": True, "step": 75, "failure_class": "optimizer-state",
         "blamed_layer": "embed.weight", "surges": surges, "jumps": {}}

    def rollbacks(diagnosis, steps):
        return sorted({c.step for c in candidates_for(diagnosis, "fp32", [], steps) if c.kind == "rollback-lr"})

    assert rollbacks(d, [0, 60, 72, 74]) == [60]
    d.update(failure_class="state", blamed_layer=None)
    assert rollbacks(d, [0, 60, 72, 74]) == [72]
    assert rollbacks(d, [74]) == []


def test_a_state_spikes_evidence_does_not_call_lower_losses_high_against_a_higher_older_state():
    """The older state may itself be in a spike: ordinary windows then are high by the rule under this state and higher
    still under that one; 'high 0.2589 under this one (vs 0.8836)' read as a contradiction."""
    base = {"reproduces": True, "loss": 2.0, "precision": "fp32", "step": 146, "samples": None, "surges": [], "where": {},
            "jumps": {}}
    older = {"step": 140, "window": 0.8755, "ordinary": 0.8836, "current_ordinary": 0.2589, "window_high": False,
             "ordinary_high": True}
    text = classify_spike({**base, "older": older})["evidence"]
    assert ("ordinary windows are a spike by the guard's rule at 0.2589 under this one, and higher still under that "
            "state (0.8836): the loss has been unsettled since") in text, text  # (it read '... itself no calm one)')
    text = classify_spike({**base, "older": {**older, "ordinary": 0.1, "current_ordinary": 0.9}})["evidence"]
    assert "ordinary windows are high at 0.9 under this one (vs 0.1)" in text, text


def test_the_onset_of_the_intervals_largest_burst_is_the_spike_captured(tmp_path, capsys):
    """Two spikes apart in one interval: two outlier samples at step 14, four at step 19 (a larger loss): one capture
    per interval, of the larger (the first may be an aftershock of an earlier one and must not hide a new one). A burst
    on consecutive steps (a divergence) is captured at its first step."""
    assert spike_to_capture([64, 65, 66, 67, 68, 69], {64: 0.8, 65: 0.85, 66: 1.2, 67: 3.0, 68: 9.0, 69: 30.0}) == 64
    assert spike_to_capture([101, 103], {101: 0.3, 103: 3.6}) == 103
    assert spike_to_capture([12, 13, 17], {12: 5.0, 13: 2.0, 17: 5.0}) == 12  # a tie: the earlier
    # A divergence's spikes with a calm step between: the later one about as large is its course, not a new burst
    assert spike_to_capture([101, 102, 104], {101: 0.21, 102: 0.2373, 104: 0.2555}) == 101
    # A burst between negligible losses (its peak below the floor) is never the one captured; one that rises past the
    # floor is captured at its onset, even where that step's loss is still below it (a trial's Adam wander at ~1e-4)
    assert spike_to_capture([61, 65], {61: 1e-5, 65: 1.2e-5}, floor=1.1e-5) == 65  # (without a floor: 61)
    assert spike_to_capture([61, 65], {61: 1e-5, 65: 1.05e-5}, floor=1.1e-5) is None
    assert spike_to_capture([230, 231, 232], {230: 1e-4, 231: 1.3e-4, 232: 6.9e-4}, floor=5.8e-4) == 230
    run_dir = tmp_path / "run"
    task = outlier_samples_task(bad=(105, 109, 145, 146, 147, 149))
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=20", "optim.lr=0.01"),
            task=task, run_dir=run_dir).fit()
    events = _events(run_dir)
    spikes = {e["step"]: e["loss"] for e in events if e["kind"] == "spike"}
    assert {14, 19} <= set(spikes) and 18 not in spikes and spikes[19] > spikes[14], spikes
    assert [e["step"] for e in events if e["kind"] == "incident"] == [19]
    d = json.loads((run_dir / "incidents" / "step_000019" / "diagnosis.json").read_text())
    assert d["failure_class"] == "data" and d["step"] == 19, d["summary"]
    # its line says the spike before it that it was chosen over (a trial: 'spike at step 124' where spikes began at 121)
    assert ("stabletrain: spike at step 19 (after the interval's spike at step 14, not captured: a larger burst is): data: "
            in capsys.readouterr().out)


def test_on_spike_remedy_applies_live_only_what_starts_where_its_replay_did_and_never_twice(tmp_path):
    """Every flagged step is skipped live: a lower LR verified from the step before the spike changes an update the
    run has made already. Applied live it cured nothing, the same spikes came back and it was applied again, until 20
    skipped steps stopped the run. Now the cure applied rolls back to a checkpoint, and the run trains to its end."""
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("optim.name=sgd", "optim.lr=1.0", "optim.weight_decay=0", "clip.max_norm=null",
                          "sched.warmup_steps=300", "sched.decay=constant", "train.batch_size=32", "train.max_steps=100",
                          "log.every=7", "ckpt.every=21", "guard.on_spike=remedy"), task=sgd_regression_task(),
                      run_dir=run_dir)
    trainer.fit()
    applied = [e for e in _events(run_dir) if e["kind"] == "remedy" and e.get("name")]
    assert trainer.step == 100 and trainer.state.stop_reason is None
    assert applied and applied[0]["incident_step"] == 64 and applied[0]["remedy"]["kind"] == "rollback-lr", applied
    assert applied[0]["at_step"] < 63  # back to a checkpoint before the update that led into the spike
    # the cures ranked above it that cannot apply live are said, and why (a trial read remedy.json's best beside a
    # rollback applied, with no word of it)
    record = json.loads((run_dir / "incidents" / "step_000064" / "remedy.json").read_text())
    above = [c["name"] for c in record["candidates"][:[c["name"] for c in record["candidates"]].index(applied[0]["name"])]
             if c["verdict"] == "cures" and not c["baseline"]]
    assert above and applied[0]["passed_over"] == "; ".join(
        f"{n} cures it too but from the update of step 63, which the run has made already" for n in above[:3]), applied[0]
    pairs = [(e["incident_step"], e["name"]) for e in applied]
    assert len(pairs) == len(set(pairs))
    # Goodput: the remedy's rollback is in the ledger (the steps trained again are redone, none counted twice), and
    # the search before it is incident time.
    ledger = [json.loads(x) for x in (run_dir / "goodput.jsonl").read_text().splitlines()]
    back = [r for r in ledger if r["kind"] == "rollback"]
    assert [(r["from"], r["to"]) for r in back][:1] == [(applied[0]["from_step"], applied[0]["at_step"])], back
    assert all(r["steps"] >= 0 and r["eval_s"] <= r["wall_s"] for r in ledger if r["kind"] == "interval")
    after = next(r for r in ledger if r["kind"] == "interval" and r["t"] > back[0]["t"])
    search_s = json.loads((Path(applied[0]["incident"]) / "remedy.json").read_text())["timings"]["total_s"]
    assert after["incident_s"] >= 0.9 * search_s, (after, search_s)
    # no validation in this run: an interval's capture and search are incident time, not evaluation as well (eval_s was
    # the wall time less the steps': the incident's seconds counted twice, 'lost: 28.6% evaluation, 28.5% incidents')
    assert all(r["eval_s"] < 0.1 * r["incident_s"] + 0.05 for r in ledger if r["kind"] == "interval" and r["incident_s"] > 0.5)
    # The rest of that interval's wall is the save the capture waited for (slow under load: it failed the test once
    # when the incident alone was asked to be half of it) and its few steps.
    assert after["incident_s"] + after["checkpoint_s"] > 0.5 * after["wall_s"], after
    g = read_goodput(run_dir)
    assert g.seconds["redone"] > 0 and sum(g.seconds.values()) == pytest.approx(g.total_s)
    assert all(0 <= g.share(p) <= 1 for p in g.seconds)


def test_after_skipped_steps_no_update_is_blamed_and_an_older_checkpoint_is_the_older_state(tmp_path):
    """guard.on_spike=skip skips every step of a burst: the spike captured in the next interval follows steps that
    made no update. Its diagnosis must not blame 'the update of step 70' (never made) nor weigh it against 'the state of
    step 63' (the same weights: 'high 0.83 under this one (vs 0.83)'): the older state is the newest checkpoint whose
    weights differ (step 42; step 63's are the spike's own), under which the window is normal."""
    run_dir = tmp_path / "run"
    Trainer(cfg("optim.name=sgd", "optim.lr=1.0", "optim.weight_decay=0", "clip.max_norm=null", "sched.warmup_steps=300",
                "sched.decay=constant", "train.batch_size=32", "train.max_steps=77", "log.every=7", "ckpt.every=21",
                "guard.on_spike=skip", "guard.max_consecutive_skips=100"), task=sgd_regression_task(), run_dir=run_dir).fit()
    events = _events(run_dir)
    skipped = {e["step"] for e in events if e["kind"] == "skip"}
    assert set(range(64, 72)) <= skipped
    assert [e["step"] for e in events if e["kind"] == "incident"][:2] == [64, 71]
    folder = run_dir / "incidents" / "step_000071"
    bundle = load_bundle(folder)
    assert bundle["previous"] is None and (bundle["reference"]["step"], bundle["reference"]["from"]) == (42, "checkpoint")
    d = json.loads((folder / "diagnosis.json").read_text())
    assert "in the update of step" not in d["summary"] and d["failure_class"] == "state", d["summary"]
    assert (d["older"]["step"], d["older"]["from"], d["older"]["window_high"]) == (42, "checkpoint", False)
    assert "the window is normal under the state of step 42" in d["summary"]


def test_a_spike_remedys_fallback_rollback_skips_the_spikes_window_and_counts_against_max_rollbacks(tmp_path):
    """A review: remedy.fallback=rollback went back to LAST_GOOD without skipping the spike's window (only
    on_spike=rollback did) and without counting the rollback (guard.max_rollbacks never reached): a spike its data
    diagnosis does not name samples for met the same window and RNG again, forever. Samples 153 and 157 spike at
    step 20; no remedy may be applied (remedy.max_applied=0)."""
    factory, kwargs, overrides, step = CASES["data"]

    def run(name, *more):
        trainer = Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "guard.on_spike=remedy",
                              "remedy.max_applied=0", "remedy.fallback=rollback", "ckpt.every=10", "log.tensorboard=false",
                              *overrides, *more), task=factory(**kwargs), run_dir=tmp_path / name)
        trainer.fit()
        return trainer, _events(tmp_path / name)

    trainer, events = run("once", "guard.max_rollbacks=1")
    (rollback,) = [e for e in events if e["kind"] == "rollback"]
    assert (rollback["from_step"], rollback["to_step"], rollback["skipped_windows"]) == (20, 10, [[0, 19]]), rollback
    assert trainer.guard.num_rollbacks == 1 and trainer.step == 30  # counted; the run went on past the window
    trainer, events = run("capped", "guard.max_rollbacks=0")
    (fallback,) = [e for e in events if e["kind"] == "remedy"]
    assert fallback["fallback"] == "rollback (a stop: 0 rollbacks already, guard.max_rollbacks)", fallback
    assert not [e for e in events if e["kind"] == "rollback"] and trainer.step == 20, trainer.step
    assert trainer.stop_reason.endswith("remedy.fallback=rollback, after 0 rollbacks (guard.max_rollbacks)"), \
        trainer.stop_reason


def test_an_uncaptured_spike_under_on_spike_remedy_says_its_step_and_why(tmp_path, capsys):
    """capture.max_spikes spent: the remedy event names the spike's step and that reason (not 'step None', not
    capture.incidents=false), and the console says it too."""
    run_dir = tmp_path / "run"
    factory, kwargs, overrides, step = CASES["data"]
    from stabletrain.config import config_from_dict, config_to_dict

    # (load_config refuses on_spike=remedy with capture.max_spikes=0 now; a config read back from a run still holds it)
    saved = config_to_dict(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "guard.on_spike=remedy",
                               *overrides))
    saved["capture"]["max_spikes"] = 0
    Trainer(config_from_dict(saved), task=factory(**kwargs), run_dir=run_dir).fit()
    remedy = [e for e in _events(run_dir) if e["kind"] == "remedy"]
    assert len(remedy) == 1 and remedy[0]["reason"].startswith(
        f"no remedy applied for the incident at step {step}: the incident was not captured (the run's spike captures "
        "are spent: capture.max_spikes=0)"), remedy
    assert remedy[0]["incident_step"] == step and remedy[0]["fallback"] == "skip"  # what the report groups by
    assert remedy[0]["why"].startswith("the incident was not captured (the run's spike captures are spent")
    assert f"stabletrain: {remedy[0]['reason']}" in capsys.readouterr().out


def test_a_spike_in_the_first_steps_is_flagged_and_falling_losses_are_not():
    """The rule arms at 4 losses (it armed at spike_window/2 = 25: a x1e4 loss at step 6 passed); until the window
    is half full a spike must also exceed spike_ratio^2 x the largest loss so far."""
    healthy = [5.5 * math.exp(-0.2 * i) + 0.01 * random.Random(i).random() for i in range(30)]
    for losses, spikes in ((healthy, []), (healthy[:5] + [healthy[5] * 1e4] + healthy[6:], [5]),
                           ([0.3, 0.6, 0.4, 0.5, 1.14, 0.7], []),  # a small batch's noise: 2.5x the median, z 6
                           ([0.3, 0.6, 0.4, 0.5, 2.5, 0.7], [4])):  # above 4x the largest
        device = Guard(GuardConfig(), torch.device("cpu"))
        device.on_device = True  # the rule on the device (guard.on_spike=skip) over the same losses
        on_device = [i for i, v in enumerate(losses) if bool(device.observe(torch.tensor(v), torch.tensor(1.0))[2])]
        host = Guard(GuardConfig(), torch.device("cpu"))
        rows = [SimpleNamespace(step=i + 1, values={"loss": v, "finite": 1.0}) for i, v in enumerate(losses)]
        host.mark_spikes(rows)
        assert on_device == [r.step - 1 for r in rows if r.values["spike"]] == spikes


def test_the_first_steps_outlier_line_names_what_the_rule_holds_out():
    """[1, 100, 2, 80]: the rule holds step 2 out (x100 its largest counted loss), step 3 clears it, and holds step 4 out
    too (x40 the largest it counts, 2); the line named step 2 only, weighing step 4 against the 100 it does not count."""
    from stabletrain.policies.spike_rule import unjudged_outliers

    said = unjudged_outliers([(1, 1.0), (2, 100.0), (3, 2.0), (4, 80.0)], GuardConfig())
    assert [(step, factor) for step, _, factor, _ in said] == [(2, 100.0), (4, 40.0)], said
    assert said[1][3] == "the largest loss before it (but step 2's, itself an outlier)"
    host = Guard(GuardConfig(), torch.device("cpu"))  # the rule holds out the same two: 2 losses counted, not 4
    host.mark_spikes([SimpleNamespace(step=i + 1, values={"loss": v, "finite": 1.0}) for i, v in enumerate([1, 100, 2, 80])])
    assert int(host.num_seen) == 2
    # a run of them in a row (a divergence from its first steps) is said once, at its first
    assert [t for t, *_ in unjudged_outliers([(1, 2.3), (2, 1e4), (3, 1e5), (4, 1e6)], GuardConfig())] == [2]


def test_spike_test_agrees_with_the_host_rule():
    gen = random.Random(3)
    losses = [2.0 + 0.1 * gen.random() for _ in range(200)]
    for i in range(10, 200, 23):
        losses[i] *= 3.0
    host = Guard(GuardConfig(spike_window=20), torch.device("cpu"))
    rows = [SimpleNamespace(step=i + 1, values={"loss": v, "finite": 1.0}) for i, v in enumerate(losses)]
    window: list[float] = []
    for row in rows:
        verdict = spike_test(row.values["loss"], window, host.cfg)
        host.mark_spikes([row])
        assert verdict["spike"] == (row.values["spike"] > 0.5), row.step
        if not verdict["spike"]:
            window = [*window, row.values["loss"]][-20:]
    assert sum(r.values["spike"] for r in rows) >= 5


def _flagged(losses: list[float]) -> list[int]:
    """The steps the guard's host rule flags in ``losses`` (steps 1..n), fed as the loop feeds it: 10 rows an interval."""
    curve = default_gpt_curve.load()
    guard = Guard(load_config(None, curve["overrides"]).guard, torch.device("cpu"))
    rows = [SimpleNamespace(step=step, values={"loss": loss, "finite": 1.0}) for step, loss in enumerate(losses, 1)]
    for start in range(0, len(rows), 10):
        guard.mark_spikes(rows[start:start + 10])
    return [row.step for row in rows if row.values["spike"]]


def test_the_default_gpt_runs_300_losses_hold_no_spike_by_the_guards_own_rule():
    """The issue's bar (#32): the default gpt run, whole, ends with no spike flagged. Its 300 per-step losses are stored
    (``default_gpt_curve.py``: trained in every suite run, it was the suite's longest test) and the guard's host rule runs
    over them; the same curve with a spike planted early (step 6, x1e4, before the window is half full) and late is
    flagged at exactly those steps."""
    curve = default_gpt_curve.load()
    assert len(curve["losses"]) == 300 and curve["spikes"] == [] and curve["losses"][0] > 2 * curve["losses"][-1]
    assert _flagged(curve["losses"]) == []
    # the stored run's schedule is still the config's, all 300 steps (the live test below trains only the first 30)
    c = load_config(None, curve["overrides"])
    lrs = [float(lr_factor(torch.tensor(float(n)), c.sched.warmup_steps, c.train.max_steps, c.sched.decay,
                           c.sched.min_lr_ratio)) * c.optim.lr for n in range(1, 301)]
    assert lrs == pytest.approx(curve["lrs"], rel=1e-5), "the default schedule changed: OMP_NUM_THREADS=1 python " \
                                                          "tests/default_gpt_curve.py writes the curve again"
    planted = list(curve["losses"])
    planted[5] *= 1e4
    planted[199] *= 10
    assert _flagged(planted) == [6, 200]


@pytest.mark.slow  # (30 steps of the default gpt: ~10 s)
def test_the_default_gpt_run_still_trains_the_stored_curve_and_its_first_steps_raise_no_spike(tmp_path):
    """The stored curve is the default run's: its first 30 steps, trained live on the run's own schedule (the run stopped
    there), give the stored losses, and the live rule flags none of them (where the losses fall fastest)."""
    curve = default_gpt_curve.load()
    seen = default_gpt_curve.train(tmp_path / "run", stop_after=30)
    assert len(seen.losses) == 30 and seen.spikes == []
    same_torch = curve["torch"] == torch.__version__  # (another CPU's kernels may round differently: not bitwise)
    assert seen.losses == pytest.approx(curve["losses"][:30], rel=1e-3 if same_torch else 5e-2), (
        f"the default gpt run no longer trains the stored curve (stored with torch {curve['torch']}); if the change "
        "is meant, write it again: OMP_NUM_THREADS=1 python tests/default_gpt_curve.py")


def test_an_adapter_spike_gets_the_same_doctor(tmp_path):
    """Monitor over a plain loop: the same capture and counterfactual replays; samples are positions in the step."""
    from spike_tasks import _mse

    from stabletrain import Monitor

    task = outlier_samples_task()
    torch.manual_seed(0)
    opt = torch.optim.AdamW(task.model.parameters(), lr=0.01, fused=True)
    with Monitor(task.model, opt, run_dir=tmp_path / "run", log_every=10, loss_fn=_mse) as monitor:
        for step in range(30):
            batch = task.train_data[step * 8:(step + 1) * 8]
            with monitor.autocast():
                loss = _mse(task.model, batch)
            monitor.backward(loss, batch)
            monitor.step()
    (incident,) = [e for e in _events(tmp_path / "run") if e["kind"] == "incident"]
    d = incident["diagnosis"]
    assert (incident["step"], incident["anomaly"], d["failure_class"], d["bad_samples"]) == (20, "spike", "data", [1, 5])
    assert d["bad_positions"] == [{"micro_batch": 0, "position": 1}, {"micro_batch": 0, "position": 5}]


def test_an_adapter_spike_opening_its_interval_gets_untestable_not_fails_for_remedies_that_change_updates(tmp_path,
                                                                                                        monkeypatch):
    """log_every=19 puts the spike (step 20) first in its interval: the bundle holds its step alone (on a host where one
    snapshot fits, not two: with two the adapter replays from the snapshot before, as the built-in loop does). A lower LR
    or a clip changes only the update after the spike's loss: its one-step replay cannot show an effect ('untestable'),
    where 'fails' said it had been tried and found wanting; dropping the named samples is testable and cures."""
    from spike_tasks import _mse

    monkeypatch.setattr("stabletrain.records.staging.host_memory_available", lambda: 0)

    from stabletrain import Monitor

    task = outlier_samples_task()
    torch.manual_seed(0)
    opt = torch.optim.AdamW(task.model.parameters(), lr=0.01, fused=True)
    with Monitor(task.model, opt, run_dir=tmp_path / "run", log_every=19, loss_fn=_mse,
                 model_factory="spike_tasks:regression_mlp") as monitor:
        for step in range(24):
            batch = task.train_data[step * 8:(step + 1) * 8]
            loss = _mse(task.model, batch)
            monitor.backward(loss, batch)
            monitor.step()
    (incident,) = [e for e in _events(tmp_path / "run") if e["kind"] == "incident"]
    assert incident["step"] == 20 and incident["diagnosis"]["failure_class"] == "data"
    record = search_remedies(tmp_path / "run" / "incidents" / "step_000020")
    verdicts = {c["name"]: c["verdict"] for c in record["candidates"]}
    assert verdicts["skip-samples"] == "cures", record["candidates"]
    changes_updates = {n for n in verdicts if n.startswith(("lr-", "clip", "update-clip", "adam-eps"))}
    assert changes_updates and {verdicts[n] for n in changes_updates} == {"untestable"}, verdicts
    baseline = next(c for c in record["candidates"] if c["baseline"])
    assert baseline["evidence"].endswith("on_spike='skip' does this live"), baseline  # (a spike's; a NaN's: on_nonfinite)


def test_an_adapter_spikes_summary_says_where_in_the_step_each_blamed_sample_is(tmp_path):
    """An adapter numbers a step's samples by their place in it: with two micro-batches 'sample 5' alone did not say
    which; the summary (the console line) says micro-batch and position, as diagnosis.json's bad_positions do."""
    from spike_tasks import _mse

    from stabletrain import Monitor

    task = outlier_samples_task()  # samples 153 and 157: step 20's micro-batches (152-155, 156-159), position 1 of each
    torch.manual_seed(0)
    opt = torch.optim.AdamW(task.model.parameters(), lr=0.01, fused=True)
    with Monitor(task.model, opt, run_dir=tmp_path / "run", log_every=10, loss_fn=_mse) as monitor:
        for step in range(30):
            for lo in (step * 8, step * 8 + 4):
                batch = task.train_data[lo:lo + 4]
                with monitor.autocast():
                    loss = _mse(task.model, batch) / 2
                monitor.backward(loss, batch)
            monitor.step()
    d = json.loads((tmp_path / "run" / "incidents" / "step_000020" / "diagnosis.json").read_text())
    assert d["failure_class"] == "data" and d["bad_positions"] == [{"micro_batch": 0, "position": 1},
                                                                   {"micro_batch": 1, "position": 1}]
    assert d["summary"].endswith("(in the step's batch: sample 1 is micro-batch 0, position 1; sample 5 is micro-batch 1, "
                                 "position 1)"), d["summary"]


def test_the_rank_with_the_largest_loss_is_found_and_a_ranks_failure_reaches_every_rank():
    from types import SimpleNamespace

    from stabletrain.distributed.blame import largest_loss_rank

    def group(*answers):
        return SimpleNamespace(gather_objects=lambda mine: [mine, *answers])

    assert largest_loss_rank(group((9.0, None), (1.0, None)), 0.5, None) == [1]
    assert largest_loss_rank(group((float("nan"), None)), float("nan"), None) is None
    with pytest.raises(RuntimeError, match=r"^rank 1 failed computing its own loss on the spike's window: OSError: gone$"):
        largest_loss_rank(group((float("nan"), "OSError: gone")), 0.5, None)  # this rank answered, rank 1 raised
    with pytest.raises(ValueError, match="mine"):
        largest_loss_rank(group((1.0, None)), float("nan"), ValueError("mine"))


def test_an_adapters_spike_window_under_on_spike_skip_is_the_one_the_rule_judged(tmp_path, capfd):
    """Under guard.on_spike=skip the rule runs on the device; an adapter's replay does not run it, so the window at
    the capture was the boundary's (the interval's later losses in it): the spike's diagnosis read another median
    than under warn for the same history. Rebuilt from the interval's start, it is the same window."""
    from spike_tasks import _mse

    from stabletrain import Monitor

    windows = {}
    for on_spike in ("warn", "skip"):
        task = outlier_samples_task(bad=(113, 117))  # step 15, mid-interval
        torch.manual_seed(0)
        opt = torch.optim.AdamW(task.model.parameters(), lr=0.01, fused=True)
        run_dir = tmp_path / on_spike
        with Monitor(task.model, opt, run_dir=run_dir, log_every=10, loss_fn=_mse, on_spike=on_spike) as monitor:
            for step in range(30):
                batch = task.train_data[step * 8:(step + 1) * 8]
                loss = _mse(task.model, batch)
                monitor.backward(loss, batch)
                monitor.step()
        windows[on_spike] = load_bundle(run_dir / "incidents" / "step_000015")["observed"]["spike_window"]
        # (a trial: an adapter prints no last line counting skipped steps, so its console never said the spike's was)
        spike_lines = [x for x in capfd.readouterr().out.splitlines() if "at step 15" in x]
        assert len(spike_lines) == 1 and spike_lines[0].startswith(
            "stabletrain: spike (skipped: on_spike=skip) at step 15: " if on_spike == "skip" else
            "stabletrain: spike at step 15: "), spike_lines
    assert len(windows["warn"]) == 14 and sorted(windows["skip"]) == sorted(windows["warn"])


def test_a_spike_the_gradscaler_skipped_is_said_skipped_by_the_overflow_not_by_on_spike(tmp_path, capfd):
    """A review: a spike whose gradients overflowed under on_spike=warn (the GradScaler skipped it) was said 'spike
    (skipped: on_spike=warn)'."""
    from spike_tasks import _mse

    from stabletrain import Monitor

    task = outlier_samples_task(bad=(113, 117))  # step 15
    torch.manual_seed(0)
    opt = torch.optim.AdamW(task.model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=10 ** 6)
    with Monitor(task.model, opt, run_dir=tmp_path / "run", log_every=10, loss_fn=_mse, on_spike="warn",
                 scaler=scaler) as monitor:
        for step in range(30):
            batch = task.train_data[step * 8:(step + 1) * 8]
            monitor.backward(_mse(task.model, batch), batch)
            if step == 14:  # the spike step's gradient overflows, as float16's would
                next(task.model.parameters()).grad[0, 0] = float("inf")
            monitor.step()
    lines = [x for x in capfd.readouterr().out.splitlines() if "at step 15" in x]
    assert len(lines) == 1 and lines[0].startswith("stabletrain: spike (skipped: fp16 overflow) at step 15: data: "), lines


def test_a_skipped_spike_that_is_not_captured_says_it_was_skipped_too(tmp_path):
    """A review: the skipped spike's label was on the diagnosis line only; a Monitor without loss_fn (no capture) said
    'the spike at step 15 was not captured', not that its step was skipped."""
    from spike_tasks import _mse

    from stabletrain import Monitor

    task = outlier_samples_task(bad=(113, 117))  # step 15
    torch.manual_seed(0)
    opt = torch.optim.AdamW(task.model.parameters(), lr=0.01, fused=True)
    with pytest.warns(UserWarning) as seen, Monitor(task.model, opt, run_dir=tmp_path / "run", log_every=10,
                                                     on_spike="skip") as monitor:
        for step in range(30):
            batch = task.train_data[step * 8:(step + 1) * 8]
            monitor.backward(_mse(task.model, batch), batch)
            monitor.step()
    said = [str(w.message) for w in seen if "not captured" in str(w.message)]
    assert said and said[0].startswith("the spike (skipped: on_spike=skip) at step 15 was not captured: "), said


def test_the_readme_spike_example_prints_what_the_readme_shows(tmp_path, capsys):
    """The docs' worked example (docs/loss-spikes.md, examples/spike_task.py): the spike line and the remedy table's candidates,
    ranking, verdicts and what each does, as on this page (its numbers within 5%: another CPU rounds the last digits)."""
    from pathlib import Path

    from test_remedy import table_rows

    from stabletrain.cli import main

    readme = (Path(__file__).parents[1] / "docs" / "loss-spikes.md").read_text(encoding="utf-8")
    block = readme.split("# Loss spikes", 1)[1].split("\n```\n", 2)[1]
    run = tmp_path / "spike"
    assert main(["train", "task=examples.spike_task:make_task", "train.batch_size=8", "train.max_steps=80",
                 "log.every=10", "data.shuffle=false", "sched.warmup_steps=0", "sched.decay=constant", f"run.dir={run}",
                 "log.progress=false", "log.tensorboard=false"]) == 0
    printed = capsys.readouterr().out
    spike_line = next(x for x in block.splitlines() if x.startswith("stabletrain: spike at step 75"))
    assert spike_line.split(" (all of it: ")[0] in printed  # (the rest of its evidence: stabletrain diagnose, the path's)
    assert f"(all of it: stabletrain diagnose {run}/incidents/step_000075); reproduces on replay" in printed
    assert main(["remedy", str(run), "--steps", "6"]) == 0
    printed = capsys.readouterr().out.splitlines()[2:]
    shown = block.split("--steps 6\n", 1)[1].splitlines()[2:]
    (ours, _), (theirs, _) = table_rows(printed), table_rows(shown)
    assert [r[:5] for r in ours] == [r[:5] for r in theirs] and len(ours) == 9  # the header and 8 candidates, ranked

    def end_losses(lines):
        start = lines[0].index("end loss")
        return [float(x) for x in (line[start:].split()[0] for line in lines[1:9]) if x != "-"]

    assert end_losses(printed) == pytest.approx(end_losses(shown), rel=0.05)
    # The README's short version of the same example: its lines are the page's (checked above), cut short.
    front = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    short = front.split("### Loss spikes", 1)[1].split("\n```\n", 2)[1].splitlines()
    page = block.splitlines()
    assert short[:2] == page[:2] and short[-1] == page[-2] == "best: update-clip"
    line = next(x for x in short if x.startswith("stabletrain: spike at step 75"))
    assert line.endswith("; ...") and spike_line.startswith(line[:-len("; ...")])
    header = page.index(next(x for x in page if x.startswith("#  candidate")))
    assert short[short.index(page[header]):-2] == page[header:header + 4]  # the header and the first three rows,
    assert len(table_rows(printed)[0]) > 3 and short[-2] == "... (the other candidates and their verdicts)", short[-2]


def test_a_data_spikes_samples_that_other_samples_match_are_said_to_be_of_a_kind_the_data_holds(tmp_path):
    """A new user's healthy CNN: two confidently wrong samples in one batch of 16 made a spike (x2.8 the median), and the
    diagnosis named them as a data spike, 'verified', as if they were bad rows. Their losses are weighed against the
    run's other samples: here the dataset holds more like them (scaled targets the run has not reached yet), and the
    evidence says the data holds such samples (its tail, or a recurring defect), this window several at once."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=30", "optim.lr=0.01"),
            task=outlier_samples_task(bad=(153, 157, 241, 243, 245, 247, 249, 251)), run_dir=run_dir).fit()
    d = json.loads((run_dir / "incidents" / "step_000020" / "diagnosis.json").read_text())
    assert d["failure_class"] == "data" and d["bad_samples"] == [153, 157], d["summary"]
    assert sorted(r["sample"] for r in d["tail"]["samples"]) == [153, 157] and min(r["reach"] for r in d["tail"]["samples"]) >= 1
    assert re.search(r"; of 248 other samples weighed under this state, (some are|one is) as lossy "
                     r"\(15[37] \([\d.]+: [1-6] reach(es)? "
                     r"it\), 15[37] \([\d.]+: [1-6] reach(es)? it\)\): the data holds such samples \(hard ones of the loss's "
                     r"own tail, or a recurring defect: label noise, a bad shard\), and this window drew several at once; "
                     r"the window is high under the state of step", d["summary"]), d["summary"]
    # (a review: one sample of the kind is no 'they', nor 'drawn together'; 1 other 'reaches' it)
    one = {"of": 40, "largest": 2.0, "samples": [{"sample": 7, "loss": 1.5, "reach": 1}]}
    assert tail_note(one) == ("of 40 other samples weighed under this state, one is as lossy (7 (1.5: 1 reaches it)): the data "
                              "holds such samples (hard ones of the loss's own tail, or a recurring defect: label noise, a bad "
                              "shard)")  # (a review: 'some are as lossy' where one was)
    assert "some are as lossy" in tail_note({**one, "samples": [{"sample": 7, "loss": 1.5, "reach": 2}]})
    assert tail_note({**one, "samples": [{"sample": 7, "loss": 3.0, "reach": 0}]}) == (
        "it is beyond all 40 other samples weighed under this state (they reach 2 at most): rare in the data (a corrupt row, "
        "or one the model has not learned yet)")
    # beyond a few others (an adapter's kept windows, a batch of one) is not called rare in the data (a review: 'beyond all
    # 3 other samples: rare in the data')
    assert tail_note({**one, "of": 3, "samples": [{"sample": 7, "loss": 3.0, "reach": 0}]}) == (
        "it is beyond all 3 other samples weighed under this state (they reach 2 at most): too few to tell whether that is "
        "rare in the data (a draw of 32 or more does)")
    # some beyond every other, some reached: each said (untested before)
    mixed = {**one, "samples": [{"sample": 7, "loss": 3.0, "reach": 0}, {"sample": 9, "loss": 1.5, "reach": 4}]}
    assert tail_note(mixed) == ("sample 7 is beyond all 40 other samples weighed under this state (they reach 2 at most); of "
                                "40 other samples weighed under this state, some are as lossy (9 (1.5: 4 reach it)): the data "
                                "holds such samples (hard ones of the loss's own tail, or a recurring defect: label noise, a "
                                "bad shard)")


def test_the_samples_a_data_spikes_are_weighed_against_are_counted_once():
    """Ordinary windows across an epoch's end hold a sample twice: 'of 20 other samples' were 8 (a review)."""
    from stabletrain.counterfactual import _tail_pool

    bench = SimpleNamespace(task=SimpleNamespace(train_data=list(range(16))))
    spike = [(list(range(8)), None)]
    context = [[(list(range(8, 16)), None)], [([0, 1, 2, 3, 8, 9, 10, 11], None)], [(list(range(8, 16)), None)]]
    for by_index in (False, True):  # (16 samples, 8 of them the spike's: no draw beyond the windows')
        assert _tail_pool(bench, spike, context, 20, by_index) == list(range(8, 16))


@pytest.mark.parametrize("steps", [(22, 23, 24), (18, 20, 21)])
def test_a_data_spike_among_other_spikes_is_judged_against_ordinary_windows(tmp_path, steps):
    """Outlier samples on several steps near each other: a spike early in its interval (its ordinary windows come
    from the steps after it, spikes too) or right after spikes of the interval before (a replay from an older state
    passes them): the windows the diagnosis calls ordinary are none of the flagged steps', and the verdict is data."""
    bad = tuple(i for s in steps for i in ((s - 1) * 8 + 1, (s - 1) * 8 + 5))
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=30", "optim.lr=0.01"),
            task=outlier_samples_task(bad=bad), run_dir=run_dir).fit()
    events = _events(run_dir)
    flagged = {e["step"] for e in events if e["kind"] == "spike"}
    assert set(steps) <= flagged, flagged
    captured = [e["step"] for e in events if e["kind"] == "incident"]
    assert captured and set(captured) <= set(steps), captured
    for step in captured:
        bundle = load_bundle(run_dir / "incidents" / f"step_{step:06d}")
        ordinary = {w[0][0] // 8 + 1 for w in bundle["observed"]["context"]}  # each window's step
        assert ordinary and not ordinary & flagged, (step, ordinary, flagged)
        d = json.loads((run_dir / "incidents" / f"step_{step:06d}" / "diagnosis.json").read_text())
        assert d["failure_class"] == "data", (step, d["summary"])
        assert d["samples"]["indices"] and set(d["samples"]["indices"]) <= {(step - 1) * 8 + 1, (step - 1) * 8 + 5}


@pytest.mark.parametrize("on_spike", ["warn", "skip", "remedy"])
def test_an_fp16_spike_that_overflows_the_gradients_is_still_a_spike(tmp_path, on_spike):
    """Under fp16 a large spike's gradients overflow: the GradScaler skips the step as a routine overflow, yet its
    finite loss is a spike by the rule (the host's, and the device's under guard.on_spike=skip), captured and
    diagnosed as any other."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=30", "optim.lr=0.01",
                "precision=fp16", f"guard.on_spike={on_spike}"), task=outlier_samples_task(), run_dir=run_dir).fit()
    events = _events(run_dir)
    skipped = {e["step"] for e in events if e["kind"] == "skip"}
    assert 20 in skipped and "overflow" in next(e["reason"] for e in events if e["kind"] == "skip" and e["step"] == 20)
    assert [e["step"] for e in events if e["kind"] == "spike"] == [20]
    assert [e["step"] for e in events if e["kind"] == "incident"] == [20]
    d = json.loads((run_dir / "incidents" / "step_000020" / "diagnosis.json").read_text())
    assert d["failure_class"] == "data" and set(d["samples"]["indices"]) <= {153, 157}, d["summary"]
    lines = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    assert (lines[10]["num_incidents"], lines[20]["num_incidents"], lines[30]["num_incidents"]) == (0, 1, 1)
    if on_spike == "remedy":  # the search's replays see the overflowing spike as the run did: skipping its samples cures
        (remedy,) = [e for e in events if e["kind"] == "remedy"]
        assert remedy.get("name") == "skip-samples", remedy["reason"]


def test_on_spike_remedy_does_not_roll_back_when_skipping_the_step_cures(tmp_path):
    """A rare token's Adam spike: skipping its step cures it on the replay, and so would rolling back 14 steps under
    half the LR. The rollback trains that stretch again and slows the rest of the run (the issue's run ended x3 worse
    than one that skipped): applied live only when the skip does not cure."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=100", "sched.warmup_steps=0",
                "sched.decay=constant", "guard.on_spike=remedy", "ckpt.every=20"), task=rare_token_task(lr=0.03),
            run_dir=run_dir).fit()
    record = json.loads((run_dir / "incidents" / "step_000075" / "remedy.json").read_text())
    verdicts = {c["name"]: c["verdict"] for c in record["candidates"]}
    assert verdicts["skip-step"] == "cures" and verdicts["rollback-lr-x0.5"] == "cures", verdicts  # the choice was real
    remedies = [e for e in _events(run_dir) if e["kind"] == "remedy"]
    assert [e.get("applied") for e in remedies] == [None] and "no remedy needed" in remedies[0]["reason"], remedies
    # the cures replayed from the step before (not applied live) are named: a trial read `stabletrain remedy`'s 'best:
    # lr-x0.1' beside the run's 'no remedy needed' as a contradiction
    before = [c["name"] for c in record["candidates"] if c["verdict"] == "cures" and c["first_step"] < 75
              and not c["name"].startswith("rollback")]  # (a rollback is not worth it where the skip cures)
    assert before and remedies[0]["reason"].endswith(
        f"; {', '.join(before)} cure{'s' if len(before) == 1 else ''} it too from the update of step 74, which the run had "
        "made already (`stabletrain remedy` lists them)"), (before, remedies[0]["reason"])
    assert not [e for e in _events(run_dir) if e["kind"] == "rollback"]
    skips = [e["reason"] for e in _events(run_dir) if e["kind"] == "skip"]  # the policy the run had, said as such
    assert skips == ["optimizer step skipped: loss spike (guard.on_spike=remedy)"], skips


def test_without_an_older_state_a_few_samples_name_a_data_spike_only_when_they_carry_most_of_it():
    """A spike with no older state to weigh it against (an adapter's interval's first step): dropping a drifted
    window's largest losses 'cures' it too, so a sample carrying 29% is no data verdict, nor are samples when the
    ordinary windows are spikes under this state as well; planted outliers carrying 99% still are."""
    def m(share, ordinary_now=None):
        return {"reproduces": True, "step": 91, "older": None, "fp32": None, "surges": [], "where": {}, "jumps": {},
                "samples": {"indices": [7], "share": share, "without": {"loss": 0.16, "ratio": 1.9}},
                **({"ordinary_now": ordinary_now} if ordinary_now else {})}

    weak = classify_spike(m(0.29))
    assert weak["failure_class"] == "state" and weak["blamed_samples"] is None
    assert "no older state to weigh the window against, and no few samples carry most of it" in weak["evidence"]
    drifted = classify_spike(m(0.9, {"loss": 0.5, "spike": True}))
    assert drifted["failure_class"] == "state" and "ordinary windows are high under this state too" in drifted["evidence"]
    data = classify_spike(m(0.99, {"loss": 0.08, "spike": False}))
    assert data["failure_class"] == "data" and data["blamed_samples"] == [7]


def test_without_an_older_state_a_window_reaching_rarely_trained_coordinates_is_optimizer_state_not_drift():
    """An adapter's spike on its interval's first step (no update before it replayed, no older state) whose ordinary
    windows are normal under this state: Monitor called a rare-token spike 'state: drifted' though nothing said so. The
    window's own surge into coordinates with a tiny sqrt(v) names the layer; with none, the verdict says it could not
    tell the state from the window."""
    surge = {"name": "encoder.tok.weight", "numel": 1024, "surge_share": 0.0146, "coord_factor": 78.5, "step": 151}
    m = {"reproduces": True, "step": 151, "older": None, "fp32": None, "where": {}, "jumps": {}, "samples": None,
         "ordinary_now": {"loss": 0.61, "spike": False}}
    opt = classify_spike({**m, "surges": [surge]})
    assert (opt["failure_class"], opt["blamed_layer"]) == ("optimizer-state", "encoder.tok.weight"), opt
    assert "which step moved them is not measured" in opt["evidence"]
    plain = classify_spike({**m, "surges": []})
    assert plain["failure_class"] == "state" and plain["evidence"].startswith("the model or optimizer state, or this window")
    assert "ordinary windows are normal under this state (0.61)" in plain["evidence"]
    drifted = classify_spike({**m, "surges": [surge], "ordinary_now": {"loss": 5.0, "spike": True}})
    assert drifted["failure_class"] == "state" and drifted["blamed_layer"] is None  # the whole state is off: no layer
    # A whole batch of bad labels on an interval's first step (HF): every sample a spike by the rule alone. Its large
    # gradients reach coordinates with a small sqrt(v) too; that named 'optimizer-state' (remedy found no cure).
    outlier = classify_spike({**m, "surges": [{**surge, "coord_factor": 5.82}], "spread": 1.0})
    assert outlier["failure_class"] == "state" and outlier["blamed_layer"] is None, outlier
    assert "the window itself may carry it (100% of its samples are a spike by the rule alone: an outlier batch)" in \
        outlier["evidence"]
    assert classify_spike({**m, "surges": [surge], "spread": 0.125})["failure_class"] == "optimizer-state"  # a few


@pytest.mark.parametrize("bad", [(153, 157), (147, 153, 157)])
def test_a_spike_rollback_also_drops_the_samples_its_diagnosis_named(tmp_path, bad, capsys):
    """guard.on_spike=rollback on outlier samples that come back every epoch (in other windows): skipping the spike's
    window alone met them again each epoch until guard.max_rollbacks stopped the run; the samples the diagnosis named
    (and verified) are dropped too, so one rollback suffices, and a resume keeps them dropped. A burst over two windows
    (sample 147 is step 19's, the onset): the later window's samples were not named, came back the next epoch and made
    a second rollback (a trial); the diagnosis weighs the burst's windows too."""
    run_dir = tmp_path / "run"
    c = cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=70", "optim.lr=0.01",
            "ckpt.every=10", "guard.on_spike=rollback", "ckpt.keep=10")
    trainer = Trainer(c, task=outlier_samples_task(bad=bad), run_dir=run_dir)
    trainer.fit()
    events = _events(run_dir)
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    assert len(rollbacks) == 1 and rollbacks[0]["dropped_samples"] and set(rollbacks[0]["dropped_samples"]) <= set(bad)
    if len(bad) == 3:
        (incident,) = [e for e in events if e["kind"] == "incident"]
        assert incident["step"] == 19 and incident["diagnosis"]["bad_samples"] == [147]
        assert incident["diagnosis"]["burst_samples"] == [{"step": 20, "samples": [153, 157],
                                                           "share": pytest.approx(1, abs=0.1)}]
        assert set(rollbacks[0]["dropped_samples"]) == set(bad) and "the burst's step 20: samples 153, 157 carry" in (
            incident["diagnosis"]["evidence"])
        # the console's line for step 20 said only 'not captured': the capture weighed it (a new user's trial)
        assert ("1 more loss spike in the interval to step 20, at step 20 (" in (out := capsys.readouterr().out) and
                "not captured (one capture per interval; events.jsonl); step 19's capture weighed its burst: step 20's "
                "samples 153, 157 carry 100% of its loss (verified)" in out), out
    assert "which the diagnosis named" in rollbacks[0]["reason"]
    assert trainer.step == 70 and trainer.state.stop_reason is None
    assert not [e for e in events if e["kind"] == "spike" and e["step"] > 20]  # step 52 (epoch 2) met them no more
    resumed = Trainer(c, task=outlier_samples_task(), run_dir=run_dir, resume=True)
    assert set(rollbacks[0]["dropped_samples"]) <= resumed.stream.drop


def test_candidates_are_judged_before_a_later_incident_every_one_past_this_one_meets_alike():
    """A data spike at step 45 and an unrelated NaN sample at step 63, inside the 20 steps the search replays: every
    candidate that gets past the spike (the baseline too) fails at 63, so none 'cured' it. They are judged on the
    steps before 63; those that failed on the spike itself keep their failure. A divergence's cures, which do not all
    fail at one later step, are left as they are."""
    from stabletrain.diagnostics.remedy_verdicts import before_later_incident as _before_later_incident

    def result(name, failed_at, losses):
        rows = [{"step": s, "loss": v, "grad_norm": 1.0, "applied": True} for s, v in losses]
        failed = {"step": failed_at, "why": f"non-finite loss at step {failed_at}"} if failed_at else None
        return {"name": name, "failed": failed, "trajectory": rows, "steps_replayed": len(rows), "end_loss": float("nan")}

    trained = [(s, 0.02) for s in range(45, 63)] + [(63, float("nan"))]
    results = [result("skip-step", 63, trained), result("lr-x0.5", 45, [(44, 0.02), (45, 210.0)]),
               result("skip-samples", 63, trained)]
    assert _before_later_incident(results, 45) == 63
    assert results[0]["failed"] is None and results[0]["end_loss"] == pytest.approx(0.02)
    assert results[0]["steps_replayed"] == 18 and results[2]["failed"] is None
    assert results[1]["failed"]["step"] == 45  # it never got past the spike
    cured = [result("skip-step", 63, trained), result("lr-x0.1", None, trained[:-1] + [(63, 0.5)])]
    assert _before_later_incident(cured, 45) is None and cured[0]["failed"]["step"] == 63  # a cure went past 63
    soon = [result("skip-step", 48, trained[:4]), result("skip-samples", 48, trained[:4])]
    assert _before_later_incident(soon, 45) is None  # the incident's own course: no later incident


def test_a_spike_after_a_fast_fall_is_caught_named_and_its_aftershocks_linked_to_it(tmp_path, capsys):
    """The loss fell from ~2 to ~6e-5 in 50 steps; 3 flipped labels at step 51 make a loss x4e4 the median that the
    rule missed (the window's deviation, from its first losses, put it at z 4). It is a spike now, its 3 samples named
    (3 of 16: a few), and under guard.on_spike=warn its update is applied: a later spike within 50 steps says it may be
    that spike's aftershock (a later one's samples were blamed with no word of the earlier spike)."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=16", "train.max_steps=72", "optim.lr=0.02", "log.every=10", "data.shuffle=false",
                "sched.warmup_steps=0", "sched.decay=constant"), task=flipped_labels_task(), run_dir=run_dir).fit()
    incidents = [e for e in _events(run_dir) if e["kind"] == "incident"]
    first, *later = incidents
    assert first["step"] == 51 and first["diagnosis"]["failure_class"] == "data"
    assert first["diagnosis"]["bad_samples"] == [802, 805, 806]
    # One capture per interval; the state it left spikes on (61, state), whose burst goes on through the next interval:
    # its course, not captured again (a trial: one divergence took 4 of the run's 5 captures, 66% of its time)
    assert [e["step"] for e in later] == [61]
    assert "10 steps after the spike at step 51 (data), whose update was applied: this may be its aftershock" in (
        later[0]["diagnosis"]["summary"])
    assert "aftershock" not in first["diagnosis"]["summary"]
    assert "the burst of loss spikes captured at step 61 (state) goes on (steps 71-" in capsys.readouterr().out


def test_a_bad_sample_standing_apart_in_a_small_window_is_named_alone(tmp_path):
    """A window of 4 (a new user's trial): sample 559 mislabelled, 94% of the loss; without it the window's mean is x2.47
    the rule's median (a clean sample of it at x6 the median, the window's own spread; z 0.57): 'samples 557, 559'
    were named, the clean one because the step without 559 alone was above spike_ratio x the median. Samples above a
    gap of x10 or more are named alone where the step without them is no spike by the rule."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=4", "train.max_steps=140", "optim.lr=0.01", "log.every=10", "data.shuffle=false",
                "sched.warmup_steps=0", "sched.decay=constant"), task=mislabelled_token_task(), run_dir=run_dir).fit()
    incident = next(e for e in _events(run_dir) if e["kind"] == "incident")
    d = incident["diagnosis"]
    assert incident["step"] == 140 and d["failure_class"] == "data" and d["bad_samples"] == [559], d["summary"]
    assert "no spike by the rule; the window's other samples lie below a x" in d["summary"]


def test_more_bad_samples_than_a_quarter_of_the_window_are_named_where_a_wide_gap_sets_them_apart(tmp_path, capsys):
    """5 relabelled samples of 16 (a new user's trial), losses x345 above the other 11: a 'few' (a quarter: 4) named
    none, and the line read "the whole window is high". Above a gap of x10 or more, up to half the window is named."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.max_steps=130", "data.shuffle=false"), task=relabelled_five_task(), run_dir=run_dir).fit()
    (incident,) = [e for e in _events(run_dir) if e["kind"] == "incident"]
    d = json.loads((Path(incident["path"]) / "diagnosis.json").read_text())
    assert incident["step"] == 126 and d["failure_class"] == "data", d["summary"]
    assert d["bad_samples"] == [2000, 2001, 2002, 2003, 2004], d["summary"]
    assert "without them the step is normal (verified" in d["summary"]
    assert "spike at step 126: data: samples 2000, 2001, 2002, 2003, 2004 carry 9" in capsys.readouterr().out
    assert "optimizer's steps have run" not in d["summary"]  # (a calm run's data spike: no drift caveat)


def test_samples_a_batch_norm_couples_are_found_by_dropping_every_few_of_a_small_window(tmp_path, capsys):
    """Three images scaled x100 in a window of 8 through a batch norm (a new user's trial): each weighed alone looks
    ordinary, and dropped one at a time the window is worse without a bad one than without a clean one, so the
    search ranked them last and the line read "the batch itself is an outlier". A window whose sets of up to a
    quarter fit the budget has each of them dropped in turn, fewest first: the three are named and verified."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=94", "optim.lr=0.003", "log.every=10", "data.shuffle=false",
                "sched.warmup_steps=0", "sched.decay=constant"), task=batchnorm_scaled_task(), run_dir=run_dir).fit()
    incident = next(e for e in _events(run_dir) if e["kind"] == "incident")
    d = json.loads((Path(incident["path"]) / "diagnosis.json").read_text())
    assert incident["step"] == 91 and d["failure_class"] == "data" and d["bad_samples"] == [720, 721, 722], d["summary"]
    assert d["samples"]["how"] == "removal" and d["samples"]["search"].startswith("every set of up to 3 of the window's 8")
    assert d["samples"]["without"]["ratio"] < 1
    assert "spike at step 91: data: samples 720, 721, 722 carry" in capsys.readouterr().out


def test_samples_named_in_a_state_whose_steps_rose_x10_inside_the_optimizer_come_with_that_caution(tmp_path, capsys):
    """A user's AdamW multiplies every update x30 from its step 120 (a new user's trial); the loss spikes from step 164
    on, each window's loss on a hard, clean sample the over-stepped model gets wrong, and the older state (step 160) is
    inside the drift: the samples were named as 'data' with no word of it. The verdict says the steps' level rose at
    step 120 at no higher LR and that the named samples may be ordinary; a data spike in a calm run says nothing of it."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.max_steps=200", "data.shuffle=false"), task=update_jump_task(), run_dir=run_dir).fit()
    incident = next(e for e in _events(run_dir) if e["kind"] == "incident")
    d = json.loads((Path(incident["path"]) / "diagnosis.json").read_text())
    assert incident["step"] == 164 and d["failure_class"] == "data", d["summary"]
    rose = re.search(r"but the optimizer's steps have run x([\d.]+) their size since step 120 ", d["evidence"])
    assert rose and float(rose.group(1)) > 10, d["evidence"]
    assert "these may be ordinary" in d["evidence"], d["evidence"]
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("stabletrain: spike at step 164: "))
    assert "; but the optimizer's steps have run x" in line and line.endswith("; reproduces on replay"), line  # (kept)


def test_spikes_in_a_drifts_course_are_weighed_under_a_state_from_before_it_not_blamed_on_samples(tmp_path):
    """A too-high LR drifts the state from step ~63 (captured at 65: state) and spikes go on every few steps under
    guard.on_spike=warn. At step 85 four ordinary samples the drifted model gets confidently wrong carried 96% of the
    window: 'data', weighed under step 80's state, itself inside the drift. A later spike in a drift's chain is weighed
    under the snapshot held from before its first spike; no spike of the chain is blamed on samples."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=32", "train.max_steps=100", "log.every=10", "sched.warmup_steps=80",
                "sched.decay=constant", "clip.max_norm=null"), task=too_high_lr_task(), run_dir=run_dir).fit()
    first, *later = [json.loads((Path(e["path"]) / "diagnosis.json").read_text())
                     for e in _events(run_dir) if e["kind"] == "incident"]
    assert first["step"] == 65 and first["failure_class"] == "state"
    # Which of the chain's spikes get captured depends on the CPU's kernels (a diverging run amplifies the last bits):
    # [76, 85] on one Xeon, [76] on an AVX-512 one (75 is x2 the median as a tenth of recent steps were: rarity)
    assert later and later[0]["step"] == 76 and all(d["step"] < 100 for d in later), [d["step"] for d in later]
    for d in later:
        assert d["failure_class"] != "data" and not d["bad_samples"], d["summary"]
        assert d["older"]["step"] < 65 and d["older"]["before_spike"] == 65, d["older"]
        assert "from before the spike at step 65 that began a drift" in d["summary"]


def test_a_data_spike_at_the_first_step_judged_is_the_samples_not_a_drift_under_step_0s_state(tmp_path):
    """Two labels x100 at step 5, the first step the rule judges (a new user's case): ordinary windows are as high under
    step 0's state as now (39.2 vs 39.3), both x2.19 the rule's median of the first 4 noisy losses (its lower middle),
    and that was read as "far above the run's level under this state too: the state drifted", though dropping the two
    samples made the step normal. Ordinary windows above the median under the older state say the run was off its level
    there only for an interval snapshot within the median's reach, never step 0's state (a loss that fell since)."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=16", "train.max_steps=10", "log.every=10", "data.shuffle=false"),
            task=first_steps_outliers_task(), run_dir=run_dir).fit()
    d = json.loads((run_dir / "incidents" / "step_000005" / "diagnosis.json").read_text())
    assert d["older"]["step"] == 0 and min(d["older"]["levels"]) > d["older"]["ratio"], d["older"]  # the case it was
    assert d["failure_class"] == "data" and d["bad_samples"] == [67, 68], d["summary"]
    assert "without them the step is normal (verified" in d["summary"] and "drifted" not in d["summary"]


def test_a_drifts_later_spikes_skipped_are_weighed_under_a_state_from_before_it_not_called_data(tmp_path):
    """A new user's trial: SGD at an LR of 30 drifts the state from step ~5; every spike is skipped (guard.on_spike=skip,
    or remedy's fallback). The captures at 6, 14 and 16 were 'state', those at 21 and 26 'data: the whole window is high
    under the state of step 10 too ... the data moved to a new level', step 10's state being inside the drift (its loss
    27 against 1.7 before), and the stop line then advised guard.on_spike=warn. A state spike starts a drift's course
    whether its own update was applied or skipped: the updates before it drifted the state."""
    run_dir = tmp_path / "run"
    Trainer(cfg("optim.name=sgd", "optim.lr=30", "optim.weight_decay=0", "clip.max_norm=null", "sched.decay=constant",
                "sched.warmup_steps=20", "train.batch_size=16", "train.max_steps=30", "log.every=5", "ckpt.every=10",
                "data.shuffle=false", "guard.on_spike=skip"), task=sgd_too_fast_task(), run_dir=run_dir).fit()
    found = {d["step"]: d for d in (json.loads(f.read_text()) for f in (run_dir / "incidents").glob("step_*/diagnosis.json"))}
    said = {t: d["summary"] for t, d in found.items()}
    assert sorted(found) == [6, 14, 16, 21, 26] and found[6]["failure_class"] == "state", said
    for step in (21, 26):
        d = found[step]
        assert d["failure_class"] == "state" and not d["bad_samples"] and "new level" not in d["summary"], d["summary"]
        assert d["older"]["step"] < 6, d["older"]  # (the snapshot from before the drift's first spike, held while it lasts)


@pytest.mark.parametrize("start", [80, 84])
def test_a_spike_in_a_drift_opening_its_interval_is_weighed_under_the_state_from_before_the_drift(start):
    """A drift began with a spike at step 65; a later spike at step 85. Its interval started at step 84 (a review): the
    capture replayed from the step before it, no older state of its own, so the chain was never looked at and it was
    weighed under the newest checkpoint (step 70's, inside the drift). Either way the snapshot from before step 65 is it."""
    from stabletrain.services.spike_reference import spike_parts

    def model(x):
        return {"w": torch.tensor([float(x)])}

    before, ckpt = ({"model": model(1), "optimizer": {"param_groups": [{"lr": 0.1}], "state": {}}}, 60), (model(3), 70)
    snapshot = SimpleNamespace(taken=True, step=start, get_previous=lambda: None, get_held=lambda: (None, before[0], 60))
    source = SimpleNamespace(strategy=SimpleNamespace(one_process_model=lambda m: m),
                             reference_state=lambda fit, at, now, oldest=0: (*ckpt, None))
    engine = SimpleNamespace(source=source, history=[], last_spike=None, spiked_samples={}, start_lrs=None, held_lrs=None,
                             snapshot=snapshot, drift_at=lambda step: {"onset": 65, "last": 75})
    fit = SimpleNamespace(history=[], precursor=None, dist=SimpleNamespace(is_main=True))
    bundle = {"observed": {}, "model": model(5), "previous": None}
    spike_parts(engine, fit, bundle, 85, ({"model": model(4), "optimizer": None}, start), {}, first=True)
    assert bundle["reference"]["step"] == 60 and torch.equal(bundle["reference"]["model"]["w"], model(1)["w"])
    assert bundle["observed"]["older_before_spike"] == {"spike": 65, "instead_of": start, "found": True}


def test_the_same_samples_spiking_again_next_epoch_are_said_to_come_back_not_called_an_aftershock(tmp_path):
    """Under guard.on_spike=warn samples 153 and 157 spike at step 20 and again at step 52, the next epoch: the second
    line said 'this may be its aftershock'; it is the same samples coming back."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=60", "optim.lr=0.01", "log.every=10", "data.shuffle=false"),
            task=outlier_samples_task(), run_dir=run_dir).fit()
    first, again = [e for e in _events(run_dir) if e["kind"] == "incident"]
    assert (first["step"], again["step"]) == (20, 52) and again["diagnosis"]["bad_samples"] == [153, 157]
    summary = again["diagnosis"]["summary"]
    assert "samples 153, 157 carried the spike at step 20 too: they come back" in summary and "aftershock" not in summary


def test_samples_spiking_again_after_a_resume_are_said_to_come_back(tmp_path):
    """A trial: the run stopped at step 30 and resumed; samples 153, 157 spiked at step 20 and again at 52, and the
    resumed launch had forgotten step 20's (memory only): no 'they come back'. It reads the run's record."""
    run_dir = tmp_path / "run"
    args = ("train.batch_size=8", "optim.lr=0.01", "log.every=10", "data.shuffle=false", "ckpt.every=10")
    Trainer(cfg(*args, "train.max_steps=30"), task=outlier_samples_task(), run_dir=run_dir).fit()
    Trainer(cfg(*args, "train.max_steps=60"), task=outlier_samples_task(), run_dir=run_dir, resume=True).fit()
    first, again = [e for e in _events(run_dir) if e["kind"] == "incident"]
    assert (first["step"], again["step"]) == (20, 52) and again["diagnosis"]["bad_samples"] == [153, 157]
    assert "samples 153, 157 carried the spike at step 20 too: they come back" in again["diagnosis"]["summary"]


def test_a_resume_by_hand_sets_aside_a_capture_the_killed_launch_left_of_a_step_it_trains_again(tmp_path, capsys):
    """A trial: a run SIGKILLed while it captured step 108 left incidents/step_000108 with its bundle and no diagnosis;
    `--resume` captured the step again into step_000108.2, and `stabletrain remedy RUN` took the half-written one first
    ('holds 2 incidents'). A resume sets the captures of the steps it trains again aside, as a restart does."""
    import shutil

    from stabletrain.cli import main

    run_dir = tmp_path / "run"
    args = ("train.batch_size=8", "optim.lr=0.01", "log.every=10", "data.shuffle=false", "ckpt.every=10", "train.max_steps=30")
    task = "spike_tasks:outlier_samples_task"  # (by name: `stabletrain remedy` rebuilds it)
    Trainer(cfg(*args, task=task), run_dir=run_dir).fit()
    # as if killed in step 20's capture: its diagnosis never written, nor the checkpoints after step 10
    (run_dir / "incidents" / "step_000020" / "diagnosis.json").unlink()
    for name in ("step_000020", "step_000030"):
        shutil.rmtree(run_dir / "checkpoints" / name)
    (run_dir / "checkpoints" / "LAST_GOOD").write_text("step_000010\n")
    Trainer(cfg(*args, task=task), run_dir=run_dir, resume=True).fit()
    assert sorted(p.name for p in (run_dir / "incidents").iterdir()) == ["step_000020", "step_000020.superseded-resume"]
    assert (run_dir / "incidents" / "step_000020" / "diagnosis.json").is_file()
    (resume,) = [e for e in _events(run_dir) if e["kind"] == "resume"]
    assert resume["superseded_incidents"] == ["step_000020.superseded-resume"] and resume["reason"].endswith(
        "; the incidents after it set aside: step_000020.superseded-resume"), resume["reason"]
    capsys.readouterr()
    assert main(["remedy", str(run_dir), "--only", "skip-samples"]) == 0
    out = "".join(capsys.readouterr())
    assert "incidents" not in out.split("skip-samples")[0] and "superseded" not in out, out  # (the one, not "1 of 2")
    assert json.loads((run_dir / "incidents" / "step_000020" / "remedy.json").read_text())["candidates"], out


def test_a_sample_coming_back_after_other_spikes_is_said_to_come_back(tmp_path):
    """Samples 153, 157 spike at steps 20 and 52, sample 200 at steps 26 and 58: at step 58 the last spike was 52's
    (other samples), and the line said 'this may be its aftershock'; sample 200 carried the spike at step 26 too."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=60", "optim.lr=0.01", "log.every=5", "data.shuffle=false"),
            task=outlier_samples_task(bad=(153, 157, 200)), run_dir=run_dir).fit()
    incidents = {e["step"]: e["diagnosis"] for e in _events(run_dir) if e["kind"] == "incident"}
    assert sorted(incidents) == [20, 26, 52, 58] and incidents[58]["bad_samples"] == [200], incidents.keys()
    assert "sample 200 carried the spike at step 26 too: it comes back" in incidents[58]["summary"]
    assert "aftershock" not in incidents[58]["summary"], incidents[58]["summary"]


def test_a_second_spike_in_a_captured_interval_reaches_the_console(tmp_path, capsys):
    """Samples 160 and 200 spike at steps 21 and 26, one interval: one is captured, the other was an event only (no
    line: a user reading the console never learnt of it)."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=30", "optim.lr=0.01", "log.every=10", "data.shuffle=false"),
            task=outlier_samples_task(bad=(160, 200)), run_dir=run_dir).fit()
    (incident,) = [e for e in _events(run_dir) if e["kind"] == "incident"]
    other = ({21, 26} - {incident["step"]}).pop()
    out = capsys.readouterr().out
    assert re.search(rf"stabletrain: 1 more loss spike in the interval to step 30, at step {other} \([0-9.e+]+\): not "
                     r"captured \(one capture per interval; events.jsonl\)", out), out


def test_samples_found_by_removal_under_batch_norm_and_dropout_are_verified_with_dropout_off(tmp_path):
    """Batch norm and dropout: the 3 mislabelled samples cannot be weighed alone (a batch norm's statistics), so they are
    found by their removal from the window, and that removal is replayed with every dropout off: with it on, a row
    removed drew other masks for every other row, the window without them kept a few % of its loss ('not verified,
    not named'), and the 'largest falls' were noise (952, 953, 957: 23%)."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=121", "optim.lr=0.01", "log.every=10", "data.shuffle=false",
                "sched.warmup_steps=0", "sched.decay=constant"), task=mislabelled_quadrants_task(), run_dir=run_dir).fit()
    (incident,) = [e for e in _events(run_dir) if e["kind"] == "incident"]
    d = incident["diagnosis"]
    assert incident["step"] == 120 and d["failure_class"] == "data" and d["bad_samples"] == [953, 955, 957], d["summary"]
    full = json.loads((run_dir / "incidents" / "step_000120" / "diagnosis.json").read_text())
    assert full["samples"]["how"] == "removal" and full["samples"]["without"]["ratio"] < 2.0, full["samples"]
    assert "(found by dropping samples from the whole window: " in d["evidence"], d["evidence"]
    assert "without them the step is normal (verified" in d["evidence"] and full["dropout"]["normal"] is False
    assert "(verified with dropout off: loss " in d["evidence"]  # (it said 'verified' of a loss measured that way)


def test_more_bad_samples_than_a_set_may_name_are_said_as_such_not_as_no_small_set(tmp_path):
    """Nine shifted targets in a window of 16, where a set names at most 4: without the four largest the loss falls
    97%, still a spike by the rule. The verdict said "no small set of its samples carries it: the batch itself is an
    outlier" beside "(100% of it gone)"; it says that more samples are bad than a few, and never rounds up. (Five
    shifted of 16, the case this test began with, stand x10 and more above the rest: those are named now, verified.)"""
    def run(shifts, name):
        Trainer(cfg("train.batch_size=16", "train.max_steps=30", "optim.lr=0.01", "log.every=10", "data.shuffle=false",
                    "sched.warmup_steps=0", "sched.decay=constant"), task=graded_outliers_task(shifts),
                run_dir=tmp_path / name).fit()
        (incident,) = [e for e in _events(tmp_path / name) if e["kind"] == "incident"]
        return incident, incident["diagnosis"]

    incident, d = run((60.0, 20.0, 8.0, 6.0, 5.0), "five")
    assert (incident["step"], d["failure_class"], d["bad_samples"]) == (26, "data", [400, 401, 402, 403, 404]), d["summary"]
    incident, d = run((60.0, 20.0, 8.0, 6.0, 5.0, 4.0, 4.0, 4.0, 4.0), "nine")
    assert (incident["step"], d["failure_class"], d["bad_samples"]) == (26, "data", None), d["summary"]
    assert "; its largest losses carry most of it, but more of its samples are bad than a few: without samples 400, 401, " \
           "402, 403 (the largest falls) the window's loss falls from " in d["evidence"], d["evidence"]
    assert "not verified, not named (a set names at most 4 of the window's 16 samples)" in d["evidence"], d["evidence"]
    assert "no small set" not in d["evidence"] and "(100% of it gone" not in d["evidence"], d["evidence"]
    assert re.search(r"\((99\.\d|9\d)% of it gone\)", d["evidence"]), d["evidence"]


def test_a_state_spike_after_the_users_lr_jump_names_the_rise_since_the_older_state(tmp_path):
    """Monitor over the user's loop, whose own schedule bug multiplies the LR by 100 at step 23: the loss spikes at
    step 26; the older state (the interval's start, step 20) kept its LR, so the state verdict says how far it rose."""
    from spike_tasks import _mse

    from stabletrain import Monitor

    task = steady_regression_task()
    torch.manual_seed(0)
    opt = torch.optim.AdamW(task.model.parameters(), lr=0.003, fused=True)
    with Monitor(task.model, opt, run_dir=tmp_path / "run", log_every=10, loss_fn=_mse, clip_max_norm=1.0) as monitor:
        for step in range(30):
            if step == 23:
                for group in opt.param_groups:
                    group["lr"] *= 100
            batch = task.train_data[step * 8:(step + 1) * 8]
            monitor.backward(_mse(task.model, batch), batch)
            monitor.step()
    incident = next(e for e in _events(tmp_path / "run") if e["kind"] == "incident")
    d = incident["diagnosis"]
    assert (incident["step"], d["failure_class"], d["bad_samples"]) == (26, "state", None), d["summary"]
    assert "; the LR rose x100 since step 20 (0.003 -> 0.3);" in d["summary"], d["summary"]
    full = json.loads((tmp_path / "run" / "incidents" / "step_000026" / "diagnosis.json").read_text())
    assert full["older"]["lr"] == pytest.approx({"then": 0.003, "now": 0.3})


def test_lr_change_reads_the_group_that_moved_most_and_a_share_short_of_all_never_prints_as_100_percent():
    from stabletrain.diagnostics.spike import _pct
    from stabletrain.diagnostics.spike_evidence import lr_change, lr_groups

    then = {"param_groups": [{"lr": 0.1, "params": [0]}, {"lr": torch.tensor(0.01), "params": [1]}]}
    now = {"param_groups": [{"lr": 0.2, "params": [0]}, {"lr": 0.5, "params": [1]}]}
    assert lr_change(then, now) == pytest.approx({"then": 0.01, "now": 0.5})
    assert lr_change(lr_groups(then), now) == lr_change(then, now)
    assert lr_change({"model": "dcp"}, now) is None and lr_change(then, None) is None
    assert (_pct(0.996), _pct(0.9999), _pct(1.0), _pct(0.87), _pct(0.004)) == ("99.6%", "99.9%", "100%", "87%", "0.4%")


@pytest.mark.parametrize("max_norm", [0.01, 100.0])
def test_monitor_replays_the_users_own_clip_to_the_state_the_run_had(tmp_path, max_norm):
    """The user clips (clip_grad_norm_ at 0.01: every step; at 100: none) and passes grad_norm=: the capture's replay
    of steps 15-19 scales the grads as that clip did, not at the Monitor's own threshold (1.0): the bundle's state
    is the run's before step 20 (bitwise where the clip left the grads alone, within float rounding where it scaled)."""
    from spike_tasks import _mse

    from stabletrain import Monitor

    task = outlier_samples_task()
    torch.manual_seed(0)
    opt = torch.optim.SGD(task.model.parameters(), lr=0.05)
    with Monitor(task.model, opt, run_dir=tmp_path / "run", log_every=7, loss_fn=_mse) as monitor:
        for step in range(22):
            if step == 19:  # the Monitor's step 20 (it counts from 1)
                live = {k: v.clone() for k, v in task.model.state_dict().items()}
            batch = task.train_data[step * 8:(step + 1) * 8]
            monitor.backward(_mse(task.model, batch), batch)
            monitor.step(grad_norm=torch.nn.utils.clip_grad_norm_(task.model.parameters(), max_norm))
    bundle = load_bundle(tmp_path / "run" / "incidents" / "step_000020")
    assert bundle["step"] == 20 and set(bundle["model"]) == set(live)
    for name, value in live.items():
        if max_norm > 1:
            assert torch.equal(bundle["model"][name], value), name
        else:
            torch.testing.assert_close(bundle["model"][name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("remedy", [False, True])
def test_the_capture_and_remedy_search_are_left_out_of_the_next_intervals_step_time(tmp_path, monkeypatch, remedy):
    """The capture (and a remedy's search) at step 20's boundary takes a second more here: the interval after it
    (steps 21-30) reports its own steps' time, as the adapters' interval does."""
    import time as time_module

    from stabletrain.services.capture import IncidentCapture

    capture = IncidentCapture.capture

    def slow(self, *args, **kwargs):
        time_module.sleep(1.0)
        return capture(self, *args, **kwargs)

    monkeypatch.setattr(IncidentCapture, "capture", slow)
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=30", "optim.lr=0.01",
                *(["guard.on_spike=remedy", "remedy.steps=3"] if remedy else [])),
            task=outlier_samples_task(), run_dir=tmp_path / "run").fit()
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert records[30]["step_time_s"] < 0.05, records[30]["step_time_s"]


def _surge_case(**older):
    surge = {"name": "2.weight", "step": 152, "surge_share": 0.0027, "coord_factor": 5.46}
    return {"reproduces": True, "loss": 0.9, "precision": "fp32", "step": 153, "samples": None, "surges": [surge],
            "where": {}, "jumps": {}, "older": {"step": 150, "window": 0.0124, "ordinary": 0.0128, "current_ordinary": 0.147,
                                                "window_high": False, "ordinary_high": True, "lr": None, **older}}


def test_a_surge_in_a_few_coordinates_is_not_blamed_where_every_coordinates_steps_grew_more():
    """An LR x30 (the optimizer's own schedule bug) moves every coordinate further; a surge of 0.27% of one layer's
    coordinates x5.5 as far as its others then named optimizer-state (Adam's second moment) for a state spike."""
    assert classify_spike(_surge_case())["failure_class"] == "optimizer-state"  # nothing grew: the surge stays the cause
    out = classify_spike(_surge_case(lr={"then": 0.003, "now": 0.09}))
    assert out["failure_class"] == "state" and out["blamed_layer"] is None, out
    assert "; the LR rose x30 since step 150 (0.003 -> 0.09)" in out["evidence"]
    assert "a few of 2.weight's coordinates surged in the update of step 152 (x5.46 as far as its others), less than " \
           "every coordinate's steps grew" in out["evidence"], out["evidence"]
    hidden = {**_surge_case(lr={"then": 0.003, "now": 0.003}), "steps": {"now": 0.17, "before": 0.0038, "upto": 150}}
    out = classify_spike(hidden)  # the same LR in its param groups, the steps x45 (the optimizer multiplies it inside)
    assert out["failure_class"] == "state" and "; the optimizer's steps grew x44.7 at the same LR: update/weight 0.17 " \
        "on ordinary windows under this state against 0.0038 in the run's intervals up to step 150" in out["evidence"]
    small = {**hidden, "steps": {"now": 0.0076, "before": 0.0038, "upto": 150}}  # x2: within a run's own wander
    assert classify_spike(small)["failure_class"] == "optimizer-state"


def test_a_surging_update_that_lowered_the_windows_loss_is_not_its_cause():
    """The window was higher still under the older state (0.2183 against 0.0448 now): the rare rows' update helped; the
    batch is the outlier (a rarely seen token), not Adam's second moment."""
    case = _surge_case(window=0.2183, ordinary=0.0035, current_ordinary=0.004, window_high=True, ordinary_high=False)
    case["loss"] = 0.0448
    out = classify_spike(case)
    assert out["failure_class"] == "data" and out["blamed_layer"] is None, out
    assert "the batch itself is an outlier" in out["evidence"] and "2.weight's surging update of step 152 is not its " \
        "cause: the window was as high under the state of step 150 (0.2183; 0.0448 now)" in out["evidence"], out["evidence"]
    # An older state from far back (every loss higher then) is no measure of one update: the window no higher than
    # ordinary windows there, the surge stays the cause.
    far = _surge_case(window=5.0, ordinary=5.0, current_ordinary=2.0, window_high=False, ordinary_high=False)
    far["loss"] = 4.0
    assert classify_spike(far)["failure_class"] == "optimizer-state"
    # Raised by less than half the window's size there: nearly as high, the batch's; a loss below 0 alike (a review: -10
    # then and -12 now read as raised x1.5, its surge blamed)
    for window, now, acquitted in ((0.2, 0.29, True), (0.2, 0.31, False), (-10.0, -12.0, True), (-10.0, -5.5, True),
                                   (-10.0, -4.5, False)):
        case = {**_surge_case(window=window, ordinary=0.0035, current_ordinary=0.004, window_high=True,
                              ordinary_high=False), "loss": now}
        out = classify_spike(case)
        assert ("surging update of step 152 is not its cause" in out["evidence"]) == acquitted, (window, now, out)
        assert (out["failure_class"] == "data") == acquitted, (window, now, out)


def test_a_surge_during_a_divergence_is_its_symptom_not_its_cause():
    """An LR warmup overshooting on a small gpt (a new user's case): every capture was named optimizer-state, a
    different layer each time, while remedies cured it with a lower LR. Surges in several layers in one update, a loss
    already climbing before it, or ordinary windows already a spike under the older state make it a divergence."""
    rows = [{"name": n, "step": 152, "surge_share": 0.01, "coord_factor": 9.0} for n in ("a.weight", "b.weight", "wte")]
    out = classify_spike({**_surge_case(), "surges": rows})
    assert (out["failure_class"], out["blamed_layer"]) == ("state", None), out
    assert ("coordinates of 3 layers surged in the update of step 152 at once (a.weight, b.weight, wte): every layer's "
            "gradients rose, not one layer's rarely trained coordinates") in out["evidence"], out["evidence"]
    assert classify_spike({**_surge_case(), "surges": rows[:2]})["failure_class"] == "optimizer-state"  # two: not yet
    climb = {**_surge_case(), "climb": [[149, 3.5, 1.0], [150, 5.07, 1.47], [151, 5.51, 1.6], [152, 5.81, 1.68]]}
    out = classify_spike(climb)
    assert out["failure_class"] == "state" and ("the loss was already climbing before the update of step 152 (x1.47, "
                                                "x1.6, x1.68 the rule's median at steps 150-152)") in out["evidence"], out
    wobble = {**_surge_case(), "climb": [[150, 5.07, 1.47], [151, 4.9, 1.4], [152, 5.81, 1.68]]}  # not a climb
    assert classify_spike(wobble)["failure_class"] == "optimizer-state"
    then = _surge_case(ordinary=8.57, ordinary_then_high=True)
    out = classify_spike(then)
    assert out["failure_class"] == "state" and ("ordinary windows were already a spike by the guard's rule under the "
                                                "state of step 150 (8.57), before that update") in out["evidence"], out


def test_a_spike_made_by_the_dropout_draw_is_named_so_not_blamed_on_samples(tmp_path):
    """A clean regression with a rare dropout: a step whose masks drop a unit for one sample spikes on that sample's
    error. That sample's removal "verified" a data verdict (another draw for the rest); with every dropout off the
    window is normal, so the draw is named and no sample is blamed, nor is a later draw an earlier one's aftershock."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=150", "optim.lr=0.01", "log.every=10", "data.shuffle=false",
                "guard.on_spike=remedy"), task=dropout_draw_task(), run_dir=run_dir).fit()
    remedies = [e["reason"] for e in _events(run_dir) if e["kind"] == "remedy"]  # live: the skip was all (another step,
    assert remedies and all(r.startswith("no remedy needed for the dropout incident at step ") for r in remedies)  # masks)
    incidents = [e for e in _events(run_dir) if e["kind"] == "incident"]
    assert len(incidents) >= 2, [e["step"] for e in incidents]
    for e in incidents:
        d = json.loads((run_dir / "incidents" / f"step_{e['step']:06d}" / "diagnosis.json").read_text())
        assert (d["failure_class"], d["bad_samples"], d["reproduces"]) == ("dropout", None, True), d["summary"]
        assert d["dropout"]["normal"] and d["dropout"]["loss"] < d["loss"] / 10, d["dropout"]
        assert d["summary"].startswith("dropout: with every dropout off the window's loss is ") and (
            "the draw made the spike, not the samples nor the state" in d["summary"]) and "aftershock" not in d["summary"]


def test_a_draw_that_made_most_of_the_spike_is_dropout_though_dropout_off_misses_the_rules_bar():
    """A width-1 bottleneck with a rare shared dropout mask, trained to a tiny loss: dropout off takes the window from
    26.05 to 0.00992 (the masks made it), still x17 the tiny median (dropout off shifts the outputs a little by itself):
    it was 'data: the batch itself is an outlier' (the older state drew the same mask)."""
    from stabletrain.counterfactual import _rules_out_aftershock

    draw = {"loss": 0.00992, "ratio": 17.0, "zscore": 30.0, "normal": False, "made_by_draw": True}
    case = {**_surge_case(window=26.0, window_high=True, ordinary_high=False, current_ordinary=0.013), "loss": 26.05,
            "surges": [], "dropout": draw}
    out = classify_spike(case)
    assert out["failure_class"] == "dropout" and out["evidence"].startswith(
        "with every dropout off the window's loss is 0.00992, 99.9% of it gone; under the step's own dropout masks it "
        "is 26.05"), out["evidence"]
    assert classify_spike({**case, "dropout": {**draw, "made_by_draw": False}})["failure_class"] == "data"
    # the state of step 60 is the one after step 60's update: a window high under it may still be that update's doing
    assert not _rules_out_aftershock("data", {"step": 60}, 60) and _rules_out_aftershock("data", {"step": 50}, 60)


def test_a_window_that_rose_alone_is_not_called_a_drifted_state():
    """Normal under the older state, ordinary windows no higher under this one: the updates since raised this window
    alone; 'the state drifted' (ordinary windows high) was not what was measured."""
    case = {**_surge_case(window_high=False, ordinary_high=False, ordinary=0.0085, current_ordinary=0.0054), "surges": []}
    out = classify_spike(case)
    assert out["failure_class"] == "state" and out["evidence"].startswith(
        "the updates since step 150 raised this window's loss against ordinary windows' (the state and this window, not "
        "told apart); the window is normal under the state of step 150 (0.0124) and ordinary windows are at 0.0054 under "
        "this one (vs 0.0085)"), out["evidence"]


def test_an_lr_jump_inside_the_optimizer_is_a_state_spike_whose_steps_grew(tmp_path):
    """The task's optimizer steps 30x from update 151 on, its param groups' lr unchanged: the spike at step 153 is a
    state spike (ordinary windows high too), the evidence says the optimizer's steps grew at the same LR, and the few
    coordinates of 2.weight that surged are not blamed (optimizer-state, before)."""
    from spike_tasks import hidden_lr_jump_task

    run = tmp_path / "run"
    Trainer(cfg("train.batch_size=32", "log.every=10", "data.shuffle=false", "train.max_steps=155", "sched.warmup_steps=0",
                "sched.decay=constant"), task=hidden_lr_jump_task(), run_dir=run).fit()
    incident = next(e for e in _events(run) if e["kind"] == "incident")
    d = json.loads((run / "incidents" / "step_000153" / "diagnosis.json").read_text())
    assert (incident["step"], d["failure_class"], d["blamed_layer"], d["bad_samples"]) == (153, "state", None, None), d
    assert "; the optimizer's steps grew x" in d["summary"] and " at the same LR: " in d["summary"], d["summary"]
    assert d["steps"]["now"] > 20 * d["steps"]["before"] and d["steps"]["upto"] == 150


def test_a_burst_of_large_steps_that_ended_is_a_state_spike_not_a_few_coordinates_surge(tmp_path):
    """A new user's trial: the optimizer steps 30x on updates 151-153 only, its LR back to normal after. The spike at step
    155 (the interval's largest) read 'optimizer-state: ... 0.39% of fc1.weight's coordinates ... moved x3.33 as far as
    its others': the surge weighed against the steps under the state now (x1.9, the LR normal again), not against how
    far the weights had moved since step 150 (x18 what the run's typical steps could)."""
    from spike_tasks import lr_burst_task

    run = tmp_path / "run"
    Trainer(cfg("train.batch_size=16", "log.every=10", "data.shuffle=false", "train.max_steps=156", "sched.decay=constant",
                "log.tensorboard=false"), task=lr_burst_task(), run_dir=run).fit()
    incident = next(e for e in _events(run) if e["kind"] == "incident")
    d = json.loads((run / "incidents" / f"step_{incident['step']:06d}" / "diagnosis.json").read_text())
    assert (incident["step"], d["failure_class"], d.get("blamed_layer")) == (155, "state", None), d["summary"]
    assert re.search(r"coordinates surged in the update of step 154 \(x3\.\d+ as far as its others\), less than every "
                     r"coordinate's steps grew since step 150 \(x1\d\)", d["summary"]), d["summary"]
    assert "; the weights moved 0.44 of their norm in the 4 updates since step 150, x1" in d["summary"], d["summary"]


def test_a_cure_that_cannot_be_applied_live_is_named_with_why_not_as_no_candidate_cures(tmp_path):
    """No checkpoint but step 0's: a lower LR from the update before the spike cures it on the replay, but the run has
    made that update already; the line said 'no candidate cures it (lr-x0.1: cures, ...)'."""
    from spike_tasks import hidden_lr_jump_task

    Trainer(cfg("train.batch_size=32", "log.every=10", "data.shuffle=false", "train.max_steps=155", "sched.warmup_steps=0",
                "sched.decay=constant", "guard.on_spike=remedy", "ckpt.every=0"), task=hidden_lr_jump_task(),
            run_dir=tmp_path / "run").fit()
    (event,) = [e for e in _events(tmp_path / "run") if e["kind"] == "remedy"]
    assert event["reason"].startswith("no remedy applied for the incident at step 153: no cure can be applied now (lr-x0.1: "
                                      "cures (from the update of step 152, which the run has made already), "), event


def test_a_remedy_search_sees_the_checkpoint_still_being_written(tmp_path):
    """The step-100 save is the run's first in the background (its writer process starts: a second or so) and was still
    in flight at step 160's capture: the search saw only step 0 to roll back to (no cure). It waits for it now."""
    from spike_tasks import hidden_lr_jump_task

    Trainer(cfg("train.batch_size=32", "log.every=10", "data.shuffle=false", "train.max_steps=170", "sched.warmup_steps=0",
                "sched.decay=constant", "guard.on_spike=remedy", "ckpt.every=100"), task=hidden_lr_jump_task(),
            run_dir=tmp_path / "run").fit()
    applied = [e for e in _events(tmp_path / "run") if e["kind"] == "remedy" and e.get("name")]
    assert applied and applied[0]["remedy"]["kind"] == "rollback-lr" and applied[0]["remedy"]["step"] == 100, applied


@pytest.mark.parametrize("offset, captured", [(0.01, False), (3.0, True)])
def test_a_spike_between_negligible_losses_is_logged_but_spends_no_capture(tmp_path, capsys, offset, captured):
    """A noiseless regression trained to ~1e-14; one target off by 0.01 makes step 61 jump x1e9 to 1.25e-5: a spike
    by the rule, below 0.1% of the run's first logged loss (0.49): logged, said once, not captured (Adam's wander near
    zero loss spent the run's five captures before a real spike came). Off by 3 (loss ~1): captured."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from stabletrain import Task

    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 4, generator=g)
    y = x @ torch.randn(4, 1, generator=g)
    y[485] += offset
    torch.manual_seed(0)
    task = Task(model=nn.Linear(4, 1), train_data=TensorDataset(x, y), loss=spike_tasks_mse(), name="noiseless")
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=70", "optim.name=sgd",
                "optim.lr=0.2", "optim.weight_decay=0", "clip.max_norm=null", "sched.warmup_steps=0", "sched.decay=constant"),
            task=task, run_dir=tmp_path / "run").fit()
    events = _events(tmp_path / "run")
    assert [e["step"] for e in events if e["kind"] == "spike"][0] == 61
    incidents = [e["step"] for e in events if e["kind"] == "incident"]
    said = "spike at step 61 not captured: its loss, 1.25e-05, is below 0.0001 x the run's first logged loss (0.4933)"
    if captured:
        assert incidents == [61] and "spike at step 61 not captured" not in capsys.readouterr().out
    else:
        assert incidents == [] and capsys.readouterr().out.count(said) == 1


def spike_tasks_mse():
    from spike_tasks import _mse

    return _mse


def test_a_candidate_from_the_step_before_is_not_failed_by_that_steps_own_earlier_spike(tmp_path):
    """Bad samples at steps 20 and 21, log.every=20: step 21's capture; a lower LR replays from step 20, whose loss (an
    earlier spike, applied) comes before the lower LR's first update: every such candidate 'failed' on 'loss spike at
    step 20' (the helper's rare-token run: five candidates, one identical verdict). They are judged on step 21 on."""
    task = outlier_samples_task(bad=(153, 157, 161, 165))
    Trainer(cfg("train.batch_size=8", "log.every=20", "data.shuffle=false", "train.max_steps=30", "optim.lr=0.01"),
            task=task, run_dir=tmp_path / "run").fit()
    record = search_remedies(tmp_path / "run" / "incidents" / "step_000021", task, steps=5)
    lower = {c["name"]: c for c in record["candidates"] if c["name"].startswith("lr-")}
    assert lower and all(c["first_step"] == 20 for c in lower.values()), record["candidates"]
    assert all(c["verdict"] == "fails" and c["evidence"].startswith("loss spike at step 21 ") for c in lower.values()), lower
    assert next(c for c in record["candidates"] if c["name"] == "skip-samples")["verdict"] == "cures"


def test_a_skipped_spike_step_does_not_count_in_the_clip_rate(tmp_path):
    """guard.on_spike=skip: step 20's gradients (norm ~60, past clip.max_norm=10) were clipped and then discarded; the
    interval's clip rate counted it (10%: the HF run's 11% out of one skipped step). It is over the applied steps."""
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=20", "optim.lr=0.01",
                "clip.max_norm=10", "guard.on_spike=skip"), task=outlier_samples_task(), run_dir=tmp_path / "run").fit()
    records = {r["step"]: r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())}
    assert records[20]["num_skipped"] == 1 and records[20]["grad_norm_max"] > 10
    assert records[20]["clip_rate"] == 0.0, records[20]



def test_spikes_between_negligible_losses_under_on_spike_remedy_take_no_fallback(tmp_path):
    """guard.on_spike=remedy: an uncaptured negligible spike said 'no remedy applied ... (no good state to replay from)'
    and took remedy.fallback (stop or rollback) on a spike the floor means to ignore."""
    from torch import nn
    from torch.utils.data import TensorDataset

    from stabletrain import Task

    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 4, generator=g)
    y = x @ torch.randn(4, 1, generator=g)
    y[485] += 0.01
    torch.manual_seed(0)
    task = Task(model=nn.Linear(4, 1), train_data=TensorDataset(x, y), loss=spike_tasks_mse(), name="noiseless")
    trainer = Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=70", "optim.name=sgd",
                          "optim.lr=0.2", "optim.weight_decay=0", "clip.max_norm=null", "sched.warmup_steps=0",
                          "sched.decay=constant", "guard.on_spike=remedy", "remedy.fallback=stop"),
                      task=task, run_dir=tmp_path / "run")
    trainer.fit()
    events = _events(tmp_path / "run")
    assert trainer.step == 70 and [e for e in events if e["kind"] in ("remedy", "incident", "stop")] == [], events
    assert 61 in [e["step"] for e in events if e["kind"] == "spike"]
    assert trainer.guard.first_loss == pytest.approx(0.4933, rel=1e-3)
    assert trainer.guard.state_dict()["first_loss"] == trainer.guard.first_loss  # a resumed run measures against it


def test_lr_change_names_the_largest_rise_not_a_larger_fall():
    from stabletrain.diagnostics.spike_evidence import lr_change

    then = {"param_groups": [{"lr": 1.0}, {"lr": 0.01}]}
    now = {"param_groups": [{"lr": 0.1}, {"lr": 0.02}]}  # one group fell x10, the other rose x2
    assert lr_change(then, now) == {"then": 0.01, "now": 0.02}


def test_the_steps_growth_is_measured_on_ordinary_windows_only():
    from stabletrain.counterfactual import _step_sizes

    history = [[10, 0.1, 0.004], [20, 0.1, 0.004]]
    assert _step_sizes(history, []) is None  # no ordinary window: the spike's own step is no 'ordinary window'
    assert _step_sizes(history, [{"update_ratio": 0.2}])["now"] == 0.2


def test_a_hand_made_drop_path_is_switched_off_as_dropout_is():
    """timm's DropPath draws its mask with bernoulli_ and divides by the keep probability: dropout_off did not see it
    (a spike its draw made was 'data: the batch an outlier', 'dropout: null'). Its mask is now its expectation: the
    identity, as in eval mode, and the draw is counted (so the model is known to draw)."""
    from torch import nn

    from stabletrain.policies.dropout import dropout_off

    class DropPath(nn.Module):  # timm's drop_path, as written there
        def __init__(self, p):
            super().__init__()
            self.p = p

        def forward(self, x):
            keep = 1 - self.p
            mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
            return x * mask.div_(keep)

    class Bern(nn.Module):  # torch.bernoulli of probabilities
        def forward(self, x):
            return x * torch.bernoulli(torch.full_like(x, 0.8)) / 0.8

    torch.manual_seed(0)
    x = torch.randn(16, 4)
    for module in (DropPath(0.3), Bern()):
        model = nn.Sequential(nn.Linear(4, 4), module, nn.Linear(4, 1)).train()
        with dropout_off(model) as (names, mode):
            off = model(x)
        assert mode.calls == 1 and names == []
        assert torch.allclose(off, model[2](model[0](x)), atol=1e-6), module  # the identity, as timm's in eval mode
        assert not torch.allclose(model(x), off)  # outside it, it draws again
    with dropout_off(nn.Linear(1, 1)) as (_, mode):  # an integer mask is drawn as it is (fill(0.9) would zero it)
        drawn = torch.zeros(1000, dtype=torch.long).bernoulli_(0.9)
    assert mode.calls == 0 and 800 < int(drawn.sum()) < 1000


def test_the_dropout_draw_verdict_needs_a_finite_loss_and_weighs_ordinary_windows_with_dropout_off_too():
    """A review found: a NaN with dropout off passed as 'normal' (the rule returns no ratio for it), so the spike was
    blamed on the draw; and a bad sample's window under heavy dropout, judged against the rule's window (recorded with
    dropout on, higher), could pass too. Ordinary windows with dropout off are the bar as well."""
    from types import SimpleNamespace

    from torch import nn

    from stabletrain.spike_samples import dropout_draw as _dropout_draw

    window = [1.0 + 0.01 * i for i in range(30)]
    rule = lambda loss: spike_test(loss, window, GuardConfig())  # noqa: E731
    losses = {"spike": float("nan"), "ordinary": 0.2}
    bench = SimpleNamespace(replica=SimpleNamespace(model=nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))),
                            loss=lambda groups: losses[groups])
    nan = _dropout_draw(bench, "spike", rule, 2.0, 9.0, ["ordinary"])
    assert (nan["normal"], nan["made_by_draw"]) == (False, False), nan
    losses["spike"] = 1.5  # under the rule's bar (x1.5 its median), but x7.5 the ordinary windows with dropout off
    bad = _dropout_draw(bench, "spike", rule, 2.0, 9.0, ["ordinary"])
    assert (bad["normal"], bad["made_by_draw"], bad["ordinary"]) == (False, False, 0.2), bad
    losses["spike"] = 0.25  # as ordinary with dropout off: the draw made it
    assert _dropout_draw(bench, "spike", rule, 2.0, 9.0, ["ordinary"])["made_by_draw"] is True


def test_a_window_high_under_the_older_state_is_no_data_spike_where_ordinary_windows_rose_since():
    """A x30 LR from step 60 (the optimizer's): at step 62 the window was already high under the state of step 60
    (its first update at the new LR), and 3 of its samples carry 90% of it, but ordinary windows are a spike under this
    state too (3.25 against 0.26): the state drifted; it was 'data: samples 342, 705, 1454' (a trial), and SGD's one
    x50 step 'data: the batch itself is an outlier' with ordinary windows x72 under the new weights."""
    samples = {"indices": [342, 705, 1454], "share": 0.9, "without": {"loss": 0.3404, "ratio": 0.829}}
    case = {**_surge_case(window=1.742, ordinary=0.2604, current_ordinary=3.254, window_high=True, ordinary_high=True,
                          ordinary_spike_now=True, window_not_above_now=True, ratio=2.0), "loss": 2.1, "surges": [],
            "samples": samples}
    out = classify_spike(case)
    assert out["failure_class"] == "state" and out["blamed_samples"] is None, out
    assert ("the window is high under the state of step 150 too (1.742 vs 0.2604) and ordinary windows are high at 3.254 "
            "under this one (vs 0.2604), within x2 of the window's 2.1; samples 342, 705, 1454 carry 90% of the loss, but "
            "ordinary windows are high under this state too") in out["evidence"], out["evidence"]
    batch = classify_spike({**case, "samples": None})
    assert batch["failure_class"] == "state" and "the batch itself" not in batch["evidence"]
    # ordinary windows as they were: the samples are to blame
    calm = classify_spike({**case, "older": {**case["older"], "current_ordinary": 0.27, "ordinary_high": False,
                                             "ordinary_spike_now": False, "window_not_above_now": False}})
    assert calm["failure_class"] == "data" and calm["blamed_samples"] == [342, 705, 1454]
    # ordinary windows doubled from a tiny loss (0.0008 -> 0.0017), far under a window of 17: still the samples (lab 8)
    tiny = classify_spike({**case, "loss": 17.42, "older": {**case["older"], "window": 17.27, "ordinary": 0.0008289,
                                                            "current_ordinary": 0.001664, "ordinary_spike_now": False,
                                                            "window_not_above_now": False}})
    assert tiny["failure_class"] == "data" and tiny["blamed_samples"] == [342, 705, 1454], tiny
    # a spike just over the rule's bar (x2.1 the ordinary windows, which barely moved): within a spike ratio of them, but
    # nothing drifted: still the sample (a review: it read 'state', ordinary windows 'as high as the window')
    small = classify_spike({**case, "loss": 2.1, "older": {**case["older"], "window": 2.3, "ordinary": 1.0,
                                                           "current_ordinary": 1.1, "ordinary_high": False,
                                                           "ordinary_spike_now": False, "window_not_above_now": True}})
    assert small["failure_class"] == "data" and small["blamed_samples"] == [342, 705, 1454], small
    # a window under x2 ordinary windows that were no calm level under the older state is not called normal (nor 'no
    # higher': it said so of 5.079 vs 3.763; the test was the rule's ratio)
    unsettled = classify_spike({**case, "samples": None, "older": {**case["older"], "window": 3.194, "ordinary": 3.151,
                                                                    "window_high": False, "ordinary_then_high": True}})
    assert ("the window is not x2 (guard.spike_ratio) above ordinary windows under the state of step 150 (3.194 vs 3.151, "
            "themselves a spike by the guard's rule there)") in unsettled["evidence"], unsettled["evidence"]


def test_another_samples_spike_the_run_flagged_soon_after_is_not_held_against_the_cure(tmp_path):
    """Samples 168 and 200 spike at steps 22 and 26 (one interval: 26 flagged, not captured). The remedy search of
    step 22 failed every candidate at step 26, 4 steps on (a later incident is set apart only past END_STEPS): 'no
    candidate cures it'. The run flagged 26 itself: the candidates are judged up to step 25."""
    from stabletrain.remedy_search import search_remedies

    def task():  # sample 200 a smaller outlier than 168 (x10, not x40): the interval captures step 22's
        t = outlier_samples_task(bad=(168,))
        y = t.train_data.tensors[1]
        y[200] = y[200] * 10 + 10
        return t

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=30", "optim.lr=0.01", "log.every=10", "data.shuffle=false"),
            task=task(), run_dir=run_dir).fit()
    assert [e["step"] for e in _events(run_dir) if e["kind"] == "spike"] == [22, 26]
    incident = next(e for e in _events(run_dir) if e["kind"] == "incident")
    assert incident["step"] == 22 and incident["diagnosis"]["bad_samples"] == [168]
    record = search_remedies(Path(incident["path"]), task(), steps=6)
    c = {r["name"]: r for r in record["candidates"]}
    assert record["later_incident"] == 26 and c["skip-samples"]["verdict"] == "cures", record["summary"]
    # live (guard.on_spike=remedy): the cure is applied, and its event says how far it was verified ('on 20 steps')
    live = tmp_path / "live"
    Trainer(cfg("train.batch_size=8", "train.max_steps=30", "optim.lr=0.01", "log.every=10", "data.shuffle=false",
                "guard.on_spike=remedy"), task=task(), run_dir=live).fit()
    applied = next(e for e in _events(live) if e["kind"] == "remedy" and e.get("name"))
    assert applied["incident_step"] == 22 and "verified on the steps up to 25, before a later incident at step 26" in (
        applied["reason"]), applied["reason"]


def test_a_loss_at_a_new_level_is_data_not_a_drifted_state_and_the_stop_says_the_level_moved(tmp_path):
    """Targets shifted from step 30 on: every step after is a spike against the level before. Under on_spike=skip no
    update is applied after step 29, so a later spike (step 41, its interval's first) cannot be a drifted state: it is
    data at a new level, no sample blamed; no window the run never trained counts as ordinary (the run stops at 49);
    the stop after 20 skipped spikes says the loss moved to a new level."""
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=80",
                          "sched.warmup_steps=0", "sched.decay=constant", "optim.lr=0.01", "guard.on_spike=skip"),
                      task=level_shift_task(), run_dir=run_dir)
    trainer.fit()
    events = _events(run_dir)
    incidents = {e["step"]: e for e in events if e["kind"] == "incident"}
    assert 30 in incidents and 41 in incidents, sorted(incidents)
    assert incidents[30]["diagnosis"]["failure_class"] == "data"
    later = json.loads((run_dir / "incidents" / "step_000041" / "diagnosis.json").read_text())
    assert later["failure_class"] == "data" and later["bad_samples"] is None, later["summary"]
    assert "since step 30 (11 flagged steps in a row" in later["evidence"] and "new level" in later["evidence"]
    assert not load_bundle(run_dir / "incidents" / "step_000041")["observed"].get("context")  # 42-49 spikes, 50+ unseen
    (stop,) = [e for e in events if e["kind"] == "stop"]
    assert "20 consecutive skipped steps" in stop["reason"] and "at step 49" in stop["reason"], stop["reason"]
    assert "every one of them was a loss spike against the level before step 30" in stop["reason"]


def test_a_step_that_moved_nothing_shows_no_surge():
    """An fp16 overflow's skipped step moves no coordinate: its gradients past 10 sqrt(v) are no optimizer-state surge
    (it read 'moves them xinf as far as its others' on a planted data spike at an interval's first step). A layer whose
    other coordinates stayed still while the surging ones moved (a rare embedding row under Adam, beta1=0) still is."""
    from stabletrain.diagnostics.spike_evidence import surge_rows

    mask = torch.tensor([True, False, False, False])
    assert surge_rows({"w": (mask, 1e-3)}, {"w": torch.zeros(4)}) == []
    (row,) = surge_rows({"w": (mask, 1e-3)}, {"w": torch.tensor([0.5, 0.0, 0.0, 0.0])})
    assert row["coord_factor"] == math.inf and row["surge_share"] == 0.25
    (row,) = surge_rows({"w": (mask, 1e-3)}, {"w": torch.tensor([0.5, 0.01, 0.01, 0.01])})
    assert row["coord_factor"] == pytest.approx(50.0)


def test_under_warn_a_loss_at_a_new_level_goes_on_as_its_course_once_diagnosed(tmp_path, capsys):
    """on_spike=warn: every step after the shift is a spike against the level before; once a capture says the loss
    moved to a new level (5+ flagged steps in a row before it), the burst's later intervals are its course: one line,
    not a capture each (they spent capture.max_spikes)."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=60", "sched.warmup_steps=0",
                "sched.decay=constant", "optim.lr=0.001"), task=level_shift_task(), run_dir=run_dir).fit()
    incidents = [e["step"] for e in _events(run_dir) if e["kind"] == "incident"]
    assert incidents == [30, 31, 41], incidents  # the shift, its next interval's start, then the one that names the level
    out = capsys.readouterr().out
    assert "the burst of loss spikes captured at step 41 (data: a loss at a new level) goes on (steps 51-60 so far)" in out, out


def test_a_rollback_for_a_state_spike_says_that_skipping_its_data_may_not_cure_it(tmp_path):
    """guard.on_spike=rollback on an LR too high: the rollback skips the windows as ever, and its line says the
    diagnosis blames the state, not that data (a user saw the same divergence met after each rollback, unexplained)."""
    run_dir = tmp_path / "run"
    factory, kwargs, overrides, step = CASES["state"]
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "guard.on_spike=rollback", "ckpt.every=10",
                *overrides), task=factory(**kwargs), run_dir=run_dir).fit()
    events = _events(run_dir)
    rollbacks = [e for e in events if e["kind"] == "rollback"]
    classes = [json.loads((Path(e["path"]) / "diagnosis.json").read_text())["failure_class"]
               for e in events if e["kind"] == "incident"]
    assert rollbacks and classes[0] == "state", classes
    assert "never training on the data of step" in rollbacks[0]["reason"]
    assert rollbacks[0]["reason"].endswith("; the diagnosis names the state, not this data: going back without changing "
                                           "the LR, the clip or Adam's epsilon may meet it again (guard.on_spike/"
                                           "on_nonfinite=remedy tries those, verified by replay)"), rollbacks[0]["reason"]
    cured = run_dir.parent / "data"  # a data spike's rollback has no such clause
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "guard.on_spike=rollback", "ckpt.every=10",
                "train.max_steps=30", "optim.lr=0.01"), task=outlier_samples_task(), run_dir=cured).fit()
    assert all("diagnosis names" not in e["reason"] for e in _events(cured) if e["kind"] == "rollback")
    assert any(e["kind"] == "rollback" for e in _events(cured))


def test_a_huge_loss_before_the_rule_arms_is_said_once_and_an_ordinary_start_is_not(tmp_path, capsys):
    """A x1000 loss at step 3 or 4 passed in silence (the rule arms after 4 losses): one line and an event now,
    nothing skipped; a healthy run's falling first losses (and the steps after arming) get no such line. Nor did one on
    step 1, or on steps 1 and 2, which no loss precedes (a trial): against the losses after them, once step 5 is in,
    whatever the log interval."""
    for steps, every in (((3,), 5), ((4,), 5), ((1,), 5), ((1, 2), 1)):
        run_dir = tmp_path / f"at{steps}"
        bad = tuple(i for step in steps for i in range(8 * (step - 1), 8 * (step - 1) + 3))  # (unshuffled, batch 8)
        trainer = Trainer(cfg("train.batch_size=8", f"log.every={every}", "data.shuffle=false", "train.max_steps=6"),
                          task=outlier_samples_task(bad=bad, scale=300.0), run_dir=run_dir)
        trainer.fit()
        said = [e for e in _events(run_dir) if e["kind"] == "early_outlier"]
        assert [e["step"] for e in said] == list(steps) and all(e["factor"] > 32 for e in said), said
        for e, step in zip(said, steps):
            assert e["reason"].startswith(f"step {step}'s loss ") and "not judged (the spike rule arms after 4 losses)" \
                in e["reason"]
            assert ("the median of the losses after it (to step 5)" in e["reason"]) is (1 in steps), e["reason"]
        assert not [e for e in _events(run_dir) if e["kind"] in ("skip", "incident")]
        err = capsys.readouterr().err
        assert all(f"step {step}'s loss" in err for step in steps)
    healthy = tmp_path / "healthy"
    Trainer(cfg("train.batch_size=2", "log.every=5", "train.max_steps=10"), task=outlier_samples_task(bad=()),
            run_dir=healthy).fit()
    assert not [e for e in _events(healthy) if e["kind"] == "early_outlier"]


@pytest.mark.parametrize("on_spike", ["warn", "skip"])
def test_an_outlier_before_the_rule_arms_does_not_hide_the_same_corruption_later(tmp_path, capsys, on_spike):
    """A trial: corrupted samples at step 2 (said: 'not judged') lifted the early bound and the window's deviation, and
    the same corruption at step 19 passed without a word, applied under on_spike=skip. Step 2's loss is not kept in the
    window now: step 19 is a spike, skipped or captured, and its samples named."""
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=24", f"guard.on_spike={on_spike}"),
            task=outlier_samples_task(bad=(8, 9, 10, 150, 151, 152), scale=300.0), run_dir=run_dir).fit()
    events = _events(run_dir)
    (early,) = [e for e in events if e["kind"] == "early_outlier"]
    assert early["step"] == 2 and early["reason"].endswith(
        "not judged (the spike rule arms after 4 losses), not skipped or captured"), early["reason"]
    assert [e["step"] for e in events if e["kind"] == "spike"] == [19]
    assert [e["step"] for e in events if e["kind"] == "skip"] == ([19] if on_spike == "skip" else [])
    (incident,) = [e for e in events if e["kind"] == "incident"]
    # (their targets, y x 300 + 300 with y near -1, are -18, -4.6 and -2.8: the fewest that carry it are 150 and 151)
    assert incident["step"] == 19 and incident["diagnosis"]["bad_samples"] == [150, 151]
    assert "the largest loss before it" in capsys.readouterr().err


def test_a_spike_in_a_window_of_one_sample_names_that_sample(tmp_path):
    """Batch size 1: the outlier batch is its one sample; it was 'no set of up to 1 of the window's 1 samples makes the
    step normal' and named no sample (the index only in sample_losses): no skip-samples, no rollback to drop it."""
    from spike_tasks import outliers_at_task

    Trainer(cfg("train.batch_size=1", "log.every=10", "data.shuffle=false", "train.max_steps=160"),
            task=outliers_at_task(bad="153"), run_dir=tmp_path / "run").fit()
    [incident] = [e for e in _events(tmp_path / "run") if e["kind"] == "incident"]
    d = incident["diagnosis"]
    assert incident["step"] == 154 and (d["failure_class"], d["bad_samples"]) == ("data", [153]), d
    # (and, weighed against the run's other samples as a window of more would be: beyond them all)
    assert re.search(r"the window is one sample, 153: the batch is that sample; it is beyond all 255 other samples weighed "
                     r"under this state \(they reach [\d.]+ at most\): rare in the data", d["evidence"]), d["evidence"]



def test_a_hosts_one_step_lr_burst_is_named_with_its_step_and_lr(tmp_path, capsys):
    """A trial: a hand-written loop set its LR x300 for one step; the spike two steps later was 'state' with "the weights
    moved ... a large update, or several, among them", its LR never named (both states' LRs are the same). The kept
    steps' LRs name the step and the LR."""
    from torch import nn

    from stabletrain import Monitor

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(960, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(960, 1, generator=g)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)

    def loss_fn(m, b):
        return nn.functional.mse_loss(m(b[0]), b[1])

    with Monitor(model, opt, run_dir=tmp_path / "run", clip_max_norm=1.0, loss_fn=loss_fn, log_every=10) as monitor:
        for s in range(50):
            batch = (x[s * 16:(s + 1) * 16], y[s * 16:(s + 1) * 16])
            for group in opt.param_groups:
                group["lr"] = 3e-3 * (300 if s == 43 else 1)  # step 44's update
            loss = loss_fn(model, batch)
            monitor.backward(loss)
            monitor.step(batch)
    (incident,) = [e for e in _events(tmp_path / "run") if e["kind"] == "incident"]
    d = incident["diagnosis"]
    assert (incident["step"], d["failure_class"]) == (45, "state")
    said = "the LR jumped x300 at step 44's update (0.003 -> 0.9)"
    assert said in d["evidence"] and said in capsys.readouterr().out
    # A review: a linear warmup's stretch (its top LR x2 the others' median) and a schedule's step up were named as a
    # one-step burst; a ramp is no jump, a step up is one (where it came), and a jump before the older state is not its
    from stabletrain.diagnostics.spike import _lr_jump

    warmup = [[t, 5e-5 * t / 500] for t in range(0, 10)]
    assert _lr_jump(warmup, None) == "" and _lr_jump(warmup, {"step": 4}) == ""
    stepped = [[t, 1e-4 if t < 7 else 1e-3] for t in range(1, 10)]
    assert _lr_jump(stepped, {"step": 3}) == "; the LR jumped x10 at step 7's update (0.0001 -> 0.001)"
    assert _lr_jump(stepped, {"step": 7}) == ""


def test_a_small_batch_with_label_noise_is_the_losss_spread_not_a_third_of_its_steps_spiking(tmp_path):
    """A new user's healthy run (batch 2, a fifth of the labels at random): a third of its steps hold a mislabelled
    sample, x30 the median; each flagged and left out of the rule's window narrowed it, until 266 of 1,000 steps were
    spikes and captures were called 'state: the model or optimizer state drifted' on a flat curve. A spike is also rare
    now: the ratio a tenth of recent steps reach is the loss's spread. What is left are the batches of two mislabelled
    samples (a few per thousand), each captured as data, naming them."""
    run_dir = tmp_path / "run"
    task = noisy_labels_task()
    Trainer(cfg("train.batch_size=2", "train.max_steps=1000", "sched.warmup_steps=50", "sched.decay=cosine", "optim.lr=0.003",
                "log.every=50"), task=task, run_dir=run_dir).fit()
    events = _events(run_dir)
    spikes = [e["step"] for e in events if e["kind"] == "spike"]
    assert 0 < len(spikes) <= 20, spikes  # (266 before; 13 with the bar, 9 of them while the model first learns)
    diagnoses = [json.loads((Path(e["path"]) / "diagnosis.json").read_text()) for e in events if e["kind"] == "incident"]
    assert len(diagnoses) == 5 and {d["failure_class"] for d in diagnoses} == {"data"}, [d["summary"] for d in diagnoses]
    x, y = task.train_data.tensors
    truth = torch.cdist(x, noisy_labels_centers()).argmin(1)  # the blob each sample came from
    named = [i for d in diagnoses for i in d["bad_samples"] or []]
    assert named and all(int(y[i]) != int(truth[i]) for i in named), named  # each one mislabelled


@pytest.mark.parametrize("on_spike", ["warn", "skip"])
def test_a_spikes_bundle_holds_the_rarity_ring_from_before_it_not_its_own_ratio(tmp_path, on_spike):
    """A review: under guard.on_spike=skip the capture's replay stood just before the spike, but the ring was read after
    the replay had put the boundary's state back: the bundle held the spike's own ratio (x1.5e3) and the steps after
    it, and a remedy's replay seeded from it let a burst's next spikes pass as cured."""
    factory, kwargs, overrides, step = CASES["data"]
    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=7", "data.shuffle=false", f"guard.on_spike={on_spike}", *overrides),
            task=factory(**kwargs), run_dir=run_dir).fit()
    observed = load_bundle(run_dir / "incidents" / f"step_{step:06d}")["observed"]
    spike = next(e for e in _events(run_dir) if e["kind"] == "spike" and e["step"] == step)
    window = sorted(observed["spike_window"])
    ratio = spike["loss"] / window[(len(window) - 1) // 2]
    ring = [r for r in observed["rarity"]["ring"] if not math.isnan(r)]
    assert ratio > 100 and ring and max(ring) < ratio / 10, (ratio, ring)
    # the ratios of the steps the rule judged before the spike: the replay's (skip) or the interval start's (warn: up to
    # log.every - 1 fewer)
    judged = step - 1 - 4  # (the rule arms on 4 losses; every step before the spike judged after that)
    assert observed["rarity"]["seen"] == (judged if on_spike == "skip" else 14 - 4), observed["rarity"]["seen"]


def test_an_lr_jump_that_is_the_rise_since_the_older_state_is_said_once():
    """A trial (Lightning, an LR x30 by the user's scheduler): "the LR jumped x30 at step 151's update (0.003 -> 0.09);
    the LR rose x30 since step 150 (0.003 -> 0.09)". Said once, as the rise; a jump that the LR came back from (no rise
    since the older state) and a rise with no one-step jump keep their own clause."""
    from stabletrain.diagnostics.spike import _lr_told

    older = {"step": 150, "lr": {"then": 0.003, "now": 0.09}}
    lrs = [[150, 0.003], [151, 0.09], [152, 0.09]]
    assert _lr_told(lrs, older) == "; the LR rose x30 since step 150 (0.003 -> 0.09)"
    back = [[150, 0.003], [151, 0.9], [152, 0.003]]
    assert _lr_told(back, {"step": 150, "lr": None}) == "; the LR jumped x300 at step 151's update (0.003 -> 0.9)"
    ramp = [[150, 0.003], [151, 0.006], [152, 0.012], [153, 0.024], [154, 0.09]]
    assert _lr_told(ramp, older) == "; the LR rose x30 since step 150 (0.003 -> 0.09)"


def test_a_precision_spike_names_the_sample_where_the_rounding_bites(tmp_path):
    """A trial's bf16 run: one row with a constant offset on its input carried 92% of the spike's window, and the
    precision diagnosis (right: 'center' alone in fp32 cures it) never named it. Where a few samples carry the window
    and the step without them is normal, the evidence names them; the remedy search has no lower LR to offer (chance)."""
    from spike_tasks import offset_row_task

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=16", "log.every=8", "train.max_steps=24", "precision=bf16"), task=offset_row_task(),
            run_dir=run_dir).fit()
    d = json.loads((run_dir / "incidents" / "step_000022" / "diagnosis.json").read_text())
    assert d["failure_class"] == "precision" and d["blamed_module"] == "center" and d["bad_samples"] is None, d["summary"]
    assert re.search(r"; in bf16 sample 100 carries \d+% of the window's loss \(without it the step is normal: where the "
                     r"rounding bites\)$", d["evidence"]) and d["samples"]["share"] > 0.8, d["evidence"]


def test_samples_a_batch_norm_couples_in_a_large_window_are_found_by_their_inputs(tmp_path):
    """A trial's CNN, three images at x100 in a window of 32: the evidence read 'no set of up to 8 of the window's 32
    samples makes the step normal' (too many sets to try every one, and a set of 3 did) and 'the batch itself is an
    outlier'. Their own losses are 0 and dropping one leaves the other two in charge of the statistics; the samples
    whose inputs stand out are tried too: the three are named and verified."""
    from spike_tasks import bright_images_cnn_task

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=32", "train.max_steps=121", "optim.lr=0.003", "log.every=10", "data.shuffle=false",
                "ckpt.every=0"), task=bright_images_cnn_task(), run_dir=run_dir).fit()
    d = json.loads((run_dir / "incidents" / "step_000120" / "diagnosis.json").read_text())
    assert d["failure_class"] == "data" and d["bad_samples"] == [3813, 3822, 3831], d["summary"]
    assert d["samples"]["search"].startswith("the samples whose inputs stand out most"), d["samples"]


def test_a_sequence_repeated_across_half_the_window_is_named_as_copies_of_one(tmp_path):
    """A trial's tiny LM: 8 of a window's 16 sequences all one token (a duplicated shard) carried 78% of its loss, and
    the evidence read 'no small set of its samples carries it: the batch itself is an outlier' (a set names a quarter
    at most). One input repeated is one defect: the copies are named, their removal verified, and said so."""
    from spike_tasks import repeated_sequence_task

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=16", "train.max_steps=151", "optim.lr=0.003", "log.every=10", "data.shuffle=false",
                "ckpt.every=0"), task=repeated_sequence_task(), run_dir=run_dir).fit()
    d = json.loads((run_dir / "incidents" / "step_000150" / "diagnosis.json").read_text())
    assert d["failure_class"] == "data" and d["bad_samples"] == list(range(2384, 2392)), d["summary"]
    assert d["samples"]["copies"] == 8 and d["evidence"].endswith(
        "; they are 8 copies of one sample, alike in every value (a duplicated row or shard: the data's, not many bad "
        "samples)"), d["evidence"]


def test_no_remedy_needed_for_a_bursts_spike_says_the_windows_its_skip_drops(tmp_path):
    """A trial's bad shard (four batches in a row holding copies of one sequence), guard.on_spike=remedy: the line read
    'skipping its step cures it' where the baseline dropped the incident's window and the 3 after it (a burst), each
    skipped as it spiked."""
    from spike_tasks import repeated_sequence_task

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=16", "train.max_steps=160", "optim.lr=0.003", "log.every=10", "data.shuffle=false",
                "guard.on_spike=remedy", "remedy.steps=10"), task=repeated_sequence_task(steps=4),
            run_dir=run_dir).fit()
    (said,) = [e["reason"] for e in _events(run_dir) if e["kind"] == "remedy" and e["step"] == 150]
    assert said.startswith("no remedy needed for the data incident at step 150: skipping its window and the 3 after it "
                           "(a burst) cures it on the replay"), said


def test_copies_are_told_by_every_byte_of_a_sample_and_the_group_that_carries_the_loss():
    """A review of _copies: numpy arrays compared by their repr (cut to its edges past 1000 elements) made 15 different
    images 'copies'; an object's repr tells nothing; the largest group by count (empty padding rows) hid the one that
    carries the loss."""
    import numpy as np

    from stabletrain.spike_samples import _copies

    def bench(items):
        return SimpleNamespace(task=SimpleNamespace(train_data=items))

    images = [np.zeros((3, 32, 32), dtype=np.float32) for _ in range(16)]
    for k, im in enumerate(images):
        im[1, 16, 16] = k  # different in the middle only
    rows = [{"sample": i, "share": 1 / 16} for i in range(16)]
    assert _copies(bench([(im, 0) for im in images]), rows) == []
    assert _copies(bench([(images[0], 0)] * 12 + [(im, 0) for im in images[12:]]), rows) == list(range(12))
    assert _copies(bench([(object(), 0)] * 16), rows) == []
    pad, bad = torch.zeros(4), torch.full((4,), 7.0)  # 6 padding rows (little loss), 4 copies that carry 80% of it
    items = [(pad,)] * 6 + [(bad,)] * 4 + [(torch.randn(4),) for _ in range(6)]
    shares = [0.001] * 6 + [0.2] * 4 + [0.194 / 6] * 6
    assert _copies(bench(items), [{"sample": i, "share": s} for i, s in enumerate(shares)]) == [6, 7, 8, 9]


def test_a_window_of_64_finds_its_coupled_samples_by_their_inputs_within_its_budget(tmp_path):
    """A review: a window of 64 spends 65 forward passes on each sample's removal, and the tries by the inputs that
    stand out then ran past the search's budget of 96 ('stopped at its budget' beside the set it found; with more
    samples the set was thrown away). Their tries have room of their own."""
    from spike_tasks import bright_images_cnn_task

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=64", "train.max_steps=61", "optim.lr=0.003", "log.every=10", "data.shuffle=false",
                "ckpt.every=0"), task=bright_images_cnn_task(bad_step=60, batch=64, n_bad=7), run_dir=run_dir).fit()
    d = json.loads((run_dir / "incidents" / "step_000060" / "diagnosis.json").read_text())
    assert d["bad_samples"] == [3781 + 9 * k for k in range(7)], d["summary"]
    assert d["samples"]["search"] == ("the samples whose inputs stand out most (their norm), the largest first (the loss "
                                      "couples them)"), d["samples"]["search"]
