"""Diagnose one bad optimizer step by replaying it: where the first non-finite value came from.

:func:`diagnose_step` replays the step's micro-batches exactly as ``Trainer.train_step`` runs them
(autocast, loss normalized over the whole window, the precision policy's backward), under
:class:`~stabletrain.nonfinite.NonFiniteLocator`, and answers, in a JSON-safe dict:

- the stage where the first non-finite value appeared: inputs -> activations -> loss -> gradients
  -> update (or ``"none"``);
- the first non-finite op (aten name), forward or backward, the module that ran it, and whether it
  created the value (origin) or was handed one (propagation);
- the first parameter whose gradient is non-finite, or the parameters an optimizer step makes
  non-finite;
- the dataset indices of the samples that trigger it (bisection over the batch);
- the forward stack behind it (a replay under ``torch.autograd.detect_anomaly``);
- whether it reproduces: the same stage, op and module and bitwise-equal losses on every replay
  (a numerical problem in the model or data), or not (suspect hardware or nondeterminism), as
  Megatron-LM's rerun state machine tells the two apart.

Every replay starts from the same model state and RNG state, and the model, its gradients, its
train/eval mode and the RNG are restored when it returns. Replay only: it syncs after every op.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import default_collate

from .accumulation import AccumulationWindow, as_sum_count
from .nonfinite import (
    Bisection,
    NonFiniteLocator,
    NonFiniteOp,
    anomaly_trace,
    bisect_samples,
)
from .clipping import GradClipper
from .numerics import first_nonfinite_grad, grad_norms, unique_params
from .precision import PrecisionPolicy
from .seeding import rng_state, set_rng_state
from .step import TrainStep

__all__ = ["STAGES", "diagnose_step"]

STAGES = ("inputs", "activations", "loss", "gradients", "update", "none")


class _LocalWindow(AccumulationWindow):
    """The loop's accumulation window on this process alone: a replay must not enter a collective."""

    def _world(self) -> int:
        return 1


def _json_float(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _same_float(a: float, b: float) -> bool:
    """Bitwise equality of two floats, any NaN equal to any NaN."""
    return (math.isnan(a) and math.isnan(b)) or float(a).hex() == float(b).hex()


def _leading_rows(batch: Any, n: int) -> list[Tensor]:
    """The floating tensors of ``batch`` whose first dimension is the sample dimension (size ``n``)."""
    leaves = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]
    out = []
    for leaf in leaves:
        if isinstance(leaf, Tensor):
            if leaf.is_floating_point() and leaf.dim() > 0 and leaf.shape[0] == n:
                out.append(leaf)
        elif isinstance(leaf, (dict, list, tuple)):
            out.extend(_leading_rows(leaf, n))
    return out


def _floating_leaves(batch: Any) -> list[Tensor]:
    if isinstance(batch, Tensor):
        return [batch] if batch.is_floating_point() else []
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _floating_leaves(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _floating_leaves(v)]
    return []


