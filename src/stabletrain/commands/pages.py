"""``stabletrain report`` and ``stabletrain compare``: the HTML pages of one run, or of runs side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

from .. import console
from .train import write_report

__all__ = ["cmd_report", "cmd_compare"]


def cmd_report(args: argparse.Namespace) -> int:
    run_dir = Path(args.run_dir)
    if not run_dir.exists():
        raise FileNotFoundError(f"run directory {str(run_dir)!r} does not exist")
    if not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists():
        raise FileNotFoundError(f"run directory {str(run_dir)!r}: no metrics.jsonl or config.yaml there; "
                                "is it a stabletrain run?")
    write_report(run_dir)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from ..report import write_compare

    for d in args.run_dirs:
        if not Path(d).exists():
            raise FileNotFoundError(f"run directory {d!r} does not exist")
        if not (Path(d) / "metrics.jsonl").exists():
            raise FileNotFoundError(f"run directory {d!r}: no metrics.jsonl there; is it a stabletrain run?")
    page = write_compare(args.run_dirs, args.out)
    console.say(f"comparison written to {page} (plots in {page.with_name(page.stem + '_plots')})")
    return 0
