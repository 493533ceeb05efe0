"""Callbacks (``callbacks=[late_sigterm_cbs:...]``) that send their own process a SIGTERM once its fit has ended: the
launcher's (torchrun's agent ends every rank when one dies) arriving while the command says its last lines."""

import os
import signal
import time

from stabletrain.callbacks import Callback


class TermThenSlow(Callback):
    """A SIGTERM, then a teardown that takes 30 s (an upload, a barrier a dead peer blocks): the time it came, in
    $LATE_SIGTERM_AT."""

    def on_fit_end(self, state, record):
        with open(os.environ["LATE_SIGTERM_AT"], "w") as fh:
            fh.write(repr(time.time()))
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)


class TermThenInternalError(Callback):
    """A SIGTERM, then an error raised in stabletrain's own code after the fit (a bug, whose traceback is its report)."""

    def on_fit_end(self, state, record):
        os.kill(os.getpid(), signal.SIGTERM)
        import stabletrain.commands.train as train

        train._skips = eval(compile("lambda run: 1 / 0", train.__file__, "eval"))  # raised from stabletrain's own file
