"""A loss spike's doctor: replay its step from the exact pre-step state, change one thing at a time, name the cause.

:func:`diagnose_spike` reads a spike's bundle (``incidents/step_N``: the state before the step, its window, the
guard's window of losses the rule judged it against, the state at the interval's start and a few ordinary
windows) and replays, each time from the same saved state and RNG streams, on a :class:`~stabletrain.replica.Replica`:

1. the step itself, with the run's own step: the same loss (bitwise in fp32)? a spike by the guard's rule?
2. each sample alone (forward; a backward each for its share of the window's gradient, up to :data:`MAX_GRAD_SAMPLES`):
   which samples carry the loss; the step without the fewest that could, replayed: normal by the rule? (greedy by loss
   is exact for a mean-loss rule; where the loss couples the samples, a batch norm's, by removal: :func:`_bisect`)
3. the window and ordinary windows under the older state (the interval's start; without ordinary windows, what stands for
   them there, if anything): is the batch itself an outlier, or did the state drift?
4. each module's output magnitude on the window under both states (where it departs first), each parameter's gradient
   and update against the ordinary windows' median (which layers jumped), Adam's second moment against the gradients
   of the spike's step and of the step before it, replayed from the state before that one (:func:`~.spike.adam_surges`);
5. under bf16/fp16, the step in fp32: normal there? (and each module against its fp32 output: where precision loses it)
6. with dropout, the window with every dropout off: a spike still? (else the step's own masks made it)

:func:`~stabletrain.diagnostics.spike.classify_spike` reads them; the model, RNG streams and task are left as they were.
Cost: about 2N + 8 forward and N + 4 backward passes for a window of N samples, and up to :data:`MAX_BISECT_REPLAYS`
forward passes more where the samples are found by their removal (N + a few, N <= 64).
"""

from __future__ import annotations

import contextlib
import copy
import math
import statistics
import time
from typing import Any

import torch

from .config import config_from_dict
from .diagnostics.cures import ModuleFP32
from .diagnostics.diagnosis import matches_observed
from .diagnostics.spike import (
    LR_RISE,
    classify_spike,
    departures,
    jumps,
    lr_change,
    lr_groups,
    max_outliers,
    ordinary_stand_in,
    outlier_sets,
    precision_departures,
    spike_summary,
)
from .policies.accumulation import as_sum_count
from .policies.dropout import dropout_off
from .policies.guard import spike_test
from .policies.precision import resolve_device
from .replica import Replica
from .seeding import kept_rng
from .services.replay_bench import ReplayBench

__all__ = ["diagnose_spike", "MAX_GRAD_SAMPLES", "MAX_CONTEXT"]

#: Per-sample gradient shares are measured for windows of at most this many samples (one backward each).
MAX_GRAD_SAMPLES = 64
#: Ordinary windows compared against (the interval's steps before the spike, else the next ones).
MAX_CONTEXT = 3
MAX_BISECT_REPLAYS = 96  #: At most this many forward replays of the window in one bisection.
#: A spike whose window keeps at most 1/DRAW_SHARE of its loss with every dropout off was made by the step's masks.
DRAW_SHARE = 10.0
#: Windows of at most this many samples are searched by each sample's removal (one forward pass each); larger, by halves.
MAX_LEAVE_ONE_OUT = 64
#: A data spike with no sample to blame, right after this many flagged steps in a row, is a level shift (the data moved).
LEVEL_RUN = 5


