"""The run directory and its sinks: config, snapshot, metrics, events (TensorBoard: :mod:`.tb_events`).

Everything a run knows lands here in plain formats (DESIGN.md, principle 5)::

    RUN_DIR/config.yaml     the resolved config, every default written out
    RUN_DIR/snapshot.json   code version, library versions, device, seed, data fingerprint
    RUN_DIR/metrics.jsonl   one line per log interval (keys: stabletrain.records.events.METRIC_KEYS)
    RUN_DIR/events.jsonl    one line per event: {"step", "kind", "reason", ...} (kinds: stabletrain.records.events.EVENT_KINDS)
    RUN_DIR/tb/             TensorBoard event files
    RUN_DIR/launch.json     the processes running on it (host, pid, start time), while they run
    RUN_DIR/metrics.superseded.jsonl   the metrics lines a resume dropped (a crash's lost steps), kept
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import yaml

from .._version import __version__
from ..config import Config, config_hash, config_to_dict
from .events import EVENT_KINDS
from ..fileio import atomic_write

__all__ = ["RunDir", "JsonlWriter", "read_jsonl", "build_snapshot", "git_info", "OUTPUT_MARKER", "mark_output_dir",
           "is_stabletrain_output", "LAUNCH_FILE", "this_process", "is_running", "running_launch", "refuse_if_running"]

#: The file that marks a folder stabletrain writes outside a run directory (``check --out``, ``lab --out``),
#: so that the snapshot's ``git.dirty`` does not count it as a change to the user's code.
OUTPUT_MARKER = ".stabletrain-output"
#: What makes a folder a run directory: RunDir creates both first thing.
_RUN_FILES = ("metrics.jsonl", "events.jsonl")


def _clean_leaf(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _clean(value: Any) -> Any:
    """Make a value JSON-safe: non-finite floats (in nested dicts, lists, tuples) become "nan", "inf", "-inf"."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return _clean_leaf(value)


