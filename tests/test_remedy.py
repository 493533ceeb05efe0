"""Verified remedies (``stabletrain remedy``): each planted fault replayed from its bundle under the candidates that fit
its class; the verdicts, the first bad steps and the ranking are asserted, not just that a table prints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from helpers import cfg

from stabletrain import Trainer
from stabletrain.cli import main
from stabletrain.config import ConfigError
from stabletrain.diagnostics.cures import (
    EpsGuard,
    LowerLR,
    ModuleFP32,
    Precision,
    RollbackLR,
    Scaler,
    SkipSamples,
    SkipStep,
    TighterClip,
    remedy_from_dict,
)
from stabletrain.diagnostics.remedy_verdicts import before_later_incident
from stabletrain.records.bundles import load_bundle
from stabletrain.remedy_search import LOSS_TOLERANCE, format_table, judge, search_remedies
from stabletrain.report import write_report

DIVERGING = ("optim.name=sgd", "optim.lr=2.5", "optim.weight_decay=0", "clip.max_norm=null", "sched.warmup_steps=20",
             "sched.decay=constant", "ckpt.every=10", "guard.max_consecutive_skips=3")


def incident_of(tmp_path, spec, *overrides):
    """Train task factory ``spec`` (8 samples a step, in order) to its first non-finite incident; return its folder."""
    c = cfg("train.batch_size=8", "log.every=5", "data.shuffle=false", *overrides, task=spec)
    Trainer(c, run_dir=tmp_path / "run").fit()
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    return Path(next(e["path"] for e in events if e["kind"] == "incident" and e.get("anomaly") != "spike"))


def by_name(record):
    return {c["name"]: c for c in record["candidates"]}


def test_a_sqrt_of_zero_is_cured_by_the_eps_guard_and_by_skipping_its_sample_not_by_a_lower_lr(tmp_path):
    # 32 samples, 8 a step: sample 13 is in step 2 and again in step 6 (the next epoch), inside K = 6.
    incident = incident_of(tmp_path, "remedy_tasks:sqrt_zero_task", "train.max_steps=3")
    record = search_remedies(incident, steps=6)
    c = by_name(record)
    assert (record["step"], record["failure_class"]) == (2, "op")
    assert [n for n in c] == ["skip-samples", "eps-guard", "lr-x0.5", "lr-x0.1", "skip-step"]  # ranked
    assert c["skip-samples"]["verdict"] == c["eps-guard"]["verdict"] == "cures"
    assert c["skip-samples"]["remedy"] == {"kind": "skip-samples", "samples": [13]}
    assert c["skip-samples"]["dropped_samples"] == 2 and c["skip-samples"]["steps_replayed"] == 7  # steps 2..8
    assert c["eps-guard"]["remedy"]["module"] == "layers.1" and c["eps-guard"]["remedy"]["op"] == "sqrt"
    assert c["eps-guard"]["change"].endswith("faults.py:39: x.clamp_min(eps) with eps=1e-12")
    for name in ("lr-x0.5", "lr-x0.1"):  # the LR cannot change a backward through sqrt(0)
        assert (c[name]["verdict"], c[name]["failed"]["step"]) == ("fails", 2)
    assert (c["skip-step"]["verdict"], c["skip-step"]["failed"]["step"]) == ("fails", 6)  # the sample comes back
    assert record["best"] == "skip-samples"
    assert json.loads((incident / "remedy.json").read_text()) == record


def test_a_log_of_a_softmax_that_rounded_to_0_is_told_to_compute_log_softmax_in_one_op(tmp_path):
    """A new user's trial: for torch.log(torch.softmax(x)) whose softmax rounded a probability to 0, the only code change
    offered was a clamp of the log's input; the stable form, log_softmax, never computes the 0. Sample 5 is in step 0."""
    incident = incident_of(tmp_path, "remedy_tasks:log_softmax_task", "train.max_steps=3")
    record = search_remedies(incident, steps=2, only=["eps-guard"])
    guard = by_name(record)["eps-guard"]
    assert (record["failure_class"], guard["remedy"]["op"], guard["remedy"]["module"]) == ("op", "log", "layers.1")
    assert guard["change"].startswith("keep the input of log away from 0 at ") and "faults.py:" in guard["change"]
    assert guard["change"].endswith("; better, compute the log in one op: log_softmax (torch.log_softmax / "
                                    "F.log_softmax) never rounds to log(0)")
    where = guard["change"].split(" at ")[1].split(": x.clamp_min")[0]  # file:line of torch.log(torch.softmax(...))
    assert "better" not in EpsGuard("layers.1", "sqrt", 1e-12, where).change  # a root's guard on that line: no such form


