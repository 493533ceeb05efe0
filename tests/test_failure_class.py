"""The failure class of a diagnosed incident, with its evidence: one planted fault per class, and one per class
that must not get it. Each run is the built-in loop on a tiny task; the class is read from the incident event
(the printed line), diagnosis.json and the summary."""

from __future__ import annotations

import json
import math

import faults
import pytest
import torch
import torch.nn.functional as F
from faults import Stack
from helpers import PoisonAt, cfg, nan_sample_task, regression_task
from remedy_tasks import Rescaled, _mse, fp16_overflow_task, sqrt_zero_task
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain import Task, Trainer
from stabletrain.cli import main
from stabletrain.console import brief
from stabletrain.diagnostics.failure_class import classify_failure, growth
from stabletrain.incident_replay import diagnose_step
from stabletrain.policies.precision import PrecisionPolicy
from stabletrain.records.jsonl import revive
from stabletrain.report import write_report

DIVERGING = ("optim.name=sgd", "optim.lr=2.5", "optim.weight_decay=0", "clip.max_norm=null", "sched.warmup_steps=20",
             "sched.decay=constant", "ckpt.every=10", "guard.max_consecutive_skips=3")


def first_incident(tmp_path, task, *overrides):
    """Train ``task`` until its first incident; return (incident event, diagnosis.json)."""
    spec = task if isinstance(task, str) else "mlp"  # a factory the CLI rebuilds, or a task object
    c = cfg("train.batch_size=8", "log.every=5", "data.shuffle=false", *overrides, task=spec)
    Trainer(c, task=None if isinstance(task, str) else task, run_dir=tmp_path / "run").fit()
    events = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    event = next(e for e in events if e["kind"] == "incident" and e.get("anomaly") != "spike")  # the non-finite one
    folder = tmp_path / "run" / "incidents" / f"step_{event['step']:06d}"
    return event, revive(json.loads((folder / "diagnosis.json").read_text()))


