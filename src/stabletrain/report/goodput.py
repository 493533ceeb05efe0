"""Goodput: the share of a run's wall time, over every launch of it (restarts included), spent on steps it kept.

Read from the run directory only: the ledger ``goodput.jsonl`` (:mod:`stabletrain.callbacks.goodput_clock`) and the
``restart`` events. In the terms of Google's ml-goodput-measurement, the wall time splits into :data:`PARTS`;
``goodput = productive / total``, where ``total`` runs from each launch's first process to its end, plus the
wait between a launch's death and its restart (a person's resume, days later, is not the run's time).

A launch killed outright writes no ``end`` line: it ends when its launcher saw it die (the restart event's
``cause.time``) or, with no launcher's word, at its last line; the time after its last log interval is
``redone`` (those steps were trained and lost). Steps are ``redone`` when a later launch resumed from, or a
rollback went back to, a step before them, or when the launch that trained them ended in an exception (a ``crash``
event) before it checkpointed them: its ``end`` line's time in the steps after its last log interval is redone too.
A launch that died in its start-up (before its ledger's first line) is known by its ``restart`` event alone: it is
counted among the launches, and its time is start-up (the wait).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..callbacks.goodput_clock import LEDGER_FILE
from ..records.jsonl import read_jsonl

__all__ = ["Goodput", "read_goodput", "goodput_section", "PARTS"]

#: Where the wall time went: part -> (its words in the printed line, what it counts).
PARTS: dict[str, tuple[str, str]] = {
    "productive": ("productive", "steps the run kept, their updates applied"),
    "redone": ("redone", "steps trained again after a restart or a rollback, or lost: a killed or crashed launch's "
                         "steps after its last checkpoint"),
    "skipped": ("skipped steps", "steps kept whose update was skipped (non-finite, overflow, a spike)"),
    "checkpoint": ("checkpoint stalls", "the loop blocked by checkpoint saves (the check and the staging copy)"),
    "startup": ("start-up", "from each launch's first process to its first step (imports, process group, task, "
                            "restore, compile set-up), and the wait before each restart"),
    "eval": ("evaluation", "validation passes"),
    "incident": ("incidents", "incident capture and diagnosis"),
    "other": ("other", "the rest: each launch's end (its last checkpoint's write, closing) and bookkeeping"),
}


#: Under this many seconds of wall time in all, the report says that start-up weighs on the figure.
SHORT_RUN_S = 60.0


@dataclass
class Goodput:
    """Seconds per part of :data:`PARTS` (they add up to ``total_s``), over ``launches`` launches and ``restarts``."""

    seconds: dict[str, float]
    total_s: float
    launches: int
    restarts: int
    refused: int = 0  # launches that refused to restart the run (a crash loop), each at its start

    @property
    def goodput(self) -> float:
        return self.seconds["productive"] / self.total_s if self.total_s > 0 else 0.0

    def share(self, part: str) -> float:
        return self.seconds[part] / self.total_s if self.total_s > 0 else 0.0

    def short_note(self) -> str:
        """What a run too short to judge by its goodput is told ("" for one of minutes, or one not mostly start-up)."""
        return ("A run this short spends much of it starting up (imports, the task, the first checkpoint): goodput means "
                "more over minutes of training." if self.total_s < SHORT_RUN_S and self.share("startup") >= 0.2 else "")

    def line(self) -> str:
        """``goodput 94.2% over 3 launches (lost: 3.1% redone after 2 restarts, 1.4% checkpoint stalls, ...)``."""
        lost = sorted((p for p in PARTS if p != "productive" and self.share(p) >= 0.0005), key=self.share, reverse=True)
        words = [f"{self.share(p):.1%} {PARTS[p][0]}" + (f" after {self.restarts} restart{'s' * (self.restarts != 1)}"
                                                          if p == "redone" and self.restarts else "") for p in lost]
        # The launches that trained (or tried to); a launch that refused to restart trained nothing: said apart
        trained = self.launches - self.refused
        launches = f"{trained} launch{'es' * (trained != 1)}"
        refused = ("and one more that started only to refuse a restart: a crash loop; " if self.refused == 1 else
                   f"and {self.refused} more that started only to refuse a restart: crash loops; " if self.refused else "")
        return (f"goodput {self.goodput:.1%} over {launches} ({refused}"
                f"{'lost: ' + ', '.join(words) if words else 'nothing lost'})")
#: The reasons of a launch's own refusal to go on: a restart's (the crash-loop rule) or a resubmission's (run.resume=auto).
REFUSED = ("restart refused", "resubmission refused")


def _launches(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    launches: list[dict[str, Any]] = []
    for row in rows:
        if row.get("kind") == "launch":
            launches.append({"line": row, "intervals": [], "rollbacks": [], "end": None})
        elif launches and row.get("kind") in ("interval", "rollback", "end"):
            target = launches[-1]
            if row["kind"] == "end":
                target["end"] = row
            else:
                target[f"{row['kind']}s"].append(row)
    return launches


#: How far a ledger line's rounded times may be off (its values are rounded to 0.1 ms, a launch's start to 1 ms).
ROUNDING_S = 1e-3


def read_goodput(run_dir: str | Path) -> Goodput | None:
    """Where the run's wall time went (module docstring), or None when it has no ledger (an older run)."""
    run_dir = Path(run_dir)
    launches = _launches(read_jsonl(run_dir / LEDGER_FILE)[0])
    if not launches:
        return None
    events = read_jsonl(run_dir / "events.jsonl")[0]
    restarts = [e for e in events if e.get("kind") == "restart"]
    # A launch that refused to restart (a crash loop) ended the run's own time: after it, a person's resume
    refusals = [e for e in events if e.get("kind") == "stop" and str(e.get("reason", "")).startswith(REFUSED)]
    sec = dict.fromkeys(PARTS, 0.0)
    total = 0.0
    for i, launch in enumerate(launches):
        line, end = launch["line"], launch["end"]
        ready = float(line.get("ready") or 0.0)
        start = float(line.get("start") or ready)
        sec["startup"] += max(0.0, ready - start)
        last = max([ready] + [float(r["t"]) for r in launch["intervals"] + launch["rollbacks"]])
        nxt = launches[i + 1]["line"] if i + 1 < len(launches) else None
        until = float(nxt["ready"]) if nxt is not None else math.inf
        restart = next((e for e in restarts if ready <= float(e.get("time") or 0) <= until), None)
        later = min((int(n["line"].get("step") or 0) for n in launches[i + 1:]), default=math.inf)
        if end is not None:
            finish = float(end["t"])
            sec["checkpoint"] += float(end.get("checkpoint_s") or 0.0)
            sec["incident"] += float(end.get("incident_s") or 0.0)
            sec["startup"] += float(end.get("startup_s") or 0.0)
            later = min(later, _crashed_from(launch, events, finish, nxt is None))
            sec["redone"] += _end_redone(launch, later)
        else:  # killed outright: it ended when its launcher saw it die, else at its last line
            told = restart or (_given_up(events, ready) if nxt is None else None)
            died = (told.get("cause") or {}).get("time") if told else None
            finish = max(last, float(died)) if died else last
            sec["redone"] += finish - last
            if nxt is None and told is not None:  # (the run's last launch, dead: no later launch trains its steps again)
                later = min(later, _crashed_from(launch, events, finish, True))
        total += finish - start
        if restart is not None:  # the wait before an automatic restart is the run's; after the last launch recorded,
            # the launches that died in their start-up lived at least until their restart events
            until = (float(nxt.get("start") or nxt["ready"]) if nxt is not None
                     else max(float(e.get("time") or 0) for e in [*restarts, *refusals]))
            refused = [float(e.get("time") or 0) for e in refusals if finish <= float(e.get("time") or 0) <= until]
            until = min(refused, default=until)  # the restarts ended there; a person resumed later
            wait = max(0.0, until - finish)
            sec["startup"] += wait
            total += wait
        for row in launch["intervals"]:
            _interval(row, later, launch["rollbacks"], sec)
    sec["other"] += max(0.0, total - sum(sec.values()))
    # The ledger's times are rounded (0.1 ms, a launch's start 1 ms): parts that overshoot the wall by that much, line
    # by line, make the wall their sum (the shares then add up to 100%); a larger overshoot is left to show
    lines = sum(1 + len(n["intervals"]) + len(n["rollbacks"]) + (n["end"] is not None) for n in launches)
    if 0.0 < sum(sec.values()) - total <= ROUNDING_S * lines:
        total = sum(sec.values())
    return Goodput(sec, total, _count_launches(launches, restarts, refusals), len(restarts), len(refusals))