def test_an_eps_guard_on_a_negative_log_input_is_no_cure_by_the_rules_early_bar(tmp_path, monkeypatch):
    """examples/nan_task.py: sample 37 is -1, and log(-1) is NaN at step 7, before the spike rule arms. Clamped to
    1e-12 the input gives log(1e-12) = -27.6, a loss x22 the run's: 'cures' (the rule could not yet judge it), and
    its code change told the user to clamp a negative input. The early bar: x8 every loss before it, two at least."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # (examples/ is the repository's, not installed)
    incident = incident_of(tmp_path, "examples.nan_task:make_task", "train.max_steps=8", "train.batch_size=16")
    record = search_remedies(incident, steps=6)
    c = by_name(record)
    # The guard is no longer offered for a negative input at all (a NaN from log's forward of finite inputs): it was
    # 'cured' where the spike rule had armed (a student's trial, the same -0.5 at step 22); skipping the sample cures.
    assert c["skip-samples"]["verdict"] == "cures" and "eps-guard" not in c, list(c)


def test_a_divergence_is_cured_by_a_lower_lr_from_before_the_growth_not_by_skipping(tmp_path, capsys):
    incident = incident_of(tmp_path, "remedy_tasks:diverging_task", "train.max_steps=60", *DIVERGING)
    capsys.readouterr()
    assert main(["remedy", str(incident), "--steps", "4"]) == 0  # the non-finite incident (RUN_DIR: its first, a spike)
    printed = capsys.readouterr().out
    record = json.loads((incident / "remedy.json").read_text())
    c = by_name(record)
    assert (record["step"], record["failure_class"]) == (38, "divergence")
    assert "skip-samples" not in c  # no sample to blame
    assert c["rollback-lr-x0.1"]["verdict"] == "cures" and c["rollback-lr-x0.1"]["remedy"]["step"] == 10
    assert c["rollback-lr-x0.1"]["first_step"] == 11 and c["rollback-lr-x0.1"]["steps_replayed"] == 32  # 11..42
    assert (c["skip-step"]["verdict"], c["skip-step"]["failed"]["step"]) == ("fails", 39)
    for name in ("lr-x0.5", "lr-x0.1", "clip"):  # from the pre-step state the weights are already huge
        assert (c[name]["verdict"], c[name]["failed"]["step"]) == ("fails", 38)
    assert c["rollback-lr-x0.5"]["verdict"] == "fails" and "spike" in c["rollback-lr-x0.5"]["evidence"]
    assert record["best"] == "rollback-lr-x0.1"
    lines = printed.splitlines()
    assert lines[3].split()[:3] == ["1", "rollback-lr-x0.1", "cures"] and "best: rollback-lr-x0.1" in printed
    page = write_report(tmp_path / "run").read_text()
    assert 'id="remedies"' in page and "<code>rollback-lr-x0.1</code>" in page and "back to step 10, lr x0.1" in page


def test_an_fp16_overflow_in_one_module_is_cured_by_that_module_in_fp32(tmp_path):
    incident = incident_of(tmp_path, "remedy_tasks:fp16_overflow_task", "train.max_steps=2", "precision=fp16")
    record = search_remedies(incident, steps=4, only=["module-fp32", "lr-x0.1", "scaler"])
    c = by_name(record)
    assert record["failure_class"] == "overflow"
    assert list(c) == ["module-fp32", "scaler", "lr-x0.1", "skip-step"]
    # The activations overflow float16 in forward: no loss scale reaches them.
    assert (c["scaler"]["verdict"], c["scaler"]["failed"]["step"]) == ("fails", 1)
    assert c["module-fp32"]["verdict"] == "cures" and c["module-fp32"]["remedy"] == {"kind": "module-fp32",
                                                                                      "module": "layers.1.fc"}
    assert (c["lr-x0.1"]["verdict"], c["lr-x0.1"]["failed"]["step"]) == ("fails", 1)
    assert (c["skip-step"]["verdict"], c["skip-step"]["failed"]["step"]) == ("fails", 2)


def test_a_candidate_that_turns_a_late_overflow_into_a_x140_loss_fails_by_the_runs_own_rule(tmp_path):
    """A new user's fp16 overflow at step 121 (sensors with a DC offset past fp16's range): 'bf16 cures' while its replay
    had a x140 loss at the step. A non-finite step's bundle had no window of the rule's: the replays were judged against
    the run's interval means, its first falling losses among them, which kept the rule in its early bound. The bundle
    holds the rule's window now, as a spike's does: bf16 fails by a spike at 121; module-fp32 and the samples' drop cure."""
    incident = incident_of(tmp_path, "remedy_tasks:dc_offset_task", "train.max_steps=122", "train.batch_size=8",
                           "precision=fp16", "optim.lr=0.01", "sched.warmup_steps=0", "sched.decay=constant")
    assert incident.name == "step_000121"
    assert len(json.loads(json.dumps(load_bundle(incident)["observed"]["spike_window"]))) == 50
    record = search_remedies(incident, steps=4, only=["bf16", "module-fp32", "skip-samples"])
    c = by_name(record)
    assert record["failure_class"] == "overflow" and c["bf16"]["verdict"] == "fails", c["bf16"]
    assert c["bf16"]["failed"]["step"] == 121 and "loss spike at step 121 by the guard's rule" in c["bf16"]["evidence"]
    assert c["module-fp32"]["verdict"] == "cures" and c["skip-samples"]["verdict"] == "cures"


@pytest.mark.parametrize("step,every", [(45, 5), (41, 5), (42, 5), (45, 1)])
def test_a_nan_sample_after_a_level_shift_is_cured_by_its_drop_at_the_new_level(tmp_path, step, every):
    """A review of the rule's window in a non-finite bundle: after a level shift that guard.on_spike=warn trained through
    (the rule flags every step at the new level, its window stays at the old one), a NaN sample's drop was judged a spike
    at the new level and failed, the baseline too. Where most of the interval's steps before the incident were above
    spike_ratio x the window's median, the replays are judged against the run's interval means, as before; on an
    interval's first steps (every step at log.every=1), where the steps flagged in a row right before it were (a review:
    the interval's few steps before it decided alone, none on its first step)."""
    from spike_tasks import level_shift_task

    task = level_shift_task()
    sample = (step - 1) * 8
    task.train_data.tensors[0][sample] = float("nan")  # batch 8, data in order; the level moves at step 30
    Trainer(cfg("train.batch_size=8", f"log.every={every}", "data.shuffle=false", f"train.max_steps={step + 1}",
                "sched.warmup_steps=0", "sched.decay=constant", "optim.lr=0.001", "capture.spikes=false", "ckpt.every=0"),
            task=task, run_dir=tmp_path / "run").fit()
    incident = tmp_path / "run" / "incidents" / f"step_{step:06d}"
    # the bundle holds the rule's window (a remedy's replays are judged by it), its diagnosis.json does not (a NaN's)
    told = json.loads((incident / "diagnosis.json").read_text())["observed"]
    assert "spike_window" in load_bundle(incident)["observed"] and not {"spike_window", "rarity"} & set(told), told
    c = by_name(search_remedies(incident, task, steps=4, only=["skip-samples"]))
    assert c["skip-samples"]["verdict"] == "cures" and c["skip-samples"]["remedy"]["samples"] == [sample], c["skip-samples"]
    assert c["skip-step"]["verdict"] == "cures", c["skip-step"]


def test_remedy_cli_errors_are_one_line_naming_the_value(tmp_path, capsys):
    assert main(["remedy", str(tmp_path), "--only", "bogus"]) == 2
    assert "--only: unknown candidate bogus; the candidates are skip-step" in capsys.readouterr().err
    # K=0 replayed the incident's window alone: a clamp 'cured' it on one step, its end loss judged against nothing
    for name in ("step_000003", "step_000007"):  # (a run with two incidents: its "holds 2 incidents" line came first)
        (tmp_path / "incidents" / name).mkdir(parents=True)
    assert main(["remedy", str(tmp_path), "--steps", "0"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "stabletrain: error: --steps: expected an integer >= 1 (the windows replayed after the incident's), got 0"]
    with pytest.raises(ConfigError, match=r"^config key 'remedy.steps': expected an integer >= 1, got 0$"):
        cfg("remedy.steps=0")
    assert main(["remedy", str(tmp_path)]) == 2
    assert "no bundle.pt there" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["remedy", "--help"])
    out = capsys.readouterr().out
    assert "--steps K" in out and "cures" in out and "(default: 20)" in out


