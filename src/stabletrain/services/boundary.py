"""The log boundary, once for the built-in loop and every adapter: reduce → record → on_log → decide → capture → on_incident.

::

    record, decision, rows = boundary.log(signal, extra)   # the interval's ONE host sync (DDP: one all-gather),
                                                           # the host spike rule, the guard's decision, the metrics
                                                           # record, on_log (metrics.jsonl, TensorBoard, events, ...)
    info = boundary.incident(decision, rows)               # the first bad step captured and diagnosed, the decision
                                                           # pinned to the update the replay found, on_incident

What follows (stop, roll back, remedy, checkpoint, warn) is the caller's: the loop's services act on the
decision, an adapter stops its host or warns.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

from .. import console
from ..callbacks.sinks import announce_precursor
from ..numerics import nonfinite_params, running_stats_modules
from ..policies.guard import NEGLIGIBLE_SPIKE, GuardDecision
from ..policies.metrics import interval_record, peak_memory_mib
from ..policies.precursor import Precursor
from ..policies.spike_rule import armed_at, unjudged_outliers
from ..runstate import RunState
from .capture import IN_MEMORY

__all__ = ["IntervalBoundary", "spike_to_capture"]


class IntervalBoundary:
    """One interval's boundary over a run's metrics, guard, callbacks and capture (see the module docstring).

    Args:
        state: the run's :class:`~stabletrain.runstate.RunState`: its counters, history and record, and the parts
            the boundary runs (``metrics``, ``guard``, ``callbacks``; it adds the ``precursor``).
        capture: ``capture(state, info, rows) -> found`` (:meth:`IncidentCapture.capture`).
        top_layers: how many parameters to name as dominating the grad norm (``log.top_layers``).
        epoch: the data's current epoch.
        count_samples: add the interval's samples to ``state.samples_seen`` here (an adapter; the loop counts per step).
    """

    def __init__(self, state: RunState, capture: Callable[[RunState, dict[str, Any], list[Any]], dict[str, Any]], *,
                 top_layers: int, epoch: Callable[[], int], count_samples: bool = False) -> None:
        self.state, self.metrics, self.guard, self.callbacks = state, state.metrics, state.guard, state.callbacks
        self._capture = capture
        self.top_layers, self.epoch, self.count_samples = top_layers, epoch, count_samples
        self.names = [n for n, _ in state.named_params]
        self.precursor = state.precursor = Precursor(state.cfg.guard, self.names,  # a warning before the spike
                                                     [p.numel() for _, p in state.named_params])
        self.first_losses: list[tuple[int, float]] = []  # the run's first losses (unjudged_outliers), and those said
        self.first_said: set[int] = set()
        self.small_spikes_said = False  # the line for a spike too small to capture: once
        self.spent_said = False  # the line for a spike after the run's captures are spent: once
        # The last captured burst of spikes: its first step, its last so far, its class, and whether its going on was said
        self.burst: dict[str, Any] | None = None
        self.passed_over: list[int] = []  # the interval's spikes before the burst captured (a larger one after them)
        self.started = time.perf_counter()
        self.excluded = 0.0  # seconds of this interval not spent training (validation): not in its throughput

    def restart(self) -> None:
        """The next interval starts now (its throughput counts from here)."""
        self.started, self.excluded = time.perf_counter(), 0.0
        self.state.steps_from = time.time()

    def log(self, signal: int = 0, extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], GuardDecision, list[Any],
                                                                                  dict[str, Any]]:
        """Reduce the interval (its one host sync), let the guard read it, record it, fire ``on_log``.

        Returns (the metrics record, the guard's decision, the per-step rows, the reduce's summary).
        ``signal``: this rank's pending signal, agreed on by every rank in the same all-gather.
        """
        state = self.state
        summary, rows, param_sq = self.metrics.reduce(signal, annotate=self.guard.mark_spikes)
        now = time.perf_counter()
        elapsed = max(now - self.started - self.excluded, 1e-9)
        self.started, self.excluded = now, 0.0
        state.tokens_seen += summary["interval_tokens"]
        if self.count_samples:
            state.samples_seen += summary["interval_samples"]
        decision = self.guard.decide(rows)
        arms = armed_at(self.guard.cfg)
        if rows and rows[0].step <= arms + 1:  # a run's first losses, which the spike rule does not judge
            start = rows[0].step  # (a rollback to the run's start trains these steps again: the new timeline's losses)
            self.first_losses = [x for x in self.first_losses if x[0] < start] + [
                (r.step, float(r.values["loss"])) for r in rows if r.step <= arms + 1]
            self.first_said = {t for t in self.first_said if t < start}
            for step, loss, factor, against in unjudged_outliers(self.first_losses, self.guard.cfg):
                if step in self.first_said:
                    continue
                self.first_said.add(step)
                text = (f"step {step}'s loss {loss:.4g} is x{factor:.3g} {against}: not judged (the spike rule "
                        f"arms after {arms} losses), not skipped or captured")
                state.event(step, "early_outlier", text, loss=loss, factor=factor, against=against)
                console.warn(text)
        if decision.stall is not None:  # guard.on_stall=warn: said once (stop: the caller stops with it)
            state.event(state.step, "stall", decision.stall)
            console.warn(decision.stall)
        progress = {"num_incidents": self.guard.num_incidents, "num_rollbacks": self.guard.num_rollbacks,
                    "peak_memory_mib": peak_memory_mib(state.device), "epoch": self.epoch(),
                    "samples_seen": state.samples_seen, "tokens_seen": state.tokens_seen}
        extra = {**(extra or {}), **({"world_size": state.dist.world} if state.dist.enabled else {})}
        record = interval_record(summary, param_sq, self.names, elapsed, top_layers=self.top_layers,
                                 progress=progress, extra=extra or None)
        state.history.append(record)
        self.callbacks.fire("on_log", state, record, rows)
        announce_precursor(state, self.precursor.observe(state.step, summary, param_sq, rows))
        return record, decision, rows, summary

    def amend(self, fields: dict[str, Any]) -> None:
        """Add ``fields`` to the last record where it is this step's (an adapter's host evaluated after the run's last
        record, which no record follows to carry it): every rank's history, rank 0's metrics.jsonl (the sinks have
        written it: not TensorBoard's or a tracker's)."""
        state = self.state
        if state.history and state.history[-1].get("step") == state.step:
            state.history[-1].update(fields)
            if state.run is not None:
                state.run.amend_last_metrics(state.step, fields)

    def incident(self, decision: GuardDecision, rows: list[Any]) -> dict[str, Any] | None:
        """Capture the decision's first bad step (every rank); pin the decision to the update the replay found.

        A non-finite step first; else the onset of the interval's largest burst of spikes (``capture.spikes``, at most
        ``capture.max_spikes`` in a run): at most one capture per interval. Returns the incident's info for
        the caller (what ``on_incident`` got; ``anomaly``: "nonfinite" or "spike"), or None without one.
        """
        skipped = decision.bad_steps or [r.step for r in rows if r.values["applied"] < 0.5  # (an fp16 forward overflow's
                                         and not math.isfinite(r.values["loss"])]  # too: a routine overflow, not bad_steps)
        if skipped and self.guard.enforce:  # (an adapter's on_nonfinite='warn': the host applied it, nothing is skipped)
            self._reset_statistics(skipped[0])
        step, anomaly = decision.first_incident, "nonfinite"
        if step is None:
            step, anomaly = self._spike(decision, rows), "spike"
        if step is None:
            return None
        t0 = time.perf_counter()
        row = next(r for r in rows if r.step == step)
        info = {"step": row.step, "after_update": decision.after_update, "ranks": list(row.ranks or []),
                "loss": row.values["loss"], "grad_norm": row.values["grad_norm"], "locate": decision.locate,
                "anomaly": anomaly}
        if row.values["applied"] < 0.5 and row.values.get("params_finite", 1.0) < 0.5:  # a skipped step made no update:
            info["live_nonfinite"] = nonfinite_params(self.state.named_params)  # they were so before it (the replay says how)
        # The losses the rule judged it against (a non-finite step's too: a remedy's replay judges its steps by them)
        info["spike_window"] = self.guard.window_before(step, rows)
        info["rarity"] = self.guard.rarity.before()  # (its bar's ratios, as that window: on the device, the replay's)
        if anomaly == "spike":
            if row.values["applied"] < 0.5:  # (an adapter prints no last line counting it: said on the spike's own)
                info["label"] = ("spike (skipped: fp16 overflow)" if row.values.get("overflow", 0.0) > 0.5 else
                                 f"spike (skipped: {self.guard.key('on_spike')}={self.guard.cfg.on_spike})"
                                 if self.guard.on_device else None)
            self.guard.num_spike_captures += 1 if self.state.cfg.capture.incidents else 0  # (off: none is, nor spent)
            earlier = self.passed_over  # (a larger burst after them is the one captured)
            if earlier:
                many, listed = len(earlier) > 1, ", ".join(map(str, earlier[:6])) + ", ..." * (len(earlier) > 6)
                info["step_note"] = (f" (after the interval's spike{'s' * many} at step{'s' * many} {listed}, not captured: "
                                     "a larger burst is)")
        info.update(self._capture(self.state, info, rows))
        diagnosis = info.get("diagnosis_record") or info.get("diagnosis") or {}  # (the whole one, in memory)
        if anomaly == "spike" and self.state.dist.enabled:  # rank 0 alone diagnoses: every rank decides its next captures
            # alike from its verdict (rank 1 knew no class, captured a burst's course rank 0 let go: the ranks hung)
            diagnosis = {**diagnosis, **self.state.dist.on_main(
                lambda: {k: diagnosis.get(k) for k in ("failure_class", "level_shift")})}
        if anomaly == "spike" and diagnosis.get("failure_class"):  # (what a stop after spike skips then says)
            self.guard.spike_class = (step, diagnosis["failure_class"])
        if anomaly == "spike" and self.burst is not None and self.burst["first"] == step:
            self.burst.update({"class": diagnosis.get("failure_class"), "level": bool(diagnosis.get("level_shift"))})
        if info.get("pinned") is not None:  # the capture's replay found the update that broke the parameters
            decision.pin(info["pinned"])
            step = decision.first_incident  # (the capture is that step's: the lines below name it, not the one flagged)
        # The capture's bundle and whole diagnosis stay with the caller (a live remedy's search), not the callbacks'.
        self.callbacks.fire("on_incident", self.state, {k: v for k, v in info.items() if k not in IN_MEMORY})
        self.excluded += time.perf_counter() - t0  # the capture's time is not the next interval's throughput
        # (with capture.incidents=false, or a capture that failed, there is no "interval's capture" to point to; with
        # capture off, nothing said the captured step either: the lines below name it too)
        off = not self.state.cfg.capture.incidents
        held = None if info.get("path") else "capture.incidents=false" if off else f"nor was step {step}"
        others = [t for t in decision.spike_steps if t != step or (off and anomaly == "spike")]
        if others and self.state.dist.is_main and self.state.run is not None:  # (each was an event only, no word)
            shown = _losses_of(others, rows)
            more = "more " if anomaly == "spike" and not off else ""
            why = held or ("one capture per interval" if anomaly == "spike"
                           else f"the interval's capture is step {step}'s, non-finite")
            burst = {b["step"]: b for b in diagnosis.get("burst_samples") or [] if isinstance(b, dict)}  # (weighed by it)
            told = ", ".join(f"step {t}'s samples {', '.join(map(str, burst[t]['samples'][:6]))} carry "
                             f"{burst[t]['share']:.0%} of its loss" for t in others[:6] if t in burst)
            console.say(f"{len(others)} {more}loss spike{'s' if len(others) > 1 else ''} in the interval to step "
                        f"{rows[-1].step}, at step{'s' if len(others) > 1 else ''} {shown}"
                        f"{' ...' if len(others) > 6 else ''}: not captured ({why}; events.jsonl)"
                        + (f"; step {step}'s capture weighed its burst: {told} (verified)" if told else ""))
        bad = [t for t in decision.bad_steps if t != step or off]
        if bad and self.state.dist.is_main and self.state.run is not None:  # (the skip events alone said nothing)
            shown = ", ".join(map(str, bad[:6])) + (" ..." if len(bad) > 6 else "")
            said = held or f"one capture per interval: step {step}'s"
            console.say(f"{len(bad)} {'' if off else 'more '}non-finite step{'s' if len(bad) > 1 else ''} in the interval to "
                        f"step {rows[-1].step}, at step{'s' if len(bad) > 1 else ''} {shown}: not captured ({said}; "
                        "events.jsonl)")
        return info

    def _reset_statistics(self, step: int) -> None:
        """A skipped step's forward still ran: a NaN input (or an fp16 forward overflow) wrote NaN into a BatchNorm's
        running statistics, which no skip undoes (its validation loss NaN for good, and every checkpoint withheld: a new
        user's trial). Modules with running statistics (``track_running_stats``) that are not finite get them reset
        (``reset_running_stats``: mean 0, var 1, re-estimated over the next steps), the same on every rank. Other buffers
        are the model's own (a causal mask of -inf): never judged here."""
        bad = {n: m for n, m in running_stats_modules(self.state.module).items()
               if any(b.is_floating_point() and not bool(b.isfinite().all()) for b in m.buffers(recurse=False))}
        if not bad:
            return
        for module in bad.values():
            module.reset_running_stats()
        text = (f"the forward of skipped step {step} left non-finite running statistics in {', '.join(list(bad)[:6])}: reset "
                "(mean 0, var 1; re-estimated over the next steps), else no checkpoint could be written again")
        self.state.event(step, "buffers_reset", text, buffers=list(bad))
        if self.state.dist.is_main:
            console.warn(text)

    def _spike(self, decision: GuardDecision, rows: list[Any]) -> int | None:
        """The interval's spike to capture (:func:`spike_to_capture`), or None (none, not asked for, the run's
        captures spent, or every spike of the interval below :data:`NEGLIGIBLE_SPIKE` of the run's first logged loss)."""
        cfg = self.state.cfg.capture
        if not decision.spike_steps:
            return None
        if not cfg.spikes:  # (guard.on_spike=warn warns: the line the capture would have said, without its findings)
            if self.state.dist.is_main and self.state.run is not None:
                steps = decision.spike_steps
                console.say(f"{len(steps)} loss spike{'s' if len(steps) > 1 else ''} in the interval to step {rows[-1].step}, "
                            f"at step{'s' if len(steps) > 1 else ''} {_losses_of(steps, rows)}"
                            f"{' ...' if len(steps) > 6 else ''}: not captured (capture.spikes=false; events.jsonl)")
            return None
        if self.guard.num_spike_captures >= cfg.max_spikes:
            if not self.spent_said and self.state.dist.is_main and self.state.run is not None:
                self.spent_said = True
                one = cfg.max_spikes == 1
                console.say(f"spike at step {decision.spike_steps[0]} not captured: the run's {cfg.max_spikes} spike "
                            f"capture{'' if one else 's'} {'is' if one else 'are'} spent (capture.max_spikes); later spikes "
                            "are logged in events.jsonl (said once)")
            return None
        losses = {r.step: r.values["loss"] for r in rows}
        if decision.negligible:  # (the guard's verdict: every spike below NEGLIGIBLE_SPIKE x the run's first loss)
            first = self.guard.first_loss
            if not self.small_spikes_said and self.state.dist.is_main and self.state.run is not None:
                self.small_spikes_said = True
                console.say(f"spike at step {decision.spike_steps[0]} not captured: its loss, "
                            f"{losses.get(decision.spike_steps[0], float('nan')):.3g}, is below {NEGLIGIBLE_SPIKE:g} x "
                            f"the run's first logged loss ({first:.4g}): a jump between negligible losses (such spikes are "
                            "counted and logged, not captured; said once)")
            return None
        steps, burst = decision.spike_steps, self.burst
        if burst is not None and steps[0] == burst["last"] + 1 and self._course(burst):  # a divergence's course
            n = next((i for i, t in enumerate(steps) if t != steps[0] + i), len(steps))
            if not burst["said"] and self.state.dist.is_main and self.state.run is not None:  # (said once a burst)
                console.say(f"the burst of loss spikes captured at step {burst['first']} ({burst['class']}"
                            f"{': a loss at a new level' if burst.get('level') else ''}) goes on "
                            f"({f'steps {steps[0]}-{steps[n - 1]}' if n > 1 else f'step {steps[0]}'} so far): not captured "
                            "again while it lasts (events.jsonl)")
            burst.update(last=steps[n - 1], said=True)
            steps = steps[n:]
            if not steps:
                return None
        step = spike_to_capture(steps, losses, NEGLIGIBLE_SPIKE * (self.guard.first_loss or 0.0))
        if step is None:
            return None
        self.passed_over = [t for t in steps if t < step]  # (not a captured burst's course: said with the capture)
        end = step
        while end + 1 in steps:
            end += 1
        self.burst = {"first": step, "last": end, "class": None, "said": False}  # (its class: once diagnosed)
        return step

    def _course(self, burst: dict[str, Any]) -> bool:
        """Whether spikes going on from a captured burst are its course, not captured again: its update applied
        (guard.on_spike=warn), and diagnosed as the state's or the optimizer's, or a loss at a new level (a data burst's
        next windows may hold other bad samples; a skip, rollback or remedy that did not stop it is news)."""
        return self.state.cfg.guard.on_spike == "warn" and (burst["class"] in COURSE_CLASSES or burst.get("level", False))


#: The classes whose burst of spikes, going on past its capture under guard.on_spike=warn, is that cause's course.
COURSE_CLASSES = ("state", "optimizer-state", "precision")

#: A later burst of spikes in an interval is captured instead of an earlier one only when its peak loss is at least
#: this many times the earlier's: a burst about as large is the earlier one's aftershock (its course), not a new one.
LARGER_BURST = 1.5


def _losses_of(steps: list[int], rows: list[Any]) -> str:
    """``"20 (810.1, skipped), 24 (95.2)"``: the first six of ``steps`` with their losses, and which were skipped."""
    by_step = {r.step: r.values for r in rows}
    nan = {"loss": float("nan"), "applied": 1.0}
    return ", ".join(f"{t} ({by_step.get(t, nan)['loss']:.4g}{', skipped' if by_step.get(t, nan)['applied'] < 0.5 else ''})"
                     for t in steps[:6])


def spike_to_capture(steps: list[int], losses: dict[int, float], floor: float = 0.0) -> int | None:
    """The onset of the interval's largest burst of spikes (a burst: spikes on consecutive steps) whose peak loss reaches
    ``floor`` (:data:`NEGLIGIBLE_SPIKE` x the run's first loss: a burst between negligible losses is never captured); None
    when no burst does.

    A divergence's burst is captured at its first step, where it began (its later, larger losses are its course);
    an aftershock of an earlier spike does not hide a new, clearly larger burst after it (:data:`LARGER_BURST`
    times the earlier's peak); one about as large (a divergence's spikes with a calm step between) does not take
    the capture from where the trouble began.
    """
    bursts: list[list[int]] = []
    for s in sorted(steps):
        if bursts and s == bursts[-1][-1] + 1:
            bursts[-1].append(s)
        else:
            bursts.append([s])
    bursts = [b for b in bursts if not max(losses.get(s, float("-inf")) for s in b) < floor]  # (NaN: not below)
    if not bursts:
        return None
    peak = [max(losses.get(s, float("-inf")) for s in burst) for burst in bursts]
    best = 0
    for i in range(1, len(bursts)):
        if peak[i] > LARGER_BURST * peak[best]:
            best = i
    return bursts[best][0]
