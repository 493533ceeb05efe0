"""A DDP incident that several ranks saw holds the model and optimizer once (2 processes under torchrun, gloo)."""

from __future__ import annotations

import json

import pytest
import torch
from multiproc import run, stabletrain

from stabletrain.data import EpochOrder
from stabletrain.records.bundles import load_bundle

pytestmark = pytest.mark.slow  # a 2-process run


def test_a_ddp_incident_seen_by_both_ranks_writes_the_model_and_optimizer_once(tmp_path):
    # Step 3 (batch 4 per rank) reads each rank's third micro-batch: one NaN sample in each.
    bad = [EpochOrder(64, 4, seed=0, shuffle=True, rank=r, world_size=2).micro_batches(0)[2][0] for r in (0, 1)]
    run_dir = tmp_path / "run"
    run(stabletrain("dist.nproc=2", "task=helpers:nan_samples_task", f"task_args.bad_indices=[{bad[0]},{bad[1]}]",
                    "train.batch_size=4", "train.max_steps=4", "log.every=4", "ckpt.every=0", "eval.every=0",
                    f"run.dir={run_dir}"))
    incident = run_dir / "incidents" / "step_000003"
    # One bundle: the step's whole batch (each rank's window, its rank named), the model and optimizer once; no rank_R
    # folder beside it (each held its own window and pointed at the first's state: the diagnosis read the first only).
    assert sorted(p.name for p in incident.iterdir()) == ["bundle.pt", "diagnosis.json"]
    bundle = load_bundle(incident)
    assert "model" in bundle and "optimizer" in bundle
    window = {i: r for idx, r in zip(bundle["window"]["indices"], bundle["window"]["ranks"]) for i in idx}
    assert (window[bad[0]], window[bad[1]]) == (0, 1), window
    diagnosis = json.loads((incident / "diagnosis.json").read_text())
    assert sorted(diagnosis["bad_samples"]) == sorted(bad), diagnosis["summary"]
    # its rank: none alone (it said 'rank 0', the first window's); each named sample's
    assert diagnosis["rank"] is None and diagnosis["sample_ranks"] == {str(bad[0]): 0, str(bad[1]): 1}, diagnosis
    assert all(torch.isfinite(v).all() for v in bundle["model"].values())