def test_growth_says_the_factor_per_step_and_since_when():
    rows = [{"step": 5, "loss": 3.0}, {"step": 10, "loss": 1.0}, {"step": 15, "loss": 2.0}, {"step": 20, "loss": 64.0},
            {"step": 25, "loss": 2048.0}]
    g = growth(rows, 25)
    assert (g["metric"], g["since_step"], g["until_step"], g["total_factor"]) == ("loss", 10, 25, 2048.0)
    assert g["factor_per_step"] == pytest.approx(2048 ** (1 / 15))
    assert growth(rows[:3], 15) is None  # x2 over two rows: not a divergence
    assert growth([{"step": s, "loss": 1.0 / s} for s in range(1, 9)], 8) is None  # falling
    # A student's trial: the interval ending at step 20 held step 16's loss alone (steps 17-20 non-finite): dated to
    # step 20 it read x34 per step where the loss grew x361 (a later incident's text beside the first one's)
    diverged = [{"step": 10, "loss": 49.0}, {"step": 15, "loss": 49.0 * 361 ** 5},
                {"step": 20, "loss": 49.0 * 361 ** 6, "num_nonfinite": 4}]
    g = growth(diverged + [{"step": 25, "loss": float("nan"), "num_nonfinite": 5}], 36)
    assert (g["since_step"], g["until_step"]) == (10, 16) and g["factor_per_step"] == pytest.approx(361.0)
    # a non-finite step the run recovered from (the next interval finite): its interval's value keeps its own step
    recovered = growth([*diverged[:2], {**diverged[2], "num_nonfinite": 1}, {"step": 25, "loss": 49.0 * 361 ** 7}], 36)
    assert (recovered["since_step"], recovered["until_step"]) == (10, 25)
    # steps whose grad norm overflowed but whose loss is finite (a new user's SGD divergence: losses of 3e35 at steps
    # 17-20, each a non-finite step) are in the loss's mean: with loss_steps saying so, it is dated to the row's step
    # (it read '1.55 -> 3.12e+35 by step 16', x7.65e5 per step, where step 16's loss was 3.03e7)
    finite_losses = [*diverged[:2], {**diverged[2], "interval_steps": 5, "loss_steps": 5},
                     {"step": 25, "loss": float("nan"), "num_nonfinite": 5, "interval_steps": 5, "loss_steps": 0}]
    assert growth(finite_losses, 36)["until_step"] == 20
    short = [*diverged[:2], {**diverged[2], "interval_steps": 5, "loss_steps": 1}, finite_losses[3]]
    assert growth(short, 36)["until_step"] == 16  # (one finite loss in it: step 16's, as before)
    # the update norm is its row's last step's own (a review): dated to its row's step, non-finite steps before or not
    updates = [{"step": 10, "update_norm": 1.0}, {"step": 15, "update_norm": 30.0},
               {"step": 20, "update_norm": 900.0, "num_nonfinite": 4}, {"step": 25, "update_norm": float("nan")}]
    g = growth(updates, 36)
    assert (g["metric"], g["since_step"], g["until_step"]) == ("update_norm", 10, 20), g
    # A trial: the first incident's growth ended at step 62's own loss (the capture's steps past the last logged row),
    # a later one's at the mean of the interval's steps 61-62, half of it; both read 'by step 62'. The mean says so.
    from stabletrain.diagnostics.failure_class import _growth_text

    logged = [{"step": 50, "loss": 11.7, "loss_min": 9.0}, {"step": 60, "loss": 300.0, "loss_min": 20.0}]
    first = growth([*logged, {"step": 61, "loss": 1.48e6}, {"step": 62, "loss": 7.06e15}], 63)
    later = growth([*logged, {"step": 70, "loss": 3.53e15, "loss_min": 1.48e6, "interval_steps": 10, "loss_steps": 2}], 71)
    assert (first["to"], first["to_is_mean"], later["to"], later["to_is_mean"]) == (7.06e15, False, 3.53e15, True)
    assert "(11.7 -> 7.06e+15 by step 62, x6.03e+14)" in _growth_text(first)
    assert "(11.7 -> 3.53e+15, the mean of its interval's steps to step 62, x3.02e+14)" in _growth_text(later)
    # (a review) a row of one step (log.every=1, or one finite loss in its interval) is that step's own value
    each = [{"step": s, "loss": v, "loss_min": v, "loss_steps": 1} for s, v in ((60, 2.0), (61, 30.0), (62, 900.0))]
    one = [*logged, {"step": 70, "loss": 3e5, "loss_min": 3e5, "interval_steps": 10, "loss_steps": 1, "num_nonfinite": 9}]
    assert not growth(each, 63)["to_is_mean"] and not growth(one, 71)["to_is_mean"]
    norms = [{"step": s, "grad_norm": v, "loss_min": 1.0} for s, v in ((1, 1.0), (2, 30.0), (3, 900.0))]  # log.every=1
    assert not growth(norms, 4)["to_is_mean"] and growth([{**r, "step": 10 * r["step"]} for r in norms], 40)["to_is_mean"]


@pytest.mark.parametrize("accum, stage, since, metric", [(1, "loss", 5, "loss"), (2, "none", 10, "loss")])
def test_a_divergence_is_divergence_with_its_growth_never_not_reproducible(tmp_path, capsys, accum, stage, since,
                                                                           metric):
    # The issue's own case (accum 2): the loss grows for tens of steps until the grad norm's sum of squares overflows
    # while every gradient is finite (a window of two micro-batches holds its gradient sum until the clip's pass: the
    # squares overflow first). One micro-batch backpropagates its mean, as a plain loop does: there the loss itself
    # overflows first. The replay reproduces the loss bitwise and the Inf: never "not reproducible".
    event, d = first_incident(tmp_path, "remedy_tasks:diverging_task", "train.max_steps=60", *DIVERGING,
                              f"accum.steps={accum}")
    assert (d["failure_class"], d["stage"], d["reproduces"], d["matches_observed"]) == ("divergence", stage, True, True)
    assert d["first_nonfinite_param"] is None
    if stage == "none":
        assert d["grad_norm"] == math.inf
    g = d["growth"]
    assert (g["metric"], g["since_step"]) == (metric, since) and g["factor_per_step"] > 4 and g["total_factor"] > 1e15
    assert f"{metric} grew x{g['factor_per_step']:.3g} per step since step {since}" in d["evidence"]
    assert event["diagnosis"]["failure_class"] == "divergence" and d["summary"].startswith("divergence: ")
    assert "hardware" not in d["summary"]
    # The printed line of `stabletrain diagnose` (a fresh replay from the bundle) and report.html say it too.
    capsys.readouterr()
    assert main(["diagnose", str(tmp_path / "run" / "incidents" / f"step_{d['step']:06d}")]) == 0
    printed, warned = capsys.readouterr()
    assert "  failure_class                  divergence\n" in printed and f"since step {since}" in printed
    # The capture's diagnosis.json stays the record; the replay goes beside it. A replay that disagrees with it
    # (a model rebuilt without what was changed after it was built) says so: planted here by editing the record.
    folder = tmp_path / "run" / "incidents" / f"step_{d['step']:06d}"
    assert "diagnosis.replayed.json (the capture's diagnosis.json is kept)" in printed and "this replay" not in warned
    assert revive(json.loads((folder / "diagnosis.json").read_text())) == d
    (folder / "diagnosis.json").write_text(json.dumps({**d, "failure_class": "op", "summary": "op: planted"}))
    assert main(["diagnose", str(folder)]) == 0
    warned = capsys.readouterr().err
    assert ("this replay in a new process says 'divergence', the diagnosis written when the incident was captured says "
            "'op' (diagnosis.json: op: planted): the model or loss rebuilt here may not be the one that trained") in warned
    assert json.loads((folder / "diagnosis.json").read_text())["summary"] == "op: planted"
    page = write_report(tmp_path / "run").read_text()
    assert "failure_class" in page and "divergence: " in page and f"{metric} grew x" in page


