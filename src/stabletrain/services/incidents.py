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
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from .. import console
from ..policies.accumulation import as_sum_count
from ..config import config_to_dict
from ..diagnostics.diagnosis import DIAGNOSIS_FIELDS
from ..records.incidents import BUNDLE_DCP_DIR, STATE_IN, write_bundle
from ..data import move_to
from ..numerics import first_nonfinite_grad, unique_params
from ..policies.precision import PrecisionPolicy
from ..replay import diagnose_incident
from ..seeding import rng_state, set_rng_state
from ..records.checkpoint.sharded import split_for_dcp
from ..records.staging import IntervalSnapshot, StateStager, fill_withheld, snapshot_fits, state_bytes
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


def _split_replicated(local: dict[str, Any], module: torch.nn.Module,
                      cache: dict[Any, set[str]] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the parameters' entries of the model state and the optimizer's per-parameter state, the rest).

    The first changes only in the optimizer's step and, under DDP, is the same on every rank; the rest (buffers such as BatchNorm's running statistics, which
    each rank updates in its own forward, the RNG streams, the data position, ...) is this rank's own.
    ``cache``: the parameter names per (module, the model state's keys), kept by the caller (a walk of the
    module per interval otherwise).
    """
    model, optimizer = local["model"], local["optimizer"]
    key = (id(module), tuple(model))
    names = cache.get(key) if cache is not None else None
    if names is None:
        names = {n for n, _ in module.named_parameters(remove_duplicate=False)}
        if cache is not None:
            cache.clear()
            cache[key] = names
    shared = {"model": {k: v for k, v in model.items() if k in names}, "optimizer": optimizer.get("state", {})}
    rest = {**local, "model": type(model)((k, v) for k, v in model.items() if k not in names),
            "optimizer": {k: v for k, v in optimizer.items() if k != "state"}}
    return shared, rest


def _join_replicated(shared: dict[str, Any], rest: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`_split_replicated` (the model's entries in any order: ``load_state_dict`` goes by name)."""
    model = type(rest["model"])(rest["model"])
    model.update(shared["model"])
    return {**rest, "model": model, "optimizer": {**rest["optimizer"], "state": shared["optimizer"]}}


