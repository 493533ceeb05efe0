"""The first-non-finite locator, batch bisection, anomaly trace, and the ``nan`` doctor check."""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import NamedTuple

import faults
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stabletrain.checks import CheckContext
from stabletrain.checks.nan import check_nan
from stabletrain.config import load_config
from stabletrain.diagnostics.anomaly import anomaly_trace
from stabletrain.diagnostics.bisection import bisect_samples
from stabletrain.diagnostics.nonfinite import NonFiniteLocator


def locate(model: nn.Module, x: Tensor, **kw) -> NonFiniteLocator:
    with NonFiniteLocator(model, **kw) as loc:
        faults.regression_loss(model, x).backward()
    return loc


# -- planted faults: exact op, direction, module, origin ---------------------------------------------


@pytest.mark.parametrize("build, op, direction, module, kind, dtype, node", [
    (faults.log_of_zero, "aten.log.default", "forward", "layers.2", "inf", "float32", None),
    (faults.sqrt_at_zero, "aten.div.Tensor", "backward", "layers.1", "nan", "float32", "SqrtBackward0"),
    (faults.zero_std, "aten.div.Tensor", "forward", "layers.1", "nan", "float32", None),
    (faults.fp16_overflow, "aten.addmm.default", "forward", "layers.1.fc", "inf", "float16", None),
], ids=["log-of-zero", "sqrt-at-zero", "zero-std", "fp16-overflow"])
def test_planted_fault_is_located_exactly(build, op, direction, module, kind, dtype, node):
    model, x = build()
    loc = locate(model, x)
    first = loc.first
    assert (first.op, first.direction, first.module, first.origin) == (op, direction, module, True)
    assert (first.kind, first.output_dtypes, first.autograd_node) == (kind, [dtype], node)
    assert loc.first_origin is first
    assert module in dict(model.named_modules())


def test_a_forward_inf_masked_by_where_is_followed_into_backward():
    # where(x > 2, log2(x), 2x) at x = 0: log2's -inf is the origin, but where drops it, so the module's
    # output is finite; the NaN appears only in backward, where Log2Backward0 computes 0 / (0 ln 2).
    model, x = faults.masked_log2()
    loc = locate(model, x)
    first = loc.first
    assert (first.op, first.direction, first.module, first.kind, first.num_nonfinite) == (
        "aten.log2.default", "forward", "layers.1", "inf", 8)
    assert first.masked_in_forward is True
    back = first.backward_op
    assert (back.op, back.direction, back.autograd_node, back.origin, back.kind, back.num_nonfinite) == (
        "aten.div.Tensor", "backward", "Log2Backward0", True, "nan", 8)
    assert first.describe().endswith("; made finite again before the module's output in forward (masked, clamped or "
                                     "saturated), non-finite again in backward at aten.div.Tensor (Log2Backward0)")
    assert first.to_dict()["backward_op"]["autograd_node"] == "Log2Backward0"
    # An unmasked -inf (log of a ReLU's zeros) reaches the module's output: nothing is followed into backward.
    model, x = faults.log_of_zero()
    first = locate(model, x).first
    assert (first.op, first.masked_in_forward, first.backward_op) == ("aten.log.default", False, None)
    # A bad value made outside any module: no module output to check.
    model = nn.Linear(8, 4)
    with NonFiniteLocator(model) as loc:
        (model(x) * torch.log2(torch.zeros(()))).sum()
    assert loc.first.op == "aten.log2.default" and loc.first.module is None and loc.first.masked_in_forward is None


def test_sqrt_at_zero_is_finite_in_forward():
    model, x = faults.sqrt_at_zero()
    with NonFiniteLocator(model) as loc:
        loss = faults.regression_loss(model, x)
    assert loc.first is None and torch.isfinite(loss)


