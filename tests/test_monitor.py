"""stabletrain.Monitor in a plain loop: the run directory, no per-step sync, a planted NaN traced, fp16, resume."""

from __future__ import annotations

import contextlib
import copy
import fractions
import importlib.util
import json
import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from integration_models import BAD_POSITION, BAD_STEP, Net, batches, loss_fn, outlier_pairs

from stabletrain import Monitor, StopTraining
from stabletrain.callbacks import Callback
from stabletrain.incident_replay import diagnose_incident
from stabletrain.records.events import EVENT_KINDS, METRIC_KEYS
from stabletrain.records.jsonl import read_jsonl
from stabletrain.report import load_run, write_compare, write_report
from stabletrain.syncs import SyncCounter


def make(seed=0, fused=True, lr=1e-2):
    torch.manual_seed(seed)
    model = Net()
    return model, torch.optim.AdamW(model.parameters(), lr=lr, fused=fused)


def train(monitor, model, data):
    for batch in data:
        with monitor.autocast():
            loss = loss_fn(model, batch)
        monitor.backward(loss)
        monitor.step(batch)


@pytest.mark.slow
def test_clean_run_writes_a_run_directory_that_report_and_compare_read(tmp_path):
    runs = []
    for name, clip in (("a", 1.0), ("b", 0.05)):
        model, opt = make()
        with Monitor(model, opt, run_dir=tmp_path / name, clip_max_norm=clip, log_every=10, loss_fn=loss_fn) as monitor:
            train(monitor, model, batches(25))
        runs.append(tmp_path / name)
    run = runs[0]
    records, problems = read_jsonl(run / "metrics.jsonl")
    assert not problems and [r["step"] for r in records] == [10, 20, 25]
    assert set(records[0]) <= set(METRIC_KEYS)  # every key is documented
    for key in ("loss", "grad_norm", "grad_norm_post_clip", "clip_rate", "lr", "loss_scale", "num_skipped",
                "num_nonfinite", "tokens_per_s", "peak_memory_mib", "top_grad_layers", "update_norm"):
        assert key in records[0], key
    assert records[0]["lr"] == pytest.approx(1e-2) and records[0]["num_skipped"] == 0
    assert all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["samples_seen"] == 25 * 8
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["integration"] == "monitor" and config["clip"]["max_norm"] == 1.0 and config["log"]["every"] == 10
    assert config["optim"]["name"] == "AdamW" and config["task"] == "Net"
    snapshot = json.loads((run / "snapshot.json").read_text())
    assert snapshot["integration"] == "monitor" and "init_signal" in snapshot
    assert (snapshot["seed"], snapshot["deterministic"]) == (None, False)  # your loop's seed is not known: not stabletrain's 0
    assert (run / "init_signal.json").exists() and list((run / "tb").iterdir())
    events, _ = read_jsonl(run / "events.jsonl")
    assert all(e["kind"] in EVENT_KINDS for e in events) and not [e for e in events if e["kind"] == "incident"]
    # The tighter clip fires on every step; the looser one measures the same norms.
    b = load_run(runs[1])
    assert [r["clip_rate"] for r in b.metrics] == [1.0, 1.0, 1.0]
    assert all(r["grad_norm_post_clip"] <= 0.05 * (1 + 1e-5) for r in b.metrics)
    html = write_report(run).read_text()
    assert "Net" in html and "grad_norm" in html
    assert write_compare(runs, tmp_path / "compare.html").exists()


def test_the_init_watch_speaks_of_a_reset_before_the_first_step_never_of_the_first_update(tmp_path, capsys):
    """Monitor's fit starts in its first step(), after the model's first forward: the watch compares there, once. Its
    hook for a first forward then met step 2's, after the first update, and called every parameter overwritten."""
    def overwritten(run):
        return [e for e in read_jsonl(run / "events.jsonl")[0] if e["kind"] == "init_overwritten"]

    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "plain", log_every=5, loss_fn=loss_fn) as monitor:
        train(monitor, model, batches(6))
    assert overwritten(tmp_path / "plain") == [] and "init overwritten" not in capsys.readouterr().err
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "reset", log_every=5, loss_fn=loss_fn) as monitor:
        torch.manual_seed(1)
        model.fc1.reset_parameters()  # after the fingerprint, before the first step
        train(monitor, model, batches(6))
    (event,) = overwritten(tmp_path / "reset")
    assert event["step"] == 0 and {p["name"] for p in event["params"]} == {"fc1.weight", "fc1.bias"}, event


def test_no_host_sync_between_log_boundaries_and_a_non_fused_optimizer_costs_one(tmp_path):
    model, opt = make(fused=True)
    monitor = Monitor(model, opt, run_dir=tmp_path / "run", log_every=5, loss_fn=loss_fn)
    with SyncCounter(lambda: monitor.num_steps) as counter:
        train(monitor, model, batches(20))
    monitor.close()
    steps = sorted({c.step for c in counter.calls if "after_first_forward" not in c.where})
    assert set(steps) <= {0, 5, 10, 15, 20}, steps  # step 0: the init fingerprint and signal report, once
    assert {c.step for c in counter.calls if "after_first_forward" in c.where} <= {0, 1}  # the init watch, once
    assert sum(1 for c in counter.calls if c.step == 10) == 1  # one sync per interval

    model, opt = make(fused=False)
    monitor = Monitor(model, opt, log_every=5, init_check=False)
    with warnings.catch_warnings(record=True) as caught, SyncCounter(lambda: monitor.num_steps) as counter:
        warnings.simplefilter("always")
        train(monitor, model, batches(10))
    # Ours: PrecisionPolicy.step reads the skip flag once a step (the non-fused AdamW's own .item()s are torch's).
    ours = [c for c in counter.calls if c.step % 5 and c.where[-3:-1] == ["apply", "step"]]
    assert len(ours) == 8 and {c.op for c in ours} == {"__bool__"}
    assert any("cannot skip a step on the device" in str(w.message) for w in caught)


@pytest.mark.parametrize("whole", ["mean", "sum"])
def test_your_own_backward_over_micro_batches_is_replayed_as_you_ran_it(tmp_path, whole):
    """A review: monitor.step(micro_batches=[b0, b1], loss=total) after your own backward kept [total] as the first
    micro-batch's backpropagated loss and nothing for the second: the replay scaled micro-batch 0's loss to the whole
    step's and backpropagated micro-batch 1's undivided, and the bundle's 'state before the bad step' was wrong. Each
    micro-batch's share is found from the whole (their mean, or their sum): the bundle is the live state, bitwise."""
    model, opt = make()
    data = batches(12, bad_step=BAD_STEP)
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=10, loss_fn=loss_fn) as monitor:
        for step, batch in enumerate(data, 1):
            before = [p.detach().clone() for p in model.parameters()] if step == BAD_STEP else None
            micro, total = [(batch[0][:4], batch[1][:4]), (batch[0][4:], batch[1][4:])], 0.0
            for b in micro:
                loss = loss_fn(model, b) / (2 if whole == "mean" else 1)
                total = total + loss.detach()
                loss.backward()
            monitor.step(micro_batches=micro, loss=total)
            before_bad = before if before is not None else locals().get("before_bad")
    incident = load_run(tmp_path / "run").counted_events("incident")[0]
    assert incident.step == BAD_STEP and incident.extra["replayed_steps"] == BAD_STEP - 1
    bundle = torch.load(tmp_path / "run" / "incidents" / f"step_{BAD_STEP:06d}" / "bundle.pt", weights_only=True)
    assert all(torch.equal(bundle["model"][k], v) for k, v in zip(model.state_dict(), before_bad))
    assert incident.extra["diagnosis"]["bad_positions"] == [{"micro_batch": 0, "position": BAD_POSITION}]


