"""Say what caused a finite loss spike, from counterfactual replays of its step: data, state, optimizer state, precision.

:mod:`stabletrain.counterfactual` replays the spike's step from its exact pre-step state, changing one thing at a
time, and hands the measurements to :func:`classify_spike`; the verdict and its evidence go into
``diagnosis.json`` as a non-finite step's do. The classes, tested in this order:

- ``not reproducible``: the replay's loss is not the run's (bitwise in fp32), or no spike by the rule: nondeterminism?
- ``precision``: under bf16/fp16 the same step in fp32 is normal by the rule.
- ``dropout``: with every dropout off the window is normal by the rule: the step's own masks made the spike (the
  samples are then weighed, and their removal verified, with dropout off: a row removed draws other masks).
- ``data``: a few samples carry the window's loss and the step without them is normal by the rule (verified by a
  replay), and the window is high under the older state too (the samples are bad whatever the weights; not a state
  that ran at an LR the run's intervals before it did not); or no small set carries it but the whole window is high
  under the older state: the batch is an outlier. High against ordinary windows under that same state, or what stands
  for them (:func:`ordinary_stand_in`); nothing else (not the rule's median under step 0's weights).
- ``optimizer-state``: Adam's second moment: in the update of the step before the spike (or of the spike's own), a
  layer's coordinates whose gradients were tiny for long get a large one (``|g| >> sqrt(v)``) and move many times as
  far as the layer's others; the window is not an outlier under the older state, and no divergence was under way
  (surges in several layers at once, the loss climbing before that update, or ordinary windows already high under the
  older state or under the state just before that update make the surge a symptom: ``state``).
- ``state``: the same window is normal under the older state and ordinary windows are high under this one: the model
  or the optimizer state drifted (a divergence onset, an LR too high). Also the verdict when nothing more specific holds.

Pure: no replay, no state. :mod:`.spike_evidence` turns tensors and per-module statistics into the evidence.
"""

from __future__ import annotations

import math
from typing import Any

from .failure_class import NOT_REPRODUCED_HINT
from .spike_evidence import MOSTLY_CARRIED, SURGE_FACTOR

__all__ = ["SPIKE_CLASSES", "classify_spike", "spike_summary", "ordinary_stand_in", "UPDATE_JUMP", "LR_RISE"]

SPIKE_CLASSES = ("data", "state", "optimizer-state", "precision", "dropout", "not reproducible")

#: A layer is blamed when at least this share of its coordinates surges and they move at least UPDATE_JUMP times
#: as far as its other coordinates in that update.
MIN_SHARE, UPDATE_JUMP = 1e-3, 3.0
#: Without an older state, a data spike's few samples must carry at least this share of the window's loss.
DATA_SHARE = 0.5
GRAD_JUMP = 1.5  #: A layer's gradient norm on the spike's window this many times an ordinary one's: a jump (evidence).
MANY_LAYERS = 3  #: Surges in this many layers in one update are the whole model's rise, not one layer's rarely trained.
#: The loss "already climbing" before a surging update: its last CLIMB_STEPS steps' losses each higher than the one
#: before, each at least CLIMB_RATIO times the rule's median and the last CLIMB_LAST times it.
CLIMB_STEPS, CLIMB_RATIO, CLIMB_LAST = 3, 1.25, 1.5
#: A state spike's evidence names the LR's rise since the older state from LR_RISE on, and the growth of the whole
#: model's update/weight ratio against the run's intervals before from STEP_GROWTH on.
LR_RISE, STEP_GROWTH = 2.0, 4.0
#: A window high under the older state too, whose loss the surging update before the spike raised less than this many
#: times, is the batch's: the surge is not named (a never-seen token's window x11,000 ordinary ones there, x1.13 after).
SURGE_LIFT = 1.5


def _against(older: dict[str, Any], named: bool = True) -> str:
    """The window's loss under the older state against what stands for ordinary windows there (:func:`ordinary_stand_in`),
    for a parenthesis; ``named``: say that ordinary windows were measured; below the rule's bar, its ``held`` share."""
    what, at = older.get("ordinary_from", "median" if older.get("no_context") else "windows"), older.get("ordinary_step")
    if what == "capture":
        return (f"{older['window']:.4g}, no ordinary window at hand: the capture at step {at}, in this run of flagged steps, "
                "found its whole batch high under an older state")
    held = f": x{older['window'] / older['ordinary']:.3g}, {_pct(older['held'])} of its excess now" if older.get("held") else ""
    return f"{older['window']:.4g} vs {older['ordinary']:.4g}" + {
        "windows": " on ordinary windows" if named else "", "median": ", the rule's median: the run's level before it",
        "step": f", the run's own loss at step {at}, under that state"}[what] + held


