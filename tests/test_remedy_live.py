"""guard.on_nonfinite=remedy and remedy=INCIDENT_DIR:NAME: a verified remedy applied to the live run, recorded, kept
in its checkpoints and put back on resume (also after SIGKILL)."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest
import torch
from helpers import cfg, regression_task
from test_resume import _env, _kill_at

from stabletrain import Trainer
from stabletrain.cli import main
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.report import write_report

DIVERGING = ("optim.name=sgd", "optim.lr=2.5", "optim.weight_decay=0", "clip.max_norm=null", "sched.warmup_steps=20",
             "sched.decay=constant", "ckpt.every=10")
#: The remedied run's final loss and that of a run with the cure's LR from the start: both are within this of 0
#: (the first interval's loss is ~3): the remedied run converges as the cured one does.
FINAL_LOSS_BAND = 1e-6


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def train(run_dir, spec, *overrides):
    trainer = Trainer(cfg("train.batch_size=8", "log.every=5", "data.shuffle=false", *overrides, task=spec), run_dir=run_dir)
    trainer.fit()
    return trainer


def test_a_divergence_that_stops_the_run_today_is_remedied_and_the_run_finishes_as_one_cured_from_the_start(tmp_path,
                                                                                                            capsys):
    today = train(tmp_path / "today", "remedy_tasks:diverging_task", "train.max_steps=60", *DIVERGING)
    assert "20 consecutive skipped steps (guard.max_consecutive_skips=20) at step 57" in today.stop_reason
    remedied = train(tmp_path / "remedied", "remedy_tasks:diverging_task", "train.max_steps=60", *DIVERGING,
                     "guard.on_nonfinite=remedy", "remedy.steps=4")
    assert remedied.step == 60 and remedied.stop_reason is None
    # The line says when the remedy was applied (step 40), its rollback's own step in what it does (issue 33).
    out = capsys.readouterr().out
    assert "stabletrain: remedy at step 40: rollback-lr-x0.1 (back to step 10, lr x0.1)" in out
    (event,) = [e for e in events(tmp_path / "remedied") if e["kind"] == "remedy"]
    assert (event["name"], event["step"], event["from_step"], event["incident_step"]) == ("rollback-lr-x0.1", 10, 40, 38)
    assert event["verdict"] == "cures" and event["failure_class"] == "divergence"
    search = event["search"]  # what the live search cost (the candidates' replays), in the event and on the line
    assert search["steps_replayed"] > 0 and search["seconds"] > 0, event
    assert f"on the replay; the search replayed {search['steps_replayed']} steps in " in out, out
    assert remedied.schedule.base_lrs == [pytest.approx(0.25)] * 2  # the LR x0.1 (both groups), in the schedule state
    assert CheckpointManager(tmp_path / "remedied" / "checkpoints").latest_good().name == "step_000060"
    cured = train(tmp_path / "cured", "remedy_tasks:diverging_task", "train.max_steps=60", *DIVERGING, "optim.lr=0.25")
    first = remedied.history[0]["loss"]
    assert first > 1.0
    assert remedied.history[-1]["loss"] < FINAL_LOSS_BAND and cured.history[-1]["loss"] < FINAL_LOSS_BAND
    page = write_report(tmp_path / "remedied").read_text()
    assert "applied rollback-lr-x0.1 (back to step 10, lr x0.1) for the divergence incident at step 38" in page


def _start(run_dir, *extra, resume=False):
    args = ["task=remedy_tasks:sqrt_zero_task", "task_args.slow=true", "train.batch_size=8", "train.max_steps=16",
            "log.every=1", "ckpt.every=4", "data.shuffle=false", "log.progress=false", "log.tensorboard=false",
            "guard.on_nonfinite=remedy", "remedy.steps=6", *extra]
    cmd = ([sys.executable, "-m", "stabletrain", "train", *args]
           + (["--resume", str(run_dir)] if resume else [f"run.dir={run_dir}"]))
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_the_remedy_and_its_evidence_survive_sigkill_and_resume(tmp_path):
    # Sample 13 (all zeros: sqrt(0)) is in steps 2, 6, 10 and 14. The remedy (skip it) is applied at step 2's boundary
    # and is in every checkpoint after it (4, 8, ...: saved in the background, so LAST_GOOD may lag the kill); killed
    # after step 9, the resumed run must still drop it at steps 10 and 14 (and at 6, resumed from step 4).
    run_dir = tmp_path / "run"
    rc, out, err = _kill_at(_start(run_dir), run_dir, 9)
    assert rc == -signal.SIGKILL, err
    # live, step 2 was skipped as it ran (its replay trained it without sample 13): the line says so
    assert "; step 2 itself was skipped as it ran, the samples are left out of every window from now on" in out + err, out + err
    saved = CheckpointManager(run_dir / "checkpoints").load()
    assert saved.meta["step"] in (4, 8, 12) and saved.state["remedies"]["applied"][0]["name"] == "skip-samples"
    proc = _start(run_dir, resume=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    final = CheckpointManager(run_dir / "checkpoints").load()
    assert final.meta["step"] == 16
    (applied,) = final.state["remedies"]["applied"]
    assert ((applied["name"], applied["remedy"], applied["at_step"])
            == ("skip-samples", {"kind": "skip-samples", "samples": [13]}, 2))
    assert applied["verdict"] == "cures" and "baseline fails: non-finite grad norm at step 6" in applied["evidence"]
    kinds = [(e["kind"], e["step"]) for e in events(run_dir) if e["kind"] in ("remedy", "skip", "nonfinite", "resume")]
    assert kinds == [("nonfinite", 2), ("skip", 2), ("remedy", 2), ("resume", saved.meta["step"])]  # nothing bad after
    # The same end as a run that was never killed (in this process): the remedy was put back exactly.
    reference = Trainer(cfg("train.batch_size=8", "train.max_steps=16", "log.every=1", "ckpt.every=4", "data.shuffle=false",
                            "guard.on_nonfinite=remedy", "remedy.steps=6", task="remedy_tasks:sqrt_zero_task"),
                        run_dir=tmp_path / "reference")
    reference.fit()
    for name, value in reference.module.state_dict().items():
        assert torch.equal(value, final.state["model"][name]), name


def test_a_remedy_is_applied_by_hand_on_resume_once_and_refused_clearly(tmp_path, capsys):
    run_dir = tmp_path / "run"
    base = ["train", f"run.dir={run_dir}", "task=remedy_tasks:sqrt_zero_task", "train.batch_size=8", "log.every=2",
            "ckpt.every=4", "data.shuffle=false", "log.progress=false", "log.tensorboard=false", "train.max_steps=8"]
    assert main(base) == 0  # on_nonfinite=skip: sample 13 is skipped at steps 2 and 6
    incident = run_dir / "incidents" / "step_000002"
    assert main(["remedy", str(incident), "--steps", "6"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "train.max_steps=12", f"remedy.apply={incident}:eps-guard"]) == 2
    assert "needs a code change (keep the input of sqrt away from 0 at " in capsys.readouterr().err
    assert main(["train", "--resume", str(run_dir), "train.max_steps=12", f"remedy.apply={incident}:nope"]) == 2
    assert "remedy.json has no candidate 'nope'; it has skip-samples, eps-guard" in capsys.readouterr().err
    # A cure that changes the state's course (an LR cut), verified from the update of step 2, applied by hand at the
    # resume's step 8: the updates since were made without it, its verdict does not hold (a student's trial: 'cures
    # on the replay', then the run diverged on). Refused, naming the rollback that holds.
    original = (incident / "remedy.json").read_text()
    record = json.loads(original)
    record["candidates"] += [{"name": "lr-x0.01", "remedy": {"kind": "lr", "factor": 0.01}, "verdict": "cures",
                              "first_step": 2, "baseline": False},
                             {"name": "rollback-lr-x0.01", "remedy": {"kind": "rollback-lr", "factor": 0.01, "step": 0},
                              "verdict": "cures", "first_step": 1, "baseline": False}]
    (incident / "remedy.json").write_text(json.dumps(record))
    assert main(["train", "--resume", str(run_dir), "train.max_steps=12", f"remedy.apply={incident}:lr-x0.01"]) == 2
    assert ("lr-x0.01 was verified from the update of step 2, but this run resumes at step 8: the updates since were made "
            "without it, so its verdict does not hold here; apply a cure that rolls back first (rollback-lr-x0.01)"
            ) in capsys.readouterr().err
    # Resumed at the very step a cure's replay starts from, the update that led into the incident (its step - 1): that
    # update was made without it too (the check read 'first < step' and applied it)
    record["step"], record["candidates"][-2]["first_step"] = 9, 8
    (incident / "remedy.json").write_text(json.dumps(record))
    assert main(["train", "--resume", str(run_dir), "train.max_steps=12", f"remedy.apply={incident}:lr-x0.01"]) == 2
    assert "lr-x0.01 was verified from the update of step 8, but this run resumes at step 8" in capsys.readouterr().err
    # A candidate that failed on the replay: nothing to apply (a trial: applied, its own event saying "fails on the replay")
    record["candidates"][-2].update(verdict="fails", evidence="loss is nan at step 9")
    (incident / "remedy.json").write_text(json.dumps(record))
    assert main(["train", "--resume", str(run_dir), "train.max_steps=12", f"remedy.apply={incident}:lr-x0.01"]) == 2
    assert ("lr-x0.01 failed on the replay of the incident (loss is nan at step 9): there is no cure in it to apply; those "
            "that cured: ") in capsys.readouterr().err
    (incident / "remedy.json").write_text(original)
    missing = run_dir / "incidents" / "step_000099"  # a folder that is not there: said so, not "run remedy on it first"
    assert main(["train", "--resume", str(run_dir), "train.max_steps=12", f"remedy.apply={missing}:skip-samples"]) == 2
    assert f"no incident folder {str(missing)!r} (it does not exist)" in capsys.readouterr().err
    # the run directory for one of its incidents: said, with its incidents (it said "run stabletrain remedy RUN first")
    assert main(["train", "--resume", str(run_dir), "train.max_steps=12", f"remedy.apply={run_dir}:1"]) == 2
    assert (f"{str(run_dir)!r} is a run directory, not an incident folder; its incidents: step_000002, step_000006 "
            f"(remedy.apply={incident}:1)") in capsys.readouterr().err
    assert main(["remedy", str(incident / "bundle.pt"), "--steps", "2"]) == 2  # the bundle's path, not its folder's
    assert f"that is the bundle itself: give its incident folder, {str(incident)!r}" in capsys.readouterr().err
    other = tmp_path / "other"  # another run's incident: its cure was verified on that run's state and data
    assert main([*base[:1], f"run.dir={other}", *base[2:]]) == 0
    assert main(["train", "--resume", str(other), "train.max_steps=12", f"remedy.apply={incident}:skip-samples"]) == 2
    assert f"the incident belongs to another run ({str(run_dir.resolve())!r}), not this one" in capsys.readouterr().err
    import shutil  # an incident moved out of its run directory: its replays lack the run's losses, said so

    moved = shutil.copytree(incident, tmp_path / "moved" / "step_000002")
    assert main(["diagnose", str(moved)]) == 0
    assert "is not in its run directory (no metrics.jsonl two levels up)" in capsys.readouterr().err
    for max_steps in (16, 20):  # the second resume keeps the remedy from the checkpoint and does not apply it twice
        assert main(["train", "--resume", str(run_dir), f"train.max_steps={max_steps}",
                     f"remedy.apply={incident}:skip-samples"]) == 0
    bad = [(e["kind"], e["step"]) for e in events(run_dir) if e["kind"] in ("remedy", "skip")]
    assert bad == [("skip", 2), ("skip", 6), ("remedy", 8)]  # sample 13 is in steps 10, 14 and 18 too: dropped
    (event,) = [e for e in events(run_dir) if e["kind"] == "remedy"]
    assert event["by_hand"] is True and event["remedy"] == {"kind": "skip-samples", "samples": [13]}
    final = CheckpointManager(run_dir / "checkpoints").load()
    assert final.meta["step"] == 20 and [a["name"] for a in final.state["remedies"]["applied"]] == ["skip-samples"]
    # By its row (remedy.apply=DIR:1 is skip-samples): applied once. remedy.json then ranked again (row 1 another
    # candidate): the same spec on a resume is refused, not a second remedy applied on top of the first.
    record = json.loads((incident / "remedy.json").read_text())
    assert record["candidates"][0]["name"] == "skip-samples"
    assert main(["train", "--resume", str(run_dir), "train.max_steps=22", f"remedy.apply={incident}:1"]) == 0
    record["candidates"] = record["candidates"][::-1]
    (incident / "remedy.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "train.max_steps=24", f"remedy.apply={incident}:1"]) == 2
    assert "row 1 of remedy.json is now" in capsys.readouterr().err


def test_a_transient_fault_needs_no_remedy_and_a_run_past_max_remedies_falls_back(tmp_path, capsys):
    from helpers import PoisonAt, regression_task

    task = regression_task()
    task.model = PoisonAt(task.model, {3})  # NaN on the 3rd forward only: not reproducible, nothing recurs
    c = cfg("train.batch_size=8", "log.every=5", "train.max_steps=5", "guard.on_nonfinite=remedy", "remedy.steps=3")
    Trainer(c, task=task, run_dir=tmp_path / "transient").fit()
    (event,) = [e for e in events(tmp_path / "transient") if e["kind"] == "remedy"]
    assert event["applied"] is None and event["reason"].startswith(
        "no remedy needed for the not reproducible incident at step 3: skipping its step cures it on the replay")
    assert event["reason"] in capsys.readouterr().out  # on the console too, in one line
    # its replay goes no further than the run (remedy.steps=3 past step 3 of 5: an 80-step run's was verified to step 95)
    record = json.loads((tmp_path / "transient" / "incidents" / "step_000003" / "remedy.json").read_text())
    assert record["steps"] == 2 and [t["step"] for t in record["candidates"][0]["trajectory"]] == [3, 4, 5], record
    stopped = train(tmp_path / "capped", "remedy_tasks:diverging_task", "train.max_steps=60", *DIVERGING,
                    "guard.on_nonfinite=remedy", "remedy.max_applied=0", "remedy.fallback=stop")
    assert stopped.step == 40 and "no remedy applied: 0 remedies applied already (remedy.max_applied=0); " \
                                  "remedy.fallback=stop" in stopped.stop_reason


def test_a_second_incident_after_a_skip_samples_remedy_is_captured_on_the_windows_the_run_trained(tmp_path):
    # Zero samples 13 (step 2) and 28 (step 4): one interval (1-5) captures step 2 only, and the remedy (verified on
    # K = 1 window after it) drops 13; in the next epoch 13 would be in step 6 and 28 is in step 8. The capture's replay
    # from the interval's snapshot (step 5) must drop 13 from step 6 as the run did: its bundle is then bitwise the
    # run's state before step 8, and the search, told what the run drops, verifies skipping 28.
    from helpers import PreStepState
    from test_checkpoint import assert_same

    from stabletrain.records.bundles import load_bundle

    c = cfg("train.batch_size=8", "log.every=5", "data.shuffle=false", "train.max_steps=12", "guard.on_nonfinite=remedy",
            "remedy.steps=1", "task_args.also=28", task="remedy_tasks:sqrt_zero_task")
    trainer = Trainer(c, run_dir=tmp_path / "run")
    pre = PreStepState(7, trainer)
    trainer.callbacks.append(pre)
    trainer.fit()
    applied = [(e["step"], e["remedy"]["samples"]) for e in events(tmp_path / "run") if e["kind"] == "remedy"]
    assert applied == [(5, [13]), (10, [28])]
    bundle = load_bundle(tmp_path / "run" / "incidents" / "step_000008")
    assert bundle["window"]["indices"] == [[24, 25, 26, 27, 28, 29, 30, 31]]
    for key in ("model", "optimizer", "schedule", "rng"):
        assert_same(bundle[key], pre.state[key], key)
    assert pre.state["stream"]["drop"] == [13] and trainer.stream.drop == {13, 28} and trainer.step == 12


def test_the_live_remedy_searches_the_capture_s_bundle_and_diagnosis_in_memory(tmp_path, monkeypatch):
    # The incident's files are its record, not the bus: a live search reads neither bundle.pt nor diagnosis.json back.
    import stabletrain.remedy_search as remedy_search

    def read_back(*args, **kwargs):
        raise AssertionError("the live remedy search read the incident back from disk")

    monkeypatch.setattr(remedy_search, "load_bundle", read_back)
    monkeypatch.setattr(remedy_search, "diagnose_incident", read_back)
    monkeypatch.setattr(remedy_search, "DIAGNOSIS_FILE", "not-read.json")
    from stabletrain.callbacks import Callback

    class Seen(Callback):  # what a user's on_incident gets: the incident's fields, not the bundle held for the remedy
        keys: list = []

        def on_incident(self, state, info):
            self.keys.append(sorted(info))

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "log.every=1", "data.shuffle=false", "train.max_steps=8", "ckpt.every=4",
                "guard.on_nonfinite=remedy", "remedy.steps=4", task="remedy_tasks:sqrt_zero_task"), run_dir=run_dir,
            callbacks=[Seen()]).fit()
    assert Seen.keys and all("diagnosis" in k and "bundle" not in k and "diagnosis_record" not in k for k in Seen.keys)
    (event,) = [e for e in events(run_dir) if e["kind"] == "remedy"]
    assert event["name"] == "skip-samples" and event["verdict"] == "cures"
    incident = run_dir / "incidents" / f"step_{event['incident_step']:06d}"
    assert {"bundle.pt", "diagnosis.json", "remedy.json"} <= {p.name for p in incident.iterdir()}


def test_a_divergence_after_a_resume_is_measured_over_the_whole_run_and_rolled_back_before_it(tmp_path, capsys):
    """The live diagnosis reads this launch's records from memory: after a resume it must also see the earlier
    launch's on disk. Without them the growth began 'since step 35' (already 2.9e34) and the remedy rolled back to step
    30, inside the divergence, and called that cured (the run ended at loss 1.7e22)."""
    args = ["task=examples.diverging_task:make_task", "optim.name=sgd", "optim.lr=2.5", "optim.weight_decay=0",
            "clip.max_norm=null", "sched.decay=constant", "train.batch_size=8", "log.every=5", "ckpt.every=10",
            "ckpt.keep=10", "data.shuffle=false", "guard.on_nonfinite=remedy", "log.progress=false"]
    run_dir = tmp_path / "run"
    assert main(["train", *args, "train.max_steps=30", f"run.dir={run_dir}"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), *args, "train.max_steps=60"]) == 0
    out = capsys.readouterr().out
    assert "loss grew x13.5 per step since step 5 (2.7 -> 4.47e+36 by step 37" in out, out
    (event,) = [e for e in events(run_dir) if e["kind"] == "remedy"]
    assert (event["name"], event["step"], event["from_step"], event["incident_step"]) == ("rollback-lr-x0.1", 0, 40, 38)
    final = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    assert final["step"] == 60 and final["loss"] < FINAL_LOSS_BAND


def test_remedy_apply_names_one_of_several_rows_of_the_same_name_by_its_number():
    """A precision incident lists module-fp32 once per module it tried; remedy.apply=DIR:module-fp32 took the first
    silently. Now one name for several rows is refused naming each row, and DIR:N applies row N of the table."""
    from stabletrain.services.remedy_applier import _candidate

    rows = [{"name": "module-fp32", "detail": "module 'merge' in fp32", "verdict": "cures", "remedy": {"module": "merge"}},
            {"name": "skip-step", "detail": "drop the incident's window", "verdict": "cures", "remedy": {}},
            {"name": "module-fp32", "detail": "module 'route' in fp32", "verdict": "cures", "remedy": {"module": "route"}}]
    with pytest.raises(ValueError) as err:
        _candidate(rows, "module-fp32", "inc:module-fp32", "inc")
    assert ("'module-fp32' names 2 candidates (row 1: module 'merge' in fp32, cures; row 3: module 'route' in fp32, "
            "cures); name one by its row: remedy.apply=inc:1") in str(err.value)
    assert _candidate(rows, "3", "inc:3", "inc")["remedy"] == {"module": "route"}
    assert _candidate(rows, "skip-step", "inc:skip-step", "inc") is rows[1]
    with pytest.raises(ValueError, match="has rows 1-3, not 4"):
        _candidate(rows, "4", "inc:4", "inc")


def test_a_cure_whose_replay_the_live_run_departs_from_is_not_applied_again(tmp_path, capsys):
    """The optimizer's LR jumps x1000 from its 50th step, counted outside its state_dict: the rollback to step 40 with a
    lower LR cures on the replay (whose optimizer counts afresh), yet the live run spikes again on a step that replay
    verified clean. The next incident is not searched and cured again on the same replay: one line says the live run
    departs from it, and the run falls back (remedy.fallback)."""
    from spike_tasks import hidden_bump_task

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=16", "log.every=10", "data.shuffle=false", "train.max_steps=90", "ckpt.every=20",
                "sched.warmup_steps=0", "sched.decay=constant", "guard.on_spike=remedy"),
            task=hidden_bump_task(), run_dir=run_dir).fit()
    remedies = [e for e in events(run_dir) if e["kind"] == "remedy"]
    applied = [e for e in remedies if e.get("applied") is not None or e.get("name")]
    assert len(applied) == 1 and applied[0]["name"].startswith("rollback-lr"), remedies
    first, last = applied[0]["verified_steps"]
    refused = [e for e in remedies if "departs from the replay" in e["reason"]]
    assert refused and first <= refused[0]["incident_step"] <= last, remedies
    assert f"steps {first}-{last} were finite with no spike" in refused[0]["reason"]
    assert "departs from the replay that verified rollback-lr" in capsys.readouterr().out


def test_a_remedy_applied_by_hand_to_an_incident_after_last_good_keeps_its_folder(tmp_path, capsys):
    """A review: a resume sets aside the captures of the steps it trains again, and so it renamed step_000038 (after
    LAST_GOOD, step 30) before remedy.apply=.../step_000038:NAME read it: 'no incident folder', exit 2, every retry."""
    args = ["task=examples.diverging_task:make_task", "optim.name=sgd", "optim.lr=2.5", "optim.weight_decay=0",
            "clip.max_norm=null", "sched.decay=constant", "train.batch_size=8", "log.every=5", "ckpt.every=10",
            "ckpt.keep=10", "data.shuffle=false", "log.progress=false", "log.tensorboard=false", "guard.on_nonfinite=stop"]
    run_dir = tmp_path / "run"
    assert main(["train", *args, "train.max_steps=60", f"run.dir={run_dir}"]) == 1  # the divergence stops it
    incident = run_dir / "incidents" / "step_000038"
    good = int((run_dir / "checkpoints" / "LAST_GOOD").read_text().strip()[5:])
    assert incident.is_dir() and good < 38
    assert main(["remedy", str(incident), "--only", "rollback-lr-x0.1", "--steps", "4"]) == 0
    capsys.readouterr()
    assert main(["train", "--resume", str(run_dir), "train.max_steps=45", f"remedy.apply={incident}:rollback-lr-x0.1"]) == 0
    (event,) = [e for e in events(run_dir) if e["kind"] == "remedy"]
    assert event["name"] == "rollback-lr-x0.1" and incident.is_dir()
    assert not [p for p in (run_dir / "incidents").iterdir() if p.name.startswith("step_000038.superseded")]


def test_a_rollback_cure_applied_by_hand_purges_tensorboard_as_a_rollback_does(tmp_path, capsys):
    """A review: remedy.apply=DIR:rollback-lr-x0.1 on a resume went back to step 10 but fired no on_rollback, so
    TensorBoard kept the steps after it beside their retrained copies (metrics.jsonl superseded them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    args = ["task=examples.diverging_task:make_task", "optim.name=sgd", "optim.lr=2.5", "optim.weight_decay=0",
            "clip.max_norm=null", "sched.decay=constant", "train.batch_size=8", "log.every=5", "ckpt.every=10",
            "ckpt.keep=10", "data.shuffle=false", "log.progress=false", "log.tensorboard=true", "guard.on_nonfinite=stop"]
    run_dir = tmp_path / "run"
    assert main(["train", *args, "train.max_steps=60", f"run.dir={run_dir}"]) == 1  # the divergence stops it
    incident = sorted((run_dir / "incidents").glob("step_*"))[0]
    assert main(["remedy", str(incident), "--only", "rollback-lr-x0.1", "--steps", "4"]) == 0
    capsys.readouterr()
    main(["train", "--resume", str(run_dir), "train.max_steps=45", f"remedy.apply={incident}:rollback-lr-x0.1"])
    (event,) = [e for e in events(run_dir) if e["kind"] == "remedy"]
    assert event["name"] == "rollback-lr-x0.1" and event["step"] < event["from_step"]
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [e.step for e in acc.Scalars("train/loss")] == steps, steps


def test_a_parameter_an_update_moved_out_of_logs_domain_is_named_and_a_rollback_with_a_lower_lr_cures_it(tmp_path):
    """A trial: log(s) of a learned variance that an SGD update moved below 0: 'op ... at every sample (16): not the data',
    no word of s, and only skips and LR cuts from the step before tried (all failed): the run stopped on its skips."""
    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("train.batch_size=16", "train.max_steps=10", "log.every=5", "optim.name=sgd", "optim.lr=1.0",
                          "optim.weight_decay=0", "sched.warmup_steps=0", "sched.decay=constant", "remedy.steps=6",
                          "guard.on_nonfinite=remedy", task="remedy_tasks:learned_scale_task"), run_dir=run_dir)
    trainer.fit()
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    incident = next(e for e in events if e["kind"] == "incident")
    d = json.loads((run_dir / "incidents" / f"step_{incident['step']:06d}" / "diagnosis.json").read_text())
    assert (d["failure_class"], d["param_input"]) == ("op", "s"), d["summary"]
    assert "its input is the parameter s itself, which an update moved out of the op's domain" in d["summary"]
    (remedy,) = [e for e in events if e["kind"] == "remedy"]
    assert remedy["name"] == "rollback-lr-x0.1" and remedy["reason"].startswith("applied rollback-lr-x0.1"), remedy
    assert trainer.step == 10 and float(trainer.module.s) > 0  # trained on from step 0 at a tenth of the LR


