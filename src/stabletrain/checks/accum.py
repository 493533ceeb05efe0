"""``accum``: one step over k micro-batches (with a short tail) equals one step over the whole batch."""

from __future__ import annotations

import torch

from ..accumulation import AccumulationWindow, as_sum_count
from ..clipping import grad_norms
from ..numerics import unique_params
from . import CheckContext, CheckResult, fixed_batch, register

#: Equivalence tolerance in fp32: |g_accum - g_big| <= ATOL + RTOL * max|g_big| (summation order only).
RTOL = 1e-4
ATOL = 1e-7


def _grads(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


@register("accum", order=20)
def check_accum(ctx: CheckContext) -> CheckResult:
    """Compare the gradient of k accumulated micro-batches with that of one big batch (fp32, dropout off)."""
    task = ctx.make_task()
    device = ctx.device
    model = task.model.to(device).eval()  # dropout masks cannot match across batch shapes
    params = [p for _, p in unique_params(model)]
    b = ctx.cfg.train.batch_size
    k = ctx.cfg.accum.steps if ctx.cfg.accum.steps > 1 else 4
    sizes = [b] * (k - 1) + [max(1, b // 2)]  # a short tail micro-batch, as at the end of an epoch
    total = sum(sizes)
    if total > len(task.train_data):
        sizes = [max(1, len(task.train_data) // (k + 1))] * k
        total = sum(sizes)
    _, big = fixed_batch(task, total, device)
    micro = []
    start = 0
    for s in sizes:
        micro.append((s, fixed_batch(task, s, device, start=start)[1]))
        start += s

    def run(mode: str) -> torch.Tensor:
        for p in params:
            p.grad = None
        if mode == "big":
            loss_sum, count = as_sum_count(task.loss(model, big), total)
            (loss_sum / count).backward()
        elif mode == "accum":
            window = AccumulationWindow(params)
            for i, (n, batch) in enumerate(micro):
                loss_sum, count = as_sum_count(task.loss(model, batch), n)
                window.normalize(loss_sum, count, last=i == len(micro) - 1).backward()
        else:  # naive: the mean of micro-batch means, each divided by k
            for n, batch in micro:
                loss_sum, count = as_sum_count(task.loss(model, batch), n)
                (loss_sum / count / len(micro)).backward()
        return _grads(params)

    g_big, g_acc, g_naive = run("big"), run("accum"), run("naive")
    scale = float(g_big.abs().max())
    tol = ATOL + RTOL * scale
    diff = float((g_acc - g_big).abs().max())
    naive = float((g_naive - g_big).abs().max())
    passed = diff <= tol
    summary = (f"{k} micro-batches (sizes {sizes}) vs one batch of {total}: max |param diff| after an SGD step (lr=1) "
               f"{diff:.3g} <= tol {tol:.3g}" if passed else
               f"{k} micro-batches vs one batch of {total}: max |param diff| {diff:.3g} exceeds tol {tol:.3g}")
    details = [f"naive mean-of-means would differ by {naive:.3g} ({naive / max(tol, 1e-30):.3g}x the tolerance)"]
    if not passed:
        details.append("the loss may depend on the batch beyond per-sample terms (e.g. BatchNorm, in-batch negatives), "
                       "or the task's (sum, count) is inconsistent")
    return CheckResult("accum", passed, summary,
                       numbers={"k": k, "max_param_diff": diff, "tolerance": tol, "naive_max_param_diff": naive,
                                "grad_norm": float(grad_norms(params)[0])},
                       details=details)
