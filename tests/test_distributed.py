"""DDP on CPU (gloo, 2 processes under torchrun): exact equivalence, consistent skips, exact resume, clean failure.

Every test starts real processes. The launcher ``stabletrain train dist.nproc=2`` and ``torchrun -m
stabletrain train`` run end to end (SIGKILL and resume, SIGTERM, a killed launcher, a rank that dies or
hangs). The rest share one 2-rank torchrun world (``dist_world.py``: a module fixture runs every scenario
in turn, each test asserts on its own): what each rank of ``stabletrain train dist.nproc=2`` runs (the
CLI's train command), the worker in ``dist_tasks.py`` (which leaves each rank's final parameters, history
and host syncs on disk) and those in ``dist_carrier.py`` and ``dist_staging.py``.
"""

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import cfg
from multiproc import FAST, TORCHRUN, World, cli, descendants, env, events, run, stabletrain, steps_logged, wait_for_step

from stabletrain import Trainer
from stabletrain.data import EpochOrder
from stabletrain.records.bundles import load_bundle
from stabletrain.records.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.slow  # 2-process torchrun runs

_env, _run, _stabletrain, _events = env, run, stabletrain, events



def _rank_pids(pid):
    """Return {rank: pid} of the workers below ``pid`` (read from each one's environment)."""
    ranks = {}
    for child in descendants(pid):
        try:
            env = dict(kv.split("=", 1) for kv in (Path("/proc") / str(child) / "environ").read_text().split("\0") if "=" in kv)
        except OSError:
            continue
        if "RANK" in env and "LOCAL_RANK" in env:
            ranks[int(env["RANK"])] = child
    return ranks


def _alive(pid):
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


# -- equivalence -------------------------------------------------------------------------------

# 2 ranks x 4 samples x accum 3 against 1 process x 8 samples x accum 3: the same 24 samples per step.
# regression: 60 samples = 7 global micro-batches of 8 and a tail of 4 (2 per rank); windows 3, 3, 2.
EQUIV = {"regression": ["task=helpers:regression_task", "task_args.n=60"], "varlen": ["task=helpers:varlen_task"]}
COMMON = ["accum.steps=3", "train.max_steps=7", "log.every=1", "ckpt.every=0", "eval.every=0", "optim.lr=0.01",
          "sched.warmup_steps=0", "clip.max_norm=0.5"]


#: Steps 3 and 5 (batch 4 per rank, accum 1) read global micro-batches 2 and 4; rank 1 takes the second half.
BAD_AT_3 = EpochOrder(64, 4, seed=0, shuffle=True, rank=1, world_size=2).micro_batches(0)[2][1]
BAD_AT_5 = EpochOrder(64, 4, seed=0, shuffle=True, rank=1, world_size=2).micro_batches(0)[4][1]
#: Step 14 (batch 8 per rank, no shuffle): rank 1's micro-batch; two of its samples carry a finite spike.
SPIKE_ON_1 = EpochOrder(256, 8, seed=0, shuffle=False, rank=1, world_size=2).micro_batches(0)[13][2:6:3]
#: Step 101 of the blobs (global batch 16, no shuffle), the first of its log interval (log.every=10): one sample per rank.
SPIKE_AT_101 = (1603, 1610)
#: ... and one sample on each rank at step 14.
SPIKE_ON_BOTH = [EpochOrder(256, 8, seed=0, shuffle=False, rank=0, world_size=2).micro_batches(0)[13][3], SPIKE_ON_1[0]]
#: test_the_carried_numbers_are_exact_every_way_and_in_any_bucket_dtype: (way, dtype, tolerance, rides a param)
CARRIERS = [("param", "float32", 1e-6, True), ("param", "float64", 1e-6, True), ("param", "bfloat16", 2e-2, False),
            ("hook", "float32", 1e-6, False), ("hook-scaled", "float32", 1e-6, False),
            ("hook-scaled", "bfloat16", 2e-2, False)]