@pytest.mark.parametrize("remedy", [SkipStep(), SkipSamples((3, 7)), ModuleFP32("layers.1"), Precision("bf16"),
                                    Scaler(256.0, 0.125), LowerLR(0.1, steps=20), RollbackLR(0.5, step=10), TighterClip(0.25),
                                    EpsGuard("layers.1", "sqrt", 1e-12, "model.py:3")], ids=lambda r: r.kind)
def test_every_remedy_round_trips_through_json(remedy):
    assert remedy_from_dict(json.loads(json.dumps(remedy.to_dict()))) == remedy
    with pytest.raises(ValueError, match="remedy kind 'nope'"):
        remedy_from_dict({"kind": "nope"})


def test_a_candidate_that_drops_most_samples_only_hides_the_symptom_and_one_ending_worse_is_worse():
    base = {"failed": None, "dropped_samples": 8, "total_samples": 56, "end_loss": 1.0, "first_step": 2,
            "trajectory": [{"step": 8}]}
    hides = {**base, "dropped_samples": 40}
    assert judge(hides, base) == ("fails", "hides the symptom: drops 40 of the 56 samples it replays")
    verdict, evidence = judge({**base, "end_loss": 1.0 + 2 * LOSS_TOLERANCE}, base)
    assert verdict == "worse" and "vs baseline 1" in evidence
    assert judge({**base, "end_loss": 1.0 + LOSS_TOLERANCE / 2}, base)[0] == "cures"
    # A spike's cure may end above the baseline but within the run's own level before the spike: said that way (it
    # read "x2.31, tolerance x1.1, or the run's ...", a failure at first sight).
    verdict, evidence = judge({**base, "end_loss": 2.3}, base, typical=2.25)
    # (and what that level is: the median the rule judged the spike against, not the steps just before it)
    assert verdict == "cures" and "end loss 2.3, within x1.1 of the run's 2.25 before the spike (the median its rule " \
        "judged the spike against; x1.02; the baseline's 1 is lower)" in evidence
    assert judge({**base, "end_loss": 1.05}, base, typical=2.25)[1].endswith(
        "or the run's 2.25 before the spike (the median its rule judged the spike against)")


def test_where_the_baseline_fails_on_a_divergence_a_finite_end_far_above_the_last_healthy_loss_is_worse():
    failed = {"failed": {"step": 38, "why": "non-finite grad norm at step 38"}, "end_loss": float("nan")}
    still_diverged = {"failed": None, "dropped_samples": 0, "total_samples": 88, "end_loss": 1.67e22, "first_step": 31,
                      "trajectory": [{"step": 41}]}
    verdict, evidence = judge(still_diverged, failed, healthy=(5, 2.7))
    assert verdict == "worse" and "end loss 1.67e+22 vs 2.7 at step 5, the last healthy interval" in evidence
    assert judge({**still_diverged, "end_loss": 3e-7}, failed, healthy=(5, 2.7))[0] == "cures"
    assert judge(still_diverged, failed)[0] == "cures"  # no bar (not a divergence): finite and no spike


def test_a_divergence_whose_intervals_before_its_growth_all_held_spikes_is_judged_against_its_first_loss():
    """SGD at lr 1.2: the loss x4 a step from step 1; its first logged interval (step 10) held 6 spikes at 5.1e5, and
    that was 'the last healthy interval' every candidate ending below it 'cured'."""
    from stabletrain.diagnostics.remedy_verdicts import healthy_bar

    divergence = {"failure_class": "divergence", "growth": {"since_step": 10}}
    history = [{"step": 10, "loss": 5.145e5, "loss_min": 34.0, "num_spikes": 6},
               {"step": 20, "loss": 3e9, "loss_min": 1e8, "num_spikes": 10}]
    bar = healthy_bar(history, divergence)
    assert bar[:2] == (10, 34.0) and bar[2].startswith("the lowest loss of the run's first interval"), bar
    assert healthy_bar([{"step": 5, "loss": 2.7, "loss_min": 2.5, "num_spikes": 0}, *history], divergence) == (
        5, 2.7, "the last healthy interval")
    failed = {"failed": {"step": 38, "why": "non-finite loss at step 38"}, "end_loss": float("nan")}
    verdict, evidence = judge({"failed": None, "dropped_samples": 0, "total_samples": 88, "end_loss": 76.7,
                               "first_step": 5, "trajectory": [{"step": 11}]}, failed, healthy=bar)
    assert verdict == "worse" and "vs 34 at step 10, the lowest loss of the run's first interval" in evidence, evidence


def test_a_spike_candidate_is_held_to_the_runs_level_before_the_spike():
    """A spike's bar is the median of the losses its rule judged it against: where the baseline cures, a candidate no
    worse than that level cures (near 1e-3, noise alone is x2 between replays); where it fails (the spike comes back),
    a candidate that ends 60x above that level is no cure (lab 8's rollback-lr-x0.1 passed so)."""
    ok = {"failed": None, "dropped_samples": 0, "total_samples": 88, "end_loss": 4e-4, "first_step": 74,
          "trajectory": [{"step": 81}]}
    assert judge({**ok, "end_loss": 9e-4}, ok, typical=1.3e-3)[0] == "cures"
    assert judge({**ok, "end_loss": 9e-4}, ok)[0] == "worse"  # without the spike's bar: x2.25 the baseline
    failed = {"failed": {"step": 76, "why": "loss spike at step 76 by the guard's rule (loss 0.0386)"},
              "end_loss": float("nan")}
    verdict, evidence = judge({**ok, "end_loss": 0.0793}, failed, typical=1.33e-3)
    assert verdict == "worse" and "end loss 0.0793 vs 0.00133, the run's before the spike" in evidence
    assert judge({**ok, "end_loss": 1.2e-3}, failed, typical=1.33e-3)[0] == "cures"


def test_the_tables_last_line_says_when_skipping_the_step_is_all_it_needs():
    def row(name, verdict, baseline=False):
        return {"name": name, "verdict": verdict, "baseline": baseline, "end_loss": 0.1, "detail": f"{name} detail",
                "evidence": "", "change": None}

    record = {"step": 75, "failure_class": "state", "evidence": "e", "note": None, "steps": 4,
              "timings": {"steps_replayed": 9, "total_s": 0.1}, "best": None,
              "candidates": [row("skip-step", "cures", True), row("lr-x0.5", "fails")]}
    assert format_table(record).splitlines()[-1] == ("no candidate cures it beyond the baseline: skip-step detail "
                                                     "(skip-step) is all it needs")
    record["candidates"][0]["verdict"] = "fails"
    assert format_table(record).splitlines()[-1] == "no candidate cures this incident"
    record["best"] = "lr-x0.5"
    assert format_table(record).splitlines()[-1] == "best: lr-x0.5"


