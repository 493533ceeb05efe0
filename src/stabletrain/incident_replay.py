"""The incident replay: the run's own step, rebuilt from an incident bundle, under the diagnosis tools.

:func:`diagnose_step` replays one step's micro-batches exactly as the run ran them — with
:class:`~stabletrain.step.TrainStep`'s own forward/backward and update (autocast, the window's
normalization, unscaling, clipping, the optimizer class and state, the schedule) — and
:func:`stabletrain.diagnostics.diagnosis.run_diagnosis` reads the replays. :func:`diagnose_incident` rebuilds
that step from ``incidents/step_N/bundle.pt`` (``stabletrain diagnose``), in a fresh process if need be.

This module sits on the step's layer: diagnostics below it know nothing of the step; the replay
composes the two.
"""

from __future__ import annotations

import copy
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import config_from_dict
from .console import some_of
from .data import move_to
from .diagnostics.diagnosis import run_diagnosis
from .diagnostics.failure_class import broken_before
from .numerics import buffers_kept, grad_norms, modes_kept, unique_params
from .policies.accumulation import as_sum_count
from .policies.clipping import GradClipper
from .policies.guard import UNRECOVERABLE_SCALE, inputs_finite
from .policies.precision import PrecisionPolicy, resolve_device
from .records.bundles import DIAGNOSIS_FILE, load_bundle, with_sample_ranks
from .records.jsonl import write_json
from .records.provenance import other_task
from .replica import Replica, copy_precision, local
from .seeding import kept_rng, rng_state, set_rng_state
from .step import TrainStep
from .tasks import Task, resolve_task

__all__ = ["diagnose_step", "diagnose_incident", "launch_history", "run_history"]


class _BeforeBackward(Exception):
    """Raised from the loss, inside the step's forward/backward, to skip the backward of a micro-batch (one already bad,
    or every one of a forward-only replay): its loss sum and its count."""

    def __init__(self, loss_sum: float, count: float = 0.0) -> None:
        super().__init__(loss_sum)
        self.loss_sum, self.count = loss_sum, count


