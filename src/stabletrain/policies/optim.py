"""The optimizer: AdamW (default), Adam or SGD from the config, or the task's own factory.

The built-in choices are built ``fused=True`` on CPU and CUDA: a fused optimizer takes the skip flag
as a device tensor (``found_inf``) and a tensor lr, so neither the guard's skip nor the LR schedule
reads anything on the host. A task's own optimizer (``Task(optimizer=lambda named_params: ...)``) may
be anything: one that cannot skip on the device costs one host sync per step
(:meth:`~stabletrain.policies.precision.PrecisionPolicy.step`), measured in ``bench/overhead.py``.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..console import StableTrainWarning
from ..numerics import unique_params

__all__ = ["build_optimizer", "optimizer_factory", "OptimizerFactory", "check_materialized", "check_optimizer_holds",
           "optimizer_change"]

OptimizerFactory = Callable[[list[tuple[str, nn.Parameter]]], torch.optim.Optimizer]


def _groups(named_params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (never on biases, norms or other 1-D parameters)."""
    decay = [p for _, p in named_params if p.dim() >= 2]
    no_decay = [p for _, p in named_params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(named_params: list[tuple[str, nn.Parameter]], optim: Any, device: torch.device,
                    factory: OptimizerFactory | None = None, *, sharded: bool = False, say: bool = True
                    ) -> torch.optim.Optimizer:
    """Return the run's optimizer over ``named_params``: the task's ``factory`` if given, else ``optim.name``.

    ``optim`` is the config's ``optim`` section (:class:`~stabletrain.config.OptimConfig`). ``sharded``
    (FSDP2: DTensor parameters): torch has no DTensor rule for fused SGD (``aten._fused_sgd_``, with a
    float or a tensor lr), so SGD is built ``foreach=True`` there: its skip flag and lr are then read on
    the host once per step (:meth:`~stabletrain.policies.precision.PrecisionPolicy.step`); AdamW and Adam stay fused.
    ``say``: warn of ``optim.*`` keys a factory leaves unused (the run's optimizer; not a replica's nor a probe's copy).
    """
    if factory is not None:
        optimizer = factory(named_params)
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Task.optimizer returned {type(optimizer).__name__}, expected a torch.optim.Optimizer "
                            "built over the named parameters it was given")
        if say:
            _unused_keys(optim, optimizer)
        return optimizer
    fused = device.type in ("cuda", "cpu")
    groups = _groups(named_params, optim.weight_decay)
    name = getattr(optim, "name", "adamw")
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=fused)
    if name == "adam":  # Adam's weight decay is L2 added to the gradient (AdamW's is decoupled)
        return torch.optim.Adam(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, fused=fused)
    if name == "sgd":
        if sharded:
            return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, nesterov=optim.nesterov, foreach=True)
        return torch.optim.SGD(groups, lr=optim.lr, momentum=optim.momentum, nesterov=optim.nesterov, fused=fused)
    raise ValueError(f"config key 'optim.name': expected adamw, adam or sgd, got {name!r}")


def _unused_keys(optim: Any, optimizer: torch.optim.Optimizer) -> None:
    """Say once that the ``optim.*`` keys set away from their defaults do nothing: the task built its own optimizer."""
    if not dataclasses.is_dataclass(optim):
        return
    default = type(optim)()
    changed = [f"optim.{f.name}={getattr(optim, f.name)}" for f in dataclasses.fields(optim)
               if getattr(optim, f.name) != getattr(default, f.name)]
    if changed:
        lr = optimizer.param_groups[0].get("lr") if optimizer.param_groups else None
        warnings.warn(f"config key{'s' if len(changed) > 1 else ''} {', '.join(changed)} not used: the task builds its "
                      f"own optimizer (Task.optimizer: {type(optimizer).__name__}, lr {lr}); its lr is the peak the "
                      "LR schedule scales: set it there", StableTrainWarning, stacklevel=2)