def test_fp16_overflow_under_autocast_on_cpu():
    torch.manual_seed(0)
    model = faults.Stack(nn.Linear(8, 16), nn.Linear(16, 16))
    with torch.no_grad():
        model.layers[1].weight.mul_(1e5)
    with torch.autocast("cpu", dtype=torch.float16), NonFiniteLocator(model) as loc:
        model(torch.randn(4, 8)).float().sum().backward()
    first = loc.first
    assert (first.op, first.direction, first.module, first.origin) == ("aten.addmm.default", "forward", "layers.1", True)
    assert first.input_dtypes == ["float16"] * 3 and first.output_dtypes == ["float16"] and first.output_shapes == [[4, 16]]


def test_bf16_autocast_locates_log_of_zero():
    model, x = faults.log_of_zero()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loc = locate(model, x)
    assert (loc.first.op, loc.first.module, loc.first.origin) == ("aten.log.default", "layers.2", True)
    assert loc.first.input_dtypes == ["bfloat16"]


def test_nan_weight_is_propagation_in_its_module():
    model, x = faults.log_of_zero()
    with torch.no_grad():
        model.layers[0].weight[3, 1] = float("nan")
    loc = locate(model, x)
    assert (loc.first.op, loc.first.module, loc.first.direction) == ("aten.addmm.default", "layers.0", "forward")
    assert loc.first.origin is False and loc.first.nonfinite_inputs == [2]  # (bias, input, weight.t())
    assert loc.first_origin is None  # the NaN reaches log first and masks its -inf: nothing new is created


def test_nan_input_then_a_later_origin():
    class DropNaN(nn.Module):
        def forward(self, x):
            return torch.nan_to_num(x, nan=0.0)

    model, x = faults.log_of_zero()
    model.layers.insert(1, DropNaN())  # the log is now layers.3
    x[0, 0] = float("nan")
    loc = locate(model, x)
    assert (loc.first.op, loc.first.module, loc.first.origin) == ("aten.addmm.default", "layers.0", False)
    assert (loc.first_origin.op, loc.first_origin.module, loc.first_origin.origin) == ("aten.log.default", "layers.3", True)


def test_loss_outside_the_model_has_no_module():
    model = faults.Stack(nn.Linear(4, 3))
    with NonFiniteLocator(model) as loc:
        (model(torch.randn(2, 4)).softmax(-1) * 0).log().sum().backward()
    assert (loc.first.op, loc.first.module, loc.first.direction) == ("aten.log.default", None, "forward")


class SqrtAtZero(nn.Module):
    def forward(self, h: Tensor) -> Tensor:
        return torch.sqrt(h * 0)  # finite forward, an inf gradient


