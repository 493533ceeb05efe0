"""Incident bundles: what replaying one bad step needs, on disk, and the diagnosis that reads them.

``RUN_DIR/incidents/step_N/``::

    bundle.pt        the step number and rank, the resolved config, the window's dataset indices
                     (epoch, position, micro-batches), the RNG states at the start of the step, the
                     model / optimizer / schedule / precision state live before the step, and what the
                     run observed (loss, grad norm, whether the bad value appeared after the update)
    diagnosis.json   written by :func:`diagnose_incident` (``stabletrain diagnose``)
    rank_R/          DDP only: the bundle of another rank that saw the same bad step

Under DDP the bundle is that of the rank whose own loss, inputs or gradients were non-finite (its
``rank``, its window of its data shard, its RNG state), so the diagnosis replays on that rank's batch;
the model and optimizer state are the same on every rank. Rank 0 writes it.

The bundle holds only tensors and plain values: it loads with ``torch.load(weights_only=True)``.
The batches are re-collated from the dataset indices, so a user's collate output need not pickle.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch

from .clipping import GradClipper
from .config import config_from_dict
from .data import move_to
from .diagnosis import diagnose_step
from .fileio import atomic_write
from .numerics import unique_params
from .optim import build_optimizer
from .precision import PrecisionPolicy, resolve_device
from .schedule import LRSchedule
from .seeding import set_rng_state
from .step import TrainStep
from .tasks import Task, resolve_task

__all__ = ["write_bundle", "load_bundle", "diagnose_incident", "BUNDLE_FILE", "DIAGNOSIS_FILE"]

BUNDLE_FILE = "bundle.pt"
DIAGNOSIS_FILE = "diagnosis.json"


def write_bundle(directory: Path, bundle: dict[str, Any]) -> Path:
    """Write ``bundle`` to ``directory/bundle.pt`` atomically (temporary name, fsync, rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / BUNDLE_FILE
    atomic_write(final, lambda fh: torch.save(bundle, fh))
    return final


def load_bundle(directory: str | Path) -> dict[str, Any]:
    """Load an incident bundle safely (``weights_only=True``); raise FileNotFoundError/ValueError clearly."""
    path = Path(directory) / BUNDLE_FILE
    if not path.exists():
        raise FileNotFoundError(f"incident {str(directory)!r}: no {BUNDLE_FILE} there; expected RUN_DIR/incidents/step_N")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # unpickling errors have many types; report them as one clear line
        raise ValueError(f"incident bundle {str(path)!r} cannot be loaded safely: {str(err).splitlines()[0]}") from None


def diagnose_incident(directory: str | Path, task: Task | None = None, *, device: str | None = None,
                      bisect: bool = True, anomaly: bool = True) -> dict[str, Any]:
    """Replay the bundled step under the precise tools; write and return ``diagnosis.json``.

    ``task``: reuse an already built task (its model is deep-copied, never touched); by default the
    task is rebuilt from the bundle's config, as ``stabletrain diagnose`` does in a fresh process.
    """
    directory = Path(directory)
    bundle = load_bundle(directory)
    cfg = config_from_dict(bundle["config"])
    dev = resolve_device(device or cfg.device)
    if task is None:
        task = resolve_task(cfg.task, cfg.task_args)
    model = copy.deepcopy(task.model).to(dev)
    model.load_state_dict(bundle["model"])
    precision = PrecisionPolicy(bundle["precision"]["mode"], dev)
    precision.load_state_dict(bundle["precision"])
    collate = task.collate or torch.utils.data.default_collate
    micro_batches = [(idx, move_to(collate([task.train_data[i] for i in idx]), dev)) for idx in bundle["window"]["indices"]]
    named = unique_params(model)

    def step_factory() -> TrainStep:
        """The run's step as it was before the bad step: same optimizer class and state, schedule, scaler, clipping."""
        optimizer = build_optimizer(named, cfg.optim, dev, task.optimizer)
        optimizer.load_state_dict(bundle["optimizer"])
        schedule = LRSchedule(optimizer, cfg.sched.warmup_steps, cfg.train.max_steps, cfg.sched.decay, cfg.sched.min_lr_ratio)
        schedule.load_state_dict(bundle["schedule"])
        fresh = PrecisionPolicy(bundle["precision"]["mode"], dev)
        fresh.load_state_dict(bundle["precision"])
        return TrainStep(model, optimizer, fresh, clipper=GradClipper(cfg.clip.max_norm), schedule=schedule,
                         params=[p for _, p in named], check_params=cfg.guard.check_params)

    set_rng_state(bundle["rng"])
    observed = bundle.get("observed", {})
    result = diagnose_step(model, task.loss, micro_batches, precision=precision, step_factory=step_factory,
                           device=dev, dataset=task.train_data, collate=task.collate, observed_loss=observed.get("loss"), bisect=bisect, anomaly=anomaly)
    result = {"step": bundle["step"], "rank": bundle.get("rank", 0), "epoch": bundle["window"]["epoch"],
              "observed": observed, **result}
    if observed.get("after_update") and result.get("stage") not in ("update",):
        result["note"] = "the run saw the bad value only in the parameters after the update"
    atomic_write(directory / DIAGNOSIS_FILE, json.dumps(result, indent=2, default=str) + "\n")
    return result
