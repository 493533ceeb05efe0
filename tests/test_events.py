"""The event kinds and metric keys: one table each, and everything that lists them agrees with it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stabletrain.records.events import EVENT_KINDS, METRIC_KEYS, REPLAY_KINDS
from stabletrain.records.jsonl import read_jsonl
from stabletrain.records.rundir import RunDir
from stabletrain.report.html import KIND_COLORS
from stabletrain.report.plots import EVENT_MARKS
from stabletrain.report.rundata import KNOWN_METRIC_KEYS

README = Path(__file__).parents[1] / "docs" / "run-directory.md"  # the tables of metric keys and event kinds


def _readme_table(header: str) -> list[str]:
    """Return the backticked names in the first column of the docs' table under ``| header |``."""
    lines = README.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header} |"))
    names = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        names += re.findall(r"`([^`]+)`", line.split("|")[1])
    return names


def test_every_event_kind_and_metric_key_has_a_meaning():
    for table in (EVENT_KINDS, METRIC_KEYS):
        for name, meaning in table.items():
            assert re.fullmatch(r"[a-z][a-z0-9_]*", name), name
            assert isinstance(meaning, str) and len(meaning) > 10 and "\n" not in meaning, name
    assert set(REPLAY_KINDS) <= set(EVENT_KINDS)
    for kind in ("crash", "schedule_changed", "checkpoint_skipped", "init_overwritten"):
        assert kind in EVENT_KINDS
    for key in ("world_size", "num_spikes", "num_incidents", "num_rollbacks", "val_loss", "update_norm", "update_ratio"):
        assert key in METRIC_KEYS


def test_the_readme_tables_list_exactly_the_metric_keys_and_event_kinds():
    metrics = _readme_table("metric key")
    assert len(metrics) == len(set(metrics)) and set(metrics) == set(METRIC_KEYS)
    kinds = _readme_table("event kind")
    assert len(kinds) == len(set(kinds)) and set(kinds) == set(EVENT_KINDS)


def test_the_report_knows_every_kind_and_key_from_the_tables():
    assert set(KIND_COLORS) == set(EVENT_KINDS)  # every kind has its color in the timeline
    assert set(EVENT_MARKS) <= set(EVENT_KINDS)
    assert KNOWN_METRIC_KEYS == set(METRIC_KEYS) | {"interval_steps"}


def test_run_dir_refuses_an_unknown_event_kind(tmp_path):
    run = RunDir(tmp_path / "run")
    record = run.event(3, "skip", "optimizer step skipped: test", loss=float("nan"))
    with pytest.raises(ValueError, match=r"event kind 'skipped' is not one of stabletrain.records.events.EVENT_KINDS \(skip, "):
        run.event(4, "skipped", "a typo")
    run.close()
    records, problems = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert not problems and [(r["step"], r["kind"], r["loss"]) for r in records] == [(3, "skip", "nan")]
    assert record["kind"] == "skip"


def test_a_rank_other_than_0_appends_its_own_crash_to_the_run_and_every_host_knows_the_run_dir(tmp_path):
    """Rank 1's crash was written nowhere (only rank 0 holds the run open); the adapters' sessions never knew the run
    directory on rank 1 (the built-in loop's path came from its checkpoints)."""
    import json
    from types import SimpleNamespace

    import torch

    from stabletrain import Monitor
    from stabletrain.runstate import RunState

    (tmp_path / "events.jsonl").write_text(json.dumps({"step": 3, "kind": "resume", "reason": "rank 0's"}) + "\n")
    state = RunState(cfg=None, task=None, module=torch.nn.Linear(2, 2), named_params=[], device=torch.device("cpu"),
                     dist=SimpleNamespace(enabled=True, rank=1), precision="fp32", run_dir=tmp_path)
    state.event(7, "crash", "OSError: gone", own=True, error="OSError")
    state.event(7, "skip", "not its own")  # (rank 0 records what every rank knows)
    lines = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert [(e["kind"], e.get("rank")) for e in lines] == [("resume", None), ("crash", 1)]
    assert lines[1]["reason"] == "rank 1: OSError: gone" and lines[1]["error"] == "OSError"
    model = torch.nn.Linear(2, 1)
    with Monitor(model, torch.optim.SGD(model.parameters(), lr=0.1), run_dir=tmp_path / "mon") as monitor:
        assert monitor.session.state.run_dir == tmp_path / "mon"

