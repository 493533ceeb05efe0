"""Exit codes stabletrain reserves (2, 3, 4, 5: it refused its input, refused to restart, applied no update, met its
guard's stop) end a run's restarts only where stabletrain itself decided them; and a resubmission after a crash loop that
wrote no checkpoint is refused up front."""

from __future__ import annotations

from multiproc import events, train_cli

ARGS = ("train.batch_size=8", "data.shuffle=false", "train.max_steps=12", "ckpt.every=2", "log.every=2", "eval.every=0")


def test_a_resubmission_after_a_crash_loop_that_wrote_no_checkpoint_is_refused_up_front(tmp_path):
    """A trial: a task that died in its factory on every launch stopped after 3 launches (exit 3, one line); the same
    command under run.resume=auto said 'holds no checkpoint: starting it', died a 4th time, then refused. With a
    checkpoint it is refused at its start: without one too."""
    run_dir, counter = tmp_path / "run", tmp_path / "calls"
    args = ("task=restart_tasks:factory_death_task", f"task_args.counter={counter}", *ARGS, "run.max_restarts=5",
            f"run.dir={run_dir}")
    first = train_cli(*args)
    assert first.returncode == 3 and len(counter.read_text().splitlines()) == 3, first.stderr[-3000:]
    again = train_cli(*args, "run.resume=auto")
    assert again.returncode == 3, again.stderr[-3000:]
    assert len(counter.read_text().splitlines()) == 3  # the task was not built again
    assert "starting it" not in again.stdout and "restart" not in again.stdout, again.stdout
    refused = [line for line in again.stderr.splitlines() if "not continuing" in line]
    assert len(refused) == 1 and refused[0].startswith(
        f"stabletrain: error: run.resume=auto: not continuing {run_dir}: the same failure ended 3 launches in a row") and (
        refused[0].endswith("start it again without run.resume=auto (it holds no checkpoint to continue)")), again.stderr
    assert [e["reason"].split(":")[0] for e in events(run_dir) if e["kind"] == "stop"] == [
        "restart refused", "resubmission refused"]
