"""The chapter's exercises, each one command: ``stabletrain lab N`` runs it, measures, and checks the observation.

Every lab is a module here with ``run(out_dir=None, seed=0, **settings) -> LabResult``, built only from
the package's own pieces (init_, signal_report, PrecisionPolicy, AccumulationWindow, GradClipper,
the locator, TrainStep, Trainer). A lab returns its numbers as a table, the claims it checks (each
with the measured value and the threshold), an explanation written from the measured numbers, and
the PNG plots it wrote. The settings of ``run`` are the knobs that break the observation (a test runs
each lab once as shipped and once with such a setting, and sees it fail).

Usage::

    from stabletrain.lab import run_lab, format_result
    result = run_lab("1", out_dir="labs")
    print(format_result(result)); assert result.passed
"""

from __future__ import annotations

import importlib
import io
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..records.provenance import mark_output_dir

__all__ = ["runs_folder", "Claim", "LabInfo", "LabResult", "LABS", "run_lab", "format_result", "format_list", "new_figure",
           "save_figure", "fmt", "MIN_LEGEND_PT"]


@dataclass(frozen=True)
class LabInfo:
    """A lab in the registry: its key, module, title, the chapter's exercise (and its original text) and what it shows."""

    key: str
    module: str
    title: str
    question: str
    question_zh: str
    shows: str
    #: ``question_zh`` is the chapter's sentence the lab puts to the test, not its exercise (labs beyond the exercises)
    quoted: bool = False


#: The labs in chapter order; ``accept`` is the chapter's acceptance point.
LABS: dict[str, LabInfo] = {info.key: info for info in (
    LabInfo("1", "lab1", "Init drift in a 12-layer MLP",
            "Record each layer's output std of a 12-layer MLP and watch plain normal init drift.",
            "记录 12 层 MLP 每层输出标准差，观察普通正态初始化的漂移。",
            "N(0,1), torch default, Xavier, Kaiming with ReLU and tanh: std by depth, forward and backward"),
    LabInfo("2", "lab2", "Device check, autocast op dtypes, GradScaler at work",
            "Add a device check to the loop that falls back to float32 where CUDA is missing.",
            "给循环加入设备判断，在 CUDA 不可用时自动回退 float32。",
            "the precision chosen here; ops autocast ran low / kept fp32; a planted overflow halves the scale, "
            "skips the step, holds the LR; the scale grows back"),
    LabInfo("3", "lab3", "Accumulation with a short tail",
            "Handle a dataloader whose length is not a multiple of 4, and record the unscaled loss.",
            "处理 dataloader 末尾不足 4 步的情况，并记录未缩放 loss。",
            "k=4 over an epoch with a short tail vs one big batch: window normalization vs naive /4, "
            "(sum, count) vs mean of means, the logged loss"),
    LabInfo("4", "lab4", "Clipping an abnormally large loss",
            "Make an abnormally large loss and compare the parameter-update norm before and after clipping.",
            "制造一个异常大 loss，比较裁剪前后参数更新范数。",
            "||update|| of a ~1e3x loss step with clipping off and on, pre/post-clip norm, clip rate, SGD vs AdamW"),
    LabInfo("5", "lab5", "The first non-finite gradient",
            "Write a function that returns the name of the first parameter with a non-finite gradient.",
            "写一个函数返回第一个出现非有限梯度的参数名。",
            "first_nonfinite_grad on a planted fault; the locator's op, module, direction and sample; "
            "detect_anomaly's answer and its cost"),
    LabInfo("6", "lab6", "Metrics every 20 steps without per-step syncs",
            "Aggregate metrics every 20 steps without a per-step sync, and compute tokens/s.",
            "每 20 步聚合一次指标，避免每步同步，并计算 tokens/s。",
            "host syncs counted with log.every=1 vs 20 over the same steps; step time and tokens/s"),
    LabInfo("7", "lab7", "Why a lower LR cures a divergence and not a sqrt(0)",
            "Explain the path by which the learning rate affects stability: meet a divergence and a sqrt(0) fault, "
            "and let the remedy replays say which fix cures which.",
            # (beyond the chapter's exercises: the chapter's own words it tests, from its NaN/Inf section)
            "大模型 NaN 可能来自脏 token、极端长度、低精度溢出或通信；先找“第一个坏点”，不要只调低学习率碰运气。",
            "each first incident replayed under the remedies: a lower LR from before the growth cures the divergence, "
            "no LR cures the sqrt(0); dropping its sample or guarding the op does", quoted=True),
    LabInfo("8", "lab8", "A loss spike: the warning before it, its cause, its cure",
            "Meet a loss spike: let the diagnosis name its cause and a replay verify the cure, and watch whether a "
            "layer's update/weight ratio rises before the loss does.",
            # (beyond the exercises: the chapter's words on spikes, from its clipping section)
            "按全局范数裁剪限制一次更新的最大梯度规模，能缓解偶发尖峰，但不能修复错误数据、过大学习率或 NaN 算子。",
            "a rare token under Adam and two mislabelled samples, both spiking at step 75: the class and the layer or "
            "samples named, the cure verified by replay; the embedding's update ratio rises a step before its spike, "
            "nothing rises before the data's", quoted=True),
    LabInfo("accept", "accept", "Acceptance: overfit, checkpoint, resume, compare the next step",
            "Overfit a tiny batch recording loss, grad norm and parameter updates; after resuming from a checkpoint, "
            "compare the next step's result, not just that the file exists.",
            "用一个极小 batch 过拟合，并记录 loss、梯度范数和参数更新；断点恢复后比较下一步结果，而不只检查文件存在。",
            "per-step loss, grad norm, update norm; resume in a fresh process, bitwise comparison of the next steps"),
)}


