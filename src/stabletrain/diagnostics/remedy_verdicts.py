"""How a remedy candidate's replay is judged against the skip-step baseline's, ranked and shown (pure: no replay).

:func:`~stabletrain.remedy_search.search_remedies` replays each candidate; :func:`judge` gives its verdict
(``cures``, ``worse``, ``fails``, ``untestable``: no step it trained to judge) and the evidence: a failure (a non-finite
value, a spike by the guard's rule), a symptom hidden (most samples dropped, most steps skipped), else its end loss (the
mean of the last :data:`END_STEPS` windows after the incident's) within :data:`LOSS_TOLERANCE` of the baseline's (or,
for a spike, of the run's own level before it; for a divergence whose baseline fails, of its last healthy interval).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["LOSS_TOLERANCE", "END_STEPS", "VERDICTS", "judge", "end_loss", "before_later_incident", "healthy_bar",
           "rank_key", "rank", "END_TIE", "format_table"]

#: A cure's end loss may exceed the baseline's by at most this fraction.
LOSS_TOLERANCE = 0.10
#: The end loss: the mean of the last this many replayed steps' losses.
END_STEPS = 5
VERDICTS = ("cures", "worse", "fails", "untestable")


def end_loss(rows: list[dict[str, Any]], step: int) -> float:
    """The end loss over the windows after the incident's (``step``), which every candidate trains on alike (the
    incident's own window only when there is none after it)."""
    after = [r["loss"] for r in rows if "loss" in r and r["step"] > step] or [r["loss"] for r in rows if "loss" in r]
    tail = after[-END_STEPS:]
    return sum(tail) / len(tail) if tail else float("nan")


def before_later_incident(results: list[dict[str, Any]], step: int, flagged: set[int] | frozenset[int] = frozenset()
                          ) -> int | None:
    """Judge the candidates before a later incident that every one that got past this one, the baseline too, fails
    at alike: one the remedies do not touch (a NaN sample 18 steps on), which failed every cure of this one.
    Truncates those results in place and returns that step; None (nothing changed) when the baseline fails no
    later than :data:`END_STEPS` windows after the incident's (unless the run flagged that step as a spike of its own:
    ``flagged``, another sample's spike in the same interval), or a candidate past it does not fail there (a
    divergence's cures do not fail, or fail elsewhere). Those that failed on the incident itself keep their failure.

    A later incident is a separate one only after a calm step: one between the incident's and it that the baseline
    trained without a spike and the run did not flag. A burst (the run's spikes on every step from the incident's
    next on: a level shift, an LR x1000; or the baseline's own spike on the first window it trains) is this incident's
    course, however far it goes: set apart, it cut every trajectory to the incident's window, and the baseline, which
    skips that window, was called a cure with no step judged.
    """
    later = (results[0]["failed"] or {}).get("step")  # the baseline's
    if later is None or (later <= step + END_STEPS and later not in flagged):
        return None
    calm = {r["step"] for r in results[0]["trajectory"] if "loss" in r and step < r["step"] < later} - set(flagged)
    if not calm:
        return None
    past = [r for r in results if r["failed"] is None or r["failed"]["step"] > step]  # those that got past this one
    if any((r["failed"] or {}).get("step") != later for r in past):
        return None
    for r in past:
        rows = [row for row in r["trajectory"] if row["step"] < later]
        r.update(trajectory=rows, steps_replayed=len(rows), failed=None, end_loss=end_loss(rows, step))
    return later


