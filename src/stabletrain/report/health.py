"""The health summary: a few plain sentences about a run, computed from its metrics and events.

Each sentence carries a level (``ok``, ``warn``, ``bad``); the run's level is the worst of them. A
crash that ended the run comes first. Throughput is in the task's unit (``count_unit`` in the
snapshot: tokens or samples).
The numbers behind the sentences are in :attr:`Health.figures`, so a test (or a script) can check
them against ``metrics.jsonl`` directly.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from .rundata import Event, RunData
from .text import fmt_num, fmt_pct, fmt_ranges, plural

__all__ = ["Health", "health_summary", "incident_summary", "crash_summary", "crash_step", "LEVELS"]

LEVELS = ("ok", "warn", "bad")


@dataclass
class Health:
    """Sentences ``[(level, text)]`` in reading order, the overall level, and the figures behind them."""

    sentences: list[tuple[str, str]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    @property
    def level(self) -> str:
        return max((lvl for lvl, _ in self.sentences), key=LEVELS.index, default="ok")

    @property
    def text(self) -> str:
        """Return the sentences as one paragraph (for a terminal)."""
        return " ".join(s for _, s in self.sentences)

    def say(self, level: str, text: str) -> None:
        assert level in LEVELS, level
        self.sentences.append((level, text))


def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _total(run: RunData, key: str) -> int:
    return int(sum(r[key] for r in run.metrics if math.isfinite(r.get(key, math.nan))))


def _skip_reason(event: Event) -> str:
    reason = event.reason or "no reason given"
    return reason.split("skipped: ", 1)[1] if "skipped: " in reason else reason


def incident_summary(event: Event) -> str:
    """Return an incident's diagnosis summary, else why the diagnosis failed, else its reason."""
    diagnosis = event.extra.get("diagnosis")
    if isinstance(diagnosis, dict) and isinstance(diagnosis.get("summary"), str) and diagnosis["summary"]:
        return diagnosis["summary"]
    error = event.extra.get("diagnosis_error")
    if error:
        return f"the diagnosis failed ({error})"
    return event.reason or "no diagnosis recorded"


def health_summary(run: RunData) -> Health:
    """Return the health of ``run`` in plain words, with the figures each sentence states."""
    h = Health()
    f = h.figures
    f["count_unit"] = run.count_unit
    _crash(run, h)
    _progress(run, h)
    _losses(run, h)
    _clipping(run, h)

    # Skipped steps: the count from the metrics, the steps and reasons from the events.
    skip_events = run.counted_events("skip")
    f["skipped_steps"] = _total(run, "num_skipped") if run.metrics else len({e.step for e in skip_events})
    f["skip_steps"] = sorted({e.step for e in skip_events})
    if f["skipped_steps"] or skip_events:
        by_reason: dict[str, list[int]] = {}
        for e in skip_events:
            by_reason.setdefault(_skip_reason(e), []).append(e.step)
        # "at 812-813 (fp16 overflow)"; a reason with its own parentheses follows a colon instead
        parts = [f"at {fmt_ranges(steps)}" + (f": {reason}" if "(" in reason else f" ({reason})")
                 for reason, steps in by_reason.items()]
        text = f"{plural(f['skipped_steps'], 'step')} skipped" + (" " + "; ".join(parts) if parts else "")
        if not skip_events:
            text += " (events.jsonl does not say which)"
        elif len(f["skip_steps"]) != f["skipped_steps"]:
            text += f" (events.jsonl names {plural(len(f['skip_steps']), 'step')})"
        h.say("warn", text + ".")
    else:
        h.say("ok", "No steps skipped.")

    nonfinite_events = run.counted_events("nonfinite")
    f["nonfinite_steps"] = _total(run, "num_nonfinite") if run.metrics else len({e.step for e in nonfinite_events})
    if f["nonfinite_steps"]:
        first = min((e.step for e in nonfinite_events), default=None)
        if first is None:
            first = next(int(r["step"]) for r in run.metrics if r.get("num_nonfinite", 0) > 0)
            where = f"first in the interval ending at step {first:,}"
        else:
            where = f"first at step {first:,}"
        f["first_nonfinite_step"] = first
        h.say("warn", f"{plural(f['nonfinite_steps'], 'step')} had a non-finite loss or grad norm ({where}).")
    else:
        h.say("ok", "No non-finite losses or grad norms.")

    spikes = run.counted_events("spike")
    f["spike_steps"] = sorted({e.step for e in spikes})
    if spikes:
        h.say("warn", f"{plural(len(f['spike_steps']), 'loss spike')} at step {fmt_ranges(f['spike_steps'])}.")

    incidents = run.counted_events("incident")
    f["incidents"] = [(e.step, incident_summary(e)) for e in incidents]
    if incidents:
        listed = "; ".join(f"at step {s:,}, {summary.rstrip('.')}" for s, summary in f["incidents"][:5])
        more = f"; and {len(incidents) - 5} more" if len(incidents) > 5 else ""
        h.say("bad", f"{plural(len(incidents), 'incident')}: {listed}{more}.")
    else:
        h.say("ok", "No incidents.")

    _records(run, h)
    _throughput(run, h)
    f["num_problems"] = len(run.problems)
    if run.problems:
        h.say("warn", f"{plural(len(run.problems), 'problem')} reading the run's files (listed under Data problems).")
    return h


