"""A SIGTERM once the loop has put its handler back (the launcher's, when another rank died) is held while the command
says its last lines, at most LateSigterm.GRACE_S; an error's traceback is printed before it ends the process; one that
came in the fit's set-up is the loop's to act on (it checkpoints and stops)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from helpers import cfg, regression_task
from multiproc import env

from stabletrain import Trainer
from stabletrain.services.signals import LateSigterm

RUN = ["task=mlp", "train.max_steps=2", "log.every=1", "eval.every=0", "ckpt.every=0"]


def _train(tmp_path, callback, **extra):
    cmd = [sys.executable, "-m", "stabletrain", "train", *RUN, f"run.dir={tmp_path / 'run'}",
           f"callbacks=[late_sigterm_cbs:{callback}]"]
    return subprocess.run(cmd, env={**env(), **extra}, capture_output=True, text=True, timeout=120)


def test_a_sigterm_after_the_fit_is_held_no_longer_than_its_grace(tmp_path):
    at = tmp_path / "sigterm_at"
    proc = _train(tmp_path, "TermThenSlow", LATE_SIGTERM_AT=str(at))
    ended = time.time()
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
    held = ended - float(at.read_text())
    assert LateSigterm.GRACE_S <= held < LateSigterm.GRACE_S + 10, held  # not the 30 s its callback sleeps


def test_a_held_sigterm_lets_an_internal_errors_traceback_be_printed_first(tmp_path):
    proc = _train(tmp_path, "TermThenInternalError")
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback (most recent call last)" in proc.stderr and "ZeroDivisionError" in proc.stderr, proc.stderr[-2000:]


def test_a_sigterm_in_the_fits_set_up_is_the_loops_to_act_on(tmp_path):
    late = LateSigterm().install()
    late.GRACE_S = 0.2  # shorter than the fit: its end must not come as a second SIGTERM once the loop took the first
    try:
        os.kill(os.getpid(), signal.SIGTERM)  # before the loop installs its handler: held, not lost
        assert late.seen
        trainer = Trainer(cfg("train.max_steps=50", "log.every=5", "ckpt.every=0"), task=regression_task(),
                          run_dir=tmp_path / "run")
        trainer.fit()  # (a second SIGTERM in it would raise KeyboardInterrupt here)
        time.sleep(0.4)
        assert not late.seen  # the loop took it: nothing is delivered again below
    finally:
        late.restore()
    assert trainer.step == 1 and trainer.stop_reason == "stopped by SIGTERM at step 1"  # its first step finished, then out
    assert signal.getsignal(signal.SIGTERM) is not late._on
