"""``resume`` and ``determinism``: does a restored checkpoint reproduce the next steps exactly?

``resume``: train N steps and checkpoint; continue M steps; restore the checkpoint in a fresh process
and run the same M steps. Each step is traced (data order, RNG state, the batches' contents, lr, loss
scale, loss, optimizer state, parameters); the losses are shown side by side, with the max parameter
difference, and the first component that differs is named. The batches are digested as the loop reads
them, so a dataset that draws unseeded randomness (``np.random.default_rng()`` in ``__getitem__``) is
named as the data, not as whatever its different inputs reach first (the loss, or the optimizer when the
loss does not depend on the input at step 0, as with a zero-initialized output layer). On CPU the two
must be bitwise equal. The per-step losses are in ``numbers["losses"]``: ``[[step, continuous loss,
resumed loss, bitwise equal], ...]``.

``determinism``: the same config twice from scratch gives identical metrics and parameters.

The fresh process is ``python -m stabletrain.checks.resume --probe ...``; it rebuilds the task from
the config (a built-in task or ``module:function``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..callbacks import Callback
from ..config import Config, config_from_dict, config_to_dict
from ..records.jsonl import read_jsonl
from . import CheckContext, CheckResult, register

__all__ = ["StepTrace", "first_divergence", "COMPONENTS", "DATA_COMPONENT", "batch_digest"]

N_STEPS, M_STEPS = 4, 3
#: The component named when the batches' contents differ for the same indices (and the same RNG state).
DATA_COMPONENT = ("the data (the batches differ for the same indices: randomness in the dataset or collate not seeded "
                  "by the run, e.g. a np.random.default_rng() / random.Random() without a seed in __getitem__)")
#: What to do about it.
DATA_ADVICE = ("draw the dataset's randomness from the RNGs the run seeds and checkpoints (torch.rand, np.random, random), "
               "or from a generator seeded per item (np.random.default_rng((seed, index)))")
#: Trace fields in the order the state flows through a step, and the component each one belongs to. The RNG state
#: comes before the batch: a dataset that draws from the global (seeded) RNG differs because the RNG did.
COMPONENTS = [("indices", "data order"), ("rng", "RNG"), ("batch", DATA_COMPONENT), ("lr", "LR scheduler"),
              ("loss_scale", "grad scaler"),
              ("loss", "the forward pass (state outside the checkpoint: a model attribute not in its state_dict, "
                       "or unseeded randomness in the data or model)"),
              ("optimizer", "optimizer"), ("params", "model parameters")]


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def batch_digest(batch: Any) -> str:
    """Return a digest of a collated batch's contents: every tensor's dtype, shape and bytes (tuples, lists and dicts
    walked in order; numpy arrays by their bytes; anything else by its repr). One host copy of the batch."""
    import numpy as np

    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(x, np.ndarray):
            h.update(f"{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, dict):
            for k, v in x.items():
                h.update(repr(k).encode())
                walk(v)
        elif isinstance(x, (tuple, list)):
            h.update(f"{type(x).__name__}{len(x)}".encode())
            for v in x:
                walk(v)
        else:
            h.update(repr(x).encode())

    walk(batch)
    return h.hexdigest()[:16]


def _rng_digest() -> str:
    import random

    import numpy as np

    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    h.update(repr(random.getstate()).encode())
    h.update(np.random.get_state()[1].tobytes())
    if torch.cuda.is_available():
        for s in torch.cuda.get_rng_state_all():
            h.update(s.numpy().tobytes())
    return h.hexdigest()[:16]


def _hex(x: float) -> str:
    return struct.pack(">d", x).hex()


class StepTrace(Callback):
    """Append one record per step after ``from_step`` to ``trace``: what went into the step and what came out.

    A checking tool, not an observer: it reads the loss and digests the state on the host every step.
    What goes into step n (RNG state, lr, loss scale) is read when step n-1 ends (or at fit start); the
    contents of its batches when the loop reads its window (the stream's ``next_window``, wrapped from fit
    start to fit end), as collated, before the step moves them to the device.
    """

    def __init__(self, trainer: Any, trace: list[dict[str, Any]], from_step: int = 0) -> None:
        self.schedule, self.precision, self.optimizer = trainer.schedule, trainer.precision, trainer.optimizer
        self.trace, self.from_step = trace, from_step
        self.before: dict[str, Any] = {}
        self.batch: str | None = None  # the digest of the last window read
        self._stream: Any = None

    def _read_before(self) -> None:
        self.before = {"rng": _rng_digest(), "lr": float(self.schedule.lr()),
                       "loss_scale": float(self.precision.loss_scale())}

    def on_fit_start(self, state: Any) -> None:
        self._read_before()
        stream = getattr(state, "stream", None)
        if stream is not None and "next_window" not in vars(stream):  # an instance attribute: this run's stream only
            read = stream.next_window

            def next_window() -> Any:
                window = read()
                self.batch = batch_digest(window.batches)
                return window

            stream.next_window, self._stream = next_window, stream

    def on_fit_end(self, state: Any, record: dict[str, Any]) -> None:
        if self._stream is not None:
            del self._stream.next_window  # the class's method again
            self._stream = None

    def on_step_end(self, state: Any, out: dict[str, Any]) -> None:
        if state.step > self.from_step:
            epoch, start = state.positions[state.step]
            indices = state.stream.order.micro_batches(epoch)[start:start + state.cfg.accum.steps]
            loss = float(out["loss"])
            opt = [v for s in self.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            self.trace.append({"step": state.step,
                               "indices": hashlib.sha256(json.dumps(indices).encode()).hexdigest()[:16],
                               "batch": self.batch, **self.before, "loss": _hex(loss), "loss_value": loss,
                               "optimizer": _digest(opt),
                               "params": _digest([p for _, p in state.named_params])})
        self._read_before()


def first_divergence(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> tuple[int, str] | None:
    """Return (step, component) of the first field that differs between two traces, or None."""
    for ra, rb in zip(a, b):
        for key, component in COMPONENTS:
            if ra.get(key) != rb.get(key):
                return ra["step"], component
    if len(a) != len(b):
        return (min(len(a), len(b)) + 1, "number of steps")
    return None


def _run_cfg(cfg: Config, run_dir: Path, steps: int, ckpt_every: int) -> Config:
    data = config_to_dict(cfg)
    data["train"]["max_steps"] = steps
    data["ckpt"]["every"] = ckpt_every
    data["log"].update(every=1, progress=False, tensorboard=False, init_signal=False)  # (its step-0 line named a file of
    # the check's deleted folder, on stdout before --json's output; the init check is the doctor's own)
    data["eval"]["every"] = 0
    data["capture"].update(diagnose=False, incidents=False)  # (an incident's capture would print a folder deleted after)
    data["run"].update(dir=str(run_dir), overwrite=True)
    data["resume"] = None
    return config_from_dict(data)


def _no_run_dir(cfg: Config) -> Config:
    """``cfg`` without ``run.dir``: a Trainer of it writes nothing (a Trainer takes the config's run.dir by default)."""
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=None))


