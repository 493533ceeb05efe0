"""Device-side step metrics: one sync per interval, finite-step means, the update norm, state round-trip."""

import math

import pytest
import torch

from stabletrain.policies.metrics import COLUMNS, StepMetrics, peak_memory_mib

t = torch.tensor


def _fill(m, rows):
    for i, (loss, norm, ok) in enumerate(rows):
        m.update(i + 1, loss=t(loss), grad_norm=t(norm), post_clip_norm=t(min(norm, 2.0)), clipped=t(norm > 2.0 and ok),
                 applied=t(ok), finite=t(ok), lr=t(0.1), loss_scale=t(1.0), count=t(8.0),
                 per_param_norms=t([norm, 0.0]), num_samples=8)


def test_reduce_summary_rows_and_state_roundtrip():
    m = StepMetrics(4, num_params=2, device=torch.device("cpu"))
    _fill(m, [(2.0, 1.0, True), (4.0, float("inf"), False), (3.0, 3.0, True)])
    clone = StepMetrics(4, 2, torch.device("cpu"))
    clone.load_state_dict(m.state_dict())
    summary, rows, param_sq = m.reduce()
    assert summary["loss"] == 3.0 and summary["loss_min"] == 2.0 and summary["loss_max"] == 4.0
    assert summary["grad_norm"] == 2.0 and summary["grad_norm_max"] == 3.0  # finite steps only
    assert summary["num_skipped"] == 1 and summary["num_nonfinite"] == 1
    assert summary["clip_rate"] == pytest.approx(1 / 2)  # over the applied steps: 1 of 2 (the skipped one's are gone)
    assert [r.step for r in rows] == [1, 2, 3] and param_sq == [10.0, 0.0]
    assert repr(clone.reduce()[0]) == repr(summary)  # repr: NaN (no update measured) equals itself
    assert len(m) == 0 and m.reduce() == ({}, [], [])  # reset after reduce


def test_a_nan_step_does_not_turn_the_interval_loss_into_nan():
    m = StepMetrics(4, num_params=2, device=torch.device("cpu"))
    _fill(m, [(2.0, 1.0, True), (float("nan"), float("nan"), False), (4.0, 1.0, True)])
    summary, rows, _ = m.reduce()
    assert summary["loss"] == 3.0 and summary["loss_max"] == 4.0, "the mean over the finite steps"
    assert summary["num_nonfinite"] == 1 and math.isnan(rows[1].values["loss"])


def test_the_update_norm_is_the_last_measured_one_and_an_overflow_is_not_nonfinite():
    m = StepMetrics(4, num_params=1, device=torch.device("cpu"))
    base = dict(loss=t(1.0), grad_norm=t(1.0), post_clip_norm=t(1.0), clipped=t(False), applied=t(True), finite=t(True),
                lr=t(0.1), loss_scale=t(1.0), count=t(1.0), per_param_norms=t([1.0]), num_samples=1)
    m.update(1, **base, update_norm=t(0.5), update_ratio=t(0.01))
    m.update(2, **{**base, "finite": t(False), "applied": t(False), "grad_norm": t(float("inf"))}, overflow=t(True))
    m.update(3, **base, update_norm=t(0.25), update_ratio=t(0.02))
    summary, _, _ = m.reduce()
    assert summary["update_norm"] == 0.25 and summary["update_ratio"] == pytest.approx(0.02)
    assert summary["num_skipped"] == 1 and summary["num_nonfinite"] == 0, "an fp16 overflow is a skip, not an incident"


