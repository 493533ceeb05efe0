"""JSON lines: the format of a run's metrics and events (one object per line, NaN and Inf spelled as strings)."""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import numbers
import sys
from pathlib import Path, PurePath
from typing import Any

from ..fileio import atomic_write

__all__ = ["JsonlWriter", "json_safe", "revive", "write_json", "read_jsonl", "line_start"]


def json_safe(value: Any) -> Any:
    """``value`` as JSON and YAML can hold it: non-finite floats (nested too) as "nan", "inf", "-inf".

    Also a one-element tensor as a float, an enum as its value (e.g. HF's SchedulerType, a str subclass YAML
    cannot write), a dataclass as a dict, a tuple as a list, a key as a string; anything else by its repr.
    """
    if isinstance(value, enum.Enum):
        return json_safe(value.value)
    if isinstance(value, (bool, int, str)) or value is None:
        return type(value)(value) if value is not None else None
    if isinstance(value, numbers.Integral):  # numpy's too
        return int(value)
    if isinstance(value, numbers.Real):
        value = float(value)
        return value if math.isfinite(value) else str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json_safe(dataclasses.asdict(value))
    if isinstance(value, PurePath):
        return str(value)
    torch = sys.modules.get("torch")  # a tensor comes only once torch is imported (not imported here: no cost)
    if torch is not None and isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return repr(value)


_SPELLED = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def revive(value: Any, key: str = "") -> Any:
    """``value`` read back from what :func:`json_safe` wrote: "nan", "inf" and "-inf" (nested too) as floats again, but
    under a key that names a kind (a diagnosis's ``kind``: the string "nan" or "inf", what kind of value went bad)."""
    if isinstance(value, str):
        return value if key == "kind" or key.endswith("_kind") else _SPELLED.get(value, value)
    if isinstance(value, dict):
        return {k: revive(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [revive(v, key) for v in value]
    return value


def write_json(path: Path, value: Any) -> None:
    """Write ``value`` to ``path`` atomically as strict JSON (NaN and Inf spelled as strings: jq and browsers read it)."""
    atomic_write(path, json.dumps(json_safe(value), indent=2, allow_nan=False) + "\n")


class JsonlWriter:
    """Append JSON lines to a file, flushed after each line so a reader sees a run in progress.

    A file whose last line was torn (a process killed mid-write, a full disk) gets its line ended first: the torn
    line stays one malformed line (:func:`read_jsonl` names it), and the next record is not glued onto it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = open(path, "a", encoding="utf-8")
        if _torn(path):
            self._fh.write("\n")
            self._fh.flush()  # (before another process appends to it: a peer's crash event)

    def write(self, record: dict[str, Any]) -> None:
        try:  # the common record is all finite: the C encoder as it is; else NaN/Inf spelled as strings
            line = json.dumps(record, allow_nan=False)
        except ValueError:
            line = json.dumps(json_safe(record))
        self._fh.write(line + "\n")
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()


def line_start(path: Path) -> str:
    """What to write before appending to ``path``: a newline where its last line was torn, else nothing."""
    return "\n" if _torn(path) else ""


def _torn(path: Path) -> bool:
    """Whether ``path`` ends inside a line (not empty, its last byte no newline)."""
    try:
        with open(path, "rb") as fh:
            if fh.seek(0, 2) == 0:
                return False
            fh.seek(-1, 2)
            return fh.read(1) != b"\n"
    except OSError:
        return False


def read_jsonl(path: str | Path) -> tuple[list[dict[str, Any]], list[str]]:
    """Return (records, problems) of a JSON-lines file; a malformed line is a problem naming file and line."""
    records, problems = [], []
    path = Path(path)
    if not path.exists():
        return records, problems
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                problems.append(f"{path}:{lineno}: malformed JSON ({err.msg})")
                continue
            if not isinstance(rec, dict):
                problems.append(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
                continue
            records.append(rec)
    return records, problems
