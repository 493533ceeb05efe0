"""Replaying a bad step: stage, op, module, parameter, samples, update, and whether it reproduces."""

from __future__ import annotations

import json
import warnings

import faults
import pytest
import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset, default_collate

from stabletrain import Task
from stabletrain.config import load_config
from stabletrain.incident_replay import diagnose_step
from stabletrain.loop import Trainer
from stabletrain.policies.precision import PrecisionPolicy

FP32 = PrecisionPolicy("fp32", "cpu")


def snapshot(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict[str, Tensor]) -> None:
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def diagnose(model, x, indices=None, **kw):
    indices = indices if indices is not None else list(range(100, 100 + len(x)))
    d = diagnose_step(model, faults.regression_loss, [(indices, x)], precision=FP32, **kw)
    json.dumps(d, allow_nan=False)  # JSON-safe: no NaN/Inf floats anywhere
    return d


@pytest.mark.parametrize("build, stage, op, direction, module", [
    (faults.log_of_zero, "activations", "aten.log.default", "forward", "layers.2"),
    (faults.sqrt_at_zero, "gradients", "aten.div.Tensor", "backward", "layers.1"),
    (faults.zero_std, "activations", "aten.div.Tensor", "forward", "layers.1"),
    (faults.fp16_overflow, "activations", "aten.addmm.default", "forward", "layers.1.fc"),
], ids=["log-of-zero", "sqrt-at-zero", "zero-std", "fp16-overflow"])
def test_planted_fault_diagnosis(build, stage, op, direction, module):
    model, x = build()
    before = snapshot(model)
    d = diagnose(model, x, bisect=False)
    assert (d["stage"], d["op"], d["direction"], d["module"], d["origin"]) == (stage, op, direction, module, True)
    assert d["reproduces"] is True and d["replays_agree"] and len(d["replays"]) == 2
    assert d["first_nonfinite_param"] == "layers.0.weight"
    assert f"{op} in {direction}" in d["summary"] and f"'{module}'" in d["summary"] and "reproduces on replay" in d["summary"]
    assert_unchanged(model, before)
    assert all(p.grad is None for p in model.parameters())


def test_a_frozen_batchnorm_replays_frozen_and_stays_frozen():
    """The replay runs the model in the modes the run had it, and gives each module its own mode back."""
    torch.manual_seed(0)
    model = faults.Stack(nn.Linear(8, 16), nn.BatchNorm1d(16), faults.LogFeatures(), nn.Linear(16, 4))
    model.layers[1].eval()  # frozen: running stats fixed
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    before = snapshot(model)
    d = diagnose(model, x, bisect=False)
    assert (d["stage"], d["op"], d["module"], d["reproduces"]) == ("activations", "aten.log.default", "layers.2", True)
    assert [m.training for m in model.modules()] == [True, True, True, False, True, True]
    assert_unchanged(model, before)


def test_sqrt_fault_names_the_zero_sample_and_its_forward_line():
    model, x = faults.sqrt_at_zero(zero_row=5)
    d = diagnose(model, x, indices=[40, 41, 42, 43, 44, 45, 46, 47])
    assert d["bad_samples"] == [45] and d["bad_sample_groups"] == []
    assert d["autograd_node"] == "SqrtBackward0"
    assert "x.pow(2).sum(-1, keepdim=True).sqrt()" in d["anomaly_trace"]
    assert "at sample 45" in d["summary"]


def test_masked_inf_says_it_never_reached_the_output_and_where_backward_made_it_nan():
    model, x = faults.masked_log2(zero_row=5)
    d = diagnose(model, x, indices=list(range(40, 48)))
    assert (d["stage"], d["op"], d["direction"], d["module"], d["kind"]) == (
        "activations", "aten.log2.default", "forward", "layers.1", "inf")
    assert (d["masked_in_forward"], d["backward_node"], d["backward_op"]) == (True, "Log2Backward0", "aten.div.Tensor")
    assert d["first_nonfinite_param"] == "layers.0.weight" and d["bad_samples"] == [45]
    assert ("aten.log2.default in forward of module 'layers.1' (origin: inputs finite); this inf was made finite again "
            "in forward (masked, clamped or saturated) before the output of module 'layers.1' and became NaN only in "
            "backward, at aten.div.Tensor in Log2Backward0 (the gradient still flows back to the op through what made it "
            "finite, 0 x inf") in d["summary"], d["summary"]
    unmasked = diagnose(*faults.log_of_zero(), bisect=False, anomaly=False)
    assert (unmasked["masked_in_forward"], unmasked["backward_node"]) == (False, None)
    assert "masked" not in unmasked["summary"]