def optimizer_factory(model: nn.Module, optim: Any, device: torch.device,
                      factory: OptimizerFactory | None = None) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """``params -> the run's optimizer`` over some of ``model``'s parameters, named as the model names them (the
    signal report's one throw-away step: the update ratios the run's own optimizer, at its peak lr, would give)."""
    names = {id(p): n for n, p in model.named_parameters()}

    def make(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return build_optimizer([(names.get(id(p), "?"), p) for p in params], optim, device, factory, say=False)

    make.rebind = lambda other: optimizer_factory(other, optim, device, factory)  # type: ignore[attr-defined]  # a copy's
    return make


def _listed(names: list[str], limit: int = 4) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


_BUILD_FIRST = ("create every layer in the model's __init__, or run one forward on a sample batch in the task factory "
                "before returning the Task (lazy modules too), so that the optimizer is built over the final parameters")


def check_materialized(model: nn.Module, task_name: str) -> None:
    """Raise ValueError naming the model's uninitialized (lazy) parameters, which no optimizer can hold yet, or those
    on the meta device (no storage: torch's copy to the device failed with 'Cannot copy out of meta tensor'); and
    for a model with no trainable parameter."""
    lazy = [n for n, p in model.named_parameters() if isinstance(p, nn.parameter.UninitializedParameter)]
    if lazy:
        raise ValueError(f"task {task_name!r}: the model has {len(lazy)} uninitialized (lazy) parameter(s) "
                         f"({_listed(lazy)}), which the optimizer cannot hold before they exist: {_BUILD_FIRST}")
    meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"task {task_name!r}: the model has {len(meta)} parameter(s) or buffer(s) on the meta device "
                         f"({_listed(meta)}), which hold no values to train: materialize them in the task (e.g. "
                         "model.to_empty(device='cpu') then initialize them, or load a state dict with assign=True)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"task {task_name!r}: the model has no trainable parameters")


def check_optimizer_holds(model: nn.Module, optimizer: torch.optim.Optimizer, built_with: int, task_name: str) -> None:
    """Raise ValueError when ``model`` has trainable parameters ``optimizer`` does not hold; they would never train.

    A forward that creates or replaces layers (built at the first call, or re-built each time) does this
    silently: the optimizer, built before it, keeps updating the ``built_with`` parameters it was given.
    The loop asks once, after the first step (one pass over the parameters, no sync).
    """
    named = unique_params(model)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    missing = [n for n, p in named if id(p) not in held]
    if missing:
        raise ValueError(f"task {task_name!r}: the first step created or replaced {len(missing)} trainable parameter(s) "
                         f"the optimizer was not built with ({_listed(missing)}; {built_with} when the optimizer was "
                         f"built, {len(named)} after the first step): they would never train; {_BUILD_FIRST}")


#: Parameter-group keys a resume may see change: the parameters, the LR (the schedule's; optim.lr is a config key, checked
#: there) and how the step is computed, not what it computes.
_RESUMABLE_GROUP_KEYS = frozenset({"params", "lr", "initial_lr", "foreach", "fused", "capturable", "differentiable"})


def optimizer_change(saved: Any, optimizer: torch.optim.Optimizer) -> str | None:
    """How ``optimizer`` (the resumed run's, as its task builds it) differs from the checkpoint's state ``saved``: its
    parameter groups' number or settings (momentum, betas, eps, weight decay, another optimizer's keys); None when they
    agree or ``saved`` is no plain state dict (a sharded one). ``load_state_dict`` would put the old settings back in
    silence (a task's new SGD(momentum=0) trained with the checkpoint's 0.9), or fail inside torch."""
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        return None
    now = optimizer.param_groups
    name = type(optimizer).__name__
    if len(groups) != len(now):
        return f"its {name} has {len(now)} parameter group(s), the checkpoint's optimizer {len(groups)}"

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        try:
            return bool(a == b) or float(a) == float(b)
        except (TypeError, ValueError, RuntimeError):
            return False

    for i, (old, new) in enumerate(zip(groups, now)):
        keys = sorted((set(old) | set(new)) - _RESUMABLE_GROUP_KEYS)
        changed = [k for k in keys if k not in old or k not in new or not same(old[k], new[k])]
        if changed:
            shown = ", ".join(f"{k} {old.get(k, 'absent')!r} -> {new.get(k, 'absent')!r}" for k in changed[:4])
            return (f"its {name}'s settings differ from the checkpoint's optimizer (group {i}: {shown}"
                    f"{', ...' if len(changed) > 4 else ''})")
    return None