def test_planted_nan_is_skipped_captured_and_traced_to_module_and_sample(tmp_path):
    model, opt = make()
    data = batches(12, bad_step=BAD_STEP)
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=10, loss_fn=loss_fn) as monitor:
        for step, batch in enumerate(data, 1):
            before = [p.detach().clone() for p in model.parameters()] if step == BAD_STEP else None
            with monitor.autocast():
                loss = loss_fn(model, batch)
            monitor.backward(loss)
            monitor.step(batch)
            if before is not None:  # skipped on the device: bitwise unchanged
                assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
                before_bad = before
    assert all(torch.isfinite(p).all() for p in model.parameters())
    run = load_run(tmp_path / "run")
    assert run.metrics[0]["num_nonfinite"] == 1 and run.metrics[0]["num_skipped"] == 1  # the bad step alone
    incident = run.counted_events("incident")[0]
    assert incident.step == BAD_STEP and incident.extra["replayed_steps"] == BAD_STEP - 1
    # The bundle holds the state from before the bad step, rebuilt by replaying steps 1-6 from the snapshot: bitwise.
    bundle = torch.load(tmp_path / "run" / "incidents" / f"step_{BAD_STEP:06d}" / "bundle.pt", weights_only=True)
    assert all(torch.equal(bundle["model"][k], v) for k, v in zip(model.state_dict(), before_bad))
    d = incident.extra["diagnosis"]
    assert (d["stage"], d["op"], d["direction"], d["module"]) == ("activations", "aten.sqrt.default", "forward", "root")
    assert d["bad_samples"] == [BAD_POSITION] and d["bad_positions"] == [{"micro_batch": 0, "position": BAD_POSITION}]
    assert d["reproduces"] is True
    assert not [e for e in run.counted_events("skip") if "held" in e.reason]
    # `stabletrain diagnose` replays it in a fresh state: the model class and the loss are importable.
    fresh = diagnose_incident(tmp_path / "run" / "incidents" / f"step_{BAD_STEP:06d}")
    assert (fresh["module"], fresh["bad_samples"], fresh["first_nonfinite_param"]) == ("root", [BAD_POSITION], "fc1.weight")
    assert "root" in write_report(tmp_path / "run").read_text()


def test_stop_raises_at_the_boundary_and_warn_only_records(tmp_path, capsys):
    model, opt = make()
    monitor = Monitor(model, opt, run_dir=tmp_path / "stop", log_every=5, on_nonfinite="stop", loss_fn=loss_fn,
                      diagnose=False)
    with pytest.raises(StopTraining) as err:
        train(monitor, model, batches(12, bad_step=3))
    assert err.value.step == 5 and "non-finite" in err.value.reason
    assert " run stops at step" not in capsys.readouterr().out  # (StopTraining says it: not a line besides)
    kinds = [e["kind"] for e in read_jsonl(tmp_path / "stop" / "events.jsonl")[0]]
    assert "stop" in kinds and "incident" in kinds

    model, opt = make()
    monitor = Monitor(model, opt, log_every=5, on_nonfinite="warn", init_check=False)
    with pytest.warns(UserWarning, match="on_nonfinite='warn'"):
        train(monitor, model, batches(5, bad_step=3))
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # warn: the bad update was applied


@pytest.mark.filterwarnings("ignore:precision=fp16 on CPU")
def test_fp16_with_the_users_grad_scaler(tmp_path):
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=4)
    monitor = Monitor(model, opt, run_dir=tmp_path / "run", scaler=scaler, log_every=5, loss_fn=loss_fn)
    for step, batch in enumerate(batches(10), 1):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model, batch)
        if step == 3:
            loss = loss * 1e6  # the scaled grads overflow fp16: the scaler's routine skip, not an incident
        scaler.scale(loss).backward()  # the user scales; the monitor unscales, measures and steps through the scaler
        monitor.step(batch, loss=loss)
    monitor.close()
    run = load_run(tmp_path / "run")
    assert run.metrics[0]["num_skipped"] == 1 and run.metrics[0]["num_nonfinite"] == 0
    assert [e.step for e in run.counted_events("skip")] == [3] and not run.counted_events("incident")
    assert run.metrics[0]["loss_scale"] == 2.0**9  # halved at step 3, no growth yet (4 clean steps needed after it)
    assert run.metrics[1]["loss_scale"] == 2.0**10  # grew back at step 7, after growth_interval clean steps
    assert scaler.get_scale() == 2.0**10 and all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.filterwarnings("ignore:precision=fp16 on CPU")
def test_a_grad_scaler_backing_off_from_a_huge_scale_is_no_run_that_is_not_recovering(tmp_path):
    """A new-user trial: GradScaler(init_scale=2**60) backs off one skipped step at a time, and the Monitor stopped the run
    at step 20 ('20 consecutive skipped steps (guard.max_consecutive_skips=20) ... the run is not recovering') with
    on_nonfinite='skip', where the same loop alone trains on; nor could the limit be set from the adapter."""
    model, opt = make()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    monitor = Monitor(model, opt, run_dir=tmp_path / "run", scaler=scaler, log_every=4, init_check=False)
    for batch in batches(60):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = loss_fn(model, batch)
        scaler.scale(loss).backward()
        monitor.step(batch, loss=loss)
    monitor.close()
    run = load_run(tmp_path / "run")
    skipped = sum(m["num_skipped"] for m in run.metrics)
    assert 30 < skipped < 60 and not run.counted_events("incident") and not run.counted_events("stop"), skipped
    assert scaler.get_scale() < 2.0**30 and all(torch.isfinite(p).all() for p in model.parameters())
    assert Monitor(*make(), max_consecutive_skips=100).session.cfg.guard.max_consecutive_skips == 100  # an option, as the key


def test_resume_from_the_users_checkpoint_keeps_metrics_and_guard_continuous(tmp_path):
    data = batches(25)
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "ref", log_every=10, init_check=False) as ref:
        train(ref, model, data)

    model, opt = make()
    monitor = Monitor(model, opt, run_dir=tmp_path / "run", log_every=10, init_check=False)
    train(monitor, model, data[:15])
    ckpt = {"model": model.state_dict(), "optimizer": opt.state_dict(), "stabletrain": monitor.state_dict()}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    monitor.close()  # the process ends here

    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    model, opt = make(seed=1)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    monitor = Monitor(model, opt, run_dir=tmp_path / "run", log_every=10, init_check=False, resume=True)
    monitor.load_state_dict(ckpt["stabletrain"], path="ckpt.pt")
    assert monitor.num_steps == 15
    with monitor:
        train(monitor, model, data[15:])
    guard_ref, guard = ref.session.guard.state_dict(), monitor.session.guard.state_dict()
    torch.testing.assert_close(guard_ref["window"], guard["window"], rtol=0, atol=0, equal_nan=True)  # bitwise
    assert torch.equal(guard_ref["num_seen"], guard["num_seen"])
    a, b = load_run(tmp_path / "ref").metrics, load_run(tmp_path / "run").metrics
    assert [r["step"] for r in b] == [10, 15, 20, 25]  # 15: the first process's close() logged its partial interval
    b = [r for r in b if r["step"] != 15]
    for key in ("loss", "loss_min", "loss_max", "grad_norm", "grad_norm_max", "clip_rate", "samples_seen"):
        assert [r[key] for r in a] == [r[key] for r in b], key  # the interval across the resume included: bitwise
    assert [e.kind for e in load_run(tmp_path / "run").events].count("resume") == 1