def test_zero_std_blames_every_sample_not_the_data():
    model, x = faults.zero_std()
    d = diagnose(model, x)
    assert d["bad_samples"] == list(range(100, 108))
    assert "every sample" in d["summary"]


def nan_dataset_window(ds: TensorDataset, indices: list[list[int]]) -> list[tuple[list[int], object]]:
    return [(i, default_collate([ds[j] for j in i])) for i in indices]


@pytest.mark.parametrize("recollate", [True, False], ids=["dataset", "sliced"])
def test_nan_sample_is_named_by_bisection(recollate):
    ds = faults.dataset_with_nan(bad_index=37)
    torch.manual_seed(0)
    model = faults.Classifier()
    window = nan_dataset_window(ds, [[3, 60, 5, 9, 22, 14, 1, 50], [8, 37, 12, 13, 40, 41, 42, 43]])  # 2 micro-batches
    d = diagnose_step(model, faults.classification_loss, window, precision=FP32,
                      dataset=ds if recollate else None)
    assert d["stage"] == "inputs" and d["bad_samples"] == [37] and d["bad_input_samples"] == [37]
    assert (d["op"], d["direction"], d["module"], d["origin"]) == ("aten.addmm.default", "forward", "body.0", False)
    assert d["bisection"]["evaluations"] <= 1 + 2 * 4
    assert d["num_micro_batches"] == 2 and d["num_samples"] == 16


def test_the_record_counts_its_passes_and_the_subsets_of_a_nan_loss_run_no_backward():
    ds = faults.dataset_with_nan(bad_index=37)
    torch.manual_seed(0)
    model = faults.Classifier()
    forwards, backwards = [], []
    model.register_forward_hook(lambda m, i, o: forwards.append(len(i[0])))
    model.body[0].weight.register_hook(lambda g: backwards.append(1))  # the first layer: reached by a whole backward
    d = diagnose_step(model, faults.classification_loss, nan_dataset_window(ds, [list(range(32, 48))]), precision=FP32,
                      dataset=ds)
    assert d["bad_samples"] == [37] and d["stage"] == "inputs"
    # The whole window is the first replay, not asked again: subsets of 8, 8, 4, 4, 2, 2, 1, 1, half of them bad.
    assert d["passes"] == {"replays": 2, "updates": 0, "bisection": 8, "bisection_forward_only": 8, "anomaly": 1}
    assert forwards == [16, 16, 8, 8, 4, 4, 2, 2, 1, 1, 16] and d["bisection"]["judged_on"] == "loss"
    # Backward: the two replays alone. The window's loss is NaN: a subset is judged on its loss, its forward alone;
    # nor the anomaly pass (anomaly mode stops at the first backward function returning NaN, in the loss, before the model).
    assert len(backwards) == 2
    assert set(d["timings"]) == {"replays_s", "bisection_s", "anomaly_s", "total_s"}
    assert d["timings"]["total_s"] >= d["timings"]["replays_s"] + d["timings"]["bisection_s"] + d["timings"]["anomaly_s"]


def test_lr_blowup_is_the_update_stage():
    torch.manual_seed(0)
    model = faults.Classifier()
    ds = faults.dataset_with_nan()
    ds.tensors[0][37, 3] = 0.5  # a clean dataset
    window = nan_dataset_window(ds, [list(range(8)), list(range(8, 16))])
    optimizer = torch.optim.AdamW([{"params": model.body.parameters()},
                                   {"params": model.head.parameters(), "lr": 1e39}], lr=1e-3, fused=True)
    opt_before = json.dumps(optimizer.state_dict()["param_groups"])
    before = snapshot(model)
    d = diagnose_step(model, faults.classification_loss, window, precision=FP32, optimizer_factory=lambda: optimizer)
    json.dumps(d, allow_nan=False)
    assert d["stage"] == "update" and d["op"] is None and d["first_nonfinite_param"] is None
    assert d["nonfinite_params_after_update"] == ["head.weight", "head.bias"]
    assert d["reproduces"] and d["bad_samples"] is None
    assert d["passes"] == {"replays": 2, "updates": 2, "bisection": 0, "bisection_forward_only": 0, "anomaly": 0}
    assert "head.weight, head.bias non-finite" in d["summary"]
    assert_unchanged(model, before)
    assert optimizer.state == {} and json.dumps(optimizer.state_dict()["param_groups"]) == opt_before