def _pct(x: float) -> str:
    if x < 0.01:
        return f"{100 * x:.2g}%"
    whole = f"{100 * x:.0f}"
    return f"{whole}%" if whole != "100" or x >= 1 else f"{math.floor(1000 * x) / 10:.1f}%"  # never "100%" of a part


def ordinary_stand_in(step: int, since: int, kept: list[float], after: dict[str, Any], median: float, as_high: bool
                      ) -> tuple[str | None, float | None]:
    """What stands for ordinary windows' loss under the older state of step ``step`` where none is at hand (all near the
    spike flagged, or the run stopped): ``(ordinary_from, loss)``; ``since``: the first of the flagged steps right before
    the spike (else the spike's), ``kept``: the rule's window, ``after``: the last captured spike's record, ``as_high``: the
    window under that state no lower than 1/spike_ratio of its loss now. "step": the run's own loss at the step after it
    (the rule's window holds every loss since step 1); "median": the rule's, for a trained state it spans from before the
    flagged steps (under step 0's weights every window is high, under one among them any may be); "capture" (loss None):
    an earlier capture among them found its whole batch high (data, no sample named); else ``(None, None)``: not weighed."""
    if len(kept) == since - 1 and step < len(kept):  # (no loss left out since step 1: kept[step] was step + 1's)
        return "step", float(kept[step])
    if 1 <= step <= since - 2 and step + 1 >= since - len(kept):
        return "median", median
    if since <= after.get("step", 0) and after.get("class") == "data" and not after.get("samples") and as_high:
        return "capture", None
    return None, None


def _apart_note(without: dict[str, Any]) -> str:
    """What a step without samples standing apart (``apart``: the gap below them) is, where it is above the median's bar."""
    return (f", z {without['zscore']:.3g}: no spike by the rule; the window's other samples lie below a x{without['apart']:.3g} "
            "gap, its own spread" if without.get("apart") else "")


