"""FSDP2 at 2 processes: DDP vs FSDP2 memory and samples/s, and the Trainer's step against a hand-written FSDP2 loop.

Both parts train the built-in ``gpt`` task under torchrun (gloo on CPU, NCCL on CUDA), sized so that
parameters, gradients and AdamW state (16 bytes per parameter under DDP; under FSDP2 each of 2 ranks
holds about half) dominate.

**memory** (one torchrun job per strategy): each rank runs ``Trainer.fit()`` with no run directory (no
checkpoint gathers the full state onto rank 0) and reports:

- ``state MiB``: the bytes of this rank's parameters, gradients and optimizer state after the last
  step (local shards under FSDP2): what sharding divides;
- ``peak MiB``: CUDA max allocated on a GPU; on CPU the process's peak RSS, which also holds the
  Python runtime, the data, and the whole model as the task built it before it was sharded;
- ``samples/s``: global, over the timed steps (after one warm-up step).

**overhead** (one torchrun job): stabletrain's ``Trainer`` with ``dist.strategy=fsdp``, no run
directory and its monitoring at the defaults (the sentinel, device metrics, the post-update check, the
per-interval reduce, the LR schedule, and the incident snapshot at each interval where FSDP supports
capture) against a hand-written FSDP2 loop (:class:`BareFSDP`): ``fully_shard`` on each transformer
block and then the root, with torch's defaults; ``zero_grad``, forward, ``loss_sum / count``,
backward, ``clip_grad_norm_(1.0)``, and AdamW built as the Trainer builds it
(``optim.build_optimizer``: fused on CPU and CUDA, weight decay on matrices only). fp32, the same
initialization (rank 0's, as the Trainer broadcasts it), and the same pre-built batches: the Trainer
reads them through its own data path (``data.shuffle=false``; sample ``i`` is its index and the
collate hands over micro-batch ``i // batch``), the bare loop takes the same micro-batch at the same
step on the same rank. The schedule is constant (no warm-up) so both compute the same update: after
each round the two models' shards are compared, and a difference above ``--tolerance`` fails the
run (the loops would not be doing the same work, and their times would not compare).

Each round builds both afresh and runs them in lockstep (``overhead.lockstep_round``: one bare step
in every ``on_step_end``, between two Trainer steps, its time taken off the Trainer's clock), so a
burst of load from another process hits both alike. A round's ratio is the Trainer's time over the
bare loop's over the ``--timed-steps`` steps after ``--warmup`` (whole log intervals, so the
interval's one sync is in it); the table shows the median of the per-round ratios (target: <= 1.05).
On CUDA each loop waits for the device once per step (:func:`cuda_sync_callback`), so both times hold
their kernels.
Noise guard, as in bench/frameworks.py (its ``CpuWatch``): a round during which other processes (not
the two ranks) used more than ``--noise`` of one core is run again, up to ``--redo`` times; the rounds
redone and those kept although noisy are counted. ``collectives per step``: what one steady-state step
of each loop issues (counted after the rounds from the profiler's ``c10d::`` ops, so FSDP2's
all-gathers and reduce-scatters and every all-reduce count, a DTensor's included).

    python bench/fsdp.py                     # n_embd 512, 8 layers (~25M parameters); several minutes on 2 cores
    python bench/fsdp.py --parts overhead --rounds 7
    python bench/fsdp.py --quick             # smoke run: a small model, not a measurement
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch

LOG_EVERY = 10  # the Trainer's log interval in the overhead part: --timed-steps is a multiple of it
NUM_BATCHES = 8  # distinct pre-built global micro-batches, cycled (one epoch of the Trainer's data)


def gpt_overrides(args: argparse.Namespace) -> list[str]:
    """The model and batch of both parts; no validation, no console output."""
    return ["task=gpt", f"task_args.n_layer={args.layers}", f"task_args.n_embd={args.width}", "task_args.n_head=8",
            f"task_args.seq_len={args.seq}", "task_args.max_bytes=400000", f"train.batch_size={args.batch}",
            "eval.every=0", "log.progress=false", "log.tensorboard=false"]


# -- memory: DDP vs FSDP2 -----------------------------------------------------------------------------


def memory_worker(args: argparse.Namespace) -> None:
    """One rank: train, then write this rank's figures to ``args.out/rank_R.json``."""
    import time

    from stabletrain import Trainer, load_config
    from stabletrain.distributed.group import process_group
    from stabletrain.policies.metrics import peak_memory_mib

    overrides = [*gpt_overrides(args), f"train.max_steps={args.steps}", f"log.every={args.steps}",
                 f"dist.strategy={args.strategy}", "capture.incidents=false"]
    with process_group("auto") as ctx:
        trainer = Trainer(load_config(None, overrides))
        trainer.cfg.train.max_steps = 1  # warm-up step, not timed
        trainer.fit()
        trainer.cfg.train.max_steps = args.steps
        start = time.perf_counter()
        trainer.fit()
        seconds = time.perf_counter() - start

        def local_bytes(t: torch.Tensor) -> int:
            t = getattr(t, "_local_tensor", t)
            return t.numel() * t.element_size()

        state = sum(local_bytes(p) + (local_bytes(p.grad) if p.grad is not None else 0) for p in trainer.params)
        state += sum(local_bytes(v) for st in trainer.optimizer.state.values() for v in st.values()
                     if isinstance(v, torch.Tensor))
        row = {"state_mib": state / 2**20, "peak_mib": peak_memory_mib(trainer.device),
               "samples_per_s": (args.steps - 1) * args.batch * ctx.world / seconds, "loss": trainer.history[-1]["loss"]}
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank_{ctx.rank}.json").write_text(json.dumps(row))