def test_a_precision_spikes_verified_module_is_ranked_over_one_that_ends_a_hair_lower():
    """A trial: the diagnosis verified 'norm' (its h*h overflowed fp16); 'inp', the Linear before it, ranked first on an
    end loss 3e-5 lower (0.07538 vs 0.07541) and was applied live, and 'best: module-fp32' did not say which."""
    from stabletrain.remedy_search import rank

    def row(detail, end, verdict="cures"):
        return {"name": "module-fp32", "verdict": verdict, "baseline": False, "end_loss": end, "detail": detail,
                "evidence": "", "change": None, "live": True, "dropped_samples": 0, "rewound_steps": 0, "scope": 0}

    rows = [row("module 'norm' in fp32", 0.07541), row("module 'inp' in fp32", 0.07538), row("module 'x' in fp32", 0.06)]
    ranked = rank(rows)  # (the candidates' order, the verified module first, among end losses within 1% of the lowest)
    assert [r["detail"] for r in ranked] == ["module 'x' in fp32", "module 'norm' in fp32", "module 'inp' in fp32"]
    rows[0]["end_loss"] = 0.0601  # within 1% of x's 0.06: the candidates' order
    assert [r["detail"] for r in rank(rows)] == ["module 'norm' in fp32", "module 'x' in fp32", "module 'inp' in fp32"]
    # (a review: 2-digit rounding split 0.07551 from 0.07548, and tied 1.049 with 1.0)
    shifted = rank([row("norm", 0.07551), row("inp", 0.07548)])
    apart = rank([row("a", 1.049), row("b", 1.0), row("c", float("nan")), row("d", 2.0, verdict="worse")])
    assert [r["detail"] for r in shifted] == ["norm", "inp"] and [r["detail"] for r in apart] == ["b", "a", "c", "d"]
    record = {"step": 80, "failure_class": "precision", "evidence": "e", "note": None, "steps": 4, "best": "module-fp32",
              "timings": {"steps_replayed": 9, "total_s": 0.1}, "candidates": ranked[1:]}
    assert format_table(record).splitlines()[-1] == "best: module-fp32 (#1: module 'norm' in fp32)"


def test_the_readme_worked_example_prints_what_the_readme_shows(tmp_path, capsys):
    """docs/remedies.md's worked example, every line it shows (the train command's lines it does not elide with '...',
    the remedy command's whole output), against a run: what is the same on every CPU exactly (the words, the steps and
    counts, the ranking, each verdict and candidate), the numbers with a fraction or an exponent within 5% (the page's
    come from one machine, it says which; another CPU's last digits differ: 7.717e-08 for 7.72e-08). Issue 33 item 2:
    the page had gone stale where the test compared only the first line's text before " (" and the table."""
    from pathlib import Path

    readme = (Path(__file__).parents[1] / "docs" / "remedies.md").read_text(encoding="utf-8")
    block = readme.split("## A worked example: a divergence", 1)[1].split("```\n", 2)[1]
    train_shown, remedy_shown = block.split("$ stabletrain remedy runs/diverge/incidents/step_000038 --steps 4\n")
    train_shown = [x for x in train_shown.splitlines() if x.startswith("stabletrain: ")]  # after the command
    remedy_shown = remedy_shown.splitlines()
    run = tmp_path / "diverge"
    assert main(["train", "task=examples.diverging_task:make_task", "optim.name=sgd", "optim.lr=2.5", "optim.weight_decay=0",
                 "clip.max_norm=null", "sched.decay=constant", "train.batch_size=8", "train.max_steps=60", "log.every=5",
                 "ckpt.every=10", "ckpt.keep=10", "data.shuffle=false", f"run.dir={run}", "log.tensorboard=false"]) == 1
    out = capsys.readouterr()
    printed = (out.out + out.err).replace(str(run), "runs/diverge").splitlines()
    assert len(train_shown) == 3  # the first spike, the first incident, the stop
    for line in train_shown:  # in the order shown
        head = line.split(": ", 2)[:2]
        ours = next((x for x in printed if x.split(": ", 2)[:2] == head), None)
        assert ours is not None, f"no line {': '.join(head)!r} printed"
        assert_same_but_digits(ours, line)
        printed = printed[printed.index(ours) + 1:]
    assert main(["remedy", str(run / "incidents" / "step_000038"), "--steps", "4"]) == 0
    printed = capsys.readouterr().out.replace(str(run), "runs/diverge").splitlines()
    assert len(printed) == len(remedy_shown) == 11  # 2 lines, the header and 6 candidates, best, written to
    for i in (0, 1, 9, 10):
        assert_same_but_digits(printed[i], remedy_shown[i], seconds=i == 1)
    (ours, our_numbers), (theirs, their_numbers) = table_rows(printed[2:]), table_rows(remedy_shown[2:])
    assert ours == theirs and len(ours) == 7  # the header and 6 candidates, ranked
    assert our_numbers == pytest.approx(their_numbers, rel=0.05) and len(their_numbers) >= 4
    assert printed[-2] == remedy_shown[-2] == "best: rollback-lr-x0.1"


def assert_same_but_digits(ours: str, shown: str, seconds: bool = False) -> None:
    """``ours`` reads as ``shown``: the same text with its numbers that have a fraction or an exponent taken out, and
    those numbers within 5%. ``seconds``: a wall time "(..., N s)" is left out (it depends on the machine's load)."""
    if seconds:
        ours, shown = (re.sub(r", [\d.]+ s\)", ", <t> s)", x) for x in (ours, shown))
    assert _FLOAT.sub("<x>", ours) == _FLOAT.sub("<x>", shown), f"\nprinted: {ours}\nshown:   {shown}"
    numbers = [[float(x) for x in _FLOAT.findall(line)] for line in (ours, shown)]
    assert numbers[0] == pytest.approx(numbers[1], rel=0.05), f"\nprinted: {ours}\nshown:   {shown}"


_FLOAT = re.compile(r"-?\d+(?:\.\d+)?e[+-]?\d+|-?\d+\.\d+")


def table_rows(lines: list[str]) -> tuple[list[tuple[str, ...]], list[float]]:
    """The rows of a printed remedy table (its header first, up to the line "best: ..."), each column's text with its
    numbers that have a fraction or an exponent taken out (as "<x>"), and those numbers in order. The columns are found
    from the header's words, so a wider number does not shift what is compared."""
    header, *rest = lines
    starts = [header.index(word) for word in ("#", "candidate", "verdict", "end loss", "what it does", "evidence")]
    rows, numbers = [tuple(header.split())], []
    for line in rest:
        if line.startswith("best:"):
            break
        cells = [line[a:b].strip() for a, b in zip(starts, [*starts[1:], None])]
        numbers += [float(x) for cell in cells for x in _FLOAT.findall(cell)]
        rows.append(tuple(_FLOAT.sub("<x>", cell) for cell in cells))
    return rows, numbers


