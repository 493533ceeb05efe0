"""Exact resumption: kill -9 at random steps, resume, and end bitwise equal to an uninterrupted run."""

import json
import math
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from multiproc import env, steps_logged

from stabletrain.records.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.slow  # subprocess runs killed and resumed

# 192 samples / 16 per micro-batch = 12 micro-batches per epoch; accum 5 -> windows of 5, 5, 2:
# 3 steps per epoch, so 15 steps cross four epoch boundaries, each with a short tail window.
ARGS = ["task=helpers:slow_mlp_task", "task_args.num_samples=192", "task_args.dropout=0.2", "task_args.sleep=0.01",
        "train.batch_size=16", "accum.steps=5", "train.max_steps=15", "log.every=1", "ckpt.every=2", "eval.every=5",
        "log.progress=false", "data.shuffle=true"]


def _env(**extra):
    return {**env(), **extra}


def _start(run_dir, *extra, resume=False, env=None):
    cmd = [sys.executable, "-m", "stabletrain", "train", *ARGS, *extra]
    cmd += ["--resume", str(run_dir)] if resume else [f"run.dir={run_dir}"]
    return subprocess.Popen(cmd, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill_at(proc, run_dir, step, sig=signal.SIGKILL, timeout=120):
    t0 = time.time()
    while steps_logged(run_dir) < step and proc.poll() is None:
        if time.time() - t0 > timeout:
            raise TimeoutError(f"training never reached step {step}")
        time.sleep(0.005)
    if proc.poll() is None:
        proc.send_signal(sig)
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _final_state(run_dir):
    loaded = CheckpointManager(run_dir / "checkpoints").load()
    assert loaded.meta["step"] == 15, loaded.path
    return loaded.state


def _assert_bitwise(a, b):
    for key in ("model",):
        for name in a[key]:
            assert torch.equal(a[key][name], b[key][name]), f"{key}.{name} differs"
    for pid, s in a["optimizer"]["state"].items():
        for k, v in s.items():
            assert torch.equal(v, b["optimizer"]["state"][pid][k]), f"optimizer.state.{pid}.{k} differs"
    assert a["stream"] == b["stream"] and a["counters"] == b["counters"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted runs' final states, by precision, each trained once for this file's tests (on CPU the default
    precision, auto, is fp32: the SIGTERM test's reference too), in this process: the killed runs' fresh processes
    must end bitwise equal to it."""
    from stabletrain import Trainer, load_config

    made = {}

    def get(precision):
        if precision not in made:
            reference = tmp_path_factory.mktemp(f"reference-{precision}")
            Trainer(load_config(None, [*ARGS, f"precision={precision}"]), run_dir=reference).fit()
            made[precision] = _final_state(reference)
        return made[precision]

    return get


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sigkill_at_random_steps_then_resume_is_bitwise_equal(tmp_path, precision, references):
    expected = references(precision)

    run_dir = tmp_path / "killed"
    rng = random.Random(f"kill-{precision}")
    kills = sorted(rng.sample(range(2, 14), 2))
    proc = _start(run_dir, f"precision={precision}")
    rc, _, _ = _kill_at(proc, run_dir, kills[0])
    assert rc == -signal.SIGKILL
    proc = _start(run_dir, f"precision={precision}", resume=True)
    rc, _, _ = _kill_at(proc, run_dir, kills[1])
    proc = _start(run_dir, f"precision={precision}", resume=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    _assert_bitwise(_final_state(run_dir), expected)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    assert sum(e["kind"] == "resume" for e in events) == 2
    # Each step once in metrics.jsonl and TensorBoard, though the steps after each checkpoint were trained twice.
    steps = [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert steps == list(range(1, 16))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == list(range(1, 16))


def test_sigterm_finishes_the_step_checkpoints_and_exits_0_then_resumes_exactly(tmp_path, references):
    expected = references("fp32")  # (the default precision, auto, on CPU)

    run_dir = tmp_path / "term"
    # SIGTERM sent by the run itself right after step 5 (a test callback): no race with a sleeping poller.
    proc = _start(run_dir, "callbacks=[helpers:SignalAtStep]", env=_env(STABLETRAIN_TEST_SIGNAL="5:1"))
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    assert f"Resume with: stabletrain train --resume {run_dir}" in out
    assert CheckpointManager(run_dir / "checkpoints").load().meta["step"] == 5  # where it stopped, not at ckpt.every
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    assert [(e["step"], e["kind"]) for e in events if e["kind"] == "stop"] == [(5, "stop")]
    assert "SIGTERM" in next(e for e in events if e["kind"] == "stop")["reason"]
    proc = _start(run_dir, resume=True)
    assert proc.wait(timeout=300) == 0
    _assert_bitwise(_final_state(run_dir), expected)


def test_a_second_signal_exits_at_once_and_leaves_checkpoints_loadable(tmp_path):
    run_dir = tmp_path / "twice"
    # Two SIGTERMs right after step 3, before the step-3 boundary is reached: the second interrupts at once.
    proc = _start(run_dir, "callbacks=[helpers:SignalAtStep]", env=_env(STABLETRAIN_TEST_SIGNAL="3:2"))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    loaded = CheckpointManager(run_dir / "checkpoints").load()
    assert loaded.meta["step"] == 2 and not loaded.problems  # ckpt.every=2: the last one before the signals


def test_resume_refuses_a_changed_config_naming_each_key(tmp_path, capsys):
    from stabletrain.cli import main

    run_dir = tmp_path / "run"
    proc = _start(run_dir, "train.max_steps=4")
    assert proc.wait(timeout=300) == 0
    capsys.readouterr()  # (the resumes in this process: what the command says is what a new one would)
    assert main(["train", "--resume", str(run_dir), "optim.lr=0.5", "accum.steps=2"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr: checkpoint 0.001, now 0.5" in err and "accum.steps: checkpoint 5, now 2" in err
    assert main(["train", "--resume", str(run_dir), "train.max_steps=6", "log.every=2"]) == 0
    # A longer run reshapes the cosine schedule: never silently.
    assert "stabletrain: warning: train.max_steps changed from 4 to 6 on resume" in capsys.readouterr().err  # (stderr)
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    changed = [e for e in events if e["kind"] == "schedule_changed"]
    assert len(changed) == 1 and changed[0]["step"] == 4 and "the LR at step 4 is" in changed[0]["reason"]


def test_a_corrupted_newest_checkpoint_is_reported_and_the_previous_one_used(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "train.max_steps=6")
    assert proc.wait(timeout=300) == 0
    newest = run_dir / "checkpoints" / "step_000006" / "state.pt"
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0xFF
    newest.write_bytes(bytes(data))
    proc = _start(run_dir, "train.max_steps=8", resume=True)
    assert proc.wait(timeout=300) == 0
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    skipped = [e for e in events if e["kind"] == "checkpoint_skipped"]
    assert skipped and "step_000006" in skipped[0]["reason"]
    resume = [e for e in events if e["kind"] == "resume"][0]
    assert resume["step"] == 4 and resume["path"].endswith("step_000004")


@pytest.mark.parametrize("every, then", [(10, 7), (7, 10)])
def test_resume_with_another_log_every_continues_and_trains_as_the_uninterrupted_run(tmp_path, every, then):
    """log.* is resume-safe: the metrics state round-trips into an interval of another length."""
    from helpers import cfg

    from stabletrain import Trainer

    def trainer(run_dir, steps, log_every, resume=False):
        torch.manual_seed(0)
        c = cfg(f"log.every={log_every}", f"ckpt.every={2 * every}", f"train.max_steps={steps}", "train.batch_size=8")
        return Trainer(c, run_dir=run_dir, resume=resume)

    first = trainer(tmp_path / "run", 2 * every, every)
    first.fit()
    resumed = trainer(tmp_path / "run", 2 * every + 12, then, resume=True)
    assert resumed.step == 2 * every
    resumed.fit()
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    after = [m["step"] for m in lines if m["step"] > 2 * every]
    assert after == [s for s in range(2 * every + 1, 2 * every + 13) if s % then == 0 or s == 2 * every + 12]
    assert all(math.isfinite(m["loss"]) for m in lines)
    straight = trainer(tmp_path / "straight", 2 * every + 12, every)
    straight.fit()
    for (name, a), b in zip(resumed.module.state_dict().items(), straight.module.state_dict().values()):
        assert torch.equal(a, b), name


def test_a_new_horizon_on_resume_gives_both_lrs_or_says_they_are_the_same():
    from helpers import cfg

    from stabletrain.services.checkpoints import schedule_change_note

    c = cfg("train.max_steps=600", "sched.warmup_steps=20", "sched.decay=cosine", "optim.lr=1e-3")
    assert schedule_change_note(c, 300, 0).endswith("the LR at step 0 is 5e-05 on both horizons")  # (warm-up's start)
    assert schedule_change_note(c, 300, 200).endswith("the LR at step 200 is 0.000803 (it was 0.000355 on the old horizon)")


def test_the_new_horizons_lrs_are_those_of_the_tasks_own_optimizer_not_optim_lr(tmp_path):
    """A task's optimizer sets the peak LR the schedule scales (here 1e-2, while optim.lr says 1e-3)."""
    from helpers import cfg, regression_task

    from stabletrain import Trainer

    def trainer(steps, resume=False):
        task = regression_task()
        task.optimizer = lambda named: torch.optim.SGD([p for _, p in named], lr=1e-2, fused=True)
        c = cfg(f"train.max_steps={steps}", "sched.warmup_steps=2", "sched.decay=cosine", "optim.lr=1e-3", "log.every=4",
                "ckpt.every=4")
        return Trainer(c, task=task, run_dir=tmp_path / "run", resume=resume)

    trainer(8).fit()
    resumed = trainer(16, resume=True)
    assert resumed.keeper.schedule_change.endswith(f"the LR at step 8 is {resumed.schedule.lr():.3g} (it was 0.001 on the "
                                                   "old horizon)")  # (8 of 8 steps: the cosine's floor, 0.1 x 1e-2)


@pytest.mark.parametrize("swap, said", [
    (lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.0), "group 0: momentum 0.9 -> 0.0"),  # (was put back in silence)
    (lambda ps: torch.optim.Adam(ps, lr=0.01), "its Adam's settings differ from the checkpoint's optimizer (group 0: "),
])
def test_resume_refuses_a_task_optimizer_that_is_not_the_one_the_run_trained_with(tmp_path, swap, said):
    """A task's own optimizer has no config key: a resume with another one was trained with the checkpoint's settings in
    silence (SGD momentum 0 ran at 0.9), or failed inside torch (KeyError 'step'). Now one line names what differs."""
    from helpers import cfg, regression_task

    from stabletrain import Trainer

    def task(make):
        t = regression_task()
        t.optimizer = lambda named: make([p for _, p in named])
        return t

    c = cfg("train.max_steps=4", "log.every=2", "train.batch_size=8")
    Trainer(c, task=task(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)), run_dir=tmp_path / "run").fit()
    with pytest.raises(ValueError, match="the task's optimizer is not the one the run trained with") as refused:
        Trainer(cfg("train.max_steps=6", "log.every=2", "train.batch_size=8"), task=task(swap), run_dir=tmp_path / "run",
                resume=True)
    assert said in str(refused.value), str(refused.value)
    same = Trainer(cfg("train.max_steps=6", "log.every=2", "train.batch_size=8"),
                   task=task(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)), run_dir=tmp_path / "run", resume=True)
    assert same.fit() and same.step == 6  # the same optimizer resumes


