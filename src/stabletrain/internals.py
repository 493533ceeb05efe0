"""Every reach into a private internal of torch, of the host trainers and of Python: in one module, each checked.

stabletrain needs a few things no public API gives without a host-device sync or without changing what
the host computes. Each reach is one function here; each checks that the internal exists (and has the
shape relied on) and otherwise raises :class:`InternalMissing`, one line naming the library, its
version and what to do. ``tests/test_internals.py`` exercises every one of them against the installed
versions, so an upgrade that removes one fails there, not in a user's run.

=====================================  ==================================================================
reach                                  why there is no public way
=====================================  ==================================================================
``GradScaler._scale``                  the scale as a device tensor (``get_scale()`` reads it on the host)
``GradScaler._growth_tracker``         kept and put back with the scale, so a replay restores the scaler
                                       exactly (``state_dict()`` reads both on the host)
``GradScaler._per_optimizer_states``   the inf check ``unscale_`` recorded: our verdict joins it, so the
                                       scaler skips a step the sentinel rejects (no ``.item()``)
``Optimizer._step_supports_amp_scaling``  whether ``step()`` reads ``found_inf`` (fused AdamW/Adam/SGD)
``optimizer.found_inf``/``grad_scale``    the device flag a fused optimizer skips on (GradScaler's protocol)
``OptimizedModule._orig_mod``          the module inside ``torch.compile``'s wrapper (its eager forward and its
                                       own parameter names, without ``_orig_mod.``)
``sys._getframe``                      the Hugging Face ``Trainer`` that runs a callback: its callbacks are
                                       not handed the trainer (``StableTrainCallback(trainer=...)`` avoids it)
``torch.serialization._save``,         ``torch.save`` without the zip's per-record CRC32 for this one file
``torch._C.PyTorchFileWriter``         (``set_crc32_options`` is process-wide): the checkpoint writer takes
                                       its own CRC32 of every byte as it passes (~4 ms of CPU less per 10 MiB)
=====================================  ==================================================================
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["InternalMissing", "scaler_scale", "scaler_state", "set_scaler_state", "scaler_found_inf", "join_found_inf",
           "join_scaler_found_inf", "skips_on_device", "set_found_inf", "clear_found_inf", "found_inf_set",
           "fused_skip", "find_caller", "eager_module", "save_without_record_crcs"]

T = TypeVar("T")


class InternalMissing(RuntimeError):
    """A private internal stabletrain relies on is not there (a library version it does not support)."""

    def __init__(self, library: str, what: str, hint: str = "") -> None:
        try:
            import importlib.metadata as md
            version = md.version(library)
        except Exception:
            version = "unknown"
        super().__init__(f"stabletrain needs {what}, which {library} {version} does not have"
                         + (f"; {hint}" if hint else "; install a version stabletrain supports (see pyproject.toml)"))


def _require(obj: Any, attr: str, library: str, what: str) -> Any:
    if not hasattr(obj, attr):
        raise InternalMissing(library, f"{what} ({type(obj).__name__}.{attr})")
    return getattr(obj, attr)


# -- torch.amp.GradScaler ------------------------------------------------------------------------------

def scaler_scale(scaler: torch.amp.GradScaler) -> Tensor | None:
    """The scaler's current scale as its device tensor (no sync); None before its first ``scale()``."""
    return _require(scaler, "_scale", "torch", "GradScaler's device-side scale")


def scaler_state(scaler: torch.amp.GradScaler) -> tuple[Tensor, Tensor] | None:
    """Clones of (scale, growth tracker) on the device (no sync); None before the scaler's first ``scale()``."""
    scale = scaler_scale(scaler)
    tracker = _require(scaler, "_growth_tracker", "torch", "GradScaler's device-side growth tracker")
    if scale is None or tracker is None:
        return None
    return scale.detach().clone(), tracker.detach().clone()