@pytest.mark.slow
def test_an_adapters_incident_gets_verdicts_on_its_own_step_only(tmp_path):
    import torch
    from integration_models import BAD_POSITION, BAD_STEP, Net, batches, loss_fn

    from stabletrain import Monitor

    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    with Monitor(model, optimizer, run_dir=tmp_path / "run", log_every=10, loss_fn=loss_fn) as monitor:
        for batch in batches(12, bad_step=BAD_STEP):
            with monitor.autocast():
                loss = loss_fn(model, batch)
            monitor.backward(loss)
            monitor.step(batch)
    record = search_remedies(tmp_path / "run" / "incidents" / f"step_{BAD_STEP:06d}", steps=5)  # rebuilt from recipes
    c = by_name(record)
    assert record["failure_class"] == "op" and "reported, not applied" in record["note"]
    assert all(r["steps_replayed"] == 1 and r["first_step"] == BAD_STEP for r in c.values())  # no window after it
    assert c["skip-samples"]["remedy"]["samples"] == [BAD_POSITION] and c["skip-samples"]["verdict"] == "cures"
    # (sqrt of a -100 input: out of its domain, no eps guard offered: clamping would hide the bad value)
    assert "eps-guard" not in c and c["lr-x0.1"]["verdict"] == "fails"
    # Skipping the lone step leaves nothing to judge: no verdict ('fails: hides the symptom' read as a finding).
    assert (c["skip-step"]["verdict"], c["skip-step"]["baseline"]) == ("untestable", True)
    assert c["skip-step"]["evidence"].startswith("skipping the step leaves nothing of this adapter bundle to replay")
    assert c["skip-step"]["evidence"].endswith("on_nonfinite='skip' (the default) does this live")  # (a NaN's, not on_spike)
    assert c["skip-samples"]["evidence"].endswith("(the baseline has no step to judge)"), c["skip-samples"]["evidence"]
    import html

    from stabletrain.report import write_report

    page = html.unescape(write_report(tmp_path / "run").read_text(encoding="utf-8"))  # it says what was replayed
    assert "Replayed the incident's window only (an adapter's bundle keeps only its own step" in page
    assert "Replayed the incident's window and the" not in page


def test_an_fp16_scaler_that_cannot_recover_is_an_incident_and_only_the_eps_guard_cures_it(tmp_path):
    # Every step's gradients are NaN (sqrt(0) for every sample), the loss finite: each step is the scaler's overflow.
    # Once it has backed off below 1 (65536 / 2**17 = 0.5 after step 17) the guard calls it an incident.
    incident = incident_of(tmp_path, "remedy_tasks:fp16_nan_grads_task", "precision=fp16", "train.max_steps=20")
    assert incident.name == "step_000017"
    record = search_remedies(incident, steps=4)
    assert record["failure_class"] == "op" and record["evidence"].endswith(
        "the GradScaler had backed off to 1 and this step's overflow takes it to 0.5: it cannot recover (the gradients "
        "are NaN whatever the scale)")
    c = by_name(record)
    assert c["eps-guard"]["verdict"] == "cures" and record["best"] == "eps-guard"
    for name in ("lr-x0.5", "lr-x0.1"):
        assert (c[name]["verdict"], c[name]["failed"]["step"]) == ("fails", 17)
        assert "the GradScaler backs off to 0.5, below 1" in c[name]["evidence"]


def test_the_baseline_skips_a_burst_of_bad_windows_as_on_spike_skip_would(tmp_path):
    """Steps 20-22 hold only outliers (no few samples carry any of them): skipping step 20 alone failed at 21 ('no
    candidate cures it') while the live fallback, skipping each flagged step, gave a clean run. The baseline now drops
    the windows of the burst that spike right after the incident's, at most 3 more, and says so."""
    from spike_tasks import outliers_at_task

    def task():
        return outliers_at_task(bad=",".join(map(str, range(152, 176))))  # the windows of steps 20, 21, 22

    run = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=30", "optim.lr=0.01"),
            task=task(), run_dir=run).fit()
    record = search_remedies(run / "incidents" / "step_000020", task(), steps=6)
    base = next(c for c in record["candidates"] if c["baseline"])
    assert (base["remedy"], base["verdict"]) == ({"kind": "skip-step", "windows": 3}, "cures"), base
    assert base["detail"] == "drop the incident's window and the 2 after it (a burst)" and base["dropped_samples"] == 24
    assert [r["step"] for r in base["trajectory"] if r.get("dropped")] == [20, 21, 22]
    assert format_table(record).endswith("no candidate cures it beyond the baseline: drop the incident's window and the 2 "
                                         "after it (a burst) (skip-step) is all it needs")


def test_an_adapters_samples_are_dropped_by_their_place_in_the_step_and_said_so():
    """An adapter names a step's samples by their place in its batch: the remedy table read 'drop samples 3, 7, 11'
    (dataset indices, to a reader); the unit is said, and kept through remedy.json."""
    from stabletrain.diagnostics.candidates import candidates_for
    from stabletrain.diagnostics.cures import remedy_from_dict

    diagnosis = {"anomaly": "spike", "failure_class": "data", "bad_samples": [3, 7, 11],
                 "sample_unit": "position in the step's batch"}
    (skip,) = [c for c in candidates_for(diagnosis, "fp32", [], []) if isinstance(c, SkipSamples)]
    assert skip.detail == "drop positions 3, 7, 11 of the step's batch"
    assert remedy_from_dict(skip.to_dict()) == skip
    (own,) = [c for c in candidates_for({**diagnosis, "sample_unit": "dataset index"}, "fp32", [], [])
              if isinstance(c, SkipSamples)]
    assert own.detail == "drop samples 3, 7, 11"


def test_a_burst_that_goes_on_is_the_incidents_course_and_no_candidate_cures_with_no_step_judged(tmp_path):
    """An LR x1000 inside the optimizer: the loss spikes at step 24 and at every step after it (the run flags 24-30).
    The baseline and lr-x0.5 both meet step 25's spike: read as another flagged spike, a later incident, it cut every
    trajectory to step 24, and the baseline, which drops that window, was 'cures ... end loss nan' with no step judged
    (lab: a level shift, an LR x1000; the live search, with no later events to read, said the baseline fails at 25)."""
    run = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=10", "data.shuffle=false", "train.max_steps=30", "sched.warmup_steps=0",
                "sched.decay=constant", task="remedy_tasks:lr_jump_task"), run_dir=run).fit()
    events = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "spike"] == list(range(24, 31))
    record = search_remedies(run / "incidents" / "step_000024", steps=6, only=["lr-x0.5"])
    c = by_name(record)
    assert (record["failure_class"], record["later_incident"]) == ("state", None)
    for name in ("skip-step", "lr-x0.5"):
        assert (c[name]["verdict"], c[name]["failed"]["step"]) == ("fails", 25), c[name]
    assert format_table(record).endswith("no candidate cures this incident")


