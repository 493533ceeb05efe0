"""Runs that restart themselves (run.max_restarts): a rank SIGKILLed at random points, crash loops, a checkpoint
that is not trusted again, run.resume=auto, and two torchrun "nodes" on one machine.

One process (stabletrain's supervisor), 2 DDP ranks and 2 FSDP2 ranks (torchrun's elastic agent) each lose a
rank (never the launcher) at 3 random points and finish by themselves, bitwise equal to an uninterrupted run;
the uninterrupted 2-rank runs share one torchrun world (``dist_world.py``), the one-process run trains in this
process. The pure parts (what ended a launch, when to refuse, where the wall time went) are tested without
processes below.
"""

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import multiproc
import pytest
import torch
from helpers import cfg
from multiproc import FAST, World, cli, descendants, env, events, steps_logged, train_cli
from restart_tasks import children, free_port, ranks_of, wait_gone

from stabletrain import Trainer
from stabletrain.cli import main
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.records.jsonl import read_jsonl
from stabletrain.report import health_summary, load_run
from stabletrain.report.goodput import read_goodput
from stabletrain.services.restarts import Failure, last_failure, refusal

# 192 samples, 8 per rank, accum 2; dropout draws from each rank's RNG stream, so a restart that restored the
# wrong one would not be bitwise equal. 20 steps, a checkpoint every 2.
ARGS = ["task=helpers:slow_mlp_task", "task_args.num_samples=192", "task_args.dropout=0.2", "task_args.sleep=0.02",
        "train.batch_size=8", "accum.steps=2", "train.max_steps=20", "log.every=1", "ckpt.every=2", "eval.every=0", *FAST]
