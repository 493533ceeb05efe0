"""What every tracker sink does: fed at log boundaries, each step once, the same run on resume, never a crash.

The trackers (:mod:`.mlflow_tracker`, :mod:`.wandb_tracker`) are installed by the Trainer for
``log.trackers=[mlflow,wandb]`` (settings ``log.mlflow.*``, ``log.wandb.*``) and by the adapters for
``trackers=["mlflow", "wandb"]`` (:func:`~stabletrain.callbacks.trackers.build_trackers`). A tracker
writes on rank 0 with a run directory only, and only at a log boundary, never per step. What it gets:

- **metrics**: every log interval's record (the numeric keys of ``metrics.jsonl``) at its step, from ``on_log``;
- **params**: the run's ``config.yaml``, flattened (``optim.lr``, ``log.every``, ...), once at start;
- **tags**: for each event kind of :data:`TAGGED` in ``events.jsonl`` (incident, skip, rollback, stop,
  crash) a count and the last one's step and reason (MLflow: tags ``stabletrain.skips``,
  ``stabletrain.last_skip``; W&B: summary keys ``stabletrain/skips``, ``stabletrain/last_skip`` and the run tag
  ``skip``), read from ``events.jsonl`` (the run's record: every kind with its reason, once);
- **artifacts**: each captured incident's folder but its tensors (``incidents/step_N/diagnosis.json``), at
  ``on_incident``; ``report.html`` when ``stabletrain report`` (or ``train --report``) writes it
  (:func:`~stabletrain.callbacks.trackers.attach_report`, into the run the run directory names).

**Each step once.** A tracker is never written a step it already holds. On start it learns the last step it
holds (MLflow: the run's ``loss`` history in the store; W&B: ``trackers.json``, see
:class:`~.wandb_tracker.WandbTracker`) and is written the ``metrics.jsonl`` lines after it, up to where the
run resumes: what a killed process logged but the tracker lost (W&B writes its file every 15 s) is written
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .. import console
from ..fileio import atomic_write
from . import Callback, RunState

__all__ = ["TrackerSink", "read_trackers_file", "failure_text", "TRACKERS_FILE", "TAGGED"]

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


def failure_text(err: BaseException) -> str:
    """One short line for a tracker's failure: its type and its words (an ImportError: its words alone)."""
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

    def _entry_fields(self) -> dict[str, Any]:
        """What else this tracker keeps in its trackers.json entry, as of now (written with every update of it)."""
        return {}

    # -- the hooks ---------------------------------------------------------------------------------

    def on_fit_start(self, state: RunState) -> None:
        if state.run is None or self.active:
            return
        self._run_dir = state.run.path
        self.own, self._events_read, self._counts, self._last = True, 0, {}, {}  # a sink may serve a second fit
        earlier = read_trackers_file(self._run_dir).get(self.name) or {}
        try:
            entry = self._start(self._run_dir, earlier)
            self.held = self._held_step(earlier if earlier.get("run_id") == entry.get("run_id") else {})
            self._entry = {**entry, "last_step": self.held}
            self._save_entry()
        except Exception as err:  # noqa: BLE001 (a tracker must never take the run down)
            hint = f" (pip install 'stabletrain[{self.extra}]')" if isinstance(err, ImportError) else ""
            console.warn(f"{self.title}: cannot start ({self._explain(err) or failure_text(err)}){hint}; this run is not "
                         f"written to {self.title}, training goes on")
            self._close_quietly()
            return
        self.active = True
        console.say(f"{self.title}: {self.where()}")
        self._write("the config", self._log_params, self._config())
        self._catch_up(state.step)
        self._read_events()  # the whole file: a resumed run's tags count the events before it too
        unseen = {TAGGED[k]: 0 for k in TAGGED if k not in self._counts}  # a clean run's counts too (filterable at 0)
        if unseen:
            self._write("tags", self._set_tags, unseen, {}, set())
        self._ended = "FINISHED"  # ... but how this process ends is this process's own

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        if self.active:
            self._write_record(record)
            self._read_events()

    def on_incident(self, state: RunState, info: dict[str, Any]) -> None:
        if not self.active:
            return
        self._read_events()
        folder = Path(info["path"]) if info.get("path") else None
        if folder is not None and folder.is_dir():
            files = [f for f in sorted(folder.iterdir()) if f.is_file() and f.suffix not in _HEAVY]
            if files:
                self._write(f"incident {folder.name}'s files", self._log_files, files, f"incidents/{folder.name}")

    def on_rollback(self, state: RunState, info: dict[str, Any]) -> None:
        if self.active:
            self._read_events()

    def on_stop(self, state: RunState, reason: str) -> None:
        if self.active:
            self._read_events()

    def on_fit_end(self, state: RunState, record: dict[str, Any]) -> None:
        if not self.active:
            return
        self._read_events()
        self.active = False
        if self.own:
            try:
                self._finish(self._ended)
            except Exception as err:  # noqa: BLE001
                console.warn(f"{self.title}: ending the run failed ({failure_text(err)})")

    # -- helpers -----------------------------------------------------------------------------------

    def _write(self, what: str, fn: Callable[..., None], *args: Any) -> bool:
        """Call ``fn``; on a failure say so in one line and write nothing more to this tracker in this run."""
        if not self.active:
            return False
        try:
            fn(*args)
            return True
        except Exception as err:  # noqa: BLE001
            console.warn(f"{self.title}: writing {what} failed ({failure_text(err)}); nothing more is written to {self.title} "
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
            self._save_entry()

    def _catch_up(self, upto: int) -> None:
        """Write the metrics.jsonl lines after the held step and up to ``upto`` (the latest line of each step)."""
        from ..records.jsonl import read_jsonl

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
            self._save_entry()

    def _save_entry(self) -> None:
        """Write this tracker's entry of ``RUN_DIR/trackers.json`` (its run, the last step written, ...)."""
        if self._run_dir is not None:
            _write_entry(self._run_dir, self.name, {**self._entry, **self._entry_fields()})

    def _close_quietly(self) -> None:
        if self.own:
            try:
                self._finish("FAILED")
            except Exception:  # noqa: BLE001 (already failing: the line said so)
                pass
