"""How early the precursor warns, and how often it warns on runs that stay healthy (guard.precursor).

The precursor (stabletrain.policies.precursor) compares each layer's update/weight ratio at every log
interval's last step with its own recent history and writes a ``precursor`` event when a layer departs.
This script trains real runs through the Trainer, each into its own run directory, and reads the
events back (events.jsonl: ``precursor``, ``spike``, ``nonfinite``), so it measures the product path.

(a) Lead time, on runs constructed to spike or diverge (a run stops at the first log boundary whose
    interval holds a spike by the guard's rule or a non-finite step):
      gpt-warmup   the default gpt, LR warmed up over 300 steps towards 1.0, no clipping, no weight decay
      mlp-gelu     the mlp with GELU, Adam warmed up over 1000 steps towards 0.2 and 1.0, no clipping or
                   weight decay: after a while it dies and revives, and spikes
      regression   a tanh MLP regression (8-32-1, batch 8), Adam warmed up over 400 steps towards 0.3 and 1.0
      outlier      the default mlp with one planted batch whose inputs are 1000x (step 150): a bad batch
                   comes from the data, not the state, so nothing can see it coming
    first_bad = the first spike or non-finite step; lead = first_bad - the step of the last precursor
    before it; "warned" when that lead is at most --horizon steps (5 log intervals by default: an older
    warning is counted with the run's earlier warnings, not as this spike's).
(b) False alarms per 10,000 steps on healthy runs (the precursor's; the spike rule's on the same runs are
    counted too): the default gpt (300 steps, and 2000) and the default mlp
    (300 steps, and 3000), several seeds each, with every default (log.every=10, the guard's precursor keys);
    only validation, checkpoints and incident capture are off (none touches what the precursor reads).

    flock -x /tmp/stabletrain-cpu.lock python bench/precursor.py        # ~10 min on 2 CPU cores
    python bench/precursor.py --quick                                     # smoke run, not a measurement
    python bench/precursor.py --set guard.precursor_zscore=2.5            # other precursor settings
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain import Task, Trainer, load_config, resolve_task
from stabletrain.callbacks import Callback, RunState

FAST = ["log.progress=false", "log.tensorboard=false", "eval.every=0", "ckpt.every=0", "capture.incidents=false"]
QUICK_GPT = ["task_args.n_layer=2", "task_args.n_embd=64", "task_args.seq_len=64", "task_args.max_bytes=300000"]


class StopAtFirstBad(Callback):
    """Stop the run at the first log boundary whose interval holds a spike or a non-finite step."""

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        if any(r.values["spike"] > 0.5 or r.values["finite"] < 0.5 for r in rows):
            state.stop_reason = "bench: the first spike or non-finite step"


def regression_task(seed: int) -> Task:
    """y = tanh(x @ w) + noise, a tanh MLP (8-32-1), a scalar-mean MSE."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)) + 0.05 * torch.randn(512, 1, generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=lambda m, b: F.mse_loss(m(b[0]), b[1]),
                name="regression")


def outlier_task(seed: int, step: int = 150, scale: float = 1000.0) -> Task:
    """The default mlp whose batch at ``step`` (batch 16, no shuffle) has its inputs ``scale`` times too large."""
    torch.manual_seed(seed)
    task = resolve_task("mlp", {})
    x, y = (t.clone() for t in task.train_data.tensors)
    x[16 * (step - 1):16 * step] *= scale
    task.train_data = TensorDataset(x, y)
    return task