def test_state_dict_round_trips(tmp_path):
    model, opt = make()
    monitor = Monitor(model, opt, log_every=10, init_check=False)
    train(monitor, model, batches(13))
    state = monitor.state_dict()
    model2, opt2 = make()
    other = Monitor(model2, opt2, log_every=10, init_check=False)
    other.load_state_dict(state)
    again = other.state_dict()
    assert again["step"] == 13 and again["metrics"]["steps"] == [11, 12, 13]
    torch.testing.assert_close(again["metrics"]["buf"], state["metrics"]["buf"], rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(again["guard"]["window"], state["guard"]["window"], rtol=0, atol=0, equal_nan=True)


def test_bad_arguments_say_what_to_do():
    model, opt = make()
    with pytest.raises(ValueError, match="rollback needs the checkpoints"):
        Monitor(model, opt, on_nonfinite="rollback")
    for bad in ("sikp", "rollback", "remedy"):  # a typo was offered rollback and remedy, which are then refused
        with pytest.raises(ValueError, match=f"^on_spike: expected 'warn' or 'skip', got '{bad}'") as err:
            Monitor(model, opt, on_spike=bad)
        assert ("host trainer owns" in str(err.value)) is (bad != "sikp")  # why not: for those asked for (a trial)
    with pytest.raises(ValueError, match=r"^on_nonfinite: expected 'skip', 'stop' or 'warn', got 'bogus'$"):
        Monitor(model, opt, on_nonfinite="bogus")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        Monitor(model, object())
    monitor = Monitor(model, opt, init_check=False)
    with pytest.raises(ValueError, match="call monitor.backward"):
        monitor.step()


@pytest.mark.parametrize("kwargs, message", [
    # a new-user trial: each was accepted, and loss_fn="x" lost the first incident ("its replay failed (TypeError: 'str'
    # object is not callable)"); init_check="no" ran the init report as if True
    ({"loss_fn": "x"}, "loss_fn: expected a function, got 'x'"),
    ({"init_check": "no"}, "init_check: expected True or False, got 'no'"),
    ({"mirror": 0}, "mirror: expected True or False, got 0"),
    ({"model_factory": "nomod_xyz:Nope"}, "model_factory: no module 'nomod_xyz' (from 'nomod_xyz:Nope'); is it on PYTHONPATH?"),
    ({"model_factory": "nomod"}, "model_factory: expected 'module:function' or a function that builds the model, got 'nomod'"),
    ({"clip_max_norm": -1}, "clip_max_norm: expected a number > 0 or None, got -1 (config key clip.max_norm)"),
    ({"clip_max_norm": "1"}, "clip_max_norm: expected a number > 0 or None, got '1' (config key clip.max_norm)"),
    ({"precision": "fp8"}, "precision: expected 'auto', 'fp32', 'bf16', 'fp16' or None, got 'fp8' (config key precision)"),
    # a new-user trial: scaler="yes" failed at the first step ('str' object has no attribute 'scale'), run_dir=123 with
    # pathlib's own error naming no argument (the HF callback took it), a bf16 run with a GradScaler was accepted
    ({"scaler": "yes"}, "scaler: expected a torch.amp.GradScaler or None, got 'yes'"),
    ({"run_dir": 123}, "run_dir: expected a path (str or pathlib.Path) or None, got 123"),
    ({"precision": "bf16", "scaler": torch.amp.GradScaler("cpu")}, "scaler: a GradScaler scales fp16's loss, but "
     "precision='bf16' (give precision='fp16' or leave it out with a scaler, or drop the scaler)"),
    # a trial: overwrite="false" replaced the run (a non-empty string is true); callbacks=[1] failed at the first step
    # with a traceback, callbacks=5 with "'int' object is not iterable"
    ({"overwrite": "false"}, "overwrite: expected True or False, got 'false'"),
    ({"callbacks": [1]}, "callbacks: expected stabletrain.callbacks.Callback instances, got 1 (an int)"),
    ({"callbacks": (Callback,)}, "callbacks: expected stabletrain.callbacks.Callback instances, got <class "
     "'stabletrain.callbacks.Callback'> (the class Callback: pass an instance, Callback())"),
    ({"callbacks": 5}, "callbacks: expected a list of stabletrain.callbacks.Callback instances, got 5"),
])
def test_an_adapters_own_arguments_are_checked_when_it_is_built_naming_the_argument(kwargs, message):
    model, opt = make()
    with pytest.raises(ValueError) as err:
        Monitor(model, opt, **kwargs)
    assert str(err.value) == message
    from stabletrain.integrations.lightning import StableTrainCallback

    if set(kwargs) <= {"loss_fn", "init_check", "mirror", "clip_max_norm", "run_dir", "overwrite", "callbacks"}:  # Lightning's
        with pytest.raises(ValueError) as err:
            StableTrainCallback(**kwargs)
        assert str(err.value) == message
    if set(kwargs) <= {"loss_fn", "init_check", "mirror", "run_dir", "overwrite", "callbacks"} and importlib.util.find_spec(
            "transformers"):  # HF's
        from stabletrain.integrations.transformers import StableTrainCallback as HFCallback

        with pytest.raises(ValueError) as err:
            HFCallback(**kwargs)
        assert str(err.value) == message
        if kwargs == {"overwrite": "false"}:  # (and its own trainer=: a Trainer or None)
            with pytest.raises(ValueError, match=r"^trainer: expected the transformers.Trainer the callback is added to, or "
                                                 r"None, got 3$"):
                HFCallback(trainer=3)


def test_callbacks_may_come_as_any_iterable():
    """A review: callbacks given as a generator worked before the check when built, then were refused by it."""
    model, opt = make()
    monitor = Monitor(model, opt, init_check=False, callbacks=(c for c in [Callback()]))
    assert [type(c) for c in monitor.session.callbacks.callbacks][-1] is Callback


def test_a_disabled_grad_scaler_is_no_scaler():
    """GradScaler(enabled=use_fp16), the common idiom, with use_fp16 False: refused beside precision='bf16' ('a GradScaler
    scales fp16's loss'), and taken as fp16's without one (its first step failed: no GradScaler._scale)."""
    off = torch.amp.GradScaler("cpu", enabled=False)
    model, opt = make()
    assert Monitor(model, opt, precision="bf16", scaler=off, init_check=False).precision.mode == "bf16"
    monitor = Monitor(model, opt, scaler=off, init_check=False)
    assert monitor.precision.mode == "fp32" and monitor.precision.scaler is None
    train(monitor, model, batches(3))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # beside precision='fp16' it scales nothing the run's unscale could take off (a review: an AssertionError at the
    # first step, 'Attempted unscale_ but _scale is None'): refused, naming both
    with pytest.raises(ValueError) as err:
        Monitor(model, opt, precision="fp16", scaler=off, init_check=False)
    assert str(err.value) == ("scaler: a disabled GradScaler (enabled=False) scales nothing, but precision='fp16' needs one "
                              "that does (enable it, or give precision='fp32'/'bf16')")


def test_an_exception_in_the_loop_is_a_crash_event_and_the_run_is_closed(tmp_path):
    model, opt = make()
    with pytest.raises(ZeroDivisionError):
        with Monitor(model, opt, run_dir=tmp_path / "run", log_every=10, init_check=False) as monitor:
            train(monitor, model, batches(3))
            _ = 1 / 0
    events = read_jsonl(tmp_path / "run" / "events.jsonl")[0]
    assert events[-1]["kind"] == "crash" and events[-1]["error"] == "ZeroDivisionError"
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]] == [3]  # the partial interval


def test_namedtuple_batches_are_captured_and_diagnosed_as_namedtuples_also_in_a_new_process(tmp_path):
    from integration_models import Pair, pair_loss_fn

    model, opt = make()
    data = [Pair(x, y) for x, y in batches(8, bad_step=BAD_STEP)]
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=4, loss_fn=pair_loss_fn) as monitor:
        for batch in data:
            monitor.backward(pair_loss_fn(model, batch), batch)
            monitor.step()
    (incident,) = load_run(tmp_path / "run").counted_events("incident")
    assert incident.extra["diagnosis"]["bad_positions"] == [{"micro_batch": 0, "position": BAD_POSITION}]
    fresh = diagnose_incident(tmp_path / "run" / "incidents" / f"step_{BAD_STEP:06d}")  # the bundle's Pair, rebuilt
    assert (fresh["module"], fresh["bad_samples"], fresh["sample_unit"]) == ("root", [BAD_POSITION],
                                                                            "position in the step's batch")


