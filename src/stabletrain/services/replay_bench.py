"""The replays of one step on a :class:`~stabletrain.replica.Replica`, each from the saved state and RNG streams.

What :mod:`stabletrain.counterfactual` asks of a spike's step: the run's own step on some of its samples (its
loss, grad norm, per-parameter grad norms and update ratios, Adam's surges), forward-only losses, and per-module
outputs (their RMS; their error under a low precision against fp32). Each call starts from the replica's saved
state and RNG streams and leaves them so; ``passes`` counts the forward and backward passes spent.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..data import move_to
from ..diagnostics.spike_evidence import adam_surges, surge_rows
from ..policies.accumulation import loss_sums
from ..replica import Replica

__all__ = ["ReplayBench", "MAX_KEPT_OUTPUTS"]

#: A precision spike's search keeps at most this many elements of the fp32 modules' outputs (1 GiB in float32).
MAX_KEPT_OUTPUTS = 2 ** 28


class ReplayBench:
    """Replays on a replica, each from the saved state and RNG streams (see the module docstring)."""

    def __init__(self, replica: Replica, task: Any) -> None:
        self.replica, self.task = replica, task
        self.collate = task.collate or torch.utils.data.default_collate
        self.precision = replica.precision()
        self.passes = {"forward": 0, "backward": 0, "steps": 0}

    def groups(self, indices: list[list[int]]) -> list[tuple[list[int], Any]]:
        dev = self.replica.device
        return [(list(idx), move_to(self.collate([self.task.train_data[i] for i in idx]), dev)) for idx in indices if idx]

    def sums(self, groups: list[tuple[list[int], Any]], model: nn.Module | None = None,
             precision: Any = None) -> tuple[float, float]:
        """(loss sum, item count) of ``groups`` under ``model`` (default: the replica's), forward only."""
        sums = self.each(groups, model, precision)
        return sum(s for s, _ in sums), sum(c for _, c in sums)

    def each(self, groups: list[tuple[list[int], Any]], model: nn.Module | None = None,
             precision: Any = None) -> list[tuple[float, float]]:
        """(loss sum, item count) of each of ``groups`` under ``model`` (default: the replica's), forward only, from one
        reset."""
        self.replica.reset()
        sums = loss_sums(self.task.loss, model if model is not None else self.replica.model, groups,
                         (precision or self.precision).autocast())
        self.passes["forward"] += len(sums)
        return sums

    def loss(self, groups: list[tuple[list[int], Any]], model: nn.Module | None = None, precision: Any = None) -> float:
        total, count = self.sums(groups, model, precision)
        return total / count if count else float("nan")

    def autocast_inside(self, groups: list[tuple[list[int], Any]], precision: Any) -> bool:
        """Whether the loss turns autocast on itself: the model's forward runs under it though ``precision`` (fp32) sets
        none (a Monitor user's loss function that enters ``torch.autocast``): a replay cannot then leave low precision."""
        dev, seen = self.replica.device.type, []
        handle = self.replica.model.register_forward_pre_hook(lambda *_: seen.append(torch.is_autocast_enabled(dev)))
        try:
            self.sums(groups[:1], precision=precision)
        finally:
            handle.remove()
        return any(seen)

    def step(self, groups: list[tuple[list[int], Any]], precision: Any = None, *, signature: bool = False) -> dict[str, Any]:
        """The run's step on ``groups``: its loss, grad norm, per-parameter grad norms and update ratios (state kept)."""
        rep = self.replica
        rep.reset()
        step = rep.step(precision=precision)
        before = [p.detach().clone() for p in rep.params]
        step.forward_backward([(len(idx), b) for idx, b in groups], self.task.loss)
        judged = step.judge(clip=False)
        scale = step.window.grad_scale
        names = [n for n, _ in rep.named_params]
        out: dict[str, Any] = {"loss": float(judged["loss"]), "grad_norm": float(judged["grad_norm"]),
                               "grad_norms": dict(zip(names, judged["per_param_norms"].tolist()))}
        masks = {}
        if signature:  # the true gradients against the optimizer's moments, before the update moves them
            # (a copy: the clip below scales the gradients in place, and the shares are of the pre-clip gradient)
            grads = {n: (p.grad.detach().float() * scale if scale is not None else p.grad.detach().float().clone())
                     for n, p in rep.named_params if p.grad is not None}
            masks = adam_surges(rep.named_params, step.optimizer, grads)
            out["grads"] = grads
        judged["clipped"] = step.clipper.clip_(step.params, judged["grad_norm"], judged["finite"], grad_scale=scale)
        step.apply(judged, check_params=False)
        moved = [(float((p.detach() - b).norm()), float(b.norm())) for (_, p), b in zip(rep.named_params, before)]
        out["update_ratios"] = {n: d / max(w, 1e-12) for (n, _), (d, w) in zip(rep.named_params, moved)}
        out["update_ratio"] = math.hypot(*(d for d, _ in moved)) / max(math.hypot(*(w for _, w in moved)), 1e-12)
        if signature:
            out["surges"] = surge_rows(masks, {n: (p.detach() - b).abs() for (n, p), b in zip(rep.named_params, before)})
        for p in rep.params:
            p.grad = None
        self.passes["forward"] += len(groups)
        self.passes["backward"] += len(groups)
        self.passes["steps"] += 1
        rep.reset()
        return out

    def _outputs(self, groups: list[tuple[list[int], Any]], model: nn.Module, precision: Any,
                 seen: Callable[[str, torch.Tensor | None], None]) -> None:
        """Run ``groups`` forward (:meth:`loss`) calling ``seen(name, output)`` at each named module's every call:
        its first floating output tensor, or None where it has none."""
        def hook(name: str):
            def record(_module: nn.Module, _args: Any, output: Any) -> None:
                t = output[0] if isinstance(output, (tuple, list)) and output else output
                seen(name, t if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel() else None)
            return record

        handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
        try:
            self.loss(groups, model, precision)
        finally:
            for h in handles:
                h.remove()

    def module_rms(self, groups: list[tuple[list[int], Any]], model: nn.Module,
                   precision: Any = None) -> tuple[dict[str, float], list[str]]:
        """Each module's output RMS on ``groups`` (mean over micro-batches) and the modules in the order they ran."""
        stats: dict[str, list[float]] = {}

        def record(name: str, t: torch.Tensor | None) -> None:
            if t is not None:
                stats.setdefault(name, []).append(float(t.detach().float().pow(2).mean().sqrt()))

        self._outputs(groups, model, precision, record)
        return {k: sum(v) / len(v) for k, v in stats.items()}, list(stats)

    def module_errors(self, groups: list[tuple[list[int], Any]], model: nn.Module, low: Any, high: Any
                      ) -> tuple[dict[str, float], list[str]]:
        """Each module's output under precision ``low`` against its output under ``high`` on ``groups`` (the same RNG
        streams): the relative error ``||low - high|| / ||high||`` (the largest over its calls), and the modules in the
        order they ran. The ``high`` outputs are kept up to :data:`MAX_KEPT_OUTPUTS` elements, the first modules'
        first (a module past it gets no error)."""
        kept: dict[tuple[str, int], torch.Tensor] = {}
        calls: dict[str, int] = {}
        errors: dict[str, float] = {}
        room = [MAX_KEPT_OUTPUTS]

        def call(name: str) -> int:
            calls[name] = calls.get(name, 0) + 1
            return calls[name] - 1

        def keep(name: str, t: torch.Tensor | None) -> None:
            k = call(name)
            if t is not None and t.numel() <= room[0]:
                room[0] -= t.numel()
                kept[(name, k)] = t.detach().float().clone()

        def compare(name: str, t: torch.Tensor | None) -> None:
            ref = kept.get((name, call(name)))
            if t is None or ref is None or ref.shape != t.shape:
                return
            err = float((t.detach().float() - ref).norm() / ref.norm().clamp_min(1e-30))
            errors[name] = max(errors.get(name, 0.0), err if math.isfinite(err) else float("inf"))

        for seen, precision in ((keep, high), (compare, low)):
            calls.clear()
            self._outputs(groups, model, precision, seen)
        return errors, list(errors)
