"""FSDP2 (``dist.strategy=fsdp``) on CPU: gloo, 2 processes under torchrun, against one process.

The slow tests share one 2-rank torchrun world (``dist_world.py``: a module fixture runs every scenario
in turn, each test asserts on its own): what each rank of ``stabletrain train dist.nproc=2
dist.strategy=fsdp`` runs (the CLI's train command, resumes included), and the worker in ``fsdp_tasks.py``
(which leaves each rank's full parameters and history on disk). The launcher and torchrun themselves are
tested end to end under FSDP in test_fsdp_checkpoint.py (SIGKILL and resume). The fast ones check the
pieces on one process.
"""

import json

import pytest
import torch
from fsdp_tasks import BlockNet
from helpers import cfg
from multiproc import FAST, World, cli, events

from stabletrain import Trainer
from stabletrain.config import ConfigError
from stabletrain.data import EpochOrder
from stabletrain.distributed.fsdp import ShardedNumerics, default_blocks, shard_model
from stabletrain.numerics import all_params_finite, grad_norms
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.tasks.gpt import GPT

pytestmark = pytest.mark.slow  # 2-process torchrun runs

_events = events



# -- the pieces, on one process ------------------------------------------------------------------


def test_the_default_blocks_are_the_children_of_the_outermost_module_lists():
    net = BlockNet(depth=3)
    assert default_blocks(net) == list(net.layers)
    gpt = GPT(vocab_size=16, seq_len=8, n_layer=2, n_head=2, n_embd=8)
    assert default_blocks(gpt) == list(gpt.blocks)
    assert default_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []  # the root is the only unit


def test_blocks_that_are_not_submodules_of_the_model_are_refused_naming_task_blocks():
    with pytest.raises(ValueError, match="Task.blocks: Linear is not a submodule"):
        shard_model(BlockNet(), [torch.nn.Linear(2, 2)])


def test_dist_strategy_accepts_ddp_and_fsdp_and_refuses_anything_else_naming_the_key():
    assert cfg().dist.strategy == "ddp" and cfg().dist.reshard_after_forward is True
    assert cfg("dist.strategy=fsdp", "dist.reshard_after_forward=false").dist.reshard_after_forward is False
    with pytest.raises(ConfigError, match="'dist.strategy'.*'zero'"):
        cfg("dist.strategy=zero")


def test_fsdp_on_one_process_trains_as_plain_one_process():
    a = Trainer(cfg("task=helpers:varlen_task", "train.max_steps=3", "dist.strategy=fsdp"))
    b = Trainer(cfg("task=helpers:varlen_task", "train.max_steps=3"))
    a.fit(), b.fit()
    for (name, p), (_, q) in zip(a.module.named_parameters(), b.module.named_parameters()):
        assert torch.equal(p, q), name


def test_running_statistics_under_fsdp_are_said_to_be_each_ranks_own():
    """A new user's BatchNorm model under FSDP resumed 5e-3 off (each rank's statistics its own, one rank's saved),
    unsaid: the strategy says it at the start; a model without them hears nothing."""
    from stabletrain.distributed.fsdp import running_stats_note

    bn = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    assert running_stats_note(bn).startswith("dist.strategy=fsdp: the running statistics of 1 are each rank's own")
    assert running_stats_note(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8))) is None
    assert running_stats_note(torch.nn.BatchNorm1d(8, track_running_stats=False)) is None


def test_sharded_numerics_on_plain_tensors_equal_the_local_ones():
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3)), torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2))]
    for p in params[:2]:
        p.grad = torch.randn_like(p)
    numerics = ShardedNumerics()
    total, per = numerics.grad_norms(params)
    want_total, want_per = grad_norms(params)
    assert torch.allclose(total, want_total, rtol=1e-6) and torch.allclose(per, want_per, rtol=1e-6)
    assert per[2] == 0  # no grad: zero
    assert bool(numerics.all_params_finite(params)) and bool(all_params_finite(params))
    before = numerics.snapshot(params)
    with torch.no_grad():
        params[0].add_(1.0)
    update, ratio = numerics.update_norm(params, before)
    assert update == pytest.approx(15 ** 0.5, rel=1e-6)
    assert ratio == pytest.approx(15 ** 0.5 / torch.linalg.vector_norm(torch.cat([b.flatten() for b in before])).item(),
                                  rel=1e-6)
    with torch.no_grad():
        params[1][2] = float("nan")
    assert not bool(numerics.all_params_finite(params))


