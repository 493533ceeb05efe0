"""The doctor's resume and determinism checks pass on a sound task and name what breaks on a broken one."""

import json

import pytest
from multiproc import env

from stabletrain.checks.resume import DATA_COMPONENT

pytestmark = pytest.mark.slow  # the doctor, with its fresh-process resume


@pytest.fixture
def check(capfd, monkeypatch):
    """``stabletrain check ARGS --json`` in this process (``cli.main``): its exit code and its results by name. stdout is
    read at the file descriptor, so whatever else reached it (the inner run's lines, the probe's) breaks the JSON as it
    would for a user; the resume check's fresh process gets tests/ on its PYTHONPATH, as a child of the CLI would."""
    from stabletrain.cli import main

    monkeypatch.setenv("PYTHONPATH", env()["PYTHONPATH"])

    def call(*args):
        capfd.readouterr()
        code = main(["check", *args, "--json"])
        return code, {r["name"]: r for r in json.loads(capfd.readouterr().out)}
    return call


def test_resume_and_determinism_pass_bitwise_on_the_mlp_task_with_dropout(check):
    rc, results = check("resume", "determinism", "task=mlp", "task_args.dropout=0.3", "accum.steps=3")
    assert rc == 0
    assert results["resume"]["numbers"]["max_param_diff"] == 0.0 and results["resume"]["numbers"]["steps_compared"] == 3
    assert all(line.endswith("yes") for line in results["resume"]["details"][1:])
    assert results["determinism"]["passed"]


def test_resume_names_state_outside_the_checkpoint(check):
    rc, results = check("resume", "task=broken_tasks:hidden_counter_task")
    assert rc == 1
    r = results["resume"]
    assert "state outside the checkpoint" in r["numbers"]["diverged_component"]
    assert r["numbers"]["max_param_diff"] > 0
    assert any(line.endswith("NO") for line in r["details"])


def test_determinism_catches_unseeded_randomness(check):
    rc, results = check("determinism", "task=broken_tasks:unseeded_noise_task")  # SystemRandom noise in __getitem__
    assert rc == 1
    assert results["determinism"]["numbers"]["diverged_component"] == DATA_COMPONENT


def test_resume_names_unseeded_augmentation_in_the_dataset_as_the_data_not_the_optimizer(check):
    """A zero-init head makes the step-5 loss independent of the input: the first difference past the batch was the
    optimizer's state ('optimizer differs'), although the augmentation's inputs were the cause."""
    # (log.init_signal=false: the run's own step-0 report of the zero head prints a line on stdout, before the JSON)
    rc, results = check("resume", "task=models_init:augmented_task", "train.batch_size=8", "log.init_signal=false")
    assert rc == 1
    r = results["resume"]
    assert r["numbers"]["diverged_component"] == DATA_COMPONENT
    assert r["summary"].startswith("resumed run diverges at step 5: the data (the batches differ for the same indices")
    assert r["details"][-1].startswith("draw the dataset's randomness from the RNGs the run seeds and checkpoints")


def test_resume_check_gives_the_per_step_losses_as_numbers():
    from stabletrain import load_config
    from stabletrain.checks import CheckContext, run_checks

    (result,) = run_checks(CheckContext(load_config(None, ["task=mlp", "log.progress=false"])), ["resume"])
    losses = result.numbers["losses"]  # [[step, continuous, resumed, bitwise equal], ...]
    assert [row[0] for row in losses] == [5, 6, 7] and all(row[3] for row in losses)
    assert all(isinstance(row[1], float) and row[1] == row[2] for row in losses)
    assert len(result.details) == 1 + len(losses)  # the same rows, as printed


def test_resume_check_on_steps_that_are_all_non_finite_says_the_checkpoint_was_withheld(capsys):
    """A new user's fp16 task whose forward overflows on every step: the check's step-4 checkpoint was withheld (its
    steps were skipped), and the fresh process failed to load it ('meta.json is missing (the write did not finish?)'),
    after 7 lines of the inner run's incidents captured into a folder the check then deleted."""
    from stabletrain import load_config
    from stabletrain.checks import CheckContext, run_checks

    cfg = load_config(None, ["task=remedy_tasks:fp16_overflow_task", "precision=fp16", "log.progress=false"])
    (result,) = run_checks(CheckContext(cfg), ["resume"])
    assert not result.passed and result.summary.startswith(
        "no checkpoint at step 4 to resume from (checkpoint at step 4 withheld: its last 4 steps were skipped"), result.summary
    assert result.summary.endswith("the steps before it are not healthy; the nan and amp checks say why")
    assert "captured into" not in capsys.readouterr().out


def test_check_resume_json_is_json_on_a_model_whose_init_the_run_would_flag(check):
    """A new user's `stabletrain check resume task=mlp task_args.depth=12 --json`: the check's inner run printed its
    step-0 init line ('init at step 0: forward: vanishes at #5 ...', naming init_signal.json in the check's deleted
    folder) on stdout before the JSON, which then did not parse."""
    rc, results = check("resume", "task=mlp", "task_args.depth=12")  # (check() parses stdout as JSON)
    assert rc == 0 and results["resume"]["passed"]
