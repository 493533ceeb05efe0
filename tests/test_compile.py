"""train.compile and host-compiled models: no graph break added, eager checkpoint keys, bitwise resume, eager diagnosis."""

from __future__ import annotations

import json
import signal

import pytest
import torch
from helpers import cfg, regression_task
from integration_models import BAD_POSITION, BAD_STEP, Net, batches, loss_fn
from test_resume import ARGS, _assert_bitwise, _final_state, _kill_at, _start
from torch._dynamo.utils import counters
from torch.utils.data import TensorDataset

from stabletrain import Monitor, Task, Trainer, load_config
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.report import load_run

pytestmark = pytest.mark.slow  # inductor compiles (a few seconds each, cached on disk)


def test_compiled_run_adds_no_graph_break_or_recompile_and_checkpoints_as_eager(tmp_path):
    torch._dynamo.reset()
    counters.clear()
    # Every stabletrain piece a step touches: log intervals (metrics, snapshot), checkpoints, update norms, checks.
    c = cfg("train.compile=true", "train.max_steps=12", "train.batch_size=8", "log.every=4", "ckpt.every=4",
            "eval.every=0")
    trainer = Trainer(c, task=regression_task(dropout=0.1), run_dir=tmp_path / "run")
    assert type(trainer.model).__name__ == "OptimizedModule" and trainer.module is not trainer.model
    trainer.fit()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1  # compiled once: nothing per step or per interval recompiles
    state = CheckpointManager(tmp_path / "run" / "checkpoints").load().state
    assert list(state["model"]) == ["0.weight", "0.bias", "3.weight", "3.bias"]  # the eager module's keys

    # An incident: the capture's replay runs the compiled step, the diagnosis the module itself, eagerly.
    c = cfg("train.compile=true", "train.max_steps=8", "train.batch_size=8", "log.every=8", "eval.every=0",
            "data.shuffle=false")
    Trainer(c, task=_root_task(bad_index=37), run_dir=tmp_path / "nan").fit()
    incident = load_run(tmp_path / "nan").counted_events("incident")[0]
    assert incident.step == 5  # samples 32-39
    full = json.loads((tmp_path / "nan" / "incidents" / "step_000005" / "diagnosis.json").read_text())
    assert (full["module"], full["op"], full["bad_samples"], full["first_nonfinite_param"]) == (
        "root", "aten.sqrt.default", [37], "fc1.weight")
    assert (full["replay_mode"], full["run_compiled"], full["reproduces"]) == ("eager", True, True)
    assert "_orig_mod" not in json.dumps(full)


def _root_task(bad_index: int, n: int = 64) -> Task:
    """Net (sqrt(|h| + x0)) on inputs with x0 >= 0, except sample ``bad_index``: NaN in module 'root'."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(n, 4, generator=g), torch.randn(n, 1, generator=g)
    x[bad_index, 0] = -100.0
    torch.manual_seed(0)
    return Task(model=Net(), train_data=TensorDataset(x, y), loss=loss_fn, name="root")


def test_host_compiled_model_in_monitor_is_named_and_diagnosed_without_the_wrapper(tmp_path):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    net = Net()
    model = torch.compile(net)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, fused=True)
    with Monitor(model, opt, run_dir=tmp_path / "run", log_every=10, loss_fn=loss_fn) as monitor:
        for batch in batches(12, bad_step=BAD_STEP):
            loss = loss_fn(model, batch)
            monitor.backward(loss)
            monitor.step(batch)
    # The adapter's hooks, snapshot, capture replay and eager diagnosis add no graph break and no recompile.
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 1
    run = load_run(tmp_path / "run")
    assert run.config["train"]["compile"] is True
    assert [n for n, _ in monitor.session.named_params] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    d = run.counted_events("incident")[0].extra["diagnosis"]
    assert (d["module"], d["bad_samples"], d["first_nonfinite_param"]) == ("root", [BAD_POSITION], "fc1.weight")


def test_compiled_sigkill_then_resume_is_bitwise_equal(tmp_path):
    reference = tmp_path / "reference"  # (uninterrupted, in this process: the killed run's fresh processes must equal it)
    Trainer(load_config(None, [*ARGS, "train.compile=true"]), run_dir=reference).fit()
    expected = _final_state(reference)
    assert not [k for k in expected["model"] if "_orig_mod" in k]

    run_dir = tmp_path / "killed"
    proc = _start(run_dir, "train.compile=true")
    rc, _, _ = _kill_at(proc, run_dir, 7)
    assert rc == -signal.SIGKILL
    proc = _start(run_dir, "train.compile=true", resume=True)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    _assert_bitwise(_final_state(run_dir), expected)


def test_a_compiled_task_model_is_refused_naming_train_compile():
    task = regression_task()
    task.model = torch.compile(task.model)
    with pytest.raises(ValueError, match=r"already a torch.compile wrapper .*'train.compile' to true"):
        Trainer(cfg(), task=task)