def _scenarios(root):
    """Every 2-rank run of this file but the launches tested end to end, in the order the world runs them."""
    nan = ["task=helpers:nan_sample_task", "train.batch_size=4", "train.max_steps=6", "log.every=3", "eval.every=0", *FAST]
    out = [(f"equiv-{name}", *cli(*task, *COMMON, "train.batch_size=4", "dist.nproc=2", f"run.dir={root / name}"))
           for name, task in EQUIV.items()]
    out += [("nan", "dist_tasks:main", [root / "nan_out", *nan, f"task_args.bad_index={BAD_AT_3}", "ckpt.every=0",
                                        f"run.dir={root / 'nan'}"]),
            ("staging", "dist_staging:main", [root / "staging"]),
            ("capture", "dist_tasks:main", [root / "capture_out", "--states", *nan, f"task_args.bad_index={BAD_AT_5}",
                                            "ckpt.every=0", f"run.dir={root / 'capture'}"]),
            ("rollback", "dist_tasks:main", [root / "rollback_out", *nan, f"task_args.bad_index={BAD_AT_3}", "ckpt.every=2",
                                             "guard.on_nonfinite=rollback", "capture.diagnose=false",
                                             f"run.dir={root / 'rollback'}"]),
            ("spike", *cli("task=spike_tasks:outliers_at_task", f"task_args.bad={','.join(map(str, SPIKE_ON_1))}",
                           "train.batch_size=8", "train.max_steps=16", "log.every=10", "data.shuffle=false",
                           "optim.lr=0.01", "ckpt.every=0", "eval.every=0", "dist.nproc=2", f"run.dir={root / 'spike'}")),
            ("spike-fsdp", *cli("task=spike_tasks:outliers_at_task", f"task_args.bad={','.join(map(str, SPIKE_ON_1))}",
                                "train.batch_size=8", "train.max_steps=16", "log.every=10", "data.shuffle=false",
                                "optim.lr=0.01", "ckpt.every=0", "eval.every=0", "dist.nproc=2", "dist.strategy=fsdp",
                                f"run.dir={root / 'spike-fsdp'}")),
            ("spike-first", *cli("task=spike_tasks:blobs_outliers_task", "train.batch_size=8", "train.max_steps=103",
                                 "log.every=10", "data.shuffle=false", "ckpt.every=100", "eval.every=0", "dist.nproc=2",
                                 f"run.dir={root / 'spike-first'}")),
            ("spike-rollback", *cli("task=spike_tasks:outliers_at_task", f"task_args.bad={','.join(map(str, SPIKE_ON_BOTH))}",
                                    "train.batch_size=8", "train.max_steps=40", "log.every=10", "data.shuffle=false",
                                    "optim.lr=0.01", "ckpt.every=10", "ckpt.keep=10", "eval.every=0",
                                    "guard.on_spike=rollback", "dist.nproc=2", f"run.dir={root / 'spike-rollback'}")),
            ("reference", *cli(*RESUME, f"run.dir={root / 'reference'}")),  # the SIGKILL test's uninterrupted run
            ("grad-nan", "dist_tasks:main", [root / "grad_nan_out", "task=helpers:grad_nan_sample_task",
                                             f"task_args.bad_index={BAD_AT_3}", "train.batch_size=4", "train.max_steps=3",
                                             "log.every=3", "ckpt.every=0", "eval.every=0", f"run.dir={root / 'grad_nan'}",
                                             *FAST]),
            ("collectives", "dist_tasks:main", [root / "collectives_out", "--count-collectives", "task=mlp",
                                                "task_args.num_samples=512", "train.batch_size=8", "accum.steps=3",
                                                "train.max_steps=8", "log.every=4", "ckpt.every=0", "eval.every=0",
                                                "guard.check_inputs=true", f"run.dir={root / 'collectives'}", *FAST]),
            ("syncs", "dist_tasks:main", [root / "syncs_out", "--count-syncs", "task=mlp", "task_args.num_samples=512",
                                          "train.batch_size=8", "accum.steps=2", "train.max_steps=25", "log.every=5",
                                          "eval.every=10", "ckpt.every=0", "clip.max_norm=0.5", f"run.dir={root / 'syncs'}",
                                          *FAST])]
    out += [(f"carrier-{way}-{dtype}", "dist_carrier:main", [way, dtype, root / f"carrier-{way}-{dtype}.json"])
            for way, dtype, _, _ in CARRIERS]
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    (root / "staging").mkdir()
    return World(root, _scenarios(root))


@pytest.mark.parametrize("name", list(EQUIV))
def test_ddp_with_accumulation_equals_one_process_on_the_same_samples(world, tmp_path, name):
    world.check(f"equiv-{name}")
    single = Trainer(cfg(*EQUIV[name], *COMMON, "train.batch_size=8", task=EQUIV[name][0].split("=", 1)[1]),
                     run_dir=tmp_path / "single")
    single.fit()
    run_dir = world.root / name
    ddp = CheckpointManager(run_dir / "checkpoints").load()
    assert ddp.meta["step"] == 7 and ddp.meta["world_size"] == 2
    for key, value in single.module.state_dict().items():
        assert torch.allclose(ddp.state["model"][key], value, rtol=0, atol=1e-6), \
            (key, (ddp.state["model"][key] - value).abs().max())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single.history], rel=1e-5)
    assert [r["samples_seen"] for r in records] == [r["samples_seen"] for r in single.history]  # global counts
    assert [r["tokens_seen"] for r in records] == [r["tokens_seen"] for r in single.history]
    assert all(r["world_size"] == 2 for r in records)


def test_resuming_under_another_world_size_still_refuses_a_changed_config_key(world, capsys):
    from stabletrain.cli import main

    world.check("equiv-regression")
    run_dir = world.root / "regression"  # the resharded resume itself: tests/test_reshard.py
    capsys.readouterr()  # (the one-process resume in this process: it is refused before it trains)
    assert main(["train", "--resume", str(run_dir), "dist.nproc=1", "optim.lr=0.5", "train.max_steps=9"]) == 2
    err = capsys.readouterr().err
    assert "optim.lr: checkpoint 0.01, now 0.5" in err and "Under another world size" in err
    # under the same world size, two ranks read the same checkpoint: one refusal, not one per rank (a new user's trial)
    res = subprocess.run([sys.executable, "-m", "stabletrain", "train", "--resume", str(run_dir), "optim.lr=0.5",
                          "train.max_steps=9"], env=_env(), capture_output=True, text=True, timeout=180)
    assert res.returncode == 2, res.stderr
    assert res.stderr.count("optim.lr: checkpoint 0.01, now 0.5") == 1, res.stderr


# -- a NaN that only rank 1 sees -----------------------------------------------------------------