def test_an_activation_an_update_sent_out_of_logs_domain_at_every_sample_is_cured_by_a_rollback_not_by_dropping_samples(
        tmp_path):
    """A new user's trial: log of a linear model's raw output, one SGD step at lr 3 sends every output below 0: 'op ...
    at every sample of the step (16): not the data' (outside any module: no module to blame), and the candidates were
    skip-step, skip-samples (all 16) and LR cuts from the step before: all failed, the run stopped on its skips, and
    `stabletrain remedy --only rollback-lr-x0.1` was refused as not fitting. Most samples going bad through one
    computation is a state the updates made: a rollback with a lower LR is a candidate, dropping the samples is not."""
    from stabletrain.diagnostics.candidates import candidates_for, why_not_offered

    run_dir = tmp_path / "run"
    trainer = Trainer(cfg("train.batch_size=16", "train.max_steps=10", "log.every=5", "ckpt.every=10", "optim.name=sgd",
                          "optim.lr=3", "clip.max_norm=null", "sched.warmup_steps=0", "sched.decay=constant",
                          "data.shuffle=false", "remedy.steps=6", "guard.on_nonfinite=remedy",
                          task="remedy_tasks:log_of_output_task"), run_dir=run_dir)
    trainer.fit()
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    incident = next(e for e in events if e["kind"] == "incident")
    d = json.loads((run_dir / "incidents" / f"step_{incident['step']:06d}" / "diagnosis.json").read_text())
    assert incident["step"] == 2 and d["failure_class"] == "op" and d["weight_driven"], d["summary"]
    names = [c.name for c in candidates_for(d, "fp32", [], [0])]
    assert "skip-samples" not in names and {"rollback-lr-x0.5", "rollback-lr-x0.1"} <= set(names), names
    assert why_not_offered("skip-samples", d).startswith("skip-samples: most of the window's samples go bad through the op")
    (remedy,) = [e for e in events if e["kind"] == "remedy"]
    assert remedy["name"].startswith("rollback-lr-") and remedy["reason"].startswith("applied rollback-lr-"), remedy
    assert trainer.step == 10 and math.isfinite(json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])["loss"])
    # `stabletrain remedy` on it again (other --steps) keeps the run's own search, the one it applied from (it replaced
    # it: the report's Remedies section lost it)
    folder = run_dir / "incidents" / "step_000002"
    ran = json.loads((folder / "remedy.json").read_text())
    assert ran["by_the_run"] and main(["remedy", str(folder), "--steps", "2", "--only", "lr-x0.5"]) == 0
    assert json.loads((folder / "remedy.run.json").read_text()) == ran and "by_the_run" not in json.loads(
        (folder / "remedy.json").read_text())
    assert main(["remedy", str(folder), "--steps", "3", "--only", "lr-x0.1"]) == 0  # (kept once: not the CLI's over it)
    assert json.loads((folder / "remedy.run.json").read_text()) == ran
    assert main(["report", str(run_dir)]) == 0
    assert "the run's own search, made while it ran" in (run_dir / "report.html").read_text()
    # compare says it too (a trial: each run's line said only 'finished', the page had no remedy, restart or goodput row)
    from stabletrain.report import load_run
    from stabletrain.report.compare import compare_lines, render_compare

    runs = [load_run(run_dir)] * 2
    line = compare_lines(runs, ["a", "b"])[1]
    assert line.startswith("a: ") and line.endswith(f"; finished; {remedy['name']} (incident at step 2)"), line
    page = render_compare(runs, ["a", "b"], plots=[])
    assert f'<td class="">remedies applied</td><td class="num">{remedy["name"]} (incident at step 2)</td>' in page
    assert '<td class="">restarts</td><td class="num">0</td>' in page and '<td class="">goodput</td><td class="num">' in page