def test_a_divergence_inside_one_interval_is_divergence_from_its_steps_losses(tmp_path):
    """No interval record before the incident shows the growth (one interval of 60 steps): the bundle carries the
    interval's per-step losses before it (observed["recent"]), from which the live and the offline diagnosis see it."""
    event, d = first_incident(tmp_path, "remedy_tasks:diverging_task", "train.max_steps=60", *DIVERGING,
                              "log.every=60", "ckpt.every=0")  # (a checkpoint's step is a log boundary too)
    assert d["failure_class"] == "divergence" and event["diagnosis"]["failure_class"] == "divergence", d["summary"]
    g = d["growth"]
    assert 0 < g["since_step"] < g["until_step"] < d["step"] and g["total_factor"] > 1e3
    folder = tmp_path / "run" / "incidents" / f"step_{d['step']:06d}"
    assert main(["diagnose", str(folder)]) == 0 and json.loads((folder / "diagnosis.replayed.json").read_text())["growth"] == g


def test_an_op_outside_any_module_is_said_so_not_module_none():
    first = {"op": "aten.mse_loss.default", "direction": "forward", "module": None, "origin": True, "kind": "inf"}
    d = {"reproduces": True, "stage": "loss", "first_op": first, "num_samples": 8, "bad_samples": [3], "loss": "inf",
         "grad_norm": "inf"}
    out = classify_failure(d)
    assert out["failure_class"] == "op" and out["evidence"] == (
        "aten.mse_loss.default in forward outside any module makes an inf from finite inputs, at sample 3")


def test_a_sqrt_of_zero_is_op_with_its_sample_not_data(tmp_path):
    _, d = first_incident(tmp_path, sqrt_zero_task(bad_index=13), "train.max_steps=4")
    assert (d["failure_class"], d["step"], d["bad_samples"]) == ("op", 2, [13])
    assert "(SqrtBackward0) in backward of module 'layers.1' makes a nan from finite inputs, at sample 13" in d["evidence"]
    assert d["growth"] is None


def test_a_nan_input_sample_is_data_not_op_nor_divergence(tmp_path):
    event, d = first_incident(tmp_path, nan_sample_task(bad_index=20, n=32), "train.max_steps=4")
    assert (d["failure_class"], d["bad_samples"], d["evidence"]) == ("data", [20], "non-finite inputs in samples 20")
    assert event["diagnosis"]["failure_class"] == "data"


def test_an_fp16_overflow_in_one_module_is_overflow_of_its_weights_not_bad_samples(tmp_path):
    _, d = first_incident(tmp_path, fp16_overflow_task(), "train.max_steps=2", "precision=fp16")
    assert (d["failure_class"], d["blamed_module"], d["op"]) == ("overflow", "layers.1.fc", "aten.addmm.default")
    assert len(d["bad_samples"]) == 8  # every sample overflows through it: the class is not "data"
    assert "computes in float16 from finite inputs and overflows it (max 65504); 8 of 8 samples go bad through it: " \
           "the module's weights" in d["evidence"]


def _scaled_loss(model, batch):
    x, y = batch
    return F.mse_loss((model(x).half() * 60000).float(), y)  # float16 overflows outside any module, in the loss


