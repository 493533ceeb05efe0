"""A DDP incident that several ranks saw holds the model and optimizer once (2 processes under torchrun, gloo)."""

from __future__ import annotations

import pytest
import torch
from multiproc import run, stabletrain

from stabletrain.data import EpochOrder
from stabletrain.records.bundles import STATE_IN, load_bundle

pytestmark = pytest.mark.slow  # a 2-process run


def test_a_ddp_incident_seen_by_both_ranks_writes_the_model_and_optimizer_once(tmp_path):
    # Step 3 (batch 4 per rank) reads each rank's third micro-batch: one NaN sample in each.
    bad = [EpochOrder(64, 4, seed=0, shuffle=True, rank=r, world_size=2).micro_batches(0)[2][0] for r in (0, 1)]
    run_dir = tmp_path / "run"
    run(stabletrain("dist.nproc=2", "task=helpers:nan_samples_task", f"task_args.bad_indices=[{bad[0]},{bad[1]}]",
                    "train.batch_size=4", "train.max_steps=4", "log.every=4", "ckpt.every=0", "eval.every=0",
                    f"run.dir={run_dir}"))
    incident = run_dir / "incidents" / "step_000003"
    first = torch.load(incident / "bundle.pt", weights_only=True)
    later = torch.load(incident / "rank_1" / "bundle.pt", weights_only=True)
    assert (first["rank"], later["rank"]) == (0, 1)
    assert "model" in first and "optimizer" in first
    assert "model" not in later and "optimizer" not in later and later[STATE_IN] == ".."
    tensors = [*first["model"].values(), *(v for e in first["optimizer"]["state"].values() for v in e.values())]
    held = sum(t.numel() * t.element_size() for t in tensors)
    saved = (incident / "bundle.pt").stat().st_size - (incident / "rank_1" / "bundle.pt").stat().st_size
    assert saved >= held > 0  # rank 1's bundle is smaller by at least the model's and optimizer's bytes
    # Loaded, rank 1's bundle has rank 1's window and the first bundle's model and optimizer, bitwise.
    loaded = load_bundle(incident / "rank_1")
    assert bad[1] in loaded["window"]["indices"][0] and bad[0] not in loaded["window"]["indices"][0]
    for name, value in first["model"].items():
        assert torch.equal(loaded["model"][name], value), name
    for i, entry in first["optimizer"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(loaded["optimizer"]["state"][i][key], value), (i, key)