def test_precision_auto_and_the_mode_it_resolves_to_are_one_precision_on_resume(tmp_path):
    """A new-user trial: a CPU run with precision=auto (fp32 there) resumed with precision=fp32 was refused
    ('precision: checkpoint "auto", now "fp32"'). Another precision still is."""
    from helpers import cfg

    from stabletrain import Trainer

    run = ("train.max_steps=4", "ckpt.every=2", "log.every=2", "eval.every=0")
    Trainer(cfg(*run, "precision=auto"), run_dir=tmp_path / "run").fit()
    resumed = Trainer(cfg("train.max_steps=6", *run[1:], "precision=fp32"), run_dir=tmp_path / "run", resume=True)
    resumed.fit()
    assert resumed.step == 6
    with pytest.raises(ValueError, match='precision: checkpoint "fp32", now "bf16"'):  # (the resumed run's own save)
        Trainer(cfg("train.max_steps=8", *run[1:], "precision=bf16"), run_dir=tmp_path / "run", resume=True)


def test_a_deleted_newest_checkpoint_is_said_with_the_steps_trained_again(tmp_path, capsys):
    """A trial: with the newest checkpoint's directory deleted (LAST_GOOD naming it), the resume said only that LAST_GOOD
    names a missing directory; a corrupted one's resume says how many steps will be trained again, and so does this."""
    import shutil

    from helpers import cfg, regression_task

    from stabletrain import Trainer

    run_dir = tmp_path / "run"
    c = ("train.batch_size=8", "log.every=2", "ckpt.every=2", "log.tensorboard=false")
    Trainer(cfg(*c, "train.max_steps=6"), task=regression_task(), run_dir=run_dir).fit()
    shutil.rmtree(run_dir / "checkpoints" / "step_000006")
    capsys.readouterr()
    Trainer(cfg(*c, "train.max_steps=8"), task=regression_task(), run_dir=run_dir, resume=True).fit()
    out = capsys.readouterr()
    assert "LAST_GOOD: names step_000006, which does not exist" in out.err
    assert (f"resumed from step 4 (checkpoint {run_dir / 'checkpoints' / 'step_000004'}, world size 1); the newest "
            "checkpoint (step 6) was skipped: 2 step(s) will be trained again") in out.out


