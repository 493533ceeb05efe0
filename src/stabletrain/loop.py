"""The built-in training loop: one short optimizer step and the fit loop around it.

One optimizer step (DESIGN.md, "the data's path")::

    for each micro-batch of the window (DDP: no_sync on all but the last):
        with precision.autocast(): loss_sum, count = task.loss(model, batch)
        precision.backward(window.normalize(loss_sum, count, last))   # / items in the whole window
    precision.unscale_(optimizer)                 # true grads before measuring and clipping
    norm, per_param = grad_norms(params)          # device tensors
    ok, finite, spike = guard.observe(loss, norm) # the sentinel: non-finite norm or loss, loss spike
    clipped = clipper.clip_(params, norm, ok)     # a non-finite norm is never "clipped"
    applied = precision.step(optimizer, ok)       # skipped on the device when not ok
    params_finite = guard.params_finite(params)   # cheap post-update check, one fused pass
    schedule.step(applied)                        # the LR schedule holds on a skipped step
    metrics.update(...)                           # device buffers; one sync per log interval

At a log boundary the interval's rows come to the host once; the guard decides (continue, stop,
rollback), the first bad step is captured into ``incidents/step_N`` and diagnosed, and at checkpoint
boundaries a healthy state is checkpointed atomically.

Under DDP (``torchrun``; see :mod:`stabletrain.distributed`) the same loop runs on every rank: the
model is wrapped in ``DistributedDataParallel``, each rank reads its shard of the data order, and
every decision (skip, log, stop, rollback, checkpoint) is made from values that are the same on every
rank. Only rank 0 writes the run directory; checkpoints hold every rank's RNG state and data position.
"""

from __future__ import annotations

import contextlib
import copy
import math
import signal
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .accumulation import AccumulationWindow, as_sum_count
from .checkpoint import HARMLESS_KEYS, CheckpointManager, diff_configs
from .clipping import GradClipper, grad_norms
from .config import Config, config_hash, config_to_dict
from .data import EpochOrder, Window, WindowStream, move_to
from .distributed import DistContext, PeerLostError, is_peer_failure, register_grad_flag
from .guard import Guard, GuardDecision, inputs_finite
from .incidents import diagnose_incident, write_bundle
from .initialization import InitFingerprint
from .metrics import StepMetrics, peak_memory_mib
from .numerics import unique_params
from .precision import PrecisionPolicy, resolve_device
from .records import RunDir, TensorBoardSink, build_snapshot
from .schedule import LRSchedule
from .seeding import rng_state, seed_everything, set_deterministic, set_rng_state
from .tasks import Task, resolve_task

__all__ = ["Trainer", "build_optimizer", "default_run_dir", "RESUME_HARMLESS_KEYS"]

#: Config keys that may differ when resuming a run (they change neither the math nor the data). The
#: world size is checked on its own: a checkpoint resumes only under the world size that wrote it.
RESUME_HARMLESS_KEYS = HARMLESS_KEYS + ("resume", "data.workers", "guard.capture", "guard.memory_snapshot", "guard.diagnose",
                                         "dist.*")


def clone_state(obj: Any) -> Any:
    """Return a deep copy of a (nested) state dict; tensors are cloned on their device."""
    if isinstance(obj, Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v) for v in obj)
    return copy.copy(obj)


