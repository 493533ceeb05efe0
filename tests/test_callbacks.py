"""Callbacks: where each hook fires, user callbacks from Python and from the config, state in checkpoints."""

import json

import pytest
import torch
from helpers import HookLog, PoisonAt, cfg, regression_task

from stabletrain import Trainer
from stabletrain.callbacks import Callback, CallbackList, load_callbacks
from stabletrain.callbacks.sinks import EventLog, InitWatch, MetricsFile, ProgressBar, TensorBoardLog
from stabletrain.records.checkpoint.writer import writer
from stabletrain.records.staging import clone_state
from stabletrain.services.checkpoints import CheckpointKeeper
from stabletrain.services.incidents import IncidentRecorder
from stabletrain.services.signals import SignalHandler
from stabletrain.tasks import TaskError


def test_hooks_fire_in_the_documented_order(tmp_path):
    import time

    running, deadline = writer(), time.monotonic() + 60  # running and serving already (as after an earlier run in this
    while not running.ready and time.monotonic() < deadline:  # process): the step-0 save goes to it, not inline (a fresh
        time.sleep(0.05)  # writer still importing torch took it inline: the test failed when run alone)
    log = HookLog()
    Trainer(cfg("train.max_steps=4", "log.every=2", "ckpt.every=4"), task=regression_task(), run_dir=tmp_path / "r",
            callbacks=[log]).fit()
    # The step-0 save runs in the background: its outcome is reported after the first log boundary at which it
    # has finished (here step 2 or 4); the run's last checkpoint is waited for and reported at once.
    first = log.calls.index(("checkpoint:checkpoint", 0))
    assert log.calls[first - 1] in (("log", 2), ("log", 4))
    assert log.calls[:first] + log.calls[first + 1:] == [
        ("fit_start", 0), ("step_end", 1), ("step_end", 2), ("log", 2), ("step_end", 3), ("step_end", 4), ("log", 4),
        ("checkpoint:checkpoint", 4), ("fit_end", 4)]


def test_incident_and_stop_hooks_fire_with_the_step(tmp_path):
    task = regression_task()
    task.model = PoisonAt(task.model, {3})
    log = HookLog()
    Trainer(cfg("train.max_steps=6", "log.every=3", "guard.on_nonfinite=stop", "train.batch_size=8"), task=task,
            run_dir=tmp_path / "r", callbacks=[log]).fit()
    assert ("incident", 3) in log.calls and ("stop", 3) in log.calls and log.calls[-1] == ("fit_end", 3)
    assert log.calls.index(("incident", 3)) < log.calls.index(("stop", 3))


def test_rollback_hook_fires_after_going_back_to_last_good(tmp_path):
    task = regression_task()
    task.model = PoisonAt(task.model, {5})
    log = HookLog()
    Trainer(cfg("train.max_steps=8", "log.every=2", "ckpt.every=2", "guard.on_nonfinite=rollback", "train.batch_size=8",
                "capture.diagnose=false"), task=task, run_dir=tmp_path / "r", callbacks=[log]).fit()
    assert ("rollback", 4) in log.calls


def test_a_callback_from_the_config_key_is_built_and_its_state_resumes_from_the_checkpoint(tmp_path):
    HookLog.instances.clear()
    c = cfg("train.max_steps=4", "log.every=2", "ckpt.every=2", "callbacks=[helpers:HookLog]")
    Trainer(c, task=regression_task(), run_dir=tmp_path / "r").fit()
    first = HookLog.instances[-1]
    assert first.steps_seen == 4
    c = cfg("train.max_steps=6", "log.every=2", "ckpt.every=2", "callbacks=[helpers:HookLog]")
    resumed = Trainer(c, task=regression_task(), run_dir=tmp_path / "r", resume=True)
    second = HookLog.instances[-1]
    assert second is not first and second.steps_seen == 4, "the callback's state came back from the checkpoint"
    resumed.fit()
    assert second.steps_seen == 6 and second.calls[:2] == [("fit_start", 4), ("resume", 4)]


@pytest.mark.parametrize("spec, message", [("nocolon", "expected 'module:Class'"),
                                           ("no_such_module_xyz:Thing", "cannot import module"),
                                           ("helpers:regression_task", "not a stabletrain.callbacks.Callback")])
def test_a_bad_callback_spec_names_the_key(spec, message):
    with pytest.raises((TaskError, ValueError), match=message):
        load_callbacks([spec])


def test_only_callback_instances_are_accepted():
    with pytest.raises(TypeError, match="expected a stabletrain.callbacks.Callback"):
        CallbackList([object()])


def test_every_builtin_callback_state_round_trips_and_services_are_not_callbacks():
    builtins = [InitWatch(), EventLog(), MetricsFile(), TensorBoardLog(), ProgressBar(), HookLog()]
    cbs = CallbackList(builtins)
    state = cbs.state_dict()
    assert set(state) == {"InitWatch", "EventLog", "MetricsFile", "TensorBoardLog", "ProgressBar", "HookLog"}
    for service in (CheckpointKeeper, IncidentRecorder, SignalHandler):  # called by the loop by name
        assert not issubclass(service, Callback)
    builtins[-1].steps_seen = 7
    again = CallbackList([HookLog(), HookLog()])
    again.load_state_dict(CallbackList([builtins[-1], HookLog()]).state_dict())
    assert [cb.steps_seen for cb in again.callbacks] == [7, 0], "the same class twice keeps its own state"


def test_clone_state_copies():
    src = {"a": torch.ones(3), "b": [torch.zeros(2), 5], "c": "x"}
    cloned = clone_state(src)
    src["b"][0] += 1
    assert torch.equal(cloned["b"][0], torch.zeros(2))


def test_a_user_callback_sees_metrics_records_and_device_step_outputs(tmp_path):
    class Collect(Callback):
        def __init__(self):
            self.records, self.kinds = [], set()

        def on_step_end(self, state, out):
            self.kinds |= {type(v) for v in out.values()}

        def on_log(self, state, record, rows):
            self.records.append(record)

    col = Collect()
    Trainer(cfg("train.max_steps=4", "log.every=2"), task=regression_task(), run_dir=tmp_path / "r",
            callbacks=[col]).fit()
    assert col.kinds == {torch.Tensor}, "the step's figures stay device tensors"
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in col.records] == [r["step"] for r in lines] == [2, 4]
