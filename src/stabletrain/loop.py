"""The built-in fit loop: pulls windows, runs the one step, calls the services by name, fires callbacks::

    strategy.wrap(model)                     # one process / DDP / FSDP2 (stabletrain.distributed.strategy)
    for each window of the data stream:
        out = step(window)                   # the one optimizer step (step.build_step): device tensors, no sync
        metrics.update(out); on_step_end     # callbacks observe
        at a log boundary (one host sync): boundary.log: reduce -> on_log -> guard.decide
            boundary.incident (the capture) [-> remedies.act] | keeper.rollback | stop | keeper.save
            recorder.mark_interval_start

The same loop runs on every rank under ``torchrun``: every decision is made from values that are the same
on every rank. Only rank 0 writes the run directory.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .callbacks import Callback, CallbackList, load_callbacks
from .callbacks.sinks import EventLog, InitWatch, MetricsFile, ProgressBar, TensorBoardLog
from .callbacks.trackers import build_trackers
from .config import Config
from .data import EpochOrder, Window, WindowStream
from .diagnostics.initialization import InitFingerprint
from .distributed.group import DistContext
from .distributed.peers import PeerLostError, is_peer_failure
from .distributed.strategy import strategy_for
from .evaluation import check_val_data, validation_loss
from .policies.guard import Guard, GuardDecision
from .policies.metrics import StepMetrics
from .policies.optim import check_materialized
from .policies.precision import resolve_device
from .policies.schedule import LRSchedule
from .process import gc_frozen
from .runstate import RunState
from .seeding import deterministic_mode, seed_everything
from .services.boundary import IntervalBoundary
from .services.checkpoints import CheckpointKeeper
from .services.incidents import IncidentRecorder
from .services.init_signal import run_init_signal
from .services.remedy_applier import RemedyApplier
from .services.run_setup import DEFAULT_RUN_DIR, default_run_dir, open_run
from .services.signals import SignalHandler
from .step import build_step
from .tasks import Task, check_task, resolve_task

__all__ = ["Trainer"]


class Trainer:
    """Train ``task`` under ``cfg``: builds the strategy, the policies and the step, runs the loop, calls the services.

    ``run_dir``: default ``run.dir``; with neither nothing is written. ``resume=True`` continues ``run_dir`` from
    LAST_GOOD (a changed key outside ``config.RESUME_SAFE_KEYS`` is refused). ``callbacks`` fire after the built-in
    ones. Under DDP ``self.model`` is the DDP wrapper, ``self.module`` the model; every rank builds it and calls fit().
    """

    def __init__(self, cfg: Config, task: Task | None = None, run_dir: str | Path | None = None, *,
                 resume: bool = False, callbacks: Sequence[Callback] = ()) -> None:
        cfg = cfg.validate()
        seed_everything(cfg.seed)
        given, task = task, check_task(task) if task is not None else resolve_task(cfg.task, cfg.task_args)
        check_val_data(task)
        check_materialized(task.model, cfg.task if given is None else task.name)  # lazy, meta or frozen: nothing to train
        fingerprint = InitFingerprint.take(task.model) if not resume else None  # before anything can touch it
        dist, device = DistContext.current(), resolve_device(cfg.device)
        if dist.enabled and device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # cuda:LOCAL_RANK (process_group set it)
        module = task.model.to(device)
        strategy = strategy_for(cfg, dist, device)
        parts, fingerprint = strategy.wrap(module, task, fingerprint)
        self.params, self.window = [p for _, p in parts.named_params], parts.window
        optimizer = strategy.optimizer(parts.named_params, task)
        schedule = LRSchedule(optimizer, cfg.sched.warmup_steps, cfg.train.max_steps, cfg.sched.decay, cfg.sched.min_lr_ratio)
        guard = Guard(cfg.guard, device, scaled=parts.precision.scaler is not None, remedy=True,
                      lr_key="the lr of the task's own optimizer" if task.optimizer is not None else "optim.lr")
        self.step_fn = build_step(cfg, parts.model, optimizer, parts.precision, guard=guard, schedule=schedule,
                                  params=self.params, window=parts.window, carrier=parts.carrier, numerics=parts.numerics)
        order = EpochOrder(len(task.train_data), cfg.train.batch_size, cfg.seed, cfg.data.shuffle, rank=dist.rank,
                           world_size=dist.world)
        stream = WindowStream(task.train_data, order, cfg.accum.steps, collate=task.collate, workers=cfg.data.workers,
                              pin_memory=device.type == "cuda")
        # The run's one state object: what the services and the callbacks are handed (stabletrain.runstate).
        self.state = state = RunState(
            cfg=cfg, task=task, module=module, named_params=parts.named_params, device=device, dist=dist, stream=stream,
            precision=parts.precision.mode, model=parts.model, strategy=strategy, optimizer=optimizer, schedule=schedule,
            precision_policy=parts.precision, clipper=self.step_fn.clipper, guard=guard, train_step=self.train_step,
            metrics=StepMetrics(cfg.log.every, len(self.params), device, dist))
        self.signals, self.keeper = SignalHandler(), CheckpointKeeper(state)
        self.recorder, state.remedies = IncidentRecorder(state, self.keeper), RemedyApplier(state)
        builtin = [EventLog(), MetricsFile(), TensorBoardLog(), *build_trackers(cfg.log.trackers, log=cfg.log), ProgressBar()]
        # (the init's check last: after the user's on_fit_start, which may re-initialize the model too)
        state.callbacks = CallbackList([*builtin, *callbacks, *load_callbacks(cfg.callbacks), InitWatch(fingerprint)])
        self.boundary = IntervalBoundary(state, self.recorder.capture, top_layers=cfg.log.top_layers,
                                         epoch=lambda: stream.epoch)
        self._pending_eval: dict[str, float] = {}
        self._agreed_signal: int | None = None  # DDP: the largest signal any rank had at the last log boundary
        self._where = "setup"  # what the loop is doing, for a clear message when a peer is lost
        self._params_held = False  # checked after the first step (the strategy's check_after_first_step)
        run_dir = cfg.run.dir if run_dir is None else run_dir  # (Trainer(cfg) with run.dir set wrote nothing, silently)
        if run_dir == DEFAULT_RUN_DIR:
            run_dir = default_run_dir(cfg, task.name)
        if run_dir is not None:
            open_run(state, self.keeper, self.recorder, Path(dist.on_main(lambda: str(run_dir))),  # every rank: rank
                     resume)  # 0's directory
        elif resume:
            raise ValueError("resume needs a run directory (--resume RUN_DIR)")

    # The run's setup, parts and progress live in its RunState (self.state); these read it (the counters write it too).
    (cfg, task, module, model, named_params, device, dist, strategy, optimizer, schedule, clipper, guard, metrics, stream,
     callbacks, remedies, history, stop_reason, run, ckpt) = (
        property(lambda self, k=k: getattr(self.state, k)) for k in (
            "cfg", "task", "module", "model", "named_params", "device", "dist", "strategy", "optimizer", "schedule",
            "clipper", "guard", "metrics", "stream", "callbacks", "remedies", "history", "stop_reason", "run", "ckpt"))
    precision = property(lambda self: self.state.precision_policy)  # the policy (state.precision: its mode)
    step = property(lambda self: self.state.step, lambda self, v: setattr(self.state, "step", v))
    samples_seen = property(lambda self: self.state.samples_seen, lambda self, v: setattr(self.state, "samples_seen", v))
    tokens_seen = property(lambda self: self.state.tokens_seen, lambda self, v: setattr(self.state, "tokens_seen", v))

    def state_dict(self, *, local: bool = False, dcp: bool = False) -> dict[str, Any]:
        """Everything the next step depends on (:meth:`RunState.state_dict <stabletrain.runstate.RunState.state_dict>`)."""
        return self.state.state_dict(local=local, dcp=dcp)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` or a checkpoint (:meth:`RunState.load_state_dict
        <stabletrain.runstate.RunState.load_state_dict>`)."""
        self.state.load_state_dict(state)

    def train_step(self, window: Window, *, measure_update: bool = False, check_params: bool = True) -> dict[str, Tensor]:
        """Run the one optimizer step on ``window``; return its figures as device tensors (no sync)."""
        out = self.step_fn(list(zip(map(len, window.indices), window.batches)), self.task.loss,
                           measure_update=measure_update, check_params=check_params)
        if not self._params_held:  # once: layers the first forward made would never train
            self.strategy.check_after_first_step(self.module, self.optimizer, len(self.params), self.task.name)
            self._params_held = True
        return out

    def fit(self) -> dict[str, Any]:
        """Train until ``train.max_steps`` (or a stop); return the last metrics record. A lost peer raises
        :class:`PeerLostError`. Process-wide settings (``deterministic``, ``train.gc_freeze``: :mod:`stabletrain.process`)
        hold while fit() runs and are put back after it."""
        try:
            with deterministic_mode(self.cfg.deterministic), gc_frozen(self.cfg.train.gc_freeze):
                return self._fit()
        except Exception as err:
            if not self._peer_lost(err):
                raise
            good = self.ckpt.latest_good() if self.ckpt is not None else None
            run_dir = str(self.ckpt.root.parent) if self.ckpt is not None else None
            raise PeerLostError(self.dist.rank, self._where, self.step, good.name if good else None,
                                str(err) or type(err).__name__, run_dir) from err

    def _fit(self) -> dict[str, Any]:
        cfg, state, fire = self.cfg, self.state, self.callbacks.fire
        self._record = state.begin_fit()  # {}: the last metrics record (a Trainer fits once)
        self.signals.install()
        try:
            self._where = "the step-0 checkpoint"
            fire("on_fit_start", state)
            self.remedies.by_hand()  # config key 'remedy': INCIDENT_DIR:NAME, applied once
            run_init_signal(state)  # a new run's step 0: which layers vanish or explode (log.init_signal)
            self.recorder.mark_interval_start()
            if self.keeper.resumed_from is not None:
                fire("on_resume", state, {"step": state.step, "path": str(self.keeper.resumed_from)})
            if self.keeper.needs_first():
                self._checkpoint(healthy=True)
            self.boundary.restart()  # the first interval's throughput counts from its first step, not from the set-up's
            while state.step < cfg.train.max_steps:
                self._where = "a training step (window or gradient all-reduce)"  # (the window's read is the step's)
                window = self.stream.next_window()
                state.positions[state.step + 1] = (window.epoch, window.start)
                nxt = state.step + 1
                # On an interval's last step only (a checkpoint's, an evaluation's too): ||update|| (one parameter copy) and
                # the parameter check (one pass; a failed check is pinned to its step by the capture's replay). No sync.
                last = nxt == cfg.train.max_steps or any(n and not nxt % n for n in (cfg.log.every, cfg.ckpt.every,
                                                                                     cfg.eval.every))
                out = self.train_step(window, measure_update=last, check_params=last)
                state.step, state.samples_seen = nxt, state.samples_seen + window.global_num_samples
                self.metrics.update(state.step, num_samples=window.global_num_samples, lr=self.schedule.lr(),
                                    loss_scale=self.precision.loss_scale(), **out)
                self._where = f"a callback's on_step_end after step {nxt}"  # (the step itself is done: not its crash)
                fire("on_step_end", state, out)
                if not self._boundary():
                    break
        except (Exception, SystemExit) as err:  # the record keeps what ended the run, with the user's file:line (a
            if not self._peer_lost(err):  # library's sys.exit in the task's code too: a crash, not a silent exit)
                try:  # (torch's SIGCHLD handler may raise again in the wait, a DataLoader's second worker gone)
                    self._record_checkpoints(self.keeper.finished(wait=True))  # the crash stays the last event
                finally:
                    state.crash(err, self._where, state.step + 1 if self._where.startswith("a training step") else state.step)
            raise
        finally:
            try:
                self._record_checkpoints(self.keeper.finished(wait=True))  # no save outlives the fit
            finally:
                self.signals.restore()
                fire("on_fit_end", state, self._record)
                if state.run is not None:
                    state.run.close()
        return self._record

    def _boundary(self) -> bool:
        """After a step: validation, and at a log boundary the interval's work. Return whether to go on."""
        cfg, state = self.cfg, self.state
        done = state.step >= cfg.train.max_steps
        evaluated = done or bool(cfg.eval.every and state.step % cfg.eval.every == 0)
        if evaluated:  # (it ends its log interval, as a checkpoint does: each val_loss logged at the step it measured)
            self._where = "the validation reduce"
            self._pending_eval = self.evaluate()
        ckpt_due = bool(cfg.ckpt.every) and state.step % cfg.ckpt.every == 0
        signalled = self.signals.received is not None and not self.dist.enabled  # DDP: waits for the boundary
        if not (evaluated or ckpt_due or signalled or state.step % cfg.log.every == 0):
            return True
        self._where = "the log-interval reduce (or an incident replay or rollback)"
        self._record, decision, rows = self._log()
        # A background save that finished is recorded now; one that a replay or rollback needs is waited for.
        self._record_checkpoints(self.keeper.finished(wait=decision.first_incident is not None
                                                      or decision.action == "rollback"))
        healthy = self._act(decision, rows)
        if state.stop_reason is not None:
            return False
        if decision.action != "rollback":  # after a rollback: back at LAST_GOOD, nothing new to save
            stop_signal = self._agreed_signal if self.dist.enabled else self.signals.received  # DDP: every rank's
            if done or ckpt_due or stop_signal:
                self._where = "the checkpoint gather"
                self._checkpoint(healthy, wait=done or bool(stop_signal))  # the last one is waited for
            if stop_signal:
                self.signals.agree(stop_signal)
                state.stop(f"stopped by {SignalHandler.name(stop_signal)} at step {state.step}")
                return False
        state.positions = {s: p for s, p in state.positions.items() if s > state.step}
        self.recorder.mark_interval_start()
        return True

    def _peer_lost(self, err: BaseException) -> bool:
        """Whether ``err`` is a collective failing for want of a peer (:func:`~stabletrain.distributed.peers.is_peer_failure`)."""
        in_sync = bool(getattr(self.step_fn.carrier, "in_gradient_sync", False))  # DDP: out of the gradient all-reduce?
        return self.dist.enabled and is_peer_failure(err, in_gradient_sync=in_sync)

    def _log(self) -> tuple[dict[str, Any], GuardDecision, list[Any]]:
        """Reduce the interval (its one host sync), let the guard read it, fire ``on_log`` (the boundary service)."""
        record, decision, rows, summary = self.boundary.log(self.signals.received or 0, self._pending_eval)
        self._agreed_signal = summary["interval_signal"] or None  # DDP: every rank stops here if any was signalled
        self._pending_eval = {}
        return record, decision, rows

    def _act(self, decision: GuardDecision, rows: list[Any]) -> bool:
        """Capture the incident, then stop or roll back as decided; return whether the state is healthy."""
        state = self.state
        info = self.boundary.incident(decision, rows)  # every rank captures: the replay has collectives
        t0 = time.perf_counter()
        cured = decision.action == "remedy" and self.remedies.act(decision, info or {})  # a cure verified on a replay
        self.boundary.excluded += time.perf_counter() - t0  # the search's time is not the next interval's throughput
        if cured:
            if decision.action == "rollback":  # the cure's own rollback: the run went back to its checkpoint
                self.callbacks.fire("on_rollback", state, self.remedies.last_rollback)
            return True
        if decision.action == "stop":
            state.stop(decision.reason)
            return False
        if decision.action == "rollback":
            info = self.keeper.rollback(decision, self.guard.counters_kept, info)
            if info is None:
                state.stop(state.stop_reason or decision.reason)
                return False
            self.callbacks.fire("on_rollback", state, info)
            return True
        # A skipped step leaves the healthy pre-step state: only an applied update that broke the parameters is unsafe.
        return decision.params_bad_at is None and not decision.after_update

    def _checkpoint(self, healthy: bool, wait: bool = False) -> None:
        # The previous save's outcome first: after ckpt.max_failures failed saves in a row the run stops here.
        self._record_checkpoints(self.keeper.finished(wait=True))
        self.keeper.check_failures()
        self._record_checkpoints(self.keeper.save(healthy, wait=wait))
        if wait:  # the run's last save: its outcome is known now
            self.keeper.check_failures()

    def _record_checkpoints(self, outcomes: list[dict[str, Any]]) -> None:
        for info in outcomes:  # saves whose outcome is known (written, withheld, failed)
            self.state.event(info["step"], info["kind"], info["reason"], **info["fields"])
            self.keeper.count_outcome(info)
            self.callbacks.fire("on_checkpoint", self.state, info)

    def evaluate(self) -> dict[str, float]:
        """Return ``{"val_loss": mean loss per item}`` over ``eval.batches`` fixed batches (one sync)."""
        t0 = time.perf_counter()
        out = validation_loss(self.task, self.module, self.precision, self.cfg.train.batch_size, self.cfg.eval.batches,
                              self.dist)
        self.boundary.excluded += time.perf_counter() - t0  # not counted in the interval's throughput
        return out
