"""Steady-state per-step overhead of the built-in loop against a hand-written bare PyTorch loop.

Both train the same model from the same init on the same data with the same fused AdamW, the same
LR schedule shape and global-norm clipping. The built-in loop runs ``Trainer.fit()`` with its default
monitoring on: device-side metrics, the sentinel, the per-interval sync, metrics.jsonl, events.jsonl,
TensorBoard, the progress bar and the default checkpoint cadence.

What is timed. Each round builds a fresh Trainer and a fresh bare loop from the same init and runs
them in lockstep: a callback (:class:`Lockstep`, public hooks only) runs one bare step in every
``on_step_end``, between two built-in steps, so a burst of load from another process hits both alike;
a round-level interleave on a shared 2-core machine swings the ratio by 2-4x. The ratio reported is
the median, over every log interval of every round, of the built-in time over the bare time of the
same interval.

* both variants run ``warmup + steps + 1`` optimizer steps; the built-in clock is read at each
  ``on_step_end`` with the bare steps' time taken off, and covers the ``steps`` steps after the
  warm-up (from the end of step ``warmup + 1`` to the end of step ``warmup + steps + 1``; each side's
  window holds the same number of data fetches). ``steps`` is a multiple of ``log.every``, so the
  built-in time holds exactly ``steps / log.every`` log intervals: the interval's one sync and
  jsonl/TensorBoard/progress writes and events are in it, amortized as they are in a real run.
* one-time setup is not: Trainer construction (run dir, config, snapshot, git), the SummaryWriter,
  the step-0 checkpoint that ``fit()`` writes, the last step's final checkpoint and closing.
* periodic checkpoints (``ckpt.every``, default 100 steps) stay on at their default cadence, but their
  time is taken off the built-in clock (a short timed window holds too many or too few of them): a
  checkpoint is the time from the callback's ``on_log`` (or ``on_fit_start`` for step 0) to its
  ``on_checkpoint`` at the same boundary. The median checkpoint (step 0 included) is shown amortized
  over ``ckpt.every`` on its own line. Validation is off in both (the bare loop has none).

``--nonfused`` (on by default) adds a row for an optimizer that cannot skip a step on the device: the
task's own factory returning ``AdamW(foreach=True)`` (not fused), so ``PrecisionPolicy.step`` reads the
skip flag on the host every step (and ``LRSchedule``, whose lr is then a host float, reads the lr
factor: a second read). Its rounds alternate with the fused default's on the first task;
each runs beside the fused bare loop and (the non-fused rounds) also beside a bare loop with the same
non-fused AdamW, which splits its cost into the optimizer's own kernels and what stabletrain adds.

``--items`` (on by default) then times each piece of the built-in per-step path in isolation on the
task and prints its cost in microseconds and in percent of the bare step; ``--profile`` adds a
cProfile of the built-in loop's steady state.

    python bench/overhead.py                       # gpt and mlp, about 3-4 minutes on 2 CPU cores
    python bench/overhead.py --tasks gpt --rounds 9 --steps 30
    python bench/overhead.py --no-items --profile
    python bench/overhead.py --tasks mlp --no-run-dir --set log.every=200   # the per-step cost alone (one boundary)
    python bench/overhead.py --quick               # smoke run (smaller task, few rounds and steps), not a measurement
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import cProfile
import io
import math
import os
import pstats
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from stabletrain import Trainer, load_config, resolve_task
from stabletrain.callbacks import Callback, RunState
from stabletrain.data import move_to
from stabletrain.numerics import all_params_finite, grad_norms
from stabletrain.policies.accumulation import as_sum_count
from stabletrain.policies.metrics import peak_memory_mib
from stabletrain.policies.precision import PrecisionPolicy
from stabletrain.policies.schedule import LRSchedule

# (warm-up steps, timed steps, rounds) per task; timed steps are a multiple of log.every (10).
DEFAULTS = {"gpt": (10, 30, 7), "mlp": (20, 200, 7)}
QUICK = {"gpt": (5, 10, 2), "mlp": (5, 20, 2)}
#: --quick also shrinks the task, so a smoke run of the whole script fits in about a minute.
QUICK_ARGS = {"gpt": ["task_args.n_layer=1", "task_args.n_embd=64", "task_args.seq_len=32", "task_args.max_bytes=300000"],
              "mlp": ["task_args.num_samples=1024"]}

OptimizerFactory = Callable[[list[tuple[str, torch.nn.Parameter]]], torch.optim.Optimizer]


def load_average() -> str:
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "load average n/a"


def param_groups(named_params: list[tuple[str, torch.nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only, as the built-in optimizers do."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]]


def nonfused_adamw(cfg: Any) -> OptimizerFactory:
    """A task optimizer factory: the config's AdamW, ``foreach=True`` and not fused (cannot skip on the device)."""
    o = cfg.optim

    def factory(named_params: list[tuple[str, torch.nn.Parameter]]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(param_groups(named_params, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2),
                                 eps=o.eps, foreach=True, fused=False)

    return factory


# -- the two loops ------------------------------------------------------------------------------


class BareLoop:
    """A plain nanoGPT-style loop, one step per call: zero_grad, fetch, forward, backward, clip, step, schedule.

    ``optimizer``: a factory over ``model.named_parameters()`` (default: the config's AdamW, fused).
    """

    def __init__(self, task: Any, model: torch.nn.Module, cfg: Any, optimizer: OptimizerFactory | None = None) -> None:
        self.task, self.model, self.cfg = task, model, cfg
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        if optimizer is not None:
            self.opt = optimizer(named)
        else:
            self.opt = torch.optim.AdamW(param_groups(named, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                         betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, fused=True)
        warm, total, floor = cfg.sched.warmup_steps, cfg.train.max_steps, cfg.sched.min_lr_ratio

        def factor(n: int) -> float:
            w = min((n + 1) / warm, 1.0) if warm else 1.0
            p = min(max((n - warm) / max(total - warm, 1), 0.0), 1.0)
            return w * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * p)))

        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, factor)
        self.loader = DataLoader(task.train_data, batch_size=cfg.train.batch_size, shuffle=True,
                                 generator=torch.Generator().manual_seed(0),
                                 collate_fn=task.collate or torch.utils.data.default_collate)
        self.it = iter(self.loader)
        model.train()

    def _next(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:  # a new epoch: a new shuffled iterator, as a plain loop does
            self.it = iter(self.loader)
            return next(self.it)

    def _loss(self, batch: Any) -> torch.Tensor:
        """The per-item loss as a plain loop writes it: a mean as it is, a ``(sum, count)`` pair divided."""
        out = self.task.loss(self.model, batch)
        return out[0] / out[1] if isinstance(out, (tuple, list)) else out

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self._loss(self._next()).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip.max_norm)
        self.opt.step()
        self.sched.step()


