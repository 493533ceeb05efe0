"""``overfit``: can the model memorize one tiny fixed batch, and does every parameter get a gradient?"""

from __future__ import annotations

import torch

from ..data import fixed_batch
from ..numerics import unique_params
from ..policies.precision import PrecisionPolicy
from ..step import TrainStep
from . import CheckContext, CheckResult, register

#: The loss must fall below initial / FACTOR within STEPS steps on one fixed batch.
FACTOR = 2.0
STEPS = 150
LR = 3e-3


@register("overfit", order=10)
def check_overfit(ctx: CheckContext) -> CheckResult:
    """Overfit one tiny fixed batch; name every trainable parameter that got no gradient."""
    task = ctx.make_task()
    device = ctx.device
    model = task.model.to(device).train()
    named = unique_params(model)
    precision = PrecisionPolicy(ctx.cfg.precision, device)
    indices, batch = fixed_batch(task, min(ctx.cfg.train.batch_size, 8), device)
    optimizer = torch.optim.AdamW([p for _, p in named], lr=LR, weight_decay=0.0, fused=device.type in ("cuda", "cpu"))
    step = TrainStep(model, optimizer, precision, params=[p for _, p in named])  # the run's step, no clipping
    micro = [(len(indices), batch)]

    step.forward_backward(micro, task.loss)
    no_grad = [n for n, p in named if p.grad is None or not bool(p.grad.abs().sum() > 0)]
    initial = float(step.window.mean_loss)
    target = initial / FACTOR
    losses = [initial]
    step.update()
    for _ in range(STEPS):
        out = step(micro, task.loss)  # the loss of this step's forward: the parameters after the previous update
        losses.append(float(out["loss"]))
        if losses[-1] <= target:
            break
    fell = losses[-1] <= target
    passed = fell and not no_grad
    steps = len(losses) - 1  # updates applied before the loss that reached the target
    summary = (f"loss {initial:.4g} -> {losses[-1]:.4g} in {steps} steps (target < initial/{FACTOR:g} within {STEPS})"
               + ("" if not no_grad else f"; {len(no_grad)} parameter(s) got no gradient"))
    details = [f"no gradient: {name}" for name in no_grad]
    if not fell:
        details.append("the loss did not fall enough on one fixed batch: look for a detached graph, a frozen model, "
                       "a wrong loss/target pairing, or an lr far off")
    return CheckResult("overfit", passed, summary,
                       numbers={"initial_loss": initial, "final_loss": losses[-1], "steps": steps, "factor": FACTOR,
                                "num_params_without_grad": len(no_grad)},
                       details=details)