def test_a_nan_only_rank_1_sees_skips_the_step_on_both_ranks_and_the_diagnosis_names_rank_1_and_the_sample(world):
    bad = BAD_AT_3
    assert bad not in EpochOrder(64, 4, seed=0, shuffle=True, rank=0, world_size=2).micro_batches(0)[2]
    world.check("nan")
    run_dir, out = world.root / "nan", world.root / "nan_out"
    ranks = [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]
    for key, value in ranks[0]["params"].items():  # both skipped the same step: still in lockstep
        assert torch.equal(value, ranks[1]["params"][key]), key
        assert torch.isfinite(value).all(), key
    for r in ranks:
        assert [h["num_skipped"] for h in r["history"]] == [1, 0]
    events = _events(run_dir)
    assert [e["step"] for e in events if e["kind"] == "skip"] == [3]
    nonfinite = [e for e in events if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0]["step"] == 3 and nonfinite[0]["ranks"] == [1]
    assert "seen on rank(s) [1]" in nonfinite[0]["reason"]
    incident = [e for e in events if e["kind"] == "incident"][0]
    assert incident["step"] == 3 and incident["ranks"] == [1]
    assert incident["diagnosis"]["rank"] == 1
    assert incident["diagnosis"]["bad_samples"] == [bad], incident["diagnosis"]
    bundle = load_bundle(run_dir / "incidents" / "step_000003")
    assert bundle["rank"] == 1 and bad in bundle["window"]["indices"][0]


@pytest.mark.parametrize("name", ["spike", "spike-fsdp"])
def test_a_finite_spike_only_rank_1s_samples_carry_is_diagnosed_on_rank_1s_batch(world, name):
    """The step's loss is the mean over the ranks: its capture weighs the step's whole batch (every rank's window, as a
    one-process replay of the DDP step), names the samples that carry it and the rank each was on (here rank 1's
    alone), not call rank 0's batch not reproducible. Under DDP and under FSDP2 (each rank's shards; the diagnosis
    replays the whole model). (It weighed only the rank with the largest own loss: samples on two ranks were half named.)"""
    assert not set(SPIKE_ON_1) & set(EpochOrder(256, 8, seed=0, shuffle=False, rank=0, world_size=2).micro_batches(0)[13])
    world.check(name)
    events = _events(world.root / name)
    incident = next(e for e in events if e["kind"] == "incident")
    assert incident["step"] == 14 and incident["ranks"] == [1], incident
    assert incident["diagnosis"]["failure_class"] == "data", incident["diagnosis"]["summary"]
    diagnosis = json.loads((world.root / name / "incidents" / "step_000014" / "diagnosis.json").read_text())
    assert diagnosis["samples"]["indices"] and set(diagnosis["samples"]["indices"]) <= set(SPIKE_ON_1), diagnosis["summary"]
    bundle = load_bundle(world.root / name / "incidents" / "step_000014")
    assert bundle["window"]["ranks"] == [0, 1] and len(bundle["window"]["indices"]) == 2  # the step's whole batch
    assert "rank 1's own window" not in diagnosis["summary"]


def test_a_ddp_spike_on_its_intervals_first_step_is_not_weighed_under_step_0s_weights(world):
    """A trial: DDP keeps no snapshot from before the interval's (one process does), so a spike on an interval's first
    step was weighed under the only checkpoint, step 0's untrained weights, and called state ('the updates since step 0
    raised this window's loss'; its planted samples 'only under the current state'); one process and FSDP said data. A
    checkpoint older than the losses the rule weighs is no older state: the samples are named, and verified."""
    world.check("spike-first")
    diagnosis = json.loads((world.root / "spike-first" / "incidents" / "step_000101" / "diagnosis.json").read_text())
    assert diagnosis["failure_class"] == "data" and set(diagnosis["bad_samples"] or []) == set(SPIKE_AT_101), (
        diagnosis["summary"])
    assert diagnosis["older"] is None and diagnosis["observed"]["reference_out_of_reach"]["step"] == 0
    assert "without them the step is normal (verified" in diagnosis["summary"], diagnosis["summary"]


def test_a_spike_rollback_under_ddp_drops_the_samples_of_every_rank_the_diagnosis_named_on_every_rank(world):
    """guard.on_spike=rollback on 2 ranks, a bad sample on each: both are named (the step's whole batch is weighed; only
    the rank with the larger own loss was, and the other's sample spiked again next epoch) and dropped on both ranks
    (the window alone was skipped: they came back next epoch, at step 30), and the ranks stay in step (each weighs the
    other's share of a window from the epoch's order)."""
    world.check("spike-rollback")
    run_dir = world.root / "spike-rollback"
    events = _events(run_dir)
    (rollback,) = [e for e in events if e["kind"] == "rollback"]
    assert sorted(rollback["dropped_samples"]) == sorted(SPIKE_ON_BOTH), rollback
    incident = next(e for e in events if e["kind"] == "incident")
    assert incident["ranks"] == [0, 1] and incident["diagnosis"]["failure_class"] == "data", incident
    assert "which the diagnosis named" in rollback["reason"]
    assert [e["step"] for e in events if e["kind"] == "spike" and not e.get("superseded")] == [14]  # not again at 30
    last = CheckpointManager(run_dir / "checkpoints").load()
    assert last.meta["step"] == 40 and set(rollback["dropped_samples"]) <= set(last.state["stream"]["drop"])


def test_a_state_every_rank_holds_alike_is_staged_in_shares_and_completed_bitwise_on_every_rank(world):
    world.check("staging")
    ranks = [json.loads((world.root / "staging" / f"rank_{r}.json").read_text()) for r in (0, 1)]
    assert sum(r["mine"] for r in ranks) == ranks[0]["total"]  # every byte staged once, on one rank
    assert all(0.3 < r["mine"] / r["total"] < 0.7 and r["withheld"] > 0 for r in ranks), ranks  # about half each
    assert all(r["equal"] and r["tied"] and r["reused"] for r in ranks), ranks


