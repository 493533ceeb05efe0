"""MLflow and W&B (offline) from the Trainer and the CLI: read back through MLflow's client and W&B's own run files.

One SQLite MLflow store for the module (MLflow's first open of a store migrates it: seconds), an experiment per
test. W&B runs offline under the run directory; its files are read with the tests' wandb_reader.py (wandb has no
public local reader; stabletrain itself never reads them).
"""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys

import pytest
import yaml
from helpers import cfg
from multiproc import env, stabletrain
from wandb_reader import WandbFileError, read_run_file, run_files

from stabletrain import Trainer
from stabletrain.callbacks import Callback
from stabletrain.callbacks.tracker_sink import TRACKERS_FILE, read_trackers_file
from stabletrain.config import flatten_config, load_config
from stabletrain.records.jsonl import read_jsonl
from stabletrain.report import write_report

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("wandb")
from mlflow.tracking import MlflowClient  # noqa: E402

# slow: every test trains and starts W&B's service process or migrates an MLflow store.
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")]

# data.shuffle=false: sample 37 (NaN) is in the third batch of each 4-batch epoch: steps 3 and 7 are bad.
INCIDENTS = ("train.batch_size=16", "train.max_steps=10", "log.every=5", "data.shuffle=false", "eval.every=0")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow') / 'mlflow.db'}"
    MlflowClient(uri).search_experiments()  # creates and migrates the store once
    return uri


def mlflow_run(run_dir):
    entry = read_trackers_file(run_dir)["mlflow"]
    client = MlflowClient(entry["tracking_uri"])
    return client, client.get_run(entry["run_id"])


def wandb_files(run_dir):
    entry = read_trackers_file(run_dir)["wandb"]
    return [read_run_file(f) for f in run_files(entry["dir"], entry["run_id"])]


def own_env(**extra):
    """A child's environment without this process's W&B service (WANDB_SERVICE): the child starts its own, as a
    command started from a shell does (a shared service writes the child's file after the child is gone)."""
    return {k: v for k, v in {**env(), **extra}.items() if not k.startswith("WANDB_SERVICE")}


