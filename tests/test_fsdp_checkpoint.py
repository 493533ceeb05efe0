"""Sharded, asynchronous checkpoints under FSDP2 (torch.distributed.checkpoint): written, verified, resumed.

The manager's side runs in this process on a one-rank gloo group (a DCP save needs a process group);
the rest are 2-rank FSDP runs (``dist.checkpoint=sharded`` is the default there): the launcher
``stabletrain train dist.nproc=2 dist.strategy=fsdp`` end to end (SIGKILL, then ``--resume``), and the
other runs in one shared torchrun world (``dist_world.py``: what each rank of that command runs, in turn).
"""

import json
import os
import pickle
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import cfg
from multiproc import FAST, World, cli, descendants, env, events, run, stabletrain, wait_for_step

from stabletrain import Trainer
from stabletrain.records.checkpoint.files import CheckpointError
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.records.checkpoint.shards import (
    ShardedSave,
    ShardedSaver,
    read_full_tensors,
    read_metadata,
    sharded_state_dicts,
    split_for_dcp,
)

pytestmark = pytest.mark.slow  # a process group in this process, and 2-process runs


# -- the manager's side, on one rank ------------------------------------------------------------------


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _stepped(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).square().sum().backward()
    opt.step()
    return model, opt


def _sharded_save(ckpt, saver, model, opt, step):
    m, o = sharded_state_dicts(model, opt)
    tensors, small = split_for_dcp({"model": m, "optimizer": o, "counters": {"step": step}})
    shards = saver.start(tensors, ckpt.begin_sharded(step), step)
    return ckpt.save_async(small, step, {"note": "x"}, shards=shards)


def test_a_sharded_save_moves_last_good_only_once_its_shards_and_metadata_verify(one_rank, tmp_path, monkeypatch):
    model, opt = _stepped()
    ckpt, saver = CheckpointManager(tmp_path / "ckpts"), ShardedSaver()
    result = _sharded_save(ckpt, saver, model, opt, 1).result()
    good = ckpt.latest_good()
    assert good.name == "step_000001" and ckpt.verify(good) == []
    assert sorted(p.name for p in (good / "dcp").iterdir()) == [".metadata", "__0_0.distcp"]  # one shard file per rank
    meta = json.loads((good / "meta.json").read_text())
    names = ("0.weight", "0.bias", "2.weight", "2.bias")
    assert meta["dcp"]["keys"] == sorted([*(f"model.{n}" for n in names),  # every tensor; the rest is in state.pt
                                          *(f"optimizer.state.{n}.{k}" for n in names
                                            for k in ("step", "exp_avg", "exp_avg_sq"))])
    assert set(result.timings) >= {"shard_stage_s", "shard_write_s", "stage_s", "write_s", "verify_s"}
    assert result.blocked_s < sum(result.timings.values())
    # loaded whole, in this process: the model and optimizer.state_dict() format, bitwise
    full = ckpt.load(full=True).state
    for name, value in model.state_dict().items():
        assert torch.equal(full["model"][name], value), name
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            assert torch.equal(full["optimizer"]["state"][i][k], v), (i, k)
    assert full["counters"] == {"step": 1}

    # a shard file that vanished (or a .metadata) before state.pt was written: never LAST_GOOD, the file named
    finish = ShardedSave.finish
    for step, victim in ((2, "__0_0.distcp"), (3, ".metadata")):
        def finish_then_lose(self, timings, victim=victim):
            info = finish(self, timings)
            (self.tmp / "dcp" / victim).unlink()
            return info

        monkeypatch.setattr(ShardedSave, "finish", finish_then_lose)
        with pytest.raises(CheckpointError, match=f"dcp/{victim} is missing") as err:
            _sharded_save(ckpt, saver, model, opt, step).result()
        assert "failed verification right after writing" in str(err.value)
        assert ckpt.latest_good().name == "step_000001"
        assert sorted(p.name for p in ckpt.root.iterdir()) == ["LAST_GOOD", "step_000001"]  # no debris
    monkeypatch.setattr(ShardedSave, "finish", finish)
    saver.wait()
    # a shard's bit flipped after it verified (a new user's trial: one exp_avg_sq went 1.5e-05 -> 5.2e+33, resumed
    # from without a word; sizes alone were checked): named, the checkpoint not loaded
    assert meta["dcp"]["crc32"].keys() == {"__0_0.distcp"}
    shard = good / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    assert ckpt.verify(good) == ["step_000001: dcp/__0_0.distcp does not match its crc32 in meta.json (corrupted)"]


