"""The signal-propagation report on a run's first batch: which layers vanish or explode at step 0, and the init to use.

A new built-in run (``log.init_signal``: by default for any task whose model's copy fits; one process or DDP) and every
adapter (``init_check``) run :func:`~stabletrain.diagnostics.signal_propagation.signal_report` once, before
the first step: one forward and backward with hooks on every leaf module, and one step of a throw-away
optimizer for the update/weight ratios. The model, its gradients and buffers and the RNG streams are left
exactly as found (the built-in run measures a copy of its model, so a forward with side effects of its own
is not run an extra time; an adapter's too where the copy fits: :func:`host_signal`), so the run trains bitwise as
without it. What it found goes to
``RUN_DIR/init_signal.json`` (every layer's numbers) and a line in ``snapshot.json`` (``init_signal``:
passed, the summary, the advice, the flagged layers); a flagged init is one console line. A report that
fails is a warning, never the run's end.
"""

from __future__ import annotations

import contextlib
import copy
import json
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import console
from ..data import fixed_batch
from ..diagnostics.initialization import (
    InitFingerprint,
    architectures,
    excluding,
    fails_too,
    zero_init_layers,
    zero_layers_small,
)
from ..diagnostics.loss_at_init import judge_loss_at_init, uninformed_loss
from ..diagnostics.signal_propagation import NothingToMeasure, signal_report
from ..errors import user_location
from ..fileio import atomic_write
from ..internals import eager_methods
from ..policies.accumulation import LossContractError
from ..policies.optim import optimizer_factory
from ..records.jsonl import json_safe
from ..records.staging import host_memory_available
from ..runstate import RunState
from ..seeding import kept_rng
from ..tasks.init_schemes import init_

__all__ = ["copy_fits", "first_batch_signal", "host_signal", "record_signal", "run_init_signal", "SIGNAL_FILE"]

#: The report's per-layer numbers, in the run directory.
SIGNAL_FILE = "init_signal.json"


