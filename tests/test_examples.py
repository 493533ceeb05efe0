"""The examples newcomers copy do what their docstrings say (run as the README runs them: from the repo root)."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
from helpers import cfg

from stabletrain.loop import Trainer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def my_task(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))
    sys.modules.pop("examples.my_task", None)
    return importlib.import_module("examples.my_task")


def test_my_task_sequences_follow_the_rule_at_every_position(my_task):
    data = my_task.Sequences(64, 24, 32, seed=0)
    x, y, mask = data[0]
    assert torch.equal(y, (x * 7 + 3) % 32)  # every target is the rule applied to its own input token
    assert all(torch.equal(data[i][1], (data[i][0] * 7 + 3) % 32) for i in range(len(data)))


def test_my_task_learns_its_rule_in_300_steps(my_task):
    """The docs' command for 300 steps (docs/your-code.md): from chance (ln 32 = 3.47) to below 0.05 (train and validation)."""
    trainer = Trainer(cfg("task=examples.my_task:make_task", "train.max_steps=300", "log.every=50", "eval.every=300"))
    trainer.fit()
    first, last = trainer.history[0], trainer.history[-1]
    assert first["loss_max"] > 0.9 * math.log(32)  # the first steps are at chance
    assert last["loss"] < 0.05 and last["val_loss"] < 0.05, last


@pytest.mark.slow  # trains for seconds
def test_the_readmes_callback_snippet_runs_as_written(tmp_path, monkeypatch, capsys):
    """The "Callbacks" snippet of the docs (docs/your-code.md), run as written: its config comes from load_config,
    its hooks print."""
    import re

    section = (ROOT / "docs" / "your-code.md").read_text(encoding="utf-8").split("## Callbacks", 1)[1].split("\n#", 1)[0]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    monkeypatch.chdir(tmp_path)
    exec(compile(snippet, "docs/your-code.md callbacks snippet", "exec"), {"__name__": "__readme__"})
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [line.split(":")[0] for line in printed] == ["step 20", "step 40", "step 60"]
    emas = [float(line.rsplit(" ", 1)[1]) for line in printed]
    assert emas[-1] < emas[0] and all(math.isfinite(e) for e in emas)  # the mlp learns; its loss EMA falls
