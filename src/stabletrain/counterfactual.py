"""A loss spike's doctor: replay its step from the exact pre-step state, change one thing at a time, name the cause.

:func:`diagnose_spike` reads a spike's bundle (``incidents/step_N``: the state before the step, its window, the
guard's window of losses the rule judged it against, the state at the interval's start and a few ordinary
windows) and replays, each time from the same saved state and RNG streams, on a :class:`~stabletrain.replica.Replica`:

1. the step itself, with the run's own step: the same loss (bitwise in fp32)? a spike by the guard's rule?
2. each sample alone (forward; a backward each for its share of the window's gradient, up to
   :data:`~.spike_samples.MAX_GRAD_SAMPLES` samples): which samples carry the loss; the step without the fewest that
   could, replayed: normal by the rule? (greedy by loss is exact for a mean-loss rule; where the loss couples the
   samples, a batch norm's, by removal: :mod:`.spike_samples`)
3. the window and ordinary windows under the older state (the interval's start; without ordinary windows, what stands for
   them there, if anything): is the batch itself an outlier, or did the state drift?
4. each module's output magnitude on the window under both states (where it departs first), each parameter's gradient
   and update against the ordinary windows' median (which layers jumped), Adam's second moment against the gradients
   of the spike's step and of the step before it, replayed from the state before that one (:func:`~.spike_evidence.adam_surges`);
5. under bf16/fp16, the step in fp32: normal there? (and each module against its fp32 output: where precision loses it)
6. with dropout, the window with every dropout off: a spike still? (else the step's own masks made it)

:func:`~stabletrain.diagnostics.spike.classify_spike` reads them; the model, RNG streams and task are left as they were.
Cost: about 2N + 8 forward and N + 4 backward passes for a window of N samples, and up to
:data:`~.spike_samples.MAX_BISECT_REPLAYS` forward passes more where the samples are found by their removal (N + a few, N <= 64;
a window of 8 or fewer whose falls misled, up to :data:`~.spike_samples.MAX_SUBSETS` more).
"""

from __future__ import annotations

import contextlib
import copy
import math
import random
import statistics
import time
from typing import Any

import torch

from .config import config_from_dict
from .diagnostics.cures import ModuleFP32
from .diagnostics.diagnosis import matches_observed
from .diagnostics.spike import DATA_SHARE, LR_RISE, classify_spike, ordinary_stand_in, spike_summary
from .diagnostics.spike_evidence import departures, jumps, lr_change, lr_groups, precision_departures
from .numerics import param_update_norms, unique_params, update_totals
from .policies.guard import spike_test
from .policies.precision import resolve_device
from .records.bundles import with_sample_ranks
from .replica import Replica
from .seeding import kept_rng
from .services.replay_bench import ReplayBench
from .services.spike_reference import HISTORY_INTERVALS, MAX_CONTEXT, update_jump, update_level_jump
from .spike_samples import dropout_draw, loss_tail, tail_note, weigh_samples

__all__ = ["diagnose_spike"]

