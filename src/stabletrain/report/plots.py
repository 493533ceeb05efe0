"""The report's plots, drawn with matplotlib's Agg canvas (no display, no pyplot state) as PNG bytes.

:func:`run_plots` draws one run's curves with its events marked; :func:`compare_plots` overlays
several runs, each metric against steps and against the items seen (tokens or samples: the task's
``count_unit``, which also names the throughput's unit). Non-finite values are gaps, and an interval
whose mean loss is non-finite is marked with a red cross.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import EngFormatter, MaxNLocator, PercentFormatter

from .rundata import RunData, x_of

__all__ = ["Plot", "run_plots", "compare_plots", "shared_unit", "item_panels", "items_note", "RUN_PLOT_NAMES", "COMPARE_METRICS"]

DPI = 110
COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
# Every plot one run's report may hold, in page order ("other_metrics" only when there are unknown keys).
# "loss_scale" only where a loss scale is in play (fp16), else "skipped" only where steps were skipped.
RUN_PLOT_NAMES = ("loss", "grad_norm", "update", "clip_rate", "lr", "loss_scale", "skipped", "tokens_per_s",
                  "peak_memory", "other_metrics")
# Metrics overlaid by ``compare``: key -> (title, y label); "{unit}" is the runs' count unit (tokens or samples).
COMPARE_METRICS = {
    "loss": ("Train loss", "loss"),
    "val_loss": ("Validation loss", "loss"),
    "grad_norm": ("Grad norm, pre-clip (interval mean)", "L2 norm"),
    "grad_norm_post_clip": ("Grad norm, post-clip (interval mean)", "L2 norm"),
    "clip_rate": ("Clip rate", "steps clipped"),
    "lr": ("Learning rate", "lr"),
    "loss_scale": ("Loss scale", "scale"),
    "num_skipped": ("Skipped steps per interval", "steps"),
    "tokens_per_s": ("Throughput", "{unit}/s"),
    "peak_memory_mib": ("Peak memory", "MiB"),
}


@dataclass
class Plot:
    """One plot: ``name`` is the PNG file stem, ``png`` its encoded bytes."""

    name: str
    title: str
    png: bytes


def _figure(width: float = 6.4, height: float = 3.3, ncols: int = 1, nrows: int = 1, right: float = 0.2,
            left: float = 0.8) -> tuple[Figure, list]:
    """Return a figure and its axes with fixed margins in inches (``right``: room for a twin axis; ``left``: for
    wide tick labels).

    Fixed margins rather than constrained layout: the layout solver doubled the drawing time.
    """
    fig = Figure(figsize=(width, height), dpi=DPI)
    FigureCanvasAgg(fig)
    bottom, top, hgap, vgap = 0.5, 0.36, 0.85, 0.7
    axis_w = (width - left - right - hgap * (ncols - 1)) / ncols
    axis_h = (height - bottom - top - vgap * (nrows - 1)) / nrows
    fig.subplots_adjust(left=left / width, right=1 - right / width, bottom=bottom / height, top=1 - top / height,
                        wspace=hgap / axis_w, hspace=vgap / axis_h)
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel().tolist()
    for ax in axes:
        ax.grid(True, color="#e5e5e5", linewidth=0.8)
        ax.set_axisbelow(True)
        for side in ("top", "right"):
            ax.spines[side].set_visible(False)
        ax.tick_params(labelsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # x is steps or tokens seen
    return fig, axes


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, facecolor="white", metadata={"Software": None})
    return buf.getvalue()


def _columns(run: RunData, *keys: str, x: str = "step") -> list[np.ndarray]:
    """Return [x, *keys] as aligned arrays over the records holding ``keys[0]`` and ``x``.

    A value missing from a record, and +-inf, become nan (a gap in the line).
    """
    rows = [r for r in run.metrics if isinstance(r.get(keys[0]), float) and isinstance(r.get(x), (int, float))]
    out = [np.asarray([float(x_of(r, keys[0], x)) for r in rows], dtype=float)]
    for key in keys:
        col = np.asarray([r.get(key, math.nan) if isinstance(r.get(key), float) else math.nan for r in rows], dtype=float)
        col[~np.isfinite(col)] = np.nan
        out.append(col)
    return out


def _column(run: RunData, key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    """Return (x, y) over the records holding ``key`` and ``x``; +-inf becomes nan (a gap)."""
    xs, ys = _columns(run, key, x=x)
    return xs, ys


def _style(n: int) -> dict:
    """Line style: markers when there are few points, so a short run still shows something."""
    return {"marker": "o", "markersize": 3} if n <= 30 else {}


def _auto_log(ax, *arrays: np.ndarray) -> None:
    """Use a log y axis when positive values span more than a factor 20 (a spike flattens a linear plot)."""
    vals = np.concatenate([a[np.isfinite(a)] for a in arrays]) if arrays else np.array([])
    if vals.size and (vals > 0).all() and vals.max() / vals.min() > 20:
        ax.set_yscale("log")


# How each marked event kind (of stabletrain.records.events.EVENT_KINDS) is drawn on the curves: a vertical line per step.
EVENT_MARKS: dict[str, dict[str, Any]] = {
    # (the thin marks in front of an incident's line at the same step: they were hidden under it)
    "skip": {"color": "#ff9f1c", "linewidth": 0.8, "alpha": 0.6, "label": "skipped step", "zorder": 2.6},
    "spike": {"color": "#9467bd", "linewidth": 1.0, "linestyles": ":", "label": "loss spike", "zorder": 2.7},
    "incident": {"color": "#d62728", "linewidth": 1.4, "alpha": 0.8, "label": "incident", "zorder": 1.5},
    "resume": {"color": "#555555", "linewidth": 1.0, "linestyles": "--", "label": "resume"},
    "rollback": {"color": "#8c564b", "linewidth": 1.2, "linestyles": "--", "label": "rollback"},
    "remedy": {"color": "#087f5b", "linewidth": 1.2, "linestyles": "-.", "label": "remedy applied"},
    "crash": {"color": "#c92a2a", "linewidth": 1.6, "label": "crash"},
}


def _mark_events(ax, run: RunData) -> None:
    """Mark skipped steps, spikes, incidents, resumes, rollbacks and a crash as vertical lines.

    One line collection per kind, so thousands of skipped steps still draw fast.
    """
    for kind, style in EVENT_MARKS.items():
        steps = sorted({e.step for e in run.events if e.kind == kind and not e.superseded})
        if steps:
            ax.vlines(steps, 0, 1, transform=ax.get_xaxis_transform(), **style)


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, frameon=False, loc="best")


def _finish(fig: Figure, ax, title: str, ylabel: str, xlabel: str = "step") -> None:
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlabel(xlabel, fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    _legend(ax)


# -- one run ------------------------------------------------------------------------------------


def run_plots(run: RunData) -> list[Plot]:
    """Return the plots of one run (empty when it has no metrics yet)."""
    if not run.metrics:
        return []
    plots = [_loss(run), _grad_norm(run), _update(run), _clip_rate(run), _simple(run, "lr", "lr", "Learning rate", "lr")]
    if run.loss_scaled:  # fp32 and bf16 have no loss scale: a flat line at 1 would say nothing
        plots.append(_loss_scale(run))
    elif any(r.get("num_skipped", 0) > 0 for r in run.metrics):
        plots.append(_skipped(run))
    plots += [_simple(run, "tokens_per_s", "tokens_per_s", "Throughput", f"{run.count_unit}/s"),
              _simple(run, "peak_memory", "peak_memory_mib", "Peak memory", "MiB")]
    other = _other(run)
    if other is not None:
        plots.append(other)
    return plots


def _loss(run: RunData) -> Plot:
    fig, (ax,) = _figure()
    x, loss, lo, hi = _columns(run, "loss", "loss_min", "loss_max")
    ax.fill_between(x, lo, hi, color=COLORS[0], alpha=0.15, linewidth=0, label="train min-max in interval")
    ax.plot(x, loss, color=COLORS[0], linewidth=1.5, label="train (interval mean)", **_style(x.size))
    vx, val = _column(run, "val_loss")
    if vx.size:
        ax.plot(vx, val, color=COLORS[1], linewidth=1.5, marker="o", markersize=4, label="validation")
    bad = np.isnan(loss)  # the interval mean is non-finite when any step's loss was
    if bad.any():
        shown = np.concatenate([loss, hi, val])
        top = float(np.nanmax(shown)) if np.isfinite(shown).any() else 0.0
        ax.plot(x[bad], np.full(int(bad.sum()), top), "x", color="#d62728", markersize=7, mew=2,
                label="non-finite loss in interval")
    gone = _abandoned(ax, run, "loss")
    _mark_events(ax, run)
    # Each spike's own loss at its own step: the curve is of interval means at the intervals' ends, so a spike at step
    # 121 showed at 130 (on a remedy's line there, as if the remedy had made it).
    own = spike_points(run)
    spiked = np.array([v for _, v in own]) if own else np.array([])
    if own:
        ax.plot([t for t, _ in own], spiked, "v", color="#9467bd", markersize=5, zorder=3, label="a spike's own loss")
    _auto_log(ax, loss, val, gone, spiked)
    _finish(fig, ax, "Loss", "loss per item")
    return Plot("loss", "Train and validation loss" if vx.size else "Train loss", _png(fig))


def spike_points(run: RunData) -> list[tuple[int, float]]:
    """(step, loss) of each loss spike the run kept (its event's own loss), for the loss plot."""
    return sorted((e.step, float(e.extra["loss"])) for e in run.events if e.kind == "spike" and not e.superseded
                  and isinstance(e.extra.get("loss"), (int, float)) and math.isfinite(e.extra["loss"]))


def _abandoned(ax, run: RunData, key: str) -> np.ndarray:
    """The intervals a rollback went back past (the run trained them again, another way), as faded points: a spike
    that a rollback undid stays on the plot. Returns the values drawn (the axis scale must hold them)."""
    rows = [r for r in run.abandoned if isinstance(r.get(key), float)]
    if not rows:
        return np.empty(0)
    steps = [r["step"] for r in rows]  # the interval's mean, and a line over its range (up to the spike itself)
    low, high = [r.get(f"{key}_min", r[key]) for r in rows], [r.get(f"{key}_max", r[key]) for r in rows]
    ax.vlines(steps, low, high, color="0.6", linewidth=1.2)
    ax.plot(steps, [r[key] for r in rows], linestyle="none", marker="o", markersize=3.5, color="0.6",
            label="before a rollback (trained again)")
    return np.asarray([*low, *high], dtype=float)


def _grad_norm(run: RunData) -> Plot:
    fig, (ax,) = _figure()
    x, pre, pre_max, post = _columns(run, "grad_norm", "grad_norm_max", "grad_norm_post_clip")
    ax.plot(x, pre_max, color=COLORS[0], linewidth=0.9, alpha=0.45, label="pre-clip (interval max)")
    ax.plot(x, pre, color=COLORS[0], linewidth=1.5, label="pre-clip (interval mean)", **_style(x.size))
    ax.plot(x, post, color=COLORS[2], linewidth=1.5, label="post-clip (interval mean)", **_style(x.size))
    threshold = run.cfg("clip.max_norm")
    if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
        ax.axhline(float(threshold), color="#d62728", linestyle="--", linewidth=1.1, label=f"clip threshold ({threshold:g})")
    gone = _abandoned(ax, run, "grad_norm")
    _mark_events(ax, run)
    _auto_log(ax, pre, pre_max, post, gone)
    _finish(fig, ax, "Gradient norm", "global L2 norm")
    return Plot("grad_norm", "Grad norm before and after clipping", _png(fig))


def _clip_rate(run: RunData) -> Plot:
    fig, (ax,) = _figure()
    x, rate, width = _columns(run, "clip_rate", "interval_steps")
    if x.size:  # a value covers the steps of its interval, so the line starts where the first interval does
        x, rate = np.concatenate([[x[0] - width[0]], x]), np.concatenate([[rate[0]], rate])
    ax.plot(x, rate, color=COLORS[4], linewidth=1.5, drawstyle="steps-pre", label="steps clipped in interval")
    ax.fill_between(x, 0, rate, step="pre", color=COLORS[4], alpha=0.15, linewidth=0)
    ax.set_ylim(-0.02, 1.02)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    _finish(fig, ax, "Clip rate", "share of steps")
    return Plot("clip_rate", "Clip rate", _png(fig))


def _simple(run: RunData, name: str, key: str, title: str, ylabel: str) -> Plot:
    fig, (ax,) = _figure()
    x, y = _column(run, key)
    ax.plot(x, y, color=COLORS[0], linewidth=1.5, **_style(x.size))
    if key == "lr":
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if key in ("tokens_per_s", "peak_memory_mib"):
        ax.set_ylim(bottom=0)
        ax.yaxis.set_major_formatter(EngFormatter(sep=""))  # 12k, 1.5M: short labels fit the margin
    _finish(fig, ax, title, ylabel)
    return Plot(name, title, _png(fig))


def _update(run: RunData) -> Plot:
    """||theta_t - theta_(t-1)|| of each interval's last step (top) and its ratio to ||theta|| (bottom).

    Two panels, not twin axes: both follow the LR schedule, so on twin log axes the two lines lie on top of each other.
    """
    fig, (top, bottom) = _figure(height=5.2, nrows=2, left=1.05)  # log ticks read "4×10⁻²"
    for ax, key, color, label, ylabel in ((top, "update_norm", COLORS[0], "||Δθ||", "||Δθ|| (L2 norm)"),
                                          (bottom, "update_ratio", COLORS[1], "||Δθ|| / ||θ||", "||Δθ|| / ||θ||")):
        x, y = _column(run, key)
        ax.plot(x, y, color=color, linewidth=1.5, label=label, **_style(x.size))
        finite = y[np.isfinite(y)]
        if finite.size and (finite > 0).all():
            ax.set_yscale("log")
        ax.set_ylabel(ylabel, fontsize=8)
    top.set_title("Parameter update (last step of each interval)", fontsize=10, loc="left")
    bottom.set_title("Update relative to the weights", fontsize=10, loc="left")
    bottom.set_xlabel("step", fontsize=8)
    return Plot("update", "Parameter update: its norm, and relative to the weights", _png(fig))


def _skipped(run: RunData) -> Plot:
    """Skipped steps per interval, for a run without a loss scale (fp32, bf16): bars only."""
    fig, (ax,) = _figure()
    _skip_bars(ax, run)
    _finish(fig, ax, "Skipped steps", "skipped steps")
    return Plot("skipped", "Skipped steps", _png(fig))


def _skip_bars(ax, run: RunData) -> None:
    sx, skipped, width = _columns(run, "num_skipped", "interval_steps")
    if sx.size:
        ax.bar(sx - width / 2, np.nan_to_num(skipped), width=np.maximum(width * 0.9, 0.5), color="#ff9f1c", alpha=0.7,
               label="skipped steps in interval")
    ax.set_ylim(0, max(1.0, float(np.nanmax(skipped)) if sx.size and np.isfinite(skipped).any() else 1.0) * 1.15)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))