def test_an_fp16_overflow_outside_any_module_says_so_and_blames_no_weights(tmp_path, capsys):
    """Issue 33 item 7: a loss's own float16 op that overflows was "aten.mul.Tensor in module 'None' ... the module's
    weights, not the samples" after "outside any module"."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g) * 4, torch.randn(32, 1, generator=g)
    torch.manual_seed(0)
    task = Task(model=Stack(nn.Linear(8, 16), nn.Linear(16, 1)), train_data=TensorDataset(x, y), loss=_scaled_loss,
                name="scaled-loss")
    event, d = first_incident(tmp_path, task, "train.max_steps=2", "precision=fp16")
    assert (d["failure_class"], d["op"], d["module"], d["blamed_module"]) == ("overflow", "aten.mul.Tensor", None, None)
    # Samples 2, 6 and 7 alone overflow it (judged on their loss: the scaled backward's routine overflow, which made
    # every subset "bad", is not this incident's failure)
    assert d["evidence"] == ("aten.mul.Tensor outside any module computes in float16 from finite inputs and overflows it "
                             "(max 65504)") and d["bad_samples"] == [2, 6, 7]
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stabletrain: incident at")]
    for text in (d["summary"], event["diagnosis"]["summary"], *printed):
        assert "outside any module" in text and "None" not in text and "module's weights" not in text, text
    assert len(printed) == 1


def test_a_weight_driven_fp16_overflow_of_most_samples_leads_with_the_verdict(tmp_path, capsys):
    """Issue 33 item 6: when 13-15 of 16 samples overflow through a module's weights the summary opened with 'at
    samples 0, 1, 2, 3, ...'. Here 13 of 16 samples overflow layers.1.fc's float16 output (their fp32 output exceeds
    65504; three a million times smaller do not), and one of those three goes bad in the scaled backward too."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 8, generator=g) * 4
    x[[3, 9, 12]] *= 1e-6
    torch.manual_seed(0)
    model = Stack(nn.Linear(8, 16, bias=False), Rescaled(16, 1e-5), nn.Linear(16, 1))
    with torch.no_grad():
        model.layers[1].fc.bias.zero_()  # (with a bias every sample overflows)
    task = Task(model=model, train_data=TensorDataset(x, torch.randn(32, 1, generator=g)), loss=_mse, name="most")
    event, d = first_incident(tmp_path, task, "train.max_steps=2", "train.batch_size=16", "precision=fp16")
    assert (d["failure_class"], d["blamed_module"], d["num_samples"]) == ("overflow", "layers.1.fc", 16)
    bad = d["bad_samples"]
    assert 13 <= len(bad) <= 15 and not {0, 1, 2, 4, 5, 6, 7, 8, 10, 11, 13, 14, 15} - set(bad)  # most, not all
    verdict = ("overflow: aten.addmm.default in module 'layers.1.fc' computes in float16 from finite inputs and overflows "
               f"it (max 65504); {len(bad)} of 16 samples go bad through it: the module's weights or its own computation, "
               "not the samples; ")
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("stabletrain: incident at")]
    folder = tmp_path / "run" / "incidents" / f"step_{event['step']:06d}"  # (the line is its first clauses: the rest there)
    assert printed == [f"stabletrain: incident at step {event['step']}: "
                       + brief(d["summary"], more=f"(all of it: stabletrain diagnose {folder})")]
    assert printed[0].startswith(f"stabletrain: incident at step {event['step']}: {verdict}")
    assert d["summary"].startswith(verdict) and event["diagnosis"]["summary"] == d["summary"]
    assert "at sample" not in d["summary"]  # the samples are the evidence's count, not the headline


def test_a_log_of_zero_in_fp32_is_op_not_overflow():
    model, x = faults.log_of_zero()
    d = diagnose_step(model, faults.regression_loss, [(list(range(8)), x)], precision=PrecisionPolicy("fp32", "cpu"))
    assert (d["failure_class"], d["module"], d["blamed_module"]) == ("op", "layers.2", "layers.2")
    assert d["evidence"].startswith("aten.log.default in forward of module 'layers.2' makes an inf from finite inputs; "
                                    "8 of 8 samples go bad through it")


def test_a_transient_fault_is_not_reproducible(tmp_path):
    task = regression_task()
    task.model = PoisonAt(task.model, {3})  # NaN on the 3rd forward only: the replay's model is past it
    event, d = first_incident(tmp_path, task, "train.max_steps=4")
    assert (d["failure_class"], d["reproduces"], d["matches_observed"]) == ("not reproducible", False, False)
    assert math.isnan(d["observed"]["loss"]) and math.isfinite(d["loss"])
    assert event["diagnosis"]["failure_class"] == "not reproducible"


