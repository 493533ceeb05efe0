"""A torchrun rank's last line, kept where its agent reads it: the line a death record quotes (``last_line``).

stabletrain's supervisor reads its one child's output as it passes (``launch._Tee``); torchrun's agent does not read
its ranks' output, and a rank that exits with a code (a task's ``sys.exit(3)`` or ``os._exit(3)``) leaves no error file:
its restart's line said nothing of what it printed. Under stabletrain's launcher (:data:`~.launch.RUN_DIR_NOTE_ENV`) a
rank's ``sys.stdout`` and ``sys.stderr`` pass their text on unchanged and write each finished line (the part a ``\\r``
last drew) to a file beside the launcher's note, named by the rank's pid (:func:`last_line_file`; not beside its error
file, which torch names only where it exists), which :mod:`.elastic` reads for a rank that exited with a code and left
no message. No torch here.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["keep_last_line", "last_line_file", "printed_last"]

#: How a restarted rank starts its output (its restart's own line, its resume's): not the last line a death quotes.
ANNOUNCED = ("stabletrain: restart ", "stabletrain: resumed from ")


def last_line_file(note: str | Path, pid: int) -> Path:
    """Where the rank ``pid`` of a launch whose launcher's note is ``note`` keeps its last line (removed with the note:
    ``records.launches.drop_notes``)."""
    return Path(note).with_name(f"{Path(note).name}.line-{pid}")


class _Keeper:
    """A text stream that passes everything to ``stream`` and writes each finished line to ``path`` (shared by a rank's
    stdout and stderr: the last line either printed, as the supervisor's ``_Tee`` keeps it)."""

    def __init__(self, stream: Any, path: Path) -> None:
        self._stream, self._path, self._tail, self._kept = stream, path, "", False

    def write(self, text: str) -> int:
        written = self._stream.write(text)
        if "\n" not in text:
            self._tail = (self._tail + text)[-4096:]
            return written
        *done, self._tail = (self._tail + text).split("\n")
        self._tail = self._tail[-4096:]
        drawn = [line.rsplit("\r", 1)[-1] for line in done]  # (what a progress bar's last \r left on the line)
        lines = [line for line in drawn if line.strip() and not line.startswith(ANNOUNCED)]
        heads = [line for line in lines if line[:1] not in (" ", "\t", "(")]  # not a message's continuation
        if heads or lines and not self._kept:
            with contextlib.suppress(OSError):  # (a full disk: the line is only not kept)
                self._path.write_text((heads or lines)[-1].strip()[:4096], encoding="utf-8")
                self._kept = True
        return written

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def keep_last_line() -> None:
    """In a rank of stabletrain's torchrun launcher (torchrun's run id and :data:`~.launch.RUN_DIR_NOTE_ENV` set): keep
    the rank's last line (see the module docstring). Nothing elsewhere (the supervisor reads its child's output)."""
    from .launch import RUN_DIR_NOTE_ENV

    note = os.environ.get(RUN_DIR_NOTE_ENV)
    if not note or "TORCHELASTIC_RUN_ID" not in os.environ or isinstance(sys.stdout, _Keeper):
        return
    path = last_line_file(note, os.getpid())
    sys.stdout, sys.stderr = _Keeper(sys.stdout, path), _Keeper(sys.stderr, path)


def printed_last(note: str | Path | None, pid: int | None) -> str | None:
    """The last line the rank ``pid`` kept (:func:`keep_last_line`), clipped as a death record quotes one; None: none."""
    from .. import console

    try:
        text = last_line_file(note, pid).read_text(encoding="utf-8").strip() if note and pid else ""
    except OSError:
        return None
    return console.clipped(text) if text else None
