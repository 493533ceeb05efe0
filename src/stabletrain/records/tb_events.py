"""TensorBoard's event file, written by hand: the one writer here of a format TensorBoard owns.

The file is TensorBoard's own (``events.out.tfevents.*``): its ``Event`` and ``Summary`` protos, from the
``tensorboard`` package, each framed as a TFRecord (length, masked CRC32C of the length, data, masked CRC32C
of the data). Why not TensorBoard's writer (or torch's ``SummaryWriter``): it hands each event to a thread
that computes the CRC32C in pure Python where TensorFlow is not installed, ~0.15 ms per interval's event
holding the GIL, which the training loop then waits for (docs/benchmarks.md: the mlp's overhead 1.33 ->
1.28x); here the CRC is google-crc32c's C code (0.4 us). ``tests/test_tb_events.py`` reads the files with
TensorBoard's own reader, CRCs included.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

__all__ = ["TensorBoardSink"]


class TensorBoardSink:
    """Write scalar metrics into a real TensorBoard event file in ``RUN_DIR/tb``, one event per interval.

    The file is what TensorBoard's own writer makes (see the module docstring), written from the calling thread,
    each event handed to the OS at once (one ``write``, a few us per interval, as ``metrics.jsonl``): a process
    killed after a log boundary loses none of its steps, so a checkpoint that a background save commits later
    never covers a step the file lacks (``SummaryWriter`` buffers up to 120 s, and a resume would purge and
    rewrite only the steps after the checkpoint).
    """

    def __init__(self, log_dir: Path, purge_step: int | None = None) -> None:
        """``purge_step``: on resume, TensorBoard drops the events at and after this step that an earlier
        process wrote (the steps after the checkpoint that a crash made the run train again)."""
        from tensorboard.compat.proto.event_pb2 import Event

        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        # (TensorBoard reads a directory's files in name order, a purge applying to the files before it: the counter
        # zero-padded, or a process's 10th file sorted before its 9th in the same second and a resume's purge was lost)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_TB_FILES):06d}"
        self.path = log_dir / name
        self._fh = open(self.path, "wb")  # noqa: SIM115 (closed by close())
        self._tags: dict[str, str] = {}
        self._write(Event(wall_time=time.time(), file_version="brain.Event:2"))
        if purge_step is not None:  # what SummaryWriter(purge_step=...) writes: TensorBoard purges from this step on
            self._write(Event(step=purge_step, file_version="brain.Event:2"))
            self.purge_from(purge_step)

    def purge_from(self, step: int) -> None:
        """TensorBoard drops the events at and after ``step`` written before this call (a session restart at that step):
        a resume's, and a rollback's (the steps after the checkpoint it went back to are trained again)."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self._write(Event(step=step, session_log=SessionLog(status=SessionLog.START)))

    def _tag(self, key: str) -> str:
        """The scalar's TensorBoard tag: ``train/KEY``, or ``val/KEY`` for validation figures (made once per key)."""
        tag = self._tags[key] = f"{'val' if key.startswith('val_') else 'train'}/{key}"
        return tag

    def _write(self, event: Any) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._fh.write(b"".join((header, struct.pack("<I", _masked_crc32c(header)), data,
                                 struct.pack("<I", _masked_crc32c(data)))))
        self._fh.flush()  # to the OS now (no fsync, as TensorBoard's writer)

    def write(self, record: dict[str, Any]) -> None:
        """One event holding every scalar of the interval (``add_scalar`` would write one event per value)."""
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        tags = self._tags
        values = [Summary.Value(tag=tags.get(key) or self._tag(key), simple_value=float(value))
                  for key, value in record.items()  # the Value add_scalar makes (simple_value), without its numpy trip
                  if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)]
        if values:
            self._write(Event(wall_time=time.time(), step=int(record["step"]), summary=Summary(value=values)))

    def close(self) -> None:
        if not self._fh.closed:
            self._fh.close()


_TB_FILES = itertools.count()  # event files this process opened (a part of each name, as TensorBoard's writer has)


def _masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC32C of ``data``."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