def run(task: str | Callable[[], Task], overrides: list[str], *, stop: bool) -> dict[str, Any]:
    """Train one run into a temporary run directory; return its steps, precursor steps and first bad step.

    ``task``: a built-in task's name, or a function returning the Task (made here, just before its run)."""
    cfg = load_config(None, [f"task={task if isinstance(task, str) else 'mlp'}", *FAST, *overrides])
    task = task if isinstance(task, str) else task()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trainer = Trainer(cfg, task=task if isinstance(task, Task) else None, run_dir=Path(tmp) / "run",
                          callbacks=[StopAtFirstBad()] if stop else ())
        with contextlib.redirect_stdout(io.StringIO()):  # the precursor's console lines
            trainer.fit()
        events = [json.loads(line) for line in (Path(tmp) / "run" / "events.jsonl").read_text().splitlines()]
    warned = [e["step"] for e in events if e["kind"] == "precursor"]
    bad = min((e["step"] for e in events if e["kind"] in ("spike", "nonfinite")), default=None)
    layers = [e["layers"][0]["name"] for e in events if e["kind"] == "precursor"]
    spikes = [e["step"] for e in events if e["kind"] == "spike"]
    return {"steps": trainer.step, "warned": warned, "first_bad": bad, "layers": layers, "spikes": spikes,
            "seconds": time.perf_counter() - t0}


def lead(result: dict[str, Any], horizon: int) -> tuple[int | None, int]:
    """(the lead of the last warning before the first bad step if within ``horizon``, else None; earlier warnings)."""
    before = [s for s in result["warned"] if result["first_bad"] is not None and s < result["first_bad"]]
    if before and result["first_bad"] - before[-1] <= horizon:
        return result["first_bad"] - before[-1], len(before) - 1
    return None, len(before)


def scenarios(args: argparse.Namespace) -> list[tuple[str, str | Callable[[], Task], list[str]]]:
    """(scenario, task, overrides) for each constructed failing run."""
    seeds = range(args.seeds)
    gpt = QUICK_GPT if args.quick else []
    nowd = ["clip.max_norm=null", "optim.weight_decay=0", "sched.decay=constant"]
    out: list[tuple[str, str | Callable[[], Task], list[str]]] = []
    out += [("gpt-warmup", "gpt", [*gpt, *nowd, "optim.lr=1.0", "sched.warmup_steps=300", "train.max_steps=300",
                                   f"seed={s}"]) for s in range(min(args.seeds, args.gpt_seeds))]
    out += [("mlp-gelu", "mlp", [*nowd, "task_args.activation=gelu", f"optim.lr={lr}", "sched.warmup_steps=1000",
                                 "train.max_steps=1500", f"seed={s}"]) for lr in (0.2, 1.0) for s in seeds]
    out += [("regression", functools.partial(regression_task, s), ["train.batch_size=8", "sched.decay=constant", f"optim.lr={lr}",
                                                "sched.warmup_steps=400", "train.max_steps=800", f"seed={s}"])
            for lr in (0.3, 1.0) for s in seeds]
    out += [("outlier", functools.partial(outlier_task, s), ["data.shuffle=false", "train.max_steps=300", f"seed={s}"])
            for s in seeds]
    return out


