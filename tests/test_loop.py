"""The fit loop: determinism, data progress, the built-in tasks and the task contract."""

import os

import pytest
import torch
from helpers import cfg

from stabletrain import Callback, Trainer, resolve_task
from stabletrain.tasks import TaskError

TIMING = {"tokens_per_s", "samples_per_s", "step_time_s", "peak_memory_mib"}


def _metrics(*overrides):
    trainer = Trainer(cfg("train.max_steps=24", "log.every=6", "eval.every=12", *overrides))
    trainer.fit()
    return [{k: v for k, v in r.items() if k not in TIMING} for r in trainer.history], trainer


@pytest.mark.slow
def test_same_seed_same_metrics_and_parameters():
    a, ta = _metrics("task_args.dropout=0.2", "accum.steps=2")
    b, tb = _metrics("task_args.dropout=0.2", "accum.steps=2")
    assert a == b
    assert all(torch.equal(x, y) for x, y in zip(ta.model.parameters(), tb.model.parameters()))
    c, _ = _metrics("task_args.dropout=0.2", "accum.steps=2", "seed=1")
    assert c != a


def test_data_progress_and_throughput_fields():
    records, trainer = _metrics("train.batch_size=100", "task_args.num_samples=1000")
    last = records[-1]
    # 1000 samples / 100 per step = 10 steps per epoch; 24 steps = 2 epochs + 4 steps.
    assert last["epoch"] == 2 and last["samples_seen"] == 2400 and last["tokens_seen"] == 2400
    assert trainer.history[-1]["samples_per_s"] > 0 and trainer.history[-1]["peak_memory_mib"] > 0
    assert "val_loss" in records[1] and "val_loss" not in records[0]


