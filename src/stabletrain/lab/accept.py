"""The acceptance lab: overfit a tiny batch, then checkpoint, resume in a fresh process, compare the next steps.

1. Overfit: :class:`~stabletrain.step.TrainStep` with the loop's optimizer and clipper on one fixed
   batch of ``batch_size`` samples, recording per step the loss, the pre-clip grad norm and the update
   norm ``||θ_t - θ_{t-1}||`` (and its ratio to ``||θ_{t-1}||``).
2. Resume: the doctor's ``resume`` check (:mod:`stabletrain.checks.resume`) trains N steps with the
   built-in loop and checkpoints, continues M steps, then restores the checkpoint in a fresh Python
   process and runs the same M steps; the losses and the final parameters must be bitwise equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checks import CheckContext, run_checks
from ..config import load_config
from ..data import fixed_batch
from ..numerics import unique_params
from ..policies.clipping import GradClipper
from ..policies.optim import build_optimizer
from ..policies.precision import PrecisionPolicy
from ..seeding import seed_everything
from ..step import TrainStep
from ..tasks import resolve_task
from . import Claim, LabResult, new_figure, save_figure

#: The overfit must bring the loss below this fraction of the initial loss.
OVERFIT_FRACTION = 0.05


def run(out_dir: Path | None = None, seed: int = 0, *, task: str = "mlp", overrides: tuple[str, ...] = (),
        steps: int = 100, batch_size: int = 8, lr: float = 3e-3) -> LabResult:
    """Overfit one batch of ``task`` and run the resume comparison on it.

    ``task`` is a config task name (the fresh process rebuilds it): a task with state outside the
    checkpoint (e.g. a model attribute that changes every forward) breaks the resume observation.
    """
    cfg = load_config(None, [f"task={task}", f"seed={seed}", "log.progress=false", "log.tensorboard=false", *overrides])

    # 1. Overfit one tiny batch.
    seed_everything(seed)
    built = resolve_task(cfg.task, cfg.task_args)
    model = built.model
    opt_cfg = load_config(None, [f"task={task}", f"optim.lr={lr}", "optim.weight_decay=0"]).optim
    step = TrainStep(model, build_optimizer(unique_params(model), opt_cfg, PrecisionPolicy("fp32").device),
                     PrecisionPolicy("fp32", "cpu"), clipper=GradClipper(cfg.clip.max_norm))
    _, batch = fixed_batch(built, batch_size)
    n = min(batch_size, len(built.train_data))
    records = []
    for i in range(1, steps + 1):
        out = step([(n, batch)], built.loss, measure_update=True)
        records.append({"step": i, **{k: float(out[k]) for k in ("loss", "grad_norm", "update_norm", "update_ratio")},
                        "clipped": bool(out["clipped"])})
    initial, final = records[0]["loss"], records[-1]["loss"]
    overfit = final <= OVERFIT_FRACTION * initial

    # 2. Checkpoint, resume in a fresh process, compare.
    (result,) = run_checks(CheckContext(cfg), ["resume"])
    compared = [[int(step), a, b, bool(equal)] for step, a, b, equal in result.numbers.get("losses", [])]
    max_diff = result.numbers.get("max_param_diff")
    ckpt_step = result.numbers.get("checkpoint_step")

    shown = sorted({1, 2, 3, 5, 10, 20, 50, steps} & set(range(1, steps + 1)))
    rows = [[r["step"], r["loss"], r["grad_norm"], r["clipped"], r["update_norm"], r["update_ratio"]]
            for r in records if r["step"] in shown]
    columns = ["step", "loss", "grad norm (pre-clip)", "clipped", "||Δθ||", "||Δθ||/||θ||"]
    tables = [(f"resume check: checkpoint at step {ckpt_step}, the next steps in one process and in a fresh one",
               ["step", "uninterrupted loss", "resumed loss", "bitwise equal"], compared)] if compared else []
    claims = [
        Claim(f"overfitting one batch of {n}: the loss falls below {OVERFIT_FRACTION:g} x its initial value in {steps} steps",
              f"{initial:.4g} -> {final:.4g} ({final / initial:.3g}x)", f"<= {OVERFIT_FRACTION:g}x", overfit),
        Claim("after resuming in a fresh process the next step's loss is bitwise the uninterrupted run's",
              f"step {compared[0][0]}: {compared[0][1]} vs {compared[0][2]}" if compared else result.summary,
              "bitwise equal", bool(compared) and compared[0][3]),
        Claim("every compared step's loss and the final parameters are bitwise equal",
              f"{sum(c[3] for c in compared)}/{len(compared)} losses equal, max |param diff| {max_diff}",
              "all equal, 0", result.passed and bool(compared) and all(c[3] for c in compared) and max_diff == 0.0),
    ]
    plots = []
    if out_dir is not None:
        fig, (ax1, ax2) = new_figure(ncols=2, width=5.2, height=3.4)
        x = [r["step"] for r in records]
        ax1.semilogy(x, [r["loss"] for r in records], label="loss")
        ax1.semilogy(x, [r["grad_norm"] for r in records], label="grad norm (pre-clip)")
        ax1.semilogy(x, [r["update_norm"] for r in records], label="||Δθ||")
        ax1.set_xlabel("step")
        ax1.set_title(f"overfitting one batch of {n}", fontsize=10)
        ax1.legend(fontsize=7)
        if compared:
            xs = [c[0] for c in compared]
            ax2.plot(xs, [float(c[1]) for c in compared], "o-", label="uninterrupted", markersize=8)
            ax2.plot(xs, [float(c[2]) for c in compared], "x--", label="resumed (fresh process)", markersize=8)
            ax2.set_xticks(xs)
            ax2.legend(fontsize=7)
        ax2.set_xlabel("step")
        ax2.set_ylabel("loss")
        ax2.set_title(f"after the checkpoint at step {ckpt_step}", fontsize=10)
        plots.append(save_figure(fig, out_dir / "lab_accept.png"))
    setup = (f"task {task}; overfit: one fixed batch of {n}, TrainStep with {type(step.optimizer).__name__} lr {lr:g}, "
             f"clip.max_norm {cfg.clip.max_norm}, {steps} steps, fp32; resume: the doctor's resume check (the built-in "
             f"loop, checkpoint at step {ckpt_step}, a fresh `python -m stabletrain.checks.resume` process); seed {seed}")
    numbers = {"initial_loss": initial, "final_loss": final, "steps": steps, "resume_passed": result.passed,
               "resume_summary": result.summary, "max_param_diff": max_diff, "checkpoint_step": ckpt_step,
               "compared": compared, "diverged_component": result.numbers.get("diverged_component")}
    return LabResult("accept", setup, columns, rows, claims, _explain(records, numbers, n), plots, numbers, tables)


def _explain(records: list[dict[str, Any]], n: dict[str, Any], size: int) -> list[str]:
    first, last = records[0], records[-1]
    peak = max(records, key=lambda r: r["update_norm"])
    clipped = sum(r["clipped"] for r in records)
    out = [f"On one batch of {size} the loss went from {first['loss']:.4g} to {last['loss']:.4g} in {len(records)} steps "
           f"while the grad norm went from {first['grad_norm']:.3g} to {last['grad_norm']:.3g} and the update from "
           f"{first['update_norm']:.3g} (peak {peak['update_norm']:.3g} at step {peak['step']}) to {last['update_norm']:.3g}, "
           f"{last['update_ratio']:.2g} of the weights' norm"
           + (f"; clipping fired on {clipped} steps." if clipped else "; clipping never fired.")
           + (" A model that can memorize a batch gets gradients everywhere it should, and its update norm says whether "
              "it is still moving." if last["loss"] <= OVERFIT_FRACTION * first["loss"] else
              " It did not memorize the batch: look for a detached graph, a frozen layer or an lr far off.")]
    compared = n["compared"]
    if compared and all(c[3] for c in compared) and n["max_param_diff"] == 0.0:
        out.append(f"The run checkpointed at step {n['checkpoint_step']}; a fresh process restored it and trained steps "
                   f"{compared[0][0]}..{compared[-1][0]}: every loss matched the uninterrupted run bitwise (first: "
                   f"{compared[0][1]}) and the final parameters differ by {n['max_param_diff']:g}. The checkpoint "
                   "holds everything the next step reads: weights, optimizer moments, the LR schedule's position, the "
                   "loss scale, the data position and every RNG.")
    elif compared:
        bad = next((c for c in compared if not c[3]), compared[-1])
        out.append(f"After resuming from step {n['checkpoint_step']} in a fresh process, step {bad[0]}'s loss was "
                   f"{bad[2]} instead of {bad[1]} and the parameters ended {n['max_param_diff']:.3g} apart; the "
                   f"check names the first component that differs: {n['diverged_component']}. A file that exists is not "
                   "a checkpoint that resumes: compare the next step.")
    else:
        out.append(f"The resume comparison did not run: {n['resume_summary']}")
    return out