#: A data spike with no sample to blame, right after this many flagged steps in a row, is a level shift (the data moved).
LEVEL_RUN = 5
#: The spike window's excess over ordinary windows' loss under the older state, as a share of its excess now, from which
#: the window counts as high there too below guard.spike_ratio times theirs (at sqrt of it at least, ordinary windows not
#: risen past sqrt of it since, the window a spike against them now): the batch's, not the updates since (``older["held"]``).
HELD_SHARE = 1 / 3
#: A data spike's named samples are weighed against at most this many others (each alone: one forward pass each).
TAIL_SAMPLES = 256


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
    m["dropout"] = dropout_draw(bench, spike, rule, cfg.guard.spike_ratio, here["loss"], context) if why is None else None
    samples_rows, m["samples"], m["samples_note"] = (
        weigh_samples(bench, spike, rule, here.get("grads"), cfg.guard.spike_ratio, dropout=m["dropout"] is not None)
        if why is None and not (m["dropout"] or {}).get("made_by_draw") else ([], None, None))
    samples_s = time.perf_counter() - start - replays_s  # (spread: the share of samples a spike by the rule alone)
    m["spread"] = sum(rule(r["loss_sum"] / (r["count"] or 1))["spike"] for r in samples_rows) / max(len(samples_rows), 1)
    ordinary_steps = [bench.step(c) for c in context]
    ordinary = _typical(ordinary_steps) if context else None
    history = (observed.get("history") or [])[-HISTORY_INTERVALS:]  # (the last intervals; all it holds: a level's rise)
    m["steps"] = _step_sizes(history, ordinary_steps or [here], not ordinary_steps) if why is None else None
    lrs = {g["lr"] for g in (lr_groups(bundle.get("optimizer")) or {}).get("param_groups", [])}
    if m["steps"] is not None and len(lrs) == 1 and min(lrs) > 0:  # the LR this state steps at (one group's, or all alike)
        m["steps"]["lr_now"] = float(lrs.pop())
    m["update_jump"] = update_jump(history)
    m["update_level"] = update_level_jump(observed.get("history") or [])
    m["stretch_lrs"] = observed.get("stretch_lrs")  # (a host's steps' LRs since the interval's snapshot)
    m["older"], m["where"] = _older(bench, bundle, cfg, spike, context, rule, here["loss"]) if why is None else (None, {})
    if m["older"] is None and context and why is None:  # no older state: are the ordinary windows high under this one?
        now = sum(bench.loss(c) for c in context) / len(context)
        m["ordinary_now"] = {"loss": now, "spike": bool(rule(now)["spike"]) and past_spread(observed, now, cfg.guard.spike_ratio)}
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
        if m["older"] is not None and context and m["surges"] and m["surges"][-1]["step"] == prev["step"]:
            # ordinary windows under the state before that surging update: was it off already? (an aftershock's is)
            m["older"]["ordinary_previous"] = sum(before.loss(c) for c in context) / len(context)
        for k, v in before.passes.items():
            bench.passes[k] += v
    m["fp32"] = None
    blocked = precision != "fp32" and why is None and bench.autocast_inside(spike, replica.precision(mode="fp32"))
    if precision != "fp32" and why is None and not blocked:  # (the loss's own autocast: no fp32 step to weigh; said below)
        fp32 = replica.precision(mode="fp32")
        full = bench.step(spike, fp32)
        m["fp32"] = {"loss": full["loss"], **{k: v for k, v in rule(full["loss"]).items() if k != "armed"}}
        if not m["fp32"]["spike"]:  # where the low-precision outputs first part from fp32's, and where it is lost
            m["where"] = _fp32_cure(bench, spike, rule, precision_departures(
                *bench.module_errors(spike, replica.model, bench.precision, fp32)))
    verdict = classify_spike(m)
    if verdict["failure_class"] == "data" and (m["samples"] or {}).get("copies"):  # (one input repeated: one defect)
        verdict["evidence"] += (f"; they are {m['samples']['copies']} copies of one sample, alike in every value (a "
                                "duplicated row or shard: the data's, not many bad samples)")
    found = m["samples"]  # (a precision spike's samples: where the rounding lands, said; the cure is the module's or dtype's)
    if verdict["failure_class"] == "precision" and found and found["share"] >= DATA_SHARE and m["reproduces"]:
        n = len(found["indices"])
        verdict["evidence"] += (f"; in {precision} sample{'s' * (n > 1)} {', '.join(map(str, found['indices']))} carr"
                                f"{'y' if n > 1 else 'ies'} {100 * found['share']:.0f}% of the window's loss (without "
                                f"{'them' if n > 1 else 'it'} the step is normal: where the rounding bites)")
    if blocked:
        verdict["evidence"] += (f"; precision is not ruled out: a replay of the step in fp32 runs in {precision} too (the "
                                "loss function turns torch.autocast on itself; enter it through the adapter, e.g. "
                                "Monitor.autocast(), and a replay can turn it off)")
    back = observed.get("older_before_spike")
    if back and back.get("found", True) and m["older"] is not None and m["reproduces"]:  # (a state from before a drift)
        m["older"]["before_spike"] = back["spike"]
        verdict["evidence"] += (f"; the older state is step {m['older']['step']}'s, from before the spike at step "
                                f"{back['spike']} that began a drift: a newer one, step {back['instead_of']}'s, is in "
                                "its course")
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
    if verdict["failure_class"] == "data" and verdict["blamed_samples"] and m["reproduces"] and observed.get("burst"):
        verdict["burst_samples"] = _burst_samples(bench, observed["burst"], rule, cfg.guard.spike_ratio,
                                                  m["dropout"] is not None)
        verdict["evidence"] += "".join(
            f"; the burst's step {b['step']}: sample{'s' if len(b['samples']) > 1 else ''} "
            f"{', '.join(map(str, b['samples']))} carr{'y' if len(b['samples']) > 1 else 'ies'} {100 * b['share']:.0f}% of "
            "its window's loss, without them normal (verified under this state)" for b in verdict["burst_samples"])
    burst = observed.get("flagged_before") or {}
    if (verdict["failure_class"] == "data" and not verdict["blamed_samples"] and m["reproduces"]
            and burst.get("steps", 0) >= LEVEL_RUN):  # every window since is as high: a new level, not one batch
        verdict["level_shift"] = {"since": burst["since"], "steps": burst["steps"]}  # its burst goes on as its course
        verdict["evidence"] = verdict["evidence"].replace(": the batch itself is an outlier", ": not one outlier batch") + (
            f"; the loss has been at this level since step {burst['since']} ({burst['steps']} flagged steps in a row "
            "before this one): the data moved to a new level (a change in its distribution or targets), and the rule "
            "keeps flagging it against the level before (guard.on_spike=warn trains on)")
    alone = [i for idx, _ in spike for i in idx]  # (not a level shift's: the data moved, not one sample)
    if (verdict["failure_class"] == "data" and not verdict["blamed_samples"] and len(alone) == 1 and m["reproduces"]
            and "level_shift" not in verdict):
        verdict["blamed_samples"] = alone  # a window of one sample: the outlier batch is that sample (batch size 1)
        verdict["evidence"] += f"; the window is one sample, {alone[0]}: the batch is that sample"
    tail_from = time.perf_counter()  # (after a window of one sample is named: it is that sample)
    tail = (loss_tail(bench, _tail_pool(bench, spike, context, bundle["step"], by_index), samples_rows,
                      verdict["blamed_samples"], dropout=m["dropout"] is not None)
            if verdict["failure_class"] == "data" and verdict["blamed_samples"] and m["reproduces"] else None)
    tail_s = time.perf_counter() - tail_from
    if tail is not None:  # beyond the data's spread, or other samples as lossy (a batch that drew its hard ones together)
        verdict["tail"] = tail  # (said after the verified removal: what the samples are comes before what else holds)
        text = verdict["evidence"]  # (before the notes on what else holds: the older state's, samples back, a burst's)
        back = text.find(" carried the spike")  # ('; samples 3, 9 carried the spikes at steps ...: they come back')
        cut = min([i for i in (text.find("; the window is high under the state of step"), text.find("; the burst's step"),
                               text.rfind("; ", 0, back) if back > 0 else -1) if i > 0] or [len(text)])
        verdict["evidence"] = f"{text[:cut]}; {tail_note(tail)}{text[cut:]}"
    # (a few named samples rule it out only where ordinary windows were measured normal under this state)
    named = bool(verdict["blamed_samples"]) and (m["older"] is not None and "no_context" not in m["older"]
                                                 or (m.get("ordinary_now") or {}).get("spike") is False)
    if not again and after and m["reproduces"] and not _rules_out_aftershock(verdict["failure_class"], m["older"],
                                                                             after["step"], named):
        # an earlier spike's update, applied, may have left the state off: say so
        gap = bundle["step"] - after["step"]
        note = (f"{gap} step{'s' if gap != 1 else ''} after the spike at step {after['step']}"
                + (f" ({after['class']})" if after.get("class") else "")
                + ", whose update was applied: this may be its aftershock")
        lead = verdict["failure_class"] == "state" and m["older"] is not None and m["older"]["step"] < after["step"]
        # (the state drifted since a state from before that spike: the aftershock leads, the console line is cut short)
        verdict["evidence"] = f"{note}; {verdict['evidence']}" if lead else f"{verdict['evidence']}; {note}"
    if bundle.get("world_size", 1) > 1 and m["reproduces"] and "ranks" not in bundle["window"]:  # (one rank's window)
        verdict["evidence"] += (f"; the losses above are rank {bundle.get('rank', 0)}'s own window's (the step's logged "
                                "loss is the ranks' mean)")
    usual = observed.get("layer_ratios") or {}
    for row in m["surges"]:  # the layer's update under this state on ordinary windows, and its usual one before the spike
        row["ordinary_ratio"] = (ordinary or {}).get("update_ratios", {}).get(row["name"])
        if usual.get(row["name"]):
            row["typical_ratio"] = usual[row["name"]]
        elif row.get("whole") and usual:  # (a layer silent for long has no usual update of its own: an ordinary layer's)
            row["typical_ratio"] = statistics.median(usual.values())
    top = sorted(m["surges"], key=lambda r: -r["coord_factor"])[:5]
    out = {"step": bundle["step"], "rank": bundle.get("rank", 0), "epoch": bundle["window"]["epoch"], "anomaly": "spike",
           "loss": here["loss"], "grad_norm": here["grad_norm"], "spike_test": test, "reproduces": m["reproduces"],
           **verdict, "bad_samples": verdict["blamed_samples"], "samples": m["samples"], "sample_losses": samples_rows[:10],
           "num_samples": len(samples_rows) or sum(len(i) for i, _ in spike), "older": m["older"], "where": m["where"],
           "ordinary_now": m.get("ordinary_now"), "steps": m["steps"], "jumps": m["jumps"], "surges": top, "fp32": m["fp32"],
           "precision": precision, "dropout": m["dropout"],
           "spike_window": {"size": len(observed.get("spike_window") or []), "median": test.get("median"),
                            "mean": test.get("mean"), "std": test.get("std")},
           "observed": observed and {k: v for k, v in observed.items() if k not in ("spike_window", "context", "layer_ratios")},
           "stage": "none", "op": None, "direction": None, "module": verdict["blamed_module"], "origin": None,
           "first_nonfinite_param": None}
    out["summary"] = spike_summary(out)
    out["timings"] = {"replays_s": replays_s, "samples_s": samples_s, "tail_s": tail_s, "total_s": time.perf_counter() - start}
    out["passes"] = bench.passes
    return with_sample_ranks(out, bundle)


