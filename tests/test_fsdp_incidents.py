"""Incidents under FSDP2 (``dist.strategy=fsdp``): the local-shard snapshot, the capture on every rank, the diagnosis.

The slow test runs this file as a torchrun worker (2 gloo processes; see :func:`worker`): the same
run twice in one process group, with and without incident capture, each rank leaving what it saw
on disk. The fast test shards a model on a one-process group in this process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from fsdp_tasks import BlockNet
from helpers import PreStepState, cfg
from multiproc import FAST, TORCHRUN, events, run
from torch.utils._python_dispatch import TorchDispatchMode

from stabletrain.data import EpochOrder
from stabletrain.distributed.fsdp import is_local_state, load_local_state_dicts, local_state_dicts, shard_model
from stabletrain.numerics import unique_params
from stabletrain.policies.optim import build_optimizer
from stabletrain.policies.schedule import LRSchedule
from stabletrain.records.bundles import load_bundle
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.records.staging import StateStager

# -- the local-shard snapshot, on a one-process group ---------------------------------------------


def _locals(model, optimizer):
    """Clones of every local shard and optimizer state tensor, and the lr, for bitwise comparison."""
    out = {n: t._local_tensor.clone() if hasattr(t, "_local_tensor") else t.clone()
           for n, t in [*model.named_parameters(), *model.named_buffers()]}
    for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"]):
        for k, v in optimizer.state.get(p, {}).items():
            out[f"optim.{i}.{k}"] = (v._local_tensor if hasattr(v, "_local_tensor") else v).clone()
    out["lr"] = torch.as_tensor(optimizer.param_groups[0]["lr"]).clone()
    return out


def _assert_bitwise(got, want):
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_local_shard_snapshot_is_copied_back_in_place_bitwise_and_training_goes_on_identically(one_process_group):
    torch.manual_seed(0)
    model = shard_model(BlockNet())
    named = unique_params(model)
    optimizer = build_optimizer(named, cfg().optim, torch.device("cpu"))  # fused AdamW, as the Trainer's
    schedule = LRSchedule(optimizer, warmup_steps=4, max_steps=20)  # a tensor lr, rewritten in place each step
    x = torch.randn(4, 5, 3)

    def step():
        optimizer.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        optimizer.step()
        schedule.step(True)

    def snapshot_now():  # as the Trainer's state_dict(local=True), staged into host buffers as the recorder does
        model_state, optim_state = local_state_dicts(model, optimizer)
        return StateStager().stage({"model": model_state, "optimizer": optim_state, "schedule": schedule.state_dict()})[0]

    def restore(snap):  # as the Trainer's load_state_dict: the schedule after the optimizer
        load_local_state_dicts(model, optimizer, snap["model"], snap["optimizer"])
        schedule.load_state_dict(snap["schedule"])

    empty = snapshot_now()  # before the first step: no optimizer state
    assert all(is_local_state(entry) for entry in (empty["model"], empty["optimizer"]))
    assert all(v.device.type == "cpu" for v in empty["model"]["tensors"].values())
    step(), step()
    want = _locals(model, optimizer)
    snapshot = snapshot_now()
    storage = {n: p._local_tensor.data_ptr() for n, p in model.named_parameters()}
    step(), step(), step()
    assert not torch.equal(_locals(model, optimizer)["stem.weight"], want["stem.weight"])  # the state moved on
    restore(snapshot)
    _assert_bitwise(_locals(model, optimizer), want)
    assert {n: p._local_tensor.data_ptr() for n, p in model.named_parameters()} == storage  # in place
    step()
    after_restore = _locals(model, optimizer)

    # Back to before the first step: the optimizer's state is dropped; then the stepped snapshot into that
    # empty optimizer: its state is recreated as DTensors like the parameters, and the next step is the same.
    restore(empty)
    assert not optimizer.state
    restore(snapshot)
    _assert_bitwise(_locals(model, optimizer), want)
    first = next(iter(model.parameters()))
    assert type(optimizer.state[first]["exp_avg"]).__name__ == "DTensor"
    step()
    _assert_bitwise(_locals(model, optimizer), after_restore)


# -- a NaN that only rank 1 sees, captured and diagnosed under FSDP -------------------------------

# 60 samples, 4 per rank per step: step 6 reads global micro-batch 5, rank 1 its second half. log.every=3:
# the snapshot is taken at step 3 and the capture replays steps 4 and 5 (log.every - 1) on both ranks.
STEP, EVERY = 6, 3
ARGS = ["task=fsdp_tasks:nan_dropout_blocks_task", "dist.strategy=fsdp", "train.batch_size=4", "train.max_steps=8",
        f"log.every={EVERY}", "ckpt.every=0", "eval.every=0", *FAST]


class CollectiveOps(TorchDispatchMode):
    """Record the c10d ops (collectives) issued while active: direct ones and DTensor gathers alike."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "c10d" in str(func):  # c10d.allreduce_, c10d.broadcast_, _c10d_functional.all_gather_into_tensor, ...
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def recording(fn, calls: list):
    """``fn``, appending (its name, the collectives it issued) to ``calls`` at each call."""
    def recorded(*args, **kwargs):
        with CollectiveOps() as mode:
            out = fn(*args, **kwargs)
        calls.append((fn.__name__, mode.ops))
        return out
    return recorded