def test_a_rollback_remedy_keeps_what_the_run_decided_never_to_train_on_again(tmp_path):
    """A review: a rollback-lr remedy loaded an older checkpoint's data stream whole: the windows an earlier rollback
    skipped and the samples a data diagnosis or a skip-samples remedy dropped after that checkpoint came back."""
    from stabletrain.callbacks import Callback
    from stabletrain.diagnostics.cures import RollbackLR

    seen = {}

    class AtStep10(Callback):  # decided after step 5's checkpoint, then a rollback remedy to it
        def on_log(self, state, record, rows):
            if state.step == 10 and not seen:
                trainer.stream.skip, trainer.stream.drop = {(0, 7)}, {3, 11}
                state.ckpt.wait()  # (step 5's save may still be in flight: a search waits for it as well)
                trainer.remedies.apply(RollbackLR(0.5, step=5), "incidents/step_000010", {"verdict": "cures"}, {"step": 10})
                seen.update(step=state.step, skip=set(trainer.stream.skip), drop=set(trainer.stream.drop))

    trainer = Trainer(cfg("train.batch_size=8", "train.max_steps=12", "log.every=5", "ckpt.every=5",
                          "log.tensorboard=false"), task=regression_task(), run_dir=tmp_path / "run", callbacks=[AtStep10()])
    trainer.fit()
    assert seen["step"] == 5 and (0, 7) in seen["skip"] and {3, 11} <= seen["drop"], seen
