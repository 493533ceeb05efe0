"""DDP throughput: samples/s of 1 vs 2 processes, and the built-in loop against a hand-written DDP loop.

For each task (``mlp``, ``gpt``) and each world size (1, 2) the same global batch is trained
(``--batch`` samples per micro-batch over all processes, ``--accum`` micro-batches per step):
1 process with the whole micro-batch (on every core as threads, ``1``, and on one thread, ``1x1t``),
or 2 under torchrun (gloo, one thread each) with half each. On a shared machine the threaded single
process is the noisiest row: its OpenMP barriers stall whenever another process takes a core. Each worker runs
``Trainer.fit()`` (DDP, monitoring on: device metrics, the sentinel, the per-interval
gather, metrics.jsonl, events.jsonl, TensorBoard) and, in lockstep beside each built-in step, one step
of a hand-written DDP loop on its own copy of the model (nanoGPT-style: ``no_sync`` on all but the
last micro-batch, mean loss / k, ``clip_grad_norm_``, fused AdamW, a DistributedSampler; DDP's defaults,
or with ``--bare-bucket-view`` the gradients as views into DDP's buckets as stabletrain builds its DDP). A callback
(``overhead.Lockstep``) runs the bare step in every ``on_step_end``, between two built-in steps, and its
time is taken off the built-in clock, so load from other processes on this shared machine hits both alike.

Under DDP a step of the built-in loop has one collective, as the bare loop's: the window's loss and
item count ride DDP's own gradient all-reduce as the gradient of a small parameter registered with DDP
(stabletrain.distributed.carrier.data_parallel). Target: the ``ratio`` column at most 1.05 on gpt at 2 processes.

``ratio``: the median, over every log interval of every round, of the built-in time over the bare
steps' time in the same interval (as bench/overhead.py): a stall of another process on this shared
machine spoils one interval, not the whole round; ``whole`` is the ratio of the whole timed windows
(median over rounds), stalls included. Timed: the task's steps after its warm-up (gpt: 60 steps after 10;
20 steps were too few: one stall of
another process moved a round's ratio by 0.05); a multiple of log.every (10), so the built-in time holds
its log intervals. Not timed: setup, the step-0 and final checkpoints. samples/s are global (all ranks).
``ms/step`` is the built-in loop's extra wall time per optimizer step: its per-step host work (sentinel,
metrics rows, clipping, schedule) is about constant, so it weighs more as DDP halves each rank's compute.

    python bench/ddp.py                      # mlp and gpt, 1 and 2 processes; about 2-3 minutes on 2 cores
    python bench/ddp.py --tasks mlp --rounds 3
    python bench/ddp.py --tasks mlp --quick  # smoke run: 1 round of 20 timed steps, not a measurement
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

TASKS = {
    # task, task_args, global micro-batch, accum, warmup, timed steps
    "mlp": ("mlp", [], 64, 2, 10, 100),
    "gpt": ("gpt", ["task_args.n_layer=2", "task_args.seq_len=64", "task_args.max_bytes=1000000"], 8, 2, 10, 60),
}


class BareDDP:
    """A hand-written DDP step: no_sync on all but the last micro-batch, mean/k, clip, fused AdamW.

    The AdamW is the config's, with weight decay on matrices only (two parameter groups), as the
    Trainer builds it and as nanoGPT's loop does: the same optimizer work on both sides.
    """

    def __init__(self, task: Any, module: torch.nn.Module, cfg: Any, rank: int, world: int, bucket_view: bool = False) -> None:
        self.task, self.k, self.max_norm = task, cfg.accum.steps, cfg.clip.max_norm
        self.model = (torch.nn.parallel.DistributedDataParallel(module, gradient_as_bucket_view=bucket_view)
                      if world > 1 else module)
        from overhead import param_groups  # bench/ is the script's directory

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        # The config's AdamW with decay on matrices only, as the Trainer builds it (and bench/overhead.py's loop).
        self.opt = torch.optim.AdamW(param_groups(named, cfg.optim.weight_decay), lr=cfg.optim.lr,
                                     betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps, fused=True)
        sampler = DistributedSampler(task.train_data, num_replicas=world, rank=rank, shuffle=True, seed=0)
        self.loader = DataLoader(task.train_data, batch_size=cfg.train.batch_size, sampler=sampler, drop_last=True,
                                 collate_fn=task.collate or torch.utils.data.default_collate)
        self.sampler, self.epoch = sampler, 0
        self.it = iter(self.loader)

    def _next(self) -> Any:
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            self.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
            return next(self.it)

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        for i in range(self.k):
            batch = self._next()
            sync = i == self.k - 1 or not hasattr(self.model, "no_sync")
            with contextlib.nullcontext() if sync else self.model.no_sync():
                out = self.task.loss(self.model, batch)
                loss = out[0] / out[1] if isinstance(out, tuple) else out
                (loss / self.k).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.opt.step()


def worker(args: argparse.Namespace) -> None:
    """One process of a measurement (under torchrun for 2): write rank 0's timings as JSON."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from overhead import Lockstep  # bench/ is the script's directory

    from stabletrain import Trainer, load_config, resolve_task
    from stabletrain.distributed.group import process_group

    name, task_args, global_batch, accum, warmup, steps = TASKS[args.task]
    if args.steps:  # --quick
        warmup, steps = 5, args.steps
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_config(None, [f"task={name}", *task_args, f"train.batch_size={global_batch // world}", f"accum.steps={accum}",
                             f"train.max_steps={warmup + steps + 1}", "log.every=10", "ckpt.every=0", "eval.every=0",
                             "log.progress=false", "sched.warmup_steps=0"])
    with process_group(cfg.dist.backend, cfg.dist.timeout_s) as ctx, tempfile.TemporaryDirectory() as tmp:
        task = resolve_task(cfg.task, cfg.task_args)
        task.val_data = None  # the bare loop has no validation
        bare = BareDDP(task, copy.deepcopy(task.model), cfg, ctx.rank, ctx.world, args.bare_bucket_view)
        clock = Lockstep({"bare": bare})  # one bare step in each on_step_end; checkpoints off the clock
        trainer = Trainer(cfg, task=task, run_dir=Path(tmp) / "run", callbacks=[clock])
        trainer.fit()
        entries, bare_s = clock.entries, clock.bare_s["bare"]
        if ctx.is_main:
            samples = global_batch * accum * steps
            built_in = entries[warmup + steps] - entries[warmup]
            bare_time = sum(bare_s[warmup:warmup + steps])
            every = cfg.log.every  # per log interval: built-in time over the bare steps' time beside it
            intervals = [(entries[warmup + j + every] - entries[warmup + j]) / sum(bare_s[warmup + j:warmup + j + every])
                         for j in range(0, steps, every)]
            Path(args.out).write_text(json.dumps({"world": ctx.world, "built_in_s": built_in, "bare_s": bare_time,
                                                  "samples": samples, "steps": steps, "intervals": intervals}))