def classify_spike(m: dict[str, Any]) -> dict[str, Any]:
    """Return ``{"failure_class", "evidence", "blamed_samples", "blamed_layer", "blamed_module"}`` for the measurements ``m``.

    ``m`` (from :func:`stabletrain.counterfactual.diagnose_spike`): ``reproduces``, ``why_not_reproducible``, ``loss``,
    ``precision``, ``fp32`` (the fp32 replay's rule test, or None), ``dropout`` (the window with dropout off, or None),
    ``samples`` (the verified set: ``indices``, ``share``, ``without``; or None), ``older`` (the window and ordinary windows
    under the older state: ``step``, ``window``, ``ordinary``, ``current_ordinary``, ``window_high``, ``ordinary_high``,
    ``ordinary_from``: None where nothing stood for them; or None), ``ordinary_now`` (without an older state: the ordinary
    windows' loss under this one and whether the rule calls it a spike; or None), ``surges`` (:func:`surge_rows` with
    ``step``: of the step before the spike and of the spike's own; only the former can be a cause), ``step`` (the spike's),
    ``where`` (:func:`departures`), ``jumps`` (:func:`jumps` of ``grad_norm`` and ``update_ratio``) and ``climb``
    (``[step, loss, ratio to the rule's median]`` of the interval's steps before the spike; ``older`` may also hold
    ``ordinary_then_high``: its ordinary windows a spike by the rule; ``ordinary_previous``: their loss under the state just
    before a surging update before the spike).
    """
    out: dict[str, Any] = {"blamed_samples": None, "blamed_layer": None, "blamed_module": None}
    older, samples = m.get("older"), m.get("samples")
    if not m.get("reproduces"):
        why = m.get("why_not_reproducible") or "the replay differs"  # (the hint where its figures differ from the run's)
        return {**out, "failure_class": "not reproducible",
                "evidence": f"{why}: {NOT_REPRODUCED_HINT}" if "differ" in why else why}
    fp32 = m.get("fp32")
    if fp32 is not None and not fp32["spike"]:
        where = m.get("where") or {}
        first, cured = where.get("first"), where.get("cured_by")
        out["blamed_module"] = cured or first
        text = (f"the same step in fp32 has loss {fp32['loss']:.4g}, no spike by the guard's rule (x{fp32['ratio']:.3g} the "
                f"window's median, z {fp32['zscore']:.3g}); in {m['precision']} it is {m['loss']:.4g}")
        departs = (f"the first module whose output departs from fp32's: '{first}' (relative error "
                   f"{where['first_error']:.3g})") if first else ""
        if cured:  # (the verified module first: a console line cut short keeps it, not only where it showed)
            text += (f"; '{cured}' alone in fp32 makes the step no spike (loss {where['cured_loss']:.4g}, verified)"
                     + (f": its output loses what '{first}' shows" if cured != first and first else ""))
        text += f"; {departs}" if departs else ""
        return {**out, "failure_class": "precision", "evidence": text}
    draw = m.get("dropout")
    if draw is not None and draw.get("made_by_draw", draw["normal"]):
        how = (f"normal by the guard's rule (x{draw['ratio']:.3g} the window's median, z {draw['zscore']:.3g})"
               if draw["normal"] else f"{_pct(1 - draw['loss'] / m['loss'])} of it gone")
        return {**out, "failure_class": "dropout",
                "evidence": (f"with every dropout off the window's loss is {draw['loss']:.4g}, {how}; under the step's "
                             f"own dropout masks it is {m['loss']:.4g}: the draw made the spike, not the samples nor "
                             "the state")}
    # The window high under the older state too names the batch, unless ordinary windows are now a spike by the rule
    # as well, or as high as the window: the state then drifted (and dropping a drifted window's largest losses brings
    # it under the rule's bar too).
    weighed = older is not None and older.get("ordinary_from", "windows") is not None  # (against what stands for them)
    drifted_now = older is not None and bool(older.get("ordinary_spike_now")
                                              or (older["ordinary_high"] and older.get("window_not_above_now")))
    # The older state ran at an LR the run's intervals before it did not (x LR_RISE): it took updates at the new one, and a
    # window it finds high is no outlier batch for that (a divergence amplifies some batches more than others).
    sizes, lr = m.get("steps"), (older or {}).get("lr")
    fresh = bool(sizes and sizes.get("lr") and lr and LR_RISE * lr["then"] >= lr["now"] >= LR_RISE * sizes["lr"])
    # Ordinary windows under this state guard.spike_ratio times the run's level before the spike (the rule's median; the
    # full rule's z-score may pass them, its window's spread grown), and as high under the older state or risen that much
    # since: the state drifted, whatever the window shows under the older state (a damaged model errs most on some samples).
    # (as high under the older state: only one the rule's median reaches back past, :func:`_off_level`; under step 0's,
    # or before the median's losses, ordinary windows above it are a loss that fell since, or a few noisy first losses)
    levels = (older or {}).get("levels") or [0.0, 0.0]
    risen = ((older or {}).get("median") or 0) > 0 and levels[1] > older["ratio"] and (_off_level(older, m, True)
                                                                                         or older["ordinary_high"])
    risen = risen and "within_spread" not in older  # (ordinary windows within the loss's own spread: no drifted level)
    # Ordinary windows already high under the state just before a surging update before the spike (and now): the state
    # was off before that update (an applied spike's aftershock), the window high under the older state no outlier batch.
    off_before = (older is not None and older["ordinary_high"] and older.get("ordinary_previous") is not None
                  and (older["ordinary"] or 0) > 0 and older["ordinary_previous"] > older["ratio"] * older["ordinary"])
    # (high there by the share it held alone, below the bar: not where the update before it surged and lifted it x1.5)
    surged = (older is not None and older.get("held") and m["loss"] > SURGE_LIFT * older["window"]
              and _surging_layer([r for r in m.get("surges") or [] if r.get("step", -1) < m.get("step", 0)]) is not None)
    high_before = (older is not None and older["window_high"] and not drifted_now and not fresh and not risen
                   and not off_before and not surged)
    overrode = risen and older["window_high"]  # (what tells this state from a calm one that finds the window high too)
    # No older state to weigh the window against: ordinary windows that are spikes by the rule under this state say
    # the state drifted (then dropping a drifted window's largest losses "cures" it too: no sample is to blame).
    now = m.get("ordinary_now") if older is None else None
    drifted = now is not None and now["spike"]
    # Nor, without one, do a few samples that carry a small share of the loss name a data spike: in a drifted state
    # dropping the window's largest losses brings any window under the rule's bar.
    weak = older is None and samples is not None and samples["share"] < DATA_SHARE
    if samples is not None and (older is None and not drifted and not weak or high_before):
        out["blamed_samples"] = samples["indices"]
        n = len(samples["indices"])
        return {**out, "failure_class": "data",
                "evidence": (f"sample{'s' if n > 1 else ''} {', '.join(map(str, samples['indices']))} carr"
                             f"{'y' if n > 1 else 'ies'} {_pct(samples['share'])} of the window's loss"
                             + ("" if samples.get("how") != "removal" else
                                f" (found by dropping samples from the whole window: {samples.get('why')})") + "; without "
                             f"{'them' if n > 1 else 'it'} "
                             f"the step is normal (verified{' with dropout off' if m.get('dropout') is not None else ''}: "
                             f"loss {samples['without']['loss']:.4g}, "
                             f"x{samples['without']['ratio']:.3g} "
                             "the median" + _apart_note(samples["without"]) + ")"
                             + (f"; the window is high under the state of step {older['step']} too "
                                f"({_against(older, False)})" if older else "") + _level_caution(m.get("update_level"), older))}
    # Only an update before the spike's loss can have caused it: the step before's (the spike's own comes after it).
    blamed = _surging_layer([r for r in m.get("surges") or [] if r.get("step", -1) < m.get("step", 0)])
    rise = lr["now"] / lr["then"] if lr else 1.0
    growth = sizes["now"] / sizes["before"] if sizes and not sizes.get("own") else 1.0  # (a window's own: its gradient too)
    moved = _moved_factor(older, sizes, m.get("step", 0))  # (the steps since the older state: an LR raised, then lowered)
    acquit = ""  # why a surge is not the cause: every coordinate moved further, or its update lowered this window's loss
    if (blamed is not None and (rise >= LR_RISE or growth >= STEP_GROWTH or moved >= STEP_GROWTH)
            and max(rise, growth, moved) >= blamed["coord_factor"]):
        acquit = (f"; {'' if blamed.get('whole') else 'a few of '}{blamed['name']}'s coordinates surged in the update of "
                  f"step {blamed['step']} (x{blamed['coord_factor']:.3g} as far as {_others(blamed)}), less than every "
                  "coordinate's steps grew"
                  + (f" since step {older['step']} (x{moved:.3g})" if moved >= max(rise, growth) else ""))
    elif (blamed is not None and older is not None and older["window_high"] and math.isfinite(older["window"])
          and m["loss"] <= older["window"] + (SURGE_LIFT - 1) * abs(older["window"])):  # (high against ordinary windows
        # there too: the batch's; raised by less than half its size, a loss below 0 too)
        acquit = (f"; {blamed['name']}'s surging update of step {blamed['step']} is not its cause: the window was "
                  f"{'as' if older['window'] >= m['loss'] else 'nearly as'} high under the state of step {older['step']} "
                  f"({older['window']:.4g}; {m['loss']:.4g} now)")
    acquit = acquit or (_whole_model_rise(m, blamed, older) if blamed is not None else "")
    if acquit:
        blamed = None
    if high_before and blamed is None:  # (a surge in the update before is a cause; a high window, one by elimination)
        note = m.get("samples_note") or ""
        if MOSTLY_CARRIED in note:  # its largest losses carry most of it: more bad samples than a few, not none
            return {**out, "failure_class": "data",
                    "evidence": (f"the whole window is high under the state of step {older['step']} too ({_against(older)}); "
                                 f"its largest losses carry most of it, but more of its samples are bad than a few: {note}"
                                 + acquit)}
        return {**out, "failure_class": "data",
                "evidence": (f"the whole window is high under the state of step {older['step']} too ({_against(older)}) "
                             "and no small set of its samples carries it: the batch itself is an outlier"
                             + (f" (the search for a few: {note})" if note else "") + acquit)}
    drift = ""
    if high_before:  # (with a surge before it: the surge is the cause named)
        drift = f"; the window is high under the state of step {older['step']} too ({_against(older, False)})"
    elif drifted:
        drift = (f"; ordinary windows are high under this state too ({now['loss']:.4g}, a spike by the guard's rule; "
                 "no older state to weigh them against)")
    elif weak:
        drift = (f"; no older state to weigh the window against, and no few samples carry most of it (the "
                 f"{len(samples['indices'])} largest: {_pct(samples['share'])})")
    elif older is None and now is not None:
        spread = m.get("spread") or 0.0  # (most samples a spike alone: the batch, not a few rarely trained coordinates)
        drift = (f"; ordinary windows are normal under this state ({now['loss']:.4g}) and no older state is at hand to "
                 "weigh the window against (the spike opens its log interval): the window itself may carry it"
                 + (f" ({_pct(spread)} of its samples are a spike by the rule alone: an outlier batch)" if spread >= 0.5 else ""))
    elif older is not None and older.get("no_context"):  # (no ordinary window measured under either state)
        window = (f"the window is normal under the state of step {older['step']} ({_against(older)})" if weighed else
                  f"the window's loss is {older['window']:.4g} under the state of step {older['step']}, with no ordinary "
                  "window at hand to weigh it against there")
        drift = (f"; {window}; the rule's median, the run's level before it, stands for ordinary windows under this state "
                 f"({older['current_ordinary']:.4g})")
    elif older is not None:
        now, then = older["current_ordinary"], older["ordinary"]
        if older["ordinary_high"] and now <= then:  # a spike by the rule now, and higher still then: no calm state
            where = (f"a spike by the guard's rule at {now:.4g} under this one, and higher still under that state "
                     f"({then:.4g}): the loss has been unsettled since")
        else:
            where = f"{'high at' if older['ordinary_high'] else 'at'} {now:.4g} under this one (vs {then:.4g})"
        if overrode:
            where += (f", x{levels[1]:.3g} the run's level before the spike under this one ({older['median']:.4g}, the "
                      f"rule's median; x{levels[0]:.3g} under that state)")
        if older["window_high"]:  # (and ordinary windows rose since: high_before is off)
            window = f"the window is high under the state of step {older['step']} too ({older['window']:.4g} vs {then:.4g})"
            near = f"within x{older['ratio']:g} of" if older.get("ratio") else "near"  # (guard.spike_ratio)
            where += (f", {near if older.get('window_not_above_now') else 'a spike by the rule against'} the window's "
                      f"{m['loss']:.4g}")
        elif older.get("ordinary_then_high"):  # (not a spike ratio above ordinary windows there, which are no calm level)
            bar = f"x{older['ratio']:g} (guard.spike_ratio)" if older.get("ratio") else "guard.spike_ratio times"
            window = (f"the window is not {bar} above ordinary windows under the state of step {older['step']} "
                      f"({older['window']:.4g} vs {then:.4g}, themselves a spike by the guard's rule there)")
        else:
            window = f"the window is normal under the state of step {older['step']} ({older['window']:.4g})"
        drift = f"; {window} and ordinary windows are {where}"
    if samples is not None and not weak:
        drift += (f"; samples {', '.join(map(str, samples['indices']))} carry {_pct(samples['share'])} of the loss, "
                  + ("but ordinary windows are high under this state too" if drifted_now else
                     "but ordinary windows are far above the run's level before under this state too: the state "
                     "drifted" if overrode else f"but the state of step "
                     f"{older['step']} already ran at x{lr['now'] / sizes['lr']:.3g} the LR of the run's intervals before "
                     "it: none from before the rise to weigh them under" if fresh else "but only under the current state"
                     if weighed else "but the window is weighed against no ordinary window under the older state"))
    if blamed is not None:
        out["blamed_layer"] = blamed["name"]
        return {**out, "failure_class": "optimizer-state",
                "evidence": (f"Adam's second moment: in the update of step {blamed['step']}, {_pct(blamed['surge_share'])} of "
                             f"{blamed['name']}'s coordinates got a gradient past {SURGE_FACTOR:g}x sqrt(v) after tiny "
                             f"gradients and moved x{blamed['coord_factor']:.3g} as far as {_others(blamed)}" + drift)}
    own = (_surging_layer([r for r in m.get("surges") or [] if r.get("step") == m.get("step")])
           if older is None and now is not None and not drifted and (m.get("spread") or 0.0) < 0.5 else None)
    if own is not None:  # no update before it was replayed: the window's own reach into rarely trained coordinates
        out["blamed_layer"] = own["name"]
        return {**out, "failure_class": "optimizer-state",
                "evidence": (f"Adam's second moment: this window's gradients reach {_pct(own['surge_share'])} of "
                             f"{own['name']}'s coordinates past {SURGE_FACTOR:g}x sqrt(v), rarely trained ones (its update "
                             f"moves them x{own['coord_factor']:.3g} as far as {_others(own)}), while ordinary windows are "
                             f"normal under this state ({now['loss']:.4g}); the update before the spike was not replayed "
                             "(it opens its log interval: no older state), so which step moved them is not measured")}
    where = m.get("where") or {}
    untold = older is None and now is not None and not drifted  # ordinary windows normal, no older state
    alone = weighed and not older["window_high"] and not older["ordinary_high"]  # only this window rose
    rose = older is not None and not weighed and 0 < older["ratio"] * older["window"] < m["loss"]  # (the same window: a fact)
    if alone or rose:
        text = (f"the updates since step {older['step']} raised this window's loss "
                + ("against ordinary windows'" if alone else f"x{m['loss'] / older['window']:.3g}")
                + " (the state and this window, not told apart)")
    else:
        text = ("the model or optimizer state, or this window (not told apart)" if untold or older is not None and not weighed
                else "the model or optimizer state drifted (a divergence onset, or an LR too high)")
    # (what moved the state first, the weighing after: the console's line keeps the first clauses that fit)
    text += (_lr_told(m.get("stretch_lrs"), older) + _steps_grew(sizes, older)
             + _update_jump(m.get("update_jump"), older) + drift + acquit
             + _moved(older, sizes, m.get("update_jump"), m.get("step", 0)))
    if where.get("first"):
        out["blamed_module"] = where["first"]
        text += f"; first module whose output departs: '{where['first']}' (x{where['first_factor']:.3g})"
    grads = [j for j in (m.get("jumps") or {}).get("grad_norm") or [] if j[1] >= GRAD_JUMP]
    if grads:
        text += "; gradient jumps: " + ", ".join(f"{n} x{f:.3g}" for n, f, *_ in grads)
    measured = m.get("jumps") or {}
    ratios = measured.get("update_ratio") or []  # the spike step's update/weight against an ordinary one's (x >= 1)
    updates = [j for j in ratios if j[1] >= GRAD_JUMP]
    if updates:
        text += "; update/weight jumps: " + ", ".join(f"{n} x{f:.3g} ({v:.2g} vs {b:.2g})" for n, f, v, b in updates)
    elif "update_ratio" in measured:  # (against ordinary windows under this state: its LR too, whatever raised it)
        text += ("; no layer's update/weight ratio jumped" + (f" (largest: {ratios[0][0]} x{ratios[0][1]:.3g})" if ratios
                                                               else " (none above an ordinary step's)")
                 + " against ordinary windows under this state and its LR")
    return {**out, "failure_class": "state", "evidence": text}


