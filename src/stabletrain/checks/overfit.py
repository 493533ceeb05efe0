"""``overfit``: can the model memorize one tiny fixed batch, and does every parameter get a gradient?

"No gradient" is judged over every step the check runs: a parameter is named when its gradient is zero (or
None) at each of them. Behind a zero-initialized layer (a GPT/DiT/ReZero-style zero output layer or residual
branch end) the layers before it get no gradient at the first step and do from the second on, once the zero
weight has moved: they pass, and a detail line says from which step they got one.

A loss or gradients that are not finite are said so (with the op where the forward's first non-finite
value appears), not taken for missing gradients: a NaN gradient is a gradient, and no lr fixes a NaN loss.
"""

from __future__ import annotations

import math

import torch

from ..data import fixed_batch
from ..diagnostics.loss_at_init import uniform_classes, uninformed_loss
from ..numerics import unique_params
from ..policies.precision import PrecisionPolicy
from ..step import TrainStep
from . import CheckContext, CheckResult, cast_wholesale, register
from .amp import first_nonfinite_forward, overflow_inside

#: The loss must fall below initial / FACTOR within STEPS steps on one fixed batch.
FACTOR = 2.0
STEPS = 150
LR = 3e-3
#: Stop after this many non-finite losses in a row: every one of those steps was skipped, nothing changes.
NONFINITE_STOP = 5