def test_a_later_incident_is_set_apart_only_after_a_calm_step_and_a_replay_with_no_step_trained_is_untestable():
    def result(failed_at, rows, dropped=(24,)):
        return {"failed": {"step": failed_at, "why": f"loss spike at step {failed_at}"}, "dropped_samples": 8 * len(dropped),
                "total_samples": 8 * (len(rows) + len(dropped)), "end_loss": float("nan"), "first_step": 24,
                "trajectory": [{"step": s, "dropped": True} for s in dropped] + [{"step": s, "loss": 0.5} for s in rows]}

    # The run flagged 25-30 (a burst from the incident's next step on): 25 is the incident's course, whatever the flags
    results = [result(25, [25]), result(25, [24, 25], dropped=())]
    assert before_later_incident(results, 24, set(range(25, 31))) is None and results[0]["failed"]["step"] == 25
    # ... and so is 28 after the run's unbroken 25-28, though the baseline trained 25-27 calmly
    assert before_later_incident([result(28, [25, 26, 27, 28]), result(28, [24, 25, 26, 27, 28], dropped=())], 24,
                                 {25, 26, 27, 28}) is None
    # Another sample's spike the run flagged at 28 after its calm 25-27 (the exemption's case): set apart, judged to 27
    results = [result(28, [25, 26, 27, 28]), result(28, [24, 25, 26, 27, 28], dropped=())]
    assert before_later_incident(results, 24, {28}) == 28
    assert [r["step"] for r in results[0]["trajectory"]] == [24, 25, 26, 27] and results[0]["end_loss"] == 0.5
    # A NaN 18 steps on that every candidate meets alike, unflagged: set apart as before
    assert before_later_incident([result(42, range(25, 43)), result(42, range(24, 43), dropped=())], 24, set()) == 42
    # A replay cut to the windows it drops has no step to judge: untestable (it was 'cures', end loss nan)
    cut = {**result(25, []), "failed": None}
    assert judge(cut, cut) == ("untestable", "no step to judge: it drops the window of step 24, all it replays")
    assert judge({**cut, "trajectory": [{"step": 24, "dropped": True}, {"step": 25, "dropped": True}]}, cut)[1] == (
        "no step to judge: it drops the windows of steps 24-25, all it replays")


def test_an_fp16_overflow_outside_any_module_gets_the_run_wide_bf16_and_scaler_candidates(tmp_path):
    """A loss x1e6 overflows float16 in the backward of its cast, outside any module: the stop line says 'try
    precision=bf16', but bf16 and the scaler were offered only with a module named (lr-x0.5, lr-x0.1 and the baseline,
    all failing). bf16 cures it."""
    from stabletrain.diagnostics.candidates import candidates_for

    incident = incident_of(tmp_path, "remedy_tasks:fp16_big_loss_task", "train.max_steps=20", "precision=fp16")
    record = search_remedies(incident, steps=2, only=["bf16", "scaler"])
    c = by_name(record)
    assert (incident.name, record["failure_class"]) == ("step_000017", "overflow") and "outside any module" in (
        record["evidence"])
    assert list(c) == ["bf16", "scaler", "skip-step"] and record["best"] == "bf16"
    assert c["bf16"]["verdict"] == "cures" and c["bf16"]["steps_replayed"] == 3  # steps 17-19
    assert c["scaler"]["verdict"] == "fails" and c["skip-step"]["failed"]["step"] == 18
    # The module's own fp32 only where one is named; run-wide ones only under fp16
    names = [r.name for r in candidates_for({"failure_class": "overflow", "module": "layers.1"}, "fp16", [], [])]
    assert names == ["skip-step", "module-fp32", "bf16", "scaler", "lr-x0.5", "lr-x0.1"]
    assert [r.name for r in candidates_for({"failure_class": "overflow"}, "bf16", [], [])] == ["skip-step", "lr-x0.5", "lr-x0.1"]
    # An overflow pinned to one sample (a student's trial: sample 50 scaled x400 overflowed every epoch): dropping it is
    # offered too ('skip-samples does not fit this incident (failure class overflow)' was refused)
    pinned = candidates_for({"failure_class": "overflow", "module": "0", "bad_samples": [50]}, "fp16", [], [])
    assert [r.name for r in pinned] == ["skip-step", "skip-samples", "module-fp32", "bf16", "scaler", "lr-x0.5", "lr-x0.1"]
    assert pinned[1].samples == (50,)
    through = candidates_for({"failure_class": "overflow", "module": "0", "bad_samples": [0, 1, 2, 3, 4, 5],
                              "weight_driven": True}, "fp16", [], [])  # 6 of 8 samples overflow: the module's weights
    assert "skip-samples" not in [r.name for r in through]
    older = {"failure_class": "overflow", "module": "0", "bad_samples": [0, 1, 2, 3, 4, 5],
             "evidence": "aten.mul in forward of module '0' ... overflows it (max 65504); 6 of 8 samples go bad through it"}
    assert "skip-samples" not in [r.name for r in candidates_for(older, "fp16", [], [])]  # a diagnosis.json before the key


def test_a_precision_spike_gets_the_run_wide_precisions_above_the_runs():
    """fp16_offset (a trial): only 'module act in fp32' was tried for a precision spike, and failed; precision=fp32
    for the whole run cures it (end loss 0.1538 vs the baseline's 0.1536, 'best: fp32')."""
    from stabletrain.diagnostics.candidates import candidates_for

    spike = {"anomaly": "spike", "failure_class": "precision", "blamed_module": "act", "where": {"first": "act"}}
    names = [(r.name, r.detail) for r in candidates_for({**spike, "precision": "fp16"}, "fp16", [], [])]
    assert names[:4] == [("skip-step", "drop the incident's window"), ("module-fp32", "module 'act' in fp32 (autocast off "
                         "around it)"), ("bf16", "precision=bf16"), ("fp32", "precision=fp32")]
    # the run's mode, not the config's (auto resolved to bf16); and with no module named
    assert [r.name for r in candidates_for({**spike, "blamed_module": None, "precision": "bf16"}, "auto", [], [])][:2] == [
        "skip-step", "fp32"]
    # no lower LR: the step is normal in fp32, and a lower LR from the step before only moves the weights off the
    # rounding's edge (a trial's bf16 spike 'cured' by lr-x0.1, ranked over fp32, and made x5.7 worse by lr-x0.5)
    assert not [r for r in candidates_for({**spike, "precision": "bf16"}, "bf16", [], []) if r.kind == "lr"]
    from stabletrain.diagnostics.candidates import why_not_offered

    assert why_not_offered("lr-x0.1", spike).startswith("lr-x0.1: the same step is normal in fp32, so the rounding")
    assert remedy_from_dict(Precision("fp32").to_dict()) == Precision("fp32")


