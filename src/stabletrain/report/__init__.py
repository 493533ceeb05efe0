"""Report and compare: see a run at a glance, and see what a config change did.

Reads only the run directory (DESIGN.md, principle 5). The pages are self-contained HTML (inline
CSS, plots embedded as PNG data URIs, no JavaScript, nothing fetched); each plot is also written as
a PNG file for people in a terminal.

    stabletrain.report.write_report("runs/gpt-1")            # runs/gpt-1/report.html, runs/gpt-1/plots/*.png
    stabletrain.report.write_compare(["runs/a", "runs/b"])   # runs/a/compare.html, runs/a/compare_plots/*.png
"""

from .compare import config_diff, write_compare
from .health import Health, health_summary
from .html import render_report, write_report
from .rundata import Event, RunData, load_run

__all__ = [
    "write_report",
    "write_compare",
    "render_report",
    "load_run",
    "RunData",
    "Event",
    "health_summary",
    "Health",
    "config_diff",
]