def test_without_loss_fn_an_incident_it_cannot_capture_is_said_once_and_a_captured_one_reaches_the_console(
        tmp_path, capsys):
    """Issue 33: the event said 'not captured: pass loss_fn=' and nothing reached the console. Now the first time a
    step cannot be captured is a StableTrainWarning (once, however many follow), and a captured incident that is not
    diagnosed still gets its one console line."""
    from stabletrain import StableTrainWarning

    model, opt = make()
    data = batches(30, bad_step=BAD_STEP)
    data[16] = batches(30, bad_step=17)[16]  # a second bad step, in the next interval
    data[20] = batches(30, bad_step=21)[20]  # and one on an interval's first step (captured, then 'diagnosis failed')
    with pytest.warns(StableTrainWarning) as caught:
        with Monitor(model, opt, run_dir=tmp_path / "run", log_every=10) as monitor:
            train(monitor, model, data)
    said = [str(w.message) for w in caught if "not captured" in str(w.message)]
    assert said == [f"the incident at step {BAD_STEP} was not captured: no replay of the host's steps (pass loss_fn= "
                    "to replay them)"]
    # It points at the user's own line that called into stabletrain (monitor.step in train() here), not at ours.
    assert [(Path(w.filename).name, w.lineno) for w in caught if "not captured" in str(w.message)] == [
        ("test_monitor.py", train.__code__.co_firstlineno + 5)]
    events = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl")[0] if e["kind"] == "incident"]
    assert [e["step"] for e in events] == [BAD_STEP, 17, 21] and all("not captured" in e["reason"] for e in events)
    out = capsys.readouterr().out
    later = [line for line in out.splitlines() if "not captured" in line]  # each later one: a line
    assert [x[:len("stabletrain: incident at step 17 (loss ")] for x in later] == [
        f"stabletrain: incident at step {s} (loss " for s in (17, 21)] and all(x.endswith(
            "not captured: no replay of the host's steps (pass loss_fn= to replay them)") for x in later), later
    assert "diagnosis failed" not in out and not (tmp_path / "run" / "incidents").exists()
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "quiet", log_every=10, loss_fn=loss_fn, diagnose=False) as monitor:
        train(monitor, model, batches(10, bad_step=BAD_STEP))
    line = f"stabletrain: incident at step {BAD_STEP} captured into {tmp_path / 'quiet' / 'incidents'}"
    assert line in capsys.readouterr().out


def test_without_loss_fn_no_batch_is_kept_and_no_snapshot_taken(tmp_path):
    """Nothing can replay the steps without loss_fn, so nothing a replay needs is kept: a copy of the state per interval
    and each step's batch were paid for an incident that could never be captured. With loss_fn both are there."""
    for fn, kept in ((None, False), (loss_fn, True)):
        model, opt = make()
        with Monitor(model, opt, run_dir=tmp_path / f"run{kept}", log_every=4, loss_fn=fn) as monitor:
            train(monitor, model, batches(10))
            session = monitor.session
            assert (session.capture.snapshot.taken, bool(session.steps.keeper.steps)) == (kept, kept)


def test_a_capture_whose_replay_fails_never_ends_the_users_loop(tmp_path):
    """loss_fn takes (x, y) but the loop hands step() its inputs alone: the capture's replay raised inside monitor.step
    and ended the user's training (its crash event said 'the host's training step'). Now the loss function's failure
    is said at the first step, with the user's line, and the incident is recorded as not captured; the loop trains on."""
    from stabletrain import StableTrainWarning

    model, opt = make()
    data = batches(20, bad_step=BAD_STEP)
    with pytest.warns(StableTrainWarning) as caught:
        with Monitor(model, opt, run_dir=tmp_path / "run", log_every=5, loss_fn=loss_fn) as monitor:
            for x, y in data:
                loss = loss_fn(model, (x, y))
                monitor.backward(loss)
                monitor.step(x)  # the inputs alone: not what loss_fn takes
    said = [str(w.message) for w in caught]
    assert any(m.startswith("the loss function that replays incidents fails on the step's batch (ValueError: ") and
               "integration_models.py" in m for m in said), said
    assert f"the incident at step {BAD_STEP} was not captured: its replay failed (ValueError: " in "".join(said), said
    events = read_jsonl(tmp_path / "run" / "events.jsonl")[0]
    assert [e["step"] for e in events if e["kind"] == "incident"] == [BAD_STEP] and not [e for e in events
                                                                                       if e["kind"] == "crash"]
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl")[0][-1]["step"] == 20  # trained to the end


def test_an_empty_batch_is_diagnosed_as_one_and_remedy_says_there_is_nothing_to_replay(tmp_path, capsys):
    """A loop that reads past its data's end hands the Monitor an empty batch: its loss is NaN (a mean over nothing).
    The diagnosis names that (it crashed on collating no rows before), and so do `diagnose` and `remedy`."""
    from stabletrain.cli import main

    model, opt = make()
    data = batches(12)
    data[8] = tuple(t[:0] for t in data[8])  # step 9: no samples
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=10, loss_fn=loss_fn) as monitor:
        train(monitor, model, data)
    (incident,) = load_run(tmp_path / "run").counted_events("incident")
    d = incident.extra["diagnosis"]
    assert incident.step == 9 and (d["failure_class"], d["stage"]) == ("data", "inputs"), d
    assert d["summary"].startswith("empty batch: its batch holds no samples; a mean loss over no samples is NaN")
    assert "stabletrain: incident at step 9: empty batch: its batch holds no samples" in capsys.readouterr().out
    folder = tmp_path / "run" / "incidents" / "step_000009"
    assert main(["diagnose", str(folder)]) == 0 and "empty batch" in capsys.readouterr().out
    assert main(["remedy", str(folder)]) != 0
    assert "step 9's batch holds no samples (micro-batch 0 empty): no remedy to replay" in capsys.readouterr().err


def test_a_second_monitor_into_a_run_it_would_replace_is_told_what_to_pass_in_python(tmp_path):
    """A Python user refused a run directory was told '--resume' and 'run.overwrite=true' (the CLI's words)."""
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=5) as monitor:
        train(monitor, model, batches(5))
    with pytest.raises(FileExistsError) as err:
        Monitor(model, opt, run_dir=tmp_path / "run", log_every=5).__enter__()
    assert "pass another run_dir= or overwrite=True" in str(err.value) and "--resume" not in str(err.value)
    assert "Monitor(..., resume=True), then load_state_dict" in str(err.value)
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=5, overwrite=True) as monitor:
        train(monitor, model, batches(5))


def test_one_empty_micro_batch_among_others_is_left_out_of_the_replay_and_said(tmp_path):
    """A step of two micro-batches, the second empty (a loop's last short slice): the replay runs the first, whose
    planted NaN it traces as ever, and the summary says the other held no samples (the whole diagnosis was 'empty
    batch' before, the NaN's own cause unnamed)."""
    model, opt = make()
    data = batches(12, bad_step=BAD_STEP)
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=10, loss_fn=loss_fn) as monitor:
        for step, batch in enumerate(data, 1):
            parts = [batch, tuple(t[:0] for t in batch)] if step == BAD_STEP else [batch]
            for part in parts:
                loss = loss_fn(model, part) if len(part[0]) else (model(part[0]).sum() * 0.0)
                monitor.backward(loss, part)
            monitor.step()
    (incident,) = load_run(tmp_path / "run").counted_events("incident")
    d = incident.extra["diagnosis"]
    assert incident.step == BAD_STEP and (d["module"], d["bad_samples"]) == ("root", [BAD_POSITION]), d
    assert "; micro-batch 1 of the step held no samples (left out of the replay; a mean loss over none is NaN)" in (
        d["summary"])


