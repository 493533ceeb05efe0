"""Plain-text formatting shared by the report pages: numbers, percentages, step ranges, the parts of
an event's reason."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

__all__ = ["fmt_num", "fmt_pct", "step_ranges", "fmt_ranges", "plural", "first_clause", "one_line", "skip_reason", "skip_places",
           "stall_parts"]


#: Floats from here on are written in scientific notation by :func:`fmt_num`.
SCIENTIFIC_FROM = 1e7


def fmt_num(x: float | int | None, digits: int = 4) -> str:
    """Return ``x`` short and readable: ``2.297``, ``1.2e-04``, ``10,366``, ``2.263e+08``; "—" for None.

    A float from 1e7 on is in scientific notation (a diverging loss of 226,312,448 reads as 2.263e+08); an int
    (a count, a step) keeps every digit.
    """
    if x is None:
        return "—"
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    if isinstance(x, float) and abs(x) >= SCIENTIFIC_FROM:
        return f"{x:.{digits}g}"
    if isinstance(x, int) or (isinstance(x, float) and x.is_integer()):
        return f"{int(x):,}"
    if abs(x) >= 10 ** digits:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def fmt_pct(fraction: float) -> str:
    """Return a fraction as a percentage: whole percent, one decimal near 0% and 100%, one significant digit below 0.05%
    (never a false 0% or 100%: 1 of 30,000 is "0.003%")."""
    value = 100.0 * fraction
    if 0 < value < 0.05:
        return f"{value:.1g}%"
    if 0 < value < 1 or 99 < value < 100:
        return f"{value:.1f}%"
    return f"{value:.0f}%"


def step_ranges(steps: Iterable[int]) -> list[tuple[int, int]]:
    """Return sorted unique steps as inclusive runs of consecutive steps: [12, 13, 20] -> [(12, 13), (20, 20)]."""
    out: list[tuple[int, int]] = []
    for step in sorted(set(steps)):
        if out and step == out[-1][1] + 1:
            out[-1] = (out[-1][0], step)
        else:
            out.append((step, step))
    return out


def fmt_ranges(steps: Iterable[int], limit: int = 8) -> str:
    """Return steps as "812-813, 1,500" (at most ``limit`` ranges, then "and N more")."""
    ranges = step_ranges(steps)
    parts = [f"{a:,}" if a == b else f"{a:,}-{b:,}" for a, b in ranges[:limit]]
    if len(ranges) > limit:
        parts.append(f"and {len(ranges) - limit} more")
    return ", ".join(parts)


def plural(n: int, word: str, words: str | None = None) -> str:
    """Return "1 step" / "2 steps"."""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


def first_clause(text: str) -> str:
    """``text`` up to its first ``"; "`` outside parentheses (a clause's own aside keeps its brackets closed)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if depth <= 0 and text.startswith("; ", i):
            return text[:i]
    return text


def one_line(text: str, limit: int = 300) -> str:
    """The first line of ``text``, cut to ``limit`` characters with "…" ("" for blank text)."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


#: A stall as :meth:`~stabletrain.policies.stall.StallWatch.stalled` words it: its step, what the guard saw, what to try.
STALL = re.compile(r"the run is stalled at step (\d+): (.*): (no gradient reached the parameters(?: measurably)?) "
                   r"\(guard\.stall_steps=(\d+)\)\. Try (.*?); "
                   r"(?:guard\.on_stall=warn trains on|training on \(guard\.on_stall=warn\))")


def stall_parts(reason: str | None) -> dict[str, Any] | None:
    """A stall guard's reason (a ``stall`` event's, a stop's) in parts: ``step`` (where the guard saw it), ``since`` (the
    first step of the ``guard.stall_steps`` it looked at), ``what`` it saw, its ``gist`` (to the first colon: the steps,
    the loss scale) and ``advice`` (what to try); None for any other reason."""
    found = STALL.search(reason or "")
    if found is None:
        return None
    step = int(found[1])
    return {"step": step, "since": max(step - int(found[4]) + 1, 1), "what": f"{found[2]}: {found[3]}",
            "gist": found[2].split(": ")[0], "advice": found[5]}


def skip_reason(reason: str | None) -> str:
    """A skip event's reason, from what follows "skipped: " ("fp16 overflow ...")."""
    reason = reason or "no reason given"
    return reason.split("skipped: ", 1)[1] if "skipped: " in reason else reason


