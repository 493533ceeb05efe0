"""Incident bundles: written atomically, loaded safely, diagnosed in a fresh task from the bundle alone."""

import json
import math

import pytest
import torch
from helpers import PreStepState, cfg, nan_sample_task
from test_checkpoint import assert_same

from stabletrain import Trainer
from stabletrain.incident_replay import diagnose_incident
from stabletrain.records.bundles import BUNDLE_FILE, load_bundle, write_bundle
from stabletrain.records.jsonl import revive


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
    with pytest.raises(ValueError, match="cannot be loaded safely") as unsafe:
        load_bundle(tmp_path)
    assert "weights_only" not in str(unsafe.value)  # (torch's first line advised weights_only=False)
    (tmp_path / BUNDLE_FILE).write_bytes(b"garbage")  # truncated or corrupt: no safety question at all
    with pytest.raises(ValueError, match=r"is not a readable torch file \(7 bytes: corrupt or truncated\?\)"):
        load_bundle(tmp_path)


def test_an_incident_is_captured_and_diagnosed_again_from_the_bundle(tmp_path):
    task = nan_sample_task(bad_index=37)
    c = cfg("train.batch_size=16", "train.max_steps=6", "log.every=3", "capture.diagnose=false", "data.shuffle=false")
    Trainer(c, task=task, run_dir=tmp_path / "run").fit()
    incident = tmp_path / "run" / "incidents" / "step_000003"  # samples 32..47 are the third batch
    bundle = load_bundle(incident)
    assert bundle["step"] == 3 and 37 in bundle["window"]["indices"][0]
    d = diagnose_incident(incident, nan_sample_task(bad_index=37))
    assert d["stage"] == "inputs" and d["bad_samples"] == [37] and d["reproduces"] is True
    assert (incident / "diagnosis.json").exists()
    t = d["timings"]  # what the diagnosis cost, by phase (its passes are counted in d["passes"])
    assert set(t) == {"load_s", "replays_s", "bisection_s", "anomaly_s", "total_s"}
    assert t["total_s"] >= t["load_s"] + t["replays_s"] + t["bisection_s"] + t["anomaly_s"] > 0


@pytest.mark.parametrize("snapshot, replayed", [(True, 3), (False, 13)])
def test_a_late_incident_replays_at_most_one_interval_and_its_bundle_is_the_runs_pre_step_state(tmp_path, snapshot, replayed):
    # 128 samples, 8 per step, in order: sample 107 is in step 14, the 4th of the interval (10, 15], with the last
    # checkpoint at step 0 (ckpt.every=100). From the interval's host snapshot the capture replays steps 11-13;
    # from LAST_GOOD (capture.memory_snapshot=false) it would replay 13 steps.
    c = cfg("train.batch_size=8", "train.max_steps=15", "log.every=5", "capture.diagnose=false", "data.shuffle=false",
            f"capture.memory_snapshot={str(snapshot).lower()}")
    trainer = Trainer(c, task=nan_sample_task(bad_index=107, n=128), run_dir=tmp_path / "run")
    pre = PreStepState(13, trainer)
    trainer.callbacks.append(pre)
    calls = []

    def counting(window, **kw):  # the run state's step, which replays call (the loop calls the trainer's own)
        calls.append(window)
        return trainer.train_step(window, **kw)

    trainer.state.train_step = counting
    trainer.fit()
    assert trainer.recorder.replayed_steps == len(calls) == replayed
    assert len(calls) <= c.log.every or not snapshot
    bundle = load_bundle(tmp_path / "run" / "incidents" / "step_000014")
    assert bundle["step"] == 14 and 107 in bundle["window"]["indices"][0]
    for key in ("model", "optimizer", "schedule", "precision", "rng"):
        assert_same(bundle[key], pre.state[key], key)  # bitwise: the replay reproduced the run exactly
    assert trainer.step == 15  # the run went on from where it was


def test_the_interval_snapshot_reuses_host_buffers_and_stays_off_the_device(tmp_path):
    trainer = Trainer(cfg("train.max_steps=6", "log.every=2"), run_dir=tmp_path / "run")
    recorder = trainer.recorder
    recorder.mark_interval_start()
    first = {k: v.data_ptr() for k, v in recorder.snapshot["model"].items()}
    trainer.fit()
    assert {k: v.data_ptr() for k, v in recorder.snapshot["model"].items()} == first  # the same buffers, refilled
    assert all(v.device.type == "cpu" and v.data_ptr() != trainer.module.state_dict()[k].data_ptr()
               for k, v in recorder.snapshot["model"].items())
    for name, value in trainer.module.state_dict().items():  # refilled at the last boundary (step 6)
        assert torch.equal(recorder.snapshot["model"][name], value), name