def test_a_resume_from_an_older_checkpoint_supersedes_the_metrics_lines_after_it(tmp_path):
    """A trial: a hand-written loop saved at step 4, died at step 9 and resumed from step 4: metrics.jsonl held steps
    4, 8, 8, 12, 14 (the dead process's step 8 beside the new one's). As the built-in loop's resume: the lines after the
    resumed step go to metrics.superseded.jsonl and the resume event counts them."""
    import json

    data = batches(14)
    model, opt = make()
    monitor = Monitor(model, opt, run_dir=tmp_path / "run", log_every=4, init_check=False)
    train(monitor, model, data[:4])
    ckpt = {"model": copy.deepcopy(model.state_dict()), "optimizer": copy.deepcopy(opt.state_dict()),
            "stabletrain": copy.deepcopy(monitor.state_dict())}
    train(monitor, model, data[4:9])
    monitor.close()  # (the process dies after step 9: its close logged the partial interval)
    (tmp_path / "run" / "incidents" / "step_000007").mkdir(parents=True)  # (as if it had captured step 7: trained again)
    model, opt = make(seed=1)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["optimizer"])
    monitor = Monitor(model, opt, run_dir=tmp_path / "run", log_every=4, init_check=False, resume=True)
    monitor.load_state_dict(ckpt["stabletrain"], path="ckpt.pt")
    with monitor:
        train(monitor, model, data[4:])
    run = load_run(tmp_path / "run")
    assert [r["step"] for r in run.metrics] == [4, 8, 12, 14]
    superseded = [json.loads(x) for x in (tmp_path / "run" / "metrics.superseded.jsonl").read_text().splitlines()]
    assert [(r["step"], r["superseded_by"]) for r in superseded] == [(8, "resume"), (9, "resume")]
    (resume,) = [e for e in run.events if e.kind == "resume"]
    assert resume.extra["superseded_metrics"] == 2 and "; 2 metrics line(s) after it superseded" in resume.reason
    # its captures of the steps trained again are set aside, as the built-in loop's resume does (a review)
    assert resume.extra["superseded_incidents"] == ["step_000007.superseded-resume"] and resume.reason.endswith(
        "; the incidents after it set aside: step_000007.superseded-resume")  # (said, as the loop's resume says it)
    assert [p.name for p in (tmp_path / "run" / "incidents").iterdir()] == ["step_000007.superseded-resume"]


def test_resume_into_a_directory_holding_another_run_is_refused_and_an_empty_one_is_said(tmp_path, capsys):
    """Monitor(resume=True) on a built-in run's directory replaced its config.yaml (integration: monitor) and appended
    its metrics after step 10000; `stabletrain train --resume` then refused the directory. Now it is refused, naming
    what the directory holds, with nothing written; a directory with no run says a new one starts there."""
    from stabletrain import Trainer

    built_in = tmp_path / "built-in"
    Trainer(cfg_mlp(), run_dir=built_in).fit()
    before = {p.name: p.read_bytes() for p in built_in.iterdir() if p.is_file()}
    model, opt = make()
    with pytest.raises(ValueError, match=r"resume=True: .*built-in holds a built-in run of task mlp, not a monitor run of "
                                         r"Net: give another run_dir \(or overwrite=True without resume\)"):
        Monitor(model, opt, run_dir=built_in, log_every=10, resume=True)
    assert {p.name: p.read_bytes() for p in built_in.iterdir() if p.is_file()} == before  # nothing written
    with Monitor(model, opt, run_dir=tmp_path / "new", log_every=10, resume=True, init_check=False) as monitor:
        train(monitor, model, batches(3))
    assert f"stabletrain: resume=True: {tmp_path / 'new'} holds no run to resume (no config.yaml); a new run starts there" \
        in capsys.readouterr().out
    with Monitor(model, opt, run_dir=tmp_path / "new", log_every=10, resume=True, init_check=False) as monitor:
        train(monitor, model, batches(3))  # its own run: reopened (load_state_dict would carry its step on)
    assert len(read_jsonl(tmp_path / "new" / "metrics.jsonl")[0]) == 2


def cfg_mlp():
    from helpers import cfg

    return cfg("train.max_steps=3", "log.every=3", "ckpt.every=0", "eval.every=0")


def test_your_own_backward_with_accumulation_hands_the_micro_batches_to_step(tmp_path, capsys):
    """Accumulation with loss.backward() of your own: there was no way to hand step() the micro-batches (the last
    one alone gave 'not reproducible ... suspect a hardware fault'); none at all said 'micro_batches is empty: pass the
    step's window as [(dataset indices, batch), ...]', an internal's words."""
    from stabletrain import StableTrainWarning

    def run(name, how):
        model, opt = make()
        data = batches(24, bad_step=BAD_STEP)
        with Monitor(model, opt, run_dir=tmp_path / name, log_every=10, loss_fn=loss_fn, init_check=False) as monitor:
            for i in range(0, 24, 2):
                micro = data[i:i + 2]  # two micro-batches a step: step 4 holds the planted sample (batch 7's)
                total = 0.0
                for batch in micro:
                    loss = loss_fn(model, batch) / 2
                    loss.backward()
                    total = total + loss.detach()
                monitor.step(loss=total, **how(micro))
        return [e for e in read_jsonl(tmp_path / name / "events.jsonl")[0] if e["kind"] == "incident"]

    (incident,) = run("list", lambda micro: {"micro_batches": micro})
    d = incident["diagnosis"]
    assert incident["step"] == 4 and d["failure_class"] == "op" and d["bad_positions"] == [
        {"micro_batch": 0, "position": BAD_POSITION}], d["summary"]
    with pytest.warns(StableTrainWarning, match=r"not captured: the step's batch was not given \(Monitor: monitor.step"
                                                r"\(batch, \.\.\.\), or with accumulation"):
        run("none", lambda micro: {})


def test_a_monitor_with_its_defaults_leaves_the_loops_updates_as_without_it(tmp_path):
    """Monitor clipped to 1.0 by default: wrapping a loop changed its updates (clip_rate 1.0). By default it measures;
    the parameters are bitwise those of the plain loop (a run directory written, the init check run)."""
    plain, opt = make()
    for batch in batches(12):
        opt.zero_grad()
        loss_fn(plain, batch).backward()
        opt.step()
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=4, loss_fn=loss_fn) as monitor:
        train(monitor, model, batches(12))
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))
    metrics = load_run(tmp_path / "run").metrics
    assert [r["clip_rate"] for r in metrics] == [0.0, 0.0, 0.0] and max(r["grad_norm"] for r in metrics) > 1.0


def test_the_kept_steps_do_not_pile_up_over_the_run(tmp_path, monkeypatch):
    """An adapter kept every step's batches for the whole run: past keep_max_mib (a long run) no capture could replay
    any more. It keeps the interval's steps and the 3 before it (a spike's ordinary windows), where one snapshot alone
    fits the host's memory (where two do, the interval before's too: the next test)."""
    monkeypatch.setattr("stabletrain.records.staging.host_memory_available", lambda: 0)
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=5, loss_fn=loss_fn) as monitor:
        for i, batch in enumerate(batches(40)):
            with monitor.autocast():
                loss = loss_fn(model, batch)
            monitor.backward(loss)
            monitor.step(batch)
            kept = monitor.session.steps.keeper
            assert len(kept.steps) <= 5 + 3 and kept.nbytes == sum(
                sum(b.numel() * b.element_size() for b in s.micro[0]) for s in kept.steps.values()), (i, sorted(kept.steps))
    assert sorted(kept.steps) == list(range(38, 41))  # the 3 before the next interval's


def test_your_own_clip_is_recorded_as_it_cut_and_the_report_says_so(tmp_path):
    """Your loop clips at 0.05 with clip_grad_norm_ and passes its pre-clip norm: the post-clip norm recorded is what
    your clip left (not the pre-clip norm again), every step clipped, and the report names your own clipping and its
    threshold, not "Clipping is off"."""
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=10) as monitor:
        for batch in batches(20):
            loss = loss_fn(model, batch)
            monitor.backward(loss)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            monitor.step(batch, grad_norm=norm)
    records, _ = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["clip_rate"] for r in records] == [1.0, 1.0]
    assert all(r["grad_norm"] > 0.05 and r["grad_norm_post_clip"] == pytest.approx(0.05, rel=1e-5) for r in records)
    html = write_report(tmp_path / "run").read_text()
    assert "Your own clipping fired on 100% of steps (20 of 20; threshold about 0.05, from the post-clip norms)" in html
    assert "Clipping is off" not in html


