"""What a person reads: a bar on a terminal and plain lines elsewhere, every message on a line of its own,
what a resume and a failed checkpoint say, one-line warnings, a closed pipe and ``--version``."""

import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from helpers import cfg, regression_task
from multiproc import env

from stabletrain import Trainer
from stabletrain.cli import main
from stabletrain.config import ConfigError
from stabletrain.console import StableTrainWarning
from stabletrain.records.checkpoint.manager import CheckpointManager

FP16_WARNING = ("stabletrain: warning: precision=fp16 on CPU: fp16 autocast and GradScaler('cpu') run, slowly; meant for "
                "testing the fp16 path without a GPU (use bf16 or fp32 to train on CPU)")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "stabletrain", *args]


# An incident at every epoch (sample 37 holds a NaN): the run prints "stabletrain: incident at step N: ..." lines.
INCIDENT_RUN = ("train", "task=helpers:nan_sample_task", "train.max_steps=12", "train.batch_size=16", "log.every=3",
                "log.tensorboard=false")
PROGRESS_LINE = re.compile(r"^regression step (\d+)/12 \(\d+%\) \| loss \S+ \| grad_norm \S+ \| lr \S+ \| "
                           r"\d+ samples/s( \| val_loss \S+)? \| eta \d+:\d\d:\d\d$")


@pytest.mark.slow
def test_a_log_that_is_not_a_terminal_gets_a_plain_line_per_interval_and_every_message_its_own_line(tmp_path):
    log = tmp_path / "log"
    with open(log, "w") as fh:  # `stabletrain train ... > log 2>&1`
        res = subprocess.run(cli(*INCIDENT_RUN, f"run.dir={tmp_path / 'r'}"), stdout=fh, stderr=subprocess.STDOUT,
                             env=env(), timeout=300)
    text = log.read_text()
    assert res.returncode == 0, text
    assert "\r" not in text  # no bar redraws
    lines = text.splitlines()
    progress = [m for m in map(PROGRESS_LINE.match, lines) if m]
    assert [int(m[1]) for m in progress] == [3, 6, 9, 12]
    others = [line for line in lines if not PROGRESS_LINE.match(line)]
    assert others and all(line.startswith("stabletrain: ") for line in others), others
    incidents = [line for line in lines if line.startswith("stabletrain: incident at step ")]
    assert len(incidents) >= 2  # what `grep '^stabletrain:'` finds: each incident, on its own line
    assert lines[-1].startswith("stabletrain: trained 12 steps; ")


def _run_on_a_terminal(args: list[str], cwd: Path) -> tuple[int, str]:
    """Run ``args`` with stdout and stderr on a pseudo-terminal (120 columns); return the exit code and every byte shown."""
    import fcntl
    import pty
    import struct
    import termios

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, cwd=cwd, env=env())
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=300), b"".join(chunks).decode("utf-8", "replace")


@pytest.mark.slow
def test_a_terminal_gets_the_bar_and_each_message_starts_at_the_line_start(tmp_path):
    code, shown = _run_on_a_terminal(cli(*INCIDENT_RUN, f"run.dir={tmp_path / 'r'}"), tmp_path)
    assert code == 0, shown
    assert "12/12" in shown and "\r" in shown  # the bar, redrawn in place
    assert not PROGRESS_LINE.search(shown.replace("\r", "\n"))  # no plain progress lines on a terminal
    starts = [m.start() for m in re.finditer("stabletrain: ", shown)]
    assert len(starts) >= 3  # incidents and the summary
    # Each message begins a line on the screen: after a newline, or after the bar was cleared with a carriage return.
    assert all(shown[i - 1] in "\r\n" for i in starts), [shown[max(0, i - 40):i + 30] for i in starts]