def test_a_tighter_clip_candidate_is_below_the_runs_own_clip():
    """A host's gradient_clip_val=1.0 and grad norms around 4: the 'clip' cure was clip.max_norm=4.14, looser than the
    run's own (a replay under it unclipped the step)."""
    from stabletrain.diagnostics.candidates import candidates_for

    spike = {"failure_class": "state", "step": 47, "anomaly": "spike"}
    history = [{"step": 10 * i, "grad_norm": 4.14} for i in range(1, 5)]
    [clip] = [c for c in candidates_for(spike, "fp32", history, [], 1.0) if c.kind == "clip"]
    assert clip.max_norm == 0.5, clip.detail
    [clip] = [c for c in candidates_for(spike, "fp32", history, []) if c.kind == "clip"]  # no clip of its own
    assert clip.max_norm == 4.14



def test_an_adapters_run_wide_cures_are_named_in_its_hosts_own_terms(tmp_path):
    """A Lightning run's precision spike: its remedy table offered 'precision=fp32', a key Lightning has no use for (a
    trial); an adapter's run-wide cures say the host's knob: Trainer(precision="32-true"), TrainingArguments'
    max_grad_norm, the callback's clip where the Trainer set none. The built-in loop's keep its own keys."""
    from types import SimpleNamespace

    import torch

    from stabletrain import Monitor
    from stabletrain.config.adapter import in_host_terms
    from stabletrain.remedy_search import _in_host_terms

    assert in_host_terms("lightning", "precision", "fp32") == 'Trainer(precision="32-true")'
    assert in_host_terms("lightning", "precision", "bf16") == 'Trainer(precision="bf16-mixed")'
    assert in_host_terms("transformers", "precision", "bf16") == "TrainingArguments(bf16=True, fp16=False)"
    trainer, callback = {"host.gradient_clip_val": 1.0}, {"host.gradient_clip_val": None, "clip.max_norm": 1.0}
    assert in_host_terms("lightning", "clip", 0.5, trainer) == "Trainer(gradient_clip_val=0.5)"
    assert in_host_terms("lightning", "clip", 0.5, callback) == "StableTrainCallback(clip_max_norm=0.5)"
    # (a review) a Trainer clipping by value: the norm the replay verified is its other algorithm; no clip at all, or a
    # config that does not record the Trainer's: the Trainer's, as the report's clip verdict says it
    assert in_host_terms("lightning", "clip", 0.5, {**trainer, "host.gradient_clip_algorithm": "value"}) == (
        'Trainer(gradient_clip_val=0.5, gradient_clip_algorithm="norm")')
    assert in_host_terms("lightning", "clip", 0.5, {"host.gradient_clip_val": None}) == "Trainer(gradient_clip_val=0.5)"
    assert in_host_terms("lightning", "clip", 0.5, {}) == "Trainer(gradient_clip_val=0.5)"
    assert in_host_terms("transformers", "clip", 0.25) == "TrainingArguments.max_grad_norm=0.25"
    assert in_host_terms(None, "precision", "fp32") is None and in_host_terms("monitor", "lr", 0.5) is None

    model = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    with Monitor(model, opt, run_dir=tmp_path / "run", clip_max_norm=1.0, init_check=False) as monitor:  # its config.yaml
        for _ in range(2):
            monitor.backward(model(torch.randn(8, 4)).square().mean())
            monitor.step()

    def rows():
        return [{"remedy": r.to_dict(), "detail": r.detail} for r in (Precision("fp32"), TighterClip(0.5), LowerLR(0.5))]

    adapter, built_in = rows(), rows()
    _in_host_terms(SimpleNamespace(adapter=True, run_dir=tmp_path / "run"), adapter)
    assert [r["detail"] for r in adapter] == ['Monitor(precision="fp32"), no autocast or GradScaler of your own',
                                               "Monitor(clip_max_norm=0.5)", "lr x0.5"]
    _in_host_terms(SimpleNamespace(adapter=False, run_dir=tmp_path / "run"), built_in)
    assert [r["detail"] for r in built_in] == ["precision=fp32", "clip.max_norm=0.5", "lr x0.5"]
    # a Lightning run's config.yaml (nested, as the adapter writes it): the callback clipped, the Trainer did not
    import yaml

    (tmp_path / "pl").mkdir()
    (tmp_path / "pl" / "config.yaml").write_text(yaml.safe_dump({"integration": "lightning", "clip": {"max_norm": 1.0},
                                                                 "host": {"gradient_clip_val": None}}))
    lightning = rows()
    _in_host_terms(SimpleNamespace(adapter=True, run_dir=tmp_path / "pl"), lightning)
    assert [r["detail"] for r in lightning] == ['Trainer(precision="32-true")', "StableTrainCallback(clip_max_norm=0.5)",
                                                "lr x0.5"]