def _final(run: RunData, kind: str) -> Event | None:
    """The last counted event of ``kind`` that ended the run: None when training resumed after it."""
    last = None
    for e in run.events:
        if e.kind == kind and not e.superseded:
            last = e
        elif e.kind == "resume" and last is not None:
            last = None  # the run went on from a checkpoint
    return last


def _one_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def crash_step(event: Event) -> int:
    """The step a crash happened in: the step being trained when it came during one, else the step it was at.

    The loop records the steps completed (``state.step``) and what it was doing (``during``).
    """
    during = str(event.extra.get("during") or "")
    return event.step + 1 if "training step" in during else event.step


def crash_summary(event: Event) -> str:
    """Return "ValueError: message (at file:line in fn)" for a crash event (its fields, else its reason)."""
    error, message = event.extra.get("error"), event.extra.get("message")
    if not isinstance(error, str) or not error:
        return _one_line(event.reason) or "no reason recorded"
    location = event.extra.get("location")
    text = f"{error}: {_one_line(str(message or ''))}".rstrip(": ")
    return text + (f" (at {location})" if isinstance(location, str) and location else "")


def _crash(run: RunData, h: Health) -> None:
    """The crash that ended the run, first (a crash the run was resumed from is history, said later)."""
    f = h.figures
    crash = _final(run, "crash")
    if crash is not None:
        during = str(crash.extra.get("during") or "").split(" (")[0]
        f["crash"] = {"step": crash_step(crash), "error": crash.extra.get("error"), "message": crash.extra.get("message"),
                      "location": crash.extra.get("location"), "during": crash.extra.get("during")}
        h.say("bad", f"The run crashed at step {f['crash']['step']:,}{f' (during {during})' if during else ''}: "
                     f"{crash_summary(crash)}.")
    earlier = [e for e in run.counted_events("crash") if e is not crash]
    if earlier:
        listed = "; ".join(f"at step {crash_step(e):,}, {crash_summary(e)}" for e in earlier[:3])
        h.say("warn", f"Crashed and resumed {plural(len(earlier), 'time')}: {listed}.")


def _stop_text(event: Event) -> str:
    reason = (event.reason or "no reason given").removeprefix("stopping: ")
    reason = reason.removesuffix(f" at step {event.step}").removeprefix("stopped ")
    return f"Stopped at step {event.step:,} {reason}" if reason.startswith("by ") else \
        f"Stopped at step {event.step:,}: {reason}"


def _progress(run: RunData, h: Health) -> None:
    f = h.figures
    steps = [int(r["step"]) for r in run.metrics] or [e.step for e in run.events] or [0]
    f["last_step"] = max(steps)
    f["max_steps"] = run.cfg("train.max_steps")
    stop = _final(run, "stop")
    if stop is not None:
        f["stop"] = {"step": stop.step, "reason": stop.reason}
        h.say("warn", _stop_text(stop) + ".")
    elif "crash" in f:
        if not run.metrics:
            h.say("warn", "No metrics were logged before the crash.")
        elif isinstance(f["max_steps"], int):
            h.say("warn", f"Logged up to step {f['last_step']:,} of {f['max_steps']:,} before the crash.")
    elif not run.metrics:
        h.say("warn", "No metrics logged yet.")
    elif isinstance(f["max_steps"], int) and f["last_step"] >= f["max_steps"]:
        h.say("ok", f"Reached step {f['last_step']:,} of {f['max_steps']:,}.")
    elif isinstance(f["max_steps"], int):
        h.say("ok", f"Logged up to step {f['last_step']:,} of {f['max_steps']:,} (still running, or stopped early).")
    else:
        h.say("ok", f"Logged up to step {f['last_step']:,}.")