def _params(trainer: Any) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in trainer.params]


@register("resume", order=70)
def check_resume(ctx: CheckContext) -> CheckResult:
    """Checkpoint after N steps, continue M; restore in a fresh process and compare the M steps."""
    from ..loop import Trainer

    if ctx.task_factory is not None:
        return CheckResult("resume", False, "the resume check rebuilds the task in a fresh process: name it in the config "
                           "(a built-in task or module:function) rather than passing a Python factory")
    with tempfile.TemporaryDirectory(prefix="stabletrain-resume-") as tmp:
        run_dir = Path(tmp) / "run"
        cfg = _run_cfg(ctx.cfg, run_dir, N_STEPS + M_STEPS, N_STEPS)
        continuous: list[dict[str, Any]] = []
        trainer = Trainer(cfg, run_dir=run_dir)
        trainer.callbacks.append(StepTrace(trainer, continuous, from_step=N_STEPS))
        trainer.fit()
        if not (run_dir / "checkpoints" / f"step_{N_STEPS:06d}").is_dir():  # withheld (non-finite steps), or failed
            said = [e for e in read_jsonl(run_dir / "events.jsonl")[0] if e.get("step") == N_STEPS
                    and e.get("kind") in ("checkpoint_withheld", "checkpoint_failed")]
            why = (said[-1]["reason"] if said else f"the run ended at step {trainer.step}" + (
                f": {trainer.stop_reason}" if trainer.stop_reason else ""))
            tail = ("its write failed" if said and said[-1]["kind"] == "checkpoint_failed" else
                    "the steps before it are not healthy; the nan and amp checks say why")
            return CheckResult("resume", False, f"no checkpoint at step {N_STEPS} to resume from ({why}): {tail}")
        final = _params(trainer)
        out_file = Path(tmp) / "probe.json"
        state_file = Path(tmp) / "probe_params.pt"
        proc = subprocess.run([sys.executable, "-m", "stabletrain.checks.resume", "--probe", str(run_dir),
                               "--from-step", str(N_STEPS), "--out", str(out_file), "--params", str(state_file)],
                              capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                  [os.getcwd(), os.environ.get("PYTHONPATH", "")])})
        if proc.returncode != 0:
            tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
            return CheckResult("resume", False, f"the fresh process could not resume: {tail}")
        resumed = json.loads(out_file.read_text())
        restored = torch.load(state_file, weights_only=True)
    max_diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(final, restored))
    divergence = first_divergence(continuous, resumed)
    passed = divergence is None and max_diff == 0.0
    losses = [[a["step"], a["loss_value"], b["loss_value"], a["loss"] == b["loss"]] for a, b in zip(continuous, resumed)]
    details = [f"{'step':>6}  {'continuous loss':>18}  {'resumed loss':>18}  same"]
    for step, loss_a, loss_b, equal in losses:
        details.append(f"{step:>6}  {loss_a:>18.10g}  {loss_b:>18.10g}  {'yes' if equal else 'NO'}")
    if divergence:
        step, component = divergence
        details.append(f"first divergence at step {step}: {component}")
        if component == DATA_COMPONENT:
            details.append(DATA_ADVICE)
        summary = f"resumed run diverges at step {step}: {component} differs; max |param diff| {max_diff:.3g}"
    else:
        summary = (f"checkpoint at step {N_STEPS}, {M_STEPS} more steps in a fresh process: bitwise equal "
                   f"(max |param diff| {max_diff:g})")
    return CheckResult("resume", passed, summary,
                       numbers={"checkpoint_step": N_STEPS, "steps_compared": len(resumed), "max_param_diff": max_diff,
                                "diverged_component": divergence[1] if divergence else None,
                                "losses": losses},
                       details=details)


