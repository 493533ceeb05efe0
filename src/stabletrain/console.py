"""What stabletrain says to a person: each message one line of its own, never glued to a progress bar.

Every ``stabletrain: ...`` line the built-in loop and the CLI print goes through :func:`say` (and
:func:`warn`, :func:`error`): it starts on a line of its own and is flushed at once, so the lines of
stdout and stderr stay in order in a combined log and ``grep '^stabletrain:'`` finds every one. While
the progress bar is drawn (on a terminal: :func:`show_bar`), a message clears it, is written, and the bar
is drawn again under it (tqdm's ``external_write_mode``).

Warnings: the library raises its own as :class:`StableTrainWarning` (``warnings.warn``: a caller of the
Python API can catch or filter them); the CLI alone shows them as one line ``stabletrain: warning: ...``
(:func:`one_line_warnings`, installed by :func:`stabletrain.cli.main` only: the library never changes how
a process shows warnings). What the loop reports about the run itself (an incident, a resume, a
checkpoint that failed or was skipped) is printed with :func:`say` / :func:`warn`, from the CLI and the
Python API alike.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sys
import warnings
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

__all__ = ["say", "some_of", "warn", "error", "write_line", "show_bar", "is_interactive", "one_line_warnings", "each_once",
           "StableTrainWarning", "PREFIX", "user_stacklevel", "clipped", "brief"]

PREFIX = "stabletrain: "

_bar: Any = None  # the tqdm bar being drawn (ProgressBar), which a message must not land inside
_said: set[str] | None = None  # inside each_once(): the lines said so far, each said once


class StableTrainWarning(UserWarning):
    """A warning from stabletrain meant for the person running it (the CLI shows it as one line)."""


#: The libraries between a user's line and stabletrain's adapters (a host trainer, torch): not the user's frames.
HOST_PACKAGES = ("lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate", "torch")


def user_stacklevel() -> int:
    """The ``stacklevel`` that makes a ``warnings.warn`` in the caller point at the first frame outside stabletrain and
    the host libraries (:data:`HOST_PACKAGES`): the user's own line that called into it (``monitor.step()``,
    ``trainer.fit(...)``), not stabletrain's file where the warning is made nor Lightning's that called the callback."""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    frame, level = inspect.currentframe(), 0
    frame = frame.f_back if frame is not None else None  # the caller: stacklevel 1
    while frame is not None:
        level += 1
        root = str(frame.f_globals.get("__name__", "")).partition(".")[0]
        if not os.path.abspath(frame.f_code.co_filename).startswith(package) and root not in HOST_PACKAGES:
            return level
        frame = frame.f_back
    return 1


def write_line(text: str, file: TextIO | None = None) -> None:
    """Write ``text`` and a newline to ``file`` (default: stdout), flushed, above the progress bar if one is drawn."""
    stream = file if file is not None else sys.stdout
    if _bar is None or getattr(_bar, "disable", False):  # (none, or closed: tqdm disables a bar it closes)
        print(text, file=stream, flush=True)
    elif is_interactive(getattr(_bar, "fp", None) or sys.stderr):
        with _bar.external_write_mode(file=stream):
            print(text, file=stream, flush=True)
    else:  # a host's bar drawn into a log (carriage returns, no newline): the line starts after it, not inside it
        print("\n" + text, file=stream, flush=True)


def say(message: str, file: TextIO | None = None) -> None:
    """Print ``stabletrain: message`` on a line of its own (default: stdout); inside :func:`each_once`, once."""
    if _said is not None:
        if message in _said:
            return
        _said.add(message)
    write_line(PREFIX + message, file)


@contextlib.contextmanager
def each_once() -> Iterator[None]:
    """Say each line once while inside (the doctor's checks train the same task several times: a run's line about the
    task, e.g. an init its forward overwrites, came once per run)."""
    global _said
    outer, _said = _said, set() if _said is None else _said
    try:
        yield
    finally:
        _said = outer


def warn(message: str) -> None:
    """Print ``stabletrain: warning: message`` on a line of its own, on stderr."""
    say(f"warning: {message}", sys.stderr)


def error(message: str) -> None:
    """Print ``stabletrain: error: message`` on stderr (the message may go on over more lines: a user's frames)."""
    say(f"error: {message}", sys.stderr)


def show_bar(bar: Any) -> None:
    """Say that ``bar`` (a tqdm bar: ours, or a host's) is being drawn, or that none is (None): messages are written
    above it (on a terminal), or after a newline that ends its pending redraws (a host's bar in a log file)."""
    global _bar
    _bar = bar


def is_interactive(stream: TextIO | None = None) -> bool:
    """Whether ``stream`` (default: stderr, where the bar goes) is shown live: a terminal or a Jupyter kernel's output.

    Anything else (a file, a pipe, CI, ``nohup``, Slurm, ``torchrun``'s captured logs) keeps every byte,
    so a bar's carriage-return redraws would pile up there: it gets plain lines instead.
    """
    stream = stream if stream is not None else sys.stderr
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False
    return type(stream).__module__.startswith("ipykernel")


@contextlib.contextmanager
def one_line_warnings() -> Iterator[None]:
    """While the block runs, show each :class:`StableTrainWarning` as ``stabletrain: warning: ...`` (one line, stderr).

    Other warnings are shown as Python shows them. For the CLI's entry point: it replaces
    ``warnings.showwarning`` for the block and puts it back after. Under torchrun a rank other than 0 shows only the
    ones that name it ("rank 1: ..."): every rank meets the same config's warnings, and rank 0 says them once.
    """
    original = warnings.showwarning
    rank = os.environ.get("RANK")

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int,
             file: TextIO | None = None, line: str | None = None) -> None:
        if issubclass(category, StableTrainWarning):
            text = " ".join(str(message).split())
            if rank in (None, "", "0") or re.search(rf"\brank {rank}\b", text):
                warn(text)
        else:
            original(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = original


def some_of(names: Sequence[str], shown: int = 3) -> str:
    """``a, b, c and 4 more``: the first ``shown`` of ``names`` and how many are left out."""
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def clipped(line: str, width: int = 300) -> str:
    """``line`` kept from its start (where a message names itself), cut at ``width`` characters with a marked end (a dead
    process's last line in a restart's record)."""
    return line if len(line) <= width else line[:width - 3].rstrip() + "..."


def brief(text: str, width: int = 320, more: str = "") -> str:
    """``text``'s '; '-separated clauses (outside parentheses) from the first while they fit in ``width`` characters, and
    its last (a verdict: "reproduces on replay"), the ones left out marked ``; ... more`` (an incident's console line: its
    whole evidence stays in diagnosis.json; a spike's ran to 550 characters). ``more`` (a path) is not counted."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth = max(0, depth + (ch == "(") - (ch == ")"))  # (a stray ")": an enumeration's "1)" turns no splitting off)
        if depth == 0 and text.startswith("; ", i):
            parts.append(text[start:i])
            start = i + 2
    parts.append(text[start:])
    if len(text) <= width or len(parts) < 3:
        return text
    middle = range(1, len(parts) - 1)

    def join(keep: list[int], marker: str = "...") -> str:  # the clauses kept, in order; a mark at each gap, the first
        out, marked = [parts[0]], False
        for i in middle:
            if i in keep:
                out.append(parts[i])
            elif i - 1 in keep:  # (a gap's first clause)
                out.append("..." if marked else marker)
                marked = True
        return "; ".join(out + [parts[-1]])

    # A caveat ("but ...": what the verdict may be wrong about) is kept before the clauses that lead up to it
    kept = [0] + [i for i in middle if parts[i].startswith("but ") and len(join([0, i])) <= width][:1]
    for i in middle:
        if i in kept:
            continue
        if len(join(kept + [i])) > width:
            break
        kept.append(i)
    return join(kept, f"... {more}".rstrip())
