"""The health summary: a few plain sentences about a run, computed from its metrics and events.

Each sentence carries a level (``ok``, ``warn``, ``bad``); the run's level is the worst of them. A crash that ended the
run comes first. Throughput is in the task's unit (``count_unit`` in the snapshot: tokens or samples). The numbers
behind the sentences are in :attr:`Health.figures`, so a test (or a script) can check them against ``metrics.jsonl``.
"""

from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..records.launches import started_over, unfinished_note
from .clip_verdict import clip_sentence
from .early_signs import early_outlier_sentence, precursor_sentence
from .loss_headline import loss_sentence
from .rundata import Event, RunData
from .skips import skip_sentence
from .text import first_clause, fmt_num, fmt_ranges, one_line, plural, skip_reason, stall_parts, total_of, went_back

__all__ = ["Health", "health_summary", "incident_summary", "crash_summary", "crash_step", "stall_figures", "LEVELS"]

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


def incident_summary(event: Event) -> str:
    """An incident's diagnosis summary, else why the diagnosis failed, else its reason; under DDP the ranks first."""
    diagnosis, ranks = event.extra.get("diagnosis"), [r for r in event.extra.get("ranks") or [] if isinstance(r, int)]
    where = f"on rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}, " if ranks else ""  # (the console's "(rank 1)")
    if isinstance(diagnosis, dict) and isinstance(diagnosis.get("summary"), str) and diagnosis["summary"]:
        return where + diagnosis["summary"]
    error = event.extra.get("diagnosis_error")
    return where + (f"the diagnosis failed ({error})" if error else event.reason or "no diagnosis recorded")