class ProbeThenBody(nn.Module):
    """A sqrt at 0 beside a trunk whose first layer reads the data: that layer's inputs need no gradient, so torch's
    ModuleTracker never sees its backward end (it named 'trunk.0' for the sqrt's backward at the root or in a
    child)."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.probe = nn.Sequential(nn.Linear(4, 4), *([SqrtAtZero()] if where == "module" else []))
        self.trunk = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.probe(x)
        h = torch.sqrt(h * 0) if self.where == "root" else h  # before the trunk: its backward runs after the trunk's
        return self.trunk(x) + h.sum() * (0 if self.where == "loss" else 1)


@pytest.mark.parametrize("where", ["root", "module", "loss"])
def test_a_backward_op_is_named_by_the_module_whose_forward_made_it(where):
    torch.manual_seed(0)
    model, x = ProbeThenBody(where), torch.randn(3, 4)
    with torch.autograd.detect_anomaly(check_nan=False), NonFiniteLocator(model) as loc:
        out = model(x)
        (out.sum() + (torch.sqrt(model.probe(x) * 0).sum() if where == "loss" else 0)).backward()
    origin = loc.first_origin
    assert (origin.op, origin.direction, origin.autograd_node) == ("aten.div.Tensor", "backward", "SqrtBackward0")
    assert origin.module == {"root": "", "module": "probe.1", "loss": None}[where]


class MaskedAttention(nn.Module):
    """Attention with the usual -inf masks: a buffer, masked_fill, where and full."""

    def __init__(self, t: int = 5, fully_masked_row: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.register_buffer("mask", torch.full((t, t), float("-inf")).triu(1))
        self.fully_masked_row = fully_masked_row

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        s = self.q(x) @ x.transpose(-1, -2)
        causal = torch.ones(t, t, dtype=torch.bool).triu(1)
        if self.fully_masked_row:
            causal[0, 0] = True  # row 0 masks every key: softmax of all -inf is NaN
        a = s.masked_fill(causal, float("-inf")).softmax(-1)
        b = (s + self.mask[:t, :t]).softmax(-1)
        c = torch.where(causal, float("-inf"), s).softmax(-1)
        d = (s + torch.full((t, t), float("-inf")).triu(1)).softmax(-1)
        return (a + b + c + d) @ x


def test_intended_inf_masks_are_not_faults():
    model = MaskedAttention()
    x = torch.randn(2, 5, 8, requires_grad=True)
    with NonFiniteLocator(model) as loc:
        model(x).sum().backward()
    assert loc.first is None and loc.num_ops > 20
    with NonFiniteLocator(model, tolerate_masks=False) as strict:
        model(x).sum().backward()
    assert strict.first is not None  # the masks themselves, when asked to be strict


def test_fully_masked_row_is_an_origin():
    model = MaskedAttention(fully_masked_row=True)
    with NonFiniteLocator(model) as loc:
        model(torch.randn(2, 5, 8)).sum().backward()
    assert (loc.first.op, loc.first.module, loc.first.origin, loc.first.kind) == ("aten._softmax.default", "", True, "nan")


def test_uninitialized_memory_is_not_a_fault():
    """Dropout fills torch.empty_like memory with its mask: the garbage it starts with may hold NaN bits."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Dropout(0.5), nn.Linear(64, 1))
    for _ in range(10):
        _ = torch.full((32, 64), float("nan"))  # freed at once: the next empty_like may get its memory
        del _
        loc = locate(model, torch.randn(32, 8))
        assert loc.first is None


def test_python_nan_constant_is_the_origin():
    class Writes(nn.Module):
        def forward(self, x):
            x = x.clone()
            x[0, 0] = float("nan")
            return x

    model = faults.Stack(nn.Linear(4, 4), Writes())
    loc = locate(model, torch.randn(2, 4))
    assert (loc.first.op, loc.first.module, loc.first.origin) == ("aten.lift_fresh.default", "layers.1", True)


def test_forward_stack_points_at_the_line():
    model, x = faults.log_of_zero()
    loc = locate(model, x)
    assert "return torch.log(F.relu(x))" in loc.first.stack
    assert "torch/nn/modules" not in loc.first.stack.replace("\\", "/")  # torch's own frames are left out


def test_locator_stops_after_the_origin_and_cleans_up():
    model, x = faults.log_of_zero()
    loc = locate(model, x)
    seen = loc.num_ops
    with loc:  # re-entering keeps the record and checks nothing more
        faults.regression_loss(model, x).backward()
    assert loc.num_ops == seen
    from torch.utils._python_dispatch import _get_current_dispatch_mode
    assert _get_current_dispatch_mode() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.complex64])
def test_the_cheap_finiteness_read_is_exact(dtype):
    from stabletrain.diagnostics.nonfinite import _all_finite

    big = torch.finfo(dtype if not dtype.is_complex else torch.float32).max
    overflows = torch.full((64,), big, dtype=dtype)  # every value finite, the sum is not: read exactly, still finite
    assert not torch.isfinite(overflows.sum()) and _all_finite([overflows]) == [True]
    assert _all_finite([torch.empty(0, dtype=dtype), torch.ones(3, 5, dtype=dtype)[:, ::2]]) == [True, True]
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in (0, 37, 4095):
            t = torch.randn(4096).to(dtype)
            t[pos] = bad
            assert _all_finite([torch.ones(2, dtype=dtype), t, overflows]) == [True, False, True], (bad, pos)
    inf_and_minus_inf = torch.tensor([float("inf"), float("-inf")]).to(dtype)  # a sum of NaN, min/max infinite
    assert _all_finite([inf_and_minus_inf]) == [False]


def test_a_non_finite_tensor_overwritten_in_place_is_read_again():
    # After the first (propagated) NaN the locator remembers which tensors it read as non-finite, so an op taking
    # one is known not to be an origin without reading it again. An in-place write (here through a view) changes
    # the tensor: the log of the zeros it now holds is the origin, not a propagation of the old NaN.
    x = torch.randn(4, 8)
    x[1, 2] = float("nan")
    with NonFiniteLocator() as loc:
        y = x * 2.0
        y[:, :] = 0.0
        torch.log(y)
    assert (loc.first.op, loc.first.origin) == ("aten.mul.Tensor", False)
    assert (loc.first_origin.op, loc.first_origin.origin, loc.first_origin.nonfinite_inputs) == ("aten.log.default", True, [])


def test_first_only_stops_at_the_first_op_but_still_follows_a_masked_origin():
    class DropNaN(nn.Module):
        def forward(self, x):
            return torch.nan_to_num(x, nan=0.0)

    model = faults.Stack(nn.Linear(8, 8), DropNaN(), faults.LogFeatures())
    x = torch.randn(8, 8)
    x[0, 0] = float("nan")  # a propagated NaN first, then an origin (log of zero) after it is dropped
    full, first = locate(model, x), locate(model, x, first_only=True)
    assert full.first.op == first.first.op == "aten.addmm.default" and not first.first.origin
    assert full.first_origin.op == "aten.log.default" and first.first_origin is None
    assert first.num_ops < full.num_ops
    masked_full, masked_first = locate(*faults.masked_log2()), locate(*faults.masked_log2(), first_only=True)
    for loc in (masked_full, masked_first):  # the first op is the origin: followed into backward either way
        assert ((loc.first.op, loc.first.masked_in_forward, loc.first.backward_op.op)
                == ("aten.log2.default", True, "aten.div.Tensor"))


# -- bisection ---------------------------------------------------------------------------------------


def test_bisect_single_bad_sample():
    calls = []

    def is_bad(subset):
        calls.append(subset)
        return 17 in subset

    result = bisect_samples(is_bad, list(range(10, 42)))
    assert result.samples == [17] and result.combinations == [] and result.whole_bad
    assert result.num_evals == len(calls) <= 1 + 2 * 5


def test_bisect_several_bad_samples():
    result = bisect_samples(lambda s: bool({3, 29, 30} & set(s)), list(range(32)))
    assert result.samples == [3, 29, 30] and result.combinations == []


def test_bisect_only_bad_in_combination_says_so():
    result = bisect_samples(lambda s: {4, 11} <= set(s), list(range(16)))
    assert result.samples == [] and result.combinations == [[4, 11]]
    assert "no single sample is bad" in result.summary()


def test_bisect_does_not_ask_again_what_the_caller_knows():
    calls = []

    def is_bad(subset):
        calls.append(subset)
        return 7 in subset

    known = bisect_samples(is_bad, list(range(16)), whole_bad=True)
    assert known.samples == [7] and list(range(16)) not in calls and known.num_evals == len(calls) == 2 * 4
    calls.clear()
    clean = bisect_samples(is_bad, list(range(20, 36)), whole_bad=False)
    assert not clean.whole_bad and clean.samples == [] and calls == []


def test_bisect_nothing_bad_and_eval_budget():
    result = bisect_samples(lambda s: False, list(range(8)))
    assert not result.whole_bad and result.samples == [] and result.num_evals == 1
    capped = bisect_samples(lambda s: True, list(range(64)), max_evals=5)
    assert capped.exhausted and capped.num_evals == 5


# -- anomaly trace -------------------------------------------------------------------------------------


