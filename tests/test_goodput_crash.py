"""Goodput of a run whose launches end in an exception past their last checkpoint: the steps they trained after it are
redone (the next launch trains them again from that checkpoint), as a SIGKILLed launch's are, not "other"."""

import json

import pytest
from multiproc import events, train_cli

from stabletrain.report.goodput import read_goodput


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _interval(t, step):
    return {"kind": "interval", "t": t, "step": step, "steps": 10, "wall_s": 1.0, "eval_s": 0.0, "checkpoint_s": 0.0,
            "incident_s": 0.0, "skipped": 0}


# The crash loop, in round numbers: launch 1 (100-106.5) logs steps 10-40, checkpoints at 0, 20, 40, trains
# steps 41-44 and raises on step 45 (its end line: 0.5 s, 0.1 of it the save at 40); launch 2 resumes from step_000040
# (start 108, ready 110), trains 41-44 again and raises at 110.4; a third refuses to loop.
LEDGER = [{"kind": "launch", "start": 100.0, "ready": 102.0, "step": 0},
          *[_interval(102.0 + n, 10 * n) for n in (1, 2, 3, 4)],
          {"kind": "end", "t": 106.5, "step": 44, "wall_s": 0.5, "checkpoint_s": 0.1, "incident_s": 0.0},
          {"kind": "launch", "start": 108.0, "ready": 110.0, "step": 40},
          {"kind": "end", "t": 110.4, "step": 44, "wall_s": 0.4, "checkpoint_s": 0.0, "incident_s": 0.0}]
EVENTS = [{"kind": "checkpoint", "step": 0, "time": 102.01}, {"kind": "checkpoint", "step": 20, "time": 104.01},
          {"kind": "checkpoint", "step": 40, "time": 106.1},
          {"kind": "crash", "step": 44, "time": 106.5, "failed_step": 45, "reason": "RuntimeError: corrupt record 709"},
          {"kind": "restart", "step": 40, "time": 109.0, "cause": {"time": 106.8},
           "reason": "restart 1 of 3 ...; resuming from step_000040: 4 steps to train again"},
          {"kind": "resume", "step": 40, "time": 110.0},
          {"kind": "crash", "step": 44, "time": 110.4, "failed_step": 45, "reason": "RuntimeError: corrupt record 709"},
          {"kind": "stop", "step": 44, "time": 112.0, "reason": "restart refused: the same failure ended 2 launches",
           "cause": {"time": 111.0}}]


def test_steps_trained_after_the_last_checkpoint_by_a_launch_that_raised_are_redone(tmp_path):
    _jsonl(tmp_path / "goodput.jsonl", LEDGER)
    _jsonl(tmp_path / "events.jsonl", EVENTS)
    g = read_goodput(tmp_path)
    assert g.total_s == pytest.approx(6.5 + 1.5 + 2.4) and (g.launches, g.restarts, g.refused) == (3, 1, 1)
    # steps 41-44 of each launch: 0.4 s each (the first's end line less its save); "other" held them (0.8 s)
    assert g.seconds == pytest.approx({"productive": 4.0, "redone": 0.4 + 0.4, "skipped": 0.0, "checkpoint": 0.1,
                                       "startup": 2.0 + 1.5 + 2.0, "eval": 0.0, "incident": 0.0, "other": 0.0})
    assert g.line() == ("goodput 38.5% over 2 launches (and one more that started only to refuse a restart: a crash loop; lost: "
                        "52.9% start-up, 7.7% redone after 1 restart, 1.0% checkpoint stalls)")

    # A launch that stopped with a checkpoint at its end step (a SIGTERM: no crash), resumed from there: nothing redone
    stopped = [{**r, "step": 44} if r["kind"] == "launch" and r["step"] == 40 else r for r in LEDGER]
    _jsonl(tmp_path / "goodput.jsonl", stopped)
    _jsonl(tmp_path / "events.jsonl", [{**e, "step": 44} if e["kind"] in ("restart", "resume") else e
                                       for e in EVENTS if e["kind"] != "crash"] + [{"kind": "checkpoint", "step": 44,
                                                                                    "time": 106.45}])
    g = read_goodput(tmp_path)
    assert g.seconds["redone"] == 0.0 and g.seconds["other"] == pytest.approx(0.4 + 0.4)