def healthy(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    gpt = QUICK_GPT if args.quick else []
    out = [("gpt 300", "gpt", [*gpt, f"seed={s}"]) for s in range(args.gpt_seeds)]
    out += [(f"gpt {args.gpt_steps}", "gpt", [*gpt, f"train.max_steps={args.gpt_steps}", f"seed={s}"])
            for s in range(args.gpt_long_seeds)]
    out += [("mlp 300", "mlp", [f"seed={s}"]) for s in range(args.mlp_seeds)]
    out += [(f"mlp {args.mlp_steps}", "mlp", [f"train.max_steps={args.mlp_steps}", f"seed={s}"])
            for s in range(args.seeds)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5, help="seeds per constructed scenario and long mlp runs")
    parser.add_argument("--gpt-seeds", type=int, default=3, help="seeds of the gpt runs (healthy and gpt-warmup)")
    parser.add_argument("--gpt-steps", type=int, default=2000, help="steps of the long healthy gpt runs")
    parser.add_argument("--gpt-long-seeds", type=int, default=2, help="seeds of the long healthy gpt runs")
    parser.add_argument("--mlp-seeds", type=int, default=10, help="seeds of the default (300-step) mlp runs")
    parser.add_argument("--mlp-steps", type=int, default=3000, help="steps of the long healthy mlp runs")
    parser.add_argument("--horizon", type=int, default=50, help="a warning counts for a spike at most this many steps before it")
    parser.add_argument("--set", nargs="*", default=[], help="config overrides for every run (e.g. guard.precursor_zscore=2.5)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a smaller gpt, 2 seeds (not a measurement)")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.gpt_seeds, args.mlp_seeds, args.mlp_steps, args.gpt_steps, args.gpt_long_seeds = 2, 1, 2, 600, 400, 1
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    print(f"bench/precursor.py: torch {torch.__version__}, {torch.get_num_threads()} thread(s), "
          f"{load_average()} at start{' (--quick: not a measurement)' if args.quick else ''}")

    print(f"\n(a) lead time on runs that go on to spike or diverge (warned: a precursor at most {args.horizon} steps "
          "before the first spike or non-finite step)")
    by_scenario: dict[str, list[tuple[dict[str, Any], int | None, int]]] = {}
    for name, task, overrides in scenarios(args):
        result = run(task, [*overrides, *args.set], stop=True)
        got, earlier = lead(result, args.horizon)
        by_scenario.setdefault(name, []).append((result, got, earlier))
        print(f"  {name:11s} {' '.join(o for o in overrides if o.startswith(('seed', 'optim.lr'))):22s} first bad "
              f"{result['first_bad']!s:>5s}  precursors {result['warned'][:6]}{'...' if len(result['warned']) > 6 else ''}"
              f"  lead {got!s:>4s}  ({result['seconds']:.0f} s)", flush=True)
    print(f"\n  {'scenario':11s} {'runs':>4s} {'spiked':>6s} {'warned':>6s} {'lead (median, range)':>22s} "
          f"{'earlier warnings /10k steps':>28s}")
    all_leads: list[int] = []
    spiked_total = warned_total = 0
    for name, results in by_scenario.items():
        spiked = [(r, g, e) for r, g, e in results if r["first_bad"] is not None]
        leads = sorted(g for _, g, _ in spiked if g is not None)
        steps = sum(r["first_bad"] for r, _, _ in spiked)
        earlier = sum(e for _, _, e in spiked)
        all_leads += leads
        spiked_total, warned_total = spiked_total + len(spiked), warned_total + len(leads)
        shown = f"{statistics.median(leads):.0f} ({leads[0]}-{leads[-1]})" if leads else "-"
        print(f"  {name:11s} {len(results):4d} {len(spiked):6d} {len(leads):6d} {shown:>22s} "
              f"{(1e4 * earlier / steps if steps else 0):28.1f}")
    shown = f"{statistics.median(all_leads):.0f} steps" if all_leads else "-"
    print(f"  all: {warned_total} of {spiked_total} runs that spiked were warned; median lead {shown}")

    print("\n(b) false alarms on healthy runs (every default; validation, checkpoints and incident capture off)")
    totals: dict[str, list[int]] = {}
    for name, task, overrides in healthy(args):
        result = run(task, [*overrides, *args.set], stop=False)
        t = totals.setdefault(name, [0, 0, 0, 0])
        t[0], t[1], t[2] = t[0] + 1, t[1] + result["steps"], t[2] + len(result["warned"])
        t[3] += len(result["spikes"])
        print(f"  {name:9s} {overrides[-1]:8s} steps {result['steps']:5d}  precursors {result['warned']} "
              f"{result['layers']}  spikes {result['spikes']}  ({result['seconds']:.0f} s)", flush=True)
    steps = sum(t[1] for t in totals.values())
    alarms = sum(t[2] for t in totals.values())
    for name, (runs, n, k, _) in totals.items():
        print(f"  {name:9s} {runs:2d} runs, {n:6d} steps, {k} false alarms = {1e4 * k / n:.2f} per 10,000 steps")
    print(f"  the spike rule on the same healthy runs: {sum(t[3] for t in totals.values())} spikes in {steps} steps")
    bound = f" (none seen: fewer than {3e4 / steps:.1f} per 10,000 steps at 95% confidence)" if not alarms else ""
    print(f"  all healthy: {alarms} false alarms in {steps} steps = {1e4 * alarms / steps:.2f} per 10,000 steps{bound}")
    print(f"\n{load_average()} at the end")


def load_average() -> str:
    try:
        return "load average " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:  # pragma: no cover - not on every platform
        return "load average n/a"


if __name__ == "__main__":
    sys.exit(main())
