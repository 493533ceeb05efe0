"""How a :class:`~stabletrain.diagnostics.signal_propagation.SignalReport` is shown: text tables and a plot."""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

from .signal_propagation import OK, SignalReport

__all__ = ["format_report", "format_updates", "format_comparison", "plot_signal"]


def _g(v: float | None, width: int = 9) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width}.3g}"


def _xr(v: float | None, width: int = 8) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:>{width - 1}.3g}x"


def format_report(report: SignalReport, updates: bool = True) -> list[str]:
    """Return the report as text lines: thresholds, the per-layer table, the summary and the updates."""
    width = max([len(layer.name) for layer in report.layers] + [5])
    kind_w = max([len(layer.kind) for layer in report.layers] + [4])
    header = (f"{'#':>3}  {'layer':<{width}}  {'type':<{kind_w}}  {'in std':>9}  {'out mean':>9}  {'out std':>9}  "
              f"{'|out|max':>9}  {'fwd':>10}  {'grad std':>9}  {'bwd':>10}  {'w std':>9}  {'w grad':>9}  verdict")
    lines = [report.thresholds.describe(), *report.rules(), header]
    for layer in report.layers:
        verdict = OK if not layer.flagged else "/".join(
            f"{d} {v}" for d, v in (("fwd", layer.forward), ("bwd", layer.backward)) if v != OK)
        w_grad = f"{'frozen':>9}" if layer.frozen else _g(layer.param_grad_std)  # (its '-' read as an activation's)
        lines.append(f"{layer.index:>3}  {layer.name:<{width}}  {layer.kind:<{kind_w}}  {_g(layer.in_std)}  "
                     f"{_g(layer.out_mean)}  {_g(layer.out_std)}  {_g(layer.out_absmax)}  {_xr(layer.forward_ratio, 10)}  "
                     f"{_g(layer.grad_std)}  {_xr(layer.backward_ratio, 10)}  {_g(layer.param_std)}  {w_grad}  {verdict}")
    lines += [report.summary("forward"), report.summary("backward"), *_saturated(report), *_frozen(report), report.advice()]
    if updates and report.updates:
        lines += format_updates(report)
    return lines


def _frozen(report: SignalReport) -> list[str]:
    """A line naming the weighted layers that do not train (requires_grad=False): a trial's frozen middle layer showed
    only a '-' for its weight's gradient, as an activation's does, and no line said it."""
    found = [x for x in report.layers if x.frozen]
    if not found:
        return []
    shown = ", ".join(f"#{x.index} {x.name!r}" for x in found[:6]) + (f" and {len(found) - 6} more" if len(found) > 6 else "")
    return [f"frozen (requires_grad=False): {shown}: {'its weights do' if len(found) == 1 else 'their weights do'} not "
            "train; gradients still pass through to the layers before"]


#: A bounded activation whose output std is this close to its bound: most of its units sit on its flat ends.
SATURATED = {"Tanh": 0.9, "Hardtanh": 0.9, "Sigmoid": 0.45}


def _saturated(report: SignalReport) -> list[str]:
    """A line naming the bounded activations (tanh, sigmoid) whose output is saturated: its std holds (no ratio flags it),
    but their gradient vanishes on the flat ends (a trial: a N(0, 1) tanh stack read 'forward: ok')."""
    found = [x for x in report.layers if x.kind in SATURATED and x.out_std is not None and x.out_std >= SATURATED[x.kind]]
    if not found:
        return []
    shown = ", ".join(f"#{x.index} {x.name!r} ({x.kind}, output std {x.out_std:.2g})" for x in found[:3])
    return [f"saturated: {shown}{f' and {len(found) - 3} more' if len(found) > 3 else ''}: the output std is near the "
            "activation's bound, most units sit on its flat ends, where its gradient vanishes (the weights before it are "
            "too large for it: a smaller init scale, init_(model, 'xavier'))"]


