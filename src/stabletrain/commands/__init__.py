"""The subcommands of ``stabletrain`` that need more than a few lines (:mod:`stabletrain.cli` parses and dispatches)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["incident_dir"]


def incident_dir(path: str | Path, *, newest: bool, command: str) -> Path:
    """Return the incident folder ``path`` names: itself (it holds a bundle), or a run directory's newest (``newest``)
    or first incident. Raises FileNotFoundError, in words, for a folder that does not exist and for a run without
    incidents; anything else is left to the replay, whose error says what the folder lacks."""
    from ..records.bundles import BUNDLE_FILE, incident_order

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{command} {str(path)!r}: it does not exist (give RUN_DIR or RUN_DIR/incidents/step_N)")
    if (path / BUNDLE_FILE).exists():
        return path
    found = sorted((path / "incidents").glob("step_*"), key=incident_order) if (path / "incidents").is_dir() else []
    live = [f for f in found if ".superseded-" not in f.name] or found  # not one a restart set aside, where others are
    if live:
        return live[-1] if newest else live[0]
    if any((path / name).exists() for name in ("events.jsonl", "metrics.jsonl", "config.yaml")):
        raise FileNotFoundError(f"{command} {str(path)!r}: the run has no incidents (no step was captured: no "
                                f"{path / 'incidents' / 'step_N'}), so there is nothing to {command}")
    return path