def test_the_capture_replays_from_a_snapshot_each_rank_holds_only_its_share_of(world):
    # Step 5 reads global micro-batch 4; the interval (log.every=3) started after step 3, where each rank staged
    # about half of the parameters and AdamW state: the capture gathers the rest (a broadcast per tensor from its
    # owner), replays step 4 and writes the state before step 5 bitwise as the run had it.
    world.check("capture")
    run_dir, out = world.root / "capture", world.root / "capture_out"
    incident = next(e for e in _events(run_dir) if e["kind"] == "incident")
    assert incident["step"] == 5 and incident["ranks"] == [1] and incident["replayed_steps"] == 1
    bundle = load_bundle(run_dir / "incidents" / "step_000005")
    for r in (0, 1):
        before = torch.load(out / f"rank_{r}.pt", weights_only=False)["states"][4]
        assert before["model"].keys() == bundle["model"].keys()
        for key, value in before["model"].items():
            assert torch.equal(value, bundle["model"][key]), (r, key)
        assert len(before["optimizer"]["state"]) == len(bundle["optimizer"]["state"]) > 0
        for i, per_param in before["optimizer"]["state"].items():
            for name, value in per_param.items():
                assert torch.equal(value, bundle["optimizer"]["state"][i][name]), (r, i, name)


def test_a_rollback_happens_on_both_ranks_together_and_skips_the_window_everywhere(world):
    world.check("rollback")
    run_dir, out = world.root / "rollback", world.root / "rollback_out"
    ranks = [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]
    for key, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][key]) and torch.isfinite(value).all(), key
    assert [r["history"][-1]["num_rollbacks"] for r in ranks] == [1, 1]
    rollback = [e for e in _events(run_dir) if e["kind"] == "rollback"]
    assert len(rollback) == 1 and rollback[0]["to_step"] == 2 and rollback[0]["skipped_windows"] == [[0, 2]]


# -- exact resume after SIGKILL ------------------------------------------------------------------

# 192 samples, 8 per rank -> 12 global micro-batches per epoch; accum 5 -> windows 5, 5, 2: 15 steps
# cross four epoch tails. Dropout makes each rank's RNG state matter.
RESUME = ["task=helpers:slow_mlp_task", "task_args.num_samples=192", "task_args.dropout=0.2", "task_args.sleep=0.01",
          "train.batch_size=8", "accum.steps=5", "train.max_steps=15", "log.every=1", "ckpt.every=2", "eval.every=5",
          "dist.nproc=2"]


def _final(run_dir):
    loaded = CheckpointManager(run_dir / "checkpoints").load()
    assert loaded.meta["step"] == 15, loaded.path
    return loaded.state


