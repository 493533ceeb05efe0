"""GPU check (run on a CUDA machine, under 5 minutes): the default task in bf16 and fp16.

For each precision it trains the default ``gpt`` task, asserts that no host-device sync happens
between log intervals (``torch.cuda.set_sync_debug_mode("error")`` armed for every step and lifted
only for the log/eval boundary), checks that loss fell and nothing was skipped beyond the fp16
scaler's warm-up, and prints tokens/s and the step-time ratio against a bare loop.

    python bench/gpu_check.py            # exits 1 on any failed assertion
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from stabletrain import Trainer, load_config, resolve_task

STEPS = 200


#: The boundaries where the loop syncs by design: the log interval, eval, checkpoints, the one-time init
#: fingerprint comparison, and acting on an incident. Everything else must run without a sync.
BOUNDARIES = ("_log", "evaluate", "_checkpoint", "_check_init", "_act")


def arm_sync_guard(trainer: Trainer) -> None:
    """Make any sync outside the loop's boundaries raise, by arming the debug mode everywhere else."""
    for name in BOUNDARIES:
        original = getattr(trainer, name)

        def lifted(*args, _original=original, **kwargs):
            torch.cuda.set_sync_debug_mode(0)
            try:
                return _original(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")

        setattr(trainer, name, lifted)


def bare_step_time(task, cfg, steps: int) -> float:
    model = copy.deepcopy(task.model).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, fused=True)
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    batches = [torch.utils.data.default_collate([task.train_data[i] for i in range(b * cfg.train.batch_size, (b + 1) * cfg.train.batch_size)])
               for b in range(8)]
    batches = [[t.cuda(non_blocking=True) for t in b] for b in batches]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            loss_sum, count = task.loss(model, batches[s % len(batches)])
            loss = loss_sum / count
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip.max_norm)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        for precision in ("bf16", "fp16"):
            cfg = load_config(None, [f"precision={precision}", f"train.max_steps={STEPS}", "log.every=20", "eval.every=100",
                                     "train.batch_size=32", "log.progress=false"])
            task = resolve_task(cfg.task, cfg.task_args)
            bare = bare_step_time(task, cfg, 50)
            trainer = Trainer(cfg, task=task, run_dir=Path(tmp) / precision)
            arm_sync_guard(trainer)
            torch.cuda.set_sync_debug_mode("error")
            t0 = time.perf_counter()
            try:
                trainer.fit()
            except RuntimeError as err:
                failures.append(f"{precision}: a sync between log intervals: {err}")
                continue
            finally:
                torch.cuda.set_sync_debug_mode(0)
            wall = time.perf_counter() - t0
            hist = trainer.history
            skipped = sum(r["num_skipped"] for r in hist)
            tok_s = statistics_median([r["tokens_per_s"] for r in hist[1:]])
            step_s = statistics_median([r["step_time_s"] for r in hist[1:]])
            print(json.dumps({"precision": precision, "steps": trainer.step, "wall_s": round(wall, 1),
                              "first_loss": round(hist[0]["loss"], 4), "last_loss": round(hist[-1]["loss"], 4),
                              "val_loss": round(hist[-1].get("val_loss", float("nan")), 4), "skipped": skipped,
                              "loss_scale": hist[-1]["loss_scale"], "tokens_per_s": round(tok_s),
                              "step_ms": round(step_s * 1e3, 2), "bare_step_ms": round(bare * 1e3, 2),
                              "overhead_ratio": round(step_s / bare, 3)}))
            if not hist[-1]["loss"] < hist[0]["loss"]:
                failures.append(f"{precision}: loss did not fall")
            if skipped > (20 if precision == "fp16" else 0):
                failures.append(f"{precision}: {skipped} skipped steps")
    for f in failures:
        print("FAIL", f)
    print("gpu_check:", "ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


def statistics_median(xs):
    import statistics

    return statistics.median(xs) if xs else float("nan")


if __name__ == "__main__":
    sys.exit(main())