def test_a_whole_window_outlier_on_its_intervals_first_step_is_data_under_the_snapshot_before(tmp_path, monkeypatch):
    """Every sample of step 11 (the first of the interval from step 10) has a target x40 off. It opens its interval: no
    step before it there, and it was "state ... not told apart". Where twice the snapshot fits the host's memory the
    Monitor keeps the one before (step 5) and the batches since it, replays from there bitwise, and weighs the window
    under step 5's state: data, the batch itself an outlier. Where only one fits it keeps neither."""
    step = 11
    x, y = outlier_pairs(15, step, range(8), 8)

    def run(name, available):
        monkeypatch.setattr("stabletrain.records.staging.host_memory_available", lambda: available)
        model, opt = make()
        with Monitor(model, opt, run_dir=tmp_path / name, log_every=5, loss_fn=loss_fn) as monitor:
            for i in range(15):
                train(monitor, model, [(x[8 * i:8 * i + 8], y[8 * i:8 * i + 8])])
                assert len(monitor.session.steps.keeper.steps) <= 2 * 5 + 3, i
        (incident,) = [e for e in read_jsonl(tmp_path / name / "events.jsonl")[0] if e["kind"] == "incident"]
        folder = tmp_path / name / "incidents" / f"step_{step:06d}"
        return monitor, incident, json.loads((folder / "diagnosis.json").read_text())

    monitor, incident, full = run("twice", None)  # (None: the host's memory unknown, every snapshot fits)
    snapshot = monitor.session.capture.snapshot
    assert snapshot.keep_previous and incident["replayed_steps"] == 5
    assert incident["diagnosis"]["failure_class"] == "data", incident["diagnosis"]["summary"]
    assert full["older"]["step"] == 5 and "under the state of step 5" in full["summary"], full["summary"]
    assert sorted(monitor.session.steps.keeper.steps) == list(range(8, 16))  # since the snapshot before (10), and 3 before
    one = snapshot.num_bytes // 2
    monitor, _, alone = run("once", 6 * one)  # capture.snapshot_memory_fraction=0.25 of it: one and a half snapshots
    assert not monitor.session.capture.snapshot.keep_previous and monitor.session.capture.snapshot.num_bytes == one
    assert sorted(monitor.session.steps.keeper.steps) == list(range(13, 16))
    assert alone["older"] is None and alone["failure_class"] == "state", alone["summary"]
    assert "no older state is at hand to weigh the window against" in alone["summary"]



def test_the_interval_befores_kept_steps_go_first_where_keep_max_mib_is_reached():
    """Kept for a replay from the snapshot before, the interval before's steps share keep_max_mib with the interval's
    own: past it they go (that replay is then not possible), and the interval's own stay capturable."""
    from stabletrain.services.kept_steps import StepKeeper

    batch = (torch.zeros(8, 4), torch.zeros(8, 1))
    keeper = StepKeeper(8 * (32 + 8) * 4)  # 8 steps' batches
    for start in (0, 5, 10):  # interval_started after step `start`: what the snapshot before it needs stays
        keeper.drop_through(start - 5 - 3, start)
        keeper.spare_through = start - 3
        for t in range(start + 1, start + 6):
            keeper.keep(t, [batch], None, [], None)
            assert keeper.overflow_at is None and keeper.nbytes <= keeper.max_bytes, t
    assert sorted(keeper.steps) == [8, 9, 10, 11, 12, 13, 14, 15]  # 1, 2 went at step 9, 3..7 at 11; the 3 before 10 stay


def test_a_loss_that_enters_autocast_itself_leaves_precision_open_not_ruled_out(tmp_path):
    """fp16 spike (offset inputs near float16's limit at step 70) under a loss function that enters torch.autocast itself:
    the 'fp32' replay ran in fp16 too (the same loss, bitwise) and the spike was called data. The replay sees the
    autocast in the model's forward and says precision is not ruled out; with monitor.autocast() it is precision."""
    from spike_tasks import offset_inputs_task

    def run(own_autocast):
        task = offset_inputs_task()
        model, data = task.model, task.train_data
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.03, fused=True)

        def loss_fn(m, b):
            with torch.autocast("cpu", dtype=torch.float16) if own_autocast else contextlib.nullcontext():
                return torch.nn.functional.mse_loss(m(b[0]).float(), b[1])

        with Monitor(model, opt, run_dir=tmp_path / str(own_autocast), loss_fn=loss_fn, scaler=torch.amp.GradScaler("cpu"),
                     precision="fp16", log_every=10) as monitor:
            for s in range(72):
                batch = data[s * 8:(s + 1) * 8]
                with monitor.autocast():
                    loss = loss_fn(model, batch)
                monitor.backward(loss, batch)
                monitor.step()
        return json.loads((tmp_path / str(own_autocast) / "incidents" / "step_000070" / "diagnosis.json").read_text())

    own = run(True)
    assert own["fp32"] is None and "precision is not ruled out: a replay of the step in fp32 runs in fp16 too" in \
        own["evidence"], own["summary"]
    assert run(False)["failure_class"] == "precision"


def test_the_spike_rules_keys_are_adapter_options_as_the_docs_say(tmp_path):
    """docs/loss-spikes.md tells a user to shorten guard.spike_window; StableTrainCallback(spike_window=20) was a
    TypeError ('unexpected option')."""
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "run", spike_window=20, spike_ratio=3.0, spike_zscore=5.0) as monitor:
        guard = monitor.session.cfg.guard
        assert (guard.spike_window, guard.spike_ratio, guard.spike_zscore) == (20, 3.0, 5.0)
    want = r"^spike_window: config key 'guard.spike_window': expected an integer in \[4, 10000\], got "
    with pytest.raises(ValueError, match=want + "2$"):
        Monitor(model, opt, run_dir=None, spike_window=2)
    with pytest.raises(ValueError, match=want + "1000000000$"):  # (a trial: accepted, a 2-step run took 24 GB and 90 s)
        Monitor(model, opt, run_dir=None, spike_window=10**9)



def test_an_adapters_arguments_take_what_they_meant_before():
    """A review: model_factory 'pkg.mod:Class.builder' (a qualname) and precision='auto': accepted."""
    model, opt = make()
    Monitor(model, opt, model_factory="spike_tasks:OneStepAdamW.step", precision="auto", clip_max_norm=1, init_check=False)


def test_the_snapshots_config_hash_is_of_what_config_yaml_holds_and_an_unmeasured_epoch_is_nan(tmp_path):
    """A trial: two Monitor runs whose config.yaml differed (lr 0.1 and 0.5) had one config_hash (of the internal
    config, which holds no host's settings); and every row said epoch 0, which a hand-written loop never tells."""
    import json

    hashes = []
    for name, lr in (("a", 0.1), ("b", 0.5), ("c", 0.1)):
        model, opt = make(lr=lr)
        with Monitor(model, opt, run_dir=tmp_path / name, log_every=2, init_check=False) as monitor:
            train(monitor, model, batches(2))
        hashes.append(json.loads((tmp_path / name / "snapshot.json").read_text())["config_hash"])
    assert hashes[0] != hashes[1] and hashes[0] == hashes[2], hashes
    rows = read_jsonl(tmp_path / "a" / "metrics.jsonl")[0]
    assert [r["epoch"] for r in rows] == ["nan"]
    # The report's unit: samples where the run counted samples (it read "items/s"), tokens for the HF Trainer's adapter
    assert load_run(tmp_path / "a").count_unit == "samples"
    snapshot = json.loads((tmp_path / "c" / "snapshot.json").read_text())
    (tmp_path / "c" / "snapshot.json").write_text(json.dumps({**snapshot, "integration": "transformers"}))
    assert load_run(tmp_path / "c").count_unit == "tokens"
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "d", log_every=2, init_check=False) as monitor:
        for batch in batches(2):
            monitor.backward(loss_fn(model, batch))
            monitor.step(batch, num_tokens=5)  # a count of its own: what it counts is not known
    assert load_run(tmp_path / "d").count_unit == "items"