def test_clipping_before_the_update_is_applied():
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    x = torch.randn(8, 8) * 1e3  # grads ~1e6: lr * grad overflows fp32 unless clipped to norm 1
    def opt():
        return torch.optim.SGD(model.parameters(), lr=1e37)

    def loss(m, b):
        return m(b).pow(2).mean()

    unclipped = diagnose_step(model, loss, [(list(range(8)), x)], precision=FP32, optimizer_factory=opt)
    clipped = diagnose_step(model, loss, [(list(range(8)), x)], precision=FP32, optimizer_factory=opt, max_norm=1.0)
    assert unclipped["stage"] == "update" and clipped["stage"] == "none"


def test_loss_stage_when_the_loss_function_goes_non_finite():
    model = faults.Classifier()
    d = diagnose_step(model, lambda m, b: (m(b).softmax(-1) * 0).log().mean(), [([0, 1], torch.randn(2, 8))],
                      precision=FP32, bisect=False)
    assert (d["stage"], d["op"], d["module"], d["direction"]) == ("loss", "aten.log.default", None, "forward")
    assert "outside any module" in d["summary"]


class CountGate(nn.Module):
    """Divides by (2 - number of flagged samples): non-finite only when both flagged samples are present."""

    def forward(self, x: Tensor) -> Tensor:
        return x / (2 - (x[:, :1] > 100).sum())


def test_bad_only_in_combination():
    torch.manual_seed(0)
    model = faults.Stack(CountGate(), nn.Linear(8, 2))
    x = torch.randn(8, 8)
    x[2, 0] = x[5, 0] = 1000.0
    d = diagnose(model, x, indices=list(range(20, 28)), anomaly=False)
    assert (d["stage"], d["op"], d["module"]) == ("activations", "aten.div.Tensor", "layers.0")
    assert d["bad_samples"] == [] and d["bad_sample_groups"] == [[22, 25]]
    assert "only in combination: samples 22, 25" in d["summary"]


class Flaky(nn.Module):
    """A stand-in for a transient fault: NaN on the calls listed in ``bad_calls`` only."""

    def __init__(self, bad_calls: set[int]) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls, self.bad_calls = 0, bad_calls

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        y = self.fc(x)
        return y * float("nan") if self.calls in self.bad_calls else y


def test_step_that_does_not_reproduce_is_called_out():
    model = faults.Stack(Flaky(set()))
    d = diagnose(model, torch.randn(4, 8), observed_loss=float("nan"))
    assert d["stage"] == "none" and d["reproduces"] is False and d["matches_observed_loss"] is False
    assert "did not reproduce" in d["summary"] and "hardware" in d["summary"]


def test_replays_that_disagree_are_nondeterministic():
    model = faults.Stack(Flaky({1}))
    d = diagnose(model, torch.randn(4, 8), bisect=False, anomaly=False)
    assert [r["stage"] for r in d["replays"]] == ["activations", "none"]
    assert d["reproduces"] is False and d["replays_agree"] is False and "replays disagree" in d["summary"]


def test_replays_restore_rng_so_dropout_matches_and_rng_is_left_as_found():
    model, x = faults.sqrt_at_zero()
    model.layers.insert(1, nn.Dropout(0.3))  # the L2 norm is now layers.2
    torch.manual_seed(123)
    d = diagnose(model, x, num_replays=3, bisect=False, anomaly=False)
    assert d["module"] == "layers.2" and d["reproduces"]
    assert len({r["loss_hex"] for r in d["replays"]}) == 1  # bitwise-equal losses under dropout
    after = torch.rand(3)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(3))


