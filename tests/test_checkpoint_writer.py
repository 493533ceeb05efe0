"""Background saves: the writer process, its shared-memory staging, its failures and its lifetime."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from ckpt_worker import WriterReady
from multiproc import env, wait_for_step
from multiproc import stabletrain as stabletrain_cmd
from test_checkpoint import MLP, assert_same, dirs, tiny_state

import stabletrain
from stabletrain.records.checkpoint.arena import SharedStager, Slot, fill_slots
from stabletrain.records.checkpoint.files import CheckpointError
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.records.checkpoint.writer import WRITER_MODULE, WRITER_NICENESS, close_writer, running_writer

WRITER_SITE = Path(__file__).parent / "writer_site"  # its sitecustomize plants STABLETRAIN_TEST_WRITER_FAULT


@pytest.fixture
def writer_fault(monkeypatch):
    """``plant("KIND:ARG")``: the next save starts a writer with that fault (tests/writer_site/sitecustomize.py)."""

    def plant(fault: str) -> None:
        close_writer()
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(WRITER_SITE), os.environ.get("PYTHONPATH")) if p))
        monkeypatch.setenv("STABLETRAIN_TEST_WRITER_FAULT", fault)

    yield plant
    close_writer()  # the next test's saves start a writer without it


def writers_of(parent: int) -> list[int]:
    """The pids of the live writer processes whose parent was ``parent`` (read from their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if WRITER_MODULE.encode() in argv and argv[argv.index(WRITER_MODULE.encode()) + 2] == str(parent).encode() \
                and state != "Z":
            found.append(int(entry.name))
    return found


def wait_until(predicate, timeout: float = 60.0) -> bool:
    deadline = time.time() + timeout
    while not predicate():
        if time.time() > deadline:
            return False
        time.sleep(0.01)
    return True


# -- shared-memory staging -----------------------------------------------------------------------------


def test_staging_fills_one_shared_block_reused_while_the_layout_fits():
    stager = SharedStager()
    state = {"model": {"w": torch.ones(3, 2), "b": torch.arange(3.0), "tied": None}, "rng": (3, (1, 2), None),
             "step": torch.tensor(7), "flags": torch.tensor([True, False]), "empty": torch.zeros(0, 4), "note": "x"}
    state["model"]["tied"] = state["model"]["w"]
    staged = stager.stage(state)
    assert staged.block is not None and staged.events == [] and len(staged.specs) == 5  # tied: one slot
    assert staged.skeleton["model"]["w"] == staged.skeleton["model"]["tied"] == Slot(0)
    assert staged.skeleton["rng"] == (3, (1, 2), None) and staged.skeleton["note"] == "x"
    rebuilt = fill_slots(staged.skeleton, stager._tensors)
    state["model"]["w"].fill_(5.0)  # training goes on: the copy does not change
    assert torch.equal(rebuilt["model"]["w"], torch.ones(3, 2)) and rebuilt["model"]["w"] is rebuilt["model"]["tied"]
    assert rebuilt["step"].dtype == torch.int64 and rebuilt["flags"].tolist() == [True, False]
    assert rebuilt["empty"].shape == (0, 4)
    # each tensor is its own storage (torch.save stores them apart), all in the one shared block
    storages = {t.untyped_storage().data_ptr() for t in stager._tensors}
    assert len(storages) == 5 and all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for t in stager._tensors)
    block, fd = staged.block, staged.block.fd
    again = stager.stage(state)
    assert again.block is None and again.specs is None and stager.block is block  # same layout: nothing new
    assert torch.equal(fill_slots(again.skeleton, stager._tensors)["model"]["w"], torch.full((3, 2), 5.0))
    smaller = stager.stage({"model": {"w": torch.ones(2)}})
    assert smaller.block is None and smaller.specs == [((2,), torch.float32)] and stager.block.fd == fd  # it fits
    bigger = stager.stage({"model": {"w": torch.ones(100_000)}})
    assert bigger.block is not None and bigger.block is not block and stager.num_bytes >= 400_000
    stager.close()


# -- a background save ----------------------------------------------------------------------------------


