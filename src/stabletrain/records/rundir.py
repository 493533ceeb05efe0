"""The run directory and its sinks: config, snapshot, metrics, events (TensorBoard: :mod:`.tb_events`).

Everything a run knows lands here in plain formats (DESIGN.md, principle 5; the lines: :mod:`.jsonl`, the snapshot:
:mod:`.provenance`, the launch file: :mod:`.launches`)::

    RUN_DIR/config.yaml     the resolved config, every default written out
    RUN_DIR/snapshot.json   code version, library versions, device, seed, data fingerprint
    RUN_DIR/metrics.jsonl   one line per log interval (keys: stabletrain.records.events.METRIC_KEYS)
    RUN_DIR/events.jsonl    one line per event: {"step", "kind", "reason", ...} (kinds: stabletrain.records.events.EVENT_KINDS)
    RUN_DIR/tb/             TensorBoard event files
    RUN_DIR/launch.json     the processes running on it (host, pid, start time), while they run
    RUN_DIR/metrics.superseded.jsonl   the metrics lines a resume dropped (a crash's lost steps), kept
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from .. import console
from ..config import Config, ConfigError, config_to_dict
from ..fileio import atomic_write
from .events import EVENT_KINDS
from .jsonl import JsonlWriter, json_safe, line_start
from .launches import LAUNCH_FILE, is_running, launch_parent

__all__ = ["RunDir", "append_event"]


def _refused(path: Path, host: str | None, why: str) -> ValueError:
    """The error for a run directory ``path`` that cannot be one (``why``), named as the user gave it: the config key
    ``run.dir``, or an adapter's ``run_dir=``."""
    if host:
        return ValueError(f"run_dir={str(path)!r}: {why}")
    return ConfigError(f"config key 'run.dir': {str(path)!r} {why}", key="run.dir")


def _check_folder(path: Path, host: str | None) -> None:
    """Refuse a run directory that is a file or lies under one, in a line naming it (not the OS's '[Errno 17] File
    exists' or '[Errno 20] Not a directory')."""
    for at in (path, *path.parents):
        if at.is_dir():
            return
        if at.exists():
            where = "is a file" if at == path else f"lies under {str(at)!r}, which is a file"
            raise _refused(path, host, f"{where}, not a folder: give a folder for the run directory (a new or an "
                                       "existing one)")


def _check_resumable(path: Path, host: str, model: str | None) -> None:
    """An adapter resuming into ``path``: it must hold ``host``'s run of ``model`` (a built-in run's or another's
    would get this config and its metrics mixed in); one that holds none starts a new run, said."""
    config = path / "config.yaml"
    if not config.is_file():
        return console.say(f"resume=True: {path} holds no run to resume (no config.yaml); a new run starts there")
    try:
        old = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ValueError(f"resume=True: {config} cannot be read ({type(err).__name__}: {err})") from None
    held = (old.get("integration"), old.get("task")) if isinstance(old, dict) else (None, None)
    if held != (host, model):
        what = f"a {held[0]} run of {held[1]}" if held[0] else f"a built-in run of task {held[1]}"
        raise ValueError(f"resume=True: {path} holds {what}, not a {host} run of {model}: give another run_dir (or "
                         "overwrite=True without resume)")


