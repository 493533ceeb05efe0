"""DDP vs FSDP2 at 2 processes: training-state memory and peak memory per rank, and samples/s.

Each strategy trains the built-in ``gpt`` task under torchrun (gloo on CPU, NCCL on CUDA), sized so
that parameters, gradients and AdamW state (16 bytes per parameter under DDP; under FSDP2 each of 2
ranks holds about half) dominate. Each rank runs ``Trainer.fit()`` with no run directory (no checkpoint
gathers the full state onto rank 0) and reports:

- ``state MiB``: the bytes of this rank's parameters, gradients and optimizer state after the last
  step (local shards under FSDP2): what sharding divides;
- ``peak MiB``: CUDA max allocated on a GPU; on CPU the process's peak RSS, which also holds the
  Python runtime, the data, and the whole model as the task built it before it was sharded;
- ``samples/s``: global, over the timed steps (after one warm-up step).

    python bench/fsdp.py                    # n_embd 512, 8 layers (~25M parameters); about a minute on 2 cores
    python bench/fsdp.py --quick            # smoke run: a small model, not a measurement

Not measured yet: the per-step overhead against a hand-written FSDP2 loop (issue 15, target <= 1.05).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def worker(args: argparse.Namespace) -> None:
    """One rank: train, then write this rank's figures to ``args.out/rank_R.json``."""
    import time

    import torch

    from stabletrain import Trainer, load_config
    from stabletrain.distributed import process_group
    from stabletrain.metrics import peak_memory_mib

    overrides = ["task=gpt", f"task_args.n_layer={args.layers}", f"task_args.n_embd={args.width}", "task_args.n_head=8",
                 f"task_args.seq_len={args.seq}", "task_args.max_bytes=400000", f"train.batch_size={args.batch}",
                 f"train.max_steps={args.steps}", f"log.every={args.steps}", "eval.every=0", "log.progress=false",
                 "log.tensorboard=false", "guard.capture=false", f"dist.strategy={args.strategy}"]
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


def run(strategy: str, args: argparse.Namespace, root: Path) -> list[dict[str, float]]:
    out = root / strategy
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__, "--worker",
           "--strategy", strategy, "--out", str(out), "--width", str(args.width), "--layers", str(args.layers),
           "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps)]
    res = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"{strategy} failed:\n{res.stderr[-3000:]}")
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in (0, 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=2, help="samples per rank per micro-batch")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--strategy", default="ddp", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.quick:
        args.width, args.layers, args.steps = 64, 2, 4
    params = 12 * args.layers * args.width ** 2 + 256 * args.width  # blocks + tied embedding (approximately)
    print(f"gpt: {args.layers} layers x {args.width} wide (~{params / 1e6:.1f}M parameters), 2 processes, "
          f"{args.batch} samples x {args.seq} bytes per rank per step, {args.steps} steps (1 warm-up)")
    with tempfile.TemporaryDirectory() as tmp:
        rows = {s: run(s, args, Path(tmp)) for s in ("ddp", "fsdp")}
    print(f"{'strategy':<10}{'rank':>5}{'state MiB':>11}{'peak MiB':>10}{'samples/s':>11}{'loss':>9}")
    for strategy, ranks in rows.items():
        for r, row in enumerate(ranks):
            print(f"{strategy:<10}{r:>5}{row['state_mib']:>11.0f}{row['peak_mib']:>10.0f}{row['samples_per_s']:>11.1f}"
                  f"{row['loss']:>9.4f}")


if __name__ == "__main__":
    main()