def health_summary(run: RunData) -> Health:
    """Return the health of ``run`` in plain words, with the figures each sentence states."""
    f = (h := Health()).figures
    f["count_unit"] = run.count_unit
    _crash(run, h)
    _progress(run, h)
    _stall(run, h)
    loss_sentence(run, h)
    _init(run, h)
    clip_sentence(run, h)

    skip_events = skip_sentence(run, h)

    nonfinite_events = run.counted_events("nonfinite")
    f["nonfinite_steps"] = total_of(run, "num_nonfinite") if run.metrics else len({e.step for e in nonfinite_events})
    undone = run.undone_events("nonfinite")
    f["nonfinite_steps_undone"] = sorted({e.step for e in undone})
    before = (f"before {went_back(undone)}, {plural(len(f['nonfinite_steps_undone']), 'step')} had one (first at step "
              f"{f['nonfinite_steps_undone'][0]:,})" if undone else "")
    # fp16 overflows (the GradScaler's skipped steps) are not counted as non-finite steps: said as what they are
    overflows = len({e.step for e in skip_events if skip_reason(e.reason).startswith("fp16 overflow")})
    besides = f" besides {plural(overflows, 'fp16 overflow')} (skipped, above)" if overflows else ""
    if f["nonfinite_steps"]:
        first = min((e.step for e in nonfinite_events), default=None)
        if first is None:
            first = next(int(r["step"]) for r in run.metrics if r.get("num_nonfinite", 0) > 0)
            where = f"first in the interval ending at step {first:,}"
        else:
            where = f"first at step {first:,}"
        f["first_nonfinite_step"] = first
        caught = sum(1 for e in run.counted_events("incident") if e.extra.get("anomaly") != "spike")
        h.say("warn", f"{plural(f['nonfinite_steps'], 'step')} had a non-finite loss or grad norm ({where})"
                      + (f"; {before}" if before else "") + ("; an incident captures the first of its log interval "
                      f"({caught} below)" if 0 < caught < f["nonfinite_steps"] else "") + ".")
    elif undone:
        h.say("warn", f"No non-finite losses or grad norms{besides} since {went_back(undone)}; {before}.")
    else:
        h.say("ok", f"No non-finite losses or grad norms{besides}.")

    spikes = run.counted_events("spike")
    f["spike_steps"] = sorted({e.step for e in spikes})
    undone_spikes = run.undone_events("spike")
    f["spike_steps_undone"] = sorted({e.step for e in undone_spikes})
    if undone_spikes and not spikes:
        h.say("warn", f"No loss spikes since {went_back(undone_spikes)}; before it, "
                      f"{plural(len(f['spike_steps_undone']), 'loss spike')} at step {fmt_ranges(f['spike_steps_undone'])}.")
    if spikes:
        text = f"{plural(len(f['spike_steps']), 'loss spike')} at step {fmt_ranges(f['spike_steps'])}"
        captured = [e.step for e in run.events if e.kind == "incident" and e.extra.get("anomaly") == "spike"]
        cap = run.cfg("capture.max_spikes")
        later = [s for s in f["spike_steps"] if captured and s > max(captured)]
        if isinstance(cap, int) and run.cfg("capture.spikes", True) and len(captured) >= cap and later:
            text += (f"; capture.max_spikes={cap} was spent at step {max(captured)}: the {plural(len(later), 'spike')} "
                     "after it went uncaptured")
        if undone_spikes:  # (each rollback trains the steps again: the same steps' spikes met once after each)
            again = (f" ({len(undone_spikes)} spikes: the run met them again after each rollback)"
                     if len(undone_spikes) > len(f["spike_steps_undone"]) else "")
            lo, hi = min(f["spike_steps_undone"]), max(f["spike_steps_undone"])  # the rollbacks that went back past them
            past = sum(1 for e in run.events if e.kind == "rollback" and e.step < hi and int(e.extra.get("from_step", -1)) >= lo)
            text += (f"; before {went_back(undone_spikes, past)}, at step {fmt_ranges(f['spike_steps_undone'])}{again}")
        h.say("warn", text + ".")
    precursor_sentence(run, h)
    early_outlier_sentence(run, h)

    incidents = run.counted_events("incident")
    f["incidents"] = [(e.step, incident_summary(e)) for e in incidents]
    undone = run.undone_events("incident")  # the run went back past them (a rollback, a remedy's rollback)
    f["incidents_undone"] = _once([(e.step, incident_summary(e)) for e in undone])
    # An incident that a remedy applied after it cured (verified on a replay, the run finished with it) is a run worth a
    # look (its config changed mid-run), not one with problems; the remedy's own line follows.
    cured = {e.extra.get("incident_step") for e in run.counted_events("remedy")
             if isinstance(e.extra.get("name"), str) and e.extra.get("verdict") == "cures" and _own(run, e.extra.get("incident"))}
    if incidents:
        noise = {e.step for e in incidents if (e.extra.get("diagnosis") or {}).get("failure_class") == "dropout"}
        remedied = all(e.step in cured or e.step in noise for e in incidents)  # (a spike the model's own dropout drew)
        h.say("warn" if remedied else "bad", f"{plural(len(incidents), 'incident')}: {_listed(f['incidents'])}" + (
            " (the model's own dropout draw made it: noise, not a fault)" if remedied and noise == {e.step for e in incidents}
            else " (cured: a remedy was applied for each, below)" if remedied and not noise else " (each cured by a remedy, "
            "below, or made by the model's own dropout draw: noise)" if remedied else "") + "." + _scattered(incidents, run))
    if undone:
        h.say("warn", f"{plural(len(f['incidents_undone']), 'incident')} before {went_back(undone)} (the run went back and "
                      f"trained that stretch again): {_listed(f['incidents_undone'])}.")
    if not incidents and not undone:
        h.say("ok", "No incidents.")
    _remedies(run, h)

    _records(run, h)
    _throughput(run, h)
    f["num_problems"] = len(run.problems)
    if run.problems:
        h.say("warn", f"{plural(len(run.problems), 'problem')} reading the run's files (listed under Data problems).")
    return h


