"""Lab 2: the device check, what autocast runs in low precision, and the GradScaler at work.

1. The device check is :func:`~stabletrain.policies.precision.resolve_device` and
   :class:`~stabletrain.policies.precision.PrecisionPolicy` with ``precision=auto``: bf16 autocast on a GPU that
   has it, float32 where CUDA is missing.
2. The op-dtype audit of the doctor's ``amp`` check records, under this device's low precision
   (bf16 on CPU), which aten ops produced low-precision outputs and which autocast kept in fp32.
3. fp16 with a GradScaler (``GradScaler("cpu")`` on CPU, where the policy allows it for testing):
   :class:`~stabletrain.step.TrainStep` with the fused AdamW the loop builds and the loop's LR schedule;
   one step's loss is multiplied by ``overflow_factor`` so its scaled gradients overflow fp16. The
   scaler must skip that step (parameters unchanged), halve the scale, the schedule must hold the LR,
   and after ``growth_interval`` clean steps the scale must double again.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from ..checks.amp import OpDtypeRecorder
from ..config import load_config
from ..data import fixed_batch
from ..numerics import unique_params
from ..policies.optim import build_optimizer
from ..policies.precision import PrecisionPolicy, resolve_device
from ..policies.schedule import LRSchedule
from ..seeding import seed_everything
from ..step import TrainStep
from ..tasks.mlp import make_task
from . import Claim, LabResult, new_figure, save_figure

_MATMULS = ("mm", "addmm", "bmm", "matmul", "linear", "convolution")
_REDUCTIONS = ("_log_softmax", "log_softmax", "nll_loss_forward", "nll_loss", "sum", "mean", "exp", "softmax")


def _audit(device: torch.device, seed: int, batch_size: int) -> tuple[str, OpDtypeRecorder, torch.dtype]:
    """Run one forward of the mlp task under this device's low-precision autocast; return what ran in which dtype."""
    seed_everything(seed)
    task = make_task(num_samples=batch_size, in_dim=32, width=64, depth=3)
    model = task.model.to(device)
    policy = PrecisionPolicy("auto", device)
    mode = policy.mode if policy.autocast_enabled else "bf16"  # what the doctor audits on an fp32 device
    policy = PrecisionPolicy(mode, device)
    _, batch = fixed_batch(task, batch_size, device)
    recorder = OpDtypeRecorder()
    with policy.autocast(), recorder:
        loss = task.loss(model, batch)
    return mode, recorder, loss.dtype


def _scale(policy: PrecisionPolicy) -> float:
    """The loss scale the next step will use (GradScaler's init_scale before its first step); syncs."""
    return float(policy.scaler.get_scale()) if policy.scaler is not None else 1.0


