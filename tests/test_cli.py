"""The CLI as a user runs it: a subprocess, exit codes, one-line errors, a real run directory."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

TESTS = Path(__file__).parent


def run(*args, cwd=None):
    env = {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "stabletrain", *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)


def test_train_writes_the_run_directory(tmp_path):
    run_dir = tmp_path / "run"
    res = run("train", "task=mlp", "train.max_steps=30", "log.every=10", "eval.every=15", "log.progress=false",
              f"run.dir={run_dir}")
    assert res.returncode == 0, res.stderr
    assert f"run directory: {run_dir}" in res.stdout
    for name in ("config.yaml", "snapshot.json", "metrics.jsonl", "events.jsonl"):
        assert (run_dir / name).exists(), name
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["train"]["max_steps"] == 30 and config["optim"]["lr"] == 1e-3  # defaults written out
    snap = json.loads((run_dir / "snapshot.json").read_text())
    assert snap["seed"] == 0 and snap["versions"]["torch"] and snap["device"]["type"] == "cpu"
    assert snap["data_fingerprint"].startswith("synthetic:")
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [10, 20, 30]
    assert "val_loss" in lines[2] and "val_loss" not in lines[0]
    # A second run into the same directory is refused instead of mixing two runs.
    again = run("train", "task=mlp", "train.max_steps=2", "log.progress=false", f"run.dir={run_dir}")
    assert again.returncode == 2 and "already holds a run" in again.stderr


def test_tensorboard_files_hold_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = tmp_path / "run"
    assert run("train", "task=mlp", "train.max_steps=20", "log.every=10", "log.progress=false", f"run.dir={run_dir}").returncode == 0
    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [10, 20]
    assert "train/grad_norm" in acc.Tags()["scalars"] and "val/val_loss" in acc.Tags()["scalars"]


@pytest.mark.parametrize("args, needle", [
    (["train", "optim.lrr=1"], "unknown config key 'optim.lrr'"),
    (["train", "task=mlp", "train.batch_size=zero"], "config key 'train.batch_size': expected an integer, got 'zero'"),
    (["train", "task=mlp", "precision=fp16"], "fp16 needs a CUDA device"),
    (["train", "task=nosuchmodule:make"], "cannot import module 'nosuchmodule'"),
    (["train", "task=mlp", "task_args.wdith=3"], "unknown config key 'task_args.wdith'"),
    (["train", "--config", "/nonexistent.yaml"], "config file '/nonexistent.yaml': cannot read it"),
    (["check", "nosuchcheck", "task=mlp"], "unknown check 'nosuchcheck'"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, needle, tmp_path):
    res = run(*args, "log.progress=false", f"run.dir={tmp_path / 'r'}") if args[0] == "train" else run(*args)
    assert res.returncode == 2, res.stderr
    assert needle in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "Traceback" not in res.stderr


def test_help_lists_every_key_with_default():
    res = run("train", "--help")
    assert res.returncode == 0
    for key in ("accum.steps", "clip.max_norm", "sched.warmup_steps", "run.dir", "default: gpt"):
        assert key in res.stdout
    assert run("--help").returncode == 0


def test_user_task_and_check_json():
    res = run("check", "overfit", "accum", "clip", "amp", "task=helpers:make_user_task", "task_args.width=12", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads(res.stdout)
    assert [r["name"] for r in results] == ["overfit", "accum", "clip", "amp"]
    assert all(r["passed"] for r in results)
    accum = results[1]["numbers"]
    assert accum["max_param_diff"] <= accum["tolerance"] < accum["naive_max_param_diff"]


def test_check_fails_with_exit_1_and_names_the_frozen_parameter():
    res = run("check", "overfit", "task=broken_tasks:frozen_layer_task")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "no gradient: 0.weight" in res.stdout and "FAIL" in res.stdout


def test_amp_check_flags_a_half_model():
    res = run("check", "amp", "task=broken_tasks:half_model_task", "--json")
    assert res.returncode == 1
    result = json.loads(res.stdout)[0]
    assert result["numbers"]["half_params"] > 0
    assert any("cast wholesale" in d for d in result["details"])
