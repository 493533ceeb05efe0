"""An adapter's incident: the state from before the bad step, from the interval snapshot and a replay of the host's steps.

The built-in loop's mechanism (:class:`~stabletrain.records.staging.IntervalSnapshot`, :func:`~stabletrain.records.staging.state_kept`),
fed with what the host ran instead of the built-in data stream::

    at each log boundary (and at the start)   snapshot.take(model, optimizer, loss scale)   (host buffers; CUDA: side stream)
    every step (no sync)                      keeper.keep(step): the micro-batches (off the device), the RNG
                                              state at its forward, each group's lr, the loss scale, host inputs
    at a boundary whose rows hold a bad step k:
        state_kept(the live state):           put the snapshot back; replay every applied step before k with the
                                              host's own step (HostReplay.replay_step); stage that state: the
                                              state before step k
        incidents/step_k/bundle.pt            then the diagnosis replays step k with the host's own loss

So no update is held back: the run loses exactly its bad steps. The live state, the host's RNG streams
(python, numpy, torch, CUDA) and its LR scheduler are as they were before the capture when it returns.

What it costs: the snapshot, once per interval, holds the model, the optimizer state and the loss scale in
host memory (``snapshot_mib`` in ``config.yaml``'s ``host``); the kept batches hold one interval of the
host's micro-batches in host memory, at most ``keep_max_mib`` (beyond that, the interval's incidents are
recorded but not captured, and an event says so). A capture replays at most ``log_every - 1`` steps.

Under DDP every rank replays together (the host's gradient all-reduce runs in the replay too); the rank
that saw the bad value sends its step (batches, RNG) to rank 0, which writes the bundle and diagnoses it
on one process.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from ..diagnostics.diagnosis import DIAGNOSIS_FIELDS
from ..records.incidents import write_bundle
from ..internals import scaler_state, set_scaler_state
from ..replay import diagnose_incident
from ..seeding import rng_state, set_rng_state
from ..records.staging import IntervalSnapshot, StateStager, load_optimizer_state_, state_kept
from ..tasks import Task
from .replay import CapturedRows, batch_nbytes, bundle_batch, optimizer_recipe, plain_batch, to_host
from .options import eager_methods

__all__ = ["KeptStep", "StepKeeper", "HostReplay", "IncidentCapture"]


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
    """The current interval's :class:`KeptStep` s, their batches off the device, within ``max_bytes``."""

    def __init__(self, max_bytes: float) -> None:
        self.max_bytes = max_bytes
        self.steps: dict[int, KeptStep] = {}
        self.nbytes = 0
        self.overflow_at: int | None = None  # the step whose batches went past the budget (nothing kept after it)

    def keep(self, step: int, micro: list[Any], rng: dict[str, Any] | None, lrs: list[Any],
             scaler: tuple[Tensor, Tensor] | None, host: dict[str, Any] | None = None) -> None:
        if self.overflow_at is not None:
            return
        size = sum(batch_nbytes(b) for b in micro)
        if self.nbytes + size > self.max_bytes:
            self.overflow_at, self.steps, self.nbytes = step, {}, 0
            return
        ready: list[Any] = []
        self.steps[step] = KeptStep(step, [to_host(b, ready) for b in micro], rng, lrs, scaler, host or {}, ready)
        self.nbytes += size

    def clear(self) -> None:
        self.steps, self.nbytes, self.overflow_at = {}, 0, None


class HostReplay(Protocol):
    """How an adapter replays its host's step (see each adapter)."""

    def replay_step(self, kept: KeptStep) -> None:
        """Run the kept step's forward/backward, clipping and update exactly as the host ran them."""

    def diagnosis_loss(self, kept: KeptStep) -> Callable[[nn.Module, Any], Any] | None:
        """``loss(model, batch)`` as the host computed the kept step's loss (None: no diagnosis)."""

    def replaying(self) -> contextlib.AbstractContextManager:
        """The adapter's own hooks and the host's logging off, while the capture replays."""

    def detached(self) -> contextlib.AbstractContextManager:
        """The model as a plain module (no trainer attached), while the diagnosis deep-copies and replays it."""


def current_lrs(optimizer: torch.optim.Optimizer) -> list[Any]:
    """Each param group's lr (a tensor lr is cloned: the host's scheduler updates it in place)."""
    return [g["lr"].detach().clone() if isinstance(g["lr"], Tensor) else g["lr"] for g in optimizer.param_groups]


def set_lrs(optimizer: torch.optim.Optimizer, lrs: list[Any]) -> None:
    for group, lr in zip(optimizer.param_groups, lrs):
        if isinstance(group["lr"], Tensor):
            group["lr"].copy_(lr if isinstance(lr, Tensor) else torch.tensor(lr))
        else:
            group["lr"] = float(lr) if isinstance(lr, Tensor) else lr


