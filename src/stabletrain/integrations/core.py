"""What every adapter adds to a host's run: the run directory, device-side metrics, the sentinel, incidents.

An adapter (:class:`stabletrain.Monitor`, the Lightning and Hugging Face callbacks) hands a :class:`RunSession` the
host's step; the session does the rest with a built-in run's pieces (the guard, the metrics, the run directory and the
callbacks that write it, the loop's :class:`~stabletrain.services.boundary.IntervalBoundary` and
:class:`~stabletrain.services.capture.IncidentCapture`, fed by :class:`~stabletrain.services.kept_steps.HostSteps`)::

    session.open(resume); session.begin()        # run dir (rank 0): config.yaml, snapshot.json; on_fit_start
    each optimizer step (no host sync):
        session.pending.add(batch, count)        # a micro-batch (and the RNG state at the step's first)
        session.before_host_step(norms)          # kept for a replay; the sentinel and the skip on the device
        ... the host applies the step ...        # (HostStep.before_step; Monitor: TrainStep.update)
        out = host_step.after_step(count)        # applied, the parameter check, ||update|| on an interval's last
        session.record_host_step(out, ...)       # StepMetrics.update, on_step_end; each log_every: the boundary (ONE sync)

A bad step is skipped (on the device) and nothing else: every healthy update is applied as the host would apply it.
Under DDP every rank runs a session: the verdict is the same on every rank without a collective of its own
(:class:`~stabletrain.distributed.carrier.LossWatch`), each interval's figures are gathered in one all-gather, and
rank 0 alone writes the run directory."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .. import console
from .._version import __version__
from ..callbacks import Callback, CallbackList
from ..callbacks.sinks import EventLog, InitWatch, MetricsFile, TensorBoardLog
from ..callbacks.trackers import build_trackers
from ..config import AdapterOptions, ClipConfig, Config, TrainConfig, config_hash
from ..diagnostics.initialization import InitFingerprint
from ..distributed.carrier import LossWatch
from ..distributed.group import DistContext
from ..distributed.strategy import strategy_for
from ..errors import crash_event
from ..fileio import atomic_write
from ..host_step import HostStep
from ..internals import is_compiled, unwrap
from ..numerics import unique_params
from ..policies.guard import Guard
from ..policies.metrics import StepMetrics
from ..records.batches import batch_size
from ..records.jsonl import json_safe
from ..records.provenance import build_snapshot, host_reproducibility, installed_versions, optimizer_config, optimizer_names
from ..records.rundir import RunDir
from ..runstate import RunState
from ..services.boundary import IntervalBoundary
from ..services.capture import IncidentCapture
from ..services.init_signal import host_signal, record_signal
from ..services.kept_steps import HostReplay, HostSteps, PendingStep

__all__ = ["RunSession"]

#: The host trainers' own distributions, whose versions a new run's snapshot records.
HOST_LIBRARIES = {"lightning": ("lightning",), "transformers": ("transformers", "accelerate")}


class RunSession:
    """One adapter's run: the run directory, metrics, guard, callbacks, captures. See the module docstring.

    Args:
        run_dir: the run directory (None: measure and guard without writing anything).
        model: the module being trained (the host's; a ``DistributedDataParallel`` wrapper is looked through).
        host: "monitor", "lightning" or "transformers" (written to ``config.yaml`` and the snapshot).
        options: :class:`~stabletrain.config.adapter.AdapterOptions`.
        precision: the precision the host really runs: "fp32", "bf16" or "fp16" (a GradScaler scales the loss).
        clip_max_norm: the global-norm clipping threshold in effect (None: no clipping).
        host_config: the host trainer's own arguments, written under ``host`` in ``config.yaml``.
        optimizer: the torch optimizer (not a host's wrapper).
        scaler: the host's ``GradScaler`` (fp16), else None.
        replay: how to replay the host's step (:class:`~stabletrain.services.kept_steps.HostReplay`); None: no bad step
            is captured (nothing would replay or diagnose it).
        recipes: how to rebuild the model and loss in a new process (:mod:`~stabletrain.records.captured`).
        callbacks: stabletrain :class:`~stabletrain.callbacks.Callback` instances, fired after the built-in ones.
        tracker_hosts: tracker name -> (a callable returning the host's own run of that tracker, the host object it
            comes from), e.g. a Lightning ``MLFlowLogger``'s client and run id: written into instead of a new run.
    """

    def __init__(self, run_dir: str | Path | None, model: nn.Module, *, host: str, options: AdapterOptions,
                 precision: str = "fp32", clip_max_norm: float | None = None, host_config: dict[str, Any] | None = None,
                 optimizer: torch.optim.Optimizer | None = None, scaler: Any = None, replay: HostReplay | None = None,
                 recipes: dict[str, Any] | None = None, callbacks: Sequence[Callback] = (), overwrite: bool = False,
                 fingerprint: InitFingerprint | None | str = "take",
                 tracker_hosts: dict[str, tuple[Callable[[], Any], Any]] | None = None, compiled: bool = False) -> None:
        self.options, self.dist = options, DistContext.current()
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.model = unwrap(model)
        self.host, self.precision, self.optimizer, self.scaler = host, precision, optimizer, scaler
        self.recipes, self.overwrite, self.host_config = dict(recipes or {}), overwrite, host_config or {}
        self.named_params = unique_params(self.model)
        if not self.named_params:
            raise ValueError(f"{type(self.model).__name__} has no trainable parameters")
        self.params, self.clip_max_norm = [p for _, p in self.named_params], clip_max_norm
        self.device = self.params[0].device
        # train.compile records a host-compiled model (``compiled``: the host says so where the model it hands over is
        # not the compiled one): the bundle's config says so, and the diagnosis that it replayed eagerly.
        cfg = Config(precision=precision, device=str(self.device), clip=ClipConfig(max_norm=clip_max_norm),
                     train=TrainConfig(compile=compiled or is_compiled(model)))
        cfg.log.progress, cfg.guard.on_nonfinite = False, "skip" if options.on_nonfinite == "warn" else options.on_nonfinite
        self.cfg = options.project(cfg, self.dist.world)  # the options as the built-in run's keys, validated as there
        self.guard = Guard(self.cfg.guard, self.device, enforce=options.on_nonfinite != "warn", scaled=scaler is not None,
                           host=host)  # (the host shows its own progress; its stops name the adapter's options)
        self.metrics = StepMetrics(options.log_every, len(self.params), self.device, self.dist, local=("loss", "count"))
        if fingerprint == "take":
            fingerprint = InitFingerprint.take(self.model) if options.init_check else None
        self.fingerprint = fingerprint if options.init_check else None
        self.replay, self.epoch = replay, math.nan  # (a host that tells none, a Monitor's loop: not measured)
        self.evaluated: dict[str, Any] = {}  # the host's last evaluation: val_loss and val_step, in the next record
        self.started = self.closed = self.signal_checked = False
        self.trackers = build_trackers(options.trackers, hosts=tracker_hosts)
        self.callbacks = CallbackList([InitWatch(self.fingerprint), EventLog(), MetricsFile(), TensorBoardLog(),
                                       *self.trackers, *callbacks])
        # The run's state has the parts an adapter measures with; the host owns the rest (model, optimizer, data).
        self.state = RunState(cfg=self.cfg, task=None, module=self.model, named_params=self.named_params,
                              device=self.device, dist=self.dist, precision=precision, guard=self.guard,
                              metrics=self.metrics, callbacks=self.callbacks, run_dir=self.run_dir)
        self.strategy = strategy_for(self.cfg, self.dist, self.device)  # DDP under a process group: snapshot shares
        self.steps = HostSteps(self, replay, options.keep_max_mib)
        self.capture = IncidentCapture(self.steps)
        self.boundary = IntervalBoundary(self.state, self.capture.capture, top_layers=options.top_layers,
                                         epoch=lambda: self.epoch, count_samples=True)
        self.loss_watch = LossWatch(self.params) if self.dist.world > 1 else None  # a rank's NaN reaches every rank
        self.host_step: HostStep | None = None  # judge_host_steps: a host that steps its optimizer itself
        self.pending = PendingStep()

    # The run's progress lives in the RunState its callbacks share.
    step = property(lambda self: self.state.step, lambda self, v: setattr(self.state, "step", v))
    samples_seen = property(lambda self: self.state.samples_seen, lambda self, v: setattr(self.state, "samples_seen", v))
    tokens_seen = property(lambda self: self.state.tokens_seen, lambda self, v: setattr(self.state, "tokens_seen", v))
    history, run, stop_reason = (property(lambda self, k=k: getattr(self.state, k)) for k in ("history", "run", "stop_reason"))

    @property
    def capturing(self) -> bool:
        """Whether an incident can be captured: asked for, a run directory on rank 0, the steps replayable (``loss_fn=``)."""
        return self.steps.capturing() and self.steps.replay is not None

    # -- the run directory -------------------------------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        """What ``config.yaml`` holds: the adapter's arguments, in the built-in config's key names where they exist."""
        return {"integration": self.host, "task": type(self.model).__name__, "precision": self.precision,
                "device": str(self.device), "clip": {"max_norm": self.clip_max_norm}, **self.options.sections(self.cfg),
                "optim": optimizer_config(self.optimizer) if self.optimizer is not None else {},
                "host": json_safe(self.host_config),
                **({"train": {"compile": True}} if self.cfg.train.compile else {}),  # the host compiled its model
                **({"world_size": self.dist.world} if self.dist.world > 1 else {})}

    def open(self, resume: bool = False) -> None:
        """Create (or, resuming, reopen) the run directory; write config.yaml and, on a new run, snapshot.json."""
        if self.run is not None or self.run_dir is None or self.dist.rank != 0:
            return
        import yaml

        config = self.config_dict()  # (resuming, the directory must hold this host's run of this model)
        self.state.run = RunDir(self.run_dir, resume=resume, overwrite=self.overwrite, host=self.host, model=config["task"])
        atomic_write(self.run.path / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        if not resume:
            extra = {"integration": self.host, "model": type(self.model).__name__, **optimizer_names(self.optimizer),
                     "config_hash": config_hash(config),  # (what config.yaml holds: the internal config hid the host's)
                     **host_reproducibility(self.host, self.host_config),
                     "host_versions": installed_versions(*HOST_LIBRARIES.get(self.host, ()))}
            self.run.write_snapshot(build_snapshot(self.cfg, self.device, self.precision, None, extra))

    def begin(self) -> None:
        """The host's fit starts: fire ``on_fit_start`` (the init fingerprint is compared: one host read, once)."""
        if self.started:
            return
        self.started, self.fingerprint = True, None  # (InitWatch holds its own)
        self.boundary.restart()
        self.callbacks.fire("on_fit_start", self.state)
        self.capture.mark_interval_start(self.step, self.capturing)

    def signal_check(self, batch: Any, loss_fn: Callable[[nn.Module, Any], Any]) -> dict[str, Any] | None:
        """The signal-propagation report on ``batch`` (:mod:`~stabletrain.services.init_signal`), once: the RNG kept,
        ``RUN_DIR/init_signal.json`` and a line in the snapshot written. Forces a few host syncs."""
        if not self.options.init_check or self.step > 0 or self.signal_checked:  # (once: a host's own skips keep step 0)
            return None
        self.signal_checked = True
        found = host_signal(self.model, batch, loss_fn, label=f"{type(self.model).__name__} at step 0", replay=self.replay)
        if found is not None and self.run is not None:
            record_signal(self.run, *found)
        return found[1] if found is not None else None

    # -- per step (no host sync) -------------------------------------------------------------------

    def watch_loss(self, loss: Tensor) -> None:
        """Before the host backpropagates a micro-batch's ``loss`` (DDP only; no sync): :class:`LossWatch`."""
        if self.loss_watch is not None:
            self.loss_watch.watch(loss)

    def keep(self, micro_batches: list[Any], rng: dict[str, Any] | None, host: dict[str, Any] | None = None) -> None:
        """Just before the host's optimizer step: keep what a replay of it needs (its micro-batches, RNG state, lrs, loss
        scale), and let the interval snapshot's copies complete first (CUDA; no sync)."""
        self.steps.keep(self.step + 1, micro_batches, rng, host)
        self.capture.snapshot.before_update()

    def judge_host_steps(self, optimizer: torch.optim.Optimizer, scaler: Any, *, host_clip: float | None,
                         own_clip: float | None, skip_hint: str) -> HostStep:
        """The host steps its optimizer itself: judge each of its steps with a :class:`~stabletrain.host_step.HostStep`."""
        o = self.options
        self.host_step = HostStep(self.model, optimizer, scaler, self.guard, self.params, host_clip=host_clip,
                                  own_clip=own_clip, may_skip=o.on_nonfinite != "warn" or o.on_spike == "skip",
                                  check_params=o.check_params, skip_hint=skip_hint)
        return self.host_step

    def before_host_step(self, norm: Tensor, per_param: Tensor, *, grads_scaled: bool) -> None:
        """Just before the host's optimizer step: keep the pending step, judge it (the skip on the device; no sync);
        ||update|| on an interval's last step (the run's last too, where the host says which: ``final_step``)."""
        p, nxt, every = self.pending, self.step + 1, self.options.log_every
        self.keep(p.micro, p.rng, p.host)
        self.host_step.before_step(p.window_loss, norm, per_param, grads_scaled=grads_scaled, measure_update=nxt % every == 0
                                   or nxt == self.host_config.get("final_step"))

    def record_host_step(self, out: dict[str, Tensor], *, epoch: int, lr: Tensor | float) -> dict[str, Any] | None:
        """Record the host's step (:meth:`record`); the next one starts. Returns the interval's record if it logged."""
        micro, self.pending, self.epoch = self.pending.micro, PendingStep(), epoch
        logged = self.record(out, num_samples=sum(batch_size(b) for b in micro), lr=lr,
                             loss_scale=self.host_step.loss_scale())
        return self.history[-1] if logged else None

    def record(self, out: dict[str, Tensor], *, num_samples: int, lr: Tensor | float, loss_scale: Tensor | float) -> bool:
        """Record one optimizer step's device tensors; at a log boundary run :meth:`log`. Return whether it logged.
        ``num_samples``, ``out["loss"]`` and ``out["count"]``: this rank's own (gathered at the boundary under DDP)."""
        if self.loss_watch is not None:
            self.loss_watch.poison = None
        self.step += 1
        if self.dist.world > 1:
            out = {**out, "local_nonfinite": out["loss"] * 0 != 0}  # this rank's own loss: names the rank
        self.metrics.update(self.step, num_samples=num_samples, lr=lr, loss_scale=loss_scale, **out)
        self.callbacks.fire("on_step_end", self.state, out)
        if self.step % self.options.log_every == 0:
            self.log()
            return True
        return False

    def evaluation(self, val_loss: float) -> None:
        """The host evaluated after this step: in the next record (the last one's where none follows: :meth:`close`)."""
        self.evaluated = {} if self.closed else {"val_loss": val_loss, "val_step": self.step}  # (after its fit: not ours)

    # -- at a log boundary (one host sync) ---------------------------------------------------------

    def log(self) -> dict[str, Any]:
        """Reduce the interval (its one sync), write the record and events, capture an incident, stop or warn."""
        if len(self.metrics) == 0:
            return {}
        (record, decision, rows, _), self.evaluated = self.boundary.log(extra=self.evaluated or None), {}
        self.boundary.incident(decision, rows)
        self.capture.mark_interval_start(self.step, self.capturing)
        warn = self.options.on_nonfinite == "warn"
        if decision.action == "stop" and not warn:  # (said where the host stops quietly: Monitor raises StopTraining)
            if self.host != "monitor" and self.dist.rank == 0 and not self.closed:
                console.say(f"the {self.host} run stops at step {self.step}: {decision.reason} (events.jsonl)")
            self.state.stop(decision.reason)
        elif warn and (decision.action == "stop" or decision.bad_steps):
            warnings.warn(f"{decision.reason} (on_nonfinite='warn': training goes on)" if decision.action == "stop" else
                          f"non-finite loss or grad norm at step(s) {decision.bad_steps} (on_nonfinite='warn': not "
                          "skipped by stabletrain)", console.StableTrainWarning, stacklevel=console.user_stacklevel())
        return record

    # -- end and state -----------------------------------------------------------------------------

    def close(self, err: BaseException | None = None) -> None:
        """Log the last partial interval, fire ``on_fit_end``, close the run directory's files. Idempotent. ``err``: the
        exception that ended the host's run, recorded first as a ``crash`` event (with the user's file:line)."""
        if self.closed:
            return
        self.closed = True
        if err is not None:
            reason, fields = crash_event(err, "the host's training step")
            self.state.event(self.step, "crash", reason, own=True, **fields)
        if self.host_step is not None:
            self.host_step.close()
        record: dict[str, Any] = {}
        try:
            if len(self.metrics) and (err is None or self.dist.world == 1):  # (a crash on one rank: no collective)
                record = self.log()
            elif self.evaluated:  # the host evaluated after the last record, which no record follows: into it
                self.boundary.amend(self.evaluated)
        finally:
            if self.loss_watch is not None:
                self.loss_watch = self.loss_watch.remove()  # (None)
            self.callbacks.fire("on_fit_end", self.state, record or (self.history[-1] if self.history else {}))
            if self.run is not None:
                self.run.close()

    def state_dict(self) -> dict[str, Any]:
        """The session's state (progress, guard, the partial interval's metrics, callbacks): saved in the host's checkpoint."""
        return {"version": __version__, **self.state.progress_state("guard", "metrics", "callbacks", "precursor")}

    def load_state_dict(self, state: dict[str, Any], *, event: bool = True, path: str | None = None) -> None:
        """Restore :meth:`state_dict` (the host resumed from its checkpoint); record a ``resume`` event."""
        self.state.load_progress_state(state)
        self.fingerprint = None  # the host loaded its weights: that is no overwritten init
        self.started = False
        if event:  # (the metrics lines past it superseded, as the loop's resume does: a trial found them twice)
            dropped, aside = self.run.supersede_after(self.step) if self.run is not None else (0, [])  # (as the loop's)
            self.state.event(self.step, "resume", f"resumed from {path or 'the host trainer checkpoint'} at step {self.step}"
                             + (f"; {dropped} metrics line(s) after it superseded" if dropped else "")
                             + (f"; the incidents after it set aside: {', '.join(aside)}" if aside else ""), path=path,
                             superseded_metrics=dropped, superseded_incidents=aside)
            if self.dist.rank == 0:
                console.say(f"resumed from step {self.step} ({path or 'the host trainer checkpoint'})")

