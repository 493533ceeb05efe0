"""No host-device sync between log intervals: count every Tensor->host conversion over many steps."""

import traceback

import torch
from torch.overrides import TorchFunctionMode

from helpers import cfg
from stabletrain import Trainer

SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
         torch.Tensor.__index__, torch.Tensor.numpy}


class CountSyncs(TorchFunctionMode):
    """Record (trainer step, calling function) for each Tensor -> Python conversion."""

    def __init__(self, trainer):
        super().__init__()
        self.trainer, self.calls = trainer, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            stack = traceback.extract_stack()[-8:]
            # DataLoader draws its workers' base seed from a CPU generator with .item() when an epoch's
            # loader opens: host memory only, never a device sync, so it is not counted.
            if not any("torch/utils/data" in f.filename for f in stack):
                self.calls.append((self.trainer.step, func.__name__, [f.name for f in stack]))
        return func(*args, **(kwargs or {}))


def _boundary(where):
    # Log and eval intervals, checkpoints, and the one-time init-fingerprint comparison before step 1.
    return any(name in where for name in ("_log", "evaluate", "_checkpoint", "_check_init"))


def test_syncs_happen_only_at_log_and_eval_boundaries(tmp_path):
    c = cfg("train.max_steps=45", "log.every=10", "eval.every=20", "accum.steps=2", "train.batch_size=16",
            "clip.max_norm=0.5", "log.tensorboard=true")
    trainer = Trainer(c, run_dir=tmp_path / "run")
    with CountSyncs(trainer) as counter:
        trainer.fit()
    stray = [(s, f, w) for s, f, w in counter.calls if not _boundary(w)]
    assert not stray, f"syncs outside log/eval boundaries: {stray[:3]}"
    assert {s for s, _, w in counter.calls if "_check_init" in w} == {0}
    logged = [(s, w) for s, _, w in counter.calls if "_checkpoint" not in w and "_check_init" not in w]
    steps = sorted({s for s, _ in logged})
    assert steps == [10, 20, 30, 40, 45]
    per_step = {s: sum(1 for t, _ in logged if t == s) for s in steps}
    # One sync per log interval; eval intervals (20, 40, and the end) add one more.
    assert per_step == {10: 1, 20: 2, 30: 1, 40: 2, 45: 2}
    # Checkpoints (step 0 and the end; ckpt.every=100 > 45) check finiteness on the host.
    assert sorted({s for s, _, w in counter.calls if "_checkpoint" in w}) == [0, 45]


def test_the_counter_sees_a_planted_per_step_sync():
    c = cfg("train.max_steps=4", "log.every=4")
    trainer = Trainer(c)
    original = trainer.train_step

    def syncing_step(window):
        out = original(window)
        out["loss"].item()  # the kind of per-step sync the loop must not have
        return out

    trainer.train_step = syncing_step
    with CountSyncs(trainer) as counter:
        trainer.fit()
    assert sum(1 for s, f, w in counter.calls if not _boundary(w)) == 4
