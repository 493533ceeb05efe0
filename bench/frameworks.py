"""stabletrain's Trainer against a hand-written loop, Lightning Fabric, the Lightning Trainer and Accelerate.

Every contender trains the same model (a fresh copy of one initialization each round) on the same
pre-built batches (collated once, cycled), fp32, global-norm clipping at 1.0, and the same optimizer:
AdamW(lr 1e-3, betas (0.9, 0.95), weight decay 0.1 on matrices only), fused (``--foreach``: torch's
default foreach implementation for every contender but stabletrain, which always builds its fused one).

    bare            zero_grad, forward, backward, clip_grad_norm_, step: the loop everyone writes
    fabric          lightning.fabric.Fabric: setup(), backward(), clip_gradients()
    lightning       lightning.Trainer (logger, checkpointing, progress bar, model summary off; gradient_clip_val)
    accelerate      accelerate.Accelerator: prepare(), backward(), clip_grad_norm_()
    stabletrain     stabletrain.Trainer without a run directory (sentinel, device metrics, LR schedule on)
    stabletrain+dir stabletrain.Trainer with its defaults: run dir, metrics.jsonl, TensorBoard, progress bar,
                    periodic checkpoints (in the background), the interval's incident snapshot
    bare+compile    the bare loop on ``torch.compile(model)`` (the optimizer step and clipping stay eager)
    stabletrain+compile  stabletrain+dir with ``train.compile=true`` (the same model compiled the same way);
                    its ratio is to bare+compile of the same round, not to bare

Timing, lockstep: every contender is a stepper that runs ONE optimizer step per call, and the round
runs them side by side, step by step (step i of every contender, in an order rotated every step, then
step i + 1), so a burst of load from another process hits all of them alike; rounds of whole runs one
after the other could not resolve a few percent on a shared machine (per-round ratios spread 0.6-1.9).
A loop contender (bare, Fabric, Accelerate) is timed around its step. A trainer that owns its loop
(the Lightning Trainer, stabletrain) runs ``fit()`` in a thread of its own that a callback parks at the
end of every step (``on_train_batch_end``, ``on_step_end``) until the round calls it again; its step is
timed inside that thread, from the moment it is let go to its next step end, so everything it does
between two steps (its logging, the next batch, a log interval's work, a checkpoint it starts) is in
it and the hand-over is not. Only one contender runs at a time. Ratios: per window of 10 steps (one
log interval of stabletrain, so each window holds exactly one of its interval boundaries) the
contender's time over the bare loop's over the same steps (a compiled one over bare+compile), median
over all windows of all rounds; the ratio of total times is printed beside it (it counts the rare
windows with a checkpoint at their full weight). A compiled contender resets dynamo first (a fresh
model each round would otherwise reach dynamo's recompile limit and silently run eager); its compile
time is in the warmup. Noise guard: a round during which other processes used more than ``--noise``
of one core (read from /proc/stat against this process's own CPU time) is run again, up to
``--redo`` times; the count of rounds redone and still noisy is printed.

    python bench/frameworks.py                      # mlp and gpt, 3 lockstep rounds x 200 steps
    python bench/frameworks.py --models gpt --rounds 4
    python bench/frameworks.py --quick              # smoke run: smaller models, 2 rounds x 20 steps (not a measurement)

Needs the ``bench`` extra: ``pip install -e .[bench]`` (lightning, accelerate).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import io
import logging
import os
import platform
import statistics
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from overhead import load_average, param_groups  # bench/ is the script's directory
from torch import nn
from torch.utils.data import DataLoader, Dataset, default_collate

from stabletrain import Task, Trainer, load_config, resolve_task
from stabletrain.callbacks import Callback

#: model -> (task, task_args, micro-batch size)
MODELS = {
    "mlp": ("mlp", ["task_args.width=256", "task_args.depth=4"], 64),
    "gpt": ("gpt", [], 16),
}
QUICK = {
    "mlp": ("mlp", ["task_args.width=64", "task_args.depth=3", "task_args.num_samples=1024"], 32),
    "gpt": ("gpt", ["task_args.n_layer=1", "task_args.n_embd=64", "task_args.seq_len=32", "task_args.max_bytes=300000"], 8),
}
CONTENDERS = ("bare", "fabric", "lightning", "accelerate", "stabletrain", "stabletrain+dir", "bare+compile",
              "stabletrain+compile")
#: the contender each one's ratio is taken against (default: bare)
BASELINE = {"stabletrain+compile": "bare+compile"}
NUM_BATCHES = 16  # distinct pre-built batches, cycled


def mean_loss(task: Task) -> Callable[[nn.Module, Any], torch.Tensor]:
    """The task's loss as a per-item mean (what the other frameworks backpropagate)."""
    def loss(model: nn.Module, batch: Any) -> torch.Tensor:
        out = task.loss(model, batch)
        return out[0] / out[1] if isinstance(out, tuple) else out
    return loss


