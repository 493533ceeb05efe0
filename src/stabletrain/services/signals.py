"""SIGTERM/SIGINT as a callback: finish the step, checkpoint, stop; a second signal interrupts at once."""

from __future__ import annotations

import signal
import threading
from typing import Any

from ..callbacks import Callback, FitState

__all__ = ["SignalHandler"]


class SignalHandler(Callback):
    """Record SIGTERM/SIGINT in :attr:`signal`; the loop checkpoints and stops at its next decision point.

    Installed for the duration of a fit (main thread only). A second signal raises KeyboardInterrupt
    at once: checkpoints are written atomically, so the last one stays loadable.
    """

    def __init__(self) -> None:
        self.signal: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt  # second signal: leave now
        self.signal = signum

    def on_fit_start(self, state: FitState) -> None:
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}

    def on_fit_end(self, state: FitState, record: dict[str, Any]) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