def _lr_told(lrs: list[list[float]] | None, older: dict[str, Any] | None) -> str:
    """The LR's jump at one update (:func:`_lr_jump`) and its rise since the older state (:func:`_lr_rise`), said once where
    the rise is that jump, from the same LR to the same LR (a trial: "the LR jumped x30 at step 151's update (0.003 ->
    0.09); the LR rose x30 since step 150 (0.003 -> 0.09)"): the rise."""
    jump, rise, lr = _largest_lr_jump(lrs, older), _lr_rise(older), (older or {}).get("lr")
    if jump and rise and math.isclose(jump[2], lr["then"], rel_tol=1e-6) and math.isclose(jump[3], lr["now"], rel_tol=1e-6):
        return rise
    return _lr_jump(lrs, older) + rise


def _lr_jump(lrs: list[list[float]] | None, older: dict[str, Any] | None) -> str:
    """The largest jump of the LR from one step to the next (``lrs``: ``[[t, lr], ...]``, a host's steps as it set them)
    at an update since the older state, where :data:`STEP_GROWTH` times or more: a burst that ended before the spike
    shows in neither state's LR. A warmup's ramp (x2 from its first step to its second at most) is none."""
    jump = _largest_lr_jump(lrs, older)
    return "" if jump is None else "; the LR jumped x{:.3g} at step {}'s update ({:.3g} -> {:.3g})".format(*jump)


