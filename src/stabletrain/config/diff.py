"""Comparing configs: flattening to dotted keys, the differences, and the keys that may change on resume.

:data:`RESUME_SAFE_KEYS` is the one list of the keys a resume may change: the help, the docs and the
resume refusal all print it from here.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import brief
from .loading import config_to_dict

__all__ = ["RESUME_SAFE_KEYS", "RESHARD_SAFE_KEYS", "resume_safe_text", "ABSENT", "ConfigDiff", "dotted_key",
           "flatten_config", "with_task_defaults", "diff_configs", "format_config_diff", "resume_refusal_message"]

#: Config keys (exact, ``fnmatch`` globs, or a section name) that may differ when a run is resumed:
#: they change neither the math nor the data of the steps still to come. The world size may change
#: (``dist.*``): the resume is then resharded, and :data:`RESHARD_SAFE_KEYS` may change as well.
RESUME_SAFE_KEYS: tuple[str, ...] = (
    "train.max_steps", "train.gc_freeze", "log.*", "ckpt.every", "ckpt.keep", "ckpt.max_failures", "eval.every", "run.*",
    "resume", "remedy.apply", "data.workers", "capture.*", "dist.*", "callbacks", "guard.precursor*", "guard.on_stall",
    "guard.stall_steps",
)


#: Keys that may also change on a resume under another world size (a resharded resume), so a run can keep
#: its global batch ``train.batch_size x accum.steps x world size`` (2 ranks x B -> 1 rank x B x accum 2).
RESHARD_SAFE_KEYS: tuple[str, ...] = ("train.batch_size", "accum.steps")


def resume_safe_text(keys: Sequence[str] = RESUME_SAFE_KEYS, *, code: bool = False) -> str:
    """Return the resume-safe keys as one line, "train.max_steps, log.*, ..." (``code``: each in Markdown backticks)."""
    return ", ".join(f"`{k}`" if code else k for k in keys)


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


#: The value of a key that one of two compared configs does not have.
ABSENT: Any = _Absent()


class ConfigDiff(NamedTuple):
    """One key whose value differs between two configs."""

    key: str  # dotted key
    saved: Any  # value in the checkpoint's (or first) config, or ABSENT
    current: Any  # value in this run's (or second) config, or ABSENT


def dotted_key(path: Sequence[str], prefix: str = "") -> str:
    """Return a key path (``stabletrain.internals.tree_flatten_with_keys``') as a dotted key: ``state.0.exp_avg``."""
    return ".".join([prefix, *path] if prefix else path)


def flatten_config(cfg: Any, *, keep_empty: bool = False) -> dict[str, Any]:
    """Return a Config (or nested plain dicts) as ``{"dotted.key": value}``, in declaration order.

    Only mappings are walked; a list is one value (a tuple becomes a list, as YAML would read it). An
    empty mapping contributes no key, unless ``keep_empty`` (for showing a config: ``task_args: {}``).
    """
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = config_to_dict(cfg)
    if not isinstance(cfg, dict):
        raise TypeError(f"flatten_config: expected a Config or a mapping, got {type(cfg).__name__}")
    flat: dict[str, Any] = {}

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and (value or not keep_empty):
                walk(value, dotted)
            else:
                flat[dotted] = list(value) if isinstance(value, tuple) else value

    walk(cfg, "")
    return flat


def with_task_defaults(cfg: Any, *, imports: bool = True) -> Any:
    """``cfg`` (a Config or plain dicts) with its task factory's defaults in ``task_args`` for the arguments it leaves
    out (:func:`~stabletrain.tasks.task_defaults`), as plain dicts: a key set to its default is the config that leaves it
    out. Unchanged where there is no task, or its factory's signature cannot be read (``imports=False``: or it would import
    a module not imported yet)."""
    from ..tasks import task_defaults

    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = config_to_dict(cfg)
    args = cfg.get("task_args") if isinstance(cfg, dict) else None
    if not isinstance(cfg, dict) or not isinstance(cfg.get("task"), str) or not isinstance(args or {}, dict):
        return cfg
    defaults = task_defaults(cfg["task"], imports=imports)
    return {**cfg, "task_args": {**defaults, **(args or {})}} if defaults else cfg


def diff_configs(saved: Any, current: Any, safe: Sequence[str] = RESUME_SAFE_KEYS) -> list[ConfigDiff]:
    """Return each dotted key whose value differs between two configs (Config objects or plain dicts).

    Keys matching a ``safe`` pattern (exact, ``fnmatch`` glob, or a section name) are ignored; pass
    ``safe=()`` to compare everything. A key present on one side only has ``ABSENT`` on the other.
    ``task_args`` are compared with each side's task factory's defaults filled in (:func:`with_task_defaults`): a key
    set to its default is no difference. Order: the saved config's keys, then new ones.
    """
    a, b = flatten_config(with_task_defaults(saved)), flatten_config(with_task_defaults(current))

    def is_safe(key: str) -> bool:
        return any(fnmatch.fnmatchcase(key, p) or key.startswith(p + ".") for p in safe)

    keys = list(a) + [k for k in b if k not in a]
    return [ConfigDiff(k, a.get(k, ABSENT), b.get(k, ABSENT)) for k in keys
            if not is_safe(k) and (k not in a or k not in b or a[k] != b[k])]


def _show(value: Any) -> str:
    return "(absent)" if value is ABSENT else json.dumps(value, default=brief)  # a tensor: its shape, not its values


def format_config_diff(diffs: Sequence[ConfigDiff]) -> str:
    """Return one line per differing key with both values (YAML-style), under a header; "" when none."""
    if not diffs:
        return ""
    width = max(len(d.key) for d in diffs)
    lines = [f"  {d.key:<{width}}  checkpoint: {_show(d.saved)}  now: {_show(d.current)}" for d in diffs]
    noun = "key differs" if len(diffs) == 1 else "keys differ"
    return f"{len(diffs)} config {noun} from the checkpoint's:\n" + "\n".join(lines)


def resume_refusal_message(run_dir: str | Path, diffs: Sequence[ConfigDiff]) -> str:
    """Return the one-line error for resuming ``run_dir`` with a config that differs in ``diffs`` (non-empty)."""
    listed = "; ".join(f"{d.key}: checkpoint {_show(d.saved)}, now {_show(d.current)}" for d in diffs)
    noun = "key differs" if len(diffs) == 1 else "keys differ"
    return (f"resume {str(run_dir)!r}: {len(diffs)} config {noun} from the checkpoint's ({listed}); only these keys may "
            f"change on resume: {resume_safe_text()}. Under another world size {resume_safe_text(RESHARD_SAFE_KEYS)} may "
            "change too. Resume without those changes, or start a new run (another run.dir)")