FSDP = [*ARGS, "dist.strategy=fsdp", "capture.incidents=false"]
RESTARTS = ["run.max_restarts=5"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The uninterrupted 2-rank runs (DDP, FSDP2) the killed ones must equal, in one torchrun world."""
    root = tmp_path_factory.mktemp("restarts")
    return World(root, [("ddp", *cli(*ARGS, "dist.nproc=2", f"run.dir={root / 'ddp'}")),
                        ("fsdp", *cli(*FSDP, "dist.nproc=2", f"run.dir={root / 'fsdp'}"))])


def _final(run_dir, step=20):
    loaded = CheckpointManager(run_dir / "checkpoints").load(full=True)
    assert loaded.meta["step"] == step, loaded.path
    return loaded.state


def _assert_bitwise(got, want):
    for name, value in want["model"].items():
        assert torch.equal(got["model"][name], value), name
    for pid, state in want["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(got["optimizer"]["state"][pid][k], v), (pid, k)
    assert got["stream"] == want["stream"] and got["counters"] == want["counters"]


def _kill_three_times(cmd, run_dir, seed, victim, timeout=240):
    """Run ``cmd``; SIGKILL ``victim(launcher_pid, rng)`` (a pid) once run_dir logged a step in each of three windows.

    Each window starts at least ckpt.every + 2 steps after the last one ends: every launch writes a checkpoint
    before it is killed. Returns (exit code, stdout + stderr, [(last step logged, pid) killed], every pid seen below
    the launcher).
    """
    rng = random.Random(seed)
    kills = [rng.randrange(3, 6), rng.randrange(9, 12), rng.randrange(15, 18)]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen, killed = set(), []
    try:
        for step in kills:
            t0 = time.time()
            while steps_logged(run_dir) < step:
                assert proc.poll() is None, f"the run ended before step {step}: {proc.communicate()[1][-3000:]}"
                assert time.time() - t0 < timeout, f"the run never reached step {step}"
                seen.update(descendants(proc.pid))
                time.sleep(0.01)
            pid = victim(proc.pid, rng)
            os.kill(pid, signal.SIGKILL)
            time.sleep(0.3)  # no rank can finish another step now; the restart drops lines only once its ranks started (~2 s)
            killed.append((max((r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")[0]), default=0), pid))
        out, err = proc.communicate(timeout=timeout)
    finally:
        for pid in descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return proc.returncode, out + err, killed, seen


def _the_trainer(launcher, rng):
    (child,) = children(launcher)  # the supervisor's one child trains
    return child


def _a_rank(launcher, rng):
    (agent,) = children(launcher)  # torchrun's agent; its children are the ranks
    ranks = {}
    t0 = time.time()
    while len(ranks) < 2 and time.time() - t0 < 30:
        ranks = ranks_of(agent)
    return ranks[rng.choice(sorted(ranks))]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["one process", "ddp", "fsdp"])
def test_a_rank_sigkilled_at_3_random_points_restarts_by_itself_and_ends_bitwise_equal(world, tmp_path, kind, capsys):
    if kind == "one process":
        reference = Trainer(cfg(*ARGS[1:], task=ARGS[0].split("=", 1)[1]), run_dir=tmp_path / "reference")
        reference.fit()
        want, extra, victim = _final(tmp_path / "reference"), [], _the_trainer
    else:
        world.check(kind)
        want = _final(world.root / kind)
        extra, victim = ([] if kind == "ddp" else ["dist.strategy=fsdp", "capture.incidents=false"]) + ["dist.nproc=2"], _a_rank
    run_dir = tmp_path / "killed"
    cmd = [sys.executable, "-m", "stabletrain", "train", *ARGS, *extra, *RESTARTS, f"run.dir={run_dir}"]
    code, output, killed, seen = _kill_three_times(cmd, run_dir, f"restart-{kind}", victim)
    assert code == 0, output[-3000:]
    assert not wait_gone(seen), "a process of the run outlived its launch"
    _assert_bitwise(_final(run_dir), want)
    restarts = [e for e in events(run_dir) if e["kind"] == "restart"]
    assert [e["restart"] for e in restarts] == [1, 2, 3] and all(e["max_restarts"] == 5 for e in restarts)
    assert [(e["cause"]["pid"], e["cause"]["signal"]) for e in restarts] == [(pid, "SIGKILL") for _, pid in killed]
    superseded_steps = {json.loads(x)["step"] for x in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()}
    for event, (step, _) in zip(restarts, killed):  # resumed at or before the step killed, the steps redone counted
        # (a step whose all-reduce both ranks finished just before the kill may be logged after this test read the
        # metrics 0.3 s on, under load: CI saw redone 2 for a read of step 5 from step 4; it is then a line superseded)
        late = event["redone"] == step + 1 - event["step"] and step + 1 in superseded_steps
        assert event["step"] <= step and (event["redone"] == step - event["step"] or late), (event, step)
        assert event["checkpoint"] == f"step_{event['step']:06d}" and "was killed by SIGKILL" in event["reason"]
    assert [output.count(f"stabletrain: restart {n} of 5 after ") for n in (1, 2, 3)] == [1, 1, 1]  # one line each
    assert not [x for x in output.splitlines() if x.startswith("stabletrain: rank ")]  # (a rank's lost peer: quoted there)
    last = [x for x in output.splitlines() if x.startswith("stabletrain: trained 20 steps")]  # the final line says it too
    assert len(last) == 1 and "; restarted itself 3 times (events.jsonl); run directory: " in last[0], last
    lines = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines == list(range(1, 21))  # each step once, as the uninterrupted run
    superseded = (run_dir / "metrics.superseded.jsonl").read_text().splitlines()
    assert len(superseded) == sum(e["superseded_metrics"] for e in events(run_dir) if e["kind"] == "resume") > 0
    goodput = read_goodput(run_dir)
    assert (goodput.launches, goodput.restarts) == (4, 3) and 0 < goodput.goodput < 1
    assert goodput.seconds["redone"] > 0 and sum(goodput.seconds.values()) == pytest.approx(goodput.total_s)
    if kind == "one process":
        # Every launch trained before it was killed: no restart waited (the 2nd and 3rd waited 1 s and 2 s, as if
        # their launches had died in their start-up): the supervisor started each next one as it saw the death
        starts = [r["start"] for r in read_jsonl(run_dir / "goodput.jsonl")[0] if r.get("kind") == "launch"]
        assert all(start - e["cause"]["time"] < 0.9 for e, start in zip(restarts, starts[1:])), (restarts, starts)
        assert main(["report", str(run_dir)]) == 0  # where the report says it: its page and its printed line
        printed = capsys.readouterr().out.splitlines()[-1]
        assert printed.startswith("goodput ") and " over 4 launches (lost: " in printed
        # a run of seconds: the line says it is too short to judge by (a 4 s run's "goodput 1.6%" alarmed a student)
        assert printed == goodput.line() + (f"; {goodput.total_s:.0f} s in all: a run this short spends much of it "
                                            "starting up (imports, the task, the first checkpoint): goodput means more "
                                            "over minutes of training" if goodput.short_note() else "")
        assert "redone after 3 restarts" in printed and 'id="goodput"' in (run_dir / "report.html").read_text()


@pytest.mark.slow
def test_sigterm_to_a_run_that_restarts_itself_still_stops_it_with_a_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "stabletrain", "train", *ARGS, "log.every=3", "ckpt.every=0",
                             *RESTARTS, f"run.dir={run_dir}"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    t0 = time.time()
    while steps_logged(run_dir) < 3:
        assert proc.poll() is None and time.time() - t0 < 120, proc.communicate()
        time.sleep(0.01)
    (child,) = children(proc.pid)
    proc.send_signal(signal.SIGTERM)  # to the supervisor, which passes it on once
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    stops = [e for e in events(run_dir) if e["kind"] in ("stop", "restart")]
    assert [e["kind"] for e in stops] == ["stop"] and "SIGTERM" in stops[0]["reason"]
    assert CheckpointManager(run_dir / "checkpoints").load().meta["step"] == stops[0]["step"] == steps_logged(run_dir)
    assert not wait_gone([child])


@pytest.mark.slow
def test_a_launch_killed_before_its_first_checkpoint_starts_over_and_keeps_its_record(tmp_path):
    """A preemption in the first seconds: nothing to resume, so the run starts again from step 0 in the same directory
    (it refused: 'there is nothing to restart from'), keeps the dead launch's record, and ends bitwise as a run that
    was never killed."""
    args = ["task=restart_tasks:slow_start_task", "task_args.sleep=2.5", "task_args.num_samples=64", "train.batch_size=8",
            "train.max_steps=6", "log.every=2", "ckpt.every=2", "eval.every=0", *FAST]
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "stabletrain", "train", *args, "run.max_restarts=2",
                             f"run.dir={run_dir}"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    while not children(proc.pid):
        assert proc.poll() is None and time.time() - t0 < 60, proc.communicate()
        time.sleep(0.01)
    time.sleep(1.0)  # in its imports or its task's factory: no checkpoint yet
    assert not (run_dir / "checkpoints").is_dir() or not CheckpointManager(run_dir / "checkpoints").checkpoints()
    for child in children(proc.pid):
        os.kill(child, signal.SIGKILL)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    restarts = [e for e in events(run_dir) if e["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["reason"].endswith(
        "no checkpoint was written yet: starting the run again from step 0"), restarts
    assert "was killed by SIGKILL" in restarts[0]["reason"] and restarts[0]["reason"] in out
    ref = tmp_path / "ref"
    assert main(["train", *args, f"run.dir={ref}"]) == 0  # (uninterrupted, in this process)
    a, b = (CheckpointManager(d / "checkpoints").load().state for d in (run_dir, ref))
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"]) and a["counters"] == b["counters"]


@pytest.mark.slow
def test_a_launch_that_logged_steps_but_whose_first_save_failed_starts_over_with_its_steps_set_aside(tmp_path):
    """No checkpoint landed (the step-0 save failed, as a sharded one does when its peer dies during it) but the launch
    logged steps before it was killed: the run starts again from step 0 (the new launch refused the directory, 'already
    holds a run'), the dead launch's lines kept in metrics.superseded.jsonl, and each step is logged once."""
    run_dir = tmp_path / "run"
    res = subprocess.run([sys.executable, "-m", "stabletrain", "train", *ARGS[:-2], "train.max_steps=8", *FAST,
                          "callbacks=[helpers:FirstSaveFailsThenKilled]", "run.max_restarts=2", f"run.dir={run_dir}"],
                         env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert re.search(r"stabletrain: warning: checkpoint at step 0 failed: .*File too large; no checkpoint was written "
                     r"before it \(1 failed in a row", res.stderr), res.stderr
    (restart,) = [e for e in events(run_dir) if e["kind"] == "restart"]
    assert restart["started_over"] and restart["reason"].endswith("starting the run again from step 0"), restart
    superseded = [json.loads(x)["step"] for x in (run_dir / "metrics.superseded.jsonl").read_text().splitlines()]
    assert superseded == [1, 2, 3] and restart["superseded_metrics"] == 3  # (killed after step 4, before its line)
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == list(range(1, 9))


@pytest.mark.slow
def test_restarts_whose_launches_die_in_their_start_up_each_get_their_event_and_line(tmp_path):
    """The trainer is killed after a checkpoint, then the two processes restarted after it are killed in their
    imports, before they record anything: the launch that lives records all three restarts (each its cause), and
    goodput counts four launches."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "stabletrain", "train", *ARGS, *RESTARTS, f"run.dir={run_dir}"],
                            env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = []
    try:
        t0 = time.time()
        while steps_logged(run_dir) < 5:  # a checkpoint at step 4
            assert proc.poll() is None and time.time() - t0 < 120, proc.communicate()
            time.sleep(0.01)
        for n in range(3):
            t0 = time.time()
            while not (now := [c for c in children(proc.pid) if c not in killed]):
                assert proc.poll() is None and time.time() - t0 < 60, proc.communicate()
                time.sleep(0.005)
            if n:
                time.sleep(0.05)  # in its imports: a restarted process records its restart ~1 s after it starts
            os.kill(now[0], signal.SIGKILL)
            killed.append(now[0])
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    restarts = [e for e in events(run_dir) if e["kind"] == "restart"]
    assert [e["restart"] for e in restarts] == [1, 2, 3], [e["reason"] for e in restarts]
    assert [e["cause"]["pid"] for e in restarts] == killed and [e.get("late", False) for e in restarts] == [True, True, False]
    assert all(e["reason"] in out for e in restarts)  # one line each
    assert restarts[0]["checkpoint"] is not None and len({e["checkpoint"] for e in restarts}) == 1
    assert [e["redone"] for e in restarts][1:] == [0, 0]  # the launches that died in their start-up trained nothing
    assert all(f"resuming from {e['checkpoint']}: no step to train again" in e["reason"] for e in restarts[1:]), \
        [e["reason"] for e in restarts]  # (not '0 step(s) to train again (more if it trained past ...)')
    assert _final(run_dir)["counters"]["step"] == 20
    goodput = read_goodput(run_dir)
    assert (goodput.launches, goodput.restarts) == (4, 3), goodput.line()
    texts = [t for _, t in health_summary(load_run(run_dir)).sentences]  # the report says it, not "Resumed once"
    assert any(t.startswith("Restarted itself 3 times after its process died (rank 0 was killed by SIGKILL, 3 times), "
                            f"from {restarts[0]['checkpoint']}") for t in texts), texts
    assert not any(t.startswith("Resumed") for t in texts), texts


@pytest.mark.slow
def test_the_same_crash_after_a_restart_stops_the_run_with_one_line(tmp_path):
    run_dir = tmp_path / "run"
    # Sample 45 raises when read: step 6 (batch 8, no shuffle) crashes on every launch; checkpoints at 0, 2, 4.
    res = train_cli("task=restart_tasks:unreadable_sample_task",
                    "train.batch_size=8", "data.shuffle=false", "train.max_steps=12", "ckpt.every=2", "log.every=2",
                    "eval.every=0", "run.max_restarts=5", "run.max_repeats=1", f"run.dir={run_dir}")
    assert res.returncode == 3, res.stderr[-3000:]
    kinds = [(e["kind"], e["step"]) for e in events(run_dir) if e["kind"] in ("crash", "restart", "stop")]
    assert kinds == [("crash", 5), ("restart", 4), ("crash", 5), ("stop", 5)]  # one restart (K=1), then no more
    crash = next(e for e in events(run_dir) if e["kind"] == "crash")
    assert crash["failed_step"] == 6 and crash["error"] == "OSError"
    refused = [line for line in res.stderr.splitlines() if "not restarting" in line]
    assert len(refused) == 1 and refused[0].startswith("stabletrain: error: not restarting the run after rank 0 ")
    assert "the same failure ended 2 launches in a row (crashed at step 6: OSError: sample 45: read error" in refused[0]
    assert "tried: 1 restart(s) so far, the last from step_000004 (run.max_restarts=5, run.max_repeats=1)" in refused[0]


@pytest.mark.slow
def test_the_same_crash_resubmission_after_resubmission_under_resume_auto_is_refused(tmp_path, capsys):
    """A trial: the same crash at step 33 submitted again and again with run.resume=auto (a Slurm requeue) was never
    refused: each submission started a new chain of restarts (4 submissions at max_restarts=0, each its exit 1). A
    resubmission continues the chain: the same failure that ended max_repeats + 1 launches in a row refuses the next
    one with one line and exit 3 (the launcher's give-up code, which ends a requeue script's loop too)."""
    run_dir = tmp_path / "run"
    args = ("task=restart_tasks:unreadable_sample_task", "train.batch_size=8", "data.shuffle=false", "train.max_steps=12",
            "ckpt.every=2", "log.every=2", "eval.every=0", "run.resume=auto", "run.max_repeats=1", f"run.dir={run_dir}")
    # (the first submission in a process of its own, which ends: the next reads a dead launch's record, as a requeue
    # does; the later ones in this process, as `stabletrain train` runs them: no supervisor here)
    first = multiproc.train_cli(*args)

    def train_cli(*args):
        capsys.readouterr()
        code = main(["train", *args, *FAST])
        out = capsys.readouterr()
        return subprocess.CompletedProcess(["stabletrain", "train", *args], code, out.out, out.err)

    codes = [first, *(train_cli(*args) for _ in range(2))]
    assert [r.returncode for r in codes] == [1, 1, 3], codes[-1].stderr[-3000:]
    refused = [line for line in codes[-1].stderr.splitlines() if "not continuing" in line]
    assert len(refused) == 1 and refused[0].startswith(
        f"stabletrain: error: run.resume=auto: not continuing {run_dir}: the same failure ended 2 launches in a row "
        "(crashed at step 6: OSError: sample 45: read error") and refused[0].endswith(
        f"restart_tasks.py:25 in __getitem__)); it would meet it again: fix its cause, then continue with: stabletrain "
        f"train --resume {run_dir}"), refused
    assert [e["kind"] for e in events(run_dir) if e["kind"] in ("crash", "stop")] == ["crash", "crash", "stop"]
    continued = [line for line in codes[1].stdout.splitlines() if "continuing it" in line]  # (how the one before ended)
    assert len(continued) == 1 and "continuing it; the launch before crashed at step 6: OSError: sample 45" in continued[0]
    # a resume by hand (--resume, though config.yaml says run.resume=auto) starts a new chain: the cause may be fixed
    by_hand = train_cli(*args[:-3], "run.max_repeats=1", "--resume", str(run_dir))
    assert by_hand.returncode == 1 and "not continuing" not in by_hand.stderr, by_hand.stderr[-3000:]
    assert [e.get("auto") for e in events(run_dir) if e["kind"] == "resume"] == [True, False]
    again = train_cli(*args)  # (and the resubmission after it is the second launch of that chain: it goes on)
    assert again.returncode == 1 and "not continuing" not in again.stderr, again.stderr[-3000:]


def test_a_resubmission_of_a_run_its_supervisor_refused_to_restart_after_the_same_death_is_refused_too(tmp_path):
    """A trial: a task that SIGKILLs itself at the same step, run.max_restarts=5: the supervisor refused the third launch
    (the same death), yet each resubmission under run.resume=auto started a new chain of restarts, saying the launch
    before had ended 'without a record of why (killed?)': the refusal's own record names the death."""
    run_dir = tmp_path / "run"
    args = ("task=restart_tasks:killed_worker_task", "train.batch_size=8", "data.shuffle=false", "train.max_steps=12",
            "ckpt.every=2", "log.every=2", "eval.every=0", "run.resume=auto", "run.max_restarts=5", "run.max_repeats=1",
            f"run.dir={run_dir}")
    first = train_cli(*args)
    assert first.returncode == 3 and "not restarting the run after" in first.stderr, first.stderr[-3000:]
    again = train_cli(*args)
    assert again.returncode == 3, again.stderr[-3000:]
    refused = [line for line in again.stderr.splitlines() if "not continuing" in line]
    assert len(refused) == 1 and refused[0].startswith(
        f"stabletrain: error: run.resume=auto: not continuing {run_dir}: the same failure ended ") and (
        "killed by SIGKILL" in refused[0]), refused
    assert "restart 1 of 5" not in again.stdout + again.stderr  # refused at its start: no new chain of restarts
    assert [e["reason"].split(":")[0] for e in events(run_dir) if e["kind"] == "stop"] == [
        "restart refused", "resubmission refused"]


def test_a_resubmission_says_that_the_launch_before_it_died_without_a_word(tmp_path):
    """A trial: run.resume=auto after a launch killed at step 35 said only 'holds LAST_GOOD (step_000020): continuing
    it'; nothing said the launch before had died. A launch whose ledger has no end (and no crash or stop event) did."""
    from stabletrain.services.restarts import requeue_refusal

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(json.dumps({"kind": "checkpoint", "step": 20, "time": 1.0}) + "\n")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (10, 20, 30)))
    ledger = [{"kind": "launch", "start": 0.5, "ready": 1.0, "step": 0}, {"kind": "interval", "step": 30, "t": 9.0}]
    (run_dir / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    assert requeue_refusal(cfg(), run_dir) == (
        None, "; the launch before ended without finishing and without a record of why (killed?), its last record at step 30")
    with (run_dir / "goodput.jsonl").open("a") as f:  # its fit ended short of its max_steps, no error: a lost peer?
        f.write(json.dumps({"kind": "end", "step": 30, "max_steps": 100, "t": 9.5}) + "\n")
    assert requeue_refusal(cfg(), run_dir) == (None, "; the launch before ended at step 30, short of train.max_steps=100 "
                                                     "without a record of why (a lost peer, a signal?)")
    with (run_dir / "goodput.jsonl").open("a") as f:  # one that trained to its end (train.max_steps raised since): no word
        f.write(json.dumps({"kind": "launch", "start": 10.0, "ready": 10.5, "step": 20}) + "\n")
        f.write(json.dumps({"kind": "end", "step": 30, "max_steps": 30, "t": 12.0}) + "\n")
    assert requeue_refusal(cfg(), run_dir) == (None, "")


def test_a_pid_or_an_address_in_a_deaths_last_line_does_not_make_it_another_failure(tmp_path):
    """A trial: a task that died with its pid in its last line was restarted until the no-checkpoint rule stopped it,
    each death 'another failure' (torch's own: 'DataLoader worker (pid 25207) is killed by signal'). The words without
    the pid (or an address) are the failure's; at the same step it is the same one, refused at run.max_repeats=1."""
    from stabletrain.services.restarts import _restart_after

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (2, 4, 6)))
    events_ = [{"kind": "checkpoint", "step": 4, "time": 1.0}]
    outcomes = []
    for number, (pid, at) in enumerate(((25207, "0x7f3a2c"), (25399, "0x7f11b0")), 1):
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events_))
        line = f"RuntimeError: DataLoader worker (pid {pid}) is killed by signal: Killed. (tensor at {at})"
        cause = {"rank": 0, "exitcode": 1, "last_line": line, "restart": number, "max_restarts": 5, "time": 2.0 + number}
        everyone = [{"causes": [cause], "count": number, "max": 5, "run_id": None}]
        outcomes.append(_restart_after(cfg("run.max_repeats=1"), run_dir, everyone, True, cause, late=False))
        events_ = read_jsonl(run_dir / "events.jsonl")[0]
    assert [o.refused is None for o in outcomes] == [True, False], [o.refused for o in outcomes]
    assert "the same failure ended 2 launches in a row" in outcomes[-1].refused
    assert "(pid 25399)" in outcomes[-1].refused  # (its text keeps the words as they were)