@pytest.mark.slow
def test_the_cli_shows_stabletrains_warnings_as_one_line(tmp_path):
    res = subprocess.run(cli("train", "task=mlp", "precision=fp16", "train.max_steps=2", "log.progress=false",
                             "log.tensorboard=false", f"run.dir={tmp_path / 'r'}"),
                         capture_output=True, text=True, env=env(), timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines() == [FP16_WARNING]  # not Python's two lines pointing into loop.py


def test_the_python_api_raises_catchable_warnings_and_the_cli_hook_is_put_back(capsys):
    task = regression_task()
    task.val_data = torch_empty_dataset()
    with pytest.warns(StableTrainWarning, match="Task.val_data is empty"):
        Trainer(cfg(), task=task)
    original = warnings.showwarning
    assert main(["tasks", "mlp"]) == 0
    assert warnings.showwarning is original  # the CLI's one-line form is installed for its command only
    assert "task=mlp" in capsys.readouterr().out


def torch_empty_dataset():
    import torch

    return torch.utils.data.TensorDataset(torch.zeros(0, 4), torch.zeros(0, 1))


# -- resume ---------------------------------------------------------------------------------------------


def test_a_resume_says_where_it_resumed_from_and_what_it_skipped(tmp_path, capsys):
    run_dir = tmp_path / "r"
    Trainer(cfg("train.max_steps=40", "ckpt.every=20", "log.every=10"), run_dir=run_dir).fit()
    capsys.readouterr()
    ckpts = run_dir / "checkpoints"

    trainer = Trainer(cfg("train.max_steps=40", "ckpt.every=20", "log.every=10"), run_dir=run_dir, resume=True)
    trainer.state.run.close()
    out, err = capsys.readouterr()
    assert out.splitlines() == [f"stabletrain: resumed from step 40 (checkpoint {ckpts / 'step_000040'}, world size 1)"]
    assert err == ""

    state = ckpts / "step_000040" / "state.pt"
    size = state.stat().st_size
    os.truncate(state, 1000)
    trainer = Trainer(cfg("train.max_steps=40", "ckpt.every=20", "log.every=10"), run_dir=run_dir, resume=True)
    trainer.state.run.close()
    out, err = capsys.readouterr()
    assert trainer.step == 20
    assert err.splitlines() == [f"stabletrain: warning: resume skipped a checkpoint in {ckpts}: step_000040: state.pt is "
                                f"1000 bytes, meta.json says {size} (truncated or overwritten)"]
    assert out.splitlines() == [f"stabletrain: resumed from step 20 (checkpoint {ckpts / 'step_000020'}, world size 1); "
                                "the newest checkpoint (step 40) was skipped: 20 step(s) will be trained again"]


# -- checkpoint saves that fail --------------------------------------------------------------------------


def test_ckpt_max_failures_is_a_checked_config_key():
    assert cfg().ckpt.max_failures == 3
    with pytest.raises(ConfigError, match=r"^config key 'ckpt.max_failures': expected an integer >= 0, got -1$"):
        cfg("ckpt.max_failures=-1")


def _train_until_saves_fail(run_dir: Path, callback: str) -> subprocess.CompletedProcess:
    """Train with a checkpoint every 10 steps; ``callback`` makes every save after step 0's fail; 2 failures stop."""
    return subprocess.run(cli("train", "task=mlp", "train.max_steps=60", "log.every=5", "ckpt.every=10",
                              "ckpt.max_failures=2", "log.progress=false", "log.tensorboard=false", f"run.dir={run_dir}",
                              f"callbacks=[helpers:{callback}]"),
                          capture_output=True, text=True, env=env(), timeout=300)


def _assert_stopped_after_two_failed_saves(res: subprocess.CompletedProcess, run_dir: Path, cause: str) -> None:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 3, res.stderr
    for line, step, count in zip(lines, (10, 20), (1, 2)):
        assert line.startswith(f"stabletrain: warning: checkpoint at step {step} failed: "), line
        assert re.search(cause, line), line
        assert line.endswith(f"; the previous checkpoint (step_000000) and LAST_GOOD are untouched ({count} failed in "
                             "a row; the run stops at 2 in a row (ckpt.max_failures))"), line
    assert lines[2].startswith("stabletrain: error: 2 checkpoint saves in a row failed (ckpt.max_failures=2), the run "
                               "stops here; the last: checkpoint at step 20 failed: "), lines[2]
    assert re.search(cause, lines[2]), lines[2]
    assert lines[2].endswith(f"LAST_GOOD is step_000000, intact: free space on the disk of {run_dir / 'checkpoints'} "
                             f"(or fix it), then resume with: stabletrain train --resume {run_dir}"), lines[2]
    # Stopped at the next save after the second failure (step 30), not at the end; LAST_GOOD loads.
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 30
    events = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert [e["step"] for e in events if e["kind"] == "checkpoint_failed"] == [10, 20]
    assert events[-1]["kind"] == "crash" and events[-1]["error"] == "CheckpointError"
    assert (run_dir / "checkpoints" / "LAST_GOOD").read_text().strip() == "step_000000"
    assert CheckpointManager(run_dir / "checkpoints").load().meta["step"] == 0


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_FSIZE with SIGXFSZ ignored: Linux")
def test_failed_saves_are_printed_and_stop_the_run_file_size_limit(tmp_path):
    run_dir = tmp_path / "r"
    res = _train_until_saves_fail(run_dir, "FileSizeLimitAfterFirstCheckpoint")
    _assert_stopped_after_two_failed_saves(res, run_dir, r"\[Errno 27\] File too large")


@pytest.mark.slow
def test_failed_saves_are_printed_and_stop_the_run_full_disk(small_disk):
    run_dir = small_disk / "r"
    res = _train_until_saves_fail(run_dir, "FillDiskAfterFirstCheckpoint")
    _assert_stopped_after_two_failed_saves(res, run_dir, r"\[Errno 28\] No space left on device")


# -- the command line ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_reader_that_leaves_ends_the_output_quietly():
    # `stabletrain tasks | true`: the reader is gone before a byte is written.
    proc = subprocess.Popen(cli("tasks"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and err == ""  # as `git log | head`: no traceback


def test_version(capsys):
    from stabletrain import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out == f"stabletrain {__version__}\n"


@pytest.mark.slow  # inductor compiles (seconds; cached on disk)
def test_a_compiled_run_says_it_compiles_and_its_eta_leaves_the_compile_time_out(capsys):
    import time

    from stabletrain.callbacks import Callback

    class FirstStep(Callback):  # when the first step (its compilation) began and ended
        def on_fit_start(self, state):
            self.began = time.perf_counter()

        def on_step_end(self, state, out):
            if state.step == 1:
                self.took = time.perf_counter() - self.began

        def on_log(self, state, record, rows):  # two progress lines are all this reads: no 392 more steps, no eval compile
            if state.step == 8:
                state.stop("enough")

    first = FirstStep()
    c = cfg("train.compile=true", "train.max_steps=400", "train.batch_size=8", "log.every=4", "eval.every=0",
            "log.progress=true")
    Trainer(c, task=regression_task(), callbacks=[first]).fit()
    captured = capsys.readouterr()
    said = [line for line in captured.out.splitlines() if "train.compile=true" in line]
    assert said == ["stabletrain: train.compile=true: torch.compile compiles the model in the first step (and again "
                    "for a new batch shape or the validation pass); the ETA leaves that time out"]
    lines = [line for line in captured.err.splitlines() if line.startswith("regression step ")]
    assert lines[0].startswith("regression step 4/400 (1%)") and "samples/s (compiling included) | eta " in lines[0]
    assert "compiling" not in lines[1]
    h, m, s = map(int, lines[0].rsplit("eta ", 1)[1].split(":"))
    # Paced from step 1 to 4, not from the start: an ETA that counted the first step would be >= 396 x took / 4.
    with_compile = first.took / 4 * 396
    assert first.took > 0.05 and 3600 * h + 60 * m + s < with_compile / 4, (lines[0], first.took)


def test_the_non_finite_steps_an_interval_does_not_capture_get_one_line_and_the_report_says_why(tmp_path, capsys):
    """Two NaN samples (steps 2 and 5, batch 8, no shuffle) in one 10-step interval: step 2 is captured, step 5 skipped
    with a line of its own (the skip event alone said nothing), and the report says why 2 non-finite steps have 1 incident."""
    from stabletrain.report import write_report

    task = regression_task(n=80)  # 10 steps an epoch: each sample once in the run
    task.train_data.tensors[0][[13, 37]] = float("nan")
    Trainer(cfg("train.batch_size=8", "data.shuffle=false", "log.every=10", "train.max_steps=10"), task=task,
            run_dir=tmp_path / "run").fit()
    out = capsys.readouterr().out
    assert "1 more non-finite step in the interval to step 10, at step 5: not captured (one capture per interval: step " \
           "2's; events.jsonl)" in out, out
    page = write_report(tmp_path / "run").read_text()
    assert "2 steps had a non-finite loss or grad norm (first at step 2); an incident captures the first of its log " \
           "interval (1 below)." in page
    assert 'alt="Train loss"' in page and "validation loss" not in page  # no validation data
    # with capture.incidents=false there is no "interval's capture" to point to (it claimed step 2's), and step 2 was
    # said by nothing (a skip and an event only): the line names both
    Trainer(cfg("train.batch_size=8", "data.shuffle=false", "log.every=10", "train.max_steps=10", "capture.incidents=false"),
            task=task, run_dir=tmp_path / "off").fit()
    out = capsys.readouterr().out
    assert "2 non-finite steps in the interval to step 10, at steps 2, 5: not captured (capture.incidents=false; " \
           "events.jsonl)" in out, out


@pytest.mark.parametrize("capture, on_spike, said", [
    ("capture.incidents=false", "warn", "at step 20 (810.1): not captured (capture.incidents=false; events.jsonl)"),
    ("capture.incidents=false", "skip", "at step 20 (810.1, skipped): not captured (capture.incidents=false; events.jsonl)"),
    ("capture.spikes=false", "skip", "at step 20 (810.1, skipped): not captured (capture.spikes=false; events.jsonl)"),
])
def test_a_spike_the_run_does_not_capture_is_said_in_one_line_skipped_or_not(tmp_path, capsys, capture, on_spike, said):
    """A trial: with capture off, a spike (guard.on_spike=warn, the default) warned of nothing, and a skipped one was
    only counted in the last line ('1 of 30 steps skipped'): events.jsonl alone named it."""
    from spike_tasks import outlier_samples_task

    Trainer(cfg("train.batch_size=8", "data.shuffle=false", "log.every=10", "train.max_steps=20", "eval.every=0", capture,
                f"guard.on_spike={on_spike}"), task=outlier_samples_task(), run_dir=tmp_path / "run").fit()
    lines = [x for x in capsys.readouterr().out.splitlines() if "spike" in x]
    assert lines == [f"stabletrain: 1 loss spike in the interval to step 20, {said}"], lines


@pytest.mark.parametrize("off", [["capture.incidents=false", "capture.max_spikes=1"],
                                 ["capture.incidents=false", "capture.spikes=false"]])
def test_with_capture_off_every_interval_with_a_spike_gets_its_line(tmp_path, capsys, off):
    """A review: with capture.incidents=false each spike still spent one of capture.max_spikes, so the sixth (here the
    second) interval said 'the run's captures are spent' of captures never made; with capture.spikes=false too, no
    line at all."""
    from spike_tasks import outlier_samples_task

    Trainer(cfg("train.batch_size=8", "data.shuffle=false", "log.every=10", "train.max_steps=30", "eval.every=0", *off),
            task=outlier_samples_task(bad=(153, 157, 233, 235)), run_dir=tmp_path / "run").fit()
    lines = [x for x in capsys.readouterr().out.splitlines() if "spike" in x]
    key = "capture.spikes=false" if "capture.spikes=false" in off else "capture.incidents=false"
    assert [x.split(", at step")[0] for x in lines] == [f"stabletrain: 1 loss spike in the interval to step {t}"
                                                       for t in (20, 30)], lines
    assert all(x.endswith(f"not captured ({key}; events.jsonl)") for x in lines), lines


def test_under_torchrun_a_rank_other_than_0_shows_only_the_warnings_that_name_it(monkeypatch, capsys):
    """FSDP's SGD warning was printed once per rank (the docs say once): rank 0 says a config's warnings for all."""
    from stabletrain.console import one_line_warnings

    for rank, shown in (("0", ["same on every rank", "rank 1: its own"]), ("1", ["rank 1: its own"]), ("10", [])):
        monkeypatch.setenv("RANK", rank)
        with one_line_warnings(), warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("same on every rank", StableTrainWarning, stacklevel=1)
            warnings.warn("rank 1: its own", StableTrainWarning, stacklevel=1)
        err = capsys.readouterr().err  # (rank 10 is not "rank 1")
        assert [line.split("warning: ")[1] for line in err.splitlines()] == shown, (rank, err)


def test_the_progress_line_shows_a_tiny_loss_in_significant_digits():
    """A new-user trial: a loss of 5.6e-13 read 'loss 0.0000' on the progress line; ordinary ones keep 4 decimals."""
    from stabletrain.callbacks.sinks import _loss_text

    assert [_loss_text(v) for v in (5.6e-13, -2e-5, 2.269, 0.0, 1e-3)] == ["5.6e-13", "-2e-05", "2.2690", "0.0000", "0.0010"]


def test_an_incidents_long_line_keeps_its_first_clauses_and_its_verdict_and_says_where_the_rest_is():
    """A trial's spike line ran to 550 characters: brief keeps the clauses from the first that fit, and the last."""
    from stabletrain.console import brief

    evidence = "; ".join(f"clause {i} (a; b)" + "x" * 40 for i in range(10)) + "; reproduces on replay"
    short = brief(evidence, width=200, more="(all of it: stabletrain diagnose D)")  # (the path's length not counted)
    assert short == ("clause 0 (a; b)" + "x" * 40 + "; clause 1 (a; b)" + "x" * 40 + "; clause 2 (a; b)" + "x" * 40
                     + "; ... (all of it: stabletrain diagnose D); reproduces on replay")
    assert len(short.replace(" (all of it: stabletrain diagnose D)", "")) <= 200
    assert brief(evidence[:150], width=200) == evidence[:150]  # one that fits: as it is
    assert brief("a" * 400 + "; b", width=100) == "a" * 400 + "; b"  # two clauses: nothing to leave out
    listed = "1) " + evidence  # a stray ")" (a review: the depth went below 0 and no clause was split any more)
    assert brief(listed, width=200) == "1) " + short.replace("... (all of it: stabletrain diagnose D)", "...")
    # A caveat ("but ...") is kept before the clauses leading up to it (a trial: the drift a data verdict may have missed)
    caveat = "; ".join(["first", "x" * 60, "y" * 60, "but it may be wrong", "z" * 60, "last"])
    assert brief(caveat, width=120, more="M") == "first; " + "x" * 60 + "; ... M; but it may be wrong; ...; last"  # each gap


def test_a_line_said_beside_a_hosts_bar_in_a_log_starts_after_it_and_a_closed_bar_is_none():
    """A trial: the Hugging Face callback let go of the Trainer's bar before its last interval's incident line, which
    then ran on after the bar's last redraw in the log ('... 15.61it/s]stabletrain: incident at step 123'). A bar drawn
    into a log (no terminal) gets the line on a line of its own; one tqdm closed (disabled) is no bar."""
    import io

    from tqdm import tqdm

    from stabletrain import console

    log = io.StringIO()
    bar = tqdm(total=4, file=log, leave=True)
    bar.update(4)
    try:
        console.show_bar(bar)
        out = io.StringIO()
        console.write_line("stabletrain: incident at step 3", out)
        assert out.getvalue() == "\nstabletrain: incident at step 3\n"
        bar.close()
        out = io.StringIO()
        console.write_line("stabletrain: incident at step 3", out)
        assert out.getvalue() == "stabletrain: incident at step 3\n"
    finally:
        console.show_bar(None)