def _losses(run: RunData, h: Health) -> None:
    f = h.figures
    train = _finite(run.series("loss")[1])
    if train:
        f["loss_first"], f["loss_last"] = train[0], train[-1]
        text = f"Train loss {fmt_num(train[0])} → {fmt_num(train[-1])} (first → last interval)"
    else:
        text = ""
    steps, vals = run.series("val_loss")
    val = [(s, v) for s, v in zip(steps, vals) if math.isfinite(v)]
    level = "ok"
    if val:
        best_step, best = min(val, key=lambda sv: sv[1])
        f.update(val_first=val[0][1], val_last=val[-1][1], val_best=best, val_best_step=int(best_step))
        if len(val) == 1:
            part = f"validation loss {fmt_num(val[0][1])} at step {int(val[0][0]):,}"
        else:
            f["val_fell"] = val[-1][1] < val[0][1]
            trend = "fell" if f["val_fell"] else "did not fall"
            level = "ok" if f["val_fell"] else "warn"
            part = (f"validation loss {trend}: {fmt_num(val[0][1])} at step {int(val[0][0]):,} → {fmt_num(val[-1][1])} at step "
                    f"{int(val[-1][0]):,}, best {fmt_num(best)} at step {int(best_step):,}")
        text = f"{text}; {part}" if text else part[0].upper() + part[1:]
    if text:
        h.say(level, text + ".")


#: Clip-rate bands of the verdict: at most RARE of the steps is healthy, more than MOST is clipping nearly always.
CLIP_RARE, CLIP_MOST = 0.1, 0.5


def _clipping(run: RunData, h: Health) -> None:
    """The clip rate with a verdict and its reason.

    Clipping is a guard for the occasional large gradient: healthy when it fires rarely, or often only
    in the first steps (their large gradients). Firing on most steps means ``max_norm`` sits below
    the typical grad norm: the clip, not the gradient, sizes the updates. The verdict reads the second
    half of the run (``clip_rate_late``), so a burst at the start does not condemn a run that settled.
    """
    f = h.figures
    threshold = run.cfg("clip.max_norm")
    f["clip_threshold"] = threshold
    rows = [r for r in run.metrics if math.isfinite(r.get("clip_rate", math.nan))]
    steps = sum(r["interval_steps"] for r in rows)
    if not rows or steps <= 0:
        return
    clipped = sum(r["clip_rate"] * r["interval_steps"] for r in rows)  # weighted by interval length
    f["clip_rate"] = clipped / steps
    f["clipped_steps"], f["clip_steps_seen"] = int(round(clipped)), int(steps)
    norms = _finite(run.series("grad_norm")[1])
    if norms:
        f["grad_norm_median"] = statistics.median(norms)
    peaks = _finite(run.series("grad_norm_max")[1])  # each interval's largest pre-clip norm
    if peaks:
        f["grad_norm_max_median"] = statistics.median(peaks)
    if threshold is None:
        median = f" (median grad norm {fmt_num(f['grad_norm_median'])})" if norms else ""
        h.say("ok", f"Clipping is off (clip.max_norm is null){median}.")
        return
    half = max(int(r["step"]) for r in rows) / 2
    late = [r for r in rows if r["step"] - r["interval_steps"] >= half] or rows[-1:]  # intervals in the second half
    f["clip_rate_late"] = sum(r["clip_rate"] * r["interval_steps"] for r in late) / sum(r["interval_steps"] for r in late)
    rate, late_rate = f["clip_rate"], f["clip_rate_late"]
    head = (f"Clipping fired on {fmt_pct(rate)} of steps ({f['clipped_steps']:,} of {f['clip_steps_seen']:,}; "
            f"threshold {fmt_num(threshold)})")
    typical = f" (median {fmt_num(f['grad_norm_median'])})" if norms else ""
    retune = (f"set clip.max_norm to about {fmt_num(f['grad_norm_max_median'], 2)} (the median of each interval's "
              "largest grad norm)" if peaks and f["grad_norm_max_median"] > threshold
              else "raise clip.max_norm above the typical grad norm")
    if rate == 0:
        f["clip_verdict"] = "never"
        h.say("ok", f"{head}: healthy, a guard that was never needed (every grad norm stayed below it).")
    elif late_rate > CLIP_MOST:
        f["clip_verdict"] = "most"
        if str(run.cfg("optim.name", "")).startswith("adam"):
            effect = ("with Adam the update size barely changes (it divides by the clipped gradients' RMS), but every "
                      "gradient is rescaled to the same norm, so the clip no longer tells a spike from an ordinary step")
        else:
            factor = f" about {fmt_num(threshold / f['grad_norm_median'], 2)}x" if norms and f["grad_norm_median"] > 0 else ""
            effect = f"with SGD the update shrinks as if the learning rate were{factor} as large"
        h.say("warn", f"{head}, {fmt_pct(late_rate)} in the second half: too often. The threshold is below the typical "
                      f"grad norm{typical}, so the clip, not the gradient, sets the size of most updates; {effect}. "
                      f"To clip only spikes, {retune}; if the smaller steps are what keeps the run stable, lower "
                      "optim.lr instead.")
    elif late_rate > CLIP_RARE:
        f["clip_verdict"] = "frequent"
        h.say("warn", f"{head}, {fmt_pct(late_rate)} in the second half: often. The threshold is close to the typical "
                      f"grad norm{typical}, so it shrinks ordinary updates, not only spikes; to clip only spikes, {retune}.")
    elif rate > CLIP_RARE:
        f["clip_verdict"] = "early"
        h.say("ok", f"{head}, {fmt_pct(late_rate)} in the second half: healthy. It clipped the large gradients of the "
                    "first steps and rarely after; that is what a clip is for.")
    else:
        f["clip_verdict"] = "rare"
        h.say("ok", f"{head}: healthy, it trims the occasional large gradient.")