def test_a_background_save_is_written_by_another_process_from_the_staged_copy_and_moves_last_good_only_then(
        tmp_path, writer_fault):
    gate = tmp_path / "gate"
    gate.mkdir()
    writer_fault(f"hold:{gate}:step_000002")
    root = tmp_path / "ckpts"
    manager = CheckpointManager(root)
    manager.save(tiny_state(1.0), 1)
    state = tiny_state(2.0)
    state["model"]["tied"] = state["model"]["w"]  # tied weights: one slot, stored once
    pending = manager.save_async(state, 2)
    assert wait_until(lambda: (gate / "reached").exists())  # written and verified, not yet renamed into place
    pid = int((gate / "reached").read_text())
    assert pid == running_writer().pid != os.getpid()
    state["model"]["w"].fill_(7.0)  # training goes on: the live state changes, the staged copy does not
    state["counters"]["step"] = 99
    assert not pending.done() and manager.in_flight is pending
    assert (root / "LAST_GOOD").read_text() == "step_000001\n"
    assert [n for n in dirs(root) if n.startswith("step_000002")] == [f"step_000002.tmp-{pid}"]  # the writer's
    (gate / "release").touch()
    res = pending.result()
    assert res.path == root / "step_000002"
    assert {"check_s", "stage_s", "send_s", "write_s", "verify_s", "prune_s"} <= res.timings.keys()
    assert res.blocked_s == res.timings["stage_s"] + res.timings["send_s"]  # the check is the writer's
    fields = res.event_fields()
    assert fields["write_s"] >= res.timings["write_s"] > 0 and fields["write_cpu_s"] > 0 and fields["blocked_s"] > 0
    assert (root / "LAST_GOOD").read_text() == "step_000002\n"
    loaded = manager.load().state
    expected = tiny_state(2.0)
    expected["model"]["tied"] = expected["model"]["w"]
    assert_same(loaded, expected)
    assert loaded["model"]["tied"].untyped_storage().data_ptr() == loaded["model"]["w"].untyped_storage().data_ptr()


def test_at_most_one_save_in_flight_the_next_waits_for_it(tmp_path, writer_fault):
    gate = tmp_path / "gate"
    gate.mkdir()
    writer_fault(f"hold:{gate}:step_000001")
    manager = CheckpointManager(tmp_path / "ckpts", keep=5)
    first = manager.save_async(tiny_state(1.0), 1)
    assert wait_until(lambda: (gate / "reached").exists())
    second: list = []
    starter = threading.Thread(target=lambda: second.append(manager.save_async(tiny_state(2.0), 2)))
    starter.start()
    starter.join(0.5)
    assert starter.is_alive() and not first.done()  # the second save waits for the first before staging
    assert not [n for n in dirs(tmp_path / "ckpts") if n.startswith("step_000002")]
    (gate / "release").touch()
    starter.join(60)
    assert first.result().path.name == "step_000001" and second[0].result().path.name == "step_000002"
    assert manager.latest_good() == tmp_path / "ckpts" / "step_000002"


def test_a_layout_change_and_a_second_manager_share_the_one_writer(tmp_path):
    a, b = CheckpointManager(tmp_path / "a"), CheckpointManager(tmp_path / "b", require_finite=None)
    a.save_async(tiny_state(1.0), 1).result()
    pid = running_writer().pid
    grown = tiny_state(2.0)
    grown["optimizer"]["state"][0]["exp_avg_sq"] = torch.full((4, 3), 3.0)  # AdamW's moments appear: a new layout
    a.save_async(grown, 2).result()
    b.save_async({"x": torch.arange(5)}, 1).result()
    assert running_writer().pid == pid
    assert_same(a.load().state, grown)
    assert torch.equal(b.load().state["x"], torch.arange(5))


def test_a_relative_root_is_the_one_the_process_named_whatever_the_writers_cwd(tmp_path, monkeypatch):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir(), second.mkdir()
    monkeypatch.chdir(first)
    CheckpointManager("ckpt").save_async(tiny_state(1.0), 1).result()  # the writer starts here, in first/
    monkeypatch.chdir(second)
    manager = CheckpointManager("ckpt")
    manager.save_async(tiny_state(2.0), 2).result()  # the same writer, started in first/
    assert dirs(second / "ckpt") == ["LAST_GOOD", "step_000002"] and dirs(first / "ckpt") == ["LAST_GOOD", "step_000001"]
    assert_same(manager.load().state, tiny_state(2.0))


