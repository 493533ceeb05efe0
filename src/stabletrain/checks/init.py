"""``stabletrain check init``: does the signal survive the model's depth at step 0, forward and backward?

Runs :func:`stabletrain.signal_propagation.signal_report` on the task's model as built, on one batch of
``train.batch_size`` samples; with ``--compare normal,xavier,kaiming`` also on copies of that model
re-initialized by :func:`stabletrain.initialization.init_` with each scheme. Writes the per-layer std
plot (``init_signal.png``) and the full per-layer numbers (``init_signal.json``) to ``--out-dir``
(default: the current directory). Passes when no layer of the model as built is flagged.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from torch import nn

from ..config import Config
from ..initialization import SCHEMES, init_
from ..seeding import seed_everything
from ..signal_propagation import SignalReport, format_comparison, format_report, plot_signal, signal_report
from . import CheckContext, CheckResult, fixed_batch, register

__all__ = ["check_init"]

AS_BUILT = "as built"


def _optimizer_factory(cfg: Config):
    """Return ``params -> AdamW`` at the run's peak lr, weight decay on matrices only (as the loop builds it)."""

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [g for g in ({"params": decay, "weight_decay": cfg.optim.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}) if g["params"]]
        return torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps)

    return make


def _schemes(option: object) -> list[str]:
    if option is None:
        return []
    names = [s.strip() for s in option.split(",")] if isinstance(option, str) else [str(s).strip() for s in option]
    names = [n for n in names if n]
    bad = [n for n in names if n not in SCHEMES]
    if bad:
        raise ValueError(f"--compare: unknown init scheme {bad[0]!r} in {option!r}; known: {', '.join(SCHEMES)}")
    return names


def _where(report: SignalReport, direction: str) -> str:
    first = report.first_forward if direction == "forward" else report.first_backward
    if first is None:
        return "ok"
    ratio = first.forward_ratio if direction == "forward" else first.backward_ratio
    verdict = first.forward if direction == "forward" else first.backward
    return f"{verdict} at #{first.index} {first.name} ({ratio:.3g}x)"


@register("init", order=50)
def check_init(ctx: CheckContext) -> CheckResult:
    """Report per-layer signal propagation at step 0 (and per init scheme with ``compare``); pass if nothing is flagged."""
    schemes = _schemes(ctx.options.get("compare"))
    out_dir = Path(ctx.options.get("out_dir") or ".")
    task = ctx.make_task()
    device = ctx.device
    _, batch = fixed_batch(task, ctx.cfg.train.batch_size, device)
    make_optimizer = _optimizer_factory(ctx.cfg)

    base = task.model.to(device)
    reports = [signal_report(base, batch, task.loss, label=AS_BUILT, make_optimizer=make_optimizer)]
    for scheme in schemes:
        model = copy.deepcopy(base)  # keeps tied weights tied
        seed_everything(ctx.cfg.seed)
        init_(model, scheme)
        reports.append(signal_report(model, batch, task.loss, label=f"init_({scheme!r})", make_optimizer=make_optimizer))

    out_dir.mkdir(parents=True, exist_ok=True)
    plot = plot_signal(reports, out_dir / "init_signal.png")
    data = out_dir / "init_signal.json"
    data.write_text(json.dumps([r.to_dict() for r in reports], indent=1, default=str))

    built = reports[0]
    numbers: dict[str, object] = {"layers": len(built.layers), "flagged": len(built.flagged),
                                  "forward": _where(built, "forward"), "backward": _where(built, "backward")}
    if schemes:
        for r in reports[1:]:
            numbers[f"{r.label}.flagged"] = len(r.flagged)
        details = format_comparison(reports)
        passing = [r.label for r in reports[1:] if r.passed]
        details.append(built.advice())
        summary = (f"as built: {'ok' if built.passed else f'{len(built.flagged)} layer(s) flagged'}; "
                   f"schemes without a flagged layer: {', '.join(passing) or 'none'}")
    else:
        details = format_report(built)
        summary = ("no layer flagged: the signal holds forward and backward" if built.passed else
                   f"{len(built.flagged)} of {len(built.layers)} layers flagged: forward {numbers['forward']}, "
                   f"backward {numbers['backward']}")
    numbers.update({"recommended": built.recommended, "plot": str(plot), "json": str(data)})
    return CheckResult("init", built.passed, summary, numbers=numbers, details=details)
