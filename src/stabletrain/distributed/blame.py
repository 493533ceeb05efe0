"""Which rank a bad step came from, where the step's own figures mixed the ranks' (a collective's sum or mean).

:func:`own_gradients_bad` (DDP: this rank's own backward, outside DDP's hooks) and :func:`own_outputs_bad` (FSDP:
what this rank's micro-batches make, read by hooks, in a forward and backward every rank runs) answer for a step
whose loss was finite on every rank but whose global grad norm was not; :func:`own_loss_rank` names the rank that
carried a finite loss spike the step's loss averaged over the ranks. Each runs at the step's RNG state and puts it
back; the caller gathers the answers (one collective).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..data import move_to
from ..numerics import first_nonfinite_grad
from ..policies.accumulation import as_sum_count
from ..records.staging import tensors_in
from ..seeding import kept_rng, set_rng_state

__all__ = ["own_gradients_bad", "own_outputs_bad", "answered_ranks", "own_loss_rank", "largest_loss_rank"]


def own_gradients_bad(module: nn.Module, task: Any, precision: Any, window: Any, device: torch.device) -> bool:
    """Whether this rank's own micro-batches make a non-finite loss or gradient: each backpropagated through the
    unwrapped module (DDP's hooks stay idle outside its forward: no all-reduce) under ``precision``'s autocast, at the
    step's RNG state; the gradients are dropped and the RNG put back. One host read."""
    params = [p for p in module.parameters() if p.requires_grad]
    bad = False
    with kept_rng():
        try:
            with precision.autocast():
                for indices, batch in zip(window.indices, window.batches):
                    loss_sum, _ = as_sum_count(task.loss(module, move_to(batch, device)), len(indices))
                    if not bool(torch.isfinite(loss_sum)):
                        bad = True
                        break
                    loss_sum.backward()
            bad = bad or first_nonfinite_grad(module) is not None  # one host read
        finally:
            for p in params:
                p.grad = None
    return bad


def own_outputs_bad(module: nn.Module, task: Any, precision: Any, window: Any, device: torch.device) -> bool:
    """:func:`own_gradients_bad` where no rank's parameter gradients are its own (FSDP: reduce-scattered as they are
    made): what this rank's micro-batches make on it, a non-finite loss, a NaN or +inf module output (forward hook; a
    -inf is a mask's, by design) or a non-finite output gradient (tensor hook). Every rank runs every forward and
    backward (the step's collectives); the gradients are dropped, the RNG put back. One host read. (Without it the run
    answered rank 0, 'not reproducible: a hardware fault', for an inf that made only one rank's gradients NaN.)"""
    flags: list[torch.Tensor] = []

    def seen(_m: nn.Module, _args: Any, out: Any) -> None:
        for t in tensors_in(out):
            if t.is_floating_point():
                flags.append((torch.isnan(t.detach()) | (t.detach() == float("inf"))).any())
                if t.requires_grad:
                    t.register_hook(lambda g: flags.append(~torch.isfinite(g).all()))

    handles = [m.register_forward_hook(seen) for m in module.modules()]
    try:
        with kept_rng(), precision.autocast():
            for indices, batch in zip(window.indices, window.batches):
                loss_sum, _ = as_sum_count(task.loss(module, move_to(batch, device)), len(indices))
                flags.append(~torch.isfinite(loss_sum.detach()))
                loss_sum.backward()  # (never skipped: every rank's backward joins the same reduce-scatters)
        return bool(torch.stack([f.reshape(()) for f in flags]).any()) if flags else False
    finally:
        for h in handles:
            h.remove()
        for p in module.parameters():
            p.grad = None


def answered_ranks(dist: Any, bad: Any) -> list[int]:
    """The ranks whose ``bad()`` is true, in one gather every rank answers: an error in it on one rank is answered too,
    then raised on every rank (a rank that left before the gather had the others wait in it to ``dist.timeout_s``)."""
    flag, error = False, None
    try:
        flag = bool(bad())
    except Exception as err:  # this rank still answers the gather (the others wait in it), then all raise
        error = err
    flags = _gathered(dist, flag, error, "replaying its own micro-batches of the bad step")
    return [r for r, f in enumerate(flags) if f]


def own_loss_rank(dist: Any, own: Any, rng: dict[str, Any] | None = None) -> list[int] | None:
    """:func:`largest_loss_rank` of ``own()``, this rank's own loss (forward only), run with the RNG streams put back
    after it (set to ``rng`` first, when given); an error in it is answered in the gather, then raised on every rank."""
    loss, error = float("nan"), None
    try:
        with kept_rng():
            if rng is not None:
                set_rng_state(rng)
            loss = own()
    except Exception as err:  # this rank still answers the gather (the others wait in it), then all raise
        error = err
    return largest_loss_rank(dist, loss, error)


def largest_loss_rank(dist: Any, loss: float, error: BaseException | None) -> list[int] | None:
    """[the rank whose ``loss`` is the largest] over every rank (one gather; NaN is never the largest; None when no
    rank has one). A rank's ``error`` is raised on every rank after the gather, so none waits on a collective."""
    losses = [v if v == v else float("-inf")
              for v in _gathered(dist, loss, error, "computing its own loss on the spike's window")]
    return [max(range(len(losses)), key=losses.__getitem__)] if max(losses) > float("-inf") else None


def _gathered(dist: Any, value: Any, error: BaseException | None, doing: str) -> list[Any]:
    """Every rank's ``value`` in one gather that every rank answers; a rank's ``error`` is raised on every rank after it
    (this rank's own as it is, another's as a RuntimeError naming the rank and what it was ``doing``)."""
    answers = dist.gather_objects((value, None if error is None else f"{type(error).__name__}: {error}"))
    failed = next(((r, why) for r, (_, why) in enumerate(answers) if why is not None), None)
    if failed is not None:
        if error is not None:
            raise error
        raise RuntimeError(f"rank {failed[0]} failed {doing}: {failed[1]}")
    return [v for v, _ in answers]