class RunDir:
    """A run directory: creates it, writes config and snapshot, and owns the metric/event sinks.

    Only the writing process (rank 0) should create one.
    """

    def __init__(self, path: str | Path, *, resume: bool = False, overwrite: bool = False, host: str | None = None,
                 model: str | None = None) -> None:
        """``host``: the adapter that opens it ("monitor", "lightning", "transformers"), whose user sets ``run_dir=``
        and ``overwrite=`` in Python and resumes its own way: the refusal says so in those terms. ``model``: the
        class name of the host's model (resuming, the directory must hold that host's run of it)."""
        self.path = Path(path)
        _check_folder(self.path, host)
        if resume and host:
            _check_resumable(self.path, host, model)
        if not resume and not overwrite:
            self.refuse_taken(self.path, host)
        # A directory that holds a run (it has config.yaml) is replaced when asked to, and so is one from an
        # attempt that never logged a trained step (it failed at start): it is not a run, the retry reuses it.
        if not resume and (self.path / "config.yaml").exists():
            shutil.rmtree(self.path)
        self.make_folder(self.path, host)
        try:  # (one that exists, resumed there: a traceback before)
            self.metrics = JsonlWriter(self.path / "metrics.jsonl")
            self.events = JsonlWriter(self.path / "events.jsonl")
        except OSError as err:
            if hasattr(self, "metrics"):
                self.metrics.close()
            raise _refused(self.path, host, f"cannot be written: {err.strerror or err} ({err.filename})") from err
        self._launch_recorded = False

    @staticmethod
    def make_folder(path: Path, host: str | None = None) -> None:
        """Create the run directory ``path`` (and its parents) or refuse it in one line naming it: one that is a file or
        lies under one, or cannot be created (a folder without write permission, a read-only file system)."""
        _check_folder(path, host)
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise _refused(path, host, f"cannot be created: {err.strerror or err}") from None
        if not os.access(path, os.W_OK | os.X_OK):  # (one that exists, read-only: said before any line that starts it)
            raise _refused(path, host, "cannot be written: the folder is not writable (its permissions, or a read-only file "
                                       "system)")

    @staticmethod
    def refuse_taken(path: Path, host: str | None = None) -> None:
        """Raise FileExistsError where ``path`` holds a run that trained (:meth:`holds_trained_run`), saying how to go on
        (``host``: in its adapter's terms); ``stabletrain train`` asks it once before starting several processes."""
        if not RunDir.holds_trained_run(path):
            return
        cont = ("Monitor(..., resume=True), then load_state_dict(the state you saved)" if host == "monitor" else
                "resume the host from its checkpoint: stabletrain's state is in it")
        raise FileExistsError(
            f"run directory {str(path)!r} already holds a run; " + (
                f"pass another run_dir= or overwrite=True (to continue that run: {cont})" if host else
                f"resume it with --resume {path}, pick another run.dir, or pass run.overwrite=true"))

    @staticmethod
    def holds_trained_run(path: Path) -> bool:
        """Whether ``path`` holds a run that trained: a logged metrics line or a checkpoint after step 0."""
        metrics = path / "metrics.jsonl"
        if metrics.exists() and metrics.stat().st_size > 0:
            return True
        return any(p.name.startswith("step_") and p.name != "step_000000" for p in (path / "checkpoints").glob("step_*"))

    def supersede_after(self, step: int, keep: str | None = None) -> tuple[int, list[str]]:
        """A resume from ``step``: the metrics lines after it superseded (:meth:`drop_metrics_after`; how many) and the
        incidents of those steps set aside but ``keep`` (:func:`~stabletrain.records.bundles.set_aside_incidents`;
        their new names): a launch killed mid-capture left a bundle without its diagnosis, read as the run's own."""
        from .bundles import set_aside_incidents  # (torch: not for a launcher's RunDir)

        return self.drop_metrics_after(step), set_aside_incidents(self.path, step, "resume", keep)

    def drop_metrics_after(self, step: int, by: str = "resume") -> int:
        """Remove the metrics lines of steps after ``step`` (a resume supersedes them); return how many.

        After a crash the steps between the last checkpoint and the crash are trained again: each step
        then appears once in metrics.jsonl, with the values of the run that continued. The removed lines
        are appended to ``metrics.superseded.jsonl`` (a crash's evidence is never deleted), each with
        ``superseded_by``: ``by`` (``resume``, ``rollback`` or ``remedy``: the report draws a rollback's faded).
        """
        path = self.path / "metrics.jsonl"
        self.metrics.close()
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []

        def after(line: str) -> bool:
            try:
                return int(json.loads(line).get("step", -1)) > step
            except (ValueError, AttributeError, TypeError):
                return False  # a malformed line stays, for the report to name

        kept = [line for line in lines if not after(line)]
        if len(kept) != len(lines):  # the dropped lines are kept as evidence: what the run lost to the crash
            superseded = self.path / "metrics.superseded.jsonl"
            with open(superseded, "a", encoding="utf-8") as fh:
                fh.write(line_start(superseded) + "".join(json.dumps({**json.loads(line), "superseded_by": by}) + "\n"
                                                          for line in lines if after(line)))
            atomic_write(path, "".join(kept))
        self.metrics = JsonlWriter(path)
        return len(lines) - len(kept)

    def amend_last_metrics(self, step: int, fields: dict[str, Any]) -> bool:
        """Add ``fields`` to metrics.jsonl's last line where it is step ``step``'s (a host's evaluation after the run's last
        record, which no record follows to carry it); return whether it did."""
        path = self.path / "metrics.jsonl"
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True) if path.exists() else []
        try:
            last = json.loads(lines[-1]) if lines else None
        except ValueError:
            return False
        if not isinstance(last, dict) or last.get("step") != step:
            return False
        self.metrics.close()
        try:
            atomic_write(path, "".join(lines[:-1]) + json.dumps(json_safe({**last, **fields})) + "\n")
        except OSError:
            return False
        finally:
            self.metrics = JsonlWriter(path)
        return True

    def write_config(self, cfg: Config) -> None:
        """Write ``config.yaml`` (every default written out), atomically."""
        atomic_write(self.path / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))

    def write_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Write ``snapshot.json``, atomically."""
        atomic_write(self.path / "snapshot.json", json.dumps(json_safe(snapshot), indent=2) + "\n")

    def update_snapshot(self, **fields: Any) -> None:
        """Add ``fields`` to ``snapshot.json`` (rewritten atomically); nothing when there is none (a run written without)."""
        path = self.path / "snapshot.json"
        if path.is_file():
            self.write_snapshot({**json.loads(path.read_text(encoding="utf-8")), **fields})

    def append_to_snapshot(self, key: str, item: Any) -> None:
        """Append ``item`` to ``snapshot.json``'s list ``key`` (made where there is none); nothing without a snapshot."""
        path = self.path / "snapshot.json"
        if path.is_file():
            old = json.loads(path.read_text(encoding="utf-8"))
            self.write_snapshot({**old, key: [*(old.get(key) or []), item]})

    def event(self, step: int, kind: str, reason: str, **fields: Any) -> dict[str, Any]:
        """Append one line to events.jsonl and return it; ``kind`` must be one of
        :data:`~stabletrain.records.events.EVENT_KINDS`."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"event kind {kind!r} is not one of stabletrain.records.events.EVENT_KINDS "
                             f"({', '.join(EVENT_KINDS)}); add it there with its meaning")
        record = {"step": step, "kind": kind, "reason": reason, "time": round(time.time(), 3), **fields}
        self.events.write(record)
        return record

    def record_launch(self, processes: list[dict[str, Any]]) -> None:
        """Write :data:`LAUNCH_FILE`: the processes (every rank's :func:`this_process`, and the launcher that restarts
        them: :func:`launch_parent`) now running on this directory."""
        atomic_write(self.path / LAUNCH_FILE, json.dumps({"processes": [*processes, *launch_parent()]}, indent=1) + "\n")
        self._launch_recorded = True

    def close(self) -> None:
        self.metrics.close()
        self.events.close()
        if self._launch_recorded:  # the run is over: nothing of this launch runs on the directory any more, but a
            # launcher that restarts it after an error (closed while one propagates): it holds the directory till then
            # (a trial: a second run.resume=auto took the run over while the first one's launcher waited to restart)
            parent = [p for p in launch_parent() if is_running(p)] if sys.exc_info()[1] is not None else []
            if parent:
                atomic_write(self.path / LAUNCH_FILE, json.dumps({"processes": parent}, indent=1) + "\n")
            else:
                (self.path / LAUNCH_FILE).unlink(missing_ok=True)
            self._launch_recorded = False


def append_event(run_dir: Path, step: int, kind: str, reason: str, **fields: Any) -> None:
    """Append one event to ``run_dir``'s ``events.jsonl`` from a process that does not hold the run open (a rank other
    than 0, recording its own crash): one line in one ``O_APPEND`` write, which another process's lines do not split.
    Never raises (the crash it records is what matters)."""
    if kind not in EVENT_KINDS:
        raise ValueError(f"event kind {kind!r} is not one of stabletrain.records.events.EVENT_KINDS")
    record = {"step": step, "kind": kind, "reason": reason, "time": round(time.time(), 3), **fields}
    line = (json.dumps(json_safe(record)) + "\n").encode("utf-8")
    try:
        fd = os.open(Path(run_dir) / "events.jsonl", os.O_WRONLY | os.O_APPEND)  # (never created here: rank 0 did)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass
