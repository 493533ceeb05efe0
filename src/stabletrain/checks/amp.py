"""``amp``: under autocast, which ops ran in low precision and which in fp32; the loss is fp32 and finite;
a model cast wholesale with ``.half()`` is flagged.

A loss that is not finite under autocast fails the check: the forward is run again under
:class:`~stabletrain.diagnostics.nonfinite.NonFiniteLocator` (a sync per op, on this failure only) to
name the op and module where the first non-finite value appears, and once in fp32 to tell an overflow
of the low precision's range from a model that is not finite in any precision.
"""

from __future__ import annotations

import math
from collections import Counter

import torch

from ..data import fixed_batch
from ..diagnostics.nonfinite import NonFiniteLocator
from ..internals import dispatch_mode_base
from ..policies.accumulation import as_sum_count
from ..policies.precision import PrecisionPolicy
from . import CheckContext, CheckResult, register

__all__ = ["OpDtypeRecorder", "check_amp", "first_nonfinite_forward", "overflow_inside"]

_LOW = (torch.float16, torch.bfloat16)
_MATMUL = ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_dot_product", "convolution", "conv")


class OpDtypeRecorder(dispatch_mode_base()):
    """Count each aten op by the dtype of its floating output: ``low`` (fp16/bf16) and ``fp32`` Counters.

    A dispatch mode: ``with policy.autocast(), OpDtypeRecorder() as rec: loss_fn(model, batch)``. Views,
    copies and casts are not counted (they follow their input's dtype).
    """

    def __init__(self) -> None:
        super().__init__()
        self.low: Counter[str] = Counter()
        self.fp32: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) and out else out
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            name = func.overloadpacket.__name__
            if name not in ("_to_copy", "clone", "detach", "view", "t", "transpose", "expand", "_unsafe_view"):
                (self.low if first.dtype in _LOW else self.fp32)[name] += 1
        return out


_DtypeRecorder = OpDtypeRecorder  # the old private name, kept for code that imported it


def _raw_dtype(task, model, batch, policy: PrecisionPolicy) -> torch.dtype:
    """The dtype of the loss exactly as the task returns it under autocast (before stabletrain's .float())."""
    with policy.autocast():
        out = task.loss(model, batch)
    return (out[0] if isinstance(out, (tuple, list)) else out).dtype


def first_nonfinite_forward(task, model, batch, policy: PrecisionPolicy) -> str:
    """Run the task's forward once under ``policy``'s autocast; return where its first non-finite value appears.

    One line: the op, its module, whether it made the value from finite inputs (an overflow) or was given
    one, and the dtype. A sync per op: call it on a failure only.
    """
    loc = _located(task, model, batch, policy)
    first = loc.first_origin or loc.first
    return "no op of the forward made one (the batch or a parameter holds it)" if first is None else first.describe()


def _located(task, model, batch, policy: PrecisionPolicy) -> NonFiniteLocator:
    """The locator after one forward under ``policy``'s autocast: its ``first`` non-finite op and ``first_origin`` (the
    first made from finite inputs; an intended ``-inf`` mask is none). A sync per op until it is found."""
    with torch.no_grad(), policy.autocast(), NonFiniteLocator(model, capture_stack=False, first_only=True) as loc:
        task.loss(model, batch)
    return loc


def overflow_inside(task, model, batch, policy: PrecisionPolicy) -> str | None:
    """Where a forward under ``policy``'s autocast makes a non-finite value the fp32 forward does not, though its loss is
    finite (the value was lost inside: a sum of squares past fp16's range, then a division by it); None: nowhere."""
    low = _located(task, model, batch, policy).first_origin
    if low is None:
        return None
    same = _located(task, model, batch, PrecisionPolicy("fp32", policy.device)).first_origin
    return None if same is not None and (same.op, same.module) == (low.op, low.module) else low.describe()


def _loss_value(loss_sum: torch.Tensor, count: torch.Tensor) -> float:
    return float((loss_sum.detach().float() / count).cpu())