@pytest.mark.slow
def test_gpt_task_contract_and_data():
    task = resolve_task("gpt", {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, "max_bytes": 100_000})
    x, y = task.train_data[3]
    assert x.shape == y.shape == (16,) and torch.equal(x[1:], y[:-1])
    assert task.count_unit == "tokens" and task.data_fingerprint.startswith("stdlib-py:")
    again = resolve_task("gpt", {"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 16, "max_bytes": 100_000})
    assert again.data_fingerprint == task.data_fingerprint and torch.equal(again.train_data[5][0], task.train_data[5][0])
    assert task.model.head.weight is task.model.wte.weight  # tied embeddings
    loss_sum, count = task.loss(task.model, (x[None], y[None]))
    assert count == 16 and loss_sum.dtype == torch.float32
    assert loss_sum.item() / 16 == pytest.approx(torch.log(torch.tensor(256.0)).item(), rel=0.05)


@pytest.mark.slow
def test_gpt_validation_loss_falls():
    c = cfg("train.max_steps=40", "log.every=20", "eval.every=20", "eval.batches=4", "optim.lr=3e-3",
            "task_args.n_layer=2", "task_args.n_embd=64", "task_args.seq_len=64", "task_args.max_bytes=400000",
            task="gpt")
    trainer = Trainer(c)
    first = trainer.evaluate()["val_loss"]
    trainer.fit()
    assert trainer.history[-1]["val_loss"] < 0.7 * first


def test_user_task_contract_errors():
    with pytest.raises(TaskError, match="task_args.nope"):
        resolve_task("helpers:make_user_task", {"nope": 1})
    with pytest.raises(TaskError, match="has no callable 'missing'"):
        resolve_task("helpers:missing")
    with pytest.raises(TaskError, match="expected a built-in task"):
        resolve_task("gtp")
    task = resolve_task("helpers:make_user_task", {"width": 5})
    assert task.model[0].out_features == 5 and task.name == "regression"


def test_an_init_overwritten_before_the_first_step_is_an_event(tmp_path):
    import json

    trainer = Trainer(cfg("train.max_steps=2", "log.every=1"), run_dir=tmp_path / "run")
    torch.nn.init.normal_(trainer.model[0].weight, std=5.0)  # a wrapper or callback re-initializing a layer
    trainer.fit()
    events = [json.loads(x) for x in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    overwritten = [e for e in events if e["kind"] == "init_overwritten"]
    assert len(overwritten) == 1 and overwritten[0]["step"] == 0
    assert [p["name"] for p in overwritten[0]["params"]] == ["0.weight"]
    assert overwritten[0]["params"][0]["new_std"] == pytest.approx(5.0, rel=0.1)


@pytest.mark.slow
def test_dataloader_workers_are_seeded():
    a, _ = _metrics("data.workers=2", "train.max_steps=12")
    b, _ = _metrics("data.workers=2", "train.max_steps=12")
    c, _ = _metrics("data.workers=0", "train.max_steps=12")
    assert a == b == c  # the sample order is the host's, whatever the number of workers


def test_a_crash_in_the_users_loss_is_recorded_with_the_users_file_and_line(tmp_path):
    import json

    task = resolve_task("mlp")
    inner, calls = task.loss, []

    def loss(model, batch):
        calls.append(1)
        if len(calls) == 3:
            x, y, w = batch  # the user's bug: unpacking a 2-tuple into three names
        return inner(model, batch)

    task.loss = loss
    with pytest.raises(ValueError, match="not enough values to unpack"):
        Trainer(cfg("train.max_steps=5", "log.every=5", "log.init_signal=false"),  # (a loss that counts its calls)
                task=task, run_dir=tmp_path / "r").fit()
    events = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines()]
    crash = events[-1]
    assert crash["kind"] == "crash" and crash["step"] == 2 and crash["error"] == "ValueError"
    assert crash["location"].startswith(__file__) and crash["location"].endswith("in loss")
    assert crash["part"] == "loss" and crash["failed_step"] == 3


def test_a_data_error_right_after_a_log_boundary_is_the_next_steps(tmp_path):
    """The dataset raises on sample 44, read for step 6 right after the boundary at step 5: the crash said 'during the
    log-interval reduce', failed_step 5 (the window's read kept the boundary's label)."""
    import json

    from helpers import regression_task

    class Fails(torch.utils.data.Dataset):
        def __init__(self, data):
            self.data = data

        def __len__(self):
            return len(self.data)

        def __getitem__(self, i):
            if i == 44:
                raise OSError("sample 44 is unreadable")
            return self.data[i]

    task = regression_task()
    task.train_data = Fails(task.train_data)
    with pytest.raises(OSError, match="unreadable"):
        Trainer(cfg("train.batch_size=8", "train.max_steps=8", "log.every=5", "data.shuffle=false"), task=task,
                run_dir=tmp_path / "r").fit()
    crash = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines()][-1]
    assert crash["kind"] == "crash" and crash["failed_step"] == 6 and crash["during"].startswith("a training step"), crash


def test_a_crash_in_a_users_on_step_end_is_that_callbacks_after_its_step(tmp_path):
    """Step 3 was applied, then the user's on_step_end raised: the crash said 'during a training step', failed_step 4."""
    import json

    from helpers import regression_task

    from stabletrain.callbacks import Callback

    class Raises(Callback):
        def on_step_end(self, state, out):
            if state.step == 3:
                raise RuntimeError("the user's callback")

    with pytest.raises(RuntimeError, match="the user's callback"):
        Trainer(cfg("train.batch_size=8", "train.max_steps=8", "log.every=5"), task=regression_task(),
                run_dir=tmp_path / "r", callbacks=[Raises()]).fit()
    crash = [json.loads(x) for x in (tmp_path / "r" / "events.jsonl").read_text().splitlines()][-1]
    assert (crash["kind"], crash["step"], crash["failed_step"]) == ("crash", 3, 3), crash
    assert crash["during"] == "a callback's on_step_end after step 3" and crash["location"].endswith("in on_step_end")


def test_a_config_built_in_python_is_validated_by_the_trainer():
    from stabletrain.config import AccumConfig, Config, ConfigError

    with pytest.raises(ConfigError, match="config key 'accum.steps': expected an integer >= 1, got 0"):
        Trainer(Config(task="mlp", accum=AccumConfig(steps=0)))


def test_fit_keeps_the_objects_alive_at_its_start_out_of_full_gc_scans_and_gives_them_back():
    import gc

    from stabletrain.callbacks import Callback
    from stabletrain.process import gc_frozen

    seen = []

    class FreezeCount(Callback):
        def on_step_end(self, state, out):
            seen.append(gc.get_freeze_count())

    assert gc.get_freeze_count() == 0
    Trainer(cfg("train.max_steps=2"), callbacks=[FreezeCount()]).fit()
    assert seen and min(seen) > 1000  # the model, torch's own objects, ...: frozen during the fit
    assert gc.get_freeze_count() == 0  # and given back after it
    gc.freeze()  # someone else froze objects before: their freeze stays
    try:
        frozen = gc.get_freeze_count()
        with gc_frozen():
            pass
        assert gc.get_freeze_count() >= frozen
    finally:
        gc.unfreeze()


def test_without_a_run_directory_no_interval_snapshot_is_taken(tmp_path):
    """Nothing could be captured without a run directory: the per-interval state copy is not paid for."""
    trainer = Trainer(cfg("train.max_steps=4", "log.every=2"))
    trainer.fit()
    assert trainer.recorder.snapshot is None
    with_dir = Trainer(cfg("train.max_steps=4", "log.every=2"), run_dir=tmp_path / "run")
    with_dir.fit()
    assert with_dir.recorder.snapshot is not None


def _torch_settings():
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))


