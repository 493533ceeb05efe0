"""MLflow as a tracker sink (see :mod:`.tracker_sink` for what every tracker is given, and when)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from .. import console
from .tracker_sink import TrackerSink

__all__ = ["MLflowTracker"]


def _absolute_uri(uri: str) -> str:
    """A local store's URI with an absolute path (a resume from another directory finds the same store)."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    if uri.startswith("file:") and not uri.startswith("file:///"):
        return Path(uri[len("file:"):]).resolve().as_uri()
    if "://" not in uri and ":" not in uri.split("/")[0]:  # a plain path: a file store
        return Path(uri).resolve().as_uri()
    return uri


def _artifact_root(uri: str) -> str | None:
    """Where a new experiment in a local SQLite store keeps its artifacts: ``mlartifacts`` beside the database.

    (MLflow's own default is ``./mlruns`` under the working directory of whichever process creates it.)
    """
    if uri.startswith("sqlite:////"):
        return (Path(uri[len("sqlite:///"):]).parent / "mlartifacts").as_uri()
    return None


class MLflowTracker(TrackerSink):
    """Write the run to MLflow (``mlflow-skinny`` with SQLAlchemy and Alembic for the SQLite store).

    ``tracking_uri``: None = MLflow's own default (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the
    working directory), made absolute; ``experiment``: created when missing; ``run_name``: default the run
    directory's name. Metrics go through ``MlflowClient.log_batch`` (one call per interval), the run's status is
    set at the end (FINISHED; FAILED after a crash; KILLED after a stop).
    """

    name, title, extra = "mlflow", "MLflow", "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str = "stabletrain", run_name: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.client: Any = None
        self.run_id = ""
        self.prefix = ""

    def _start(self, run_dir: Path, earlier: dict[str, Any]) -> dict[str, Any]:
        import mlflow
        from mlflow.tracking import MlflowClient

        self.run_id, self.prefix = "", ""
        host = self.host() if self.host is not None else _active_mlflow()
        if host is not None:
            self.client, self.run_id = host
            self.own, self.prefix = False, "stabletrain/"
        else:
            uri = _absolute_uri(self.tracking_uri or mlflow.get_tracking_uri())
            if earlier.get("run_id") and not earlier.get("host") and (self.tracking_uri is None
                                                                        or uri == earlier.get("tracking_uri")):
                uri = earlier["tracking_uri"]  # the run goes on in the store it started in
                self.client = MlflowClient(uri)
                if _usable(self.client, earlier["run_id"]):
                    self.run_id = earlier["run_id"]
                    self.client.update_run(self.run_id, status="RUNNING")
                else:
                    console.warn(f"MLflow: the run's MLflow run {earlier['run_id']} is gone from {uri} (deleted?): "
                                 "a new MLflow run goes on from here")
            if not self.run_id:
                self.client = MlflowClient(uri)
                exp = self.client.get_experiment_by_name(self.experiment)
                exp_id = exp.experiment_id if exp is not None else self.client.create_experiment(
                    self.experiment, artifact_location=_artifact_root(uri))
                run = self.client.create_run(exp_id, run_name=self.run_name or run_dir.resolve().name,
                                             tags={"stabletrain.run_dir": str(run_dir.resolve())})
                self.run_id = run.info.run_id
        run = self.client.get_run(self.run_id)
        return {"run_id": self.run_id, "tracking_uri": self.client.tracking_uri,
                "experiment_id": run.info.experiment_id, "host": not self.own}

    def _explain(self, err: BaseException) -> str | None:
        if "MLFLOW_ALLOW_FILE_STORE" in str(err):
            return ("this MLflow refuses a file: store unless the environment sets MLFLOW_ALLOW_FILE_STORE=true: set "
                    "it, or use a sqlite: store")
        return None

    def _held_step(self, earlier: dict[str, Any]) -> int:
        history = self.client.get_metric_history(self.run_id, self.prefix + "loss")
        return max((int(m.step) for m in history), default=0)

    def _log_metrics(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(self.prefix + k, v, now, step) for k, v in values.items()],
                              synchronous=True)

    def _log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunTag

        key = "stabletrain." if not self.own else ""
        have = self.client.get_run(self.run_id).data.params
        texts = {key + k: _param_text(v)[:6000] for k, v in params.items()}
        new = [Param(k, v) for k, v in texts.items() if k not in have]
        changed = [f"{k}: {have[k]} -> {v}" for k, v in texts.items() if k in have and have[k] != v]
        for i in range(0, len(new), 100):  # MLflow's limit per call
            self.client.log_batch(self.run_id, params=new[i:i + 100], synchronous=True)
        if changed:  # a param cannot change in MLflow: a resume with other log.*/ckpt.* values says so here
            self.client.log_batch(self.run_id, tags=[RunTag("stabletrain.changed_on_resume", "; ".join(changed)[:8000])],
                                  synchronous=True)

    def _set_tags(self, counts: dict[str, int], last: dict[str, str], kinds: set[str]) -> None:
        from mlflow.entities import RunTag

        tags = [RunTag(f"stabletrain.{n}", str(c)) for n, c in counts.items()]
        tags += [RunTag(f"stabletrain.last_{k}", text[:8000]) for k, text in last.items()]
        self.client.log_batch(self.run_id, tags=tags, synchronous=True)

    def _log_files(self, files: list[Path], dest: str) -> None:
        for f in files:
            self.client.log_artifact(self.run_id, str(f), artifact_path=dest)

    def _finish(self, status: str) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, status)

    def where(self) -> str:
        uri = self.client.tracking_uri
        if not self.own:
            return f"writing into the host's run {self.run_id} ({uri})"
        ui = f"; see it with: mlflow ui --backend-store-uri {uri}" if uri.startswith(("sqlite:", "file:")) else ""
        return f"run {self.run_id} in experiment {self.experiment!r} at {uri}{ui}"


def _usable(client: Any, run_id: str) -> bool:
    """Whether ``run_id`` is in the client's store and not deleted."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id).info.lifecycle_stage != "deleted"
    except MlflowException:
        return False


def _active_mlflow() -> tuple[Any, str] | None:
    """The run ``mlflow.start_run()`` made active in this process (the HF Trainer's ``report_to``, your own), if any."""
    mlflow = sys.modules.get("mlflow")  # never imported: no run can be active
    if mlflow is None or mlflow.active_run() is None:
        return None
    from mlflow.tracking import MlflowClient

    return MlflowClient(mlflow.get_tracking_uri()), mlflow.active_run().info.run_id


def _param_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)