# -- overhead: the Trainer's FSDP2 step against a hand-written one --------------------------------------


class BareFSDP:
    """A hand-written FSDP2 loop, one step per call: the loop a user writes from the FSDP2 tutorial.

    ``fully_shard`` on each of the model's transformer blocks, then on the root (in place); AdamW from
    :func:`stabletrain.policies.optim.build_optimizer`, so its implementation (fused, foreach) is the Trainer's.
    ``batches[i]`` is this rank's micro-batch of step ``i`` (cycled).
    """

    def __init__(self, model: torch.nn.Module, loss: Any, batches: list[Any], cfg: Any, device: torch.device) -> None:
        from torch.distributed.fsdp import fully_shard

        from stabletrain.policies.optim import build_optimizer

        model.to(device)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        self.model, self.loss, self.batches, self.max_norm = model, loss, batches, cfg.clip.max_norm
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        self.opt = build_optimizer(named, cfg.optim, device)
        self.device, self.i = device, 0
        model.train()

    def step(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        x, y = (t.to(self.device, non_blocking=True) for t in self.batches[self.i % len(self.batches)])
        self.i += 1
        loss_sum, count = self.loss(self.model, (x, y))
        (loss_sum / count).backward()
        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)
        self.opt.step()
        if self.device.type == "cuda":  # the step's time includes its device work (see CudaSync)
            torch.cuda.synchronize(self.device)


def max_shard_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """The largest |difference| between two sharded models' parameters (local shards; max over the ranks)."""
    import torch.distributed as dist

    local = lambda t: getattr(t.detach(), "_local_tensor", t.detach())  # noqa: E731
    other = dict(b.named_parameters())
    diffs = [(local(p) - local(other[n])).abs().max() for n, p in a.named_parameters() if local(p).numel()]
    worst = torch.stack(diffs).max().float().cpu().reshape(1) if diffs else torch.zeros(1)
    if dist.is_initialized():
        worst = worst.to(local(next(a.parameters())).device)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


class CollectiveCounter:
    """Count the collectives issued while active, by kind, from the profiler's record of c10d's ops.

    Every collective reaches the process group through a ``c10d::`` op, whoever issues it:
    ``dist.all_reduce``, FSDP2's all-gathers and reduce-scatters, or a DTensor redistribution (through
    functional collectives), so the count does not depend on the Python API used. ``counts``: kind
    (``all_reduce``, ``all_gather``, ``reduce_scatter``, ...) -> calls, after the block.
    """

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def __enter__(self) -> CollectiveCounter:
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU])
        self.prof.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.prof.__exit__(*exc)
        for event in self.prof.events():
            if event.name.startswith("c10d::"):
                op = event.name[len("c10d::"):].strip("_").replace("_", "")  # _allgather_base_ -> allgatherbase
                kind = next((k for p, k in (("allreduce", "all_reduce"), ("allgather", "all_gather"),
                                            ("reducescatter", "reduce_scatter"), ("broadcast", "broadcast"))
                             if op.startswith(p)), op)
                self.counts[kind] = self.counts.get(kind, 0) + 1