def _count_launches(launches: list[dict[str, Any]], restarts: list[dict[str, Any]], refusals: list[dict[str, Any]]) -> int:
    """Every launch of the run, those that died in their start-up (before the ledger's first line) too, from the
    launches that got ready (R), the ``restart`` events (S: each written by the launch it started, as it starts) and
    the refusals (F: a restart's, by the launch that refused to loop; Q: a resubmission's, by the launch submitted), in
    time order: each S, F and Q is a launch; an R is one unless an S just before it was its own start; and an S or F
    with nothing before it, or right after an F or a Q, follows the death of a launch a person started that never got
    ready. A Q is no restart: the launch a person submitted refused at its start, after nothing of its own (a trial's
    Q right after its supervisor's F was counted twice). (A refusing launch may write the restarts' events late, all at
    once: they still count one each.)"""
    rank = {"S": 0, "F": 1, "Q": 1, "R": 2}
    items = sorted([(float(e.get("time") or 0.0), "S") for e in restarts] + [
        (float(e.get("time") or 0.0), "Q" if str(e.get("reason", "")).startswith(REFUSED[1]) else "F") for e in refusals]
        + [(float(n["line"].get("ready") or 0.0), "R") for n in launches], key=lambda x: (x[0], rank[x[1]]))
    count, prev = 0, None
    for _, kind in items:
        count += 1 if kind != "R" or prev != "S" else 0
        count += kind in ("S", "F") and prev in (None, "F", "Q")
        prev = kind
    return count