def test_a_replay_matching_a_finite_observation_with_no_bad_value_is_not_reproducible():
    # Observed: an Inf grad norm; the replay: finite everything -> the replay differs from what was seen.
    d = {"reproduces": False, "replays_agree": True, "loss": 1.0, "grad_norm": 2.0, "observed": {"loss": 1.0,
         "grad_norm": float("inf")}}
    c = classify_failure(d)
    assert c["failure_class"] == "not reproducible" and "differ from the observed 1.0 and inf: suspect state the " \
        "replay does not restore" in c["evidence"]
    # a host that recorded the grad norm only (a trial's Hugging Face step): 'the observed (not recorded) and nan' read as
    # two values; the one recorded is named
    c = classify_failure({**d, "observed": {"grad_norm": float("nan")}})
    assert "differ from the observed grad norm nan: suspect state" in c["evidence"], c["evidence"]


def test_a_summary_leads_with_its_verdict_and_a_divergence_names_no_samples(tmp_path):
    """Issue 33: a weight-driven fp16 overflow opened with 'at samples 0, 1, 2, 3, ...' (its evidence then said
    'the module's weights, not the samples'); a divergence's summary named samples ('only in combination: samples
    393, 58, ...') and said 'in module None' after 'outside any module'."""
    d = diagnose_step(*_weight_driven(), precision=PrecisionPolicy("fp32", "cpu"))
    assert d["summary"].startswith(f"op: {d['evidence']}; first non-finite value") and "at sample" not in d["summary"]
    _, div = first_incident(tmp_path, "remedy_tasks:diverging_task", "train.max_steps=60", *DIVERGING, "accum.steps=1")
    assert div["failure_class"] == "divergence" and "sample" not in div["summary"] and "'None'" not in div["summary"]
    assert "outside any module" in div["summary"]


def _weight_driven():
    model, x = faults.log_of_zero()  # 8 of 8 samples go bad through layers.2: the module, not the samples
    return model, faults.regression_loss, [(list(range(8)), x)]


class _LogOfMinusOne(nn.Module):
    """No weights, a buffer: log(c - 1) with c = 0 is NaN for every sample, from finite inputs."""

    def __init__(self):
        super().__init__()
        self.register_buffer("c", torch.zeros(()))

    def forward(self, x):
        return x * torch.log(self.c - 1)


