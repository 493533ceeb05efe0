"""The run report: one self-contained HTML page (inline CSS, PNGs as data URIs, no JS, no network).

``write_report(RUN_DIR)`` writes ``RUN_DIR/report.html`` and each plot as ``RUN_DIR/plots/<name>.png``.
Both are written atomically (a temporary file, then a rename), so a reader never sees half a page,
and the report can be rewritten while the run is still going.
"""

from __future__ import annotations

import base64
import html
import json
import math
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from .. import console
from .._version import __version__
from ..config import flatten_config
from ..fileio import atomic_write
from ..records.bundles import REMEDY_FILE, incident_order
from ..records.events import EVENT_KINDS
from .goodput import goodput_section
from .health import Health, health_summary, incident_summary
from .plots import RUN_PLOT_NAMES, Plot, run_plots
from .rundata import Event, RunData, as_number, load_run
from .text import fmt_num, fmt_pct

__all__ = ["write_report", "render_report", "ReportNotWritten"]

MAX_TIMELINE_ROWS = 400
MAX_PROBLEMS = 200
# Diagnosis fields shown first in the timeline (stabletrain.diagnostics.diagnosis); the rest fold away.
_DIAGNOSIS_KEYS = ("failure_class", "evidence", "stage", "op", "direction", "module", "first_nonfinite_param", "bad_samples",
                  "reproduces", "precision")

CSS = """
:root { --fg:#1d2329; --muted:#65707b; --line:#e3e6ea; --bg:#f6f7f9; --ok:#2f9e44; --warn:#e8890c; --bad:#d6336c; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--fg);
  font:14px/1.5 -apple-system, BlinkMacSystemFont, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width:1240px; margin:0 auto; padding:24px 28px 48px; }
h1 { font-size:22px; margin:0 0 2px; }
h2 { font-size:17px; margin:32px 0 10px; padding-bottom:4px; border-bottom:1px solid var(--line); }
code, .mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, "DejaVu Sans Mono", monospace; font-size:12.5px; }
.sub { color:var(--muted); margin:0; }
.card { background:#fff; border:1px solid var(--line); border-radius:8px; padding:14px 18px; }
.badge { display:inline-block; padding:1px 9px; border-radius:10px; font-size:12px; font-weight:600; color:#fff;
  vertical-align:middle; }
.badge.ok { background:var(--ok); } .badge.warn { background:var(--warn); } .badge.bad { background:var(--bad); }
.health { margin-top:18px; }
.health h2 { margin-top:0; border:0; }
.health ul { list-style:none; margin:0; padding:0; }
.health li { padding:3px 0 3px 22px; position:relative; }
.health li::before { content:""; position:absolute; left:4px; top:10px; width:9px; height:9px; border-radius:50%; }
.health li.ok::before { background:var(--ok); } .health li.warn::before { background:var(--warn); }
.health li.bad::before { background:var(--bad); }
nav { margin:14px 0 0; color:var(--muted); }
nav a { color:#1c6fd1; text-decoration:none; margin-right:14px; }
.problems { border-left:4px solid var(--warn); margin-top:14px; }
.problems h2 { margin:0 0 6px; border:0; font-size:15px; }
.problems li { font-family: ui-monospace, Menlo, Consolas, monospace; font-size:12.5px; word-break:break-all; }
.plots { display:grid; grid-template-columns:repeat(auto-fit, minmax(500px, 1fr)); gap:14px; }
.plots.wide { grid-template-columns:1fr; }
figure { margin:0; background:#fff; border:1px solid var(--line); border-radius:8px; padding:8px; }
figure img { width:100%; height:auto; display:block; }
figcaption { color:var(--muted); font-size:12px; padding:2px 4px 0; }
table { border-collapse:collapse; width:100%; background:#fff; border:1px solid var(--line); border-radius:8px; overflow:hidden; }
th, td { text-align:left; padding:5px 10px; border-bottom:1px solid var(--line); vertical-align:top; }
th { background:#fafbfc; font-weight:600; font-size:12.5px; color:#3b444d; }
tr:last-child td { border-bottom:0; }
td.num { text-align:right; font-variant-numeric:tabular-nums; white-space:nowrap; }
td.key { font-family: ui-monospace, Menlo, Consolas, monospace; font-size:12.5px; white-space:nowrap; }
td.nowrap { white-space:nowrap; }
td.val { font-family: ui-monospace, Menlo, Consolas, monospace; font-size:12.5px; word-break:break-word; }
.tables { display:grid; grid-template-columns:repeat(auto-fit, minmax(420px, 1fr)); gap:14px; align-items:start; }
.kind { display:inline-block; padding:0 7px; border-radius:4px; font-size:12px; font-weight:600; background:#e9ecef;
  color:#343a40; white-space:nowrap; }
/* kind colors */
tr.superseded td { color:#9aa3ab; }
.detail { color:var(--muted); font-size:12.5px; }
td.kindcol { white-space:nowrap; }
td.time { color:var(--muted); font-size:12.5px; white-space:nowrap; }
.narrow { max-width:640px; }
.empty { color:var(--muted); font-style:italic; }
details summary { cursor:pointer; color:var(--muted); font-size:12.5px; }
pre { background:#f6f8fa; border:1px solid var(--line); border-radius:6px; padding:8px; font-size:12px; max-height:320px;
  overflow:auto; white-space:pre-wrap; word-break:break-word; }
footer { margin-top:36px; color:var(--muted); font-size:12px; }
"""

