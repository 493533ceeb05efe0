"""What a spike's bundle holds besides the state before its step: the older state its window is weighed under.

:func:`spike_parts` adds to a spike's bundle the rule's window, the run's last interval records (step, LR,
update/weight ratio), an earlier spike it may be the aftershock of, the samples earlier spikes named, and the
older state with the LR its step ran at. The older state is the interval's start, unless

- the run skipped every update since (its steps were flagged): the snapshot held from before that run of flagged
  steps (:func:`before_run`);
- the LR jumped in the interval that ended at it (its record's LR at least
  :data:`~stabletrain.diagnostics.spike.LR_RISE` times the record's before), or the update its record measured (that
  interval's last, the one the state was made by) was :data:`~stabletrain.diagnostics.spike.STEP_GROWTH` times the
  records' before it: that state already took the large update, and a window it finds high is no outlier batch for
  that (a jump x30 on step 130, a spike at 132: its window high under step 130's state, "data"; an optimizer that
  ran one step at x200 its LR on step 60, the interval's last, and a spike at 64: "data", two samples named); the
  snapshot before it (:meth:`IntervalSnapshot.get_previous`), where kept, ran before it (:func:`before_jump`);
- it is in the course of a chain of earlier spikes (each at most :data:`AFTERSHOCK_STEPS` after the one before) whose
  first was diagnosed as the state's or the optimizer's (:data:`DRIFT_CLASSES`), applied or skipped: a kept snapshot from
  before that first one (held while the chain lasts, :meth:`IncidentCapture._hold_before_run`; ``observed.older_before_spike``);
- there is none (a spike right after the interval's start): an older checkpoint (rank 0's bundle looks one up).
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..diagnostics.spike import LR_RISE, STEP_GROWTH
from ..diagnostics.spike_evidence import lr_groups
from ..records.checkpoint.shards import is_dcp_entry
from ..records.staging import equal_states, join_params
from ..runstate import RunState

__all__ = ["spike_parts", "before_run", "before_jump", "lr_jumped_at", "update_jump", "update_jumped_at", "update_level_jump",
           "HISTORY_INTERVALS", "LEVEL_INTERVALS",
           "AFTERSHOCK_STEPS", "MAX_EARLIER_SAMPLES", "MAX_CONTEXT", "DRIFT_CLASSES"]

#: Ordinary windows a spike's bundle holds to compare against (the interval's steps before the spike, else the next ones).
MAX_CONTEXT = 3
#: How many of the run's interval records before a spike its bundle holds (their step, LR and update/weight ratio).
HISTORY_INTERVALS = 5
#: How many its bundle holds to find where the optimizer's steps rose to a new level and stayed (:func:`update_level_jump`).
LEVEL_INTERVALS = 12
#: An earlier spike of these classes (applied or skipped) found the state off: a later spike's older state is from before it.
DRIFT_CLASSES = ("state", "optimizer-state")
#: A spike this many steps or fewer after an applied one (guard.on_spike=warn) says it may be its aftershock; a drift's
#: chain of spikes (applied or skipped) lasts while each comes this many steps or fewer after the one before.
AFTERSHOCK_STEPS = 50
MAX_EARLIER_SAMPLES = 256  # earlier spikes' named samples a spike's bundle carries (the newest)


def spike_parts(engine: Any, fit: RunState, bundle: dict[str, Any], step: int, start: tuple[dict[str, Any], int],
                info: dict[str, Any], *, first: bool) -> None:
    """Add what a spike's counterfactual replays need to ``bundle`` (module docstring); ``engine``: the
    :class:`~stabletrain.services.capture.IncidentCapture`, ``start``: the state the capture replayed from and its step,
    ``first``: rank 0's bundle (it may look an older checkpoint up)."""
    src = engine.source
    guard = getattr(fit, "guard", None)
    rare = info.get("rarity") or (guard.rarity.before() if guard is not None else None)  # (the bar's ratios before it)
    # The loss curve's level before the spike's interval (the intervals' means, spikes included): ordinary windows within
    # spike_ratio x it are no drifted level where it is far above the rule's median (a heavy-tailed loss: counterfactual)
    means = [r["loss"] for r in [*engine.history, *fit.history] if r["step"] < step and isinstance(r.get("loss"), float)
             and math.isfinite(r["loss"])][-HISTORY_INTERVALS:]
    bundle["observed"].update(anomaly="spike", spike_window=list(info.get("spike_window") or []),
                              level=statistics.median(means) if means else None, **({"rarity": rare} if rare else {}),
                              history=[[r["step"], r.get("lr"), r.get("update_ratio")] for r in [*engine.history, *fit.history]
                                       if r["step"] < step][-LEVEL_INTERVALS:])
    typical = fit.precursor.typical_ratios() if fit.precursor is not None else {}
    if typical:  # each layer's usual update before the interval (an update clip's size: not one a surge inflated)
        bundle["observed"]["layer_ratios"] = typical
    if engine.last_spike is not None and 0 < step - engine.last_spike["step"] <= AFTERSHOCK_STEPS:
        bundle["observed"]["after_spike"] = dict(engine.last_spike)
    earlier = sorted((t, i) for i, t in engine.spiked_samples.items() if t < step)[-MAX_EARLIER_SAMPLES:]
    if earlier:
        bundle["observed"]["earlier_samples"] = [[i, t] for t, i in earlier]
    # A state the run made no update from since (its steps skipped) is the spike's own: the step before then led
    # nothing into the spike, and the older state is no other (FSDP: shards only; right after the interval's
    # start: the spike's own too).
    now = bundle.get("model")
    if bundle.get("previous") is not None and equal_states(bundle["previous"]["model"], now):
        bundle["previous"] = None
    older = src.strategy.one_process_model(start[0]["model"]) if start[1] < step - 1 else None
    ran = start[0].get("optimizer")  # the lrs its last step ran at; a host's scheduler may have stepped on since:
    if engine.start_lrs is not None and engine.snapshot.taken and start[1] == engine.snapshot.step:  # the source's word
        ran = {"param_groups": [{"lr": lr} for lr in engine.start_lrs]} if engine.start_lrs else None  # ([]: unknown)
    at = start[1]
    if older is not None and equal_states(older, now):  # the run skipped every update since: its steps were flagged
        older, at, ran = before_run(engine, start[1], now)
    elif older is not None and (lr_jumped_at(recent := bundle["observed"]["history"][-HISTORY_INTERVALS:], at)
                                or update_jumped_at(recent, at)):
        older, at, ran = before_jump(engine, at, now) or (older, at, ran)
    chain = engine.drift_at(step)
    if chain is not None and (older is None or at >= chain["onset"]):  # (None: the spike opens its interval)
        # The state is in the course of a drift an earlier spike met (its update applied or not; and the spikes after it):
        # a window it finds high tells no outlier batch from a state left off (a too-high LR's model errs most, and
        # confidently, on a few ordinary samples), so it is weighed under a kept snapshot from before that spike
        found = (_kept_older(engine, engine.snapshot.get_previous(), chain["onset"], now)
                 or _kept_older(engine, engine.snapshot.get_held(), chain["onset"], now))
        if found is not None and engine.held_lrs is not None and found[1] == (engine.snapshot.get_held() or (0, 0, -1))[2]:
            found = (*found[:2], {"param_groups": [{"lr": lr} for lr in engine.held_lrs]} if engine.held_lrs else None)
        bundle["observed"]["older_before_spike"] = {"spike": chain["onset"], "instead_of": at, "found": found is not None}
        if found is not None:
            older, at, ran = found
    reference = {"step": at, "model": older, "optimizer": lr_groups(ran)} if older is not None else None
    if reference is None and first and fit.dist.is_main and now is not None and not is_dcp_entry(now):
        # Within the rule window's reach only: a checkpoint from before the losses the rule weighs the spike against is
        # a less trained model that finds every window high (DDP keeps no snapshot before the interval's: a spike on its
        # first step was weighed under step 0's and called state, its two planted samples named "only under this state").
        # The window's losses end where the run of flagged steps before the spike begins; its oldest ran on the state
        # of the step before it (step 0's made step 1's loss).
        flagged, since = set(fit.guard.unordinary) if fit.guard is not None else set(), step
        while since - 1 in flagged:
            since -= 1
        reach = len(bundle["observed"]["spike_window"]) + (step - since) + 1
        found = src.reference_state(fit, start[1] if start[1] < step - 1 else step - 1, now, step - reach)
        reference = ({"step": found[1], "model": found[0], "optimizer": lr_groups(found[2]), "from": "checkpoint"}
                     if found and found[0] is not None else None)
        if found and reference is None:
            bundle["observed"]["reference_out_of_reach"] = {"step": found[1], "reach": reach}
    bundle["reference"] = reference


