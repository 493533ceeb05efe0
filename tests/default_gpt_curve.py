"""The default ``gpt`` run's per-step training losses, stored once (``data/default_gpt_losses.json``) for the spike rule.

The whole default run (300 steps, ~1 minute of the suite alone, ~2 beside the other worker) is what the spike rule
must not flag (issue #32); training it in every suite run cost more than any other test. The tests replay the guard's
own host rule over the stored curve of all 300 steps and train its first steps live, which must give the stored losses
(so the stored curve is still the default run's), and the config's schedule must give its 300 LRs. After a change that
moves the default run (its config, the task, a new torch), write the curve again:

    OMP_NUM_THREADS=1 python tests/default_gpt_curve.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from stabletrain.callbacks import Callback
from stabletrain.config import load_config

PATH = Path(__file__).parent / "data" / "default_gpt_losses.json"
#: The overrides of the stored run: none that changes its training (no evaluation, a log line every 10 steps, no
#: progress bar or TensorBoard).
OVERRIDES = ["task=gpt", "eval.every=0", "log.every=10", "log.progress=false", "log.tensorboard=false"]


class StepLosses(Callback):
    """Each step's training loss (the interval's host rows) and whether the guard flagged it; stops the run once
    ``stop_after`` steps are in (the schedule stays the full run's)."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.spikes: list[int] = []
        self.stop_after = stop_after

    def on_log(self, state, record, rows) -> None:
        for row in rows:
            self.losses.append(float(row.values["loss"]))
            self.lrs.append(float(row.values["lr"]))
            if row.values.get("spike", 0.0) > 0.5:
                self.spikes.append(row.step)
        if self.stop_after is not None and len(self.losses) >= self.stop_after and state.stop_reason is None:
            state.stop(f"the test's {self.stop_after} steps are in")


def train(run_dir: Path, stop_after: int | None = None) -> StepLosses:
    """Train the default gpt run in this process (one thread, as the suite's workers) into ``run_dir``."""
    from stabletrain import Trainer

    seen = StepLosses(stop_after)
    Trainer(load_config(None, OVERRIDES), run_dir=run_dir, callbacks=[seen]).fit()
    return seen


def load() -> dict:
    return json.loads(PATH.read_text())


if __name__ == "__main__":
    import tempfile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        seen = train(Path(tmp) / "run")
    if len(seen.losses) != 300:
        sys.exit(f"the default run trained {len(seen.losses)} steps, not 300")
    PATH.parent.mkdir(exist_ok=True)
    PATH.write_text(json.dumps({"torch": torch.__version__, "overrides": OVERRIDES, "spikes": seen.spikes,
                                "losses": seen.losses, "lrs": seen.lrs}, indent=0) + "\n")
    print(f"wrote {PATH}: {len(seen.losses)} losses, {len(seen.spikes)} flagged as spikes")