def judge(result: dict[str, Any], baseline: dict[str, Any], healthy: tuple[int, float] | None = None,
          typical: float | None = None) -> tuple[str, str]:
    """(verdict, evidence) of one candidate's replay against the baseline's (module docstring).

    ``healthy``: (step, loss[, what it is]) of the run's last healthy interval (:func:`healthy_bar`), the bar when the
    baseline itself fails
    (a finite end far above it is no cure: the run stays diverged). ``typical``: a spike's, the median of the
    losses the rule judged it against: an end loss within tolerance of the run's own level before the spike is
    no worse, whatever the baseline's happens to be (near a loss of 1e-3 the noise alone is x2).
    """
    if result["failed"] is not None:
        return "fails", result["failed"]["why"]
    # Every window it replayed dropped (the baseline cut to the incident's window read 'cures ... end loss nan'): no
    # step trained, none to judge, whatever share of the samples that is.
    if all(r.get("dropped") for r in result["trajectory"]):
        dropped = [r["step"] for r in result["trajectory"]]
        if not dropped:
            return "untestable", "no step to judge: it replays none"
        where = f"the window of step {dropped[0]}" if len(dropped) == 1 else f"the windows of steps {dropped[0]}-{dropped[-1]}"
        return "untestable", f"no step to judge: it drops {where}, all it replays"
    if result["dropped_samples"] * 2 > result["total_samples"]:
        return "fails", (f"hides the symptom: drops {result['dropped_samples']} of the {result['total_samples']} samples "
                         "it replays")
    trained = [r for r in result["trajectory"] if "applied" in r]
    if trained and sum(r["applied"] for r in trained) * 2 < len(trained):
        return "fails", (f"hides the symptom: {sum(r['applied'] for r in trained)} of its {len(trained)} steps were "
                         "applied (the rest skipped)")
    last = result["trajectory"][-1]["step"]
    steps = (f"steps {result['first_step']}-{last}" if last != result["first_step"] else f"step {last}") + " finite, no spike"
    base, end, bar = baseline["end_loss"], result["end_loss"], 1 + LOSS_TOLERANCE
    if result is baseline:
        return "cures", f"{steps}; end loss {end:.4g}"
    if math.isfinite(base):
        text = f"{steps}; end loss {end:.4g} vs baseline {base:.4g} (x{end / base if base > 0 else 1.0:.3g}, tolerance x{bar:g})"
        if typical is not None and typical > base:  # a spike's: no worse than the run's own level before it will do
            if end > base * bar + 1e-12 and end <= typical * bar + 1e-12:  # (the baseline alone would have said worse)
                text = (f"{steps}; end loss {end:.4g}, within x{bar:g} of the run's {typical:.4g} before the spike (the "
                        f"median its rule judged the spike against; x{end / typical:.3g}; the baseline's {base:.4g} is lower)")
            else:
                text += f", or the run's {typical:.4g} before the spike (the median its rule judged the spike against)"
            base = typical
        return ("cures" if end <= base * bar + 1e-12 else "worse"), text
    fails = (f"the baseline fails: {baseline['failed']['why']}" if baseline["failed"] else
             "the baseline has no step to judge" if baseline.get("verdict") == "untestable" else "the baseline fails")
    if healthy is None and typical is not None:  # a spike: no worse than the run's own level before it
        text = (f"{steps}; end loss {end:.4g} vs {typical:.4g}, the run's before the spike (the median its rule judged the "
                f"spike against; {fails})")
        return ("cures" if end <= typical * bar + 1e-12 else "worse"), text
    if healthy is None:
        return "cures", f"{steps}; end loss {end:.4g} ({fails})"
    what = healthy[2] if len(healthy) > 2 else "the last healthy interval"
    text = f"{steps}; end loss {end:.4g} vs {healthy[1]:.4g} at step {healthy[0]}, {what} ({fails})"
    return ("cures" if end <= healthy[1] * bar + 1e-12 else "worse"), text


def healthy_bar(history: list[dict[str, Any]], diagnosis: dict[str, Any]) -> tuple[int, float, str] | None:
    """(step, loss, what it is) of a divergence's last logged interval before its growth began that held no spike nor
    non-finite step; None for any other class.

    Only a divergence needs the bar: there a finite end can still be far off (the run stays diverged); for
    the other classes, one interval's loss on other batches would be too noisy a bar. A run that diverged within its
    first interval has none (its interval at step 10 held 6 spikes at x1.5e4 its first loss, and every candidate with
    an end below 5e5 'cured' it): the lowest loss of its first interval is the bar.
    """
    since = (diagnosis.get("growth") or {}).get("since_step")
    if diagnosis.get("failure_class") != "divergence" or since is None:
        return None
    rows = [r for r in history if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"]) and r["step"] <= since
            and not r.get("num_spikes") and not r.get("num_nonfinite")]
    if rows:
        return int(rows[-1]["step"]), float(rows[-1]["loss"]), "the last healthy interval"
    first = next((r for r in history if isinstance(r.get("loss_min"), (int, float)) and math.isfinite(r["loss_min"])), None)
    return (int(first["step"]), float(first["loss_min"]), "the lowest loss of the run's first interval (every interval "
            "before the growth held a spike)") if first is not None else None


