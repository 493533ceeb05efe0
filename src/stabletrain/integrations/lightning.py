"""stabletrain inside the Lightning ``Trainer``: one callback, the same run directory as a built-in run.

::

    from stabletrain.integrations.lightning import StableTrainCallback
    trainer = L.Trainer(..., callbacks=[StableTrainCallback(run_dir="runs/exp1")])

Where each hook does its part of the step (automatic optimization, one optimizer)::

    setup                       init fingerprint (before configure_model and the strategy touch the module)
    on_fit_start                run dir opened on rank 0 (or reopened when resuming from ckpt_path); our state restored
    on_train_start              on_fit_start of stabletrain's callbacks (an init overwritten since setup is an
                                event); the interval snapshot
    on_train_epoch_start        a step left pending (its module's on_train_batch_start returned -1) dropped
    on_train_batch_start        the micro-batch, its batch_idx and the RNG state kept; first batch: signal report
    on_before_backward          the loss (unscaled when a GradScaler scaled it) summed over the micro-batches
    on_before_optimizer_step    the step's pre-clip norms and sentinel (HostStep.before_step): the skip decided
                                on the device; stabletrain's own clipping when asked (clip_max_norm); none, not
                                recorded, where every training_step returned None (Lightning's own skip)
    [Lightning clips, then steps]
    on_train_batch_end          applied, params check, StepMetrics.update; every log_every steps the interval's
                                one sync: metrics.jsonl, events, TensorBoard, the ``log_dict`` mirror (when the
                                trainer has a logger), incident capture + diagnosis, ``trainer.should_stop``
    on_validation_end           what the module logged as val_loss: in the next interval's record (at val_step)
    state_dict/load_state_dict  our state travels in Lightning's own checkpoint (callbacks[...])

A capture replays the interval's steps as Lightning ran them (``_LightningReplay``), the diagnosis the module's own
``training_step``. With ``strategy="ddp"`` every rank runs the callback; rank 0 writes. Lightning's LR scheduler
still advances on a skipped step (its loop has no hook to hold it without a host read)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from torch import Tensor

from ..callbacks import Callback as StableCallback
from ..callbacks.trackers import logger_runs
from ..config import AdapterOptions
from ..data import move_to
from ..diagnostics.initialization import InitFingerprint
from ..host_step import clip_as_judged
from ..internals import skips_on_device
from ..numerics import grad_norms
from ..policies.metrics import host_figures
from ..records.batches import batch_size
from ..records.captured import lightning_loss, loss_recipe, model_recipe
from ..services.kept_steps import HostReplay, KeptStep, PendingStep, current_lrs
from .core import RunSession

__all__ = ["StableTrainCallback"]


class StableTrainCallback(pl.Callback):
    """Metrics, sentinel, incidents and the run directory for a Lightning ``Trainer``. See the module docstring.

    Args:
        run_dir: the run directory (None: measure and guard, write nothing).
        clip_max_norm: clip the global grad norm to this value (stabletrain does it, before Lightning's own
            step): for a fused optimizer under mixed precision, which Lightning cannot clip. Leave None when
            the trainer clips (``gradient_clip_val``): stabletrain then measures and never clips twice.
        loss_fn: ``loss_fn(module, batch)`` for the diagnosis (default: the module's ``training_step(batch, i)``,
            its ``"loss"`` when it returns a dict).
        count_fn: ``count_fn(batch)`` -> the tokens (or items) the loss covers, for ``tokens_per_s``
            (default: the samples in the batch).
        overwrite: replace a run already in ``run_dir`` (a new fit, not a resume).
        callbacks: stabletrain :class:`~stabletrain.callbacks.Callback` instances fired with the built-in sinks.
        options: :class:`~stabletrain.config.adapter.AdapterOptions` (``log_every``, ``on_nonfinite``, ...; with
            ``trackers=["mlflow"]`` (or "wandb") and the trainer's own ``MLFlowLogger`` (``WandbLogger``), stabletrain
            writes into that logger's run, and the mirror skips that logger: no figure twice).
    """

    def __init__(self, run_dir: str | Path | None = None, *, clip_max_norm: float | None = None,
                 loss_fn: Callable[[Any, Any], Any] | None = None, count_fn: Callable[[Any], Any] | None = None,
                 overwrite: bool = False, callbacks: Sequence[StableCallback] = (), **options: Any) -> None:
        self.run_dir, self.loss_fn, self.count_fn, self.overwrite = run_dir, loss_fn, count_fn, overwrite
        self.clip_max_norm = clip_max_norm
        self.options = AdapterOptions(**options).checked(clip_max_norm=clip_max_norm, loss_fn=loss_fn, count_fn=count_fn,
                                                         run_dir=run_dir, overwrite=overwrite, callbacks=callbacks)
        self.stable_callbacks, self.session = list(callbacks), None  # (session: a RunSession, from on_fit_start)
        self._fingerprint: InitFingerprint | None = None
        self._loaded: dict[str, Any] | None = None
        self._host_skip = False  # this step's training_steps all returned None

    @property
    def state_key(self) -> str:
        return "StableTrainCallback"

    # -- fit start ---------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and self.options.init_check and trainer.ckpt_path is None:
            fp = InitFingerprint.take(pl_module)
            self._fingerprint = fp if fp.params else None  # layers made in configure_model: nothing to compare

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._loaded = state_dict  # applied once the session exists (on_fit_start)

    def state_dict(self) -> dict[str, Any]:
        return self.session.state_dict() if self.session is not None else {}

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"StableTrainCallback supports one optimizer; this LightningModule configures "
                             f"{len(trainer.optimizers)} (use stabletrain.Monitor in a manual-optimization training_step)")
        if not pl_module.automatic_optimization:
            raise ValueError("StableTrainCallback needs automatic optimization (self.automatic_optimization = True): "
                             "with manual optimization use stabletrain.Monitor in training_step")
        optimizer = trainer.optimizers[0]
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        precision = str(trainer.precision)
        mode = "fp16" if scaler is not None else "bf16" if precision.startswith("bf16") and "mixed" in precision \
            else "fp16" if precision.startswith("16") and "mixed" in precision else "fp32"
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm").split(".")[-1].lower()
        clip = trainer.gradient_clip_val if trainer.gradient_clip_val else None
        fused = skips_on_device(optimizer)
        if clip is not None and fused and mode != "fp32":
            raise ValueError(f"Lightning cannot clip the gradients of a fused optimizer under precision={precision!r} "
                             f"(gradient_clip_val={clip}); pass StableTrainCallback(clip_max_norm={clip}) instead")
        if clip is not None and self.clip_max_norm is not None:
            raise ValueError(f"gradient_clip_val={clip} and StableTrainCallback(clip_max_norm={self.clip_max_norm}) "
                             "would clip twice: keep one")
        self.value_clip = clip is not None and algorithm != "norm"
        host_clip = float(clip) if clip is not None and not self.value_clip else None
        host = {"max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs, "precision": precision,
                "accumulate_grad_batches": trainer.accumulate_grad_batches, "gradient_clip_val": trainer.gradient_clip_val,
                "gradient_clip_algorithm": algorithm, "strategy": type(trainer.strategy).__name__,
                "world_size": trainer.world_size, "ckpt_path": str(trainer.ckpt_path) if trainer.ckpt_path else None,
                "final_step": int(trainer.estimated_stepping_batches) if 0 < trainer.estimated_stepping_batches < 1e18 else None}
        self.trainer, self.pl_module, self.scaler = trainer, pl_module, scaler
        self.session = RunSession(
            self.run_dir, pl_module, host="lightning", options=self.options, precision=mode, fingerprint=self._fingerprint,
            clip_max_norm=self.clip_max_norm if self.clip_max_norm is not None else host_clip,
            optimizer=optimizer, scaler=scaler, replay=_LightningReplay(self), overwrite=self.overwrite,
            recipes={"model": model_recipe(pl_module, "lightning"), "loss": loss_recipe(self.loss_fn, {"kind": "lightning"})},
            host_config=host, callbacks=self.stable_callbacks, tracker_hosts=logger_runs(trainer.loggers))
        self.session.judge_host_steps(optimizer, scaler, host_clip=host_clip, own_clip=self.clip_max_norm,
                                      skip_hint="use torch.optim.AdamW(..., fused=True)" + (", and clip_max_norm= here for "
                                      "gradient_clip_val (Lightning refuses it then)" if host_clip and mode != "fp32" else ""))
        self.session.open(resume=trainer.ckpt_path is not None)
        if self._loaded:
            self.session.load_state_dict(self._loaded, path=str(trainer.ckpt_path))
            self._loaded = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.begin()

    # -- the step ----------------------------------------------------------------------------------

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.pending, self._host_skip = PendingStep(), False  # (an epoch's last step runs: a batch never trained)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        session = self.session
        if session.step == 0 and not session.pending.micro and self.options.init_check and session.started:
            session.signal_check(batch, self.loss_fn or lightning_loss)
        session.pending.add(batch, self.count_fn(batch) if self.count_fn is not None else batch_size(batch),
                            rng=session.capturing)
        session.pending.host.setdefault("batch_idx", []).append(batch_idx)

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self.session is None or self.session.capture.replaying:
            return
        loss = self.session.host_step.unscale(loss.detach().float())  # Lightning hands the scaled loss under a GradScaler
        self.session.watch_loss(loss)
        self.session.pending.add_loss(loss, trainer.accumulate_grad_batches)  # (Lightning divided it by that)
        self.session.pending.host["backward_at"] = len(self.session.pending.micro)  # (the micro-batches backpropagated)

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        replaying, p = self.session.capture.replaying, self.session.pending  # Lightning's own skip: every training_step
        self._host_skip = not replaying and (p.loss is None or self.scaler is not None  # None; under a GradScaler, the last
                                             and p.host.get("backward_at") != len(p.micro))
        if replaying or self._host_skip:
            return
        norm, per = grad_norms(self.session.params)
        self._lr = current_lrs(self.session.host_step.optimizer)[0]  # the step's: Lightning's scheduler steps before batch end
        # A fused optimizer under a GradScaler unscales inside its step: its grads still hold the scale here.
        self.session.before_host_step(norm, per, grads_scaled=self.scaler is not None and self.session.host_step.fused)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        session = self.session
        out = session.host_step.after_step(session.pending.count, value_clipped=self.value_clip)
        if self._host_skip:  # Lightning skipped the step itself: not one of ours
            session.pending, self._host_skip = PendingStep(), False
        if out is None:  # an accumulation micro-batch: the optimizer has not stepped yet
            return
        record = session.record_host_step(out, epoch=trainer.current_epoch, lr=self._lr)
        if record is not None:
            if self.options.mirror and trainer.loggers:  # no logger: Lightning would warn at every call
                figures = {k: float(v) for k, v in host_figures(record).items()}
                # In callback_metrics (a checkpoint or early stop may monitor them), and in the loggers at this step only
                # (log_dict(logger=True) from a batch-end hook: Lightning wrote it again at every step until the next).
                pl_module.log_dict(figures, on_step=True, on_epoch=False, logger=False, sync_dist=False,
                                   rank_zero_only=True)
                covered = {id(t.owner) for t in session.trackers if t.active and t.owner is not None}
                if trainer.is_global_zero:  # (a tracker writing into a logger's run already: that logger is left out)
                    for logger in trainer.loggers:
                        if id(logger) not in covered:
                            logger.log_metrics(figures, step=trainer.global_step)
            if session.stop_reason is not None:
                trainer.should_stop = True

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.session and not trainer.sanity_checking and (value := trainer.callback_metrics.get("val_loss")) is not None:
            self.session.evaluation(float(value))  # what the module logged as val_loss (not a sanity check's)

    # -- the end -----------------------------------------------------------------------------------

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.session is not None:
            self.session.close()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.session is not None:
            self.session.close(exception)


class _LightningReplay(HostReplay):
    """Replays a kept step as Lightning's automatic optimization ran it (``trainer.strategy.training_step``, the loss
    divided by ``accumulate_grad_batches``, the module's ``backward``, the GradScaler, ``configure_gradient_clipping``,
    the optimizer); the diagnosis replays ``training_step``."""

    def __init__(self, callback: StableTrainCallback) -> None:
        self.cb = callback

    def replay_step(self, kept: KeptStep) -> None:
        cb = self.cb
        trainer, module, optimizer, scaler = cb.trainer, cb.pl_module, cb.trainer.optimizers[0], cb.scaler
        strategy = trainer.strategy
        optimizer.zero_grad(set_to_none=True)
        n = len(kept.micro)
        for i, (batch, batch_idx) in enumerate(zip(kept.micro, kept.host["batch_idx"])):
            batch = move_to(batch, module.device)
            last = i == n - 1
            block = getattr(strategy, "block_backward_sync", None)
            with block() if block is not None and not last else contextlib.nullcontext():
                out = strategy.training_step(batch, batch_idx)
                loss = out["loss"] if isinstance(out, Mapping) else out
                if loss is None:  # (this micro-batch's training_step skipped it: no backward, as live)
                    continue
                loss = loss / trainer.accumulate_grad_batches
                module.backward(scaler.scale(loss) if scaler is not None else loss)
        if scaler is not None and not skips_on_device(optimizer):
            scaler.unscale_(optimizer)
        if cb.clip_max_norm is not None:  # as the live step clipped: a fused step's grads still hold the loss scale
            clip_as_judged(cb.session.params, cb.clip_max_norm,
                           cb.session.host_step if scaler is not None and skips_on_device(optimizer) else None)
        module.configure_gradient_clipping(optimizer, gradient_clip_val=trainer.gradient_clip_val,
                                           gradient_clip_algorithm=trainer.gradient_clip_algorithm)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def diagnosis_loss(self, kept: KeptStep) -> Callable[[Any, Any], Any]:
        return self.cb.loss_fn or lightning_loss

    @contextlib.contextmanager
    def replaying(self) -> Iterator[None]:
        """The module's ``self.log`` calls are no-ops meanwhile (instance attributes over the methods, removed after)."""
        module = self.cb.pl_module
        module.log = module.log_dict = lambda *args, **kwargs: None
        try:
            yield
        finally:
            del module.log, module.log_dict

    @contextlib.contextmanager
    def detached(self) -> Iterator[None]:
        """The module without its trainer (deep-copied for the diagnosis; its ``self.log`` calls do nothing)."""
        import warnings

        module = self.cb.pl_module
        trainer = module.trainer
        module.trainer = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            module.trainer = trainer