def routine_backoff(metrics: Iterable[dict[str, Any]], skips: Iterable[Any], skipped: int) -> bool:
    """Whether the skipped steps are the fp16 GradScaler's routine back-off, healthy (not "worth a look"): each an fp16
    overflow, the loss scale never below the guard's unrecoverable one, and few (3 steps, or 2% of the run's)."""
    from ..policies.stall import UNRECOVERABLE_SCALE

    metrics, skips = list(metrics), list(skips)
    # each an overflow (not "fp16 overflow or NaN": a NaN a batch made), each named (as many events as skips counted)
    if (not skips or len({e.step for e in skips}) != skipped
            or not all(skip_reason(e.reason).startswith("fp16 overflow (") for e in skips)):
        return False
    scales = [s for s in (*(r.get("loss_scale") for r in metrics), *(e.extra.get("loss_scale") for e in skips))
              if isinstance(s, (int, float)) and not isinstance(s, bool)]
    steps = max((int(r["step"]) for r in metrics if isinstance(r.get("step"), int)), default=0)
    # the scale seen to recover (no record of it: no evidence), and some update applied between
    return bool(scales) and all(s >= UNRECOVERABLE_SCALE for s in scales) and skipped <= max(3, 0.02 * steps) and (
        skipped < steps)


def skip_places(events: Iterable[Any]) -> str:
    """ " at 812-813 (fp16 overflow); at 900 (loss spike ...)": skip events' steps, grouped by reason ("" for none)."""
    by_reason: dict[str, list[int]] = {}
    for e in events:
        by_reason.setdefault(skip_reason(e.reason), []).append(e.step)
    # "at 812-813 (fp16 overflow)"; a reason with its own parentheses follows a colon instead
    parts = [f"at {fmt_ranges(steps)}" + (f": {reason}" if "(" in reason else f" ({reason})")
             for reason, steps in by_reason.items()]
    return " " + "; ".join(parts) if parts else ""


def scale_note(metrics: Iterable[dict[str, Any]], skips: Iterable[Any] = (), held: bool = False) -> str:
    """ "; the fp16 loss scale went 32,768 -> 8 (lowest 8)": the GradScaler's scale over the records and the skip events
    (``skips``: each its step's; the records hold an interval's last, and a back-off within the first one said nothing),
    in step order, where it moved."""
    seen = [(int(r["step"]), 1, r.get("loss_scale")) for r in metrics if isinstance(r.get("step"), int)]
    seen += [(e.step, 0, e.extra.get("loss_scale")) for e in skips]  # (each the scale after its step: a back-off's after it)
    kept = [(kind, float(s)) for _, kind, s in sorted(seen, key=lambda x: x[:2]) if isinstance(s, (int, float))
            and math.isfinite(s)]
    scales = [s for _, s in kept]
    if len(set(scales)) <= 1:  # (``held``: the value it held, said: an fp16 run with no step skipped)
        return f"; the fp16 loss scale held at {_scale(scales[0])}" if held and scales else ""
    first = " after its first back-off" if kept[0][0] == 0 else ""
    return f"; the fp16 loss scale went{first} {_scale(scales[0])} -> {_scale(scales[-1])} (lowest {_scale(min(scales))})"


def _scale(x: float) -> str:
    """A loss scale (a power of two, mostly): whole ones with every digit (8,388,608, not 8.38861e+06 beside 65,536)."""
    return f"{int(x):,}" if x.is_integer() and x < 1e15 else f"{x:.6g}"


def total_of(run: Any, key: str) -> int:
    """The sum of ``key`` over the run's metrics rows that hold a finite one."""
    return int(sum(r[key] for r in run.metrics if math.isfinite(r.get(key, math.nan))))


def went_back(events: list[Any], rollbacks: int = 1) -> str:
    """What went back past ``events`` (undone ones): "the rollback" ("the 3 rollbacks": ``rollbacks``), "the remedy's
    rollback", or both."""
    kinds = sorted({e.superseded_by for e in events if e.superseded_by})
    names = {"rollback": "the rollback" if rollbacks < 2 else f"the {rollbacks} rollbacks", "remedy": "the remedy's rollback"}
    return " and ".join(names.get(k, k) for k in kinds) or names["rollback"]