# -- two processes against one ---------------------------------------------------------------------

pytest_slow = pytest.mark.slow  # 2-process torchrun runs

# 2 ranks x 4 samples x accum 3 against 1 process x 8 samples x accum 3: the same 24 samples per step.
# 60 samples = 7 global micro-batches of 8 and a tail of 4 (2 per rank); windows 3, 3, 2 (tail included).
EQUIV = {
    "regression": ["task=helpers:regression_task", "task_args.n=60"],  # Sequential: the root is the only unit
    "varlen": ["task=helpers:varlen_task"],  # per-token counts differ per rank and per micro-batch
    "blocks": ["task=fsdp_tasks:blocks_task"],  # one unit per ModuleList child and the root
    "named_blocks_kept": ["task=fsdp_tasks:blocks_task", "task_args.named_blocks=true",
                          "dist.reshard_after_forward=false"],
    # torch has no DTensor rule for fused SGD: a foreach SGD (host-read skip) against one process's fused one
    "sgd_momentum": ["task=fsdp_tasks:blocks_task", "optim.name=sgd", "optim.momentum=0.9", "optim.nesterov=true"],
}
COMMON = ["accum.steps=3", "train.max_steps=7", "log.every=1", "ckpt.every=0", "eval.every=0", "optim.lr=0.01",
          "sched.warmup_steps=0", "clip.max_norm=0.5"]
#: FSDP reduce-scatters where DDP all-reduces and sums shards' squared norms: rounding differs, not math.
RTOL, ATOL = 1e-5, 1e-6


#: The NaN sample (test_parameters_are_dtensor_shards...): step 3 (batch 4 per rank, accum 1) reads global
#: micro-batch 2; rank 1 takes its second half.
NAN_INDEX = EpochOrder(60, 4, seed=0, shuffle=True, rank=1, world_size=2).micro_batches(0)[2][1]
RESUME = ["task=fsdp_tasks:blocks_task", "train.batch_size=4", "accum.steps=2", "log.every=2", "ckpt.every=2",
          "eval.every=3", "sched.decay=constant", "sched.warmup_steps=0", "clip.max_norm=0.5", "dist.nproc=2",
          "dist.strategy=fsdp"]
ACROSS = ["task=fsdp_tasks:blocks_task", "train.batch_size=4", "accum.steps=2", "log.every=2", "ckpt.every=2",
          "eval.every=0", "sched.decay=constant", "sched.warmup_steps=0", "clip.max_norm=0.5", "dist.nproc=2"]
STRATEGIES = [("ddp", "fsdp"), ("fsdp", "ddp")]


def _scenarios(root):
    """Every 2-rank run of this file, in the order the world runs them; results under ``root``."""
    out = [(f"equiv-{name}", *cli(*args, *COMMON, "train.batch_size=4", "dist.nproc=2", "dist.strategy=fsdp",
                                 f"run.dir={root / name}")) for name, args in EQUIV.items()]
    out.append(("nan", "fsdp_tasks:main", [root / "nan_out", "task=fsdp_tasks:nan_blocks_task",
                                           f"task_args.bad_index={NAN_INDEX}", "dist.strategy=fsdp", "train.batch_size=4",
                                           "train.max_steps=6", "log.every=3", "ckpt.every=0", "eval.every=0",
                                           f"run.dir={root / 'nan'}", *FAST]))
    resume = root / "resume"
    out += [("resume-straight", *cli(*RESUME, "train.max_steps=8", f"run.dir={resume / 'straight'}")),
            ("resume-parts", *cli(*RESUME, "train.max_steps=4", f"run.dir={resume / 'parts'}")),
            ("resume-resumed", *cli("--resume", resume / "parts", "train.max_steps=8"))]
    # dist_tasks.py: the DDP tests' worker, which counts every Tensor -> host conversion
    out.append(("syncs", "dist_tasks:main", [root / "syncs_out", "--count-syncs", "task=fsdp_tasks:blocks_task",
                                             "dist.strategy=fsdp", "train.batch_size=4", "accum.steps=2",
                                             "train.max_steps=12", "log.every=4", "eval.every=8", "ckpt.every=0",
                                             "clip.max_norm=0.5", f"run.dir={root / 'syncs'}", *FAST]))
    for precision in ("bf16", "fp16"):
        out.append((precision, *cli("task=fsdp_tasks:blocks_task", *COMMON, "train.batch_size=4", "dist.nproc=2",
                                    "dist.strategy=fsdp", f"precision={precision}", f"run.dir={root / precision}")))
    for first, then in STRATEGIES:
        across = root / f"{first}-{then}"
        out += [(f"{first}-{then}-straight", *cli(*ACROSS, f"dist.strategy={first}", "train.max_steps=8",
                                                  f"run.dir={across / 'straight'}")),
                (f"{first}-{then}-parts", *cli(*ACROSS, f"dist.strategy={first}", "train.max_steps=4",
                                               f"run.dir={across / 'parts'}")),
                (f"{first}-{then}-resumed", *cli("--resume", across / "parts", "train.max_steps=8",
                                                 f"dist.strategy={then}"))]
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    return World(root, _scenarios(root))