class _Replayer:
    """Runs the step's forward/backward (and optionally its update) from one saved state, with the run's step.

    Forward/backward and the update are :class:`~stabletrain.step.TrainStep`'s own halves, so the replay
    normalizes, unscales, measures, clips and steps exactly as the run did.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[nn.Module, Any], Any], precision: PrecisionPolicy,
                 device: torch.device, step_factory: Callable[[], TrainStep] | None = None) -> None:
        self.model, self.loss_fn, self.precision, self.device = model, loss_fn, precision, device
        self.step_factory = step_factory
        self.named_params = unique_params(model)
        self.params = [p for _, p in self.named_params]
        self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.modes = [(m, m.training) for m in model.modules()]  # the run's modes (a frozen BatchNorm stays frozen)
        self.rng = rng_state()
        self.step: TrainStep | None = None

    def reset(self) -> None:
        """Put back the saved parameters, buffers, modes and RNG state; drop the gradients."""
        self.model.load_state_dict(self.state)
        set_rng_state(self.rng)
        for p in self.params:
            p.grad = None
        for m, training in self.modes:
            m.training = training

    def _fresh_step(self) -> TrainStep:
        """The run's step with its optimizer, schedule and scaler as before the bad step (or a measuring one)."""
        if self.step_factory is not None:
            step = self.step_factory()
        else:
            step = TrainStep(self.model, None, copy_precision(self.precision, self.device), params=self.params)
        # A replay must not enter a collective; it accumulates as the run did (raw sums or not: a window's sum
        # can overflow the norm's sum of squares where its mean does not). The guard's own input check is no op of the
        # run's to trace (guard.check_inputs: its isfinite was 'the first op to use the NaN', outside any module).
        step.check_inputs = False
        return local(step)

    @property
    def judging_scale(self) -> float | None:
        """The loss scale a replay judged on its gradients runs at, where it is not the run's own; else None.

        fp16 with a GradScaler above :data:`UNRECOVERABLE_SCALE`: gradients that overflow only scaled are the scaler's
        routine skip (the guard raises no incident for them), not the step's NaN; at that scale an overflow is one the
        scaler cannot fix. None in fp32 and bf16, and where the run's scale is at or below it already.
        """
        scaler = self.precision.scaler
        if scaler is None or scaler.get_scale() <= UNRECOVERABLE_SCALE:
            return None
        return UNRECOVERABLE_SCALE

    def forward_backward(self, groups: list[tuple[list[int], Any]], stop_at_nonfinite_loss: bool = False, *,
                         forward_only: bool = False, loss_scale: float | None = None) -> tuple[list[float], float]:
        """Run the window through the step's forward/backward; return the per-micro-batch loss sums and the mean loss.

        Losses are returned as Python floats (one sync per micro-batch). ``stop_at_nonfinite_loss``: return
        at the first micro-batch whose loss sum is not finite, before its backward (the sums so far and that
        non-finite sum as the mean): all that a search asking "is this subset bad?" needs of a bad one.
        ``forward_only``: run each micro-batch's forward alone, through the step (its autocast and modes), and no
        backward (no gradients): the mean is the sums' total over the counts. ``loss_scale``: fp16, run at this
        GradScaler scale instead of the run's (see :attr:`judging_scale`); ignored without a scaler.
        """
        self.step = step = self._fresh_step()
        if loss_scale is not None and step.precision.scaler is not None:  # on a copy: a factory's policy is left as is
            step.precision = copy_precision(step.precision, step.precision.device)
            scaler = step.precision.scaler
            scaler.load_state_dict({**scaler.state_dict(), "scale": float(loss_scale)})
        if forward_only:
            return self._forwards(step, groups, stop_at_nonfinite_loss)
        outputs: list[Any] = []

        def recorded(model: nn.Module, batch: Any) -> Any:
            outputs.append(self.loss_fn(model, batch))
            if stop_at_nonfinite_loss:
                loss_sum = float(as_sum_count(outputs[-1], len(groups[len(outputs) - 1][0]))[0].detach())
                if not math.isfinite(loss_sum):
                    raise _BeforeBackward(loss_sum)
            return outputs[-1]

        try:
            step.forward_backward([(len(indices), batch) for indices, batch in groups], recorded)
        except _BeforeBackward as stop:
            done = [float(as_sum_count(o, len(indices))[0].detach()) for o, (indices, _) in zip(outputs[:-1], groups)]
            return [*done, stop.loss_sum], stop.loss_sum
        sums = [float(as_sum_count(o, len(indices))[0].detach()) for o, (indices, _) in zip(outputs, groups)]
        return sums, float(step.window.mean_loss)

    def _forwards(self, step: TrainStep, groups: list[tuple[list[int], Any]],
                  stop_at_nonfinite_loss: bool) -> tuple[list[float], float]:
        """Each micro-batch's forward through ``step`` (a window of its own), stopped before its backward."""
        sums: list[float] = []
        count = 0.0
        for indices, batch in groups:

            def forward(model: nn.Module, batch: Any, n: int = len(indices)) -> Any:
                loss_sum, num = as_sum_count(self.loss_fn(model, batch), n)
                raise _BeforeBackward(float(loss_sum.detach()), float(num))

            try:
                step.forward_backward([(len(indices), batch)], forward)
            except _BeforeBackward as stop:
                sums.append(stop.loss_sum)
                count += stop.count
            if stop_at_nonfinite_loss and not math.isfinite(sums[-1]):
                return sums, sums[-1]
        return sums, sum(sums) / count if count else float("nan")

    def grad_norm(self) -> float:
        """The pre-clip norm of the true (unscaled) gradients, as the step measures it."""
        if not any(p.grad is not None for p in self.params):
            return 0.0
        norm, _ = grad_norms(self.params)
        precision = self.step.precision if self.step is not None else self.precision
        norm = norm / precision.loss_scale().to(norm.device)
        grad_scale = self.step.window.grad_scale if self.step is not None else None  # the grads hold the window's sum
        return float(norm * grad_scale if grad_scale is not None else norm)

    def update(self) -> tuple[list[str], float]:
        """Apply the step's update on the (finite) grads; return the parameters it makes non-finite and the norm.

        The optimizer's state is put back afterwards, in case the factory hands out a live optimizer.
        """
        step = self.step
        assert step is not None and step.optimizer is not None, "update() after forward_backward() with a step_factory"
        saved = copy.deepcopy(step.optimizer.state_dict())
        try:
            out = step.update()
            flags = torch.stack([torch.isfinite(p.detach()).all() for p in self.params]).tolist()
            return [name for (name, _), ok in zip(self.named_params, flags) if not ok], float(out["grad_norm"])
        finally:
            step.optimizer.load_state_dict(saved)