def _largest_lr_jump(lrs: list[list[float]] | None, older: dict[str, Any] | None) -> tuple[float, int, float, float] | None:
    """(ratio, step, LR before, LR after) of :func:`_lr_jump`'s jump; None where there is none."""
    since = older["step"] if older is not None else -1
    steps = sorted((int(t), float(lr)) for t, lr in lrs or [] if lr > 0)
    jumps = [(b / a, t, a, b) for (s, a), (t, b) in zip(steps, steps[1:]) if t == s + 1 and t > since]
    best = max(jumps, default=None)
    return best if best is not None and best[0] >= STEP_GROWTH else None


def _lr_rise(older: dict[str, Any] | None) -> str:
    """The LR's rise since the older state (or ``since`` a later record), where it at least doubled (a warmup's climb, a jump)."""
    lr = (older or {}).get("lr")
    if not lr or lr["now"] < LR_RISE * lr["then"]:
        return ""
    return (f"; the LR rose x{lr['now'] / lr['then']:.3g} since step {lr.get('since', older['step'])} ({lr['then']:.3g} -> "
            f"{lr['now']:.3g})")


def _steps_grew(sizes: dict[str, Any] | None, older: dict[str, Any] | None) -> str:
    """The whole model's update/weight ratio against the run's before, where it grew :data:`STEP_GROWTH` times or more,
    and the LR now against the one those intervals ran at (the older state's where they did not record one)."""
    if not sizes or sizes["now"] < STEP_GROWTH * sizes["before"]:
        return ""
    lr, was = (older or {}).get("lr"), sizes.get("lr")
    if not lr and was and sizes.get("lr_now"):  # no older state: the LR this state steps at against the intervals'
        lr = {"now": sizes["lr_now"], "then": was}
    f = lr["now"] / (was or lr["then"]) if lr else 1.0  # (an LR that jumped at the older state's step: theirs was lower)
    same = ("" if not lr else " at the same LR" if max(f, 1 / f) < 1.01 else " with it" if _lr_rise(older) else
            f" with the LR (x{f:.3g}: {was:.3g} -> {lr['now']:.3g})" if was and f >= LR_RISE else "")
    on = "the spike's own window (no ordinary one at hand: its gradient counts too)" if sizes.get("own") else "ordinary windows"
    return (f"; the optimizer's steps grew x{sizes['now'] / sizes['before']:.3g}{same}: update/weight {sizes['now']:.2g} on "
            f"{on} under this state against {sizes['before']:.2g} in the run's intervals up to step {sizes['upto']}")