@pytest_slow
@pytest.mark.parametrize("name", list(EQUIV))
def test_fsdp_with_accumulation_equals_one_process_on_the_same_samples(world, tmp_path, name):
    root = world.root
    world.check(f"equiv-{name}")
    args = [a for a in EQUIV[name] if not a.startswith("dist.")]
    single = Trainer(cfg(*args[1:], *COMMON, "train.batch_size=8", task=args[0].split("=", 1)[1]),
                     run_dir=tmp_path / "single")
    single.fit()
    run_dir = root / name
    fsdp = CheckpointManager(run_dir / "checkpoints").load(full=True)
    assert fsdp.meta["step"] == 7 and fsdp.meta["world_size"] == 2
    for key, value in single.module.state_dict().items():  # the checkpoint holds the full (gathered) model
        got = fsdp.state["model"][key]
        assert torch.allclose(got, value, rtol=RTOL, atol=ATOL), (key, (got - value).abs().max())
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single.history], rel=RTOL)
    # the global pre-clip norm and each parameter's share are the one-process ones
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in single.history], rel=RTOL)
    assert [r["clip_rate"] for r in records] == [r["clip_rate"] for r in single.history]
    assert [r["samples_seen"] for r in records] == [r["samples_seen"] for r in single.history]
    assert [r["tokens_seen"] for r in records] == [r["tokens_seen"] for r in single.history]
    # the optimizer state is the one-process format (integer ids) and the same values
    want = single.optimizer.state_dict()
    impl = ("lr", "fused", "foreach")  # the lr is a host float where the optimizer is not fused (sgd under FSDP)
    assert [{k: v for k, v in g.items() if k not in impl} for g in fsdp.state["optimizer"]["param_groups"]] == [
        {k: v for k, v in g.items() if k not in impl} for g in want["param_groups"]]
    assert [float(g["lr"]) for g in fsdp.state["optimizer"]["param_groups"]] == pytest.approx(
        [float(g["lr"]) for g in want["param_groups"]], rel=1e-6)
    for i, st in want["state"].items():
        for k, v in st.items():
            assert torch.allclose(fsdp.state["optimizer"]["state"][i][k], v, rtol=RTOL, atol=ATOL), (i, k)


