"""stabletrain's Trainer against a hand-written loop, Lightning Fabric, the Lightning Trainer and Accelerate.

Every contender trains the model and runs the step of ``bench/overhead.py``: the task's default config
(``task=mlp`` or ``task=gpt``: model, dataset, ``train.batch_size``), a fresh copy of one initialization
per round, the dataset through a shuffled DataLoader (stabletrain: through its own data stream), the
config's fused AdamW with weight decay on matrices only, global-norm clipping at ``clip.max_norm`` and
the config's warmup + cosine schedule, fp32 on the CPU.

    bare                 overhead.BareLoop: zero_grad, next batch, forward, backward, clip_grad_norm_, step, LambdaLR
    fabric               the same loop through lightning.fabric.Fabric: setup(), setup_dataloaders(), backward(),
                         clip_gradients()
    accelerate           the same loop through accelerate.Accelerator: prepare(model, optimizer, loader, scheduler),
                         backward(), clip_grad_norm_()
    lightning            lightning.Trainer (logger, checkpointing, progress bar, model summary off; gradient_clip_val;
                         the schedule stepped per step)
    stabletrain          stabletrain.Trainer with its defaults: run directory, metrics.jsonl, events, TensorBoard,
                         progress line, periodic checkpoints (background), sentinel, incident snapshot (what
                         bench/overhead.py times)
    stabletrain-nodir    the same Trainer without a run directory (no files, no snapshot, no checkpoints)
    bare+compile         the bare loop on torch.compile(model) (the optimizer step and clipping stay eager)
    stabletrain+compile  stabletrain with train.compile=true; its ratio is to bare+compile of the same rounds

Timing: lockstep, in one thread. A contender that owns its loop (stabletrain, the Lightning Trainer)
*drives* a round: its ``fit()`` runs in the main thread and a callback at the end of each of its steps runs
one step of every loop contender (bare, Fabric, Accelerate), in an order rotated every step, so a burst of
load from another process hits all of them alike. The driver's clock is read at each of its step ends with
the loop steps' time taken off, so everything it does between two steps (the next batch, a log interval's
work, a checkpoint it starts) is in its time, as in ``bench/overhead.py``. The drivers take turns round by
round: a driver's ratio comes from its own rounds, a loop contender's from every round. Ratio: per window of
10 steps (one stabletrain log interval, so each window holds one interval boundary) a contender's time over
the bare loop's over the same steps; each round prints its median window ratio per contender, the table the
median over all windows and, in brackets, the ratio of total times (which counts a rare window holding a
checkpoint at its full weight).

Why one thread: the form before ran each trainer's ``fit()`` in a thread of its own, parked at every step
end. Its rounds disagreed with themselves (mlp: the bare loop's median step 8.2, 7.6 and 4.7 ms in three
rounds, stabletrain below bare in two), and here no thread hands over and every contender's compute runs on
the same intra-op thread pool. The noise guard: a round during which other processes used more than
``--noise`` of one core (read from /proc/stat against this process's own CPU time) is run again, up to
``--redo`` times; the rounds redone and those kept noisy are counted.

    python bench/frameworks.py                       # mlp and gpt, every contender but the compiled ones, ~2 min
    python bench/frameworks.py --models mlp --rounds 4 --contenders bare fabric stabletrain
    python bench/frameworks.py --contenders bare stabletrain bare+compile stabletrain+compile
    python bench/frameworks.py --quick               # smoke run: smaller models, few steps (not a measurement)

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
from overhead import QUICK_ARGS, BareLoop, load_average, make_trainer  # bench/ is the script's directory
from torch import nn

from stabletrain import load_config, resolve_task
from stabletrain.callbacks import Callback

#: model -> (timed steps, warm-up steps) per round; the timed steps are whole 10-step windows.
STEPS = {"mlp": (200, 20), "gpt": (30, 5)}
QUICK_STEPS = {"mlp": (20, 5), "gpt": (10, 2)}
LOOPS = ("bare", "fabric", "accelerate", "bare+compile")
DRIVERS = ("stabletrain", "stabletrain-nodir", "lightning", "stabletrain+compile")
CONTENDERS = ("bare", "fabric", "accelerate", "lightning", "stabletrain", "stabletrain-nodir", "bare+compile",
              "stabletrain+compile")
DEFAULT = ("bare", "fabric", "accelerate", "lightning", "stabletrain", "stabletrain-nodir")
#: the contender each one's ratio is taken against (default: bare)
BASELINE = {"stabletrain+compile": "bare+compile"}
WINDOW = 10  # steps per ratio window: stabletrain's log.every, so each window holds one interval boundary


class Setup:
    """One model's shared pieces: the config every contender follows, the task, and its initialization."""

    def __init__(self, name: str, quick: bool, steps: int) -> None:
        self.name = name
        self.overrides = [f"task={name}", *(QUICK_ARGS[name] if quick else []), f"train.max_steps={steps}",
                          f"log.every={WINDOW}", "eval.every=0", "device=cpu", "precision=fp32", "run.overwrite=true"]
        self.cfg = load_config(None, self.overrides)
        self.task = resolve_task(self.cfg.task, self.cfg.task_args)
        self.task.val_data = None  # validation is not part of the comparison (the loops have none)
        self.init = copy.deepcopy(self.task.model.state_dict())

    def model(self) -> nn.Module:
        model = copy.deepcopy(self.task.model)
        model.load_state_dict(self.init)
        return model.train()


