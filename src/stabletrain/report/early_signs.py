"""What came before trouble, in the report's health summary: the precursor's warnings and a run's early outliers.

``h``: the summary being written (:class:`~stabletrain.report.health.Health`: ``figures`` and ``say``).
"""

from __future__ import annotations

from typing import Any

from .rundata import RunData
from .text import fmt_num, plural

__all__ = ["precursor_sentence", "early_outlier_sentence", "PRECURSOR_LEAD"]


#: A precursor is said to have come before a spike when the spike followed within this many steps.
PRECURSOR_LEAD = 100


def precursor_sentence(run: RunData, h: Any) -> None:
    """The precursor warnings (guard.precursor): each with the spike it came before, if one followed."""
    steps = sorted({e.step for e in run.counted_events("precursor")})
    h.figures["precursor_steps"] = steps
    if not steps:
        return
    undone = {e.step for e in run.undone_events("spike")}  # a spike the run went back past still followed it
    spikes = sorted({*(h.figures.get("spike_steps") or []), *undone})
    parts = []
    last = max((int(r["step"]) for r in run.metrics if isinstance(r.get("step"), int)), default=None)
    for p in steps:
        after = next((s for s in spikes if p < s <= p + PRECURSOR_LEAD), None)
        gone = ", which the run went back past" if after in undone else ""
        # (a run that ended sooner had fewer steps in which one could follow: said so)
        within = (f"in the {plural(last - p, 'step')} the run went on" if last is not None and last - p < PRECURSOR_LEAD
                  else f"within {PRECURSOR_LEAD} steps")
        parts.append(f"step {p:,} ({plural(after - p, 'step')} before the spike at step {after:,}{gone})"
                     if after is not None else f"step {p:,} (no spike followed {within})")
    h.say("ok", f"{plural(len(steps), 'precursor warning')} (a layer's update/weight ratio departed from its history) at "
                + "; ".join(parts) + ".")


def early_outlier_sentence(run: RunData, h: Any) -> None:
    """A run's first losses far above every loss before them (``early_outlier`` events: before the spike rule arms, not
    judged, skipped or captured). They were in the timeline only: a run whose LR diverged it at step 2 said "No incidents"."""
    events = run.counted_events("early_outlier")
    h.figures["early_outlier_steps"] = [e.step for e in events]
    if not events:
        return
    against = [e.extra.get("against") or "the largest loss before it" for e in events]
    above = all(a.startswith("the largest loss before it") for a in against)  # (its note on a held-out outlier follows)
    shown = [f"step {e.step:,} (loss {fmt_num(e.extra.get('loss'))}, x{fmt_num(e.extra.get('factor'))} {what})"
             for e, what in zip(events[:4], against)]
    back = [_back_at(run, e) for e in events]
    spiked = any(b[2] for b in back if b)  # (an interval between with a spike: the same data again?)
    why = ((f"the loss was back by the next log interval{' without a loss spike' if spiked else ''} ("
            + ", ".join(f"{fmt_num(x)} at step {t:,}" for t, x, _ in dict.fromkeys(filter(None, back)))
            + ("): its batch (a corrupted sample?), not a divergence; the loss spikes between may be that data again"
               if spiked else "): a one-off step, its batch (a corrupted sample?), not a divergence"))
           if all(back) and above else
           "a run that jumps this far in its first steps may be diverging from the start (an LR too high for it?)"
           if above else
           "a first step far above the steps after it is its batch (a corrupted sample?) or a start far from where the "
           "run went; one far above those before it, a divergence from the start (an LR too high for it?)")
    h.say("warn", f"{plural(len(events), 'early outlier')} before the spike rule armed: {'; '.join(shown)}"
                  f"{' ...' if len(events) > 4 else ''}: not judged, skipped or captured; {why}.")


def _back_at(run: RunData, event: Any) -> tuple[int, float, bool] | None:
    """(the step, the mean loss, whether an interval with a spike came first) of the first log interval wholly after an
    early outlier, and without a loss spike of its own, whose loss is back within x2 of the level it stood out from (its
    loss over its factor), or None: none logged after it, or the loss stayed up. (An interval lifted by a later spike,
    the same corrupted data met again, said the start 'may be diverging'.)"""
    loss, factor = event.extra.get("loss"), event.extra.get("factor")
    if not (isinstance(loss, (int, float)) and isinstance(factor, (int, float)) and factor > 0):
        return None
    spikes, passed = [e.step for e in run.counted_events("spike")], False
    for r in run.metrics:
        step, n, mean = r.get("step"), r.get("interval_steps"), r.get("loss")
        if isinstance(step, int) and isinstance(n, (int, float)) and step - n >= event.step:  # (a later interval)
            if any(step - n < t <= step for t in spikes):
                passed = True
                continue
            return (step, float(mean), passed) if isinstance(mean, (int, float)) and mean <= 2 * loss / factor else None
    return None