def test_an_optimizer_of_another_model_is_refused_and_a_float_loss_is_taken(tmp_path):
    """A new user's slips: an optimizer built on another model's parameters was accepted in silence (the model never
    trained, its gradients piled up: grad_norm 9.8 and climbing); step(loss=loss.item()) raised "'float' object has no
    attribute 'detach'" from stabletrain's own line."""
    model, _ = make()
    _, other = make()
    with pytest.raises(ValueError, match=r"^the optimizer \(AdamW\) holds none of the model's parameters \(\d+ tensor\(s\) "
                                         r"of another model\): build it on this model's parameters \(a Task.optimizer "
                                         r"factory: on the named_params it is given\)$"):
        Monitor(model, other, run_dir=tmp_path / "other")
    assert not (tmp_path / "other").exists()  # refused before anything was written
    model, opt = make()
    losses = []
    with Monitor(model, opt, run_dir=tmp_path / "float", log_every=5) as monitor:
        for batch in batches(5):
            loss = loss_fn(model, batch)
            loss.backward()
            losses.append(loss.item())
            # your own backward, its loss as a Python float (or a 1-element tensor, DataParallel's shape)
            monitor.step(batch, loss=loss.item() if len(losses) % 2 else loss.detach().reshape(1))
    (record,) = read_jsonl(tmp_path / "float" / "metrics.jsonl")[0]
    assert record["loss"] == pytest.approx(sum(losses) / 5, rel=1e-6)
    # what is not a step's loss gets one line that names loss= and what it got (a raw torch error named neither)
    model, opt = make()
    with Monitor(model, opt, run_dir=tmp_path / "wrong", log_every=5) as monitor:
        batch = next(iter(batches(1)))
        loss_fn(model, batch).backward()
        for wrong, got in ((torch.ones(3), r"a tensor of shape \(3,\) \(reduce it first, e.g. loss.mean\(\)\)"),
                           ("0.5", "str '0.5'"), (True, "bool True"), (torch.tensor(1j), r"Tensor tensor\(0.\+1.j\)"),
                           (None, None)):
            if wrong is None:  # a numpy number, numpy's 0-d and 1-element arrays, a Fraction: numbers
                for number in (np.float32(0.5), np.array(0.5), np.array([0.5]), fractions.Fraction(1, 2)):
                    loss_fn(model, batch).backward()
                    monitor.step(batch, loss=number)
                continue
            with pytest.raises(ValueError, match=r"^Monitor.step\(loss=...\): expected the step's loss as a number or a "
                                                 rf"one-element tensor, got {got}$"):
                monitor.step(batch, loss=wrong)


def test_a_buffer_of_minus_inf_is_no_broken_weight(tmp_path):
    """A review: the check of the weights a step started from read the whole state dict, so a causal mask of -inf (a
    buffer) opened every incident's summary with 'the parameters were non-finite before this step (mask)'."""
    model, opt = make()
    model.register_buffer("mask", torch.full((4,), float("-inf")))
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=5, loss_fn=loss_fn, init_check=False) as monitor:
        train(monitor, model, batches(6, bad_step=3))
    (incident,) = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl")[0] if e["kind"] == "incident"]
    assert "params_nonfinite_before" not in incident["diagnosis"], incident["diagnosis"]["summary"]
    assert not incident["diagnosis"]["summary"].startswith("the parameters were"), incident["diagnosis"]["summary"]


def test_under_warn_a_later_incident_says_the_parameters_were_already_non_finite(tmp_path):
    """A trial (HF, on_nonfinite='warn'): step 33's NaN update was applied as asked, and the incidents after it read 'first
    non-finite value (loss) ... outside any module ... at every sample: not the data' while the weights were NaN since.
    A step replayed from non-finite weights says so first, naming them."""
    model, opt = make()
    with pytest.warns(UserWarning, match="on_nonfinite='warn'"):
        with Monitor(model, opt, run_dir=tmp_path / "run", log_every=5, on_nonfinite="warn", loss_fn=loss_fn,
                     init_check=False) as monitor:
            train(monitor, model, batches(12, bad_step=3))
    incidents = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl")[0] if e["kind"] == "incident"]
    assert [e["step"] for e in incidents][:1] == [3] and len(incidents) >= 2, [e["reason"] for e in incidents]
    first, later = (e.get("diagnosis") or {} for e in incidents[:2])
    assert "params_nonfinite_before" not in first and not first["summary"].startswith("the parameters were")
    assert later["summary"].startswith("the parameters were non-finite before this step (fc1.weight"), later["summary"]
    assert "an update applied before it broke them (on_nonfinite='warn'" in later["summary"]


def test_a_loop_that_misuses_the_monitor_is_told_once_at_its_own_line(tmp_path):
    """A trial: the loop's own optimizer.step() beside monitor.step() ran every step twice, with only an 'init
    overwritten' warning; a Monitor never stepped, or a last backward never stepped, closed silently (an empty
    metrics.jsonl); a function given as the model failed with AttributeError: 'function' object has no attribute
    'parameters'."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    with pytest.raises(ValueError, match=r"^model: expected a torch.nn.Module, got "):
        Monitor(lambda x: x, opt)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Monitor(model, opt, run_dir=tmp_path / "twice", log_every=2, loss_fn=loss_fn) as monitor:
            for batch in batches(4):
                monitor.backward(loss_fn(model, batch), batch)
                opt.step()  # the loop's own: monitor.step() steps it too
                monitor.step()
    said = [w for w in seen if "outside monitor.step()" in str(w.message)]
    assert len(said) == 1 and Path(said[0].filename) == Path(__file__), [str(w.message) for w in seen]  # once, here
    assert str(said[0].message).startswith("optimizer.step() was called outside monitor.step(), which steps the optimizer")
    for case in ("never stepped", "a last backward"):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with Monitor(model, opt, run_dir=tmp_path / case.replace(" ", "_"), log_every=2) as monitor:
                for batch in batches(3 if case == "a last backward" else 1):
                    if case == "never stepped":  # the loop steps its optimizer itself
                        loss_fn(model, batch).backward()
                        opt.step()
                        continue
                    monitor.backward(loss_fn(model, batch), batch)
                    if monitor.num_steps < 2:
                        monitor.step()
        said = [str(w.message) for w in seen if "monitor.step()" in str(w.message)]
        want = (["optimizer.step() was called outside monitor.step()", "the Monitor recorded no step"]
                if case == "never stepped" else  # each of the two misuses, once
                ["1 monitor.backward() call(s) after the last monitor.step() were never stepped: their gradients are "
                 "dropped at close"])
        assert len(said) == len(want) and all(x.startswith(w) for x, w in zip(said, want)), said
    with warnings.catch_warnings(record=True) as seen:  # built and closed with no step at all
        warnings.simplefilter("always")
        Monitor(model, opt, run_dir=tmp_path / "empty").close()
    assert [str(w.message) for w in seen if "no step" in str(w.message)] == [
        "the Monitor recorded no step: call monitor.step() once per optimizer step, after its backward (monitor.step() "
        "steps the optimizer; the run directory holds no metrics)"]
    with warnings.catch_warnings(record=True) as seen:  # an exception that ends the loop says it all: nothing more
        warnings.simplefilter("always")
        with pytest.raises(KeyError), Monitor(model, opt, run_dir=tmp_path / "raised") as monitor:
            monitor.backward(loss_fn(model, batches(1)[0]), batches(1)[0])
            raise KeyError("the loop's own")
        monitor.close()  # a finally: monitor.close() around the with block (close is idempotent): still nothing said
    assert not [w for w in seen if "monitor.step()" in str(w.message)], [str(w.message) for w in seen]
    with warnings.catch_warnings(record=True) as seen:  # two misuses in one loop: each said (one silenced the other)
        warnings.simplefilter("always")
        with Monitor(model, opt, run_dir=tmp_path / "both", log_every=2) as monitor:
            for batch in batches(2):
                monitor.backward(loss_fn(model, batch), batch)
                opt.step()
                if monitor.num_steps < 1:
                    monitor.step()
    said = [str(w.message)[:60] for w in seen if "monitor.step()" in str(w.message)]
    assert said == ["optimizer.step() was called outside monitor.step(), which st",
                    "1 monitor.backward() call(s) after the last monitor.step() w"], said


def test_a_weight_non_finite_before_the_first_step_is_said_to_have_come_so_not_blamed_on_the_learning_rate(tmp_path):
    """A trial (a GPT-2 with one embedding row set to inf before train()): the incident at step 1 said 'an update applied
    before it broke them (on_nonfinite='warn' ...)' under the default skip, and 'the optimizer step makes it non-finite
    (learning rate too high?)': no update had been applied."""
    torch.manual_seed(0)
    model = Net()
    with torch.no_grad():
        model.fc2.weight[0, 3] = float("inf")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    run_dir = tmp_path / "run"
    with contextlib.suppress(StopTraining), Monitor(model, opt, run_dir=run_dir, log_every=4, loss_fn=loss_fn) as monitor:
        for batch in batches(4):
            monitor.backward(loss_fn(model, batch), batch)
            monitor.step()
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    incident = next(e for e in events if e["kind"] == "incident")
    d = json.loads((Path(incident["path"]) / "diagnosis.json").read_text())
    assert incident["step"] == 1 and d["params_nonfinite_before"] == ["fc2.weight"]
    assert d["summary"] == ("the parameters were non-finite before the first step (fc2.weight): the model came so, no "
                            "update had been applied (its init, weights it loaded, an edit before training); the replay's "
                            "own reading, on those weights, is in the evidence"), d["summary"]
    assert incident["diagnosis"]["summary"] == d["summary"]


