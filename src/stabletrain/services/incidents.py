"""The incident recorder: capture the first bad step of an interval into ``incidents/step_N`` and diagnose it.

At each interval start (``guard.memory_snapshot``, the default) the recorder copies the whole state
into host buffers that are reused from one interval to the next (:class:`~stabletrain.records.staging.StateStager`:
from CUDA pinned and non-blocking, so device memory does not double and the step does not wait).
Under DDP the parameters and optimizer state are the same on every rank: each rank copies its share
of them (about 1/world of their bytes) and all of its own state, and the capture completes the
snapshot with one broadcast per tensor from its owner (:func:`~stabletrain.records.staging.fill_withheld`).
Under FSDP each rank copies its own shards of the model and optimizer (``state_dict(local=True)``:
no collective) and the capture copies them back in place. The capture replays from that snapshot
to just before the bad step, on every rank together, with the same :class:`~stabletrain.step.TrainStep`
the run uses (collectives included): at most ``log.every - 1`` steps, wherever the incident falls and
however far the last checkpoint is. Without the snapshot (``guard.memory_snapshot=false``) it replays
from LAST_GOOD instead, up to ``ckpt.every`` steps. Then it writes the bundle (the model and optimizer
state before the step; under FSDP every rank writes its own shards of them with DCP into the bundle's
``dcp/`` folder); the diagnosis replays that step on one process under the precise tools
(:func:`stabletrain.replay.diagnose_incident`), on the full state read from those shards.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import console
from ..policies.accumulation import as_sum_count
from ..config import config_to_dict
from ..diagnostics.diagnosis import DIAGNOSIS_FIELDS
from ..records.incidents import BUNDLE_DCP_DIR, write_bundle
from ..data import move_to
from ..numerics import first_nonfinite_grad, unique_params
from ..policies.precision import PrecisionPolicy
from ..replay import diagnose_incident
from ..seeding import rng_state, set_rng_state
from ..records.checkpoint.sharded import split_for_dcp
from ..records.staging import IntervalSnapshot, StateStager, fill_withheld
from ..tasks import Task, resolve_task
from ..callbacks import FitState
from . import TrainerOps
from .checkpoints import CheckpointKeeper

__all__ = ["IncidentRecorder", "clone_state", "copy_state_into"]


def clone_state(obj: Any) -> Any:
    """Return a deep copy of a nested state; tensors are cloned on their device."""
    return tree_map(lambda x: x.detach().clone() if isinstance(x, Tensor) else copy.copy(x), obj)


def copy_state_into(dst: Any, src: Any) -> Any:
    """Return a deep copy of ``src`` that reuses ``dst``'s tensors where the structure, shapes and dtypes match."""
    src_leaves, spec = tree_flatten(src)
    dst_leaves, dst_spec = tree_flatten(dst) if dst is not None else ([], None)
    if dst_spec != spec:
        return clone_state(src)
    out = []
    for d, s in zip(dst_leaves, src_leaves):
        if isinstance(s, Tensor) and isinstance(d, Tensor) and (d.shape, d.dtype, d.device) == (s.shape, s.dtype, s.device):
            out.append(d.copy_(s.detach()))
        else:
            out.append(s.detach().clone() if isinstance(s, Tensor) else copy.copy(s))
    return tree_unflatten(out, spec)