def test_each_rank_checksums_its_own_shards_and_a_rank_whose_checksums_never_come_fails_the_save(tmp_path):
    """A review: rank 0 read every rank's shards back for their CRC32s on each save (a whole model's bytes through one
    process, LAST_GOOD waiting on it). Each rank checksums its own files; rank 0 gathers them, waiting dist.timeout_s."""
    import zlib
    from concurrent.futures import Future

    folder = tmp_path / "dcp"
    folder.mkdir()
    for name in ("__0_0.distcp", "__1_0.distcp", "__1_1.distcp"):
        (folder / name).write_bytes(name.encode() * 1000)
    done = Future()
    done.set_result(None)
    mine = ShardedSave(1, tmp_path, [], done, {}, rank=1, world=2, timeout_s=0.2)
    mine.checksums.join()
    crc = {n: f"{zlib.crc32(n.encode() * 1000):08x}" for n in ("__0_0.distcp", "__1_0.distcp", "__1_1.distcp")}
    assert json.loads((folder / ".crc32.1.json").read_text()) == {n: crc[n] for n in ("__1_0.distcp", "__1_1.distcp")}
    lost = Future()
    lost.set_exception(OSError("disk full"))
    ShardedSave(1, tmp_path, [], lost, {}, rank=0, world=2).checksums.join()  # a failed write leaves none
    with pytest.raises(RuntimeError, match="rank 0.s shard checksums did not arrive within 0.2 s"):
        mine._gathered(folder, 0)
    ShardedSave(1, tmp_path, [], done, {}, rank=0, world=2).checksums.join()
    assert mine._gathered(folder, 0) == crc and not list(folder.glob(".crc32*"))


def test_metadata_that_pickles_anything_but_dcp_metadata_is_refused_and_never_run(tmp_path):
    path = tmp_path / ".metadata"
    path.write_bytes(pickle.dumps(os.getcwd))
    with pytest.raises(pickle.UnpicklingError, match="refused: .metadata pickles the global posix.getcwd"):
        read_metadata(path)


# -- two ranks ----------------------------------------------------------------------------------------

TASK = ["task=fsdp_tasks:blocks_task", "train.batch_size=4", "log.every=1", "eval.every=0", "sched.decay=constant",
        "sched.warmup_steps=0", "clip.max_norm=0.5", "optim.lr=0.01"]
#: 2 FSDP ranks x 4 (accum 1) -> 1 process x 4 x accum 2 on the same samples: measured within 2e-7 (loss, relative).
RTOL, ATOL = 1e-5, 1e-6