def test_the_diagnosis_file_is_strict_json_with_its_non_finite_numbers_spelled_and_read_back_as_floats(tmp_path):
    """jq, a browser and every strict reader read diagnosis.json (a bare NaN is no JSON); the house's readers revive them."""
    task = nan_sample_task(bad_index=37)
    c = cfg("train.batch_size=16", "train.max_steps=6", "log.every=3", "capture.diagnose=false", "data.shuffle=false")
    Trainer(c, task=task, run_dir=tmp_path / "run").fit()
    incident = tmp_path / "run" / "incidents" / "step_000003"
    d = diagnose_incident(incident, nan_sample_task(bad_index=37))
    text = (incident / "diagnosis.json").read_text()

    def refuse(constant):
        raise AssertionError(f"{constant} in diagnosis.json")

    stored = json.loads(text, parse_constant=refuse)
    assert '"nan"' in text and not math.isfinite(d["observed"]["loss"]) and stored["observed"]["loss"] == "nan"
    assert math.isnan(revive(stored)["observed"]["loss"]) and revive(stored)["bad_samples"] == d["bad_samples"] == [37]
    # what kind of value went bad is a string "nan" or "inf", not a number: it stays one
    assert revive({"kind": "inf", "first_op": {"kind": "nan", "max": "inf"}, "x_kind": ["nan"]}) == {
        "kind": "inf", "first_op": {"kind": "nan", "max": math.inf}, "x_kind": ["nan"]}



def test_a_failure_met_again_is_said_short_naming_the_step_that_first_met_it(tmp_path, capfd):
    """A trial's fp16 regression whose output outgrew float16: the same overflow in module '1' captured each interval
    printed its whole 400-character line 8 times. A later incident that finds what an earlier one did (class, stage, op,
    module) says so in one short line: the step that first met it and this step's samples (diagnosis.json keeps it all)."""
    Trainer(cfg("train.batch_size=8", "data.shuffle=false", "log.every=4", "train.max_steps=12", "log.progress=false"),
            task=nan_sample_task(5, n=32), run_dir=tmp_path / "run").fit()  # sample 5: steps 1, 5 and 9
    lines = [x for x in capfd.readouterr().out.splitlines() if x.startswith("stabletrain: incident at step")]
    assert len(lines) == 3 and "as at step" not in lines[0] and "sample 5" in lines[0], lines
    for line, step in zip(lines[1:], (5, 9)):
        assert line.startswith(f"stabletrain: incident at step {step}: data: as at step 1 (aten.addmm.default in forward of "
                               "module '0'), at sample 5; reproduces on replay"), line
    later = json.loads((tmp_path / "run" / "incidents" / "step_000005" / "diagnosis.json").read_text())
    assert "as at step" not in later["summary"] and later["bad_samples"] == [5], later["summary"]  # (the record: whole)


def test_a_failure_said_short_is_the_same_failure_not_only_the_same_op():
    """A review of 'as at step N': an overflow through a few samples and a later one through the module's weights (most
    samples) share class, op and module, not a cause: the later one is said whole. Outside any module or in the root
    module is said so; a step whose inputs hold the NaN names them."""
    from stabletrain.diagnostics.diagnosis import repeat_key, repeat_summary

    first = {"failure_class": "overflow", "stage": "activations", "op": "aten.addmm.default", "direction": "forward",
             "module": "1", "origin": True, "kind": "inf", "reproduces": True, "bad_samples": [3750], "num_samples": 16}
    again = {**first, "bad_samples": [472]}
    weights = {**first, "bad_samples": list(range(14)), "blamed_module": "1"}
    assert repeat_key(again) == repeat_key(first) != repeat_key(weights)
    assert repeat_key({**first, "param_input": True}) != repeat_key(first) and repeat_key({**first, "anomaly": "spike"}) is None
    assert repeat_summary(again, 163) == ("overflow: as at step 163 (aten.addmm.default in forward of module '1'), at "
                                          "sample 472; reproduces on replay")
    assert "outside any module)" in repeat_summary({**again, "module": None}, 163)
    assert "of the root module)" in repeat_summary({**again, "module": ""}, 163)
    inputs = {**first, "stage": "inputs", "bad_samples": None, "bad_input_samples": [5, 9]}
    assert repeat_summary(inputs, 1).endswith(", at samples 5, 9; reproduces on replay")