def worker(argv: list[str]) -> None:
    """torchrun worker: OUT_DIR RUN_DIR key=value ...; the run with capture, then without (``capture.incidents=false``)."""
    import stabletrain.distributed.fsdp
    from stabletrain import Trainer, load_config
    from stabletrain.distributed.fsdp import full_state_dicts
    from stabletrain.distributed.group import process_group

    out, run_dir, overrides = Path(argv[0]), Path(argv[1]), argv[2:]
    with process_group("gloo", 120) as ctx:
        result, local = {}, []  # local: each snapshot and in-place load of this rank's shards, with its collectives
        stabletrain.distributed.fsdp.load_local_state_dicts = recording(stabletrain.distributed.fsdp.load_local_state_dicts,
                                                                        local)
        for name, extra in (("captured", []), ("uncaptured", ["capture.incidents=false"])):
            cfg = load_config(None, [*overrides, *extra])
            trainer = Trainer(cfg, run_dir=run_dir / name)
            pre = PreStepState(STEP - 1, trainer)
            trainer.callbacks.append(pre)
            if name == "captured":
                trainer.recorder.mark_interval_start = recording(trainer.recorder.mark_interval_start, local)
            trainer.fit()
            model, optim = full_state_dicts(trainer.module, trainer.optimizer, trainer.named_params)
            result[name] = {"model": model, "optimizer": optim, "history": trainer.history, "pre": pre.state,
                            "replayed": trainer.recorder.replayed_steps, "capture": trainer.cfg.capture.incidents,
                            "names": [n for n, _ in trainer.named_params], "local": list(local),
                            "kinds": sorted({type(p).__name__ for p in trainer.module.parameters()})}
        out.mkdir(parents=True, exist_ok=True)
        torch.save(result, out / f"rank_{ctx.rank}.pt")