def before_run(engine: Any, before: int, now: Any) -> tuple[Any, int, Any]:
    """(model, step, optimizer lrs) of the snapshot held from before the run of flagged steps
    (:meth:`IncidentCapture._hold_before_run`), where it is older than step ``before`` and its model unlike ``now``;
    else (None, ...)."""
    found = _kept_older(engine, engine.snapshot.get_held(), before, now)
    if found is None:
        return None, before, None
    if engine.held_lrs is not None:  # the source's word (see start_lrs)
        found = (*found[:2], {"param_groups": [{"lr": lr} for lr in engine.held_lrs]} if engine.held_lrs else None)
    return found


def lr_jumped_at(history: list[list[Any]], at: int) -> bool:
    """Whether the interval record of step ``at`` (``[step, lr, ratio]``) has an LR :data:`LR_RISE` times or more the
    record's before it: the LR jumped in the interval that ended at step ``at``."""
    lrs = {int(t): lr for t, lr, *_ in history if isinstance(lr, (int, float)) and lr > 0}
    older = [t for t in lrs if t < at]
    return at in lrs and bool(older) and lrs[at] >= LR_RISE * lrs[max(older)]


def update_jump(history: list[list[Any]], at: int | None = None) -> dict[str, Any] | None:
    """The last interval record (``[step, lr, ratio]``; at step ``at`` or before it, where given) whose measured update (its
    interval's last step's, which made the state of its step) had a whole-model update/weight ratio :data:`STEP_GROWTH`
    times or more the median of the finite records before it (two at least): ``{"step", "ratio", "typical", "lr",
    "lr_before"}`` (``lr_before``: the median LR of those records); None where none did. The last, not the first: a run
    may have jumped early on and again just before its spike, and the later jump is the one that made the spike's state.
    What sends a spike's older state back one snapshot and what its evidence names."""
    rows = [(int(t), lr, float(r)) for t, lr, r, *_ in history if isinstance(r, (int, float)) and math.isfinite(r) and r > 0
            and (at is None or int(t) <= at)]

    def high(i: int) -> bool:
        return i >= 2 and rows[i][2] >= STEP_GROWTH * statistics.median(r for _, _, r in rows[:i])

    # The last jump: a high record whose record before it is not high, or is but far below it (a second jump); a high
    # record that merely stays where the one before it went is that jump's, not one of its own
    i = next((i for i in range(len(rows) - 1, 1, -1)
              if high(i) and (not high(i - 1) or rows[i][2] >= STEP_GROWTH * rows[i - 1][2])), None)
    if i is None:
        return None
    lrs = [lr for _, lr, _ in rows[:i] if isinstance(lr, (int, float)) and lr > 0]
    return {"step": rows[i][0], "ratio": rows[i][2], "typical": statistics.median(r for _, _, r in rows[:i]), "lr": rows[i][1],
            "lr_before": statistics.median(lrs) if lrs else None}