def set_scaler_state(scaler: torch.amp.GradScaler, state: tuple[Tensor, Tensor] | None,
                     where: Tensor | None = None) -> None:
    """Put back a :func:`scaler_state` in place (no sync); ``where`` (device bool): only where it is True."""
    if state is None:
        return
    scale, tracker = scaler_scale(scaler), _require(scaler, "_growth_tracker", "torch", "GradScaler's growth tracker")
    if scale is None or tracker is None:
        return
    if where is None:
        scale.copy_(state[0])
        tracker.copy_(state[1])
    else:
        scale.copy_(torch.where(where, state[0], scale))
        tracker.copy_(torch.where(where, state[1], tracker))


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The per-device inf flags ``scaler.unscale_(optimizer)`` recorded (empty when it has not unscaled yet)."""
    states = _require(scaler, "_per_optimizer_states", "torch", "GradScaler's per-optimizer inf check")
    state = states[id(optimizer)]
    if not isinstance(state, dict) or "found_inf_per_device" not in state:
        raise InternalMissing("torch", "GradScaler's per-optimizer 'found_inf_per_device'")
    return list(state["found_inf_per_device"].values())


def join_scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, skip: Tensor) -> Tensor | None:
    """Make the scaler skip ``optimizer``'s next step where ``skip`` (device bool) is True; no sync.

    Returns the scaler's own verdict before the join (whether it found an inf), or None when the scaler
    has not unscaled ``optimizer`` yet (nothing to join: its ``step`` will check and unscale itself).
    """
    found = scaler_found_inf(scaler, optimizer)
    if not found:
        return None
    own = torch.stack([t.to(skip.device) for t in found]).sum() > 0
    first = found[0]
    first.copy_(torch.maximum(first, skip.to(first.dtype).to(first.device)))
    return own


# -- fused optimizers: found_inf ------------------------------------------------------------------------

def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` reads a ``found_inf`` flag (fused AdamW/Adam/SGD), so it can skip without a sync."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def set_found_inf(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """Have a fused optimizer's next ``step()`` skip where ``skip`` (device bool) is True (grads already unscaled)."""
    optimizer.grad_scale = None
    optimizer.found_inf = skip.float()


def found_inf_set(optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The ``found_inf`` flag set on a fused optimizer for its next step (by a GradScaler or :func:`set_found_inf`)."""
    return getattr(optimizer, "found_inf", None)


def join_found_inf(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """Also skip where ``skip`` (device bool) is True, keeping the ``found_inf`` a GradScaler already set (its scale stays)."""
    existing = found_inf_set(optimizer)
    optimizer.found_inf = torch.maximum(existing, skip.float().to(existing.device))


def clear_found_inf(optimizer: torch.optim.Optimizer) -> None:
    for name in ("grad_scale", "found_inf"):
        if name in vars(optimizer):
            delattr(optimizer, name)


@contextlib.contextmanager
def fused_skip(optimizer: torch.optim.Optimizer, skip: Tensor) -> Iterator[None]:
    """Within the block, ``optimizer.step()`` (a fused one) skips where ``skip`` is True."""
    set_found_inf(optimizer, skip)
    try:
        yield
    finally:
        clear_found_inf(optimizer)


# -- Python: the caller that runs us --------------------------------------------------------------------

def find_caller(predicate: Callable[[Any], bool], max_depth: int = 40) -> Any:
    """Return the ``self`` of the nearest calling frame for which ``predicate(self)`` holds, else None.

    Used to find the Hugging Face ``Trainer`` that calls a ``TrainerCallback`` (the Trainer hands its
    callbacks the model and optimizer, never itself).
    """
    getframe = getattr(sys, "_getframe", None)
    if getframe is None:
        raise InternalMissing("python", "sys._getframe", "pass the trainer explicitly")
    frame = getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if candidate is not None and predicate(candidate):
            return candidate
        frame = frame.f_back
    return None


# -- torch.compile ---------------------------------------------------------------------------------------

def eager_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``torch.compile``'s wrapper (an ``OptimizedModule``; ``model`` itself when it is none).

    The wrapper's parameters and state-dict keys carry an ``_orig_mod.`` prefix and its forward is compiled;
    the module inside holds the same tensors under their own names and runs eagerly.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled (and no import cost)
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        try:
            model = model._orig_mod
        except (AttributeError, KeyError):  # the wrapper's own __getattr__ raises KeyError for it
            raise InternalMissing("torch", "the module inside a torch.compile wrapper (OptimizedModule._orig_mod)") from None
    return model


# -- torch.save ------------------------------------------------------------------------------------------

def save_without_record_crcs(obj: Any, fh: Any) -> None:
    """``torch.save(obj, fh)`` into the binary file object ``fh``, without the zip's CRC32 of each record.

    ``torch.load`` reads the file as any other (it does not check those CRCs; ``unzip -t`` would report them);
    the caller checksums the bytes itself. Only this call is affected: ``torch.serialization.set_crc32_options``
    would switch the CRCs off for every thread's saves.
    """
    import pickle

    import torch.serialization as serialization

    writer_cls = _require(torch._C, "PyTorchFileWriter", "torch", "torch.save's zip writer")
    save = _require(serialization, "_save", "torch", "torch.save's pickling into an open zip writer")
    alignment = _require(serialization, "_get_storage_alignment", "torch", "torch.save's storage alignment")()
    try:
        writer = writer_cls(fh, False, alignment)  # (file, compute_crc32, storage alignment)
    except TypeError:
        raise InternalMissing("torch", "a zip writer that can leave out the per-record CRC32 "
                                       "(PyTorchFileWriter(file, compute_crc32, alignment))") from None
    save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)  # (..., _disable_byteorder_record) as torch.save
    writer.write_end_of_file()
    fh.flush()
