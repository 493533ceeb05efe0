"""The spike rule a remedy's replays are judged by (:func:`~stabletrain.remedy_search.search_remedies`).

A replayed step is a failure where the guard's own rule calls it a spike, so the replay's rule starts where the run's
stood before the incident: the rule's own window and rarity bar, which the bundle holds (a spike's; a non-finite
step's too), or the state a rollback loads. Where the bundle's window is not what the run's steps were judged against,
the run's interval means before the incident are: after a level shift the rule kept flagging under
``guard.on_spike=warn`` (its window stayed at the old level), only those at the new one.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from types import SimpleNamespace
from typing import Any

import torch

from ..counterfactual import LEVEL_RUN
from ..policies.guard import Guard
from ..policies.spike_rule import armed_at

__all__ = ["replay_guard", "rule_window", "level_losses", "LEVEL_STEPS"]

#: A non-finite step's interval steps before it that tell a level shift by their majority; with fewer, the run of
#: flagged steps right before it does (a spike's burst is a new level from :data:`~stabletrain.counterfactual.LEVEL_RUN`).
LEVEL_STEPS = 3


def replay_guard(cfg: Any, observed: dict[str, Any], history: list[dict[str, Any]], saved: dict[str, Any] | None
                 ) -> Guard:
    """The host spike rule (``on_spike=warn``: it flags, the replay judges) for a replay of the incident ``observed``
    describes: from ``saved`` (a rollback's checkpointed guard), the bundle's rule window (:func:`rule_window`) and its
    rarity bar, or the run's interval means ``history`` before the incident; after a level shift, the losses at the new
    level (:func:`level_losses`), repeated to arm the rule where they are fewer (one loss left it judging nothing)."""
    guard = Guard(dataclasses.replace(cfg.guard, on_spike="warn"), torch.device("cpu"))
    window = rule_window(observed, cfg.guard.spike_ratio, history, cfg.log.every)
    if saved is not None:
        guard.load_state_dict(saved)
    elif window:  # the losses the rule judged it against, and its rarity bar's ratios (not a seed's made up)
        guard.mark_spikes([SimpleNamespace(values={"loss": float(v), "finite": 1.0}) for v in window])
        rarity = observed.get("rarity")  # (a bundle from before the bar: none, as a resume from then)
        guard.rarity.load_snapshot(rarity) if rarity else guard.rarity.load_state_dict({})
    else:
        level = level_losses(observed, history, cfg.log.every) if observed.get("spike_window") else []
        seeds = ([level[i % len(level)] for i in range(max(len(level), armed_at(cfg.guard)))] if level else
                 [float(r["loss"]) for r in history if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])])
        guard.mark_spikes([SimpleNamespace(values={"loss": v, "finite": 1.0}) for v in seeds])
    return guard


def rule_window(observed: dict[str, Any], ratio: float, history: list[dict[str, Any]] = (), every: int = 1
                ) -> list[float] | None:
    """The losses the replays' rule judges by: the bundle's rule window (a spike's; a non-finite step's since it has one),
    or None (the run's losses at the new level then, :func:`level_losses`). Not a non-finite step's where most of its
    interval's steps before it were above ``ratio`` x that window's median, or, with fewer than :data:`LEVEL_STEPS`
    before it in its interval, where LEVEL_RUN steps right before it were flagged and every loss since (the interval
    means wholly after, ``history`` of ``every`` steps, and its interval's own) is above that: the loss moved to a level
    the rule kept flagging under guard.on_spike=warn (a level shift), which would call every replayed step at it a spike,
    the samples' drop too. (Flagged non-finite or skipped steps are no new level: their intervals' finite losses are not.)"""
    window = observed.get("spike_window")
    if not window or observed.get("anomaly") == "spike":
        return window
    median = statistics.median(float(v) for v in window)
    recent = [float(r[1]) for r in observed.get("recent") or [] if math.isfinite(float(r[1]))]
    above = sum(x > ratio * median for x in recent)
    if len(recent) >= LEVEL_STEPS:
        shifted = 2 * above > len(recent)
    else:  # an interval's first steps (every step's at log.every=1): the run of flagged steps right before it, across
        # intervals, and every loss since at the new level
        level = level_losses(observed, history, every)
        shifted = (int((observed.get("flagged_before") or {}).get("steps", 0)) >= LEVEL_RUN and bool(level)
                   and all(x > ratio * median for x in level))
    return None if median > 0 and shifted else window


def level_losses(observed: dict[str, Any], history: list[dict[str, Any]], every: int) -> list[float]:
    """The run's losses since the run of flagged steps right before a non-finite incident began (``flagged_before``): the
    interval means wholly after its start (``history``, intervals of ``every`` steps) and the incident's interval's own
    steps after it; [] where the bundle names no such run."""
    since = (observed.get("flagged_before") or {}).get("since")
    if since is None or observed.get("anomaly") == "spike":
        return []
    means = [float(r["loss"]) for r in history if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])
             and isinstance(r.get("step"), int) and r["step"] - every + 1 >= since]
    return means + [float(r[1]) for r in observed.get("recent") or [] if int(r[0]) >= since and math.isfinite(float(r[1]))]