def test_model_mode_and_existing_grads_are_restored():
    model, x = faults.log_of_zero()
    model.eval()
    faults.regression_loss(model, torch.ones(2, 8)).backward()
    grads = [p.grad for p in model.parameters()]
    diagnose(model, x, bisect=False, anomaly=False)
    assert not model.training
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))


def test_num_replays_must_be_positive():
    model, x = faults.log_of_zero()
    with pytest.raises(ValueError, match="num_replays"):
        diagnose(model, x, num_replays=0)


def test_trainer_step_with_a_nan_sample_is_diagnosed_at_its_step():
    """End to end with the built-in loop: the sentinel flags the step, the replay names the sample."""
    bad_index = 37
    ds = faults.dataset_with_nan(n=64, bad_index=bad_index)
    torch.manual_seed(0)
    task = Task(model=faults.Classifier(), train_data=ds, loss=faults.classification_loss, name="nan-sample")
    cfg = load_config(None, ["device=cpu", "precision=fp32", "train.batch_size=4", "accum.steps=2", "log.progress=false",
                             "log.tensorboard=false", "train.max_steps=8"])
    trainer = Trainer(cfg, task=task)
    for step in range(1, 9):  # noqa: B007 (read after the loop: the step the sentinel fired at)
        window = trainer.stream.next_window()
        before, rng = snapshot(trainer.model), torch.get_rng_state()
        if not bool(trainer.train_step(window)["finite"]):
            break
    else:
        pytest.fail("the sentinel never fired")
    assert any(bad_index in mb for mb in window.indices)
    assert_unchanged(trainer.model, before)  # fused AdamW skipped the step on the device
    torch.set_rng_state(rng)
    d = diagnose_step(trainer.model, task.loss, list(zip(window.indices, window.batches)), precision=trainer.precision,
                      optimizer_factory=lambda: trainer.optimizer, dataset=ds, max_norm=cfg.clip.max_norm)
    assert (d["stage"], d["bad_samples"], d["module"], d["reproduces"]) == ("inputs", [bad_index], "body.0", True)
    order = trainer.stream.order.micro_batches(0)
    assert step == next(i for i, mb in enumerate(order) if bad_index in mb) // 2 + 1


@pytest.mark.parametrize("build", [faults.log_of_zero, faults.sqrt_at_zero], ids=["forward", "backward"])
def test_the_frames_shown_for_the_first_bad_op_are_only_the_users(build):
    """Forward stack, the autograd node's forward call and anomaly mode's: the task's file alone (faults.py).

    Not stabletrain's replay/step frames, not torch's, and not the caller above stabletrain (this test).
    """
    import re

    model, x = build()
    d = diagnose(model, x, bisect=False)
    files = re.findall(r'File "([^"]+)", line (\d+)', d["anomaly_trace"])
    assert len(files) >= 2, d["anomaly_trace"]
    assert {f.replace("\\", "/").rsplit("/", 1)[-1] for f, _ in files} == {"faults.py"}, d["anomaly_trace"]
    assert "x = layer(x)" in d["anomaly_trace"]  # Stack.forward, the user's own loop over layers, stays


# -- the user's own loop (stabletrain.Monitor): BatchNorm, fp16 with a GradScaler, an output object ---------------