def _uniform_guess(probe: tuple[float, float, int] | None) -> tuple[float, int] | None:
    """(the loss, C) where an uninformed output's loss (``probe``: :func:`~.init.uninformed_loss`) is a uniform guess's
    over C classes, ln C (or ln 2: a binary or multi-label one on logits); else None (a regression: no such bar)."""
    if probe is None:
        return None
    zero, _, classes = probe
    found = uniform_classes(zero, classes)
    return (zero, found) if found is not None else None


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

    zero_at_init = [n for n, p in named if not n.endswith("bias") and not bool(p.detach().ne(0).any())]  # weights
    first_grad: dict[str, int] = {}  # parameter -> the first step (0-based) at which its gradient was nonzero

    def note_gradients(at: int) -> None:
        pending = [(n, p) for n, p in named if n not in first_grad]
        if not pending:
            return
        # NaN != 0: a (bad) gradient. One host sync for all the parameters still without one.
        got = torch.stack([p.grad.ne(0).any() if p.grad is not None else torch.zeros((), dtype=torch.bool, device=p.device)
                           for _, p in pending]).tolist()
        first_grad.update({n: at for (n, _), g in zip(pending, got) if g})

    # (before the first step: the loss at init's; under the run's autocast, as the step's own forward)
    chance = _uniform_guess(uninformed_loss(model, batch, task.loss, precision.autocast()))
    step.forward_backward(micro, task.loss)
    note_gradients(0)
    if float(step.window.global_count) == 0:  # (sum, 0): the mean is 0/0 whatever the weights: no op, no gradient to judge
        return CheckResult("overfit", False, f"the fixed batch (dataset indices {indices[0]}-{indices[-1]}) holds no item "
                           "its loss counts (count 0: e.g. every token masked out): its mean loss is 0/0, NaN whatever the "
                           "weights, so there is nothing to overfit (do some samples hold no item? a run skips such a window)",
                           numbers={"initial_loss": float("nan"), "num_items": 0, "steps": 0})
    nonfinite_grad = [n for n, p in named if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
    initial = float(step.window.mean_loss)
    # Halving a loss that starts far above a uniform guess's proves nothing memorized (2.3e5 -> 1.0e5 'passed' where ln 4
    # is 1.39): the target is below the guess's too, where the loss is a cross-entropy on logits.
    by_chance = chance is not None and chance[0] < initial / FACTOR  # (False for a non-finite first loss)
    target = chance[0] if chance is not None and by_chance else initial / FACTOR
    losses = [initial]
    skipped = int(not bool(step.update()["applied"]))  # a non-finite loss or gradient: the step is skipped
    for _ in range(STEPS):
        out = step(micro, task.loss)  # the loss of this step's forward: the parameters after the previous update
        losses.append(float(out["loss"]))
        note_gradients(len(losses) - 1)
        skipped += not bool(out["applied"])
        if losses[-1] <= target or (len(losses) >= NONFINITE_STOP
                                    and not any(math.isfinite(v) for v in losses[-NONFINITE_STOP:])):
            break
    no_grad = [n for n, _ in named if n not in first_grad]
    late = [n for n, _ in named if first_grad.get(n, 0) > 0]
    fell = losses[-1] <= target
    nonfinite = [i for i, v in enumerate(losses) if not math.isfinite(v)]
    passed = fell and not no_grad
    steps = len(losses) - 1  # updates applied before the loss that reached the target
    bar = (f"{target:.4g} within {STEPS}: a uniform guess's ln {chance[1]}, below initial/{FACTOR:g}" if chance and by_chance
           else f"initial/{FACTOR:g} within {STEPS}")
    summary = (f"loss {initial:.4g} -> {losses[-1]:.4g} in {steps} steps (target < {bar})"
               + ("" if not no_grad else f"; {len(no_grad)} parameter(s) got no gradient in any of the {len(losses)} steps")
               + ("" if not nonfinite else f"; the loss is not finite at {len(nonfinite)} of {len(losses)} steps"))
    details = [f"no gradient: {name}" for name in no_grad]
    # (a value past the low precision's range lost inside the forward: its features, and their gradients, are 0)
    inside = overflow_inside(task, model, batch, precision) if not passed and not nonfinite and precision.mode != "fp32" else None
    if inside is not None:
        details.append(f"under {precision.mode} autocast a value inside the forward is not finite (in fp32 it is; the loss "
                       f"stays finite): {inside}; what follows it is lost (zero features, zero gradients), not a detached "
                       f"graph: see `stabletrain check amp precision={precision.mode}`, or use bf16")
    if late:
        shown = ", ".join(f"{n} (step {first_grad[n]})" for n in late[:6]) + (f" and {len(late) - 6} more" if len(late) > 6
                                                                              else "")
        zeros = ", ".join(zero_at_init[:4]) + (" ..." if len(zero_at_init) > 4 else "")
        details.append(f"{len(late)} parameter(s) got no gradient at the first step and got one later: {shown}"
                       + (f"; zero at init: {zeros} (a zero-initialized layer passes no gradient to the layers "
                          "before it until its weight moves)" if zero_at_init else ""))
    if nonfinite:
        where = first_nonfinite_forward(task, model, batch, precision) if nonfinite[0] == 0 else ""
        details.append(f"the loss is {losses[nonfinite[0]]} from step {nonfinite[0]} on (precision={precision.mode}): "
                       "non-finite values, not a missing gradient; those steps were skipped"
                       + (f"; first non-finite value in the forward: {where}" if where else "")
                       + ("; under fp16 see `stabletrain check amp precision=fp16`, or use bf16" if
                          precision.mode == "fp16" else "")
                       + "".join(f"; {cast}" for cast in filter(None, [cast_wholesale(model)])))
    elif skipped and not fell:  # (fp16: the scaled gradients of the first step may overflow by design)
        first = f" ({len(nonfinite_grad)} parameter(s) at the first step, e.g. {nonfinite_grad[0]})" if nonfinite_grad else ""
        details.append(f"{skipped} of {len(losses)} steps were skipped: their gradients were not finite{first} while the "
                       "loss was: the backward overflows or divides by zero")
    elif not fell and losses[-1] <= initial / FACTOR:  # halved, yet still above a uniform guess's
        details.append(f"the loss fell x{initial / losses[-1]:.3g} but stays {losses[-1] / target:.3g}x a uniform guess's "
                       f"{target:.4g} (the model's output set to 0): the model starts far off, confidently wrong; see "
                       "`stabletrain check init`")
    elif not fell and inside is None:
        details.append("the loss did not fall enough on one fixed batch: look for a detached graph, a frozen model, "
                       "a wrong loss/target pairing, or an lr far off")
    return CheckResult("overfit", passed, summary,
                       numbers={"initial_loss": initial, "final_loss": losses[-1], "steps": steps, "factor": FACTOR,
                                "target": target, "uniform_guess": chance[0] if chance is not None else None,
                                "num_params_without_grad": len(no_grad), "num_params_with_late_grad": len(late),
                                "num_nonfinite_losses": len(nonfinite),
                                "num_skipped_steps": skipped},
                       details=details)
