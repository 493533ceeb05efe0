"""One way to rebuild a run from a saved state on this process: what the diagnosis, the remedies and the capture replay on.

A saved state (an incident bundle, a checkpoint, the state a live capture staged) holds the model, the
optimizer, the LR schedule, the precision policy (the GradScaler's state) and the RNG streams.
:class:`Replica` rebuilds the run's one step from it, over a copy of the task's model::

    replica = Replica(cfg, task, state, device)   # a copy of the task's model holding the state's weights
    step = replica.step()                         # the run's TrainStep: its optimizer, schedule and scaler as saved
    replica.reset()                               # the saved weights and RNG streams again

A replica's step never enters a collective (:class:`LocalWindow`): a replay runs on one process, whatever
the run did. Every replay of a saved state builds its step here, so the incident's diagnosis, a remedy's
replay and the capture's bundle agree on what "the run's step" is.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from .numerics import unique_params
from .policies.accumulation import AccumulationWindow
from .policies.clipping import GradClipper
from .policies.optim import build_optimizer
from .policies.precision import PrecisionPolicy
from .policies.schedule import LRSchedule
from .records.staging import clone_state
from .seeding import set_rng_state
from .step import TrainStep, build_step

__all__ = ["Replica", "LocalWindow", "local", "copy_precision", "KEEP"]

#: ``Replica.step(max_norm=KEEP)``: the run's own clipping threshold.
KEEP: Any = object()
#: The param-group keys that choose an optimizer's kernel: a replica keeps the ones it was built with.
_KERNEL = ("fused", "foreach", "capturable", "differentiable")


class LocalWindow(AccumulationWindow):
    """The run's accumulation window on this process alone: a replay must not enter a collective."""

    def _world(self) -> int:
        return 1


def local(step: TrainStep) -> TrainStep:
    """``step`` with a :class:`LocalWindow` that accumulates as its own did (raw sums or not); returned."""
    step.window = LocalWindow(step.params, sums=step.window.sums)
    return step


def copy_precision(state: dict[str, Any] | PrecisionPolicy, device: torch.device | str) -> PrecisionPolicy:
    """A new precision policy on ``device`` in the mode and GradScaler state of ``state`` (a policy or its state_dict)."""
    if isinstance(state, PrecisionPolicy):
        state = state.state_dict()
    return PrecisionPolicy.from_state(state, device)


class Replica:
    """A run rebuilt from ``state`` on this process (see the module docstring).

    Args:
        cfg: the run's :class:`~stabletrain.config.Config` (optimizer, schedule, clipping, guard checks).
        task: the run's task: its model is copied (never touched), its optimizer factory used.
        state: ``model``, ``optimizer``, ``schedule``, ``precision`` and ``rng`` in the one-process format.
        device: where to run.
        model: a model to load the state into instead of a copy of the task's.
    """

    def __init__(self, cfg: Any, task: Any, state: dict[str, Any], device: torch.device | str, *,
                 model: nn.Module | None = None) -> None:
        self.cfg, self.task, self.state, self.device = cfg, task, state, torch.device(device)
        self.model = model if model is not None else copy.deepcopy(task.model).to(self.device)
        self.model.load_state_dict(state["model"])
        self.named_params = unique_params(self.model)
        self.params = [p for _, p in self.named_params]

    def precision(self, mode: str | None = None, state: dict[str, Any] | None = None) -> PrecisionPolicy:
        """The run's precision policy as saved; ``mode``: a fresh one in another mode; ``state``: that state instead. Its
        one warning (an optimizer that cannot skip on the device reads its skip flag on the host) is the run's, not each
        replay's: a diagnosis said it once per step it replayed."""
        policy = (PrecisionPolicy(mode, self.device) if mode is not None else
                  copy_precision(state if state is not None else self.state["precision"], self.device))
        policy._warned_sync = True
        return policy

    def optimizer(self) -> torch.optim.Optimizer:
        """The run's optimizer class over the replica's parameters, with the saved state."""
        optimizer = build_optimizer(self.named_params, self.cfg.optim, self.device, self.task.optimizer, say=False)
        # torch's load_state_dict keeps the given tensors where device and dtype match: the saved state would be
        # updated in place by this replay and seen by the next one. Each optimizer gets its own copy.
        built = [{k: g[k] for k in _KERNEL if k in g} for g in optimizer.param_groups]
        optimizer.load_state_dict(clone_state(self.state["optimizer"]))
        for group, kernel in zip(optimizer.param_groups, built):  # the kernel this process built, not the run's: FSDP's
            group.update(kernel)  # foreach SGD (no fused DTensor rule) saved fused=False into a fused one, which then took
        return optimizer  # a found_inf it cannot read ("Expected grad_scale and found_inf to be None")

    def step(self, *, optimizer: bool = True, precision: PrecisionPolicy | None = None, lr_factor: float = 1.0,
             max_norm: Any = KEEP, guard: Any = None) -> TrainStep:
        """The run's step over the replica, as it was at the state (a fresh optimizer, schedule and scaler each call).

        ``optimizer=False``: a step that measures without updating. ``precision``: another policy (a remedy's);
        ``lr_factor``: the schedule's LR scaled; ``max_norm``: another clipping threshold (None: none).
        """
        precision = precision if precision is not None else self.precision()
        opt = schedule = None
        if optimizer:
            opt = self.optimizer()
            sched = self.cfg.sched
            schedule = LRSchedule(opt, sched.warmup_steps, self.cfg.train.max_steps, sched.decay, sched.min_lr_ratio)
            schedule.load_state_dict(self.state["schedule"])
            if lr_factor != 1.0:
                schedule.scale(lr_factor)
        step = local(build_step(self.cfg, self.model, opt, precision, schedule=schedule, params=self.params, guard=guard))
        if max_norm is not KEEP:
            step.clipper = GradClipper(max_norm)
        return step

    def reset(self) -> None:
        """Put the saved weights and RNG streams back (the optimizer, schedule and scaler are rebuilt per :meth:`step`)."""
        self.model.load_state_dict(self.state["model"])
        if self.state.get("rng") is not None:
            set_rng_state(self.state["rng"])