def test_the_eps_guard_is_not_offered_for_a_log_of_a_negative_input():
    """A student's trial: log of a -0.5 in the data (a NaN, not log(0)'s -inf) was 'cured' by eps-guard, whose code change
    read 'keep the input of log away from 0': clamping a bad value to 1e-12 hides it (log = -27.6). Dropping the
    sample is offered; log(0) (-inf) still gets the guard."""
    negative = {"failure_class": "op", "module": "feat", "op": "aten.log.default", "direction": "forward", "kind": "nan",
                "first_op": {"nonfinite_inputs": [], "input_range": [-0.5, 3.0]}, "bad_samples": [100]}
    from stabletrain.diagnostics.candidates import candidates_for

    assert [r.name for r in candidates_for(negative, "fp32", [], [])] == ["skip-step", "skip-samples", "lr-x0.5", "lr-x0.1"]
    zero = {**negative, "kind": "inf"}
    assert "eps-guard" in [r.name for r in candidates_for(zero, "fp32", [], [])]
    # a variance rounded to -1e-7 beside values of 1 (a review): the guard is its cure, not a bad sample's drop
    rounded = {**negative, "op": "aten.rsqrt.default", "first_op": {"nonfinite_inputs": [], "input_range": [-1e-7, 1.0]}}
    assert "eps-guard" in [r.name for r in candidates_for(rounded, "fp32", [], [])]
    assert "eps-guard" not in [r.name for r in candidates_for({**rounded, "first_op": {"input_range": [-0.2, 1.0]}},
                                                               "fp32", [], [])]
    noise = {**rounded, "first_op": {"input_range": [-1e-7, 1.2e-7], "input_dtypes": ["float32"]}}  # all noise
    assert "eps-guard" in [r.name for r in candidates_for(noise, "fp32", [], [])]
    rounded_bf16 = {**rounded, "first_op": {"input_range": [-0.004, 1.0], "input_dtypes": ["bfloat16"]}}  # bf16's step
    assert "eps-guard" in [r.name for r in candidates_for(rounded_bf16, "fp32", [], [])]
    # a log's input -0.5 beside values of 1000 (a review): 5e-4 of the largest, no float32 rounding; a log of 1 - p
    # with p rounded above 1 is one
    far = {**negative, "first_op": {"nonfinite_inputs": [], "input_range": [-0.5, 1000.0], "input_dtypes": ["float32"]}}
    assert "eps-guard" not in [r.name for r in candidates_for(far, "fp32", [], [])]
    one_minus_p = {**negative, "first_op": {"nonfinite_inputs": [], "input_range": [-1.2e-7, 1.0], "input_dtypes": ["float32"]}}
    assert "eps-guard" in [r.name for r in candidates_for(one_minus_p, "fp32", [], [])]
    for dtype, low in (("bfloat16", -0.05), ("float16", -0.009)):  # really below 0 in a low precision: no guard either
        bad = {**rounded, "first_op": {"input_range": [low, 1.0], "input_dtypes": [dtype]}}
        assert "eps-guard" not in [r.name for r in candidates_for(bad, "fp32", [], [])], dtype


def test_the_eps_guard_change_said_for_a_division_is_the_one_its_replay_verified():
    """A new user's trial: for x / x.norm() with an all-zero sample the change said 'x.abs().clamp_min(eps) * x.sign()',
    which leaves 0 at 0 (sign(0) = 0): 0/0 is still NaN. The replay had verified torch.where(|x| < eps, +-eps, x)."""
    import torch

    from stabletrain.diagnostics.cures import EpsGuard

    change = EpsGuard(module="norm", op="div", eps=1e-6, where="kt.py:56").change
    assert change == ("keep the denominator away from 0 at kt.py:56: torch.where(x.abs() < eps, torch.where(x < 0, -eps, "
                      "eps), x) with eps=1e-06")
    eps, x = 1e-6, torch.tensor([0.0, -0.0, -1e-9, 2.0])
    said = torch.where(x.abs() < eps, torch.where(x < 0, -eps, eps), x)  # the change as written
    assert bool((said != 0).all()) and torch.isfinite(torch.ones(4) / said).all()


def test_remedy_only_says_why_a_candidate_it_refuses_is_not_offered():
    """A new user's `remedy --only eps-guard` on a log of -1 read 'does not fit this incident (failure class op)', while
    --help lists eps-guard for that class: the reason is the input, out of log's domain (a guard would hide it)."""
    from stabletrain.diagnostics.candidates import why_not_offered

    d = {"failure_class": "op", "op": "aten.log.default", "direction": "forward", "kind": "nan",
         "first_op": {"input_range": [-1.0, 3.0], "input_dtypes": ["float32"]}}
    assert why_not_offered("eps-guard", d).startswith("eps-guard: the log's input is out of its domain (as low as -1)")
    rounded = {**d, "first_op": {"input_range": [-1e-9, 3.0], "input_dtypes": ["float32"]}}  # offered there: no reason
    assert why_not_offered("eps-guard", rounded) is None and why_not_offered("lr-x0.5", d) is None


def test_the_replays_rule_after_a_level_shift_is_armed_at_the_new_level_and_a_burst_of_skipped_nans_is_no_shift():
    """A review of the level shift's rule (services/replay_rule.py): a shift x3 at step 31 and a NaN at step 36, its
    interval's first step (log.every=5): seeded with the one interval mean at the new level, the rule judged nothing (a
    x10 replayed loss passed); seeded to arm, it flags it. Five NaN steps skipped in a row (flagged, but no new level:
    their intervals' finite losses stay at the old one) are no shift: the bundle's rule window stays."""
    from types import SimpleNamespace

    from stabletrain.services.replay_rule import replay_guard, rule_window

    run = cfg("log.every=5")
    observed = {"anomaly": "nonfinite", "spike_window": [1.0 + 0.01 * (i % 7) for i in range(50)], "recent": [],
                "flagged_before": {"since": 31, "steps": 5}}
    shifted = [{"step": s, "loss": 1.0 if s <= 30 else 3.0} for s in range(5, 36, 5)]
    assert rule_window(observed, 2.0, shifted, 5) is None
    rows = [SimpleNamespace(step=36 + i, values={"loss": x, "finite": 1.0}) for i, x in enumerate([3.0, 30.0, 3.0, 3.3])]
    replay_guard(run, observed, shifted, None).mark_spikes(rows)
    assert [r.values["spike"] for r in rows] == [0.0, 1.0, 0.0, 0.0]
    skipped_nans = [{"step": s, "loss": 1.0} for s in range(5, 36, 5)]
    assert rule_window(observed, 2.0, skipped_nans, 5) == observed["spike_window"]


def test_remedy_refuses_a_ddp_incident_saying_what_its_bundle_holds_and_what_it_lacks(tmp_path):
    """A trial: the refusal said 'the global window is not in the bundle' of a bundle whose window holds every rank's
    batch. What it lacks is the windows after the step, drawn from a data order split across the processes."""
    from stabletrain.records.bundles import write_bundle

    folder = tmp_path / "run" / "incidents" / "step_000010"
    write_bundle(folder, {"step": 10, "world_size": 2, "window": {"indices": [[1, 2], [3, 4]], "ranks": [0, 1]}})
    with pytest.raises(ValueError) as err:
        search_remedies(folder, steps=2)
    assert str(err.value) == (f"incident {str(folder)!r} comes from a run of 2 processes; stabletrain remedy replays a "
                              "one-process run only: the bundle holds the incident's step (every rank's batch: stabletrain "
                              "diagnose replays it), not the windows after it that each cure is judged on, drawn from a data "
                              "order split across the processes")
    assert not (folder / "remedy.json").exists()
    # a rank's own window (a non-finite step on one rank, an adapter's: no every-rank record): said as its part (a review)
    write_bundle(folder, {"step": 10, "world_size": 2, "window": {"indices": [[1, 2]]}})
    with pytest.raises(ValueError, match=r"the bundle holds its rank's part of the incident's step, not the windows after"):
        search_remedies(folder, steps=2)
