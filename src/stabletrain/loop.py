"""The built-in fit loop: pulls windows, runs the one step (:mod:`stabletrain.step`), fires callbacks.

Everything else a run does is a callback (:mod:`stabletrain.callbacks`): the metrics sinks, the
checkpoint keeper (periodic save, LAST_GOOD, resume, rollback), the incident recorder (capture and
diagnosis), the signal handler. The loop owns the order of things and the one host sync per log
interval, where the guard decides (continue, stop, rollback) from the interval's rows.

Under DDP (``torchrun``; see :mod:`stabletrain.distributed.ddp`) the same loop runs on every rank: the
model is wrapped in ``DistributedDataParallel``, each rank reads its shard of the data order, and
every decision (skip, log, stop, rollback, checkpoint) is made from values that are the same on every
rank. Only rank 0 writes the run directory; checkpoints hold every rank's RNG state and data position.
"""

from __future__ import annotations

import contextlib
import gc
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from . import console
from .policies.accumulation import AccumulationWindow, sums_safe
from .callbacks import Callback, CallbackList, FitState, load_callbacks
from .services.checkpoints import CheckpointKeeper
from .services.incidents import IncidentRecorder
from .services.signals import SignalHandler
from .callbacks.sinks import EventLog, InitWatch, MetricsFile, ProgressBar, TensorBoardLog
from .callbacks.trackers import build_trackers
from .records.checkpoint import CheckpointManager
from .policies.clipping import GradClipper
from .config import Config
from .data import EpochOrder, Window, WindowStream
from .errors import task_part, user_location
from .evaluation import validation_loss
from .distributed.ddp import DistContext, PeerLostError, WindowCarrier, data_parallel, is_peer_failure
from .policies.guard import Guard, GuardDecision
from .diagnostics.initialization import InitFingerprint
from .policies.metrics import StepMetrics, interval_record, peak_memory_mib
from .numerics import unique_params
from .policies.optim import build_optimizer, check_materialized, check_optimizer_holds
from .policies.precision import PrecisionPolicy, resolve_device
from .records.rundir import RunDir, build_snapshot, refuse_if_running, this_process
from .policies.schedule import LRSchedule
from .seeding import deterministic_mode, rng_state, seed_everything, set_rng_state
from .step import TrainStep
from .tasks import Task, resolve_task

__all__ = ["Trainer", "default_run_dir", "DEFAULT_RUN_DIR"]

#: ``Trainer(run_dir=DEFAULT_RUN_DIR)``: ``runs/<Task.name>-<timestamp>`` (what ``stabletrain train`` uses).
DEFAULT_RUN_DIR = "<default run dir>"


def default_run_dir(cfg: Config, task_name: str | None = None) -> Path:
    """``runs/<task name>-<timestamp>``: the task's ``Task.name`` when known, else the config's task spec."""
    name = (task_name or cfg.task.split(":")[-1]).replace("/", "_").replace(":", "_")
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


@contextlib.contextmanager
def gc_frozen() -> Iterator[None]:
    """Keep the objects alive at the start out of the garbage collector's full scans while the block runs.

    A full (generation 2) collection walks every tracked object, and torch's imports alone leave
    hundreds of thousands: 150 ms measured on this 2-core machine, at a moment no one chooses, and under
    DDP every rank waits for it at the next collective. :func:`gc.freeze` moves the objects that exist
    now to a generation the collector does not scan; objects made during the block are collected as
    usual. At the end they are unfrozen again (and any garbage among them collected later), unless
    something had frozen objects before (then the caller's freeze stays as it was, with these added).
    """
    already = gc.get_freeze_count() > 0
    gc.freeze()
    try:
        yield
    finally:
        if not already:
            gc.unfreeze()


