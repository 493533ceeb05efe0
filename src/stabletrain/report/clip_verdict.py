"""The clip-rate sentence of the health summary: how often clipping fired, how much it cut, and whether that is a problem.

Clipping guards against the occasional large gradient. Firing often is normal early in training, while
the grad norm is still large or settling toward the threshold (the default ``clip.max_norm=1`` on a
model whose grad norm hovers near 1 trims its peaks on a third of the steps); what matters is how much
it cuts the gradients late in the run. :data:`CLIP_CUT` is the line: when the clip shortens the second
half's gradients by a fifth or more (the median over its log intervals of 1 - post-clip / pre-clip norm,
so one spike's interval does not decide it), the clip, not the gradient, sizes the updates (with SGD that
is a smaller LR; with Adam every gradient is rescaled to one norm, so the clip stops telling a spike from
an ordinary step) — that is worth a look. A smaller cut is the clip trimming peaks, which is what it is for.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from .rundata import RunData
from .text import fmt_num, fmt_pct

__all__ = ["clip_sentence", "CLIP_RARE", "CLIP_MOST", "CLIP_CUT"]

#: Clip-rate bands: at most RARE of the steps is rare; more than MOST of the second half's steps is nearly always.
CLIP_RARE, CLIP_MOST = 0.1, 0.5
#: A cut of the second half's gradient norms (1 - post-clip / pre-clip) from which frequent clipping is a problem:
#: a fifth, smaller than the step between the LRs of a sweep (2-3x), larger than the trimming of peaks.
CLIP_CUT = 0.2


#: Optimizers that divide by a running RMS of the gradients (the clip barely changes their update size), by class name.
ADAPTIVE = ("adam", "nadam", "radam", "adagrad", "adadelta", "adafactor", "rmsprop", "lamb")
#: (the clip's key, the learning rate's) in each adapter's own terms (the built-in loop's: clip.max_norm, optim.lr).
HOST_KEYS = {"lightning": ("Trainer(gradient_clip_val=)", "the optimizer's lr"),
             "transformers": ("TrainingArguments.max_grad_norm", "TrainingArguments.learning_rate"),
             "monitor": ("Monitor(clip_max_norm=)", "the optimizer's lr")}
#: A Lightning run clipped by the callback (``StableTrainCallback(clip_max_norm=)``, the only clip Lightning allows a fused
#: optimizer under mixed precision), not by the Trainer: its config's ``host.gradient_clip_val`` is null.
LIGHTNING_OWN_CLIP = "StableTrainCallback(clip_max_norm=)"

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
    norms = _finite(run.series("grad_norm")[1])
    if norms:
        f["grad_norm_median"] = statistics.median(norms)
    peaks = _finite(run.series("grad_norm_max")[1])  # each interval's largest pre-clip norm
    if peaks:
        f["grad_norm_max_median"] = statistics.median(peaks)
    own = None  # no threshold of stabletrain's, yet steps were clipped: the loop's own clip (Monitor's step(grad_norm=))
    if threshold is None and clipped > 0:
        posts = _finite(run.series("grad_norm_post_clip")[1])
        own = threshold = max(posts) if posts else None  # its ceiling, as near as the intervals' mean post-clip norms show
    if threshold is None:
        median = f" (median grad norm {fmt_num(f['grad_norm_median'])})" if norms else ""
        h.say("ok", f"Clipping is off (clip.max_norm is null){median}.")
        return
    half = max(int(r["step"]) for r in rows) / 2
    late = [r for r in rows if r["step"] - r["interval_steps"] >= half] or rows[-1:]  # intervals in the second half
    f["clip_rate_late"] = sum(r["clip_rate"] * _applied(r) for r in late) / max(sum(_applied(r) for r in late), 1)
    f["clip_cut_late"] = _cut(late)
    rate, late_rate, cut = f["clip_rate"], f["clip_rate_late"], f["clip_cut_late"]
    cut_text, cut = _judged_pct(cut, CLIP_CUT) if cut is not None else ("", None)  # the verdict follows the printed figure
    head = (f"{'Your own clipping' if own is not None else 'Clipping'} fired on {fmt_pct(rate)} of steps "
            f"({f['clipped_steps']:,} of {f['clip_steps_seen']:,}; threshold "
            + (f"about {fmt_num(own, 2)}, from the post-clip norms)" if own is not None else f"{fmt_num(threshold)})"))
    typical = f" (median {fmt_num(f['grad_norm_median'])})" if norms else ""
    cuts = f", a median cut of {cut_text} to the gradient norm there (over its log intervals)" if cut is not None else ""
    clip_key, lr_key = _host_keys(run)
    clip_key = "your clip's max_norm" if own is not None else clip_key
    retune = (f"set {clip_key} to about {fmt_num(f['grad_norm_max_median'], 2)} (the median of each interval's "
              "largest grad norm)" if peaks and f["grad_norm_max_median"] > threshold
              else f"raise {clip_key} above the typical grad norm")
    if rate == 0:
        f["clip_verdict"] = "never"
        h.say("ok", f"{head}: healthy, a guard that was never needed (every grad norm stayed below it).")
    elif late_rate > CLIP_RARE and cut is not None and cut < CLIP_CUT:
        f["clip_verdict"] = "trims"
        h.say("ok", f"{head}, {fmt_pct(late_rate)} in the second half{cuts}: healthy. The grad norm{typical} sits near "
                    f"the threshold and the clip trims its peaks, as is usual while training settles; it would need a "
                    f"look if its median cut of the late gradients reached {fmt_pct(CLIP_CUT)} (the clip, not the "
                    "gradient, would then size the updates).")
    elif late_rate > CLIP_MOST:
        f["clip_verdict"] = "most"
        # the optimizer the run stepped (snapshot.json: a task's own one too), else the config's name (an adapter's class)
        optimizer = str(run.snapshot.get("optimizer") or run.cfg("optim.name", "")).lower()
        factor = f" about {fmt_num(threshold / f['grad_norm_median'], 2)}x" if norms and f["grad_norm_median"] > 0 else ""
        if optimizer.startswith(ADAPTIVE):
            effect = ("with Adam the update size barely changes (it divides by the clipped gradients' RMS), but every "
                      "gradient is rescaled to the same norm, so the clip no longer tells a spike from an ordinary step")
        elif "sgd" in optimizer:
            effect = f"with SGD the update shrinks as if the learning rate were{factor} as large"
        else:
            named = run.snapshot.get("optimizer") or run.cfg("optim.name")  # (neither: a run of an unknown optimizer)
            effect = (f"with {named or 'this optimizer'} every gradient is rescaled to the "
                      f"same norm (for a plain gradient step, as if the learning rate were{factor} as large)")
        h.say("warn", f"{head}, {fmt_pct(late_rate)} in the second half{cuts}: too often. The threshold is below the "
                      f"typical grad norm{typical}, so the clip, not the gradient, sets the size of most updates; {effect}. "
                      f"To clip only spikes, {retune}; if the smaller steps are what keeps the run stable, lower "
                      f"{lr_key} instead.")
    elif late_rate > CLIP_RARE:
        f["clip_verdict"] = "frequent"
        h.say("warn", f"{head}, {fmt_pct(late_rate)} in the second half{cuts}: often. The threshold is close to the "
                      f"typical grad norm{typical}, so it shrinks ordinary updates, not only spikes; to clip only spikes, "
                      f"{retune}.")
    elif rate > CLIP_RARE:
        f["clip_verdict"] = "early"
        h.say("ok", f"{head}, {fmt_pct(late_rate)} in the second half: healthy. It clipped the large gradients of the "
                    "first steps and rarely after; that is what a clip is for.")
    else:
        f["clip_verdict"] = "rare"
        h.say("ok", f"{head}: healthy, it trims the occasional large gradient.")


def _host_keys(run: RunData) -> tuple[str, str]:
    """(the clip's key, the learning rate's) as this run set them: the built-in loop's, or its adapter's own.

    A Lightning run names the knob that clipped it: the Trainer's ``gradient_clip_val`` when its config records one
    (``host.gradient_clip_val``), else the callback's ``clip_max_norm`` (Lightning refuses to clip a fused optimizer's
    gradients under mixed precision, so the callback clips; advising ``gradient_clip_val`` there names a setting that
    the callback would refuse).
    """
    integration = str(run.cfg("integration", ""))
    clip_key, lr_key = HOST_KEYS.get(integration, ("clip.max_norm", "optim.lr"))
    trainer_clip = run.cfg("host.gradient_clip_val", "unrecorded")  # (a config without it: the Trainer's, as before)
    if integration == "lightning" and not trainer_clip and run.cfg("clip.max_norm") is not None:
        clip_key = LIGHTNING_OWN_CLIP
    return clip_key, lr_key


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