def _loss_scale(run: RunData) -> Plot:
    fig, (ax,) = _figure(right=0.85)
    x, scale = _column(run, "loss_scale")
    ax.plot(x, scale, color=COLORS[0], linewidth=1.5, drawstyle="steps-post", label="loss scale", **_style(x.size))
    finite = scale[np.isfinite(scale)]
    if finite.size and (finite > 0).all() and finite.max() > finite.min():
        ax.set_yscale("log", base=2)
    elif finite.size:  # a scale that never changed: one tick, not a zoomed-in axis of noise
        ax.set_yticks([float(finite[0])])
    bars = ax.twinx()
    _skip_bars(bars, run)
    ax.set_zorder(bars.get_zorder() + 1)  # the scale line in front of the bars
    ax.patch.set_visible(False)
    bars.set_ylabel("skipped steps", fontsize=8)
    bars.tick_params(labelsize=8)
    bars.spines["top"].set_visible(False)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = bars.get_legend_handles_labels()
    ax.set_title("Loss scale and skipped steps", fontsize=10, loc="left")
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel("loss scale", fontsize=8)
    fig.legend(h1 + h2, l1 + l2, fontsize=7, frameon=False, loc="upper right", ncols=2,
               bbox_to_anchor=(0.99 - 0.85 / fig.get_figwidth(), 1.0))  # above the axes, clear of the bars
    return Plot("loss_scale", "Loss scale and skipped steps", _png(fig))