def format_updates(report: SignalReport) -> list[str]:
    """Return the update/weight ratio of every parameter as text lines (zero weights on one line)."""
    th = report.thresholds
    if report.adaptive:
        title = (f"update/weight (rms) after one {report.optimizer} step: an Adam-like first step moves each element "
                 f"by about lr, so a ratio is about lr/rms(w); band per parameter: {th.adaptive_low:g} x lr/rms(w), "
                 f"at most {th.adaptive_low * th.adaptive_high:g} (below: most elements got no gradient, or one under "
                 f"the optimizer's eps) to {th.adaptive_high:g} (above: lr is large for the weight's scale):")
    else:
        title = (f"update/weight (rms) after one {report.optimizer} step (lr x |grad| / |w|): band {th.update_low:g} "
                 f"to {th.update_high:g}, around the ~1e-3 rule of thumb for SGD-like updates:")
    lines = [title]
    measured = [u for u in report.updates if u.ratio is not None]
    name_w = max([len(u.name) for u in measured] + [4])
    for u in measured:
        lines.append(f"  {u.name:<{name_w}}  {u.ratio:<9.3g} band {u.low:.3g}..{u.high:.3g}  {u.mark}".rstrip())
    zero = [u for u in report.updates if u.ratio is None]
    if zero:
        names = ", ".join(u.name for u in zero[:6]) + (f" and {len(zero) - 6} more" if len(zero) > 6 else "")
        lines.append(f"  zero at init (no ratio): {names}")
    large = [u for u in measured if u.mark == "large"]
    if large:  # (not a failed signal: the verdict above is the forward and backward's; this is the first step's size)
        lines.append(f"  {len(large)} above the band: one step moves those weights by more than the band's top (lr is "
                     "large for their scale). Where they were scaled down on purpose (a GPT's residual projections, std / "
                     "sqrt(2 x layers)), that is their init's choice and a warm-up eases it; else a lower lr or a larger "
                     "init for them")
    return lines


def format_comparison(reports: list[SignalReport]) -> list[str]:
    """Return one table of several runs of the same model: fwd and bwd ratio and verdict per layer per run."""
    base = reports[0]
    width = max([len(layer.name) for layer in base.layers] + [5])
    kind_w = max([len(layer.kind) for layer in base.layers] + [4])
    cell_w = 31
    head = f"{'':>3}  {'':<{width}}  {'':<{kind_w}}  " + "  ".join(f"{r.label[:cell_w]:<{cell_w}}" for r in reports)
    sub = f"{'#':>3}  {'layer':<{width}}  {'type':<{kind_w}}  " + "  ".join(
        f"{'fwd':>10} {'bwd':>10} {'verdict':<9}" for _ in reports)
    lines = [base.thresholds.describe(), *base.rules(), head.rstrip(), sub.rstrip()]
    for i, layer in enumerate(base.layers):
        cells = []
        for r in reports:
            other = r.layers[i] if i < len(r.layers) and r.layers[i].name == layer.name else None
            if other is None:
                cells.append(f"{'-':>10} {'-':>10} {'':<9}")
                continue
            v = other.forward if other.forward != OK else other.backward
            cells.append(f"{_xr(other.forward_ratio, 10)} {_xr(other.backward_ratio, 10)} {v:<9}")
        lines.append(f"{layer.index:>3}  {layer.name:<{width}}  {layer.kind:<{kind_w}}  " + "  ".join(cells).rstrip())
    for r in reports:
        lines.append(f"{r.label}: {'PASS' if r.passed else 'FAIL'}; {r.summary('forward')}; {r.summary('backward')}")
    return lines


def plot_signal(reports: Iterable[SignalReport], path: str | Path, xlabel: str = "layer (execution order)") -> Path:
    """Plot per-layer std by depth, forward and backward, one line per report, to a PNG at ``path``.

    The x axis is each layer's ``index`` (integer ticks), named ``xlabel``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    reports = list(reports)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_f, ax_b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in reports:
        idx = [layer.index for layer in r.layers]
        fwd = [layer.signal_std if layer.signal_std > 0 else math.nan for layer in r.layers]
        bwd = [layer.grad_std if layer.grad_std else math.nan for layer in r.layers]
        label = f"{r.label or 'model'} ({'ok' if r.passed else f'{len(r.flagged)} flagged'})"
        ax_f.plot(idx, fwd, marker="o", markersize=3, label=label)
        ax_b.plot(idx, bwd, marker="o", markersize=3, label=label)
    for ax, title, ylabel in ((ax_f, "forward: activation std", "std of the layer's output (norms: input)"),
                              (ax_b, "backward: gradient std", "std of d loss / d output")):
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    if reports:  # below both panels, never over a curve (one legend box sat on lab 1's tanh lines)
        fig.legend(*ax_f.get_legend_handles_labels(), loc="lower center", ncol=min(len(reports), 4), fontsize=8,
                   frameon=False)
        fig.suptitle(f"signal propagation at step 0 (flagged outside {1 / reports[0].thresholds.explode:g}x.."
                     f"{reports[0].thresholds.explode:g}x of the reference layer)", fontsize=10)
    rows = -(-len(reports) // 4)  # the legend's rows, under the panels
    fig.tight_layout(rect=(0, 0.06 * rows, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