def test_a_module_without_weights_that_makes_the_nan_is_blamed_for_its_computation_not_its_weights(tmp_path):
    """A user's NaN-making module holding only a buffer was told 'the module's weights, not the samples'."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
    torch.manual_seed(0)
    task = Task(model=Stack(nn.Linear(8, 16), _LogOfMinusOne(), nn.Linear(16, 1)), train_data=TensorDataset(x, y),
                loss=_mse, name="noweights")
    _, d = first_incident(tmp_path, task, "train.max_steps=2")
    assert (d["failure_class"], d["module"], d["module_params"]) == ("op", "layers.1", 0), d["summary"]
    assert "8 of 8 samples go bad through it: the module's own computation (it holds no weights), not the samples" \
        in d["evidence"], d["evidence"]


def test_an_input_past_fp16s_range_at_autocasts_cast_is_the_inputs_scale_not_the_modules_weights():
    """A trial: every input x1e6 under fp16: 'aten._to_copy in module fc1 computes in float16 ... 16 of 16 samples go bad
    through it: the module's weights or its own computation, not the samples ... not the data'. The cast was of the
    batch (its values 2.5e6 past 65504), not of the weight."""
    def case(shape, params=()):
        first = {"op": "aten._to_copy.default", "origin": True, "kind": "inf", "direction": "forward", "module": "fc1",
                 "output_dtypes": ["torch.float16"], "input_range": [-2498139.0, 2498139.0], "input_shapes": [shape],
                 "param_inputs": list(params)}
        return classify_failure({"reproduces": True, "stage": "activations", "first_op": first, "num_samples": 16,
                                 "bad_samples": list(range(16)), "module_params": 2, "loss": float("inf"), "grad_norm": 1.0})

    cast = case([16, 16])  # the batch's (its 16 samples)
    assert cast["failure_class"] == "overflow" and cast["weight_driven"] is False
    assert "casts its input to float16, whose values (up to 2.5e+06) are past its range (max 65504) in 16 of 16 " \
           "samples: the input's scale" in cast["evidence"] and "not the samples" not in cast["evidence"], cast
    # (a trial: inputs x1e-4 whose square underflowed, an rsqrt of 0 cast back to float16, read "scale the inputs down")
    assert "a division or rsqrt of a value near 0" in cast["evidence"] and "scale the inputs down" not in cast["evidence"]
    weight = case([16, 16], params=[0])  # a Linear(16, 16)'s weight, batch-shaped (a review): the module's own
    assert weight["weight_driven"] is True and "the module's weights or its own computation" in weight["evidence"]


def test_only_a_log_root_or_divisor_that_reads_a_parameter_blames_the_parameter_not_an_overflow_through_a_linear():
    """A review: an fp32 Linear's addmm takes its bias as an input, so a sample of 1e36 overflowing there read 'its input is
    the parameter fc.bias itself, which an update moved out of the op's domain', its samples and their skip left out."""
    def case(op, params, names, kind="inf"):
        first = {"op": op, "origin": True, "kind": kind, "direction": "forward", "module": "fc",
                 "output_dtypes": ["torch.float32"], "input_shapes": [[4], [16, 8], [8, 4]], "param_inputs": params,
                 "param_names": names}
        return classify_failure({"reproduces": True, "stage": "activations", "first_op": first, "num_samples": 16,
                                 "bad_samples": [3], "module_params": 2, "loss": float("inf"), "grad_norm": 1.0})

    linear = case("aten.addmm.default", [0], ["fc.bias"])
    assert linear["failure_class"] == "op" and "param_input" not in linear, linear
    assert linear["evidence"].endswith("makes an inf from finite inputs, at sample 3") and "fc.bias" not in linear["evidence"]
    log = case("aten.log.default", [0], ["fc.s"])
    assert log["param_input"] == "fc.s" and "its input is the parameter fc.s itself" in log["evidence"]
    assert case("aten.div.Tensor", [1], ["fc.s"])["param_input"] == "fc.s"  # x / s: the divisor
    assert "param_input" not in case("aten.div.Tensor", [0], ["fc.s"])  # s / x: the divisor is the data's
    assert "param_input" not in case("aten.mul.Tensor", [1], ["fc.gamma"])  # x * gamma: no domain to leave
    assert case("aten.reciprocal.default", [0], ["fc.s"])["param_input"] == "fc.s"  # 1 / s
    assert "param_input" not in case("aten.pow.Tensor_Scalar", [0], ["fc.v"])  # an inf: v ** 2 overflowing, no domain
    assert case("aten.pow.Tensor_Scalar", [0], ["fc.v"], kind="nan")["param_input"] == "fc.v"  # v ** 0.5 of v < 0


def test_a_float16_overflow_after_growth_is_the_precisions_and_a_float32_one_is_a_divergence():
    """A trial: activations that grew for 20 steps overflowed float16 in module 'head': class divergence (so no precision
    cure was tried; the same op was 'overflow' 30 steps later), though fp32 trained on. A float16 op that overflows from
    finite inputs is 'overflow' with the growth said; the same in float32 (or bfloat16) stays a divergence."""
    rows = [{"step": 5, "loss": 3.0}, {"step": 10, "loss": 1.0}, {"step": 15, "loss": 2.0}, {"step": 20, "loss": 64.0},
            {"step": 25, "loss": 2048.0}]
    first = {"op": "aten.addmm.default", "module": "head", "direction": "forward", "kind": "inf", "origin": True,
             "output_dtypes": ["torch.float16"], "param_inputs": [0], "input_shapes": [[16, 8]]}
    d = {"reproduces": True, "stage": "activations", "first_op": first, "num_samples": 16, "bad_samples": [],
         "grad_norm": float("inf"), "loss": float("inf")}
    verdict = classify_failure(d, rows, 26)
    assert verdict["failure_class"] == "overflow" and verdict["blamed_module"] == "head", verdict
    assert "computes in float16 from finite inputs and overflows it (max 65504)" in verdict["evidence"]
    assert "; before it the run's loss grew x" in verdict["evidence"], verdict["evidence"]
    for dtype in ("torch.float32", "torch.bfloat16"):
        again = classify_failure({**d, "first_op": {**first, "output_dtypes": [dtype]}}, rows, 26)
        assert again["failure_class"] == "divergence", (dtype, again)