def _dropout_draw(bench: ReplayBench, groups: list[tuple[list[int], Any]], rule: Any, bound: float,
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


def _samples(bench: ReplayBench, groups: list[tuple[list[int], Any]], rule: Any, grads: dict[str, torch.Tensor] | None,
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
    if found is not None:
        share = sum(r["share"] for r in rows if r["sample"] in found["indices"])
        return rows, {"indices": found["indices"], "share": share, "without": found["without"]}, None
    window_sum, _ = bench.sums(groups)
    median = rule(0.0).get("median") or float("nan")
    drop, note = _bisect(bench, groups, normal, bound, bound * median, dropout)
    found = _verified(bench, groups, rule, normal, [drop] if drop else [])
    if found is None:
        n = sum(len(idx) for idx, _ in groups)
        note = note or f"no set of up to {max_outliers(n)} of the window's {n} samples makes the step normal"
        return rows, None, "; ".join(x for x in (failed, note) if x)
    kept = [[i for i in idx if i not in found["indices"]] for idx, _ in groups]
    share = 1.0 - bench.sums(bench.groups(kept))[0] / window_sum if window_sum else 0.0
    why = failed or "no few of the samples' own largest losses made the step normal: the loss couples them"
    return rows, {"indices": found["indices"], "share": share, "without": found["without"], "how": "removal",
                  "why": why, "search": note}, None


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
    limit, calls, notes = max_outliers(len(flat)), [0], []

    def loss_of(samples: list[int]) -> float | None:
        if calls[0] >= MAX_BISECT_REPLAYS:
            if not notes:
                notes.append(f"stopped at its budget of {MAX_BISECT_REPLAYS} forward passes")
            return None
        calls[0] += 1
        try:
            return bench.loss(bench.groups([samples]))
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception:  # a group the model refuses (one sample for a batch norm in training): not split further
            return None

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
        order = [i for _, i in ranked]
        found = next((order[:k] for k in whole if normal_without(set(order[:k]))), [])
        how = "each sample's removal from the whole window, the largest falls first"
        if not found and rest is not None and base and math.isfinite(base) and rest <= base / 2:  # most of it: say so
            notes.append(f"without samples {', '.join(map(str, top))} (the largest falls) the window's loss falls from "
                         f"{base:.4g} to {rest:.4g} ({100 * (1 - rest / base):.0f}% of it gone"
                         f"{'; dropout off' if dropout else ''}), still no normal step by the rule: not verified, not named")
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


def diagnose_spike(bundle: dict[str, Any], task: Any, *, device: str | None = None) -> dict[str, Any]:
    """Replay a spike's step under counterfactuals and return its diagnosis (JSON-safe; module docstring).

    Returns keys: ``anomaly`` ("spike"), ``loss``, ``grad_norm``, ``spike_test`` (the rule on the replay's loss), ``reproduces``,
    ``failure_class`` (:data:`~stabletrain.diagnostics.spike.SPIKE_CLASSES`), ``evidence``, ``summary``, ``bad_samples``
    (``data``'s verified samples), ``blamed_layer``, ``blamed_module``, ``samples`` (the verified set and the step without
    it), ``sample_losses`` (the ten largest, with gradient shares), ``older``, ``where``, ``jumps``, ``surges`` (the five
    parameters whose surging coordinates moved most, in the spike's update and the one before), ``fp32``, ``timings``, ``passes``.
    """
    start = time.perf_counter()
    cfg = config_from_dict(bundle["config"])
    dev = resolve_device(device or cfg.device)
    observed = bundle.get("observed", {})
    window = [float(x) for x in observed.get("spike_window") or []]

    def rule(loss: float) -> dict[str, Any]:
        return spike_test(loss, window, cfg.guard)

    with kept_rng(), torch.enable_grad():  # the replays draw from the run's RNG streams: they are put back
        return _diagnose(ReplayBench(Replica(cfg, task, bundle, dev), task), bundle, cfg, observed, rule, start)


def _diagnose(bench: ReplayBench, bundle: dict[str, Any], cfg: Any, observed: dict[str, Any], rule: Any,
              start: float) -> dict[str, Any]:
    replica, precision = bench.replica, bench.precision.mode
    spike = bench.groups(bundle["window"]["indices"])
    context = [c for w in (observed.get("context") or [])[:MAX_CONTEXT] if (c := bench.groups(w))]
    here = bench.step(spike, signature=True)
    test = rule(here["loss"])
    # The loss and grad norm the run saw (one process: under DDP they are the global ones, a replay sees one rank's).
    seen = ({k: observed[k] for k in ("loss", "grad_norm") if observed.get(k) is not None}
            if observed.get("loss") is not None else {})
    # A compiled run's kernels round differently from the eager replay: compared within a tolerance, not bitwise.
    tolerance = "compiled" if cfg.train.compile else precision
    items = ((cfg.task_args or {}).get("host") or {}).get("window_items")
    if (not seen and observed.get("host_loss") is not None and (len(spike) == 1 or items)
            and bundle.get("world_size", 1) == 1 and bundle.get("host") == "transformers"):
        # A Hugging Face step on one process whose loss the replay computes as the Trainer did (one micro-batch, or a loss divided
        # by the window's num_items_in_batch, summed over its micro-batches; under DDP it is the ranks' mean): the replay must
        # give the Trainer's loss, or it replays another loss than the run's (one without its num_items_in_batch did).
        # (Monitor's is the user's backward, whose RNG point may be the previous step's end: not compared.)
        seen, tolerance = {"loss": observed["host_loss"]}, "host" if tolerance == "fp32" else tolerance
    why = None
    if seen and not matches_observed(here["loss"], float("nan"), {"loss": seen["loss"]}, tolerance):
        why = f"the replay's loss {here['loss']:.6g} differs from the observed {float(seen['loss']):.6g}"
    elif seen and not matches_observed(here["loss"], here["grad_norm"], seen, tolerance):
        why = (f"the replay's grad norm {here['grad_norm']:.6g} differs from the observed "
               f"{float(observed['grad_norm']):.6g} (the loss is the same)")
    elif not test["spike"]:
        why = (f"the replay's loss {here['loss']:.4g} is no spike by the guard's rule (x{test.get('ratio', float('nan')):.3g} "
               f"the median, z {test.get('zscore', float('nan')):.3g})")
    replays_s = time.perf_counter() - start
    m: dict[str, Any] = {"reproduces": why is None, "why_not_reproducible": why, "loss": here["loss"],
                         "precision": precision, "step": bundle["step"]}
    # A model with dropout: is the window a spike with it off? (else the step's own draw made it: no sample is to blame)
    m["dropout"] = _dropout_draw(bench, spike, rule, cfg.guard.spike_ratio, here["loss"], context) if why is None else None
    samples_rows, m["samples"], m["samples_note"] = (
        _samples(bench, spike, rule, here.get("grads"), cfg.guard.spike_ratio, dropout=m["dropout"] is not None)
        if why is None and not (m["dropout"] or {}).get("made_by_draw") else ([], None, None))
    samples_s = time.perf_counter() - start - replays_s  # (spread: the share of samples a spike by the rule alone)
    m["spread"] = sum(rule(r["loss_sum"] / (r["count"] or 1))["spike"] for r in samples_rows) / max(len(samples_rows), 1)
    ordinary_steps = [bench.step(c) for c in context]
    ordinary = _typical(ordinary_steps) if context else None
    m["steps"] = _step_sizes(observed.get("history") or [], ordinary_steps or [here], not ordinary_steps) if why is None else None
    m["older"], m["where"] = _older(bench, bundle, cfg, spike, context, rule, here["loss"]) if why is None else (None, {})
    if m["older"] is None and context and why is None:  # no older state: are the ordinary windows high under this one?
        now = sum(bench.loss(c) for c in context) / len(context)
        m["ordinary_now"] = {"loss": now, "spike": bool(rule(now)["spike"])}
    m["jumps"] = ({"grad_norm": jumps(here["grad_norms"], ordinary["grad_norms"]),
                   "update_ratio": jumps(here["update_ratios"], ordinary["update_ratios"])} if ordinary else {})
    m["surges"] = [{**r, "step": bundle["step"]} for r in here.get("surges", [])]
    # the interval's losses before the spike, against the rule's window (a climb before a surging update)
    m["climb"] = [[int(t), float(x), rule(float(x)).get("ratio", float("nan"))] for t, x, *_ in observed.get("recent") or []
                  if x is not None and math.isfinite(float(x))]
    prev = bundle.get("previous")
    if prev and why is None:  # the update that led into the spike, replayed from the state before it
        before = ReplayBench(Replica(cfg, bench.task, prev, replica.device), bench.task)
        m["surges"] += [{**r, "step": prev["step"]} for r in before.step(before.groups(prev["window"]), signature=True)["surges"]]
        for k, v in before.passes.items():
            bench.passes[k] += v
    m["fp32"] = None
    if precision != "fp32" and why is None:
        fp32 = replica.precision(mode="fp32")
        full = bench.step(spike, fp32)
        m["fp32"] = {"loss": full["loss"], **{k: v for k, v in rule(full["loss"]).items() if k != "armed"}}
        if not m["fp32"]["spike"]:  # where the low-precision outputs first part from fp32's, and where it is lost
            m["where"] = _fp32_cure(bench, spike, rule, precision_departures(
                *bench.module_errors(spike, replica.model, bench.precision, fp32)))
    verdict = classify_spike(m)
    after, by_index = observed.get("after_spike"), bundle.get("sample_unit", "dataset index") == "dataset index"
    # The samples earlier spikes named (one process: by dataset index), the last one's too where it was an applied spike
    # (an adapter numbers samples by their place in the step: the same number in another step is another sample).
    earlier = {int(i): int(t) for i, t in observed.get("earlier_samples") or []} if by_index else {}
    if by_index and after and after.get("sample_unit", "dataset index") == "dataset index":
        earlier.update((int(i), int(after["step"])) for i in after.get("samples") or [])
    again = sorted(i for i in verdict["blamed_samples"] or [] if i in earlier)
    if again and m["reproduces"]:  # the same samples as an earlier spike's: they come back (each epoch), no aftershock
        steps = sorted({earlier[i] for i in again})
        verdict["evidence"] += (f"; sample{'s' if len(again) > 1 else ''} {', '.join(map(str, again))} carried the "
                                f"spike{'s' if len(steps) > 1 else ''} at step{'s' if len(steps) > 1 else ''} "
                                f"{', '.join(map(str, steps))} too: {'they come' if len(again) > 1 else 'it comes'} back")
    burst = observed.get("flagged_before") or {}
    if (verdict["failure_class"] == "data" and not verdict["blamed_samples"] and m["reproduces"]
            and burst.get("steps", 0) >= LEVEL_RUN):  # every window since is as high: a new level, not one batch
        verdict["level_shift"] = {"since": burst["since"], "steps": burst["steps"]}  # its burst goes on as its course
        verdict["evidence"] = verdict["evidence"].replace(": the batch itself is an outlier", ": not one outlier batch") + (
            f"; the loss has been at this level since step {burst['since']} ({burst['steps']} flagged steps in a row "
            "before this one): the data moved to a new level (a change in its distribution or targets), and the rule "
            "keeps flagging it against the level before (guard.on_spike=warn trains on)")
    # (a few named samples rule it out only where ordinary windows were measured normal under this state)
    named = bool(verdict["blamed_samples"]) and (m["older"] is not None and "no_context" not in m["older"]
                                                 or (m.get("ordinary_now") or {}).get("spike") is False)
    if not again and after and m["reproduces"] and not _rules_out_aftershock(verdict["failure_class"], m["older"],
                                                                             after["step"], named):
        # an earlier spike's update, applied, may have left the state off: say so
        gap = bundle["step"] - after["step"]
        verdict["evidence"] += (f"; {gap} step{'s' if gap != 1 else ''} after the spike at step {after['step']}"
                                + (f" ({after['class']})" if after.get("class") else "")
                                + ", whose update was applied: this may be its aftershock")
    if bundle.get("world_size", 1) > 1 and m["reproduces"] and "ranks" not in bundle["window"]:  # (one rank's window)
        verdict["evidence"] += (f"; the losses above are rank {bundle.get('rank', 0)}'s own window's (the step's logged "
                                "loss is the ranks' mean)")
    for row in m["surges"]:  # what an update clip for that layer would hold it to
        row["ordinary_ratio"] = (ordinary or {}).get("update_ratios", {}).get(row["name"])
    top = sorted(m["surges"], key=lambda r: -r["coord_factor"])[:5]
    out = {"step": bundle["step"], "rank": bundle.get("rank", 0), "epoch": bundle["window"]["epoch"], "anomaly": "spike",
           "loss": here["loss"], "grad_norm": here["grad_norm"], "spike_test": test, "reproduces": m["reproduces"],
           **verdict, "bad_samples": verdict["blamed_samples"], "samples": m["samples"], "sample_losses": samples_rows[:10],
           "num_samples": len(samples_rows) or sum(len(i) for i, _ in spike), "older": m["older"], "where": m["where"],
           "ordinary_now": m.get("ordinary_now"), "steps": m["steps"], "jumps": m["jumps"], "surges": top, "fp32": m["fp32"],
           "precision": precision, "dropout": m["dropout"],
           "spike_window": {"size": len(observed.get("spike_window") or []), "median": test.get("median"),
                            "mean": test.get("mean"), "std": test.get("std")},
           "observed": observed and {k: v for k, v in observed.items() if k not in ("spike_window", "context")},
           "stage": "none", "op": None, "direction": None, "module": verdict["blamed_module"], "origin": None,
           "first_nonfinite_param": None}
    out["summary"] = spike_summary(out)
    out["timings"] = {"replays_s": replays_s, "samples_s": samples_s, "total_s": time.perf_counter() - start}
    out["passes"] = bench.passes
    return out


def _fp32_cure(bench: ReplayBench, spike: list, rule: Any, where: dict[str, Any]) -> dict[str, Any]:
    """``where`` with ``cured_by`` (and ``cured_loss``): of the first module whose output departs from fp32's and the
    two that ran before it (nearest first), the first that, alone in fp32, makes the window no spike by the rule (a
    forward each): a value made in low precision may only show downstream (an offset added, rounding the signal
    away, then taken off: the module that takes it off departs, the one that added it loses it)."""
    for name in [where["first"], *where.get("upstream", [])] if where.get("first") else []:
        with ModuleFP32(name).installed(bench.replica.model):
            loss = bench.loss(spike)
        if math.isfinite(loss) and not rule(loss)["spike"]:
            return {**where, "cured_by": name, "cured_loss": loss}
    return where


def _rules_out_aftershock(cls: str, older: dict[str, Any] | None, earlier: int, named: bool = False) -> bool:
    """Whether the verdict rules out that an earlier spike's applied update made this one: a dropout draw, a precision
    loss, a few samples ``named`` whose removal makes the step normal under this state (ordinary windows are normal
    under it: the update left no state off), or a window that was high under a state from before that update (the
    state of step N is the one after step N's update: an interval's start before the earlier spike's step)."""
    return cls in ("dropout", "precision") or (cls == "data" and (named or older is not None and older["step"] < earlier))


def _step_sizes(history: list[list[Any]], steps: list[dict[str, Any]], own: bool = False) -> dict[str, Any] | None:
    """The whole model's update/weight ratio on ordinary windows under this state (their replayed steps' median; without
    one, the spike's own step's: ``own``) against the run's before it (the median of the last intervals' records: ``[step,
    lr, ratio]``) and the LR those ran at (``lr``, their median); None without two such records."""
    before = [(int(t), r, lr) for t, lr, r in history if isinstance(r, (int, float)) and math.isfinite(r) and r > 0]
    lrs = [float(lr) for *_, lr in before if isinstance(lr, (int, float)) and lr > 0]
    if len(before) < 2 or not steps:
        return None
    return {"now": statistics.median(s["update_ratio"] for s in steps), "before": statistics.median(r for _, r, _ in before),
            "upto": before[-1][0], **({"own": True} if own else {}), **({"lr": statistics.median(lrs)} if lrs else {})}


def _typical(steps: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per parameter, what the ordinary windows' steps show as usual: the median grad norm, and the smallest update
    ratio (an update clip holds the layer at twice it). A window next to the spike may be part of it (the surging
    update's own, another with the rare rows), so no single window sets either."""
    out: dict[str, dict[str, float]] = {}
    for key, pick in (("grad_norms", statistics.median), ("update_ratios", min)):
        names = steps[0].get(key, {})
        out[key] = {n: pick([s[key][n] for s in steps if n in s.get(key, {})]) for n in names}
    return out


def _older(bench: ReplayBench, bundle: dict[str, Any], cfg: Any, spike: list, context: list, rule: Any, loss: float
           ) -> tuple[dict[str, Any] | None, dict[str, Any]]:
    """The window and ordinary windows under the older state (``from``: the snapshot, else an older checkpoint), and where
    the outputs depart; ``loss``: the spike window's now. Without ordinary windows: what stands for them there
    (``ordinary_from``: :func:`~.spike.ordinary_stand_in`), the rule's median now. ``lr``: since then, or ``since``."""
    ref = bundle.get("reference")
    if not ref or ref.get("model") is None:
        return None, {}
    older = copy.deepcopy(bench.replica.model)
    older.load_state_dict(ref["model"])
    window_old = bench.loss(spike, older)
    seen, step, ratio = bundle.get("observed") or {}, int(ref.get("step", 0)), cfg.guard.spike_ratio
    since, after = int((seen.get("flagged_before") or {}).get("since", bundle["step"])), seen.get("after_spike") or {}
    if context:
        source, ordinary_old = "windows", sum(bench.loss(c, older) for c in context) / len(context)
        ordinary_now = sum(bench.loss(c) for c in context) / len(context)
    else:
        ordinary_now = rule(0.0).get("median") or float("nan")
        source, ordinary_old = ordinary_stand_in(step, since, seen.get("spike_window") or [], after, ordinary_now,
                                                 loss <= ratio * window_old)
    high = window_old > ratio * ordinary_old if ordinary_old is not None and math.isfinite(ordinary_old) else source == "capture"
    lrs = {g["lr"] for g in (lr_groups(bundle.get("optimizer")) or {}).get("param_groups", [])}  # (one LR: the records')
    kept = [(int(t), float(x)) for t, x, *_ in seen.get("history") or [] if step <= t < since and isinstance(x, float) and x > 0]
    ran, now_lr = [r for r in kept if r[0] > step], lrs.pop() if len(lrs) == 1 and min(lrs) > 0 else None
    low = [r for r in kept if r[1] * LR_RISE <= now_lr] if ran and now_lr else []  # the last record before a jump
    lr = ({"then": (low or ran)[-1][1], "now": now_lr, "since": (low or ran)[-1][0]} if ran and now_lr
          else lr_change(ref.get("optimizer"), bundle.get("optimizer")))
    spike_now = bool(context and math.isfinite(ordinary_now) and rule(ordinary_now)["spike"])
    info = {"step": step, "from": ref.get("from", "snapshot"), "window": window_old, "ordinary": ordinary_old,
            "current_ordinary": ordinary_now, "ordinary_from": source, "lr": lr,
            "window_high": bool(math.isfinite(window_old) and high), "ordinary_spike_now": spike_now,
            "ordinary_then_high": bool(context and rule(ordinary_old)["spike"]),
            "ordinary_high": spike_now or bool(context and math.isfinite(ordinary_now) and ordinary_now > ratio * ordinary_old),
            "window_not_above_now": bool(context and math.isfinite(ordinary_now) and loss <= ratio * ordinary_now),
            "ratio": ratio, **({} if context else {"no_context": True}),
            "ordinary_step": {"step": step + 1, "capture": after.get("step")}.get(source)}
    now, order = bench.module_rms(spike, bench.replica.model)
    return info, departures(now, bench.module_rms(spike, older)[0], order)