def test_a_skipped_last_measured_update_is_not_stood_in_for_by_an_earlier_measured_one():
    """Two steps of an interval measured their update (a host's checkpoint mid-interval, the interval's last step); the
    last was skipped: its update NaN and its per-parameter norms too. The summary took the earlier step's update_norm,
    beside per-parameter norms (top_update_layers) of the last: two steps' figures on one line."""
    m = StepMetrics(4, num_params=1, device=torch.device("cpu"))
    base = dict(loss=t(1.0), grad_norm=t(1.0), post_clip_norm=t(1.0), clipped=t(False), finite=t(True), lr=t(0.1),
                loss_scale=t(1.0), count=t(1.0), per_param_norms=t([1.0]), num_samples=1)
    measured = dict(update_norm=t(0.5), update_ratio=t(0.01), param_update_norms=t([0.5]), param_norms=t([50.0]))
    m.update(1, **base, applied=t(True), **measured)
    m.update(2, **base, applied=t(False), **measured)
    summary, _, _ = m.reduce()
    assert math.isnan(summary["update_norm"]) and math.isnan(summary["update_ratio"]), summary
    assert all(math.isnan(x) for x in summary["interval_param_update_norms"])
    m.update(3, **base, applied=t(False), **measured)  # the other way round: the last measured one applied
    m.update(4, **base, applied=t(True), **{**measured, "update_norm": t(0.25), "param_update_norms": t([0.25])})
    summary, _, _ = m.reduce()
    assert summary["update_norm"] == 0.25 and summary["interval_param_update_norms"] == [0.25]


def test_update_refuses_a_missing_column_and_ignores_extra_step_outputs():
    m = StepMetrics(2, num_params=1, device=torch.device("cpu"))
    with pytest.raises(AssertionError, match="missing"):
        m.update(1, loss=t(1.0), per_param_norms=t([1.0]), num_samples=1)
    values = {c: t(True) if c in ("finite", "applied", "clipped") else t(1.0) for c in COLUMNS}
    m.update(1, **values, per_param_norms=t([1.0]), num_samples=1, something_else=t(3.0))
    assert len(m) == 1


def test_peak_memory_is_the_process_rss_on_cpu():
    assert 10 < peak_memory_mib(torch.device("cpu")) < 1e6


def test_rows_keep_each_steps_lr_although_the_lr_tensor_is_updated_in_place():
    """update() keeps the step's tensors until the interval's reduce; the live lr and loss scale are copied."""
    m = StepMetrics(4, num_params=1, device=torch.device("cpu"))
    lr, scale = t(0.1), t(1024.0)
    base = dict(loss=t(1.0), grad_norm=t(1.0), post_clip_norm=t(1.0), clipped=t(False), applied=t(True), finite=t(True),
                count=t(1.0), per_param_norms=t([1.0]), num_samples=1)
    for step in (1, 2, 3):
        m.update(step, **base, lr=lr, loss_scale=scale, **({"params_finite": t(True)} if step == 3 else {}))
        lr.mul_(2.0)  # what the schedule does to the optimizer's lr tensor after each step
        scale.div_(2.0)  # and a GradScaler to its scale
    _, rows, param_sq = m.reduce()
    assert [r.values["lr"] for r in rows] == pytest.approx([0.1, 0.2, 0.4])
    assert [r.values["loss_scale"] for r in rows] == [1024.0, 512.0, 256.0]
    assert math.isnan(rows[0].values["params_finite"]) and rows[2].values["params_finite"] == 1.0  # checked on 3 only
    assert param_sq == [3.0]


