"""An adapter's host as the source of the one capture: the steps it kept this interval, replayed as the host ran them.

The engine is the built-in loop's (:class:`~stabletrain.services.capture.IncidentCapture`: the interval
snapshot, the replay to just before the bad step, the bundle, the diagnosis), and the loop's own steps are
its other source (:class:`~stabletrain.services.incidents.LoopSteps`); :class:`HostSteps` feeds it with what
an adapter's host ran instead of the built-in data stream::

    every step (no sync)                      the adapter's PendingStep (its micro-batches, the RNG state at its
                                              first forward, the host's inputs), then keeper.keep(step): the
                                              batches off the device, each group's lr, the loss scale
    at a boundary whose rows hold a bad step k:
        replay_to(k)                          every applied step of the interval before k, with the host's own
                                              step (HostReplay.replay_step), from the interval's snapshot
        bundle                                the step's micro-batches as a dataset and how to rebuild the host's
                                              model, loss and optimizer (:mod:`~stabletrain.records.captured`);
                                              the diagnosis replays step k with the host's own loss

So no update is held back: the run loses exactly its bad steps. The live state, the host's RNG streams
(python, numpy, torch, CUDA) and its LR scheduler are as they were before the capture when it returns.

What it costs: the snapshot, once per interval, holds the model, the optimizer state and the loss scale in
host memory; the kept batches hold one interval of the host's micro-batches in host memory, at most
``keep_max_mib`` (beyond that, the interval's incidents are recorded but not captured, and an event says
so). A capture replays at most ``log_every - 1`` steps. On one process, where twice the snapshot fits
``capture.snapshot_memory_fraction`` (:meth:`HostSteps.wants_previous`), the snapshot before is kept too, and
the batches since it, within the same ``keep_max_mib`` (past it, the interval before's go first): a spike on
its interval's first step replays from there (``log_every`` steps) to be weighed under an older state.
Under DDP every rank replays together (the host's gradient all-reduce runs in the replay too); the rank that
saw the bad value sends its step (batches, RNG) to rank 0, which writes the bundle and diagnoses it on one process.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..internals import eager_methods, scaler_state, set_scaler_state
from ..policies.accumulation import as_sum_count
from ..records.batches import CapturedRows, batch_nbytes, bundle_batch, plain_batch, to_host, unbundle_batch, window_items
from ..records.captured import noop_optimizer, optimizer_factory, optimizer_recipe
from ..records.staging import load_optimizer_state_, snapshot_fits, state_bytes
from ..seeding import rng_state, set_rng_state
from ..tasks import Task
from .capture import staged_now
from .spike_reference import MAX_CONTEXT

__all__ = ["PendingStep", "KeptStep", "StepKeeper", "HostReplay", "HostSteps"]


class PendingStep:
    """The optimizer step a host is running: its micro-batches (kept for a capture), the RNG state where its
    first forward began, its summed loss and item count, the host's own inputs to it (see each adapter)."""

    def __init__(self) -> None:
        self.micro: list[Any] = []
        self.rng: dict[str, Any] | None = None
        self.loss: Tensor | None = None
        self.losses, self.parts = 0, 1  # the losses added; what the host divided each by
        self.count: Tensor | float = 0.0
        self.host: dict[str, Any] = {}

    def add(self, batch: Any, count: Tensor | float, *, rng: bool) -> None:
        """A micro-batch and the items its loss covers; ``rng``: take the RNG state at the step's first (no sync)."""
        if rng and not self.micro:
            self.rng = rng_state()
        self.micro.append(batch)
        self.count = self.count + (count.detach().float() if isinstance(count, Tensor) else float(count))

    def add_loss(self, loss: Tensor, parts: int = 1) -> None:
        """A micro-batch's loss as the host backpropagates it; ``parts``: the micro-batches the host divided each loss
        by (Lightning's ``accumulate_grad_batches``, whatever the window holds)."""
        self.loss = loss if self.loss is None else self.loss + loss
        self.losses, self.parts = self.losses + 1, parts

    @property
    def window_loss(self) -> Tensor | None:
        """The window's mean loss: the sum of what was backpropagated, a short window's (an epoch's last, fewer
        micro-batches than ``parts``) brought back from Lightning's division by ``parts`` to its own mean."""
        short = self.loss is not None and self.losses < self.parts
        return self.loss * (self.parts / self.losses) if short else self.loss


