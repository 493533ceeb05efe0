"""stabletrain in your own training loop: a few lines change, the run directory is the same as a built-in run's.

::

    monitor = stabletrain.Monitor(model, optimizer, run_dir="runs/exp1", clip_max_norm=1.0,
                                  loss_fn=lambda model, batch: model(batch).loss)   # loss_fn: for replays
    with monitor:
        for batch in loader:
            with monitor.autocast():          # optional: your precision's autocast (and the step's RNG point)
                loss = model(batch).loss
            monitor.backward(loss, batch)     # or loss.backward() / scaler.scale(loss).backward(), then step(loss=)
            monitor.step()                    # unscale, measure, guard, clip, step (skipped on the device when bad),
                                              # zero the grads, metrics; the run dir every log_every steps

``monitor.step`` is :meth:`stabletrain.step.TrainStep.update` (:mod:`stabletrain.step`) on the gradients your backward
left; a bad step is skipped (on the device with a fused optimizer or a GradScaler, else by one host read per step,
warned once). Every ``log_every`` steps one host sync writes the run directory, and a bad step is captured and
diagnosed by replaying ``loss_fn`` on the step's batches (your own backward with accumulation: ``micro_batches=``, and
``loss=`` the sum of what you backpropagated, e.g. of each micro-batch's loss / k).

Your own clipping (e.g. ``accelerator.clip_grad_norm_``) may stay: pass the pre-clip norm it returned,
``monitor.step(batch, loss=loss, grad_norm=norm)``; stabletrain then records it and does not clip again. A model
wrapped in ``DistributedDataParallel`` (under ``torchrun``) works as it is: every rank builds its Monitor, rank 0
writes the run directory. Your LR scheduler stays yours (``monitor.last_applied``: the step's device flag); resume
with ``state_dict`` and ``Monitor(..., resume=True)``; see docs/adapters.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..callbacks import Callback
from ..config import AdapterOptions
from ..data import move_to
from ..errors import StopTraining
from ..host_step import MonitorUse, as_backpropagated, backpropagated_parts, given_loss, redo_user_clip
from ..internals import unwrap
from ..policies.precision import PrecisionPolicy
from ..records.batches import batch_size
from ..records.captured import loss_recipe, model_recipe
from ..seeding import rng_state
from ..services.kept_steps import HostReplay, KeptStep
from ..step import TrainStep, build_step
from .core import RunSession

__all__ = ["Monitor", "StopTraining"]


class Monitor:
    """Measure, guard, clip and step your own loop's optimizer, and keep the run's record. See the module docstring.

    Args:
        model: the model being trained (a ``DistributedDataParallel`` wrapper under torchrun is fine).
        optimizer: its torch optimizer (``fused=True`` AdamW/Adam/SGD skip a bad step without a host sync); an
            accelerate ``AcceleratedOptimizer`` is looked through.
        run_dir: the run directory (None: guard and measure, write nothing).
        clip_max_norm: global L2 grad-norm threshold the monitor clips to (default None: it measures without clipping,
            and your loop's updates are as without it; pass your own clip's norm to ``step(grad_norm=)``).
        scaler: your ``torch.amp.GradScaler`` (fp16; accelerate's is ``accelerator.scaler``); the monitor unscales
            (unless you did) and steps through it; do not call ``scaler.step``/``scaler.update`` yourself.
        precision: "fp32", "bf16" or "fp16" for :meth:`autocast` and the record (default: fp16 with a scaler,
            else fp32). With "fp16" and no scaler the monitor makes its own and :meth:`backward` scales.
        loss_fn: ``loss_fn(model, batch) -> loss`` as your loop computes it: replays the interval's steps for a
            capture and the bad step for its diagnosis (a module-level function can also be replayed later by
            ``stabletrain diagnose``).
        model_factory: ``"module:function"`` (or the function) that builds the model, so ``stabletrain diagnose``
            can replay in a new process; default: the model's class with no arguments.
        resume: reopen ``run_dir`` to continue a run (then call :meth:`load_state_dict`).
        overwrite: replace a run already in ``run_dir``.
        callbacks: stabletrain :class:`~stabletrain.callbacks.Callback` instances (``on_step_end``, ``on_log``, ...).
        options: :class:`~stabletrain.config.adapter.AdapterOptions` (``log_every``, ``on_nonfinite``: "stop"
            raises :class:`StopTraining` at the log boundary, ``on_spike``, ``capture``, ``diagnose``, ...;
            ``trackers=["mlflow"]``: an MLflow or W&B run active in the process is written into).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, run_dir: str | Path | None = None, *,
                 clip_max_norm: float | None = None, scaler: torch.amp.GradScaler | None = None,
                 precision: str | None = None, loss_fn: Callable[[nn.Module, Any], Any] | None = None,
                 model_factory: str | Callable[[], nn.Module] | None = None, resume: bool = False,
                 overwrite: bool = False, callbacks: Sequence[Callback] = (), **options: Any) -> None:
        inner = optimizer
        while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
            inner = inner.optimizer  # accelerate's AcceleratedOptimizer (and the like) wrap the torch one
        if not isinstance(inner, torch.optim.Optimizer):
            raise TypeError(f"Monitor(optimizer=...): expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.model, self.optimizer, self.loss_fn = model, inner, loss_fn
        options = AdapterOptions(**options).checked(model=model, clip_max_norm=clip_max_norm, precision=precision,
                                                    loss_fn=loss_fn, model_factory=model_factory, run_dir=run_dir,
                                                    scaler=scaler, overwrite=overwrite, callbacks=callbacks)
        device = next(p.device for p in model.parameters())
        scaler = scaler if scaler is None or scaler.is_enabled() else None  # GradScaler(enabled=False): an fp32/bf16 run's
        mode = precision or ("fp16" if scaler is not None else "fp32")
        self.precision = PrecisionPolicy(mode, device)
        if scaler is not None:
            self.precision.scaler = scaler  # the user's scaler: its scale, growth and state are theirs
        self.session = RunSession(
            run_dir, model, host="monitor", options=options, precision=self.precision.mode, clip_max_norm=clip_max_norm,
            optimizer=inner, scaler=self.precision.scaler, replay=_MonitorReplay(self) if loss_fn is not None else None,
            recipes={"model": model_recipe(unwrap(model), "monitor", model_factory), "loss": loss_recipe(loss_fn)},
            host_config={"log_every": options.log_every, "clip_max_norm": clip_max_norm, "scaler": scaler is not None},
            callbacks=callbacks, overwrite=overwrite)
        self.step_fn = build_step(self.session.cfg, model, inner, self.precision, guard=self.session.guard,
                                  params=self.session.params)  # the built-in run's step, on your gradients
        self.clipper = self.step_fn.clipper
        self.last_applied: Tensor | None = None
        self.session.open(resume=resume)
        self.use = MonitorUse(inner, lambda: self.session.capture.replaying)  # (optimizer.step() outside step(), ...)
        self._reset()

    def _reset(self) -> None:
        self._loss: Tensor | None = None
        self._backward: list[Tensor] = []
        self._micro: list[Any] = []
        self._rng: dict[str, Any] | None = rng_state() if self.session.capturing else None
        self._rng_marked = self._autocast = False

    # -- the loop's few lines ----------------------------------------------------------------------

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Your precision's autocast (a no-op in fp32); entering it marks where the step's forward starts: a capture
        replays the step from the RNG state taken here (dropout draws the same numbers), else from the previous step's end.
        """
        if not self._rng_marked and self.session.capturing:
            self._rng, self._rng_marked = rng_state(), True
        self._autocast = True
        with self.precision.autocast():
            yield

    def backward(self, loss: Tensor, batch: Any = None) -> None:
        """Backpropagate ``loss`` (scaled in fp16) and remember it for the step's metrics and guard.

        With gradient accumulation call it once per micro-batch, with the loss as you would backpropagate
        it (e.g. ``loss / k``): the step's loss is the sum of the losses passed since the last step.
        ``batch``: the micro-batch (kept for a capture; with accumulation pass it here, not to :meth:`step`).
        """
        self.session.watch_loss(loss)
        self.precision.backward(loss)
        detached = loss.detach().float()
        self._loss = detached if self._loss is None else self._loss + detached
        self._backward.append(detached)
        if batch is not None:
            self._micro.append(batch)

    def step(self, batch: Any = None, *, loss: Tensor | None = None, num_samples: int | None = None, num_tokens: int |
             Tensor | None = None, grad_norm: Tensor | None = None, micro_batches: list[Any] | None = None) -> dict[str, Tensor]:
        """Unscale, measure, guard, clip, step (skipped on the device when bad), zero the grads; record the step.

        ``batch``: the step's batch (kept for a capture; shapes give the sample count); ``micro_batches``: instead,
        the step's micro-batches in order (accumulation with your own backward). ``loss``: the step's
        loss when you called backward yourself. ``num_samples`` / ``num_tokens``: what the step covered
        (default: the batch's leading dimension). ``grad_norm``: the pre-clip norm your own clipping returned
        (the grads are clipped already: stabletrain records it and does not clip again). Returns the step's
        device tensors (:data:`stabletrain.step.STEP_KEYS`); reading them on the host is a sync. Raises
        :class:`StopTraining` at a log boundary when ``on_nonfinite="stop"`` saw a bad step.
        """
        session = self.session
        if session.closed:
            raise RuntimeError("Monitor.step() after close(): build a new Monitor (resume=True) to continue the run")
        given = loss is not None
        loss = given_loss(loss, session.device) if given else self._loss
        if loss is None:
            raise ValueError("Monitor.step(): no loss for this step; call monitor.backward(loss) first, or pass "
                             "monitor.step(batch, loss=loss) when you ran backward yourself")
        micro = self._micro or list(micro_batches or []) or ([batch] if batch is not None else [])
        self.use.batches(len(self._backward) if session.capturing else 0, len(micro))
        if not session.started:
            session.begin()
            if self.loss_fn is not None and micro:
                session.signal_check(micro[0], self.loss_fn)
        n = num_samples if num_samples is not None else (sum(batch_size(b) for b in micro) if micro else 1)
        count = num_tokens if num_tokens is not None else n
        count = (count.detach().float().reshape(()) if isinstance(count, Tensor)
                 else torch.full((), float(count), device=loss.device))
        host = {"backward": self._backward if not given else [loss], "autocast": self._autocast, "loss": loss, "count": count,
                "whole": given and len(micro) > 1}
        session.keep(micro, self._rng, host)
        last_of_interval = (session.step + 1) % session.options.log_every == 0
        norm = torch.as_tensor(grad_norm).detach().float().reshape(()) if grad_norm is not None else None
        with self.use.stepping():
            out = self.step_fn.update(loss=loss, count=count, measure_update=last_of_interval, grad_norm=norm)
        if norm is not None and session.capturing:  # your clip, for a replay: the norms before and after it (device)
            host["user_clip"] = (norm, torch.linalg.vector_norm(out["per_param_norms"]))
        self.optimizer.zero_grad(set_to_none=True)
        self.last_applied = out["applied"]
        self._reset()
        session.record(out, num_samples=n, lr=self.optimizer.param_groups[0]["lr"], loss_scale=self.precision.loss_scale())
        if session.stop_reason is not None:
            reason = session.stop_reason
            self.close()
            raise StopTraining(session.step, reason)
        return out

    # -- progress, end and state -------------------------------------------------------------------

    @property
    def num_steps(self) -> int:
        """Optimizer steps taken (skipped ones included)."""
        return self.session.step

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every metrics record written so far (one per log interval)."""
        return self.session.history

    @property
    def run_dir(self) -> Path | None:
        return self.session.run.path if self.session.run is not None else self.session.run_dir

    def close(self) -> None:
        """Log the last partial interval and close the run directory's files (idempotent)."""
        self.use.close(self.session.step, len(self._backward), None)
        self.session.close()

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        self.use.close(self.session.step, len(self._backward), exc)
        self.session.close(exc if not isinstance(exc, StopTraining) else None)

    def state_dict(self) -> dict[str, Any]:
        """The monitor's state (progress, guard, the partial interval's metrics, loss scale): save it in your checkpoint."""
        return {**self.session.state_dict(), "precision": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any], *, path: str | None = None) -> None:
        """Restore :meth:`state_dict`; the run continues at its step (a ``resume`` event in the run directory)."""
        self.session.load_state_dict(state, path=path)
        self.precision.load_state_dict(state["precision"])


class _MonitorReplay(HostReplay):
    """Replays one of the user's steps with ``loss_fn``, through the Monitor's own update (no guard: a replayed step
    was applied), for a capture; ``loss_fn`` is also the diagnosis's loss."""

    def __init__(self, monitor: Monitor) -> None:
        self.monitor = monitor

    def replay_step(self, kept: KeptStep) -> None:
        m = self.monitor
        step = TrainStep(m.model, m.optimizer, m.precision, clipper=m.clipper, params=m.session.params,
                         check_params=False)
        m.optimizer.zero_grad(set_to_none=True)
        def forward(batch: Any) -> Tensor:
            with m.precision.autocast() if kept.host["autocast"] else contextlib.nullcontext():
                return m.loss_fn(m.model, move_to(batch, m.precision.device))
        backward = kept.host["backward"]
        if kept.host.get("whole"):  # your own backward over micro_batches=: the step's loss alone was handed
            backward = backpropagated_parts(m.model, lambda: [forward(b) for b in kept.micro], backward[0])
        for i, batch in enumerate(kept.micro):
            m.precision.backward(as_backpropagated(forward(batch), backward[i] if i < len(backward) else None, len(kept.micro)))
        clip = kept.host.get("user_clip")
        redo_user_clip(m.session.params, clip)  # your own clip, as it scaled the grads
        step.update(loss=kept.host["loss"], count=kept.host["count"], grad_norm=None if clip is None else clip[0])
        m.optimizer.zero_grad(set_to_none=True)

    def diagnosis_loss(self, kept: KeptStep) -> Callable[[nn.Module, Any], Any]:
        return self.monitor.loss_fn

