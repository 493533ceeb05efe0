"""Atomic, durable file writes: a reader sees the old file or the new one, never half of one.

One helper for every file stabletrain replaces in place (checkpoint files and ``LAST_GOOD``, the run
directory's config and snapshot, incident bundles, report pages)::

    write PATH.tmp-<pid> in the same directory     # same filesystem, so the rename is atomic
    flush, fsync                                    # the bytes are on disk before the name points at them
    os.replace(PATH.tmp-<pid>, PATH)
    fsync the directory                             # the rename itself survives a power cut

A writer that raises leaves ``PATH`` as it was and removes its temporary file. A process killed
mid-write leaves ``PATH.tmp-<pid>`` behind (the checkpoint manager cleans up such debris).
"""

from __future__ import annotations

import errno
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_write", "fsync_dir", "check_folder"]


def fsync_dir(path: str | Path) -> None:
    """Make a rename or a new entry in directory ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # filesystems that cannot sync a directory
            raise
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str | Callable[[IO[bytes]], Any], *, fsync: bool = True) -> Path:
    """Replace ``path`` with ``data`` atomically; return the path.

    ``data``: bytes, a str (written as UTF-8), or a function that writes to the binary file handle it
    is given (e.g. ``lambda fh: torch.save(state, fh)``). ``fsync=False`` skips both fsyncs: still
    atomic for readers, but not durable across a power cut (fine for a report page). The parent
    directory must exist. On any error the temporary file is removed, ``path`` is untouched, and the
    error is raised.
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:  # "wb", not "xb": a dead process with our pid may have left this name
            if callable(data):
                data(fh)
            else:
                fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)
    return path


def check_folder(path: str | Path, what: str = "--out") -> Path:
    """``path`` as a folder to write into: it, or its nearest existing parent, must be a folder. Raises ValueError
    naming ``what`` and the file in the way (a file given as --out: a traceback, NotADirectoryError, or a check that
    'raised FileExistsError')."""
    path = Path(path)
    at = path
    while not at.exists() and at != at.parent:
        at = at.parent
    if at.exists() and not at.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {str(at)!r} is a file, not a folder; give a folder (or a new path)")
    if at.is_dir() and at != path:  # a folder to be made there: tried (and taken back) now, not when a check first writes
        try:
            probe = tempfile.mkdtemp(prefix=".stabletrain-probe-", dir=at)
        except OSError as err:
            raise ValueError(f"{what} {str(path)!r} cannot be created in {str(at)!r}: {err.strerror or err}") from None
        try:
            os.rmdir(probe)
        except OSError:  # (a folder was made: the path can be; one that cannot go again stays, named)
            warnings.warn(f"{what}: the probe folder {probe} could not be removed", stacklevel=2)
    return path

