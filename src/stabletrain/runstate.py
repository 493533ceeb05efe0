"""The run's one state object: its setup, its parts, its progress and records, saved and restored as a whole.

:class:`RunState` is what the loop, its services (the checkpoint keeper, the incident recorder, the remedy
applier, the interval boundary) and the callbacks are all handed: the same object, never the trainer. It
owns the parts the next step depends on and their state dicts::

    setup      cfg, task, module (the model itself), model (its wrapper), named_params, device, dist, strategy
    parts      optimizer, schedule, precision_policy, clipper, guard, metrics, stream, callbacks, remedies, precursor
    the step   train_step(window, ...): the one optimizer step, as the loop runs it (replays use it)
    progress   step, samples_seen, tokens_seen, history, positions, stop_reason
    records    run (the run directory, rank 0), ckpt (the checkpoints)

A checkpoint, the incident snapshot and a replay save and restore it through :meth:`RunState.state_dict`; the
model and optimizer go through the run's strategy (:mod:`stabletrain.distributed.strategy`), so the same
checkpoint loads under any strategy and world size. An adapter's run (:mod:`stabletrain.integrations`) has
the setup, the progress and the records, and the parts it measures with (guard, metrics, callbacks); the
host owns the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from torch import nn

from .errors import clean_exit, crash_event, exit_call
from .records.rundir import append_event
from .seeding import rng_state, seed_everything, set_rng_state

__all__ = ["RunState"]

#: The parts saved beside the model and optimizer, in the order they are restored: (state dict key, attribute).
#: The schedule after the optimizer (it rewrites its lr tensors); the remedies after the schedule and clipper (they
#: re-apply to them).
PARTS = (("schedule", "schedule"), ("precision", "precision_policy"), ("clipper", "clipper"), ("guard", "guard"),
         ("metrics", "metrics"), ("stream", "stream"), ("callbacks", "callbacks"), ("remedies", "remedies"),
         ("precursor", "precursor"))
_NEWER = ("callbacks", "remedies", "precursor")
#: The keys of :meth:`RunState.state_dict` whose values each call makes afresh, tensors cloned (our own parts, the RNG
#: states, the counters; not the user's callbacks): nothing the run changes later, so on CPU an interval snapshot keeps
#: them as they are instead of staging a copy (:attr:`~stabletrain.services.incidents.LoopSteps.fresh_parts`). A list
#: to extend by hand: a new part is copied until its state_dict is known fresh (tests/test_snapshot_parts.py).
FRESH_KEYS = frozenset({"schedule", "precision", "clipper", "guard", "metrics", "stream", "remedies", "precursor", "rng",
                        "counters"})


@dataclass(eq=False)
class RunState:
    """The run's setup, parts, progress and records (see the module docstring).

    Attributes:
        cfg: the resolved :class:`~stabletrain.config.Config`.
        task: the :class:`~stabletrain.tasks.Task` being trained (None in an adapter).
        module: the model itself (under DDP, not the wrapper); ``model``: what the step calls (the wrapper).
        named_params: the trainable (name, parameter) pairs the step covers.
        device, dist: the device and the :class:`~stabletrain.distributed.group.DistContext`.
        stream: the :class:`~stabletrain.data.WindowStream` the loop reads windows from (None in an adapter).
        precision: the resolved precision mode ("fp32", "bf16", "fp16"); ``precision_policy``: the policy (autocast
            and the GradScaler) whose state is saved.
        strategy, optimizer, schedule, clipper, guard, metrics, callbacks, remedies, precursor: the run's parts.
        train_step: the one optimizer step on a window, exactly as the loop runs it (the trainer sets it).
        run: the :class:`~stabletrain.records.rundir.RunDir` (rank 0 with a run dir), else None.
        ckpt: the :class:`~stabletrain.records.checkpoint.CheckpointManager` (every rank with a run dir), else None.
        step, samples_seen, tokens_seen: progress (optimizer steps taken, skipped ones included).
        history: every metrics record of this process.
        positions: step -> (epoch, start) of its data window, for the current interval's steps.
        stop_reason: set when the run stops early (guard, signal).
        fitted: whether ``fit()`` began (a Trainer fits once: :meth:`begin_fit`).
        steps_from: when the fit's first interval began (``time.time()``; None before).
    """

    cfg: Any
    task: Any
    module: nn.Module
    named_params: list[tuple[str, nn.Parameter]]
    device: Any
    dist: Any
    stream: Any = None
    run: Any = None
    ckpt: Any = None
    run_dir: Any = None  # the run directory's path, on every rank (rank 0 alone holds ``run``)
    precision: str = "fp32"
    model: Any = None
    strategy: Any = None
    optimizer: Any = None
    schedule: Any = None
    precision_policy: Any = None
    clipper: Any = None
    guard: Any = None
    metrics: Any = None
    callbacks: Any = None
    remedies: Any = None
    precursor: Any = None
    train_step: Callable[..., dict[str, Any]] | None = None
    step: int = 0
    samples_seen: int = 0
    tokens_seen: float = 0.0
    history: list[dict[str, Any]] = field(default_factory=list)
    positions: dict[int, tuple[int, int]] = field(default_factory=dict)
    stop_reason: str | None = None
    fitted: bool = False
    steps_from: float | None = None  # time.time() the fit's first interval began (its set-up before: start-up)

    def __post_init__(self) -> None:
        if self.model is None:
            self.model = self.module

    def event(self, step: int, kind: str, reason: str, *, own: bool = False, **fields: Any) -> None:
        """Record an event in ``events.jsonl`` (rank 0 with a run dir; a no-op elsewhere). ``own``: what only this rank
        knows (its own crash): another rank of a run with a run dir appends it there itself, naming itself."""
        if self.run is not None:
            self.run.event(step, kind, reason, **fields)
        elif own and self.dist.enabled and self.run_dir is not None:
            append_event(self.run_dir, step, kind, f"rank {self.dist.rank}: {reason}", rank=self.dist.rank, **fields)

    def crash(self, err: BaseException, during: str, failed: int) -> None:
        """Record ``err``'s ``crash`` event (the user's file:line; ``failed``: the step whose work raised it). Recorded
        again where another exception cuts it short: torch's SIGCHLD handler raises at any bytecode for each DataLoader
        worker gone, and a second one's may land in here, leaving the run without the record of what ended it."""
        for attempt in range(3):
            try:
                reason, fields = crash_event(err, during, failed)
                if clean_exit(err):  # a sys.exit(0) in the code the loop ran (the task's): an end it asked for, a stop
                    where = f" at {fields['location']}" if fields.get("location") else ""
                    self.event(self.step, "stop", f"stopping: the {'task' if fields.get('part') else 'training'}'s code "
                               f"called {exit_call(err)}{where}", own=True, failed_step=failed, task_exit=True, **fields)
                    return
                self.event(self.step, "crash", reason, own=True, failed_step=failed, **fields)
                return
            except Exception:  # noqa: BLE001  (an exception raised into this frame, not by it: again)
                if attempt == 2:
                    raise

    def begin_fit(self) -> dict[str, Any]:
        """Mark the fit begun (an empty metrics record); a second ``fit()`` of the same Trainer is one clear error."""
        if self.fitted:
            raise RuntimeError(f"Trainer.fit(): this Trainer already ran its fit (to step {self.step}, its run closed); "
                               f"to train on, resume its run directory in a new Trainer(cfg, run_dir=..., resume=True) "
                               f"with a larger train.max_steps")
        self.fitted = True
        return {}

    def stop(self, reason: str) -> None:
        """Stop the run early (the guard, a signal): the reason, a ``stop`` event and the callbacks' ``on_stop``."""
        self.stop_reason = reason
        self.event(self.step, "stop", f"stopping: {reason}")
        if self.callbacks is not None:
            self.callbacks.fire("on_stop", self, reason)

    def state_dict(self, *, local: bool = False, dcp: bool = False) -> dict[str, Any]:
        """Everything the next step depends on (model, optimizer, the parts, data position, RNG, counters).

        This rank's: under DDP a checkpoint adds every rank's RNG state and data position (``ranks``).
        ``local``/``dcp`` (FSDP): the model and optimizer as this rank's own shards, or as DCP's sharded
        state dicts (:meth:`~stabletrain.distributed.strategy.Strategy.state`).
        """
        model_state, optim_state = self.strategy.state(self.module, self.optimizer, self.named_params, local=local,
                                                       dcp=dcp)
        return {"model": model_state, "optimizer": optim_state,
                **{key: getattr(self, attr).state_dict() for key, attr in PARTS}, "rng": rng_state(),
                "counters": {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen}}

    def progress_state(self, *parts: str) -> dict[str, Any]:
        """The counters and the named parts' state dicts, in one flat dict (an adapter's, in its host's checkpoint)."""
        return {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen,
                **{key: getattr(self, attr).state_dict() for key, attr in PARTS if key in parts}}

    def load_progress_state(self, state: dict[str, Any]) -> None:
        """Restore :meth:`progress_state`: the counters and each part it holds (a newer part it lacks: afresh)."""
        self.step, self.samples_seen = int(state["step"]), int(state["samples_seen"])
        self.tokens_seen = float(state["tokens_seen"])
        for key, attr in PARTS:
            if getattr(self, attr) is not None and (key in state or key in _NEWER):
                getattr(self, attr).load_state_dict(state.get(key, {}))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (or a checkpoint: this rank's RNG and data position from ``ranks``).

        A checkpoint written under another world size is resharded: the model and optimizer load into any
        world size and strategy (:meth:`~stabletrain.distributed.strategy.Strategy.load_state`); the data
        continues from the same global sample position (:class:`~stabletrain.data.WindowStream`); rank r
        takes rank r's saved RNG state, and a rank that did not exist a state seeded from (seed, rank, step).
        """
        ranks = state.get("ranks")
        if ranks is None and int(state["stream"].get("world_size", self.dist.world)) != self.dist.world:
            ranks = [{"rng": state["rng"], "stream": state["stream"]}]  # a one-process checkpoint, under another world
        if ranks is not None:  # else: this rank's own state (a round trip)
            if len(ranks) != self.dist.world and "global_batch" not in ranks[0]["stream"]:
                raise ValueError(f"the state was written by {len(ranks)} process(es), before checkpoints recorded "
                                 f"their data layout, and this run has {self.dist.world}; resume it under {len(ranks)}")
            mine = ranks[self.dist.rank] if self.dist.rank < len(ranks) else None  # a rank the saved run had
            state = {**state, "rng": mine["rng"] if mine else None, "stream": (mine or ranks[0])["stream"]}
        self.strategy.load_state(self.module, self.optimizer, self.named_params, state["model"], state["optimizer"])
        for key, attr in PARTS:  # callbacks, remedies, precursor: {} in checkpoints written before them
            getattr(self, attr).load_state_dict(state.get(key, {}) if key in _NEWER else state[key])
        c = state["counters"]
        self.step, self.samples_seen, self.tokens_seen = int(c["step"]), int(c["samples_seen"]), float(c["tokens_seen"])
        if state["rng"] is not None:
            set_rng_state(state["rng"])
        else:  # a rank the checkpoint's run did not have: its own stream, reproducible from (seed, rank, step)
            seed_everything(int(np.random.SeedSequence([self.cfg.seed, self.dist.rank, self.step]).generate_state(1)[0]))