def _optimizer_slots(optimizer: torch.optim.Optimizer) -> int:
    """Tensors the size of a parameter the optimizer's state will hold per parameter (SGD: 1 with momentum, else 0; 2 else).

    Adam and AdamW hold two (exp_avg, exp_avg_sq); 2 is assumed for any other optimizer.
    """
    if isinstance(optimizer, torch.optim.SGD):
        return 1 if any(group.get("momentum") for group in optimizer.param_groups) else 0
    return 2


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
        # The state at the interval's start, in two parts (one process and DDP). The parameters and the optimizer's
        # per-parameter state (nearly all the bytes; under DDP this rank's share of them) change only in the
        # optimizer's step: on CUDA they are copied on a side stream, which the compute stream waits for just before
        # that step (an optimizer step pre-hook: a device-side wait, no host sync), so the forward and backward run
        # beside the copy. The rest (buffers, which a forward may update, the policies, RNG, counters: small) is
        # copied on the compute stream. FSDP: this rank's shards, all on the compute stream.
        self._interval = IntervalSnapshot(side_stream=False)
        self._params_stager = StateStager()
        self._snapshot_params: dict[str, Any] | None = None
        self._params_ready: list[Any] = []  # CUDA events the parameters' copies complete at
        self._ordered = True  # the compute stream waits for those copies already
        self._stream: Any = None  # the side stream (CUDA)
        self._hooked = False
        self._enabled: bool | None = None  # guard.memory_snapshot=auto: decided once, at the first interval
        self._names: dict[Any, set[str]] = {}  # _split_replicated's parameter names, per model layout
        self.replayed_steps: int | None = None  # steps the last capture replayed (None: no capture yet)

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """The state at the interval's start in host buffers (None: no snapshot this interval; DDP: others' shares withheld).

        Not waited for: on CUDA its copies may still be running (a capture waits for them).
        """
        rest = self._interval.state
        if rest is None or self._snapshot_params is None:
            return rest
        return _join_replicated(self._snapshot_params, rest)

    def _snapshots(self, state: FitState) -> bool:
        """Whether to snapshot each interval: a capture is asked for, has a run directory, and (auto) the state fits."""
        guard = state.cfg.guard
        return bool(guard.capture and guard.memory_snapshot and state.ckpt is not None and self._enabled)

    def plan_snapshot(self, state: FitState) -> None:
        """Decide once, when the run directory opens, whether the intervals are snapshot (every rank calls it).

        ``guard.memory_snapshot=auto``: rank 0 decides for every rank (one broadcast, here, so no interval's
        snapshot needs a collective): whether the snapshots on this host fit ``guard.snapshot_memory_fraction``
        of the host memory available now (:func:`~stabletrain.records.staging.host_memory_available`). A
        snapshot is this process's state (DDP: its share of the parameters and optimizer state, and its own
        rest; FSDP: its shards), the optimizer's state estimated before its first step made it; the processes
        on this host are ``LOCAL_WORLD_SIZE``. When they do not fit: off, and one warning line says so and
        what an incident then costs.
        """
        guard = state.cfg.guard
        if guard.memory_snapshot == "auto" and guard.capture:
            self._enabled = state.dist.on_main(lambda: self._fits(state))
        else:
            self._enabled = bool(guard.memory_snapshot)

    def _fits(self, state: FitState) -> bool:
        local = self._local_state(state)
        params, rest = (local, {}) if self.ops.strategy.sharded else _split_replicated(local, state.module)
        params_bytes = state_bytes(params, share=state.dist.world if self.ops.strategy.replicated else 1)
        if not self.ops.optimizer.state:  # before the first step: the state the optimizer will make, estimated
            params_bytes *= 1 + _optimizer_slots(self.ops.optimizer)
        per_process = params_bytes + state_bytes(rest)
        processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if state.dist.enabled else 1
        fraction = state.cfg.guard.snapshot_memory_fraction
        fits, budget = snapshot_fits(per_process, fraction, processes=processes)
        if not fits:
            mib = 2 ** 20
            console.warn(f"guard.memory_snapshot=auto: the incident snapshot is off: {per_process / mib:.0f} MiB per "
                         f"process x {processes} process(es) on this host exceed guard.snapshot_memory_fraction="
                         f"{fraction:g} of the host memory available at start ({budget / mib:.0f} MiB); an incident "
                         f"then replays from the last checkpoint (LAST_GOOD, up to ckpt.every={state.cfg.ckpt.every} "
                         f"steps) instead of the interval's start (at most log.every={state.cfg.log.every}); set "
                         "guard.memory_snapshot=true to take it anyway")
        return fits

    def _local_state(self, state: FitState) -> dict[str, Any]:
        """The run's state as this rank holds it (live; stage it before the run moves on): no collective."""
        return self.ops.state_dict(local=True) if self.ops.strategy.sharded else self.ops.state_dict()

    def _order(self, *_: Any) -> None:
        """Make the compute stream wait for the parameters' copies (once per snapshot; device-side, no host sync)."""
        if not self._ordered:
            for event in self._params_ready:
                torch.cuda.current_stream().wait_event(event)
            self._ordered = True

    def _side_stream(self, state: FitState) -> Any:
        """The side stream for the parameters' copies on CUDA (None elsewhere), with the optimizer's pre-hook set once."""
        if state.device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(state.device)
        if not self._hooked:
            self.ops.optimizer.register_step_pre_hook(self._order)
            self._hooked = True
        return self._stream

    def mark_interval_start(self, state: FitState) -> None:
        """A new interval starts: stage the state into the snapshot's host buffers (``guard.memory_snapshot``).

        On CUDA the copies are queued (pinned, non-blocking; the parameters and optimizer state on a side
        stream) and waited for only by a capture; on CPU it is one copy of the state per interval (under DDP:
        of this rank's share of what every rank holds).
        """
        self._order()  # the last snapshot's copies are done before anything loads into the state
        self._interval.clear()
        self._snapshot_params, self._params_ready = None, []
        if not self._snapshots(state):
            return
        local = self._local_state(state)
        if not self.ops.strategy.sharded:
            params, local = _split_replicated(local, state.module, self._names)
            share = (state.dist.rank, state.dist.world) if self.ops.strategy.replicated else None
            stream = self._side_stream(state)
            self._snapshot_params, self._params_ready = self._params_stager.stage(params, share=share, stream=stream)
            self._ordered = stream is None
        self._interval.take(local, state.step)

    def _source(self, state: FitState) -> dict[str, Any] | None:
        if self.snapshot is not None:
            rest = self._interval.get()  # waits for its copies
            for event in self._params_ready:
                event.synchronize()
            self._order()
            if self._snapshot_params is None:  # FSDP: this rank's shards
                return rest
            params = self._snapshot_params
            if self.ops.strategy.replicated:  # DDP: every rank gets the others' shares (a broadcast each)
                device = state.device if dist.get_backend() == "nccl" else torch.device("cpu")
                params = fill_withheld(params, device)
            return _join_replicated(params, rest)
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
            # The model and optimizer (the same on every rank) once, in the first bundle; a later rank's names it.
            if self.ops.strategy.sharded:
                shared = {"dcp_dir": BUNDLE_DCP_DIR if n == 0 else f"../{BUNDLE_DCP_DIR}",
                          "model": before["model"], "optimizer": before["optimizer"]}
            else:
                shared = {"model": before["model"], "optimizer": before["optimizer"]} if n == 0 else {STATE_IN: ".."}
            write_bundle(incident_dir if n == 0 else incident_dir / f"rank_{r}", {**shared,
                "step": step, "rank": r, "world_size": state.dist.world, "config": config_to_dict(state.cfg),
                "window": per_rank[r]["window"], "rng": per_rank[r]["rng"],
                "schedule": before["schedule"], "precision": before["precision"],
                "observed": {"after_update": after_update, "interval_loss": interval_loss, "ranks": ranks,
                             "grad_norm": {**info, **found}.get("grad_norm"),  # a pinned step's own figures
                             # The step's loss as the run saw it; the replay compares it bitwise (one process:
                             # under DDP the run's loss is the global one, a replay sees one rank's batch).
                             **({"loss": {**info, **found}.get("loss")} if not state.dist.enabled else {})},
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
