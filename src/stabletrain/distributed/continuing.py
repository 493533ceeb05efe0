"""How a run that stopped goes on: the end of a launcher's line that says where a resume starts (LAST_GOOD's step) or
that nothing was written to resume from. No torch: the launcher and the supervisor read the run directory's files."""

from __future__ import annotations

from pathlib import Path

__all__ = ["continue_line", "from_last_good"]


def continue_line(run_dir: Path) -> str:
    """How to go on from ``run_dir``: resume it (from LAST_GOOD, or the newest checkpoint that verifies: one written
    without LAST_GOOD moved to it counts), or, with no checkpoint written, start it over."""
    folder = run_dir / "checkpoints"
    if (folder / "LAST_GOOD").is_file() or folder.is_dir() and any(d.name[5:].isdigit() for d in folder.glob("step_*")):
        return f"; continue the run{from_last_good(run_dir)}: stabletrain train --resume {run_dir}"
    return f"; no checkpoint of it was written: start it over (the same command with run.overwrite=true, run.dir={run_dir})"


def from_last_good(run_dir: Path) -> str:
    """" from step 400 (LAST_GOOD)": where a resume of ``run_dir`` starts, as LAST_GOOD names it ("" where it names none)."""
    try:
        name = (run_dir / "checkpoints" / "LAST_GOOD").read_text(encoding="utf-8").strip()
    except OSError:
        return ""
    return f" from step {int(name[5:])} (LAST_GOOD)" if name.startswith("step_") and name[5:].isdigit() else ""