def finish(cmd):
    """Run ``cmd`` to completion in :func:`own_env`; fail with its output's tail when it exits non-zero."""
    res = subprocess.run(cmd, env=own_env(), capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, f"stdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"


def metrics(run_dir):
    return read_jsonl(run_dir / "metrics.jsonl")[0]


def same(a, b):
    """Equal, NaN to NaN (metrics.jsonl writes a non-finite float as the string "nan", "inf" or "-inf")."""
    a, b = (float(x) if isinstance(x, str) else x for x in (a, b))
    return a == b or (math.isnan(a) and math.isnan(b))


def numeric(line):
    """The keys of a metrics.jsonl line a tracker gets: numbers (and non-finite ones, written as strings)."""
    return [k for k, v in line.items() if k != "step" and (isinstance(v, (int, float)) or v in ("nan", "inf", "-inf"))]


@pytest.fixture(scope="module")
def incident_run(store, tmp_path_factory):
    """Ten steps of the NaN-sample task with MLflow and W&B: two skipped steps, two incidents (diagnosed)."""
    run_dir = tmp_path_factory.mktemp("tracked") / "run"
    c = cfg(*INCIDENTS, "log.trackers=[mlflow,wandb]", f"log.mlflow.tracking_uri={store}",
            "log.mlflow.experiment=incidents", task="helpers:nan_sample_task")
    Trainer(c, run_dir=run_dir).fit()
    return run_dir


def test_mlflow_holds_the_metrics_config_tags_and_each_diagnosis(incident_run):
    lines = metrics(incident_run)
    assert [r["step"] for r in lines] == [5, 10]
    client, run = mlflow_run(incident_run)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    # Every numeric key of every metrics.jsonl line, at its step, once; the same value (a double, exactly).
    for key in numeric(lines[0]):
        history = client.get_metric_history(run.info.run_id, key)
        assert [m.step for m in history] == [5, 10], key
        assert all(same(m.value, r[key]) for m, r in zip(history, lines)), key
    assert "top_grad_layers" not in run.data.metrics  # not a number
    config = flatten_config(yaml.safe_load((incident_run / "config.yaml").read_text()))
    assert run.data.params == {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    assert run.data.params["optim.lr"] == "0.001" and run.data.params["log.trackers"] == '["mlflow", "wandb"]'
    tags = run.data.tags
    assert tags["stabletrain.skips"] == "2" and tags["stabletrain.incidents"] == "2"
    assert tags["stabletrain.rollbacks"] == tags["stabletrain.stops"] == tags["stabletrain.crashes"] == "0"  # filterable
    assert tags["stabletrain.last_skip"].startswith("step 7: optimizer step skipped")
    assert tags["stabletrain.last_incident"].startswith("step 7: captured step 7")
    for step in (3, 7):
        folder = f"incidents/step_{step:06d}"
        assert [a.path for a in client.list_artifacts(run.info.run_id, folder)] == [f"{folder}/diagnosis.json"]
        local = client.download_artifacts(run.info.run_id, f"{folder}/diagnosis.json")
        assert json.loads(open(local).read()) == json.loads((incident_run / folder / "diagnosis.json").read_text())


def test_wandb_offline_run_holds_the_metrics_config_tags_and_each_diagnosis(incident_run):
    lines = metrics(incident_run)
    (w,) = wandb_files(incident_run)
    assert w.finished and w.run_id == read_trackers_file(incident_run)["wandb"]["run_id"]
    assert w.path.is_relative_to(incident_run / "wandb")  # offline, under the run directory
    assert w.steps() == [5, 10]
    for row, line in zip(w.history, lines):
        for key in numeric(line):
            assert same(row[key], line[key]), key
    config = flatten_config(yaml.safe_load((incident_run / "config.yaml").read_text()))
    assert w.config == config
    assert set(w.tags) == {"incident", "skip"}
    assert w.summary["stabletrain/skips"] == 2 and w.summary["stabletrain/incidents"] == 2
    assert w.summary["stabletrain/rollbacks"] == w.summary["stabletrain/crashes"] == 0  # (no run tag for a 0)
    assert w.summary["stabletrain/last_incident"].startswith("step 7: captured step 7")
    assert {"incidents/step_000003/diagnosis.json", "incidents/step_000007/diagnosis.json"} <= set(w.files)
    saved = w.path.parent / "files" / "incidents" / "step_000007" / "diagnosis.json"
    assert saved.read_bytes() == (incident_run / "incidents" / "step_000007" / "diagnosis.json").read_bytes()


def test_the_report_is_attached_to_both_runs_when_written(incident_run, capsys):
    write_report(incident_run)
    out = capsys.readouterr().out
    client, run = mlflow_run(incident_run)
    assert "report.html" in [a.path for a in client.list_artifacts(run.info.run_id)]
    assert f"report.html attached to the MLflow run {run.info.run_id}" in out
    first, again = wandb_files(incident_run)  # the offline run reopened by its id, to save the page
    assert again.run_id == first.run_id and "report.html" in again.files and again.history == []
    assert set(again.tags) == {"incident", "skip"}  # kept: an offline run cannot fetch them from the server
    assert (again.path.parent / "files" / "report.html").read_bytes() == (incident_run / "report.html").read_bytes()


def test_without_tensorboard_in_the_list_no_tb_folder(tmp_path, store):
    c = load_config(None, ["task=mlp", "train.max_steps=5", "log.every=5", "log.progress=false", "eval.every=0",
                           "log.trackers=[mlflow]", f"log.mlflow.tracking_uri={store}", "log.mlflow.experiment=no-tb"])
    Trainer(c, run_dir=tmp_path / "run").fit()
    assert not (tmp_path / "run" / "tb").exists()
    client, run = mlflow_run(tmp_path / "run")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [5]


def test_a_file_store_where_the_user_asks_for_one(tmp_path, monkeypatch, capsys):
    base = ["task=mlp", "train.max_steps=5", "log.every=5", "log.progress=false", "log.tensorboard=false",
            "eval.every=0", "log.trackers=[mlflow]", f"log.mlflow.tracking_uri=file:{tmp_path}/mlruns"]
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    Trainer(load_config(None, base), run_dir=tmp_path / "refused").fit()
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "MLflow" in x]
    assert "refuses a file: store unless the environment sets MLFLOW_ALLOW_FILE_STORE=true" in line
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    Trainer(load_config(None, base), run_dir=tmp_path / "run").fit()
    client, run = mlflow_run(tmp_path / "run")
    assert client.tracking_uri == (tmp_path / "mlruns").as_uri() and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [5]
    assert (tmp_path / "mlruns" / run.info.experiment_id / run.info.run_id).is_dir()


def test_trackers_add_no_host_sync(tmp_path, store):
    from stabletrain.syncs import SyncCounter

    seen = []
    for name, trackers in (("plain", "[]"), ("tracked", "[mlflow,wandb]")):
        c = load_config(None, ["task=mlp", "train.max_steps=20", "log.every=5", "eval.every=10", "log.progress=false",
                               f"log.trackers={trackers}", f"log.mlflow.tracking_uri={store}",
                               "log.mlflow.experiment=syncs"])
        trainer = Trainer(c, run_dir=tmp_path / name)
        with SyncCounter(lambda trainer=trainer: trainer.step) as counter:
            trainer.fit()
        seen.append([(step, fn) for step, fn, _ in counter.calls])
    assert seen[0] and seen[1] == seen[0] and {s for s, _ in seen[0]} <= {0, 5, 10, 15, 20}  # the same syncs, at the boundaries


class DeleteMLflowRun(Callback):
    """Delete the MLflow run after the tracker wrote step 5: its next write fails (a store that goes away)."""

    def on_log(self, state, record, rows):
        if state.step == 5:
            entry = read_trackers_file(state.run.path)["mlflow"]
            MlflowClient(entry["tracking_uri"]).delete_run(entry["run_id"])


def test_a_tracker_that_cannot_start_or_fails_later_is_one_line_and_training_goes_on(tmp_path, store, capsys,
                                                                                      monkeypatch):
    base = ["task=mlp", "train.max_steps=10", "log.every=5", "log.progress=false", "log.tensorboard=false", "eval.every=0"]
    (tmp_path / "a_file").write_text("")  # the store's folder is a file: the store cannot be made
    c = load_config(None, [*base, "log.trackers=[mlflow]", f"log.mlflow.tracking_uri=sqlite:///{tmp_path}/a_file/m.db"])
    Trainer(c, run_dir=tmp_path / "unwritable").fit()
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if "MLflow" in x]
    assert len(lines) == 1 and lines[0].startswith("stabletrain: warning: MLflow: cannot start (")
    assert lines[0].endswith("this run is not written to MLflow, training goes on")
    assert [r["step"] for r in metrics(tmp_path / "unwritable")] == [5, 10]

    monkeypatch.setitem(sys.modules, "wandb", None)  # how Python reports a package that is not installed
    c = load_config(None, [*base, "log.trackers=[wandb]"])
    Trainer(c, run_dir=tmp_path / "not_installed").fit()
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "W&B" in x]
    assert line.startswith("stabletrain: warning: W&B: cannot start (") and "pip install 'stabletrain[wandb]'" in line
    assert [r["step"] for r in metrics(tmp_path / "not_installed")] == [5, 10]

    c = load_config(None, [*base, "log.trackers=[mlflow]", f"log.mlflow.tracking_uri={store}",
                           "log.mlflow.experiment=fails-later"])
    Trainer(c, run_dir=tmp_path / "later", callbacks=[DeleteMLflowRun()]).fit()
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "MLflow" in x]
    assert line.startswith("stabletrain: warning: MLflow: writing step 10 failed (")
    assert line.endswith("nothing more is written to MLflow in this run, training goes on")
    assert [r["step"] for r in metrics(tmp_path / "later")] == [5, 10]

    # Resumed (to step 15), the deleted run is gone: one line, and a new MLflow run gets the run's whole history.
    c = load_config(None, [*base, "train.max_steps=15", "log.trackers=[mlflow]", f"log.mlflow.tracking_uri={store}",
                           "log.mlflow.experiment=fails-later"])
    gone = read_trackers_file(tmp_path / "later")["mlflow"]["run_id"]
    Trainer(c, run_dir=tmp_path / "later", resume=True).fit()
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "MLflow" in x]
    assert line.startswith(f"stabletrain: warning: MLflow: the run's MLflow run {gone} is gone from ")
    client, run = mlflow_run(tmp_path / "later")
    assert run.info.run_id != gone and run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in metrics(tmp_path / "later")]
    assert [m.step for m in history] == [5, 10, 15]