def diagnose_step(
    model: nn.Module,
    loss_fn: Callable[[nn.Module, Any], Any],
    micro_batches: Sequence[tuple[Sequence[int], Any]],
    *,
    precision: PrecisionPolicy,
    optimizer_factory: Callable[[], torch.optim.Optimizer] | None = None,
    device: torch.device | str | None = None,
    num_replays: int = 2,
    dataset: Any = None,
    collate: Callable[[list[Any]], Any] | None = None,
    max_norm: float | None = None,
    step_factory: Callable[[], TrainStep] | None = None,
    observed_loss: float | None = None,
    bisect: bool = True,
    anomaly: bool = True,
    observed_grad_norm: float | None = None,
    history: list[dict[str, Any]] | None = None,
    step: int | None = None,
) -> dict[str, Any]:
    """Replay one optimizer step and return where its first non-finite value came from (a JSON-safe dict).

    Args:
        model: the model (not a DDP wrapper) holding the parameters as they were before the step.
        loss_fn: ``loss_fn(model, batch)`` -> scalar mean or ``(sum, count)``, as a task's loss.
        micro_batches: the step's window as ``[(dataset indices, collated batch), ...]``.
        precision: the run's precision policy (autocast, and its loss scale in fp16).
        optimizer_factory: returns the optimizer bound to ``model``'s parameters with its state and
            lr as before the step; None skips the update stage.
        device: where to run (default: ``precision.device``).
        num_replays: forward/backward replays compared to decide ``reproduces`` (at least 1).
        dataset, collate: re-collate subsets for the bisection from dataset indices (default: slice
            the rows of the collated batches).
        max_norm: clip as the run does before the update stage (None: no clipping); with
            ``optimizer_factory`` only.
        step_factory: returns the run's :class:`~stabletrain.step.TrainStep` over ``model`` with its
            optimizer, schedule and precision state as before the step (what an incident replay uses);
            replaces ``optimizer_factory``/``max_norm``. None of either skips the update stage.
        observed_loss, observed_grad_norm: the step's loss and grad norm as the run saw them; when given,
            ``reproduces`` requires the replay's to match them (the same ones non-finite, the loss bitwise in
            fp32: :func:`~stabletrain.diagnostics.diagnosis.matches_observed`).
        bisect, anomaly: run the batch bisection and the anomaly-mode replay.
        history, step: the run's metrics rows (``metrics.jsonl``) and the step's number: a growth over
            the intervals before it makes the failure class ``divergence``.

    Returns keys: ``stage``, ``op``, ``direction``, ``module``, ``origin``, ``kind``, ``autograd_node``,
    ``first_op`` and ``first_origin_op`` (full records), ``first_nonfinite_param``,
    ``nonfinite_params_after_update``, ``bad_samples`` (bisection), ``bad_input_samples`` (rows of the
    batch holding NaN/Inf), ``bad_sample_groups``, ``bisection`` (its search: ``judged_on`` loss, gradients or
    precise, at ``loss_scale``; where one sample alone cannot run, ``cannot_run_alone``, ``judged_with`` and
    ``unrunnable_subsets``: see :class:`~stabletrain.diagnostics.bisection.SubsetJudge`), ``replay_loss_scale``
    (fp16: the scale the replays ran at where it is not the run's: :attr:`_Replayer.judging_scale`),
    ``masked_in_forward`` (the first non-finite forward value never reached its module's output; None when
    unknown, and never True where the loss is non-finite), ``backward_node`` and ``backward_op`` (where it then
    became non-finite in backward), ``anomaly_trace``,
    ``reproduces``, ``replays``, ``loss``, ``grad_norm``, ``failure_class`` (op, data, overflow, divergence,
    not reproducible) with its ``evidence``, ``growth`` and ``blamed_module``, ``summary``, and what the diagnosis cost:
    ``timings`` (seconds: ``replays_s``, ``bisection_s``, ``anomaly_s``, ``total_s``) and ``passes``
    (forward/backward replays: ``replays``, ``updates``, ``bisection`` subsets, of which
    ``bisection_forward_only`` ran no backward: a loss judged non-finite, or every subset of a step whose
    loss is, ``anomaly``).
    The model's parameters, buffers, gradients and mode, and the RNG state, are restored on return.
    """
    if num_replays < 1:
        raise ValueError(f"num_replays: expected an integer >= 1, got {num_replays!r}")
    micro_batches = [(list(indices), batch) for indices, batch in micro_batches]
    if not micro_batches:
        raise ValueError("micro_batches is empty: pass the step's window as [(dataset indices, batch), ...]")
    device = torch.device(device) if device is not None else precision.device
    saved_grads = [(p, p.grad) for p in model.parameters()]
    if step_factory is None and optimizer_factory is not None:
        factory = optimizer_factory

        def step_factory() -> TrainStep:
            return TrainStep(model, factory(), copy_precision(precision, device), clipper=GradClipper(max_norm))

    with modes_kept(model):
        replayer = _Replayer(model, loss_fn, precision, device, step_factory)
        try:
            observed = {"loss": observed_loss, "grad_norm": observed_grad_norm}
            return run_diagnosis(replayer, micro_batches, num_replays, dataset, collate, observed, bisect, anomaly,
                                 history, step)
        finally:
            replayer.reset()
            for p, g in saved_grads:
                p.grad = g



