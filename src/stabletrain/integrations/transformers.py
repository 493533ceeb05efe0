"""stabletrain inside the Hugging Face ``transformers.Trainer``: one callback, the same run directory as a built-in run.

::

    from stabletrain.integrations.transformers import StableTrainCallback
    trainer = transformers.Trainer(..., callbacks=[StableTrainCallback(run_dir="runs/exp1")])

A ``TrainerCallback`` sees neither the loss nor the pre-clip norm of a step (the Trainer clips before
``on_pre_optimizer_step``), so at ``on_train_begin`` the callback attaches three light hooks to the model:

- a forward pre-hook (training only): the micro-batch and the RNG state are kept (references), its
  tokens counted on the device (``labels != -100``, else the attention mask, else the inputs);
- a forward hook: the micro-batch's ``loss`` (summed when the Trainer passed ``num_items_in_batch``, the
  model then normalizing by the whole window, else averaged);
- a post-accumulate-grad hook per parameter that queues one callback at the end of each backward pass:
  the global and per-parameter grad norms (one fused pass), i.e. the pre-clip norms of the step's
  accumulated gradients (divided by the GradScaler's scale under fp16, when the Trainer's accelerator
  has one).

Then, per optimizer step::

    on_pre_optimizer_step   (after the Trainer's clipping) the sentinel on the loss and pre-clip norm; the
                            skip on the device: a fused optimizer (the Trainer's default adamw_torch_fused)
                            reads it as found_inf; under a GradScaler it joins the scaler's found_inf
                            (then the Trainer also holds its LR scheduler: step_was_skipped)
    on_optimizer_step       applied flag, params check, StepMetrics.update; every log_every steps the
                            interval's one sync: metrics.jsonl, events, TensorBoard, incident capture and
                            diagnosis (replaying ``model(**batch).loss``), ``should_training_stop`` on "stop"
    on_step_end             at our boundary, ``should_log``: the Trainer logs, and ``on_log`` adds our figures
                            (``stabletrain/...``) to its ``logs`` and ``log_history``
    on_save                 our state in the checkpoint folder (``stabletrain_state.pt``); a Trainer resumed
                            from that checkpoint continues our step count, metrics and guard

A non-fused optimizer without a GradScaler skips a bad step by dropping its gradients, which reads the
verdict on the host once per step (a sync; warned once).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import TrainerCallback

from ..callbacks import Callback as StableCallback
from ..initialization import InitFingerprint
from ..numerics import all_params_finite, grad_norms
from ..seeding import rng_state
from .core import AdapterOptions, RunSession
from .replay import _transformers_loss, batch_size, import_path

__all__ = ["StableTrainCallback", "STATE_FILE"]

#: Our state's file in each of the Trainer's checkpoint folders.
STATE_FILE = "stabletrain_state.pt"


def _count_tokens(inputs: dict[str, Any]) -> Tensor | int:
    labels, mask, ids = inputs.get("labels"), inputs.get("attention_mask"), inputs.get("input_ids")
    if isinstance(labels, Tensor) and labels.dtype in (torch.long, torch.int):
        return (labels != -100).sum()
    if isinstance(mask, Tensor):
        return mask.sum()
    if isinstance(ids, Tensor):
        return ids.numel()
    return batch_size(inputs)


class StableTrainCallback(TrainerCallback):
    """Metrics, sentinel, incidents and the run directory for a ``transformers.Trainer``. See the module docstring.

    Args:
        run_dir: the run directory (None: measure and guard, write nothing).
        log_every, on_nonfinite, on_spike, capture, diagnose, check_params, tensorboard, top_layers,
            init_check, mirror: see :class:`~stabletrain.integrations.core.AdapterOptions`.
        loss_fn: ``loss_fn(model, batch)`` for replays (default: ``model(**batch).loss``, as the Trainer's
            ``compute_loss`` without label smoothing or a custom loss).
        overwrite: replace a run already in ``run_dir`` (a new training, not a resume).
        callbacks: stabletrain :class:`~stabletrain.callbacks.Callback` instances fired with the built-in sinks.
    """

    def __init__(self, run_dir: str | Path | None = None, *, log_every: int = 10, on_nonfinite: str = "skip",
                 on_spike: str = "warn", capture: bool = True, diagnose: bool = True, check_params: bool = True,
                 tensorboard: bool = True, top_layers: int = 3, init_check: bool = True, mirror: bool = True,
                 loss_fn: Callable[[nn.Module, Any], Any] | None = None, overwrite: bool = False,
                 callbacks: Sequence[StableCallback] = ()) -> None:
        self.run_dir, self.loss_fn, self.overwrite = run_dir, loss_fn, overwrite
        self.options = AdapterOptions(log_every=log_every, on_nonfinite=on_nonfinite, on_spike=on_spike,
                                      capture=capture, diagnose=diagnose, check_params=check_params,
                                      tensorboard=tensorboard, top_layers=top_layers, init_check=init_check,
                                      mirror=mirror).validate()
        self.stable_callbacks = list(callbacks)
        self.session: RunSession | None = None
        self._fingerprint: InitFingerprint | None = None
        self._handles: list[Any] = []
        self._record: dict[str, Any] | None = None
        self._reset_step()

    def _reset_step(self) -> None:
        self._micro: list[Any] = []
        self._rng: dict[str, Any] | None = None
        self._losses: list[Tensor] = []
        self._window_normalized = False
        self._count: Tensor | float = 0.0
        self._pending: dict[str, Any] | None = None
        self._queued = False

    # -- set-up --------------------------------------------------------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        if self.options.init_check and model is not None:
            self._fingerprint = InitFingerprint.take(model)  # the model as handed to the Trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None,
                       optimizer: Any = None, **kwargs: Any) -> None:
        if self.session is not None:  # a second train() on the same callback: a new session
            self._detach()
        inner = getattr(optimizer, "optimizer", optimizer)
        self.scaler = getattr(optimizer, "scaler", None)  # the accelerator's GradScaler (fp16), else None
        self.optimizer, self.inner = optimizer, inner
        self.fused = bool(getattr(inner, "_step_supports_amp_scaling", False))
        mode = "fp16" if (args.fp16 or self.scaler is not None) else "bf16" if args.bf16 else "fp32"
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        resumed = state.global_step > 0
        cls = import_path(type(model))
        config = getattr(model, "config", None)
        model_recipe = ({"kind": "transformers", "class": cls, "config": config.to_dict()}
                        if cls and config is not None and hasattr(type(model), "config_class") else None)
        loss_recipe = ({"kind": "transformers"} if self.loss_fn is None else
                       {"kind": "function", "function": import_path(self.loss_fn)} if import_path(self.loss_fn) else None)
        host = {k: getattr(args, k, None) for k in (
            "output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
            "learning_rate", "weight_decay", "max_grad_norm", "lr_scheduler_type", "warmup_steps", "optim", "fp16",
            "bf16", "seed", "logging_steps", "save_steps")}
        self.session = RunSession(
            self.run_dir, model, host="transformers", options=self.options, precision=mode, clip_max_norm=clip,
            optimizer=inner, loss_fn=self.loss_fn or _transformers_loss, overwrite=self.overwrite,
            scaled=self.scaler is not None, fingerprint=None if resumed else self._fingerprint,
            recipes={"model": model_recipe, "loss": loss_recipe, "scaler": self.scaler}, host_config=host,
            callbacks=self.stable_callbacks, replay_context=self._hooks_off)
        self.session.open(resume=resumed)
        if resumed:
            path = os.path.join(args.output_dir, f"checkpoint-{state.global_step}", STATE_FILE)
            if os.path.exists(path):
                self.session.load_state_dict(torch.load(path, map_location=self.session.device, weights_only=True),
                                             path=os.path.dirname(path))
            else:
                warnings.warn(f"stabletrain: resuming at step {state.global_step} without {path}: our metrics and "
                              "guard state start afresh (the checkpoint was not written with this callback)", stacklevel=2)
        self.model = model
        self._add_hooks()
        self.session.begin()

    def _add_hooks(self) -> None:
        self._handles = [self.model.register_forward_pre_hook(self._on_forward_pre, with_kwargs=True),
                         self.model.register_forward_hook(self._on_forward, with_kwargs=True),
                         *[p.register_post_accumulate_grad_hook(self._on_grad) for p in self.session.params]]

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def _hooks_off(self) -> Iterator[None]:
        """A replay (signal report, diagnosis) runs the model without our hooks (and deep-copies it without them)."""
        self._remove_hooks()
        self._replaying = True
        try:
            yield
        finally:
            self._replaying = False
            self._add_hooks()

    # -- hooks on the model (no host sync) -------------------------------------------------------------

    def _training(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled() and self.session is not None and not self._replaying

    _replaying = False

    def _on_forward_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._training(module):
            return
        inputs = {k: v for k, v in kwargs.items() if k != "num_items_in_batch"}
        session = self.session
        if self._rng is None and self.options.capture and session.run is not None:
            self._rng = rng_state()
        self._micro.append(inputs)
        self._window_normalized = kwargs.get("num_items_in_batch") is not None
        n = _count_tokens(inputs)
        self._count = self._count + (n.detach().float() if isinstance(n, Tensor) else float(n))

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        if not self._training(module):
            return
        loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
        if isinstance(loss, Tensor):
            self._losses.append(loss.detach().float().reshape(()))

    def _on_grad(self, param: Tensor) -> None:
        if self._queued or self.session is None or self._replaying:
            return
        self._queued = True
        # Once per backward pass, when every gradient of it is accumulated: one fused norm pass.
        torch.autograd.Variable._execution_engine.queue_callback(self._measure)

    def _measure(self) -> None:
        self._queued = False
        norm, per = grad_norms(self.session.params)
        self._norm = norm
        self._per = per

    # -- the Trainer's step ----------------------------------------------------------------------------

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        session = self.session
        if session.step == 0 and self._micro and self.options.init_check and not session.history:
            session.signal_check(self._micro[0], self.loss_fn or _transformers_loss)  # grads and RNG put back
        norm, per = self._norm, self._per
        scaler = self.scaler
        if scaler is not None:  # measured on the scaled grads of the backward: unscale the figures
            inv = 1.0 / scaler._scale.to(norm.device)  # _scale: the scaler's device tensor (no sync)
            norm, per = norm * inv, per * inv
        if self._losses:
            total = torch.stack(self._losses).sum()
            loss = total if self._window_normalized else total / len(self._losses)
        else:
            loss = torch.full((), float("nan"), device=norm.device)
        ok, finite, spike = session.guard.observe(loss, norm)
        own_found, ours = None, False
        if scaler is not None:
            found = scaler._per_optimizer_states[id(self.inner)]["found_inf_per_device"]
            if found:  # the accelerator unscaled for clipping/measuring: our verdict joins its found_inf
                first = next(iter(found.values()))
                own_found = torch.stack([t.to(norm.device) for t in found.values()]).sum() > 0
                self._scale_before = (scaler._scale.clone(), scaler._growth_tracker.clone())
                first.copy_(torch.maximum(first, (~ok).to(first.dtype).to(first.device)))
        may_skip = self.options.on_nonfinite != "warn" or self.options.on_spike == "skip" or self.options.holds
        if own_found is None and self.fused:
            self.inner.grad_scale, self.inner.found_inf, ours = None, (~ok).float(), True
        elif own_found is None and may_skip:
            session.skip_on_host(ok, "use optim='adamw_torch_fused'")
        clip = session.clip_max_norm
        clipped = finite & (norm > clip) if clip is not None else torch.zeros((), dtype=torch.bool, device=norm.device)
        post = norm * torch.clamp(clip / (norm + 1e-6), max=1.0) if clip is not None else norm
        overflow = (torch.isfinite(loss) & ~torch.isfinite(norm) if scaler is not None
                    else torch.zeros((), dtype=torch.bool, device=norm.device))
        self._pending = {"loss": loss, "grad_norm": norm, "post_clip_norm": post, "clipped": clipped, "ok": ok,
                         "finite": finite, "spike": spike, "overflow": overflow, "per_param_norms": per,
                         "own_found": own_found, "ours": ours}
        session.before_update()  # ||update|| on the interval's last step: one parameter copy, no sync

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        p, session = self._pending, self.session
        if p is None:
            return
        if p["ours"]:
            del self.inner.grad_scale, self.inner.found_inf
        device = p["grad_norm"].device
        applied = p["ok"] if p["own_found"] is None else p["ok"] & ~p["own_found"]
        scaler = self.scaler
        if scaler is not None and p["own_found"] is not None:
            ours_only = ~p["ok"] & ~p["own_found"]  # only we skipped: undo the scaler's back-off
            scale, tracker = self._scale_before
            scaler._scale.copy_(torch.where(ours_only, scale, scaler._scale))
            scaler._growth_tracker.copy_(torch.where(ours_only, tracker, scaler._growth_tracker))
        count = self._count if isinstance(self._count, Tensor) else torch.full((), float(self._count), device=device)
        out = {"loss": p["loss"], "grad_norm": p["grad_norm"], "post_clip_norm": p["post_clip_norm"],
               "clipped": p["clipped"], "applied": applied, "finite": p["finite"], "spike": p["spike"],
               "params_finite": all_params_finite(session.params) if self.options.check_params else
               torch.ones((), dtype=torch.bool, device=device),
               "overflow": p["overflow"], "count": count.to(device), "per_param_norms": p["per_param_norms"]}
        session.after_update(out)
        num_samples = sum(batch_size(b) for b in self._micro)
        session.keep(self._micro, self._rng)
        session.epoch = int(state.epoch or 0)
        lr = self.inner.param_groups[0]["lr"]
        loss_scale = scaler._scale if scaler is not None and scaler._scale is not None else 1.0
        self._reset_step()
        if session.record(out, num_samples=num_samples, lr=lr, loss_scale=loss_scale):
            self._record = session.history[-1]
            if session.stop_reason is not None:
                control.should_training_stop = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._record is not None and self.options.mirror:
            control.should_log = True  # the Trainer logs now; on_log adds our figures

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kwargs: Any) -> None:
        record, self._record = self._record, None
        if record is None or logs is None or not self.options.mirror:
            return
        ours = {f"stabletrain/{k}": v for k, v in record.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        logs.update(ours)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(ours)

    # -- checkpoints and the end -------------------------------------------------------------------------

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.session is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if os.path.isdir(folder):
            torch.save(self.session.state_dict(), os.path.join(folder, STATE_FILE))

    def _detach(self) -> None:
        self._remove_hooks()
        if self.session is not None:
            self.session.close()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._detach()