class JsonlWriter:
    """Append JSON lines to a file, flushed after each line so a reader sees a run in progress."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        try:  # the common record is all finite: the C encoder as it is; else NaN/Inf spelled as strings
            line = json.dumps(record, allow_nan=False)
        except ValueError:
            line = json.dumps(_clean(record))
        self._fh.write(line + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Return (records, problems) of a JSON-lines file; a malformed line is a problem naming file and line."""
    records, problems = [], []
    path = Path(path)
    if not path.exists():
        return records, problems
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                problems.append(f"{path}:{lineno}: malformed JSON ({err.msg})")
                continue
            if not isinstance(rec, dict):
                problems.append(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
                continue
            records.append(rec)
    return records, problems


def mark_output_dir(path: str | Path) -> Path:
    """Create ``path`` (parents too) and mark it as stabletrain's output (:data:`OUTPUT_MARKER`); return it."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    marker = path / OUTPUT_MARKER
    if not marker.exists():
        marker.write_text("written by stabletrain: a snapshot's git.dirty does not count this folder\n", encoding="utf-8")
    return path


def _is_output_root(path: Path) -> bool:
    return (path / OUTPUT_MARKER).is_file() or all((path / name).is_file() for name in _RUN_FILES)


def is_stabletrain_output(path: str | Path) -> bool:
    """Whether ``path`` is a folder of stabletrain's own output, not the user's.

    That is a run directory (its ``metrics.jsonl`` and ``events.jsonl``), a folder marked with
    :data:`OUTPUT_MARKER` (``stabletrain check`` and ``lab`` output), or a folder holding nothing but
    such folders (``runs/``). A file, a symlink, or a folder with anything else in it is not.
    """
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    if _is_output_root(path):
        return True
    entries = list(path.iterdir())
    return bool(entries) and all(is_stabletrain_output(e) for e in entries)


def _porcelain_paths(status: str) -> list[str]:
    """The paths of ``git status --porcelain -z`` (a rename's both paths), relative to the repository root."""
    paths, fields = [], status.split("\0")
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.append(entry[3:])
        if entry[0] in "RC":  # -z puts a rename's source in the next field
            paths.append(fields[i])
            i += 1
    return paths


def _inside_output(root: Path, rel: str) -> bool:
    """Whether the repo path ``rel`` is stabletrain's output or lies inside a folder that is."""
    path = root / rel.rstrip("/")
    if is_stabletrain_output(path):
        return True
    return any(_is_output_root(parent) for parent in path.parents if parent != root and root in parent.parents)


def git_info(path: Path) -> dict[str, Any]:
    """Return the git commit, dirty flag and a hash of the dirty diff for the repo holding ``path``.

    stabletrain's own output (run directories, ``runs/``, check and lab folders: :func:`is_stabletrain_output`)
    is not dirt: a run of unchanged code after ``stabletrain check`` wrote its folder is not dirty.
    """
    def git(*args: str, cwd: Path = path) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        root = Path(git("rev-parse", "--show-toplevel").strip())
        changed = [p for p in _porcelain_paths(git("status", "--porcelain", "-z", cwd=root)) if not _inside_output(root, p)]
        diff = git("diff", "HEAD", "--", *[f":(literal){p}" for p in changed], cwd=root) if changed else ""
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(changed),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if changed else None}


def build_snapshot(cfg: Config, device: torch.device, precision: str, data_fingerprint: str | None,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return what identifies a run: code, libraries, device, seed, data, config hash."""
    dev: dict[str, Any] = {"type": device.type, "cpu": platform.processor() or platform.machine(),
                           "num_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev.update(name=props.name, total_memory_mib=props.total_memory // 2**20, capability=f"{props.major}.{props.minor}")
    snap = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "cwd": os.getcwd(),
        "git": git_info(Path.cwd()),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "stabletrain": __version__,
                     "numpy": __import__("numpy").__version__},
        "platform": platform.platform(),
        "device": dev,
        "precision": precision,
        "seed": cfg.seed,
        "deterministic": cfg.deterministic,
        "data_fingerprint": data_fingerprint,
        "config_hash": config_hash(cfg),
    }
    snap.update(extra or {})
    return snap


#: The processes of the launch running on a run directory (every rank's host, pid and start time); written
#: when the run opens, removed when it closes. What a SIGKILL leaves behind names processes that are gone.
LAUNCH_FILE = "launch.json"


def this_process() -> dict[str, Any]:
    """This process as :data:`LAUNCH_FILE` records it: host, pid and start time (which tells a reused pid apart)."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (Linux ``/proc``); None where unknown, gone or a zombie."""
    try:
        fields = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[19]) if fields[0] != "Z" else None


def is_running(proc: dict[str, Any]) -> bool:
    """Whether a process :func:`this_process` recorded still runs (on another host: False, it cannot be seen).

    The same pid must hold the same process (its start time); without ``/proc`` (not Linux) the pid alone tells.
    """
    if proc.get("host") != socket.gethostname() or not isinstance(proc.get("pid"), int):
        return False
    if Path("/proc/self/stat").exists():
        start = _start_time(proc["pid"])
        return start is not None and proc.get("start") in (None, start)
    try:
        os.kill(proc["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def running_launch(run_dir: str | Path, exclude: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The processes :data:`LAUNCH_FILE` in ``run_dir`` records that still run, but those in ``exclude`` (this launch's)."""
    try:
        recorded = json.loads((Path(run_dir) / LAUNCH_FILE).read_text(encoding="utf-8"))["processes"]
    except (OSError, ValueError, KeyError, TypeError):
        return []
    mine = {(p["host"], p["pid"]) for p in exclude}
    return [p for p in recorded if isinstance(p, dict) and (p.get("host"), p.get("pid")) not in mine and is_running(p)]


def refuse_if_running(run_dir: str | Path, exclude: Sequence[dict[str, Any]] = ()) -> None:
    """Raise ValueError while processes of an earlier launch still run on ``run_dir`` (two would write one run)."""
    running = running_launch(run_dir, exclude)
    if running:
        pids = " ".join(str(p["pid"]) for p in running)
        raise ValueError(f"run directory {str(run_dir)!r} is in use: {len(running)} process(es) of an earlier launch "
                         f"still run on it (pid {pids} on {running[0]['host']}); stop them (kill {pids}) or wait for "
                         "them to end, then start again")


class RunDir:
    """A run directory: creates it, writes config and snapshot, and owns the metric/event sinks.

    Only the writing process (rank 0) should create one.
    """

    def __init__(self, path: str | Path, *, resume: bool = False, overwrite: bool = False) -> None:
        self.path = Path(path)
        if not resume and not overwrite and self.holds_trained_run(self.path):
            raise FileExistsError(
                f"run directory {str(self.path)!r} already holds a run; resume it with --resume {self.path}, "
                "pick another run.dir, or pass run.overwrite=true"
            )
        # A directory that holds a run (it has config.yaml) is replaced when asked to, and so is one from an
        # attempt that never logged a trained step (it failed at start): it is not a run, the retry reuses it.
        if not resume and (self.path / "config.yaml").exists():
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.metrics = JsonlWriter(self.path / "metrics.jsonl")
        self.events = JsonlWriter(self.path / "events.jsonl")
        self._launch_recorded = False

    @staticmethod
    def holds_trained_run(path: Path) -> bool:
        """Whether ``path`` holds a run that trained: a logged metrics line or a checkpoint after step 0."""
        metrics = path / "metrics.jsonl"
        if metrics.exists() and metrics.stat().st_size > 0:
            return True
        return any(p.name.startswith("step_") and p.name != "step_000000" for p in (path / "checkpoints").glob("step_*"))

    def drop_metrics_after(self, step: int) -> int:
        """Remove the metrics lines of steps after ``step`` (a resume supersedes them); return how many.

        After a crash the steps between the last checkpoint and the crash are trained again: each step
        then appears once in metrics.jsonl, with the values of the run that continued. The removed lines
        are appended to ``metrics.superseded.jsonl`` (a crash's evidence is never deleted).
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
            with open(self.path / "metrics.superseded.jsonl", "a", encoding="utf-8") as fh:
                fh.write("".join(line if line.endswith("\n") else line + "\n" for line in lines if after(line)))
            atomic_write(path, "".join(kept))
        self.metrics = JsonlWriter(path)
        return len(lines) - len(kept)

    def write_config(self, cfg: Config) -> None:
        """Write ``config.yaml`` (every default written out), atomically."""
        atomic_write(self.path / "config.yaml", yaml.safe_dump(config_to_dict(cfg), sort_keys=False))

    def write_snapshot(self, snapshot: dict[str, Any]) -> None:
        """Write ``snapshot.json``, atomically."""
        atomic_write(self.path / "snapshot.json", json.dumps(_clean(snapshot), indent=2) + "\n")

    def event(self, step: int, kind: str, reason: str, **fields: Any) -> dict[str, Any]:
        """Append one line to events.jsonl and return it; ``kind`` must be one of :data:`~stabletrain.records.events.EVENT_KINDS`."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"event kind {kind!r} is not one of stabletrain.records.events.EVENT_KINDS "
                             f"({', '.join(EVENT_KINDS)}); add it there with its meaning")
        record = {"step": step, "kind": kind, "reason": reason, "time": round(time.time(), 3), **fields}
        self.events.write(record)
        return record

    def record_launch(self, processes: list[dict[str, Any]]) -> None:
        """Write :data:`LAUNCH_FILE`: the processes (every rank's :func:`this_process`) now running on this directory."""
        atomic_write(self.path / LAUNCH_FILE, json.dumps({"processes": processes}, indent=1) + "\n")
        self._launch_recorded = True

    def close(self) -> None:
        self.metrics.close()
        self.events.close()
        if self._launch_recorded:  # the run is over: nothing of this launch runs on the directory any more
            (self.path / LAUNCH_FILE).unlink(missing_ok=True)
            self._launch_recorded = False