def _level_caution(level: dict[str, Any] | None, older: dict[str, Any] | None) -> str:
    """A data verdict's caution where the optimizer's steps rose to a new level and stayed, at no higher LR, by the older
    state it was weighed under (``update_level`` of :func:`~stabletrain.counterfactual.diagnose_spike`): that state is
    inside the drift, and a drifted model's loss sits on a few hard samples (a new user's x30 update inside AdamW)."""
    if not level or (older is not None and older["step"] < level["step"]):
        return ""
    rise = level["lr"] / level["lr_before"]
    lr = "at no higher LR" if rise <= 1.01 else f"with the LR x{rise:.2g}"
    return (f"; but the optimizer's steps have run x{level['level'] / level['before']:.3g} their size since step "
            f"{level['step']} {lr} (update/weight {level['level']:.2g} vs {level['before']:.2g}): the state may have "
            "drifted, and these may be ordinary hard samples (a lower LR tells)")


def _update_jump(jump: dict[str, Any] | None, older: dict[str, Any] | None) -> str:
    """The interval record whose measured update jumped (``update_jump`` of :func:`~stabletrain.counterfactual.diagnose_spike`),
    with its LR against the record's before: one large step (an LR raised inside the optimizer, a bad update) made the state."""
    if not jump:
        return ""
    lr, was = jump.get("lr"), jump.get("lr_before")
    f = lr / was if isinstance(lr, (int, float)) and isinstance(was, (int, float)) and was > 0 else None
    same = "" if f is None else " at the same LR" if abs(f - 1) < 0.01 else f" with the LR x{f:.3g}" if f >= LR_RISE else ""
    held = f": the state of step {older['step']} holds it" if older is not None and older["step"] >= jump["step"] else ""
    return (f"; the update of step {jump['step']} (its interval's measured one) was x{jump['ratio'] / jump['typical']:.3g} the "
            f"run's before it{same} (whole-model update/weight {jump['ratio']:.2g} vs {jump['typical']:.2g}){held}")