@pytest_slow
def test_parameters_are_dtensor_shards_and_a_nan_only_rank_1_sees_skips_the_step_on_both_ranks(world):
    root = world.root
    assert NAN_INDEX not in EpochOrder(60, 4, seed=0, shuffle=True, rank=0, world_size=2).micro_batches(0)[2]
    world.check("nan")
    run_dir, out = root / "nan", root / "nan_out"
    ranks = [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        assert r["kinds"] == ["DTensor"] and r["step"] == 6
        assert [h["num_skipped"] for h in r["history"]] == [1, 0]
        assert [h["grad_norm"] for h in r["history"]] == [h["grad_norm"] for h in ranks[0]["history"]]
    for key, value in ranks[0]["params"].items():  # both skipped the same step: the shards agree
        assert torch.equal(value, ranks[1]["params"][key]), key
        assert torch.isfinite(value).all(), key
    events = _events(run_dir)
    assert [e["step"] for e in events if e["kind"] == "skip"] == [3]
    nonfinite = [e for e in events if e["kind"] == "nonfinite"]
    assert len(nonfinite) == 1 and nonfinite[0]["step"] == 3 and nonfinite[0]["ranks"] == [1]
    saved = CheckpointManager(run_dir / "checkpoints").load(full=True)  # the last checkpoint is finite and after the skip
    assert saved.meta["step"] == 6
    assert all(torch.isfinite(v).all() for v in saved.state["model"].values())


@pytest_slow
def test_an_fsdp_run_resumed_at_the_same_world_size_is_bitwise_equal_to_an_uninterrupted_one(world):
    root = world.root
    for part in ("straight", "parts", "resumed"):
        world.check(f"resume-{part}")
    base = root / "resume"
    straight = CheckpointManager(base / "straight" / "checkpoints").load(full=True)
    parts = CheckpointManager(base / "parts" / "checkpoints").load(full=True)
    assert straight.meta["step"] == parts.meta["step"] == 8
    for key, value in straight.state["model"].items():
        assert torch.equal(parts.state["model"][key], value), key
    for i, st in straight.state["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(parts.state["optimizer"]["state"][i][k], v), (i, k)
    assert any(e["kind"] == "resume" for e in _events(base / "parts"))


@pytest_slow
def test_each_rank_syncs_only_at_log_eval_and_checkpoint_boundaries_under_fsdp(world):
    root = world.root
    world.check("syncs")
    out = root / "syncs_out"
    boundary = ("_log", "evaluate", "save", "check_failures", "on_fit_start")  # check_failures: per checkpoint
    for rank in (0, 1):
        calls = torch.load(out / f"rank_{rank}.pt", weights_only=False)["syncs"]
        stray = [(s, f, w[-6:]) for s, f, w in calls if not any(b in w for b in boundary)
                 and not (s == 0 and "on_main" in w)]
        assert not stray, f"rank {rank}: syncs outside log/eval/checkpoint boundaries: {stray[:3]}"
        logged = [s for s, _, w in calls if "_log" in w]
        assert {s: logged.count(s) for s in set(logged)} == {4: 1, 8: 1, 12: 1}  # one per interval


@pytest_slow
def test_bf16_under_fsdp_with_accumulation_tracks_fp32_on_one_process(world):
    # MixedPrecisionPolicy: bf16 gathered parameters, fp32 gradient reduction; the window rescales the fp32
    # gradients FSDP accumulates between syncs. bf16 compute: within 1e-2 (loss) and 3e-2 (grad norm).
    root = world.root
    world.check("bf16")
    run_dir = root / "bf16"
    single = Trainer(cfg(*COMMON, "train.batch_size=8", "precision=fp32", task="fsdp_tasks:blocks_task"))
    single.fit()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["num_skipped"] == 0 for r in records)
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single.history], rel=1e-2)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in single.history], rel=3e-2)


@pytest_slow
def test_fp16_under_fsdp_skips_the_same_overflow_steps_with_the_same_loss_scale_as_one_process(world):
    # The GradScaler's found_inf is all-reduced across the shards, so every rank backs off together.
    root = world.root
    world.check("fp16")
    run_dir = root / "fp16"
    single = Trainer(cfg(*COMMON, "train.batch_size=8", "precision=fp16", task="fsdp_tasks:blocks_task"))
    single.fit()
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_skipped"] for r in records] == [r["num_skipped"] for r in single.history]
    assert sum(r["num_skipped"] for r in records) >= 1  # the initial scale overflows: the backoff is exercised
    assert [r["loss_scale"] for r in records] == [r["loss_scale"] for r in single.history]
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in single.history], rel=1e-3)
    norms = [(float(r["grad_norm"]), h["grad_norm"]) for r, h in zip(records, single.history) if h["grad_norm"] == h["grad_norm"]]
    assert norms and all(a == pytest.approx(b, rel=1e-3) for a, b in norms)


@pytest_slow
@pytest.mark.parametrize("first,then", STRATEGIES)
def test_a_checkpoint_resumes_under_the_other_strategy_and_continues_the_run(world, first, then):
    root = world.root
    for part in ("straight", "parts", "resumed"):
        world.check(f"{first}-{then}-{part}")
    base = root / f"{first}-{then}"
    straight = CheckpointManager(base / "straight" / "checkpoints").load(full=True)
    parts = CheckpointManager(base / "parts" / "checkpoints").load(full=True)
    assert parts.meta["step"] == 8
    for key, value in straight.state["model"].items():  # the same math; the reductions round differently
        assert torch.allclose(parts.state["model"][key], value, rtol=RTOL, atol=ATOL), key
    for i, st in straight.state["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.allclose(parts.state["optimizer"]["state"][i][k], v, rtol=RTOL, atol=ATOL), (i, k)
