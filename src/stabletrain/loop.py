"""The built-in training loop: one short optimizer step and the fit loop around it.

One optimizer step (DESIGN.md, "the data's path")::

    for each micro-batch of the window (DDP: no_sync on all but the last):
        with precision.autocast(): loss_sum, count = task.loss(model, batch)
        precision.backward(window.normalize(loss_sum, count, last))   # / items in the whole window
    precision.unscale_(optimizer)                 # true grads before measuring and clipping
    norm, per_param = grad_norms(params)          # device tensors; non-finite norm = the sentinel
    clipped = clipper.clip_(params, norm, finite) # a non-finite norm is never "clipped"
    applied = precision.step(optimizer, finite)   # skipped on the device when not finite
    schedule.step(applied)                        # the LR schedule holds on a skipped step
    metrics.update(...)                           # device buffers; one sync per log interval
"""

from __future__ import annotations

import contextlib
import math
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .accumulation import AccumulationWindow, as_sum_count
from .clipping import GradClipper, grad_norms
from .config import Config
from .data import EpochOrder, Window, WindowStream, move_to
from .metrics import StepMetrics, peak_memory_mib
from .numerics import top_grad_norms  # noqa: F401  (re-exported for users of the loop module)
from .precision import PrecisionPolicy, resolve_device
from .records import RunDir, TensorBoardSink, build_snapshot
from .schedule import LRSchedule
from .seeding import rng_state, seed_everything, set_deterministic, set_rng_state
from .tasks import Task, resolve_task

__all__ = ["Trainer", "build_optimizer", "unique_params", "default_run_dir"]