def _other(run: RunData) -> Plot | None:
    """Small multiples of the numeric metric keys this version does not know (at most 12)."""
    keys = run.other_metric_keys()[:12]
    if not keys:
        return None
    ncols = min(3, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = _figure(width=6.4, height=0.6 + 2.2 * nrows, ncols=ncols, nrows=nrows)
    for ax, key in zip(axes, keys):
        x, y = _column(run, key)
        ax.plot(x, y, color=COLORS[0], linewidth=1.3, **_style(x.size))
        ax.set_title(key, fontsize=9, loc="left")
        ax.xaxis.set_major_locator(MaxNLocator(nbins=4, integer=True))  # small panels: few ticks
        finite = y[np.isfinite(y)]
        counter = bool(finite.size) and bool((finite == np.round(finite)).all())
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5, integer=counter))
    for ax in axes[len(keys):]:
        ax.set_visible(False)
    return Plot("other_metrics", "Other metrics", _png(fig))


# -- several runs -------------------------------------------------------------------------------


def shared_unit(runs: list[RunData]) -> str:
    """The runs' count unit ("tokens", "samples"), or "tokens or samples" when they differ."""
    units = sorted({run.count_unit for run in runs})
    return units[0] if len(units) == 1 else " or ".join(units)


def _logs(run: RunData, key: str) -> bool:
    return any(isinstance(r.get(key), (int, float)) for r in run.metrics)