@dataclass
class KeptStep:
    """What a replay of one optimizer step needs (kept per step of the current interval)."""

    step: int
    micro: list[Any]                 # the micro-batches as the host handed them, in host memory
    rng: dict[str, Any] | None       # the RNG streams where the step's forward began
    lrs: list[Any]                   # each param group's lr for this step
    scaler: tuple[Tensor, Tensor] | None  # (scale, growth tracker) before the step
    host: dict[str, Any] = field(default_factory=dict)  # the host's own inputs to its step (see each adapter)
    ready: list[Any] = field(default_factory=list)      # CUDA events the micro-batches' copies complete at

    def batches(self) -> list[Any]:
        for event in self.ready:
            event.synchronize()
        self.ready = []
        return self.micro


class StepKeeper:
    """The current interval's :class:`KeptStep` s, their batches off the device, within ``max_bytes``; the steps up to
    ``spare_through`` (the interval before's, kept for a replay from the snapshot before) go first where they do not fit."""

    def __init__(self, max_bytes: float) -> None:
        self.max_bytes = max_bytes
        self.steps: dict[int, KeptStep] = {}
        self.nbytes = 0
        self.overflow_at: int | None = None  # the step whose batches went past the budget (nothing kept after it)
        self.spare_through = -1

    def keep(self, step: int, micro: list[Any], rng: dict[str, Any] | None, lrs: list[Any],
             scaler: tuple[Tensor, Tensor] | None, host: dict[str, Any] | None = None) -> None:
        if self.overflow_at is not None:
            return
        size = sum(batch_nbytes(b) for b in micro)
        if self.nbytes + size > self.max_bytes:
            self._drop(self.spare_through)
        if self.nbytes + size > self.max_bytes:
            self.overflow_at, self.steps, self.nbytes = step, {}, 0
            return
        ready: list[Any] = []
        self.steps[step] = KeptStep(step, [to_host(b, ready) for b in micro], rng, lrs, scaler, host or {}, ready)
        self.nbytes += size

    def clear(self) -> None:
        self.steps, self.nbytes, self.overflow_at = {}, 0, None

    def drop_through(self, cut: int, start: int) -> None:
        """Drop the steps up to ``cut`` (no replay starts before them any more); an interval starting after ``start``
        keeps its steps again after one went past the budget."""
        self._drop(cut)
        if self.overflow_at is not None and self.overflow_at <= start:
            self.overflow_at = None

    def _drop(self, cut: int) -> None:
        for t in [t for t in self.steps if t <= cut]:
            self.nbytes -= sum(batch_nbytes(b) for b in self.steps.pop(t).micro)


class HostReplay:
    """How an adapter replays its host's step (each adapter's subclass); by default nothing to switch off or detach."""

    def replay_step(self, kept: KeptStep) -> None:
        """Run the kept step's forward/backward, clipping and update exactly as the host ran them."""
        raise NotImplementedError

    def diagnosis_loss(self, kept: KeptStep) -> Callable[[nn.Module, Any], Any] | None:
        """``loss(model, batch)`` as the host computed the kept step's loss (None: no diagnosis)."""
        raise NotImplementedError

    def replaying(self) -> contextlib.AbstractContextManager:
        """The adapter's own hooks and the host's logging off, while the capture replays."""
        return contextlib.nullcontext()

    def detached(self) -> contextlib.AbstractContextManager:
        """The model as a plain module (no trainer attached), while the diagnosis deep-copies and replays it."""
        return contextlib.nullcontext()