#: End losses within this share of the lowest among candidates otherwise alike are a tie: the candidates' own order
#: stands (a precision spike's verified module first: a trial's Linear before the norm that overflowed won on an end
#: loss 3e-5 lower, 0.07538 vs 0.07541, and was applied live).
END_TIE = 0.01


def rank_key(r: dict[str, Any]) -> tuple:
    """Verdict first; then no code change before one, fewer samples dropped and steps rewound, local before run-wide."""
    cost = r["dropped_samples"] + r["rewound_steps"] * 1_000_000  # a rollback loses steps: costlier than samples
    return (VERDICTS.index(r["verdict"]), not r["live"], cost, r["scope"])


def rank(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` (in the candidates' order) by :func:`rank_key`, then by end loss, where end losses within
    :data:`END_TIE` of the lowest of their cluster keep the candidates' own order."""
    def end(r: dict[str, Any]) -> float:
        return r["end_loss"] if math.isfinite(r["end_loss"]) else math.inf

    order = {id(r): i for i, r in enumerate(rows)}
    clusters: list[tuple[tuple, float, list[dict[str, Any]]]] = []
    for r in sorted(rows, key=lambda r: (rank_key(r), end(r))):
        key, low = rank_key(r), end(r)
        if clusters and clusters[-1][0] == key and (low == clusters[-1][1] or low <= clusters[-1][1] * (1 + END_TIE)):
            clusters[-1][2].append(r)
        else:
            clusters.append((key, low, [r]))
    return [r for _, _, members in clusters for r in sorted(members, key=lambda r: order[id(r)])]


def format_table(record: dict[str, Any]) -> str:
    """The console table of a search, ranked by verdict and cost."""
    after = f"the incident's window and the {record['steps']} after it" if not record.get("note") else (
        f"the incident's window only ({record['note']})")
    if record.get("later_incident"):
        after += (f", judged up to step {record['later_incident'] - 1} (every candidate, the baseline too, meets a "
                  f"later incident at step {record['later_incident']} alike: not this one's)")
    head = (f"incident step {record['step']}: {record['failure_class']} ({record['evidence']})\n"
            f"replayed {after} under {len(record['candidates'])} "
            f"candidate{'s' if len(record['candidates']) != 1 else ''} ({record['timings']['steps_replayed']} steps, "
            f"{record['timings']['total_s']:.1f} s)")
    rows = [("#", "candidate", "verdict", "end loss", "what it does", "evidence")]
    for i, r in enumerate(record["candidates"], 1):
        end = f"{r['end_loss']:.4g}" if isinstance(r["end_loss"], float) and math.isfinite(r["end_loss"]) else "-"
        name = r["name"] + (" (baseline)" if r["baseline"] else "")
        rows.append((str(i), name, r["verdict"], end, r["detail"], r["evidence"]))
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths)) + "  " + row[5] for row in rows]
    best = record["best"]
    base = next((r for r in record["candidates"] if r["baseline"]), None)
    same = [(i, r) for i, r in enumerate(record["candidates"], 1) if r["name"] == best]  # (module-fp32: one per module)
    tail = [(f"best: {best}" + (f" (#{same[0][0]}: {same[0][1]['detail']})" if len(same) > 1 else "")) if best else
            f"no candidate cures it beyond the baseline: {base['detail']} ({base['name']}) is all it needs"
            if base is not None and base["verdict"] == "cures" else "no candidate cures this incident"]
    tail += [f"code change ({r['name']}, {r['verdict']}): {r['change']}" for r in record["candidates"]
             if r.get("change") and r["verdict"] == "cures"]
    return "\n".join([head, *lines, *tail])