def test_a_sigterm_after_the_loop_let_go_of_its_handler_does_not_end_the_process_before_its_last_line(tmp_path):
    """CI: rank 0 of a torchrun whose rank 1 was SIGKILLed died by torchrun's SIGTERM (exit -15) before its 'another
    rank exited' line: the signal came after the loop had put back the default handler, during its teardown. Here the
    SIGTERM comes at on_fit_end (after the loop's handler is gone): the run still ends with its line, then by the
    SIGTERM it was sent (held until then)."""
    res = subprocess.run([sys.executable, "-m", "stabletrain", "train", *ARGS, "train.max_steps=3",
                          "callbacks=[ckpt_worker:SigtermAtFitEnd]", f"run.dir={tmp_path / 'run'}"], env=_env(),
                         capture_output=True, text=True, timeout=180)
    assert res.returncode == -signal.SIGTERM, (res.returncode, res.stderr[-2000:])
    assert "stabletrain: trained 3 steps" in res.stdout, res.stdout[-2000:]


def test_a_resume_on_another_number_of_cpu_threads_says_it_is_not_bitwise(tmp_path, capfd):
    """A trial: OMP_NUM_THREADS=2 on the resume of a run trained on 1 thread ended 2.8e-4 off the uninterrupted run with
    no word, while snapshot.json recorded both counts. The resume says so, with the count to launch with; the same count
    says nothing."""
    from helpers import cfg

    from stabletrain import Trainer

    threads = torch.get_num_threads()
    Trainer(cfg("train.max_steps=2", "eval.every=0"), run_dir=tmp_path / "run").fit()
    for now, said in ((threads, False), (threads + 1, True)):
        capfd.readouterr()
        torch.set_num_threads(now)
        try:
            Trainer(cfg(f"train.max_steps={4 if said else 3}", "eval.every=0"), run_dir=tmp_path / "run", resume=True).fit()
        finally:
            torch.set_num_threads(threads)
        lines = [x for x in capfd.readouterr().err.splitlines() if "CPU threads" in x]
        assert lines == ([f"stabletrain: warning: torch's CPU threads: {now} in this launch, {threads} in the one before "
                          "(OMP_NUM_THREADS, torch.set_num_threads): CPU kernels split their sums by thread, so the resumed "
                          f"steps are not bitwise the uninterrupted run's (launch with OMP_NUM_THREADS={threads} to continue "
                          "it bitwise)"] if said else []), lines
    # A resume onto another world size is not bitwise already, and says so itself: no thread count to launch with (a
    # trial's FSDP run of 2 ranks resumed on 1 was told both)
    from stabletrain.records.provenance import threads_changed

    snapshot = json.loads((tmp_path / "run" / "snapshot.json").read_text())
    snapshot["resumes"][-1]["world_size"] = 2
    (tmp_path / "run" / "snapshot.json").write_text(json.dumps(snapshot))
    assert threads != snapshot["resumes"][-1]["device"]["num_threads"]  # (the last launch's: threads + 1)
    assert threads_changed(tmp_path / "run", torch.device("cpu"), 1) is None
    assert threads_changed(tmp_path / "run", torch.device("cpu"), 2) is not None
