"""Read what W&B wrote into a run's ``.wandb`` file, for the tests: what the trackers' tests check W&B got.

stabletrain itself never reads this file (W&B's own format; what W&B holds for a resume is in
``trackers.json``). wandb has no public reader of its local run files: ``wandb.Api`` asks the server. The
file (``DIR/wandb/offline-run-*-ID/run-ID.wandb``) is the log that ``wandb sync`` uploads: LevelDB's log
format (32 KiB blocks of records, each with a CRC-32 of its type and data) behind a 7-byte header ``:W&B``,
magic ``0xBEE1``, a version byte; each record is one of wandb's own protobuf messages,
``wandb.proto.wandb_internal_pb2.Record`` (history rows, config, summary, tags in the run record, saved
files). A header it does not know raises :class:`WandbFileError`; a truncated tail (a killed process) ends
the read. W&B buffers the file: it is written every 15 s and at ``run.finish()``, so a process killed with
SIGKILL leaves only what was written.
"""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["WandbFileError", "WandbRunFile", "read_run_file", "run_files"]

_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_IDENT, _MAGIC, _VERSIONS = b":W&B", 0xBEE1, (0, 1)
_BLOCK = 32768
_RECORD = struct.Struct("<IHB")  # crc32, length, type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


class WandbFileError(ValueError):
    """A ``.wandb`` file this reader does not understand (another header or version, a bad checksum)."""


@dataclass
class WandbRunFile:
    """What one ``.wandb`` file holds: history rows (``_step`` and the logged values), config, summary, tags, files."""

    path: Path
    run_id: str = ""
    history: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    tags: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    finished: bool = False  # the run's exit record is there (run.finish() ran)

    def steps(self, key: str | None = None) -> list[int]:
        """The ``_step`` of every history row (that holds ``key``), in file order."""
        return [int(row["_step"]) for row in self.history if key is None or key in row]


def run_files(base: str | Path, run_id: str) -> list[Path]:
    """The ``.wandb`` files of run ``run_id`` under ``base/wandb`` (one per process that wrote it), oldest first.

    Each process's folder is ``[offline-]run-YYYYMMDD_HHMMSS-ID``, with ``-N`` after it when two start in one second.
    """
    pattern = re.compile(rf"(\d{{8}}_\d{{6}})-{re.escape(run_id)}(?:-(\d+))?")
    found = []
    for path in Path(base).glob(f"wandb/*{run_id}*/run-{run_id}.wandb"):
        match = pattern.search(path.parent.name)
        if match:
            found.append(((match.group(1), int(match.group(2) or 0)), path))
    return [path for _, path in sorted(found)]


def _payloads(data: bytes, path: Path) -> Iterator[bytes]:
    if len(data) < _HEADER.size:
        return
    ident, magic, version = _HEADER.unpack_from(data)
    if ident != _IDENT or magic != _MAGIC or version not in _VERSIONS:
        raise WandbFileError(f"{path}: not a W&B run file this reader knows (header {ident!r}, magic {magic:#x}, "
                             f"version {version})")
    pos, pending = _HEADER.size, b""
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _RECORD.size:  # a block's trailer: zero bytes
            pos += left
            continue
        if pos + _RECORD.size > len(data):
            return
        crc, length, kind = _RECORD.unpack_from(data, pos)
        if crc == length == kind == 0:  # zero padding up to the block's end
            pos += left
            continue
        chunk = data[pos + _RECORD.size:pos + _RECORD.size + length]
        if len(chunk) < length:
            return  # a truncated tail: what a killed process left
        if zlib.crc32(bytes([kind]) + chunk) != crc:
            raise WandbFileError(f"{path}: record at byte {pos} fails its checksum")
        pos += _RECORD.size + length
        if kind == _FULL:
            yield chunk
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield pending + chunk
            pending = b""
        else:
            raise WandbFileError(f"{path}: record type {kind} at byte {pos} is not LevelDB's")


def _value(item: Any) -> tuple[str, Any]:
    key = item.key or "/".join(item.nested_key)
    return key, json.loads(item.value_json)


def read_run_file(path: str | Path) -> WandbRunFile:
    """Read one ``.wandb`` file (see the module docstring); raise :class:`WandbFileError` on a format it does not know."""
    from wandb.proto import wandb_internal_pb2

    path = Path(path)
    out = WandbRunFile(path)
    for payload in _payloads(path.read_bytes(), path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = dict(_value(item) for item in record.history.item)
            row.setdefault("_step", record.history.step.num)
            out.history.append(row)
        elif kind == "run":
            out.run_id = record.run.run_id
            out.tags = list(record.run.tags)
            out.config.update(_value(item) for item in record.run.config.update)
        elif kind == "config":
            out.config.update(_value(item) for item in record.config.update)
        elif kind == "summary":
            out.summary.update(_value(item) for item in record.summary.update)
        elif kind == "files":
            out.files.extend(f.path for f in record.files.files)
        elif kind == "exit":
            out.finished = True
    out.config.pop("_wandb", None)
    return out
