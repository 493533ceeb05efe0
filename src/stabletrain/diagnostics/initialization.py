"""Initialization, checked: a fingerprint that catches an init being overwritten before the first step.

``InitFingerprint`` is a cheap fingerprint of every parameter (std and a hash of its bytes), taken
right after the user's init and compared again before the first step: it names every parameter
whose values changed in between (a ``reset_parameters()`` call, a meta-device ``to_empty`` +
``reset_parameters`` path or a wrapper that re-creates the modules; pytorch #104187, #90465). The init
schemes themselves (``init_``) are :mod:`stabletrain.tasks.init_schemes`.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ParamFingerprint", "InitChange", "InitFingerprint"]


# -- the fingerprint ---------------------------------------------------------------------------------

# Prefixes that wrappers put in front of parameter names (DDP, torch.compile, FSDP1, checkpoint wrappers).
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def _strip_wrappers(name: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in _WRAPPER_PREFIXES:
            if name.startswith(prefix):
                name, changed = name[len(prefix):], True
        name = name.replace("._fsdp_wrapped_module.", ".").replace("._checkpoint_wrapped_module.", ".")
    return name


@dataclass(frozen=True)
class ParamFingerprint:
    """One parameter's fingerprint: shape, dtype, std and a 64-bit BLAKE2 hash of its bytes."""

    shape: tuple[int, ...]
    dtype: str
    std: float
    digest: str


@dataclass
class InitChange:
    """A parameter whose values differ from its fingerprint: its name, old and new std and why."""

    name: str
    old_std: float | None
    new_std: float | None
    why: str  # values changed | shape changed | dtype changed | missing | new

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "old_std": self.old_std, "new_std": self.new_std, "why": self.why}


def _fingerprints(model: nn.Module) -> tuple[dict[str, ParamFingerprint], list[str]]:
    named = [(n, p) for n, p in model.named_parameters() if p.device.type != "meta"]
    skipped = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if not named:
        return {}, skipped
    # All stds in one host sync; an empty or one-element parameter has std 0.
    stds = torch.stack([p.detach().double().std() if p.numel() > 1 else p.new_zeros((), dtype=torch.float64)
                        for _, p in named]).cpu().tolist()
    out = {}
    for (name, p), std in zip(named, stds):
        raw = p.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy()  # once per run: a copy is fine
        digest = hashlib.blake2b(raw.tobytes(), digest_size=8).hexdigest()
        out[_strip_wrappers(name)] = ParamFingerprint(tuple(p.shape), str(p.dtype).replace("torch.", ""), std, digest)
    return out, skipped


class InitFingerprint:
    """The std and hash of every parameter, to check that nothing re-initializes the model unseen.

    Take it right after the model is built (``InitFingerprint.take(model)``) and ``compare(model)``
    before the first optimizer step. Names are matched after dropping the prefixes wrappers add
    (``module.``, ``_orig_mod.``, ``_fsdp_wrapped_module.``), so wrapping the model is not a change;
    moving it to another device is not a change either (the bytes are the same). Parameters on the
    meta device have no values and are left out (listed in ``skipped``). Each call forces one
    host-device sync and copies every parameter to the host once to hash it.
    """

    def __init__(self, params: dict[str, ParamFingerprint], skipped: list[str] | None = None) -> None:
        self.params = params
        self.skipped = list(skipped or [])

    @classmethod
    def take(cls, model: nn.Module) -> InitFingerprint:
        """Return the fingerprint of every parameter of ``model`` (tied parameters once)."""
        return cls(*_fingerprints(model))

    def compare(self, model: nn.Module, std_rtol: float = 1e-2) -> list[InitChange]:
        """Return every parameter of ``model`` whose values differ from this fingerprint (empty: none).

        A parameter whose dtype changed (the model was cast) can only be compared by its std: it is
        reported when its std moved by more than ``std_rtol`` (relative).
        """
        now, _ = _fingerprints(model)
        changes = []
        for name, old in self.params.items():
            new = now.get(name)
            if new is None:
                changes.append(InitChange(name, old.std, None, "missing"))
            elif new.shape != old.shape:
                changes.append(InitChange(name, old.std, new.std, "shape changed"))
            elif new.dtype != old.dtype:
                if abs(new.std - old.std) > std_rtol * max(abs(old.std), 1e-12):
                    changes.append(InitChange(name, old.std, new.std, "dtype changed"))
            elif new.digest != old.digest:
                changes.append(InitChange(name, old.std, new.std, "values changed"))
        changes += [InitChange(name, None, new.std, "new") for name, new in now.items() if name not in self.params]
        return changes

    @staticmethod
    def describe(changes: list[InitChange], limit: int = 5) -> str:
        """Return a one-line reason for an ``init_overwritten`` event ('' when nothing changed)."""
        if not changes:
            return ""

        def one(c: InitChange) -> str:
            old = "-" if c.old_std is None else f"{c.old_std:.4g}"
            new = "-" if c.new_std is None else f"{c.new_std:.4g}"
            return f"{c.name} (std {old} -> {new}, {c.why})"

        shown = ", ".join(one(c) for c in changes[:limit])
        more = f" and {len(changes) - limit} more" if len(changes) > limit else ""
        return (f"{len(changes)} parameter(s) changed between the model's init and the first step: {shown}{more}; "
                "something re-initialized them (a reset_parameters() call, to_empty() on a meta-device model, "
                "or a wrapper that rebuilds modules): initialize after that, or not before it")

    def state_dict(self) -> dict[str, Any]:
        return {"params": {n: asdict(f) for n, f in self.params.items()}, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.params = {n: ParamFingerprint(tuple(f["shape"]), f["dtype"], f["std"], f["digest"])
                       for n, f in state["params"].items()}
        self.skipped = list(state["skipped"])
