"""Launchers: the wait before a restart (none after a healthy stretch or a launch that trained, growing while
attempts die in their start-up), and what a death record carries."""

from __future__ import annotations

import signal

from stabletrain.distributed.launch import QUICK_DEATH_S, quick_deaths, restart_backoff_s


def test_the_wait_before_a_restart_is_none_at_first_and_after_a_healthy_attempt_and_doubles_over_quick_deaths():
    quick, waits = 0, []
    lives = (0.5, 120.0, 3.0, 2.0, 0.5, 1.0, 1.0, 1.0, 1.0, QUICK_DEATH_S, 0.1)
    for attempt, lived in enumerate(lives):
        quick = quick_deaths(quick, lived, restarted=attempt > 0)
        waits.append(restart_backoff_s(quick))
    assert waits == [0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 0.0, 1.0]


def test_a_restarted_attempt_that_reached_training_is_no_quick_death_however_short(tmp_path):
    """The wait grows while restarts die in their start-up. A restart whose fit began (its launch line in the ledger,
    ready after it was started) and that was killed 4 s later (a preemption; each kill of the 3-kill tests) counted as
    one: the next restart waited 1 s, then 2, 4 ... while every launch trained."""
    import json

    from stabletrain.records.launches import LEDGER_FILE, noted_run_dir, reached_training

    assert quick_deaths(2, 4.0, restarted=True, trained=True) == 0 and quick_deaths(2, 4.0, restarted=True) == 3
    run = tmp_path / "run"
    run.mkdir()
    (run / LEDGER_FILE).write_text(json.dumps({"kind": "launch", "start": 100.0, "ready": 103.0, "step": 0}) + "\n"
                                   + json.dumps({"kind": "interval", "t": 104.0, "step": 1}) + "\n")
    assert reached_training(run, 99.5)  # the attempt started at 99.5 got to its fit at 103
    assert not reached_training(run, 103.5)  # one started later wrote no launch line: it died in its start-up
    assert not reached_training(None, 0.0) and not reached_training(tmp_path / "gone", 0.0)
    note = tmp_path / "note"
    note.write_text(f"{run}\n")  # what rank 0 wrote for the launcher (distributed.launch.note_run_dir)
    assert noted_run_dir(note) == run and noted_run_dir(tmp_path / "no-note") is None and noted_run_dir(None) is None
    note.write_text("")  # the note made before any rank named the directory
    assert noted_run_dir(note) is None


def test_a_deaths_last_line_is_the_childs_own_not_its_restart_announcement(tmp_path):
    """A child killed in its start-up printed only the line announcing its own restart: quoting it as 'its last line'
    nested every earlier restart's text into the next restart's line."""
    import os

    from stabletrain.distributed.launch import _Tee

    for output, last in ((b"step 3/10\nstabletrain: restart 2 of 3 after rank 0 (pid 1) was killed\n", ["step 3/10"]),
                         (b"stabletrain: restart 2 of 3 after rank 0 (pid 1) was killed; its last line: 'x'\n", []),
                         # nor its resume's (a trial: 'its last line: stabletrain: resumed from step 40 ...')
                         (b"step 3/10\nstabletrain: resumed from step 40 (checkpoint step_000040, world size 1)\n",
                          ["step 3/10"]),
                         (b"stabletrain: restart 1 of 3 ...\nTraceback (most recent call last)\nValueError: bad\n",
                          ["ValueError: bad"]),
                         # a message's continuation line is not its last word: the line it continues is
                         (b"stabletrain: stopped at step 9: stalled\n  (recorded in runs/x; see: stabletrain report)\n",
                          ["stabletrain: stopped at step 9: stalled"]),
                         # a long line is quoted from its start (where it names itself), cut at its end with a mark
                         (b"stabletrain: loss spike at step 83: " + b"x" * 400 + b"\n",
                          ["stabletrain: loss spike at step 83: " + "x" * 261 + "..."])):
        read, write = os.pipe()
        sink = open(os.devnull, "wb")
        lines: list[str] = []
        tee = _Tee(os.fdopen(read, "rb"), sink.fileno(), lines)
        tee.start()
        os.write(write, output)
        os.close(write)
        tee.join(timeout=10)
        sink.close()
        assert lines == last, output


def test_a_refusal_exits_with_its_own_code_unless_another_rank_crashed_too():
    """Ranks that refused (3: the same failure again; 2: bad input) and said why exit with that code, the others
    stopped by torchrun's SIGTERM; a rank that crashed beside them keeps torchrun's table of failures (None)."""
    from types import SimpleNamespace

    from stabletrain.distributed.elastic import told_exit

    def err(*codes):
        return SimpleNamespace(failures={rank: SimpleNamespace(exitcode=code) for rank, code in enumerate(codes)})

    assert told_exit(err(3, -signal.SIGTERM)) == 3
    assert told_exit(err(2, 2)) == 2
    assert told_exit(err(3, 2)) == 3
    assert told_exit(err(3, 1)) is None  # another rank's crash
    assert told_exit(err(1, -signal.SIGTERM)) is None
    assert told_exit(err(-signal.SIGKILL)) is None
    # a second Ctrl-C: the ranks said 'interrupted at step N' and exit 130 (a trial: torchrun's traceback, exit 1)
    assert told_exit(err(130, 130)) == 130 and told_exit(err(130, -signal.SIGINT)) == 130
    assert told_exit(err(130, 1)) is None
    assert told_exit(err(4)) == 4  # rank 0 applied no update (the others end 0): final, not restarted
    assert told_exit(err(5, 5)) == 5 and told_exit(err(5, -signal.SIGTERM)) == 5  # stalled (guard.on_stall=stop): final