def test_a_worker_gone_while_its_batch_was_handed_over_is_the_same_one_line(capsys):
    """CI, once: the killed worker's batch was being received (torch's rebuild of its shared storage) when the connection
    to it reset: a ConnectionResetError with ~40 lines of frames, not the data loader's one line."""
    from stabletrain.cli import _report_error

    scope = {}
    exec(compile("def rebuild_storage_fd():\n    raise ConnectionResetError(104, 'Connection reset by peer')",
                 "/x/site-packages/torch/multiprocessing/reductions.py", "exec"), scope)
    try:
        scope["rebuild_storage_fd"]()
    except ConnectionResetError as err:
        assert _report_error(err) == 1
    line = capsys.readouterr().err
    assert line.startswith("stabletrain: error: a data loader worker process (data.workers) died: its batch's shared "
                           "memory could not be received (ConnectionResetError: [Errno 104] Connection reset by peer)"), line
    assert _report_error(ConnectionResetError(104, "elsewhere")) is None  # (another: its traceback, as before)


def test_a_data_loader_worker_killed_is_one_line_that_names_the_data_loader_not_a_traceback(tmp_path):
    """A trial: a DataLoader worker SIGKILLed printed ~40 lines of stabletrain's and torch's frames ending in the fused
    Adam step (torch's SIGCHLD handler raises wherever the main process is): one line that says what died."""
    run_dir = tmp_path / "run"
    res = train_cli("task=restart_tasks:killed_worker_task", "data.workers=2", "train.batch_size=8", "data.shuffle=false",
                    "train.max_steps=12", "log.every=2", "eval.every=0", f"run.dir={run_dir}")
    # (torch says 'is killed by signal: Killed.' or 'exited unexpectedly', by where the main process was; a worker that
    # died mid-handshake may leave multiprocessing's own resource-sharer thread's traceback: not the run's)
    assert res.returncode == 1 and "stabletrain/loop.py" not in res.stderr, res.stderr[-3000:]
    said = [x for x in res.stderr.splitlines() if x.startswith("stabletrain: error:")]
    # (or, by where the kill lands, while its batch's shared memory is handed over: the connection to it reset)
    handoff = ("stabletrain: error: a data loader worker process (data.workers) died: its batch's shared memory could "
               "not be received (ConnectionResetError: ")
    assert len(said) == 1 and (said[0].startswith("stabletrain: error: a data loader worker process (data.workers) died: "
                                                  "DataLoader worker (pid") and ("is killed by signal: Killed." in said[0]
                                                                                 or "exited unexpectedly" in said[0])
                               or said[0].startswith(handoff)), said
    assert [e["error"] for e in events(run_dir) if e["kind"] == "crash"] == (
        ["ConnectionResetError"] if said[0].startswith(handoff) else ["RuntimeError"])


def test_a_run_the_guard_stopped_as_stalled_is_not_restarted(tmp_path):
    """A new user's case: an fp16 run whose loss scale collapsed, stopped by guard.on_stall=stop, exited 1 like a crash;
    run.max_restarts restarted it from a checkpoint written while it stalled, it stalled again at a later step (so no
    repeat rule caught it), twice, and it ended 'exited with code 1 ... restarts used up ... continue the run'. The stall
    is a final exit (5): one line, no restart."""
    run_dir = tmp_path / "run"
    res = train_cli("task=remedy_tasks:fp16_stall_task", "precision=fp16",
                    "train.batch_size=8", "data.shuffle=false", "train.max_steps=80", "log.every=10", "ckpt.every=10",
                    "eval.every=0", "capture.incidents=false", "run.max_restarts=2", f"run.dir={run_dir}")
    assert res.returncode == 5, res.stderr[-3000:]
    kinds = [(e["kind"], e["step"]) for e in events(run_dir) if e["kind"] in ("crash", "restart", "stop")]
    assert kinds == [("stop", 60)], kinds
    said = [line for line in res.stderr.splitlines() if line.startswith("stabletrain: the run stopped")]
    assert len(said) == 1 and "the run is stalled at step 60" in said[0] and said[0].endswith(
        "(not restarted: its checkpoints hold the stalled state, a restart would stall again)"), res.stderr[-3000:]
    assert [x for x in res.stderr.splitlines() if "warning: precision=fp16 on CPU" not in x] == said, res.stderr[-3000:]


def test_a_run_of_skips_no_fp16_loss_scale_makes_finite_is_not_restarted(tmp_path):
    """A new user's case: fp16 whose forward overflows whatever the loss scale; guard.max_consecutive_skips stopped it
    (exit 1, like a crash), run.max_restarts restarted it twice into the same steps, and the last line called the stop a
    crash and said 'continue the run: stabletrain train --resume'. The same steps overflow after any restart: a final
    exit (5), one line, no restart."""
    run_dir = tmp_path / "run"
    res = train_cli("task=remedy_tasks:fp16_overflow_task",
                    "precision=fp16", "train.batch_size=8", "train.max_steps=40", "log.every=5", "ckpt.every=5",
                    "eval.every=0", "capture.incidents=false", "guard.max_consecutive_skips=4", "run.max_restarts=2",
                    f"run.dir={run_dir}")
    assert res.returncode == 5, res.stderr[-3000:]
    assert [e["kind"] for e in events(run_dir) if e["kind"] in ("crash", "restart", "stop")] == ["stop"]
    said = [line for line in res.stderr.splitlines() if line.startswith("stabletrain: the run stopped")]
    assert len(said) == 1 and "consecutive skipped steps (guard.max_consecutive_skips=4)" in said[0] and said[0].endswith(
        "(not restarted: no loss scale the GradScaler reaches within guard.max_consecutive_skips=4 makes these steps "
        "finite: a restart would skip them again)"
    ), res.stderr[-3000:]
    assert "restart 1 of" not in res.stderr and "used up" not in res.stderr, res.stderr[-3000:]


def test_restarts_used_up_on_a_guard_stop_say_the_guard_stopped_it_not_a_crash(tmp_path):
    """The restarts used up on the guard's stop (guard.on_nonfinite=stop) ended 'its crash is recorded in ...; continue
    the run: stabletrain train --resume': the stop is the guard's, and resuming as it is may meet it again."""
    run_dir = tmp_path / "run"
    res = train_cli("task=examples.nan_task:make_task",
                    "train.max_steps=12", "train.batch_size=16", "log.every=2", "ckpt.every=2", "eval.every=0",
                    "capture.incidents=false", "guard.on_nonfinite=stop", "run.max_restarts=1", "run.max_repeats=5",
                    f"run.dir={run_dir}")
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    # (its reason is added where the line quoted is not the stop's own: the process's stdout and stderr reach the
    # supervisor by two pipes, and under load the interval's line on stdout can come after the stop's on stderr)
    reason = " (non-finite value in the loss or grad norm at step 7)"
    assert last.startswith("stabletrain: error: the run's process (pid ") and any(last.endswith(
        f"and its 1 restart(s) are used up (run.max_restarts=1); not restarted again; the guard stopped it{why}, recorded "
        f"in {run_dir / 'events.jsonl'}: read why before resuming it as it is (it may stop there again)")
        for why in ("", reason)), last
    assert (reason in last) is ("non-finite value in the loss or grad norm at step 7" not in last.split("(its last line:")[1]
                                .split("'), and")[0]), last
    assert "crash" not in last and "--resume" not in last


@pytest.mark.slow
def test_a_nonfinite_step_the_first_launch_met_too_is_the_data_not_the_checkpoint_it_was_loaded_from(tmp_path):
    """A trial: a NaN from one sample at step 7 (guard.on_nonfinite=stop) on every launch was refused after one restart
    as 'checkpoint step_000000 led to a non-finite step (step 7) right after its load and is not trusted': the launch
    before met it without that load, so the checkpoint is not to blame; the same failure's rule says what it is."""
    run_dir = tmp_path / "run"
    res = train_cli("task=examples.nan_task:make_task", "train.max_steps=12", "train.batch_size=16", "log.every=2",
                    "ckpt.every=20", "eval.every=0", "capture.incidents=false", "guard.on_nonfinite=stop",
                    "run.max_restarts=5", "run.max_repeats=2", f"run.dir={run_dir}")
    assert res.returncode == 3 and "not trusted" not in res.stderr, res.stderr[-3000:]
    refused = [x for x in res.stderr.splitlines() if "not restarting" in x]
    assert len(refused) == 1 and ("the same failure ended 3 launches in a row (stopped at step 8: non-finite value in the "
                                  "loss or grad norm at step 7)") in refused[0], refused
    assert not (run_dir / "checkpoints" / "distrusted").exists()