def test_a_2_rank_run_killed_with_sigkill_and_resumed_is_bitwise_equal(world, tmp_path):
    world.check("reference")  # the uninterrupted run: in the shared world
    expected = _final(world.root / "reference")

    run_dir = tmp_path / "killed"
    kill_at = random.Random("ddp-kill").randrange(3, 13)
    proc = subprocess.Popen(_stabletrain(*RESUME, f"run.dir={run_dir}"), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, run_dir, kill_at)
    for pid in [*descendants(proc.pid), proc.pid]:  # the launcher, torchrun and both ranks, at once
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert CheckpointManager(run_dir / "checkpoints").load().meta["step"] < 15
    _run([sys.executable, "-m", "stabletrain", "train", "--resume", str(run_dir)])  # dist.nproc=2 from config.yaml
    got = _final(run_dir)
    for name, value in expected["model"].items():
        assert torch.equal(got["model"][name], value), name
    for pid, state in expected["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(got["optimizer"]["state"][pid][k], v), (pid, k)
    assert got["stream"] == expected["stream"] and got["counters"] == expected["counters"]
    assert got["world_size"] == 2 and len(got["ranks"]) == 2
    for mine, theirs in zip(got["ranks"], expected["ranks"]):
        assert torch.equal(mine["rng"]["torch"], theirs["rng"]["torch"]) and mine["rng"]["python"] == theirs["rng"]["python"]
        assert mine["stream"] == theirs["stream"]
    assert not torch.equal(got["ranks"][0]["rng"]["torch"], got["ranks"][1]["rng"]["torch"])  # each rank its own stream
    assert sum(e["kind"] == "resume" for e in _events(run_dir)) == 1


# -- failure is clean ----------------------------------------------------------------------------

SLOW = ["task=helpers:slow_mlp_task", "task_args.num_samples=256", "task_args.sleep=0.05", "train.batch_size=8",
        "train.max_steps=500", "log.every=1", "ckpt.every=2", "eval.every=0"]


@pytest.mark.parametrize("how", ["sigkill", "hang"])
def test_when_rank_1_dies_or_hangs_rank_0_exits_with_a_clear_line_in_bounded_time(tmp_path, how):
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([*TORCHRUN, "-m", "stabletrain", "train", *FAST, *SLOW, "dist.timeout_s=5",
                             f"run.dir={run_dir}"], env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(proc, run_dir, 4)
        pids = _rank_pids(proc.pid)
        assert set(pids) == {0, 1}, pids
        t0 = time.time()
        os.kill(pids[1], signal.SIGKILL if how == "sigkill" else signal.SIGSTOP)
        while _alive(pids[0]) and time.time() - t0 < 60:
            time.sleep(0.05)
        took = time.time() - t0
        assert not _alive(pids[0]), "rank 0 still running 60 s after rank 1 went away"
        assert took < (10 if how == "sigkill" else 5 + 15), took  # hang: dist.timeout_s=5 and a margin
    finally:
        for pid in descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    # (on failure: rank 0's own lines come first, torchrun's summary of each rank last; CI once saw neither line of rank
    # 0's, after torchrun's SIGTERM to it, in a message that showed only the summary's tail)
    said = [x for x in err.splitlines() if x.startswith("stabletrain") or "exitcode" in x or "traceback :" in x]
    assert "stabletrain: error: rank 0: another rank exited or became unreachable" in err, (said, err[:1500])
    loaded = CheckpointManager(run_dir / "checkpoints").load()  # the last checkpoint is whole
    assert loaded.meta["step"] >= 2 and not loaded.problems


def test_a_launcher_killed_outright_takes_torchrun_and_every_rank_with_it(tmp_path):
    run_dir = tmp_path / "run"
    # In a session of its own (setsid), as a user's shell or a scheduler starts it: only the launcher is killed.
    proc = subprocess.Popen(_stabletrain(*SLOW, "dist.nproc=2", f"run.dir={run_dir}"), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    below = []
    try:
        wait_for_step(proc, run_dir, 3)  # past the step-2 save, which starts rank 0's writer process
        ranks, below = _rank_pids(proc.pid), descendants(proc.pid)
        writers = [pid for pid in below if b"stabletrain.records.checkpoint.writer" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        # torchrun, the two ranks, and rank 0's checkpoint writer process
        assert set(ranks) == {0, 1} and len(below) == 4 and len(writers) == 1, (ranks, below)
        recorded = json.loads((run_dir / "launch.json").read_text())["processes"]
        # the run dir names who runs on it: the ranks and their launcher (which restarts them, and holds the run meanwhile)
        assert sorted(p["pid"] for p in recorded) == sorted([*ranks.values(), proc.pid])
        os.kill(proc.pid, signal.SIGKILL)
        t0 = time.time()
        while any(_alive(pid) for pid in below) and time.time() - t0 < 10:
            time.sleep(0.05)
        assert not [pid for pid in below if _alive(pid)], "torchrun or a rank outlived its launcher by 10 s"
    finally:
        for pid in {*below, *descendants(proc.pid), proc.pid}:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=60)


@pytest.mark.parametrize("name, to_group", [("SIGTERM", False), ("SIGINT", True)])
def test_sigterm_to_the_launcher_checkpoints_every_rank_at_the_same_log_boundary(tmp_path, name, to_group):
    """SIGTERM to the launcher, and a terminal's Ctrl-C (SIGINT to its whole process group): each rank checkpoints at
    the boundary they agree on and the launch exits 0. Ctrl-C reached torchrun twice (the group's, then the launcher's),
    the ranks SIGINT then SIGTERM (a second signal: exit at once, often before the checkpoint), and torchrun's
    SignalException traceback ended the launch with exit 1."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_stabletrain(*SLOW, "log.every=3", "ckpt.every=0", "dist.nproc=2", f"run.dir={run_dir}"),
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    wait_for_step(proc, run_dir, 3)
    sig = getattr(signal, name)
    os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)  # passed on once, to both ranks
    out, err = proc.communicate(timeout=120)
    assert f"stabletrain: stopped by {name} at step" in out, (out, err[-2000:])
    assert proc.returncode == 0 and "Traceback" not in err and "SignalException" not in err, (proc.returncode, err[-3000:])
    loaded = CheckpointManager(run_dir / "checkpoints").load()
    assert loaded.meta["step"] % 3 == 0 and loaded.meta["step"] == steps_logged(run_dir) and len(loaded.state["ranks"]) == 2


def test_an_agent_killed_outright_is_said_with_how_to_continue(tmp_path):
    """SIGKILL to torchrun's agent (run.max_restarts=3): its ranks die with it and nothing restarts them; the launcher
    exited 247 (-9 & 0xff) without a word."""
    from stabletrain.distributed.launch import children

    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_stabletrain(*SLOW, "log.every=3", "ckpt.every=3", "dist.nproc=2", "run.max_restarts=3",
                                         f"run.dir={run_dir}"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        wait_for_step(proc, run_dir, 3)
        (agent,) = children(proc.pid)
        os.kill(agent, signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + 9, (proc.returncode, err[-2000:])
    assert (f"stabletrain: error: torchrun's agent (pid {agent}) was killed by SIGKILL; its ranks stopped with it and "
            f"nothing restarts them. Continue the run: the same command with run.resume=auto (or stabletrain train "
            f"--resume {run_dir.resolve()})") in err, err[-2000:]  # (a trial: it said RUN_DIR)


def test_a_nan_only_in_rank_1s_own_gradients_is_traced_to_rank_1_by_the_capture(world):
    # Rank 1's sample gives a finite loss and NaN gradients: the all-reduce mixes them into every rank's, so the
    # step's rows name no rank; the capture backpropagates the bad step on each rank alone and names rank 1.
    bad = BAD_AT_3
    world.check("grad-nan")
    run_dir = world.root / "grad_nan"
    events = _events(run_dir)
    nonfinite = [e for e in events if e["kind"] == "nonfinite"]
    assert [e["step"] for e in nonfinite] == [3] and nonfinite[0]["ranks"] == [] and math.isfinite(nonfinite[0]["loss"])
    incident = next(e for e in events if e["kind"] == "incident")
    assert incident["step"] == 3 and incident["ranks"] == [1] and incident["diagnosis"]["rank"] == 1
    bundle = load_bundle(run_dir / "incidents" / "step_000003")
    assert bundle["rank"] == 1 and bad in bundle["window"]["indices"][0]


# -- one collective per step ----------------------------------------------------------------------


def test_a_step_has_one_collective_the_gradient_all_reduce_which_carries_the_windows_numbers(world):
    world.check("collectives")
    out = world.root / "collectives_out"
    for rank in (0, 1):
        saved = torch.load(out / f"rank_{rank}.pt", weights_only=False)
        calls = saved["collectives"]
        steps = [(step, counts) for step, name, counts in calls if name == "step"]
        # Every step runs exactly one all-reduce per DDP bucket (the window's numbers ride one), nothing else
        # (keyed by the steps taken before it); the second one also has DDP's one-time bucket rebuild (rank 0
        # broadcasts the bucket order: two broadcasts), as any DDP loop has.
        assert [s for s, _ in steps] == list(range(8)), steps
        assert all(ran == buckets + (2 if s == 1 else 0) and buckets >= 1 for s, (ran, buckets) in steps), steps
        for step, name, stack in calls:  # DDP's own (C++) all-reduce: no Python collective inside a step at all
            if name == "step":
                continue
            assert "forward_backward" not in stack and "update" not in stack, (rank, step, name, stack[-6:])
            assert step in (0, 4, 8), (rank, step, name, stack[-6:])  # the log boundaries, the start and the end
        assert all(r["world_size"] == 2 and r["loss"] == r["loss"] for r in saved["history"])  # global, finite


@pytest.mark.parametrize("way, dtype, tol, rides", CARRIERS)
def test_the_carried_numbers_are_exact_every_way_and_in_any_bucket_dtype(world, way, dtype, tol, rides):
    # A bf16 model has no bucket that could hold a count exactly: data_parallel falls back to the hook, whose
    # numbers then travel in a float64 all-reduce of their own.
    world.check(f"carrier-{way}-{dtype}")
    out = world.root / f"carrier-{way}-{dtype}.json"
    for r in json.loads(out.read_text()):  # two windows: the second after DDP rebuilt its buckets
        assert r["count"] == 12.0  # 7 + 5
        assert r["mean_loss"] == pytest.approx(r["reference_loss"], rel=tol)
        assert r["grad_err"] <= tol * r["grad_scale"], r
        assert r["names"] and r["rides_a_param"] is rides  # the carrier parameter never shows in the model


# -- the sync count per interval -----------------------------------------------------------------


def test_each_rank_syncs_only_at_log_eval_and_checkpoint_boundaries(world):
    world.check("syncs")
    out = world.root / "syncs_out"
    # the keeper's save and its failed-saves verdict (rank 0 broadcasts it per checkpoint); InitWatch's one-time compare
    boundary = ("_log", "evaluate", "save", "check_failures", "on_fit_start", "after_first_forward",  # (InitWatch, once)
                "run_init_signal")  # + the step-0 report
    for rank in (0, 1):
        calls = torch.load(out / f"rank_{rank}.pt", weights_only=False)["syncs"]
        stray = [(s, f, w[-6:]) for s, f, w in calls if not any(b in w for b in boundary)
                 and not (s == 0 and "on_main" in w)]  # step 0: rank 0 says whether to write the step-0 checkpoint
        assert not stray, f"rank {rank}: syncs outside log/eval/checkpoint boundaries: {stray[:3]}"
        logged = [s for s, _, w in calls if "_log" in w]
        assert {s: logged.count(s) for s in set(logged)} == {5: 1, 10: 1, 15: 1, 20: 1, 25: 1}  # one per interval
        evals = [s for s, _, w in calls if "evaluate" in w]
        assert {s: evals.count(s) for s in set(evals)} == {10: 1, 20: 1, 25: 1}
    assert json.loads((world.root / "syncs" / "snapshot.json").read_text())["init_signal"]["passed"] is True  # rank 0's


# -- what counts as a lost peer --------------------------------------------------------------------


@pytest.fixture
def one_rank_group(tmp_path):
    """A real (gloo, one-rank) default process group in this process; destroyed after the test."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield dist
    finally:
        dist.destroy_process_group()


def _raised(fn):
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the exception object is what the test is about
        return err
    raise AssertionError("expected an exception")


class _SlowSample(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        time.sleep(1.5)
        return torch.zeros(1)


def test_a_lost_peer_is_told_by_the_exceptions_type_and_where_it_arose_not_by_its_words(one_rank_group):
    from stabletrain.distributed.peers import is_peer_failure

    dist = one_rank_group
    for kind in (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError):  # c10d's own failure types
        assert is_peer_failure(_raised(lambda kind=kind: (_ for _ in ()).throw(kind("NCCL watchdog: collective timed out"))))
    # A DataLoader that times out says "timed out": it is this rank's own data, not a peer.
    loader = torch.utils.data.DataLoader(_SlowSample(), num_workers=1, timeout=0.3)
    timeout = _raised(lambda: next(iter(loader)))
    assert type(timeout) is RuntimeError and "timed out" in str(timeout)
    assert not is_peer_failure(timeout) and not is_peer_failure(timeout, in_gradient_sync=True)
    # A user's own RuntimeError in gloo's words is still the user's.
    def user_code():
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer; nccl timed out")
    assert not is_peer_failure(_raised(user_code))
    # A RuntimeError raised inside a collective (here gloo refusing a sparse MAX all-reduce) is the collective's.
    inside = _raised(lambda: dist.all_reduce(torch.ones(1).to_sparse(), op=dist.ReduceOp.MAX))
    assert type(inside) is RuntimeError and is_peer_failure(inside)
    # DDP's forward broadcasts its buffers through a C++ call: gloo's failure there has DDP's function innermost (a peer
    # SIGKILLed during a forward read "the task's model forward raised RuntimeError"); its reducer's errors do not.
    ddp_file = torch.nn.parallel.distributed.__file__
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error 127.0.0.1: Connection reset by peer"
    unused = "Expected to have finished reduction in the prior iteration before starting a new one"
    for name, text, lost in (("_sync_module_buffers", "Connection reset", True), ("_pre_forward", gloo, True),
                             ("_pre_forward", unused, False)):  # (_pre_forward's bucket rebuild: a broadcast, or the
        scope: dict = {}  # user's unused parameters, on one line)
        exec(compile(f"def {name}():\n    raise RuntimeError({text!r})", ddp_file, "exec"), scope)
        assert is_peer_failure(_raised(scope[name])) is lost, (name, text)


def test_a_lost_peer_line_says_resume_by_hand_only_when_no_restart_is_left(monkeypatch):
    from stabletrain.distributed.peers import PeerLostError

    def line(count, most, good="step_000006"):
        for key, value in (("TORCHELASTIC_RESTART_COUNT", count), ("TORCHELASTIC_MAX_RESTARTS", most)):
            monkeypatch.setenv(key, str(value))
        return str(PeerLostError(0, "a training step", 7, good, "Connection closed by peer", "runs/a"))

    assert line(0, 0).endswith("; resume with: the script again, its Trainer(cfg, run_dir='runs/a', resume=True) "
                               "(Connection closed by peer)")  # (a script's own Trainer: not the command line's --resume)
    monkeypatch.setenv("STABLETRAIN_RUN_DIR_NOTE", "/tmp/note")  # (stabletrain's launcher: dist.nproc + run.max_restarts)
    assert ("; the launch restarts from LAST_GOOD (restart 2 of 3, run.max_restarts), unless the same failure keeps "
            "coming back (run.max_repeats) (") in line(1, 3)
    monkeypatch.delenv("STABLETRAIN_RUN_DIR_NOTE")  # a torchrun of the user's own: its --max-restarts (a trial)
    assert "(restart 2 of 3, torchrun's --max-restarts), unless" in line(1, 3)
    assert "resume with" in line(3, 3) and "restarts from" not in line(3, 3)  # the last restart is spent
    # before the first checkpoint: no LAST_GOOD to restart from (a trial: it named one)
    assert "no checkpoint was written; the launch restarts from step 0 (restart 1 of 3" in line(0, 3, None)


def test_out_of_a_ddp_backward_only_a_failed_gradient_all_reduce_is_a_lost_peer(one_rank_group):
    from stabletrain.distributed.carrier import data_parallel
    from stabletrain.distributed.peers import is_peer_failure

    torch.manual_seed(0)
    ddp, carrier = data_parallel(torch.nn.Linear(3, 2), None, sums=True)

    def backward(bad_graph=False):
        carrier.reset()
        out = ddp(torch.randn(4, 3)).sigmoid()
        if bad_graph:
            out.add_(1.0)  # sigmoid's backward needs its output: modified in place, the graph cannot run
        carrier.carry(torch.zeros(3), None, out.sum()).backward()

    backward()
    assert carrier.in_gradient_sync is False  # the all-reduce finished
    err = _raised(lambda: backward(bad_graph=True))
    assert type(err) is RuntimeError and "inplace" in str(err)
    assert carrier.in_gradient_sync is False and not is_peer_failure(err, in_gradient_sync=carrier.in_gradient_sync)

    def failing_all_reduce(state, bucket):  # what DDP's reducer gets from gloo when a peer is gone
        fut = torch.futures.Future()
        fut.set_exception(RuntimeError("Connection closed by peer"))
        return fut

    ddp, carrier = data_parallel(torch.nn.Linear(3, 2), None, sums=True)  # the reducer above is spent
    ddp.register_comm_hook(None, failing_all_reduce)
    err = _raised(backward)
    assert type(err) is RuntimeError and carrier.in_gradient_sync is True
    assert is_peer_failure(err, in_gradient_sync=carrier.in_gradient_sync)


def test_a_sharded_save_whose_background_staging_fails_is_written_synchronously(one_rank_group, tmp_path, monkeypatch):
    """torch 2.11's DCP stager cannot deep-copy a CUDA DTensor (KeyError: <class 'type'>, seen on an H200): the save is
    written in the loop's thread instead, said once in a warning, and the checkpoint is whole."""
    import torch.distributed.checkpoint as dcp

    from stabletrain.console import StableTrainWarning
    from stabletrain.records.checkpoint.shards import ShardedSaver

    def broken(*args, **kwargs):
        raise KeyError(type)

    monkeypatch.setattr(dcp, "async_save", broken)
    saver = ShardedSaver(timeout_s=30)
    for step in (1, 2):
        folder = tmp_path / f"step_{step}"
        if step == 1:
            with pytest.warns(StableTrainWarning, match=r"DCP's background staging failed .* written synchronously"):
                pending = saver.start({"w": torch.arange(6.0) * step}, folder, step)
        else:  # once: the next save goes straight to the synchronous write
            pending = saver.start({"w": torch.arange(6.0) * step}, folder, step)
        meta = pending.finish({})
        assert saver.synchronous and meta["keys"] == ["w"] and meta["bytes"] > 0
        loaded = {"w": torch.zeros(6)}
        dcp.load(loaded, checkpoint_id=str(folder / meta["dir"]))
        assert torch.equal(loaded["w"], torch.arange(6.0) * step)


def test_a_lost_peer_is_news_not_an_error_when_the_launch_restarts(monkeypatch, capsys):
    """A surviving rank's line under run.max_restarts with a restart left reads as what happens next, not a failure."""
    from stabletrain import cli
    from stabletrain.distributed.peers import PeerLostError

    def lost(args):
        raise PeerLostError(0, "a training step", 7, "step_000006", "Connection closed by peer", "runs/a")

    monkeypatch.setitem(cli.COMMANDS, "train", lost)
    for count, most, head in ((0, 2, "stabletrain: rank 0: "), (2, 2, "stabletrain: error: rank 0: ")):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(most))
        assert cli.main(["train"]) == 1
        assert capsys.readouterr().err.startswith(head)
    # under stabletrain's own launcher, whose restart line quotes it: nothing (a new user saw two lines for one restart)
    monkeypatch.setenv("STABLETRAIN_RUN_DIR_NOTE", "/tmp/note")
    for count, said in ((0, ""), (2, "stabletrain: error: rank 0: ")):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(count))
        assert cli.main(["train"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(said) and bool(err) == bool(said), err


def test_the_launcher_sweeps_the_processes_its_launch_left_behind(tmp_path):
    """A new-user trial: rank 1 of an FSDP2 run, SIGKILLed before its first sharded save was durable, left its DCP
    checkpoint process and multiprocessing's resource tracker running, reparented, holding the console's pipe (a
    `| tail` never returned). What carries the launch's mark and is no longer under the launcher is killed; what is
    still under it (a rank) and what carries another launch's mark are not."""
    from stabletrain.distributed.launch import LAUNCH_MARK_ENV, sweep_orphans

    me = os.getpid()
    marked = {**os.environ, LAUNCH_MARK_ENV: str(me)}
    # an orphan: started by a shell that exits at once (the sleep is reparented away from this process)
    subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $! > orphan.pid"], env=marked, cwd=tmp_path, check=True)
    orphan = int((tmp_path / "orphan.pid").read_text())
    other = subprocess.run(["sh", "-c", "sleep 60 >/dev/null 2>&1 & echo $!"], env={**os.environ, LAUNCH_MARK_ENV: "1"},
                           capture_output=True, text=True, check=True)
    stranger = int(other.stdout)
    child = subprocess.Popen(["sleep", "60"], env=marked)  # still under the launcher: a rank
    try:
        time.sleep(0.2)
        assert sweep_orphans(me) == [orphan]
        time.sleep(0.2)
        assert not Path(f"/proc/{orphan}").exists() or "Z" in Path(f"/proc/{orphan}/stat").read_text().split()[2]
        assert child.poll() is None and Path(f"/proc/{stranger}").exists()
    finally:
        child.kill()
        child.wait()
        os.kill(stranger, signal.SIGKILL)


def test_a_death_before_the_first_checkpoint_says_to_start_over_not_to_resume(tmp_path):
    """A new-user trial: rank 1 died before any checkpoint was durable and the launcher's line said 'continue the run:
    stabletrain train --resume RUN', which then failed ('no checkpoint in .../checkpoints')."""
    from stabletrain.distributed.continuing import continue_line as _continue

    (tmp_path / "checkpoints").mkdir()
    assert _continue(tmp_path) == (f"; no checkpoint of it was written: start it over (the same command with "
                                   f"run.overwrite=true, run.dir={tmp_path})")
    (tmp_path / "checkpoints" / "step_000010.tmp-7").mkdir()  # a save that never completed: still nothing to resume
    assert "start it over" in _continue(tmp_path)
    (tmp_path / "checkpoints" / "step_000010").mkdir()  # written, LAST_GOOD not yet moved to it: the resume finds it
    assert _continue(tmp_path) == f"; continue the run: stabletrain train --resume {tmp_path}"
    (tmp_path / "checkpoints" / "step_000010").rmdir()
    (tmp_path / "checkpoints" / "LAST_GOOD").write_text("step_000010")  # (it says where: the run's last record is later)
    assert _continue(tmp_path) == f"; continue the run from step 10 (LAST_GOOD): stabletrain train --resume {tmp_path}"


@pytest.mark.slow
def test_a_spike_bursts_course_is_let_go_by_every_rank_alike(tmp_path):
    """A new user's trial: the docs' diverging task on 2 ranks. Its spike at step 9 was diagnosed 'state' on rank 0
    alone (rank 0 diagnoses), so under guard.on_spike=warn rank 0 let the burst's course go (steps 11-15: 'not captured
    again while it lasts') while rank 1, knowing no class, began a capture: the ranks met different collectives and the
    run died after 120 s. Every rank takes the capture's verdict from rank 0's diagnosis."""
    run_dir = tmp_path / "run"
    root = Path(__file__).resolve().parents[1]  # (examples/ is importable from the repository's root)
    child = {**env(), "PYTHONPATH": os.pathsep.join([str(root), env()["PYTHONPATH"]])}
    res = subprocess.run([sys.executable, "-m", "stabletrain", "train", "task=examples.diverging_task:make_task",
                          "optim.name=sgd", "optim.lr=2.5", "optim.weight_decay=0", "clip.max_norm=null",
                          "sched.decay=constant", "train.batch_size=4", "train.max_steps=20", "log.every=5",
                          "ckpt.every=10", "data.shuffle=false", "dist.nproc=2", f"run.dir={run_dir}", *FAST],
                         env=child, capture_output=True, text=True, timeout=200)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "spike at step 9 (every rank's batch): state: " in res.stderr + res.stdout
    assert ("the burst of loss spikes captured at step 9 (state) goes on (steps 11-15 so far): not captured again while "
            "it lasts") in res.stderr + res.stdout
    assert [e["step"] for e in events(run_dir) if e["kind"] == "incident"] == [9]