def test_anomaly_trace_names_the_forward_line_of_a_backward_fault():
    model, x = faults.sqrt_at_zero()
    text = anomaly_trace(lambda: faults.regression_loss(model, x).backward(), model)
    assert "aten.div.Tensor in backward (SqrtBackward0) of module 'layers.1'" in text
    assert "x.pow(2).sum(-1, keepdim=True).sqrt()" in text  # the forward line, from anomaly mode
    assert "Function 'SqrtBackward0' returned nan values" in text
    assert "torch/nn/modules/module.py" not in text


def test_anomaly_trace_reuses_a_forward_first_op_already_located_and_locates_a_backward_one_itself():
    model, x = faults.log_of_zero()
    run = lambda: faults.regression_loss(model, x).backward()  # noqa: E731
    own = anomaly_trace(run, model)
    first = locate(model, x).first  # forward, with its stack (from this test's frames, not the anomaly pass's)
    reused = anomaly_trace(run, model, located=first)
    head, anomaly = reused.split("\nanomaly mode: ")
    assert head == f"first non-finite op: {first.describe()}\nstack:\n{first.stack}"
    own_anomaly = own.split("\nanomaly mode: ")[1]
    assert (anomaly.splitlines()[0] == own_anomaly.splitlines()[0]
            == "Function 'PowBackward0' returned nan values in its 0th output.")
    assert "return model(batch).float().pow(2).mean()" in anomaly  # the forward call of the function anomaly mode names
    model, x = faults.sqrt_at_zero()
    backward_first = locate(model, x).first  # backward: no forward stack outside anomaly mode
    assert backward_first.direction == "backward" and backward_first.stack is None
    text = anomaly_trace(lambda: faults.regression_loss(model, x).backward(), model, located=backward_first)
    assert "x.pow(2).sum(-1, keepdim=True).sqrt()" in text.split("\nanomaly mode: ")[0]


def test_anomaly_trace_is_none_when_finite():
    model = nn.Linear(3, 2)
    assert anomaly_trace(lambda: model(torch.randn(2, 3)).sum().backward(), model) is None


# -- the nan doctor check ----------------------------------------------------------------------------


@pytest.mark.parametrize("task, args, planted", [
    ("mlp", {"num_samples": 256}, "2"),
    ("gpt", {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32, "max_bytes": 200000}, "blocks.1.attn.qkv"),
])
def test_nan_check_finds_the_planted_module(task, args, planted):
    cfg = load_config(None, [f"task={task}", "device=cpu", "precision=fp32", "train.batch_size=4"])
    cfg.task_args = args
    result = check_nan(CheckContext(cfg))
    assert result.passed, result.summary
    assert result.numbers["planted_module"] == result.numbers["found_module"] == planted
    assert (result.numbers["op"], result.numbers["direction"], result.numbers["origin"]) == ("aten.fill_.Scalar", "forward", True)
    assert result.numbers["nonfinite_grads"] > 0  # (counted: which is 'first' was the parameters' registration order)


def test_nan_check_fails_on_a_model_that_is_already_broken():
    def factory():
        from torch.utils.data import TensorDataset

        from stabletrain import Task

        model, _ = faults.log_of_zero()
        data = TensorDataset(torch.randn(16, 8), torch.zeros(16, 4))
        return Task(model=model, train_data=data, loss=lambda m, b: F.mse_loss(m(b[0]), b[1]))

    cfg = load_config(None, ["device=cpu", "precision=fp32", "train.batch_size=4"])
    result = check_nan(CheckContext(cfg, task_factory=factory))
    assert not result.passed and "not finite before planting" in result.summary
    assert result.numbers == {"op": "aten.log.default", "module": "layers.2"}

    class LogAtRoot(torch.nn.Module):  # the op in the root module's own forward: its name is "", shown as 'module='
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(8, 4)

        def forward(self, x):
            return torch.log(self.lin(x) * 0)

    def at_root():
        from torch.utils.data import TensorDataset

        from stabletrain import Task

        return Task(model=LogAtRoot(), train_data=TensorDataset(torch.randn(16, 8), torch.zeros(16, 4)),
                    loss=lambda m, b: F.mse_loss(m(b[0]), b[1]))

    result = check_nan(CheckContext(cfg, task_factory=at_root))
    assert not result.passed and result.numbers == {"op": "aten.log.default", "module": "(the root module)"}

    def in_the_loss():  # the op in the loss, outside any module: not the root module's (a review)
        task = at_root()
        task.model, task.loss = torch.nn.Linear(8, 4), lambda m, b: torch.log(F.mse_loss(m(b[0]), b[1]) * 0)
        return task

    result = check_nan(CheckContext(cfg, task_factory=in_the_loss))
    assert not result.passed and result.numbers == {"op": "aten.log.default", "module": "(outside any module)"}