def _panels_by_unit(runs: list[RunData]) -> list[tuple[str, str, list[int]]]:
    """``[(x key, unit, run indices)]``, one per count unit of the runs (their own items seen), in first-seen order."""
    units = [run.count_unit for run in runs]
    return [("tokens_seen", unit, [i for i, u in enumerate(units) if u == unit]) for unit in dict.fromkeys(units)]


def item_panels(runs: list[RunData]) -> list[tuple[str, str, list[int]]]:
    """The compare plots' panels by items seen: ``[(x key, unit, indices of the runs drawn)]``.

    One panel by the runs' count unit when they share it (``tokens_seen``: the items each loss counts). When they count
    different items (tokens for one, samples for another: 640k tokens beside 3k samples on one axis squash the samples'
    curves flat), one panel by samples seen, which every run logs; failing that, one panel per unit.
    """
    by_unit = _panels_by_unit(runs)
    if len(by_unit) > 1 and all(_logs(run, "samples_seen") for run in runs):
        return [("samples_seen", "samples", list(range(len(runs))))]
    return by_unit


def items_note(runs: list[RunData], labels: list[str]) -> str:
    """What the compare plots' right-hand panels are drawn against, in a sentence for the page (plain text)."""
    panels = item_panels(runs)
    units = ", ".join(f"{unit} for {', '.join(labels[i] for i in idx)}" for _, unit, idx in _panels_by_unit(runs))
    if len(panels) > 1:
        return (f"Right: one panel per item the runs' losses count ({units}), by the items seen in each: not every run "
                "logs the samples it trained on, so they have no common unit.")
    if panels[0][0] == "samples_seen":
        rates = " (and the throughput in samples/s)" if all(_logs(run, "samples_per_s") for run in runs) else ""
        return (f"Right: by samples seen. The runs' losses count different items ({units}), so each run is drawn against "
                f"the samples it trained on, which every run logs{rates}.")
    return (f"Right: by {panels[0][1]} seen (the items each run's loss counts), which lines up runs with different batch "
            "sizes or accumulation.")


