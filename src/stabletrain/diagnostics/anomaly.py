"""Replay under ``torch.autograd.detect_anomaly``: the Python stack of the forward call behind the first non-finite value."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .nonfinite import NonFiniteLocator, NonFiniteOp
from .stacks import keep_user_entries

__all__ = ["anomaly_trace"]


def anomaly_trace(fn: Callable[[], Any], model: nn.Module | None = None, *,
                  located: NonFiniteOp | None = None) -> str | None:
    """Run ``fn`` (a forward and backward) under anomaly mode; return the stack behind the first non-finite value.

    Replay only: anomaly mode records a Python stack for every autograd node. The text names the
    first non-finite op (found by :class:`NonFiniteLocator`, which also sees infs, which anomaly mode
    does not check) and the forward call that created it, followed by anomaly mode's own report when
    a backward function returned NaN. Returns None when everything stayed finite. Gradients that
    ``fn`` accumulates are left in place.

    ``located``: the first op as a locator already found it on the same replay, in forward and with
    its stack: the anomaly-mode pass then runs without a locator of its own (a first op in backward
    still needs one: the stack of the forward call behind it exists only under anomaly mode).
    """
    reuse = located is not None and located.direction == "forward" and located.stack is not None
    locator = None if reuse else NonFiniteLocator(model, capture_stack=True, first_only=True)  # its first op only
    anomaly_error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with torch.autograd.detect_anomaly(check_nan=True), locator if locator is not None else contextlib.nullcontext():
                fn()
        except RuntimeError as err:
            if "returned nan values" not in str(err):
                raise
            anomaly_error = str(err)
    parts = []
    first = locator.first if locator is not None else located
    if first is not None:
        label = "forward call that created its autograd node" if first.direction == "backward" else "stack"
        stack = first.stack or "  (not recorded)\n"
        parts.append(f"first non-finite op: {first.describe()}\n{label}:\n{stack}")
    if anomaly_error is not None:
        text = f"anomaly mode: {anomaly_error}\n"
        node = anomaly_error.split("'")[1] if anomaly_error.count("'") >= 2 else None
        if first is None or first.autograd_node != node:  # a different op than the locator's: show its stack
            forward = [str(w.message) for w in caught if "Traceback of forward call" in str(w.message)]
            if forward:
                body = forward[-1].split(" (Triggered internally at")[0].split("\n", 1)[-1]
                entries = ["  File" + e for e in body.split("  File")[1:]]
                text += f"forward call that created it:\n{keep_user_entries(entries)}"
        parts.append(text)
    return "\n".join(parts) if parts else None