def _records(run: RunData, h: Health) -> None:
    f = h.figures
    ckpts = run.counted_events("checkpoint")
    withheld = run.counted_events("checkpoint_withheld")
    f["checkpoints"], f["checkpoints_withheld"] = len(ckpts), len(withheld)
    if ckpts or withheld:
        text = f"{plural(len(ckpts), 'checkpoint')}" + (f", the last at step {ckpts[-1].step:,}" if ckpts else "")
        if withheld:
            text += f"; {len(withheld)} withheld ({withheld[-1].reason or 'no reason given'})"
        h.say("warn" if withheld else "ok", text + ".")
    failed = run.counted_events("checkpoint_failed")
    f["checkpoints_failed"] = len(failed)
    if failed:
        h.say("warn", f"{plural(len(failed), 'checkpoint')} failed to save ({failed[-1].reason or 'no reason given'}).")
    rollbacks = run.counted_events("rollback")
    f["rollback_steps"] = [e.step for e in rollbacks]
    if rollbacks:
        moves = ", ".join(f"{e.extra['from_step']:,} → {e.step:,}" if isinstance(e.extra.get("from_step"), int)
                          else f"to {e.step:,}" for e in rollbacks[:5])
        h.say("warn", f"Rolled back {plural(len(rollbacks), 'time')} (step {moves}).")
    resumes = [e for e in run.events if e.kind == "resume"]
    f["resume_steps"] = [e.step for e in resumes]
    if resumes:
        times = "once" if len(resumes) == 1 else f"{len(resumes)} times"
        h.say("ok", f"Resumed {times}, at step {', '.join(f'{s:,}' for s in f['resume_steps'])}.")
    overwrites = run.counted_events("init_overwritten")
    names = [p.get("name", "?") for e in overwrites for p in (e.extra.get("params") or []) if isinstance(p, dict)]
    f["init_overwritten_params"] = len(names)
    if overwrites:
        shown = ", ".join(map(str, names[:4])) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        what = plural(len(names), "parameter") + (f" ({shown})" if names else "")
        h.say("warn", f"Initialization was overwritten at step {overwrites[0].step:,} for {what}.")


def _throughput(run: RunData, h: Health) -> None:
    f = h.figures
    tps = _finite(run.series("tokens_per_s")[1])
    mem = _finite(run.series("peak_memory_mib")[1])
    parts = []
    if tps:
        f["tokens_per_s_median"] = statistics.median(tps)
        parts.append(f"median {fmt_num(round(f['tokens_per_s_median']))} {run.count_unit}/s")
    if mem:
        f["peak_memory_mib"] = max(mem)
        parts.append(f"peak memory {fmt_num(round(f['peak_memory_mib']))} MiB")
    if parts:
        text = "; ".join(parts)
        h.say("ok", text[0].upper() + text[1:] + ".")