def unique_params(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Return the trainable (name, parameter) pairs, each parameter once (tied weights appear once)."""
    seen: set[int] = set()
    out = []
    for name, p in model.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def build_optimizer(named_params: list[tuple[str, nn.Parameter]], cfg: Config, device: torch.device) -> torch.optim.Optimizer:
    """Return fused AdamW with weight decay on matrices only (not biases, norms or other 1-D params).

    ``fused=True`` lets the step be skipped on the device (``found_inf``) and take a tensor lr.
    """
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
                             fused=fused)


def default_run_dir(cfg: Config) -> Path:
    name = cfg.task.split(":")[-1].replace("/", "_")
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


class Trainer:
    """Train ``task`` under ``cfg``: builds the policies, runs steps, writes the run directory.

    ``run_dir=None`` trains without writing anything (useful for checks and tests).
    """

    def __init__(self, cfg: Config, task: Task | None = None, run_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        set_deterministic(cfg.deterministic)
        seed_everything(cfg.seed)
        self.task = task if task is not None else resolve_task(cfg.task, cfg.task_args)
        self.device = resolve_device(cfg.device)
        self.precision = PrecisionPolicy(cfg.precision, self.device)
        self.model = self.task.model.to(self.device)
        self.named_params = unique_params(self.model)
        if not self.named_params:
            raise ValueError(f"task {cfg.task!r}: the model has no trainable parameters")
        self.params = [p for _, p in self.named_params]
        self.optimizer = build_optimizer(self.named_params, cfg, self.device)
        self.schedule = LRSchedule(self.optimizer, cfg.sched.warmup_steps, cfg.train.max_steps, cfg.sched.decay,
                                   cfg.sched.min_lr_ratio)
        self.clipper = GradClipper(cfg.clip.max_norm)
        self.window = AccumulationWindow(self.params)
        order = EpochOrder(len(self.task.train_data), cfg.train.batch_size, cfg.seed, cfg.data.shuffle)
        self.stream = WindowStream(self.task.train_data, order, cfg.accum.steps, collate=self.task.collate,
                                   workers=cfg.data.workers, pin_memory=self.device.type == "cuda")
        self.metrics = StepMetrics(cfg.log.every, len(self.params), self.device)
        self.step = 0  # optimizer steps taken (skipped ones included)
        self.samples_seen = 0
        self.tokens_seen = 0.0
        self.run: RunDir | None = None
        self._tb: TensorBoardSink | None = None
        self._bar: Any = None
        self.history: list[dict[str, Any]] = []  # every metrics record of this process
        self._interval_start = time.perf_counter()
        self._eval_seconds = 0.0
        if run_dir is not None:
            self.run = RunDir(run_dir, overwrite=cfg.run.overwrite)
            self.run.write_config(cfg)
            self.run.write_snapshot(build_snapshot(cfg, self.device, self.precision.mode, self.task.data_fingerprint,
                                                   {"task_info": self.task.info}))

    # -- one optimizer step ---------------------------------------------------------------------

    def train_step(self, window: Window) -> dict[str, Tensor]:
        """Run one optimizer step on ``window``; return its figures as device tensors (no sync)."""
        model, optimizer = self.model, self.optimizer
        model.train()
        optimizer.zero_grad(set_to_none=True)
        self.window.begin()
        for i, (indices, batch) in enumerate(zip(window.indices, window.batches)):
            last = i == len(window.indices) - 1
            with self._sync_context(last), self.precision.autocast():
                loss_sum, count = as_sum_count(self.task.loss(model, move_to(batch, self.device)), len(indices))
            self.precision.backward(self.window.normalize(loss_sum, count, last))
        self.precision.unscale_(optimizer)
        norm, per_param = grad_norms(self.params)
        loss = self.window.mean_loss
        finite = torch.isfinite(norm) & torch.isfinite(loss)  # the sentinel: no extra pass over the grads
        clipped = self.clipper.clip_(self.params, norm, finite)
        applied = self.precision.step(optimizer, finite)
        self.schedule.step(applied)
        return {"loss": loss, "grad_norm": norm, "post_clip_norm": self.clipper.post_clip_norm(norm), "clipped": clipped,
                "applied": applied, "finite": finite, "count": self.window.global_count, "per_param_norms": per_param}

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync on all but the last micro-batch of a window; nothing on one process."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()

    # -- the fit loop ---------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``train.max_steps``; return the last metrics record."""
        cfg = self.cfg
        self._open_sinks()
        self._interval_start = time.perf_counter()
        self._eval_seconds = 0.0
        last_record: dict[str, Any] = {}
        try:
            while self.step < cfg.train.max_steps:
                window = self.stream.next_window()
                out = self.train_step(window)
                self.step += 1
                self.samples_seen += window.num_samples
                self.metrics.update(self.step, loss=out["loss"], grad_norm=out["grad_norm"],
                                    post_clip_norm=out["post_clip_norm"], clipped=out["clipped"], applied=out["applied"],
                                    finite=out["finite"], lr=self.schedule.lr(), loss_scale=self.precision.loss_scale(),
                                    count=out["count"], per_param_norms=out["per_param_norms"],
                                    num_samples=window.num_samples)
                if self._bar is not None:
                    self._bar.update(1)
                done = self.step >= cfg.train.max_steps
                record: dict[str, Any] = {}
                if done or (cfg.eval.every and self.step % cfg.eval.every == 0):
                    record.update(self.evaluate())
                if done or self.step % cfg.log.every == 0:
                    last_record = self._log(record)
        finally:
            self._close_sinks()
        return last_record

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Return ``{"val_loss": mean loss per item}`` over ``eval.batches`` fixed batches (one sync)."""
        if self.task.val_data is None or len(self.task.val_data) == 0:
            return {}
        t0 = time.perf_counter()
        self.model.eval()
        order = EpochOrder(len(self.task.val_data), self.cfg.train.batch_size, seed=0, shuffle=False)
        batches = order.micro_batches(0)
        if self.cfg.eval.batches:
            batches = batches[: self.cfg.eval.batches]
        collate = self.task.collate or torch.utils.data.default_collate
        total = torch.zeros(2, device=self.device)
        for indices in batches:
            batch = move_to(collate([self.task.val_data[i] for i in indices]), self.device)
            with self.precision.autocast():
                loss_sum, count = as_sum_count(self.task.loss(self.model, batch), len(indices))
            total += torch.stack([loss_sum.detach(), count])
        loss_sum, count = total.tolist()  # the eval pass's one sync
        self.model.train()
        self._eval_seconds += time.perf_counter() - t0
        return {"val_loss": loss_sum / max(count, 1.0)}

    def _log(self, extra: dict[str, Any]) -> dict[str, Any]:
        summary, rows, param_sq = self.metrics.reduce()  # the interval's one sync
        now = time.perf_counter()
        elapsed = max(now - self._interval_start - self._eval_seconds, 1e-9)
        self._interval_start, self._eval_seconds = now, 0.0
        self.tokens_seen += summary["interval_tokens"]
        total_sq = sum(param_sq) or 1.0
        top = sorted(range(len(param_sq)), key=lambda i: -param_sq[i])[: self.cfg.log.top_layers]
        record = {
            **{k: v for k, v in summary.items() if not k.startswith("interval_")},
            "tokens_per_s": summary["interval_tokens"] / elapsed,
            "samples_per_s": summary["interval_samples"] / elapsed,
            "step_time_s": elapsed / summary["interval_steps"],
            "peak_memory_mib": peak_memory_mib(self.device),
            "epoch": self.stream.epoch,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "top_grad_layers": [{"name": self.named_params[i][0], "share": param_sq[i] / total_sq} for i in top],
            **extra,
        }
        for row in rows:
            self._row_events(row.step, row.values)
        self.history.append(record)
        if self.run is not None:
            self.run.metrics.write(record)
        if self._tb is not None:
            self._tb.write(record)
        if self._bar is not None:
            shown = {"loss": f"{record['loss']:.4f}", "gnorm": f"{record['grad_norm']:.3g}", "lr": f"{record['lr']:.2e}",
                     "tok/s": f"{record['tokens_per_s']:.0f}"}
            if "val_loss" in record:
                shown["val"] = f"{record['val_loss']:.4f}"
            self._bar.set_postfix(shown, refresh=True)
        return record

    def _row_events(self, step: int, values: dict[str, float]) -> None:
        if self.run is None:
            return
        if values["finite"] < 0.5:
            what = "loss" if not math.isfinite(values["loss"]) else "grad norm"
            self.run.event(step, "nonfinite", f"non-finite {what}: loss={values['loss']}, grad_norm={values['grad_norm']}",
                           loss=values["loss"], grad_norm=values["grad_norm"])
        if values["applied"] < 0.5:
            reason = "fp16 overflow (GradScaler)" if self.precision.scaler is not None else "non-finite loss or grad norm"
            self.run.event(step, "skip", f"optimizer step skipped: {reason}", loss_scale=values["loss_scale"])

    def _open_sinks(self) -> None:
        if self.run is not None and self.cfg.log.tensorboard and self._tb is None:
            self._tb = TensorBoardSink(self.run.path / "tb")
        if self.cfg.log.progress and self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.cfg.train.max_steps, initial=self.step, desc=self.task.name, unit="step",
                             dynamic_ncols=True)

    def _close_sinks(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self.run is not None:
            self.run.close()

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything the next step depends on (model, optimizer, policies, data position, RNG, counters)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "precision": self.precision.state_dict(),
            "clipper": self.clipper.state_dict(),
            "metrics": self.metrics.state_dict(),
            "stream": self.stream.state_dict(),
            "rng": rng_state(),
            "counters": {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])  # after the optimizer: rewrites its lr tensors
        self.precision.load_state_dict(state["precision"])
        self.clipper.load_state_dict(state["clipper"])
        self.metrics.load_state_dict(state["metrics"])
        self.stream.load_state_dict(state["stream"])
        set_rng_state(state["rng"])
        c = state["counters"]
        self.step, self.samples_seen, self.tokens_seen = int(c["step"]), int(c["samples_seen"]), float(c["tokens_seen"])
