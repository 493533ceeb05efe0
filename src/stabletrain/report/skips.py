"""The report's sentence on skipped steps: the count from the metrics, the steps and reasons from the events; the fp16
GradScaler's routine back-off (a few overflows at a scale that recovers) is healthy, not worth a look."""

from __future__ import annotations

from typing import Any

from .rundata import Event, RunData
from .text import plural, routine_backoff, scale_note, skip_places, total_of, went_back

__all__ = ["skip_sentence"]


def skip_sentence(run: RunData, h: Any) -> list[Event]:  # h: report.health.Health (which imports this module)
    """Say the run's skipped steps with a level; put their figures in ``h.figures``; return the skip events counted."""
    f = h.figures
    skip_events = run.counted_events("skip")
    f["skipped_steps"] = total_of(run, "num_skipped") if run.metrics else len({e.step for e in skip_events})
    f["skip_steps"] = sorted({e.step for e in skip_events})
    undone = run.undone_events("skip")  # skipped before a rollback: that stretch was trained again
    f["skip_steps_undone"] = sorted({e.step for e in undone})
    if f["skipped_steps"] or skip_events:
        every = bool(run.metrics) and f["skipped_steps"] >= run.metrics[-1]["step"]  # (no update was ever applied)
        text = (("No update was applied: every step was skipped, " if every else "")
                + f"{plural(f['skipped_steps'], 'step')} skipped" + skip_places(skip_events))
        text += (" (events.jsonl does not say which)" if not skip_events else
                 f" (events.jsonl names {plural(len(f['skip_steps']), 'step')})" if len(f["skip_steps"]) != f["skipped_steps"]
                 else "")
        if undone:
            text += f"; before {went_back(undone)}, {plural(len(f['skip_steps_undone']), 'more step')}" + skip_places(undone)
        h.say("ok" if not undone and routine_backoff(run.metrics, skip_events, f["skipped_steps"]) else "warn",
              text + scale_note(run.metrics, skip_events) + ".")
    elif undone:
        h.say("warn", f"No steps skipped since {went_back(undone)}; before it {plural(len(f['skip_steps_undone']), 'step')} "
                      f"{'was' if len(f['skip_steps_undone']) == 1 else 'were'} skipped{skip_places(undone)}, and that "
                      "stretch was trained again.")
    else:  # (under fp16 the scale said too: a trial's report named it only where steps were skipped)
        h.say("ok", "No steps skipped" + (scale_note(run.metrics, held=True) if run.snapshot.get("precision") == "fp16"
                                          else "") + ".")
    return skip_events
