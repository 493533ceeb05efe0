"""The run's record as callbacks: metrics.jsonl, TensorBoard, the progress bar, per-step events, the init watch.

Each writes at log boundaries only (the interval's host values), never per step.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

from .. import console
from ..diagnostics.initialization import InitFingerprint
from ..records.tb_events import TensorBoardSink
from . import Callback, RunState

__all__ = ["MetricsFile", "TensorBoardLog", "ProgressBar", "EventLog", "InitWatch", "announce_precursor"]


class MetricsFile(Callback):
    """Append each interval's record to ``RUN_DIR/metrics.jsonl`` (rank 0 with a run dir)."""

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        if state.run is not None:
            state.run.metrics.write(record)


class TensorBoardLog(Callback):
    """Write each interval's scalars to ``RUN_DIR/tb``: one TensorBoard event per interval
    (:class:`~stabletrain.records.tb_events.TensorBoardSink`).

    When ``log.trackers`` lists tensorboard (the default) and ``log.tensorboard`` is true.
    """

    def __init__(self) -> None:
        self._sink: TensorBoardSink | None = None

    def on_fit_start(self, state: RunState) -> None:
        log = state.cfg.log
        if state.run is not None and log.tensorboard and "tensorboard" in log.trackers and self._sink is None:
            # On a resume the steps after the checkpoint are written again: purge what a crash left of them
            # (from the step-0 checkpoint too: whatever an earlier process wrote, not whether the step is 0).
            tb = state.run.path / "tb"
            earlier = tb.is_dir() and any(tb.glob("events.out.tfevents.*"))
            self._sink = TensorBoardSink(tb, purge_step=state.step + 1 if earlier else None)

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        if self._sink is not None:
            self._sink.write(record)

    def on_rollback(self, state: RunState, info: dict[str, Any]) -> None:
        if self._sink is not None:  # the steps after the checkpoint are trained again, as after a resume
            self._sink.purge_from(int(info["to_step"]) + 1)

    def on_fit_end(self, state: RunState, record: dict[str, Any]) -> None:
        if self._sink is not None:
            self._sink.close()
            self._sink = None