class IncidentCapture:
    """The interval snapshot, the kept steps, and the capture of an adapter's bad step (see the module docstring).

    Args:
        session: the adapter's :class:`~stabletrain.integrations.core.RunSession`.
        replay: the host's :class:`HostReplay` (None: only a bad step at an interval's start can be captured).
        max_keep_mib: the budget for one interval's kept batches, in MiB.
    """

    def __init__(self, session: Any, replay: HostReplay | None, max_keep_mib: float) -> None:
        self.session, self.replay = session, replay
        self.snapshot = IntervalSnapshot()
        self.keeper = StepKeeper(max_keep_mib * 2**20)
        self.replayed_steps: int | None = None
        self.replaying = False  # a capture is replaying the host's steps: the adapter's own hooks stand by

    @property
    def enabled(self) -> bool:
        """Whether a capture can be written: asked for, and some rank has a run directory (rank 0's)."""
        s = self.session
        return s.options.capture and (s.run is not None or s.dist.world > 1) and s.run_dir is not None

    # -- per interval and per step -----------------------------------------------------------------

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
            load_optimizer_state_(s.optimizer, state["optimizer"])
        if s.scaler is not None:
            set_scaler_state(s.scaler, state.get("scaler"))

    def mark_interval_start(self) -> None:
        """The state now is the state before the next interval's first step: snapshot it (no sync on CUDA)."""
        self.keeper.clear()
        if self.enabled:
            self.snapshot.take(self.live_state(), self.session.step)

    def before_update(self) -> None:
        """Before the host's optimizer step: the snapshot's copies (CUDA side stream) come first."""
        self.snapshot.before_update()

    def keep(self, step: int, micro: list[Any], rng: dict[str, Any] | None, host: dict[str, Any] | None = None) -> None:
        """Keep what a replay of ``step`` needs (batches copied off the device without a sync)."""
        if not self.enabled:
            return
        s = self.session
        lrs = current_lrs(s.optimizer) if s.optimizer is not None else []
        scale = scaler_state(s.scaler) if s.scaler is not None else None
        self.keeper.keep(step, micro, rng, lrs, scale, host)

    # -- at a boundary with an incident ----------------------------------------------------------------

    def capture(self, step: int, rows: list[Any], info: dict[str, Any]) -> dict[str, Any] | None:
        """Write ``incidents/step_N/bundle.pt`` for ``step`` and diagnose it; return the event's fields (None: nothing).

        Every rank calls it (a replay under DDP has collectives); rank 0 writes. Returns ``{"why": ...}``
        when the step cannot be captured.
        """
        s = self.session
        if not self.enabled:
            return None
        applied = {r.step: r.values["applied"] >= 0.5 for r in rows}
        start = self.snapshot.step
        missing = [t for t in range(start + 1, step + 1) if t not in self.keeper.steps]
        why = (f"the interval's batches went past keep_max_mib={self.keeper.max_bytes / 2**20:g} at step "
               f"{self.keeper.overflow_at}" if self.keeper.overflow_at is not None else
               f"the batches of steps {missing} were not kept" if missing else
               "no replay of the host's steps (pass loss_fn= to replay them)" if step - 1 > start and self.replay is None
               else None)
        if why is not None:
            return {"why": why}
        bad_rank = (info.get("ranks") or [0])[0]
        t0 = time.perf_counter()
        before: dict[str, Any] | None = None
        self.replayed_steps = 0
        with state_kept(self.live_state, self.load_live_state), self._replaying():
            self.load_live_state(_cloned(self.snapshot.get()))
            for t in range(start + 1, step):
                kept = self.keeper.steps[t]
                if not applied[t]:  # skipped live: parameters and optimizer state did not move
                    continue
                self._replay(kept)
                self.replayed_steps += 1
            before, ready = StateStager().stage(self.live_state())
            for event in ready:
                event.synchronize()
        kept = self.keeper.steps[step]
        mine = {"micro": [plain_batch(b) for b in kept.batches()], "rng": kept.rng, "lrs": [float(lr) for lr in kept.lrs],
                "host": {k: (v.item() if isinstance(v, Tensor) else v) for k, v in kept.host.items()
                         if k in ("num_items_in_batch", "accumulation_steps")}} \
            if s.dist.rank == bad_rank else None
        sent = s.dist.gather_objects(mine)[bad_rank] if s.dist.world > 1 else mine
        replay_s = time.perf_counter() - t0
        if s.run is None:  # another rank: rank 0 writes and diagnoses
            return None
        return self._write(step, sent, before, kept, info, bad_rank, replay_s)

    def _replay(self, kept: KeptStep) -> None:
        s = self.session
        if kept.rng is not None:
            set_rng_state(kept.rng)
        if s.optimizer is not None:
            set_lrs(s.optimizer, kept.lrs)
        if s.scaler is not None:
            set_scaler_state(s.scaler, kept.scaler)
        kept.batches()
        self.replay.replay_step(kept)

    @contextlib.contextmanager
    def _replaying(self) -> Any:
        self.replaying = True
        try:
            with self.replay.replaying() if self.replay is not None else contextlib.nullcontext():
                yield
        finally:
            self.replaying = False

    def _write(self, step: int, sent: dict[str, Any], before: dict[str, Any], kept: KeptStep, info: dict[str, Any],
               bad_rank: int, replay_s: float) -> dict[str, Any]:
        from ..config import SchedConfig, TrainConfig, config_to_dict
        from .replay import TASK_SPEC
        import dataclasses

        s = self.session
        incident_dir = s.run.path / "incidents" / f"step_{step:06d}"
        rows_ds = CapturedRows(sent["micro"])
        opt = s.optimizer
        opt_recipe = optimizer_recipe(opt, s.named_params) if opt is not None else None
        task_args = {"batches": [bundle_batch(b) for b in sent["micro"]], "model": s.recipes.get("model"), "loss": s.recipes.get("loss"),
                     "optimizer": opt_recipe, "name": f"{s.host}:{type(s.model).__name__}",
                     "host": sent["host"]}
        # The replay's update uses the host's optimizer at the step's lr: a constant schedule over the bundle's lrs.
        replay_cfg = dataclasses.replace(s.cfg, task=TASK_SPEC, task_args=task_args,
                                         train=TrainConfig(max_steps=1, compile=s.cfg.train.compile),
                                         sched=SchedConfig(warmup_steps=0, decay="constant"))
        scale = kept.scaler
        bundle = {
            "step": step, "rank": bad_rank, "world_size": s.dist.world, "host": s.host, "config": config_to_dict(replay_cfg),
            "window": {"epoch": s.epoch, "start": 0, "indices": rows_ds.indices()},
            "sample_unit": "position in the step's batch",
            "rng": sent["rng"] if sent["rng"] is not None else rng_state(),
            "model": before["model"],
            "optimizer": before["optimizer"] if opt is not None and opt_recipe is not None else
            torch.optim.SGD(s.params, lr=0.0).state_dict(),
            "schedule": {"applied_steps": torch.zeros(()), "base_lrs": sent["lrs"] if opt_recipe is not None else [0.0]},
            "precision": {"mode": s.precision, "scaler": _scaler_dict(s.scaler, scale)},
            "observed": {"after_update": info["after_update"], "host_loss": info.get("loss"),
                         "grad_norm": info.get("grad_norm"), "ranks": info.get("ranks") or []},
        }
        write_bundle(incident_dir, bundle)
        fields: dict[str, Any] = {"path": str(incident_dir), "after_update": info["after_update"],
                                  "replayed_steps": self.replayed_steps, "replay_s": round(replay_s, 4),
                                  "sample_unit": "position in the step's batch"}
        if s.dist.world > 1:
            fields["ranks"] = info.get("ranks") or []
        if s.options.diagnose:
            fields.update(self._diagnose(incident_dir, rows_ds, kept, opt_recipe, bad_rank))
        return fields

    def _diagnose(self, incident_dir: Any, rows_ds: CapturedRows, kept: KeptStep, opt_recipe: dict[str, Any] | None,
                  bad_rank: int) -> dict[str, Any]:
        s = self.session
        loss = self.replay.diagnosis_loss(kept) if self.replay is not None else None
        if loss is None:
            return {"diagnosis_error": "no loss function to replay the step with (pass loss_fn= to the adapter)"}
        rng = rng_state()  # the diagnosis seeds and replays: the host's streams must not notice
        try:
            live = Task(model=s.model, train_data=rows_ds, loss=loss, collate=rows_ds.collate,
                        name=f"{s.host}:{type(s.model).__name__}", optimizer=_live_optimizer_factory(opt_recipe))
            # Eagerly, on the bundle's weights in a copy: a module compiled in place (Lightning) runs its class's methods.
            with self._replaying(), self.replay.detached(), eager_methods(s.model):
                diagnosis = diagnose_incident(incident_dir, live, device=str(s.device))
            positions = diagnosis["bad_positions"]  # diagnose_incident maps them (CapturedRows.where)
            fields = {"diagnosis": {**{k: diagnosis.get(k) for k in DIAGNOSIS_FIELDS}, "bad_positions": positions}}
            on_rank = f" (rank {bad_rank})" if s.dist.world > 1 else ""
            s.say(f"incident at step {kept.step}{on_rank}: {diagnosis.get('summary')}")
            return fields
        except Exception as err:  # a diagnosis that fails must not take the run down with it
            return {"diagnosis_error": f"{type(err).__name__}: {_first_line(err)}"}
        finally:
            set_rng_state(rng)


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _cloned(state: dict[str, Any]) -> dict[str, Any]:
    """The snapshot's state with fresh tensors: whatever loads it may keep them; the snapshot's buffers stay its own."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.clone() if isinstance(x, Tensor) else x, state)


def _scaler_dict(scaler: Any, state: tuple[Tensor, Tensor] | None) -> dict[str, Any] | None:
    """The scaler's ``state_dict()`` with the scale and growth tracker of the bad step (read once, at capture)."""
    if scaler is None:
        return None
    out = scaler.state_dict()
    if state is not None:
        out["scale"], out["_growth_tracker"] = float(state[0]), int(state[1])
    return out


def _live_optimizer_factory(recipe: dict[str, Any] | None) -> Callable[[list], torch.optim.Optimizer]:
    from .replay import _sgd_noop, build_optimizer_from_recipe

    if recipe is None:
        return _sgd_noop
    return lambda named: build_optimizer_from_recipe(recipe, named)
