"""Which frames of a stack a replay reports: the user's, not stabletrain's (the replay machinery), torch's or the stdlib's.

A third-party model library's frames (site-packages) stay: a NaN in a Hugging Face model's attention is
worth seeing. The frames above the outermost stabletrain frame are a script calling stabletrain
(``fit()``, ``diagnose_step``): where the call came from, not the code that made the value.
"""

from __future__ import annotations

import os
import sysconfig
import traceback

import torch

__all__ = ["user_stack", "keep_user_entries"]

_TORCH_DIR = os.path.join(os.path.dirname(os.path.realpath(torch.__file__)), "")
_PACKAGE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "")  # stabletrain/
_STDLIB_DIR = os.path.join(os.path.realpath(sysconfig.get_paths()["stdlib"]), "")
_SITE_DIRS = tuple({os.path.join(os.path.realpath(sysconfig.get_paths()[k]), "") for k in ("purelib", "platlib")})


#: stabletrain's own models (the built-in tasks, the labs): their code is where a value is made, as a user's would be.
_MODEL_DIRS = tuple(os.path.join(_PACKAGE_DIR, d, "") for d in ("tasks", "lab"))


def _is_ours(filename: str) -> bool:
    path = os.path.realpath(filename)
    return path.startswith(_PACKAGE_DIR) and not path.startswith(_MODEL_DIRS)


def _is_user_frame(filename: str) -> bool:
    """Whether a frame's file is the user's: not stabletrain (but for its own models: the built-in tasks, the labs),
    torch, the stdlib or a frozen module. (A lab's model had no frame of its own: the console script was named.)"""
    if filename.startswith("<frozen"):
        return False
    path = os.path.realpath(filename)
    if path.startswith(_MODEL_DIRS):
        return True
    if path.startswith(_PACKAGE_DIR) or path.startswith(_TORCH_DIR):
        return False
    return not path.startswith(_STDLIB_DIR) or path.startswith(_SITE_DIRS)


def _user_indices(filenames: list[str]) -> list[int]:
    """The positions (outermost first) of the user's frames below the outermost stabletrain frame.

    The frames above it are a script calling stabletrain (``fit()``, ``diagnose_step``): where the call came
    from, not the code that made the value. Without a stabletrain frame above the user's innermost one
    (a locator used directly around the user's code) every user frame is kept.
    """
    users = [i for i, f in enumerate(filenames) if _is_user_frame(f)]
    if not users:
        return []
    start = next((i for i, f in enumerate(filenames[:users[-1]]) if _is_ours(f)), 0)
    return [i for i in users if i >= start]


def user_stack(limit: int = 12) -> str:
    """Return the user's part of the current Python stack (see :func:`_user_indices`; most recent last)."""
    frames = traceback.extract_stack()
    kept = [frames[i] for i in _user_indices([f.filename for f in frames])]
    return "".join(traceback.format_list(kept[-limit:]))


def keep_user_entries(entries: list[str], limit: int = 12) -> str:
    """Keep the user's entries of a formatted stack (``'  File "x.py", line 3, in f\\n    code\\n'`` each)."""
    heads = [entry.strip().split('"') for entry in entries]
    names = [head[1] if len(head) >= 2 else "<frozen unknown>" for head in heads]
    kept = [entries[i] for i in _user_indices(names)]
    return "".join(e if e.endswith("\n") else e + "\n" for e in kept[-limit:])
