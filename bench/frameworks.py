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

Timing: each contender runs ``--warmup`` steps, then ``--steps`` timed steps (a loop contender is timed
around its loop; a trainer that owns its loop, by a callback stamping each step's end). Rounds
interleave the contenders, in an order rotated every round, so drift hits all alike; each round gives
each contender a ratio to the bare loop of the same round (a compiled one to the compiled bare loop), and
the table shows medians over rounds. A compiled contender resets dynamo first (a fresh model each round
would otherwise reach dynamo's recompile limit and silently run eager); its compile time is in the warmup.
Noise guard: a round during which other processes used more than ``--noise`` of one core (read from
/proc/stat against this process's own CPU time) is run again, up to ``--redo`` times; the count of
rounds redone and still noisy is printed.

    python bench/frameworks.py                      # mlp and gpt, 6 rounds x 200 steps (needs a quiet machine)
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


# -- the contenders: each returns the wall time of its timed steps ------------------------------------


def run_bare(s: Setup, warmup: int, steps: int, compile: bool = False) -> float:
    model = s.model()
    if compile:
        torch._dynamo.reset()
        model = torch.compile(model)
    opt, params = s.optimizer(model), [p for p in model.parameters() if p.requires_grad]
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        s.loss(model, s.batch(i)).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
    return time.perf_counter() - t0


def run_fabric(s: Setup, warmup: int, steps: int) -> float:
    from lightning.fabric import Fabric

    fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
    model = s.model()
    model, opt = fabric.setup(model, s.optimizer(model))
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        fabric.backward(s.loss(model, s.batch(i)))
        fabric.clip_gradients(model, opt, max_norm=1.0)
        opt.step()
    return time.perf_counter() - t0


def run_accelerate(s: Setup, warmup: int, steps: int) -> float:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = s.model()
    model, opt = accelerator.prepare(model, s.optimizer(model))
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        accelerator.backward(s.loss(model, s.batch(i)))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return time.perf_counter() - t0


class _Batches(Dataset):
    """The pre-built batches as a dataset of batches (a DataLoader with batch_size=None hands them over as they are)."""

    def __init__(self, s: Setup, n: int) -> None:
        self.s, self.n = s, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return self.s.batch(i)


def run_lightning(s: Setup, warmup: int, steps: int) -> float:
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

    class Stamps(L.Callback):
        def __init__(self) -> None:
            self.stamps: list[float] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.stamps.append(time.perf_counter())

    stamps = Stamps()
    with contextlib.redirect_stdout(io.StringIO()):  # its tips and "GPU available" lines
        trainer = L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=warmup + steps, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            gradient_clip_val=1.0, gradient_clip_algorithm="norm", num_sanity_val_steps=0,
                            limit_val_batches=0, callbacks=[stamps])
        trainer.fit(Module(), train_dataloaders=DataLoader(_Batches(s, warmup + steps + 1), batch_size=None))
    return stamps.stamps[warmup + steps - 1] - stamps.stamps[warmup - 1]


class _Stamps(Callback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_end(self, state: Any, out: Any) -> None:
        self.stamps.append(time.perf_counter())


def _stabletrain(s: Setup, warmup: int, steps: int, run_dir: Path | None, compile: bool = False) -> float:
    bs = s.batch_size
    # The pre-built batches through stabletrain's own data path: sample i is its index, the collate hands
    # over batch i // batch_size (data.shuffle=false keeps the micro-batches in order).
    task = Task(model=s.model(), train_data=range(NUM_BATCHES * bs), loss=s.task.loss,
                collate=lambda items: s.batch(items[0] // bs), name=s.name, count_unit=s.task.count_unit)
    cfg = load_config(None, [*s.overrides, f"train.batch_size={bs}", f"train.max_steps={warmup + steps}",
                             "data.shuffle=false", "clip.max_norm=1.0", "precision=fp32", "device=cpu", "eval.every=0",
                             "run.overwrite=true", *([] if run_dir is not None else ["log.progress=false"]),
                             *(["train.compile=true"] if compile else [])])
    if compile:
        torch._dynamo.reset()
    stamps = _Stamps()
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        Trainer(cfg, task=task, run_dir=run_dir, callbacks=[stamps]).fit()
    return stamps.stamps[warmup + steps - 1] - stamps.stamps[warmup - 1]


def run_stabletrain(s: Setup, warmup: int, steps: int) -> float:
    return _stabletrain(s, warmup, steps, None)


def run_stabletrain_dir(s: Setup, warmup: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        return _stabletrain(s, warmup, steps, Path(tmp) / "run")


def run_bare_compile(s: Setup, warmup: int, steps: int) -> float:
    return run_bare(s, warmup, steps, compile=True)


def run_stabletrain_compile(s: Setup, warmup: int, steps: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        return _stabletrain(s, warmup, steps, Path(tmp) / "run", compile=True)


RUNNERS: dict[str, Callable[[Setup, int, int], float]] = {
    "bare": run_bare, "fabric": run_fabric, "lightning": run_lightning, "accelerate": run_accelerate,
    "stabletrain": run_stabletrain, "stabletrain+dir": run_stabletrain_dir, "bare+compile": run_bare_compile,
    "stabletrain+compile": run_stabletrain_compile,
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


def measure(setup: Setup, contenders: list[str], rounds: int, warmup: int, steps: int, noise: float,
            redo: int) -> tuple[dict[str, list[float]], dict[str, list[float]], int, int]:
    """Return (per-contender ratios to bare per round, per-contender seconds per step, rounds redone, rounds kept noisy)."""
    ratios: dict[str, list[float]] = {c: [] for c in contenders}
    per_step: dict[str, list[float]] = {c: [] for c in contenders}
    redone = noisy = 0
    order = list(contenders)
    for r in range(rounds):
        k = r % len(order)
        this_order = order[k:] + order[:k]  # rotated: no contender always runs first
        for attempt in range(redo + 1):
            times: dict[str, float] = {}
            with CpuWatch() as watch:
                for c in this_order:
                    times[c] = RUNNERS[c](setup, warmup, steps)
            if watch.others_cores <= noise:
                break
            if attempt < redo:
                redone += 1
        else:
            noisy += 1
        for c in contenders:
            per_step[c].append(times[c] / steps)
            ratios[c].append(times[c] / times[BASELINE.get(c, "bare")])
        print(f"  {setup.name} round {r + 1}/{rounds}: " + ", ".join(f"{c} {times[c] / steps * 1e3:.2f} ms"
                                                                   for c in contenders)
              + f"  [others used {watch.others_cores:.2f} cores]", flush=True)
    return ratios, per_step, redone, noisy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--foreach", action="store_true", help="torch's default (foreach) AdamW for all but stabletrain")
    ap.add_argument("--noise", type=float, default=0.1, help="redo a round when other processes used more cores than this")
    ap.add_argument("--redo", type=int, default=3, help="redos of a noisy round before it is kept (and counted)")
    ap.add_argument("--quick", action="store_true", help="smoke run: smaller models, 2 rounds x 20 steps, no redo")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.steps, args.redo = 2, 5, 20, 0
    contenders = ["bare"] + [c for c in args.contenders if c != "bare"]
    for c, base in BASELINE.items():  # a compiled contender needs its compiled baseline in the same rounds
        if c in contenders and base not in contenders:
            contenders.insert(contenders.index(c), base)
    warnings.filterwarnings("ignore")
    print(f"{datetime.date.today().isoformat()}; {machine()}; {versions()}; {load_average()}")
    print(f"{args.rounds} interleaved rounds x {args.steps} timed steps (after {args.warmup}), fp32, clip 1.0, "
          f"AdamW {'foreach (stabletrain: fused)' if args.foreach else 'fused'}; medians of per-round ratios to the bare "
          f"loop; noise guard {args.noise} cores{' (quick: a smoke run, not a measurement)' if args.quick else ''}", flush=True)
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
            ratios, per_step, _, _ = results[name]
            cells.append(f"{statistics.median(ratios[c]):.2f}")
        label = f"{c} (vs {BASELINE[c]})" if c in BASELINE else c
        print(f"| {label} | " + " | ".join(cells) + " |")
    for name in args.models:
        _, _, redone, noisy = results[name]
        print(f"{name}: {redone} round(s) redone for noise, {noisy} kept although noisy")


if __name__ == "__main__":
    main()
