"""Steady-state per-step overhead of the built-in loop against a hand-written bare PyTorch loop.

Both train the same model from the same init on the same data with the same fused AdamW, the same
LR schedule shape and global-norm clipping. The built-in loop runs ``Trainer.fit()`` with its default
monitoring on: device-side metrics, the sentinel, the per-interval sync, metrics.jsonl, events.jsonl,
TensorBoard, the progress bar, the in-memory incident snapshot per log interval and the default
checkpoint cadence.

What is timed. Each round builds a fresh Trainer and a fresh bare loop from the same init and runs
them in lockstep, one bare step beside each built-in step (before it on even steps, after it on odd
ones), so a burst of load from another process hits both alike; a round-level interleave on a
shared 2-core machine swings the ratio by 2-4x. The ratio reported is the median, over every log
interval of every round, of the built-in time over the bare time of the same interval.

* both variants run ``warmup + steps + 1`` optimizer steps; the clock covers the ``steps`` steps after
  the warm-up, from the start of step ``warmup + 1`` to the start of step ``warmup + steps + 1``
  (for the built-in loop: the entry of ``Trainer.train_step``, with the bare steps' time taken off;
  each side's window holds the same number of data fetches). ``steps`` is a multiple of
  ``log.every``, so the built-in time holds exactly ``steps / log.every`` log intervals: the
  interval's one sync, jsonl/TensorBoard/progress writes, events and the snapshot clone for incident
  capture are in it, amortized as they are in a real run.
* one-time setup is not: Trainer construction (run dir, config, snapshot, git), the SummaryWriter,
  the step-0 checkpoint that ``fit()`` writes, the last step's final checkpoint and closing.
* periodic checkpoints (``ckpt.every``, default 100 steps) stay on at their default cadence, but their
  time is taken off the built-in clock (a short timed window holds too many or too few of them);
  the median checkpoint (step 0 included) is shown amortized over ``ckpt.every`` on its own line.
  Validation is off in both (the bare loop has none).

``--items`` (on by default) then times each piece of the built-in per-step path in isolation on the
task and prints its cost in microseconds and in percent of the bare step; ``--profile`` adds a
cProfile of the built-in loop's steady state.

    python bench/overhead.py                       # gpt and mlp, about 2-3 minutes on 2 CPU cores
    python bench/overhead.py --tasks gpt --rounds 9 --steps 30
    python bench/overhead.py --no-items --profile
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from stabletrain import Trainer, load_config, resolve_task
from stabletrain.accumulation import as_sum_count
from stabletrain.data import move_to
from stabletrain.loop import clone_state

# (warm-up steps, timed steps, rounds) per task; timed steps are a multiple of log.every (10).
DEFAULTS = {"gpt": (10, 30, 7), "mlp": (20, 200, 7)}


def load_average() -> str:
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "load average n/a"


# -- the two loops ------------------------------------------------------------------------------


class BareLoop:
    """A plain nanoGPT-style loop, one step per call: zero_grad, fetch, forward, backward, clip, step, schedule."""

    def __init__(self, task: Any, model: torch.nn.Module, cfg: Any) -> None:
        self.task, self.model, self.cfg = task, model, cfg
        self.params = [p for p in model.parameters() if p.requires_grad]
        decay = [p for p in self.params if p.dim() >= 2]
        no_decay = [p for p in self.params if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}],
                                     lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, fused=True)
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

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        try:
            batch = next(self.it)
        except StopIteration:  # a new epoch: a new shuffled iterator, as a plain loop does
            self.it = iter(self.loader)
            batch = next(self.it)
        loss_sum, count = as_sum_count(self.task.loss(self.model, batch), len(batch[0]))
        (loss_sum / count).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.cfg.clip.max_norm)
        self.opt.step()
        self.sched.step()


def make_trainer(task: Any, model: torch.nn.Module, cfg: Any, run_dir: Path | None) -> Trainer:
    run_task = copy.copy(task)
    run_task.model = model
    run_task.val_data = None  # validation is not part of the comparison (the bare loop has none)
    return Trainer(cfg, task=run_task, run_dir=run_dir)


def lockstep_round(trainer: Trainer, bare: BareLoop, warmup: int, steps: int,
                   bare_context: Callable[[], Any] = contextlib.nullcontext) -> dict[str, Any]:
    """Run ``trainer.fit()`` with one bare step beside each built-in step; return both steady-state times.

    The bare step runs inside the wrapper around ``Trainer.train_step`` (before it on even steps, after
    it on odd ones) and its time is taken off the built-in clock, so a burst of load from elsewhere
    hits both variants alike. The built-in clock still holds everything ``fit()`` does between two
    ``train_step`` calls (metrics, logging, the snapshot clone, the progress bar, the next window)
    except checkpoints, whose time is returned separately (``ckpt``: the median checkpoint).
    ``bare_context`` wraps each bare step (e.g. to keep anomaly mode off there). Returns per log
    interval of the timed window the built-in and bare seconds, and ``fit_s``: the whole ``fit()``
    (setup, checkpoints and closing included) without the bare steps.
    """
    entries: list[float] = []  # built-in clock at each train_step entry
    bare_s: list[float] = []
    ckpt_s: list[float] = []
    excluded = 0.0
    inner_step, inner_ckpt = trainer.train_step, trainer._checkpoint

    def run_bare() -> None:
        nonlocal excluded
        t0 = time.perf_counter()
        with bare_context():
            bare.step()
        dt = time.perf_counter() - t0
        bare_s.append(dt)
        excluded += dt

    def train_step(window: Any) -> Any:
        entries.append(time.perf_counter() - excluded)
        if len(entries) % 2:
            run_bare()
            return inner_step(window)
        out = inner_step(window)
        run_bare()
        return out

    def checkpoint(*args: Any, **kwargs: Any) -> None:
        nonlocal excluded
        t0 = time.perf_counter()
        inner_ckpt(*args, **kwargs)
        dt = time.perf_counter() - t0
        ckpt_s.append(dt)
        excluded += dt  # periodic checkpoints are shown amortized on their own line

    trainer.train_step, trainer._checkpoint = train_step, checkpoint  # instance attributes: fit() calls these
    t0 = time.perf_counter()
    trainer.fit()
    fit_s = time.perf_counter() - t0 - sum(bare_s)
    assert trainer.stop_reason is None, trainer.stop_reason
    assert len(entries) >= warmup + steps + 1, f"fit ran {len(entries)} steps, expected {warmup + steps + 1}"
    every = trainer.cfg.log.every
    starts = range(warmup, warmup + steps, every)  # one log interval each, its log and snapshot included
    return {"builtin": [entries[k + every] - entries[k] for k in starts],
            "bare": [sum(bare_s[k:k + every]) for k in starts],
            "ckpt": statistics.median(ckpt_s) if ckpt_s else float("nan"), "fit_s": fit_s}


def measure(name: str, rounds: int, warmup: int, steps: int) -> dict[str, Any]:
    # One-time imports (TensorBoard writer, tqdm) are process start-up, not per-step overhead.
    import torch.utils.tensorboard  # noqa: F401
    import tqdm.auto  # noqa: F401

    cfg = load_config(None, [f"task={name}", f"train.max_steps={warmup + steps + 1}", "run.overwrite=true"])
    if steps % cfg.log.every:
        raise ValueError(f"--steps ({steps}) must be a multiple of log.every ({cfg.log.every}) to hold whole log intervals")
    task = resolve_task(cfg.task, cfg.task_args)
    init = copy.deepcopy(task.model.state_dict())
    every = cfg.log.every
    bare, built, ckpt, paired = [], [], [], []  # per log interval: seconds per step, and built-in / bare
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            models = []
            for _ in range(2):
                model = copy.deepcopy(task.model)
                model.load_state_dict(init)
                models.append(model)
            trainer = make_trainer(task, models[0], cfg, Path(tmp) / f"run{i}")  # seeds the process
            r = lockstep_round(trainer, BareLoop(task, models[1], cfg), warmup, steps)
            bare += [x / every for x in r["bare"]]
            built += [x / every for x in r["builtin"]]
            paired += [x / y for x, y in zip(r["builtin"], r["bare"])]
            ckpt.append(r["ckpt"])
    b, s = statistics.median(bare), statistics.median(built)
    return {"bare_ms": b * 1e3, "builtin_ms": s * 1e3, "ratio": statistics.median(paired), "ratio_of_medians": s / b,
            "ckpt_s": statistics.median(ckpt), "ckpt_every": cfg.ckpt.every, "paired_all": paired,
            "intervals": len(paired)}


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


def per_item_costs(name: str, bare_step_s: float) -> None:
    """Time each piece of the built-in step (and each per-interval piece) in isolation on ``name``."""
    from tqdm.auto import tqdm

    from stabletrain.clipping import grad_norms

    cfg = load_config(None, [f"task={name}", "train.max_steps=1000", "run.overwrite=true"])
    task = resolve_task(cfg.task, cfg.task_args)
    with tempfile.TemporaryDirectory() as tmp, open(os.devnull, "w") as devnull:
        trainer = make_trainer(task, task.model, cfg, Path(tmp) / "items")
        trainer._open_sinks()
        trainer._bar.close()
        trainer._bar = tqdm(total=10**9, file=devnull)  # the call's cost, not the terminal's
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

        def metrics_update() -> None:
            if len(metrics) == metrics.capacity:
                metrics.steps = []
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

        def full_log() -> None:
            metrics.steps = []
            for _ in range(cfg.log.every):
                metrics_update()
            trainer._log()

        def fill_only() -> None:
            metrics.steps = []
            for _ in range(cfg.log.every):
                metrics_update()

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
            ("model.train() every step", lambda: trainer.model.train(), None, 1),
            ("loss via window.begin/normalize/mean_loss vs loss_sum / count", one_micro_batch_window, bare_loss, 1),
            ("precision.step (found_inf, tensor lr) vs optimizer.step()", lambda: trainer.precision.step(opt, ok),
             lambda: bare_opt.step(), 1),
            ("data: stream.next_window vs DataLoader next", lambda: trainer.stream.next_window(), bare_next, 1),
            ("move_to(batch)", lambda: move_to(window.batches[0], trainer.device), None, 1),
            ("grad_norms (foreach_norm + per-param stack) vs get_total_norm", lambda: grad_norms(params),
             lambda: torch.nn.utils.get_total_norm(grads), 1),
            ("guard.observe (isfinite, nanmedian, nanmean, std, index_put)", observe, None, 1),
            ("clipper.clip_ (where + clip_grads_with_norm_) vs clip_grads_with_norm_",
             lambda: trainer.clipper.clip_(params, norm, ok), lambda: torch.nn.utils.clip_grads_with_norm_(params, 1.0, norm), 1),
            ("clipper.post_clip_norm", lambda: trainer.clipper.post_clip_norm(norm), None, 1),
            ("guard.params_finite (foreach_norm over params + stack)", lambda: trainer.guard.params_finite(params), None, 1),
            ("schedule.step (device cos, lr tensor copy) vs LambdaLR.step", lambda: trainer.schedule.step(ok),
             lambda: lambda_sched.step(), 1),
            ("precision.loss_scale() (a fresh ones tensor)", lambda: trainer.precision.loss_scale(), None, 1),
            ("metrics.update (stack 11 scalars, copy, param_sq)", metrics_update, None, 1),
            ("progress bar update", lambda: trainer._bar.update(1), None, 1),
        ]
        per_interval = [
            ("_log: reduce sync + jsonl + TensorBoard + bar + events", full_log, fill_only, 1 / cfg.log.every),
        ]
        if cfg.guard.memory_snapshot:  # off by default: an incident replays from LAST_GOOD instead
            per_interval.append(("snapshot: state copy for incident capture (guard.memory_snapshot)",
                                 lambda: clone_state(trainer.state_dict()), None, 1 / cfg.log.every))
        fns: dict[str, Callable[[], Any]] = {}
        for label, fn, base, _ in per_step + per_interval:
            fns[label] = fn
            if base is not None:
                fns[label + " [bare]"] = base
        with contextlib.redirect_stderr(io.StringIO()):
            costs = time_items(fns, reps=5, rounds=25)
        ckpt_s = []
        for _ in range(3):
            t0 = time.perf_counter()
            trainer._checkpoint(True)
            ckpt_s.append(time.perf_counter() - t0)
        trainer._close_sinks()
    epoch_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        trainer.stream._open()
        epoch_s.append(time.perf_counter() - t0)
    batches_per_epoch = trainer.stream.order.batches_per_epoch

    print(f"\nper-item cost of the built-in step on {name} (isolated, median of 25 interleaved blocks of 5 calls; "
          f"bare step {bare_step_s * 1e3:.2f} ms):")
    print(f"  {'item':<74} {'us/call':>9} {'bare':>8} {'extra us/step':>14} {'% of bare':>9}")
    total = 0.0
    for label, _, base, per in per_step + per_interval:
        c = costs[label]
        b = costs.get(label + " [bare]", 0.0) if base is not None else 0.0
        extra = (c - b) * (per or 1)
        total += extra if per else 0.0
        bare_col = f"{b * 1e6:8.1f}" if base is not None else f"{'':>8}"
        print(f"  {label:<74} {c * 1e6:9.1f} {bare_col} {extra * 1e6:14.1f} {100 * extra / bare_step_s:8.2f}%")
    print(f"  {'sum of the extras above (the first row excluded)':<74} {'':>9} {'':>8} {total * 1e6:14.1f} {100 * total / bare_step_s:8.2f}%")
    ckpt = statistics.median(ckpt_s)
    print(f"  {f'checkpoint (per ckpt.every={cfg.ckpt.every} steps)':<74} {ckpt * 1e6:9.0f} {'':>8} "
          f"{ckpt / cfg.ckpt.every * 1e6:14.1f} {100 * ckpt / cfg.ckpt.every / bare_step_s:8.2f}%")
    ep = statistics.median(epoch_s)
    print(f"  {f'new epoch: order + DataLoader (per {batches_per_epoch} steps)':<74} {ep * 1e6:9.0f} {'':>8} "
          f"{ep / batches_per_epoch * 1e6:14.1f} {100 * ep / batches_per_epoch / bare_step_s:8.2f}%")


def profile_builtin(name: str, warmup: int, steps: int) -> None:
    """cProfile the built-in loop (its steady state only) and print the top functions by own time."""
    cfg = load_config(None, [f"task={name}", f"train.max_steps={warmup + steps + 1}", "run.overwrite=true"])
    task = resolve_task(cfg.task, cfg.task_args)
    prof = cProfile.Profile()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(task, task.model, cfg, Path(tmp) / "prof")
        inner = trainer.train_step
        count = [0]

        def train_step(window: Any) -> Any:
            count[0] += 1
            if count[0] == warmup + 1:
                prof.enable()
            elif count[0] == warmup + steps + 1:
                prof.disable()
            return inner(window)

        trainer.train_step = train_step
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
    ap.add_argument("--steps", type=int, default=0, help="timed steps per round, a multiple of log.every (default: gpt 30, mlp 200)")
    ap.add_argument("--items", action=argparse.BooleanOptionalAction, default=True, help="per-item costs of the built-in step")
    ap.add_argument("--profile", action="store_true", help="cProfile the built-in loop's steady state")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {load_average()}", flush=True)
    bare_ms: dict[str, float] = {}
    for name in args.tasks.split(","):
        warmup, steps, rounds = DEFAULTS[name]
        warmup, steps, rounds = args.warmup or warmup, args.steps or steps, args.rounds or rounds
        r = measure(name, rounds, warmup, steps)
        bare_ms[name] = r["bare_ms"]
        target = "  (target <= 1.03)" if name == "gpt" else ""
        print(f"{name}: {rounds} lockstep rounds x {steps // 10} log intervals after {warmup} warm-up steps; "
              f"median step bare {r['bare_ms']:.2f} ms, built-in {r['builtin_ms']:.2f} ms", flush=True)
        print(f"  {name} overhead: ratio {r['ratio']:.3f}{target}  (median over {r['intervals']} intervals of "
              f"built-in/bare; ratio of medians {r['ratio_of_medians']:.3f})", flush=True)
        q = statistics.quantiles(r["paired_all"], n=4) if len(r["paired_all"]) > 1 else [r["ratio"]] * 3
        print(f"  per-interval ratios: quartiles {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}, min {min(r['paired_all']):.3f}, "
              f"max {max(r['paired_all']):.3f}")
        amortized = r["ratio"] + r["ckpt_s"] / r["ckpt_every"] / (r["bare_ms"] / 1e3)
        print(f"  with a checkpoint every {r['ckpt_every']} steps ({r['ckpt_s'] * 1e3:.0f} ms each) amortized: "
              f"ratio {amortized:.3f}  [{load_average()}]", flush=True)
    if args.items:
        for name in args.tasks.split(","):
            per_item_costs(name, bare_ms[name] / 1e3)
    if args.profile:
        profile_builtin(args.tasks.split(",")[0], 10, 30)


if __name__ == "__main__":
    sys.exit(main())