@register("determinism", order=80)
def check_determinism(ctx: CheckContext) -> CheckResult:
    """Train the same config twice from scratch; compare every step and the final parameters bitwise."""
    from ..loop import Trainer

    traces, finals = [], []
    for _ in range(2):
        with tempfile.TemporaryDirectory(prefix="stabletrain-det-") as tmp:
            cfg = _run_cfg(ctx.cfg, Path(tmp) / "run", N_STEPS + M_STEPS, 0)
            trainer = Trainer(_no_run_dir(cfg), task=ctx.make_task() if ctx.task_factory else None)
            trace: list[dict[str, Any]] = []
            trainer.callbacks.append(StepTrace(trainer, trace))
            trainer.fit()
            traces.append(trace)
            finals.append(_params(trainer))
    max_diff = max(float((a.double() - b.double()).abs().max()) for a, b in zip(*finals))
    divergence = first_divergence(*traces)
    passed = divergence is None and max_diff == 0.0
    summary = (f"two runs of {N_STEPS + M_STEPS} steps from scratch: identical (losses, RNG, data order, batches, "
               "parameters)" if passed
               else f"two runs from scratch differ{f' first at step {divergence[0]} in {divergence[1]}' if divergence else ''}; "
                    f"max |param diff| {max_diff:.3g}")
    if passed:
        details = []
    elif divergence and divergence[1] == DATA_COMPONENT:
        details = [DATA_ADVICE]
    else:
        details = ["nondeterminism: set deterministic=true, check for unseeded RNG (e.g. in the dataset) "
                   "or nondeterministic kernels (scatter_add, index_add on CUDA)"]
    return CheckResult("determinism", passed, summary,
                       numbers={"steps": N_STEPS + M_STEPS, "max_param_diff": max_diff,
                                "diverged_component": divergence[1] if divergence else None},
                       details=details)


def _probe(argv: list[str]) -> int:
    """The fresh process of the resume check: restore step ``--from-step`` and trace the remaining steps."""
    from ..loop import Trainer
    from ..records.checkpoint.manager import CheckpointManager

    ap = argparse.ArgumentParser(prog="python -m stabletrain.checks.resume")
    ap.add_argument("--probe", required=True, metavar="RUN_DIR")
    ap.add_argument("--from-step", type=int, required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--params", required=True)
    args = ap.parse_args(argv)
    run_dir = Path(args.probe)
    manager = CheckpointManager(run_dir / "checkpoints")
    loaded = manager.load(run_dir / "checkpoints" / f"step_{args.from_step:06d}")
    cfg = config_from_dict(loaded.meta["config"])
    trainer = Trainer(_no_run_dir(cfg))  # no run dir: the probe writes nothing there (its run.dir is the probe's)
    trainer.load_state_dict(loaded.state)
    trace: list[dict[str, Any]] = []
    trainer.callbacks.append(StepTrace(trainer, trace))
    trainer.fit()
    Path(args.out).write_text(json.dumps(trace))
    torch.save(_params(trainer), args.params)
    return 0


if __name__ == "__main__":
    sys.exit(_probe(sys.argv[1:]))