def run(out_dir: Path | None = None, seed: int = 0, *, precision: str = "fp16", overflow_step: int = 4,
        overflow_factor: float = 1e6, growth_interval: int = 3, batch_size: int = 64) -> LabResult:
    """Device check, op-dtype audit, and a planted overflow under ``precision`` (default fp16 + GradScaler).

    ``precision="bf16"`` (no scaler) or ``overflow_factor=1`` breaks the scaler observations.
    """
    device = resolve_device("auto")
    chosen = PrecisionPolicy("auto", device).mode
    fallback = PrecisionPolicy("auto", "cpu").mode  # what any machine without CUDA gets
    audited, recorder, loss_dtype = _audit(device, seed, batch_size)
    low_matmuls = {k: v for k, v in recorder.low.items() if k in _MATMULS}
    fp32_kept = {k: v for k, v in recorder.fp32.items() if k in _REDUCTIONS}

    # The scaler at work.
    seed_everything(seed)
    task = make_task(num_samples=4096, in_dim=32, width=64, depth=3)
    model = task.model.to(device)
    cfg = load_config(None, ["task=mlp", "optim.lr=1e-3"])
    optimizer = build_optimizer(unique_params(model), cfg.optim, device)
    steps = overflow_step + 2 * growth_interval + 1
    schedule = LRSchedule(optimizer, warmup_steps=steps, max_steps=steps)  # warmup: the lr moves every applied step
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="precision=fp16 on CPU")  # the lab knows; it is here for testing
        policy = PrecisionPolicy(precision, device)
    if policy.scaler is not None:
        policy.scaler.set_growth_interval(growth_interval)
    step = TrainStep(model, optimizer, policy, schedule=schedule)
    records = []
    for i in range(1, steps + 1):
        _, batch = fixed_batch(task, batch_size, device, start=(i - 1) * batch_size)
        factor = overflow_factor if i == overflow_step else 1.0
        scale_before, lr_before = _scale(policy), float(schedule.lr())
        out = step([(batch_size, batch)], lambda m, b, f=factor: task.loss(m, b) * f, measure_update=True)
        records.append({"step": i, "planted": i == overflow_step, "loss": float(out["loss"]),
                        "grad_norm": float(out["grad_norm"]), "applied": bool(out["applied"]),
                        "update_norm": float(out["update_norm"]), "scale_before": scale_before,
                        "scale": _scale(policy), "lr_before": lr_before, "lr": float(schedule.lr())})

    bad = records[overflow_step - 1]
    halved = bad["scale"] == bad["scale_before"] / 2
    held = bad["lr"] == bad["lr_before"]
    skipped = not bad["applied"] and bad["update_norm"] == 0.0
    after = records[overflow_step:]
    grew_at = next((r["step"] for r in after if r["scale"] > bad["scale"]), None)
    regrown = grew_at == overflow_step + growth_interval and records[grew_at - 1]["scale"] == 2 * bad["scale"]
    all_clean_applied = all(r["applied"] for r in records if not r["planted"])

    rows = [[r["step"], "x" + f"{overflow_factor:g}" if r["planted"] else "", r["loss"], r["grad_norm"], r["applied"],
             r["update_norm"], r["scale"], r["lr"]] for r in records]
    columns = ["step", "planted", "loss", "grad norm (unscaled)", "applied", "||Δθ||", "scale after", "lr after"]
    audit_rows = [[op, "low" if op in recorder.low else "fp32", recorder.low.get(op, 0) or recorder.fp32.get(op, 0)]
                  for op in list(recorder.low) + [op for op in recorder.fp32 if op not in recorder.low]]
    tables = [(f"autocast {audited} on {device.type}: aten ops by output dtype (the amp check's audit)",
               ["op", "dtype", "calls"], audit_rows)]

    claims = [
        Claim("where CUDA is missing, precision=auto falls back to float32", f"cpu -> {fallback}; this machine "
              f"({device.type}) -> {chosen}", "fp32 on cpu", fallback == "fp32"),
        Claim(f"under {audited} autocast the matmuls run in low precision, the loss's softmax/NLL stays fp32",
              f"low: {', '.join(f'{k} x{v}' for k, v in low_matmuls.items()) or 'none'}; fp32: "
              f"{', '.join(f'{k} x{v}' for k, v in fp32_kept.items()) or 'none'}; loss {str(loss_dtype).replace('torch.', '')}",
              ">= 1 matmul low, >= 1 reduction fp32, loss fp32",
              bool(low_matmuls) and bool(fp32_kept) and loss_dtype == torch.float32),
        Claim(f"the overflow at step {overflow_step} is skipped: not applied, ||Δθ|| = 0",
              f"applied {bad['applied']}, ||Δθ|| {bad['update_norm']:.3g}", "not applied, 0", skipped),
        Claim("the scale halves on the overflow", f"{bad['scale_before']:g} -> {bad['scale']:g}", "x0.5", halved),
        Claim("the LR schedule holds on the skipped step", f"{bad['lr_before']:.4g} -> {bad['lr']:.4g}", "unchanged", held),
        Claim(f"the scale doubles after growth_interval={growth_interval} clean steps, and every clean step is applied",
              f"grew at step {grew_at} to {records[grew_at - 1]['scale'] if grew_at else bad['scale']:g}"
              f"{'' if all_clean_applied else '; a clean step was skipped'}",
              f"step {overflow_step + growth_interval}, x2", regrown and all_clean_applied),
    ]
    plots = []
    if out_dir is not None:
        fig, (ax1, ax2) = new_figure(ncols=2, width=5.2, height=3.4)
        x = [r["step"] for r in records]
        ax1.step(x, [r["scale"] for r in records], where="post", color="#1f77b4")
        ax1.set_yscale("log", base=2)
        ax1.axvline(overflow_step, color="#d62728", ls="--", lw=1, label=f"planted overflow (x{overflow_factor:g})")
        ax1.set_xlabel("step")
        ax1.set_ylabel("loss scale after the step")
        ax1.set_title(f"GradScaler ({policy.mode}), growth_interval={growth_interval}", fontsize=10)
        ax1.legend(fontsize=7)
        ax2.plot(x, [r["lr"] for r in records], "o-", label="lr after the step")
        ax2b = ax2.twinx()
        ax2b.bar(x, [r["update_norm"] for r in records], alpha=0.3, color="#2ca02c", label="||Δθ||")
        ax2b.set_ylabel("||Δθ||", fontsize=8)
        ax2.axvline(overflow_step, color="#d62728", ls="--", lw=1)
        ax2.set_xlabel("step")
        ax2.set_ylabel("lr")
        ax2.set_title("the LR holds and nothing moves on the skipped step", fontsize=10)
        ax2.legend(fontsize=7, loc="upper left")
        plots.append(save_figure(fig, out_dir / "lab2_scaler.png"))

    setup = (f"device auto -> {device.type} (CUDA available: {torch.cuda.is_available()}); op audit: one forward of the "
             f"mlp task under {audited} autocast; scaler: the mlp task, TrainStep with fused AdamW lr 1e-3 and a "
             f"{steps}-step warmup schedule, precision {policy.mode}, growth_interval {growth_interval}, batch {batch_size}, "
             f"step {overflow_step}'s loss x{overflow_factor:g}; seed {seed}")
    numbers = {"device": device.type, "chosen": chosen, "fallback": fallback, "audited": audited,
               "low_ops": dict(recorder.low), "fp32_ops": dict(recorder.fp32), "loss_dtype": str(loss_dtype),
               "skipped": skipped, "scale_before": bad["scale_before"], "scale_after": bad["scale"],
               "lr_held": held, "grew_at": grew_at}
    return LabResult("2", setup, columns, rows, claims,
                     _explain(numbers, records, bad, policy.mode, overflow_step, overflow_factor, growth_interval),
                     plots, numbers, tables)