def make_trainer(task: Any, model: torch.nn.Module, cfg: Any, run_dir: Path | None,
                 optimizer: OptimizerFactory | None = None, callbacks: list[Callback] = ()) -> Trainer:
    run_task = copy.copy(task)
    run_task.model = model
    run_task.val_data = None  # validation is not part of the comparison (the bare loop has none)
    if optimizer is not None:
        run_task.optimizer = optimizer
    return Trainer(cfg, task=run_task, run_dir=run_dir, callbacks=callbacks)


class Lockstep(Callback):
    """Run one step of each bare loop beside every built-in step; keep both clocks, take checkpoints off.

    ``entries[i]``: the built-in clock (wall time less every bare step and checkpoint so far) at the
    ``on_step_end`` of the i-th step of this fit; ``bare_s[name][i]``: the bare step run right after it.
    ``ckpt_s``: from this callback's ``on_log`` to an ``on_checkpoint`` (appended last, so its ``on_log`` runs
    after the sinks wrote and its ``on_checkpoint`` after the checkpoint event was written). Checkpoints
    are written in the background: a periodic one reports at a later boundary, so what the step waited
    for (the check and the staging copy) stays on the built-in clock; the run's last one is waited for
    at its boundary and taken off.
    """

    def __init__(self, bare: dict[str, BareLoop], bare_context: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.bare, self.bare_context = bare, bare_context
        self.entries: list[float] = []
        self.bare_s: dict[str, list[float]] = {name: [] for name in bare}
        self.ckpt_s: list[float] = []
        self.excluded = 0.0
        self.mark = 0.0

    def on_fit_start(self, state: RunState) -> None:
        self.mark = time.perf_counter()

    def on_step_end(self, state: RunState, out: dict[str, Any]) -> None:
        self.entries.append(time.perf_counter() - self.excluded)
        for name, loop in self.bare.items():
            t0 = time.perf_counter()
            with self.bare_context():
                loop.step()
            dt = time.perf_counter() - t0
            self.bare_s[name].append(dt)
            self.excluded += dt

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        self.mark = time.perf_counter()

    def on_checkpoint(self, state: RunState, info: dict[str, Any]) -> None:
        dt = time.perf_counter() - self.mark
        self.ckpt_s.append(dt)
        self.excluded += dt  # periodic checkpoints are shown amortized on their own line


def lockstep_round(trainer: Trainer, bare: BareLoop, warmup: int, steps: int,
                   bare_context: Callable[[], Any] = contextlib.nullcontext,
                   others: dict[str, BareLoop] | None = None) -> dict[str, Any]:
    """Run ``trainer.fit()`` with one bare step beside each built-in step; return both steady-state times.

    The built-in clock holds everything ``fit()`` does between two steps' ``on_step_end`` (the step,
    metrics, logging, the progress bar, the next window) except checkpoints, whose time is returned
    separately (``ckpt``: the median checkpoint). ``bare_context`` wraps each bare step (e.g. to keep
    anomaly mode off there); ``others``: more bare loops stepped beside each built-in step too. Returns
    per log interval of the timed window the built-in and bare seconds (``others``: per name), and
    ``fit_s``: the whole ``fit()`` (setup, checkpoints and closing included) without the bare steps.
    """
    clock = Lockstep({"bare": bare, **(others or {})}, bare_context)
    trainer.callbacks.append(clock)  # after the built-in callbacks
    t0 = time.perf_counter()
    trainer.fit()
    fit_s = time.perf_counter() - t0 - sum(sum(v) for v in clock.bare_s.values())
    assert trainer.stop_reason is None, trainer.stop_reason
    entries = clock.entries
    assert len(entries) >= warmup + steps + 1, f"fit ran {len(entries)} steps, expected {warmup + steps + 1}"
    every = trainer.cfg.log.every
    starts = range(warmup, warmup + steps, every)  # one log interval each, its log included
    per_name = {name: [sum(v[k:k + every]) for k in starts] for name, v in clock.bare_s.items()}
    return {"builtin": [entries[k + every] - entries[k] for k in starts], "bare": per_name.pop("bare"),
            "others": per_name, "ckpt": statistics.median(clock.ckpt_s) if clock.ckpt_s else float("nan"),
            "fit_s": fit_s}


def fresh_models(task: Any, init: dict[str, Any], n: int) -> list[torch.nn.Module]:
    models = []
    for _ in range(n):
        model = copy.deepcopy(task.model)
        model.load_state_dict(init)
        models.append(model)
    return models


def measure(name: str, rounds: int, warmup: int, steps: int, nonfused: bool = False,
            overrides: list[str] = (), run_dir: bool = True) -> dict[str, Any]:
    """Lockstep rounds of the built-in loop beside the bare loop; with ``nonfused`` alternate with non-fused rounds.

    ``run_dir=False``: the Trainer without a run directory (no files, no snapshot, no checkpoints).
    """
    # One-time imports (TensorBoard writer, tqdm) are process start-up, not per-step overhead.
    import torch.utils.tensorboard  # noqa: F401
    import tqdm.auto  # noqa: F401

    cfg = load_config(None, [f"task={name}", *overrides, f"train.max_steps={warmup + steps + 1}", "run.overwrite=true"])
    if steps % cfg.log.every:
        raise ValueError(f"--steps ({steps}) must be a multiple of log.every ({cfg.log.every}) to hold whole log intervals")
    task = resolve_task(cfg.task, cfg.task_args)
    init = copy.deepcopy(task.model.state_dict())
    every = cfg.log.every
    factory = nonfused_adamw(cfg)
    bare, built, ckpt, paired = [], [], [], []  # per log interval: seconds per step, and built-in / bare
    nf: dict[str, list[float]] = {"vs_fused_bare": [], "vs_same_bare": [], "bare_vs_bare": [], "builtin": []}
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*cannot skip a step on the device")
        for i in range(rounds):
            for variant in (("fused", "nonfused") if i % 2 == 0 else ("nonfused", "fused")) if nonfused else ("fused",):
                if variant == "fused":
                    model, bare_model = fresh_models(task, init, 2)
                    trainer = make_trainer(task, model, cfg, Path(tmp) / f"run{i}" if run_dir else None)  # seeds it
                    r = lockstep_round(trainer, BareLoop(task, bare_model, cfg), warmup, steps)
                    bare += [x / every for x in r["bare"]]
                    built += [x / every for x in r["builtin"]]
                    paired += [x / y for x, y in zip(r["builtin"], r["bare"])]
                    ckpt.append(r["ckpt"])
                    continue
                model, bare_model, same_model = fresh_models(task, init, 3)
                trainer = make_trainer(task, model, cfg, Path(tmp) / f"nonfused{i}" if run_dir else None,
                                       optimizer=factory)
                r = lockstep_round(trainer, BareLoop(task, bare_model, cfg), warmup, steps,
                                   others={"same": BareLoop(task, same_model, cfg, optimizer=factory)})
                same = r["others"]["same"]
                nf["vs_fused_bare"] += [x / y for x, y in zip(r["builtin"], r["bare"])]
                nf["vs_same_bare"] += [x / y for x, y in zip(r["builtin"], same)]
                nf["bare_vs_bare"] += [x / y for x, y in zip(same, r["bare"])]
                nf["builtin"] += [x / every for x in r["builtin"]]
    b, s = statistics.median(bare), statistics.median(built)
    out = {"bare_ms": b * 1e3, "builtin_ms": s * 1e3, "ratio": statistics.median(paired), "ratio_of_medians": s / b,
           "ckpt_s": statistics.median(ckpt), "ckpt_every": cfg.ckpt.every, "paired_all": paired,
           "intervals": len(paired)}
    if nonfused:
        out["nonfused"] = {k: statistics.median(v) for k, v in nf.items()} | {"intervals": len(nf["builtin"])}
    return out


# -- the built-in step's pieces, one by one -------------------------------------------------------


def time_items(items: dict[str, Callable[[], Any]], reps: int, rounds: int) -> dict[str, float]:
    """Return the median seconds per call of each item; items are interleaved round by round."""
    results: dict[str, list[float]] = {k: [] for k in items}
    for _ in range(rounds):
        for key, fn in items.items():
            fn()  # warm
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            results[key].append((time.perf_counter() - t0) / reps)
    return {k: statistics.median(v) for k, v in results.items()}


def per_item_costs(name: str, bare_step_s: float, reps: int = 5, rounds: int = 25, overrides: list[str] = ()) -> None:
    """Time each piece of the built-in step (and each per-interval piece) in isolation on ``name``."""
    cfg = load_config(None, [f"task={name}", *overrides, "train.max_steps=1000", "run.overwrite=true"])
    task = resolve_task(cfg.task, cfg.task_args)
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        trainer = make_trainer(task, task.model, cfg, Path(tmp) / "items")
        state, fire = trainer.state, trainer.callbacks.fire
        with contextlib.redirect_stderr(devnull):  # the progress bar draws to devnull: the call's cost, not the terminal's
            fire("on_fit_start", state)
        for _ in range(3):
            out = trainer.train_step(trainer.stream.next_window())
        params, opt = trainer.params, trainer.optimizer
        grads = [p.grad for p in params]
        norm, per_param = grad_norms(params)
        loss = trainer.window.mean_loss
        ok = torch.ones((), dtype=torch.bool)
        window = trainer.stream.next_window()
        bare_it = iter(DataLoader(task.train_data, batch_size=cfg.train.batch_size, shuffle=True,
                                  collate_fn=task.collate or torch.utils.data.default_collate))
        lambda_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
        lambda_sched = torch.optim.lr_scheduler.LambdaLR(lambda_opt, lambda n: 0.5 * (1 + math.cos(math.pi * min(n / 1e6, 1))))
        metrics = trainer.metrics
        values = {k: v for k, v in out.items() if k != "per_param_norms"}
        # A non-fused optimizer over the same parameters, under its own policy: the skip flag is read on the host.
        nonfused_opt = nonfused_adamw(cfg)(trainer.named_params)
        nonfused_policy = PrecisionPolicy(trainer.precision.mode, trainer.device)
        nonfused_sched = LRSchedule(nonfused_opt, cfg.sched.warmup_steps, cfg.train.max_steps, cfg.sched.decay,
                                    cfg.sched.min_lr_ratio)  # its lr is a host float: one more read per step

        def nonfused_step() -> None:
            nonfused_sched.step(nonfused_policy.step(nonfused_opt, ok))

        def nonfused_bare() -> None:
            nonfused_opt.step()
            lambda_sched.step()

        def metrics_update() -> None:
            if len(metrics) == metrics.capacity:
                metrics.clear()  # drop the interval unreduced: this item times update() alone
            metrics.update(1, per_param_norms=per_param, num_samples=16, lr=trainer.schedule.lr(),
                           loss_scale=trainer.precision.loss_scale(), **values)

        def bare_next() -> Any:
            nonlocal bare_it
            try:
                return next(bare_it)
            except StopIteration:
                bare_it = iter(DataLoader(task.train_data, batch_size=cfg.train.batch_size, shuffle=True))
                return next(bare_it)

        def observe() -> None:
            trainer.guard.observe(loss, norm)

        def fill_only() -> None:
            metrics.clear()
            for _ in range(cfg.log.every):
                metrics_update()

        def log_interval() -> None:
            # What the loop does at a log boundary, through public pieces: the reduce (its one sync), the
            # guard's decision, the record (as Trainer builds it) and on_log for the sinks.
            fill_only()
            summary, rows, param_sq = metrics.reduce(0, annotate=trainer.guard.mark_spikes)
            trainer.guard.decide(rows)
            total_sq = sum(param_sq) or 1.0
            top = sorted(range(len(param_sq)), key=lambda i: -param_sq[i])[: cfg.log.top_layers]
            elapsed = 0.1
            record = {**{k: v for k, v in summary.items() if not k.startswith("interval_")},
                      "num_incidents": trainer.guard.num_incidents, "num_rollbacks": trainer.guard.num_rollbacks,
                      "tokens_per_s": summary["interval_tokens"] / elapsed,
                      "samples_per_s": summary["interval_samples"] / elapsed,
                      "step_time_s": elapsed / summary["interval_steps"], "peak_memory_mib": peak_memory_mib(trainer.device),
                      "epoch": trainer.stream.epoch, "samples_seen": state.samples_seen, "tokens_seen": state.tokens_seen,
                      "top_grad_layers": [{"name": trainer.named_params[i][0], "share": param_sq[i] / total_sq} for i in top]}
            fire("on_log", state, record, rows)

        # (label, built-in callable, bare-loop counterpart or None, calls per step)
        bare = BareLoop(task, copy.deepcopy(trainer.model), cfg)
        bare_opt = bare.opt
        for _ in range(3):
            bare.step()
        bare_opt.zero_grad(set_to_none=False)
        opt_params = [p for g in opt.param_groups for p in g["params"]]
        for p, q in zip([p for g in bare_opt.param_groups for p in g["params"]], opt_params):
            p.grad = q.grad.clone()

        def one_micro_batch_window() -> None:
            trainer.window.begin()
            loss_sum, count = as_sum_count(task.loss(trainer.model, window.batches[0]), len(window.indices[0]))
            trainer.window.normalize(loss_sum.detach(), count, True)
            return trainer.window.mean_loss

        def bare_loss() -> Any:
            loss_sum, count = as_sum_count(task.loss(trainer.model, window.batches[0]), len(window.indices[0]))
            return loss_sum.detach() / count

        per_step = [
            ("whole train_step (no fit loop around it) vs whole bare step",
             lambda: trainer.train_step(window), bare.step, 0),
            ("loss via window.begin/normalize/mean_loss vs loss_sum / count", one_micro_batch_window, bare_loss, 1),
            ("precision.step (found_inf, tensor lr) vs optimizer.step()", lambda: trainer.precision.step(opt, ok),
             lambda: bare_opt.step(), 1),
            ("data: stream.next_window vs DataLoader next", lambda: trainer.stream.next_window(), bare_next, 1),
            ("move_to(batch)", lambda: move_to(window.batches[0], trainer.device), None, 1),
            ("grad_norms (foreach_norm + per-param stack) vs get_total_norm", lambda: grad_norms(params),
             lambda: torch.nn.utils.get_total_norm(grads), 1),
            ("guard.observe (isfinite of loss and norm; the spike rule runs at the boundary unless on_spike=skip)",
             observe, None, 1),
            ("clipper.clip_ (where + clip_grads_with_norm_) vs clip_grads_with_norm_",
             lambda: trainer.clipper.clip_(params, norm, ok), lambda: torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm), 1),
            ("clipper.post_clip_norm", lambda: trainer.clipper.post_clip_norm(norm), None, 1),
            ("schedule.step (table gather, lr tensor copy) vs LambdaLR.step", lambda: trainer.schedule.step(ok),
             lambda: lambda_sched.step(), 1),
            ("precision.loss_scale() (a fresh ones tensor)", lambda: trainer.precision.loss_scale(), None, 1),
            ("metrics.update (stack 11 scalars, copy, param_sq)", metrics_update, None, 1),
            ("callbacks on_step_end (progress bar update)", lambda: fire("on_step_end", state, out), None, 1),
        ]
        per_interval = [
            ("log interval: reduce sync + guard.decide + on_log (jsonl, TensorBoard, bar, events)", log_interval,
             fill_only, 1 / cfg.log.every),
        ]
        if cfg.guard.check_params:  # on each interval's last step
            per_interval.append(("all_params_finite (the parameter check, on the interval's last step)",
                                 lambda: all_params_finite(params), None, 1 / cfg.log.every))
        if cfg.capture.memory_snapshot:  # on by default: a capture replays at most one interval
            per_interval.append(("snapshot: state copy into host buffers for incident capture (capture.memory_snapshot)",
                                 lambda: trainer.recorder.mark_interval_start(), None, 1 / cfg.log.every))
        # Not a piece of the default step: what an optimizer that cannot skip on the device pays instead.
        aside = [("non-fused AdamW(foreach): precision.step + schedule.step (host reads) vs step() + LambdaLR",
                  nonfused_step, nonfused_bare, 1)]
        fns: dict[str, Callable[[], Any]] = {}
        for label, fn, base, _ in per_step + per_interval + aside:
            fns[label] = fn
            if base is not None:
                fns[label + " [bare]"] = base
        with contextlib.redirect_stderr(devnull), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            costs = time_items(fns, reps=reps, rounds=rounds)
        ckpt_s = []
        for _ in range(3):
            t0 = time.perf_counter()
            trainer.keeper.save(True)  # what the step waits for: the check and the staging copy
            ckpt_s.append(time.perf_counter() - t0)
            trainer.keeper.finished(wait=True)  # the background write, off the clock
        with contextlib.redirect_stderr(devnull):
            fire("on_fit_end", state, {})
        trainer.run.close()
        # A new epoch: load_state_dict drops the stream's loader, so next_window opens the epoch's order and
        # DataLoader; the plain next_window (timed above) is taken off.
        stream, epoch_s = trainer.stream, []
        for _ in range(3):
            at = stream.state_dict()
            t0 = time.perf_counter()
            stream.load_state_dict({**at, "pos": 0})
            stream.next_window()
            epoch_s.append(time.perf_counter() - t0)
        batches_per_epoch = stream.order.batches_per_epoch

    print(f"\nper-item cost of the built-in step on {name} (isolated, median of {rounds} interleaved blocks of {reps} "
          f"calls; bare step {bare_step_s * 1e3:.2f} ms):")
    print(f"  {'item':<88} {'us/call':>9} {'bare':>8} {'extra us/step':>14} {'% of bare':>9}")
    total = 0.0

    def row(label: str, base: Any, per: float) -> float:
        c = costs[label]
        b = costs.get(label + " [bare]", 0.0) if base is not None else 0.0
        extra = (c - b) * (per or 1)
        bare_col = f"{b * 1e6:8.1f}" if base is not None else f"{'':>8}"
        print(f"  {label:<88} {c * 1e6:9.1f} {bare_col} {extra * 1e6:14.1f} {100 * extra / bare_step_s:8.2f}%")
        return extra

    for label, _, base, per in per_step + per_interval:
        extra = row(label, base, per)
        total += extra if per else 0.0
    print(f"  {'sum of the extras above (the first row excluded)':<88} {'':>9} {'':>8} {total * 1e6:14.1f} "
          f"{100 * total / bare_step_s:8.2f}%")
    ckpt = statistics.median(ckpt_s)
    print(f"  {f'checkpoint (per ckpt.every={cfg.ckpt.every} steps)':<88} {ckpt * 1e6:9.0f} {'':>8} "
          f"{ckpt / cfg.ckpt.every * 1e6:14.1f} {100 * ckpt / cfg.ckpt.every / bare_step_s:8.2f}%")
    ep = max(statistics.median(epoch_s) - costs["data: stream.next_window vs DataLoader next"], 0.0)
    print(f"  {f'new epoch: order + DataLoader (per {batches_per_epoch} steps)':<88} {ep * 1e6:9.0f} {'':>8} "
          f"{ep / batches_per_epoch * 1e6:14.1f} {100 * ep / batches_per_epoch / bare_step_s:8.2f}%")
    for label, _, base, per in aside:
        row(label, base, per)