def measure(task: str, nproc: int, out: Path, threads: int | None = None, steps: int = 0,
            bucket_view: bool = False) -> dict[str, Any]:
    me = [str(Path(__file__).resolve()), "--worker", "--task", task, "--out", str(out), "--steps", str(steps),
          *(["--bare-bucket-view"] if bucket_view else [])]
    if nproc == 1:
        cmd = [sys.executable, *me]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads or os.cpu_count() or 1)}
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *me]
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--rounds", type=int, default=2, help="measurements per (task, world size); the median is shown")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 20 timed steps (not a measurement)")
    parser.add_argument("--bare-bucket-view", action="store_true",
                        help="build the bare loop's DDP with gradient_as_bucket_view=True, as stabletrain builds its own "
                             "(default: DDP's defaults, as a hand-written loop usually has them)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.quick:
        args.rounds, quick_steps = 1, 20
    else:
        quick_steps = 0
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores, gloo; load average "
          f"{', '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'task':<5} {'procs':>5} {'global batch':>12} {'bare DDP samples/s':>19} {'stabletrain samples/s':>22} "
          f"{'ratio':>6} {'overhead':>9} {'whole':>6} {'ms/step':>8}")
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            _, _, global_batch, accum, _, _ = TASKS[task]
            rows = {}
            # 1 process with every core as threads, 1 process on one thread (the per-core baseline), 2 processes.
            for label, nproc, threads in (("1", 1, None), ("1x1t", 1, 1), ("2", 2, None)):
                runs = [measure(task, nproc, Path(tmp) / f"{task}-{label}-{r}.json", threads, quick_steps,
                                args.bare_bucket_view) for r in range(args.rounds)]
                bare = statistics.median(r["samples"] / r["bare_s"] for r in runs)
                ours = statistics.median(r["samples"] / r["built_in_s"] for r in runs)
                ratio = statistics.median(x for r in runs for x in r["intervals"])
                over = ratio - 1
                whole = statistics.median(r["built_in_s"] / r["bare_s"] for r in runs)  # stalls included
                per_step_ms = statistics.median((r["built_in_s"] - r["bare_s"]) / r["steps"] * 1e3 for r in runs)
                rows[label] = (bare, ours)
                target = "  (target <= 1.05)" if task == "gpt" and label == "2" else ""
                print(f"{task:<5} {label:>5} {f'{global_batch}x{accum}':>12} {bare:>19.0f} {ours:>22.0f} {ratio:>6.3f} "
                      f"{over:>+8.1%} {whole:>6.3f} {per_step_ms:>+8.2f}{target}", flush=True)
            print(f"{task:<5} 2 processes vs 1 (all cores as threads): bare {rows['2'][0] / rows['1'][0]:.2f}x, stabletrain "
                  f"{rows['2'][1] / rows['1'][1]:.2f}x; vs 1 on one thread: bare {rows['2'][0] / rows['1x1t'][0]:.2f}x, "
                  f"stabletrain {rows['2'][1] / rows['1x1t'][1]:.2f}x")


if __name__ == "__main__":
    main()
