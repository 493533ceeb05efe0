"""The trainer's state as one dict: everything the next step depends on, saved and restored as a whole.

A checkpoint, the incident snapshot and a replay all save and restore it through :class:`TrainState`;
the model and optimizer go through the run's strategy (:mod:`stabletrain.distributed.strategy`), so the
same checkpoint loads under any strategy and world size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .seeding import rng_state, seed_everything, set_rng_state

__all__ = ["TrainState"]


class TrainState:
    """:meth:`state_dict` / :meth:`load_state_dict` of a trainer (mixed into :class:`stabletrain.loop.Trainer`)."""

    strategy: Any

    def state_dict(self, *, local: bool = False, dcp: bool = False) -> dict[str, Any]:
        """Everything the next step depends on (model, optimizer, policies, data position, RNG, counters, callbacks).

        This rank's: under DDP a checkpoint adds every rank's RNG state and data position (``ranks``).
        ``local``/``dcp`` (FSDP): the model and optimizer as this rank's own shards, or as DCP's sharded
        state dicts (:meth:`~stabletrain.distributed.strategy.Strategy.state`).
        """
        model_state, optim_state = self.strategy.state(self.module, self.optimizer, self.named_params, local=local,
                                                       dcp=dcp)
        return {"model": model_state, "optimizer": optim_state, "schedule": self.schedule.state_dict(),
                "precision": self.precision.state_dict(), "clipper": self.clipper.state_dict(),
                "guard": self.guard.state_dict(), "metrics": self.metrics.state_dict(), "stream": self.stream.state_dict(),
                "rng": rng_state(), "callbacks": self.callbacks.state_dict(), "remedies": self.remedies.state_dict(),
                "precursor": self.boundary.precursor.state_dict(),
                "counters": {"step": self.step, "samples_seen": self.samples_seen, "tokens_seen": self.tokens_seen}}

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
        self.schedule.load_state_dict(state["schedule"])  # after the optimizer: rewrites its lr tensors
        for part, key in ((self.precision, "precision"), (self.clipper, "clipper"), (self.guard, "guard"),
                          (self.metrics, "metrics"), (self.stream, "stream")):
            part.load_state_dict(state[key])
        self.callbacks.load_state_dict(state.get("callbacks", {}))
        self.remedies.load_state_dict(state.get("remedies", {}))  # after the schedule and clipper: it re-applies to them
        self.boundary.precursor.load_state_dict(state.get("precursor", {}))
        c = state["counters"]
        self.step, self.samples_seen, self.tokens_seen = int(c["step"]), int(c["samples_seen"]), float(c["tokens_seen"])
        if state["rng"] is not None:
            set_rng_state(state["rng"])
        else:  # a rank the checkpoint's run did not have: its own stream, reproducible from (seed, rank, step)
            seed_everything(int(np.random.SeedSequence([self.cfg.seed, self.dist.rank, self.step]).generate_state(1)[0]))
