"""Resuming at another world size (a resharded resume): 2 -> 1 and 1 -> 2, under FSDP2 and DDP.

The model and optimizer state are full (unsharded) in the checkpoint and load into any world size; the
data continues from the same global sample position (stabletrain.data); rank r takes rank r's RNG state
and a new rank a seeded one. With the global batch kept (2 ranks x 4 -> 1 rank x 4 x accum 2, or 1 x 8),
every step after the resume trains on exactly the samples the uninterrupted run trained on, and its loss
matches within RTOL: the same math, the reductions add in another order.
"""

import json
import shutil

import numpy as np
import pytest
import torch
from ckpt_worker import record_windows
from helpers import cfg
from multiproc import FAST, World, events

from stabletrain import Trainer
from stabletrain.records.checkpoint.manager import CheckpointManager

pytestmark = pytest.mark.slow  # 2-process torchrun runs

TASK = "fsdp_tasks:blocks_task"  # 60 variable-length sequences (a token-count loss): 8 samples per step, tail of 4
ARGS = ["train.batch_size=4", "log.every=1", "ckpt.every=3", "eval.every=0", "sched.decay=constant", "sched.warmup_steps=0",
        "clip.max_norm=0.5", "optim.lr=0.01", *FAST]
STEPS, CUT = 12, 5  # 60 samples = 8 steps per epoch: the resume is mid-epoch 0 and the run crosses into epoch 1
#: Measured (7 steps after the resume): largest relative loss difference 9e-8 (FSDP 2 -> 1), 1.8e-7 (DDP 2 -> 1),
#: 1.1e-7 (1 -> 2 FSDP); parameters within the same bounds as the FSDP / DDP equivalence with one process.
RTOL, ATOL = 1e-5, 1e-6


def worker(out, *args):
    """A :class:`World` scenario: ``ckpt_worker.py`` trains (or resumes) on both ranks, each writing ``out/rank_R.pt``."""
    return "ckpt_worker:main", [out, f"task={TASK}", *ARGS, *args]


def rank_files(out):
    """Each rank's ``out/rank_R.pt``, in rank order."""
    return [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]


def in_process(run_dir, *args, resume=False):
    """Train (or resume) ``run_dir`` in this process; return the trainer, its windows and its RNG state after setup."""
    trainer = Trainer(cfg(*ARGS, *args, f"run.dir={run_dir}", task=TASK), run_dir=run_dir, resume=resume)
    rng = torch.get_rng_state()
    windows = record_windows(trainer)
    trainer.fit()
    return trainer, windows, rng


def samples_by_step(*ranks_windows):
    """{step: the window's global samples, micro-batch by micro-batch and rank by rank} from each rank's windows."""
    out = {}
    for per_rank in zip(*ranks_windows):
        step, k = per_rank[0][0], len(per_rank[0][3])
        out[step] = [i for m in range(k) for w in per_rank for i in w[3][m]]
    return out


