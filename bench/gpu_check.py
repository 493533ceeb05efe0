"""GPU check (run on a CUDA machine, under 5 minutes): the default task in bf16 and fp16, and fp16 with SGD.

For each case it trains the default ``gpt`` task through ``Trainer``, asserts that no host-device sync
happens between log intervals (``torch.cuda.set_sync_debug_mode("error")`` armed by a callback,
:class:`SyncGuard`, for every step and lifted only for the loop's designed boundaries), checks that
loss fell and nothing was skipped beyond the fp16 scaler's warm-up, and prints tokens/s and the
step-time ratio against a bare loop with the same optimizer (fused AdamW, or fused SGD with momentum).

    python bench/gpu_check.py            # exits 1 on any failed assertion; 0 with a note without CUDA
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from stabletrain import Trainer, load_config, resolve_task
from stabletrain.callbacks import Callback, FitState

STEPS = 200
COMMON = [f"train.max_steps={STEPS}", "log.every=20", "eval.every=100", "train.batch_size=32", "log.progress=false"]
#: (name, config overrides): the default optimizer (fused AdamW) in bf16 and fp16, and fused SGD under the scaler.
CASES = [
    ("bf16", ["precision=bf16"]),
    ("fp16", ["precision=fp16"]),
    ("fp16-sgd", ["precision=fp16", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0.9"]),
]


class SyncGuard(Callback):
    """Make any host-device sync between log boundaries raise: ``set_sync_debug_mode("error")`` on, except there.

    The loop syncs by design only at its boundaries: the one-time init fingerprint check and the step-0
    checkpoint before the first step, and at a log/eval/checkpoint step after its ``on_step_end``: eval,
    the interval's reduce, the guard acting on it (an incident's capture), the checkpoint. So the mode is
    lifted in ``on_step_end`` of such a step and armed again at the end of the boundary: in ``on_log``
    (appended last: after the sinks), or in ``on_checkpoint`` when a checkpoint follows. After an
    interval with a bad row (an incident's capture may follow) it is armed at the next ``on_step_end``
    instead. ``armed_steps`` counts the steps that ran armed, so a check that never armed is seen.
    """

    def __init__(self) -> None:
        self.armed, self.armed_steps = False, 0

    def _set(self, armed: bool) -> None:
        torch.cuda.set_sync_debug_mode("error" if armed else 0)
        self.armed = armed

    @staticmethod
    def _boundary(state: FitState) -> bool:
        cfg, step = state.cfg, state.step
        return (step >= cfg.train.max_steps or step % cfg.log.every == 0 or bool(cfg.eval.every and step % cfg.eval.every == 0)
                or bool(cfg.ckpt.every and step % cfg.ckpt.every == 0))

    @staticmethod
    def _checkpoint_follows(state: FitState) -> bool:
        cfg, step = state.cfg, state.step
        return state.ckpt is not None and (step >= cfg.train.max_steps or bool(cfg.ckpt.every and step % cfg.ckpt.every == 0))

    def on_fit_start(self, state: FitState) -> None:
        if state.ckpt is None:  # else the step-0 checkpoint follows; on_checkpoint arms
            self._set(True)

    def on_step_end(self, state: FitState, out: dict[str, Any]) -> None:
        self.armed_steps += self.armed
        if self._boundary(state):
            self._set(False)
        elif not self.armed:
            self._set(True)

    def on_log(self, state: FitState, record: dict[str, Any], rows: list[Any]) -> None:
        bad = any(r.values["finite"] < 0.5 and r.values["overflow"] < 0.5 or r.values["params_finite"] < 0.5
                  for r in rows)
        if not bad and not self._checkpoint_follows(state):
            self._set(True)

    def on_checkpoint(self, state: FitState, info: dict[str, Any]) -> None:
        if state.step < state.cfg.train.max_steps:
            self._set(True)

    def on_fit_end(self, state: FitState, record: dict[str, Any]) -> None:
        self._set(False)


def bare_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """The config's optimizer, fused, written out by hand (weight decay on matrices only, as stabletrain does)."""
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, fused=True)
    if o.name == "adam":
        return torch.optim.Adam(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)


def bare_step_time(task: Any, cfg: Any, steps: int) -> float:
    model = copy.deepcopy(task.model).cuda()
    opt = bare_optimizer(model, cfg)
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    bs = cfg.train.batch_size
    batches = [torch.utils.data.default_collate([task.train_data[i] for i in range(b * bs, (b + 1) * bs)]) for b in range(8)]
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


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_case(name: str, overrides: list[str], tmp: Path, failures: list[str]) -> None:
    cfg = load_config(None, [*overrides, *COMMON])
    task = resolve_task(cfg.task, cfg.task_args)
    bare = bare_step_time(task, cfg, 50)
    guard = SyncGuard()
    trainer = Trainer(cfg, task=task, run_dir=tmp / name, callbacks=[guard])
    t0 = time.perf_counter()
    try:
        trainer.fit()
    except RuntimeError as err:
        failures.append(f"{name}: a sync between log intervals at step {trainer.step}: {err}")
        return
    finally:
        torch.cuda.set_sync_debug_mode(0)
    wall = time.perf_counter() - t0
    hist = trainer.history
    skipped = sum(r["num_skipped"] for r in hist)
    tok_s = median([r["tokens_per_s"] for r in hist[1:]])
    step_s = median([r["step_time_s"] for r in hist[1:]])
    print(json.dumps({"case": name, "precision": cfg.precision, "optimizer": type(trainer.optimizer).__name__,
                      "steps": trainer.step, "armed_steps": guard.armed_steps, "wall_s": round(wall, 1),
                      "first_loss": round(hist[0]["loss"], 4), "last_loss": round(hist[-1]["loss"], 4),
                      "val_loss": round(hist[-1].get("val_loss", float("nan")), 4), "skipped": skipped,
                      "loss_scale": hist[-1]["loss_scale"], "tokens_per_s": round(tok_s),
                      "step_ms": round(step_s * 1e3, 2), "bare_step_ms": round(bare * 1e3, 2),
                      "overhead_ratio": round(step_s / bare, 3)}), flush=True)
    # Every step but those right after a boundary runs armed; far fewer means the guard did not check.
    if guard.armed_steps < STEPS - STEPS // cfg.log.every - 2:
        failures.append(f"{name}: the sync guard was armed for only {guard.armed_steps} of {trainer.step} steps")
    if not hist[-1]["loss"] < hist[0]["loss"]:
        failures.append(f"{name}: loss did not fall ({hist[0]['loss']:.4f} -> {hist[-1]['loss']:.4f})")
    if skipped > (20 if cfg.precision == "fp16" else 0):
        failures.append(f"{name}: {skipped} skipped steps")


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in CASES:
            run_case(name, overrides, Path(tmp), failures)
    for f in failures:
        print("FAIL", f)
    print("gpu_check:", "ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