def cuda_sync_callback() -> Any:
    """A callback that waits for the device at each ``on_step_end`` (before the lockstep clock reads it).

    On CUDA a step returns before its kernels finish; both loops' times must hold their device work,
    so each side waits once per step: this for the Trainer, :meth:`BareFSDP.step` for the bare loop.
    """
    from stabletrain.callbacks import Callback

    class CudaSync(Callback):
        def on_step_end(self, state: Any, out: Any) -> None:
            torch.cuda.synchronize(state.device)

    return CudaSync()


def cpu_seconds() -> float:
    """CPU seconds this process has used (user + system, its children included)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def prebuilt_task(model: torch.nn.Module, batches: list[Any], batch_size: int, loss: Any) -> Any:
    """A Task over ``model`` whose data path hands over the pre-built ``batches`` (sample i: micro-batch i // batch_size)."""
    from stabletrain import Task

    return Task(model=model, train_data=range(len(batches) * batch_size), loss=loss,
                collate=lambda items: batches[items[0] // batch_size], name="gpt", count_unit="tokens")


def overhead_worker(args: argparse.Namespace) -> None:
    """One rank of the overhead job: lockstep rounds of Trainer vs BareFSDP; rank 0 writes the figures as JSON."""
    import torch.distributed as dist
    from frameworks import CpuWatch  # bench/ is the script's directory
    from overhead import fresh_models, lockstep_round

    from stabletrain import Trainer, load_config, resolve_task
    from stabletrain.distributed.group import process_group
    from stabletrain.policies.precision import resolve_device

    warnings.filterwarnings("ignore", message="dist.strategy=fsdp: incident capture")  # where FSDP has none yet
    warmup, steps = args.warmup, args.timed_steps
    cfg = load_config(None, [*gpt_overrides(args), "dist.strategy=fsdp", "precision=fp32", "clip.max_norm=1.0",
                             "sched.warmup_steps=0", "sched.decay=constant", "data.shuffle=false", "ckpt.every=0",
                             f"log.every={LOG_EVERY}", f"train.max_steps={warmup + steps + 1}"])
    with process_group(cfg.dist.backend, cfg.dist.timeout_s) as ctx:
        device = resolve_device(cfg.device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())  # cuda:LOCAL_RANK (process_group set it)
        torch.manual_seed(cfg.seed)
        task = resolve_task(cfg.task, cfg.task_args)
        with torch.no_grad():  # both loops start from rank 0's initialization on every rank
            for t in task.model.state_dict().values():
                on_device = t.to(device)
                dist.broadcast(on_device, src=0)
                t.copy_(on_device)
        init = copy.deepcopy(task.model.state_dict())
        bs, world = cfg.train.batch_size, ctx.world
        # Global micro-batch b is micro-batches b * world .. b * world + world - 1; rank r takes the r-th.
        batches = [torch.utils.data.default_collate([task.train_data[i] for i in range(k * bs, (k + 1) * bs)])
                   for k in range(NUM_BATCHES * world)]
        mine = [batches[b * world + ctx.rank] for b in range(NUM_BATCHES)]

        def pair() -> tuple[Trainer, BareFSDP]:
            model, bare_model = fresh_models(task, init, 2)
            callbacks = [cuda_sync_callback()] if device.type == "cuda" else []
            trainer = Trainer(cfg, task=prebuilt_task(model, batches, bs, task.loss), run_dir=None, callbacks=callbacks)
            return trainer, BareFSDP(bare_model, task.loss, mine, cfg, trainer.device)

        rounds: list[dict[str, Any]] = []
        redone = noisy = 0
        for r in range(args.rounds):
            for attempt in range(args.redo + 1):
                trainer, bare = pair()
                own0 = cpu_seconds()
                with CpuWatch() as watch:
                    res = lockstep_round(trainer, bare, warmup, steps)
                own = cpu_seconds() - own0
                # Other processes' CPU use: the machine's busy time less both ranks' own (the peer is not noise).
                figures = torch.tensor([watch.others + own, own, watch.wall], dtype=torch.float64, device=device)
                dist.all_reduce(figures)
                others_cores = max(float((figures[0] / world - figures[1]) / (figures[2] / world)), 0.0)
                built_in, bare_s = sum(res["builtin"]), sum(res["bare"])
                row = {"ratio": built_in / bare_s, "builtin_ms": built_in / steps * 1e3, "bare_ms": bare_s / steps * 1e3,
                       "others_cores": others_cores, "max_diff": max_shard_difference(trainer.module, bare.model)}
                del trainer, bare
                if others_cores <= args.noise:
                    break
                if attempt < args.redo:
                    redone += 1
            else:
                noisy += 1
            rounds.append(row)
            if ctx.is_main:
                print(f"  round {r + 1}/{args.rounds}: bare {row['bare_ms']:.1f} ms/step, stabletrain "
                      f"{row['builtin_ms']:.1f} ms/step, ratio {row['ratio']:.3f}, max |shard difference| "
                      f"{row['max_diff']:.1e}  [others used {others_cores:.2f} cores]", flush=True)
        counts = count_collectives(*pair())
        if ctx.is_main:
            Path(args.out).write_text(json.dumps({"rounds": rounds, "redone": redone, "noisy": noisy,
                                                  "collectives": counts}))


def count_collectives(trainer: Any, bare: BareFSDP) -> dict[str, dict[str, int]]:
    """The collectives of one steady-state step of each loop, by kind (this rank's; every rank issues the same)."""
    for _ in range(2):  # past FSDP2's lazy init and the optimizers' state creation
        trainer.train_step(trainer.stream.next_window())
        bare.step()
    window = trainer.stream.next_window()
    with CollectiveCounter() as ours:
        trainer.train_step(window)
    with CollectiveCounter() as theirs:
        bare.step()
    return {"stabletrain": ours.counts, "bare": theirs.counts}


# -- launching and the tables -----------------------------------------------------------------------------


def torchrun(args: argparse.Namespace, worker: list[str], live: str | None = None) -> None:
    """Run this script's ``worker`` on 2 processes; print rank 0's lines that start with ``live`` as they come."""
    me = [str(Path(__file__).resolve()), "--width", str(args.width), "--layers", str(args.layers), "--seq",
          str(args.seq), "--batch", str(args.batch)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", *me, *worker]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            if live is not None and line.startswith(live):
                print(line, end="", flush=True)
        if proc.wait():
            err.seek(0)
            sys.exit(f"{' '.join(worker[:2])} failed:\n{err.read()[-3000:]}")


def memory(args: argparse.Namespace, root: Path) -> None:
    rows = {}
    for strategy in ("ddp", "fsdp"):
        out = root / strategy
        torchrun(args, ["--worker", "memory", "--strategy", strategy, "--out", str(out), "--steps", str(args.steps)])
        rows[strategy] = [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]
    print(f"\nmemory and throughput: {args.steps} steps (1 warm-up)")
    print(f"{'strategy':<10}{'rank':>5}{'state MiB':>11}{'peak MiB':>10}{'samples/s':>11}{'loss':>9}")
    for strategy, ranks in rows.items():
        for r, row in enumerate(ranks):
            print(f"{strategy:<10}{r:>5}{row['state_mib']:>11.0f}{row['peak_mib']:>10.0f}{row['samples_per_s']:>11.1f}"
                  f"{row['loss']:>9.4f}")


def overhead(args: argparse.Namespace, root: Path) -> int:
    """Run the overhead job, print its table; return 1 if the two loops did not compute the same update."""
    out = root / "overhead.json"
    print(f"\noverhead: {args.rounds} lockstep rounds x {args.timed_steps} timed steps (after {args.warmup}), fp32, "
          f"clip 1.0, AdamW as the Trainer builds it, the same pre-built batches; noise guard {args.noise} cores",
          flush=True)
    torchrun(args, ["--worker", "overhead", "--out", str(out), "--rounds", str(args.rounds), "--warmup", str(args.warmup),
                    "--timed-steps", str(args.timed_steps), "--noise", str(args.noise), "--redo", str(args.redo)],
             live="  round ")
    r = json.loads(out.read_text())
    rounds = r["rounds"]
    ratio = statistics.median(x["ratio"] for x in rounds)
    bare = statistics.median(x["bare_ms"] for x in rounds)
    ours = statistics.median(x["builtin_ms"] for x in rounds)
    extra = statistics.median(x["builtin_ms"] - x["bare_ms"] for x in rounds)
    diff = max(x["max_diff"] for x in rounds)
    samples = args.batch * 2  # per step, both ranks
    print(f"\n{'loop':<32}{'ms/step':>9}{'samples/s':>11}{'ratio':>8}")
    print(f"{'hand-written FSDP2 (BareFSDP)':<32}{bare:>9.1f}{samples / bare * 1e3:>11.1f}{1.0:>8.3f}")
    print(f"{'stabletrain Trainer, fsdp':<32}{ours:>9.1f}{samples / ours * 1e3:>11.1f}{ratio:>8.3f}  (target <= 1.05)")
    per_round = ", ".join(f"{x['ratio']:.3f}" for x in rounds)
    print(f"ratio: median over {len(rounds)} rounds of the per-round ratio ({per_round}); extra {extra:+.2f} ms/step; "
          f"{r['redone']} round(s) redone for noise, {r['noisy']} kept although noisy")
    counts = r["collectives"]
    kinds = sorted(set(counts["bare"]) | set(counts["stabletrain"]))
    print("collectives per step: " + "; ".join(f"{name} " + ", ".join(f"{k} {counts[name].get(k, 0)}" for k in kinds)
                                               for name in ("bare", "stabletrain")))
    print(f"same update: max |shard difference| after a round {diff:.1e} (tolerance {args.tolerance:g})")
    if not diff <= args.tolerance:
        print(f"FAIL: the two loops' parameters differ by {diff:.3e} > {args.tolerance:g}: they do not compute the "
              "same update, so their times do not compare")
        return 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["memory", "overhead"], choices=["memory", "overhead"])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="samples per rank per micro-batch")
    parser.add_argument("--steps", type=int, default=10, help="memory: steps per strategy (1 warm-up)")
    parser.add_argument("--rounds", type=int, default=5, help="overhead: lockstep rounds (the median is shown)")
    parser.add_argument("--warmup", type=int, default=3, help="overhead: untimed steps per round")
    parser.add_argument("--timed-steps", type=int, default=20,
                        help=f"overhead: timed steps per round, a multiple of the log interval ({LOG_EVERY})")
    parser.add_argument("--noise", type=float, default=0.1,
                        help="overhead: redo a round when other processes used more cores than this")
    parser.add_argument("--redo", type=int, default=2, help="overhead: redos of a noisy round before it is kept")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="overhead: largest |difference| of the two loops' parameters after a round")
    parser.add_argument("--quick", action="store_true", help="smoke run: a small model, 2 rounds, no redo (not a measurement)")
    parser.add_argument("--worker", choices=["memory", "overhead"], help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker == "memory":
        memory_worker(args)
        return 0
    if args.worker == "overhead":
        overhead_worker(args)
        return 0
    if args.quick:
        args.width, args.layers, args.steps = 64, 2, 4
        args.rounds, args.warmup, args.timed_steps, args.redo = 2, 2, LOG_EVERY, 0
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.timed_steps <= 0 or args.timed_steps % LOG_EVERY:
        parser.error(f"--timed-steps must be a positive multiple of the log interval ({LOG_EVERY}), got {args.timed_steps}")
    params = 12 * args.layers * args.width ** 2 + 256 * args.width  # blocks + tied embedding (approximately)
    print(f"gpt: {args.layers} layers x {args.width} wide (~{params / 1e6:.1f}M parameters), 2 processes, "
          f"{args.batch} samples x {args.seq} bytes per rank per step; torch {torch.__version__}, "
          f"{os.cpu_count()} CPU cores, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    status = 0
    with tempfile.TemporaryDirectory() as tmp:
        if "memory" in args.parts:
            memory(args, Path(tmp))
        if "overhead" in args.parts:
            status = overhead(args, Path(tmp))
    return status


if __name__ == "__main__":
    sys.exit(main())