# -- the loop contenders: one optimizer step per call -------------------------------------------------


class FabricLoop(BareLoop):
    """The bare loop's step written for Lightning Fabric."""

    def __init__(self, s: Setup) -> None:
        from lightning.fabric import Fabric

        super().__init__(s.task, s.model(), s.cfg)
        self.fabric = Fabric(accelerator="cpu", devices=1, precision="32-true")
        self.model, self.opt = self.fabric.setup(self.model, self.opt)
        self.loader = self.fabric.setup_dataloaders(self.loader)
        self.it = iter(self.loader)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        batch = self._next()
        self.fabric.backward(self._loss(batch))
        self.fabric.clip_gradients(self.model, self.opt, max_norm=self.cfg.clip.max_norm)
        self.opt.step()
        self.sched.step()


class AccelerateLoop(BareLoop):
    """The bare loop's step written for Hugging Face Accelerate."""

    def __init__(self, s: Setup) -> None:
        from accelerate import Accelerator

        super().__init__(s.task, s.model(), s.cfg)
        self.accelerator = Accelerator(cpu=True)
        self.model, self.opt, self.loader, self.sched = self.accelerator.prepare(self.model, self.opt, self.loader,
                                                                                 self.sched)
        self.it = iter(self.loader)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        batch = self._next()
        self.accelerator.backward(self._loss(batch))
        self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.clip.max_norm)
        self.opt.step()
        self.sched.step()


def make_loop(name: str, s: Setup) -> BareLoop:
    if name == "fabric":
        return FabricLoop(s)
    if name == "accelerate":
        return AccelerateLoop(s)
    model = s.model()
    if name == "bare+compile":
        model = torch.compile(model)
    return BareLoop(s.task, model, s.cfg)


# -- the drivers: a trainer's fit() with the loops stepped beside each of its steps ------------------


class Beside:
    """Run one step of each loop beside every step of a driver; keep every contender's per-step seconds.

    ``tick()`` is called at the end of each driver step: it stamps the driver's clock (wall time less the loop
    steps run so far), then steps each loop once, in an order rotated every step.
    """

    def __init__(self, loops: dict[str, BareLoop]) -> None:
        self.loops = loops
        self.order = list(loops)
        self.stamps: list[float] = []
        self.times: dict[str, list[float]] = {name: [] for name in loops}
        self.excluded = 0.0

    def tick(self) -> None:
        self.stamps.append(time.perf_counter() - self.excluded)
        k = len(self.stamps) % max(len(self.order), 1)
        for name in self.order[k:] + self.order[:k]:
            t0 = time.perf_counter()
            self.loops[name].step()
            dt = time.perf_counter() - t0
            self.times[name].append(dt)
            self.excluded += dt

    def driver_times(self) -> list[float]:
        """The driver's seconds per step, from its first step end on (its first step holds its setup: not timed)."""
        return [b - a for a, b in zip(self.stamps, self.stamps[1:])]