@pytest.mark.parametrize("saved, loaded", [(10, 2), (2, 10)])
def test_a_partial_interval_loads_into_an_interval_of_another_length(saved, loaded):
    """log.every changed on resume: the recorded steps carry over; the interval may then hold n + interval steps."""
    rows = [(1.0, 1.0, True), (2.0, 3.0, True), (float("nan"), float("nan"), False), (4.0, 1.0, True), (5.0, 1.0, True)]
    rows = rows[:2 + min(loaded, 3)]  # 2 loaded steps, then at most one whole new interval
    whole = StepMetrics(10, num_params=2, device=torch.device("cpu"))
    _fill(whole, rows)
    expected = whole.reduce()
    m = StepMetrics(saved, num_params=2, device=torch.device("cpu"))
    _fill(m, rows[:2])
    clone = StepMetrics(loaded, 2, torch.device("cpu"))
    clone.load_state_dict(m.state_dict())
    assert len(clone) == 2 and clone.state_dict()["buf"].shape == (2, len(COLUMNS))
    for i, (loss, norm, ok) in enumerate(rows[2:], start=3):
        clone.update(i, loss=t(loss), grad_norm=t(norm), post_clip_norm=t(min(norm, 2.0)),
                     clipped=t(norm > 2.0 and ok), applied=t(ok), finite=t(ok), lr=t(0.1), loss_scale=t(1.0),
                     count=t(8.0), per_param_norms=t([norm, 0.0]), num_samples=8)
    summary, got_rows, param_sq = clone.reduce()
    assert repr(summary) == repr(expected[0]) and param_sq == expected[2]
    assert [r.step for r in got_rows] == list(range(1, len(rows) + 1)) and summary["num_skipped"] == 1
    assert summary["loss"] == (7.0 / 3 if loaded == 2 else 3.0) and param_sq[0] == (11.0 if loaded == 2 else 12.0)
    assert clone.capacity == loaded and len(clone) == 0  # back to the configured interval after its reduce


def test_clear_drops_the_recorded_steps_without_a_reduce():
    m = StepMetrics(3, num_params=2, device=torch.device("cpu"))
    for _ in range(4):  # what a benchmark timing update() alone does: fill, drop, fill again
        _fill(m, [(1.0, 1.0, True), (2.0, 1.0, True)])
        m.clear()
    _fill(m, [(2.0, 1.0, True), (4.0, 3.0, True), (6.0, 1.0, True)])
    summary, rows, param_sq = m.reduce()
    assert [r.step for r in rows] == [1, 2, 3] and summary["loss"] == 4.0 and param_sq == [11.0, 0.0]


@pytest.mark.parametrize("odd", ["none", "shape", "dtype", "numbers"])
def test_every_value_lands_in_its_row_and_column_whatever_mixes_them(odd):
    """The flush stacks columns by kind; a column of other shapes, dtypes or numbers lands in the same places."""
    m = StepMetrics(6, num_params=1, device=torch.device("cpu"))
    expect = []
    for i in range(5):
        row = {c: float(10 * i + j) for j, c in enumerate(COLUMNS)}
        row.update(finite=1.0, applied=float(i % 2), params_finite=1.0 if i == 4 else float("nan"))
        if i < 4:  # measured on the last step only: NaN (the default) before it
            row.update(update_norm=float("nan"), update_ratio=float("nan"))
        values = {c: t(v) for c, v in row.items() if not math.isnan(v)}
        values.update(finite=t(True), applied=t(bool(i % 2)))
        if odd == "shape":
            values["count"] = t([row["count"]])  # a 1-element tensor among 0-dim ones
        elif odd == "dtype":
            values["count"] = t(int(row["count"])) if i % 2 else t(row["count"])  # int64 beside float32
        elif odd == "numbers":
            values["lr"] = row["lr"]  # a host number that changes every step
        m.update(i + 1, per_param_norms=t([1.0]), num_samples=1, **values)
        expect.append(row)
    _, rows, _ = m.reduce()
    got = [{c: r.values[c] for c in COLUMNS} for r in rows]
    assert repr(got) == repr(expect)  # repr: NaN equals itself


