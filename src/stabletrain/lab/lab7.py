"""Lab 7: the path by which the learning rate affects stability — why a lower LR cures one failure and not another.

Two runs of the built-in loop meet two failures, and :func:`stabletrain.remedy_search.search_remedies` replays
each incident from its bundle under the candidate fixes (the K windows after it included):

- a divergence: linear regression under SGD whose warmup takes the LR past the stable step size for
  the data's scale (lr x curvature > 2): each update overshoots, the loss grows geometrically, until the
  grad norm overflows. The LR acts here through every update since the growth began.
- a sqrt(0) fault: a model that L2-normalises a hidden vector; one sample is all zeros, so the backward
  of sqrt at 0 is NaN. The NaN is born in the incident step's own gradient, before the LR touches
  anything.

The remedy table, from its own numbers, says which fix cures which: a lower LR *from before the growth*
cures the divergence, a lower LR from the incident's own state cures neither (the weights are already
huge; the gradient is NaN whatever the LR), and skipping the sample or guarding the op cures the sqrt(0).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from ..config import load_config
from ..loop import Trainer
from ..remedy_search import search_remedies
from ..tasks import Task
from . import Claim, LabResult, new_figure, runs_folder, save_figure

# The divergence spikes before its first NaN (lab 8 meets those spikes): here the non-finite incidents alone are captured.
COMMON = ["log.progress=false", "log.tensorboard=false", "train.batch_size=8", "log.every=5", "data.shuffle=false",
          "eval.every=0", "capture.spikes=false"]
DIVERGE = ["optim.name=sgd", "optim.weight_decay=0", "clip.max_norm=null", "sched.warmup_steps=20", "sched.decay=constant",
           "ckpt.every=10", "ckpt.keep=10", "guard.max_consecutive_skips=3", "train.max_steps=60"]


def _mse(model: nn.Module, batch: Any) -> Tensor:
    return F.mse_loss(model(batch[0]), batch[1])


class _L2Normalize(nn.Module):
    """x / (||x|| + eps): finite forward at x = 0, but the backward of sqrt at 0 is 1 / (2 sqrt(0)) = inf."""

    def forward(self, x: Tensor) -> Tensor:
        return x / (x.pow(2).sum(-1, keepdim=True).sqrt() + 1e-6)


def _diverging_task(seed: int) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(seed)
    return Task(model=nn.Sequential(nn.Linear(8, 1)), train_data=TensorDataset(x, y), loss=_mse, name="diverging")


def _sqrt_task(seed: int, bad_index: int = 13) -> Task:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 8, generator=g)
    x[bad_index] = 0.0
    y = torch.randn(32, 1, generator=g)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), _L2Normalize(), nn.Linear(16, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="sqrt-zero")


def _search(task: Task, overrides: list[str], run_dir: Path, steps: int) -> dict[str, Any]:
    cfg = load_config(None, [*COMMON, *overrides])
    Trainer(cfg, task=task, run_dir=run_dir).fit()
    incidents = sorted((run_dir / "incidents").glob("step_*"))
    if not incidents:
        return {"failure_class": "none", "candidates": [], "step": None, "evidence": "no incident", "best": None}
    return search_remedies(incidents[0], task, steps=steps, device="cpu")


def run(out_dir: Path | None = None, seed: int = 0, *, lr: float = 2.5, steps: int = 6) -> LabResult:
    """Meet a divergence (SGD at peak ``lr``) and a sqrt(0) fault; replay both under the remedies for ``steps`` windows."""
    with runs_folder(out_dir, "lab7") as tmp:  # (kept under --out: its lines point there)
        div = _search(_diverging_task(seed), [*DIVERGE, f"optim.lr={lr}", f"seed={seed}"], Path(tmp) / "div", steps)
        sq = _search(_sqrt_task(seed), ["train.max_steps=3", f"seed={seed}"], Path(tmp) / "sqrt", steps)
    by = {"divergence": {c["name"]: c for c in div["candidates"]}, "sqrt(0)": {c["name"]: c for c in sq["candidates"]}}
    rows = []
    for fault, record in (("divergence", div), ("sqrt(0)", sq)):
        for c in record["candidates"]:
            end = c["end_loss"] if isinstance(c["end_loss"], float) and math.isfinite(c["end_loss"]) else None
            rows.append([fault, c["name"], c["detail"], c["verdict"], (c["failed"] or {}).get("step"), end])
    columns = ["fault", "candidate", "what it does", "verdict", "first bad step", "end loss"]

    def verdict(fault: str, name: str) -> str:
        return by[fault].get(name, {}).get("verdict", "not tried")

    rollback = next((n for n in by["divergence"] if n == "rollback-lr-x0.1"), None)
    lr_div, lr_sq = verdict("divergence", "lr-x0.1"), verdict("sqrt(0)", "lr-x0.1")
    claims = [
        Claim("the growing loss is classified a divergence, the zero sample's NaN an op fault",
              f"{div['failure_class']}, {sq['failure_class']}", "divergence, op",
              (div["failure_class"], sq["failure_class"]) == ("divergence", "op")),
        Claim("a lower LR from before the growth cures the divergence",
              f"rollback-lr-x0.1: {verdict('divergence', 'rollback-lr-x0.1')}",
              "cures", rollback is not None and verdict("divergence", "rollback-lr-x0.1") == "cures"),
        Claim("a lower LR does not cure the sqrt(0) fault; dropping its sample and guarding the op do",
              f"lr-x0.1: {lr_sq}; skip-samples: {verdict('sqrt(0)', 'skip-samples')}; "
              f"eps-guard: {verdict('sqrt(0)', 'eps-guard')}",
              "fails; cures; cures",
              lr_sq == "fails" and verdict("sqrt(0)", "skip-samples") == verdict("sqrt(0)", "eps-guard") == "cures"),
        Claim("a lower LR from the divergence's own incident state does not cure it either", f"lr-x0.1: {lr_div}", "fails",
              lr_div == "fails"),
    ]
    plots = []
    if out_dir is not None:
        fig, axes = new_figure(ncols=2, width=5.4, height=3.6)
        for ax, (fault, record) in zip(axes, (("divergence", div), ("sqrt(0)", sq))):
            for c in record["candidates"]:
                pts = [(r["step"], r["loss"]) for r in c["trajectory"] if isinstance(r.get("loss"), float)
                       and math.isfinite(r["loss"]) and r["loss"] > 0]
                if pts:
                    ax.plot(*zip(*pts), marker=".", label=f"{c['name']} ({c['verdict']})")
                elif c.get("failed"):  # non-finite from its first replayed step: a cross at that step, on the axis' top
                    ax.plot([c["failed"]["step"]], [1.0], "x", transform=ax.get_xaxis_transform(), clip_on=False,
                            label=f"{c['name']} ({c['verdict']}: non-finite at step {c['failed']['step']})")
            ax.set_yscale("log")
            ax.set_xlabel("step")
            ax.set_ylabel("loss (replay)")
            ax.set_title(f"{fault}: {record['failure_class']} at step {record['step']}", fontsize=10)
            ax.legend(fontsize=6)
        plots.append(save_figure(fig, out_dir / "lab7_remedies.png"))
    setup = (f"a linear regression under SGD (peak lr {lr:g} after a 20-step warmup, no clipping, 64 samples) and an "
             f"L2-normalising model whose sample 13 is all zeros (32 samples), batch 8, seed {seed}; each first incident "
             f"replayed by stabletrain remedy over its window and the {steps} after it")
    numbers = {"divergence": div, "sqrt": sq}
    return LabResult("7", setup, columns, rows, claims, _explain(div, sq, by), plots, numbers)


def _explain(div: dict[str, Any], sq: dict[str, Any], by: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    grew = None
    if div["candidates"]:
        g = (div.get("evidence") or "")
        grew = g.split(";")[0]
    if div["failure_class"] != "divergence":
        out.append(f"The first run did not diverge (its class: {div['failure_class']}): at this LR each update shrinks "
                   "the error instead of overshooting it, so there is nothing for a lower LR to cure.")
    else:
        roll = by["divergence"].get("rollback-lr-x0.1", {})
        low = by["divergence"].get("lr-x0.1", {})
        out.append(f"The divergence: {grew}. SGD's update is lr x gradient, and on this quadratic loss a learning "
                   "rate above 2 / curvature makes each update overshoot the minimum by more than it started from: the "
                   "error is multiplied every step, so the LR acts through every update since the growth began.")
        if roll:
            out.append(f"Replayed from the checkpoint of step {roll['remedy']['step']} (before the growth) with the LR "
                       f"x0.1, it {roll['verdict']}: {roll['evidence']}. From the incident's own state the same x0.1 "
                       f"{low.get('verdict', '-')} ({(low.get('failed') or {}).get('why', low.get('evidence', ''))}): "
                       "the weights are already huge, and the gradient at the incident step is computed before any LR "
                       "is applied.")
    if sq["candidates"]:
        low = by["sqrt(0)"].get("lr-x0.1", {})
        skip = by["sqrt(0)"].get("skip-samples", {})
        out.append(f"The sqrt(0) fault ({sq['evidence']}) is born in the incident step's own backward: the LR only "
                   f"scales an update made from that gradient, so x0.1 {low.get('verdict', '-')} "
                   f"({(low.get('failed') or {}).get('why', '')}). Dropping the sample "
                   f"{skip.get('verdict', '-')} ({skip.get('evidence', '')}); the eps guard "
                   f"{by['sqrt(0)'].get('eps-guard', {}).get('verdict', '-')}, and its code change is "
                   f"'{by['sqrt(0)'].get('eps-guard', {}).get('change', '')}'.")
    out.append("So the path from the LR to stability runs through the updates: it decides whether the weights' "
               "error shrinks or grows from one step to the next. A failure born inside one step's forward or "
               "backward, from the data or an op at a bad point, does not go through that path, and no LR reaches it.")
    return out