def update_level_jump(history: list[list[Any]], factor: float = 4.0) -> dict[str, Any] | None:
    """Where the optimizer's measured steps rose to a new level and stayed there while the LR rose x1.5 at most: the
    interval record (``[step, lr, ratio]``) that is ``factor`` times or more the median whole-model update/weight ratio of
    the 3 records before it, the one before it not, and the median of it and the 2 or more after it too (the rise's own
    record; the largest such rise): ``{"step", "level", "before", "lr", "lr_before"}``; None where there is none. An update
    multiplied inside the optimizer (a new user's x30 from step 120 on: x13.8) leaves no single large step to find."""
    rows = [(int(t), lr, float(r)) for t, lr, r, *_ in history if isinstance(r, (int, float)) and math.isfinite(r) and r > 0]
    best = None
    for i in range(3, len(rows) - 2):
        before, level = statistics.median(r for *_, r in rows[i - 3:i]), statistics.median(r for *_, r in rows[i:])
        if rows[i][2] < factor * before or rows[i - 1][2] >= factor * before or level < factor * before:
            continue
        lrs_before = [lr for _, lr, _ in rows[i - 3:i] if isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0]
        lrs_after = [lr for _, lr, _ in rows[i:] if isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0]
        lr_before, lr = (statistics.median(lrs_before) if lrs_before else None), (max(lrs_after) if lrs_after else None)
        if lr_before is None or lr is None or lr > 1.5 * lr_before:
            continue
        if best is None or level / before > best["level"] / best["before"]:
            best = {"step": rows[i][0], "level": level, "before": before, "lr": lr, "lr_before": lr_before}
    return best


def update_jumped_at(history: list[list[Any]], at: int) -> bool:
    """Whether the interval record of step ``at`` is where the measured update jumped (:func:`update_jump`)."""
    jump = update_jump(history, at)
    return jump is not None and jump["step"] == at


def before_jump(engine: Any, at: int, now: Any) -> tuple[Any, int, Any] | None:
    """(model, step, optimizer state) of the snapshot before the one of step ``at`` (kept where twice the snapshot fits),
    whose model is unlike ``now``; None where there is none."""
    return _kept_older(engine, engine.snapshot.get_previous(), at, now)


def _kept_older(engine: Any, kept: tuple[Any, Any, int] | None, before: int, now: Any) -> tuple[Any, int, Any] | None:
    """(model, step, optimizer state) of a kept snapshot ``kept`` ((side, rest, step): held or previous) older than step
    ``before`` whose one-process model is unlike ``now``; None otherwise."""
    if kept is None or kept[2] >= before or now is None:
        return None
    state = join_params(*kept[:2])
    model = engine.source.strategy.one_process_model(state["model"])
    if model is None or equal_states(model, now):
        return None
    return model, kept[2], state.get("optimizer")