class Trainer:
    """Train ``task`` under ``cfg``: builds the policies and the step, runs the fit loop, fires callbacks.

    ``run_dir=None`` trains without writing anything (checks and tests). ``resume=True`` continues the
    run in ``run_dir`` from its LAST_GOOD checkpoint, refusing a config that differs in anything but
    ``config.RESUME_SAFE_KEYS`` (under another world size, resharded, also ``config.RESHARD_SAFE_KEYS``). ``callbacks``: your
    :class:`~stabletrain.callbacks.Callback` instances, fired after the built-in ones (the config key
    ``callbacks`` adds more by ``module:Class``).

    Under DDP (a process group of more than one rank) ``self.model`` is the ``DistributedDataParallel``
    wrapper and ``self.module`` the model itself. Every rank must construct the Trainer and call :meth:`fit`.
    """

    def __init__(self, cfg: Config, task: Task | None = None, run_dir: str | Path | None = None, *,
                 resume: bool = False, callbacks: Sequence[Callback] = ()) -> None:
        self.cfg = cfg.validate()
        seed_everything(cfg.seed)
        self.task = task if task is not None else resolve_task(cfg.task, cfg.task_args)
        if self.task.val_data is not None and len(self.task.val_data) == 0:
            warnings.warn(f"task {self.task.name!r}: Task.val_data is empty; no validation loss will be reported "
                          "(pass val_data=None to say so)", console.StableTrainWarning, stacklevel=2)
        check_materialized(self.task.model, self.task.name)  # lazy parameters: the optimizer could not hold them
        fingerprint = InitFingerprint.take(self.task.model) if not resume else None  # before anything can touch it
        self.dist = DistContext.current()
        self.device = resolve_device(cfg.device)
        if self.dist.enabled and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())  # cuda:LOCAL_RANK (process_group set it)
        self.precision = PrecisionPolicy(cfg.precision, self.device)
        self.module = self.task.model.to(self.device)
        self.model: nn.Module = self.module
        self.named_params = unique_params(self.module)
        if not self.named_params:
            raise ValueError(f"task {cfg.task!r}: the model has no trainable parameters")
        self.params = [p for _, p in self.named_params]
        carrier = numerics = None
        sums = sums_safe(self.params, self.precision)  # the window backpropagates raw loss sums
        self.sharded = self.dist.enabled and cfg.dist.strategy == "fsdp"
        if self.sharded:  # FSDP2: the parameters become DTensor shards under the same names
            from .distributed.fsdp import ShardedNumerics, ShardedPrecision, shard_model
            self.precision = ShardedPrecision(cfg.precision, self.device)  # fp16: every rank agrees on overflow
            if fingerprint is not None:  # InitWatch compares plain tensors: compare now, before sharding
                changes = fingerprint.compare(self.module)
                fingerprint = SimpleNamespace(compare=lambda module: changes)
            shard_model(self.module, self.task.blocks, reshard_after_forward=cfg.dist.reshard_after_forward,
                        precision=self.precision.mode)
            self.named_params = unique_params(self.module)
            self.params = [p for _, p in self.named_params]
            numerics = ShardedNumerics()
            carrier = WindowCarrier()  # carries nothing: names the rank whose own loss or inputs were non-finite
            seed_everything(int(np.random.SeedSequence([cfg.seed, self.dist.rank]).generate_state(1)[0]))
        elif self.dist.enabled:
            # DDP broadcasts rank 0's parameters and buffers; then each rank draws its own random stream.
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model, carrier = data_parallel(self.module, ids, sums=sums)  # the window's numbers ride the all-reduce
            seed_everything(int(np.random.SeedSequence([cfg.seed, self.dist.rank]).generate_state(1)[0]))
        self.optimizer = build_optimizer(self.named_params, cfg.optim, self.device, self.task.optimizer, sharded=self.sharded)
        self.schedule = LRSchedule(self.optimizer, cfg.sched.warmup_steps, cfg.train.max_steps, cfg.sched.decay,
                                   cfg.sched.min_lr_ratio)
        self.clipper = GradClipper(cfg.clip.max_norm)
        self.guard = Guard(cfg.guard, self.device)
        if self.sharded:
            from .distributed.fsdp import ShardedWindow
            self.window: AccumulationWindow = ShardedWindow(self.module, self.params)
        else:
            self.window = AccumulationWindow(self.params, sums=sums)
        self.step_fn = TrainStep(self.model, self.optimizer, self.precision, clipper=self.clipper, guard=self.guard,
                                 schedule=self.schedule, params=self.params, window=self.window, carrier=carrier,
                                 check_inputs=cfg.guard.check_inputs, check_params=cfg.guard.check_params,
                                 numerics=numerics)
        order = EpochOrder(len(self.task.train_data), cfg.train.batch_size, cfg.seed, cfg.data.shuffle,
                           rank=self.dist.rank, world_size=self.dist.world)
        self.stream = WindowStream(self.task.train_data, order, cfg.accum.steps, collate=self.task.collate,
                                   workers=cfg.data.workers, pin_memory=self.device.type == "cuda")
        self.metrics = StepMetrics(cfg.log.every, len(self.params), self.device, self.dist)
        self.state = FitState(cfg=cfg, task=self.task, module=self.module, named_params=self.named_params,
                              device=self.device, dist=self.dist, stream=self.stream, state_dict=self.state_dict,
                              load_state_dict=self.load_state_dict, run_step=self.train_step, precision=self.precision.mode)
        self.signals, self.keeper = SignalHandler(), CheckpointKeeper()
        self.recorder = IncidentRecorder(self.keeper)
        builtin = [self.signals, InitWatch(fingerprint), self.recorder, self.keeper, EventLog(), MetricsFile(),
                   TensorBoardLog(), *build_trackers(cfg.log.trackers, log=cfg.log), ProgressBar()]
        self.callbacks = CallbackList([*builtin, *callbacks, *load_callbacks(cfg.callbacks)])
        self._pending_eval: dict[str, float] = {}
        self._interval_start, self._eval_seconds = time.perf_counter(), 0.0
        self._agreed_signal: int | None = None  # DDP: the largest signal any rank had at the last log boundary
        self._where = "setup"  # what the loop is doing, for a clear message when a peer is lost
        self._params_held = self.sharded  # checked after the first step (FSDP: sharding needs the parameters built)
        if run_dir == DEFAULT_RUN_DIR:
            run_dir = default_run_dir(cfg, self.task.name)
        if run_dir is not None:
            run_dir = Path(self.dist.on_main(lambda: str(run_dir)))  # every rank uses rank 0's directory
            launch = self.dist.gather_objects(this_process())  # recorded in the run dir while this launch runs
            self.dist.on_main(lambda: refuse_if_running(run_dir, exclude=launch))  # never two launches on one run
            self.state.ckpt = CheckpointManager(run_dir / "checkpoints", keep=cfg.ckpt.keep)
            if resume:
                self.keeper.resume(self.state, run_dir)
            self.dist.on_main(lambda: self._open_run(run_dir, resume))
            if self.state.run is not None:
                self.state.run.record_launch(launch)
        elif resume:
            raise ValueError("resume needs a run directory (--resume RUN_DIR)")

    # The run's progress lives in the FitState the callbacks share; these read and write it.
    step = property(lambda self: self.state.step, lambda self, v: setattr(self.state, "step", v))
    samples_seen = property(lambda self: self.state.samples_seen, lambda self, v: setattr(self.state, "samples_seen", v))
    tokens_seen = property(lambda self: self.state.tokens_seen, lambda self, v: setattr(self.state, "tokens_seen", v))
    history = property(lambda self: self.state.history)
    stop_reason = property(lambda self: self.state.stop_reason)
    run = property(lambda self: self.state.run)
    ckpt = property(lambda self: self.state.ckpt)

    def _open_run(self, run_dir: Path, resume: bool) -> None:
        """Create the run directory and write config, snapshot and resume events (rank 0 only)."""
        run = self.state.run = RunDir(run_dir, resume=resume, overwrite=self.cfg.run.overwrite)
        run.write_config(self.cfg)
        if resume:
            for problem in self.keeper.problems:
                run.event(self.step, "checkpoint_skipped", problem)
                console.warn(f"resume skipped a checkpoint in {self.ckpt.root}: {problem}")
            self._say_resumed()
            dropped = run.drop_metrics_after(self.step)
            reshard = self.keeper.reshard_note
            run.event(self.step, "resume", f"resumed from {self.keeper.resumed_from} at step {self.step}"
                      + (f"; {reshard}" if reshard else "")
                      + (f"; {dropped} metrics line(s) after it superseded" if dropped else ""),
                      path=str(self.keeper.resumed_from), superseded_metrics=dropped, **(self.keeper.reshard or {}))
            if reshard:
                console.say(reshard)
            if self.keeper.schedule_change is not None:
                run.event(self.step, "schedule_changed", self.keeper.schedule_change, max_steps=self.cfg.train.max_steps)
                console.warn(self.keeper.schedule_change)
        else:
            extra: dict[str, Any] = {"task_info": self.task.info, "task_name": self.task.name,
                                     "count_unit": self.task.count_unit, "optimizer": type(self.optimizer).__name__}
            if self.dist.enabled:
                extra["world_size"] = self.dist.world
            run.write_snapshot(build_snapshot(self.cfg, self.device, self.precision.mode, self.task.data_fingerprint, extra))

    def _say_resumed(self) -> None:
        """Print where the run resumed from; after a skipped newer checkpoint, how many saved steps will be redone."""
        line = (f"resumed from step {self.step} (checkpoint {self.keeper.resumed_from}, world size {self.dist.world})")
        newest = max((int(d.name.removeprefix("step_")) for d in self.ckpt.checkpoints()), default=self.step)
        if self.keeper.problems and newest > self.step:
            line += (f"; the newest checkpoint (step {newest}) was skipped: {newest - self.step} step(s) will be "
                     "trained again")
        console.say(line)

    def train_step(self, window: Window, *, measure_update: bool = False, check_params: bool = True) -> dict[str, Tensor]:
        """Run the one optimizer step on ``window``; return its figures as device tensors (no sync)."""
        out = self.step_fn(list(zip(map(len, window.indices), window.batches)), self.task.loss,
                           measure_update=measure_update, check_params=check_params)
        if not self._params_held:  # once: layers the first forward made would never train
            check_optimizer_holds(self.module, self.optimizer, len(self.params), self.task.name)
            self._params_held = True
        return out

    # -- the fit loop ---------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``train.max_steps`` (or a stop); return the last metrics record.

        Under DDP a SIGTERM/SIGINT is acted on at the next log boundary, where the ranks agree on it
        (one rank may have seen it a step before another); a lost peer raises :class:`PeerLostError`.
        ``deterministic=true`` turns on torch's deterministic algorithms while fit() runs only
        (:func:`~stabletrain.seeding.deterministic_mode`); otherwise no global torch setting is touched.
        """
        try:
            with deterministic_mode(self.cfg.deterministic), gc_frozen():  # put back when fit() returns or raises
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
        record: dict[str, Any] = {}
        self._interval_start, self._eval_seconds = time.perf_counter(), 0.0
        try:
            self._where = "the step-0 checkpoint"
            fire("on_fit_start", state)
            if self.keeper.resumed_from is not None:
                fire("on_resume", state, {"step": state.step, "path": str(self.keeper.resumed_from)})
            if self.keeper.needs_first(state):
                self._checkpoint(healthy=True)
            while state.step < cfg.train.max_steps:
                window = self.stream.next_window()
                state.positions[state.step + 1] = (window.epoch, window.start)
                self._where = "a training step (window or gradient all-reduce)"
                nxt = state.step + 1
                # On the interval's last step only: ||update|| (one parameter copy) and the parameter check (one
                # pass; a failed check is pinned to its step by the capture's replay). No sync.
                last = nxt % cfg.log.every == 0 or nxt == cfg.train.max_steps
                out = self.train_step(window, measure_update=last,
                                      check_params=last or bool(cfg.ckpt.every and nxt % cfg.ckpt.every == 0))
                state.step, state.samples_seen = nxt, state.samples_seen + window.global_num_samples
                self.metrics.update(state.step, num_samples=window.global_num_samples, lr=self.schedule.lr(),
                                    loss_scale=self.precision.loss_scale(), **out)
                fire("on_step_end", state, out)
                done = state.step >= cfg.train.max_steps
                if done or (cfg.eval.every and state.step % cfg.eval.every == 0):
                    self._where = "the validation reduce"
                    self._pending_eval = self.evaluate()
                ckpt_due = bool(cfg.ckpt.every) and state.step % cfg.ckpt.every == 0
                # Under DDP a signal waits for the next log boundary, where every rank learns of it.
                signalled = self.signals.signal is not None and not self.dist.enabled
                if not (done or ckpt_due or signalled or state.step % cfg.log.every == 0):
                    continue
                self._where = "the log-interval reduce (or an incident replay or rollback)"
                record, decision, rows = self._log()
                # A background save that finished is recorded now; one that a replay or rollback needs is waited for.
                self._record_checkpoints(self.keeper.finished(
                    wait=decision.first_incident is not None or decision.action == "rollback"))
                healthy = self._act(decision, rows)
                if state.stop_reason is not None:
                    break
                if decision.action != "rollback":  # after a rollback: back at LAST_GOOD, nothing new to save
                    stop_signal = self._agreed_signal if self.dist.enabled else self.signals.signal
                    if done or ckpt_due or stop_signal:
                        self._where = "the checkpoint gather"
                        self._checkpoint(healthy, wait=done or bool(stop_signal))  # the last one is waited for
                    if stop_signal:
                        self.signals.signal = stop_signal
                        self._stop(f"stopped by {SignalHandler.name(stop_signal)} at step {state.step}")
                        break
                state.positions = {s: p for s, p in state.positions.items() if s > state.step}
                self.recorder.mark_interval_start(state)
        except Exception as err:  # the record keeps what ended the run, with the user's file:line
            if not self._peer_lost(err):
                self._record_checkpoints(self.keeper.finished(wait=True))  # the crash stays the last event
                where, part = user_location(err), task_part(err)
                failed = state.step + 1 if self._where.startswith("a training step") else state.step
                state.event(state.step, "crash", f"{type(err).__name__}: {err}" + (f" (at {where})" if where else ""),
                            error=type(err).__name__, message=str(err), location=where, during=self._where, part=part,
                            failed_step=failed)
            raise
        finally:
            try:
                self._record_checkpoints(self.keeper.finished(wait=True))  # no save outlives the fit
            finally:
                fire("on_fit_end", state, record)
                if state.run is not None:
                    state.run.close()
        return record

    def _peer_lost(self, err: BaseException) -> bool:
        """Whether ``err`` is a collective failing for want of a peer (:func:`~stabletrain.distributed.ddp.is_peer_failure`)."""
        carrier = self.step_fn.carrier  # DDP: knows whether the error came out of the gradient all-reduce
        in_sync = bool(getattr(carrier, "in_gradient_sync", False))
        return self.dist.enabled and is_peer_failure(err, in_gradient_sync=in_sync)

    def _log(self) -> tuple[dict[str, Any], GuardDecision, list[Any]]:
        """Reduce the interval (its one host sync), let the guard read it, fire ``on_log``."""
        state = self.state
        summary, rows, param_sq = self.metrics.reduce(self.signals.signal or 0,  # DDP: one all-gather
                                                      annotate=self.guard.mark_spikes)
        self._agreed_signal = summary["interval_signal"] or None  # DDP: every rank stops here if any was signalled
        now = time.perf_counter()
        elapsed, self._interval_start, self._eval_seconds = now - self._interval_start - self._eval_seconds, now, 0.0
        state.tokens_seen += summary["interval_tokens"]
        decision = self.guard.decide(rows)
        progress = {"num_incidents": self.guard.num_incidents, "num_rollbacks": self.guard.num_rollbacks,
                    "peak_memory_mib": peak_memory_mib(self.device), "epoch": self.stream.epoch,
                    "samples_seen": state.samples_seen, "tokens_seen": state.tokens_seen}
        extra = {**self._pending_eval, **({"world_size": self.dist.world} if self.dist.enabled else {})}
        record = interval_record(summary, param_sq, [n for n, _ in self.named_params], elapsed,
                                 top_layers=self.cfg.log.top_layers, progress=progress, extra=extra)
        self._pending_eval = {}
        state.history.append(record)
        self.callbacks.fire("on_log", state, record, rows)
        return record, decision, rows

    def _act(self, decision: GuardDecision, rows: list[Any]) -> bool:
        """Fire the incident, then stop or roll back as decided; return whether the state is healthy."""
        state = self.state
        if decision.first_incident is not None:  # every rank fires it: the capture's replay has collectives
            row = next(r for r in rows if r.step == decision.first_incident)
            info = {"step": row.step, "after_update": decision.after_update, "ranks": list(row.ranks or []),
                    "loss": row.values["loss"], "grad_norm": row.values["grad_norm"], "locate": decision.locate}
            self.callbacks.fire("on_incident", state, info)
            if info.get("pinned") is not None:  # the capture's replay found the update that broke the parameters
                decision.pin(info["pinned"])
        if decision.action == "stop":
            self._stop(decision.reason)
            return False
        if decision.action == "rollback":
            spikes = decision.spike_steps if self.cfg.guard.on_spike == "rollback" else []
            info = self.keeper.rollback(state, sorted(set(decision.bad_steps) | set(spikes)), decision.reason,
                                        self.guard.counters_kept)
            if info is None:
                self._stop(state.stop_reason or decision.reason)
                return False
            state.event(state.step, "rollback", info["reason"], **{k: v for k, v in info.items() if k != "reason"})
            self.callbacks.fire("on_rollback", state, info)
            return True
        # A skipped step leaves the pre-step state (healthy, whether or not it ends the run); only parameters an
        # applied update made non-finite are unsafe to save (the checkpoint also checks every tensor it writes).
        return decision.params_bad_at is None and not decision.after_update

    def _stop(self, reason: str) -> None:
        self.state.stop_reason = reason
        self.state.event(self.step, "stop", f"stopping: {reason}")
        self.callbacks.fire("on_stop", self.state, reason)

    def _checkpoint(self, healthy: bool, wait: bool = False) -> None:
        # The previous save's outcome first: after ckpt.max_failures failed saves in a row the run stops here.
        self._record_checkpoints(self.keeper.finished(wait=True))
        self.keeper.check_failures(self.state)
        self._record_checkpoints(self.keeper.save(self.state, healthy, wait=wait))
        if wait:  # the run's last save: its outcome is known now
            self.keeper.check_failures(self.state)

    def _record_checkpoints(self, outcomes: list[dict[str, Any]]) -> None:
        for info in outcomes:  # saves whose outcome is known (written, withheld, failed)
            self.state.event(info["step"], info["kind"], info["reason"], **info["fields"])
            self.callbacks.fire("on_checkpoint", self.state, info)

    def evaluate(self) -> dict[str, float]:
        """Return ``{"val_loss": mean loss per item}`` over ``eval.batches`` fixed batches (one sync)."""
        t0 = time.perf_counter()
        out = validation_loss(self.task, self.module, self.precision, self.cfg.train.batch_size, self.cfg.eval.batches,
                              self.dist)
        self._eval_seconds += time.perf_counter() - t0  # not counted in the interval's throughput
        return out

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self, *, local: bool = False, dcp: bool = False) -> dict[str, Any]:
        """Everything the next step depends on (model, optimizer, policies, data position, RNG, counters, callbacks).

        This rank's: under DDP a checkpoint adds every rank's RNG state and data position (``ranks``).
        ``local=True`` under FSDP: the model and optimizer entries are this rank's own shards, live views
        (no collective, no copy: :func:`stabletrain.distributed.fsdp.local_state_dicts`), for the incident snapshot.
        ``dcp=True`` under FSDP: DCP's sharded state dicts, FQN keys and DTensor values (no collective, no
        copy: :func:`stabletrain.distributed.sharded_checkpoint.sharded_state_dicts`), for a sharded checkpoint.
        """
        if self.sharded and dcp:
            from .distributed.sharded_checkpoint import sharded_state_dicts
            model_state, optim_state = sharded_state_dicts(self.module, self.optimizer)
        elif self.sharded and local:
            from .distributed.fsdp import local_state_dicts
            model_state, optim_state = local_state_dicts(self.module, self.optimizer)
        elif self.sharded:  # a collective: full (unsharded) state dicts, the same format as DDP's or one process's
            from .distributed.fsdp import full_state_dicts
            model_state, optim_state = full_state_dicts(self.module, self.optimizer, self.named_params)
        else:
            model_state, optim_state = self.module.state_dict(), self.optimizer.state_dict()
        return {
            "model": model_state,
            "optimizer": optim_state,
            "schedule": self.schedule.state_dict(),
            "precision": self.precision.state_dict(),
            "clipper": self.clipper.state_dict(),
            "guard": self.guard.state_dict(),
            "metrics": self.metrics.state_dict(),
            "stream": self.stream.state_dict(),
            "rng": rng_state(),
            "counters": {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen},
            "callbacks": self.callbacks.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or a checkpoint: this rank's RNG and data position from ``ranks``).

        A checkpoint written under another world size is resharded: the full model and optimizer state
        load into any world size; the data continues from the same global sample position
        (:class:`~stabletrain.data.WindowStream`); rank r takes rank r's saved RNG state, and a rank
        that did not exist a state seeded from (seed, rank, step). A sharded (DCP) checkpoint's model and
        optimizer are read shard by shard (a collective), under any strategy and world size.
        """
        ranks = state.get("ranks")
        if ranks is None and int(state["stream"].get("world_size", self.dist.world)) != self.dist.world:
            ranks = [{"rng": state["rng"], "stream": state["stream"]}]  # a one-process checkpoint, under another world
        if ranks is not None:  # else: this rank's own state (a round trip)
            if len(ranks) != self.dist.world and "global_batch" not in ranks[0]["stream"]:
                raise ValueError(f"the state was written by {len(ranks)} process(es), before checkpoints recorded "
                                 f"their data layout, and this run has {self.dist.world}; resume it under {len(ranks)}")
            mine = ranks[self.dist.rank] if self.dist.rank < len(ranks) else None
            state = {**state, "rng": mine["rng"] if mine else None, "stream": (mine or ranks[0])["stream"]}
        from .distributed.fsdp import is_local_state, load_local_state_dicts
        from .distributed.sharded_checkpoint import is_dcp_entry, load_dcp_state_dicts
        if is_dcp_entry(state["model"]):  # a collective: DCP reads each rank's part (any world size, any strategy)
            load_dcp_state_dicts(self.module, self.optimizer, state["model"], state["optimizer"])
        elif self.sharded and is_local_state(state["model"]):  # this rank's own shards, copied back in place
            load_local_state_dicts(self.module, self.optimizer, state["model"], state["optimizer"])
        elif self.sharded:  # a collective: rank 0's full state is broadcast, each rank keeps its shards
            from .distributed.fsdp import load_full_state_dicts
            load_full_state_dicts(self.module, self.optimizer, self.named_params, state["model"], state["optimizer"])
        else:
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])  # after the optimizer: rewrites its lr tensors
        self.precision.load_state_dict(state["precision"])
        self.clipper.load_state_dict(state["clipper"])
        self.guard.load_state_dict(state["guard"])
        self.metrics.load_state_dict(state["metrics"])
        self.stream.load_state_dict(state["stream"])
        self.callbacks.load_state_dict(state.get("callbacks", {}))
        c = state["counters"]
        self.step, self.samples_seen, self.tokens_seen = int(c["step"]), int(c["samples_seen"]), float(c["tokens_seen"])
        if state["rng"] is not None:
            set_rng_state(state["rng"])
        else:  # a rank the checkpoint's run did not have: its own stream, reproducible from (seed, rank, step)
            seed_everything(int(np.random.SeedSequence([self.cfg.seed, self.dist.rank, self.step]).generate_state(1)[0]))