def test_own_loop_with_batchnorm_fp16_and_an_output_object_names_the_one_bad_sample(tmp_path):
    """Accumulation over 3 micro-batches of 8, the user's GradScaler and clip, a model with BatchNorm returning a
    SimpleNamespace: the planted log(-1) (step 3, micro-batch 1, position 5) is sample 13 alone, in forward.

    BatchNorm cannot run one sample in training mode: sample 13 is judged with a sample of its micro-batch found good.
    The subsets are judged on their loss (the step's failure), not on gradients the GradScaler's scale overflows."""
    from nan_tasks import WeightedNet, weighted_batches, weighted_loss

    from stabletrain import Monitor
    from stabletrain.report import load_run

    torch.manual_seed(0)
    model = WeightedNet(batch_norm=True, output="namespace")
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # gradients scaled by it overflow float16
    data = weighted_batches(4 * 3)
    data[2 * 3 + 1]["w"][5] = -1.0
    with warnings.catch_warnings():  # fp16 on CPU: meant for testing (warned once a process)
        warnings.simplefilter("ignore")
        monitor = Monitor(model, opt, run_dir=tmp_path / "run", scaler=scaler, precision="fp16", loss_fn=weighted_loss,
                          log_every=10)
    with monitor:
        for step in range(4):
            micro, total = data[3 * step:3 * step + 3], 0.0
            for batch in micro:
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = weighted_loss(model, batch) / 3
                total = total + loss.detach()
                scaler.scale(loss).backward()
            scaler.unscale_(opt)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            monitor.step(micro_batches=micro, loss=total, grad_norm=norm)
    incident = load_run(tmp_path / "run").counted_events("incident")[0]
    d = incident.extra["diagnosis"]
    assert incident.step == 3 and d["failure_class"] == "op"
    assert (d["stage"], d["op"], d["direction"], d["module"]) == ("activations", "aten.log.default", "forward", "")
    assert d["bad_samples"] == [13] and d["bad_positions"] == [{"micro_batch": 1, "position": 5}]
    full = json.loads((tmp_path / "run" / "incidents" / "step_000003" / "diagnosis.json").read_text())
    assert full["masked_in_forward"] is False and full["replay_loss_scale"] == 1.0  # 2**22 overflows micro-batch 0's
    assert full["bisection"]["judged_on"] == "loss" and full["bisection"]["judged_with"] == {"13": [8]}
    assert ("aten.log.default in forward of the root module (origin: inputs finite), at sample 13 (judged with a sample "
            "of its micro-batch found good: 13 with 8; one sample alone cannot be replayed: BatchNorm in training mode "
            "needs more than one value per channel); reproduces on replay") in d["summary"]
    assert "masked" not in d["summary"]


def weighted_window(batch_norm: bool, output: str = "namespace", sizes: tuple[int, ...] = (8, 8), bad: int = 13):
    """A WeightedNet and a window of micro-batches of ``sizes`` (samples 40, 41, ...) whose sample 40 + ``bad`` has w = -1."""
    from nan_tasks import WeightedNet, weighted_batches

    torch.manual_seed(0)
    model = WeightedNet(batch_norm=batch_norm, output=output)
    batches = [weighted_batches(1, size, seed=i)[0] for i, size in enumerate(sizes)]
    starts = [40 + sum(sizes[:i]) for i in range(len(sizes))]
    window = [(list(range(start, start + size)), b) for start, size, b in zip(starts, sizes, batches)]
    for indices, b in window:
        if 40 + bad in indices:
            b["w"][indices.index(40 + bad)] = -1.0
    return model, window


