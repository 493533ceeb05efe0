"""Overhead of the built-in loop against a hand-written bare PyTorch loop.

Both train the same model from the same init on the same data with the same fused AdamW, the same
LR schedule shape and global-norm clipping; the built-in loop runs with its default monitoring
(device-side metrics, metrics.jsonl, TensorBoard, progress bar, events). Rounds are interleaved
(bare, built-in, bare, ...) and the median per-step time of each is compared.

    python bench/overhead.py                 # gpt and mlp, 5 rounds each
    python bench/overhead.py --tasks gpt --rounds 7 --steps 40
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from stabletrain import Trainer, load_config, resolve_task
from stabletrain.accumulation import as_sum_count

STEPS = {"gpt": 30, "mlp": 300}


def bare_loop(task, model, cfg, steps: int) -> float:
    """A plain nanoGPT-style loop: zero_grad, forward, backward, clip, step, schedule. Returns seconds."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), fused=True)
    warm, total = cfg.sched.warmup_steps, cfg.train.max_steps

    def factor(n):
        w = min((n + 1) / warm, 1.0) if warm else 1.0
        p = min(max((n - warm) / max(total - warm, 1), 0.0), 1.0)
        return w * (cfg.sched.min_lr_ratio + (1 - cfg.sched.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(task.train_data, batch_size=cfg.train.batch_size, shuffle=True, generator=g,
                        collate_fn=task.collate or torch.utils.data.default_collate)
    it = iter(loader)
    model.train()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        try:
            batch = next(it)
        except StopIteration:
            it = iter(loader)
            batch = next(it)
        loss_sum, count = as_sum_count(task.loss(model, batch), cfg.train.batch_size)
        (loss_sum / count).backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.clip.max_norm)
        opt.step()
        sched.step()
    return time.perf_counter() - t0


def builtin_loop(task, model, cfg, steps: int, tmp: Path, i: int) -> float:
    run_task = copy.copy(task)
    run_task.model = model
    run_task.val_data = None  # validation is not part of the comparison
    trainer = Trainer(cfg, task=run_task, run_dir=tmp / f"run{i}")
    t0 = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - t0


def measure(name: str, rounds: int, steps: int) -> dict[str, float]:
    # One-time imports (TensorBoard writer, tqdm) are process start-up, not per-step overhead.
    import torch.utils.tensorboard  # noqa: F401
    import tqdm.auto  # noqa: F401

    cfg = load_config(None, [f"task={name}", f"train.max_steps={steps}", "run.overwrite=true"])
    task = resolve_task(cfg.task, cfg.task_args)
    init = copy.deepcopy(task.model.state_dict())
    bare, built = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(rounds):
            for variant in ("bare", "builtin"):
                torch.manual_seed(0)
                model = copy.deepcopy(task.model)
                model.load_state_dict(init)
                if variant == "bare":
                    bare.append(bare_loop(task, model, cfg, steps) / steps)
                else:
                    built.append(builtin_loop(task, model, cfg, steps, Path(tmp), i) / steps)
    b, s = statistics.median(bare), statistics.median(built)
    return {"bare_ms": b * 1e3, "builtin_ms": s * 1e3, "ratio": s / b}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", default="gpt,mlp")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=0, help="steps per round (default: gpt 30, mlp 300)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.rounds} interleaved rounds", flush=True)
    for name in args.tasks.split(","):
        r = measure(name, args.rounds, args.steps or STEPS[name])
        target = "  (target <= 1.03)" if name == "gpt" else ""
        print(f"{name}: median step bare {r['bare_ms']:.2f} ms, built-in {r['builtin_ms']:.2f} ms, "
              f"ratio {r['ratio']:.3f}{target}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
