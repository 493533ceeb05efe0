"""stabletrain inside the Lightning ``Trainer``: one callback, the same run directory as a built-in run.

::

    from stabletrain.integrations.lightning import StableTrainCallback
    trainer = L.Trainer(..., callbacks=[StableTrainCallback(run_dir="runs/exp1")])

Where each hook does its part of the step (automatic optimization, one optimizer)::

    setup                       init fingerprint (before configure_model and the strategy touch the module)
    on_fit_start                run dir opened (or reopened when resuming from ckpt_path); our state restored
    on_train_start              on_fit_start of stabletrain's callbacks: an init overwritten since setup is an event
    on_train_batch_start        the micro-batch and RNG state kept (references); first batch: signal report
    on_before_backward          the loss (unscaled when a GradScaler scaled it) summed over the micro-batches
    on_before_optimizer_step    grads are unscaled here: global and per-parameter norms, the sentinel
                                (stabletrain.guard), the step's skip decided on the device
    [Lightning clips, then steps: a fused optimizer reads our skip flag as ``found_inf`` (a step pre-hook);
     under a GradScaler our verdict joins its found_inf (its scale is restored when only we skipped)]
    on_train_batch_end          applied flag, params check, StepMetrics.update; every log_every steps the
                                interval's one sync: metrics.jsonl, events, TensorBoard, ``log_dict`` mirror,
                                incident capture + diagnosis, ``trainer.should_stop`` on "stop"
    state_dict/load_state_dict  our state travels in Lightning's own checkpoint (callbacks[...])

Skipping without a host sync needs a fused optimizer (``torch.optim.AdamW(..., fused=True)``) or a
GradScaler (``16-mixed``); with any other optimizer and no scaler, a bad step is skipped by dropping its
gradients, which reads the verdict on the host once per step (a sync; warned once). Lightning's LR
scheduler still advances on a skipped step. Post-clip norm and clip rate follow from the pre-clip norm
and ``gradient_clip_val`` (torch's formula) for norm clipping; value clipping is measured after the step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor

from ..callbacks import Callback as StableCallback
from ..initialization import InitFingerprint
from ..numerics import all_params_finite, grad_norms
from ..seeding import rng_state
from .core import AdapterOptions, RunSession
from .replay import _lightning_loss, batch_size, import_path, plain_batch

__all__ = ["StableTrainCallback"]


def _plain_hparams(module: pl.LightningModule) -> dict[str, Any] | None:
    try:
        hparams = dict(module.hparams)
        plain_batch(hparams)  # only values a safe bundle can hold
        return hparams
    except (TypeError, AttributeError):
        return None


class StableTrainCallback(pl.Callback):
    """Metrics, sentinel, incidents and the run directory for a Lightning ``Trainer``. See the module docstring.

    Args:
        run_dir: the run directory (None: measure and guard, write nothing).
        log_every, on_nonfinite, on_spike, capture, diagnose, check_params, tensorboard, top_layers,
            init_check, mirror: see :class:`~stabletrain.integrations.core.AdapterOptions`.
        loss_fn: ``loss_fn(module, batch)`` for replays (default: ``module.training_step(batch, 0)``, its
            ``"loss"`` when it returns a dict).
        count_fn: ``count_fn(batch)`` -> the tokens (or items) the loss covers, for ``tokens_per_s``
            (default: the samples in the batch).
        overwrite: replace a run already in ``run_dir`` (a new fit, not a resume).
        callbacks: stabletrain :class:`~stabletrain.callbacks.Callback` instances fired with the built-in sinks.
    """

    def __init__(self, run_dir: str | Path | None = None, *, log_every: int = 10, on_nonfinite: str = "skip",
                 on_spike: str = "warn", capture: bool = True, diagnose: bool = True, check_params: bool = True,
                 tensorboard: bool = True, top_layers: int = 3, init_check: bool = True, mirror: bool = True,
                 loss_fn: Callable[[Any, Any], Any] | None = None, count_fn: Callable[[Any], Any] | None = None,
                 overwrite: bool = False, callbacks: Sequence[StableCallback] = ()) -> None:
        self.run_dir, self.loss_fn, self.count_fn, self.overwrite = run_dir, loss_fn, count_fn, overwrite
        self.options = AdapterOptions(log_every=log_every, on_nonfinite=on_nonfinite, on_spike=on_spike,
                                      capture=capture, diagnose=diagnose, check_params=check_params,
                                      tensorboard=tensorboard, top_layers=top_layers, init_check=init_check,
                                      mirror=mirror).validate()
        self.stable_callbacks = list(callbacks)
        self.session: RunSession | None = None
        self._fingerprint: InitFingerprint | None = None
        self._loaded: dict[str, Any] | None = None
        self._hooks: list[Any] = []
        self._reset_step()

    def _reset_step(self) -> None:
        self._micro: list[Any] = []
        self._rng: dict[str, Any] | None = None
        self._loss: Tensor | None = None
        self._count: Tensor | float = 0.0
        self._pending: dict[str, Tensor] | None = None

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

    @contextlib.contextmanager
    def _detached(self, pl_module: pl.LightningModule) -> Iterator[None]:
        """Replay the module's training_step outside the trainer: its self.log calls are no-ops meanwhile."""
        trainer = pl_module._trainer
        pl_module._trainer = None
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        finally:
            pl_module._trainer = trainer

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if len(trainer.optimizers) != 1:
            raise ValueError(f"StableTrainCallback supports one optimizer; this LightningModule configures "
                             f"{len(trainer.optimizers)}")
        if not pl_module.automatic_optimization:
            raise ValueError("StableTrainCallback needs automatic optimization (self.automatic_optimization = True): "
                             "with manual optimization use stabletrain.Monitor in training_step")
        optimizer = trainer.optimizers[0]
        plugin = trainer.precision_plugin
        self.scaler = getattr(plugin, "scaler", None)
        precision = str(trainer.precision)
        mode = "fp16" if self.scaler is not None else "bf16" if precision.startswith("bf16") else \
            "fp16" if precision.startswith("16") else "fp32"
        algorithm = str(getattr(trainer, "gradient_clip_algorithm", "norm") or "norm")
        clip = trainer.gradient_clip_val if trainer.gradient_clip_val else None
        self.clip_norm = float(clip) if clip is not None and algorithm == "norm" else None
        self.clip_value = float(clip) if clip is not None and algorithm != "norm" else None
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        cls = import_path(type(pl_module))
        hparams = _plain_hparams(pl_module)
        loss_fn = self.loss_fn or _lightning_loss
        host = {"max_steps": trainer.max_steps, "max_epochs": trainer.max_epochs, "precision": precision,
                "accumulate_grad_batches": trainer.accumulate_grad_batches,
                "gradient_clip_val": trainer.gradient_clip_val, "gradient_clip_algorithm": algorithm,
                "ckpt_path": str(trainer.ckpt_path) if trainer.ckpt_path else None}
        self.session = RunSession(
            self.run_dir, pl_module, host="lightning", options=self.options, precision=mode, clip_max_norm=clip,
            optimizer=optimizer, loss_fn=loss_fn, overwrite=self.overwrite, scaled=self.scaler is not None,
            fingerprint=self._fingerprint,
            recipes={"model": {"kind": "lightning", "class": cls, "hparams": hparams} if cls and hparams is not None
                     else None,
                     "loss": ({"kind": "function", "function": import_path(self.loss_fn)} if self.loss_fn is not None
                              and import_path(self.loss_fn) else None if self.loss_fn is not None
                              else {"kind": "lightning"}),
                     "scaler": self.scaler},
            host_config=host, callbacks=self.stable_callbacks, replay_context=lambda: self._detached(pl_module))
        self.session.open(resume=trainer.ckpt_path is not None)
        if self._loaded:
            self.session.load_state_dict(self._loaded, path=str(trainer.ckpt_path))
            self._loaded = None
        self._hooks = [optimizer.register_step_pre_hook(self._pre_step),
                       optimizer.register_step_post_hook(self._post_step)]

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.session.begin()

    # -- the step ----------------------------------------------------------------------------------

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        session = self.session
        if session.step == 0 and not self._micro and self.options.init_check and session.started:
            session.signal_check(batch, self.loss_fn or _lightning_loss)
        if self._rng is None and self.options.capture and session.run is not None:
            self._rng = rng_state()
        self._micro.append(batch)
        n = self.count_fn(batch) if self.count_fn is not None else batch_size(batch)
        self._count = self._count + (n.detach().float() if isinstance(n, Tensor) else float(n))

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        loss = loss.detach().float()
        if self.scaler is not None:  # Lightning hands the scaled loss under a GradScaler
            loss = loss / self.scaler._scale.to(loss.device)  # _scale: the scaler's device tensor (no sync)
        self._loss = loss if self._loss is None else self._loss + loss

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        session = self.session
        params = session.params
        norm, per = grad_norms(params)
        scaler = self.scaler
        if scaler is not None and self.fused:  # Lightning leaves the unscale to a fused optimizer: grads still scaled
            inv = 1.0 / scaler._scale.to(norm.device)
            norm, per = norm * inv, per * inv
        loss = self._loss if self._loss is not None else torch.full((), float("nan"), device=norm.device)
        ok, finite, spike = session.guard.observe(loss, norm)
        own_found = None
        if scaler is not None:
            found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            if found:  # non-fused: Lightning unscaled; our verdict joins the scaler's found_inf (no sync)
                first = next(iter(found.values()))
                own_found = torch.stack([t.to(norm.device) for t in found.values()]).sum() > 0
                self._scale_before = (scaler._scale.clone(), scaler._growth_tracker.clone())
                first.copy_(torch.maximum(first, (~ok).to(first.dtype).to(first.device)))
        may_skip = self.options.on_nonfinite != "warn" or self.options.on_spike == "skip" or self.options.holds
        ours = False
        if self.fused and scaler is None:
            # Lightning runs this hook inside optimizer.step(closure); the fused update reads found_inf after it.
            optimizer.grad_scale, optimizer.found_inf, ours = None, (~ok).float(), True
        elif not self.fused and own_found is None and may_skip:
            session.skip_on_host(ok, "use fused=True, e.g. torch.optim.AdamW(..., fused=True)")
        clipped = (finite & (norm > self.clip_norm) if self.clip_norm is not None
                   else torch.zeros((), dtype=torch.bool, device=norm.device))
        post = norm * torch.clamp(self.clip_norm / (norm + 1e-6), max=1.0) if self.clip_norm is not None else norm
        overflow = (torch.isfinite(loss) & ~torch.isfinite(norm) if scaler is not None
                    else torch.zeros((), dtype=torch.bool, device=norm.device))
        self._pending = {"loss": loss, "grad_norm": norm, "post_clip_norm": post, "clipped": clipped, "ok": ok,
                         "finite": finite, "spike": spike, "overflow": overflow, "per_param_norms": per,
                         "own_found": own_found, "ours": ours}
        session.before_update()  # ||update|| on the interval's last step: one parameter copy, no sync

    def _pre_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """Under a GradScaler, scaler.step() sets found_inf and then calls step(): a fused optimizer skips on ours too.

        (Without a scaler this pre-hook runs before Lightning's closure, so there is no verdict yet: the
        flag is set in on_before_optimizer_step instead.)
        """
        p = self._pending
        existing = getattr(optimizer, "found_inf", None)
        if p is None or not self.fused or p["ours"] or existing is None:
            return
        optimizer.found_inf = torch.maximum(existing, (~p["ok"]).float().to(existing.device))

    def _post_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._pending is not None and self._pending["ours"]:
            del optimizer.grad_scale, optimizer.found_inf
            self._pending["ours"] = False

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        p = self._pending
        if p is None:  # an accumulation micro-batch: the optimizer has not stepped yet
            return
        session = self.session
        device = p["grad_norm"].device
        applied = p["ok"] if p["own_found"] is None else p["ok"] & ~p["own_found"]
        scaler = self.scaler
        if scaler is not None and p["own_found"] is not None:
            # Only we skipped (the scaler found no inf): its update() backed off the scale; undo that.
            ours_only = ~p["ok"] & ~p["own_found"]
            scale, tracker = self._scale_before
            scaler._scale.copy_(torch.where(ours_only, scale, scaler._scale))
            scaler._growth_tracker.copy_(torch.where(ours_only, tracker, scaler._growth_tracker))
        if self.clip_value is not None:  # value clipping: measure what the optimizer got (grads are still there)
            post, _ = grad_norms(session.params)
            p["post_clip_norm"] = post
            p["clipped"] = p["finite"] & (post < p["grad_norm"])
        out = {"loss": p["loss"], "grad_norm": p["grad_norm"], "post_clip_norm": p["post_clip_norm"],
               "clipped": p["clipped"], "applied": applied, "finite": p["finite"], "spike": p["spike"],
               "params_finite": all_params_finite(session.params) if self.options.check_params else
               torch.ones((), dtype=torch.bool, device=device),
               "overflow": p["overflow"],
               "count": self._count if isinstance(self._count, Tensor) else torch.full((), self._count, device=device),
               "per_param_norms": p["per_param_norms"]}
        session.after_update(out)
        num_samples = sum(batch_size(b) for b in self._micro)
        session.keep(self._micro, self._rng)
        session.epoch = trainer.current_epoch
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        loss_scale = scaler._scale if scaler is not None and scaler._scale is not None else 1.0
        self._reset_step()
        if session.record(out, num_samples=num_samples, lr=lr, loss_scale=loss_scale):
            record = session.history[-1]
            if self.options.mirror:
                pl_module.log_dict({f"stabletrain/{k}": float(v) for k, v in record.items()
                                    if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"},
                                   on_step=True, on_epoch=False, logger=True)
            if session.stop_reason is not None:
                trainer.should_stop = True

    # -- the end -----------------------------------------------------------------------------------

    def _finish(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if self.session is not None:
            self.session.close()

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._finish()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if self.session is not None and not self.session.closed:
            self.session.crash(exception)
        self._finish()
