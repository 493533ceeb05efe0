"""The clip-rate sentence of the health summary: how often clipping fired, how much it cut, and whether that is a problem.

Clipping guards against the occasional large gradient. Firing often is normal early in training, while
the grad norm is still large or settling toward the threshold (the default ``clip.max_norm=1`` on a
model whose grad norm hovers near 1 trims its peaks on a third of the steps); what matters is how much
it cuts the gradients late in the run. :data:`CLIP_CUT` is the line: when the clip shortens the second
half's gradients by a fifth or more (the median over its log intervals of 1 - post-clip / pre-clip norm,
so one spike's interval does not decide it), the clip, not the gradient, sizes the updates (with SGD that
is a smaller LR; with Adam every gradient is rescaled to one norm, so the clip stops telling a spike from
an ordinary step) — that is worth a look. A smaller cut is the clip trimming peaks, which is what it is for.

Where the threshold sits against the typical (median) grad norm says why it fires: below it, on ordinary steps; above
it (by more than :data:`CLIP_NEAR`), only on the tail of the grad norms — a surge (an LR jump, bad data) or a heavy tail
— and the line says which steps, and advises no threshold the run already has. The optimizer's family is what it
stepped as: its class and bases as snapshot.json recorded them (``class LRBump(AdamW)`` is Adam's), else its name.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from ..config.adapter import HOST_KNOBS, clip_knob
from .rundata import RunData
from .text import fmt_num, fmt_pct

__all__ = ["clip_sentence", "CLIP_RARE", "CLIP_MOST", "CLIP_CUT"]

#: Clip-rate bands: at most RARE of the steps is rare; more than MOST of the second half's steps is nearly always.
CLIP_RARE, CLIP_MOST = 0.1, 0.5
#: A cut of the second half's gradient norms (1 - post-clip / pre-clip) from which frequent clipping is a problem:
#: a fifth, smaller than the step between the LRs of a sweep (2-3x), larger than the trimming of peaks.
CLIP_CUT = 0.2
#: The typical grad norm within this factor of the threshold (either way) is "close to" it; beyond, the threshold is
#: below it (the clip sizes ordinary steps) or above it (the clip fires on the tail only).
CLIP_NEAR = 1.25
#: How a median of grad norms that left out the intervals with a spike or a non-finite step is labelled where it is shown.
CALM_NOTE = ", the intervals without a loss spike or non-finite step"


#: Optimizers that divide by a running RMS of the gradients (the clip barely changes their update size), by class name.
ADAPTIVE = ("adam", "nadam", "radam", "adagrad", "adadelta", "adafactor", "rmsprop", "lamb")
#: (the clip's key, the learning rate's) in each adapter's own terms (the built-in loop's: clip.max_norm, optim.lr).
HOST_KEYS = {host: (knobs["clip"], knobs["lr"]) for host, knobs in HOST_KNOBS.items()}

def _finite(values: list[float]) -> list[float]:
    return [v for v in values if math.isfinite(v)]


def _applied(row: dict[str, Any]) -> int:
    """An interval's applied steps: what its ``clip_rate`` is over (a skipped step's gradients were discarded)."""
    return max(int(row["interval_steps"]) - int(row.get("num_skipped", 0) or 0), 0)


def clip_sentence(run: RunData, h: Any) -> None:  # h: report.health.Health (which imports this module)
    """Say the clip rate with a verdict and its reason; put the figures behind it in ``h.figures``.

    The verdict reads the second half of the run (``clip_rate_late``, ``clip_cut_late``), so a burst at
    the start does not condemn a run that settled. ``clip_cut_late`` is None for a run that logged no
    post-clip norm (then frequent clipping is judged by its rate alone, as before that key existed).
    """
    f = h.figures
    threshold = run.cfg("clip.max_norm")
    f["clip_threshold"] = threshold
    rows = [r for r in run.metrics if math.isfinite(r.get("clip_rate", math.nan))]
    steps = sum(_applied(r) for r in rows)
    if not rows or steps <= 0:
        return
    clipped = sum(r["clip_rate"] * _applied(r) for r in rows)  # clip_rate is over each interval's applied steps
    f["clip_rate"] = clipped / steps
    f["clipped_steps"], f["clip_steps_seen"] = int(round(clipped)), int(steps)
    # The typical norms are the calm intervals' (no loss spike, no non-finite step) where the run has any: a few huge
    # spikes in half its intervals made a trial's median 187 of norms about 5.5, and its advice a threshold of 1,825.
    calm = [r for r in run.metrics if not r.get("num_spikes") and not r.get("num_nonfinite")]
    f["grad_norm_calm"] = bool(calm) and len(calm) < len(run.metrics)
    norms = _finite([r["grad_norm"] for r in calm or run.metrics if isinstance(r.get("grad_norm"), float)])
    if norms:
        f["grad_norm_median"] = statistics.median(norms)
    peaks = _finite([r["grad_norm_max"] for r in calm or run.metrics if isinstance(r.get("grad_norm_max"), float)])
    if peaks:
        f["grad_norm_max_median"] = statistics.median(peaks)
    calm_note = CALM_NOTE if f["grad_norm_calm"] else ""
    if not isinstance(run.cfg("clip"), dict):  # every run writes its clip section: its config.yaml was not read
        median = f" (median grad norm {fmt_num(f['grad_norm_median'])}{calm_note})" if norms else ""
        h.say("ok", f"The clip threshold is unknown: the run's config.yaml could not be read (see Data problems){median}.")
        return
    own = None  # no threshold of stabletrain's, yet steps were clipped: the loop's own clip (Monitor's step(grad_norm=))
    if threshold is None and clipped > 0:
        posts = _finite(run.series("grad_norm_post_clip")[1])
        own = threshold = max(posts) if posts else None  # its ceiling, as near as the intervals' mean post-clip norms show
    if threshold is None:
        median = f" (median grad norm {fmt_num(f['grad_norm_median'])}{calm_note})" if norms else ""
        h.say("ok", f"Clipping is off (clip.max_norm is null){median}.")
        return
    half = max(int(r["step"]) for r in rows) / 2
    late = [r for r in rows if r["step"] - r["interval_steps"] >= half] or rows[-1:]  # intervals in the second half
    if not sum(_applied(r) for r in late):  # every step of the second half skipped: nothing there to judge
        f["clip_verdict"] = "none late"
        h.say("ok", f"{'Your own clipping' if own is not None else 'Clipping'} fired on {fmt_pct(f['clip_rate'])} of the "
                    f"applied steps ({f['clipped_steps']:,} of {f['clip_steps_seen']:,}; threshold {fmt_num(threshold)}); "
                    "the second half of the run applied no step (every one skipped, below): no verdict on it.")
        return
    f["clip_rate_late"] = sum(r["clip_rate"] * _applied(r) for r in late) / max(sum(_applied(r) for r in late), 1)
    f["clip_cut_late"] = _cut(late)
    rate, late_rate, cut = f["clip_rate"], f["clip_rate_late"], f["clip_cut_late"]
    cut_text, cut = _judged_pct(cut, CLIP_CUT) if cut is not None else ("", None)  # the verdict follows the printed figure
    head = (f"{'Your own clipping' if own is not None else 'Clipping'} fired on {fmt_pct(rate)} of steps "
            f"({f['clipped_steps']:,} of {f['clip_steps_seen']:,}; threshold "
            + (f"about {fmt_num(own, 2)}, from the post-clip norms)" if own is not None else f"{fmt_num(threshold)})"))
    typical = f" (median {fmt_num(f['grad_norm_median'])}{calm_note})" if norms else ""
    cuts = f", a median cut of {cut_text} to the gradient norm there (over its log intervals)" if cut is not None else ""
    clip_key, lr_key = _host_keys(run)
    clip_key = "your clip's max_norm" if own is not None else clip_key
    where = _where(threshold, f.get("grad_norm_median"))
    peak = f.get("grad_norm_max_median")
    retune = (f"set {clip_key} to about {fmt_num(peak, 2)} (the median of each interval's largest grad norm)"
              if peak is not None and peak >= 1.1 * threshold else None)  # (never "about 1" to a run clipping at 1)
    rose = f.get("loss_rose")  # (the loss sentence's, above: the run got worse since its best interval)
    if rose is not None and late_rate > CLIP_RARE and rate > 0:  # the clip fires on a diverging run: its symptom
        f["clip_verdict"] = "diverging"
        h.say("warn", f"{head}, {fmt_pct(late_rate)} in the second half{cuts}: the loss rose x{rose['factor']:.3g} from "
                      f"{rose['best_of']} (step {rose['best_step']:,}, above), so the clip fires on gradients of a run "
                      f"that got worse: a symptom, not the setting to tune first. Lower the learning rate ({lr_key}), "
                      f"or see what the incidents say, before retuning {clip_key}.")
        return
    if rate == 0:
        f["clip_verdict"] = "never"
        h.say("ok", f"{head}: healthy, a guard that was never needed (every grad norm stayed below it).")
    elif late_rate > CLIP_RARE and cut is not None and cut < CLIP_CUT:
        f["clip_verdict"] = "trims"
        # (a whole-run median above the threshold whose late cut is small: the grad norm fell since, as training settled)
        sits = {"above": "sits below the threshold", "below": "was above the threshold over the run, but sits near or "
                "below it in the second half"}.get(where, "sits near the threshold")
        h.say("ok", f"{head}, {fmt_pct(late_rate)} in the second half{cuts}: healthy. The grad norm{typical} {sits} "
                    f"and the clip trims its peaks, as is usual while training settles; it would need a "
                    f"look if its median cut of the late gradients reached {fmt_pct(CLIP_CUT)} (the clip, not the "
                    "gradient, would then size the updates).")
    elif late_rate > CLIP_RARE and where == "above":
        f["clip_verdict"] = "tail"
        h.say("warn", _tail_text(late, f, head + f", {fmt_pct(late_rate)} in the second half{cuts}", threshold, clip_key,
                                 retune))
    elif late_rate > CLIP_MOST:
        f["clip_verdict"] = "most"
        effect = _effect(run, threshold, f.get("grad_norm_median"))
        place = (f"The threshold is {'below' if where == 'below' else 'close to'} the typical grad norm{typical}"
                 if where else "Most late steps' grad norms exceeded the threshold")
        advice = retune or f"raise {clip_key} above the typical grad norm"
        h.say("warn", f"{head}, {fmt_pct(late_rate)} in the second half{cuts}: too often. {place}, so the clip, not the "
                      f"gradient, sets the size of most updates; {effect}. To clip only spikes, {advice}; if the clip is "
                      f"what keeps the run stable, lower {lr_key} instead.")
    elif late_rate > CLIP_RARE:
        f["clip_verdict"] = "frequent"
        place = f"{'below' if where == 'below' else 'close to'} the typical grad norm{typical}"
        h.say("warn", f"{head}, {fmt_pct(late_rate)} in the second half{cuts}: often. The threshold is {place}, so it "
                      f"shrinks ordinary updates, not only spikes; to clip only spikes, "
                      f"{retune or f'raise {clip_key} above the typical grad norm'}.")
    elif rate > CLIP_RARE:
        f["clip_verdict"] = "early"
        h.say("ok", f"{head}, {fmt_pct(late_rate)} in the second half: healthy. It clipped the large gradients of the "
                    "first steps and rarely after; that is what a clip is for.")
    else:
        f["clip_verdict"] = "rare"
        h.say("ok", f"{head}: healthy, it trims the occasional large gradient.")


def _where(threshold: float, median: float | None) -> str | None:
    """Where the threshold sits against the typical grad norm: "below", "near" (within :data:`CLIP_NEAR`), "above"."""
    if median is None or median <= 0:
        return None
    return "below" if median > CLIP_NEAR * threshold else "above" if CLIP_NEAR * median < threshold else "near"


def _effect(run: RunData, threshold: float, median: float | None) -> str:
    """What rescaling most gradients to the threshold does to this run's updates, by its optimizer's family. A clip only
    shrinks a gradient: the equivalent learning rate is told only where it is smaller (the median above the threshold)."""
    name = run.snapshot.get("optimizer") or run.cfg("optim.name") or ""  # the optimizer the run stepped, else the config's
    family = _family(run, str(name))
    factor = f" about {fmt_num(threshold / median, 2)}x" if median and median > threshold else ""
    if family == "adaptive":
        who = "Adam" if str(name).lower().startswith("adam") else f"{name or 'this optimizer'}, an optimizer of Adam's family,"
        return (f"with {who} the update size barely changes (it divides by the clipped gradients' RMS), but every "
                "clipped gradient is rescaled to the same norm, so the clip no longer tells a spike from an ordinary step")
    if family == "sgd":
        who = "SGD" if "sgd" in str(name).lower() else f"{name or 'this optimizer'}, an optimizer of SGD's family,"
        return (f"with {who} the update shrinks as if the learning rate were{factor} as large" if factor
                else f"with {who} the clipped updates shrink")
    return (f"with {name or 'this optimizer'} every clipped gradient is rescaled to the same norm"
            + (f" (for a plain gradient step, as if the learning rate were{factor} as large)" if factor else ""))


def _family(run: RunData, name: str) -> str | None:
    """"adaptive" (a running RMS divides the update), "sgd", or None: by the optimizer's class and its bases, as the run's
    snapshot recorded them (a subclass under a name of its own, ``class LRBump(AdamW)``, is its base's), else its name."""
    bases = [str(b).lower() for b in run.snapshot.get("optimizer_bases") or [name]]
    return ("adaptive" if any(b.startswith(ADAPTIVE) for b in bases) else "sgd" if any("sgd" in b for b in bases)
            else None)


def _tail_text(rows: list[dict[str, Any]], f: dict[str, Any], head: str, threshold: float, clip_key: str,
               retune: str | None) -> str:
    """The clip line of a threshold above the typical grad norm: its rate is the tail of the grad norms, the steps whose
    norm exceeded it; where most of a late interval's steps (``rows``: the second half's) were clipped (a surge), which
    steps and how high the norm rose."""
    median = f["grad_norm_median"]
    bursts: list[list[Any]] = []  # [first step, last step, clipped steps, largest interval mean grad norm]
    for r in rows:
        if r["clip_rate"] <= CLIP_MOST:
            continue
        first, norm = int(r["step"] - r["interval_steps"]) + 1, r.get("grad_norm", math.nan)
        if bursts and bursts[-1][1] == first - 1:
            peak = max((v for v in (bursts[-1][3], norm) if math.isfinite(v)), default=math.nan)
            bursts[-1][1:] = [int(r["step"]), bursts[-1][2] + r["clip_rate"] * _applied(r), peak]
        else:
            bursts.append([first, int(r["step"]), r["clip_rate"] * _applied(r), norm])
    f["clip_surges"] = [(a, b) for a, b, _, _ in bursts]
    calm = CALM_NOTE if f.get("grad_norm_calm") else ""
    tail = (f"The threshold is above the typical grad norm (median {fmt_num(median)}{calm}), so the clip fired only on the tail, "
            f"the {fmt_pct(f['clip_rate'])} of steps whose grad norm exceeded {fmt_num(threshold)}")
    if not bursts:
        return (f"{head}: often, from the tail of the grad norm. {tail}, spread over the second half (none of its log "
                "intervals had most of its steps clipped)" + (f"; to clip fewer of them, {retune}." if retune else "."))

    def surge(a: int, b: int, n: float, m: float) -> str:
        rose = f", where the grad norm's interval mean rose to {fmt_num(m)} (x{fmt_num(m / median, 3)} the median)"
        return f"{int(round(n)):,} in " + (f"steps {a:,}-{b:,}" if b > a else f"step {a:,}") + (rose if math.isfinite(m) else "")

    more = f", and {len(bursts) - 3} more such stretches" if len(bursts) > 3 else ""
    return (f"{head}: a surge of the grad norm, not a low threshold. {tail}: "
            + "; ".join(surge(*b) for b in bursts[:3]).replace(" in step", " of them in step", 1) + f"{more}. There the "
            f"clip capped the gradients' norm at {fmt_num(threshold)}, as a guard should; what needs a look is why the grad "
            f"norm rose (the spikes and incidents of those steps, a learning rate too high, bad data), not {clip_key}.")


_UNRECORDED = object()  # (a key the run's config.yaml does not hold)


def _host_keys(run: RunData) -> tuple[str, str]:
    """(the clip's key, the learning rate's) as this run set them: the built-in loop's, or its adapter's own.

    A Lightning run names the knob that clipped it: the Trainer's ``gradient_clip_val`` when its config records one
    (``host.gradient_clip_val``), else the callback's ``clip_max_norm`` (Lightning refuses to clip a fused optimizer's
    gradients under mixed precision, so the callback clips; advising ``gradient_clip_val`` there names a setting that
    the callback would refuse).
    """
    integration = str(run.cfg("integration", ""))
    _, lr_key = HOST_KEYS.get(integration, ("clip.max_norm", "optim.lr"))
    keys = ("host.gradient_clip_val", "host.gradient_clip_algorithm", "clip.max_norm")
    config = {k: v for k in keys if (v := run.cfg(k, _UNRECORDED)) is not _UNRECORDED}
    return clip_knob(integration, config) or "clip.max_norm", lr_key


def _judged_pct(value: float, line: float) -> tuple[str, float]:
    """``value`` as a percentage with as many decimals as it takes for the printed figure to fall on the same side of
    ``line`` as ``value`` (19.5% is not "20%" beside "a look from 20%"), and the value the verdict is to judge: ``value``,
    or past two decimals the printed figure itself (so the sentence never contradicts the number it shows)."""
    text = fmt_pct(value)
    for decimals in (1, 2):
        if (float(text.rstrip("%")) / 100 >= line) == (value >= line):
            return text, value
        text = f"{100 * value:.{decimals}f}%"
    printed = float(text.rstrip("%")) / 100
    return text, value if (printed >= line) == (value >= line) else printed


def _cut(rows: list[dict]) -> float | None:
    """The median over ``rows`` (log intervals, each weighed by its applied steps) of 1 - post-clip / pre-clip grad norm
    (interval means); None without them.

    A median, not the ratio of the sums: one spike's interval (a pre-clip mean of 308 clipped to 1) would otherwise
    read as a cut of 99% over the whole second half, where the other intervals cut a third.
    """
    cuts = sorted((max(0.0, 1.0 - r["grad_norm_post_clip"] / r["grad_norm"]), _applied(r)) for r in rows
                  if math.isfinite(r.get("grad_norm", math.nan)) and math.isfinite(r.get("grad_norm_post_clip", math.nan))
                  and r["grad_norm"] > 0 and _applied(r) > 0)
    total = sum(w for _, w in cuts)
    if not cuts or total <= 0:
        return None
    seen = 0
    for i, (cut, weight) in enumerate(cuts):
        seen += weight
        if 2 * seen > total:
            return cut
        if 2 * seen == total:  # exactly half the steps at or below it: the middle of the two (statistics.median's rule)
            return (cut + cuts[i + 1][0]) / 2
    return cuts[-1][0]