def first_batch_signal(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any], *, label: str,
                       make_optimizer: Callable[[list[nn.Parameter]], Any] | None = None,
                       context: contextlib.AbstractContextManager | None = None,
                       asked: bool = True, step_runs_loss: bool = True, raises: bool = False, disposable: bool = False,
                       ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the report as a dict, its snapshot line) for ``batch``, or None when the report failed (warned once).

    The RNG state is put back. ``context``: what the model needs around its forward (a host's replay mode). An
    error raised in ``loss_fn`` itself is not warned of where the first step runs that loss too (``step_runs_loss``:
    it says it with the user's line); an adapter's ``loss_fn`` only replays incidents: its error is warned of now,
    with the user's line (every capture would fail on it).
    ``asked=False`` (``log.init_signal=auto``): a model with no leaf module to measure is passed over quietly.
    ``disposable``: ``model`` is a copy the caller drops after: a flagged init is measured again on it re-initialized
    with the recommended scheme, and a flag that stays is the architecture's (``architecture`` in both dicts:
    :func:`~stabletrain.diagnostics.initialization.architectures`), said by no console line.
    """
    architecture, uninformed, overwritten, refused = None, None, [], None
    try:
        # The module's own eager forward (no recompile); the RNG streams put back after it.
        with kept_rng(), context or contextlib.nullcontext(), eager_methods(model):
            before = InitFingerprint.before_forward(model) if disposable else None
            report = signal_report(model, batch, loss_fn, label=label, make_optimizer=make_optimizer)
            first_loss = report.loss
            if disposable:  # (a copy: another forward, for the loss at init, is the copy's own; and what its forward drew)
                overwritten = before.redrawn(model) if before is not None else []
                uninformed = uninformed_loss(model, batch, loss_fn)
            zero = [z for z in zero_init_layers(model, report) if z.deliberate]
            if zero:  # a zero-initialized output layer or branch end is deliberate: judged without it, as check init does
                probe = zero_layers_small(model, zero)
                rebind = getattr(make_optimizer, "rebind", None)
                measured = signal_report(probe, batch, loss_fn, label=label,
                                         make_optimizer=rebind(probe) if rebind is not None else make_optimizer)
                report = excluding(measured, zero, label=label, as_built=report)
            elif disposable and not report.passed and not overwritten and not report.nonfinite:  # (kept_rng: the re-init draws)
                with contextlib.suppress(Exception):
                    init_(model, report.recommended, trace=lambda m: loss_fn(m, batch))
                    reinit = signal_report(model, batch, loss_fn, label=label, make_optimizer=make_optimizer)
                    architecture = architectures(report, reinit)
                    refused = fails_too(report, reinit) if architecture is None else None  # (no scheme that fails too)
    except Exception as err:  # the report must never take the run down
        if raises:  # (the caller tries another way first)
            raise
        own = _raised_in(err, loss_fn) or isinstance(err, LossContractError)  # (what it returned: the same)
        if own and step_runs_loss:  # the first step raises it with the user's own line
            return None
        if own:
            where = user_location(err)
            warnings.warn(f"the loss function that replays incidents fails on the step's batch ({type(err).__name__}: "
                          f"{err}{f', at {where}' if where else ''}): no incident can be captured with it; it is called "
                          "as loss_fn(model, batch), batch as the step was given it", console.StableTrainWarning,
                          stacklevel=console.user_stacklevel())
            return None
        if not asked and isinstance(err, NothingToMeasure):  # log.init_signal=auto on a model it cannot see into
            return None
        warnings.warn(f"the signal-propagation report failed ({type(err).__name__}: {err})", console.StableTrainWarning,
                      stacklevel=3)
        return None
    full = report.to_dict()
    extra: dict[str, Any] = {"architecture": architecture} if architecture else {}
    if refused:  # (the scheme for the activations fails too: none recommended, as check init says)
        extra.update(recommended=None, advice=refused)
    if uninformed is not None:  # (a model whose output is not one tensor: not probed, as check init says)
        numbers, said, fails = judge_loss_at_init(report, first_loss, uninformed, batch)
        extra["loss_at_init"] = {**numbers, "line": said, "fails": fails}
    advice = refused or report.advice()
    if overwritten:  # no scheme survives a forward that draws again (check init recommends none either)
        extra["init_overwritten"] = [c.name for c in overwritten]
        advice = (f"no init advice: the model's first forward re-draws {len(overwritten)} parameter(s) "
                  f"({', '.join(c.name for c in overwritten[:3])}{', ...' if len(overwritten) > 3 else ''}): no init "
                  "applied before it survives")
    return {**full, **extra}, {"passed": full["passed"], "summary": full["summary"], "advice": advice,
                               "flagged": [layer.name for layer in report.flagged], **extra}


def _raised_in(err: BaseException, fn: Any) -> bool:
    """Whether ``err`` went through a frame of the function ``fn`` (a plain function, or a bound method's)."""
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    tb = err.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is code:
            return True
        tb = tb.tb_next
    return False


def record_signal(run: Any, full: dict[str, Any], line: dict[str, Any]) -> None:
    """Write ``init_signal.json`` into ``run`` (a RunDir) and the line into its ``snapshot.json``."""
    atomic_write(run.path / SIGNAL_FILE, json.dumps(json_safe(full), indent=2) + "\n")
    run.update_snapshot(init_signal=line)


#: ``log.init_signal=auto``: the copy's share of its device's free memory at most.
FIT_FRACTION = 0.25
#: The copy's bytes, its gradients and a throw-away Adam's two slots: four times the model's.
COPY_FACTOR = 4


def copy_fits(module: nn.Module, device: torch.device, free: int | None = None) -> bool:
    """Whether the report's copy of ``module`` (with its gradients and a throw-away Adam's state: :data:`COPY_FACTOR`
    times its parameters' and buffers' bytes) fits :data:`FIT_FRACTION` of ``device``'s free memory.

    ``free``: that memory in bytes (default: measured now, CUDA's ``mem_get_info`` or the host's ``MemAvailable``);
    where it is unknown, the copy is taken.
    """
    if free is None:
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_memory_available()
    if free is None:
        return True
    size = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
    return size * COPY_FACTOR <= free * FIT_FRACTION


def host_signal(model: nn.Module, batch: Any, loss_fn: Callable[[nn.Module, Any], Any], *, label: str,
                replay: Any = None) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """An adapter's report at step 0 (:func:`first_batch_signal`): on a copy of the host's model where it fits
    (:func:`copy_fits`) and can be copied, made and run under ``replay.detached()`` (Lightning: no trainer, its
    ``self.log`` calls quiet), so the model's own Python state (a call counter, a cache) sees no extra call and the host
    trains as without it; else on the live model under ``replay.replaying()`` (its parameters, gradients, buffers and
    RNG put back). ``replay``: the adapter's :class:`~stabletrain.services.kept_steps.HostReplay`, or None."""
    detached = replay.detached if replay is not None else contextlib.nullcontext
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    copied = None
    if copy_fits(model, device):
        with contextlib.suppress(Exception), detached(), eager_methods(model):  # (the copy's methods its own)
            copied = copy.deepcopy(model)
    if copied is not None:
        # A loss that needs what the copy lacks (Lightning's self.trainer, self.optimizers()) or that reaches the live
        # model (a closure over it) fails there: measured on the live model instead, its gradients put back first.
        grads = [(p, p.grad if p.grad is None else p.grad.clone()) for p in model.parameters()]
        try:
            return first_batch_signal(copied, batch, loss_fn, label=label, context=detached(), step_runs_loss=False,
                                      raises=True, disposable=True)
        except Exception:
            for p, g in grads:
                p.grad = g
        finally:
            del copied
    return first_batch_signal(model, batch, loss_fn, label=label, context=replay.replaying() if replay is not None else None,
                              step_runs_loss=False)


def run_init_signal(state: RunState) -> dict[str, Any] | None:
    """The built-in run's report at step 0 (``log.init_signal``; rank 0 with a run directory, on its own: under DDP
    on a copy of the model it holds whole; not under FSDP).

    ``auto`` (the default): for any task, built-in or the user's, when the copy fits (:func:`copy_fits`); ``true``:
    whatever it takes. The task's loss runs three more times at step 0, on the copy (the report's forward, one
    without dropout, the loss at init's: a loss that counts its calls sees them; ``log.init_signal=false`` for it).

    On a copy of the model (its own Python state is not touched) and the task's first ``train.batch_size``
    training samples, with the run's own optimizer (at its peak LR) for the update ratios; a flagged init is one
    line. Returns the snapshot line, or None when not run.
    """
    cfg, task, module = state.cfg, state.task, state.module
    if not cfg.log.init_signal or state.run is None or state.step != 0:
        return None
    if state.strategy is not None and state.strategy.one_process_model(module.state_dict()) is None:
        return None  # FSDP: this rank holds its shards only, and a forward of them is a collective
    if cfg.log.init_signal == "auto" and not copy_fits(module, state.device):
        return None  # auto: not where the copy could crowd the run out of memory; log.init_signal=true runs it anyway
    try:  # a copy: the model's own Python state (a forward counter, a cache) must not see an extra forward
        model = copy.deepcopy(module)
    except Exception as err:
        warnings.warn(f"the signal-propagation report was skipped: the model cannot be copied ({type(err).__name__}: "
                      f"{err}); log.init_signal=false turns it off", console.StableTrainWarning, stacklevel=2)
        return None
    _, batch = fixed_batch(task, cfg.train.batch_size, state.device)
    found = first_batch_signal(
        model, batch, task.loss, label=f"{task.name} at step 0",
        make_optimizer=optimizer_factory(model, cfg.optim, state.device, getattr(task, "optimizer", None)),
        asked=cfg.log.init_signal is True, disposable=True)
    if found is None:
        return None
    full, line = found
    record_signal(state.run, full, line)
    if not line["passed"] and not line.get("architecture"):  # (no init fixes it: a BN ResNet's backward, no word)
        console.say(f"init at step 0: {'; '.join(line['summary'])}; {line['advice']} ({SIGNAL_FILE})")
    if (line.get("loss_at_init") or {}).get("fails"):  # the output starts confidently wrong, as check init says
        console.say(f"init at step 0: {line['loss_at_init']['line']}")
    return line
