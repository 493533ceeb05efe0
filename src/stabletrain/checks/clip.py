"""``clip``: after clipping, the recomputed global norm is at most max_norm (plus float tolerance),
and a non-finite norm leaves the gradients untouched."""

from __future__ import annotations

import math

import torch

from ..data import fixed_batch
from ..numerics import grad_norms, unique_params
from ..policies.accumulation import as_sum_count
from ..policies.clipping import GradClipper
from . import CheckContext, CheckResult, cast_wholesale, register

REL_TOL = 1e-5


@register("clip", order=40)
def check_clip(ctx: CheckContext) -> CheckResult:
    """Clip real grads to a threshold below their norm and recompute the norm."""
    task = ctx.make_task()
    device = ctx.device
    model = task.model.to(device).train()
    params = [p for _, p in unique_params(model)]
    _, batch = fixed_batch(task, ctx.cfg.train.batch_size, device)
    loss_sum, count = as_sum_count(task.loss(model, batch), ctx.cfg.train.batch_size)
    (loss_sum / count).backward()
    norm, _ = grad_norms(params)
    pre = float(norm)
    # Clip at the configured threshold if it would fire, else at a tenth of the norm, so clipping acts.
    max_norm = ctx.cfg.clip.max_norm if (ctx.cfg.clip.max_norm and ctx.cfg.clip.max_norm < pre) else pre / 10
    clipper = GradClipper(max_norm)
    clipped = bool(clipper.clip_(params, norm, torch.isfinite(norm)))
    post = float(grad_norms(params)[0])
    bound = max_norm * (1 + REL_TOL) + 1e-6
    predicted = float(clipper.post_clip_norm(norm))
    # A non-finite norm must not be "clipped": the grads stay as they were.
    before = [p.grad.clone() for p in params if p.grad is not None]
    clipper.clip_(params, torch.tensor(math.inf, device=device), torch.tensor(False, device=device))
    untouched = all(torch.equal(a, p.grad) for a, p in zip(before, [p for p in params if p.grad is not None]))
    passed = clipped and post <= bound and untouched and abs(predicted - post) <= 1e-4 * max(post, 1e-12) + 1e-6
    summary = (f"pre-clip norm {pre:.4g} -> {post:.6g} after clipping at {max_norm:.4g} (bound {bound:.6g}); "
               f"non-finite norm {'left grads untouched' if untouched else 'CHANGED the grads'}")
    failed = [  # which test failed (a trial's FAIL gave none)
        "the clip did not act" if not clipped else f"the norm after clipping, {post:.6g}, is above the bound {bound:.6g}"
        if post > bound else f"the norm after clipping, {post:.6g}, is not the predicted {predicted:.6g}" if
        abs(predicted - post) > 1e-4 * max(post, 1e-12) + 1e-6 else "",
        "" if untouched else "clipping at a non-finite norm changed the gradients"]
    details = [d for d in (*failed, cast_wholesale(model) if not passed else None) if d]
    return CheckResult("clip", passed, summary, details=details,
                       numbers={"pre_clip_norm": pre, "max_norm": max_norm, "post_clip_norm": post,
                                "predicted_post_clip_norm": predicted, "rel_tol": REL_TOL})