@pytest.mark.slow
def test_a_nan_only_rank_1_sees_is_captured_on_both_ranks_diagnosed_by_name_and_the_run_goes_on_as_without_capture(
        tmp_path):
    bad = EpochOrder(60, 4, seed=0, shuffle=True, rank=1, world_size=2).micro_batches(0)[STEP - 1][1]
    assert bad not in EpochOrder(60, 4, seed=0, shuffle=True, rank=0, world_size=2).micro_batches(0)[STEP - 1]
    out, runs = tmp_path / "out", tmp_path / "runs"
    run([*TORCHRUN, __file__, str(out), str(runs), f"task_args.bad_index={bad}", *ARGS])
    ranks = [torch.load(out / f"rank_{r}.pt", weights_only=False) for r in (0, 1)]
    for r in ranks:
        for name in ("captured", "uncaptured"):
            assert r[name]["kinds"] == ["DTensor"]
            assert [h["num_skipped"] for h in r[name]["history"]] == [0, 1, 0]  # step 6 skipped on both ranks
        assert r["captured"]["capture"] is True  # not switched off under FSDP any more
        assert r["captured"]["replayed"] == EVERY - 1  # from the interval's snapshot: steps 4 and 5, on both ranks
        # A snapshot at the fit's start and at each boundary (3, 6, 8); at 6 the capture first loads the snapshot,
        # then the run's own state: all of it this rank's shards alone, without a collective.
        calls = r["captured"]["local"]
        assert [c for c, _ in calls] == ["mark_interval_start"] * 2 + ["load_local_state_dicts"] * 2 \
            + ["mark_interval_start"] * 2, calls
        assert all(ops == [] for _, ops in calls), calls

    captured = events(runs / "captured")
    assert [e["step"] for e in captured if e["kind"] == "skip"] == [STEP]
    incident = [e for e in captured if e["kind"] == "incident"]
    assert len(incident) == 1 and incident[0]["step"] == STEP and incident[0]["ranks"] == [1]
    assert incident[0]["replayed_steps"] == EVERY - 1 and "diagnosis_error" not in incident[0], incident[0]
    d = incident[0]["diagnosis"]
    assert d["rank"] == 1 and d["bad_samples"] == [bad] and d["reproduces"] is True, d
    assert (d["stage"], d["op"], d["direction"]) == ("inputs", "aten.addmm.default", "forward"), d
    assert (d["module"], d["first_nonfinite_param"]) == ("stem", "stem.weight"), d
    names = ranks[0]["captured"]["names"]
    assert d["first_nonfinite_param"] in names  # the FSDP run's own parameter name (fully_shard keeps FQNs)
    assert not any(e["kind"] == "incident" for e in events(runs / "uncaptured"))

    incident_dir = runs / "captured" / "incidents" / f"step_{STEP:06d}"
    assert (incident_dir / "diagnosis.json").exists()
    # Written with DCP: each rank its own shards, bundle.pt only markers (no rank gathered the whole model).
    assert sorted(p.name for p in (incident_dir / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    raw = torch.load(incident_dir / "bundle.pt", weights_only=True)
    assert raw["model"]["format"] and not any(isinstance(v, torch.Tensor) for v in raw["model"].get("tree", {}).values())
    bundle = load_bundle(incident_dir)
    assert bundle["rank"] == 1 and bundle["world_size"] == 2 and bad in bundle["window"]["indices"][0]
    pre = ranks[0]["captured"]["pre"]  # the run's own full state before step 6, gathered at the end of step 5
    assert list(bundle["model"]) == list(pre["model"]) and set(names) <= set(bundle["model"])  # by the run's FQNs
    for key, value in pre["model"].items():  # the replay on both ranks reproduced the run bitwise
        assert torch.equal(bundle["model"][key], value), key
    for i, st in pre["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(bundle["optimizer"]["state"][i][k], v), (i, k)

    # The capture restored every rank's shards, optimizer and RNG in place: with dropout drawing from each rank's
    # RNG, the run after the incident is bitwise the run that skipped step 6 without capturing it.
    a, b = ranks[0]["captured"], ranks[0]["uncaptured"]
    assert [h["loss"] for h in a["history"]] == [h["loss"] for h in b["history"]]
    for key, value in b["model"].items():
        assert torch.equal(a["model"][key], value) and torch.isfinite(value).all(), key
    for i, st in b["optimizer"]["state"].items():
        for k, v in st.items():
            assert torch.equal(a["optimizer"]["state"][i][k], v), (i, k)


if __name__ == "__main__":
    worker(sys.argv[1:])


@pytest.mark.slow
def test_a_nan_only_one_ranks_gradients_hold_is_found_on_that_rank_under_fsdp(tmp_path):
    """An inf input a tanh squashes: the loss finite on every rank, rank 1's gradients NaN. FSDP had no way to tell the
    ranks' gradients apart (reduce-scattered as they are made): rank 0 replayed its own batch and called the step 'not
    reproducible: a hardware fault'. Each rank now reads what its own micro-batches make (outputs and their gradients)."""
    from multiproc import stabletrain as stabletrain_cmd

    run_dir = tmp_path / "run"
    res = run(stabletrain_cmd("task=fsdp_tasks:grads_only_nan_task", "dist.nproc=2", "dist.strategy=fsdp",
                              "train.batch_size=8", "data.shuffle=false", "train.max_steps=8", "log.every=4", "ckpt.every=0",
                              f"run.dir={run_dir}"), timeout=300)
    [incident] = [e for e in events(run_dir) if e["kind"] == "incident"]
    d = incident["diagnosis"]
    assert incident["step"] == 6 and incident["ranks"] == [1] and d["rank"] == 1, incident
    assert (d["bad_samples"], d["module"], d["reproduces"]) == ([91], "stem", True), d
    # No periodic save: the first and the last sharded checkpoints are written by the ranks themselves, whole and
    # verified, and no DCP checkpoint process is started for them (2 processes, ~3 CPU-seconds each, per launch)
    assert [e["step"] for e in events(run_dir) if e["kind"] == "checkpoint"] == [0, 8]
    manager = CheckpointManager(run_dir / "checkpoints")
    last = manager.load()
    assert last.meta["step"] == 8 and last.meta["dcp"]["keys"] and manager.verify(last.path) == []
    assert "Checkpoint background process" not in res.stdout + res.stderr, res.stderr[-2000:]


@pytest.mark.slow
def test_a_step_two_ranks_saw_go_bad_names_each_ranks_samples_and_a_rollback_drops_them_all(tmp_path):
    """NaN samples 83 (rank 0) and 91 (rank 1) in step 6: the capture diagnosed rank 0's window alone, named 83, and the
    rollback dropped 83 only: 91 came back the next epoch with an incident of its own."""
    from multiproc import stabletrain as stabletrain_cmd

    run_dir = tmp_path / "run"
    run(stabletrain_cmd("task=fsdp_tasks:two_nan_task", "dist.nproc=2", "train.batch_size=8", "data.shuffle=false",
                        "train.max_steps=12", "log.every=5", "ckpt.every=5", "guard.on_nonfinite=rollback",
                        f"run.dir={run_dir}"), timeout=300)
    [incident] = [e for e in events(run_dir) if e["kind"] == "incident"]
    assert incident["step"] == 6 and incident["ranks"] == [0, 1] and incident["diagnosis"]["bad_samples"] == [83, 91]
    [rollback] = [e for e in events(run_dir) if e["kind"] == "rollback"]
    assert rollback["dropped_samples"] == [83, 91], rollback


def test_a_ranks_own_outputs_are_bad_for_a_nan_or_a_plus_inf_not_for_a_minus_inf_mask_and_its_error_reaches_every_rank():
    """own_outputs_bad (FSDP's answer to whose gradients went bad) flagged any inf: a -inf attention or vocabulary mask
    blamed every rank; an error on one rank left the others waiting in the gather."""
    from types import SimpleNamespace

    from fsdp_tasks import TanhStemNet
    from torch import nn

    from stabletrain.distributed.blame import answered_ranks, own_outputs_bad
    from stabletrain.policies.precision import PrecisionPolicy

    class Masked(nn.Module):  # logits of padded classes set to -inf by design
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(x).masked_fill(torch.tensor([False, False, True, True]), float("-inf"))

    def bad(model, x, loss):
        torch.manual_seed(0)
        window = SimpleNamespace(indices=[list(range(len(x)))], batches=[(x,)])
        return own_outputs_bad(model, SimpleNamespace(loss=loss), PrecisionPolicy("fp32", torch.device("cpu")), window,
                               torch.device("cpu"))

    ce = lambda m, b: nn.functional.cross_entropy(m(b[0]), torch.zeros(len(b[0]), dtype=torch.long))  # noqa: E731
    x = torch.randn(4, 16)
    assert not bad(Masked(), x, ce)
    x_inf = x.clone()
    x_inf[1, 3] = float("inf")  # through the stem: +inf and NaN outputs, a finite loss (tanh)
    mse = lambda m, b: m(b[0]).square().mean()  # noqa: E731
    assert bad(TanhStemNet(), x_inf, mse) and not bad(TanhStemNet(), x, mse)

    def group(*answers):
        return SimpleNamespace(gather_objects=lambda mine: [mine, *answers])

    assert answered_ranks(group((True, None)), lambda: False) == [1]
    with pytest.raises(RuntimeError, match=r"^rank 1 failed replaying its own micro-batches of the bad step: OSError: x$"):
        answered_ranks(group((False, "OSError: x")), lambda: False)  # this rank answered the gather, then raised
    with pytest.raises(ValueError, match="mine"):
        answered_ranks(group((False, None)), lambda: (_ for _ in ()).throw(ValueError("mine")))