def drive_stabletrain(s: Setup, beside: Beside, with_dir: bool, compile: bool = False) -> None:
    class Tick(Callback):
        def on_step_end(self, state: Any, out: Any) -> None:
            beside.tick()

    cfg = load_config(None, [*s.overrides, *([] if with_dir else ["log.progress=false"]),
                             *(["train.compile=true"] if compile else [])])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = make_trainer(s.task, s.model(), cfg, Path(tmp) / "run" if with_dir else None, callbacks=[Tick()])
        trainer.fit()
        if trainer.stop_reason is not None:
            raise RuntimeError(f"stabletrain stopped early: {trainer.stop_reason}")


def drive_lightning(s: Setup, beside: Beside) -> None:
    import lightning as L

    for name in ("lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)  # after the import: it configures its own loggers
    bare = BareLoop(s.task, s.model(), s.cfg)  # its optimizer, schedule and loader, handed to Lightning

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = bare.model

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return bare._loss(batch)

        def configure_optimizers(self) -> Any:
            return {"optimizer": bare.opt, "lr_scheduler": {"scheduler": bare.sched, "interval": "step"}}

    class Tick(L.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            beside.tick()

    trainer = L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=s.cfg.train.max_steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=s.cfg.clip.max_norm,
                        gradient_clip_algorithm="norm", num_sanity_val_steps=0, limit_val_batches=0, callbacks=[Tick()])
    trainer.fit(Module(), train_dataloaders=bare.loader)


DRIVE: dict[str, Callable[[Setup, Beside], None]] = {
    "stabletrain": lambda s, b: drive_stabletrain(s, b, with_dir=True),
    "stabletrain-nodir": lambda s, b: drive_stabletrain(s, b, with_dir=False),
    "lightning": drive_lightning,
    "stabletrain+compile": lambda s, b: drive_stabletrain(s, b, with_dir=True, compile=True),
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


# -- rounds -------------------------------------------------------------------------------------------


def one_round(s: Setup, driver: str, loops: list[str], warmup: int, steps: int) -> dict[str, list[float]]:
    """One round driven by ``driver`` with ``loops`` beside it; each contender's seconds per timed step."""
    if "compile" in driver or "bare+compile" in loops:
        torch._dynamo.reset()  # fresh models each round would otherwise reach dynamo's recompile limit (and run eager)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        beside = Beside({name: make_loop(name, s) for name in loops})
        DRIVE[driver](s, beside)
    times = {driver: beside.driver_times(), **beside.times}
    # The driver's step i (from 1) ends at stamp i; loop steps run after each stamp: align both on the driver's.
    timed = {name: v[warmup:warmup + steps] for name, v in times.items()}
    short = [name for name, v in timed.items() if len(v) < steps]
    if short:
        raise RuntimeError(f"round driven by {driver}: {short} ran fewer than {warmup + steps} steps")
    return timed


def window_ratios(mine: list[float], base: list[float]) -> list[float]:
    return [sum(mine[w:w + WINDOW]) / sum(base[w:w + WINDOW]) for w in range(0, len(mine) - WINDOW + 1, WINDOW)]


def measure(s: Setup, contenders: list[str], rounds: int, warmup: int, steps: int, noise: float,
            redo: int) -> dict[str, Any]:
    """``rounds`` rounds per driver (drivers taking turns); per contender its window ratios and total seconds."""
    drivers = [c for c in contenders if c in DRIVERS]
    loops = [c for c in contenders if c in LOOPS]
    ratios: dict[str, list[float]] = {c: [] for c in contenders}
    step_s: dict[str, list[float]] = {c: [] for c in contenders}
    totals: dict[str, float] = {c: 0.0 for c in contenders}
    base_totals: dict[str, float] = {c: 0.0 for c in contenders}
    redone = noisy = 0
    for r in range(rounds):
        for driver in drivers:
            for attempt in range(redo + 1):
                with CpuWatch() as watch:
                    times = one_round(s, driver, loops, warmup, steps)
                if watch.others_cores <= noise:
                    break
                if attempt < redo:
                    redone += 1
            else:
                noisy += 1
            line = []
            for c, mine in times.items():
                base = times[BASELINE.get(c, "bare")]
                w = window_ratios(mine, base)
                ratios[c] += w
                step_s[c] += mine
                totals[c] += sum(mine)
                base_totals[c] += sum(base)
                if c != "bare":
                    line.append(f"{c} {statistics.median(w):.3f}")
            print(f"  {s.name} round {r + 1}/{rounds}, driven by {driver}: bare {statistics.median(times['bare']) * 1e3:.2f} "
                  f"ms/step; median window ratio: {', '.join(line)}  [others used {watch.others_cores:.2f} cores; "
                  f"{load_average()}]", flush=True)
    return {"ratios": ratios, "step_s": step_s, "total_ratio": {c: totals[c] / base_totals[c] for c in contenders},
            "redone": redone, "noisy": noisy}


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["mlp", "gpt"], choices=["mlp", "gpt"])
    ap.add_argument("--contenders", nargs="+", default=list(DEFAULT), choices=list(CONTENDERS))
    ap.add_argument("--rounds", type=int, default=3, help="rounds per driver (default 3)")
    ap.add_argument("--steps", type=int, default=0,
                    help="timed steps per round, whole 10-step windows (default: mlp 200, gpt 30)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed steps per round (default: mlp 20, gpt 5)")
    ap.add_argument("--noise", type=float, default=0.25, help="redo a round when other processes used more cores than this")
    ap.add_argument("--redo", type=int, default=1, help="redos of a noisy round before it is kept (and counted)")
    ap.add_argument("--quick", action="store_true", help="smoke run: smaller models, 2 rounds of few steps, no redo")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.redo = min(args.rounds, 2), 0
    if args.steps % WINDOW:
        ap.error(f"--steps must be a multiple of {WINDOW} (whole ratio windows), got {args.steps}")
    contenders = ["bare"] + [c for c in CONTENDERS if c in args.contenders and c != "bare"]
    for c, base in BASELINE.items():  # a compiled driver needs its compiled baseline in the same rounds
        if c in contenders and base not in contenders:
            contenders.insert(contenders.index(c), base)
    if not any(c in DRIVERS for c in contenders):
        ap.error(f"--contenders needs at least one trainer that owns its loop ({', '.join(DRIVERS)}): it drives the rounds")
    warnings.filterwarnings("ignore")
    print(f"{datetime.date.today().isoformat()}; {machine()}; {versions()}; {load_average()}")
    print(f"lockstep in one thread, {args.rounds} round(s) per driver, fp32, each task's default config (bench/overhead.py's "
          f"model and step); median over {WINDOW}-step windows of the ratio to the bare loop over the same steps [ratio "
          f"of total times]; noise guard {args.noise} cores{' (quick: a smoke run, not a measurement)' if args.quick else ''}",
          flush=True)
    results, headers = {}, []
    for name in args.models:
        steps, warmup = (QUICK_STEPS if args.quick else STEPS)[name]
        steps, warmup = args.steps or steps, args.warmup or warmup
        s = Setup(name, args.quick, warmup + steps + 1)
        params = sum(p.numel() for p in s.task.model.parameters())
        print(f"{name}: {params / 1e6:.2f}M params, batch {s.cfg.train.batch_size}, {steps} timed steps after {warmup}",
              flush=True)
        results[name] = r = measure(s, contenders, args.rounds, warmup, steps, args.noise, args.redo)
        headers.append(f"{name} {params / 1e6:.2f}M params, b{s.cfg.train.batch_size} "
                       f"({statistics.median(r['step_s']['bare']) * 1e3:.2f} ms/step bare)")
    print()
    print("| step time vs bare loop | " + " | ".join(headers) + " |")
    print("|---|" + "---|" * len(args.models))
    for c in contenders:
        cells = [f"{statistics.median(results[n]['ratios'][c]):.3f} [{results[n]['total_ratio'][c]:.3f}]"
                 for n in args.models]
        label = f"{c} (vs {BASELINE[c]})" if c in BASELINE else c
        print(f"| {label} | " + " | ".join(cells) + " |")
    for name in args.models:
        r = results[name]
        spread = ", ".join(f"{c} {q[0]:.3f}-{q[2]:.3f}" for c in contenders if c != "bare"
                           for q in [statistics.quantiles(r["ratios"][c], n=4) if len(r["ratios"][c]) > 1
                                     else [r["ratios"][c][0]] * 3])
        print(f"{name}: window-ratio quartiles {spread}; {r['redone']} round(s) redone for noise, {r['noisy']} kept "
              f"although noisy  [{load_average()}]")


if __name__ == "__main__":
    main()
