"""Weights & Biases as a tracker sink (see :mod:`.tracker_sink` for what every tracker is given, and when)."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

from .. import console
from .tracker_sink import TrackerSink

__all__ = ["WandbTracker"]


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