def compare_plots(runs: list[RunData], labels: list[str]) -> list[Plot]:
    """Return one plot per metric any run has: the runs overlaid, against steps (left) and items seen (right).

    Items are the runs' count unit (:func:`item_panels`): tokens for a token-level loss, samples otherwise; samples for
    runs that count different items (or one panel per unit where a run logs no samples seen).
    """
    plots = []
    panels = item_panels(runs)
    unit = panels[0][1] if len(panels) == 1 else shared_unit(runs)
    for key, (title, ylabel) in COMPARE_METRICS.items():
        if not any(run.series(key)[0] for run in runs):
            continue
        # as one run's report: no loss-scale panel where no run scales its loss, no skipped-steps one where none skipped
        if key == "loss_scale" and not any(run.loss_scaled for run in runs):
            continue
        if key == "num_skipped" and not any(r.get("num_skipped", 0) > 0 for run in runs for r in run.metrics):
            continue
        ykey = key
        if key == "tokens_per_s" and panels[0][0] == "samples_seen" and all(_logs(run, "samples_per_s") for run in runs):
            ykey = "samples_per_s"  # throughputs in one unit too
        ylabel = ylabel.format(unit="samples" if ykey == "samples_per_s" else unit)
        fig, (by_step, *by_items) = _figure(width=5.5 * (1 + len(panels)), height=3.4, ncols=1 + len(panels))
        arrays = []
        for i, (run, label) in enumerate(zip(runs, labels)):
            color = COLORS[i % len(COLORS)]
            marker = {"marker": "o", "markersize": 3} if key == "val_loss" or len(run.metrics) <= 30 else {}
            axes = [(by_step, "step")] + [(ax, x) for ax, (x, _, idx) in zip(by_items, panels) if i in idx]
            for ax, x in axes:
                xs, ys = _column(run, ykey, x)
                if xs.size:
                    ax.plot(xs, ys, color=color, linewidth=1.4, label=label, **marker)
                    arrays.append(ys)
            threshold = run.cfg("clip.max_norm")
            if key in ("grad_norm", "grad_norm_post_clip") and isinstance(threshold, (int, float)) \
                    and not isinstance(threshold, bool):
                for ax, _ in axes:
                    ax.axhline(float(threshold), color=color, linestyle="--", linewidth=1.0, alpha=0.8)
        for ax, xlabel in ((by_step, "step"), *((ax, f"{u} seen") for ax, (_, u, _) in zip(by_items, panels))):
            if key in ("loss", "val_loss", "grad_norm", "grad_norm_post_clip"):
                _auto_log(ax, *arrays)
            if key == "grad_norm_post_clip" and ax.get_yscale() == "linear":
                # Clipped norms sit at or just under the threshold: from 0, so 0.96 -> 1.00 does not fill the panel.
                ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 0.05))
            if key == "clip_rate":
                ax.yaxis.set_major_formatter(PercentFormatter(1.0))
            if key in ("tokens_per_s", "peak_memory_mib"):
                ax.yaxis.set_major_formatter(EngFormatter(sep=""))
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # tokens seen reach millions
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            if ax is not by_step:
                ax.set_title(f"{title} by {xlabel}", fontsize=10, loc="left")
        by_step.set_title(f"{title} by step", fontsize=10, loc="left")
        if key in ("grad_norm", "grad_norm_post_clip"):
            by_step.plot([], [], color="#555555", linestyle="--", linewidth=1.0, label="clip threshold")
        _legend(by_step)
        plots.append(Plot(key, f"{title}", _png(fig)))
    return plots