def losses(history, after=CUT):
    return {r["step"]: r["loss"] for r in history if r["step"] > after}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Every 2-rank run of this file in one shared torchrun world (``dist_world.py``), in turn.

    Per strategy, an uninterrupted run of STEPS steps and one stopped at CUT (checkpointed there), with
    full-state checkpoints (FSDP's sharded ones resume on one process in test_fsdp_checkpoint.py). Then the
    1 -> 2 resume: its one-process runs train here first (a copy of the one stopped at CUT is resumed).
    """
    root = tmp_path_factory.mktemp("reshard")
    scenarios = []
    for strategy in ("fsdp", "ddp"):
        keys = [f"dist.strategy={strategy}", "dist.checkpoint=full"]
        scenarios += [(f"{strategy}-straight", *worker(root / f"{strategy}_out_straight", *keys,
                                                       f"train.max_steps={STEPS}", f"run.dir={root / strategy / 'straight'}")),
                      (f"{strategy}-parts", *worker(root / f"{strategy}_out_parts", *keys, f"train.max_steps={CUT}",
                                                    f"run.dir={root / strategy / 'parts'}"))]
    one = root / "one"
    straight, straight_windows, _ = in_process(one / "straight", "train.batch_size=8", f"train.max_steps={STEPS}")
    in_process(one / "parts", "train.batch_size=8", f"train.max_steps={CUT}")
    shutil.copytree(one / "parts", one / "resumed")
    scenarios.append(("1-to-2", *worker(one / "out", "dist.strategy=fsdp", "dist.nproc=2", f"train.max_steps={STEPS}",
                                        f"resume={one / 'resumed'}", f"run.dir={one / 'resumed'}")))  # 2 x 4: 8 per step
    shared = World(root, scenarios)
    shared.one = straight, straight_windows
    return shared


@pytest.fixture(scope="module", params=["fsdp", "ddp"])
def two_ranks(request, world):
    """(strategy, its folder, the uninterrupted run's ranks)."""
    for part in ("straight", "parts"):
        world.check(f"{request.param}-{part}")
    return request.param, world.root / request.param, rank_files(world.root / f"{request.param}_out_straight")


def test_a_2_rank_run_resumed_on_1_process_trains_on_the_same_samples_and_continues_the_curve(two_ranks, tmp_path,
                                                                                             capsys):
    strategy, root, straight = two_ranks
    run_dir = tmp_path / "parts"
    shutil.copytree(root / "parts", run_dir)
    saved = CheckpointManager(run_dir / "checkpoints").load()
    assert saved.meta["step"] == CUT and saved.meta["world_size"] == 2 and "dcp" not in saved.meta
    # the global batch kept: FSDP's as 1 x 4 x accum 2, DDP's as 1 x 8
    keep = ["accum.steps=2"] if strategy == "fsdp" else ["train.batch_size=8"]
    trainer, windows, rng = in_process(run_dir, *keep, f"dist.strategy={strategy}", f"train.max_steps={STEPS}",
                                       resume=True)
    want = samples_by_step(*(r["windows"] for r in straight))
    got = samples_by_step(windows)
    assert sorted(got) == list(range(CUT + 1, STEPS + 1))
    assert {s: got[s] for s in got} == {s: want[s] for s in got}  # the same samples, step by step, in the same order
    assert [w[1] for w in windows] == [0, 0, 0, 1, 1, 1, 1]  # steps 6-8 end epoch 0 (8: its tail of 4)
    assert torch.equal(rng, saved.state["ranks"][0]["rng"]["torch"])  # rank 0 took rank 0's RNG state
    before = losses(straight[0]["history"])
    after = losses(trainer.history)
    assert after == pytest.approx(before, rel=RTOL)
    for name, p in trainer.module.named_parameters():
        assert torch.allclose(p.detach(), straight[0]["params"][name], rtol=RTOL, atol=ATOL), name
    resume = [e for e in events(run_dir) if e["kind"] == "resume"][-1]
    gb = 8
    assert {k: resume[k] for k in ("step", "resharded", "old_world_size", "new_world_size", "old_global_batch",
                                   "new_global_batch", "epoch", "sample_offset", "bitwise_expected")} == {
        "step": CUT, "resharded": True, "old_world_size": 2, "new_world_size": 1, "old_global_batch": gb,
        "new_global_batch": gb, "epoch": 0, "sample_offset": CUT * gb, "bitwise_expected": False}
    assert "bitwise equality with the uninterrupted run is not expected" in resume["reason"]
    assert "resharded from 2 to 1 process(es)" in capsys.readouterr().out
    # the report's summary says it too (a new-user trial: 'Resumed once, at step 80.', the reshard in the events alone)
    from stabletrain.report import health_summary, load_run

    assert (f"At step {CUT} the run went on under 1 process (it had 2): the same global batch, 8 samples per step."
            in health_summary(load_run(run_dir)).text)
    # snapshot.json keeps the first launch (world size 2) and adds each resume's own: its step, command, world size
    snapshot = json.loads((run_dir / "snapshot.json").read_text())
    assert snapshot["world_size"] == 2 and [(r["step"], r["world_size"]) for r in snapshot["resumes"]] == [(CUT, 1)]
    assert snapshot["resumes"][0]["command"] and snapshot["resumes"][0]["device"]["type"] == "cpu"


def test_a_1_process_run_resumed_on_2_fsdp_ranks_trains_on_the_same_samples_and_seeds_the_new_rank(world):
    one = world.root / "one"
    straight, straight_windows = world.one
    saved = CheckpointManager(one / "parts" / "checkpoints").load()  # the copy in one / "resumed" went on to STEPS
    world.check("1-to-2")
    ranks = rank_files(one / "out")
    want = samples_by_step(straight_windows)
    got = samples_by_step(*(r["windows"] for r in ranks))
    assert sorted(got) == list(range(CUT + 1, STEPS + 1)) and got == {s: want[s] for s in got}
    assert torch.equal(ranks[0]["rng"], saved.state["rng"]["torch"])  # rank 0: the one process's RNG state
    seed = int(np.random.SeedSequence([0, 1, CUT]).generate_state(1)[0])  # rank 1 did not exist: seeded
    assert torch.equal(ranks[1]["rng"], torch.manual_seed(seed).get_state())
    assert losses(ranks[0]["history"]) == pytest.approx(losses(straight.history), rel=RTOL)
    for name, p in straight.module.named_parameters():
        assert torch.allclose(ranks[0]["params"][name], p.detach(), rtol=RTOL, atol=ATOL), name
    resume = [e for e in events(one / "resumed") if e["kind"] == "resume"][-1]
    assert (resume["old_world_size"], resume["new_world_size"], resume["old_global_batch"],
            resume["new_global_batch"]) == (1, 2, 8, 8)


def test_a_resharded_resume_still_refuses_other_config_changes_and_a_same_size_one_refuses_the_batch(tmp_path):
    in_process(tmp_path / "one", "train.batch_size=8", "train.max_steps=2")
    with pytest.raises(ValueError, match=r"train.batch_size: checkpoint 8, now 4.*Under another world size "
                                         r"train.batch_size, accum.steps may change too"):
        Trainer(cfg(*ARGS, "train.max_steps=4", f"run.dir={tmp_path / 'one'}", task=TASK), run_dir=tmp_path / "one",
                resume=True)