def fp16_at(scale: float) -> PrecisionPolicy:
    """fp16 with a GradScaler at ``scale`` (a run's scale after many clean steps; its warning on CPU silenced)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        policy = PrecisionPolicy("fp16", "cpu")
    policy.scaler.load_state_dict({**policy.scaler.state_dict(), "scale": scale})
    return policy


def test_batchnorm_cannot_run_one_sample_so_it_is_judged_with_a_sample_of_its_micro_batch_found_good():
    """BatchNorm in training mode raises ValueError on one sample: sample 53 is judged with 48 (found good before)."""
    from nan_tasks import weighted_loss

    model, window = weighted_window(batch_norm=True)
    d = diagnose_step(model, weighted_loss, window, precision=FP32, anomaly=False)
    assert (d["stage"], d["op"], d["module"], d["bad_samples"], d["bad_sample_groups"]) == (
        "activations", "aten.log.default", "", [53], [])
    assert d["bisection"]["judged_with"] == {"53": [48]} and d["bisection"]["unrunnable_subsets"] == 0
    assert d["bisection"]["cannot_run_alone"].startswith("ValueError: Expected more than 1 value per channel")
    assert ("at sample 53 (judged with a sample of its micro-batch found good: 53 with 48; one sample alone cannot be "
            "replayed: BatchNorm in training mode needs more than one value per channel); reproduces") in d["summary"]
    # Micro-batches of 2: no sample of 41's micro-batch is ever found good, so no single one can be judged; the
    # smallest set found is said to be that, not a set bad only together.
    model, window = weighted_window(batch_norm=True, sizes=(2, 2), bad=1)
    d = diagnose_step(model, weighted_loss, window, precision=FP32, anomaly=False)
    assert d["bad_samples"] == [] and d["bad_sample_groups"] == [[40, 41]] and d["bisection"]["unrunnable_subsets"] == 2
    assert ("aten.log.default in forward of the root module (origin: inputs finite), smallest set found: samples 40, 41 "
            "(a smaller one cannot be replayed: BatchNorm in training mode needs more than one value per channel)"
            ) in d["summary"]
    assert "samples 40, 41 are the smallest set found bad (2 smaller subsets could not be replayed)" in (
        d["bisection"]["summary"])


def test_fp16_subsets_are_judged_on_the_failure_not_on_scaled_gradients_that_overflow():
    """At a GradScaler scale of 2**24 every subset's scaled gradients overflow float16 (the scaler's routine skip).

    A NaN loss (sample 53's log(-1)): subsets are judged on their forward loss, and the replays run at scale 1, where
    micro-batch 0's backward no longer overflows before micro-batch 1's forward. A NaN gradient (sample 45's sqrt
    at 0): subsets are judged at scale 1. Each names its one sample and its own op, as in fp32."""
    from nan_tasks import weighted_loss

    model, window = weighted_window(batch_norm=False, output="dict")
    d = diagnose_step(model, weighted_loss, window, precision=fp16_at(2.0**24), anomaly=False)
    assert (d["failure_class"], d["stage"], d["op"], d["direction"]) == ("op", "activations", "aten.log.default", "forward")
    assert d["bad_samples"] == [53] and d["replay_loss_scale"] == 1.0 and d["bisection"]["judged_on"] == "loss"
    assert "at sample 53; reproduces on replay" in d["summary"]

    model, x = faults.sqrt_at_zero(zero_row=5)
    d = diagnose_step(model, faults.regression_loss, [(list(range(40, 48)), x)], precision=fp16_at(2.0**30), anomaly=False)
    assert (d["failure_class"], d["op"], d["autograd_node"], d["module"]) == ("op", "aten.div.Tensor", "SqrtBackward0",
                                                                              "layers.1")
    assert d["bad_samples"] == [45] and d["bisection"]["judged_on"] == "gradients"
    assert d["bisection"]["loss_scale"] == 1.0 and d["replay_loss_scale"] == 1.0
    assert d["summary"].endswith("of module 'layers.1' (origin: inputs finite), at sample 45; reproduces on replay")


@pytest.mark.parametrize("output, masked", [("namespace", False), ("dataclass", False), ("opaque", None)])
def test_a_nan_loss_in_an_output_object_is_never_called_masked(output, masked):
    """The loss inside a SimpleNamespace or a dataclass: the locator reads the root module's output (the NaN reached it).
    An output it cannot read (slots): unknown, and the loss is NaN anyway, so nothing is called masked."""
    from nan_tasks import weighted_loss

    model, window = weighted_window(batch_norm=False, output=output)
    d = diagnose_step(model, weighted_loss, window, precision=FP32, anomaly=False)
    assert (d["stage"], d["op"], d["module"], d["bad_samples"]) == ("activations", "aten.log.default", "", [53])
    assert d["masked_in_forward"] is masked and d["backward_op"] is None and "masked" not in d["summary"]
    assert d["summary"] == ("op: first non-finite value (activations): aten.log.default in forward of the root module "
                            "(origin: inputs finite), at sample 53; reproduces on replay")


def test_a_replica_keeps_the_optimizer_kernel_it_built_whatever_the_saved_groups_say():
    """FSDP2 builds SGD foreach (no fused DTensor rule) and saves fused=False; the one-process replica builds a fused SGD,
    and loading that state made it a foreach SGD that still took a found_inf: every FSDP+SGD diagnosis crashed with
    'Expected grad_scale and found_inf to be None'."""
    from helpers import cfg, regression_task

    from stabletrain.replica import Replica

    task = regression_task()
    run_cfg = cfg("optim.name=sgd", "optim.weight_decay=0")
    from stabletrain.policies.optim import build_optimizer

    saved = build_optimizer(list(task.model.named_parameters()), run_cfg.optim, torch.device("cpu")).state_dict()
    for group in saved["param_groups"]:  # as FSDP2's foreach SGD saves them
        group.update(fused=False, foreach=True)
    state = {"model": task.model.state_dict(), "optimizer": saved}
    optimizer = Replica(run_cfg, task, state, "cpu").optimizer()
    assert all(g["fused"] and not g["foreach"] for g in optimizer.param_groups)
    for p in optimizer.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    optimizer.found_inf, optimizer.grad_scale = torch.zeros(()), None  # the skip flag PrecisionPolicy.step sets
    optimizer.step()


def test_a_window_whose_loss_counts_no_item_is_said_so_not_blamed_on_an_op(tmp_path):
    """A new-user trial: a (sum, count) token loss whose windows 1, 3, 5... mask every token (count 0): stabletrain's own
    normalization is 0/0, and the incident read 'op: aten.div.Tensor in forward outside any module', pointing at the
    stabletrain executable's line. The window holds nothing to learn from: said so, its samples named."""
    from helpers import cfg

    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 16, (32, 9), generator=g)
    mask = torch.tensor([[i % 4 >= 2] * 8 for i in range(32)])  # samples 0, 1, 4, 5, ...: no token counted

    def loss(model, batch):
        x, y, m = batch
        per = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="none")
        return (per * m.flatten()).sum(), m.sum()

    torch.manual_seed(0)
    task = Task(model=nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16)),
                train_data=torch.utils.data.TensorDataset(tokens[:, :-1], tokens[:, 1:], mask), loss=loss)
    Trainer(cfg("train.batch_size=1", "accum.steps=2", "data.shuffle=false", "train.max_steps=4", "log.every=2",
                "ckpt.every=0", "eval.every=0"), task=task, run_dir=tmp_path / "run").fit()
    d = json.loads((tmp_path / "run" / "incidents" / "step_000001" / "diagnosis.json").read_text())
    assert d["failure_class"] == "data" and d["empty_window"] and d["op"] is None and d["bad_samples"] == [0, 1], d
    assert d["summary"].startswith("empty window: the loss counts no item in any of its 2 micro-batches (count 0"), d


