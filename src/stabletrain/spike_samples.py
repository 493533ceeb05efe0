"""Which samples carry a loss spike: each weighed alone, the fewest that could dropped, and the step without them replayed.

:func:`weigh_samples` is the data counterfactual of a spike's doctor (:mod:`stabletrain.counterfactual`): each
sample's loss (and share of the window's gradient), then the fewest samples whose removal the run's own step,
replayed without them, finds normal by the guard's rule: greedy by the samples' own losses (exact for a mean-loss
rule), else by their removal from the window (:func:`_bisect`: a batch norm couples them). :func:`dropout_draw` asks
whether the step's own dropout masks made the spike. Each replay runs on a
:class:`~stabletrain.services.replay_bench.ReplayBench`.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import math
import statistics
from typing import Any

import torch

from .diagnostics.spike_evidence import MOSTLY_CARRIED, max_outliers, outlier_sets
from .internals import tree_flatten
from .policies.accumulation import as_sum_count
from .policies.dropout import dropout_off
from .services.replay_bench import ReplayBench

__all__ = ["weigh_samples", "dropout_draw", "loss_tail", "tail_note", "MAX_GRAD_SAMPLES", "TAIL_MIN"]

#: Per-sample gradient shares are measured for windows of at most this many samples (one backward each).
MAX_GRAD_SAMPLES = 64
MAX_BISECT_REPLAYS = 96  #: At most this many forward replays of the window in one bisection (and MAX_SUBSETS's).
#: A spike whose window keeps at most 1/DRAW_SHARE of its loss with every dropout off was made by the step's masks.
DRAW_SHARE = 10.0
#: Windows of at most this many samples are searched by each sample's removal (one forward pass each); larger, by halves.
MAX_LEAVE_ONE_OUT = 64
#: Where no sample's own removal points at the set (a batch norm: a window without one of three scaled images is worse
#: than without a clean one), every set of up to ``max_outliers`` samples is tried, fewest first, within this many passes.
MAX_SUBSETS = 128
#: A data spike's named samples are weighed against others this many at a time (their batches on the device at once).
TAIL_CHUNK = 32
#: Fewer other samples weighed than this (an adapter's kept windows, a batch of one): a named sample beyond them all is
#: not called rare in the data.
TAIL_MIN = 32


def dropout_draw(bench: ReplayBench, groups: list[tuple[list[int], Any]], rule: Any, bound: float,
                  loss: float, context: list[list[tuple[list[int], Any]]]) -> dict[str, Any] | None:
    """The window's loss with every dropout off (None: the model draws none): ``loss``, ``ratio``, ``zscore``,
    ``normal`` and ``made_by_draw`` (the step's own draw made the spike).

    Normal: no spike by the rule and at most ``bound`` times its median; where ordinary windows (``context``) are at
    hand, at most ``bound`` times their loss with dropout off too (dropout off lowers every window's loss: against
    the rule's window, recorded with dropout on, a bad sample's window could pass). Made by the draw: normal, or at
    most 1/:data:`DRAW_SHARE` of the spike's positive ``loss`` left (near a tiny loss, dropout off shifts a trained
    model's outputs enough to miss the bar by itself). A non-finite loss with dropout off is neither.
    """
    with dropout_off(bench.replica.model) as (names, mode):
        quiet = bench.loss(groups)
        ordinary = [bench.loss(c) for c in context]
    if not names and not mode.calls:
        return None
    test = rule(quiet)
    if not math.isfinite(quiet) or "ratio" not in test or not test.get("armed"):
        return {"loss": quiet, "ratio": None, "zscore": None, "normal": False, "made_by_draw": False}
    ordinary = [x for x in ordinary if math.isfinite(x)]
    base = statistics.median(ordinary) if ordinary else None
    normal = not test["spike"] and test["ratio"] <= bound and (base is None or base <= 0 or quiet <= bound * base)
    made = normal or (quiet >= 0 and loss > 0 and quiet * DRAW_SHARE <= loss)
    return {"loss": quiet, "ratio": test["ratio"], "zscore": test.get("zscore"), "normal": normal, "made_by_draw": made,
            **({"ordinary": base} if base is not None else {})}


def _gone(base: float, rest: float) -> str:
    """The share of ``base`` that ``rest`` lost, as a percentage that never rounds a part up to all of it."""
    pct = 100 * (1 - rest / base)
    return f"{pct:.0f}%" if pct < 99.5 or pct >= 100 else f"{min(pct, 99.9):.1f}%"


def weigh_samples(bench: ReplayBench, groups: list[tuple[list[int], Any]], rule: Any, grads: dict[str, torch.Tensor] | None,
             bound: float, *, dropout: bool = False) -> tuple[list[dict[str, Any]], dict[str, Any] | None, str | None]:
    """:func:`_weigh_samples`, with every dropout off where the model has some (``dropout``): a row removed draws other
    masks for every other row, so a removal "verified" under dropout could be a luckier draw (it was)."""
    with dropout_off(bench.replica.model) if dropout else contextlib.nullcontext():
        return _weigh_samples(bench, groups, rule, grads, bound, dropout)


def _weigh_samples(bench: ReplayBench, groups: list[tuple[list[int], Any]], rule: Any, grads: dict[str, torch.Tensor] | None,
                   bound: float, dropout: bool) -> tuple[list[dict[str, Any]], dict[str, Any] | None, str | None]:
    """(per-sample losses (and gradient shares), and the fewest samples whose removal makes the step normal: no
    spike by the rule and at most ``bound`` (``guard.spike_ratio``) times the window's median (a z-score that a
    noisy window keeps under the rule's is not enough: x9 the median is no normal step), and when no set is found a
    note on why the search stopped short (None: it did not).

    The samples' own largest losses first (greedy: exact for a mean-loss rule); where none of those sets makes the
    step normal (the loss couples the samples: a batch norm's statistics) or a sample cannot be weighed alone (a
    model that refuses a batch of one), by their removal from the window (:func:`_bisect`): the found set's ``how``
    is then "removal", ``why`` says why and ``search`` how it searched.
    """

    def normal(loss: float) -> bool:
        verdict = rule(loss)
        return not verdict["spike"] and verdict.get("ratio", 0.0) <= bound

    rows, total_sum, total_count, failed = [], 0.0, 0.0, None
    try:
        for idx, _ in groups:
            for i in idx:
                s, c = bench.sums(bench.groups([[i]]))
                rows.append({"sample": i, "loss_sum": s, "count": c})
                total_sum, total_count = total_sum + s, total_count + c
    except torch.cuda.OutOfMemoryError:
        raise
    except Exception as exc:  # e.g. a batch norm in training refuses a batch of one: the window decides (bisection)
        rows, failed = [], f"weighing one sample alone failed ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
    for r in rows:
        r["loss"] = r["loss_sum"] / r["count"] if r["count"] else float("nan")
        r["share"] = r["loss_sum"] / total_sum if total_sum else 0.0
    if grads is not None and rows and len(rows) <= MAX_GRAD_SAMPLES:
        _gradient_shares(bench, rows, grads, total_count)
    rows.sort(key=lambda r: -r["loss_sum"])
    found = _verified(bench, groups, rule, normal, outlier_sets(rows, normal))  # fewest first, by the samples' own losses
    if found is None and rows:  # more than a quarter, yet far apart from the rest: 5 relabelled of 16, x345 the next
        wide, level = _outlier_group(rows, len(rows) // 2, bound), rule(0.0).get("median") or 0.0
        # each of them far above the run's level too, not a trained model's ordinary hard samples above its confident rest
        if (wide and wide[1] >= APART_GAP and len(wide[0]) > max_outliers(len(rows)) and level > 0
                and min(r["loss"] for r in rows if r["sample"] in wide[0]) >= APART_GAP * level):
            found = _verified(bench, groups, rule, normal, [wide[0]])
    copies = _copies(bench, rows) if found is None and rows else []
    if copies:  # more than a quarter, yet one input repeated: one defect (a duplicated row or shard), not many samples
        found = _verified(bench, groups, rule, normal, [copies])
        found = {**found, "copies": len(copies)} if found is not None else None
    if found is not None:  # with the samples as far out as its own (the fewest may leave some of the outliers in)
        alike = _alike(rows, found["indices"], max_outliers(len(rows)), bound)
        found = (_verified(bench, groups, rule, normal, [alike]) if alike else None) or found
        apart = _apart(rows, found["indices"], max_outliers(len(rows)), bound)  # a small window's ordinary hard sample
        relaxed = _verified(bench, groups, rule, lambda x: not rule(x)["spike"], [apart[0]]) if apart else None
        if relaxed is not None:
            found = {**relaxed, "without": {**relaxed["without"], "apart": apart[1]}}
        share = sum(r["share"] for r in rows if r["sample"] in found["indices"])
        return rows, {"indices": found["indices"], "share": share, "without": found["without"],
                      **({"copies": found["copies"]} if "copies" in found else {})}, None
    window_sum, _ = bench.sums(groups)
    median = rule(0.0).get("median") or float("nan")
    drop, note = _bisect(bench, groups, normal, bound, bound * median, dropout)
    found = _verified(bench, groups, rule, normal, [drop] if drop else [])
    if found is None:
        n = sum(len(idx) for idx, _ in groups)
        note = note or (f"no set it tried of up to {max_outliers(n)} of the window's {n} samples makes the step normal "
                        "(not every one)")  # (where it tried every one, the search's note says so)
        return rows, None, "; ".join(x for x in (failed, note) if x)
    kept = [[i for i in idx if i not in found["indices"]] for idx, _ in groups]
    share = 1.0 - bench.sums(bench.groups(kept))[0] / window_sum if window_sum else 0.0
    why = failed or "no few of the samples' own largest losses made the step normal: the loss couples them"
    return rows, {"indices": found["indices"], "share": share, "without": found["without"], "how": "removal",
                  "why": why, "search": note}, None


def _outlier_group(rows: list[dict[str, Any]], limit: int, bound: float) -> tuple[list[int], float] | None:
    """(the samples above the widest gap between the window's largest losses, that gap): among the ``limit`` largest and
    the one after (``rows``: one per sample), where the lowest of them is ``bound`` x the window's median or more (each
    an outlier of the window itself too: the widest gap may sit at its low end, near-0 losses of a trained model's
    confident samples below ordinary ones). None where there is no such gap."""
    finite = [r["loss"] for r in rows if math.isfinite(r["loss"])]
    top = sorted((r for r in rows if math.isfinite(r["loss"]) and r["loss"] > 0), key=lambda r: -r["loss"])[:limit + 1]
    gaps = [(a["loss"] / b["loss"], i) for i, (a, b) in enumerate(zip(top, top[1:]))]
    if not gaps or not finite:
        return None
    gap, at = max(gaps)
    if top[at]["loss"] < bound * statistics.median(finite):
        return None
    return sorted(r["sample"] for r in top[:at + 1]), gap


def _alike(rows: list[dict[str, Any]], found: list[int], limit: int, bound: float) -> list[int] | None:
    """The samples above the widest gap (:func:`_outlier_group`; a gap of at least ``bound``, the spike ratio), where those
    hold ``found`` and more: the outliers as a group, not the fewest whose removal passes the bar (5 of 8 planted x50
    samples were named, the step without them 'normal' at x1.92 the median). None where no such gap sets them apart."""
    outliers = _outlier_group(rows, limit, bound)
    return outliers[0] if outliers and outliers[1] >= bound and set(found) < set(outliers[0]) else None


#: Samples above a gap of this many times the next loss are the outliers alone: the step without them need only be no
#: spike by the guard's rule (a window of 4 kept a clean sample at x6 the median, its mean without the bad one x2.5).
APART_GAP = 10.0


def _apart(rows: list[dict[str, Any]], found: list[int], limit: int, bound: float) -> tuple[list[int], float] | None:
    """(the samples above the widest gap, that gap: :func:`_outlier_group`) where it is :data:`APART_GAP` or more and
    ``found`` (the fewest whose removal leaves a step within ``bound`` x the median) holds them and more: the more are the
    window's own spread, below the gap, not outliers. None otherwise."""
    outliers = _outlier_group(rows, limit, bound)
    return outliers if outliers and outliers[1] >= APART_GAP and set(outliers[0]) < set(found) else None


def _verified(bench: ReplayBench, groups: list[tuple[list[int], Any]], rule: Any, normal: Any, sets: Any
              ) -> dict[str, Any] | None:
    """The first of ``sets`` whose removal the run's own step, replayed without them, finds normal (None: none)."""
    for drop in sets:
        kept = [[i for i in idx if i not in drop] for idx, _ in groups]
        replayed = bench.step(bench.groups(kept))
        verdict = rule(replayed["loss"])
        if normal(replayed["loss"]):
            return {"indices": sorted(drop), "without": {"loss": replayed["loss"], "grad_norm": replayed["grad_norm"],
                                                         "ratio": verdict["ratio"], "zscore": verdict["zscore"]}}
    return None


def _bisect(bench: ReplayBench, groups: list[tuple[list[int], Any]], normal: Any, ratio: float, level: float,
            dropout: bool = False) -> tuple[list[int] | None, str | None]:
    """The few samples whose removal makes the window normal, found by weighing groups of them: (samples or None, a
    note on what stopped it, or None).

    A window of at most :data:`MAX_LEAVE_ONE_OUT` samples: each sample is dropped from the whole window in turn
    (the rest keeps nearly all of it: a batch norm's statistics barely move), and the fewest of those whose
    removal lowers the loss most that leave a normal window are the set. A larger window: each half is weighed on
    its own; where one half's loss is more than ``ratio`` times the other's, that half is narrowed; where the two are
    alike, each above ``level`` (``spike_ratio`` x the rule's median) is; down to the smallest group the model takes.
    Either way the set is dropped from the whole window and replayed, and each sample that need not go is given
    back. At most :data:`MAX_BISECT_REPLAYS` forward passes; None when none stands out, more than a quarter of the
    window (16 at most) would go, or the rest is not normal. The note says how it searched (and why it stopped).
    """
    flat = [i for idx, _ in groups for i in idx]
    limit, calls, notes, budget = max_outliers(len(flat)), [0], [], [MAX_BISECT_REPLAYS]

    def replay(parts: list[list[int]]) -> float | None:  # (the loss of these micro-batches, within the budget)
        if calls[0] >= budget[0]:
            if not notes:
                notes.append(f"stopped at its budget of {MAX_BISECT_REPLAYS} forward passes")
            return None
        calls[0] += 1
        try:
            return bench.loss(bench.groups(parts))
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception:  # a group the model refuses (one sample for a batch norm in training): not split further
            return None

    def loss_of(samples: list[int]) -> float | None:
        return replay([samples])

    def normal_without(drop: set[int]) -> bool:
        kept = [i for i in flat if i not in drop]
        loss = loss_of(kept) if kept else None
        return loss is not None and normal(loss)

    def narrow(cands: list[int]) -> list[int]:
        if len(cands) <= 1:
            return cands
        halves = (cands[:len(cands) // 2], cands[len(cands) // 2:])
        losses = [loss_of(h) for h in halves]
        if None in losses or not all(math.isfinite(x) for x in losses):
            return cands  # the halves cannot be weighed apart: the group stays whole
        if max(losses) > ratio * min(losses):  # one half stands out
            high = [h for h, x in zip(halves, losses) if x == max(losses)]
        else:  # alike: each is judged against the ordinary level (two outliers, one in each half)
            high = [h for h, x in zip(halves, losses) if not x <= level]
        return [i for h in high for i in narrow(h)]

    if len(flat) <= MAX_LEAVE_ONE_OUT:  # each sample's removal from the whole window: how far the window's loss falls
        with dropout_off(bench.replica.model):  # (a row removed shifts every later row's mask: the falls would be noise)
            base = loss_of(flat)
            falls = [(base - x, i) for i in flat
                     if base is not None and (x := loss_of([j for j in flat if j != i])) is not None]
            ranked = sorted(falls, reverse=True)  # (a set that splits a tie of falls names a sample by the tie's order)
            whole = [k for k in range(1, min(limit, len(ranked)) + 1)
                     if not (k < len(ranked) and math.isclose(ranked[k - 1][0], ranked[k][0], rel_tol=1e-6))]
            top = sorted(i for _, i in ranked[:whole[-1]]) if whole else []
            rest = loss_of([i for i in flat if i not in top]) if top else None
        order, every = [i for _, i in ranked], False
        found = next((order[:k] for k in whole if normal_without(set(order[:k]))), [])
        how = "each sample's removal from the whole window, the largest falls first"
        sets = sum(math.comb(len(flat), k) for k in range(1, min(limit, len(flat) - 1) + 1))
        tied = any(math.isclose(a[0], b[0], rel_tol=1e-6) for a, b in zip(ranked, ranked[1:]))  # (a set splits no tie)
        exhaustive = not tied and sets <= MAX_SUBSETS
        if not found and exhaustive:  # the falls misled (coupled samples): every few, fewest first
            budget[0] = calls[0] + sets + limit + 1  # (and the checks below)
            found = _fewest_normal(flat, min(limit, len(flat) - 1),  # (the window's own micro-batches: a batch norm's)
                                   lambda drop: replay([[i for i in idx if i not in drop] for idx, _ in groups]), normal)
            notes[:] = notes if not found else []
            how = (f"every set of up to {min(limit, len(flat) - 1)} of the window's {len(flat)} samples dropped in turn, "
                   "fewest first (no sample's own removal pointed at them: the loss couples them)")
            every = not found and not notes  # (within its budget: every one tried, said below unless more is)
        if not found and not exhaustive:  # too many sets to try each (or tied falls): the inputs that stand out
            by_size = _input_outliers(bench, flat, limit)  # (a batch norm's statistics owned by a few huge images: their
            budget[0] = max(budget[0], calls[0] + 2 * len(by_size) + 2)  # (its tries and the checks below: a window of
            # 64 has spent 65 passes on the falls)
            found = next((by_size[:k] for k in range(1, len(by_size) + 1) if normal_without(set(by_size[:k]))), [])
            if found:  # own losses and their removals' falls point elsewhere; a trial's three of 32, x100 brightness)
                how = "the samples whose inputs stand out most (their norm), the largest first (the loss couples them)"
        if not found and rest is not None and base and math.isfinite(base) and rest <= base / 2:  # most of it: say so
            notes.append(f"{MOSTLY_CARRIED}{', '.join(map(str, top))} (the largest falls) the window's loss falls from "
                         f"{base:.4g} to {rest:.4g} ({_gone(base, rest)} of it gone"
                         f"{'; dropout off' if dropout else ''}), still no normal step by the rule: not verified, not named "
                         f"(a set names at most {limit} of the window's {len(flat)} samples)")
        if not found and not notes and every:
            notes.append(f"no set of up to {min(limit, len(flat) - 1)} of the window's {len(flat)} samples makes the step "
                         "normal (every one tried)")
    else:
        found = narrow(flat)
        how = "halves of the window weighed on their own, narrowed"
    if not found or len(found) == len(flat) or not normal_without(set(found)):
        return None, (notes[0] if notes else None)
    for i in list(found):  # give back each sample whose removal is not needed
        if len(found) > 1 and normal_without(set(found) - {i}):
            found.remove(i)
    if len(found) > limit:
        return None, f"{len(found)} samples would have to go (more than {limit})"
    return sorted(found), "; ".join([how, *notes])


def _item_leaves(bench: ReplayBench, i: int) -> list[Any]:
    """The leaves (tensors, arrays, values) of the dataset's item ``i``, as it stands before collation."""
    return tree_flatten(bench.task.train_data[i])[0]


def _copies(bench: ReplayBench, rows: list[dict[str, Any]]) -> list[int]:
    """The window's set of identical samples (every tensor, array and plain value of the dataset item alike, by a digest
    of their bytes) that carries the largest share of its loss, where it holds two or more and most of the loss
    (``rows``: one per sample, with its ``share``); else [] (also for an item holding anything else)."""
    groups: dict[bytes, list[int]] = {}
    try:
        for r in rows:
            digest = hashlib.blake2b(digest_size=16)
            for leaf in _item_leaves(bench, r["sample"]):
                if isinstance(leaf, torch.Tensor):
                    leaf = leaf.detach().cpu().contiguous()
                    digest.update(repr((tuple(leaf.shape), str(leaf.dtype))).encode())
                    digest.update(leaf.view(-1).view(torch.uint8).numpy().tobytes())
                elif type(leaf).__module__ == "numpy" and hasattr(leaf, "tobytes"):  # (an array, a numpy scalar)
                    digest.update(repr((getattr(leaf, "shape", ()), str(leaf.dtype))).encode() + leaf.tobytes())
                elif isinstance(leaf, (str, int, float, bool, bytes)) or leaf is None:
                    digest.update(repr(leaf).encode())
                else:  # (an object whose repr need not tell two apart)
                    return []
            groups.setdefault(digest.digest(), []).append(r["sample"])
    except Exception:  # noqa: BLE001  (an item of another kind: no copies told)
        return []
    share = {r["sample"]: r["share"] for r in rows}
    best = max((g for g in groups.values() if len(g) >= 2), key=lambda g: sum(share[i] for i in g), default=[])
    return sorted(best) if len(best) < len(rows) and sum(share[i] for i in best) > 0.5 else []


def _input_outliers(bench: ReplayBench, flat: list[int], limit: int) -> list[int]:
    """Up to ``limit`` of ``flat`` whose inputs' norm (the floating tensors of the sample) stands out of the window's:
    more than twice its median, the largest first ([] where none does, or a sample cannot be read)."""
    norms = []
    try:
        for i in flat:
            leaves = [t for t in _item_leaves(bench, i) if isinstance(t, torch.Tensor) and t.is_floating_point()]
            norms.append((float(sum(t.double().pow(2).sum() for t in leaves)) ** 0.5 if leaves else 0.0, i))
    except Exception:  # noqa: BLE001  (a dataset item of another kind: no ordering by size)
        return []
    middle = sorted(n for n, _ in norms)[len(norms) // 2]
    return [i for n, i in sorted(norms, reverse=True) if middle > 0 and n > 2 * middle][:limit]


def _fewest_normal(flat: list[int], limit: int, loss_without: Any, normal: Any) -> list[int]:
    """The fewest of ``flat`` whose removal leaves a normal window (of those, the lowest loss), [] where no set of up to
    ``limit`` does (``loss_without(drop)``: the window's loss without them, None past the search's budget)."""
    for k in range(1, limit + 1):
        passed = [(x, list(drop)) for drop in itertools.combinations(flat, k)
                  if (x := loss_without(drop)) is not None and normal(x)]
        if passed:
            return min(passed)[1]
    return []


def _gradient_shares(bench: ReplayBench, rows: list[dict[str, Any]], grads: dict[str, torch.Tensor], count: float) -> None:
    """Each sample's share of the window's gradient G: <g_i / count, G> / ||G||^2 (they sum to 1)."""
    rep = bench.replica
    g_sq = sum(float((g * g).sum()) for g in grads.values())
    if not g_sq:
        return
    for r in rows:
        rep.reset()
        for p in rep.params:
            p.grad = None
        (idx, batch), = bench.groups([[r["sample"]]])
        with bench.precision.autocast():
            s, _ = as_sum_count(bench.task.loss(rep.model, batch), len(idx))
        (s / count).backward()
        bench.passes["forward"] += 1
        bench.passes["backward"] += 1
        dot = sum(float((p.grad.detach().float() * grads[n]).sum()) for n, p in rep.named_params
                  if p.grad is not None and n in grads)
        r["grad_share"] = dot / g_sq
    for p in rep.params:
        p.grad = None
    rep.reset()




def loss_tail(bench: ReplayBench, pool: list[int], rows: list[dict[str, Any]], named: list[int], *,
              dropout: bool = False) -> dict[str, Any] | None:
    """How the ``named`` samples (a data spike's; ``rows``: the window's samples weighed alone) stand among the samples
    ``pool`` (others of the run's: the ordinary windows', a draw of the dataset), weighed alone under the same state (a
    forward each, TAIL_CHUNK at a time on the device): ``{"of", "largest", "samples": [{"sample", "loss", "reach"}]}``,
    ``of`` the others with a finite loss, ``reach`` how many of them reach the sample's loss. A named sample none reaches
    is beyond the data's spread; one that some do is of a kind the data holds (the loss's own tail, or a recurring
    defect). None where a sample cannot be weighed alone (a model that refuses a batch of one), the device runs out of
    memory (an extra: the diagnosis goes on without it), or no other has a finite loss."""
    losses = {r["sample"]: r["loss"] for r in rows}
    mine = {i: losses[i] for i in named if i in losses and math.isfinite(losses[i])}
    if not mine or not pool:
        return None
    others: list[float] = []
    short = False
    try:
        with dropout_off(bench.replica.model) if dropout else contextlib.nullcontext():
            for at in range(0, len(pool), TAIL_CHUNK):
                chunk = bench.groups([[i] for i in pool[at:at + TAIL_CHUNK]])
                others += [s / c if c else float("nan") for s, c in bench.each(chunk)]
    except torch.cuda.OutOfMemoryError:  # (an extra: the diagnosis goes on without it, its memory freed below)
        short = True
    except Exception:  # noqa: BLE001  (no tail to weigh against)
        return None
    if short:
        torch.cuda.empty_cache()  # (out of the handler: its traceback, which held the chunk, is gone)
        return None
    finite = [x for x in others if math.isfinite(x)]
    if not finite:
        return None
    return {"of": len(finite), "largest": max(finite),
            "samples": [{"sample": i, "loss": loss, "reach": sum(1 for x in finite if x >= loss)} for i, loss in mine.items()]}


def tail_note(tail: dict[str, Any]) -> str:
    """The evidence's words for :func:`loss_tail`'s finding."""
    beyond = [r["sample"] for r in tail["samples"] if not r["reach"]]
    within = [r for r in tail["samples"] if r["reach"]]
    others = f"{tail['of']} other samples weighed under this state"
    # (beyond a few others is no finding about the data: an adapter's kept windows, a batch of one)
    rare = ("rare in the data (a corrupt row, or one the model has not learned yet)" if tail["of"] >= TAIL_MIN else
            f"too few to tell whether that is rare in the data (a draw of {TAIL_MIN} or more does)")
    if not within:
        who = "each is" if len(beyond) > 1 else "it is"
        return f"{who} beyond all {others} (they reach {tail['largest']:.4g} at most): {rare}"
    said = ", ".join(f"{r['sample']} ({r['loss']:.4g}: {r['reach']} reach{'es' * (r['reach'] == 1)} it)" for r in within)
    held = (f"of {others}, {'one is' if max(r['reach'] for r in within) == 1 else 'some are'} as lossy ({said}): the data "
            "holds such samples (hard ones of the loss's own tail, or a recurring defect: label noise, a bad shard)")
    if not beyond:
        return held + (", and this window drew several at once" if len(within) > 1 else "")
    who = f"samples {', '.join(map(str, beyond))} are" if len(beyond) > 1 else f"sample {beyond[0]} is"
    return f"{who} beyond all {others} (they reach {tail['largest']:.4g} at most); {held}"