def test_a_sigkilled_ranks_death_carries_what_its_peer_said():
    """A SIGKILLed rank leaves no error file; the rank that lost it says where the run was: the death record keeps
    that line, and the restart's line quotes it."""
    from types import SimpleNamespace

    from stabletrain.distributed.elastic import _peer_line
    from stabletrain.distributed.launch import death_record
    from stabletrain.services.restarts import _who

    lost = "PeerLostError: rank 1: another rank exited or became unreachable during a training step after step 57"
    failures = {0: SimpleNamespace(exitcode=-9, error_file_data={}),
                1: SimpleNamespace(exitcode=1, error_file_data={"message": {"message": lost}})}
    assert _peer_line(failures, 0) == lost and _peer_line({0: failures[0]}, 0) is None
    cause = death_record(-9, rank=0, pid=42, restart=1, max_restarts=3, by="torchrun", peer_line=_peer_line(failures, 0))
    assert _who(cause, 1) == f"rank 0 (pid 42) was killed by SIGKILL; then {lost!r}"
    other = {0: failures[0], 1: SimpleNamespace(exitcode=1, error_file_data={"message": "RuntimeError: boom"})}
    assert _peer_line(other, 0) == "rank 1: RuntimeError: boom"
    # PeerLostError's advice (resume by hand, or the restart to come) is left out: where and when the peer was lost stays
    advice = (f"{lost}; no checkpoint was written after step_000050 (LAST_GOOD); the launch restarts from LAST_GOOD (restart "
              "1 of 2, run.max_restarts), unless the same failure keeps coming back (run.max_repeats) (Connection closed)")
    told = {0: failures[0], 1: SimpleNamespace(exitcode=1, error_file_data={"message": {"message": advice}})}
    assert _peer_line(told, 0) == lost


def test_more_processes_than_cores_on_a_machine_without_a_gpu_is_warned_before_the_launch(monkeypatch, capsys, tmp_path):
    """A trial: dist.nproc=999 on a 2-core CPU machine started 999 processes without a word (each imports torch)."""
    import os

    from stabletrain.cli import main
    from stabletrain.distributed import launch as launcher

    started = []
    monkeypatch.setattr(launcher, "launch", lambda nproc, argv, **kw: started.append(nproc) or 0)  # (the warning's test)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert main(["train", "dist.nproc=3", f"run.dir={tmp_path / 'run'}"]) == 0 and started == [3]
    err = capsys.readouterr().err
    assert "stabletrain: warning: config key 'dist.nproc': 3 processes on a machine with 2 CPU core(s) and no GPU" in err
    assert main(["train", "dist.nproc=2", f"run.dir={tmp_path / 'run2'}"]) == 0 and "dist.nproc" not in capsys.readouterr().err


def test_restarts_used_up_on_a_signals_stop_say_resume_it_not_that_the_guard_stopped_it(tmp_path, capsys):
    """A preempted run (SIGTERM, then SIGKILL during its last checkpoint's wait) with its restarts used up: its last
    record is the signal's stop, which the line called 'the guard stopped it' and dropped 'continue the run' (a review)."""
    import json

    from stabletrain.distributed.launch import restarts_used_up

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "LAST_GOOD").write_text("step_000004\n")
    (run / "events.jsonl").write_text(json.dumps({"step": 5, "kind": "stop", "reason": "stopping: stopped by SIGTERM at "
                                                                                     "step 5"}) + "\n")
    note = tmp_path / "note"
    note.write_text(f"{run}\n")
    death = {"exitcode": -9, "max_restarts": 1, "pid": 42, "last_line": None}
    assert restarts_used_up(death, note, who="the run's process") == 137
    said = capsys.readouterr().err.strip()
    assert said.endswith(f"its stop is recorded in {run / 'events.jsonl'}; continue the run from step 4 (LAST_GOOD): "
                         f"stabletrain train --resume {run}") and "the guard" not in said, said
    (run / "events.jsonl").write_text(json.dumps({"step": 5, "kind": "stop", "reason": "stopping: non-finite value in the "
                                                                                     "loss at step 5"}) + "\n")
    restarts_used_up(death, note, who="the run's process")
    said = capsys.readouterr().err.strip()
    assert said.endswith(f"the guard stopped it (non-finite value in the loss at step 5), recorded in {run / 'events.jsonl'}: "
                         "read why before resuming it as it is (it may stop there again)"), said
    # The task's own sys.exit(0) (a stop event marked task_exit) is no guard's stop either: resume it
    (run / "events.jsonl").write_text(json.dumps({"step": 5, "kind": "stop", "task_exit": True, "reason": "stopping: the "
                                                 "task's code called sys.exit(0) at f.py:3"}) + "\n")
    restarts_used_up(death, note, who="the run's process")
    said = capsys.readouterr().err.strip()
    assert "the guard" not in said and f"stabletrain train --resume {run}" in said, said