def _explain(n: dict[str, Any], records: list[dict[str, Any]], bad: dict[str, Any], mode: str, overflow_step: int,
             factor: float, growth_interval: int) -> list[str]:
    out = [f"This machine has {'a CUDA device' if n['device'] == 'cuda' else 'no CUDA device'}, so precision=auto "
           f"chose {n['chosen']}" + (" (the fallback: fp32 needs neither autocast nor a scaler)." if n["chosen"] == "fp32"
                                     else f"; without CUDA it would be {n['fallback']}.")]
    low = ", ".join(sorted(n["low_ops"])) or "nothing"
    kept = ", ".join(sorted(n["fp32_ops"])) or "nothing"
    out.append(f"Under {n['audited']} autocast the ops that produced low-precision outputs were {low}; {kept} produced "
               f"fp32, and the loss is {n['loss_dtype'].replace('torch.', '')}: autocast lowers the matmuls, where the "
               "speed is, and keeps exponentials, log-softmax and reductions in fp32, where rounding would bias the loss.")
    if mode != "fp16":
        out.append(f"With precision={mode} there is no GradScaler: the loss x{factor:g} at step {overflow_step} did not "
                   f"overflow ({mode} has fp32's exponent range), so the step was {'applied' if bad['applied'] else 'skipped'} "
                   f"with ||Δθ|| = {bad['update_norm']:.3g} and the LR moved on ({bad['lr_before']:.4g} -> {bad['lr']:.4g}); "
                   "a scaler is for fp16 only.")
        return out
    first_scale = records[0]["scale_before"]
    if bad["applied"]:
        out.append(f"The loss x{factor:g} at step {overflow_step} did not overflow fp16 at scale {bad['scale_before']:g} "
                   f"(unscaled grad norm {bad['grad_norm']:.3g}): the step was applied, and the scale stayed "
                   f"{bad['scale']:g}.")
    else:
        out.append(f"At step {overflow_step} the loss x{factor:g} times the scale {bad['scale_before']:g} overflowed fp16 "
                   f"in backward (unscaled grad norm {bad['grad_norm']:.3g}); GradScaler found the inf when unscaling, "
                   f"the fused optimizer skipped on the device (||Δθ|| = {bad['update_norm']:g}), the scale went "
                   f"{bad['scale_before']:g} -> {bad['scale']:g}, and the schedule held the lr at {bad['lr']:.4g} "
                   "because it counts applied steps only.")
    if n["grew_at"] is not None:
        out.append(f"The scale started at {first_scale:g} and doubles after every {growth_interval} consecutive clean steps "
                   f"(growth_interval, set small here; torch's default is 2000): after the overflow it grew back at step "
                   f"{n['grew_at']}. That back-off-and-probe cycle keeps the scale as large as fp16 allows, so small "
                   "gradients do not underflow to zero, at the price of one skipped step per overflow.")
    return out
