"""Weights & Biases as a tracker sink (see :mod:`.tracker_sink` for what every tracker is given, and when)."""

from __future__ import annotations

import math
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from .tracker_sink import TrackerSink

__all__ = ["WandbTracker", "flushed_step"]

#: How often W&B writes a run's file when its settings do not say (``wandb.Settings``'
#: ``x_transaction_log_flush_interval``; it also writes it at ``run.finish()``).
WANDB_FLUSH_S = 15.0


def flushed_step(handed: list[tuple[float, int]], now: float, flush_s: float) -> int | None:
    """The last step of ``handed`` ((time handed to W&B, step), in order) that W&B has surely written to its file.

    A step handed twice its flush interval ago (W&B writes every ``flush_s`` seconds; twice leaves it the time to
    get there); None: none is. ``flush_s`` <= 0: W&B writes only when a buffer fills or the run finishes.
    """
    cutoff = now - 2 * flush_s if flush_s > 0 else -math.inf
    return max((step for t, step in handed if t <= cutoff), default=None)


class WandbTracker(TrackerSink):
    """Write the run to Weights & Biases, offline by default: ``DIR/wandb/offline-run-*-ID/`` (``wandb sync`` uploads it).

    ``dir``: None = the run directory. The run's console is not captured (``console="off"``) and W&B's own
    lines are silenced: stabletrain says where the run is. A resumed run continues the same run id (each
    process writes its own ``offline-run-*-ID`` folder; ``wandb sync`` uploads them in order).

    What W&B holds, for a resume (its file is W&B's own format: stabletrain does not read it): ``trackers.json``
    keeps the last step handed to W&B, whether the process that handed it finished the run (W&B then wrote
    it all), and ``flushed_step``, the last step handed long enough before (:func:`flushed_step`) to be in
    W&B's file whatever happened after. After a process that finished, a resume writes the steps after the
    last handed; after one that was killed, those after ``flushed_step``: what W&B lost with the killed
    process is written again from ``metrics.jsonl``, and a step W&B did write in its last seconds may be
    there twice (the same value: the resumed run reproduces it bitwise).
    """

    name, title, extra = "wandb", "W&B", "wandb"

    def __init__(self, mode: str = "offline", project: str = "stabletrain", entity: str | None = None,
                 dir: str | None = None, run_name: str | None = None, **kwargs: Any) -> None:  # noqa: A002
        super().__init__(**kwargs)
        self.mode, self.project, self.entity, self.dir, self.run_name = mode, project, entity, dir, run_name
        self.run: Any = None
        self.base: Path | None = None
        self.finished = False  # this process ended the run: W&B wrote all it was handed
        self._handed: list[tuple[float, int]] = []  # (time.monotonic(), step) not yet known to be in W&B's file
        self._flushed = 0

    def _start(self, run_dir: Path, earlier: dict[str, Any]) -> dict[str, Any]:
        import wandb

        self.base, self.finished, self._handed = None, False, []
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
        # An entry without "finished" was written before stabletrain kept it: taken as finished.
        if not self.own or self.base is None or earlier.get("finished", True):
            held = int(earlier.get("last_step", 0))
        else:  # the process before was killed: W&B's file holds what it had written by then
            held = int(earlier.get("flushed_step", 0))
        self._flushed = held
        return held

    def _entry_fields(self) -> dict[str, Any]:
        if self.run is not None and not self.finished:
            settings = getattr(self.run, "settings", None)
            flush_s = float(getattr(settings, "x_transaction_log_flush_interval", WANDB_FLUSH_S) or 0.0)
            step = flushed_step(self._handed, time.monotonic(), flush_s)
            if step is not None:
                self._flushed = max(self._flushed, step)
                self._handed = [(t, s) for t, s in self._handed if s > step]
        return {"finished": self.finished, "flushed_step": self._flushed}

    def _log_metrics(self, step: int, values: dict[str, float]) -> None:
        if self.own:
            self.run.log(values, step=step)
            self._handed.append((time.monotonic(), step))
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
            self.finished, self._handed = True, []
            self._flushed = self.held  # all W&B was handed is in its file now
            if self._entry:  # (none when the run failed to start)
                self._save_entry()

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