def make_optimizer(model: nn.Module, foreach: bool) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    kind = {"foreach": True} if foreach else {"fused": True}
    return torch.optim.AdamW(param_groups(named, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, **kind)


class Setup:
    """One model's shared pieces: the task, its initialization and the pre-built batches."""

    def __init__(self, name: str, quick: bool, foreach: bool) -> None:
        task_name, task_args, self.batch_size = (QUICK if quick else MODELS)[name]
        self.name, self.foreach = name, foreach
        self.overrides = [f"task={task_name}", *task_args]
        cfg = load_config(None, self.overrides)
        self.task = resolve_task(cfg.task, cfg.task_args)
        self.init = copy.deepcopy(self.task.model.state_dict())
        collate = self.task.collate or default_collate
        bs = self.batch_size
        self.batches = [collate([self.task.train_data[i] for i in range(b * bs, (b + 1) * bs)]) for b in range(NUM_BATCHES)]
        self.loss = mean_loss(self.task)

    def model(self) -> nn.Module:
        model = copy.deepcopy(self.task.model)
        model.load_state_dict(self.init)
        return model.train()

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return make_optimizer(model, self.foreach)

    def batch(self, i: int) -> Any:
        return self.batches[i % NUM_BATCHES]


# -- the contenders: steppers, one optimizer step per call ------------------------------------------

WINDOW = 10  # steps per ratio window: stabletrain's log.every, so each window holds one interval boundary


class LoopStepper:
    """A hand-written loop's step (``step_fn(i)``), timed around the call."""

    threaded = False

    def __init__(self, step_fn: Callable[[int], None], close: Callable[[], None] = lambda: None) -> None:
        self.step_fn, self.close, self.i = step_fn, close, 0

    def step(self) -> float:
        t0 = time.perf_counter()
        self.step_fn(self.i)
        self.i += 1
        return time.perf_counter() - t0


class _Aborted(Exception):
    """Raised in a parked trainer's thread to end its fit when the round ends early."""


class ThreadStepper:
    """A trainer that owns its loop: ``fit(on_step_end)`` runs in a thread parked at each step end.

    ``fit`` builds the trainer and trains ``total`` steps, calling ``on_step_end()`` after each; there the
    thread stamps the time, hands control back and waits to be called again. A step's time is taken in the
    thread, from the moment it is let go to its next step end (setup is in the first step's).
    """

    threaded = True

    def __init__(self, fit: Callable[[Callable[[], None]], None], total: int) -> None:
        self.total, self.n = total, 0
        self._go, self._parked = threading.Semaphore(0), threading.Semaphore(0)
        self._times: list[float] = []
        self._resumed = 0.0
        self._error: BaseException | None = None
        self._abort = False
        self._thread = threading.Thread(target=self._run, args=(fit,), daemon=True)
        self._thread.start()

    def _run(self, fit: Callable[[Callable[[], None]], None]) -> None:
        self._go.acquire()
        self._resumed = time.perf_counter()
        try:
            if self._abort:
                raise _Aborted()
            fit(self._on_step_end)
        except BaseException as err:  # handed to the round
            self._error = err
        finally:
            self._parked.release()

    def _on_step_end(self) -> None:
        self._times.append(time.perf_counter() - self._resumed)
        self.n += 1
        if self.n >= self.total:  # the last step: fit() finishes on its own (untimed)
            return
        self._parked.release()
        self._go.acquire()
        if self._abort:  # the round ended early (another contender failed): unwind this fit
            raise _Aborted()
        self._resumed = time.perf_counter()

    def step(self) -> float:
        self._go.release()
        self._parked.acquire()
        if self._error is not None:
            raise self._error
        if len(self._times) != self.n or not self._times:
            raise RuntimeError("the trainer ended before its steps were done")
        return self._times[-1]

    def close(self) -> None:
        if self.n < self.total and self._thread.is_alive():  # parked mid-run: let it go, to unwind
            self._abort = True
            self._go.release()
        self._thread.join()
        if self._error is not None and not isinstance(self._error, _Aborted):
            raise self._error


def make_bare(s: Setup, total: int, compile: bool = False) -> LoopStepper:
    model = s.model()
    if compile:
        torch._dynamo.reset()
        model = torch.compile(model)
    opt, params = s.optimizer(model), [p for p in model.parameters() if p.requires_grad]

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        s.loss(model, s.batch(i)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    return LoopStepper(step)


def make_fabric(s: Setup, total: int) -> LoopStepper:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model = s.model()
    model, opt = fabric.setup(model, s.optimizer(model))

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        fabric.backward(s.loss(model, s.batch(i)))
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()

    return LoopStepper(step)


def make_accelerate(s: Setup, total: int) -> LoopStepper:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = s.model()
    model, opt = accelerator.prepare(model, s.optimizer(model))

    def step(i: int) -> None:
        opt.zero_grad(set_to_none=True)
        accelerator.backward(s.loss(model, s.batch(i)))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return LoopStepper(step)


class _Batches(Dataset):
    """The pre-built batches as a dataset of batches (a DataLoader with batch_size=None hands them over as they are)."""

    def __init__(self, s: Setup, n: int) -> None:
        self.s, self.n = s, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.s.batch(i)


def make_lightning(s: Setup, total: int) -> ThreadStepper:
    import lightning as L

    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)  # after the import: it configures its own loggers

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = s.model()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return s.loss(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return s.optimizer(self.model)

    def fit(on_step_end: Callable[[], None]) -> None:
        class Park(L.Callback):
            def on_train_batch_end(self, *args: Any) -> None:
                on_step_end()

        # (stdout, its tips and "GPU available" lines: redirected by the round, in the main thread)
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=total, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            gradient_clip_val=1.0, gradient_clip_algorithm="norm", num_sanity_val_steps=0,
                            limit_val_batches=0, callbacks=[Park()])
        trainer.fit(Module(), train_dataloaders=DataLoader(_Batches(s, total + 1), batch_size=None))

    return ThreadStepper(fit, total)


def _stabletrain(s: Setup, total: int, with_dir: bool, compile: bool = False) -> ThreadStepper:
    bs = s.batch_size
    # The pre-built batches through stabletrain's own data path: sample i is its index, the collate hands
    # over batch i // batch_size (data.shuffle=false keeps the micro-batches in order).
    task = Task(model=s.model(), train_data=range(NUM_BATCHES * bs), loss=s.task.loss,
                collate=lambda items: s.batch(items[0] // bs), name=s.name, count_unit=s.task.count_unit)
    cfg = load_config(None, [*s.overrides, f"train.batch_size={bs}", f"train.max_steps={total}",
                             "data.shuffle=false", "clip.max_norm=1.0", "precision=fp32", "device=cpu", "eval.every=0",
                             f"log.every={WINDOW}", "run.overwrite=true", *([] if with_dir else ["log.progress=false"]),
                             *(["train.compile=true"] if compile else [])])

    def fit(on_step_end: Callable[[], None]) -> None:
        class Park(Callback):
            def on_step_end(self, state: Any, out: Any) -> None:
                on_step_end()

        if compile:
            torch._dynamo.reset()
        with tempfile.TemporaryDirectory() as tmp:  # (stderr: redirected by the round, in the main thread)
            Trainer(cfg, task=task, run_dir=Path(tmp) / "run" if with_dir else None, callbacks=[Park()]).fit()

    return ThreadStepper(fit, total)


MAKERS: dict[str, Callable[[Setup, int], Any]] = {
    "bare": make_bare, "fabric": make_fabric, "lightning": make_lightning, "accelerate": make_accelerate,
    "stabletrain": lambda s, n: _stabletrain(s, n, with_dir=False),
    "stabletrain+dir": lambda s, n: _stabletrain(s, n, with_dir=True),
    "bare+compile": lambda s, n: make_bare(s, n, compile=True),
    "stabletrain+compile": lambda s, n: _stabletrain(s, n, with_dir=True, compile=True),
}


# -- the noise guard ----------------------------------------------------------------------------------


class CpuWatch:
    """CPU seconds other processes used while it ran: /proc/stat's busy time minus this process's own."""

    def __enter__(self) -> CpuWatch:
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wall = time.perf_counter() - self.t0
        self.others = max(0.0, (self._busy() - self.busy0) - (self._own() - self.own0))

    @staticmethod
    def _busy() -> float:
        try:
            with open("/proc/stat") as fh:
                fields = [int(x) for x in fh.readline().split()[1:8]]
        except OSError:  # not Linux: no guard
            return 0.0
        return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait

    @staticmethod
    def _own() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    @property
    def others_cores(self) -> float:
        """Other processes' average CPU use over the interval, in cores."""
        return self.others / max(self.wall, 1e-9)


# -- main -----------------------------------------------------------------------------------------


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def versions() -> str:
    out = [f"torch {torch.__version__}"]
    for name in ("lightning", "accelerate"):
        with contextlib.suppress(ImportError):
            out.append(f"{name} {__import__(name).__version__}")
    from stabletrain import __version__

    return ", ".join(out + [f"stabletrain {__version__}"])


def lockstep_round(setup: Setup, contenders: list[str], warmup: int, steps: int) -> dict[str, list[float]]:
    """One round: every contender built fresh, then stepped side by side; return each one's timed steps' seconds.

    The order within a step rotates every step (no contender always runs first, or right after another).
    The progress bars and tips the trainers print go nowhere (redirected here, once, for every thread).
    """
    total = warmup + steps
    times: dict[str, list[float]] = {c: [] for c in contenders}
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        steppers = {c: MAKERS[c](setup, total) for c in contenders}
        _lockstep(steppers, contenders, warmup, total, times)
    return times


def _lockstep(steppers: dict[str, Any], contenders: list[str], warmup: int, total: int,
              times: dict[str, list[float]]) -> None:
    try:
        for i in range(total):
            k = i % len(contenders)
            for c in contenders[k:] + contenders[:k]:
                dt = steppers[c].step()
                if i >= warmup:
                    times[c].append(dt)
    finally:
        for stepper in steppers.values():
            stepper.close()  # a trainer finishes its fit (its last checkpoint, closing): untimed


def measure(setup: Setup, contenders: list[str], rounds: int, warmup: int, steps: int, noise: float,
            redo: int) -> tuple[dict[str, list[float]], dict[str, list[float]], dict[str, float], int, int]:
    """Lockstep rounds; return (per-window ratios to the baseline, seconds per step per window, ratio of totals,
    rounds redone, rounds kept noisy)."""
    ratios: dict[str, list[float]] = {c: [] for c in contenders}
    per_step: dict[str, list[float]] = {c: [] for c in contenders}
    totals: dict[str, float] = {c: 0.0 for c in contenders}
    redone = noisy = 0
    for r in range(rounds):
        for attempt in range(redo + 1):
            with CpuWatch() as watch:
                times = lockstep_round(setup, contenders, warmup, steps)
            if watch.others_cores <= noise:
                break
            if attempt < redo:
                redone += 1
        else:
            noisy += 1
        windows = range(0, steps - WINDOW + 1, WINDOW)
        for c in contenders:
            base = times[BASELINE.get(c, "bare")]
            for w in windows:
                mine = sum(times[c][w:w + WINDOW])
                ratios[c].append(mine / sum(base[w:w + WINDOW]))
                per_step[c].append(mine / WINDOW)
            totals[c] += sum(times[c])
        print(f"  {setup.name} round {r + 1}/{rounds}: " + ", ".join(
            f"{c} {statistics.median(times[c]) * 1e3:.2f} ms" for c in contenders)
              + f"  (median step)  [others used {watch.others_cores:.2f} cores]", flush=True)
    total_ratio = {c: totals[c] / totals[BASELINE.get(c, "bare")] for c in contenders}
    return ratios, per_step, total_ratio, redone, noisy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--foreach", action="store_true", help="torch's default (foreach) AdamW for all but stabletrain")
    ap.add_argument("--noise", type=float, default=0.1, help="redo a round when other processes used more cores than this")
    ap.add_argument("--redo", type=int, default=3, help="redos of a noisy round before it is kept (and counted)")
    ap.add_argument("--quick", action="store_true", help="smoke run: smaller models, 2 rounds x 20 steps, no redo")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.steps, args.redo = 2, 5, 20, 0
    if args.steps % WINDOW:
        ap.error(f"--steps must be a multiple of {WINDOW} (whole ratio windows), got {args.steps}")
    contenders = ["bare"] + [c for c in args.contenders if c != "bare"]
    for c, base in BASELINE.items():  # a compiled contender needs its compiled baseline in the same rounds
        if c in contenders and base not in contenders:
            contenders.insert(contenders.index(c), base)
    warnings.filterwarnings("ignore")
    print(f"{datetime.date.today().isoformat()}; {machine()}; {versions()}; {load_average()}")
    print(f"{args.rounds} lockstep rounds x {args.steps} timed steps (after {args.warmup}), fp32, clip 1.0, "
          f"AdamW {'foreach (stabletrain: fused)' if args.foreach else 'fused'}; medians over {WINDOW}-step windows of "
          f"the ratio to the bare loop over the same steps [ratio of total times]; noise guard {args.noise} cores"
          f"{' (quick: a smoke run, not a measurement)' if args.quick else ''}", flush=True)
    results, sizes = {}, {}
    for name in args.models:
        setup = Setup(name, args.quick, args.foreach)
        sizes[name] = f"{sum(p.numel() for p in setup.task.model.parameters()) / 1e6:.2f}M params, b{setup.batch_size}"
        results[name] = measure(setup, contenders, args.rounds, args.warmup, args.steps, args.noise, args.redo)
    headers = []
    for name in args.models:
        per_step = results[name][1]
        headers.append(f"{name} {sizes[name]} ({statistics.median(per_step['bare']) * 1e3:.1f} ms/step bare)")
    print()
    print("| step time vs bare loop | " + " | ".join(headers) + " |")
    print("|---|" + "---|" * len(args.models))
    for c in contenders:
        cells = []
        for name in args.models:
            ratios, _, total_ratio, _, _ = results[name]
            cells.append(f"{statistics.median(ratios[c]):.3f} [{total_ratio[c]:.3f}]")
        label = f"{c} (vs {BASELINE[c]})" if c in BASELINE else c
        print(f"| {label} | " + " | ".join(cells) + " |")
    for name in args.models:
        ratios, _, _, redone, noisy = results[name]
        spread = ", ".join(f"{c} {q[0]:.3f}-{q[2]:.3f}" for c in contenders if c != "bare"
                           for q in [statistics.quantiles(ratios[c], n=4) if len(ratios[c]) > 1 else [ratios[c][0]] * 3])
        print(f"{name}: window-ratio quartiles {spread}; {redone} round(s) redone for noise, {noisy} kept although noisy")


if __name__ == "__main__":
    main()