def task_of_run(cfg: Any, directory: Path) -> Task:
    """The task of the run an incident ``directory`` comes from, rebuilt from its config: refused in one line when the
    run trained another one (a ``Task`` handed to the ``Trainer`` as an object; replaying the config's failed deep in
    ``load_state_dict``)."""
    task = resolve_task(cfg.task, cfg.task_args)
    why = other_task(Path(directory).resolve().parent.parent, task, cfg.task)
    if why is not None:
        raise ValueError(f"incident {str(directory)!r}: {why}; replay it from Python with that task: "
                         "stabletrain.incident_replay.diagnose_incident(DIR, task) or "
                         "stabletrain.remedy_search.search_remedies(DIR, task)")
    return task


def _positions(result: dict[str, Any], task: Task) -> None:
    """An adapter's step numbers its samples by their place in the step: say which micro-batch and position each
    blamed one is (``bad_positions``), in the summary too ('sample 11' alone did not say where in a step of 2)."""
    where = getattr(task.train_data, "where", None)
    if where is None:
        return
    samples = result.get("bad_samples") or []
    result["bad_positions"] = [where(i) for i in samples]
    if samples and re.search(rf"\bsamples? (\d+, )*{samples[0]}\b", result.get("summary") or ""):  # it names them
        result["summary"] += " (in the step's batch: " + "; ".join(
            f"sample {i} is micro-batch {p['micro_batch']}, position {p['position']}"
            for i, p in zip(samples, result["bad_positions"])) + ")"


def _empty_batch(bundle: dict[str, Any], empty: list[int]) -> dict[str, Any]:
    """The diagnosis of a step with an empty micro-batch (a host's loop read past its data's end): no replay."""
    parts = len(bundle["window"]["indices"])
    which = ("its batch holds no samples" if parts == 1 else
             f"{'all' if len(empty) == parts else len(empty)} of its {parts} micro-batches hold no samples "
             f"(micro-batch{'es' if len(empty) > 1 else ''} {', '.join(map(str, empty))})")
    summary = (f"empty batch: {which}; a mean loss over no samples is NaN whatever the weights (does the loop read past "
               "its data's end? a last short slice, or a sampler with fewer samples than steps)")
    return {"step": bundle["step"], "rank": bundle.get("rank", 0), "epoch": bundle["window"]["epoch"],
            "summary": summary, "failure_class": "data", "stage": "inputs", "op": None, "direction": None,
            "module": None, "origin": "inputs", "first_nonfinite_param": None, "bad_samples": None,
            "reproduces": None, "evidence": f"the step's window: {bundle['window']['indices']} (no replay: nothing to run)",
            "empty_micro_batches": empty, "observed": _told(bundle),
            "sample_unit": bundle.get("sample_unit", "dataset index")}