@register("amp", order=30)
def check_amp(ctx: CheckContext) -> CheckResult:
    """Audit op dtypes under autocast, the loss dtype and the parameter dtypes."""
    task = ctx.make_task()
    device = ctx.device
    model = task.model.to(device).train()
    half_params = [n for n, p in model.named_parameters() if p.dtype in _LOW]
    # Audit the configured low precision, or on fp32 the one this device would use (bf16 on CPU).
    policy = PrecisionPolicy(ctx.cfg.precision, device)
    audited = policy.mode
    if not policy.autocast_enabled:
        audited = "bf16" if device.type == "cpu" or torch.cuda.is_bf16_supported() else "fp16"
        policy = PrecisionPolicy(audited, device)
    _, batch = fixed_batch(task, ctx.cfg.train.batch_size, device)
    recorder = OpDtypeRecorder()
    with policy.autocast(), recorder:
        low_sum_count = as_sum_count(task.loss(model, batch), ctx.cfg.train.batch_size)
    low_loss = _loss_value(*low_sum_count)
    finite = math.isfinite(low_loss)
    low_matmuls = sum(v for k, v in recorder.low.items() if any(m in k for m in _MATMUL))
    raw_dtype = _raw_dtype(task, model, batch, policy)
    loss_fp32 = raw_dtype == torch.float32
    inside = overflow_inside(task, model, batch, policy) if finite else None  # (a loss that hides it)
    passed = not half_params and loss_fp32 and low_matmuls > 0 and finite and inside is None
    details = [f"low precision ({audited}): " + ", ".join(f"{k} x{v}" for k, v in recorder.low.most_common(12)),
               "fp32: " + ", ".join(f"{k} x{v}" for k, v in recorder.fp32.most_common(12))]
    if half_params:
        details.append(f"{len(half_params)} parameter(s) are stored in half precision (e.g. {half_params[0]}): the model "
                       "was cast wholesale (.half()/.bfloat16()); keep fp32 weights and let autocast choose per op")
    if not loss_fp32:
        details.append(f"the task loss is {raw_dtype}: reduce it in fp32 (e.g. cross_entropy(logits.float(), y))")
    if not finite:
        with torch.no_grad():
            fp32_loss = _loss_value(*as_sum_count(task.loss(model, batch), ctx.cfg.train.batch_size))
        where = first_nonfinite_forward(task, model, batch, policy)
        if math.isfinite(fp32_loss):
            limit = torch.finfo(policy.dtype).max
            details.append(f"the loss is {low_loss} under {audited} autocast but {fp32_loss:.4g} in fp32: the forward "
                           f"exceeds {audited}'s range (max {limit:.6g}); first non-finite value: {where}; scale that "
                           f"module's weights or inputs down, run it in fp32, or use bf16 (fp32's range)")
        else:
            details.append(f"the loss is {low_loss} under {audited} autocast and {fp32_loss} in fp32 too: not the low "
                           f"precision; first non-finite value: {where}")
    if inside is not None:
        with torch.no_grad():
            fp32_loss = _loss_value(*as_sum_count(task.loss(model, batch), ctx.cfg.train.batch_size))
        details.append(f"the loss is finite under {audited} autocast ({low_loss:.4g}; {fp32_loss:.4g} in fp32), but a value "
                       f"inside the forward is not, and is not in fp32: {inside}; it leaves {audited}'s range (max "
                       f"{torch.finfo(policy.dtype).max:.6g}, or a value below its smallest, {torch.finfo(policy.dtype).tiny:.3g}"
                       ", flushed to 0 before a log or a division) and what follows hides it (the features it scales lost): "
                       "scale that op's inputs, run it in fp32, or use bf16 (fp32's range)")
    if low_matmuls == 0:
        details.append("no matmul/conv ran in low precision: autocast is not reaching the model's compute")
    summary = (("" if finite else f"the loss is not finite under {audited} autocast ({low_loss}); ") +
               (f"a value inside the forward is not finite under {audited} autocast (the loss is); " if inside else "") +
               f"autocast {audited} on {device.type}: {sum(recorder.low.values())} ops low precision "
               f"({low_matmuls} matmul/conv), {sum(recorder.fp32.values())} in fp32; loss {raw_dtype}; "
               f"{len(half_params)} half-precision parameters")
    return CheckResult("amp", passed, summary,
                       numbers={"audited": audited, "configured": ctx.cfg.precision,
                                "low_precision_ops": sum(recorder.low.values()),
                                "low_precision_matmuls": low_matmuls, "fp32_ops": sum(recorder.fp32.values()),
                                "loss_dtype": str(raw_dtype), "half_params": len(half_params), "loss": low_loss},
                       details=details)