class _Profile(Callback):
    """cProfile the steps after ``warmup`` (from the end of step ``warmup`` to the end of ``warmup + steps``)."""

    def __init__(self, prof: cProfile.Profile, warmup: int, steps: int) -> None:
        self.prof, self.warmup, self.steps = prof, warmup, steps

    def on_step_end(self, state: RunState, out: dict[str, Any]) -> None:
        if state.step == self.warmup:
            self.prof.enable()
        elif state.step == self.warmup + self.steps:
            self.prof.disable()


def in_loop_costs(name: str, bare_step_s: float, steps: int, overrides: list[str] = ()) -> None:
    """Time the pieces of ``Trainer.fit()`` where they run, in one fit of ``steps`` steps: wall time per call.

    The isolated items above run with warm caches; in the loop each piece follows a step that evicted them, and
    the interval's pieces cost about twice as much there. Each piece is wrapped (an instance attribute over the
    method: the loop calls them by attribute) and timed per call; the table shows the median call, its calls per
    step and its share of the bare step. Periodic checkpoints are off (``ckpt.every=0``: their own line above).
    """
    cfg = load_config(None, [f"task={name}", *overrides, f"train.max_steps={steps}", "run.overwrite=true",
                             "ckpt.every=0"])
    task = copy.copy(resolve_task(cfg.task, cfg.task_args))
    task.val_data = None
    calls: dict[str, list[float]] = {}

    def wrap(obj: Any, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                calls.setdefault(label, []).append(time.perf_counter() - t0)

        setattr(obj, attr, timed)

    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        trainer = make_trainer(task, task.model, cfg, Path(tmp) / "in_loop")
        per_step = [(trainer, "train_step", "train_step (the whole step)"),
                    (trainer.stream, "next_window", "stream.next_window (data)"),
                    (trainer.metrics, "update", "metrics.update")]
        per_interval = [(trainer, "_log", "log interval: _log (all of the below but the snapshot)"),
                        (trainer.metrics, "reduce", "  metrics.reduce (its one sync)"),
                        (trainer.guard, "mark_spikes", "  guard.mark_spikes (the host spike rule)"),
                        (trainer.guard, "decide", "  guard.decide")]
        for cb in trainer.callbacks.callbacks:
            if "on_log" in type(cb).__dict__:
                per_interval.append((cb, "on_log", f"  on_log {type(cb).__name__}"))
        per_interval.append((trainer.recorder, "mark_interval_start", "snapshot: recorder.mark_interval_start"))
        for obj, attr, label in per_step + per_interval:
            wrap(obj, attr, label)
        trainer.callbacks._index()  # the wrapped on_log methods
        with contextlib.redirect_stderr(devnull), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            trainer.fit()
            fit_s = time.perf_counter() - t0
    every = cfg.log.every
    print(f"\nin-loop cost of the pieces of fit() on {name} ({steps} steps, log.every={every}, wall time per call, "
          f"median over the run's calls after the first {every}; bare step {bare_step_s * 1e3:.2f} ms; the whole fit "
          f"{fit_s / steps * 1e3:.2f} ms/step):")
    print(f"  {'piece':62s} {'us/call':>9s} {'calls/step':>10s} {'us/step':>8s} {'% of bare':>9s}")
    for _, _, label in per_step + per_interval:
        v = calls.get(label, [])
        steady = v[every:-1] if len(v) > every + 2 else v
        if not steady:
            continue
        per = 1.0 if label in {lab for _, _, lab in per_step} else 1 / every
        med = statistics.median(steady)
        print(f"  {label:62s} {med * 1e6:9.1f} {per:10.2f} {med * per * 1e6:8.1f} {med * per / bare_step_s * 100:8.2f}%")


def profile_builtin(name: str, warmup: int, steps: int, overrides: list[str] = ()) -> None:
    """cProfile the built-in loop (its steady state only) and print the top functions by own time."""
    cfg = load_config(None, [f"task={name}", *overrides, f"train.max_steps={warmup + steps + 1}", "run.overwrite=true"])
    task = resolve_task(cfg.task, cfg.task_args)
    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(task, task.model, cfg, Path(tmp) / "prof", callbacks=[_Profile(prof, warmup, steps)])
        trainer.fit()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    print(f"\ncProfile of the built-in loop on {name}, {steps} steady-state steps, top 25 by own time:")
    print(text.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="gpt,mlp")
    ap.add_argument("--rounds", type=int, default=0, help="lockstep rounds (default: 7)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps per round (default: gpt 10, mlp 20)")
    ap.add_argument("--steps", type=int, default=0,
                    help="timed steps per round, a multiple of log.every (default: gpt 30, mlp 200)")
    ap.add_argument("--items", action=argparse.BooleanOptionalAction, default=True, help="per-item costs of the built-in step")
    ap.add_argument("--nonfused", action=argparse.BooleanOptionalAction, default=True,
                    help="on the first task, also rounds with a non-fused AdamW(foreach) from the task's optimizer factory")
    ap.add_argument("--profile", action="store_true", help="cProfile the built-in loop's steady state")
    ap.add_argument("--in-loop", action=argparse.BooleanOptionalAction, default=True,
                    help="time the pieces of fit() where they run (a fit with each piece wrapped)")
    ap.add_argument("--run-dir", action=argparse.BooleanOptionalAction, default=True,
                    help="the lockstep rounds' Trainer with a run directory (default); --no-run-dir: without one (no "
                         "files, no incident snapshot, no checkpoints)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for the built-in loop (repeatable), e.g. --set capture.memory_snapshot=false")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: a smaller task, 2 rounds of few steps, few item blocks (not a measurement)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {load_average()}", flush=True)
    names = args.tasks.split(",")

    def quick_args(name: str) -> list[str]:
        return (QUICK_ARGS[name] if args.quick else []) + args.set

    bare_ms: dict[str, float] = {}
    for name in names:
        warmup, steps, rounds = (QUICK if args.quick else DEFAULTS)[name]
        warmup, steps, rounds = args.warmup or warmup, args.steps or steps, args.rounds or rounds
        r = measure(name, rounds, warmup, steps, nonfused=args.nonfused and name == names[0], overrides=quick_args(name),
                    run_dir=args.run_dir)
        bare_ms[name] = r["bare_ms"]
        target = "  (target <= 1.02)" if name == "gpt" else "  (target <= 1.10)"
        print(f"{name}: {rounds} lockstep rounds x {r['intervals'] // rounds} log intervals after {warmup} warm-up steps"
              f"{'' if args.run_dir else ', no run directory'}; "
              f"median step bare {r['bare_ms']:.2f} ms, built-in {r['builtin_ms']:.2f} ms", flush=True)
        print(f"  {name} overhead: ratio {r['ratio']:.3f}{target}  (median over {r['intervals']} intervals of "
              f"built-in/bare; ratio of medians {r['ratio_of_medians']:.3f})", flush=True)
        q = statistics.quantiles(r["paired_all"], n=4) if len(r["paired_all"]) > 1 else [r["ratio"]] * 3
        print(f"  per-interval ratios: quartiles {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}, min {min(r['paired_all']):.3f}, "
              f"max {max(r['paired_all']):.3f}")
        amortized = r["ratio"] + r["ckpt_s"] / r["ckpt_every"] / (r["bare_ms"] / 1e3)
        if math.isfinite(amortized):  # (no checkpoint without a run directory)
            print(f"  with a checkpoint every {r['ckpt_every']} steps ({r['ckpt_s'] * 1e3:.0f} ms each) amortized: "
                  f"ratio {amortized:.3f}", flush=True)
        print(f"  [{load_average()}]", flush=True)
        if "nonfused" in r:
            n = r["nonfused"]
            print(f"  {name} non-fused optimizer (Task.optimizer -> AdamW(foreach=True): skip flag and lr read on the "
                  f"host every step): built-in {n['builtin'] * 1e3:.2f} ms/step, step-time ratio vs the fused default "
                  f"{n['vs_fused_bare'] / r['ratio']:.3f}", flush=True)
            print(f"    of which the optimizer itself (bare foreach / bare fused) {n['bare_vs_bare']:.3f}; stabletrain's "
                  f"overhead with it (built-in / bare foreach) {n['vs_same_bare']:.3f} vs {r['ratio']:.3f} fused  "
                  f"(medians over {n['intervals']} intervals, rounds alternating with the fused ones)", flush=True)
    if args.items:
        for name in names:
            per_item_costs(name, bare_ms[name] / 1e3, *((2, 3) if args.quick else (5, 25)), overrides=quick_args(name))
    if args.in_loop:
        for name in names:
            in_loop_costs(name, bare_ms[name] / 1e3, 100 if args.quick else 400 if name == "mlp" else 60,
                          overrides=quick_args(name))
    if args.profile:
        profile_builtin(names[0], *((5, 10) if args.quick else (10, 30)), overrides=quick_args(names[0]))


if __name__ == "__main__":
    sys.exit(main())