def test_the_empty_window_probe_leaves_the_models_buffers_and_the_rng_as_they_were():
    """A review: the probe's early return skipped putting the buffers back: a BatchNorm's statistics moved before the
    replay (the common case: a mean loss, whose count is never 0)."""
    from stabletrain.incident_replay import _no_items

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1)).train()
    before = {n: b.clone() for n, b in model.named_buffers()}
    batch = (torch.randn(8, 4), torch.randn(8, 1))
    rng = torch.get_rng_state()
    assert _no_items(model, lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), [(list(range(8)), batch)],
                     PrecisionPolicy("fp32", torch.device("cpu"))) is None
    assert all(torch.equal(b, before[n]) for n, b in model.named_buffers())
    assert torch.equal(torch.get_rng_state(), rng)  # (its dropout drew: put back)


def test_a_diagnosis_replaying_an_optimizer_that_cannot_skip_on_the_device_warns_of_it_no_more(tmp_path):
    """A new user's trial: `stabletrain diagnose` of a spike on a run with a non-fused AdamW printed 'AdamW cannot skip a
    step on the device; stabletrain reads the skip flag on the host ...' once per step it replayed (7 times): the run
    said it once; a replay's copy of the run is quiet about it."""
    from helpers import cfg
    from spike_tasks import outlier_samples_task

    from stabletrain.incident_replay import diagnose_incident

    task = outlier_samples_task()
    task.optimizer = lambda named: torch.optim.AdamW([p for _, p in named], lr=1e-2, foreach=True)
    with warnings.catch_warnings(record=True) as during:
        warnings.simplefilter("always")
        Trainer(cfg("train.batch_size=8", "train.max_steps=21", "log.every=10", "data.shuffle=false"), task=task,
                run_dir=tmp_path / "run").fit()
    assert sum("cannot skip a step on the device" in str(w.message) for w in during) == 1  # the run's own, once
    folder = next((tmp_path / "run").glob("incidents/step_*"))
    with warnings.catch_warnings(record=True) as replayed:
        warnings.simplefilter("always")
        d = diagnose_incident(folder, task)
    assert d["reproduces"] and d["failure_class"] == "data", d.get("summary")
    assert not [w for w in replayed if "cannot skip a step on the device" in str(w.message)]