def current_lrs(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Each param group's lr (a tensor lr is cloned: the host's scheduler updates it in place)."""
    return [g["lr"].detach().clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in optimizer.param_groups]


def set_lrs(optimizer: torch.optim.Optimizer, lrs: list[Any]) -> None:
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], Tensor):
            group["lr"].copy_(lr if isinstance(lr, Tensor) else torch.tensor(lr))
        else:
            group["lr"] = float(lr) if isinstance(lr, Tensor) else lr


class HostSteps:
    """A host's kept steps and its own replay of them, as a :class:`~stabletrain.services.capture.StepSource`.

    Args:
        session: the adapter's run (:class:`~stabletrain.integrations.core.RunSession`).
        replay: the host's :class:`HostReplay` (None: no bad step is captured; nothing would replay or diagnose it).
        max_keep_mib: the budget for one interval's kept batches, in MiB.
    """

    def __init__(self, session: Any, replay: HostReplay | None, max_keep_mib: float) -> None:
        self.session, self.replay = session, replay
        self.keeper = StepKeeper(max_keep_mib * 2**20)
        self.strategy, self.module, self.optimizer = session.strategy, session.model, session.optimizer
        self.run_dir, self.diagnose = session.run_dir, session.options.diagnose
        self._kept: KeptStep | None = None
        self._newest_context: int | None = None  # the step of the newest ordinary window record() gathered
        self._previous: tuple[dict[str, Any], KeptStep] | None = None

    def capturing(self, fit: Any = None) -> bool:
        """Whether a capture can be written: asked for, and some rank has a run directory (rank 0's)."""
        s = self.session
        return s.options.capture and (s.run is not None or s.dist.world > 1) and s.run_dir is not None

    def live_state(self) -> dict[str, Any]:
        s = self.session
        out: dict[str, Any] = {"model": s.model.state_dict()}
        if s.optimizer is not None:
            out["optimizer"] = s.optimizer.state_dict()
        if s.scaler is not None:
            out["scaler"] = scaler_state(s.scaler)
        return out

    def load_live_state(self, state: dict[str, Any]) -> None:
        s = self.session
        s.model.load_state_dict(state["model"])
        if "optimizer" in state:
            load_optimizer_state_(s.optimizer, state["optimizer"])  # in place: the host's wrappers hold the live one
        if s.scaler is not None:
            set_scaler_state(s.scaler, state.get("scaler"))

    bundle_state = live_state

    def wants_previous(self) -> bool:
        """Whether the snapshot before the interval's is kept too (``IntervalSnapshot.keep_previous``, read by the capture
        at the first interval start it snapshots): on one process where spikes are captured and replayed, if twice the
        snapshot (the model and optimizer state; the optimizer's estimated before its first step made it) fits
        ``capture.snapshot_memory_fraction`` of the host memory available now."""
        s = self.session
        if s.dist.world > 1 or self.replay is None or not (s.cfg.capture.spikes and self.capturing()):
            return False
        one = (self.strategy.snapshot_bytes(self.live_state(), self.module, self.optimizer) if self.optimizer is not None
               else state_bytes(self.live_state()))
        return snapshot_fits(2 * one, s.cfg.capture.snapshot_memory_fraction)[0]

    def keep(self, step: int, micro: list[Any], rng: dict[str, Any] | None, host: dict[str, Any] | None = None) -> None:
        """Keep what a replay of ``step`` needs (batches copied off the device without a sync)."""
        if self.replay is None or not self.capturing():
            return
        s = self.session
        lrs = current_lrs(s.optimizer) if s.optimizer is not None else []
        scale = scaler_state(s.scaler) if s.scaler is not None else None
        self.keeper.keep(step, micro, rng, lrs, scale, host)

    def fallback_state(self, fit: Any) -> None:
        return None  # the host owns its checkpoints

    def reference_state(self, fit: Any, before: int, unlike: Any, oldest: int = 0) -> None:
        return None  # the host owns its checkpoints

    def interval_started(self, retired: int | None, step: int) -> list[float] | None:
        """Drop the kept steps no replay needs (they piled up over the run: past the budget, every later capture
        failed); the lrs step ``step`` ran at (kept before the host's scheduler stepped; ``[]``: not kept)."""
        kept = self.keeper.steps.get(step)
        self.keeper.drop_through(retired if retired is not None else -1, step)
        self.keeper.spare_through = step - MAX_CONTEXT  # what only a replay from the snapshot before needs
        return [float(lr) for lr in kept.lrs] if kept is not None and kept.lrs else []

    def why_not(self, step: int, start: int | None) -> str | None:
        if self.replay is None:  # (one on the interval's first step needs none to reach it, but its diagnosis does)
            return "no replay of the host's steps (pass loss_fn= to replay them)"
        if start is None:
            return None
        missing = [t for t in range(start + 1, step + 1) if t not in self.keeper.steps]
        if self.keeper.overflow_at is not None:
            return (f"the interval's batches went past keep_max_mib={self.keeper.max_bytes / 2**20:g} at step "
                    f"{self.keeper.overflow_at}")
        if missing:
            return f"the batches of steps {missing} were not kept"
        if not self.keeper.steps[step].micro:
            return ("the step's batch was not given (Monitor: monitor.step(batch, ...), or with accumulation "
                    "monitor.backward(loss, batch) per micro-batch or monitor.step(micro_batches=[...], ...))")
        return None

    def stretch_lrs(self, start: int, step: int) -> list[list[float]] | None:
        kept = [(t, self.keeper.steps[t].lrs) for t in range(start, step) if t in self.keeper.steps]
        return [[t, max(float(lr) for lr in lrs)] for t, lrs in kept if lrs] or None

    def replay_to(self, fit: Any, step: int, start: int, locate: Any, rows: list[Any] = (),
                  keep_previous: bool = False) -> tuple[int, None]:
        applied = {r.step: r.values["applied"] >= 0.5 for r in rows}
        replayed = 0
        self._previous = None
        if any(t not in self.keeper.steps for t in range(start + 1, step) if applied.get(t, True)):
            return 0, None  # from the snapshot before, its steps let go (keep_max_mib): the capture finds it not come back
        for t in range(start + 1, step):
            if not applied.get(t, True):  # skipped live: parameters and optimizer state did not move
                continue
            kept = self.keeper.steps[t]
            if keep_previous and t == step - 1:  # a spike's: the state before the step before it
                self._previous = (staged_now(self.live_state()), kept)
            if kept.rng is not None:
                set_rng_state(kept.rng)
            if self.optimizer is not None:
                set_lrs(self.optimizer, kept.lrs)
            if self.session.scaler is not None:
                set_scaler_state(self.session.scaler, kept.scaler)
            kept.batches()
            self.replay.replay_step(kept)
            replayed += 1
        if self.optimizer is not None and step in self.keeper.steps:  # the lrs as the host's scheduler left them: step's
            set_lrs(self.optimizer, self.keeper.steps[step].lrs)
        return replayed, None

    def record(self, fit: Any, step: int, context: int = 0, avoid: Collection[int] = (), seen: int | None = None
               ) -> dict[str, Any]:
        self._kept = kept = self.keeper.steps[step]
        steps = [t for t in sorted(self.keeper.steps, reverse=True) if t < step and t not in avoid][:context]
        self._newest_context = steps[0] if steps else None  # (a flagged step before the spike is no ordinary window)
        earlier = [self.keeper.steps[t] for t in steps]
        return {"rank": fit.dist.rank, "micro": [plain_batch(b) for b in kept.batches()], "rng": kept.rng,
                "context": [[plain_batch(b) for b in k.batches()] for k in reversed(earlier)],
                "lrs": [float(lr) for lr in kept.lrs],
                "scaler": (float(kept.scaler[0]), int(kept.scaler[1])) if kept.scaler is not None else None,
                "host": {**{k: (v.item() if isinstance(v, Tensor) else v) for k, v in kept.host.items()
                            if k in ("num_items_in_batch", "accumulation_steps") or (k == "loss_factor" and v != 1)},
                         # a loss divided by the window's item count: the count its parts are weighed on
                         **({"window_items": window_items(kept.batches())} if kept.host.get("items_normalized") else {})}}

    def blame(self, fit: Any, spike: bool = False) -> list[int] | None:
        """A finite spike under DDP: the rank whose own loss on its kept batches is the largest (the host's loss as
        the diagnosis computes it, no gradients, the step's RNG, one collective); None otherwise."""
        s = self.session
        if not spike or s.dist.world <= 1:
            return None
        from ..data import move_to
        from ..distributed.blame import own_loss_rank
        from ..policies.precision import PrecisionPolicy

        loss = self.replay.diagnosis_loss(self._kept) if self.replay is not None and self._kept is not None else None

        def own() -> float:  # the host's loss on this rank's window (its own normalization)
            if loss is None:
                return float("nan")
            with torch.no_grad(), PrecisionPolicy(s.precision, s.device).autocast():
                sums = [as_sum_count(loss(s.model, move_to(b, s.device)), 1) for b in self._kept.batches()]
            count = sum(float(c) for _, c in sums)
            return sum(float(x) for x, _ in sums) / count if count else float("nan")

        return own_loss_rank(s.dist, own, self._kept.rng if self._kept is not None else None)

    def bundle(self, fit: Any, step: int, record: dict[str, Any], before: dict[str, Any],
               info: dict[str, Any]) -> dict[str, Any]:
        import dataclasses

        from ..config import SchedConfig, TrainConfig, config_to_dict
        from ..records.captured import TASK_SPEC

        s = self.session
        # A spike's ordinary windows (the interval's kept steps before it) ride as more micro-batches of the dataset.
        context = record.get("context") or []
        # The step before's own window rides too where it is not the newest ordinary one (a flagged step: not one)
        own = ([plain_batch(b) for b in self._previous[1].batches()]
               if self._previous is not None and self._newest_context != step - 1 else [])
        batches = [*record["micro"], *(b for step_batches in context for b in step_batches), *own]
        rows = CapturedRows(batches)
        groups, n = rows.indices(), len(record["micro"])
        ordinary, at = [], n
        for step_batches in context:
            ordinary.append(groups[at:at + len(step_batches)])
            at += len(step_batches)
        window = groups[at:] if own else ordinary[-1] if ordinary else None  # the step before's
        opt = s.optimizer
        opt_recipe = optimizer_recipe(opt, s.named_params) if opt is not None else None
        task_args = {"batches": [bundle_batch(b) for b in batches], "model": s.recipes.get("model"),
                     "loss": s.recipes.get("loss"), "optimizer": opt_recipe, "name": f"{s.host}:{type(s.model).__name__}",
                     "host": record["host"]}
        # The replay's update uses the host's optimizer at the step's lr: a constant schedule over the bundle's lrs.
        replay_cfg = dataclasses.replace(s.cfg, task=TASK_SPEC, task_args=task_args,
                                         train=TrainConfig(max_steps=1, compile=s.cfg.train.compile),
                                         sched=SchedConfig(warmup_steps=0, decay="constant"))
        previous = None
        if self._previous is not None and window:  # the step before: its state, lrs, scaler and RNG, its window
            prev, kept = self._previous
            previous = {"step": step - 1, "window": window, "model": prev["model"], "rng": kept.rng,
                        "optimizer": prev.get("optimizer") if opt_recipe is not None else
                        noop_optimizer(s.named_params).state_dict(),
                        "schedule": {"applied_steps": torch.zeros(()), "base_lrs": [float(lr) for lr in kept.lrs]},
                        "precision": {"mode": s.precision, "scaler": _scaler_dict(
                            s.scaler, (float(kept.scaler[0]), int(kept.scaler[1])) if kept.scaler is not None else None)}}
        return {
            "previous": previous, "step": step, "rank": record["rank"], "world_size": s.dist.world, "host": s.host,
            "config": config_to_dict(replay_cfg), "window": {"epoch": s.epoch, "start": 0, "indices": groups[:n]},
            "sample_unit": "position in the step's batch",
            "rng": record["rng"] if record["rng"] is not None else rng_state(),
            "model": before["model"],
            "optimizer": before["optimizer"] if opt is not None and opt_recipe is not None else
            noop_optimizer(s.named_params).state_dict(),
            "schedule": {"applied_steps": torch.zeros(()), "base_lrs": record["lrs"] if opt_recipe is not None else [0.0]},
            "precision": {"mode": s.precision, "scaler": _scaler_dict(s.scaler, record["scaler"])},
            "observed": {"after_update": info["after_update"], "host_loss": info.get("loss"),
                         "grad_norm": info.get("grad_norm"), "ranks": info.get("ranks") or [],
                         **({"context": ordinary} if ordinary else {})},
        }

    def diagnosis(self, bundle: dict[str, Any]) -> tuple[Task, contextlib.AbstractContextManager, tuple[str, ...]]:
        s = self.session
        loss = self.replay.diagnosis_loss(self._kept) if self.replay is not None else None
        if loss is None:
            raise ValueError("no loss function to replay the step with (pass loss_fn= to the adapter)")
        rows = CapturedRows([unbundle_batch(b) for b in bundle["config"]["task_args"]["batches"]])
        recipe = bundle["config"]["task_args"]["optimizer"]
        task = Task(model=s.model, train_data=rows, loss=loss, collate=rows.collate,
                    name=f"{s.host}:{type(s.model).__name__}", optimizer=optimizer_factory(recipe))
        # Eagerly, on the bundle's weights in a copy: a module compiled in place (Lightning) runs its class's methods.
        context = contextlib.ExitStack()
        context.enter_context(self.replay.detached())
        context.enter_context(eager_methods(s.model))
        return task, context, ("bad_positions",)

    def replaying(self) -> contextlib.AbstractContextManager:
        return self.replay.replaying() if self.replay is not None else contextlib.nullcontext()


def _scaler_dict(scaler: Any, state: tuple[float, int] | None) -> dict[str, Any] | None:
    """The scaler's ``state_dict()`` with the scale and growth tracker of the bad step (read once, at capture)."""
    if scaler is None:
        return None
    out = scaler.state_dict()
    if state is not None:
        out["scale"], out["_growth_tracker"] = float(state[0]), int(state[1])
    return out