def _moved(older: dict[str, Any] | None, sizes: dict[str, Any] | None, jump: dict[str, Any] | None, step: int) -> str:
    """How far the weights moved since the older state (``moved``: ||theta - theta_then|| / ||theta_then||) against as many of
    the run's typical steps (``sizes["before"]``, per step) could move them, where :data:`STEP_GROWTH` times or more: a
    large update since then that no interval record measured (one inside an interval); not where one did (``jump``)."""
    moved, per = (older or {}).get("moved"), (sizes or {}).get("before")
    if _moved_factor(older, sizes, step) < STEP_GROWTH or jump and jump["step"] > older["step"]:
        return ""
    n = step - 1 - older["step"]
    return (f"; the weights moved {moved:.2g} of their norm in the {n} update{'s' if n > 1 else ''} since step {older['step']}, "
            f"x{moved / (n * per):.3g} as far as {n} of the run's typical steps could ({per:.2g} each, its interval records): "
            "a large update, or several, among them")


def _moved_factor(older: dict[str, Any] | None, sizes: dict[str, Any] | None, step: int) -> float:
    """How many times as far as the run's typical steps (``sizes["before"]``, per step) could move them the weights moved
    in the updates since the older state (1.0 where not measured)."""
    # the updates between that state and the spike's (an interval snapshot's: an older checkpoint's stretch may hold a
    # run's first, larger steps, which its recent records do not measure)
    n = step - 1 - older["step"] if older is not None and older.get("from", "snapshot") == "snapshot" else 0
    moved, per = (older or {}).get("moved"), (sizes or {}).get("before")
    return moved / (n * per) if n >= 1 and isinstance(moved, (int, float)) and per else 1.0