def _no_items(model: nn.Module, loss_fn: Any, micro_batches: list[tuple[list[int], Any]],
              precision: PrecisionPolicy) -> list[float] | None:
    """The loss sums of a window whose ``(sum, count)`` loss counts no item in any micro-batch (every token masked out):
    its mean is 0/0 whatever the weights. None for any other window (a count above 0, a mean loss, a non-finite sum, a
    forward that fails here: the replay says). A forward per micro-batch under the run's autocast, without gradients;
    the RNG, the model's modes and its buffers (BatchNorm's statistics, a spectral norm's vectors) are put back."""
    sums: list[float] = []
    try:
        with kept_rng(), torch.no_grad(), modes_kept(model), buffers_kept(model), precision.autocast():
            for indices, batch in micro_batches:
                out = loss_fn(model, batch)
                if not isinstance(out, (tuple, list)):
                    return None  # a per-item mean: its count is the samples', never 0 here
                total, count = as_sum_count(out, len(indices))
                if float(count) != 0 or not math.isfinite(float(total)):
                    return None
                sums.append(float(total))
    except Exception:  # noqa: BLE001  (the replay runs the same forward and says what fails)
        return None
    return sums if micro_batches else None


def _no_items_window(bundle: dict[str, Any], sums: list[float]) -> dict[str, Any]:
    """The diagnosis of a step whose window holds no item its loss counts: no op search (the 0/0 is the mean's)."""
    parts = len(bundle["window"]["indices"])
    summary = (f"empty window: the loss counts no item in {'its batch' if parts == 1 else f'any of its {parts} micro-batches'}"
               " (count 0: e.g. every token masked out), so its mean loss is 0/0, NaN whatever the weights; the step "
               "was skipped, nothing to learn from (do some samples hold no item?)")
    return {"step": bundle["step"], "rank": bundle.get("rank", 0), "epoch": bundle["window"]["epoch"], "summary": summary,
            "failure_class": "data", "stage": "loss", "op": None, "direction": None, "module": None, "origin": "inputs",
            "first_nonfinite_param": None, "bad_samples": sorted(i for idx in bundle["window"]["indices"] for i in idx),
            "reproduces": True, "evidence": f"the window's loss sums {sums} over counts of 0: no item to average over",
            "empty_window": True, "observed": _told(bundle),
            "sample_unit": bundle.get("sample_unit", "dataset index")}


def _comparable_norm(norm: Any, world_size: int) -> float | None:
    """The run's grad norm a one-process replay can be held to: under DDP/FSDP the run's is the global one, the
    replay's one rank's, so only a non-finite one (the replayed rank is the one that saw it) is compared."""
    if norm is None:
        return None
    norm = float(norm)
    return norm if int(world_size) <= 1 or not math.isfinite(norm) else None


def _told(bundle: dict[str, Any]) -> dict[str, Any]:
    """What the run saw of a non-finite step, for its diagnosis: not the spike rule's window and bar (a remedy's)."""
    return {k: v for k, v in bundle.get("observed", {}).items() if k not in ("spike_window", "rarity")}


def run_history(incident_dir: str | Path) -> list[dict[str, Any]]:
    """The metrics rows of the run an incident belongs to (``RUN_DIR/metrics.jsonl``; [] when there is none)."""
    path = Path(incident_dir).resolve().parent.parent / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # a line cut short by a crash
            continue
    return [r for r in rows if isinstance(r, dict)]