@pytest.fixture
def user_torch_settings():
    """A process whose own settings are not torch's defaults (benchmark on, determinism warn-only); put back after."""
    before = _torch_settings()
    env = os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    torch.backends.cudnn.benchmark = True
    torch.use_deterministic_algorithms(False, warn_only=True)
    try:
        yield _torch_settings()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]
        if env is not None:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = env


def test_a_trainer_leaves_the_process_torch_settings_alone_unless_asked_and_puts_them_back(user_torch_settings):
    seen = []

    class Seen(Callback):
        def on_step_end(self, state, out):
            seen.append(_torch_settings())

    trainer = Trainer(cfg("train.max_steps=2"), callbacks=[Seen()])
    assert _torch_settings() == user_torch_settings  # deterministic=false: nothing changed, not even at build
    trainer.fit()
    assert seen[-1] == user_torch_settings and _torch_settings() == user_torch_settings
    trainer = Trainer(cfg("train.max_steps=2", "deterministic=true"), callbacks=[Seen()])
    trainer.fit()
    assert seen[-1] == (True, False, True, False, ":4096:8")  # on while fit() runs
    assert _torch_settings() == user_torch_settings  # and put back after it

    class Boom(Callback):
        def on_step_end(self, state, out):
            raise RuntimeError("boom")

    trainer = Trainer(cfg("train.max_steps=2", "deterministic=true"), callbacks=[Boom()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    assert _torch_settings() == user_torch_settings  # also after an exception


def test_an_interval_a_checkpoint_ends_between_log_boundaries_has_its_update_measured(tmp_path):
    """ckpt.every=15 with log.every=10: the interval ending at step 15 (the checkpoint's) recorded update_norm NaN."""
    import json
    import math

    from helpers import cfg

    from stabletrain import Trainer

    Trainer(cfg("train.max_steps=30", "log.every=10", "ckpt.every=15"), run_dir=tmp_path / "run").fit()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [10, 15, 20, 30]
    assert all(isinstance(r["update_norm"], float) and math.isfinite(r["update_norm"]) for r in records), records



def test_each_evaluation_is_logged_at_the_step_it_measured(tmp_path):
    """A trial: eval.every=4 with log.every=7 stamped step 4's val_loss on step 7's line and lost steps 8 and 16's
    evaluations (each overwrote the one before before a line took it). An evaluation ends its log interval."""
    import json

    c = cfg("train.max_steps=23", "log.every=7", "eval.every=4", "eval.batches=2", "ckpt.every=0")
    trainer = Trainer(c, run_dir=tmp_path / "run")
    trainer.fit()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [4, 7, 8, 12, 14, 16, 20, 21, 23]
    measured = {r["step"]: r["val_loss"] for r in rows if "val_loss" in r}
    assert sorted(measured) == [4, 8, 12, 16, 20, 23]
    again = Trainer(cfg("train.max_steps=23", "log.every=1", "eval.every=4", "eval.batches=2", "ckpt.every=0"),
                    run_dir=tmp_path / "every")
    again.fit()  # the same run logged every step: the same evaluations at the same steps, bitwise
    assert {r["step"]: r["val_loss"] for r in again.history if "val_loss" in r} == measured