def test_a_weight_made_non_finite_outside_the_optimizer_is_said_so_not_blamed_on_the_hardware(tmp_path):
    """A trial: the loop set one weight to inf before step 7 (weight surgery, an EMA swap, a load_state_dict do it): the
    incident said 'no non-finite value on replay ... suspect a hardware fault or nondeterminism' (the replay's weights,
    from the interval's start, are finite) and the stop 'a skip cannot undo an applied update', of a step that applied
    none. The run's own weights before the skipped step were non-finite and no replayed update made them so."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    run_dir = tmp_path / "run"
    with contextlib.suppress(StopTraining), Monitor(model, opt, run_dir=run_dir, log_every=4, loss_fn=loss_fn) as monitor:
        for step, batch in enumerate(batches(8), start=1):
            if step == 7:
                with torch.no_grad():
                    model.fc2.weight[0, 3] = float("inf")
            monitor.backward(loss_fn(model, batch), batch)
            monitor.step()
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    (incident,) = [e for e in events if e["kind"] == "incident"]
    d = json.loads((Path(incident["path"]) / "diagnosis.json").read_text())
    assert incident["step"] == 7 and d["failure_class"] == "not reproducible" and d["changed_outside"] == ["fc2.weight"]
    assert incident["diagnosis"]["summary"] == d["summary"]
    assert d["summary"].startswith("not reproducible: the run's parameters held non-finite values before this step "
                                   "(fc2.weight; its update was skipped), the replay's do not: no replayed update of the "
                                   "interval made them so; they were changed outside the optimizer's steps"), d["summary"]
    assert "suspect a hardware fault" not in d["summary"]
    stops = [e["reason"] for e in events if e["kind"] == "stop"]
    assert all("a skip cannot make non-finite parameters finite again" in r for r in stops) and len(stops) == 1, stops


def test_a_monitor_never_closed_lets_go_of_the_optimizer_and_a_new_one_on_it_is_not_warned(tmp_path):
    """A review: a Monitor never closed (its loop raised, a notebook cell run again) stayed alive through its hook on
    the optimizer, and a new Monitor on that optimizer was told 'optimizer.step() was called outside monitor.step()' of
    its own steps."""
    import gc
    import weakref

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = batches(6)
    old = Monitor(model, opt)
    for batch in data[:2]:
        old.backward(loss_fn(model, batch), batch)
        old.step()
    kept = Monitor(model, opt)  # built again while the first is still held (not closed)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Monitor(model, opt, run_dir=tmp_path / "new") as monitor:
            for batch in data[2:]:
                monitor.backward(loss_fn(model, batch), batch)
                monitor.step()
    assert not [w for w in seen if "outside monitor.step()" in str(w.message)], [str(w.message) for w in seen]
    ref = weakref.ref(old)
    del old, kept
    gc.collect()
    assert ref() is None  # the optimizer's hook does not hold it


def test_fewer_batches_than_backward_calls_are_said_once_at_the_users_line(tmp_path):
    """A trial: two monitor.backward(loss / 2) calls without their micro-batches, then monitor.step(last_micro_batch): the
    capture replayed one micro-batch of two and its diagnosis led with 'suspect a hardware fault or nondeterminism'. The
    Monitor counts what it was given: said once, where the loop called step()."""
    model, opt = make()
    data = batches(6)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Monitor(model, opt, run_dir=tmp_path / "fewer", log_every=3, loss_fn=loss_fn) as monitor:
            for batch in data:
                halves = [batch[0][:4], batch[1][:4]], [batch[0][4:], batch[1][4:]]
                for half in halves:
                    monitor.backward(loss_fn(model, half) / 2)
                monitor.step(halves[-1])
    said = [w for w in seen if "monitor.backward() calls since the last step" in str(w.message)]
    assert len(said) == 1 and Path(said[0].filename) == Path(__file__), [str(w.message) for w in seen]
    assert str(said[0].message) == (
        "monitor.step(): 2 monitor.backward() calls since the last step but 1 batch given: a capture replays only "
        "those (and finds the step's loss not reproducible); pass each micro-batch to monitor.backward(loss, batch), or "
        "all to monitor.step(micro_batches=[...])")
    model, opt = make()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with Monitor(model, opt, run_dir=tmp_path / "each", log_every=3, loss_fn=loss_fn) as monitor:
            for batch in data:
                for half in ([batch[0][:4], batch[1][:4]], [batch[0][4:], batch[1][4:]]):
                    monitor.backward(loss_fn(model, half) / 2, half)
                monitor.step()
    assert not [w for w in seen if "calls since the last step" in str(w.message)]



def test_a_nan_batch_your_loop_ran_before_a_skip_has_its_batchnorm_statistics_reset_at_the_boundary(tmp_path):
    """Your loop's forward moved the BatchNorm's running statistics before the monitor judged the step (its forwards are
    yours: not kept, not put back as the built-in loop's are): a NaN batch it skips leaves NaN there, which the log
    boundary resets (mean 0, var 1), said in a buffers_reset event, so that the run's checkpoints are not withheld."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    x, y = torch.randn(40, 4), torch.randn(40, 1)
    x[21] = float("nan")  # in step 3's batch of 8 (steps 1..5)
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=5, init_check=False, capture=False) as monitor:
        for s in range(5):
            loss = torch.nn.functional.mse_loss(model(x[8 * s:8 * (s + 1)]), y[8 * s:8 * (s + 1)])
            monitor.backward(loss)
            monitor.step()
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "skip"] == [3]
    assert [(e["step"], e["buffers"]) for e in events if e["kind"] == "buffers_reset"] == [(3, ["1"])], events
    assert bool(model[1].running_mean.isfinite().all()) and bool(model[1].running_var.isfinite().all())