_LEVEL_WORDS = {"ok": "healthy", "warn": "worth a look", "bad": "problems"}
# Why an event no longer counts, by the kind of event that went back past it (RunData: superseded_by).
_SUPERSEDED = {"resume": "this stretch was trained again after a resume (the same steps; the later line counts)",
               "rollback": "the run rolled back past this step and trained that stretch again (the health summary "
                           "still tells it)",
               "remedy": "a remedy rolled the run back past this step and trained that stretch again (the health "
                         "summary still tells it)"}

# (background, text) color of each event kind's label in the timeline: one per kind of
# stabletrain.records.events.EVENT_KINDS (a test checks); a kind unknown to this version is grey.
KIND_COLORS: dict[str, tuple[str, str]] = {
    "skip": ("#fff3bf", "#8a5a00"),
    "nonfinite": ("#ffe3e3", "#a61e4d"), "buffers_reset": ("#ffe3e3", "#862e9c"),
    "spike": ("#f3d9fa", "#862e9c"),
    "precursor": ("#fff9db", "#862e9c"),
    "early_outlier": ("#f8f0fc", "#862e9c"),
    "stall": ("#ffe8cc", "#c92a2a"),
    "incident": ("#d6336c", "#fff"),
    "checkpoint": ("#d3f9d8", "#2b8a3e"),
    "checkpoint_withheld": ("#ffe8cc", "#d9480f"),
    "checkpoint_failed": ("#ffe3e3", "#c92a2a"),
    "checkpoint_skipped": ("#fff4e6", "#d9480f"),
    "restart": ("#1864ab", "#fff"),
    "resume": ("#d0ebff", "#1864ab"),
    "rollback": ("#f4e4d7", "#7a3e12"),
    "remedy": ("#e6fcf5", "#087f5b"),
    "schedule_changed": ("#e3fafc", "#0b7285"),
    "stop": ("#343a40", "#fff"),
    "crash": ("#c92a2a", "#fff"),
    "retry": ("#fff4e6", "#c92a2a"),
    "init_overwritten": ("#fff0f6", "#c2255c"),
}
assert KIND_COLORS.keys() <= EVENT_KINDS.keys(), set(KIND_COLORS) - set(EVENT_KINDS)
CSS = CSS.replace("/* kind colors */\n", "".join(f".kind.{kind} {{ background:{bg}; color:{fg}; }}\n"
                                                 for kind, (bg, fg) in KIND_COLORS.items()))


