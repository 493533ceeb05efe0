"""No host-device sync between log intervals: count every Tensor->host conversion over many steps."""

import pytest
from helpers import cfg

from stabletrain import Trainer
from stabletrain.callbacks import Callback
from stabletrain.records.checkpoint.writer import close_writer
from stabletrain.syncs import SyncCounter


def CountSyncs(trainer):
    """Record (trainer step, calling function, callers) for each Tensor -> Python conversion."""
    return SyncCounter(lambda: trainer.step)


#: The one-time init-fingerprint comparisons (InitWatch: before step 1, and right after the model's first forward).
_INIT_WATCH = ("on_fit_start", "after_first_forward")
#: The signal report before step 1 (its stack's outer frames, where a deep one holds only the inner: its loss at init's).
_REPORT = ("run_init_signal", "first_batch_signal")


def _boundary(where):
    # Log and eval intervals, checkpoints (the keeper's save), the one-time init-fingerprint comparisons and the
    # signal report before step 1 (services.init_signal.run_init_signal).
    return any(name in where for name in ("_log", "evaluate", "save", *_INIT_WATCH, *_REPORT))


def test_syncs_happen_only_at_log_and_eval_boundaries(tmp_path):
    c = cfg("train.max_steps=45", "log.every=10", "eval.every=20", "accum.steps=2", "train.batch_size=16",
            "clip.max_norm=0.5", "log.tensorboard=true")
    close_writer()  # (one an earlier test started would take the saves: they would force no sync at all)
    trainer = Trainer(c, run_dir=tmp_path / "run")
    with CountSyncs(trainer) as counter:
        trainer.fit()
    stray = [(s, f, w) for s, f, w in counter.calls if not _boundary(w)]
    assert not stray, f"syncs outside log/eval boundaries: {stray[:3]}"
    assert {s for s, _, w in counter.calls if any(n in w for n in _INIT_WATCH)} == {0}  # once, in step 1's forward
    assert {s for s, _, w in counter.calls if any(n in w for n in _REPORT)} == {0}  # the step-0 report (log.init_signal)
    logged = [(s, w) for s, _, w in counter.calls
              if "save" not in w and not any(n in w for n in (*_INIT_WATCH, *_REPORT))]
    steps = sorted({s for s, _ in logged})
    assert steps == [10, 20, 30, 40, 45]
    per_step = {s: sum(1 for t, _ in logged if t == s) for s in steps}
    # One sync per log interval; eval intervals (20, 40, and the end) add one more.
    assert per_step == {10: 1, 20: 2, 30: 1, 40: 2, 45: 2}
    # Checkpoints (step 0 and the end; ckpt.every=100 > 45) check finiteness on the host: with no writer process
    # running (closed above), a run's first save and its last are written in the loop's thread.
    assert sorted({s for s, _, w in counter.calls if "save" in w}) == [0, 45]


def test_the_counter_sees_a_planted_per_step_sync():
    c = cfg("train.max_steps=4", "log.every=4")
    trainer = Trainer(c)
    original = trainer.train_step

    def syncing_step(window, **kw):
        out = original(window, **kw)
        out["loss"].item()  # the kind of per-step sync the loop must not have
        return out

    trainer.train_step = syncing_step
    with CountSyncs(trainer) as counter:
        trainer.fit()
    assert sum(1 for s, f, w in counter.calls if not _boundary(w)) == 4


class DeviceLossMean(Callback):
    """An observer done right: accumulate on the device every step, read on the host once per interval."""

    def __init__(self):
        self.total, self.means = None, []

    def on_step_end(self, state, out):
        self.total = out["loss"].detach() if self.total is None else self.total + out["loss"].detach()

    def on_log(self, state, record, rows):
        self.means.append(float(self.total) / len(rows))  # at the boundary: the interval's one read
        self.total = None


class HostLoss(Callback):
    """An observer done wrong: reads the loss on the host every step (a sync per step)."""

    def on_step_end(self, state, out):
        float(out["loss"])


def test_an_observing_callback_adds_no_per_step_sync_and_a_wrong_one_is_caught():
    observer = DeviceLossMean()
    trainer = Trainer(cfg("train.max_steps=20", "log.every=10"), callbacks=[observer])
    with CountSyncs(trainer) as counter:
        trainer.fit()
    assert not [c for c in counter.calls if not _boundary(c[2]) and "on_log" not in c[2]]
    assert observer.means == pytest.approx([r["loss"] for r in trainer.history], rel=1e-5)
    trainer = Trainer(cfg("train.max_steps=20", "log.every=10"), callbacks=[HostLoss()])
    with CountSyncs(trainer) as counter:
        trainer.fit()
    assert sum(1 for s, f, w in counter.calls if "on_step_end" in w) == 20
