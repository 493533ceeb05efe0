"""Exit codes stabletrain reserves (2, 3, 4, 5: it refused its input, refused to restart, applied no update, met its
guard's stop) end a run's restarts only where stabletrain itself decided them: the same code from the task's own
``sys.exit`` or ``os._exit`` is a crash, restarted; and a resubmission after a crash loop that wrote no checkpoint is
refused up front."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from types import SimpleNamespace

import pytest
from multiproc import env, events, train_cli

from stabletrain.distributed.elastic import told_exit
from stabletrain.errors import clean_exit
from stabletrain.records.launches import final_exit, final_note, note_final
from stabletrain.services.launch_failures import last_failure

ARGS = ("train.batch_size=8", "data.shuffle=false", "train.max_steps=12", "ckpt.every=2", "log.every=2", "eval.every=0")


def test_only_an_exit_the_process_wrote_down_as_its_own_decision_is_final(tmp_path):
    """A reserved code counts as stabletrain's decision only where the process that exited with it noted its pid and
    code beside its launcher's note; torchrun's failures read it the same way (``told_exit``'s ``decided``)."""
    note = tmp_path / "note"
    note.write_text("")
    assert final_exit(note, 42, 0)  # a finished run: always final
    assert not final_exit(note, 42, 3) and not final_exit(None, 42, 3)  # nothing noted: the task's own exit
    note_final(str(note), 3)
    import os

    assert final_exit(note, os.getpid(), 3) and not final_exit(note, os.getpid(), 2) and not final_exit(note, 42, 3)
    assert final_note(note).read_text() == f"{os.getpid()} 3\n"
    note_final(None, 3)  # no launcher: nothing written, no error

    def err(*codes):
        return SimpleNamespace(failures={rank: SimpleNamespace(exitcode=code, pid=rank) for rank, code in enumerate(codes)})

    assert told_exit(err(3, -signal.SIGTERM), lambda f: True) == 3
    assert told_exit(err(3, -signal.SIGTERM), lambda f: False) is None  # a task's exit(3): a crash, torchrun's to tell
    assert told_exit(err(2, 2), lambda f: f.pid == 0) is None  # one rank's 2 was its task's own


@pytest.mark.parametrize("code,hard", [(3, False), (2, True)])
def test_a_tasks_own_exit_with_a_reserved_code_is_restarted_like_any_crash(tmp_path, code, hard):
    """A new user's trial: a task that exited with code 3 (or 2, 4, 5) at run.max_restarts=2 was never restarted and
    nothing was said: the supervisor took it for stabletrain's own refusal. It is a crash: restarted, with one line that
    names the exit and quotes the task's last line, and a restart event."""
    run_dir = tmp_path / "run"
    res = train_cli("task=restart_tasks:exit_code_task", f"task_args.code={code}", f"task_args.hard={hard}",
                    f"task_args.marker={tmp_path / 'exited'}", *ARGS, "run.max_restarts=2", f"run.dir={run_dir}")
    assert res.returncode == 0, res.stderr[-3000:]
    restarts = [e for e in events(run_dir) if e["kind"] == "restart"]
    assert len(restarts) == 1 and restarts[0]["cause"]["exitcode"] == code, restarts
    last = f"TASK: exiting with code {code}" if hard else f"SystemExit: {code}"  # (sys.exit: its line names where)
    assert restarts[0]["cause"]["last_line"] == last
    said = [line for line in res.stdout.splitlines() if line.startswith("stabletrain: restart 1 of 2")]
    assert len(said) == 1 and f"exited with code {code}; its last line: '{last}'" in said[0], said
    if not hard:
        assert "the task's dataset item raised SystemExit at " in res.stdout + res.stderr
    if hard:  # (os._exit: its last record is its checkpoint's step; it said 'nothing recorded to train again (any steps
        # it trained past step 4 ... are trained again)', where it had trained one)
        assert said[0].endswith("resuming from step_000004: its last record is at step 4: any steps it trained past it are "
                                "trained again (how many is not recorded)"), said


def test_a_ranks_own_exit_with_a_reserved_code_under_ddp_is_restarted_with_no_torchrun_traceback(tmp_path):
    """The trial under DDP: rank 1's os._exit(3) ended the run with torchrun's ChildFailedError traceback, exit 1, and
    rank 0's line claimed a restart that never came. torchrun's agent restarts it, as it restarts any crash."""
    run_dir = tmp_path / "run"
    res = train_cli("task=restart_tasks:exit_code_task", "task_args.code=3", "task_args.hard=true", "task_args.rank=1",
                    f"task_args.marker={tmp_path / 'exited'}", *ARGS, "run.max_restarts=2", "dist.nproc=2",
                    f"run.dir={run_dir}")
    assert res.returncode == 0 and "ChildFailedError" not in res.stderr, res.stderr[-3000:]
    restarts = [e for e in events(run_dir) if e["kind"] == "restart"]
    assert len(restarts) == 1 and (restarts[0]["cause"]["rank"], restarts[0]["cause"]["exitcode"]) == (1, 3), restarts
    # its last line, as one process's is quoted (it was null: torchrun's agent reads no rank's output)
    assert restarts[0]["cause"]["last_line"] == "TASK: exiting with code 3", restarts[0]["cause"]
    said = [line for line in res.stdout.splitlines() if line.startswith("stabletrain: restart 1 of 2 after rank 1")]
    assert len(said) == 1 and "exited with code 3; its last line: 'TASK: exiting with code 3'" in said[0], res.stdout[-3000:]


def test_a_rank_keeps_its_last_line_beside_its_launchers_note_for_its_agent(tmp_path, monkeypatch):
    """What a rank prints passes through unchanged; its last finished line (not a continuation, not its restart's
    announcement, what a progress bar's last \\r drew) is kept beside its launcher's note, by its pid; only in a rank of
    stabletrain's torchrun launcher."""
    import io
    import os
    import sys

    from stabletrain.distributed.elastic import _last_line
    from stabletrain.distributed.last_line import keep_last_line, last_line_file, printed_last
    from stabletrain.distributed.launch import RUN_DIR_NOTE_ENV
    from stabletrain.records.launches import drop_notes

    note = tmp_path / "note"
    note.write_text("")
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.delenv(RUN_DIR_NOTE_ENV, raising=False)
    keep_last_line()
    assert sys.stdout is out  # a torchrun of the user's own: nothing kept, nothing wrapped
    monkeypatch.setenv(RUN_DIR_NOTE_ENV, str(note))
    keep_last_line()
    me = os.getpid()
    print("step 10/20", end="")
    assert printed_last(note, me) is None  # (not finished yet)
    print("\rstep 20/20")
    assert printed_last(note, me) == "step 20/20"
    print("stabletrain: error: bad\n  (recorded in runs/x)", file=sys.stderr)
    print("stabletrain: restart 1 of 2 after rank 1 ...")
    assert printed_last(note, me) == "stabletrain: error: bad"
    print("TASK: exiting", flush=True)
    assert last_line_file(note, me).read_text() == "TASK: exiting"
    assert out.getvalue() == "step 10/20\rstep 20/20\nstabletrain: restart 1 of 2 after rank 1 ...\nTASK: exiting\n"
    assert err.getvalue() == "stabletrain: error: bad\n  (recorded in runs/x)\n"

    # the agent: an exit with a code quotes it, an error file's message first; a signal's death none
    def failure(code, data=None):
        return SimpleNamespace(exitcode=code, pid=me, error_file_data=data or {})

    assert _last_line(failure(3)) == "TASK: exiting" and _last_line(failure(-9)) is None
    assert _last_line(failure(1, {"message": "RuntimeError: boom"})) == "RuntimeError: boom"
    drop_notes(note)  # the launch's end removes it with the note
    assert not list(tmp_path.iterdir())


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


def test_a_tasks_own_sys_exit_without_restarts_says_where_and_keeps_its_code(tmp_path):
    """A library's ``sys.exit(3)`` in the task's dataset at run.max_restarts=0 ended the run with exit code 3 and not a word
    of stabletrain's (code 3 reads as a refused restart in docs/restarts.md): one line names the task's part, its file:line
    and the step, a ``crash`` event records it, and the process keeps the task's own exit code."""
    run_dir = tmp_path / "run"
    res = train_cli("task=restart_tasks:exit_code_task", "task_args.code=3", f"task_args.marker={tmp_path / 'exited'}",
                    *ARGS, f"run.dir={run_dir}")
    assert res.returncode == 3, res.stderr[-3000:]
    assert re.search(r"error: the task's dataset item raised SystemExit at \S*restart_tasks\.py:\d+ in __getitem__, in step "
                     r"\d+", res.stderr), res.stderr[-3000:]
    crash = [e for e in events(run_dir) if e["kind"] == "crash"]
    assert len(crash) == 1 and crash[0]["error"] == "SystemExit" and crash[0]["part"] == "dataset item", crash


def test_a_tasks_own_sys_exit_0_is_a_stop_and_one_in_a_data_worker_says_the_workers_code(tmp_path):
    """A review: sys.exit(0) in the task's dataset read 'error: ... raised SystemExit' beside exit 0 and a crash event; it
    is a stop the task asked for (a stop event, a plain line, exit 0). With data.workers=2 a sys.exit(3) in the dataset
    was blamed on a signal (or, raced, a FileNotFoundError of the worker's shared memory read as refused input, exit 2)."""
    run_dir = tmp_path / "run"
    res = train_cli("task=restart_tasks:exit_code_task", "task_args.code=0", f"task_args.marker={tmp_path / 'exited'}",
                    *ARGS, f"run.dir={run_dir}")
    assert res.returncode == 0 and "error:" not in res.stderr, res.stderr[-3000:]
    assert re.search(r"stabletrain: the task's dataset item ended the process \(sys.exit\(0\)\) at \S*restart_tasks\.py:\d+ "
                     r"in __getitem__, in step \d+: the run stopped there, unfinished", res.stderr), res.stderr[-3000:]
    (stop,) = [e for e in events(run_dir) if e["kind"] in ("crash", "stop")]
    assert stop["kind"] == "stop" and stop["task_exit"] and re.match(
        r"stopping: the task's code called sys.exit\(0\) at \S*restart_tasks\.py:\d+ in __getitem__$", stop["reason"]), stop
    # (a review) what a restart or a requeue reads of it: a stop the task asked for, no failure to meet again, no incident
    failure = last_failure(events(run_dir))
    assert (failure.kind, failure.key) == ("stop", None) and "incident" not in failure.text, failure
    # Python's own rule for what exits 0: None, 0, False; not "" nor 0.0 (they exit 1, as errors)
    assert [clean_exit(SystemExit(*c)) for c in ((), (0,), (False,), ("",), (0.0,), (3,), ("bye",))] == [
        True, True, True, False, False, False, False]
    # sys.exit() is said as the code wrote it, on the console and in the stop event (a review: 'sys.exit(None)' in the
    # event, 'sys.exit(0)' on the console); sys.exit("bye") once, exit 1
    res = train_cli("task=restart_tasks:exit_call_task", "task_args.bare=true", f"task_args.marker={tmp_path / 'bare'}",
                    *ARGS, f"run.dir={tmp_path / 'bare_run'}")
    assert res.returncode == 0 and "ended the process (sys.exit()) at " in res.stderr, res.stderr[-3000:]
    (stop,) = [e for e in events(tmp_path / "bare_run") if e["kind"] in ("crash", "stop")]
    assert stop["reason"].startswith("stopping: the task's code called sys.exit() at "), stop
    res = train_cli("task=restart_tasks:exit_call_task", "task_args.message=bye", f"task_args.marker={tmp_path / 'said'}",
                    *ARGS, f"run.dir={tmp_path / 'said_run'}")
    assert res.returncode == 1 and res.stderr.count("bye") == 1 and "SystemExit: bye" in res.stderr, res.stderr[-3000:]
    # Another command the task's exit cuts short has no result: not a pass (exit 1), and no word of training
    res = subprocess.run([sys.executable, "-m", "stabletrain", "check", "overfit", "task=restart_tasks:exit_call_task",
                          "task_args.bare=true", "task_args.index=0", f"task_args.marker={tmp_path / 'check'}",
                          f"--out={tmp_path / 'check_out'}"], env=env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 1 and "stabletrain check did not finish (no result)" in res.stderr, res.stderr[-3000:]
    assert "training" not in res.stderr.splitlines()[-1], res.stderr[-3000:]
    res = train_cli("task=restart_tasks:exit_code_task", "task_args.code=3", f"task_args.marker={tmp_path / 'exited3'}",
                    "data.workers=2", *ARGS, f"run.dir={tmp_path / 'workers'}")
    said = [x for x in res.stderr.splitlines() if x.startswith("stabletrain: error: ")]
    assert res.returncode == 1 and len(said) == 1, res.stderr[-3000:]
    assert said[0].startswith("stabletrain: error: a data loader worker process (data.workers) died: ") and (
        "exited unexpectedly with exit code 3. An exit with code 3 is the worker's own (a sys.exit" in said[0]
        or "an exit of its own (a sys.exit or os._exit in the dataset's code)" in said[0]), said
