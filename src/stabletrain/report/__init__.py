"""Report and compare: see a run at a glance, and see what a config change did.

Reads only the run directory (DESIGN.md, principle 5). The pages are self-contained HTML (inline
CSS, plots embedded as PNG data URIs, no JavaScript, nothing fetched); each plot is also written as
a PNG file for people in a terminal.

    stabletrain.report.write_report("runs/gpt-1")            # runs/gpt-1/report.html, runs/gpt-1/plots/*.png
    stabletrain.report.write_compare(["runs/a", "runs/b"])   # runs/a/compare.html, runs/a/compare_plots/*.png
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# name -> the module that defines it, imported when the name is first asked for (PEP 562): reading a run
# (``report.rundata``, ``report.goodput``: the train command's last line) does not import matplotlib.
_EXPORTS: dict[str, str] = {
    "write_report": ".html", "render_report": ".html", "write_compare": ".compare", "config_diff": ".compare",
    "load_run": ".rundata", "RunData": ".rundata", "Event": ".rundata", "health_summary": ".health", "Health": ".health",
}

__all__ = ["write_report", "render_report", "write_compare", "config_diff", "load_run", "RunData", "Event",
           "health_summary", "Health"]

if TYPE_CHECKING:
    from .compare import config_diff, write_compare
    from .health import Health, health_summary
    from .html import render_report, write_report
    from .rundata import Event, RunData, load_run


def __getattr__(name: str) -> Any:
    """Import ``name`` from the module that defines it, the first time it is asked for."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
