"""The health summary's loss sentence: the train loss from one end of the run to the other, read robustly.

An interval's mean is the headline's figure at each end unless a few large losses (a spike) lifted it; then the
median of the end intervals' means, and the words saying so. A run that got worse since its best interval says how
far; a run that stalled (no gradient reached the parameters), since when. Then the validation loss's trend.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .rundata import RunData
from .text import fmt_num, fmt_ranges

__all__ = ["loss_sentence", "LOSS_ENDS"]

LOSS_ENDS = 5
#: A loss that rose from its best interval is said to have risen only by more than this share of the run's descent to it.
RISE_FLOOR = 0.005
#: Whether the loss rose since its best is read over stretches of at least this many steps where the log intervals are
#: SHORT_INTERVAL steps or fewer (log.every=1: one step's loss against another's is the batches' noise): merged.
ROSE_STEPS, SHORT_INTERVAL = 10, 2


def loss_sentence(run: RunData, h: Any) -> None:  # h: report.health.Health (which imports this module)
    """The sentence on the train loss (from its first interval to its last, robust to a few huge losses) and the
    validation loss, into ``h``."""
    f = h.figures
    rows = [(int(r["step"]), r["interval_steps"], r["loss"],
             r["loss_min"] if isinstance(r.get("loss_min"), (int, float)) else r["loss"],  # (a null one: the mean)
             int(r["loss_steps"]) if isinstance(r.get("loss_steps"), (int, float)) else r["interval_steps"])  # its mean is over
            for r in run.metrics if isinstance(r.get("loss"), float) and math.isfinite(r["loss"])]
    text, tail = "", 0
    if rows:
        f["loss_first"], f["loss_last"] = rows[0][2], rows[-1][2]  # the interval means, as metrics.jsonl has them
        # (a run that ended where it was to end: a short last interval is read with the one before; not a stopped one's)
        ended = "stop" not in f and "crash" not in f and not (isinstance(f.get("max_steps"), int)
                                                              and f.get("last_step", 0) < f["max_steps"])
        heads, tail = _with_tail(rows) if ended else (rows, 0)
        events = run.counted_events("spike")
        spikes = sorted({e.step for e in events})
        own = {e.step: float(e.extra["loss"]) for e in events if isinstance(e.extra.get("loss"), (int, float))}
        ratio = run.cfg("guard.spike_ratio", 2.0)
        ratio = float(ratio) if isinstance(ratio, (int, float)) and ratio > 1 else 2.0
        # The run's first interval holds its descent: only a spike or an early outlier (the rule not armed yet) lifts it
        early = sorted({*spikes, *(e.step for e in run.counted_events("early_outlier"))})
        (f["loss_start"], start), (f["loss_end"], end) = (_robust_end(heads, early, ratio, "first", own, descent=True),
                                                          _robust_end(heads[::-1], spikes, ratio, "last", own))
        text = f"Train loss {fmt_num(f['loss_start'])} → {fmt_num(f['loss_end'])}"
        if len(heads) == 1:  # one interval: no "X → X"
            text = f"Train loss {fmt_num(f['loss_start'])} (one interval)" + (
                f" ({_why(heads[0], early, 'only', set(early) - set(spikes))})" if start else "")
        elif start is None and end is None:
            text += f" (first → last interval{f' with the {tail}-step one after it' if tail else ''})"
        else:
            why = "; ".join(w for w in (start and _why(heads[0], early, "first", set(early) - set(spikes)),
                                        end and _why(heads[-1], spikes, "last")) if w)
            text += f" ({start or 'first interval'} → {end or 'last interval'}: {why})"
    level = "ok"
    after = [r for r in run.metrics if rows and isinstance(r.get("step"), (int, float)) and r["step"] > rows[-1][0]]
    if after:  # its last intervals had no finite loss: the headline's end is the last finite one's, said so
        level = "warn"
        first = min(int(r["step"]) - int(r.get("interval_steps") or 1) + 1 for r in after)
        # (the last finite interval's own last steps may have had none either: its nonfinite events say which)
        bad = {e.step for e in run.counted_events("nonfinite") if _nonfinite(e.extra.get("loss"))}  # (an update's: none)
        while first - 1 in bad and first - 1 > rows[-1][0] - rows[-1][1]:
            first -= 1
        text = text.replace("last interval", "last finite interval") + (
            f"; from step {first:,} on no step's loss was finite ({len(after)} interval{'s' if len(after) > 1 else ''} "
            f"after step {rows[-1][0]:,})")
    # (intervals of a step or two, log.every=1: a single step's loss against another's is the batches' noise, not a rise;
    # read over stretches of ROSE_STEPS steps at least where they merge, half that at least where a gap cuts one short)
    short = bool(rows) and statistics.median(r[1] for r in rows) <= SHORT_INTERVAL
    judged = [r for r in _stretches(rows) if r[1] >= ROSE_STEPS // 2] if short else rows
    if len(judged) > (1 if short else 2):  # (short: up to the last stretch a gap left whole, its end step said)
        best_step, best_width, best, *_ = min(judged, key=lambda r: r[2])
        # (an end read as a median of the last intervals reaches back to where the loss was still falling: whether the
        # loss rose since its best is the last interval's own smallest loss's to say; 'rose x3.71' for one that fell)
        # (a short tail that holds a spike step, which the end excludes: its smallest loss is the spike's, read with
        # the interval before it; a tail of no spike whose smallest loss rose did rise)
        lifted = tail and any(rows[-1][0] - rows[-1][1] < s <= rows[-1][0] for s in spikes)
        now = (heads[-1] if lifted else rows[-1])[3] if end is not None and len(rows) > 1 else f["loss_end"]
        # it got worse since: how far; by more than RISE_FLOOR of the run's own descent (x7 on a memorized 1e-9 is
        # float32 noise, not a divergence)
        if short:  # (the last stretch's mean, or its smallest loss where spikes lifted the end)
            now = judged[-1][3] if end is not None else judged[-1][2]
        if best > 0 and now > ratio * best and best_step != judged[-1][0] and now - best > RISE_FLOOR * (f["loss_start"] - best):
            level = "warn"
            width = int(judged[-1][1])
            upto = f" to step {judged[-1][0]:,}" if judged[-1][0] != rows[-1][0] else ""
            last, mean = ((f"the {'smallest loss' if end is not None else 'mean'} of its last {width} steps{upto}",
                           f"its best {int(best_width)} steps' mean") if short
                          else ("its last interval's smallest loss", "its best interval's mean"))
            own = "" if now == f["loss_end"] and not short else f" ({last}, {fmt_num(now)})"
            f["loss_rose"] = {"factor": now / best, "best": best, "best_step": int(best_step), "from": mean,  # (the clip
                              "best_of": mean.removesuffix(" mean").removesuffix("'s").removesuffix("'")}  # verdict's, the
            # last line's: 'its best interval', 'its best 10 steps')
            text += f"; it rose x{now / best:.3g}{own} from {mean}, {fmt_num(best)} at step {best_step:,}"
    stall = f.get("stall")  # (health's, said above it): an end loss the parameters stopped moving at is not learning's
    if rows and stall and stall["recovered"] is None:
        level = "warn"
        since = "on any step" if stall["since"] <= rows[0][0] - rows[0][1] + 1 else f"from step {stall['since']:,} on"
        text += f"; no gradient reached the parameters {since} (stalled, above)"
    steps, vals = run.series("val_loss")
    val = [(s, v) for s, v in zip(steps, vals) if math.isfinite(v)]
    if val:
        best_step, best = min(val, key=lambda sv: sv[1])
        f.update(val_first=val[0][1], val_last=val[-1][1], val_best=best, val_best_step=int(best_step))
        if len(val) == 1:
            part = f"validation loss {fmt_num(val[0][1])} at step {int(val[0][0]):,}"
        else:
            f["val_fell"] = val[-1][1] < val[0][1]
            trend = "fell" if f["val_fell"] else "did not fall"
            level = level if f["val_fell"] else "warn"
            part = (f"validation loss {trend}: {fmt_num(val[0][1])} at step {int(val[0][0]):,} → {fmt_num(val[-1][1])} at step "
                    f"{int(val[-1][0]):,}, best {fmt_num(best)} at step {int(best_step):,}")
        text = f"{text}; {part}" if text else part[0].upper() + part[1:]
    if text:
        h.say(level, text + ".")


def _nonfinite(value: Any) -> bool:
    """Whether ``value`` (an event's loss: a float, or "nan", "inf" as metrics write them) is a non-finite number."""
    try:
        return value is not None and not math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def _stretches(rows: list[tuple]) -> list[tuple]:
    """``rows`` (short intervals) merged into adjacent stretches of :data:`ROSE_STEPS` steps at least, counted from the
    end (the last stretch whole); rows with a gap between them (intervals of no finite loss) are not merged."""
    out: list[tuple] = []
    for row in reversed(rows):
        if out and out[-1][1] < ROSE_STEPS and out[-1][0] - out[-1][1] == row[0]:
            step, width, mean, low, finite = out[-1]
            total = finite + row[4]
            out[-1] = (step, width + row[1], (mean * finite + row[2] * row[4]) / max(total, 1), min(low, row[3]), total)
        else:
            out.append(row)
    return out[::-1]


def _with_tail(rows: list[tuple]) -> tuple[list[tuple], int]:
    """``rows`` with a short last interval (half the width of the one before or less: ``train.max_steps`` not a multiple of
    the log interval) merged into the one before, its mean over both's steps (a trial: a 2-step tail's 1.239 read as the
    run's end beside intervals falling 0.99 -> 0.75); and the tail's width (0: none merged)."""
    if len(rows) < 4 or 2 * rows[-1][1] > rows[-2][1] or rows[-1][0] - rows[-1][1] != rows[-2][0]:  # (3 kept at least;
        # the two adjacent: no interval of no finite loss between them)
        return rows, 0
    (_, width, mean, low, finite), (step, tail, tail_mean, tail_low, tail_finite) = rows[-2], rows[-1]
    merged = (mean * finite + tail_mean * tail_finite) / max(finite + tail_finite, 1)
    return [*rows[:-2], (step, width + tail, merged, min(low, tail_low), finite + tail_finite)], int(tail)


def _robust_end(rows: list[tuple], spikes: list[int], ratio: float, end: str,
                own: dict[int, float] | None = None, descent: bool = False) -> tuple[float, str | None]:
    """The loss at one end of the run: its end interval's mean, unless a few large losses made that mean and not the
    interval's typical loss; then the median of the :data:`LOSS_ENDS` end intervals' means (of those without a spike
    event when spikes lift most of them: spikes that recur every epoch), and the words saying so.

    A few large losses: the interval holds a loss spike (an event), or its mean is above ``ratio`` times that median
    (the guard's spike ratio) while its smallest loss is not (most of its steps are typical). A run whose loss is
    still falling fast at the start, or that diverges at the end, has its smallest losses high too (or spike events on
    half its steps or more): its mean stands.
    ``rows`` are (step, interval steps, mean loss, smallest loss, the finite steps it is a mean of) from that end
    inward. A run of fewer than 6
    intervals has no end intervals of its own to take a median of (it reached back to the other end: "10.39 → 10.39,
    rose x2.51" for a loss that fell): the end interval's mean without its spike steps' own losses (``own``: the spike
    events'), where each is known. ``descent``: ``rows[0]`` is the run's first interval, whose first losses are its
    fast fall (34 -> 0.04 in 10 steps was "lifted by a few large losses"): its mean stands unless ``spikes`` (and early
    outliers) fall in it.
    """
    step, width, mean, low, finite = rows[0]
    ends = min(LOSS_ENDS, max(3, len(rows) // 2))  # a short run: the two ends share as few intervals as they can
    near = [r[2] for r in rows[:ends]]
    median = statistics.median(near)
    # (its smallest loss high too: most of its steps are, a divergence's course, not a few large losses; so are
    # spikes on half its steps or more: a loss that rose and stayed, above the rule's frozen window)
    inside = sum(step - width < s <= step for s in spikes)
    if descent and not inside and step - width <= 0:
        return mean, None
    spiky = ((inside or mean > ratio * median) and low <= ratio * median and 2 * inside < width)
    if not spiky:
        return mean, None
    mine = [own.get(s) for s in spikes if step - width < s <= step] if own else []
    without = None
    if mine and None not in mine and finite > len(mine):  # (a skipped non-finite step: not in its mean)
        without = (mean * finite - sum(mine)) / (finite - len(mine))
        without = without if low - 1e-6 * abs(low) <= without <= mean else None  # (a record from before loss_steps: over
    bare = (without, f"{end} interval without its spike step{'s' * (len(mine) > 1)}")  # every step, a NaN one too)
    if len(rows) < 6 and without is not None:
        return bare
    if len(near) < 3:  # too few intervals for a typical value: the mean stands, and the words say what lifted it
        return mean, f"{end} interval"
    quiet = [r[2] for r in rows[:ends] if not any(r[0] - r[1] < s <= r[0] for s in spikes)]
    lifted = [r for r in rows[:ends] if any(r[0] - r[1] < s <= r[0] for s in spikes)]
    if quiet and 2 * len(lifted) >= len(near):  # spikes on most of the end intervals
        if all(r[3] <= ratio * statistics.median(quiet) for r in lifted):  # they recur (every epoch), their lows typical
            typical = statistics.median(quiet)
            return (typical, (f"median of the means of the {len(quiet)} of the {end} {len(near)} intervals without a "
                              "loss spike")) if typical < mean else (mean, None)
        return mean, None  # their smallest losses high too: the loss rose past the quiet ones and stayed (a divergence)
    # (a figure no lower than the mean it replaces was not lifted: a loss still falling puts the intervals before the
    # last above it, and "0.008788 is lifted by loss spikes" then gave way to 0.009096, a trial's)
    # (the median no lower, a loss still falling: the interval's own steps without its spike's, where each is known; an
    # adapter's end, its short tail merged into the interval of the spike, read as the plain mean with the spike in it)
    return ((median, f"median of the {end} {len(near)} intervals' means") if median < mean else
            bare if without is not None and without < mean else (mean, None))


def _why(row: tuple, spikes: list[int], end: str, outliers: set[int] = frozenset()) -> str:
    """Why the headline did not take the ``end`` interval's mean: its value and what lifted it (``outliers``: those of
    ``spikes`` that were early outliers, before the spike rule armed, not spikes by it)."""
    step, width, mean = row[:3]
    inside = [s for s in spikes if step - width < s <= step]
    early = [s for s in inside if s in outliers]
    spiky = f"a loss spike at step {fmt_ranges(inside)}" if len(inside) == 1 else f"loss spikes at steps {fmt_ranges(inside)}"
    lifted = ("a few large losses" if not inside else spiky if not early else
              f"{'early outliers at steps' if len(early) > 1 else 'an early outlier at step'} {fmt_ranges(early)} (before "
              "the spike rule armed)" if early == inside else f"loss spikes and early outliers at steps {fmt_ranges(inside)}")
    return f"the {end} interval's mean, {fmt_num(mean)}, is lifted by {lifted}"
