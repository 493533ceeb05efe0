"""Keys that moved: an old name in a YAML file, an override or a saved run's config is read at its new place.

``guard`` once held the capture and the remedies too; it split by concern (``guard``: the sentinel, spikes,
stalls and skips; ``capture``: the incident snapshot, capture and diagnosis; ``remedy``: applying one by hand,
the search and its fallback). A config written before still loads: :func:`move_old_keys` moves each old key
to its new place and says so in one line.
"""

from __future__ import annotations

from typing import Any

from .values import ConfigError, section_at

__all__ = ["MOVED_KEYS", "move_old_keys"]

#: Old dotted key -> its new place.
MOVED_KEYS: dict[str, str] = {
    "remedy": "remedy.apply",  # a value then (INCIDENT_DIR:NAME or null), a section now: moved first
    "guard.capture": "capture.incidents",
    "guard.capture_spikes": "capture.spikes",
    "guard.max_spike_captures": "capture.max_spikes",
    "guard.memory_snapshot": "capture.memory_snapshot",
    "guard.snapshot_memory_fraction": "capture.snapshot_memory_fraction",
    "guard.diagnose": "capture.diagnose",
    "guard.remedy_steps": "remedy.steps",
    "guard.remedy_fallback": "remedy.fallback",
    "guard.max_remedies": "remedy.max_applied",
}


def _pop(data: dict[str, Any], parts: list[str]) -> tuple[bool, Any]:
    node = data
    for part in parts[:-1]:
        node = node.get(part)
        if not isinstance(node, dict):
            return False, None
    if parts[-1] not in node or (len(parts) == 1 and isinstance(node[parts[-1]], dict)):  # ``remedy``: a section now
        return False, None
    return True, node.pop(parts[-1])


def move_old_keys(data: dict[str, Any], source: str) -> str | None:
    """Move every old key of ``data`` (plain nested dicts, in place) to its new place; return one line naming them.

    None when there was none. A key set at both its old and its new place is a ConfigError naming both.
    ``source`` says where the config came from (``config file 'my.yaml'``), for the line and the error.
    """
    moved = []
    for old, new in MOVED_KEYS.items():
        found, value = _pop(data, old.split("."))
        if not found:
            continue
        *path, last = new.split(".")
        node = section_at(data, path, source)
        if last in node:
            raise ConfigError(f"{source}: config key '{old}' moved to '{new}', and both are set; keep '{new}'")
        node[last] = value
        moved.append(f"{old} -> {new}")
    if not moved:
        return None
    return f"{source}: read old config keys at their new places ({', '.join(moved)}); rename them to stop this line"