def test_the_same_crash_of_rank_1_under_ddp_stops_with_exit_3_and_one_line(tmp_path):
    """Rank 1 crashes reading sample 45 on every launch; rank 0 writes the events and only saw a peer lost, so the crash
    was 'ended without a record of why' and only the no-checkpoint rule stopped the loop (5 launches), and torchrun
    ended exit 1 with its ChildFailedError banner. The launcher's record of the death names it: the same failure."""
    run_dir = tmp_path / "run"
    res = train_cli("task=restart_tasks:unreadable_sample_task",
                    "train.batch_size=8", "data.shuffle=false", "train.max_steps=12", "ckpt.every=1", "log.every=1",
                    "eval.every=0", "run.max_restarts=5", "run.max_repeats=1", "dist.nproc=2",
                    f"run.dir={run_dir}")
    assert res.returncode == 3 and "ChildFailedError" not in res.stderr, res.stderr[-3000:]
    assert [e["kind"] for e in events(run_dir) if e["kind"] in ("restart", "stop")] == ["restart", "stop"]
    refused = [line for line in res.stderr.splitlines() if "not restarting" in line]
    assert len(refused) == 1 and "the same failure ended 2 launches in a row (crashed at step 3: rank 1: OSError: sample " \
        "45: read error" in refused[0], refused
    # Rank 1 records its own crash (rank 0 only saw a peer lost): the error and the user's file:line, as on one process.
    crashes = [e for e in events(run_dir) if e["kind"] == "crash"]
    assert len(crashes) == 2 and all(e["rank"] == 1 and e["error"] == "OSError" and e["failed_step"] == 3
                                     and e["location"].endswith("restart_tasks.py:25 in __getitem__") for e in crashes)


