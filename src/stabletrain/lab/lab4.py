"""Lab 4: one abnormally large loss, and what clipping and the optimizer do to the update it causes.

Four runs of the same model from the same init on the same batches: {SGD, AdamW} x {clipping off,
clipping on}. At step ``spike_step`` the loss is multiplied by ``spike`` (a stand-in for a corrupt
batch: the gradient grows by the same factor). Every step is :class:`~stabletrain.step.TrainStep`
with ``measure_update=True``, so the table reads, for the spike step, the pre- and post-clip grad
norm, whether clipping fired, and ``||Δθ|| = ||θ_t - θ_{t-1}||``, next to the same figures of a
normal step. The optimizers are the loop's own (:func:`~stabletrain.policies.optim.build_optimizer`).
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from ..config import load_config
from ..data import fixed_batch
from ..numerics import unique_params
from ..policies.clipping import GradClipper
from ..policies.optim import build_optimizer
from ..policies.precision import PrecisionPolicy
from ..seeding import seed_everything
from ..step import TrainStep
from ..tasks.mlp import make_task
from . import Claim, LabResult, new_figure, save_figure

LR = {"sgd": 0.05, "adamw": 1e-3}
#: Without clipping, an SGD update at the spike is at least this many times a normal one.
SGD_GROWTH_MIN = 100.0
#: With clipping, the SGD update at the spike shrinks at least this many times vs clipping off.
CLIP_SHRINK_MIN = 100.0
#: AdamW's update at the spike stays within this factor of a normal one, even without clipping.
ADAM_GROWTH_MAX = 10.0


def _run(optimizer: str, max_norm: float | None, steps: int, spike_step: int, spike: float, seed: int,
         batch_size: int) -> list[dict[str, Any]]:
    seed_everything(seed)
    task = make_task(num_samples=steps * batch_size, in_dim=32, width=64, depth=3)
    model = task.model
    cfg = load_config(None, ["task=mlp", f"optim.name={optimizer}", f"optim.lr={LR[optimizer]}", "optim.weight_decay=0"])
    step = TrainStep(model, build_optimizer(unique_params(model), cfg.optim, model[0].weight.device),
                     PrecisionPolicy("fp32", "cpu"), clipper=GradClipper(max_norm))
    records = []
    for i in range(1, steps + 1):
        _, batch = fixed_batch(task, batch_size, start=(i - 1) * batch_size)
        factor = spike if i == spike_step else 1.0
        out = step([(batch_size, batch)], lambda m, b, f=factor: task.loss(m, b) * f, measure_update=True)
        records.append({k: float(out[k]) for k in ("loss", "grad_norm", "post_clip_norm", "update_norm", "update_ratio")}
                       | {"clipped": bool(out["clipped"]), "step": i})
    return records


def _summary(records: list[dict[str, Any]], spike_step: int) -> dict[str, Any]:
    at = records[spike_step - 1]
    before = [r for r in records if r["step"] < spike_step]
    after = [r for r in records if spike_step < r["step"] <= spike_step + 3]
    med = lambda key, rs: statistics.median(r[key] for r in rs)  # noqa: E731
    # "Normal" is the steps before the spike: after it, an unclipped SGD run is a different (damaged) model.
    return {"loss": at["loss"], "loss_ratio": at["loss"] / med("loss", before), "grad_norm": at["grad_norm"],
            "normal_grad_norm": med("grad_norm", before), "post_clip_norm": at["post_clip_norm"],
            "loss_after": med("loss", after) if after else float("nan"), "loss_before": med("loss", before),
            "clipped": at["clipped"], "update": at["update_norm"], "normal_update": med("update_norm", before),
            "update_ratio": at["update_norm"] / med("update_norm", before),
            "after_ratio": med("update_norm", after) / med("update_norm", before) if after else float("nan"),
            "clip_rate": sum(r["clipped"] for r in records) / len(records),
            "clips_elsewhere": [r["step"] for r in records if r["clipped"] and r["step"] != spike_step]}


def run(out_dir: Path | None = None, seed: int = 0, *, max_norm: float = 1.0, spike: float = 1e3, spike_step: int = 8,
        steps: int = 16, batch_size: int = 32) -> LabResult:
    """Train the four runs; ``max_norm`` is the clip threshold of the clipping runs (too high, e.g. 1e6, protects nothing)."""
    configs = [("sgd", None), ("sgd", max_norm), ("adamw", None), ("adamw", max_norm)]
    runs = {(opt, clip): _run(opt, clip, steps, spike_step, spike, seed, batch_size) for opt, clip in configs}
    s = {key: _summary(recs, spike_step) for key, recs in runs.items()}
    label = lambda opt, clip: f"{'SGD' if opt == 'sgd' else 'AdamW'}, clip {'off' if clip is None else f'{clip:g}'}"  # noqa: E731
    rows = [[label(*key), v["loss"], v["grad_norm"], v["post_clip_norm"], v["clipped"], v["update"], v["normal_update"],
             v["update_ratio"], v["after_ratio"], v["clip_rate"]] for key, v in s.items()]
    columns = ["run", "loss@spike", "grad norm pre-clip", "post-clip", "clipped", "||Δθ||@spike", "||Δθ|| normal",
               "spike/normal", "after/before", "clip rate"]
    sgd_off, sgd_on = s[("sgd", None)], s[("sgd", max_norm)]
    adam_off = s[("adamw", None)]
    shrink = sgd_off["update"] / sgd_on["update"]
    bound = LR["sgd"] * max_norm * (1 + 1e-4)
    claims = [
        Claim(f"the planted batch's loss is ~{spike:g}x a normal one", f"{sgd_off['loss_ratio']:.3g}x",
              f">= {spike / 3:g}x", sgd_off["loss_ratio"] >= spike / 3),
        Claim("SGD without clipping: the update at the spike is orders of magnitude larger",
              f"{sgd_off['update_ratio']:.3g}x a normal update", f">= {SGD_GROWTH_MIN:g}x",
              sgd_off["update_ratio"] >= SGD_GROWTH_MIN),
        Claim(f"clipping at {max_norm:g} fires on the spike and shrinks the SGD update to at most lr x max_norm",
              f"clipped {sgd_on['clipped']}, post-clip norm {sgd_on['post_clip_norm']:.3g}, ||Δθ|| {sgd_on['update']:.3g}, "
              f"{shrink:.3g}x smaller than unclipped", f"fired, ||Δθ|| <= {LR['sgd'] * max_norm:.3g}, >= {CLIP_SHRINK_MIN:g}x",
              sgd_on["clipped"] and sgd_on["update"] <= bound and shrink >= CLIP_SHRINK_MIN),
        Claim("clipping fires only on the spike (max_norm sits above the normal grad norm)",
              f"clip rate {sgd_on['clip_rate']:.3g}, normal grad norm {sgd_on['normal_grad_norm']:.3g}"
              + (f", also at steps {sgd_on['clips_elsewhere']}" if sgd_on["clips_elsewhere"] else ""),
              f"1/{steps}", not sgd_on["clips_elsewhere"] and sgd_on["clipped"]),
        Claim("AdamW without clipping: the update at the spike stays near its normal size",
              f"{adam_off['update_ratio']:.3g}x a normal update", f"<= {ADAM_GROWTH_MAX:g}x",
              adam_off["update_ratio"] <= ADAM_GROWTH_MAX),
    ]
    plots = []
    if out_dir is not None:
        fig, (ax1, ax2) = new_figure(ncols=2, width=5.2, height=3.4)
        for key, recs in runs.items():
            ax1.semilogy([r["step"] for r in recs], [max(r["update_norm"], 1e-12) for r in recs], "o-", markersize=3,
                         label=label(*key))
        ax1.axvline(spike_step, color="#d62728", ls="--", lw=1)
        ax1.set_xlabel("step")
        ax1.set_ylabel("||θ_t - θ_{t-1}||")
        ax1.set_title(f"the update; loss x{spike:g} at step {spike_step}", fontsize=10)
        ax1.legend(fontsize=7)
        recs = runs[("sgd", max_norm)]
        ax2.semilogy([r["step"] for r in recs], [r["grad_norm"] for r in recs], "o-", markersize=3, label="pre-clip")
        ax2.semilogy([r["step"] for r in recs], [r["post_clip_norm"] for r in recs], "x--", label="post-clip")
        ax2.axhline(max_norm, color="#888", ls=":", lw=1, label=f"max_norm {max_norm:g}")
        ax2.set_xlabel("step")
        ax2.set_ylabel("grad norm")
        ax2.set_title("SGD with clipping: the grad norm", fontsize=10)
        ax2.legend(fontsize=7)
        plots.append(save_figure(fig, out_dir / "lab4_clipping.png"))
    setup = (f"mlp task, batch {batch_size}, {steps} steps, fp32; SGD lr {LR['sgd']:g} and AdamW lr {LR['adamw']:g} "
             f"(the loop's build_optimizer, no weight decay), clipping off or at max_norm {max_norm:g} (GradClipper); "
             f"loss x{spike:g} at step {spike_step}; 'after/before' = median ||Δθ|| of the 3 steps after the spike over "
             f"the steps before; seed {seed}")
    numbers = {f"{opt}_{'off' if clip is None else 'on'}_{k}": v for (opt, clip), summ in s.items() for k, v in summ.items()}
    numbers["sgd_clip_shrink"] = shrink
    return LabResult("4", setup, columns, rows, claims, _explain(s, max_norm, spike, LR, shrink), plots, numbers)


def _explain(s: dict[tuple[str, float | None], dict[str, Any]], max_norm: float, spike: float, lr: dict[str, float],
             shrink: float) -> list[str]:
    keys = list(s)
    sgd_off, sgd_on, adam_off, adam_on = (s[k] for k in keys)
    out = [f"The planted batch's loss was {sgd_off['loss_ratio']:.3g}x a normal one and its gradient norm "
           f"{sgd_off['grad_norm']:.3g}, {sgd_off['grad_norm'] / sgd_off['normal_grad_norm']:.3g}x the normal "
           f"{sgd_off['normal_grad_norm']:.3g}: the gradient scales with the loss."]
    out.append(f"SGD moves the parameters by lr x gradient, so without clipping that step moved them by "
               f"{sgd_off['update']:.3g}, {sgd_off['update_ratio']:.3g}x a normal step: one bad batch undoes many good ones.")
    if sgd_on["clipped"]:
        out.append(f"With clipping at {max_norm:g} the step's gradient was rescaled from {sgd_on['grad_norm']:.3g} to "
                   f"{sgd_on['post_clip_norm']:.3g}, so the update was {sgd_on['update']:.3g} ({shrink:.3g}x smaller, at "
                   f"most lr x max_norm = {lr['sgd'] * max_norm:.3g}); the clip rate over the run was "
                   f"{sgd_on['clip_rate']:.3g}" + (", i.e. only the spike: clipping bounded the damage without touching "
                                                  "normal steps." if not sgd_on["clips_elsewhere"] else
                                                  f", including normal steps {sgd_on['clips_elsewhere']}: max_norm is below "
                                                  "the normal grad norm, so clipping rescales every step, acting as a "
                                                  "smaller lr, and no longer tells a spike from a normal step."))
    else:
        out.append(f"With max_norm {max_norm:g} above even the spike's grad norm {sgd_on['grad_norm']:.3g}, clipping never "
                   f"fired and the update was {sgd_on['update']:.3g}: a threshold must sit just above the normal grad "
                   f"norm ({sgd_on['normal_grad_norm']:.3g}) to protect anything.")
    adam_shrink = adam_off["update"] / adam_on["update"] if adam_on["update"] > 0 else float("inf")
    out.append(f"AdamW divides each coordinate's step by the running RMS of its gradients, which the spike enters at "
               f"once, so even unclipped the spike step moved the parameters only {adam_off['update_ratio']:.3g}x a normal "
               f"step (clipped: {adam_on['update_ratio']:.3g}x), and the 3 steps after it were {adam_off['after_ratio']:.3g}x "
               f"the steps before (clipped: {adam_on['after_ratio']:.3g}x): for AdamW clipping changed the spike's update "
               f"{adam_shrink:.3g}x, for SGD {shrink:.3g}x. The optimizer, not only the clip threshold, sets how far one "
               "bad batch can move the weights.")
    out.append(f"The damage shows in the loss: the median loss of the 3 steps after the spike was {sgd_off['loss_after']:.4g} "
               f"for SGD without clipping vs {sgd_on['loss_after']:.4g} with it "
               f"(before the spike: {sgd_off['loss_before']:.4g}).")
    out.append("Clipping bounds the size of a step; it does not make a bad batch good (the clipped step still points "
               "where the bad batch says) and it cannot repair a NaN: the loss itself should be found and fixed.")
    return out
