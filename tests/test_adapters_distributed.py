"""The adapters on two real gloo processes: Monitor around DDP and the HF Trainer under torchrun, Lightning ddp.

A NaN in rank 1's data at step 3 must be skipped on both ranks (their parameters stay equal), both ranks
count the same steps, rank 0 alone writes one run directory whose figures are over both ranks, and the
incident names rank 1 and the sample. Between log boundaries stabletrain adds no collective to a step:
every step runs exactly as many as the host alone runs (the process group's sequence number counts them).
"""

from __future__ import annotations

import json

import pytest
import torch
from integration_models import BAD_POSITION
from multiproc import TESTS, TORCHRUN, run

pytestmark = pytest.mark.slow  # two processes per test
STEPS, LOG_EVERY = 8, 4


def _load(out, host):
    return [torch.load(out / f"{host}_rank_{r}.pt", weights_only=False) for r in (0, 1)]


def _events(run_dir):
    return [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]


def _check(ranks, run_dir, step, position, module):
    a, b = ranks
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))  # skipped on both: still in lockstep
    assert all(torch.isfinite(p).all() for p in a["params"])
    assert a["steps"] == b["steps"] == STEPS
    for r in ranks:  # no collective of ours inside the interval; one all-gather per boundary (+ the capture's own)
        boundaries = {LOG_EVERY, STEPS}
        assert [c for s, c in enumerate(r["counts"], 1) if s not in boundaries] == \
               [c for s, c in enumerate(r["bare_counts"], 1) if s not in boundaries]
        assert r["counts"][STEPS - 1] == r["bare_counts"][STEPS - 1] + 1  # the interval's all-gather, nothing else
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [LOG_EVERY, STEPS] and all(r["world_size"] == 2 for r in records)
    assert records[0]["num_skipped"] == 1 and records[1]["num_skipped"] == 0
    assert [round(r["loss"], 12) for r in records] == [round(h["loss"], 12) for h in a["history"]]  # one record
    incidents = [e for e in _events(run_dir) if e["kind"] == "incident"]
    assert len(incidents) == 1 and incidents[0]["step"] == step and incidents[0]["ranks"] == [1]
    d = incidents[0]["diagnosis"]
    assert (d["rank"], d["module"], d["op"]) == (1, module, "aten.sqrt.default")
    assert d["bad_positions"] == [{"micro_batch": 0, "position": position}]
    assert sorted(p.name for p in (run_dir / "incidents").iterdir()) == [f"step_{step:06d}"]


def test_monitor_around_a_ddp_model_under_torchrun(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    run([*TORCHRUN, str(TESTS / "dist_adapters.py"), "monitor", str(out), str(run_dir)], timeout=300)
    ranks = _load(out, "monitor")
    _check([{**r["sqrt"], "bare_counts": r["bare_counts"]} for r in ranks], run_dir / "sqrt", 3, 3, "root")
    # A NaN loss whose gradients are finite (its NaN has no gradient) is skipped on both ranks too: the verdict
    # reaches rank 0 through the gradients of the smallest parameter, no collective of its own.
    a, b = (r["detached"] for r in ranks)
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert a["history"][0]["num_skipped"] == 1 and a["counts"][:3] == ranks[0]["bare_counts"][:3]
    events = _events(run_dir / "detached")
    assert [e["ranks"] for e in events if e["kind"] == "nonfinite"] == [[1]]
    assert all(r["skip_refused"].startswith("on_spike='skip' under torch.distributed (world size 2): ") for r in ranks)
    # A finite spike only rank 1's batch carries: found on rank 1 by its own loss, its sample named.
    incident = next(e for e in _events(run_dir / "spike") if e["kind"] == "incident")
    assert incident["step"] == 7 and incident["ranks"] == [1] and incident["diagnosis"]["rank"] == 1, incident
    d = json.loads((run_dir / "spike" / "incidents" / "step_000007" / "diagnosis.json").read_text())
    assert d["failure_class"] == "data" and d["samples"]["indices"] == [BAD_POSITION], d["summary"]


def test_the_hugging_face_trainer_under_torchrun(tmp_path):
    out, run_dir = tmp_path / "out", tmp_path / "run"
    run([*TORCHRUN, str(TESTS / "dist_adapters.py"), "transformers", str(out), str(run_dir)], timeout=300)
    _check(_load(out, "transformers"), run_dir, 3, 1, "transformer.wte")
    # The Trainer multiplied each rank's loss by the 2 processes (its items were both ranks'): a replay on one process
    # (stabletrain diagnose) multiplies by what the bundle says, or it replays a spike at half its loss.
    from stabletrain.records.bundles import load_bundle

    host = load_bundle(run_dir / "incidents" / "step_000003")["config"]["task_args"]["host"]
    assert host["loss_factor"] == 2 and host["num_items_in_batch"] > 0, host


def test_lightning_with_strategy_ddp(tmp_path):
    import sys

    pytest.importorskip("lightning")
    out, run_dir = tmp_path / "out", tmp_path / "run"
    run([sys.executable, str(TESTS / "dist_adapters.py"), "lightning", str(out), str(run_dir)], timeout=300)
    ranks = _load(out, "lightning")
    (rank, step, position), = [p for r in ranks for p in r["planted"]]
    assert rank == 1
    _check(ranks, run_dir, step, position, "net.root")