def _final(run_dir, step):
    """(the final checkpoint's state, its whole tensors read from its DCP folder)."""
    loaded = CheckpointManager(run_dir / "checkpoints").load()
    assert loaded.meta["step"] == step, loaded.path
    assert sorted(p.name for p in (loaded.path / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # each shard's CRC32, by the rank that wrote it (its side file gathered into meta.json, then removed: above), checked
    assert loaded.meta["dcp"]["crc32"].keys() == {"__0_0.distcp", "__1_0.distcp"}
    assert CheckpointManager(run_dir / "checkpoints").verify(loaded.path) == []
    return loaded.state, read_full_tensors(loaded.path / "dcp")


def _cmdline(pid):
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return b""


def _alive(pid):
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# dropout draws from each rank's RNG stream: a resume that restored the wrong one would not be bitwise equal
KILL = ["task=helpers:slow_mlp_task", "task_args.num_samples=192", "task_args.dropout=0.2", "task_args.sleep=0",
        "train.batch_size=8", "accum.steps=3", "train.max_steps=14", "log.every=1", "ckpt.every=2", "eval.every=0",
        "dist.nproc=2", "dist.strategy=fsdp", "capture.incidents=false", "callbacks=[ckpt_worker:SlowSteps]"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """One 2-rank world: the SIGKILL test's uninterrupted run, a planted NaN, and a run of 12 steps and one of 5
    (sharded checkpoints at 0, 3 and 5) that the one-process resumes start from."""
    root = tmp_path_factory.mktemp("sharded")
    scenarios = [("reference", *cli(*KILL, f"run.dir={root / 'reference'}")),
                 ("nan", *cli(*TASK, "dist.nproc=2", "dist.strategy=fsdp", "train.max_steps=2", "ckpt.every=0",
                              "capture.incidents=false", "callbacks=[ckpt_worker:PlantNaN]", f"run.dir={root / 'nan'}"))]
    scenarios += [(name, *cli(*TASK, "dist.nproc=2", "dist.strategy=fsdp", "ckpt.every=3", f"train.max_steps={steps}",
                              f"run.dir={root / name}")) for name, steps in (("straight", 12), ("parts", 5))]
    return World(root, scenarios)


def test_an_fsdp_run_killed_with_sigkill_and_resumed_from_sharded_checkpoints_is_bitwise_equal(world, tmp_path):
    world.check("reference")
    want_state, want = _final(world.root / "reference", 14)
    run_dir = tmp_path / "killed"
    kill_at = random.Random("fsdp-dcp-kill").randrange(3, 12)
    proc = subprocess.Popen(stabletrain(*KILL, f"run.dir={run_dir}"), env={**env(), "STABLETRAIN_TEST_SLEEP": "0.15"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, run_dir, kill_at)
    below = descendants(proc.pid)
    # The checkpoint helpers: rank 0's writer, each rank's DCP checkpoint process (and multiprocessing's tracker)
    helpers = [pid for pid in below if any(name in _cmdline(pid) for name in (b"stabletrain.records.checkpoint.writer",
                                                                              b"multiprocessing.spawn"))]
    assert len(helpers) == 3, [_cmdline(pid) for pid in below]
    for pid in [*(p for p in below if p not in helpers and b"multiprocessing" not in _cmdline(p)), proc.pid]:
        os.kill(pid, signal.SIGKILL)  # the launcher, torchrun and both ranks, at once; not their helpers
    killed = proc.communicate(timeout=60)
    t0 = time.time()
    while [pid for pid in below if _alive(pid)] and time.time() - t0 < 10:
        time.sleep(0.05)
    assert not [_cmdline(pid) for pid in below if _alive(pid)], "a checkpoint helper outlived its rank by 10 s"
    # DCP's checkpoint processes, their ranks gone, print no traceback of the pipe they read (EOFError)
    assert "EOFError" not in killed[1] and "Traceback" not in killed[1], killed[1][-3000:]
    assert CheckpointManager(run_dir / "checkpoints").load().meta["step"] < 14
    resumed = run(stabletrain("--resume", str(run_dir)))  # dist.nproc=2 and the rest from config.yaml
    # each rank ends its DCP checkpoint process itself (no EOFError at exit), whose INFO lines stop at the first save
    console = resumed.stdout + resumed.stderr
    assert "Traceback" not in console and "EOFError" not in console, console[-3000:]
    assert console.count("Completed checkpoint save request") == 0 and console.count("shutting down") == 0, console[-3000:]
    got_state, got = _final(run_dir, 14)
    assert sorted(got) == sorted(want) and any(k.startswith("optimizer.state.") for k in got)
    for key, value in want.items():  # every parameter and optimizer tensor, whole
        assert torch.equal(got[key], value), key
    assert got_state["counters"] == want_state["counters"] and got_state["stream"] == want_state["stream"]
    for mine, theirs in zip(got_state["ranks"], want_state["ranks"]):
        assert torch.equal(mine["rng"]["torch"], theirs["rng"]["torch"]) and mine["stream"] == theirs["stream"]
    saves = [e for e in events(run_dir) if e["kind"] == "checkpoint"]
    assert saves and all(0 < e["blocked_s"] < e["seconds"] for e in saves)


def test_a_failed_sharded_save_says_the_gist_of_a_gloo_error_not_its_source_path(tmp_path):
    """A trial: a peer's death during an FSDP save read 'the DCP save failed (RuntimeError: [.../gloo/transport/tcp/
    pair.cc:553] Connection closed by peer ...'; the gist is said, as a lost peer's own line says it."""
    from types import SimpleNamespace

    from stabletrain.records.checkpoint.background import shards_written
    from stabletrain.records.checkpoint.files import CheckpointError

    def finish(timings):
        raise RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                           "[127.0.0.1]:41234\nmore lines")

    (tmp_path / "tmp").mkdir()
    with pytest.raises(CheckpointError) as err:
        shards_written(SimpleNamespace(finish=finish, tmp=tmp_path / "tmp"), tmp_path / "step_000080", {})
    assert "the DCP save failed (RuntimeError: Connection closed by peer [127.0.0.1]:41234); the previous" in str(err.value)
    assert not (tmp_path / "tmp").exists()


def test_a_sharded_save_written_at_once_that_fails_on_one_rank_is_a_failed_save_not_a_crash(tmp_path):
    """ckpt.every=0: the last save is written by dcp.save in the loop; rank 1's write fails (a full disk, planted).
    DCP raises its CheckpointException, a BaseException, on every rank: it escaped the loop as a traceback on both."""
    run_dir = tmp_path / "run"
    res = subprocess.run(stabletrain(*TASK, "train.max_steps=4", "log.every=2", "ckpt.every=0", "dist.nproc=2",
                                     "dist.strategy=fsdp", "callbacks=[ckpt_worker:FailShardWrite]", f"run.dir={run_dir}"),
                         env=env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    [failed] = [e for e in events(run_dir) if e["kind"] == "checkpoint_failed"]
    assert failed["step"] == 4 and ("the DCP save failed (rank 1: OSError: [Errno 28] No space left on device "
                                    "(planted)); the previous checkpoint and LAST_GOOD are untouched") in failed["reason"]
    assert f"stabletrain: warning: {failed['reason']}" in res.stderr
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["LAST_GOOD", "step_000000"]  # nothing half-written left


def test_a_nan_in_one_ranks_shard_withholds_the_sharded_checkpoint_on_every_rank(world):
    world.check("nan")
    run_dir = world.root / "nan"
    withheld = [e for e in events(run_dir) if e["kind"] == "checkpoint_withheld"]
    assert [(e["step"], e["rank"], e["key"]) for e in withheld] == [(2, 1, "model.layers.1.fc.weight")]
    assert "rank 1's shard of model.layers.1.fc.weight is not finite" in withheld[0]["reason"]
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["LAST_GOOD", "step_000000"]  # nothing staged or left behind


@pytest.mark.parametrize("damage, resumed_at", [(None, 5), ("dcp/__1_0.distcp", 3), ("dcp/.metadata", 3)])
def test_a_sharded_checkpoint_resumes_on_one_process_and_a_damaged_one_is_skipped_naming_the_file(
        world, tmp_path, damage, resumed_at):
    sharded_runs = world.root
    for name in ("straight", "parts"):
        world.check(name)
    run_dir = tmp_path / "parts"
    shutil.copytree(sharded_runs / "parts", run_dir)
    if damage:
        (run_dir / "checkpoints" / "step_000005" / damage).unlink()
    trainer = Trainer(cfg(*TASK[1:], *FAST, "accum.steps=2", "ckpt.every=3", "train.max_steps=12",
                          f"run.dir={run_dir}", task=TASK[0].split("=", 1)[1]), run_dir=run_dir, resume=True)
    assert trainer.step == resumed_at
    if damage:
        assert trainer.keeper.problems == [f"step_000005: {damage} is missing" + (
            " (a shard file of the sharded checkpoint)" if damage.endswith("distcp") else
            " (the sharded save did not finish?)")]
    trainer.fit()
    straight = {json.loads(x)["step"]: json.loads(x)["loss"]
                for x in (sharded_runs / "straight" / "metrics.jsonl").read_text().splitlines()}
    after = {r["step"]: r["loss"] for r in trainer.history}
    assert sorted(after) == list(range(resumed_at + 1, 13))
    assert after == pytest.approx({s: straight[s] for s in after}, rel=RTOL)
    want = read_full_tensors(sharded_runs / "straight" / "checkpoints" / "step_000012" / "dcp")
    for name, p in trainer.module.named_parameters():
        assert torch.allclose(p.detach(), want[f"model.{name}"], rtol=RTOL, atol=ATOL), name
    resume = [e for e in events(run_dir) if e["kind"] == "resume"][-1]
    assert (resume["step"], resume["old_world_size"], resume["new_world_size"]) == (resumed_at, 2, 1)
    if damage:
        skipped = [e for e in events(run_dir) if e["kind"] == "checkpoint_skipped"]
        assert damage in skipped[-1]["reason"]


def test_the_checkpoint_process_prints_a_crash_while_its_rank_lives_and_nothing_once_it_is_gone():
    import io

    from stabletrain.records.checkpoint.dcp_process import OrphanQuiet

    alive, gone = io.StringIO(), io.StringIO()
    mine = OrphanQuiet(alive, os.getppid())  # its parent alive: a crash report is printed (after the wait)
    mine.wait_s = 0.05
    for text in ("Process SpawnProcess-1:\n", "Traceback (most recent call last):\n"):
        mine.write(text)
    orphan = OrphanQuiet(gone, -1)  # its parent gone (reparented): silent from the report on
    orphan.write("a warning before it\n")
    for text in ("Process SpawnProcess-1:\n", "Traceback (most recent call last):\n", "EOFError\n"):
        orphan.write(text)
    assert alive.getvalue().count("\n") == 2 and gone.getvalue() == "a warning before it\n"

