"""``stabletrain report`` and ``stabletrain compare``: the HTML pages of one run, or of runs side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import console
from .train import write_report

__all__ = ["cmd_report", "add_report_parser", "cmd_compare", "add_compare_parser"]


def add_report_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="write RUN_DIR/report.html from a run directory",
                       description="Write RUN_DIR/report.html, one self-contained page (no network): a health "
                                   "summary, the curves (loss, grad norm, clip rate, LR, loss scale, throughput, "
                                   "memory), the events (skips, clips, spikes, incidents, checkpoints, resumes), "
                                   "the layers dominating the grad norm, the config and the snapshot; and each "
                                   "plot as RUN_DIR/plots/NAME.png. Reads only the run directory's files (it works "
                                   "on a run in progress too); prints the health summary.")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--out", metavar="DIR|FILE.html",
                   help="write the page elsewhere (a run directory that cannot be written): a directory (the page is "
                        "DIR/report.html) or an .html file; its plots go in PAGE_STEM_plots/ next to it")


def _run_dir(given: str | Path, *, config_enough: bool = True) -> Path:
    """``given`` as a run directory, or one line that says what it is instead (missing, a file of a run, not a run)."""
    run_dir = Path(given)
    if not run_dir.exists():
        raise FileNotFoundError(f"run directory {str(given)!r} does not exist")
    if run_dir.is_file():  # metrics.jsonl, report.html: a file of the run
        parent = run_dir.parent
        of_run = (parent / "metrics.jsonl").exists() or (parent / "config.yaml").exists()
        raise FileNotFoundError(f"run directory {str(given)!r} is a file" + (
            f" of the run: give its directory, {str(parent)!r}" if of_run else ", not a run directory"))
    if not (run_dir / "metrics.jsonl").exists() and not (config_enough and (run_dir / "config.yaml").exists()):
        there = "metrics.jsonl or config.yaml" if config_enough else "metrics.jsonl"
        raise FileNotFoundError(f"run directory {str(given)!r}: no {there} there; is it a stabletrain run?")
    return run_dir


def cmd_report(args: argparse.Namespace) -> int:
    from ..report.html import ReportNotWritten

    run_dir = _run_dir(args.run_dir)
    try:
        write_report(run_dir, args.out)
    except ReportNotWritten as err:  # (the run read, its page not written: the summary still printed)
        if args.out is not None:
            raise
        from ..report import health_summary, load_run

        print(health_summary(load_run(run_dir)).text)
        raise ReportNotWritten(f"{err}; the health summary is above; give --out DIR for the page") from err
    return 0


def add_compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="compare runs: config differences and overlaid curves",
                       description="Write one self-contained HTML page comparing two or more runs: the config "
                                   "keys that differ, the code, libraries, device and data that differ, a "
                                   "summary per run, and the curves (loss, val loss, grad norm, clip rate, LR, "
                                   "...) overlaid by step and by tokens (or samples) seen; each plot is also "
                                   "written as PAGE_STEM_plots/METRIC.png next to the page. Writes nothing to "
                                   "the current directory unless --out says so.")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", metavar="DIR|FILE.html",
                   help="a directory (the page is DIR/compare.html) or an .html file (default: the first run's "
                        "directory, RUN_DIR/compare.html: the first run is the baseline)")


def cmd_compare(args: argparse.Namespace) -> int:
    from ..report import write_compare

    for d in args.run_dirs:
        _run_dir(d, config_enough=False)
    said: list[str] = []
    page = write_compare(args.run_dirs, args.out, said=said)
    for line in said:
        print(line)
    console.say(f"comparison written to {page} (plots in {page.with_name(page.stem + '_plots')})")
    return 0
