"""``torch.save`` with one CRC32 of the whole file, taken as the bytes pass, instead of one per zip record.

A checkpoint's ``state.pt`` is checked by the CRC32 of every byte, recorded in meta.json and verified before a
load. ``torch.save`` also computes a CRC32 of each record of its zip: the same bytes checksummed twice. This
file leaves torch's out (:func:`stabletrain.internals.save_without_record_crcs`, for this one file; torch's
``set_crc32_options`` would switch it off for every save in the process): 5 ms less writer CPU per save of
the default gpt's 9.7 MiB state (docs/benchmarks.md). ``torch.load`` reads the file as any other (it does
not check those CRCs); ``tests/test_internals.py`` loads it with ``torch.load`` and checks the CRC32.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from ...internals import InternalMissing, save_without_record_crcs

__all__ = ["save_checksummed"]


class _ChecksumWriter:
    """A write-only file wrapper that takes the CRC32 of what passes through and counts it (torch.save writes to it).

    zlib releases the GIL while it checksums a chunk larger than a few KiB, as the file does while it writes.
    """

    def __init__(self, fh: Any) -> None:
        self.fh, self.crc, self.num_bytes = fh, 0, 0
        self.error: OSError | None = None  # what the file raised (torch's zip writer reports only a position mismatch)

    def write(self, data: Any) -> int:
        self.crc = zlib.crc32(data, self.crc)
        try:
            n = self.fh.write(data)
        except OSError as err:
            self.error = err
            raise
        self.num_bytes += n
        return n

    def flush(self) -> None:
        self.fh.flush()


def save_checksummed(state: Any, fh: Any) -> tuple[int, int]:
    """``torch.save(state)`` into the binary file ``fh``; return (zlib's CRC32 of the bytes written, their count).

    An OSError is the disk's own (ENOSPC, EIO, EFBIG), not torch's rewording of it. Where the installed torch
    lacks the writer without record CRCs, the file is ``torch.save``'s own, with them (5 ms more per 9.7 MiB).
    """
    writer = _ChecksumWriter(fh)
    try:
        try:
            save_without_record_crcs(state, writer)
        except InternalMissing:
            torch.save(state, writer)
    except Exception:
        if writer.error is not None:  # what the file raised: torch's zip writer reports only a position mismatch
            raise writer.error from None
        raise
    return writer.crc, writer.num_bytes
