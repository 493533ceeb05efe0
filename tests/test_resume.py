"""Exact resumption: kill -9 at random steps, resume, and end bitwise equal to an uninterrupted run."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from stabletrain.checkpoint import CheckpointManager

TESTS = Path(__file__).parent
# 192 samples / 16 per micro-batch = 12 micro-batches per epoch; accum 5 -> windows of 5, 5, 2:
# 3 steps per epoch, so 15 steps cross four epoch boundaries, each with a short tail window.
ARGS = ["task=helpers:slow_mlp_task", "task_args.num_samples=192", "task_args.dropout=0.2", "task_args.sleep=0.01",
        "train.batch_size=16", "accum.steps=5", "train.max_steps=15", "log.every=1", "ckpt.every=2", "eval.every=5",
        "log.progress=false", "data.shuffle=true"]


def _env():
    return {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _start(run_dir, *extra, resume=False):
    cmd = [sys.executable, "-m", "stabletrain", "train", *ARGS, *extra]
    cmd += ["--resume", str(run_dir)] if resume else [f"run.dir={run_dir}"]
    return subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _steps_logged(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except json.JSONDecodeError:
        return 0


def _kill_at(proc, run_dir, step, sig=signal.SIGKILL, timeout=120):
    t0 = time.time()
    while _steps_logged(run_dir) < step and proc.poll() is None:
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


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_sigkill_at_random_steps_then_resume_is_bitwise_equal(tmp_path, precision):
    reference = tmp_path / "reference"
    proc = _start(reference, f"precision={precision}")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    expected = _final_state(reference)

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


def test_sigterm_finishes_the_step_checkpoints_and_exits_0_then_resumes_exactly(tmp_path):
    reference = tmp_path / "reference"
    proc = _start(reference)
    assert proc.wait(timeout=300) == 0
    expected = _final_state(reference)

    run_dir = tmp_path / "term"
    proc = _start(run_dir)
    rc, out, err = _kill_at(proc, run_dir, 5, sig=signal.SIGTERM)
    assert rc == 0, err
    assert f"Resume with: stabletrain train --resume {run_dir}" in out
    stopped_at = CheckpointManager(run_dir / "checkpoints").load().meta["step"]
    assert 5 <= stopped_at < 15  # checkpointed where it stopped, not at the last ckpt.every boundary
    proc = _start(run_dir, resume=True)
    assert proc.wait(timeout=300) == 0
    _assert_bitwise(_final_state(run_dir), expected)


def test_a_second_signal_exits_at_once_and_leaves_checkpoints_loadable(tmp_path):
    run_dir = tmp_path / "twice"
    proc = _start(run_dir, "task_args.sleep=0.05")
    t0 = time.time()
    while _steps_logged(run_dir) < 3 and time.time() - t0 < 120:
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)  # two signals back to back can coalesce into one; the second comes mid-step
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    loaded = CheckpointManager(run_dir / "checkpoints").load()
    assert loaded.meta["step"] >= 2 and not loaded.problems


def test_resume_refuses_a_changed_config_naming_each_key(tmp_path):
    run_dir = tmp_path / "run"
    proc = _start(run_dir, "train.max_steps=4")
    assert proc.wait(timeout=300) == 0
    res = subprocess.run([sys.executable, "-m", "stabletrain", "train", "--resume", str(run_dir), "optim.lr=0.5",
                          "accum.steps=2"], env=_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 2
    assert "optim.lr: checkpoint 0.001, now 0.5" in res.stderr and "accum.steps: checkpoint 5, now 2" in res.stderr
    ok = subprocess.run([sys.executable, "-m", "stabletrain", "train", "--resume", str(run_dir), "train.max_steps=6",
                         "log.every=2"], env=_env(), capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr


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