def test_an_interval_whose_measured_step_was_skipped_records_no_update_not_a_zero_one(tmp_path):
    """A new-user trial: a NaN at step 10, the interval's last (the step that measures the update): metrics.jsonl said
    update_norm 0.0, update_ratio 0.0 and every top_update_layers ratio 0.0, which reads as training that froze. A skipped
    step made no update: not measured (NaN, written "nan" as every non-finite figure), the other intervals' as before."""
    import json

    from helpers import cfg
    from remedy_tasks import sqrt_zero_task

    from stabletrain import Trainer

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=8", "log.every=2", "data.shuffle=false", "ckpt.every=0",
                "eval.every=0"), task=sqrt_zero_task(), run_dir=run_dir).fit()  # sample 13: steps 2 and 6 are NaN
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    for step in (2, 6):
        assert rows[step]["num_skipped"] == 1 and rows[step]["update_norm"] == rows[step]["update_ratio"] == "nan"
        assert rows[step]["top_update_layers"] == [], rows[step]["top_update_layers"]
    for step in (4, 8):
        assert rows[step]["update_norm"] > 0 and rows[step]["top_update_layers"][0]["ratio"] > 0


def test_the_first_intervals_throughput_counts_from_its_first_step_not_from_the_set_up(tmp_path):
    """A review: the first interval's clock started before on_fit_start, the step-0 init signal and the step-0
    checkpoint: its step_time_s and tokens_per_s held the run's set-up. A callback's on_fit_start takes 0.5 s here, which
    would put 0.125 s into each of the interval's 4 steps; a tiny model's step takes milliseconds (4 ms seen on a loaded
    machine): the bound is half the set-up's share, and the first interval's steps no slower than the second's by it."""
    import json
    import time

    from helpers import cfg, regression_task

    from stabletrain import Trainer
    from stabletrain.callbacks import Callback

    class SlowStart(Callback):
        def on_fit_start(self, state):
            time.sleep(0.5)

    run_dir = tmp_path / "run"
    Trainer(cfg("train.batch_size=8", "train.max_steps=8", "log.every=4"), task=regression_task(), run_dir=run_dir,
            callbacks=[SlowStart()]).fit()
    first, second = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    share = 0.5 / 4
    assert first["step_time_s"] < share / 2 and first["step_time_s"] < second["step_time_s"] + share / 2, (first, second)
    # The goodput ledger books the set-up to start-up (the step-0 report after the clock's own on_fit_start: startup_s;
    # it was the steps' time, then, the residual, 'evaluation')
    ledger = [json.loads(x) for x in (run_dir / "goodput.jsonl").read_text().splitlines()]
    one, two = [r for r in ledger if r["kind"] == "interval"]
    assert one["startup_s"] > 0 and one["eval_s"] < 0.1 and "startup_s" not in two and two["eval_s"] < 0.1, ledger
    assert one["checkpoint_s"] == 0, ledger  # the step-0 save's blocked time is the set-up's, booked once (a review)
    from stabletrain.report.goodput import read_goodput

    assert read_goodput(run_dir).seconds["startup"] >= 0.5


def test_a_fit_that_ends_before_its_first_interval_books_its_set_up_to_start_up_not_to_steps_redone(tmp_path):
    """A review: a new run that crashed at step 3 (before its first log boundary) had its step-0 report and save in
    its end line's steps, all of it booked as 'redone' (no checkpoint after step 0 to keep them)."""
    import json

    import pytest
    from helpers import cfg, regression_task

    from stabletrain import Trainer
    from stabletrain.report.goodput import read_goodput

    task, calls = regression_task(), []
    plain = task.loss

    def crashing(model, batch):
        calls.append(1)
        if len(calls) == 6:  # the step-0 report's three calls, then steps 1 and 2; step 3 raises
            raise RuntimeError("planted crash in step 3")
        return plain(model, batch)

    task.loss = crashing
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError, match="planted crash"):
        Trainer(cfg("train.batch_size=8", "train.max_steps=20", "log.every=10", "log.tensorboard=false"), task=task,
                run_dir=run_dir).fit()
    (end,) = [r for r in map(json.loads, (run_dir / "goodput.jsonl").read_text().splitlines()) if r["kind"] == "end"]
    g = read_goodput(run_dir)
    assert end["startup_s"] > 0 and g.seconds["startup"] >= end["startup_s"], (end, g.seconds)
    assert g.seconds["redone"] <= end["wall_s"] - end["startup_s"] + 1e-3, (end, g.seconds)
