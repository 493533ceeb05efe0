"""stabletrain inside the Hugging Face ``transformers.Trainer``: one callback, the same run directory as a built-in run.

::

    from stabletrain.integrations.transformers import StableTrainCallback
    trainer = transformers.Trainer(..., callbacks=[StableTrainCallback(run_dir="runs/exp1")])

A ``TrainerCallback`` sees neither the loss nor the pre-clip norm of a step (the Trainer clips before
``on_pre_optimizer_step``), and is not handed the trainer. The callback finds the ``Trainer`` that runs it (``trainer=``
names it explicitly) and, while it trains, wraps that trainer's own ``training_step`` (a subclass's override included;
an attribute of the instance, removed at the end of training):

- before it: the micro-batch, the RNG state, ``num_items_in_batch`` and the accumulation steps are kept; its tokens
  counted on the device (``labels != -100``, else the attention mask, else the ids or the embedded inputs);
- after it: its returned loss (the Trainer's own, from its ``compute_loss``: a dict, tuple or ModelOutput, label
  smoothing, ``compute_loss_func`` and ``num_items_in_batch`` included) summed over the window; on the window's last
  micro-batch (``accelerator.sync_gradients``) the pre-clip global and per-parameter grad norms (one fused pass).

Then, per optimizer step::

    on_pre_optimizer_step   (after the Trainer's clipping) the sentinel on the loss and pre-clip norm; the skip on
                            the device (HostStep.before_step): a fused optimizer (the default adamw_torch_fused)
                            reads it as found_inf; under a GradScaler it joins the scaler's found_inf (the Trainer
                            then also holds its LR scheduler: optimizer_step_was_skipped)
    on_optimizer_step       applied flag, params check
    on_step_end             StepMetrics.update; every log_every steps the interval's one sync: the run directory,
                            incident capture and diagnosis, ``should_training_stop`` on "stop"
    on_log                  (the Trainer's own logging steps) the latest interval's figures added to its logs,
                            before its trackers (``report_to``) write them: our callback is moved before theirs
    on_evaluate             its eval_loss: val_loss (at val_step) in the next interval's record (the last's at the end)
    on_save                 our state in the checkpoint folder (``stabletrain_state.pt``); a Trainer resumed from
                            that checkpoint continues our step count, metrics and guard

A capture replays the interval's steps with the Trainer's own step (``_TransformersReplay``), the diagnosis its
``compute_loss``. Under ``torchrun`` every rank runs the callback (DDP): a rank's non-finite loss reaches every rank's
gradients (``compute_loss`` is watched too), rank 0 writes."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import Trainer, TrainerCallback

from ..callbacks import Callback as StableCallback
from ..config import AdapterOptions, host_precision
from ..console import StableTrainWarning, show_bar
from ..data import move_to
from ..diagnostics.initialization import InitFingerprint
from ..errors import host_retry, retried, retry_line
from ..host_step import items_ignored
from ..internals import find_caller, is_compiled
from ..numerics import grad_norms
from ..policies.metrics import host_figures
from ..records.batches import count_tokens, items_normalized, window_items
from ..records.captured import default_compute_loss, divides_by_items, host_loss_factor, loss_recipe, model_recipe
from ..records.provenance import HF_TRAINING_ARGS
from ..services.kept_steps import HostReplay, KeptStep, current_lrs
from .core import RunSession

__all__ = ["StableTrainCallback", "STATE_FILE"]

#: Our state's file in each of the Trainer's checkpoint folders.
STATE_FILE = "stabletrain_state.pt"


class StableTrainCallback(TrainerCallback):
    """Metrics, sentinel, incidents and the run directory for a ``transformers.Trainer``. See the module docstring.

    Args:
        run_dir: the run directory (None: measure and guard, write nothing).
        loss_fn: ``loss_fn(model, batch)`` for the diagnosis (default: the trainer's own ``compute_loss``).
        trainer: the ``Trainer`` this callback is added to (default: found when it starts the callback).
        overwrite: replace a run already in ``run_dir`` (a new training, not a resume).
        callbacks: stabletrain :class:`~stabletrain.callbacks.Callback` instances fired with the built-in sinks.
        options: :class:`~stabletrain.config.adapter.AdapterOptions` (``log_every``, ``on_nonfinite``, ...; with
            ``trackers=["mlflow"]`` (or "wandb") and ``report_to=["mlflow"]``, stabletrain writes into the run the
            Trainer's own MLflow (W&B) callback started).
    """

    def __init__(self, run_dir: str | Path | None = None, *, loss_fn: Callable[[nn.Module, Any], Any] | None = None,
                 trainer: Trainer | None = None, overwrite: bool = False, callbacks: Sequence[StableCallback] = (),
                 **options: Any) -> None:
        self.run_dir, self.loss_fn, self.overwrite = run_dir, loss_fn, overwrite
        self.options = AdapterOptions(**options).checked(loss_fn=loss_fn, run_dir=run_dir, trainer=trainer,
                                                         overwrite=overwrite, callbacks=callbacks)
        self.stable_callbacks, self.trainer, self.session = list(callbacks), trainer, None
        self._record = self._out = self._norms = self._fingerprint = None  # (interval record; step outputs; norms; init)
        self._wrapped: list[str] = []
        self._bar: Any = None  # the Trainer's own progress bar (False: it draws none), which our lines go above
        self._retry: dict[str, Any] | None = None  # the out-of-memory step the Trainer is retrying at a smaller batch
        self._batch: int | None = None  # the session's batch size (a retry's is smaller)
        self._items_ignored: bool | None = None  # the session's loss ignores num_items_in_batch (a mean: items_ignored)

    # -- set-up --------------------------------------------------------------------------------------

    def _find_trainer(self, fresh: bool = False) -> Trainer | None:  # (fresh: the one being built, at on_init_end)
        if self.trainer is None or fresh:
            self.trainer = find_caller(lambda t: isinstance(t, Trainer) and self in t.callback_handler.callbacks) or self.trainer
        if sum(isinstance(c, StableTrainCallback) for c in (self.trainer.callback_handler.callbacks if self.trainer else ())) > 1:
            raise ValueError("StableTrainCallback: the Trainer's callbacks hold more than one; one watches a run and writes "
                             "its directory: remove the others")  # (added when built, or by add_callback: at train())
        return self.trainer

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        self._find_trainer(fresh=True)
        if self.options.init_check and model is not None:
            self._fingerprint = InitFingerprint.take(model)  # the model as handed to the Trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        opened = self.session.step if self.session is not None and not self.session.closed else None
        retry = retried(self._retry, opened, args, state.train_batch_size, self._batch)
        self._retry, self._items_ignored, self._batch = None, None, state.train_batch_size
        if self.session is not None:  # a second train() on the same callback (or its retry): a new session
            self._detach()
        trainer = self._find_trainer()
        if trainer is None:
            raise ValueError("StableTrainCallback: cannot find the transformers.Trainer running this callback; pass "
                             "StableTrainCallback(..., trainer=trainer) after building the trainer")
        inner = getattr(optimizer, "optimizer", optimizer)
        scaler = getattr(optimizer, "scaler", None)  # the accelerator's GradScaler (fp16), else None
        # what it really runs: e.g. fp16=True on a CPU runs fp32 (no autocast)
        mode = host_precision("Trainer", "fp16" if args.fp16 else "bf16" if args.bf16 else None, scaler,
                              trainer.accelerator, args.device)
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        resumed = state.global_step > 0
        host = {k: getattr(args, k, None) for k in HF_TRAINING_ARGS}
        host.update(trainer_class=f"{type(trainer).__module__}.{type(trainer).__qualname__}", world_size=args.world_size,
                    final_step=state.max_steps)
        self.session = RunSession(
            self.run_dir, model, host="transformers", options=self.options, precision=mode, clip_max_norm=clip,
            optimizer=inner, scaler=scaler, replay=_TransformersReplay(self), overwrite=self.overwrite or bool(retry),
            fingerprint=None if resumed or retry else self._fingerprint, recipes={"model": model_recipe(model, "transformers"),
                     "loss": loss_recipe(self.loss_fn, {"kind": "transformers"} if default_compute_loss(trainer) else None)},
            host_config=host, callbacks=self.stable_callbacks,
            compiled=bool(getattr(args, "torch_compile", False))  # the callbacks are handed the uncompiled model
            or is_compiled(getattr(trainer, "model_wrapped", model)))
        self.session.judge_host_steps(inner, scaler, host_clip=clip, own_clip=None, skip_hint="use optim='adamw_torch_fused'")
        self.session.open(resume=resumed)
        if retry:  # the attempt before is replaced: the Trainer trains from its first step again (its weights kept)
            self.session.state.event(0, "retry", retry_line(retry, n := state.train_batch_size), **retry, batch_size=n)
            warnings.warn(retry_line(retry, n), StableTrainWarning, stacklevel=2)
        if resumed:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_FILE)
            if os.path.exists(path):
                self.session.load_state_dict(torch.load(path, map_location=self.session.device, weights_only=True),
                                             path=os.path.dirname(path))
            else:
                warnings.warn(f"resuming at step {state.global_step} without {path}: our metrics and guard state start "
                              "afresh (the checkpoint was not written with this callback)", StableTrainWarning, stacklevel=2)
        self.model, self.args = model, args
        self._wrap(trainer)
        self.session.begin()

    # -- the trainer's own training_step (and compute_loss under DDP), watched ---------------------------

    def _wrap(self, trainer: Trainer) -> None:
        cbs = trainer.callback_handler.callbacks  # our on_log before the trackers' (report_to): the mirror reaches them
        at = next((i for i, cb in enumerate(cbs) if type(cb).__module__.startswith("transformers.integrations")), None)
        if self.options.mirror and at is not None and self in cbs and cbs.index(self) > at:
            cbs.insert(at, cbs.pop(cbs.index(self)))
        self._training_step = trainer.training_step  # bound: a subclass's override is what runs
        trainer.training_step = self._watched_training_step
        self._wrapped = ["training_step"]
        if self.session.dist.world > 1:  # the loss before its backward: a rank's NaN must reach every rank's grads
            self._compute_loss = trainer.compute_loss
            trainer.compute_loss = self._watched_compute_loss
            self._wrapped.append("compute_loss")

    def _unwrap(self) -> None:
        for name in self._wrapped:
            if self.trainer is not None and name in vars(self.trainer):
                delattr(self.trainer, name)
        self._wrapped = []

    def _watched_training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> Tensor:
        session = self.session
        if session is None or session.capture.replaying:
            return self._call_training_step(model, inputs, num_items_in_batch)
        pending = session.pending
        if not pending.micro:
            pending.host = {"model": model, "num_items_in_batch": num_items_in_batch,
                            "accumulation_steps": getattr(self.trainer, "current_gradient_accumulation_steps", None),
                            "items_normalized": self.loss_fn is None and divides_by_items(self.trainer, num_items_in_batch)
                            and not self._items_ignored,
                            "loss_factor": host_loss_factor(self.trainer, num_items_in_batch) if self.loss_fn is None else 1}
            if session.step == 0 and not session.history:  # once: the step-0 report
                session.signal_check(dict(inputs), self.diagnosis_loss(num_items_in_batch))
            if self._items_ignored is None:  # once a session: a loss that ignores its items is weighed as the mean it is
                self._items_ignored = items_ignored(pending.host, model, dict(inputs), self.diagnosis_loss)
                pending.host["items_normalized"] &= not self._items_ignored
        pending.add(dict(inputs), count_tokens(inputs), rng=session.capturing)
        try:
            loss = self._call_training_step(model, inputs, num_items_in_batch)
        except BaseException as err:  # (the Trainer has no hook for it): the crash recorded (an out-of-memory error it
            self._retry = host_retry(self.args, err, session.step + 1, self._batch)  # retries: none), the run closed
            self._detach(None if self._retry else err)
            raise
        pending.add_loss(loss.detach().float().reshape(()))
        if self.trainer.accelerator.sync_gradients:  # the window's last backward: its pre-clip gradients
            self._norms = grad_norms(session.params)
        return loss

    def _call_training_step(self, model: nn.Module, inputs: Any, num_items_in_batch: Any) -> Tensor:
        # (transformers < 4.46 calls training_step(model, inputs))
        return self._training_step(model, inputs, *(() if num_items_in_batch is None else (num_items_in_batch,)))

    def _watched_compute_loss(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        out = self._compute_loss(model, inputs, *args, **kwargs)
        if self.session is not None and model.training and torch.is_grad_enabled() and not self.session.capture.replaying:
            self.session.watch_loss(out[0] if isinstance(out, tuple) else out)
        return out

    def diagnosis_loss(self, num_items_in_batch: Any, window_items: float | None = None) -> Callable[[nn.Module, Any], Any]:
        """``loss(model, batch)`` as the trainer computes it (its ``compute_loss``), or the user's ``loss_fn``; given
        the window's items, one the Trainer divides by ``num_items_in_batch`` is the pair of
        :func:`~stabletrain.records.batches.items_normalized` (any part of the window on its own items)."""
        if self.loss_fn is not None:
            return self.loss_fn
        compute = getattr(self, "_compute_loss", None) or self.trainer.compute_loss
        loss = lambda model, batch: compute(model, dict(batch), num_items_in_batch=num_items_in_batch)  # noqa: E731
        divides = window_items and divides_by_items(self.trainer, num_items_in_batch)
        return items_normalized(loss, window_items) if divides else loss

    # -- the Trainer's step ----------------------------------------------------------------------------

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.session
        if self._norms is None:
            raise RuntimeError("StableTrainCallback: the optimizer steps, but the trainer's training_step did not run "
                               "through stabletrain's watch (was training_step replaced after train() began?)")
        (norm, per), self._norms = self._norms, None
        self._lr = current_lrs(session.host_step.optimizer)[0]  # the step's: the Trainer's scheduler steps after it
        session.before_host_step(norm, per, grads_scaled=session.host_step.scaler is not None)

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._out = self.session.host_step.after_step(self.session.pending.count)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        out, session = self._out, self.session
        if self._bar is None:  # drawn by now (the Trainer's ProgressCallback): a line of ours never lands inside it
            self._bar = next((c.training_bar for c in self.trainer.callback_handler.callbacks
                              if getattr(c, "training_bar", None) is not None), False)
            show_bar(self._bar or None)
        if out is None:
            return
        self._out = None
        record = session.record_host_step(out, epoch=int(state.epoch or 0), lr=self._lr)
        if record is not None:
            self._record, control.should_training_stop = record, control.should_training_stop or session.stop_reason is not None

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        """At the Trainer's own logging steps (its cadence and loss left as they are): the latest interval's figures."""
        if self._record is None or logs is None or "loss" not in logs or not self.options.mirror:
            return  # (an evaluation's metrics, the run's summary: not ours)
        ours, self._record = host_figures(self._record), None
        logs.update(ours)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(ours)

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if self.session is not None and isinstance((metrics or {}).get("eval_loss"), (int, float)):  # the next record's
            self.session.evaluation(float(metrics["eval_loss"]))

    # -- checkpoints and the end -------------------------------------------------------------------------

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if self.session is not None and os.path.isdir(folder) and self.session.dist.rank == 0:
            torch.save(self.session.state_dict(), os.path.join(folder, STATE_FILE))

    def _detach(self, err: BaseException | None = None) -> None:
        self._unwrap()
        if self.session is not None:  # (its last interval's lines while the Trainer's bar stands: after it, not inside)
            self.session.close(err)
        if self._bar:
            self._bar = show_bar(None)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()


class _TransformersReplay(HostReplay):
    """Replays a kept step with the Trainer's own ``training_step``, clipping and optimizer; diagnoses ``compute_loss``."""

    def __init__(self, callback: StableTrainCallback) -> None:
        self.cb = callback

    def replay_step(self, kept: KeptStep) -> None:
        cb = self.cb
        trainer, args = cb.trainer, cb.args
        model = kept.host["model"]
        accelerator = trainer.accelerator
        saved = getattr(trainer, "current_gradient_accumulation_steps", None)
        if kept.host.get("accumulation_steps") is not None:
            trainer.current_gradient_accumulation_steps = kept.host["accumulation_steps"]
        try:
            model.zero_grad(set_to_none=True)
            n = len(kept.micro)
            for i, inputs in enumerate(kept.micro):
                with accelerator.no_sync(model) if i < n - 1 else contextlib.nullcontext():
                    cb._call_training_step(model, move_to(inputs, args.device), kept.host["num_items_in_batch"])
            clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else float("inf")
            accelerator.clip_grad_norm_(model.parameters(), clip)
            trainer.optimizer.step()
            model.zero_grad(set_to_none=True)
        finally:
            if saved is not None:
                trainer.current_gradient_accumulation_steps = saved

    def diagnosis_loss(self, kept: KeptStep) -> Callable[[nn.Module, Any], Any]:
        return self.cb.diagnosis_loss(kept.host.get("num_items_in_batch"),
                                      window_items(kept.batches()) if kept.host.get("items_normalized") else None)