class Pair(NamedTuple):
    logits: Tensor
    extra: object


@dataclass
class Record:
    logits: Tensor


class Slots:
    __slots__ = ("logits",)

    def __init__(self, logits: Tensor) -> None:
        self.logits = logits


WRAPS = {"namespace": lambda t: types.SimpleNamespace(logits=t, note="x"), "dataclass": Record,
         "namedtuple": lambda t: Pair(t, None), "nested": lambda t: {"out": [types.SimpleNamespace(logits=t)]}}


class RootOrigin(nn.Module):
    """The origin in the root module's own forward, its output wrapped: log of a ReLU's zeros (the -inf reaches the
    output) or ``where(h > 2, log2(h), 2h)`` at a zero row (masked out of it, NaN in Log2Backward0)."""

    def __init__(self, wrap, masked: bool) -> None:
        super().__init__()
        self.fc, self.wrap, self.masked = nn.Linear(8, 8, bias=False), wrap, masked
        with torch.no_grad():
            self.fc.weight.copy_(torch.eye(8))

    def forward(self, x: Tensor):
        h = self.fc(x)
        return self.wrap(torch.where(h > 2, torch.log2(h), 2 * h) if self.masked else torch.log(F.relu(h)))


@pytest.mark.parametrize("wrap", [*WRAPS, "slots"])
@pytest.mark.parametrize("masked", [False, True], ids=["reaches", "masked"])
def test_masked_in_forward_reads_the_tensors_inside_the_root_modules_output_object(wrap, masked):
    """A SimpleNamespace, a dataclass, a named tuple, a list in a dict: read like a tensor output. An object whose
    tensors cannot be read (slots, no ``__dict__``) leaves it unknown (None): never "masked" on no evidence."""
    model = RootOrigin(WRAPS.get(wrap, Slots), masked)
    x = torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) * 4
    x[5] = 0.0
    with NonFiniteLocator(model) as loc:
        out = model(x)
        (out.logits if hasattr(out, "logits") else out["out"][0].logits).pow(2).mean().backward()
    origin = loc.first_origin
    assert (origin.op, origin.module) == ("aten.log2.default" if masked else "aten.log.default", "")
    assert origin.masked_in_forward is (None if wrap == "slots" else masked)
    assert (origin.backward_op.autograd_node if origin.backward_op else None) == (
        "Log2Backward0" if masked and wrap != "slots" else None)


def test_the_first_origin_records_its_inputs_range_also_for_an_in_place_op():
    """A review: an in-place log_ overwrote its input before the range was read ([-0.5, 2, 3] recorded as [0.69, 1.10]),
    so a negative data value read as in the log's domain and the eps guard was offered for it."""
    from stabletrain.diagnostics.nonfinite import NonFiniteLocator

    class Log(torch.nn.Module):
        def __init__(self, in_place: bool) -> None:
            super().__init__()
            self.in_place = in_place

        def forward(self, x):
            return x.clone().log_() if self.in_place else torch.log(x)

    for in_place in (False, True):
        model = Log(in_place)
        with NonFiniteLocator(model) as loc:
            model(torch.tensor([-0.5, 2.0, 3.0]))
        assert loc.first_origin is not None and loc.first_origin.input_range == [-0.5, 3.0], (in_place, loc.first_origin)