@dataclass
class Claim:
    """One observation a lab checks: what it says, the value measured, the threshold, whether it held."""

    text: str
    measured: str
    threshold: str
    passed: bool


@dataclass
class LabResult:
    """What a lab measured: its table, the claims checked, the explanation and the plots written.

    ``numbers`` holds the headline measurements by name (for tests and JSON); ``explanation`` is a list
    of sentences written from them; ``tables`` holds further ``(title, columns, rows)`` tables.
    """

    key: str
    setup: str
    columns: list[str]
    rows: list[list[Any]]
    claims: list[Claim]
    explanation: list[str]
    plots: list[Path] = field(default_factory=list)
    numbers: dict[str, Any] = field(default_factory=dict)
    tables: list[tuple[str, list[str], list[list[Any]]]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def info(self) -> LabInfo:
        return LABS[self.key]

    @property
    def passed(self) -> bool:
        return bool(self.claims) and all(c.passed for c in self.claims)


def run_lab(key: str, out_dir: str | Path | None = None, **settings: Any) -> LabResult:
    """Run lab ``key`` (``"1"``..``"6"`` or ``"accept"``); write its plots to ``out_dir`` (None: no plots).

    ``settings`` go to the lab's ``run`` (e.g. ``seed=1``, or the knob that breaks its observation).
    """
    key = str(key)
    if key not in LABS:
        raise ValueError(f"unknown lab {key!r}; the labs are {', '.join(LABS)} (stabletrain lab lists them)")
    module = importlib.import_module(f"{__name__}.{LABS[key].module}")
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        created = not out.exists()
        mark_output_dir(out)  # stabletrain's output: a run's git.dirty does not count it
        if created:  # nor the user's git status (it showed '?? labs/'), as check's folder
            (out / ".gitignore").write_text("# written by stabletrain lab: its output, not your code\n*\n", encoding="utf-8")
    t0 = time.perf_counter()
    result = module.run(out_dir=out, **settings)
    result.seconds = time.perf_counter() - t0
    return result


# -- text ---------------------------------------------------------------------------------------------


def fmt(v: Any) -> str:
    """Format a table cell: floats with 4 significant digits, None as '-'."""
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


def format_table(columns: list[str], rows: list[list[Any]]) -> list[str]:
    """Return a plain-text table: numbers right-aligned, text left-aligned."""
    cells = [[fmt(v) for v in row] for row in rows]
    widths = [max([len(c)] + [len(r[i]) for r in cells]) for i, c in enumerate(columns)]
    numeric = [all(isinstance(r[i], (int, float)) or r[i] is None for r in rows) and i > 0 for i in range(len(columns))]

    def line(vals: list[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    return [line(columns), line(["-" * w for w in widths]), *(line(r) for r in cells)]


def format_result(result: LabResult) -> str:
    """Return the lab's printout: question, setup, table, claims with PASS/FAIL, explanation, plots."""
    info = result.info
    asked = (f"question: {info.question}\nthe chapter: {info.question_zh}" if info.quoted else
             f"question: {info.question} ({info.question_zh})")
    lines = [f"lab {info.key}: {info.title}", asked,
             f"setup: {result.setup}", ""]
    lines += format_table(result.columns, result.rows)
    for title, columns, rows in result.tables:
        lines += ["", f"{title}:", *format_table(columns, rows)]
    lines += ["", "observations:"]
    lines += [f"  {'PASS' if c.passed else 'FAIL'}  {c.text}: measured {c.measured} (threshold {c.threshold})"
              for c in result.claims]
    lines += ["", "explanation:"]
    lines += [f"  {s}" for s in result.explanation]
    if result.plots:
        lines += ["", "plots: " + ", ".join(str(p) for p in result.plots)]
    lines += ["", f"lab {info.key}: {'PASS' if result.passed else 'FAIL'} ({result.seconds:.1f} s)"]
    return "\n".join(lines)


def format_list() -> str:
    """Return the list of labs, one per line with what each shows."""
    width = max(len(k) for k in LABS)
    lines = []
    for info in LABS.values():
        lines.append(f"{info.key:<{width}}  {info.title}")
        lines.append(f"{'':<{width}}  {info.shows}")
    lines.append("")
    lines.append("run one: stabletrain lab N [--out DIR]; all, with an index page: stabletrain lab all --out DIR")
    return "\n".join(lines)


# -- plots --------------------------------------------------------------------------------------------


def new_figure(ncols: int = 1, width: float = 6.4, height: float = 3.6, integer_x: bool = True) -> tuple[Any, list[Any]]:
    """Return a matplotlib Figure (Agg canvas, no pyplot state) and its ``ncols`` axes side by side.

    ``integer_x``: x ticks at whole numbers only (steps, windows, layers are counted; a tick at 2.5 means nothing).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(width * ncols, height), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols, squeeze=False).ravel().tolist()
    for ax in axes:
        ax.grid(True, color="#e5e5e5", linewidth=0.8)
        ax.set_axisbelow(True)
        ax.tick_params(labelsize=8)
        if integer_x:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, axes


#: The smallest legend font of a lab plot, in points: at 110 dpi, about 11 px where labs/index.html shows a two-panel
#: plot on a 1280 px wide screen (one plot per row, never wider than its pixels), 14 px for a one-panel plot.
MIN_LEGEND_PT = 9.0


def save_figure(fig: Any, path: Path) -> Path:
    """Write ``fig`` as a PNG to ``path`` (no timestamp in the file, so reruns are byte-identical).

    Legends smaller than :data:`MIN_LEGEND_PT` are set to it: a lab's figure is read on a page, not zoomed into.
    """
    for legend in [*fig.legends, *(ax.get_legend() for ax in fig.axes)]:
        if legend is not None:
            for text in [*legend.get_texts(), legend.get_title()]:
                text.set_fontsize(max(text.get_fontsize(), MIN_LEGEND_PT))
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, facecolor="white", metadata={"Software": None})
    path.write_bytes(buf.getvalue())
    return path


def runs_folder(out_dir: Path | None, lab: str) -> Any:
    """Where a lab's training runs go: ``OUT_DIR/<lab>-runs``, the lab's last runs replaced (kept: their incident lines
    point there, for ``stabletrain diagnose``), or a temporary folder removed after the lab without an ``out_dir`` (a lab
    run from Python)."""
    import contextlib
    import shutil
    import tempfile

    if out_dir is None:
        return tempfile.TemporaryDirectory()
    folder = Path(out_dir) / f"{lab}-runs"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    return contextlib.nullcontext(str(folder))
