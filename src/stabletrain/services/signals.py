"""SIGTERM/SIGINT: finish the step, checkpoint, stop; a second signal interrupts at once."""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

__all__ = ["SignalHandler", "LateSigterm"]


class SignalHandler:
    """Record SIGTERM/SIGINT; the loop checkpoints and stops at its next decision point.

    A service the loop calls by name: :meth:`install` for the duration of a fit (main thread only),
    :meth:`restore` after it. :attr:`received` is the signal seen (None: none). A second signal raises
    KeyboardInterrupt at once: checkpoints are written atomically, so the last one stays loadable.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        self._old: dict[int, Any] = {}

    def _handler(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            raise KeyboardInterrupt  # second signal: leave now
        self.received = signum

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handler) for sig in (signal.SIGTERM, signal.SIGINT)}
            held = getattr(self._old[signal.SIGTERM], "__self__", None)
            if isinstance(held, LateSigterm) and held.take():  # one came in the set-up: this fit stops at its first chance
                self.received = signal.SIGTERM

    def restore(self) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old = {}

    def agree(self, signum: int | None) -> None:
        """Take the signal every rank agreed on at a log boundary (DDP: one rank may have seen it later)."""
        if signum:
            self.received = signum

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name


class LateSigterm:
    """A SIGTERM once the loop has put back the handler it had (its teardown, the command's last line): the first is
    held, so the process says why it ends before it ends (torchrun's agent SIGTERMs every rank when another dies: rank
    0 died by it, -15, before its "another rank exited" line); a second one ends it at once, by the handler before.

    :meth:`install` right before the fit (in the main thread only; a SIGTERM before it ends the set-up as it did),
    :meth:`restore` once the command has said its last line (the handler before is back, for an in-process caller). A
    SIGTERM is held :data:`GRACE_S` at most (a teardown that blocks, a slow callback: a launcher SIGKILLs after ~30 s); one
    held when the loop's own handler is installed is the loop's (:meth:`take`): it checkpoints and stops.
    """

    GRACE_S = 5.0

    def __init__(self) -> None:
        self.installed, self.old, self.seen = False, None, False
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()  # the grace's end against take() and restore(), which disarm it

    def install(self) -> LateSigterm:
        if threading.current_thread() is threading.main_thread():
            self.old = signal.signal(signal.SIGTERM, self._on)
            self.installed = True
        return self

    def _on(self, signum: int, frame: Any) -> None:
        if self.seen:  # a second (or the grace's end): the handler before decides now (the default ends the process)
            self.restore()
            return
        self.seen = True
        with self._lock:
            self._timer = threading.Timer(self.GRACE_S, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        """The grace is over (the timer's thread): a second SIGTERM, to this holder only (taken, restored: none)."""
        with self._lock:
            if self._timer is None or signal.getsignal(signal.SIGTERM) != self._on:
                return
            self._timer = None
            os.kill(os.getpid(), signal.SIGTERM)

    def take(self) -> bool:
        """Whether a SIGTERM was held; it is no longer (its taker acts on it)."""
        seen, self.seen = self.seen, False
        self._cancel()
        return seen

    def _cancel(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

    def restore(self) -> None:
        """Put back the handler before (the default where it was not Python's) and give it the SIGTERM held, if one
        was: the process ends by it, as it was asked to, after its last line (an in-process caller's handler runs)."""
        self._cancel()
        if not self.installed:
            return
        self.installed = False
        signal.signal(signal.SIGTERM, self.old if self.old is not None else signal.SIG_DFL)
        if self.seen and self.old is not signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGTERM)