def launch_history(incident_dir: str | Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's history as a live diagnosis sees it: ``rows`` (this launch's records in memory, the newest maybe not
    on disk yet) after the run's earlier records on disk (``metrics.jsonl``'s rows before them: a resumed run's earlier
    launches, whose rows this process never held)."""
    first = next((r["step"] for r in rows if isinstance(r.get("step"), int)), None)
    earlier = [r for r in run_history(incident_dir) if isinstance(r.get("step"), int) and (first is None or r["step"] < first)]
    return [*earlier, *rows]


def diagnose_incident(directory: str | Path, task: Task | None = None, *, device: str | None = None,
                      bisect: bool = True, anomaly: bool = True, bundle: dict[str, Any] | None = None,
                      history: list[dict[str, Any]] | None = None, out: str = DIAGNOSIS_FILE) -> dict[str, Any]:
    """Replay the bundled step under the precise tools; write (as ``out`` in ``directory``) and return ``diagnosis.json``.

    ``task``: reuse an already built task (its model is deep-copied, never touched); by default the
    task is rebuilt from the bundle's config, as ``stabletrain diagnose`` does in a fresh process.
    ``bundle``: the bundle already in memory (a live capture's; the file in ``directory`` is its record).
    ``history``: the run's metrics records (default: its ``metrics.jsonl``), for the divergence's growth, with the
    losses and grad norms of the steps of the incident's interval before it (the bundle's ``observed["recent"]``).
    """
    start = time.perf_counter()
    directory = Path(directory)
    bundle = bundle if bundle is not None else load_bundle(directory)
    cfg = config_from_dict(bundle["config"])
    dev = resolve_device(device or cfg.device)
    empty = [m for m, idx in enumerate(bundle["window"]["indices"]) if not idx]
    if empty and len(empty) == len(bundle["window"]["indices"]):  # nothing to replay: a mean over none is NaN
        result = _empty_batch(bundle, empty)
        result["timings"] = {"total_s": time.perf_counter() - start}
        write_json(directory / out, result)
        return result
    if task is None:
        task = task_of_run(cfg, directory)
    if bundle.get("observed", {}).get("anomaly") == "spike":  # a finite spike: its counterfactual replays
        from .counterfactual import diagnose_spike

        load_s = time.perf_counter() - start
        result = diagnose_spike(bundle, task, device=str(dev))
        result["timings"] = {"load_s": load_s, **result["timings"], "total_s": time.perf_counter() - start}
        result["sample_unit"] = bundle.get("sample_unit", "dataset index")
        _positions(result, task)
        write_json(directory / out, result)
        return result
    replica = Replica(cfg, task, bundle, dev)
    model, precision = replica.model, replica.precision()
    # its parameters as the step met them (not its buffers: a causal mask of -inf is no broken weight)
    broken = [n for n, p in model.named_parameters() if not bool(torch.isfinite(p.detach()).all())]
    collate = task.collate or torch.utils.data.default_collate
    # An empty micro-batch adds nothing to a (sum, count) loss (a rank or a micro-batch with no samples): left out.
    micro_batches = [(idx, move_to(collate([task.train_data[i] for i in idx]), dev))
                     for idx in bundle["window"]["indices"] if idx]
    if bundle.get("world_size", 1) == 1 and (counted := _no_items(model, task.loss, micro_batches, precision)) is not None:
        result = _no_items_window(bundle, counted)  # a (sum, count) loss that counts nothing: its mean is 0/0
        result["timings"] = {"total_s": time.perf_counter() - start}
        write_json(directory / out, result)
        return result
    set_rng_state(bundle["rng"])
    observed = _told(bundle)
    if cfg.train.compile and observed.get("loss") is not None and math.isfinite(float(observed["loss"])):
        # Compiled kernels round differently: an eager replay's finite loss is not bitwise the run's (not compared).
        observed = {k: v for k, v in observed.items() if k != "loss"}
    checked = cfg.guard.check_inputs and any(flag is not None and not bool(flag)
                                             for flag in (inputs_finite(b) for _, b in micro_batches))
    if checked:  # guard.check_inputs made the step's loss and norm non-finite: the model's own may be finite (not compared)
        observed = {k: v for k, v in observed.items() if k not in ("loss", "grad_norm")}
    load_s = time.perf_counter() - start
    result = diagnose_step(model, task.loss, micro_batches, precision=precision, step_factory=replica.step,
                           device=dev, dataset=task.train_data, collate=task.collate, observed_loss=observed.get("loss"),
                           observed_grad_norm=_comparable_norm(observed.get("grad_norm"), bundle.get("world_size", 1)),
                           bisect=bisect, anomaly=anomaly,
                           history=[*(history if history is not None else run_history(directory)),
                                    *({"step": s, "loss": loss, "grad_norm": norm}
                                      for s, loss, norm in observed.get("recent") or [])],
                           step=bundle["step"])
    result = with_sample_ranks({"step": bundle["step"], "rank": bundle.get("rank", 0), "epoch": bundle["window"]["epoch"],
                                **result, "observed": observed, "sample_unit": bundle.get("sample_unit", "dataset index")},
                               bundle)
    if empty:  # said: with a per-item mean loss the run's NaN may be that empty micro-batch's, which the replay left out
        note = (f"micro-batch{'es' if len(empty) > 1 else ''} {', '.join(map(str, empty))} of the step held no samples "
                "(left out of the replay; a mean loss over none is NaN)")
        result["summary"], result["empty_micro_batches"] = f"{result.get('summary')}; {note}", empty
    if checked and result.get("stage") == "inputs" and result.get("op") is None:
        result["summary"] += "; no op of the model reads it (its loss stays finite): guard.check_inputs flagged the step"
    if result.get("stage") == "none" and bundle.get("host") == "monitor":  # the step's own batch, or not all of it?
        result["summary"] += ("; Monitor: the replay ran the batches the step was given: if it accumulated more with "
                              "your own backward, give them all: monitor.step(micro_batches=[...], loss=...)")
    _positions(result, task)
    result["timings"] = {"load_s": load_s, **result["timings"], "total_s": time.perf_counter() - start}
    # A compiled run (train.compile, or a host's torch.compile) is diagnosed on the module itself, eagerly, on the
    # bundle's weights: module names carry no '_orig_mod.', and a finite loss may differ from the run's in its last bits.
    result["replay_mode"], result["run_compiled"] = "eager", bool(cfg.train.compile)
    result["observed"] = _told(bundle)
    scaler = (bundle.get("precision") or {}).get("scaler") or {}
    after = float(scaler.get("scale", 1.0)) * float(scaler.get("backoff_factor", 1.0))  # the scale this step backs off to
    if scaler and after < UNRECOVERABLE_SCALE and result.get("failure_class") in ("overflow", "op"):
        why = ("it cannot recover (the gradients are NaN whatever the scale)" if result.get("failure_class") == "op" else
               "the gradients do not fit float16 unscaled (a lower scale may fit them, a skipped step each halving)")
        result["evidence"] += (f"; the GradScaler had backed off to {float(scaler['scale']):g} and this step's overflow "
                               f"takes it to {after:g}: {why}")
    if observed.get("after_update") and result.get("stage") not in ("update",):
        result["note"] = "the run saw the bad value only in the parameters after the update"
    if broken:  # the weights the step started from were: an earlier update broke them, or they came so
        result["params_nonfinite_before"] = broken
        result["summary"] = broken_before(broken, int(bundle["step"]), result.get("summary"))
    live = observed.get("live_nonfinite")  # the run's parameters were non-finite before this (skipped) step
    if live and not broken and result.get("stage") == "none" and not result.get("reproduces"):  # ... the replay's are not
        result["changed_outside"] = live
        result["evidence"] = (f"the run's parameters held non-finite values before this step ({some_of(live)}; its update "
                              "was skipped), the replay's do not: no replayed update of the interval made them so; they "
                              "were changed outside the optimizer's steps (an in-place edit, a load_state_dict, an EMA "
                              "or weight swap), or an update did not reproduce (nondeterminism, a hardware fault)")
        result["summary"] = f"not reproducible: {result['evidence']}"
    write_json(directory / out, result)
    return result
