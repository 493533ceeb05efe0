"""Compare runs: what differs in their configs, and their curves overlaid by step and by items seen.

``write_compare([RUN_A, RUN_B, ...], out)`` writes one self-contained page and each plot as
``<page stem>_plots/<metric>.png`` next to it. ``out`` is a directory (``OUT/compare.html``) or an
``.html`` file; by default the page goes in the first run's directory (``RUN_A/compare.html``): the
first run is the baseline the others are compared with, and nothing is written to the current directory.
Items seen are the runs' count unit (tokens or samples, from each snapshot's ``count_unit``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import ABSENT, flatten_config
from ..config.diff import with_task_defaults
from ..fileio import atomic_write, check_folder
from .goodput import read_goodput
from .health import health_summary
from .html import esc, figure, footer, page, problems_box, table, value_cell, write_plots
from .plots import COLORS, COMPARE_METRICS, compare_plots, items_note
from .rundata import RunData, load_run
from .text import fmt_num, fmt_pct

__all__ = ["write_compare", "render_compare", "compare_path", "config_diff", "run_labels", "COMPARE_FILE"]

#: The page's file name when ``out`` is a directory (or not given: the first run's directory).
COMPARE_FILE = "compare.html"

# Snapshot fields worth comparing (code, libraries, device, data); the rest differ by nature (time, cwd). Not the config's
# hash: the config table names every key that differs (a hash that differs by run.dir alone read as another config).
_SNAPSHOT_KEYS = ("git.commit", "git.dirty", "git.diff_sha256", "versions.", "platform", "device.", "precision",
                  "data_fingerprint")


def run_labels(runs: Sequence[RunData]) -> list[str]:
    """Return a short unique label per run: the folder name, with parents added only where names clash."""
    depth = 1
    while True:
        labels = ["/".join(run.path.resolve().parts[-depth:]) for run in runs]
        if len(set(labels)) == len(labels) or depth > 8:
            return labels if len(set(labels)) == len(labels) else [f"{label} [{i + 1}]" for i, label in enumerate(labels)]
        depth += 1


def config_diff(trees: Sequence[dict[str, Any]], only: Sequence[str] | None = None) -> list[tuple[str, list[Any]]]:
    """Return ``[(dotted key, [value per tree])]`` for the keys whose values differ (a missing key is ``ABSENT``).

    ``only`` keeps keys equal to, or starting with, one of its prefixes (a prefix ends with "."). ``task_args`` with each
    run's task factory's defaults filled in (:func:`~stabletrain.config.diff.with_task_defaults`): a key set to its
    default is no difference, and neither is a key every run has absent or empty (``task_args: {}`` of a factory that
    takes none, beside runs whose ``task_args.*`` hold values: those keys are the differences).
    """
    flats = [flatten_config(with_task_defaults(t, imports=False), keep_empty=True) for t in trees]  # (no user code run)
    keys: dict[str, None] = {}
    for flat in flats:
        keys.update(dict.fromkeys(flat))
    out = []
    for key in keys:
        if only is not None and not any(key == p or (p.endswith(".") and key.startswith(p)) for p in only):
            continue
        values = [flat.get(key, ABSENT) for flat in flats]
        if any(v != values[0] for v in values[1:]) and not all(v is ABSENT or v in ({}, []) for v in values):
            out.append((key, values))
    return out


def compare_path(run_dirs: Sequence[str | Path], out: str | Path | None = None) -> Path:
    """Return where the page goes: ``out`` when it names an ``.html`` file, ``out/compare.html`` for a
    directory, and ``RUN_A/compare.html`` (the first run's directory) without ``out``."""
    if out is None:
        return Path(run_dirs[0]) / COMPARE_FILE
    out = Path(out)
    page = out if out.suffix.lower() in (".html", ".htm") and not out.is_dir() else out / COMPARE_FILE
    check_folder(page.parent)
    return page


def write_compare(run_dirs: Sequence[str | Path], out: str | Path | None = None, *, said: list[str] | None = None) -> Path:
    """Write the comparison page of ``run_dirs``; return its path (see :func:`compare_path` for where).

    The plots go in ``<page stem>_plots/`` next to the page. Raises ValueError for fewer than two
    runs, and FileNotFoundError / ValueError for a folder that is not a run directory. Malformed
    lines are listed on the page, never raised. ``said``: a list the page's gist is appended to, as lines for a
    console (:func:`compare_lines`).
    """
    if len(run_dirs) < 2:
        raise ValueError(f"compare needs at least two run directories, got {len(run_dirs)}")
    seen: dict[Path, str] = {}  # (the same run twice compares it with itself: a slip in the command, not a comparison)
    for d in map(str, run_dirs):
        first = seen.get(Path(d).resolve())
        if first is not None:
            raise ValueError(f"run directory {d!r} is given twice" + (f" (as {first!r} too)" if first != d else "")
                             + ": compare needs two or more different runs")
        seen[Path(d).resolve()] = d
    runs = [load_run(d) for d in run_dirs]
    out = compare_path(run_dirs, out)
    labels = run_labels(runs)
    plots = compare_plots(runs, labels)
    folder = out.parent / f"{out.stem}_plots"
    paths = write_plots(plots, folder, COMPARE_METRICS)
    files = {k: str(Path(folder.name) / p.name) for k, p in paths.items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    figures = [health_summary(run).figures for run in runs]  # (once, for the page's summary and the lines)
    atomic_write(out, render_compare(runs, labels, plots, files, figures=figures), fsync=False)
    if said is not None:
        said.extend(compare_lines(runs, labels, figures))
    return out


def compare_lines(runs: Sequence[RunData], labels: Sequence[str], figures: Sequence[dict[str, Any]] | None = None
                  ) -> list[str]:
    """The page's gist in lines: the config keys that differ (with each run's value), then each run's headline figures
    (``figures``: each run's health figures, where the caller has them)."""
    diff = [(k, v) for k, v in _host_aware(config_diff([run.config for run in runs]), runs)[0] if k != "run.dir"]

    def plain(value: Any) -> str:
        if isinstance(value, bool) or value is None:  # (as config.yaml writes them)
            return {True: "true", False: "false", None: "null"}[value]
        return "absent" if value is ABSENT else fmt_num(value) if isinstance(value, float) else str(value)

    shown = "; ".join(f"{k} {' | '.join(plain(x) for x in values)}" for k, values in diff[:6])
    lines = [f"config: {len(diff)} key{'s' if len(diff) != 1 else ''} differ{'s' if len(diff) == 1 else ''} "
             f"({' | '.join(labels)}): {shown}{f'; and {len(diff) - 6} more' if len(diff) > 6 else ''}" if diff
             else "config: the same (besides run.dir)"]
    for label, f in zip(labels, figures or [health_summary(run).figures for run in runs]):
        loss = f"loss {fmt_num(f['loss_start'])} -> {fmt_num(f['loss_end'])}" if "loss_start" in f else "no loss logged"
        val = f", val loss {fmt_num(f['val_last'])}" if f.get("val_last") is not None else ""
        counts = [(len(f.get("spike_steps") or []), "loss spike", "loss spikes"),
                  (f.get("nonfinite_steps") or 0, "non-finite step", "non-finite steps"),
                  (f.get("skipped_steps") or 0, "skipped step", "skipped steps"),
                  (len(f.get("incidents", [])), "incident captured", "incidents captured")]
        told = ", ".join(f"{n:,} {one if n == 1 else many}" for n, one, many in counts)
        lines.append(f"{label}: {loss}{val}; {told}; {_ending(f)}"
                     + "".join(f"; {x}" for x in (_remedies_text(f), _restarts_text(f)) if x != "—"))
    return lines


def _remedies_text(f: dict[str, Any]) -> str:
    """The remedies a run applied (a config changed mid-run): "rollback-lr-x0.1 (incident at step 38)", or "—"."""
    done = [r for r in f.get("remedies") or [] if r.get("name")]
    return ", ".join(f"{r['name']}" + (f" (incident at step {r['incident_step']:,})" if isinstance(r.get("incident_step"), int)
                                       else "") for r in done) or "—"


def _restarts_text(f: dict[str, Any]) -> str:
    n = f.get("restarts") or 0
    return f"restarted itself {n} time{'s' if n != 1 else ''}" if n else "—"


def render_compare(runs: Sequence[RunData], labels: Sequence[str], plots=None, files: dict[str, str] | None = None, *,
                   figures: Sequence[dict[str, Any]] | None = None) -> str:
    """Return the comparison page as HTML."""
    plots = compare_plots(list(runs), list(labels)) if plots is None else plots
    files = files or {}
    swatch = [f'<span style="display:inline-block;width:11px;height:11px;border-radius:2px;background:{COLORS[i % len(COLORS)]};'
              f'margin-right:6px;vertical-align:-1px"></span>' for i in range(len(runs))]
    head = [f"{swatch[i]}<b>{esc(label)}</b>" for i, label in enumerate(labels)]

    diff, hosts_note = _host_aware(config_diff([run.config for run in runs]), runs)
    resumed = [label for run, label in zip(runs, labels) if _resumes(run)]
    if resumed:  # (config.yaml is the last launch's: a resume may have changed train.max_steps, log.*, a reshard's batch)
        hosts_note += (f'<p class="detail">{esc(", ".join(resumed))} {"was" if len(resumed) == 1 else "were"} resumed: '
                       "the config shown is each run's last launch's (the summary's 'resumed at step' row; the run's events "
                       "say what a resume changed).</p>")
    if diff:
        config_html = table(["config key", *head], ([esc(k), *(_cell(v) for v in vals)] for k, vals in diff),
                            ["key", *["val"] * len(runs)]) + hosts_note
    else:
        config_html = '<p class="empty">The configs are identical.</p>' + hosts_note
    snap_diff = config_diff([run.snapshot for run in runs], only=_SNAPSHOT_KEYS)
    # (the snapshot's precision is the one the config's resolved to: 'auto' above, 'fp32' here, told apart by name)
    snap_html = (table(["snapshot key", *head], ([esc("precision (resolved)" if k == "precision" else k),
                                                  *(_snap_cell(k, v) for v in vals)] for k, vals in snap_diff),
                       ["key", *["val"] * len(runs)]) + _unfingerprinted(snap_diff, runs, labels) if snap_diff
                 else '<p class="empty">Same code version, libraries, device and data.</p>')

    problems = [p for run in runs for p in run.problems]
    runs_list = "".join(f"<li>{swatch[i]}<b>{esc(label)}</b> <code>{esc(run.path.resolve())}</code></li>"
                        for i, (run, label) in enumerate(zip(runs, labels)))
    body = [
        f"<header><h1>Compare {len(runs)} runs</h1><ul class='sub'>{runs_list}</ul></header>",
        problems_box(problems),
        '<nav><a href="#config">Config differences</a><a href="#summary">Summary</a><a href="#curves">Curves</a></nav>',
        # (run.dir differs between any two runs of the CLI: not counted as a setting, said)
        f'<h2 id="config">Config keys that differ ({sum(k != "run.dir" for k, _ in diff)}'
        f'{", and run.dir" if any(k == "run.dir" for k, _ in diff) else ""})</h2>',
        config_html,
        '<h2 id="snapshot">Code, libraries, device and data that differ</h2>',
        snap_html,
        '<h2 id="summary">Summary</h2>',
        _summary(runs, head, figures),
        f'<h2 id="curves">Curves</h2><p class="detail">Left: by optimizer step. {esc(items_note(list(runs), list(labels)))}</p>',
        (f'<div class="plots wide">{"".join(figure(p, files.get(p.name)) for p in plots)}</div>' if plots
         else '<p class="empty">No metrics logged yet in any of the runs.</p>'),
        footer(", ".join(f"<code>{esc(run.path.resolve())}</code>" for run in runs), runs=len(runs)),
    ]
    return page(f"compare {' vs '.join(labels)} — stabletrain", "\n".join(s for s in body if s))


def _host_aware(diff: list[tuple[str, list[Any]]], runs: Sequence[RunData]) -> tuple[list[tuple[str, list[Any]]], str]:
    """Leave out the ``host.*`` keys that only some runs have when the runs come from different hosts, and say so.

    ``host.*`` are each host's own arguments under its own names (Monitor's ``clip_max_norm``, Lightning's
    ``gradient_clip_val``): one setting from two hosts is two names, not two differences. What they set is
    compared under stabletrain's own keys (``clip.max_norm``, ``precision``, ``log.every``, ...), which every run has.
    """
    integrations = {str(run.cfg("integration", "stabletrain")) for run in runs}
    if len(integrations) < 2:
        return diff, ""
    own = [(k, v) for k, v in diff if k.startswith("host.") and any(x is ABSENT for x in v)]
    if not own:
        return diff, ""
    names = ", ".join(sorted(integrations))
    note = (f'<p class="detail">{len(own)} <code>host.*</code> keys are left out: each host ({esc(names)}) names its '
            "own arguments, so one setting from two hosts would read as two differences; what they set is compared "
            "above under stabletrain's keys (clip.max_norm, precision, log.every, ...).</p>")
    return [(k, v) for k, v in diff if (k, v) not in own], note


def _cell(value: Any) -> str:
    return '<span class="empty">absent</span>' if value is ABSENT else value_cell(value)


def _snap_cell(key: str, value: Any) -> str:
    """A snapshot value; a data fingerprint the run did not record is "not recorded" (said why under the table), not a
    null that reads as a value."""
    return '<span class="empty">not recorded</span>' if key == "data_fingerprint" and value is None else _cell(value)


def _unfingerprinted(snap_diff: list[tuple[str, list[Any]]], runs: Sequence[RunData], labels: Sequence[str]) -> str:
    """Why a run has no data fingerprint (when the runs' fingerprints differ): its task declares none, or it is an adapter's
    run (the host's data is not fingerprinted); so whether it read the others' data is unknown."""
    values = dict(snap_diff).get("data_fingerprint")
    if values is None:
        return ""
    parts = []
    for run, label, value in zip(runs, labels, values):
        if value is None:
            host = run.cfg("integration")
            why = (f"a {host} run: the adapter does not fingerprint the host's data" if host
                   else f"whose task, {run.cfg('task')}, declares no Task.data_fingerprint")
            parts.append(f"<b>{esc(label)}</b>, {esc(why)}")
    if not parts:
        return ""
    return (f'<p class="detail">data_fingerprint is not recorded for {"; for ".join(parts)}: whether '
            f'{"it" if len(parts) == 1 else "they"} read the same data as the others is unknown.</p>')


def _ending(f: dict[str, Any]) -> str:
    """How a run ended, for the summary: a crash (step and error type), a stop, its last step reached ("finished"), or
    short of it with neither ("not finished": still going, or killed)."""
    if "crash" in f:
        return f"crash at step {f['crash']['step']:,} ({f['crash']['error'] or 'error'})"
    if "stop" in f:
        return f"stop at step {f['stop']['step']:,}"
    last, most = f.get("last_step"), f.get("max_steps")
    if isinstance(last, int) and isinstance(most, int):
        return "finished" if last >= most else f"not finished ({last:,} of {most:,}: still going, or killed)"
    return "—"


def _resumes(run: RunData) -> list[Any]:
    """The run's resumes (by hand, or a restart's own), those a later one went back past left out."""
    return [e for e in run.events if e.kind == "resume" and not e.superseded]


def _resumed_text(run: RunData) -> str:
    """"80, 120 (1 under another world size)", or "—"."""
    resumes = _resumes(run)
    moved = sum(1 for e in resumes if e.extra.get("resharded"))
    return (", ".join(f"{e.step:,}" for e in resumes) or "—") + (f" ({moved} under another world size)" if moved else "")


def _summary_cell(text: str) -> str:
    """A summary cell's html: a figure kept on one line; a sentence (a goodput's parts, how a run ended) wraps, as a
    number's cell would not: the table ran past the page's edge, the second run's column cut off (a new user's)."""
    return esc(text) if len(text) <= 40 else f'<span style="white-space:normal">{esc(text)}</span>'


def _summary(runs: Sequence[RunData], head: Sequence[str], figures: Sequence[dict[str, Any]] | None = None) -> str:
    """One row per headline figure, one column per run (``figures``: their health figures, where the caller has them)."""
    figures = figures or [health_summary(run).figures for run in runs]
    rows_spec = [
        ("last step", lambda f: fmt_num(f.get("last_step"))),
        ("ended by", _ending),
        ("train loss, start → end", lambda f: f"{fmt_num(f.get('loss_start'))} → {fmt_num(f.get('loss_end'))}"
         if "loss_start" in f else "—"),  # the health summary's headline: robust to a few huge losses at either end
        ("last val loss", lambda f: fmt_num(f.get("val_last"))),
        ("best val loss (step)", lambda f: f"{fmt_num(f['val_best'])} ({f['val_best_step']:,})" if "val_best" in f else "—"),
        ("clip rate", lambda f: fmt_pct(f["clip_rate"]) if "clip_rate" in f else "—"),
        ("skipped steps", lambda f: fmt_num(f.get("skipped_steps"))),
        ("non-finite steps (fp16 overflows aside)", lambda f: fmt_num(f.get("nonfinite_steps"))),
        ("incidents", lambda f: fmt_num(len(f.get("incidents", []))) + (
            f" (+{len(f['incidents_undone'])} rolled back past)" if f.get("incidents_undone") else "")),
        ("median throughput", lambda f: f"{fmt_num(round(f['tokens_per_s_median']))} {f['count_unit']}/s"
         if "tokens_per_s_median" in f else "—"),
        ("peak memory MiB", lambda f: fmt_num(round(f["peak_memory_mib"])) if "peak_memory_mib" in f else "—"),
        ("remedies applied", _remedies_text),
        ("restarts", lambda f: fmt_num(f.get("restarts") or 0)),
    ]
    rows = [[esc(name), *(_summary_cell(fn(f)) for f in figures)] for name, fn in rows_spec]
    rows.insert(2, ["resumed at step", *(_summary_cell(_resumed_text(run)) for run in runs)])
    put = [(g.line().removeprefix("goodput ") if (g := read_goodput(run.path)) is not None else "—") for run in runs]
    rows.append(["goodput", *map(_summary_cell, put)])
    return table(["", *head], rows, ["", *["num"] * len(runs)])