def _whole_model_rise(m: dict[str, Any], blamed: dict[str, Any], older: dict[str, Any] | None) -> str:
    """Why a surge in the update before the spike is not its cause though nothing grew by the LR's or the steps' bars
    (empty: it is): surges in :data:`MANY_LAYERS` layers at once (every layer's gradients rose, not one layer's rarely
    trained coordinates), the loss already climbing over the steps before that update, or ordinary windows already
    a spike by the guard's rule under the older state, or guard.spike_ratio times the run's level under it (the interval's
    snapshot) and under this state: a divergence under way, of which the surge is a symptom."""
    at = blamed["step"]
    layers = sorted({r["name"] for r in _passing(m.get("surges") or []) if r.get("step") == at})
    if len(layers) >= MANY_LAYERS:
        shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
        return (f"; coordinates of {len(layers)} layers surged in the update of step {at} at once ({shown}): every "
                "layer's gradients rose, not one layer's rarely trained coordinates")
    climb = [r for r in m.get("climb") or [] if r[0] <= at][-CLIMB_STEPS:]
    if (len(climb) == CLIMB_STEPS and all(a[1] < b[1] for a, b in zip(climb, climb[1:]))
            and all(r[2] >= CLIMB_RATIO for r in climb) and climb[-1][2] >= CLIMB_LAST):
        return (f"; the loss was already climbing before the update of step {at} (x"
                + ", x".join(f"{r[2]:.3g}" for r in climb) + f" the rule's median at steps {climb[0][0]}-{climb[-1][0]})")
    if older is not None and older.get("ordinary_then_high"):
        return (f"; ordinary windows were already a spike by the guard's rule under the state of step {older['step']} "
                f"({older['ordinary']:.4g}), before that update")
    before, then = (older or {}).get("ordinary_previous"), (older or {}).get("ordinary")
    if before is not None and older["ordinary_high"] and (then or 0) > 0 and before > older["ratio"] * then:  # (off_before)
        # (the state right before the surging update, replayed: ordinary windows already high there, not by it)
        return (f"; {blamed['name']}'s coordinates surged in the update of step {at} (x{blamed['coord_factor']:.3g} as far "
                f"as {_others(blamed)}), but ordinary windows were already at {before:.4g} under the state just before that "
                f"update, x{before / then:.3g} their {then:.4g} under the state of step {older['step']}: the state was off "
                "before it")
    # Far above the run's level under the interval's start and under this state (the rule's z-score may pass them: its
    # window's spread grew with the unsettled loss): the state drifted before that update (an LR too high; _off_level)
    levels = (older or {}).get("levels")
    if _off_level(older, m) and min(levels) > older["ratio"]:
        return (f"; {blamed['name']}'s coordinates surged in the update of step {at} (x{blamed['coord_factor']:.3g} as far "
                f"as {_others(blamed)}) in a run already off its level: ordinary windows ran at x{levels[0]:.3g} the run's "
                f"level before the spike ({older['median']:.4g}, the rule's median) under the state of step {older['step']}, "
                "before that update")
    return ""


def _off_level(older: dict[str, Any] | None, m: dict[str, Any], checkpoint: bool = False) -> bool:
    """Ordinary windows guard.spike_ratio times the run's level before the spike (the rule's median) under the older
    state, where that says the run was off its level there: a state after the run's start within the reach of the rule's
    window (its median is the run's level around it, not a level an untrained or older state was far above in a loss
    still falling fast, nor the lower middle of a just-armed rule's few noisy first losses): an interval snapshot, or
    with ``checkpoint`` an older checkpoint too (one is loaded only within about that reach: the rule window's losses and
    the flagged steps before the spike)."""
    levels, bar, span = (older or {}).get("levels"), (older or {}).get("ratio"), (older or {}).get("span") or 0
    return bool(older is not None and (checkpoint or older.get("from", "snapshot") == "snapshot")
                and 0 < m.get("step", 0) - older["step"] <= span and older["step"] > 0 and (older.get("median") or 0) > 0
                and levels and bar and levels[0] > bar)


def _passing(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r["surge_share"] >= MIN_SHARE and r["coord_factor"] >= UPDATE_JUMP]


def _others(row: dict[str, Any]) -> str:
    """What a surge's coordinates moved against: the layer's other coordinates, or (the whole layer surging) the other
    layers' steady ones."""
    return "the other layers' steady coordinates" if row.get("whole") else "its others"


def _surging_layer(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The layer whose surging coordinates moved the most times its others, among those that pass the bars, or None."""
    fit = _passing(rows)
    return max(fit, key=lambda r: r["coord_factor"]) if fit else None


def spike_summary(d: dict[str, Any]) -> str:
    """One line for a person: the class, its evidence, whether it reproduces."""
    head = f"{d['failure_class']}: {d['evidence']}"
    if d["failure_class"] != "not reproducible":
        head += "; reproduces on replay"
    return head