def test_a_nonfinite_state_is_withheld_by_the_writer_and_nothing_is_written(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save_async(tiny_state(1.0), 1).result()
    state = tiny_state(2.0)
    state["model"]["b"][0] = float("nan")
    pending = manager.save_async(state, 2)
    state["model"]["b"][0] = 0.0  # too late: the copy the writer checks is the one staged
    res = pending.result()
    assert res.withheld and res.kind == "checkpoint_withheld" and res.event_fields() == {}
    assert res.reason == "checkpoint at step 2 withheld: model.b is not finite (NaN/Inf); LAST_GOOD stays at step_000001"
    assert dirs(tmp_path) == ["LAST_GOOD", "step_000001"]


# -- what a save cost ------------------------------------------------------------------------------------


def test_save_costs_compare_the_steps_a_save_was_written_beside_with_as_many_before_it(monkeypatch):
    from stabletrain.records.checkpoint import saves

    now = [0.0]
    monkeypatch.setattr(saves.time, "perf_counter", lambda: now[0])
    costs = saves.SaveCosts()
    for step in (10, 20):  # boundaries 10 steps apart, 1 s each: 0.1 s per step
        costs.mark(step)
        now[0] += 1.0
    costs.mark(30)
    with costs.blocked():  # the save blocks the loop 0.05 s: reported apart, not a step's time
        now[0] += 0.05
    costs.started(30)
    now[0] += 1.2  # the 10 steps while it was written: 0.12 s each
    assert costs.fields(30, 40) == {"steps_after": 10, "step_time_s_after": 0.12, "steps_before": 10,
                                    "step_time_s_before": 0.1, "slowdown": 1.2}
    assert costs.fields(30, 40) == {}  # each save's fields once
    costs.started(40)
    assert costs.fields(40, 40) == {}  # waited for at once (the run's last): no step after it
    with costs.blocked():  # a save begun inside a wait (a crash's), the wait longer than the step after it: its time
        now[0] += 0.5  # taken off would make the step's negative (-0.4 s): not measurable, no field
        costs.started(41)
        now[0] += 0.5
    now[0] += 0.1
    assert costs.fields(41, 42) == {}


def test_a_runs_checkpoint_events_say_what_each_background_save_cost(tmp_path):
    run_dir = tmp_path / "run"
    stabletrain.Trainer(stabletrain.load_config(None, [*MLP, "train.max_steps=12", "log.every=2", "ckpt.every=4"]),
                        run_dir=run_dir, callbacks=[WriterReady()]).fit()
    saves = {e["step"]: e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
             if e["kind"] == "checkpoint"}
    assert sorted(saves) == [0, 4, 8, 12]
    for step in (4, 8):  # in the background: blocked for the copy only, written by the writer process
        e = saves[step]
        assert 0 < e["blocked_s"] < e["seconds"] and e["write_s"] > 0 and e["write_cpu_s"] > 0, e
        assert e["steps_after"] in (2, 4) and e["step_time_s_after"] > 0 and e["steps_before"] == e["steps_after"], e
        assert e["slowdown"] == pytest.approx(e["step_time_s_after"] / e["step_time_s_before"], rel=0.01)


def test_the_writer_starts_beside_the_steps_after_the_first_save_only_when_a_periodic_save_follows(tmp_path):
    close_writer()
    at_first_save = []

    class Probe(stabletrain.Callback):
        def on_checkpoint(self, state, info):
            if info["step"] == 0:
                at_first_save.append(running_writer() is not None)

    for name, every in (("short", "100"), ("periodic", "4")):  # max_steps 6: a save at step 4 only for the second
        stabletrain.Trainer(stabletrain.load_config(None, [*MLP, "train.max_steps=6", "log.every=2", f"ckpt.every={every}"]),
                            run_dir=tmp_path / name, callbacks=[Probe()]).fit()
        if name == "short":
            assert running_writer() is None  # steps 0 and 6 written in the loop's thread: no process started
    assert at_first_save == [False, True]  # started right after the step-0 save, before the step-4 one needs it
    close_writer()


def test_a_save_before_the_writer_serves_is_written_at_once_by_training_not_queued_for_it(tmp_path, writer_fault):
    """A fresh writer imports torch first (~1-2 s beside busy training): a save handed to it meanwhile was not durable
    until then (a restart went back to the save before), and the next save waited for it. Until it serves, a small
    save is written by training itself; then the writer takes them."""
    gate = tmp_path / "gate"
    gate.mkdir()
    writer_fault(f"slow:{gate}")
    good = []

    class Probe(stabletrain.Callback):
        def on_checkpoint(self, state, info):
            good.append((info["step"], (state.ckpt.root / "LAST_GOOD").read_text().strip()))
            if info["step"] == 4:  # the writer may serve from now on
                (gate / "release").touch()
                WriterReady().on_fit_start(state)

    run_dir = tmp_path / "run"
    stabletrain.Trainer(stabletrain.load_config(None, [*MLP, "train.max_steps=8", "log.every=2", "ckpt.every=2"]),
                        run_dir=run_dir, callbacks=[Probe()]).fit()
    saves = {e["step"]: e for e in map(json.loads, (run_dir / "events.jsonl").read_text().splitlines())
             if e["kind"] == "checkpoint"}
    assert sorted(saves) == [0, 2, 4, 6, 8]
    assert good[:3] == [(0, "step_000000"), (2, "step_000002"), (4, "step_000004")]  # durable at once, each
    # (written by training: the loop blocked for the whole save; by the writer: for its staging copy only)
    assert [s for s, e in sorted(saves.items()) if e["blocked_s"] < e["seconds"]] == [6, 8], saves


# -- failures ------------------------------------------------------------------------------------------


def test_a_state_larger_than_the_space_left_is_refused_before_a_byte_is_written(small_disk):
    manager = CheckpointManager(small_disk / "ckpt")
    manager.save_async(tiny_state(1.0), 1).result()
    filler = small_disk / "filler.bin"
    with open(filler, "wb", buffering=0) as fh:  # the disk full but 256 KiB
        with pytest.raises(OSError):
            while True:
                fh.write(b"\0" * (1 << 16))
    os.truncate(filler, filler.stat().st_size - 256 * 1024)
    free = os.statvfs(small_disk).f_bavail
    big = {"model": {"w": torch.ones(128, 1024)}, "optimizer": {}}  # 512 KiB of tensors
    with pytest.raises(CheckpointError, match=r"\[Errno 28\] No space left on device \(0\.50 MiB of tensors, 0\.2"):
        manager.save_async(big, 2).result()
    assert os.statvfs(small_disk).f_bavail == free  # no partial file took the rest
    assert dirs(small_disk / "ckpt") == ["LAST_GOOD", "step_000001"]


def test_a_failed_background_save_is_a_checkpoint_failed_event_and_training_goes_on(tmp_path, writer_fault):
    writer_fault("enospc:*/step_00000[2-9].tmp-*/state.pt.tmp-*")  # the disk is full from the step-2 save on
    run_dir = tmp_path / "run"
    # ckpt.max_failures=0: never stop (stopping after N failures in a row: tests/test_console.py)
    trainer = stabletrain.Trainer(stabletrain.load_config(None, [*MLP, "train.max_steps=6", "log.every=2",
                                                                  "ckpt.every=2", "ckpt.max_failures=0"]), run_dir=run_dir,
                                  callbacks=[WriterReady()])
    trainer.fit()
    assert trainer.step == 6
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = sorted((e["step"], e["kind"]) for e in events if e["kind"].startswith("checkpoint"))
    assert kinds == [(0, "checkpoint"), (2, "checkpoint_failed"), (4, "checkpoint_failed"), (6, "checkpoint_failed")]
    failed = next(e for e in events if e["kind"] == "checkpoint_failed")
    assert "No space left on device" in failed["reason"] and "untouched" in failed["reason"]
    assert (run_dir / "checkpoints" / "LAST_GOOD").read_text() == "step_000000\n"
    assert not [n for n in dirs(run_dir / "checkpoints") if "-" in n]


def test_a_writer_killed_mid_save_is_one_failed_save_and_the_next_save_starts_a_new_writer(tmp_path, writer_fault):
    gate = tmp_path / "gate"
    gate.mkdir()
    writer_fault(f"hold:{gate}:step_000002")
    root = tmp_path / "ckpts"
    manager = CheckpointManager(root)
    manager.save_async(tiny_state(1.0), 1).result()
    pending = manager.save_async(tiny_state(2.0), 2)
    assert wait_until(lambda: (gate / "reached").exists())
    pid = int((gate / "reached").read_text())
    os.kill(pid, signal.SIGKILL)
    t0 = time.time()
    with pytest.raises(CheckpointError, match=rf"^the checkpoint writer process \(pid {pid}\) killed by SIGKILL while "
                                              r"writing step_000002 \(LAST_GOOD names step_000001; the next save starts "
                                              r"a new writer\)$"):
        pending.result()
    assert time.time() - t0 < 10 and manager.in_flight is None  # told at once, not a hang
    assert [n for n in dirs(root) if ".tmp-" in n] == [f"step_000002.tmp-{pid}"]  # what it left
    assert manager.save_async(tiny_state(3.0), 3).result().path.name == "step_000003"
    assert running_writer().pid != pid and not [n for n in dirs(root) if "-" in n]  # a new writer cleaned up
    assert_same(manager.load().state, tiny_state(3.0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="nice values and prctl are Linux's")
def test_the_writer_runs_below_trainings_priority_and_outlives_sigint_and_sigterm_but_not_its_parent(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save_async(tiny_state(1.0), 1).result()
    pid = running_writer().pid
    assert os.getpriority(os.PRIO_PROCESS, pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + WRITER_NICENESS)
    for sig in (signal.SIGINT, signal.SIGTERM):  # a terminal's Ctrl-C or a scheduler's SIGTERM: training saves once more
        os.kill(pid, sig)
    time.sleep(0.2)
    assert manager.save_async(tiny_state(2.0), 2).result().path.name == "step_000002" and running_writer().pid == pid
    close_writer()  # as at the end of the process: it exits
    assert wait_until(lambda: not writers_of(os.getpid()), 10)


def test_a_writer_whose_training_process_is_gone_exits_without_a_traceback_on_the_shared_console():
    """Its reply to a save met a closed socket (the training process SIGKILLed): the BrokenPipeError's traceback went
    to the console it shares with training, and a restart's line quoted it as the killed rank's last line."""
    import socket

    from stabletrain.records.checkpoint.writer import send

    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", WRITER_MODULE, str(theirs.fileno()), str(os.getpid()), "0"],
                            pass_fds=[theirs.fileno()], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    theirs.close()
    send(ours, {"op": "save", "rid": 1, "drop": [], "block": None, "specs": None, "skeleton": b"not a pickle"})
    ours.close()  # gone before its reply (it imports torch first): the reply meets a closed socket
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (1, "", "")


# -- lifetime: a killed run, a killed writer -------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_while_a_background_save_is_in_flight_takes_the_writer_and_resumes_from_the_previous_last_good(
        tmp_path):
    args = [*MLP, "train.max_steps=8", "log.every=2", "ckpt.every=2", "log.tensorboard=false", "ckpt.max_failures=0"]
    gate, run_dir = tmp_path / "gate", tmp_path / "run"
    gate.mkdir()
    fault_env = {**env(), "PYTHONPATH": os.pathsep.join([str(WRITER_SITE), env().get("PYTHONPATH", "")]),
                 "STABLETRAIN_TEST_WRITER_FAULT": f"hold:{gate}:step_000004", "STABLETRAIN_TEST_SLEEP": "0.2"}
    proc = subprocess.Popen(stabletrain_cmd(*args, f"run.dir={run_dir}",
                                            "callbacks=[ckpt_worker:SlowSteps,ckpt_worker:WriterReady]"),
                            env=fault_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert wait_until(lambda: (gate / "reached").exists() or proc.poll() is not None, 120), proc.communicate()
        writer = int((gate / "reached").read_text())
        wait_for_step(proc, run_dir, 6)  # the run trains on while the step-4 save is held in its writer
        assert writers_of(proc.pid) == [writer]
        proc.kill()
        proc.communicate(timeout=60)
        assert wait_until(lambda: not writers_of(proc.pid), 10), "the writer outlived its training process"
    finally:
        (gate / "release").touch()
        if proc.poll() is None:
            proc.kill()
    root = run_dir / "checkpoints"
    assert (root / "LAST_GOOD").read_text() == "step_000002\n"
    assert [n for n in dirs(root) if n.startswith("step_000004")] == [f"step_000004.tmp-{writer}"]

    cfg = stabletrain.load_config(None, args)
    resumed = stabletrain.Trainer(cfg, run_dir=run_dir, resume=True)
    assert resumed.step == 2 and resumed.keeper.resumed_from == root / "step_000002"
    resumed.fit()
    reference = stabletrain.Trainer(cfg, run_dir=tmp_path / "reference")
    reference.fit()
    assert_same(resumed.state_dict()["model"], reference.state_dict()["model"])
    assert_same(resumed.state_dict()["optimizer"], reference.state_dict()["optimizer"])
    assert not [n for n in dirs(root) if "-" in n]  # the dead writer's debris is gone


@pytest.mark.slow
def test_a_run_whose_writer_dies_says_so_in_one_line_trains_on_and_leaves_no_process(tmp_path):
    run_dir = tmp_path / "run"
    fault_env = {**env(), "PYTHONPATH": os.pathsep.join([str(WRITER_SITE), env().get("PYTHONPATH", "")]),
                 "STABLETRAIN_TEST_WRITER_FAULT": "die:*/step_000004.tmp-*/state.pt.tmp-*"}
    proc = subprocess.Popen(stabletrain_cmd(*MLP, "train.max_steps=8", "log.every=2", "ckpt.every=2",
                                            "log.tensorboard=false", f"run.dir={run_dir}", "callbacks=[ckpt_worker:WriterReady]"),
                            env=fault_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    kinds = [(e["step"], e["kind"]) for e in events if e["kind"].startswith("checkpoint")]
    assert kinds == [(0, "checkpoint"), (2, "checkpoint"), (4, "checkpoint_failed"), (6, "checkpoint"), (8, "checkpoint")]
    failed = next(e for e in events if e["kind"] == "checkpoint_failed")
    assert "killed by SIGKILL while writing step_000004 (LAST_GOOD names step_000002" in failed["reason"]
    warnings = [line for line in err.splitlines() if line.startswith("stabletrain: warning:")]
    assert len(warnings) == 1 and "checkpoint at step 4 failed: the checkpoint writer process" in warnings[0], err
    assert "(1 failed in a row; the run stops at 3 in a row (ckpt.max_failures))" in warnings[0]
    assert not writers_of(proc.pid)
    assert (run_dir / "checkpoints" / "LAST_GOOD").read_text() == "step_000008\n"


#: The line a writer found dead with no save in flight gets.
IDLE_DEATH = ("stabletrain: warning: the checkpoint writer process (pid {pid}) killed by SIGKILL between saves, none in "
              "flight (nothing lost); the next save starts another")


def _writer_killed_idle():
    """This process's writer, started, serving, then SIGKILLed (and reaped): dead with no save in flight."""
    from stabletrain.records.checkpoint.writer import writer

    current = writer()
    deadline = time.time() + 60
    while not current.ready and time.time() < deadline:
        time.sleep(0.05)
    os.kill(current.pid, signal.SIGKILL)
    current.proc.wait()
    return current


def test_a_writer_killed_between_saves_is_said_and_costs_no_checkpoint(tmp_path, capsys):
    """A trial: the writer, serving and idle, SIGKILLed between two saves (an OOM killer's pick): the next save was sent
    to the dead process and failed (a lost checkpoint, counted toward ckpt.max_failures), or, before it served, nothing
    was said at all. Its death is seen before the next save, said in one line, and that save is written all the same.
    (The writer is the process's: one a run finds dead before its saves is one that died between a run's saves.)"""
    from helpers import cfg

    from stabletrain import Trainer
    current = _writer_killed_idle()
    Trainer(cfg("train.max_steps=30", "ckpt.every=10", "log.every=10"), run_dir=tmp_path / "run").fit()
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [(e["step"], e["kind"]) for e in events if e["kind"].startswith("checkpoint")] == [
        (s, "checkpoint") for s in (0, 10, 20, 30)]
    said = [x for x in capsys.readouterr().err.splitlines() if "checkpoint writer" in x]
    assert said == [IDLE_DEATH.format(pid=current.pid)], said


def test_a_writer_found_dead_before_any_save_is_replaced_not_handed_the_save(capsys):
    """A review: only a save that could be written in the loop's thread asked whether the writer served; a sharded
    save took the dead writer from writer() and was lost. writer() itself now sees it gone, says so once, starts another."""
    from stabletrain.records.checkpoint.writer import writer

    first = _writer_killed_idle()
    try:
        second = writer()
        assert second is not first and second.dead is None and writer() is second
        said = [x for x in capsys.readouterr().err.splitlines() if "checkpoint writer" in x]
        assert said == [IDLE_DEATH.format(pid=first.pid)], said
    finally:
        close_writer()


def test_a_second_ctrl_c_while_the_writer_is_closed_at_exit_ends_it_without_a_traceback(monkeypatch):
    """A trial: a second SIGINT reached a supervised run's process while its atexit hook waited for the writer to exit:
    'Exception ignored in atexit callback: close_writer ... KeyboardInterrupt'. The writer is killed and reaped instead."""
    from stabletrain.records.checkpoint.writer import Writer

    w = Writer()
    wait, calls = w.proc.wait, []

    def interrupted(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return wait(timeout)

    monkeypatch.setattr(w.proc, "wait", interrupted)
    w.close()  # no KeyboardInterrupt out of it
    assert len(calls) == 2 and w.proc.returncode is not None and w.dead.endswith("was closed")
