"""The trackers people already use: MLflow and Weights & Biases, one sink callback each.

Installed by the Trainer for ``log.trackers=[mlflow,wandb]`` (settings ``log.mlflow.*``, ``log.wandb.*``) and
by the adapters for ``trackers=["mlflow", "wandb"]``. A tracker writes on rank 0 with a run directory only,
and only at a log boundary, never per step. What it gets:

- **metrics**: every log interval's record (the numeric keys of ``metrics.jsonl``) at its step, from ``on_log``;
- **params**: the run's ``config.yaml``, flattened (``optim.lr``, ``log.every``, ...), once at start;
- **tags**: for each event kind of :data:`TAGGED` in ``events.jsonl`` (incident, skip, rollback, stop,
  crash) a count and the last one's step and reason (MLflow: tags ``stabletrain.skips``,
  ``stabletrain.last_skip``; W&B: summary keys ``stabletrain/skips``, ``stabletrain/last_skip`` and the run tag
  ``skip``), read from ``events.jsonl`` (the run's record: every kind with its reason, once);
- **artifacts**: each captured incident's folder but its tensors (``incidents/step_N/diagnosis.json``), at
  ``on_incident``; ``report.html`` when ``stabletrain report`` (or ``train --report``) writes it
  (:func:`attach_report`, into the run the run directory names).

**Each step once.** A tracker is never written a step it already holds. On start it learns the last step it
holds (MLflow: the run's ``loss`` history in the store; W&B: the ``.wandb`` files earlier processes of the
run wrote, :mod:`.wandb_files`) and is written the ``metrics.jsonl`` lines after it, up to where the run
resumes: what a killed process logged but the tracker lost (W&B flushes its file every 15 s) is written
then, and a tracker added on resume gets the run's earlier intervals. A resumed run then trains the steps after
its checkpoint again, bitwise the same: those the tracker holds are not written twice. After a rollback the
steps trained again keep, in the tracker, the values first written (``metrics.jsonl`` holds both, the latest
counts); the rollback tag says from which step to which.

**The same run on resume.** ``RUN_DIR/trackers.json`` keeps each tracker's run (MLflow run id and store, W&B
run id, project and folder) and the last step written; a resumed run continues that run.

**A host's run.** Where the host already has the tracker (Lightning's ``MLFlowLogger`` / ``WandbLogger``, the
Hugging Face Trainer's ``report_to``, your own ``mlflow.start_run()`` / ``wandb.init()`` active in the
process), stabletrain writes into that run instead of opening a second one: metric keys ``stabletrain/loss``
(W&B: against the ``stabletrain/step`` axis), params ``stabletrain.optim.lr``, and the run is left open
for the host to end.

**Failures.** A tracker that cannot start (not installed, a store that cannot be written, no such run) is one
line at start (``stabletrain: warning: ...``) and the run goes on without it; a write that fails later is
one line too, and no more writes go to that tracker in this run. Never a crash.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .. import console
from ..config import TRACKERS
from ..errors import brief
from ..fileio import atomic_write
from . import Callback, FitState

__all__ = ["TrackerSink", "MLflowTracker", "WandbTracker", "build_trackers", "attach_report", "read_trackers_file",
           "TRACKERS_FILE", "TAGGED"]

#: Each tracker's run and the last step written to it, in the run directory.
TRACKERS_FILE = "trackers.json"
#: Event kinds (stabletrain.records.events.EVENT_KINDS) a tracker is told of, and the plural its tags count them under.
TAGGED: dict[str, str] = {"incident": "incidents", "skip": "skips", "rollback": "rollbacks", "stop": "stops",
                          "crash": "crashes"}
#: The artifacts of an incident folder a tracker is not given (tensors: the bundle, the state snapshot).
_HEAVY = (".pt", ".safetensors", ".bin")


def read_trackers_file(run_dir: str | Path) -> dict[str, Any]:
    """``RUN_DIR/trackers.json`` as a dict (empty when absent or unreadable)."""
    try:
        data = json.loads((Path(run_dir) / TRACKERS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _write_entry(run_dir: Path, name: str, entry: dict[str, Any]) -> None:
    data = read_trackers_file(run_dir)
    data[name] = entry
    atomic_write(run_dir / TRACKERS_FILE, json.dumps(data, indent=1) + "\n", fsync=False)


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """The numeric values of a metrics record but its step (``"nan"``/``"inf"`` strings from metrics.jsonl as floats)."""
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif value in ("nan", "inf", "-inf"):
            out[key] = float(value)
    return out


def _param_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _why(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text[:300]}" if not isinstance(err, ImportError) else text


class TrackerSink(Callback):
    """One tracker fed at log boundaries (see the module docstring); a subclass implements the ``_`` methods.

    ``host``: a zero-argument callable returning the host's run to write into (or None to look for an active
    one); ``owner``: the host object it comes from (a Lightning logger), so the adapter can tell it is covered.
    """

    name = ""
    title = ""
    extra = ""  # pip install 'stabletrain[EXTRA]'

    def __init__(self, *, host: Callable[[], Any] | None = None, owner: Any = None) -> None:
        self.host, self.owner = host, owner
        self.active = False  # started and writing
        self.own = True  # a run stabletrain opened (not the host's)
        self.held = 0  # the last step the tracker holds
        self._run_dir: Path | None = None
        self._entry: dict[str, Any] = {}
        self._events_read = 0  # bytes of events.jsonl read
        self._counts: dict[str, int] = {}
        self._last: dict[str, str] = {}
        self._ended = "FINISHED"

    # -- what a tracker implements ------------------------------------------------------------------

    def _start(self, run_dir: Path, earlier: dict[str, Any]) -> dict[str, Any]:
        """Open (or continue, from ``earlier``: this tracker's trackers.json entry) the run; return its new entry."""
        raise NotImplementedError

    def _held_step(self, earlier: dict[str, Any]) -> int:
        """The last step the tracker holds for this run (0: none)."""
        raise NotImplementedError

    def _log_metrics(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def _log_params(self, params: dict[str, Any]) -> None:
        raise NotImplementedError

    def _set_tags(self, counts: dict[str, int], last: dict[str, str], kinds: set[str]) -> None:
        raise NotImplementedError

    def _log_files(self, files: list[Path], dest: str) -> None:
        raise NotImplementedError

    def _finish(self, status: str) -> None:
        """End a run stabletrain opened: FINISHED, FAILED (a crash) or KILLED (a stop)."""
        raise NotImplementedError

    def where(self) -> str:
        """One line: which run, where, and how to look at it."""
        raise NotImplementedError

    def _explain(self, err: BaseException) -> str | None:
        """A shorter, actionable reason for a known failure to start (None: the error's own words)."""
        return None

    # -- the hooks ---------------------------------------------------------------------------------

    def on_fit_start(self, state: FitState) -> None:
        if state.run is None or self.active:
            return
        self._run_dir = state.run.path
        self.own, self._events_read, self._counts, self._last = True, 0, {}, {}  # a sink may serve a second fit
        earlier = read_trackers_file(self._run_dir).get(self.name) or {}
        try:
            entry = self._start(self._run_dir, earlier)
            self.held = self._held_step(earlier if earlier.get("run_id") == entry.get("run_id") else {})
            self._entry = {**entry, "last_step": self.held}
            _write_entry(self._run_dir, self.name, self._entry)
        except Exception as err:  # noqa: BLE001 (a tracker must never take the run down)
            hint = f" (pip install 'stabletrain[{self.extra}]')" if isinstance(err, ImportError) else ""
            console.warn(f"{self.title}: cannot start ({self._explain(err) or _why(err)}){hint}; this run is not "
                         f"written to {self.title}, training goes on")
            self._close_quietly()
            return
        self.active = True
        console.say(f"{self.title}: {self.where()}")
        self._write("the config", self._log_params, self._config())
        self._catch_up(state.step)
        self._read_events()  # the whole file: a resumed run's tags count the events before it too
        self._ended = "FINISHED"  # ... but how this process ends is this process's own

    def on_log(self, state: FitState, record: dict[str, Any], rows: list[Any]) -> None:
        if self.active:
            self._write_record(record)
            self._read_events()

    def on_incident(self, state: FitState, info: dict[str, Any]) -> None:
        if not self.active:
            return
        self._read_events()
        folder = Path(info["path"]) if info.get("path") else None
        if folder is not None and folder.is_dir():
            files = [f for f in sorted(folder.iterdir()) if f.is_file() and f.suffix not in _HEAVY]
            if files:
                self._write(f"incident {folder.name}'s files", self._log_files, files, f"incidents/{folder.name}")

    def on_rollback(self, state: FitState, info: dict[str, Any]) -> None:
        if self.active:
            self._read_events()

    def on_stop(self, state: FitState, reason: str) -> None:
        if self.active:
            self._read_events()

    def on_fit_end(self, state: FitState, record: dict[str, Any]) -> None:
        if not self.active:
            return
        self._read_events()
        self.active = False
        if self.own:
            try:
                self._finish(self._ended)
            except Exception as err:  # noqa: BLE001
                console.warn(f"{self.title}: ending the run failed ({_why(err)})")

    # -- helpers -----------------------------------------------------------------------------------

    def _write(self, what: str, fn: Callable[..., None], *args: Any) -> bool:
        """Call ``fn``; on a failure say so in one line and write nothing more to this tracker in this run."""
        if not self.active:
            return False
        try:
            fn(*args)
            return True
        except Exception as err:  # noqa: BLE001
            console.warn(f"{self.title}: writing {what} failed ({_why(err)}); nothing more is written to {self.title} "
                         "in this run, training goes on")
            self.active = False
            self._close_quietly()
            return False

    def _write_record(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        if step <= self.held:  # the tracker holds it (written before a resume or a rollback)
            return
        if self._write(f"step {step}", self._log_metrics, step, _scalars(record)):
            self.held = self._entry["last_step"] = step
            if self._run_dir is not None:
                _write_entry(self._run_dir, self.name, self._entry)

    def _catch_up(self, upto: int) -> None:
        """Write the metrics.jsonl lines after the held step and up to ``upto`` (the latest line of each step)."""
        from ..records.rundir import read_jsonl

        lines, _ = read_jsonl(self._run_dir / "metrics.jsonl")
        latest: dict[int, dict[str, Any]] = {}
        for rec in lines:
            try:
                step = int(rec["step"])
            except (KeyError, TypeError, ValueError):
                continue
            if self.held < step <= upto:
                latest[step] = rec
        for step in sorted(latest):
            self._write_record(latest[step])

    def _config(self) -> dict[str, Any]:
        """The run's config.yaml, flattened (the run directory is the record: the Trainer's and an adapter's alike)."""
        import yaml

        from ..config import flatten_config

        try:
            data = yaml.safe_load((self._run_dir / "config.yaml").read_text(encoding="utf-8")) or {}
        except (OSError, yaml.YAMLError):
            return {}
        return flatten_config(data) if isinstance(data, dict) else {}

    def _read_events(self) -> None:
        """Count the new events of TAGGED kinds in events.jsonl; tell the tracker when a count changed."""
        path = self._run_dir / "events.jsonl" if self._run_dir is not None else None
        if path is None or not path.exists():
            return
        with open(path, "rb") as fh:
            fh.seek(self._events_read)
            data = fh.read()
        end = data.rfind(b"\n") + 1  # whole lines only
        self._events_read += end
        kinds: set[str] = set()
        for line in data[:end].splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("kind") if isinstance(event, dict) else None
            if kind in TAGGED:
                kinds.add(kind)
                self._counts[kind] = self._counts.get(kind, 0) + 1
                self._last[kind] = f"step {event.get('step')}: {event.get('reason', '')}"
                if kind == "crash":
                    self._ended = "FAILED"
                elif kind == "stop" and self._ended != "FAILED":
                    self._ended = "KILLED"
        if kinds and self._write("tags", self._set_tags, {TAGGED[k]: self._counts[k] for k in kinds},
                                 {k: self._last[k] for k in kinds}, kinds):
            _write_entry(self._run_dir, self.name, self._entry)

    def _close_quietly(self) -> None:
        if self.own:
            try:
                self._finish("FAILED")
            except Exception:  # noqa: BLE001 (already failing: the line said so)
                pass


# ---------------------------------------------------------------------------------------------
# MLflow


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


# ---------------------------------------------------------------------------------------------
# Weights & Biases


class WandbTracker(TrackerSink):
    """Write the run to Weights & Biases, offline by default: ``DIR/wandb/offline-run-*-ID/`` (``wandb sync`` uploads it).

    ``dir``: None = the run directory. The run's console is not captured (``console="off"``) and W&B's own
    lines are silenced: stabletrain says where the run is. A resumed run continues the same run id (each
    process writes its own ``offline-run-*-ID`` folder; ``wandb sync`` uploads them in order).
    """

    name, title, extra = "wandb", "W&B", "wandb"

    def __init__(self, mode: str = "offline", project: str = "stabletrain", entity: str | None = None,
                 dir: str | None = None, run_name: str | None = None, **kwargs: Any) -> None:  # noqa: A002
        super().__init__(**kwargs)
        self.mode, self.project, self.entity, self.dir, self.run_name = mode, project, entity, dir, run_name
        self.run: Any = None
        self.base: Path | None = None

    def _start(self, run_dir: Path, earlier: dict[str, Any]) -> dict[str, Any]:
        import wandb

        self.base = None
        host = self.host() if self.host is not None else _active_wandb()
        if host is not None:
            self.run, self.own = host, False
            self.run.define_metric("stabletrain/step", hidden=True)
            self.run.define_metric("stabletrain/*", step_metric="stabletrain/step")
        else:
            self.base = Path(self.dir).resolve() if self.dir else run_dir.resolve()
            self.base.mkdir(parents=True, exist_ok=True)
            again = bool(earlier.get("run_id")) and not earlier.get("host")
            self.run = wandb.init(project=self.project, entity=self.entity, dir=str(self.base), mode=self.mode,
                                  id=earlier["run_id"] if again else None, resume="allow" if again else None,
                                  name=self.run_name or run_dir.resolve().name,
                                  tags=earlier.get("tags") if again else None,  # offline, W&B cannot fetch them
                                  settings=wandb.Settings(console="off", silent=True))
        return {"run_id": self.run.id, "project": self.run.project, "entity": self.entity,
                "dir": str(self.base) if self.base is not None else None, "mode": str(self.run.settings.mode),
                "host": not self.own, "tags": list(self.run.tags or ())}

    def _held_step(self, earlier: dict[str, Any]) -> int:
        if not self.own or self.base is None:
            return int(earlier.get("last_step", 0))
        from .wandb_files import WandbFileError, read_run_file, run_files

        try:
            steps = [s for f in run_files(self.base, self.run.id) for s in read_run_file(f).steps("loss")]
        except (WandbFileError, OSError) as err:
            console.warn(f"W&B: cannot read the earlier processes' run files ({err}); the steps up to "
                         f"{earlier.get('last_step', 0)} (trackers.json) are not written again")
            return int(earlier.get("last_step", 0))
        return max(steps, default=0)

    def _log_metrics(self, step: int, values: dict[str, float]) -> None:
        if self.own:
            self.run.log(values, step=step)
        else:  # the host's run: its own step counter stays the host's
            self.run.log({**{f"stabletrain/{k}": v for k, v in values.items()}, "stabletrain/step": step})

    def _log_params(self, params: dict[str, Any]) -> None:
        key = "" if self.own else "stabletrain."
        self.run.config.update({key + k: v for k, v in params.items()}, allow_val_change=True)

    def _set_tags(self, counts: dict[str, int], last: dict[str, str], kinds: set[str]) -> None:
        for name, count in counts.items():
            self.run.summary[f"stabletrain/{name}"] = count
        for kind, text in last.items():
            self.run.summary[f"stabletrain/last_{kind}"] = text
        self.run.tags = tuple(sorted(set(self.run.tags or ()) | kinds))
        self._entry["tags"] = list(self.run.tags)  # kept for a reopened offline run (trackers.json)

    def _log_files(self, files: list[Path], dest: str) -> None:
        folder = Path(self.run.dir) / dest  # copied into the run's files: W&B would symlink a file outside it
        folder.mkdir(parents=True, exist_ok=True)
        for f in files:
            shutil.copy2(f, folder / f.name)
            self.run.save(str(folder / f.name), base_path=self.run.dir, policy="now")

    def _finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if status == "FAILED" else 0)
            self.run = None

    def where(self) -> str:
        if not self.own:
            return f"writing into the host's run {self.run.id}"
        folder = Path(self.run.dir).parent
        if self.mode == "offline":
            return f"offline run {self.run.id} in {folder} (upload it with: wandb sync {folder})"
        return f"run {self.run.id} ({self.run.url}), files in {folder}"


def _active_wandb() -> Any:
    """The run ``wandb.init()`` made active in this process (the HF Trainer's ``report_to``, your own), if any."""
    wandb = sys.modules.get("wandb")
    return getattr(wandb, "run", None) if wandb is not None else None


# ---------------------------------------------------------------------------------------------
# Building them, and the report afterwards


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
            console.warn(f"{name}: could not attach {Path(report).name} to run {entry['run_id']} ({_why(err)})")
            continue
        done.append(f"{_TITLES[name]} run {entry['run_id']}")
    return done