class ProgressBar(Callback):
    """Progress on the console (rank 0, ``log.progress``): a bar on a terminal, else one plain line per log interval.

    On a terminal (or in Jupyter: :func:`stabletrain.console.is_interactive` of stderr) a tqdm bar advances
    per step on the host and its figures refresh per interval; messages are written above it
    (:mod:`stabletrain.console`). Anywhere else (a file, a pipe, CI, ``nohup``, Slurm, ``torchrun``) a bar's
    carriage-return redraws would pile up in the log, so each interval is one line on stderr::

        mlp step 100/300 (33%) | loss 2.2690 | grad_norm 0.816 | lr 1.00e-03 | 5120 samples/s | eta 0:00:12

    The ETA is the remaining steps at this process's pace so far (validation and checkpoints included). Under
    ``train.compile=true`` a line says that the model compiles, and the pace is measured from the end of the first
    step, so the ETA leaves out the compile time (the first interval's throughput still includes it, and says so).
    """

    def __init__(self) -> None:
        self._bar: Any = None
        self._lines = False  # no terminal: a line per interval
        self._start = (0.0, 0)  # (time, step) the pace is measured from
        self._compiling = False  # train.compile: the first step compiles; the pace starts after it

    def on_fit_start(self, state: RunState) -> None:
        if not (state.cfg.log.progress and state.dist.is_main) or self._bar is not None or self._lines:
            return
        self._start = (time.perf_counter(), state.step)
        self._compiling = bool(state.cfg.train.compile)
        if self._compiling:
            console.say("train.compile=true: torch.compile compiles the model in the first step (and again for a new "
                        "batch shape or the validation pass); the ETA leaves that time out")
        if not console.is_interactive(sys.stderr):
            self._lines = True
            return
        from tqdm.auto import tqdm

        self._bar = tqdm(total=state.cfg.train.max_steps, initial=state.step, desc=state.task.name, unit="step",
                         dynamic_ncols=True)
        console.show_bar(self._bar)

    def on_step_end(self, state: RunState, out: dict[str, Any]) -> None:
        if self._compiling:  # the first step is over, and its compilation with it: the pace counts from here
            self._start, self._compiling = (time.perf_counter(), state.step), None
            if self._bar is not None:  # the bar's rate afresh (its elapsed time stays whole), drawn at the next step
                start = self._bar.start_t
                self._bar.reset()
                self._bar.start_t, self._bar.n, self._bar.last_print_n = start, state.step, state.step
            return
        if self._bar is not None:
            self._bar.update(1)

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        if self._bar is None and not self._lines:
            return
        unit = "tok/s" if getattr(state.task, "count_unit", "samples") == "tokens" else "samples/s"
        if self._lines:
            console.write_line(self._line(state, record, unit), sys.stderr)
            return
        shown = {"loss": _loss_text(record["loss"]), "gnorm": f"{record['grad_norm']:.3g}", "lr": f"{record['lr']:.2e}",
                 unit: f"{record['tokens_per_s']:.0f}"}
        if "val_loss" in record:
            shown["val"] = _loss_text(record["val_loss"])
        self._bar.set_postfix(shown, refresh=True)

    def _line(self, state: RunState, record: dict[str, Any], unit: str) -> str:
        """The interval's line: step, loss, grad norm, lr, throughput, (val loss,) ETA."""
        total = state.cfg.train.max_steps
        t0, step0 = self._start
        done = state.step - step0
        eta = _clock((time.perf_counter() - t0) / done * (total - state.step)) if done > 0 else "?"
        parts = [f"{state.task.name} step {state.step}/{total} ({100 * state.step // total}%)",
                 f"loss {_loss_text(record['loss'])}", f"grad_norm {record['grad_norm']:.3g}", f"lr {record['lr']:.2e}",
                 f"{record['tokens_per_s']:.0f} {unit}" + (" (compiling included)" if self._compiling is None else "")]
        if self._compiling is None:  # said on the first interval's line only
            self._compiling = False
        if "val_loss" in record:
            parts.append(f"val_loss {_loss_text(record['val_loss'])}")
        return " | ".join([*parts, f"eta {eta}"])

    def on_rollback(self, state: RunState, info: dict[str, Any]) -> None:
        self._start = (time.perf_counter(), state.step)  # the pace is measured afresh from the restored step
        if self._bar is not None:
            self._bar.n = state.step
            self._bar.refresh()

    def on_fit_end(self, state: RunState, record: dict[str, Any]) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            console.show_bar(None)
        self._lines = False


