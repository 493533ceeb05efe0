"""The subcommands of ``stabletrain``: each module builds its subcommand's parser (``add_NAME_parser``) next to
its handler (``cmd_NAME``); :mod:`stabletrain.cli` holds the top-level parser, the dispatch and the error handling.

A module here imports torch only inside its handler: building the parsers must not (``--help``, ``--version``).
"""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

from ..config import describe_keys

__all__ = ["incident_dir", "keys_help"]


def keys_help() -> str:
    """Return the config keys, their meaning and defaults: the epilog of the commands that take a config."""
    rows = describe_keys()
    width = max(len(k) for k, _, _ in rows)
    lines = ["config keys (set in --config YAML or as dotted key=value overrides):", ""]
    for key, default, help_text in rows:
        wrapped = textwrap.wrap(help_text, 100 - width - 4) or [""]
        lines.append(f"  {key:<{width}}  {wrapped[0]}")
        lines.extend(f"  {'':<{width}}  {w}" for w in wrapped[1:])
        lines.append(f"  {'':<{width}}  default: {default}{_choices(key)}")
    return "\n".join(lines)


def _choices(key: str) -> str:
    """' (one of: a, b, c)' for a key whose type lists its values (guard.on_spike), else ''."""
    import dataclasses
    import typing

    from ..config import Config
    from ..config.values import type_hints

    tp: typing.Any = Config
    for part in key.split("."):
        if not dataclasses.is_dataclass(tp):
            return ""
        tp = type_hints(tp).get(part)
    args = typing.get_args(tp) if typing.get_origin(tp) is not typing.Literal else (tp,)
    literals = [str(v) for arg in args for v in (typing.get_args(arg) if typing.get_origin(arg) is typing.Literal else ())]
    if not literals:
        return ""
    values = (["true", "false"] if bool in args else []) + literals + (["null"] if type(None) in args else [])
    return f" (one of: {', '.join(values)})"


def incident_dir(path: str | Path, *, newest: bool, command: str) -> Path:
    """Return the incident folder ``path`` names: itself (it holds a bundle), or a run directory's newest (``newest``)
    or first incident. Raises FileNotFoundError, in words, for a folder that does not exist and for a run without
    incidents; anything else is left to the replay, whose error says what the folder lacks."""
    from ..records.bundles import BUNDLE_FILE, incident_order

    path = Path(path)
    padded = re.fullmatch(r"step_(\d+)((?:\.\S+)?)", path.name)
    if not path.exists() and padded:  # "step_121", as the console says it: the folder is step_000121
        full = path.with_name(f"step_{int(padded[1]):06d}{padded[2]}")
        path = full if full.exists() else path
    if not path.exists():
        raise FileNotFoundError(f"{command} {str(path)!r}: it does not exist (give RUN_DIR or RUN_DIR/incidents/step_N)")
    if (path / BUNDLE_FILE).exists():
        if not (path.resolve().parent.parent / "metrics.jsonl").is_file():  # (moved out of RUN_DIR/incidents/)
            print(f"stabletrain: warning: {command}: {str(path)!r} is not in its run directory (no metrics.jsonl two "
                  "levels up): the spike rule judges the replays without the run's losses before the step, its bundle's "
                  "few alone, and may judge otherwise than in place", file=sys.stderr)
        return path
    found = sorted((path / "incidents").glob("step_*"), key=incident_order) if (path / "incidents").is_dir() else []
    live = [f for f in found if ".superseded-" not in f.name] or found  # not one a restart set aside, where others are
    if live:
        chosen = live[-1] if newest else live[0]
        if len(live) > 1:  # said, so that diagnose (the newest) and remedy (the first) on a run are not taken for one
            print(f"stabletrain: {command}: {path} holds {len(live)} incidents; this is the {'newest' if newest else 'first'}"
                  f", {chosen.name} (give {path / 'incidents' / live[0 if newest else -1].name} for the "
                  f"{'first' if newest else 'newest'})", file=sys.stderr)
        return chosen
    if any((path / name).exists() for name in ("events.jsonl", "metrics.jsonl", "config.yaml")):
        raise FileNotFoundError(f"{command} {str(path)!r}: the run has no incidents (no step was captured: no "
                                f"{path / 'incidents' / 'step_N'}), so there is nothing to {command}")
    return path