def _select(batch: Any, positions: list[int], n: int) -> Any:
    """Return the rows ``positions`` of every tensor in ``batch`` whose first dimension is ``n``."""
    if isinstance(batch, Tensor):
        return batch[positions] if batch.dim() > 0 and batch.shape[0] == n else batch
    if isinstance(batch, dict):
        return {k: _select(v, positions, n) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        items = [_select(v, positions, n) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else type(batch)(items)
    return batch


def _bad_inputs(micro_batches: list[tuple[list[int], Any]]) -> tuple[bool, list[int]]:
    """Return (some input is non-finite, the dataset indices of the samples whose rows hold it)."""
    any_bad, samples = False, []
    for indices, batch in micro_batches:
        if not any(not bool(torch.isfinite(t).all()) for t in _floating_leaves(batch)):
            continue
        any_bad = True
        for t in _leading_rows(batch, len(indices)):
            rows = (~torch.isfinite(t)).reshape(len(indices), -1).any(1)
            samples.extend(indices[i] for i in rows.nonzero().flatten().tolist())
    return any_bad, sorted(set(samples))


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
        self.rng = rng_state()
        self.step: TrainStep | None = None

    def reset(self) -> None:
        """Put back the saved parameters and buffers and RNG state; drop the gradients."""
        self.model.load_state_dict(self.state)
        set_rng_state(self.rng)
        for p in self.params:
            p.grad = None
        self.model.train()

    def _fresh_step(self) -> TrainStep:
        """The run's step with its optimizer, schedule and scaler as before the bad step (or a measuring one)."""
        if self.step_factory is not None:
            step = self.step_factory()
        else:
            precision = PrecisionPolicy(self.precision.mode, self.device)
            precision.load_state_dict(self.precision.state_dict())
            step = TrainStep(self.model, None, precision, params=self.params)
        step.window = _LocalWindow(step.params)  # a replay must not enter a collective
        return step

    def forward_backward(self, groups: list[tuple[list[int], Any]]) -> tuple[list[float], float]:
        """Run the window through the step's forward/backward; return the per-micro-batch loss sums and the mean loss.

        Losses are returned as Python floats (one sync per micro-batch).
        """
        self.step = step = self._fresh_step()
        outputs: list[Any] = []

        def recorded(model: nn.Module, batch: Any) -> Any:
            outputs.append(self.loss_fn(model, batch))
            return outputs[-1]

        step.forward_backward([(len(indices), batch) for indices, batch in groups], recorded)
        sums = [float(as_sum_count(o, len(indices))[0].detach()) for o, (indices, _) in zip(outputs, groups)]
        return sums, float(step.window.mean_loss)

    def grad_norm(self) -> float:
        """The pre-clip norm of the true (unscaled) gradients, as the step measures it."""
        if not any(p.grad is not None for p in self.params):
            return 0.0
        norm, _ = grad_norms(self.params)
        precision = self.step.precision if self.step is not None else self.precision
        return float(norm / precision.loss_scale().to(norm.device))

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


def _stage(inputs_bad: bool, first: NonFiniteOp | None, loss: float, grad_name: str | None,
           after_update: list[str]) -> str:
    if inputs_bad:
        return "inputs"
    if first is not None:
        if first.direction == "backward":
            return "gradients"
        return "loss" if first.module is None else "activations"
    if not math.isfinite(loss):
        return "loss"
    if grad_name is not None:
        return "gradients"
    return "update" if after_update else "none"


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
        observed_loss: the step's loss as the run saw it; when given, ``reproduces`` also requires the
            replayed loss to equal it bitwise (any NaN equals any NaN).
        bisect, anomaly: run the batch bisection and the anomaly-mode replay.

    Returns keys: ``stage``, ``op``, ``direction``, ``module``, ``origin``, ``kind``, ``autograd_node``,
    ``first_op`` and ``first_origin_op`` (full records), ``first_nonfinite_param``,
    ``nonfinite_params_after_update``, ``bad_samples`` (bisection), ``bad_input_samples`` (rows of the
    batch holding NaN/Inf), ``bad_sample_groups``, ``bisection``, ``masked_in_forward`` (the first
    non-finite forward value never reached its module's output; None when unknown), ``backward_node``
    and ``backward_op`` (where it then became non-finite in backward), ``anomaly_trace``,
    ``reproduces``, ``replays``, ``loss``, ``grad_norm``, ``summary``.
    The model's parameters, buffers, gradients and mode, and the RNG state, are restored on return.
    """
    if num_replays < 1:
        raise ValueError(f"num_replays: expected an integer >= 1, got {num_replays!r}")
    micro_batches = [(list(indices), batch) for indices, batch in micro_batches]
    if not micro_batches:
        raise ValueError("micro_batches is empty: pass the step's window as [(dataset indices, batch), ...]")
    device = torch.device(device) if device is not None else precision.device
    was_training = model.training
    saved_grads = [(p, p.grad) for p in model.parameters()]
    if step_factory is None and optimizer_factory is not None:
        factory = optimizer_factory

        def step_factory() -> TrainStep:
            fresh = PrecisionPolicy(precision.mode, device)
            fresh.load_state_dict(precision.state_dict())
            return TrainStep(model, factory(), fresh, clipper=GradClipper(max_norm))

    replayer = _Replayer(model, loss_fn, precision, device, step_factory)
    try:
        return _diagnose(replayer, micro_batches, num_replays, dataset, collate, observed_loss, bisect, anomaly)
    finally:
        replayer.reset()
        for p, g in saved_grads:
            p.grad = g
        model.train(was_training)


def _diagnose(rep: _Replayer, micro_batches: list[tuple[list[int], Any]],
              num_replays: int, dataset: Any, collate: Callable[[list[Any]], Any] | None, observed_loss: float | None,
              bisect: bool, anomaly: bool) -> dict[str, Any]:
    inputs_bad, input_samples = _bad_inputs(micro_batches)
    replays = []
    first_rec = origin_rec = None
    for r in range(num_replays):
        rep.reset()
        with NonFiniteLocator(rep.model, capture_stack=r == 0) as loc:
            sums, loss = rep.forward_backward(micro_batches)
        grad_name = first_nonfinite_grad(rep.model)
        after_update: list[str] = []
        grad_norm = rep.grad_norm()
        if rep.step_factory is not None and grad_name is None and loc.first is None and math.isfinite(loss):
            after_update, _ = rep.update()  # the loop steps only on finite grads
        first = loc.first
        if r == 0:
            first_rec, origin_rec = loc.first, loc.first_origin
        replays.append({
            "stage": _stage(inputs_bad, first, loss, grad_name, after_update),
            "op": first.op if first else None, "direction": first.direction if first else None,
            "module": first.module if first else None, "loss": _json_float(loss), "loss_hex": float(loss).hex(),
            "micro_batch_loss_sums": [_json_float(s) for s in sums], "grad_norm": _json_float(grad_norm),
            "first_nonfinite_param": grad_name, "nonfinite_params_after_update": after_update,
            "_sums": sums,
        })
    head = replays[0]
    stage = head["stage"]
    keys = ("stage", "op", "direction", "module", "first_nonfinite_param", "nonfinite_params_after_update")
    same = all(all(r[k] == head[k] for k in keys) and len(r["_sums"]) == len(head["_sums"])
               and all(_same_float(a, b) for a, b in zip(r["_sums"], head["_sums"])) for r in replays[1:])
    matches_observed = True
    if observed_loss is not None:
        loss0 = float.fromhex(head["loss_hex"])
        matches_observed = _same_float(loss0, float(observed_loss))
    reproduces = stage != "none" and same and matches_observed
    for r in replays:
        del r["_sums"]

    # Which samples: bisection over the window (rows holding a non-finite input are also read directly).
    bisection: Bisection | None = None
    bad_samples: list[int] | None = input_samples if stage == "inputs" and input_samples else None
    if bisect and stage in ("inputs", "activations", "loss", "gradients"):
        # The bisection replays many subsets: where the whole window's bad value reaches the loss or the
        # gradients, a plain finiteness check on those tells bad from good, without the op-by-op locator.
        reaches = not math.isfinite(float(replays[0]["loss"])) or replays[0]["first_nonfinite_param"] is not None
        bisection = bisect_samples(_is_bad_fn(rep, micro_batches, dataset, collate, precise=not reaches),
                                   [i for indices, _ in micro_batches for i in indices])
        bad_samples = bisection.samples

    trace = None
    if anomaly and stage in ("inputs", "activations", "loss", "gradients"):
        rep.reset()
        trace = anomaly_trace(lambda: rep.forward_backward(micro_batches), rep.model)

    out: dict[str, Any] = {
        "stage": stage,
        "op": first_rec.op if first_rec else None,
        "direction": first_rec.direction if first_rec else None,
        "module": first_rec.module if first_rec else None,
        "origin": first_rec.origin if first_rec else None,
        "kind": first_rec.kind if first_rec else None,
        "autograd_node": first_rec.autograd_node if first_rec else None,
        # A forward origin masked out of its module's output (torch.where): where it turns non-finite in backward.
        "masked_in_forward": origin_rec.masked_in_forward if origin_rec else None,
        "backward_node": (origin_rec.backward_op.autograd_node if origin_rec and origin_rec.backward_op else None),
        "backward_op": origin_rec.backward_op.op if origin_rec and origin_rec.backward_op else None,
        "first_op": first_rec.to_dict() if first_rec else None,
        "first_origin_op": origin_rec.to_dict() if origin_rec and origin_rec is not first_rec else None,
        "first_nonfinite_param": head["first_nonfinite_param"],
        "nonfinite_params_after_update": head["nonfinite_params_after_update"],
        "update_checked": rep.step_factory is not None,
        "bad_samples": bad_samples,
        "bad_input_samples": input_samples,
        "bad_sample_groups": bisection.combinations if bisection else [],
        "bisection": ({"evaluations": bisection.num_evals, "whole_batch_bad": bisection.whole_bad,
                       "exhausted": bisection.exhausted, "summary": bisection.summary()} if bisection else None),
        "anomaly_trace": trace,
        "reproduces": reproduces,
        "replays_agree": same,
        "matches_observed_loss": matches_observed if observed_loss is not None else None,
        "replays": replays,
        "loss": head["loss"],
        "grad_norm": head["grad_norm"],
        "precision": rep.precision.mode,
        "num_micro_batches": len(micro_batches),
        "num_samples": sum(len(i) for i, _ in micro_batches),
    }
    out["summary"] = _summary(out, bisection)
    return out


def _is_bad_fn(rep: _Replayer, micro_batches: list[tuple[list[int], Any]], dataset: Any,
               collate: Callable[[list[Any]], Any] | None, precise: bool = True) -> Callable[[list[int]], bool]:
    """Return ``is_bad(subset)``: replay only those dataset indices, each in its own micro-batch's group.

    ``precise``: also count a non-finite value that never reaches the loss or the gradients (the
    op-by-op locator); otherwise a subset is bad when its loss or a gradient is non-finite (cheaper).
    """
    collate = collate or default_collate

    def is_bad(subset: list[int]) -> bool:
        wanted = set(subset)
        groups = []
        for indices, batch in micro_batches:
            positions = [k for k, i in enumerate(indices) if i in wanted]
            if not positions:
                continue
            kept = [indices[k] for k in positions]
            sub = collate([dataset[i] for i in kept]) if dataset is not None else _select(batch, positions, len(indices))
            groups.append((kept, sub))
        if not groups:
            return False
        rep.reset()
        try:
            with NonFiniteLocator(rep.model, capture_stack=False) if precise else contextlib.nullcontext() as loc:
                _, loss = rep.forward_backward(groups)
        except RuntimeError:  # a subset the model cannot run (e.g. batch norm on one sample) blames no one
            return False
        return (loc is not None and loc.found) or not math.isfinite(loss) or first_nonfinite_grad(rep.model) is not None

    return is_bad


def _summary(d: dict[str, Any], bisection: Bisection | None) -> str:
    """One sentence for a person: what went non-finite first, where, for which samples, and whether it reproduces."""
    stage = d["stage"]
    if stage == "none":
        return ("no non-finite value on replay: the step did not reproduce (suspect a hardware fault or "
                "nondeterminism; compare the recorded loss and rerun on another device)")
    module = ""
    if d["op"] is not None:
        where = d["direction"]
        node = f" ({d['autograd_node']})" if d["autograd_node"] else ""
        module = ("outside any module" if d["module"] is None else
                  "of the root module" if d["module"] == "" else f"of module '{d['module']}'")
        how = "origin: inputs finite" if d["origin"] else "propagated from a non-finite input"
        text = f"first non-finite value ({stage}): {d['op']} in {where}{node} {module} ({how})"
        if d.get("masked_in_forward"):
            value = {"inf": "inf", "nan": "NaN"}.get(d["kind"] or "", "non-finite value")
            text += f"; this {value} was masked out in forward (it never reached the output {module})"
            if d.get("backward_node") or d.get("backward_op"):
                text += (f" and became NaN only in backward, at {d['backward_op']} in {d['backward_node']} (a masked "
                         "branch still gets a gradient, 0 x inf: keep the op's input finite where it is masked, "
                         "e.g. log2(torch.where(mask, x, 1)))")
    elif stage == "update":
        names = d["nonfinite_params_after_update"]
        shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        text = f"first non-finite value (update): forward and backward stay finite, the optimizer step makes {shown} non-finite (learning rate too high?)"
    else:
        text = f"first non-finite value ({stage})"
        if d["first_nonfinite_param"]:
            text += f": gradient of {d['first_nonfinite_param']}"
    if stage == "inputs":
        samples = d["bad_samples"] or d["bad_input_samples"]
        text = "first non-finite value (inputs): the batch itself holds NaN/Inf" + (
            f" at sample{'s' if len(samples) > 1 else ''} {', '.join(map(str, samples))}" if samples else "")
        if d["op"] is not None:
            text += f", first used by {d['op']} in {d['direction']} {module}"
    elif d["bad_samples"] and len(d["bad_samples"]) == d["num_samples"] > 1:
        text += f", at every sample of the step ({d['num_samples']}): not the data"
    elif d["bad_samples"]:
        text += f", at sample{'s' if len(d['bad_samples']) > 1 else ''} {', '.join(map(str, d['bad_samples']))}"
    elif bisection is not None and bisection.combinations:
        text += f", only in combination: samples {', '.join(map(str, bisection.combinations[0]))} (no single sample is bad)"
    elif bisection is not None and bisection.whole_bad:
        text += ", no single sample to blame"
    if d["reproduces"]:
        text += "; reproduces on replay"
    elif not d["replays_agree"]:
        text += "; replays disagree (nondeterministic: suspect hardware or nondeterministic kernels)"
    else:
        text += "; replays agree but differ from the recorded loss (suspect hardware or nondeterminism in the run)"
    return text