def _clock(seconds: float) -> str:
    """``H:MM:SS`` of a duration (rounded to the second)."""
    s = max(0, round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class EventLog(Callback):
    """Turn each interval's per-step rows into events: non-finite values, spikes and skipped updates."""

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        if state.run is None:
            return
        guard = state.cfg.guard
        for row in rows:
            step, values = row.step, row.values
            if values["finite"] < 0.5 and values["overflow"] > 0.5:
                pass  # the GradScaler's routine overflow: a skip event below, not a non-finite value
            elif values["finite"] < 0.5:
                what = "loss" if not math.isfinite(values["loss"]) else "grad norm (or inputs)"
                where: dict[str, Any] = {}
                seen = ""
                if state.dist.enabled:
                    where["ranks"] = list(row.ranks or [])
                    seen = (f" (seen on rank(s) {where['ranks']})" if row.ranks
                            else " (no rank's own loss or inputs: the gradients; the incident names the rank)")
                state.event(step, "nonfinite", f"non-finite {what}{seen}: loss={values['loss']}, "
                            f"grad_norm={values['grad_norm']}", loss=values["loss"], grad_norm=values["grad_norm"], **where)
            elif values["params_finite"] < 0.5:
                state.event(step, "nonfinite", "parameters non-finite at this step's check (loss and grad norm were "
                            "finite; an update since the last check broke them)", loss=values["loss"],
                            grad_norm=values["grad_norm"], after_update=True)
            if values["spike"] > 0.5:
                state.event(step, "spike", f"loss spike: {values['loss']:.4g} (rule: > {guard.spike_ratio:g}x the "
                            f"median and z > {guard.spike_zscore:g}, or robust z past {guard.spike_ratio ** 2:g}x, over the "
                            f"last {guard.spike_window} steps)",
                            loss=values["loss"], action=guard.on_spike)
            if values["applied"] < 0.5:
                if values["finite"] >= 0.5 and values["spike"] > 0.5:
                    reason = f"loss spike (guard.on_spike={guard.on_spike})"
                elif values["overflow"] > 0.5:  # (NaN: an overflow's inf makes NaN too, and so does a bad sample: said)
                    norm = "nan" if math.isnan(values["grad_norm"]) else "inf"
                    reason = (f"fp16 overflow{' or NaN' if norm == 'nan' else ''} (grad norm {norm}; GradScaler backs off "
                              "the loss scale)")
                else:
                    reason = "non-finite loss or grad norm"
                state.event(step, "skip", f"optimizer step skipped: {reason}", loss_scale=values["loss_scale"])


def announce_precursor(state: RunState, warning: Any) -> None:
    """Record a :class:`~stabletrain.policies.precursor.PrecursorWarning` as a ``precursor`` event and say its one
    line (rank 0); None: nothing. At a log boundary, after the interval's ``on_log``."""
    if warning is None:
        return
    state.event(warning.step, "precursor", warning.reason, **warning.fields())
    if state.dist.is_main:
        console.say(warning.line)


class InitWatch(Callback):
    """Fingerprint every parameter right after the task factory; report any init changed before the first step.

    A ``reset_parameters()``, a wrapper or a meta-device materialization that silently re-initializes is
    an ``init_overwritten`` event naming each parameter. One host read at the fit's start, and, where nothing had
    changed by then, one more right after the model's first forward (a lazy re-init on the first call; not under
    ``train.compile``, where a hook would be traced into the compiled forward), before its backward.
    """

    def __init__(self, fingerprint: InitFingerprint | None = None) -> None:
        self.fingerprint = fingerprint

    def on_fit_start(self, state: RunState) -> None:
        fingerprint, self.fingerprint = self.fingerprint, None
        if fingerprint is None or state.step > 0:
            return
        changes = fingerprint.compare(state.module)
        if changes:
            _say_overwritten(state, changes, "")
        elif not getattr(getattr(state.cfg, "train", None), "compile", False):

            def after_first_forward(module: Any, args: Any, out: Any) -> None:
                if module is not watched:  # a copy (the step-0 report's deepcopy carries the hook): not the run's model
                    return
                handle.remove()
                if state.step > 0:  # a host whose fit starts in its first step (Monitor): its first forward came before
                    return  # the comparison above, and this one is after an update (every parameter "changed")
                changes = fingerprint.compare(module)
                if changes:  # (what the step-0 report measured and advised on: not what the run starts from)
                    _say_overwritten(state, changes, " in the model's first forward", "; no init applied before that forward "
                                     "survives it, the step-0 init line's advice included: remove the re-initialization (a "
                                     "lazy init on the first call) or the in-place change of the weights from the forward")

            watched = state.module
            handle = watched.register_forward_hook(after_first_forward)


def _loss_text(value: Any) -> str:
    """A loss for the progress line: 4 decimals, or 4 significant digits below 0.001 (5.6e-13 read 'loss 0.0000')."""
    if isinstance(value, (int, float)) and value != 0 and math.isfinite(value) and abs(value) < 1e-3:
        return f"{value:.4g}"
    return f"{value:.4f}" if isinstance(value, (int, float)) else str(value)


def _say_overwritten(state: RunState, changes: list[Any], when: str, then: str = "") -> None:
    text = InitFingerprint.describe(changes) + then
    state.event(state.step, "init_overwritten", f"init overwritten{when}: {text}", params=[c.as_dict() for c in changes])
    if state.dist.is_main:  # (it was an event only: the run trained on another init without a word)
        console.say(f"init overwritten{when}: {text}")