def _tail_pool(bench: ReplayBench, spike: list, context: list, step: int, by_index: bool) -> list[int]:
    """The samples a data spike's named ones are weighed against (:func:`loss_tail`): the ordinary windows', and where
    samples are dataset indices, a draw of the dataset (seeded by the step, no global RNG touched) up to TAIL_SAMPLES."""
    own = {i for idx, _ in spike for i in idx}
    pool = list(dict.fromkeys(i for groups in context for idx, _ in groups for i in idx if i not in own))  # (windows
    # across an epoch's end hold a sample twice: counted once)
    size = 0
    with contextlib.suppress(TypeError):  # (a dataset of no length, or one whose __len__ says it has none)
        size = len(bench.task.train_data) if by_index else 0
    if size > len(own) + len(pool):
        draw = random.Random(step).sample(range(size), min(size, TAIL_SAMPLES + len(own) + len(pool)))
        seen = own | set(pool)
        pool += [i for i in draw if i not in seen][:max(TAIL_SAMPLES - len(pool), 0)]
    return pool[:TAIL_SAMPLES]


def _burst_samples(bench: ReplayBench, burst: list[list[Any]], rule: Any, bound: float, dropout: bool
                   ) -> list[dict[str, Any]]:
    """The samples that carry each window of a data spike's burst (``[[step, indices], ...]``: the flagged steps right
    after it, one process), weighed under the state before the spike and verified as the spike's are; the burst's first
    window that is no spike under it, or whose spike no few samples carry, ends the list. A rollback drops them all: one
    left out comes back the next epoch (a trial's second rollback)."""
    out = []
    for step, indices in burst:
        groups = bench.groups(indices)
        if not groups or not rule(bench.loss(groups))["spike"]:
            break
        _, found, _ = weigh_samples(bench, groups, rule, None, bound, dropout=dropout)
        if not found:
            break
        out.append({"step": int(step), "samples": list(found["indices"]), "share": float(found["share"])})
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


