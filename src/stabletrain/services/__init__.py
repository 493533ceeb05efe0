"""What the loop drives by name: the checkpoint keeper, the incident recorder, the remedy applier, the signal handler.

A service is not a callback: the loop calls its methods where the run needs them and gets their results
back (a callback only observes and reacts through hooks). A service that saves, restores or replays the
run's state is given the trainer's operations for it (:class:`TrainerOps`), not the trainer itself.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["TrainerOps"]


class TrainerOps(Protocol):
    """The trainer's state and step operations a service needs (the built-in ``Trainer`` provides them)."""

    strategy: Any  # the run's Strategy (stabletrain.distributed.strategy): sharded / replicated
    optimizer: Any  # the run's torch optimizer (the incident snapshot orders its copies before its step)
    # The remedy applier (services.remedies) puts a remedy on these: the config, the task, the model (not a wrapper),
    # the LR schedule, the clipper, the precision policy (the GradScaler), the guard (its counters outlive a rollback)
    # and the data stream (dropped samples).
    precision: Any
    stream: Any
    cfg: Any
    task: Any
    module: Any
    schedule: Any
    clipper: Any
    guard: Any

    def state_dict(self, *, local: bool = False, dcp: bool = False) -> dict[str, Any]:
        """Everything the next step depends on (see ``Trainer.state_dict``)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` or a checkpoint."""

    def train_step(self, window: Any, *, measure_update: bool = False, check_params: bool = True) -> dict[str, Any]:
        """Run the one optimizer step on a window, exactly as the loop does (replays use it)."""