# -- shared page pieces (also used by compare) ----------------------------------------------------


def esc(value: Any) -> str:
    return html.escape(str(value), quote=True)


def page(title: str, body: str) -> str:
    """Return a whole HTML document around ``body``."""
    return (f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n<title>{esc(title)}</title>\n'
            f'<style>{CSS}</style>\n</head>\n<body>\n<main>\n{body}\n</main>\n</body>\n</html>\n')


def table(header: Sequence[str], rows: Iterable[Sequence[str]], classes: Sequence[str] = (),
          row_classes: Iterable[str] | None = None) -> str:
    """Return a table; cells are HTML already (escape them first); ``classes`` are per-column td classes."""
    head = "".join(f"<th>{h}</th>" for h in header)
    body = []
    row_classes = iter(row_classes) if row_classes is not None else None
    for row in rows:
        cls = next(row_classes) if row_classes is not None else ""
        cells = "".join(f'<td class="{classes[i] if i < len(classes) else ""}">{c}</td>' for i, c in enumerate(row))
        body.append(f'<tr class="{cls}">{cells}</tr>' if cls else f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def figure(plot: Plot, src: str | None = None) -> str:
    """Return a <figure> with the plot embedded as a base64 data URI (the page needs no other file)."""
    data = base64.b64encode(plot.png).decode("ascii")
    return (f'<figure id="plot-{esc(plot.name)}"><img src="data:image/png;base64,{data}" alt="{esc(plot.title)}">'
            f"<figcaption>{esc(plot.title)}{f' — <code>{esc(src)}</code>' if src else ''}</figcaption></figure>")


def problems_box(problems: Sequence[str]) -> str:
    if not problems:
        return ""
    items = "".join(f"<li>{esc(p)}</li>" for p in problems[:MAX_PROBLEMS])
    more = f"<p class='detail'>and {len(problems) - MAX_PROBLEMS} more</p>" if len(problems) > MAX_PROBLEMS else ""
    return (f'<section class="card problems" id="problems"><h2>Data problems ({len(problems)})</h2>'
            f"<p class='detail'>These lines or files could not be read and were left out; the rest of the page is "
            f"drawn from what could be read.</p><ul>{items}</ul>{more}</section>")


def value_cell(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, str):
        return esc(value)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return esc(value)
    return esc(json.dumps(value, default=str))


def write_plots(plots: Sequence[Plot], folder: Path, known: Iterable[str]) -> dict[str, Path]:
    """Write each plot as ``folder/<name>.png``; remove stale PNGs of ``known`` names this report did not draw."""
    paths = {}
    folder.mkdir(parents=True, exist_ok=True)
    for plot in plots:
        paths[plot.name] = folder / f"{plot.name}.png"
        atomic_write(paths[plot.name], plot.png, fsync=False)  # a page, not a record: atomic is enough
    for name in set(known) - set(paths):
        (folder / f"{name}.png").unlink(missing_ok=True)
    return paths


def footer(source: str, runs: int = 1) -> str:
    return (f"<footer>Written by stabletrain {esc(__version__)} on {esc(time.strftime('%Y-%m-%d %H:%M:%S'))} "
            f"from {source}. The page reads only the run director{'ies' if runs > 1 else 'y'}.</footer>")


# -- the run report -------------------------------------------------------------------------------


class ReportNotWritten(ValueError):
    """The report's page or plots could not be written where they go (a read-only run directory): one line."""


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``RUN_DIR/report.html`` and ``RUN_DIR/plots/*.png``; return the page's path.

    ``out``: elsewhere (a run directory that cannot be written): an ``.html`` file, or a directory for its
    ``report.html``; the plots then go in ``<page stem>_plots/`` next to the page, as a comparison's do.
    Works on a run in progress, a resumed run and a run with incidents; malformed lines are listed
    on the page under "Data problems". Raises FileNotFoundError / ValueError only when ``run_dir``
    is not a run directory. The page also goes to each tracker run the run wrote to
    (``RUN_DIR/trackers.json``: :func:`stabletrain.callbacks.trackers.attach_report`), a line saying where.
    """
    from ..callbacks.trackers import attach_report

    run = load_run(run_dir)
    plots = run_plots(run)
    if out is None:
        out, folder = run.path / "report.html", run.path / "plots"
    else:
        out = Path(out) if Path(out).suffix.lower() in (".html", ".htm") and not Path(out).is_dir() else Path(out) / "report.html"
        folder = out.parent / f"{out.stem}_plots"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        paths = write_plots(plots, folder, RUN_PLOT_NAMES)
        atomic_write(out, render_report(run, plots, {k: str(p.relative_to(out.parent)) for k, p in paths.items()}),
                     fsync=False)
    except OSError as err:  # (a read-only run directory: a traceback before)
        raise ReportNotWritten(f"report: {str(out.parent)!r} cannot be written ({err.strerror or err}: "
                               f"{err.filename or err.filename2 or out})") from err
    for where in attach_report(run.path, out):
        console.say(f"{out.name} attached to the {where}")
    return out


def render_report(run: RunData, plots: Sequence[Plot] | None = None, files: dict[str, str] | None = None) -> str:
    """Return the report page of ``run`` as HTML (``plots`` default to :func:`run_plots`)."""
    plots = run_plots(run) if plots is None else plots
    files = files or {}
    health = health_summary(run)
    sections = [
        _header(run, health),
        _health(health),
        goodput_section(run.path),
        problems_box(run.problems),
        '<nav><a href="#curves">Curves</a><a href="#events">Events</a><a href="#layers">Grad-norm layers</a>'
        '<a href="#config">Config</a><a href="#snapshot">Snapshot</a></nav>',
        '<h2 id="curves">Curves</h2>',
        (f'<div class="plots">{"".join(figure(p, files.get(p.name)) for p in plots)}</div>' if plots
         else f'<p class="empty">{_no_metrics(health)}</p>'),
        _no_loss_scale(run, health) if plots else "",
        f'<h2 id="events">Events ({sum(1 for e in run.events if not e.superseded)})</h2>',
        _timeline(run),
        _remedies(run),
        '<h2 id="layers">Layers dominating the grad norm</h2>',
        _top_layers(run),
        '<div class="tables"><div><h2 id="config">Config</h2>',
        _tree_table(run.config, "config.yaml"),
        '</div><div><h2 id="snapshot">Snapshot</h2>',
        _tree_table(run.snapshot, "snapshot.json"),
        "</div></div>",
        footer(f"<code>{esc(run.path.resolve())}</code>"),
    ]
    return page(f"{run.name} — stabletrain report", "\n".join(s for s in sections if s))


def _header(run: RunData, health: Health) -> str:
    snap = run.snapshot
    device = snap.get("device") if isinstance(snap.get("device"), dict) else {}
    git = snap.get("git") if isinstance(snap.get("git"), dict) else {}
    task, name = run.cfg("task"), snap.get("task_name")  # the spec, and Task.name when it says more
    facts = {"task": f"{task} ({name})" if name and task and name != task else task or name,
             "precision": snap.get("precision") or run.cfg("precision"),
             "device": device.get("name") or device.get("type"), "started": snap.get("created"),
             "commit": str(git.get("commit") or "")[:10] + (" (dirty)" if git.get("dirty") else "")}
    shown = " · ".join(f"{label} <b>{esc(value)}</b>" for label, value in facts.items() if value)
    level = health.level
    return (f'<header><h1>{esc(run.name)} <span class="badge {level}">{_LEVEL_WORDS[level]}</span></h1>'
            f'<p class="sub mono">{esc(run.path.resolve())}</p><p class="sub">{shown}</p></header>')


def _no_loss_scale(run: RunData, health: Health) -> str:
    """The one line that says why there is no loss-scale panel (fp32, bf16: no GradScaler)."""
    if run.loss_scaled:
        return ""
    precision = run.snapshot.get("precision") or run.cfg("precision") or "this precision"
    skipped = health.figures.get("skipped_steps", 0)
    rest = "the skipped steps have their own panel" if skipped else "no step was skipped"
    return (f'<p class="detail" id="no-loss-scale">No loss-scale panel: {esc(precision)} trains without a loss scale '
            f"(only fp16 runs a GradScaler); {rest}.</p>")


def _no_metrics(health: Health) -> str:
    crash = health.figures.get("crash")
    if crash:
        return (f"No metrics: the run crashed at step {crash['step']:,}, before its first log interval "
                f"(see the crash under Events).")
    return "No metrics logged yet: metrics.jsonl is empty or missing."


def _health(health: Health) -> str:
    items = "".join(f'<li class="{lvl}">{esc(text)}</li>' for lvl, text in health.sentences)
    return f'<section class="card health" id="health"><h2>Health</h2><ul>{items}</ul></section>'


# -- events timeline ------------------------------------------------------------------------------


def _groups(events: Sequence[Event]) -> list[list[Event]]:
    """Group events of the same kind and reason at consecutive steps (a burst of skips is one row)."""
    open_groups: dict[tuple, list[Event]] = {}
    groups: list[list[Event]] = []
    for event in sorted(events, key=lambda e: e.step):
        key = (event.kind, event.reason, event.superseded)
        group = open_groups.get(key)
        if event.kind in ("skip", "nonfinite") and group and event.step - group[-1].step <= 1:
            group.append(event)
            continue
        open_groups[key] = [event]
        groups.append(open_groups[key])
    return groups


def _timeline(run: RunData) -> str:
    if not run.events:
        return '<p class="empty">No events: events.jsonl is empty or missing (no skips, spikes, incidents or checkpoints).</p>'
    groups = _groups(run.events)
    rows, classes = [], []
    for group in groups[:MAX_TIMELINE_ROWS]:
        first, last = group[0], group[-1]
        steps = f"{first.step:,}" if first.step == last.step else f"{first.step:,}–{last.step:,}"
        count = f" ×{len(group)}" if len(group) > 1 else ""
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(first.time)) if first.time is not None else ""
        what = esc(first.reason) + _details(first, run)
        if first.superseded:
            what += f'<div class="detail">superseded: {_SUPERSEDED.get(first.superseded_by, _SUPERSEDED["resume"])}</div>'
        moved = _moved_incident(first)
        if moved:
            what += f'<div class="detail">its folder is now {esc(moved)} (a restart went back past it)</div>'
        rows.append([steps, f'<span class="kind {esc(first.kind)}">{esc(first.kind)}</span>{count}', what, when])
        classes.append("superseded" if first.superseded else "")
    more = ""
    if len(groups) > MAX_TIMELINE_ROWS:
        more = f'<p class="detail">and {len(groups) - MAX_TIMELINE_ROWS} more rows in events.jsonl</p>'
    return table(["step", "kind", "what happened", "time"], rows, ["num", "kindcol", "", "time"], classes) + more


def _moved_incident(event: Event) -> str | None:
    """Where an incident event's folder went when a restart renamed it ``step_N.superseded-R`` (None: where it says)."""
    path = event.extra.get("path") if event.kind == "incident" else None
    if not isinstance(path, str) or Path(path).exists():
        return None
    moved = sorted(Path(path).parent.glob(Path(path).name + ".superseded-*"))
    return str(moved[0]) if moved else None


def _details(event: Event, run: RunData) -> str:
    """Return the kind-specific detail lines of an event, then any other fields plainly."""
    extra = dict(event.extra)
    lines = []
    if event.kind == "skip" and "loss_scale" in extra:
        lines.append(f"loss scale {esc(fmt_num(as_number(extra.pop('loss_scale'))))}")
    elif event.kind == "nonfinite":
        # The loop's reason already reads "loss=inf, grad_norm=nan"; say the values only when it does not.
        parts = [f"{k.replace('_', ' ')} {esc(fmt_num(as_number(extra.pop(k))))}" for k in ("loss", "grad_norm")
                 if k in extra and f"{k}=" not in event.reason]
        extra = {k: v for k, v in extra.items() if k not in ("loss", "grad_norm")}
        if parts:
            lines.append(", ".join(parts))
    elif event.kind == "incident":
        diagnosis = extra.pop("diagnosis", None)
        summary = incident_summary(event)
        if summary and summary != event.reason:
            lines.append(f"<b>diagnosis:</b> {esc(summary)}")
        if isinstance(diagnosis, dict):
            rest = {k: v for k, v in diagnosis.items() if k != "summary" and v not in (None, [], {})}
            ordered = {k: rest[k] for k in _DIAGNOSIS_KEYS if k in rest}  # the fields a person reads first
            ordered.update(rest)
            if ordered:
                lines.append(_kv(ordered, inline=8))
    elif event.kind == "init_overwritten" and isinstance(extra.get("params"), list):
        params = extra.pop("params")
        cells = []
        for p in params[:12]:
            if isinstance(p, dict):
                cells.append(f"<code>{esc(p.get('name', '?'))}</code> std {esc(fmt_num(as_number(p.get('old_std'))))}"
                             f" → {esc(fmt_num(as_number(p.get('new_std'))))}")
        if len(params) > 12:
            cells.append(f"and {len(params) - 12} more")
        lines.append("<br>".join(cells))
    if "path" in extra:
        lines.append(f"<code>{esc(_relative(extra.pop('path'), run.path))}</code>")
    extra = {k: v for k, v in extra.items() if v not in (None, "", [], {})}
    if extra:
        lines.append(_kv(extra))
    return "".join(f'<div class="detail">{line}</div>' for line in lines)


def _relative(path: Any, run_dir: Path) -> str:
    """Return ``path`` relative to the run directory when it lies inside it (the run dir may have moved since)."""
    try:
        return str(Path(str(path)).resolve().relative_to(run_dir.resolve()))
    except (ValueError, OSError):
        return str(path)


def _kv(mapping: dict[str, Any], inline: int = 12, width: int = 120) -> str:
    """Return short fields inline ("key: value; ..."), and long or surplus ones in a collapsed <details> (no JS)."""
    short, long = [], {}
    for key, value in mapping.items():
        text = value if isinstance(value, str) else json.dumps(value, default=str)
        if len(text) <= width and len(short) < inline:
            short.append(f"{esc(key)}: <code>{esc(text)}</code>")
        else:
            long[key] = value
    out = "; ".join(short)
    if long:
        blob = json.dumps(long, indent=1, default=str)
        if len(blob) > 20000:
            blob = blob[:20000] + "\n…"
        out += (f"<details><summary>{len(long)} more field{'s' if len(long) > 1 else ''}: {esc(', '.join(long))}</summary>"
                f"<pre>{esc(blob)}</pre></details>")
    return out


# -- tables ---------------------------------------------------------------------------------------


def _top_layers(run: RunData) -> str:
    latest = next((r for r in reversed(run.metrics) if r.get("top_grad_layers")), None)
    if latest is None:
        return '<p class="empty">Not logged.</p>'
    rows = []
    for item in latest["top_grad_layers"]:
        if isinstance(item, dict):
            share = as_number(item.get("share"))
            rows.append([f"<code>{esc(item.get('name', '?'))}</code>", fmt_pct(share) if share is not None else "—"])
    caption = f'<p class="detail">Share of the squared grad norm in the interval ending at step {int(latest["step"]):,}.</p>'
    return f'<div class="narrow">{caption}{table(["parameter", "share"], rows, ["", "num"])}</div>'


def _remedies(run: RunData) -> str:
    """The "Remedies" section: each incident's ``remedy.json`` (``stabletrain remedy``), its candidates ranked."""
    parts, found = [], (run.path / "incidents").glob("step_*/remedy*.json")  # (remedy.run.json: the run's own, kept)
    for path in sorted(found, key=lambda p: (incident_order(p.parent), p.name == REMEDY_FILE)):
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            parts.append(f'<p class="empty">{esc(path)} could not be read ({esc(err)}).</p>')
            continue
        rows = [[str(i), f"<code>{esc(c.get('name'))}</code>" + (" (baseline)" if c.get("baseline") else ""),
                 f"<b>{esc(c.get('verdict'))}</b>", esc(_end_loss(c.get("end_loss"))), esc(c.get("detail")),
                 esc(c.get("evidence")) + (f"<br>code change: {esc(c['change'])}" if c.get("change") else "")]
                for i, c in enumerate(record.get("candidates") or [], 1) if isinstance(c, dict)]
        timings = record.get("timings") or {}
        best = record.get("best")
        later = record.get("later_incident")
        # A restart went back past it (its folder renamed step_N.superseded-R): the search of a stretch trained again
        superseded = ".superseded-" in path.parent.name
        parts.append(
            f"<h3>Step {esc(record.get('step'))}: {esc(record.get('failure_class'))}"
            + (f" <small>(superseded: restart {esc(path.parent.name.rsplit('-', 1)[-1])} went back past it; "
               f"{esc(path.parent.name)})</small>" if superseded else "") + (" <small>(the run's own search, made while it "
               f"ran; {REMEDY_FILE} holds a later one)</small>" if path.name != REMEDY_FILE else "") + "</h3>"
            f'<p class="detail">{esc(record.get("evidence"))}. '
            + (f"Replayed the incident's window only ({esc(record['note'])}; " if record.get("note") else
               f"Replayed the incident's window and the {esc(record.get('steps'))} after it (")
            + f"{esc(timings.get('steps_replayed'))} steps, "
            f"{esc(fmt_num(as_number(timings.get('total_s'))))} s)"
            + (f", judged up to step {esc(later - 1)}: every candidate past it met a later incident at step "
               f"{esc(later)} alike" if isinstance(later, int) else "") + ". "
            + (f"Best: <code>{esc(best)}</code>." if best else "No candidate cures it.") + "</p>"
            + table(["#", "candidate", "verdict", "end loss", "what it does", "evidence"], rows,
                    ["num", "nowrap", "nowrap", "num", "", ""]))
    return '<h2 id="remedies">Remedies</h2>' + "".join(parts) if parts else ""


def _end_loss(value: Any) -> str:
    """A candidate's end loss as ``stabletrain remedy`` prints it: 4 digits, "-" where it has none (it failed)."""
    number = as_number(value)
    return f"{number:.4g}" if number is not None and math.isfinite(number) else "-"


def _tree_table(tree: dict[str, Any], source: str) -> str:
    if not tree:
        return f'<p class="empty">{esc(source)} is missing or could not be read.</p>'
    # (snapshot.json's resumes: one launch each, its keys as rows of their own, resumes.1.command ...)
    launches = {f"{k}.{i + 1}": x for k in ("resumes",) if isinstance(tree.get(k), list) for i, x in enumerate(tree[k])}
    flat = flatten_config({**{k: v for k, v in tree.items() if k != "resumes" or not launches}, **launches}, keep_empty=True)
    for key, item in [("", tree), *launches.items()]:
        if isinstance(item, dict) and isinstance(item.get("command"), list):
            flat[f"{key}.command" if key else "command"] = " ".join(map(str, item["command"]))
    return table(["key", "value"], ([esc(k), value_cell(v)] for k, v in flat.items()), ["key", "val"])