def copy_state_into(dst: Any, src: Any) -> Any:
    """Return a deep copy of ``src`` that reuses ``dst``'s tensors where shapes and dtypes match."""
    if isinstance(src, Tensor):
        if isinstance(dst, Tensor) and dst.shape == src.shape and dst.dtype == src.dtype and dst.device == src.device:
            return dst.copy_(src.detach())
        return src.detach().clone()
    if isinstance(src, dict):
        old = dst if isinstance(dst, dict) else {}
        return {k: copy_state_into(old.get(k), v) for k, v in src.items()}
    if isinstance(src, (list, tuple)):
        old = list(dst) if isinstance(dst, (list, tuple)) and len(dst) == len(src) else [None] * len(src)
        return type(src)(copy_state_into(o, v) for o, v in zip(old, src))
    return copy.copy(src)


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

    ``run_dir=None`` trains without writing anything (checks and tests). ``resume=True`` continues the
    run in ``run_dir`` from its LAST_GOOD checkpoint, refusing a config that differs in anything but
    :data:`RESUME_HARMLESS_KEYS`, or another world size.

    When the default process group is initialized with more than one rank (torchrun; see
    :func:`stabletrain.distributed.process_group`) the model is trained with DDP: ``self.model`` is
    the ``DistributedDataParallel`` wrapper and ``self.module`` the model itself (the two are the same
    object on one process). Every rank must construct the Trainer and call :meth:`fit`.
    """

    def __init__(self, cfg: Config, task: Task | None = None, run_dir: str | Path | None = None, *,
                 resume: bool = False) -> None:
        self.cfg = cfg
        set_deterministic(cfg.deterministic)
        seed_everything(cfg.seed)
        self.task = task if task is not None else resolve_task(cfg.task, cfg.task_args)
        # Taken right after the user's init; compared before the first step (a reset_parameters(),
        # meta-device materialization or wrapper that silently re-initializes is reported by name).
        self.init_fingerprint = InitFingerprint.take(self.task.model) if not resume else None
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
        self._grad_flag = None
        if self.dist.enabled:
            # DDP broadcasts rank 0's parameters and buffers; then each rank draws its own random stream
            # (dropout), so the ranks' noise is not the same noise W times.
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = torch.nn.parallel.DistributedDataParallel(self.module, device_ids=ids)
            self._grad_flag = register_grad_flag(self.model, self.device)
            seed_everything(int(np.random.SeedSequence([cfg.seed, self.dist.rank]).generate_state(1)[0]))
        self.optimizer = build_optimizer(self.named_params, cfg, self.device)
        self.schedule = LRSchedule(self.optimizer, cfg.sched.warmup_steps, cfg.train.max_steps, cfg.sched.decay,
                                   cfg.sched.min_lr_ratio)
        self.clipper = GradClipper(cfg.clip.max_norm)
        self.window = AccumulationWindow(self.params)
        self.guard = Guard(cfg.guard, self.device)
        order = EpochOrder(len(self.task.train_data), cfg.train.batch_size, cfg.seed, cfg.data.shuffle,
                           rank=self.dist.rank, world_size=self.dist.world)
        self.stream = WindowStream(self.task.train_data, order, cfg.accum.steps, collate=self.task.collate,
                                   workers=cfg.data.workers, pin_memory=self.device.type == "cuda")
        self.metrics = StepMetrics(cfg.log.every, len(self.params), self.device, self.dist)
        self.step = 0  # optimizer steps taken (skipped ones included)
        self.samples_seen = 0
        self.tokens_seen = 0.0
        self.run: RunDir | None = None
        self.ckpt: CheckpointManager | None = None
        self.history: list[dict[str, Any]] = []  # every metrics record of this process
        self.stop_reason: str | None = None  # set when the guard or a signal ends the run early
        self._tb: TensorBoardSink | None = None
        self._bar: Any = None
        self._interval_start = time.perf_counter()
        self._eval_seconds = 0.0
        self._pending_eval: dict[str, float] = {}
        self._positions: dict[int, tuple[int, int]] = {}  # step -> (epoch, start) of its window, this interval
        self._snapshot: dict[str, Any] | None = None  # state at the start of the interval (incident replay)
        self._signal: int | None = None  # set by the SIGTERM/SIGINT handler (this process)
        self._agreed_signal: int | None = None  # DDP: the largest signal any rank had at the last log boundary
        self._seen_on: dict[int, list[int]] = {}  # step -> ranks whose own values were non-finite (DDP), last interval
        self._where = "setup"  # what the loop is doing, for a clear message when a peer is lost
        if run_dir is not None:
            run_dir = Path(self.dist.on_main(lambda: str(run_dir)))  # every rank uses rank 0's directory
            self.ckpt = CheckpointManager(run_dir / "checkpoints", keep=cfg.ckpt.keep)
            problems = self._resume_from(run_dir) if resume else []
            self.dist.on_main(lambda: self._open_run(run_dir, resume, problems))
        elif resume:
            raise ValueError("resume needs a run directory (--resume RUN_DIR)")

    def _open_run(self, run_dir: Path, resume: bool, problems: list[str]) -> None:
        """Create the run directory and write config, snapshot and resume events (rank 0 only)."""
        cfg = self.cfg
        self.run = RunDir(run_dir, resume=resume, overwrite=cfg.run.overwrite)
        self.run.write_config(cfg)
        if resume:
            for problem in problems:
                self.run.event(self.step, "checkpoint_skipped", problem)
            self.run.event(self.step, "resume", f"resumed from {self._resumed_from} at step {self.step}",
                           path=str(self._resumed_from))
        else:
            extra: dict[str, Any] = {"task_info": self.task.info}
            if self.dist.enabled:
                extra["world_size"] = self.dist.world
            self.run.write_snapshot(build_snapshot(cfg, self.device, self.precision.mode, self.task.data_fingerprint, extra))

    def _resume_from(self, run_dir: Path) -> list[str]:
        problems: list[str] = []
        if not (run_dir / "checkpoints").is_dir():
            raise FileNotFoundError(f"resume {str(run_dir)!r}: no checkpoints/ there; is it a stabletrain run directory?")
        assert self.ckpt is not None
        ckpt = self.ckpt

        chosen = []

        def choose() -> str:  # rank 0 picks the checkpoint (LAST_GOOD, or the newest that verifies)
            chosen.append(ckpt.load(on_problem=problems.append))
            return str(chosen[0].path)

        path = self.dist.on_main(choose)
        loaded = chosen[0] if chosen else ckpt.load(path)
        diffs = diff_configs(loaded.meta.get("config", {}), config_to_dict(self.cfg), harmless=RESUME_HARMLESS_KEYS)
        if diffs:
            listed = "; ".join(f"{d.key}: checkpoint {d.saved!r}, now {d.current!r}" for d in diffs)
            raise ValueError(f"resume {str(run_dir)!r}: {len(diffs)} config key(s) differ from the checkpoint's ({listed}); "
                             f"only {', '.join(RESUME_HARMLESS_KEYS)} may change")
        saved_world = int(loaded.meta.get("world_size", 1))
        if saved_world != self.dist.world:
            raise ValueError(f"resume {str(run_dir)!r}: {loaded.path.name} was written by {saved_world} process(es) and this "
                             f"run has {self.dist.world}; a checkpoint resumes only under the world size that wrote it (each "
                             f"rank's RNG stream and data shard, and the global batch train.batch_size x accum.steps x "
                             f"world size, depend on it): resume with dist.nproc={saved_world} "
                             f"(or torchrun --nproc_per_node={saved_world})")
        self.load_state_dict(loaded.state)
        self._resumed_from = loaded.path
        return problems

    # -- one optimizer step ---------------------------------------------------------------------

    def train_step(self, window: Window) -> dict[str, Tensor]:
        """Run one optimizer step on ``window``; return its figures as device tensors (no sync)."""
        model, optimizer = self.model, self.optimizer
        if not model.training:  # evaluate() switches back; a per-step .train() walks every module
            model.train()
        optimizer.zero_grad(set_to_none=True)
        self.window.begin()
        if self._grad_flag is not None:
            self._grad_flag.reset()
        inputs_ok = None
        for i, (indices, batch) in enumerate(zip(window.indices, window.batches)):
            last = i == len(window.indices) - 1
            batch = move_to(batch, self.device)
            if self.cfg.guard.check_inputs:
                flag = inputs_finite(batch)
                inputs_ok = flag if inputs_ok is None or flag is None else inputs_ok & flag
            with self._sync_context(last), self.precision.autocast():
                loss_sum, count = as_sum_count(self.task.loss(model, batch), len(indices))
            self.precision.backward(self.window.normalize(loss_sum, count, last, inputs_ok if last else None))
        self.precision.unscale_(optimizer)
        norm, per_param = grad_norms(self.params)  # DDP: of the all-reduced grads, the same on every rank
        loss = self.window.mean_loss  # DDP: the global mean, so spike detection sees the global loss
        # The sentinel: no extra pass over grads. DDP: the inputs flag is all ranks' (the window's all-reduce).
        ok, finite, spike = self.guard.observe(loss, norm, self.window.inputs_ok)
        clipped = self.clipper.clip_(self.params, norm, ok)
        applied = self.precision.step(optimizer, ok)
        params_finite = self.guard.params_finite(self.params) if self.cfg.guard.check_params else True
        self.schedule.step(applied)
        out = {"loss": loss, "grad_norm": norm, "post_clip_norm": self.clipper.post_clip_norm(norm), "clipped": clipped,
               "applied": applied, "finite": finite, "spike": spike, "params_finite": params_finite,
               "count": self.window.global_count, "per_param_norms": per_param}
        if self._grad_flag is not None:  # DDP: did THIS rank see it (its own loss, inputs or pre-all-reduce grads)?
            local = ~torch.isfinite(self.window.loss_sum) | self._grad_flag.bad
            out["local_nonfinite"] = local if inputs_ok is None else local | ~inputs_ok
        return out

    def _sync_context(self, last: bool) -> contextlib.AbstractContextManager:
        """DDP's no_sync on all but the last micro-batch of a window; nothing on one process."""
        no_sync = getattr(self.model, "no_sync", None)
        return no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()

    # -- the fit loop ---------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``train.max_steps`` (or a stop); return the last metrics record.

        Under DDP a SIGTERM/SIGINT is acted on at the next log boundary, where the ranks agree on it
        (one rank may have seen it a step before another); a lost peer raises :class:`PeerLostError`.
        """
        try:
            return self._fit()
        except Exception as err:
            if not (self.dist.enabled and is_peer_failure(err)):
                raise
            good = self.ckpt.latest_good() if self.ckpt is not None else None
            run_dir = str(self.ckpt.root.parent) if self.ckpt is not None else None
            raise PeerLostError(self.dist.rank, self._where, self.step, good.name if good else None,
                                str(err) or type(err).__name__, run_dir) from err

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        self._open_sinks()
        self._interval_start = time.perf_counter()
        self._eval_seconds = 0.0
        last_record: dict[str, Any] = {}
        restore = self._install_signal_handlers()
        ckpt = self.ckpt
        try:
            self._check_init()
            self._where = "the step-0 checkpoint"
            if ckpt is not None and self.dist.on_main(lambda: ckpt.latest_good() is None):
                self._checkpoint(healthy=True)  # step 0: rollback and resume always have a state to return to
            self._snapshot = self._capture_point()
            while self.step < cfg.train.max_steps:
                window = self.stream.next_window()
                self._positions[self.step + 1] = (window.epoch, window.start)
                self._where = "a training step (window or gradient all-reduce)"
                out = self.train_step(window)
                self.step += 1
                self.samples_seen += window.global_num_samples
                self.metrics.update(self.step, per_param_norms=out.pop("per_param_norms"),
                                    num_samples=window.global_num_samples, lr=self.schedule.lr(),
                                    loss_scale=self.precision.loss_scale(), **out)
                if self._bar is not None:
                    self._bar.update(1)
                done = self.step >= cfg.train.max_steps
                if done or (cfg.eval.every and self.step % cfg.eval.every == 0):
                    self._where = "the validation reduce"
                    self._pending_eval = self.evaluate()
                ckpt_due = bool(cfg.ckpt.every) and self.step % cfg.ckpt.every == 0
                # Under DDP a signal waits for the next log boundary, where every rank learns of it.
                signalled = self._signal is not None and not self.dist.enabled
                if not (done or ckpt_due or signalled or self.step % cfg.log.every == 0):
                    continue
                self._where = "the log-interval reduce (or an incident replay or rollback)"
                last_record, decision = self._log()
                healthy = self._act(decision)
                if self.stop_reason is not None:
                    break
                if decision.action == "rollback":  # back at LAST_GOOD: nothing new to checkpoint
                    self._snapshot = self._capture_point()
                    continue
                # Under DDP only the signal the ranks agreed on in _log counts: a signal arriving since
                # reached this rank alone, and acting on it here would leave the others waiting.
                stop_signal = self._agreed_signal if self.dist.enabled else self._signal
                if done or ckpt_due or stop_signal:
                    self._where = "the checkpoint gather"
                    self._checkpoint(healthy)
                if stop_signal:
                    self._signal = stop_signal
                    self.stop_reason = f"stopped by {signal.Signals(stop_signal).name} at step {self.step}"
                    break
                self._snapshot = self._capture_point()
        finally:
            restore()
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
        batches = batches[self.dist.rank::self.dist.world]  # DDP: each rank its share of the same batches
        collate = self.task.collate or torch.utils.data.default_collate
        total = torch.zeros(2, device=self.device)
        for indices in batches:
            batch = move_to(collate([self.task.val_data[i] for i in indices]), self.device)
            with self.precision.autocast():  # the model itself: a forward through DDP could broadcast buffers
                loss_sum, count = as_sum_count(self.task.loss(self.module, batch), len(indices))
            total += torch.stack([loss_sum.detach(), count])
        loss_sum, count = self.dist.all_reduce_(total).tolist()  # the eval pass's one sync (and one all-reduce)
        self.model.train()
        self._eval_seconds += time.perf_counter() - t0
        return {"val_loss": loss_sum / max(count, 1.0)}

    def _log(self) -> tuple[dict[str, Any], GuardDecision]:
        summary, rows, param_sq = self.metrics.reduce(self._signal or 0)  # the interval's one sync (DDP: one all-gather)
        self._agreed_signal = summary["interval_signal"] or None  # DDP: every rank stops here if any was signalled
        now = time.perf_counter()
        elapsed = max(now - self._interval_start - self._eval_seconds, 1e-9)
        self._interval_start, self._eval_seconds = now, 0.0
        self.tokens_seen += summary["interval_tokens"]
        decision = self.guard.decide(rows)
        total_sq = sum(param_sq) or 1.0
        top = sorted(range(len(param_sq)), key=lambda i: -param_sq[i])[: self.cfg.log.top_layers]
        record = {
            **{k: v for k, v in summary.items() if not k.startswith("interval_")},
            "num_incidents": self.guard.num_incidents,
            "num_rollbacks": self.guard.num_rollbacks,
            "tokens_per_s": summary["interval_tokens"] / elapsed,
            "samples_per_s": summary["interval_samples"] / elapsed,
            "step_time_s": elapsed / summary["interval_steps"],
            "peak_memory_mib": peak_memory_mib(self.device),
            "epoch": self.stream.epoch,
            "samples_seen": self.samples_seen,
            "tokens_seen": self.tokens_seen,
            "top_grad_layers": [{"name": self.named_params[i][0], "share": param_sq[i] / total_sq} for i in top],
            **self._pending_eval,
        }
        if self.dist.enabled:
            record["world_size"] = self.dist.world
        self._pending_eval = {}
        for row in rows:
            self._row_events(row.step, row.values, row.ranks)
        self._seen_on = {row.step: row.ranks for row in rows}
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
        return record, decision

    def _row_events(self, step: int, values: dict[str, float], ranks: list[int] | None = None) -> None:
        if self.run is None:
            return
        if values["finite"] < 0.5:
            what = "loss" if not math.isfinite(values["loss"]) else "grad norm (or inputs)"
            where: dict[str, Any] = {}
            seen = ""
            if self.dist.enabled:
                where["ranks"] = list(ranks or [])
                seen = f" (seen on rank(s) {where['ranks']})" if ranks else " (on no rank's own values: after the all-reduce)"
            self.run.event(step, "nonfinite", f"non-finite {what}{seen}: loss={values['loss']}, grad_norm={values['grad_norm']}",
                           loss=values["loss"], grad_norm=values["grad_norm"], **where)
        elif values["params_finite"] < 0.5:
            self.run.event(step, "nonfinite", "parameters became non-finite in the update (loss and grad norm were finite)",
                           loss=values["loss"], grad_norm=values["grad_norm"], after_update=True)
        if values["spike"] > 0.5:
            self.run.event(step, "spike", f"loss spike: {values['loss']:.4g} (rule: > {self.cfg.guard.spike_ratio:g}x the "
                           f"median and z > {self.cfg.guard.spike_zscore:g} over the last {self.cfg.guard.spike_window} steps)",
                           loss=values["loss"], action=self.cfg.guard.on_spike)
        if values["applied"] < 0.5:
            if values["finite"] >= 0.5 and values["spike"] > 0.5:
                reason = "loss spike (guard.on_spike=skip)"
            elif self.precision.scaler is not None:
                reason = "fp16 overflow (GradScaler)"
            else:
                reason = "non-finite loss or grad norm"
            self.run.event(step, "skip", f"optimizer step skipped: {reason}", loss_scale=values["loss_scale"])

    # -- acting on what the guard saw -----------------------------------------------------------

    def _act(self, decision: GuardDecision) -> bool:
        """Capture and diagnose the first incident, then stop or roll back as decided; return healthy."""
        # Every rank takes part (the replay has collectives): the condition is the same on all of them.
        if decision.first_incident is not None and self.cfg.guard.capture \
                and (self.ckpt is not None or self._snapshot is not None):
            self._capture_incident(decision.first_incident, decision.after_update,
                                   self._seen_on.get(decision.first_incident, []))
        if decision.action == "stop":
            self.stop_reason = decision.reason
            if self.run is not None:
                self.run.event(self.step, "stop", f"stopping: {decision.reason}")
            return False
        if decision.action == "rollback":
            self._rollback(decision)
            return True
        return not decision.bad_steps or (self.guard.consecutive_skips == 0 and not decision.after_update)

    def _check_init(self) -> None:
        """Report every parameter whose init changed between the task factory and the first step."""
        if self.init_fingerprint is None or self.step > 0:
            return
        changes = self.init_fingerprint.compare(self.module)
        self.init_fingerprint = None
        if changes and self.run is not None:
            self.run.event(self.step, "init_overwritten", InitFingerprint.describe(changes),
                           params=[c.as_dict() for c in changes])

    def _capture_point(self) -> dict[str, Any] | None:
        """Start a new interval; with ``guard.memory_snapshot`` keep the state at its start in memory.

        Without it (the default) an incident is replayed from LAST_GOOD, so no per-interval copy of the
        state is paid. The snapshot reuses the previous one's buffers: no allocation per interval.
        """
        self._positions = {s: p for s, p in self._positions.items() if s > self.step}
        if not (self.cfg.guard.capture and self.cfg.guard.memory_snapshot):
            return None
        return copy_state_into(self._snapshot, self.state_dict())

    def _load_last_good(self) -> Any:
        """Load LAST_GOOD (a LoadedCheckpoint) on every rank, or return None when there is none.

        Rank 0 picks it (LAST_GOOD, or the newest that verifies); every rank then loads that one.
        """
        ckpt = self.ckpt
        chosen: list[Any] = []

        def choose() -> str | None:
            if ckpt is None or ckpt.latest_good() is None:
                return None
            chosen.append(ckpt.load())
            return str(chosen[0].path)

        path = self.dist.on_main(choose)
        if path is None or ckpt is None:
            return None
        return chosen[0] if chosen else ckpt.load(path)

    def _replay_source(self) -> dict[str, Any] | None:
        """The newest state before the current interval's steps: the in-memory snapshot, else LAST_GOOD."""
        if self._snapshot is not None:
            return self._snapshot
        loaded = self._load_last_good()
        return loaded.state if loaded is not None else None

    def _capture_incident(self, step: int, after_update: bool, ranks: list[int] | None = None) -> None:
        """Replay from LAST_GOOD (or the interval's snapshot) to just before ``step``; write its incident bundle.

        Under DDP every rank replays (the replay's collectives need them all); the bundle holds the
        window and RNG state of the rank that saw the bad value (``ranks``; rank 0 when none did, e.g.
        a bad update), so its diagnosis replays on that rank's batch. Rank 0 writes it (the model and
        optimizer state are the same on every rank): ``incidents/step_N`` for the first such rank,
        ``incidents/step_N/rank_R`` for any other.
        """
        source = self._replay_source()
        if source is None:
            if self.run is not None:
                self.run.event(step, "incident", f"step {step} not captured: no good state to replay from (no verified "
                               "checkpoint yet; was the state non-finite from the start?)", after_update=after_update,
                               ranks=sorted(ranks or []))
            return
        current = clone_state(self.state_dict())
        skip = set(self.stream.skip)
        self.load_state_dict(source)
        self.stream.skip = skip  # windows a rollback skipped after that state was saved stay skipped
        while self.step < step - 1:
            self.train_step(self.stream.next_window())
            self.step += 1
        rng = rng_state()
        window = self.stream.next_window()
        mine = {"rank": self.dist.rank, "rng": rng, "window": {"epoch": window.epoch, "start": window.start,
                                                               "indices": window.indices}}
        per_rank = self.dist.gather_objects(mine)
        model_state = clone_state(self.module.state_dict()) if self.run is not None else None
        optimizer_state = clone_state(self.optimizer.state_dict()) if self.run is not None else None
        schedule_state, precision_state = self.schedule.state_dict(), self.precision.state_dict()
        self.load_state_dict(current)
        if self.run is None:
            return
        row_loss = next((r for r in self.history[-1:]), {})
        seen = sorted(ranks or []) or [0]
        incident_dir = self.run.path / "incidents" / f"step_{step:06d}"
        fields: dict[str, Any] = {"path": str(incident_dir), "after_update": after_update}
        if self.dist.enabled:
            fields["ranks"] = sorted(ranks or [])
        for n, r in enumerate(seen):
            directory = incident_dir if n == 0 else incident_dir / f"rank_{r}"
            write_bundle(directory, {
                "step": step, "rank": r, "world_size": self.dist.world, "config": config_to_dict(self.cfg),
                "window": per_rank[r]["window"], "rng": per_rank[r]["rng"], "model": model_state,
                "optimizer": optimizer_state, "schedule": schedule_state, "precision": precision_state,
                "observed": {"after_update": after_update, "interval_loss": row_loss.get("loss"), "ranks": sorted(ranks or [])},
            })
        if self.cfg.guard.diagnose:  # on the first rank that saw it, on that rank's batch
            try:
                diagnosis = diagnose_incident(incident_dir, self.task, device=str(self.device))
                fields["diagnosis"] = {k: diagnosis.get(k) for k in ("summary", "stage", "op", "direction", "module",
                                                                     "origin", "first_nonfinite_param", "bad_samples",
                                                                     "reproduces", "rank")}
                on_rank = f" (rank {seen[0]})" if self.dist.enabled else ""
                print(f"stabletrain: incident at step {step}{on_rank}: {diagnosis.get('summary')}", flush=True)
            except Exception as err:  # a diagnosis that fails must not take the run down with it
                fields["diagnosis_error"] = f"{type(err).__name__}: {err}"
        seen_note = f" (seen on rank(s) {sorted(ranks)})" if self.dist.enabled and ranks else ""
        self.run.event(step, "incident", f"captured step {step}{seen_note} into {incident_dir}", **fields)

    def _rollback(self, decision: GuardDecision) -> None:
        """Restore LAST_GOOD and never train on the windows of the offending steps again."""
        bad = sorted(set(decision.bad_steps) | set(decision.spike_steps if self.cfg.guard.on_spike == "rollback" else []))
        windows = {self._positions[s] for s in bad if s in self._positions}
        loaded = self._load_last_good()
        if loaded is None:
            self.stop_reason = f"{decision.reason}; no checkpoint to roll back to"
            if self.run is not None:
                self.run.event(self.step, "stop", f"stopping: {self.stop_reason}")
            return
        from_step = self.step
        counters = (self.guard.num_rollbacks, self.guard.num_incidents, self.guard.num_spikes)
        skip = self.stream.skip | windows
        self.load_state_dict(loaded.state)
        self.guard.num_rollbacks, self.guard.num_incidents, self.guard.num_spikes = counters
        self.stream.skip = skip
        if self.run is not None:
            self.run.event(self.step, "rollback", f"{decision.reason}: rolled back from step {from_step} to {loaded.path.name}; "
                           f"skipping data windows {sorted(windows)}", from_step=from_step, to_step=self.step,
                           path=str(loaded.path), skipped_windows=sorted(windows))
        if self._bar is not None:
            self._bar.n = self.step
            self._bar.refresh()

    def _checkpoint(self, healthy: bool) -> None:
        """Write a checkpoint from a healthy state (never from inside an incident); record the event.

        Under DDP every rank sends rank 0 its RNG state and data position (one all_gather_object);
        rank 0 writes them all, with the world size, and only rank 0 writes.
        """
        if self.ckpt is None:
            return
        if not healthy:
            if self.run is not None:
                good = self.ckpt.latest_good()
                self.run.event(self.step, "checkpoint_withheld", f"checkpoint at step {self.step} withheld: inside an "
                               f"incident; LAST_GOOD stays at {good.name if good else 'none'}")
            return
        state = self.state_dict()
        meta = {"config": config_to_dict(self.cfg), "config_hash": config_hash(self.cfg)}
        if self.dist.enabled:
            per_rank = self.dist.gather_objects({"rng": state["rng"], "stream": state["stream"]})
            state["ranks"] = per_rank
            state["world_size"] = meta["world_size"] = self.dist.world
        if self.run is None:
            return
        try:
            result = self.ckpt.save(state, self.step, meta)
        except Exception as err:  # the previous checkpoint is intact; say so and keep training
            self.run.event(self.step, "checkpoint_failed", f"checkpoint at step {self.step} failed: {err}")
            return
        self.run.event(self.step, result.kind, result.reason, **result.event_fields())

    def _install_signal_handlers(self) -> Any:
        """SIGTERM/SIGINT: finish the step, checkpoint, stop. A second signal interrupts at once."""
        if threading.current_thread() is not threading.main_thread():
            return lambda: None

        def handler(signum: int, frame: Any) -> None:
            if self._signal is not None:
                raise KeyboardInterrupt  # second signal: leave now; checkpoints are written atomically
            self._signal = signum

        old = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}

        def restore() -> None:
            for sig, h in old.items():
                signal.signal(sig, h)

        return restore

    # -- sinks ----------------------------------------------------------------------------------

    def _open_sinks(self) -> None:
        if self.run is not None and self.cfg.log.tensorboard and self._tb is None:
            self._tb = TensorBoardSink(self.run.path / "tb")
        if self.cfg.log.progress and self._bar is None and self.dist.is_main:
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
        """Everything the next step depends on (model, optimizer, policies, data position, RNG, counters).

        This rank's: under DDP a checkpoint adds every rank's RNG state and data position (``ranks``).
        """
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "precision": self.precision.state_dict(),
            "clipper": self.clipper.state_dict(),
            "guard": self.guard.state_dict(),
            "metrics": self.metrics.state_dict(),
            "stream": self.stream.state_dict(),
            "rng": rng_state(),
            "counters": {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or a checkpoint: this rank's RNG and data position from ``ranks``)."""
        if "ranks" in state:
            if len(state["ranks"]) != self.dist.world:
                raise ValueError(f"the state holds {len(state['ranks'])} ranks' RNG states and this run has "
                                 f"{self.dist.world} processes; resume under the world size that wrote it")
            mine = state["ranks"][self.dist.rank]
            state = {**state, "rng": mine["rng"], "stream": mine["stream"]}
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["schedule"])  # after the optimizer: rewrites its lr tensors
        self.precision.load_state_dict(state["precision"])
        self.clipper.load_state_dict(state["clipper"])
        self.guard.load_state_dict(state["guard"])
        self.metrics.load_state_dict(state["metrics"])
        self.stream.load_state_dict(state["stream"])
        set_rng_state(state["rng"])
        c = state["counters"]
        self.step, self.samples_seen, self.tokens_seen = int(c["step"]), int(c["samples_seen"]), float(c["tokens_seen"])
