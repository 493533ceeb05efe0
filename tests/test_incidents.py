"""Incident bundles: written atomically, loaded safely, diagnosed in a fresh task from the bundle alone."""

import pytest
import torch

from helpers import cfg, nan_sample_task
from stabletrain import Trainer
from stabletrain.incidents import BUNDLE_FILE, diagnose_incident, load_bundle, write_bundle


def test_bundle_round_trips_and_leaves_no_temporary_file(tmp_path):
    bundle = {"step": 3, "model": {"w": torch.ones(2)}, "window": {"indices": [[1, 2]]}}
    path = write_bundle(tmp_path / "incidents" / "step_000003", bundle)
    assert path.name == BUNDLE_FILE and [p.name for p in path.parent.iterdir()] == [BUNDLE_FILE]
    loaded = load_bundle(path.parent)
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.ones(2))


def test_missing_and_unsafe_bundles_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no bundle.pt there"):
        load_bundle(tmp_path)
    torch.save({"fn": print}, tmp_path / BUNDLE_FILE)  # needs pickle beyond weights_only
    with pytest.raises(ValueError, match="cannot be loaded safely"):
        load_bundle(tmp_path)


def test_an_incident_is_captured_and_diagnosed_again_from_the_bundle(tmp_path):
    task = nan_sample_task(bad_index=37)
    c = cfg("train.batch_size=16", "train.max_steps=6", "log.every=3", "guard.diagnose=false", "data.shuffle=false")
    Trainer(c, task=task, run_dir=tmp_path / "run").fit()
    incident = tmp_path / "run" / "incidents" / "step_000003"  # samples 32..47 are the third batch
    bundle = load_bundle(incident)
    assert bundle["step"] == 3 and 37 in bundle["window"]["indices"][0]
    d = diagnose_incident(incident, nan_sample_task(bad_index=37))
    assert d["stage"] == "inputs" and d["bad_samples"] == [37] and d["reproduces"] is True
    assert (incident / "diagnosis.json").exists()
