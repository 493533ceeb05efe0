"""``accum``: one step over k micro-batches (with a short tail) equals one step over the whole batch.

The model runs in training mode, as the run does. Dropout is switched off for the comparison (its
masks cannot match across batch shapes): ``nn.Dropout`` modules, a module's own ``dropout`` (LSTM,
GRU, RNN, MultiheadAttention) and functional dropout in the user's forward (``F.dropout`` and friends,
``scaled_dot_product_attention``'s ``dropout_p``); every other layer behaves as in training. Each side
runs from the same RNG state, and the big batch runs again from the same state and from another one:
a forward that keeps state of its own (a counter) shows in the first, randomness the check could not
switch off in the second, and then the check says it is inconclusive rather than blaming the loss. A
scalar loss that adds up over the batch (``reduction="sum"`` returned as if it were a mean) is named
as such: the whole batch's loss equals the sum of its micro-batches' losses. A model whose loss
depends on the whole batch beyond per-sample terms (BatchNorm's batch statistics) does not give the
same gradient from micro-batches: the check says so with the measured difference (a warning).

Both sides hold the same samples, fetched once: the big batch collates them all, each micro-batch its share. A
dataset that draws randomness of its own in ``__getitem__`` (an unseeded augmentation) therefore cannot make the
sides differ; the check fetches the samples a second time and says so when they differ. A collate function that
draws randomness does make the sides differ (each side is collated on its own): the big batch collated twice shows
it, and a difference is then called inconclusive (the batches differ, not the loss normalization).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils.data import default_collate

from ..data import move_to
from ..numerics import grad_norms, unique_params
from ..policies.accumulation import as_sum_count
from ..policies.dropout import dropout_off
from ..policies.precision import PrecisionPolicy
from ..step import TrainStep
from . import CheckContext, CheckResult, cast_wholesale, register
from .resume import batch_digest

#: Equivalence tolerance in fp32: |g_accum - g_big| <= ATOL + RTOL * max|g_big| (summation order only).
RTOL = 1e-4
ATOL = 1e-7
#: A scalar loss whose whole-batch value is off its micro-batches' sample-weighted mean by more than this share averages
#: over another unit than samples. A per-sample mean is off by fp32 rounding only (~1e-7); a per-token mean at init, where
#: every token's loss is near ln V, was off by 8e-4, under the 1e-3 this was, and went unnamed.
UNIT_RTOL = 1e-5

_BATCH_STATS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
                nn.LazyBatchNorm3d, nn.SyncBatchNorm)


def _grads(params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in params])


def _sums(big: float, micro: list[float], sizes: list[int], rtol: float = 1e-3) -> bool:
    """Whether a scalar loss adds up over the batch (the batch's = the sum of its parts', not their weighted mean)."""
    mean = sum(n * v for n, v in zip(sizes, micro)) / sum(sizes)
    return abs(big - sum(micro)) <= rtol * abs(big) < abs(big - mean)


@register("accum", order=20)
def check_accum(ctx: CheckContext) -> CheckResult:
    """Compare the gradient of k accumulated micro-batches with that of one big batch (fp32, train mode, dropout off)."""
    task = ctx.make_task()
    device = ctx.device
    model = task.model.to(device).train()
    params = [p for _, p in unique_params(model)]
    step = TrainStep(model, None, PrecisionPolicy("fp32", device), params=params)  # the run's forward/backward
    b = ctx.cfg.train.batch_size
    k = ctx.cfg.accum.steps if ctx.cfg.accum.steps > 1 else 4
    sizes = [b] * (k - 1) + [max(1, b // 2)]  # a short tail micro-batch, as at the end of an epoch
    total = sum(sizes)
    if total > len(task.train_data):  # (a small dataset: still a short tail where it has room for one)
        part = max(1, len(task.train_data) // k)
        sizes = [part] * (k - 1) + [max(1, part // 2)]
        total = sum(sizes)
    collate = task.collate or default_collate
    items = [task.train_data[i] for i in range(total)]  # one fetch: the big batch and the micro-batches share it
    big_host = collate(items)
    big = move_to(big_host, device)
    micro = []
    start = 0
    for s in sizes:
        micro.append((s, move_to(collate(items[start:start + s]), device)))
        start += s
    digest = batch_digest(big_host)
    items_random = batch_digest([task.train_data[i] for i in range(total)]) != batch_digest(items)  # __getitem__ draws
    collate_random = batch_digest(collate(items)) != digest  # the sides' batches differ: each is collated on its own
    batch_stats = [n for n, m in model.named_modules() if isinstance(m, _BATCH_STATS)]
    saved = {k_: v.detach().clone() for k_, v in model.state_dict().items()}  # BatchNorm running stats move

    def run(mode: str, seed: int = 0) -> torch.Tensor:
        model.load_state_dict(saved)
        torch.manual_seed(seed)  # every side draws the same numbers (inside fork_rng: the caller's RNG is kept)
        if mode == "big":
            step.forward_backward([(total, big)], task.loss)
        elif mode == "accum":
            step.forward_backward(micro, task.loss)
        else:  # naive: the mean of micro-batch means, each divided by k (what the step must NOT do)
            for p in params:
                p.grad = None
            for n, batch in micro:
                loss_sum, count = as_sum_count(task.loss(model, batch), n)
                (loss_sum / count / len(micro)).backward()
        return _grads(params)

    def scalar_losses() -> tuple[float, list[float]] | None:
        """The loss of the whole batch and of each micro-batch, when the task returns a scalar (else None)."""
        model.load_state_dict(saved)
        torch.manual_seed(0)
        with torch.no_grad():
            outs = [task.loss(model, batch) for batch in [big] + [b_ for _, b_ in micro]]
        if not all(isinstance(o, torch.Tensor) and o.dim() == 0 for o in outs):
            return None
        values = torch.stack([o.detach().float() for o in outs]).cpu().tolist()
        return values[0], values[1:]

    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), dropout_off(model) as (dropouts, functional):
        g_big = run("big")
        functional_calls = functional.calls  # in one forward of the big batch
        g_acc, g_naive = run("accum"), run("naive")
        g_same = run("big")  # the same batch from the same RNG state: state outside the inputs shows here
        g_again = run("big", seed=1)  # ... and from another RNG state: what randomness is left
        losses = scalar_losses()
    model.load_state_dict(saved)
    scale = float(g_big.abs().max())
    tol = ATOL + RTOL * scale
    diff = float((g_acc - g_big).abs().max())
    naive = float((g_naive - g_big).abs().max())
    noise = float((g_again - g_big).abs().max())
    repeat = float((g_same - g_big).abs().max())
    stateful = repeat > tol  # two identical forwards differ: the forward is not a function of its inputs and the RNG
    random = noise > tol or stateful
    passed = diff <= tol
    summed = not passed and not random and not collate_random and losses is not None and _sums(*losses, sizes)
    # A scalar that is a mean over another unit than samples (tokens of varying length): the window weighs a scalar by
    # its micro-batch's samples, so the whole batch's loss is not its micro-batches' sample-weighted mean.
    weighted = sum(n * v for n, v in zip(sizes, losses[1])) / total if losses is not None else math.nan
    cast = cast_wholesale(model)  # (half-precision weights: their rounding fails the tolerance, not the loss's unit)
    per_unit = (not passed and not summed and not cast and not random and not collate_random and not batch_stats
                and losses is not None
                and abs(losses[0] - weighted) > UNIT_RTOL * max(abs(losses[0]), abs(weighted), 1e-12))
    warning = not passed and (bool(batch_stats) or random or collate_random)
    # Passed, but so would the naive mean of means: these micro-batches cannot tell the window's normalization from it
    # (equal sizes and a per-sample loss: a dataset too small for a short tail). A new user's 5 samples read PASS.
    undecided = passed and naive <= tol and not random
    if passed:
        summary = (f"{k} micro-batches (sizes {sizes}) vs one batch of {total}: max |param diff| after an SGD step "
                   f"(lr=1) {diff:.3g} <= tol {tol:.3g}")
    elif collate_random:
        summary = (f"inconclusive: the batches differ between the two sides, not the loss normalization: the same "
                   f"samples collated twice give different batches (randomness in the collate function), so the {k} "
                   f"micro-batches' difference of {diff:.3g} ({diff / tol:.3g}x tol {tol:.3g}) from one batch of "
                   f"{total} says nothing about accumulation")
    elif stateful:
        summary = (f"inconclusive: two identical forward/backward passes (the same batch, the same RNG state) differ by "
                   f"{repeat:.3g} ({repeat / tol:.3g}x tol {tol:.3g}), so the {k} micro-batches' difference of {diff:.3g} "
                   f"from one batch of {total} says nothing about accumulation")
    elif random:
        summary = (f"inconclusive: the model's forward draws randomness the check could not switch off: the same batch "
                   f"from two RNG states differs by {noise:.3g} ({noise / tol:.3g}x tol {tol:.3g}), so the "
                   f"{k} micro-batches' difference of {diff:.3g} from one batch of {total} says nothing about accumulation")
    elif warning:
        summary = (f"{k} micro-batches vs one batch of {total}: max |param diff| {diff:.3g} ({diff / tol:.3g}x tol "
                   f"{tol:.3g}): expected with batch statistics ({', '.join(batch_stats[:3])}"
                   f"{' ...' if len(batch_stats) > 3 else ''}): each micro-batch is normalized by its own mean and "
                   "variance, so accumulation is not one big batch for this model")
    else:
        summary = f"{k} micro-batches vs one batch of {total}: max |param diff| {diff:.3g} exceeds tol {tol:.3g}"
        if summed:
            summary += "; the scalar loss sums over the batch instead of averaging"
        elif per_unit:
            summary += "; the scalar loss is a mean over another unit than samples (tokens?): return (sum, count)"
        elif cast:
            summary += "; the weights are stored in half precision (cast wholesale): their rounding, not the loss"
    details = [f"naive mean-of-means would differ by {naive:.3g} ({naive / max(tol, 1e-30):.3g}x the tolerance)"]
    if dropouts or functional_calls:
        off = [f"{', '.join(dropouts[:4])}{' ...' if len(dropouts) > 4 else ''}"] if dropouts else []
        if functional_calls:
            off.append(f"functional dropout calls in one forward: {functional_calls}")
        details.append(f"dropout switched off for the comparison: {'; '.join(off)}")
    if undecided:
        fix = ("train.batch_size=2 or more gives the check a short tail micro-batch" if b == 1 else
               f"a dataset of {2 * k} samples or more gives the check a short tail micro-batch" if len(set(sizes)) == 1
               else "the micro-batches' losses are too alike here to tell them apart")
        details.append(f"the naive mean of means passes too ({naive:.3g} <= tol): micro-batches of sizes {sizes} with this "
                       f"loss cannot tell the window's normalization from it, so this pass proves little; {fix}")
    if items_random:
        details.append("the dataset returns different items for the same index on two fetches (randomness in "
                       "__getitem__, an augmentation; whether a run draws it again the same is the determinism check's "
                       "to say): both sides were collated from one fetch of the samples, so it does not show here")
    if collate_random:
        details.append("the collate function draws randomness: each side is collated on its own, so their batches "
                       "differ; seed it from the run's RNG state or compare with it off")
    elif stateful and passed:
        details.append(f"two identical forward/backward passes differ by {repeat:.3g}: the forward keeps state of its "
                       "own; the sides still matched")
    elif random and passed:
        details.append(f"the forward draws randomness the check could not switch off (the same batch from two RNG states "
                       f"differs by {noise:.3g}); the sides still matched: each drew the same numbers from one RNG state")
    elif stateful:
        details.append("the forward depends on something besides its inputs and torch's RNG: state it changes per call "
                       "(a counter, a cache, an attribute not in the state_dict) or randomness of its own (a generator "
                       "seeded from the clock): make the forward a function of the batch, or keep that state fixed")
    elif random:
        details.append("a random op outside nn.Dropout, a module's own dropout and F.dropout (a mask drawn by hand, "
                       "noise injection, random augmentation in the forward): make it depend on self.training, or "
                       "compare with it off; the check switches dropout off by those three routes only")
    elif warning:
        details.append("to make k micro-batches match one batch: GroupNorm/LayerNorm instead of BatchNorm (a batch norm's "
                       "statistics are each micro-batch's own; SyncBatchNorm pools them across ranks, not across a window's "
                       "micro-batches); otherwise keep micro-batches large enough for stable statistics")
    elif summed:
        big_loss, micro_losses = losses
        details.append(f"the scalar loss scales with the batch size: {big_loss:.4g} on the batch of {total} = the sum of "
                       f"its micro-batches' losses ({sum(micro_losses):.4g}), not their size-weighted mean "
                       f"({sum(n * v for n, v in zip(sizes, micro_losses)) / total:.4g}): it sums instead of averaging; "
                       "use reduction='mean', or return (sum, count)")
    elif per_unit:
        whole, parts = apart(losses[0], weighted)
        details.append(f"the scalar loss is {whole} on the batch of {total}, while its micro-batches' losses "
                       f"weighed by their samples give {parts}: it averages over another unit than samples "
                       "(tokens of varying length, masked positions), and a scalar is weighed by its micro-batch's samples; "
                       "return (sum, count) with count in that unit (the tokens), so the window weighs each by what it holds")
    elif not passed and cast:
        details.append(cast)
    elif not passed and losses is not None:  # a scalar: no (sum, count) of the task's to be inconsistent
        details.append("the loss may depend on the batch beyond per-sample terms (e.g. in-batch negatives), or average "
                       "over another unit than samples (tokens) whose losses are still too alike to tell: then return "
                       "(sum, count) with count in that unit")
    elif not passed:
        details.append("the loss may depend on the batch beyond per-sample terms (e.g. in-batch negatives), "
                       "or the task's (sum, count) is inconsistent")
    return CheckResult("accum", passed or warning, summary, warning=warning or undecided,
                       numbers={"k": k, "max_param_diff": diff, "tolerance": tol, "naive_max_param_diff": naive,
                                "grad_norm": float(grad_norms(params)[0]), "batch_stat_layers": len(batch_stats),
                                "residual_randomness": noise, "repeat_diff": repeat, "items_random": items_random,
                                "collate_random": collate_random},
                       details=details)


def apart(a: float, b: float) -> tuple[str, str]:
    """``a`` and ``b`` in as many significant digits (4 at least, 9 at most) as tell them apart (a trial's '3.486 ...
    while ... give 3.486' said two losses differ)."""
    digits = next((d for d in range(4, 10) if f"{a:.{d}g}" != f"{b:.{d}g}"), 9)
    return f"{a:.{digits}g}", f"{b:.{digits}g}"