def past_spread(observed: dict[str, Any], loss: float, ratio: float) -> bool:
    """Whether ``loss`` (ordinary windows') is past the loss's own spread: where the loss curve's level before the spike
    (its intervals' means, spikes included: ``observed["level"]``) is ``ratio`` x the rule's median or more (a heavy-
    tailed loss: a small batch with label noise, x30 the median on a third of its steps), above ``ratio`` x that level
    (ordinary windows' mean under this state against the rule's median alone called a flat run drifted); else True."""
    window, level = sorted(observed.get("spike_window") or []), observed.get("level")
    median = window[(len(window) - 1) // 2] if window else None
    heavy = level is not None and median is not None and median > 0 and level > ratio * median
    return not heavy or not math.isfinite(loss) or loss > ratio * level


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
    held = (context and not high and all(map(math.isfinite, (window_old, ordinary_old, ordinary_now)))
            and loss > ratio * ordinary_now and 0 < ordinary_old and ordinary_now <= math.sqrt(ratio) * ordinary_old
            and window_old >= math.sqrt(ratio) * ordinary_old
            and window_old - ordinary_old >= HELD_SHARE * (loss - ordinary_now))
    # (or, while ordinary windows did not rise past sqrt(ratio), a third or more of its excess over them was there, the window
    # sqrt(ratio) x theirs there: the updates since lifted it past the bar, not to it; a trial's three rows at x50 inputs,
    # x1.81 ordinary windows' loss then and x2.14 now, were called the state's. A surge before it may still be the cause.)
    high = high or held
    lrs = {g["lr"] for g in (lr_groups(bundle.get("optimizer")) or {}).get("param_groups", [])}  # (one LR: the records')
    kept = [(int(t), float(x)) for t, x, *_ in (seen.get("history") or [])[-HISTORY_INTERVALS:]
            if step <= t < since and isinstance(x, float) and x > 0]
    ran, now_lr = [r for r in kept if r[0] > step], lrs.pop() if len(lrs) == 1 and min(lrs) > 0 else None
    low = [r for r in kept if r[1] * LR_RISE <= now_lr] if ran and now_lr else []  # the last record before a jump
    lr = ({"then": (low or ran)[-1][1], "now": now_lr, "since": (low or ran)[-1][0]} if ran and now_lr
          else lr_change(ref.get("optimizer"), bundle.get("optimizer")))
    spread = not past_spread(seen, ordinary_now, ratio)  # (ordinary windows within the loss's own spread: no drift)
    spike_now = bool(context and math.isfinite(ordinary_now) and rule(ordinary_now)["spike"] and not spread)
    info = {"step": step, "from": ref.get("from", "snapshot"), "window": window_old, "ordinary": ordinary_old,
            "current_ordinary": ordinary_now, "ordinary_from": source, "lr": lr,
            "window_high": bool(math.isfinite(window_old) and high),
            **({"held": (window_old - ordinary_old) / (loss - ordinary_now)} if held else {}),  # (its share of the excess)
            "ordinary_spike_now": spike_now,
            "ordinary_then_high": bool(context and rule(ordinary_old)["spike"]),
            # ordinary windows against the run's level before the spike (the rule's median), under either state
            **({"levels": [rule(ordinary_old).get("ratio"), rule(ordinary_now).get("ratio")], "median": rule(0.0).get("median"),
                "span": len(seen.get("spike_window") or [])}  # (the rule window's losses: the median's reach back)
               if context and math.isfinite(ordinary_old) and math.isfinite(ordinary_now) else {}),
            "ordinary_high": spike_now or bool(context and math.isfinite(ordinary_now) and ordinary_now > ratio * ordinary_old),
            "window_not_above_now": bool(context and math.isfinite(ordinary_now) and loss <= ratio * ordinary_now),
            "ratio": ratio, **({} if context else {"no_context": True}),
            **({"within_spread": seen["level"]} if context and spread else {}),
            "ordinary_step": {"step": step + 1, "capture": after.get("step")}.get(source)}
    # how far the weights moved since then, against their norm there: the update/weight ratio of the run's own records
    # (the trainable parameters, as the records' update/weight: a frozen backbone's norm would shrink the ratio)
    trained, then = unique_params(bench.replica.model), dict(older.named_parameters())
    pairs = ([(p, then[n].detach()) for n, p in trained] if all(n in then for n, _ in trained)
             else list(zip(bench.replica.model.parameters(), older.parameters())))  # (names that differ: every one)
    moved = update_totals(*param_update_norms([p for p, _ in pairs], [q for _, q in pairs]))
    info["moved"] = float(moved["update_ratio"]) if float(moved["param_norms"].norm()) > 0 else None
    now, order = bench.module_rms(spike, bench.replica.model)
    return info, departures(now, bench.module_rms(spike, older)[0], order)
