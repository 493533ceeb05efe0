"""The interval snapshot keeps the parts whose state dicts are fresh copies as they are (on the CPU) and copies the rest:
both hold the state of the interval's start however the run goes on."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers import cfg, regression_task

from stabletrain import Trainer
from stabletrain.callbacks import Callback
from stabletrain.records.staging import tensors_in
from stabletrain.runstate import FRESH_KEYS, PARTS


def same(a, b) -> bool:
    """equal_states with NaN equal to NaN (the guard's window holds NaN where it has no loss yet)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(a.isnan(), b.isnan()) and torch.equal(
            a.nan_to_num(0.0), b.nan_to_num(0.0)))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


class LiveList(Callback):
    """A user's callback whose state dict hands out its live list (not a copy): the snapshot must copy it."""

    def __init__(self) -> None:
        self.seen: list[int] = []
        self.kept: dict = {}

    def on_step_end(self, state, out) -> None:
        self.seen.append(state.step)

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def on_log(self, state, record, rows) -> None:
        if state.step == 10:  # the snapshot of the interval starting now, taken after the on_log hooks
            self.kept["live"] = state.state_dict()
            self.kept["copy"] = copy.deepcopy(self.kept["live"])


@pytest.mark.parametrize("precision", ["fp32", "fp16"])  # fp16: the GradScaler's state in the precision part
def test_fresh_parts_and_a_callbacks_live_state_stay_as_they_were_at_the_interval_start(tmp_path, precision):
    live = LiveList()
    snapshots = []

    class Grab(Callback):
        def on_log(self, state, record, rows) -> None:
            if state.step == 15:  # the snapshot taken at step 10's boundary, before it is replaced
                snapshots.append(trainer.recorder.engine.state)

    trainer = Trainer(cfg("train.max_steps=30", "log.every=5", "capture.memory_snapshot=true", f"precision={precision}"),
                      task=regression_task(dropout=0.2), run_dir=tmp_path / "run", callbacks=[live, Grab()])
    snapshot, handed, objects = trainer.recorder.engine.snapshot, {}, {}
    take = snapshot.take

    def take_and_keep(side, rest, step, **kw):  # what the snapshot is handed at step 10, as it was then
        if step == 10:
            handed.update(copy.deepcopy(rest))
            objects.update(rest)
        take(side, rest, step, **kw)

    snapshot.take = take_and_keep
    trainer.fit()
    assert {key for key, _ in PARTS} - FRESH_KEYS == {"callbacks"} and {"rng", "counters"} <= FRESH_KEYS
    kept, copied = live.kept["live"], live.kept["copy"]
    for key in FRESH_KEYS:  # each fresh part's state dict at step 10 is what it was then, 20 steps later
        assert same(kept[key], copied[key]), key
    assert kept["callbacks"]["LiveList"]["seen"] == list(range(1, 31))  # the live one moved on ...
    (snap,) = snapshots
    assert snap["counters"]["step"] == 10 and snap["callbacks"]["LiveList"]["seen"] == list(range(1, 11))  # ... not its copy
    for key in FRESH_KEYS:  # the snapshot's fresh parts: the state dicts handed to it at step 10, kept as they were
        assert same(snap[key], handed[key]), key
        assert snap[key] is objects[key], key  # (kept, not copied: the fresh path was taken)
    assert snap["callbacks"] is not objects["callbacks"]  # copied
    if precision == "fp16":
        assert kept["precision"]["scaler"]["scale"] == snap["precision"]["scaler"]["scale"]
        assert trainer.state.precision_policy.state_dict()["scaler"] != kept["precision"]["scaler"]  # the scaler moved on
    live_tensors = {t.untyped_storage().data_ptr() for t in tensors_in(trainer.state.state_dict())}
    live_parts = {t.untyped_storage().data_ptr() for key, attr in PARTS if key != "callbacks"
                  for t in tensors_in(vars(getattr(trainer.state, attr)))}
    assert not {t.untyped_storage().data_ptr() for t in tensors_in({k: snap[k] for k in FRESH_KEYS})} & live_parts
    assert live_tensors  # (the comparison above had tensors to compare)