def _init(run: RunData, h: Health) -> None:
    """The step-0 signal report's verdict (``snapshot.json``'s ``init_signal``: log.init_signal, an adapter's init_check)."""
    line = run.snapshot.get("init_signal")
    if not isinstance(line, dict) or "passed" not in line:
        return
    h.figures["init_signal_passed"] = bool(line["passed"])
    loss = line.get("loss_at_init") or {}
    if line["passed"] and not loss.get("fails"):
        h.say("ok", "At step 0 the signal held through every layer, forward and backward.")
    elif line["passed"]:  # (a trial: a tied head of std 1 read "held through every layer", its loss 8x ln C unsaid)
        h.say("warn", f"At step 0 the signal held through every layer, but {loss['line']}.")
    else:
        found = "; ".join(part for part in line.get("summary", []) if not part.endswith(": ok"))
        h.say("warn", f"At step 0 {found}; {line.get('advice', '')} (init_signal.json)"
              + (f"; and {loss['line']}." if loss.get("fails") else "."))


def _once(incidents: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Each incident once, in order, with how often it was met (a run that went back into it again): the same step
    and class ("state: ..."; the evidence's numbers may differ in their last digits), its first summary. A data
    incident's named samples are part of it (after a rollback that skipped its window, the step's next one is another
    incident)."""
    first: dict[tuple[int, str, str], str] = {}
    counts: dict[tuple[int, str, str], int] = {}
    for step, summary in incidents:
        named = re.match(r"data: samples? ([\d, ]+) carr", summary)
        key = (step, summary.split(":", 1)[0], named.group(1) if named else "")
        first.setdefault(key, summary)
        counts[key] = counts.get(key, 0) + 1
    return [(key[0], first[key].rstrip(".") + (f" (met {n} times)" if n > 1 else "")) for key, n in counts.items()]


def _listed(incidents: list[tuple[int, str]], limit: int = 5) -> str:
    """Each incident's summary; of several, each one's class and first clause (the incidents table has the rest: five
    whole summaries made a 16-line paragraph)."""
    def head(summary: str) -> str:
        return summary if len(incidents) == 1 else first_clause(summary)

    listed = "; ".join(f"at step {s:,}, {head(summary).rstrip('.')}" for s, summary in incidents[:limit])
    return listed + (f"; and {len(incidents) - limit} more" if len(incidents) > limit else "")


def _scattered(incidents: list[Event], run: RunData | None = None) -> str:
    """A note where 3 or more data spikes each name one or two samples and no sample twice: a heavy tail of the loss
    (noisy targets or labels, a small batch) more likely than a few bad samples (empty otherwise). Only where those
    samples could have come back (the run trained a later epoch, none dropped by a remedy or a rollback) and none
    is a gross outlier (a loss :data:`GROSS_OUTLIER` times the rule's median or more: a corrupt sample, no tail)."""
    data = [e for e in incidents
            if e.extra.get("anomaly") == "spike" and (e.extra.get("diagnosis") or {}).get("failure_class") == "data"]
    named = [(e.extra.get("diagnosis") or {}).get("bad_samples") or [] for e in data]
    flat = [i for n in named for i in n]
    if len(named) < 3 or not all(1 <= len(n) <= 2 for n in named) or len(set(flat)) < len(flat):
        return ""
    ratios = [((e.extra.get("diagnosis") or {}).get("spike_test") or {}).get("ratio") for e in data]
    if any(isinstance(r, (int, float)) and r >= GROSS_OUTLIER for r in ratios):
        return ""
    if run is not None:
        dropped = {int(i) for e in run.counted_events("rollback") for i in e.extra.get("dropped_samples") or []}
        dropped |= {int(i) for e in run.counted_events("remedy") if (e.extra.get("remedy") or {}).get("kind") == "skip-samples"
                    for i in (e.extra.get("remedy") or {}).get("samples") or []}
        epochs = [(e.extra.get("diagnosis") or {}).get("epoch") for e in data]
        last = max((int(r["epoch"]) for r in run.metrics if isinstance(r.get("epoch"), int)), default=None)
        if dropped & set(flat) or last is None or any(not isinstance(x, int) or x >= last for x in epochs):
            return ""
    return (f" {len(named)} data spikes each carried by one or two samples, never the same: a loss with a heavy tail "
            "(noisy targets or labels, a small batch) more likely than a few bad samples; a robust loss (Huber) or a "
            "larger batch calms it, a higher guard.spike_ratio stops flagging it.")


#: A data spike this many times the rule's median or more is a gross outlier (a corrupt sample), not a heavy tail.
GROSS_OUTLIER = 100.0


def _own(run: RunData, incident: Any) -> bool:
    """Whether ``incident`` (a remedy event's incident folder) is one of this run's (a remedy applied by hand may come
    from another run's incident at the same step)."""
    path = Path(str(incident))
    if path.parent.name != "incidents" or not (run.path / "incidents" / path.name).is_dir():
        return False
    try:  # an absolute path names its run; a relative one was relative to where the run was started
        return not path.is_absolute() or path.resolve().parent.parent == run.path.resolve()
    except OSError:
        return False


def _remedies(run: RunData, h: Health) -> None:
    """Each remedy event: what was applied (the run's config changed mid-run: worth a look), or why none was."""
    f = h.figures
    f["remedies"] = []
    unapplied: dict[tuple[str, str], list[int]] = {}  # (why, fallback) -> the incidents' steps: one line for them all
    for e in run.counted_events("remedy"):
        x = e.extra
        if isinstance(x.get("name"), str):  # applied
            f["remedies"].append({k: x.get(k) for k in ("name", "detail", "incident_step", "failure_class", "verdict",
                                                         "at_step", "from_step", "by_hand")})
            how = "by hand (config key 'remedy')" if x.get("by_hand") else f"{x.get('verdict') or 'verified'} on a replay"
            text = (f"Remedy applied: {x['name']}" + (f" ({x['detail']})" if x.get("detail") else "")
                    + (f" for the {x['failure_class']} incident" if x.get("failure_class") else " for the incident")
                    + (f" at step {x['incident_step']:,}" if isinstance(x.get("incident_step"), int) else "") + f", {how}")
            at, since = x.get("at_step"), x.get("from_step")
            if isinstance(at, int) and isinstance(since, int) and at < since:
                text += f"; at step {since:,} the run went back to step {at:,} and trained on from there with it"
            h.say("warn", text + ".")
        else:  # none applied: not needed (skipping the step cured it), or none cured it and the fallback was taken
            f["remedies"].append({"name": None, "reason": e.reason})
            if isinstance(x.get("why"), str) and isinstance(x.get("incident_step"), int):  # grouped below
                unapplied.setdefault((x["why"], str(x.get("fallback"))), []).append(x["incident_step"])
                continue
            needed = not e.reason.startswith("no remedy needed")
            h.say("warn" if needed else "ok", one_line(e.reason[:1].upper() + e.reason[1:]).rstrip(".") + ".")
    for (why, fallback), steps in unapplied.items():  # the same reason for several incidents (captures spent): one line
        at = f"the incident at step {steps[0]}" if len(steps) == 1 else f"the incidents at steps {', '.join(map(str, steps))}"
        h.say("warn", one_line(f"No remedy applied for {at}: {why}; falling back to remedy.fallback={fallback}") + ".")


def _final(run: RunData, kind: str) -> Event | None:
    """The last counted event of ``kind`` that ended the run: None when training resumed after it."""
    last = None
    for e in run.events:
        if e.kind == kind and not e.superseded:
            last = e
        elif e.kind == "resume" and last is not None:
            last = None  # the run went on from a checkpoint
    return last


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
        return one_line(event.reason) or "no reason recorded"
    location = event.extra.get("location")
    text = f"{error}: {one_line(str(message or ''))}".rstrip(": ")
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
    # (a launcher's stop after its process died with no record of why: the step is its last record, which it may have
    # trained past; one after a crash or stop the process recorded is at its step)
    failure = event.extra.get("failure") if isinstance(event.extra.get("failure"), dict) else {}
    died = isinstance(event.extra.get("cause"), dict) and failure.get("kind", "exit") == "exit"
    at = f"after step {event.step:,} (the last step recorded before its process died)" if died else f"at step {event.step:,}"
    return f"Stopped {at} {reason}" if reason.startswith("by ") else f"Stopped {at}: {reason}"


def stall_figures(run: RunData) -> dict[str, Any] | None:
    """The run's stall (:func:`~.text.stall_parts`: its stop for one, guard.on_stall=stop, else its ``stall`` event), with
    ``stopped`` and ``recovered``: the first logged step after it whose interval had a gradient (a finite grad norm above
    0, at a loss scale of at least 1) when the last interval had one too, else None. None without a stall."""
    stop = _final(run, "stop")
    stopped = stop is not None and stall_parts(stop.reason) is not None
    events = [stop] if stopped else run.counted_events("stall")
    stall = stall_parts(events[-1].reason) if events else None
    if stall is None:
        return None
    moving = [int(r["step"]) for r in run.metrics if r["step"] > stall["step"] and isinstance(r.get("grad_norm"), float)
              and 0 < r["grad_norm"] < math.inf and r.get("loss_scale", 1.0) >= 1.0]
    last = max((int(r["step"]) for r in run.metrics), default=0)
    return {**stall, "stopped": stopped, "recovered": moving[0] if last in moving else None}


def _stall(run: RunData, h: Health) -> None:
    """A stall that guard.on_stall=warn trained on through: since when, what the guard saw, what to do (a stop for one:
    :func:`_progress`)."""
    s = h.figures["stall"] = stall_figures(run)
    if s is None or s["stopped"]:
        return
    if s["recovered"] is not None:
        h.say("warn", f"Stalled from step {s['since']:,} (at step {s['step']:,}, {s['what']}); gradients reached the "
                      f"parameters again by step {s['recovered']:,} (guard.on_stall=warn trained on).")
    else:
        h.say("bad", f"Stalled since step {s['since']:,}, and trained on stalled to step {h.figures['last_step']:,} "
                     f"(guard.on_stall=warn): at step {s['step']:,}, {s['what']}. Try {s['advice']}; guard.on_stall=stop "
                     "stops such a run at once.")


def _progress(run: RunData, h: Health) -> None:
    f = h.figures
    steps = [int(r["step"]) for r in run.metrics] or [e.step for e in run.events] or [0]
    f["last_step"] = max(steps)
    f["max_steps"] = run.cfg("train.max_steps")
    stop = _final(run, "stop")
    if stop is not None:  # a stall stop (guard.on_stall=stop): a run that was not learning, stopped without learning
        f["stop"] = {"step": stop.step, "reason": stop.reason}
        h.say("bad" if stall_parts(stop.reason) else "warn", _stop_text(stop) + ".")
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
        note = unfinished_note(run.path)  # (a run killed outright read "still running, or stopped early")
        h.say("warn" if "gone" in note else "ok", f"Logged up to step {f['last_step']:,} of {f['max_steps']:,} ({note}).")
    else:
        h.say("ok", f"Logged up to step {f['last_step']:,}.")


def _restarts(run: RunData, h: Health) -> None:
    """The restarts the run made by itself (``run.max_restarts``): how many, after which deaths, from where; a host's retry."""
    from ..distributed.launch import describe_exit

    for e in (e for e in run.events if e.kind == "retry"):  # the host trainer trained again (auto_find_batch_size)
        h.say("warn", f"{e.reason[:1].upper()}{e.reason[1:]}.")
    h.figures["restarts"] = len(restarts := [e for e in run.events if e.kind == "restart"])
    if not restarts:
        return
    deaths: dict[str, int] = {}
    for e in restarts:
        cause = e.extra.get("cause") if isinstance(e.extra.get("cause"), dict) else {}
        who = f"rank {cause['rank']} " if cause.get("rank") is not None else ""
        what = who + (describe_exit(int(cause["exitcode"])) if isinstance(cause.get("exitcode"), int) else "ended")
        deaths[what] = deaths.get(what, 0) + 1
    said = "; ".join(what + (f", {n} times" if n > 1 else "") for what, n in deaths.items())
    after = {id(e): next((x for x in run.events[i + 1:] if x.kind == "restart" or x.kind == "resume" and not x.extra.get(
        "auto")), e) for i, e in enumerate(run.events) if e.kind == "restart"}  # where its launch resumed (LAST_GOOD bad?)
    froms = sorted({Path(str(after[id(e)].extra["path"])).name if after[id(e)].extra.get("path") else str(e.extra.get(
        "checkpoint") or ("step 0" if started_over({**e.extra, "step": e.step}) else "the newest checkpoint that verified"))
        for e in restarts})
    h.say("warn", f"Restarted itself {'once' if len(restarts) == 1 else f'{len(restarts)} times'} after its process "
                  f"died ({said}), from {', '.join(froms)} (run.max_restarts; what each cost: the goodput line).")


def _records(run: RunData, h: Health) -> None:
    f = h.figures
    ckpts = run.counted_events("checkpoint")
    withheld = run.counted_events("checkpoint_withheld")
    f["checkpoints"], f["checkpoints_withheld"] = len(ckpts), len(withheld)
    if ckpts or withheld:
        kept = len([d for d in (run.path / "checkpoints").glob("step_*") if d.is_dir() and d.name[5:].isdigit()])
        text = f"{plural(len(ckpts), 'checkpoint')}" + (f", the last at step {ckpts[-1].step:,}" if ckpts else "") + (
            f" ({kept} kept on disk: ckpt.keep={run.cfg('ckpt.keep', '?')})" if ckpts and 0 < kept < len(ckpts) else "")
        if withheld:
            text += f"; {len(withheld)} withheld ({withheld[-1].reason or 'no reason given'})"
        h.say("warn" if withheld else "ok", text + ".")
    f["checkpoints_failed"] = len(failed := run.counted_events("checkpoint_failed"))
    if failed:
        h.say("warn", f"{plural(len(failed), 'checkpoint')} failed to save ({failed[-1].reason or 'no reason given'}).")
    rollbacks = run.counted_events("rollback")
    f["rollback_steps"] = [e.step for e in rollbacks]
    if rollbacks:
        moves = ", ".join(f"{e.extra['from_step']:,} → {e.step:,}" if isinstance(e.extra.get("from_step"), int)
                          else f"to {e.step:,}" for e in rollbacks[:5])
        h.say("warn", f"Rolled back {'once' if len(rollbacks) == 1 else f'{len(rollbacks)} times'} (step {moves}).")
    _restarts(run, h)
    marks = [e for e in run.events if e.kind in ("restart", "resume")]  # a restart's own resume follows its event
    resumes = [e for i, e in enumerate(marks) if e.kind == "resume" and (i == 0 or marks[i - 1].kind != "restart")]
    f["resume_steps"] = [e.step for e in resumes]
    if resumes:
        times = "once" if len(resumes) == 1 else f"{len(resumes)} times"
        h.say("ok", f"Resumed {times}, at step {', '.join(f'{s:,}' for s in f['resume_steps'])}.")
    resharded = [e for e in run.events if e.kind == "resume" and e.extra.get("resharded")]
    f["reshards"] = len(resharded)
    for e in resharded:  # (a global batch that changed mid-run moves the loss, grad-norm and clip curves at that step)
        x = e.extra
        old, new = x.get("old_global_batch"), x.get("new_global_batch")
        batch = (f"the same global batch, {new} samples per step" if old == new else f"the global batch {old} -> {new} "
                 "samples per step from there, which moves the loss and grad-norm curves' level there")
        h.say("ok", f"At step {e.step:,} the run went on under {plural(x.get('new_world_size', 0), 'process', 'processes')} "
                    f"(it had {x.get('old_world_size', '?')}): {batch}.")
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