def test_sigkill_then_resume_continues_both_runs_with_each_step_once(tmp_path, store):
    run_dir = tmp_path / "run"
    args = ["task=mlp", "train.max_steps=30", "log.every=5", "ckpt.every=10", "eval.every=0",
            "log.trackers=[mlflow,wandb]", f"log.mlflow.tracking_uri={store}", "log.mlflow.experiment=killed",
            "callbacks=[helpers:KillAtLog]"]
    proc = subprocess.run(stabletrain(*args, f"run.dir={run_dir}"), env=own_env(STABLETRAIN_TEST_KILL="25"),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    first = read_trackers_file(run_dir)
    assert first["mlflow"]["last_step"] == first["wandb"]["last_step"] == 25
    assert first["wandb"]["finished"] is False  # killed: W&B holds what it wrote by flushed_step, no more for sure
    finish(stabletrain(*args, "--resume", str(run_dir)))
    resumed = [e for e in read_jsonl(run_dir / "events.jsonl")[0] if e["kind"] == "resume"]
    assert len(resumed) == 1 and resumed[0]["step"] in (10, 20)
    lines = metrics(run_dir)
    assert [r["step"] for r in lines] == [5, 10, 15, 20, 25, 30]

    entry = read_trackers_file(run_dir)
    assert entry["mlflow"]["run_id"] == first["mlflow"]["run_id"] and entry["wandb"]["run_id"] == first["wandb"]["run_id"]
    assert entry["wandb"]["finished"] is True and entry["wandb"]["flushed_step"] == entry["wandb"]["last_step"] == 30
    client = MlflowClient(store)
    (run_info,) = client.search_runs([client.get_experiment_by_name("killed").experiment_id])  # one run, continued
    assert run_info.info.status == "FINISHED"
    history = client.get_metric_history(run_info.info.run_id, "loss")
    assert [m.step for m in history] == [5, 10, 15, 20, 25, 30]  # the steps trained twice are written once
    assert [m.value for m in history] == [r["loss"] for r in lines]  # bitwise: the resumed run reproduced them

    files = wandb_files(run_dir)
    assert len(files) == 2 and all(entry["wandb"]["run_id"] in f.path.parent.name for f in files)
    assert files[1].run_id == entry["wandb"]["run_id"] and files[1].finished
    # W&B flushes its file every 15 s: the killed process's holds what it flushed (here: nothing); the resumed
    # process writes the metrics.jsonl lines W&B lost, then the rest, so each step is there once.
    steps = [s for f in files for s in f.steps("loss")]
    assert sorted(steps) == [5, 10, 15, 20, 25, 30] and len(set(steps)) == len(steps)
    values = {row["_step"]: row["loss"] for f in files for row in f.history}
    assert [values[r["step"]] for r in lines] == [r["loss"] for r in lines]


class CrashAtLog(Callback):
    """Raise at the log boundary of step 25 (after the trackers wrote it): the run ends with a crash event."""

    def on_log(self, state, record, rows):
        if state.step == 25:
            raise RuntimeError("planted crash at step 25")


def test_a_crash_is_tagged_and_a_resume_writes_no_step_the_trackers_hold(tmp_path, store):
    run_dir = tmp_path / "run"
    args = ["task=mlp", "train.max_steps=30", "log.every=5", "ckpt.every=10", "eval.every=0", "log.progress=false",
            "log.tensorboard=false", "log.trackers=[mlflow,wandb]", f"log.mlflow.tracking_uri={store}",
            "log.mlflow.experiment=crashed"]
    with pytest.raises(RuntimeError, match="planted crash"):
        Trainer(load_config(None, args), run_dir=run_dir, callbacks=[CrashAtLog()]).fit()
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FAILED" and run.data.tags["stabletrain.crashes"] == "1"
    assert run.data.tags["stabletrain.last_crash"].startswith("step 25: RuntimeError: planted crash at step 25")
    (killed,) = wandb_files(run_dir)
    assert killed.steps("loss") == [5, 10, 15, 20, 25] and "crash" in killed.tags and killed.summary["stabletrain/crashes"] == 1
    assert read_trackers_file(run_dir)["wandb"]["finished"] is True  # the crash ended the run: W&B wrote it all

    Trainer(load_config(None, args), run_dir=run_dir, resume=True).fit()  # from step 20: 25 is trained again
    client, run = mlflow_run(run_dir)
    assert run.info.status == "FINISHED"
    lines = metrics(run_dir)
    history = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == [r["step"] for r in lines] == [5, 10, 15, 20, 25, 30]
    assert [m.value for m in history] == [r["loss"] for r in lines]
    first, resumed = wandb_files(run_dir)
    assert resumed.steps("loss") == [30]  # 25: W&B's files hold it already
    assert {row["_step"]: row["loss"] for f in (first, resumed) for row in f.history} == {r["step"]: r["loss"] for r in lines}
    assert set(resumed.tags) == {"crash"}  # the events before the resume are counted again: the tags stay


def test_under_ddp_only_rank_0_writes(tmp_path, store):
    run_dir = tmp_path / "ddp"
    finish(stabletrain("task=mlp", "dist.nproc=2", "train.max_steps=10", "log.every=5", "eval.every=0",
                    "log.trackers=[mlflow,wandb]", f"log.mlflow.tracking_uri={store}", "log.mlflow.experiment=ddp",
                    f"run.dir={run_dir}"))
    client = MlflowClient(store)
    (only,) = client.search_runs([client.get_experiment_by_name("ddp").experiment_id])
    assert [m.step for m in client.get_metric_history(only.info.run_id, "loss")] == [5, 10]
    assert only.data.params["dist.nproc"] == "2"
    (w,) = wandb_files(run_dir)
    assert w.steps() == [5, 10] and len(list((run_dir / "wandb").glob("*run-*"))) == 1


def test_what_wandb_holds_for_a_resume_comes_from_trackers_json(tmp_path):
    from stabletrain.callbacks.wandb_tracker import WandbTracker, flushed_step

    handed = [(0.0, 5), (10.0, 10), (31.0, 15), (40.0, 20)]  # (seconds, step) handed to W&B
    assert flushed_step(handed, now=41.0, flush_s=15.0) == 10  # handed >= 30 s (twice W&B's interval) ago
    assert flushed_step(handed, now=20.0, flush_s=15.0) is None
    assert flushed_step(handed, now=1e9, flush_s=0.0) is None  # W&B writes only at finish (or a full buffer)
    tracker = WandbTracker()
    tracker.base = tmp_path  # a run of its own, offline
    assert tracker._held_step({"last_step": 25, "finished": True, "flushed_step": 10}) == 25
    assert tracker._held_step({"last_step": 25, "finished": False, "flushed_step": 10}) == 10  # killed: 15-25 again
    assert tracker._held_step({"last_step": 25}) == 25  # an entry from before "finished" was kept
    assert tracker._held_step({}) == 0


def test_the_wandb_reader_refuses_what_it_does_not_know_and_stops_at_a_truncated_tail(incident_run, tmp_path):
    (w,) = wandb_files(incident_run)[:1]
    data = w.path.read_bytes()
    cut = tmp_path / "cut.wandb"
    cut.write_bytes(data[: len(data) // 2])  # what a killed process may leave
    part = read_run_file(cut)
    assert not part.finished and part.steps() == w.steps()[: len(part.steps())]
    bad = tmp_path / "bad.wandb"
    bad.write_bytes(data[:7] + bytes([data[7] ^ 0xFF]) + data[8:])
    with pytest.raises(WandbFileError, match="fails its checksum"):
        read_run_file(bad)
    other = tmp_path / "other.wandb"
    other.write_bytes(b":W&B" + data[4:5] + b"\x00" + data[6:])
    with pytest.raises(WandbFileError, match="not a W&B run file this reader knows"):
        read_run_file(other)
    assert TRACKERS_FILE == "trackers.json"


# -- the adapters: a run the host already has is written into --------------------------------------------------


def test_monitor_writes_into_the_active_mlflow_run_and_leaves_it_to_its_owner(tmp_path, store, monkeypatch):
    import torch
    from integration_models import Net, batches, loss_fn

    from stabletrain import Monitor

    monkeypatch.chdir(tmp_path)  # MLflow's fluent API keeps artifacts under the working directory
    client = MlflowClient(store)
    exp = client.create_experiment("monitor", artifact_location=(tmp_path / "art").as_uri())
    mlflow.set_tracking_uri(store)
    try:
        with mlflow.start_run(experiment_id=exp) as active:
            torch.manual_seed(0)
            model = Net()
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
            with Monitor(model, opt, run_dir=tmp_path / "m", log_every=10, loss_fn=loss_fn,
                         trackers=["tensorboard", "mlflow"]) as monitor:
                for batch in batches(25):
                    with monitor.autocast():
                        loss = loss_fn(model, batch)
                    monitor.backward(loss)
                    monitor.step(batch)
            assert client.get_run(active.info.run_id).info.status == "RUNNING"  # the owner ends it, not stabletrain
    finally:
        mlflow.set_tracking_uri(None)
    lines = metrics(tmp_path / "m")
    assert [r["step"] for r in lines] == [10, 20, 25]
    run = client.get_run(active.info.run_id)
    history = client.get_metric_history(active.info.run_id, "stabletrain/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in lines]
    assert "loss" not in run.data.metrics  # the host's own names stay the host's
    assert run.data.params["stabletrain.log.every"] == "10" and run.data.params["stabletrain.integration"] == "monitor"
    entry = read_trackers_file(tmp_path / "m")["mlflow"]
    assert entry["run_id"] == active.info.run_id and entry["host"] is True
    assert (tmp_path / "m" / "tb").is_dir()


def test_lightning_writes_into_its_own_mlflow_and_wandb_loggers_runs_once_per_interval(tmp_path, store, monkeypatch):
    L = pytest.importorskip("lightning")
    import torch
    import torch.nn.functional as F
    import wandb
    from integration_models import Net
    from lightning.pytorch.loggers import CSVLogger, MLFlowLogger, WandbLogger
    from torch.utils.data import DataLoader, TensorDataset

    from stabletrain.integrations.lightning import StableTrainCallback

    class Lit(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.save_hyperparameters()
            torch.manual_seed(0)
            self.net = Net()

        def training_step(self, batch, batch_idx):
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    g = torch.Generator().manual_seed(0)
    data = DataLoader(TensorDataset(torch.rand(96, 4, generator=g), torch.randn(96, 1, generator=g)), batch_size=8)
    ml = MLFlowLogger(experiment_name="lightning", tracking_uri=store, artifact_location=(tmp_path / "art").as_uri())
    monkeypatch.setenv("WANDB_MODE", "offline")  # WandbLogger(offline=True) sets it for the process: put back after
    # mode= too: W&B read the environment when this process first used it (an earlier test), not now.
    wb = WandbLogger(project="lightning", save_dir=str(tmp_path / "wb"), offline=True, mode="offline")
    csv = CSVLogger(tmp_path / "csv")
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5, trackers=["mlflow", "wandb"])
    trainer = L.Trainer(max_steps=12, accelerator="cpu", logger=[ml, wb, csv], log_every_n_steps=1, callbacks=[cb],
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(Lit(), data)
    wandb_id = wb.experiment.id
    wandb.finish()  # Lightning leaves the W&B run to the process's exit: its file is flushed here
    lines = metrics(tmp_path / "run")
    assert [r["step"] for r in lines] == [5, 10, 12]
    client = MlflowClient(store)
    (only,) = client.search_runs([client.get_experiment_by_name("lightning").experiment_id])
    assert only.info.run_id == ml.run_id  # no second run
    history = client.get_metric_history(ml.run_id, "stabletrain/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in lines]  # once: no mirror too
    assert only.data.params["stabletrain.integration"] == "lightning"
    (w,) = [read_run_file(f) for f in run_files(tmp_path / "wb", wandb_id)]
    rows = [row for row in w.history if "stabletrain/loss" in row]
    assert [(row["stabletrain/step"], row["stabletrain/loss"]) for row in rows] == [(r["step"], r["loss"]) for r in lines]
    assert w.config["stabletrain.integration"] == "lightning"
    # The logger no tracker covers keeps the mirror (at the boundaries inside the fit: the last, partial interval
    # is logged when the fit has ended).
    assert [int(r["step"]) for r in read_csv(tmp_path / "csv") if r.get("stabletrain/loss")] == [5, 10]


def read_csv(folder):
    import csv

    (path,) = folder.rglob("metrics.csv")
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_hugging_face_report_to_mlflow_gets_stabletrains_figures_in_the_same_run(tmp_path, store, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from integration_models import gpt2, token_rows

    from stabletrain.integrations.transformers import StableTrainCallback

    transformers.logging.set_verbosity_error()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf")
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=3, trackers=["mlflow"])
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-3, use_cpu=True,
        report_to=["mlflow"], logging_steps=1000, save_strategy="no", seed=0, disable_tqdm=True)
    try:
        transformers.Trainer(model=gpt2(), args=args, train_dataset=token_rows(24), callbacks=[cb]).train()
    finally:
        mlflow.set_tracking_uri(None)
    lines = metrics(tmp_path / "run")
    client = MlflowClient(store)
    (only,) = client.search_runs([client.get_experiment_by_name("hf").experiment_id])
    history = client.get_metric_history(only.info.run_id, "stabletrain/loss")
    assert [(m.step, m.value) for m in history] == [(r["step"], r["loss"]) for r in lines] and len(lines) == 2
    assert only.data.params["stabletrain.integration"] == "transformers" and "learning_rate" in only.data.params
    assert read_trackers_file(tmp_path / "run")["mlflow"] == {**read_trackers_file(tmp_path / "run")["mlflow"],
                                                            "run_id": only.info.run_id, "host": True}