def _given_up(events: list[dict[str, Any]], ready: float) -> dict[str, Any] | None:
    """The launcher's ``stop`` for a death it did not restart after (its restarts used up: the event carries the death's
    ``cause``) since ``ready``, or None."""
    return next((e for e in events if e.get("kind") == "stop" and isinstance(e.get("cause"), dict)
                 and not str(e.get("reason", "")).startswith(REFUSED)  # (a launch of its own: its refusal)
                 and float(e.get("time") or 0.0) >= ready - ROUNDING_S), None)


def _crashed_from(launch: dict[str, Any], events: list[dict[str, Any]], finish: float, last: bool) -> float:
    """For a launch that ended in an exception (its ``crash`` event, between its ledger's first and last lines), or, the
    run's ``last`` launch, in a death its launcher did not restart after (a killed peer: the survivor's ``end`` line, then
    the launcher's ``stop``): the step of its last checkpoint (the one it resumed from, or saved), from which its steps
    would be trained again (lost); else inf."""
    ready = float(launch["line"].get("ready") or 0.0)
    within = [e for e in events if ready - ROUNDING_S <= float(e.get("time") or 0.0) <= finish + ROUNDING_S]
    if not any(e.get("kind") == "crash" for e in within) and not (last and _given_up(events, ready)):
        return math.inf
    saved = [int(e.get("step") or 0) for e in within if e.get("kind") == "checkpoint"]  # (in time order: the last one
    return saved[-1] if saved else int(launch["line"].get("step") or 0)  # written, not the largest a rollback left behind)


def _end_redone(launch: dict[str, Any], later_resume: float) -> float:
    """The seconds of a launch's ``end`` line (less its checkpoint and incident parts) that went into steps trained after
    its last line and to be trained again (``later_resume``: a later launch resumed from, or the launch crashed past its
    last checkpoint at, a step before the end's): redone, as a killed launch's time after its last line is."""
    end = launch["end"]
    lines = sorted(launch["intervals"] + launch["rollbacks"], key=lambda r: float(r["t"]))
    last = lines[-1] if lines else launch["line"]
    since = int((last.get("to") if last.get("kind") == "rollback" else last.get("step")) or 0)  # where the end counts from
    trained = int(end.get("step") or 0) - since
    if trained <= 0 or later_resume >= since + trained:
        return 0.0
    wall = float(end.get("wall_s") or 0.0)
    stepping = max(0.0, wall - sum(float(end.get(f"{k}_s") or 0.0) for k in ("checkpoint", "incident", "startup")))
    return stepping * min(1.0, (since + trained - max(later_resume, since)) / trained)


def _interval(row: dict[str, Any], later_resume: float, rollbacks: list[dict[str, Any]], sec: dict[str, float]) -> None:
    """Add one interval line's seconds to ``sec``: the steps' share kept, redone or skipped, and the rest."""
    steps, step = int(row.get("steps") or 0), int(row["step"])
    parts = {k: float(row.get(f"{k}_s") or 0.0) for k in ("eval", "checkpoint", "incident", "startup")}
    wall, told = float(row.get("wall_s") or 0.0), sum(parts.values())
    if told > wall > 0.0:  # overlapping parts (a save waited for within a rollback's incident time): within the wall
        parts = {k: v * wall / told for k, v in parts.items()}
    for key, value in parts.items():
        sec[key] += value
    stepping = max(0.0, float(row.get("wall_s") or 0.0) - sum(parts.values()))
    cut = min([later_resume] + [int(r["to"]) for r in rollbacks if float(r["t"]) >= float(row["t"])])
    redone = min(1.0, max(0.0, (step - max(cut, step - steps)) / steps)) if steps else 0.0
    kept = stepping * (1.0 - redone)
    skipped = min(1.0, int(row.get("skipped") or 0) / steps) if steps else 0.0
    sec["redone"] += stepping * redone
    sec["skipped"] += kept * skipped
    sec["productive"] += kept * (1.0 - skipped)


def goodput_section(run_dir: str | Path) -> str:
    """The report's "Goodput" section (HTML): the line and a table of the parts; "" for a run without a ledger."""
    import html

    g = read_goodput(run_dir)
    if g is None:
        return ""
    rows = "".join(f'<tr><td>{html.escape(PARTS[p][0])}</td><td class="num">{g.seconds[p]:,.1f}</td>'
                   f'<td class="num">{g.share(p):.1%}</td><td class="detail">{html.escape(PARTS[p][1])}</td></tr>'
                   for p in PARTS)
    short = " " + g.short_note() if g.short_note() else ""
    return (f'<h2 id="goodput">Goodput</h2><p>{html.escape(g.line())}, {g.total_s:,.1f} s of wall time in all.{short}</p>'
            f'<div class="narrow"><table><thead><tr><th>where the time went</th><th>seconds</th><th>share</th><th></th>'
            f"</tr></thead><tbody>{rows}</tbody></table></div>")
