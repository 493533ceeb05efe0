"""The trackers people already use, MLflow and Weights & Biases: building their sinks, and the report afterwards.

One sink callback each (:class:`~stabletrain.callbacks.mlflow_tracker.MLflowTracker`,
:class:`~stabletrain.callbacks.wandb_tracker.WandbTracker`); what every one is given, and when, is
:mod:`stabletrain.callbacks.tracker_sink`'s.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import console
from ..config import TRACKERS
from ..errors import brief
from .mlflow_tracker import MLflowTracker
from .tracker_sink import TrackerSink, failure_text, read_trackers_file
from .wandb_tracker import WandbTracker

__all__ = ["build_trackers", "attach_report", "logger_runs"]


def build_trackers(specs: Sequence[Any], *, log: Any = None, hosts: dict[str, tuple[Callable[[], Any], Any]] | None = None
                   ) -> list[TrackerSink]:
    """One sink per tracker ``specs`` names ("mlflow", "wandb"; "tensorboard" is TensorBoardLog's) or holds (a sink).

    ``log``: a :class:`~stabletrain.config.LogConfig` whose ``mlflow``/``wandb`` sections configure the named
    ones; ``hosts``: tracker name -> (callable returning the host's run, its owner), from an adapter.
    """
    out: list[TrackerSink] = []
    for i, spec in enumerate(specs):
        if isinstance(spec, TrackerSink):
            sink = spec
        elif spec == "mlflow":
            sink = MLflowTracker(**(vars(log.mlflow) if log is not None else {}))
        elif spec == "wandb":
            sink = WandbTracker(**(vars(log.wandb) if log is not None else {}))
        elif spec == "tensorboard":
            continue
        else:
            raise ValueError(f"trackers[{i}]: expected one of {', '.join(TRACKERS)} or a TrackerSink, got {brief(spec)}")
        if sink.name in {s.name for s in out}:
            raise ValueError(f"trackers[{i}]: {sink.name} is listed twice")
        if hosts and sink.name in hosts and sink.host is None:
            sink.host, sink.owner = hosts[sink.name]
        out.append(sink)
    return out


_TITLES = {"mlflow": MLflowTracker.title, "wandb": WandbTracker.title}


def attach_report(run_dir: str | Path, report: str | Path) -> list[str]:
    """Give ``report`` (``report.html``) to each tracker run ``RUN_DIR/trackers.json`` names; return where it went.

    MLflow: an artifact of the run (finished or not). W&B: the run is reopened by its id (one more short
    ``offline-run-*-ID`` folder, in the run's mode) to save the file. A failure is one line, never an error.
    """
    done = []
    for name, entry in read_trackers_file(run_dir).items():
        if not isinstance(entry, dict) or not entry.get("run_id"):
            continue
        try:
            if name == "mlflow":
                from mlflow.tracking import MlflowClient

                MlflowClient(entry["tracking_uri"]).log_artifact(entry["run_id"], str(report))
            elif name == "wandb":
                import wandb

                base = Path(entry.get("dir") or run_dir)
                run = wandb.init(project=entry.get("project"), entity=entry.get("entity"), dir=str(base),
                                 id=entry["run_id"], resume="allow", mode=entry.get("mode") or "offline",
                                 tags=entry.get("tags") or None, settings=wandb.Settings(console="off", silent=True))
                shutil.copy2(report, Path(run.dir) / Path(report).name)
                run.save(str(Path(run.dir) / Path(report).name), base_path=run.dir, policy="now")
                run.finish()
            else:
                continue
        except Exception as err:  # noqa: BLE001 (the report is written; the tracker is extra)
            console.warn(f"{name}: could not attach {Path(report).name} to run {entry['run_id']} ({failure_text(err)})")
            continue
        done.append(f"{_TITLES[name]} run {entry['run_id']}")
    return done


def logger_runs(loggers: Sequence[Any]) -> dict[str, tuple[Callable[[], Any], Any]]:
    """The runs of a host's own MLflow and W&B loggers (Lightning's ``trainer.loggers``: by class name, no import), for
    ``trackers=`` to write into (read on rank 0 only): tracker name -> (a callable returning the run, the logger)."""
    hosts: dict[str, tuple[Callable[[], Any], Any]] = {}
    for logger in loggers:
        kind = type(logger).__name__
        if kind == "MLFlowLogger" and "mlflow" not in hosts:
            hosts["mlflow"] = ((lambda lg=logger: (lg.experiment, lg.run_id)), logger)
        elif kind == "WandbLogger" and "wandb" not in hosts:
            hosts["wandb"] = ((lambda lg=logger: lg.experiment), logger)
    return hosts