def _split_replicated(local: dict[str, Any], module: torch.nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """DDP: (the parameters' entries of the model state and the optimizer's per-parameter state, the rest).

    The first is the same on every rank; the rest (buffers such as BatchNorm's running statistics, which
    each rank updates in its own forward, the RNG streams, the data position, ...) is this rank's own.
    """
    names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    model, optimizer = local["model"], local["optimizer"]
    shared = {"model": {k: v for k, v in model.items() if k in names}, "optimizer": optimizer.get("state", {})}
    rest = {**local, "model": type(model)((k, v) for k, v in model.items() if k not in names),
            "optimizer": {k: v for k, v in optimizer.items() if k != "state"}}
    return shared, rest


def _join_replicated(shared: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`_split_replicated` (the model's entries in any order: ``load_state_dict`` goes by name)."""
    model = type(rest["model"])(rest["model"])
    model.update(shared["model"])
    return {**rest, "model": model, "optimizer": {**rest["optimizer"], "state": shared["optimizer"]}}


class IncidentRecorder:
    """On an incident, write ``incidents/step_N/bundle.pt`` and (``guard.diagnose``) its ``diagnosis.json``.

    A service the loop calls by name (:meth:`mark_interval_start` at fit start and at every log boundary,
    :meth:`capture` on an incident); ``ops`` is the trainer's state and step operations
    (:class:`~stabletrain.services.TrainerOps`).

    Every rank takes part (the replay has collectives); rank 0 writes. The bundle holds the window and
    RNG state of the rank that saw the bad value, so its diagnosis replays on that rank's batch. The
    run's state, RNG included, is as it was before the capture when it returns, so a captured run goes
    on exactly as one that was not.
    """

    def __init__(self, ops: TrainerOps, keeper: CheckpointKeeper) -> None:
        self.ops, self.keeper = ops, keeper
        # The state at the interval's start: the same snapshot the adapters take (records.staging), on the compute
        # stream (the next update needs no wait for it).
        self._interval = IntervalSnapshot(side_stream=False)
        self._shared_stager = StateStager()  # DDP: this rank's share of the parameters and optimizer state
        self._snapshot_shared: dict[str, Any] | None = None
        self._shared_ready: list[Any] = []  # CUDA events the share's copies complete at
        self.replayed_steps: int | None = None  # steps the last capture replayed (None: no capture yet)

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The state at the interval's start in host buffers (None: no snapshot this interval)."""
        return self._interval.state

    @staticmethod
    def _snapshots(state: FitState) -> bool:
        """Whether to snapshot each interval: a capture is asked for and has a run directory to write to."""
        return state.cfg.guard.capture and state.cfg.guard.memory_snapshot and state.ckpt is not None

    def _local_state(self, state: FitState) -> dict[str, Any]:
        """The run's state as this rank holds it (live; stage it before the run moves on): no collective."""
        return self.ops.state_dict(local=True) if self.ops.strategy.sharded else self.ops.state_dict()

    def mark_interval_start(self, state: FitState) -> None:
        """A new interval starts: stage the state into the snapshot's host buffers (``guard.memory_snapshot``).

        On CUDA the copies are queued (pinned, non-blocking) and waited for only by a capture; on CPU
        it is one copy of the state per interval (under DDP: of this rank's share of what every rank holds).
        """
        self._interval.clear()
        self._snapshot_shared, self._shared_ready = None, []
        if not self._snapshots(state):
            return
        local = self._local_state(state)
        if self.ops.strategy.replicated:
            shared, local = _split_replicated(local, state.module)
            self._snapshot_shared, self._shared_ready = self._shared_stager.stage(
                shared, share=(state.dist.rank, state.dist.world))
        self._interval.take(local, state.step)

    def _source(self, state: FitState) -> dict[str, Any] | None:
        if self.snapshot is not None:
            local = self._interval.get()  # waits for its copies
            for event in self._shared_ready:
                event.synchronize()
            if self._snapshot_shared is not None:  # DDP: every rank gets the others' shares (a broadcast each)
                device = state.device if dist.get_backend() == "nccl" else torch.device("cpu")
                return _join_replicated(fill_withheld(self._snapshot_shared, device), local)
            return local
        loaded = self.keeper.load_last_good(state)
        return loaded.state if loaded is not None else None

    def capture(self, state: FitState, info: dict[str, Any]) -> dict[str, Any]:
        """Replay to just before ``info["step"]``, write its bundle, diagnose it, record the ``incident`` event.

        Every rank calls it (the replay has collectives). Returns what it found, for the loop and the
        ``on_incident`` callbacks: ``pinned`` (the step whose update broke the parameters, when the replay
        pinned one), ``ranks``, ``path``, ``replayed_steps``, ``diagnosis`` or ``diagnosis_error``.
        """
        found: dict[str, Any] = {}
        if not state.cfg.guard.capture or (state.ckpt is None and self.snapshot is None):
            return found
        step, after_update, ranks = info["step"], info["after_update"], sorted(info.get("ranks") or [])
        source = self._source(state)
        if source is None:
            state.event(step, "incident", f"step {step} not captured: no good state to replay from (no verified "
                        "checkpoint yet; was the state non-finite from the start?)", after_update=after_update, ranks=ranks)
            return found
        # The run's state, to host memory (device memory stays flat), in buffers of its own: once loaded back, the
        # optimizer may keep them as its state (CPU), so they must never be staged into again. FSDP: this rank's shards.
        current, ready = StateStager().stage(self._local_state(state))
        for event in ready:
            event.synchronize()
        skip = set(state.stream.skip)
        self.ops.load_state_dict(source)
        state.stream.skip = skip  # windows a rollback skipped after that state was saved stay skipped
        self.replayed_steps = 0
        pinned = self._replay_to(state, step, info.get("locate"), skip)
        if pinned is None and info.get("locate") is not None and after_update:
            pinned = {"step": step}  # no earlier update broke them: the checked step's own did
        if pinned is not None:
            step, after_update = pinned["step"], True
            found.update(pinned, pinned=step, after_update=True)
        if pinned is not None and step < info["locate"][1]:  # the check's own row has its event already
            state.event(step, "nonfinite", f"parameters became non-finite in the update of step {step} (its loss and "
                        f"grad norm were finite; the check at step {info['locate'][1]} found them, the capture's "
                        "replay pinned the step)", after_update=True, pinned_by_replay=True,
                        **{k: v for k, v in pinned.items() if k != "step"})
        rng = rng_state()
        window = state.stream.next_window()
        mine = {"rank": state.dist.rank, "rng": rng,
                "window": {"epoch": window.epoch, "start": window.start, "indices": window.indices}}
        per_rank = state.dist.gather_objects(mine)
        before = None
        if self.ops.strategy.sharded:  # every rank writes its shards of the pre-step model and optimizer (DCP)
            before = self._write_shards(state, step)
        elif state.run is not None:  # the pre-step state for the bundle, in host memory
            before, ready = StateStager().stage(self.ops.state_dict())
            for event in ready:
                event.synchronize()
        if state.dist.enabled and not ranks and not after_update and not self.ops.strategy.sharded:
            ranks = self._own_gradients_nonfinite(state, window)  # every rank's loss was finite: whose grads?
            found["ranks"] = ranks
        self.ops.load_state_dict(current)
        if state.run is None or before is None:
            return found
        interval_loss = state.history[-1].get("loss") if state.history else None
        seen = ranks or [0]
        incident_dir = state.run.path / "incidents" / f"step_{step:06d}"
        fields: dict[str, Any] = {"path": str(incident_dir), "after_update": after_update,
                                  "replayed_steps": self.replayed_steps}
        if state.dist.enabled:
            fields["ranks"] = ranks
        for n, r in enumerate(seen):
            shards = {"dcp_dir": BUNDLE_DCP_DIR if n == 0 else f"../{BUNDLE_DCP_DIR}"} if self.ops.strategy.sharded else {}
            write_bundle(incident_dir if n == 0 else incident_dir / f"rank_{r}", {**shards,
                "step": step, "rank": r, "world_size": state.dist.world, "config": config_to_dict(state.cfg),
                "window": per_rank[r]["window"], "rng": per_rank[r]["rng"], "model": before["model"],
                "optimizer": before["optimizer"], "schedule": before["schedule"], "precision": before["precision"],
                "observed": {"after_update": after_update, "interval_loss": interval_loss, "ranks": ranks,
                             "grad_norm": info.get("grad_norm"),
                             # The step's loss as the run saw it; the replay compares it bitwise (one process:
                             # under DDP the run's loss is the global one, a replay sees one rank's batch).
                             **({"loss": info.get("loss")} if not state.dist.enabled else {})},
            })
        if state.cfg.guard.diagnose:  # on the first rank that saw it, on that rank's batch
            run_rng = rng_state()  # the diagnosis seeds and replays: the run's own streams must not notice
            try:
                diagnosis = diagnose_incident(incident_dir, self._diagnosis_task(state), device=str(state.device))
                fields["diagnosis"] = {k: diagnosis.get(k) for k in DIAGNOSIS_FIELDS}
                on_rank = f" (rank {seen[0]})" if state.dist.enabled else ""
                console.say(f"incident at step {step}{on_rank}: {diagnosis.get('summary')}")
            except Exception as err:  # a diagnosis that fails must not take the run down with it
                fields["diagnosis_error"] = f"{type(err).__name__}: {err}"
            finally:
                set_rng_state(run_rng)
        found.update(fields)
        seen_note = f" (seen on rank(s) {ranks})" if state.dist.enabled and ranks else ""
        state.event(step, "incident", f"captured step {step}{seen_note} into {incident_dir}", **fields)
        return found

    def _replay_to(self, state: FitState, step: int, locate: tuple[int, int] | None, skip: set) -> dict[str, Any] | None:
        """Replay from the loaded state to just before ``step``; pin an update that broke the parameters.

        ``locate`` (lo, hi): the parameters were found non-finite at step hi's check; from step lo on each
        replayed step's parameters are checked (one host read each) with the state before it staged, and
        at the first that fails the state goes back to before it. Returns that step with its loss and grad
        norm (the replay's, bitwise the run's), or None.
        """
        stager = StateStager() if locate is not None else None
        while state.step < step - 1:
            before = None
            if stager is not None and state.step + 1 >= locate[0]:
                before, ready = stager.stage(self._local_state(state))
                for event in ready:
                    event.synchronize()
            out = self.ops.train_step(state.stream.next_window())
            state.step += 1
            self.replayed_steps += 1
            if before is not None and "params_finite" in out and not bool(out["params_finite"]):
                found = {"step": state.step, "loss": float(out["loss"]), "grad_norm": float(out["grad_norm"])}
                self.ops.load_state_dict(before)  # its buffers are the state's now: the stager is not used again
                state.stream.skip = skip
                return found
        return None

    @staticmethod
    def _own_gradients_nonfinite(state: FitState, window: Any) -> list[int]:
        """DDP: the ranks whose own gradients for ``window`` are non-finite (a collective: every rank answers).

        Asked when no rank's own loss or inputs were non-finite but the all-reduced grad norm was: the
        all-reduce mixed every rank's gradients. Each rank backpropagates its own micro-batches through
        the unwrapped module (DDP's hooks stay idle outside its forward: no all-reduce) under the run's
        autocast, at the step's RNG state, then drops the gradients and restores the RNG.
        """
        params = [p for _, p in state.named_params]
        rng, bad = rng_state(), False
        try:
            with PrecisionPolicy(state.precision, state.device).autocast():
                for indices, batch in zip(window.indices, window.batches):
                    loss_sum, _ = as_sum_count(state.task.loss(state.module, move_to(batch, state.device)), len(indices))
                    if not bool(torch.isfinite(loss_sum)):
                        bad = True
                        break
                    loss_sum.backward()
            bad = bad or first_nonfinite_grad(state.module) is not None  # one host read
        finally:
            for p in params:
                p.grad = None
            set_rng_state(rng)
        return [r for r, flag in enumerate(state.dist.gather_objects(bad)) if flag]

    def _write_shards(self, state: FitState, step: int) -> dict[str, Any] | None:
        """FSDP: every rank writes its shards of the model and optimizer into ``incidents/step_N/dcp`` (a collective).

        Returns the rest of the state in host memory, with DCP markers in place of the model and the
        optimizer (:func:`~stabletrain.records.checkpoint.sharded.split_for_dcp`): what rank 0's bundle holds.
        No rank holds more than its shards: :func:`~stabletrain.records.incidents.load_bundle` reads them whole
        for the one-process diagnosis. None without a run directory.
        """
        import torch.distributed.checkpoint as dcp

        if state.ckpt is None:
            return None
        tensors, whole = split_for_dcp(self.ops.state_dict(dcp=True))  # live views of this rank's shards
        folder = state.ckpt.root.parent / "incidents" / f"step_{step:06d}" / BUNDLE_DCP_DIR
        folder.mkdir(parents=True, exist_ok=True)
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(str(folder)))  # written before the state moves on
        before, ready = StateStager().stage(whole)
        for event in ready:
            event.synchronize()
        return before

    def _diagnosis_task(self, state: FitState) -> Task:
        """The task the one-process diagnosis replays: the run's own; under FSDP with an unsharded model.

        A sharded model cannot run on one process, so the task factory (config key ``task``) builds a
        fresh one, which the bundle's full state then fills; its parameters must be the run's, by name
        (``fully_shard`` keeps every parameter's name). The data stays the run's own.
        """
        if not self.ops.strategy.sharded:
            return state.task
        model = resolve_task(state.cfg.task, state.cfg.task_args).model
        names, want = [n for n, _ in unique_params(model)], [n for n, _ in state.named_params]
        if names != want:
            raise ValueError(f"config key 'task' ({state.cfg.task!r}) builds a model whose parameters "
                             f"({', '.join(names[:3])}, ...) are not the run's ({', '.join(want[:3])}, ...); under "
                             "dist.strategy=fsdp the diagnosis rebuilds the model from the task factory: name the task "
                             "by config key 'task' (module:function), or diagnose the bundle with "
                             "stabletrain.replay.diagnose_incident(INCIDENT_DIR, task) and an unsharded task")
        return dataclasses.replace(state.task, model=model)