def test_the_steps_a_last_launch_trained_past_its_checkpoint_before_a_death_not_restarted_after_are_lost(tmp_path):
    """A new user's DDP run: rank 1 killed a third time with run.max_restarts=2: rank 0 ended (PeerLost) with its end
    line and the launcher recorded the death as a stop. The steps after LAST_GOOD (step 40) counted as productive and
    the end line's as "other": the report said 52.6% where the run kept ~45%. No launch trains them again: lost."""
    ledger = [{"kind": "launch", "start": 100.0, "ready": 102.0, "step": 0},
              *[_interval(102.0 + n, 10 * n) for n in (1, 2, 3, 4, 5)],
              {"kind": "end", "t": 107.5, "step": 55, "wall_s": 0.5, "checkpoint_s": 0.0, "incident_s": 0.0}]
    died = {"kind": "stop", "step": 55, "time": 107.7, "cause": {"time": 107.6, "signal": "SIGKILL", "rank": 1},
            "reason": "the run's 2 restart(s) were used up (run.max_restarts=2) when rank 1 (pid 9) was killed by SIGKILL"}
    _jsonl(tmp_path / "goodput.jsonl", ledger)
    saves = [{"kind": "checkpoint", "step": s, "time": 102.01 + s / 10} for s in (0, 20, 40)]
    _jsonl(tmp_path / "events.jsonl", [*saves, died])
    g = read_goodput(tmp_path)
    assert g.seconds["productive"] == pytest.approx(4.0) and g.seconds["redone"] == pytest.approx(1.0 + 0.5)
    assert g.seconds["other"] == pytest.approx(0.0, abs=1e-9) and g.total_s == pytest.approx(7.5)
    # the same launch killed outright (no end line): to the launcher's word of the death
    _jsonl(tmp_path / "goodput.jsonl", ledger[:-1])
    g = read_goodput(tmp_path)
    assert g.seconds["productive"] == pytest.approx(4.0) and g.seconds["redone"] == pytest.approx(1.0 + 0.6)
    # no word of a death (a run still going, or one the report cannot tell): its steps are kept, as before
    _jsonl(tmp_path / "events.jsonl", saves)
    assert read_goodput(tmp_path).seconds["productive"] == pytest.approx(5.0)


@pytest.mark.slow  # two launches and their supervisor: ~8 s
def test_a_crash_loop_through_the_cli_books_the_steps_each_launch_trained_again_as_redone(tmp_path):
    """Sample 45 raises (batch 8, no shuffle: step 6) on every launch; checkpoints and log lines every 4 steps, so each
    launch trains step 5 after its last checkpoint and log line; the restart resumes from step_000004."""
    run_dir = tmp_path / "run"
    res = train_cli("task=restart_tasks:unreadable_sample_task",
                    "train.batch_size=8", "data.shuffle=false", "train.max_steps=8", "ckpt.every=4", "log.every=4",
                    "eval.every=0", "log.init_signal=false", "run.max_restarts=2", "run.max_repeats=1",
                    f"run.dir={run_dir}", timeout=120)
    assert res.returncode == 3, res.stderr[-3000:]
    kinds = [(e["kind"], e["step"]) for e in events(run_dir) if e["kind"] in ("crash", "restart", "stop")]
    assert kinds == [("crash", 5), ("restart", 4), ("crash", 5), ("stop", 5)]
    ends = [r for r in map(json.loads, (run_dir / "goodput.jsonl").read_text().splitlines()) if r["kind"] == "end"]
    assert [r["step"] for r in ends] == [5, 5]
    g = read_goodput(run_dir)
    # each launch's step 5 (its end line's time, less a save's) is redone: one launch's by the restart, the last's by the
    # one a person resumes
    # (less a launch's set-up before its first step where it ended before its first interval: start-up)
    assert g.seconds["redone"] == pytest.approx(sum(r["wall_s"] - r["checkpoint_s"] - r["incident_s"] - r.get("startup_s", 0)
                                                    for r in ends))
    assert g.seconds["redone"] > 0 and "redone after 1 restart" in g.line(), g.line()