@pytest.mark.slow
def test_a_checkpoint_that_leads_to_a_nonfinite_step_right_after_its_load_is_not_trusted_again(tmp_path):
    run_dir = tmp_path / "run"
    base = ["train.batch_size=8", "log.every=1", "ckpt.every=2", "eval.every=0", "task_args.num_samples=256",
            "guard.on_nonfinite=stop"]
    Trainer(cfg(*base, "train.max_steps=6", f"run.dir={run_dir}"), run_dir=run_dir).fit()
    # A held-out of our own (the Megatron-LM #5281 pattern): step 6's weights stay finite but are so large that the
    # first step after loading them overflows. Re-saved the way the run saves, so it verifies.
    ckpt = CheckpointManager(run_dir / "checkpoints")
    loaded = ckpt.load()
    assert loaded.path.name == "step_000006"
    for value in loaded.state["model"].values():
        value.mul_(1e20)
    assert all(torch.isfinite(v).all() for v in loaded.state["model"].values())
    ckpt.save(loaded.state, 6, {k: v for k, v in loaded.meta.items() if k in ("config", "config_hash")})
    res = subprocess.run([sys.executable, "-m", "stabletrain", "train", "--resume", str(run_dir), "train.max_steps=10",
                          "capture.diagnose=false", "run.max_restarts=2"],
                         env=env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stderr[-3000:]
    restart = [e for e in events(run_dir) if e["kind"] == "restart"]
    assert len(restart) == 1 and restart[0]["distrusted"] == "checkpoints/distrusted/step_000006"
    assert restart[0]["checkpoint"] == "step_000004" and restart[0]["step"] == 4 and restart[0]["redone"] == 3
    assert restart[0]["failure"]["kind"] == "stop" and "incident at step 7" in restart[0]["failure"]["text"]
    assert "step_000006 led to a non-finite step at step 7, 1 after its load: not trusted again" in restart[0]["reason"]
    # The evidence stays: the distrusted checkpoint whole, the incident it led to, the lines the redo supersedes.
    assert CheckpointManager(run_dir / "checkpoints").verify(run_dir / "checkpoints" / "distrusted" / "step_000006") == []
    assert restart[0]["incidents_kept"] == ["step_000007.superseded-1"]
    assert (run_dir / "incidents" / "step_000007.superseded-1" / "bundle.pt").is_file()
    final = _final(run_dir, 10)
    assert all(torch.isfinite(v).all() and v.abs().max() < 1e3 for v in final["model"].values())


@pytest.mark.slow
def test_two_torchrun_nodes_on_one_machine_restart_together_after_a_worker_is_killed(world, tmp_path):
    world.check("ddp")
    run_dir, port = tmp_path / "run", free_port()
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
             f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-nodes", "--max-restarts=2"]
    # Several machines' torchrun that restarts its ranks needs a rendezvous store per attempt (pytorch/pytorch#135712;
    # their agents count their restarts each on its own: one machine's ranks take keys of their own per attempt).
    node_env = {**env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    nodes = [subprocess.Popen([*agent, f"--node-rank={n}", "-m", "stabletrain", "train", *ARGS, f"run.dir={run_dir}"],
                              env=node_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for n in (0, 1)]
    seen = set()
    try:
        kill_at = random.Random("two-nodes").randrange(5, 12)
        t0 = time.time()
        while steps_logged(run_dir) < kill_at:
            assert all(n.poll() is None for n in nodes) and time.time() - t0 < 180, [n.poll() for n in nodes]
            seen.update(p for n in nodes for p in descendants(n.pid))
            time.sleep(0.01)
        (worker,) = ranks_of(nodes[1].pid).values()  # the one rank of "node" 1
        os.kill(worker, signal.SIGKILL)
        outs = [n.communicate(timeout=240) for n in nodes]
    finally:
        for n in nodes:
            for pid in descendants(n.pid):
                os.kill(pid, signal.SIGKILL)
            if n.poll() is None:
                n.kill()
    assert [n.returncode for n in nodes] == [0, 0], [o[1][-2000:] for o in outs]
    assert not wait_gone(seen)
    restarts = [e for e in events(run_dir) if e["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["step"] <= kill_at
    _assert_bitwise(_final(run_dir), _final(world.root / "ddp"))  # the same run as dist.nproc=2


@pytest.mark.slow
def test_a_users_own_torchrun_restarts_its_ranks_after_one_is_killed(world, tmp_path, capsys):
    """A trial, the issue's own command: `torchrun --nproc-per-node=2 --max-restarts=2 -m stabletrain train ...` with a
    rank SIGKILLed: the restarted ranks read the attempt before's addresses from torchrun's shared store (gloo's
    'connectFullMesh failed ... Connection refused', 6 times) or hung in the group's set-up. They resume by themselves."""
    world.check("ddp")
    run_dir = tmp_path / "run"
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--max-restarts=2",
                              f"--master-port={free_port()}", "-m", "stabletrain", "train", *ARGS, f"run.dir={run_dir}"],
                             env={k: v for k, v in env().items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = set()
    try:
        t0 = time.time()
        while steps_logged(run_dir) < 7:
            assert agent.poll() is None and time.time() - t0 < 180, agent.poll()
            seen.update(descendants(agent.pid))
            time.sleep(0.01)
        os.kill(ranks_of(agent.pid)[1], signal.SIGKILL)
        out, err = agent.communicate(timeout=240)
    finally:
        for pid in descendants(agent.pid):
            os.kill(pid, signal.SIGKILL)
        if agent.poll() is None:
            agent.kill()
    assert agent.returncode == 0, err[-3000:]
    assert not wait_gone(seen)
    assert len([e for e in events(run_dir) if e["kind"] == "restart"]) == 1
    _assert_bitwise(_final(run_dir), _final(world.root / "ddp"))
    # A plain --resume of it on one process (what its SIGTERM line says to type): a trial's halved the global batch with
    # an informational line; refused, saying how it was launched (dist.nproc=1 says a reshard is meant)
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert main(["train", "--resume", str(run_dir), "train.max_steps=40"]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith(
        f"stabletrain: error: resume {str(run_dir)!r}: its last launch trained on 2 processes (a torchrun of your own: its "
        "config.yaml says dist.nproc=1), and this one would go on on 1, its global batch from ")
    assert ("resume it as it was launched (the same torchrun command, 2 processes in all, with -m stabletrain train "
            f"--resume {run_dir}), or on this machine with dist.nproc=2") in err  # (nodes x processes per node: not one node's)
    assert (run_dir / "metrics.jsonl").read_text() == metrics  # nothing written


def test_run_resume_auto_starts_the_run_then_continues_it(tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = ["train", "task=mlp", "task_args.num_samples=256", "train.batch_size=8", "ckpt.every=2", "log.every=2",
            "eval.every=0", "run.resume=auto", f"run.dir={run_dir}", *FAST]
    assert main([*args, "train.max_steps=4"]) == 0
    assert f"stabletrain: run.resume=auto: {run_dir} holds no checkpoint: starting it" in capsys.readouterr().out
    assert main([*args, "train.max_steps=8"]) == 0  # the same command, submitted again with a longer horizon
    out = capsys.readouterr().out
    assert f"stabletrain: run.resume=auto: {run_dir} holds LAST_GOOD (step_000004): continuing it" in out
    assert [(e["kind"], e["step"]) for e in events(run_dir) if e["kind"] in ("resume", "restart")] == [("resume", 4)]
    assert [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()] == [2, 4, 6, 8]
    ledger = [json.loads(x) for x in (run_dir / "goodput.jsonl").read_text().splitlines()]
    assert [(r["kind"], r["step"]) for r in ledger if r["kind"] != "interval"] == [("launch", 0), ("end", 4),
                                                                                   ("launch", 4), ("end", 8)]
    before = [(run_dir / f).read_text() for f in ("events.jsonl", "goodput.jsonl", "metrics.jsonl")]
    assert main([*args, "train.max_steps=8"]) == 0  # submitted again once it finished: nothing to train, nothing written
    assert f"run.resume=auto: {run_dir} has finished (LAST_GOOD step_000008, train.max_steps=8): nothing to train" in (
        capsys.readouterr().out)
    assert [(run_dir / f).read_text() for f in ("events.jsonl", "goodput.jsonl", "metrics.jsonl")] == before
    # run.overwrite=true beside it (a new user's trial: dropped without a word): said, the run left as it is
    assert main([*args, "train.max_steps=8", "run.overwrite=true"]) == 0
    assert ("nothing to train (raise train.max_steps to train on); run.overwrite=true starts over only a run with no "
            "checkpoint (run.resume=never to)") in capsys.readouterr().out
    assert [(run_dir / f).read_text() for f in ("events.jsonl", "goodput.jsonl", "metrics.jsonl")] == before
    assert main([*args, "train.max_steps=8", "optim.lr=0.5"]) == 2  # a changed config is refused as --resume does
    out, err = capsys.readouterr()
    assert "optim.lr: checkpoint 0.001, now 0.5" in err and "continuing it" not in out  # (it said so, then refused)
    assert main(["train", "task=mlp", "run.resume=auto"]) == 2
    assert "config key 'run.resume': auto continues or starts run.dir, but run.dir is not set" in capsys.readouterr().err
    # A finished run whose last checkpoint is damaged (a byte flipped) is no finished run: it said 'has finished', exit 0;
    # the resume falls back to the checkpoint before it (saying why) and trains the last steps again.
    state = run_dir / "checkpoints" / "step_000008" / "state.pt"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0xFF
    state.write_bytes(bytes(data))
    assert main([*args, "train.max_steps=8"]) == 0
    out, err = capsys.readouterr()
    assert "has finished" not in out and "step_000008" in err, (out, err)
    assert [(e["kind"], e["step"]) for e in events(run_dir) if e["kind"] == "resume"][-1] == ("resume", 6)
    # Its newest checkpoint's meta.json unreadable: the resume falls back, and the line that says it continues is there
    (run_dir / "checkpoints" / "step_000008" / "meta.json").write_text("{not json")  # (a trial: no line at all)
    assert main([*args, "train.max_steps=10"]) == 0
    out, err = capsys.readouterr()
    assert f"stabletrain: run.resume=auto: {run_dir} holds LAST_GOOD (step_000008): continuing it" in out, (out, err)
    # A run that trained, its checkpoints gone (a trial: 'holds no checkpoint: starting it', then 'already holds a run')
    shutil.rmtree(run_dir / "checkpoints")
    record = [(run_dir / f).read_text() for f in ("events.jsonl", "metrics.jsonl")]
    assert main([*args, "train.max_steps=10"]) == 2
    out, err = capsys.readouterr()
    assert "starting it" not in out and err.strip() == (
        f"stabletrain: error: run.resume=auto: run directory '{run_dir}' holds a run that trained but no checkpoint to "
        "continue it from; pick another run.dir, or pass run.overwrite=true to start it over"), err
    assert [(run_dir / f).read_text() for f in ("events.jsonl", "metrics.jsonl")] == record  # nothing written
    # A run.dir that cannot be one (under a file; not creatable): its refusal alone, not 'starting it' first (a trial)
    (tmp_path / "afile").write_text("x")
    for where, why in ((tmp_path / "afile" / "run", "lies under"), (Path("/proc/none/run"), "cannot be created")):
        assert main([*args[:-len(FAST) - 1], f"run.dir={where}", *FAST, "train.max_steps=2"]) == 2
        out, err = capsys.readouterr()
        assert "starting it" not in out and err.startswith(f"stabletrain: error: config key 'run.dir': '{where}' {why}"), (
            out, err)


# -- what ended a launch, and when not to restart (no processes) ------------------------------------------------


def _crash(step):
    return {"kind": "crash", "step": step - 1, "failed_step": step, "error": "OSError", "location": "data.py:9",
            "reason": "OSError: bad"}


def test_a_launch_is_told_by_its_record_and_the_same_failure_k_times_in_a_row_is_refused():
    ckpt = {"kind": "checkpoint", "step": 6}
    first = last_failure([ckpt, _crash(7)], last_logged=6)
    assert (first.kind, first.key, first.progress, first.resumed_step, first.last_step) == (
        "crash", ["crash", "OSError", "data.py:9", 7], True, None, 6)
    restart = {"kind": "restart", "step": 6, "failure": first.record()}
    again = last_failure([ckpt, _crash(7), restart, {"kind": "resume", "step": 6}, _crash(7)])
    assert again.key == first.key and again.progress is False and again.resumed_step == 6
    assert refusal(again, [restart], max_repeats=2) is None
    assert refusal(again, [restart], max_repeats=1) == ("the same failure ended 2 launches in a row (crashed at step 7: "
                                                        "OSError: bad)")
    assert refusal(again, [restart, restart], max_repeats=2).startswith("the same failure ended 3 launches")
    # Deaths without a record are never "the same failure"; K + 1 of them in a row with no new checkpoint are refused.
    killed = Failure("exit", "ended without a record of why", None, progress=False, resumed_step=6, last_step=7)
    stuck = {"kind": "restart", "failure": killed.record()}
    assert refusal(killed, [stuck], max_repeats=2) is None
    assert refusal(killed, [stuck, stuck], max_repeats=2) == ("3 launches in a row ended before writing a new "
                                                              "checkpoint (the last ended without a record of why)")
    moving = {"kind": "restart", "failure": {**killed.record(), "progress": True}}
    assert refusal(killed, [stuck, moving, stuck], max_repeats=2) is None  # progress in between resets the count
    # A trial: killed right after a save landed, before the boundary that writes its event: LAST_GOOD (step 8) past the
    # launch's start (step 6) is its progress, not three launches 'stuck' (the crash-loop rule's refusal)
    from pathlib import Path

    from stabletrain.services.launch_failures import landed as _landed

    assert _landed(killed, Path("checkpoints/step_000008")).progress is True
    assert _landed(killed, Path("checkpoints/step_000006")).progress is False and _landed(killed, None) is killed
    assert refusal(_landed(killed, Path("checkpoints/step_000008")), [stuck, stuck], max_repeats=2) is None
    # (a review) a launch whose resume fell back past a LAST_GOOD that did not verify made no progress by it; a launch
    # after a restart that started the run over resumed nothing: its step-0 checkpoint is progress
    fell = last_failure([ckpt, {"kind": "checkpoint_skipped", "step": 6}, {"kind": "resume", "step": 6}])
    assert fell.fell_back and _landed(fell, Path("checkpoints/step_000008")).progress is False
    over = {"kind": "restart", "step": 0, "checkpoint": None, "started_over": True}
    assert last_failure([over, {"kind": "checkpoint", "step": 0}]).progress is True
    # A launch that recorded its restart (from step 6) and died before resuming trained nothing: the metrics lines up
    # to step 9 are the launch's before it; one that resumed reached them itself.
    recorded = {"kind": "restart", "step": 6, "checkpoint": "step_000006"}
    assert last_failure([ckpt, recorded], last_logged=9).last_step == 6
    assert last_failure([ckpt, recorded, {"kind": "resume", "step": 6}], last_logged=9).last_step == 9


def test_resubmissions_join_the_chain_and_what_is_no_repeatable_failure_stays_out_of_it():
    """A review of the run.resume=auto chain: a resubmission right after a restart whose launch wrote no resume (it
    started over, or died in its start-up) joins the chain too; a refusal's own stop is not the failure it refused (the
    next resubmission met 'another' one and went on); a stop by SIGTERM or SIGINT (a preemption, a person) is no failure
    to repeat, whatever incident came before it; torch's 'pid(s) 25207, 25208' is no part of a death's identity."""
    from stabletrain.services.launch_failures import death_failure, restart_chain

    ckpt, crash = {"kind": "checkpoint", "step": 6}, _crash(7)
    restart = {"kind": "restart", "step": 0, "failure": last_failure([ckpt, crash]).record(), "started_over": True}
    chain = restart_chain([ckpt, crash, restart, crash, {"kind": "resume", "step": 6, "auto": True}])
    assert [e["kind"] for e in chain] == ["restart", "requeue"] and chain[1]["failure"]["key"] == restart["failure"]["key"]
    assert restart_chain([ckpt, crash, restart, {"kind": "resume", "step": 0}]) == [restart]  # (the restart's own resume)
    assert restart_chain([ckpt, crash, {"kind": "resume", "step": 6}]) == []  # (by hand: a new chain)
    refused = {"kind": "stop", "step": 8, "reason": "resubmission refused: the same failure ended 2 launches in a row"}
    stop = {"kind": "stop", "step": 8, "reason": "stopping: 20 consecutive skipped steps at step 8"}
    assert last_failure([ckpt, stop, refused]).key == last_failure([ckpt, stop]).key is not None
    incident = {"kind": "incident", "step": 7, "diagnosis": {"failure_class": "data"}}
    for reason in ("stopped by SIGTERM at step 8", "stopping: stopped by SIGINT at step 8"):
        assert last_failure([ckpt, incident, {"kind": "stop", "step": 8, "reason": reason}]).key is None
    keys = [death_failure(last_failure([ckpt]), {"rank": 0, "exitcode": 1, "last_line": line}).key for line in (
        "RuntimeError: DataLoader worker (pid(s) 25207, 25208) exited unexpectedly",
        "RuntimeError: DataLoader worker (pid(s) 31001) exited unexpectedly")]
    assert keys[0] == keys[1] and "25207" not in str(keys[0])


def test_a_guard_stop_is_identified_by_its_incident_and_a_nonfinite_step_after_a_load_is_seen():
    stop = last_failure([{"kind": "resume", "step": 6}, {"kind": "nonfinite", "step": 7},
                         {"kind": "incident", "step": 7, "diagnosis": {"failure_class": "overflow"}},
                         {"kind": "stop", "step": 7, "reason": "stopping: non-finite loss at step 7"}])
    assert stop.key == ["stop", 7, "overflow", None] and stop.nonfinite_step == 7 and stop.resumed_step == 6
    assert stop.text == "stopped at step 7: non-finite loss at step 7 (incident at step 7: overflow)"


def test_set_aside_keeps_the_checkpoint_and_moves_last_good_back(tmp_path):
    ckpt = CheckpointManager(tmp_path / "c", keep=3)
    for step in (2, 4):
        ckpt.save({"model": {"w": torch.full((2,), float(step))}, "optimizer": {}}, step)
    moved, good = ckpt.set_aside(ckpt.latest_good())
    assert (moved.relative_to(tmp_path).as_posix(), good.name, ckpt.latest_good().name) == ("c/distrusted/step_000004",
                                                                                  "step_000002", "step_000002")
    assert ckpt.verify(moved) == [] and [p.name for p in ckpt.checkpoints()] == ["step_000002"]
    with pytest.raises(Exception, match="no checkpoint older than step_000002"):
        ckpt.set_aside(good)
    assert ckpt.latest_good().name == "step_000002"


def test_goodput_splits_the_wall_time_of_every_launch_and_the_wait_before_a_restart(tmp_path):
    # Launch 1 starts at t=100, is ready at 104, logs steps 10 and 20, dies at 117 (its launcher saw it); the restart
    # starts at 119 from step 10, is ready at 121, logs step 20 again and ends at 128.
    ledger = [{"kind": "launch", "start": 100.0, "ready": 104.0, "step": 0},
              {"kind": "interval", "t": 110.0, "step": 10, "steps": 10, "wall_s": 6.0, "eval_s": 1.0, "checkpoint_s": 0.5,
               "incident_s": 0.0, "skipped": 1},
              {"kind": "interval", "t": 116.0, "step": 20, "steps": 10, "wall_s": 6.0, "eval_s": 0.0, "checkpoint_s": 0.0,
               "incident_s": 0.0, "skipped": 0},
              {"kind": "launch", "start": 119.0, "ready": 121.0, "step": 10},
              {"kind": "interval", "t": 127.0, "step": 20, "steps": 10, "wall_s": 6.0, "eval_s": 0.0, "checkpoint_s": 0.0,
               "incident_s": 0.0, "skipped": 0},
              {"kind": "end", "t": 128.0, "step": 20, "wall_s": 1.0, "checkpoint_s": 0.4, "incident_s": 0.0}]
    (tmp_path / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "restart", "step": 10, "time": 120.0,
                                                       "cause": {"time": 117.0}}) + "\n")
    g = read_goodput(tmp_path)
    assert g.total_s == pytest.approx(28.0) and (g.launches, g.restarts) == (2, 1)
    assert g.seconds == pytest.approx({"productive": 4.05 + 6.0,  # launch 1's first interval (less its skipped tenth), launch 2's
                                       "redone": 6.0 + 1.0,  # launch 1's steps 11-20, and its second after its last line
                                       "skipped": 0.45, "checkpoint": 0.5 + 0.4, "startup": 4.0 + 2.0 + 2.0,  # + the wait
                                       "eval": 1.0, "incident": 0.0, "other": 0.6})
    assert g.line() == ("goodput 35.9% over 2 launches (lost: 28.6% start-up, 25.0% redone after 1 restart, 3.6% "
                        "evaluation, 3.2% checkpoint stalls, 2.1% other, 1.6% skipped steps)")
    # 28 s in all, 29% of it start-up: the report's section says what weighs on the figure (a 4 s run showed 14%, bare)
    from stabletrain.report.goodput import goodput_section
    assert "28.0 s of wall time in all. A run this short spends much of it starting up" in goodput_section(tmp_path)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _two_launches(ready, wall, start, ready2, end, wall2):
    """A ledger of a launch (from 100, ready at ``ready``, one 10-step interval logged at 110 after ``wall`` s) and a
    later one (``start``, ``ready2``, ending at ``end`` after ``wall2`` s)."""
    return [{"kind": "launch", "start": 100.0, "ready": ready, "step": 0},
            {"kind": "interval", "t": 110.0, "step": 10, "steps": 10, "wall_s": wall, "eval_s": 0.0, "checkpoint_s": 0.0,
             "incident_s": 0.0, "skipped": 0},
            {"kind": "launch", "start": start, "ready": ready2, "step": 10},
            {"kind": "end", "t": end, "step": 10, "wall_s": wall2, "checkpoint_s": 0.0, "incident_s": 0.0}]


def test_goodputs_parts_add_up_to_the_wall_though_the_ledger_rounds_its_times(tmp_path):
    """A line's rounded times may overshoot its wall by a fraction of a millisecond: the parts then make the wall (the
    test of a rollback's goodput failed once on 17.7260 parts vs 17.7251 s); a larger overshoot is not hidden."""
    ledger = [{"kind": "launch", "start": 100.0, "ready": 101.0, "step": 0},
              {"kind": "interval", "t": 111.0, "step": 10, "steps": 10, "wall_s": 10.0003, "eval_s": 0.0,
               "checkpoint_s": 0.0, "incident_s": 0.0, "skipped": 0},
              {"kind": "end", "t": 112.0, "step": 10, "wall_s": 1.0, "checkpoint_s": 1.0, "incident_s": 0.0}]
    _jsonl(tmp_path / "goodput.jsonl", ledger)
    _jsonl(tmp_path / "events.jsonl", [])
    g = read_goodput(tmp_path)
    assert g.total_s == pytest.approx(12.0003) and sum(g.seconds.values()) == pytest.approx(g.total_s)
    ledger[1]["wall_s"] = 11.0  # a second over: shown as it is
    _jsonl(tmp_path / "goodput.jsonl", ledger)
    g = read_goodput(tmp_path)
    assert g.total_s == pytest.approx(12.0) and sum(g.seconds.values()) == pytest.approx(13.0)


def test_a_ledger_line_claims_no_more_checkpoint_and_incident_time_than_its_wall(tmp_path):
    """A save's blocked time is counted when its outcome is known, a line later: the end line held 12.5 ms of
    checkpoint in 12.0 ms of wall."""
    from stabletrain.callbacks.goodput_clock import GoodputClock

    clock = GoodputClock(tmp_path / "goodput.jsonl", {})
    clock._checkpoint_s, clock._incident_s = 0.0125, 0.3
    assert clock._within(0.012) == (0.012, 0.0)
    clock._checkpoint_s = 0.002
    assert clock._within(0.012) == (0.002, pytest.approx(0.010))


def test_goodput_counts_a_launch_that_died_in_its_start_up(tmp_path):
    # Launch 1 (100-117, killed); launch 2 starts, writes its restart event at 120 and dies at 123 before its ledger's
    # first line; launch 3 writes its restart event at 125 (its own start 124), is ready at 126 and ends at 130.
    ledger = _two_launches(104.0, 6.0, 124.0, 126.0, 130.0, 4.0)
    _jsonl(tmp_path / "goodput.jsonl", ledger)
    restarts = [{"kind": "restart", "step": 10, "time": 120.0, "cause": {"time": 117.0}},
                {"kind": "restart", "step": 10, "time": 125.0, "cause": {"time": 123.0}}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in restarts))
    g = read_goodput(tmp_path)
    assert (g.launches, g.restarts) == (3, 2) and "over 3 launches" in g.line() and "after 2 restarts" in g.line()
    # launch 1's 17 s, the 7 s from its death to launch 3's start (launch 2's life), launch 3's 6 s
    assert g.total_s == pytest.approx(30.0) and g.seconds["startup"] == pytest.approx(4.0 + 7.0 + 2.0)
    # The first launch died in its start-up, the second ran: two launches, one restart.
    (tmp_path / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger[2:]))
    (tmp_path / "events.jsonl").write_text(json.dumps(restarts[1]) + "\n")
    assert (read_goodput(tmp_path).launches, read_goodput(tmp_path).restarts) == (2, 1)
    # The last restarted launch died in its start-up too (the run then stopped): counted, and alive until its event.
    (tmp_path / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger[:2]))
    (tmp_path / "events.jsonl").write_text(json.dumps(restarts[0]) + "\n")
    g = read_goodput(tmp_path)
    assert (g.launches, g.restarts) == (2, 1) and g.total_s == pytest.approx(20.0)


def test_goodput_counts_the_launch_that_refused_once(tmp_path):
    """A crash loop: 3 launches got ready (the 2nd and 3rd restarted), a 4th refused to loop at its start: 'over 5
    launches' (the refusing launch counted twice)."""
    ledger = [{"kind": "launch", "start": 100.0 + 10 * i, "ready": 101.0 + 10 * i, "step": 0} for i in range(3)]
    _jsonl(tmp_path / "goodput.jsonl", ledger)
    events = [{"kind": "restart", "step": 0, "time": 100.5 + 10 * i, "cause": {"time": 99.0 + 10 * i}} for i in (1, 2)]
    events.append({"kind": "stop", "step": 0, "time": 130.5, "reason": "restart refused: the same failure ...",
                   "cause": {"time": 129.0}})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    g = read_goodput(tmp_path)
    assert (g.launches, g.restarts, g.refused) == (4, 2, 1)
    # a user counted 3 launch lines and 2 restarts against "4 launches" (and again against "4 launches (the last refused
    # to restart ...)"): the line counts the launches that trained, and the one that refused apart
    assert "over 3 launches (and one more that started only to refuse a restart: a crash loop; lost: " in g.line(), g.line()


def test_goodput_parts_that_overlap_in_an_interval_stay_within_its_wall_time(tmp_path):
    # A save waited for inside a rollback's incident time was in both: 0.63 s checkpoint and 0.67 s incident in 0.68 s.
    ledger = [{"kind": "launch", "start": 100.0, "ready": 101.0, "step": 0},
              {"kind": "interval", "t": 101.68, "step": 10, "steps": 10, "wall_s": 0.68, "eval_s": 0.0,
               "checkpoint_s": 0.63, "incident_s": 0.67, "skipped": 0},
              {"kind": "end", "t": 102.0, "step": 10, "wall_s": 0.32, "checkpoint_s": 0.0, "incident_s": 0.0}]
    (tmp_path / "goodput.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ledger))
    g = read_goodput(tmp_path)
    assert g.seconds["checkpoint"] + g.seconds["incident"] == pytest.approx(0.68)
    assert sum(g.seconds.values()) == pytest.approx(g.total_s) and sum(g.share(p) for p in g.seconds) == pytest.approx(1.0)


def test_goodput_leaves_out_the_wait_after_a_refused_restart_and_counts_the_refusing_launch(tmp_path):
    # Launch 1 dies at 111; the 3 launches restarted after it die in their start-up (their restarts recorded late, at
    # 120, by the 5th, which refuses to loop); a person resumes at 200: the 80 s between are nobody's run time.
    _jsonl(tmp_path / "goodput.jsonl", _two_launches(101.0, 9.0, 200.0, 201.0, 210.0, 9.0))
    events = [{"kind": "restart", "step": 10, "time": 120.0, "restart": n, "cause": {"time": t}}
              for n, t in ((1, 111.0), (2, 113.0), (3, 116.0))]
    events += [{"kind": "stop", "step": 10, "time": 120.0, "reason": "restart refused: 3 launches in a row ...",
                "cause": {"time": 119.0}},
               {"kind": "resume", "step": 10, "time": 201.0, "reason": "resumed"}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    g = read_goodput(tmp_path)
    assert (g.launches, g.restarts) == (6, 3), g.line()
    assert g.total_s == pytest.approx(11.0 + 9.0 + 10.0)  # launch 1 to its death, the restarts until the refusal, the resume
    assert g.seconds["startup"] == pytest.approx(1.0 + 9.0 + 1.0)


def test_goodput_counts_a_resubmissions_refusal_right_after_its_supervisors_as_one_launch(tmp_path):
    """A trial: 3 launches trained (2 restarted), a 4th refused to restart, and a resubmission under run.resume=auto
    refused at its start: 'over 4 launches (and 2 more that started only to refuse ...)', where 3 trained. A refusal
    right after a refusal followed the death of a launch that never got ready; a resubmission's refuses at its own start,
    after nothing: 5 launches, 3 that trained."""
    ledger = [{"kind": "launch", "start": 100.0 + 10 * i, "ready": 101.0 + 10 * i, "step": 0} for i in range(3)]
    _jsonl(tmp_path / "goodput.jsonl", ledger)
    events = [{"kind": "restart", "step": 0, "time": 100.5 + 10 * i, "cause": {"time": 99.0 + 10 * i}} for i in (1, 2)]
    events += [{"kind": "stop", "step": 0, "time": 130.5, "reason": "restart refused: the same failure ...",
                "cause": {"time": 129.0}},
               {"kind": "stop", "step": 0, "time": 140.0, "reason": "resubmission refused: the same failure ..."}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    g = read_goodput(tmp_path)
    assert (g.launches, g.restarts, g.refused) == (5, 2, 2), g.line()
    assert "over 3 launches (and 2 more that started only to refuse" in g.line(), g.line()
    # a restart refused right after the resubmission's refusal: the launch a person started in between died unready
    events.append({"kind": "stop", "step": 0, "time": 150.0, "reason": "restart refused: ...", "cause": {"time": 149.0}})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert (read_goodput(tmp_path).launches, read_goodput(tmp_path).refused) == (7, 3)


def test_a_restart_sets_aside_every_capture_of_the_steps_it_trains_again(tmp_path):
    """A step captured twice (step_N, then step_N.2 after a rollback) is set aside whole when a restart goes back
    past it; an earlier step's capture and a folder set aside before stay as they are."""
    from stabletrain.records.bundles import set_aside_incidents

    for name in ("step_000005", "step_000020", "step_000020.2", "step_000020.superseded-1", "step_000021.2.superseded-1"):
        (tmp_path / "incidents" / name).mkdir(parents=True)
    kept = set_aside_incidents(tmp_path, 10, "2")
    assert kept == ["step_000020.superseded-2", "step_000020.2.superseded-2"]
    assert sorted(p.name for p in (tmp_path / "incidents").iterdir()) == [
        "step_000005", "step_000020.2.superseded-2", "step_000020.superseded-1", "step_000020.superseded-2",
        "step_000021.2.superseded-1"]
    # two resumes by hand from the same step, each past a new capture of step 20: the second keeps the first's
    (tmp_path / "incidents" / "step_000020").mkdir()
    assert set_aside_incidents(tmp_path, 10, "resume") == ["step_000020.superseded-resume"]
    (tmp_path / "incidents" / "step_000020").mkdir()
    assert set_aside_incidents(tmp_path, 10, "resume") == ["step_000020.superseded-resume.2"]
    # the incident remedy.apply names stays where it reads it, a restart's or a resume's (a review: exit 2 each retry)
    (tmp_path / "incidents" / "step_000030").mkdir()
    spec = f"{tmp_path / 'incidents' / 'step_000030'}:rollback-lr-x0.1"
    assert set_aside_incidents(tmp_path, 10, "3", spec) == [] and (tmp_path / "incidents" / "step_000030").is_dir()


def test_diagnose_and_remedy_on_a_run_directory_pick_its_captures_by_step_and_number(tmp_path, capsys):
    """'newest' is the last step's last capture, numerically (step_N.10 after step_N.9), not one a restart set aside;
    each says which it took of how many (diagnose takes the newest, remedy the first: not to be taken for one)."""
    from stabletrain.commands import incident_dir

    for name in ("step_000020", "step_000020.9", "step_000020.10", "step_000007.superseded-1", "step_000021.superseded-1"):
        (tmp_path / "incidents" / name).mkdir(parents=True)
    assert incident_dir(tmp_path, newest=True, command="diagnose").name == "step_000020.10"
    assert capsys.readouterr().err == (f"stabletrain: diagnose: {tmp_path} holds 3 incidents; this is the newest, "
                                       f"step_000020.10 (give {tmp_path / 'incidents' / 'step_000020'} for the first)\n")
    assert incident_dir(tmp_path, newest=False, command="remedy").name == "step_000020"
    assert "this is the first, step_000020 (give" in capsys.readouterr().err
    # The console says "step 20": RUN/incidents/step_20 names step_000020 (and step_20.9 its ninth capture).
    assert incident_dir(tmp_path / "incidents" / "step_20", newest=True, command="diagnose").name == "step_000020"
    assert incident_dir(tmp_path / "incidents" / "step_20.9", newest=True, command="diagnose").name == "step_000020.9"
    with pytest.raises(FileNotFoundError, match="step_21'.*does not exist"):
        incident_dir(tmp_path / "incidents" / "step_21", newest=True, command="diagnose")


def test_a_ranks_death_named_by_its_launcher_is_the_same_failure_only_at_the_same_last_step(tmp_path):
    """Rank 1 dies with the same last line twice: at the same last step it is the same failure (refused at
    run.max_repeats=1); after the restart trained on past it, the same words are another failure (a restart)."""
    from stabletrain.services.restarts import _restart_after

    def launch(last_logged: int, code) -> object:
        run_dir = tmp_path / f"run{last_logged}"
        run_dir.mkdir()
        earlier = {"kind": "exit", "text": "ended as rank 1 ...", "progress": True,
                   "key": ["exit", 1, 1, "RuntimeError: boom", 5]}
        events = [{"kind": "checkpoint", "step": 4, "time": 1.0},
                  {"kind": "restart", "step": 4, "time": 2.0, "restart": 1, "failure": earlier, "checkpoint": "step_000004"},
                  {"kind": "resume", "step": 4, "time": 3.0}]
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in range(1, last_logged + 1)))
        cause = {"rank": 1, "exitcode": code, "last_line": "RuntimeError: boom", "restart": 2, "max_restarts": 5, "time": 4.0}
        everyone = [{"causes": [cause], "count": 2, "max": 5, "run_id": None}]
        return _restart_after(cfg("run.max_repeats=1"), run_dir, everyone, False, cause, late=False)

    same = launch(5, 1)
    assert "the same failure ended 2 launches in a row (ended as rank 1 exited with code 1" in (same.refused or "")
    later = launch(12, 1)
    assert later.refused is None
    assert "ended as rank 1 exited with code 1 (its last line: 'RuntimeError: boom')" in (
        tmp_path / "run12" / "events.jsonl").read_text()
    # A record without an exit code (a launcher that could not read it) is taken as exit 1, not a crash of the launch
    assert launch(6, None).refused is None


def test_a_signal_death_at_the_same_step_is_the_same_failure_whatever_its_last_line(tmp_path):
    """A process SIGKILLed at the same step on every launch printed a progress line before its first death and its
    restart's announcement before the others: the same failure all the same (a signal's victim says nothing of it),
    refused at run.max_repeats=2 after two restarts, and the line names the step it got to."""
    from stabletrain.services.restarts import _restart_after

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    events = [{"kind": "checkpoint", "step": 20, "time": 1.0}]
    lines = ["mlp step 20/100 (20%) | loss 2.3", "stabletrain: restart 1 of 5 after rank 0 ...; resuming from step_000020",
             "stabletrain: restart 2 of 5 after rank 0 ...; resuming from step_000020"]
    outcomes = []
    for number, line in enumerate(lines, 1):
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        # each launch logged steps 10 and 20 (a start-over sets the launch before's lines aside)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (10, 20)))
        cause = {"rank": 0, "exitcode": -9, "last_line": line, "restart": number, "max_restarts": 5, "time": 2.0 + number}
        everyone = [{"causes": [cause], "count": number, "max": 5, "run_id": None}]
        outcomes.append(_restart_after(cfg("run.max_repeats=2"), run_dir, everyone, False, cause, late=False))
        events = read_jsonl(run_dir / "events.jsonl")[0]
    assert [o.refused is None for o in outcomes] == [True, True, False], [o.refused for o in outcomes]
    assert ("the same failure ended 3 launches in a row (ended as rank 0 was killed by SIGKILL (its last record: step 20; "
            "its last line: 'stabletrain: restart 2 of 5") in outcomes[-1].refused
    # (no checkpoint on disk here: each restart started the run over, and the line says so rather than 'from None')
    assert "tried: 2 restart(s) so far, the last from step 0 (no checkpoint was written yet)" in outcomes[-1].refused


def test_a_stop_asked_for_after_the_ranks_finished_leaves_the_finished_run_at_exit_0(tmp_path):
    """SIGINT to the launcher after the ranks trained and exited, while torchrun's agent was ending: it went to the
    agent, which died of it: 'stopped by SIGINT before the ranks started', exit 130, for a finished run. Now the
    stop waits for the agent to end by itself."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "stabletrain", "train", *ARGS, "train.max_steps=4", "ckpt.every=0",
                             "dist.nproc=2", f"run.dir={run_dir}"], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0, agent, ranks_seen = time.time(), None, False
    while True:  # the agent alive, its ranks gone after they ran
        assert proc.poll() is None and time.time() - t0 < 120, proc.communicate()
        agent = agent or next(iter(children(proc.pid)), None)
        ranks = children(agent) if agent else []
        ranks_seen = ranks_seen or bool(ranks)
        if ranks_seen and not ranks:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "before the ranks started" not in err, err[-2000:]
    assert "trained 4 steps" in out


def test_a_second_trainer_in_one_process_starts_its_launch_when_it_is_built_not_with_the_process(tmp_path):
    """Two Trainers in one script (a fit, a pause, a resume): the second launch's start-up was counted from the
    process's start, the first fit and the pause in it ('86.8% start-up' over more seconds than the script ran)."""
    from helpers import regression_task

    run_dir = tmp_path / "run"
    overrides = ("log.every=2", "ckpt.every=2", "train.batch_size=8")
    Trainer(cfg("train.max_steps=4", *overrides), task=regression_task(), run_dir=run_dir).fit()
    time.sleep(1.0)  # the script's own time between the fits: nobody's start-up
    Trainer(cfg("train.max_steps=8", *overrides), task=regression_task(), run_dir=run_dir, resume=True).fit()
    ledger = read_jsonl(run_dir / "goodput.jsonl")[0]
    first_end = next(r for r in ledger if r["kind"] == "end")["t"]
    second = [r for r in ledger if r["kind"] == "launch"][1]
    assert second["start"] >= first_end + 0.9 and second["ready"] - second["start"] < 2.0, ledger
    g = read_goodput(run_dir)
    last_end = [r for r in ledger if r["kind"] == "end"][-1]["t"]
    assert g.launches == 2 and g.total_s <= last_end - ledger[0]["start"] - 0.9, g.line()  # the pause is not counted


def test_the_finished_check_takes_a_config_as_the_resume_would(tmp_path):
    """The check that a run is finished (--resume or run.resume=auto at train.max_steps: nothing written) compares the
    configs by the resume's rule: a resharded resume may change train.batch_size (it refused that, and the resume went on
    to rewrite the run's record), and the mode a saved precision=auto trained in is the checkpoint's (meta.json), not
    what auto resolves to on the machine that checks."""
    from stabletrain.config import config_to_dict
    from stabletrain.services.restarts import _same_config

    ckpt = tmp_path / "step_000010"
    ckpt.mkdir()

    def meta(world, trained, **cfg_overrides):
        saved = config_to_dict(cfg("train.batch_size=8", *[f"{k}={v}" for k, v in cfg_overrides.items()]))
        (ckpt / "meta.json").write_text(json.dumps({"config": saved, "world_size": world, "precision": trained}))

    meta(2, "fp32")
    assert _same_config(cfg("train.batch_size=16"), ckpt, world=1)  # resharded: the batch may change
    assert not _same_config(cfg("train.batch_size=16"), ckpt, world=2)
    assert _same_config(cfg("train.batch_size=8", "precision=fp32"), ckpt, world=2)  # auto trained in fp32: the same
    meta(2, "bf16")  # a GPU run's auto (bf16), checked on a CPU host: fp32 is another precision
    assert not _same_config(cfg("train.batch_size=8", "precision=fp32"), ckpt, world=2)


def test_where_a_restart_resumed_from_reads_older_run_directories_right(tmp_path):
    """A review: restart events written before 'started_over' was recorded: a start-over (step 0, no checkpoint) read as
    'the newest checkpoint that verified' in the refusal line, and the report said 'from step 0' for a restart that
    resumed with no LAST_GOOD to name."""
    from stabletrain.records.launches import started_over

    old_start_over = {"step": 0, "kind": "restart", "time": 1.0, "cause": {"rank": 0, "exitcode": -9}, "checkpoint": None}
    unnamed = {**old_start_over, "step": 37}
    named = {**old_start_over, "step": 40, "checkpoint": "step_000030"}
    assert started_over(old_start_over) and not started_over(unnamed) and not started_over(named)
    assert started_over({**unnamed, "step": 0, "started_over": True})
    assert not started_over({**old_start_over, "started_over": False})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("".join(json.dumps({**e, "reason": "restart"}) + "\n"
                                                  for e in (old_start_over, unnamed, named)))
    texts = [t for _, t in health_summary(load_run(run_dir)).sentences]
    assert any("from step 0, step_000030, the newest checkpoint that verified (run.max_restarts" in t for t in texts), texts


def test_a_process_killed_after_the_run_finished_is_not_restarted_into_nothing(tmp_path, monkeypatch, capsys):
    """A new user's trial: killed right after 'trained 400 steps', the supervisor restarted it: a 'restart' event, a
    second launch that said 'nothing to train', goodput over 2 launches. A restart of a finished run says so and
    records no restart."""
    run_dir = tmp_path / "run"
    args = ["train", "task=mlp", "task_args.num_samples=64", "train.batch_size=8", "train.max_steps=4", "ckpt.every=2",
            "log.every=2", "eval.every=0", "run.max_restarts=1", f"run.dir={run_dir}", *FAST]
    monkeypatch.setenv("STABLETRAIN_SUPERVISED", "1")  # this process as the supervisor's child: it trains itself
    assert main(args) == 0
    before = [(run_dir / f).read_text() for f in ("events.jsonl", "goodput.jsonl", "metrics.jsonl")]
    capsys.readouterr()
    monkeypatch.setenv("STABLETRAIN_RESTART", json.dumps([{"restart": 1, "max_restarts": 1, "signal": 9, "rank": 0,
                                                           "pid": 12345, "time": time.time()}]))
    assert main(args) == 0  # the restarted child
    assert "the run had trained to train.max_steps=4 (LAST_GOOD step_000004) when its process died: nothing to restart" in (
        capsys.readouterr().out)
    assert [(run_dir / f).read_text() for f in ("events.jsonl", "goodput.jsonl", "metrics.jsonl")] == before


def test_a_checkpoint_whose_event_a_kill_cut_off_is_recorded_at_the_restart_and_counts_as_progress(tmp_path):
    """A trial: a launch SIGKILLed after its save landed, before the boundary that writes its event: the report counted
    7 checkpoints of 9 and the launch read as one that wrote none (the crash-loop rule's 'stuck'). Here the events of
    steps 4 and 6 are cut as such a kill leaves them."""
    import json

    from helpers import cfg, regression_task

    from stabletrain.services.restarts import _restart_after

    run_dir = tmp_path / "run"
    c = cfg("train.batch_size=8", "train.max_steps=6", "log.every=2", "ckpt.every=2", "log.tensorboard=false",
            f"run.dir={run_dir}", "run.max_restarts=3")
    Trainer(c, task=regression_task(), run_dir=run_dir).fit()
    lines = (run_dir / "events.jsonl").read_text().splitlines()
    kept = [x for x in lines if not (json.loads(x)["kind"] == "checkpoint" and json.loads(x)["step"] in (4, 6))]
    (run_dir / "events.jsonl").write_text("\n".join(kept) + "\n")
    launch = _restart_after(c, run_dir, [{"count": 1, "max": 3}], True, None, late=False)
    assert launch.resume and launch.refused is None
    events = read_jsonl(run_dir / "events.jsonl")[0]
    late = [e for e in events if e.get("recorded_at_restart")]
    assert [(e["kind"], e["step"]) for e in late] == [("checkpoint", 4), ("checkpoint", 6)], late
    (restart,) = [e for e in events if e["kind"] == "restart"]
    assert restart["failure"]["progress"] is True and restart["checkpoint"] == "step_000006", restart
    assert health_summary(load_run(run_dir)).figures["checkpoints"] == 4  # steps 0, 2, 4, 6


def test_while_its_launcher_waits_to_restart_it_the_run_directory_stays_in_use(tmp_path, monkeypatch):
    """A trial: a run with run.max_restarts crashed; while its launcher waited to restart it launch.json was gone and a
    second run.resume=auto took the run over (both wrote one run directory). A process that ends by an error keeps its
    launcher (PARENT_ENV, alive) in launch.json: another launch is refused, the launcher's own restart is not; a run
    that ends well removes the record."""
    from stabletrain.callbacks import Callback
    from stabletrain.records.launches import PARENT_ENV, as_parent, refuse_if_running

    class Crash(Callback):
        def on_step_end(self, state, out):
            if state.step == 3:
                raise RuntimeError("boom")

    run_dir = tmp_path / "run"
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])  # the launcher, waiting
    try:
        monkeypatch.setenv(PARENT_ENV, json.dumps({**json.loads(as_parent()[PARENT_ENV]), "pid": parent.pid,
                                                   "start": None}))
        c = cfg("train.max_steps=6", "log.every=2", "ckpt.every=2")
        with pytest.raises(RuntimeError, match="boom"):
            Trainer(c, run_dir=run_dir, callbacks=[Crash()]).fit()
        assert [p["pid"] for p in json.loads((run_dir / "launch.json").read_text())["processes"]] == [parent.pid]
        refuse_if_running(run_dir)  # the launcher's own restart: its processes carry it
        monkeypatch.delenv(PARENT_ENV)
        with pytest.raises(ValueError, match=rf"is in use: 1 process\(es\) of an earlier launch still run on it \(pid "
                                             rf"{parent.pid} "):
            refuse_if_running(run_dir)  # another launch (a resubmitted run.resume=auto)
        parent.kill()
        parent.wait()
        refuse_if_running(run_dir)  # the launcher gone: no longer in use
        monkeypatch.setenv(PARENT_ENV, json.dumps({**json.loads(as_parent()[PARENT_ENV]), "start": None}))
        Trainer(c, run_dir=run_dir, resume=True).fit()  # (this process as the launcher) a run that ends well
        assert not (run_dir / "launch.json").exists()
    finally:
        parent.kill()


def test_a_launchs_last_step_is_its_ledgers_where_its_metrics_stop_short(tmp_path):
    """A trial: a DDP rank 0 whose peer was killed after step 76 logs no event (its metrics stopped at step 70); the
    restart said 'any steps it trained after step 75' and redone 0. The goodput ledger's end line has the last step.
    Here a launch's records are cut back to step 4 (checkpoints, events, metrics) and its ledger kept: it reached step 6."""
    import shutil

    from helpers import cfg, regression_task

    from stabletrain.records.checkpoint.manager import LAST_GOOD
    from stabletrain.services.restarts import _ledger_last_step, _restart_after

    run_dir = tmp_path / "run"
    c = cfg("train.batch_size=8", "train.max_steps=6", "log.every=2", "ckpt.every=2", "log.tensorboard=false",
            f"run.dir={run_dir}", "run.max_restarts=3")
    Trainer(c, task=regression_task(), run_dir=run_dir).fit()
    shutil.rmtree(run_dir / "checkpoints" / "step_000006")
    (run_dir / "checkpoints" / LAST_GOOD).write_text("step_000004\n")
    for name in ("events.jsonl", "metrics.jsonl"):
        rows = read_jsonl(run_dir / name)[0]
        _jsonl(run_dir / name, [r for r in rows if r["step"] <= 4])
    launch = _restart_after(c, run_dir, [{"count": 1, "max": 3}], True, None, late=False)
    assert launch.resume and launch.refused is None
    (restart,) = [e for e in read_jsonl(run_dir / "events.jsonl")[0] if e["kind"] == "restart"]
    assert restart["redone"] == 2 and "resuming from step_000004: 2 steps to train again (more if it trained past step " \
        "6, its last record)" in restart["reason"], restart
    marked = read_jsonl(run_dir / "events.jsonl")[0]  # a launch that died before its ledger began: not its ledger's
    assert _ledger_last_step(run_dir, marked) == 0


def test_the_report_names_the_checkpoint_a_restart_really_resumed_from(tmp_path):
    """A trial: LAST_GOOD (step 40) damaged, the process killed: the restart said 'resuming from step_000040', its
    launch's resume passed over the damaged one and loaded step 20 (its line said so), and the report said the run
    restarted itself 'from step_000040'. The report takes the resume's own word."""
    from stabletrain.services.restarts import _restart_after

    run_dir = tmp_path / "run"
    Trainer(cfg("train.max_steps=40", "ckpt.every=20", "log.every=10"), run_dir=run_dir).fit()
    (run_dir / "checkpoints" / "step_000040" / "state.pt").write_bytes(b"damaged")
    cause = {"rank": 0, "exitcode": -9, "signal": "SIGKILL", "restart": 1, "max_restarts": 2, "time": time.time()}
    everyone = [{"causes": [cause], "count": 1, "max": 2, "run_id": None}]
    assert _restart_after(cfg("train.max_steps=40"), run_dir, everyone, True, cause, late=False).resume
    Trainer(cfg("train.max_steps=40", "ckpt.every=20", "log.every=10"), run_dir=run_dir, resume=True).fit()
    restart, resume = (next(e for e in events(run_dir) if e["kind"] == k) for k in ("restart", "resume"))
    assert restart["checkpoint"] == "step_000040" and resume["step"] == 20  # (what the restart expected, what it loaded)
    texts = [t for _, t in health_summary(load_run(run_dir)).sentences]
    assert any(t.startswith("Restarted itself once after its process died (rank 0 was killed by SIGKILL), from "
                            "step_000020 (") for t in texts), texts
