"""Bitwise parity: stabletrain's step and loop against a hand-written torch loop, in fp32, bf16 and fp16.

What is compared. The same tiny model (two Linear layers and a Tanh, biases undecayed) is trained for 50
optimizer steps on the same batches three ways: by a hand-written PyTorch loop (:func:`hand_written_loop`:
autocast, ``torch.amp.GradScaler`` in fp16, ``torch.nn.utils.clip_grad_norm_``, fused AdamW, warmup +
cosine held on skipped steps), by the step ``stabletrain.step.build_step`` builds (with
:class:`~stabletrain.policies.schedule.LRSchedule`), and by the built-in ``Trainer`` (its guard, metrics and
log intervals around that step). After the 50 steps every parameter, every optimizer state tensor (``step``,
``exp_avg``, ``exp_avg_sq``), every group's lr and the GradScaler's state must be the same BITS, and every
step must have been applied, skipped and clipped alike. The batches plant what the step must get right: an
inf input at step 21 (a non-finite loss and gradients: skipped, the schedule held); in fp16 a GradScaler
starting at 2**24 (the first steps overflow and back the scale off), growing every 10 clean steps (it
overflows again) and a batch at step 31 whose targets are 3000 times larger (a finite loss whose fp16
backward overflows); the clipping threshold fires on some steps and not on others; and windows of 2
micro-batches (accumulation).

Why bitwise. Both sides run the same kernels on the same inputs in the same order, so any difference is a
difference in what is computed, and a tolerance would hide it: Lightning's own Fabric-vs-PyTorch parity
test allows 1% and 0.1 s per step and skips fp16 with a GradScaler (a "TODO"); this one does not.
Bitwise equality holds where the two compute the same thing; each place where stabletrain had computed
something else was found this way:

* The lr. stabletrain keeps the lr of a fused optimizer as a float32 tensor (it skips and schedules on the
  device, without a sync), and its schedule table holds the float32 nearest to ``lr x factor(n)`` computed
  in float64 (fixed here: it was a chain of float32 ops, up to 4 ulp off here, 7 over 100k steps). The
  hand-written loop does what a
  careful user of a sync-free fused optimizer writes, as nanoGPT sets ``param_group['lr'] = lr`` each step:
  it fills a float32 tensor lr with ``PEAK_LR * factor(n)``. A Python float lr is not the same lr: the
  fused kernels compute with it as a double (and on CUDA take a tensor lr only in float32), and
  ``LambdaLR`` over a tensor lr multiplies the float32 base lr by the factor rounded to float32.
* Accumulation in fp16. stabletrain normalized a window's micro-batch i by the count seen so far (the
  count of a ``(sum, count)`` loss is known only after its forward), backpropagating the first of k
  micro-batches k times larger than its share: the GradScaler then overflows where a plain loop's
  ``loss / accum_steps`` does not (a skipped step more here, then a different scale for the rest). For a
  loss that returns a per-item mean the sample counts are known before any forward;
  :class:`~stabletrain.policies.accumulation.AccumulationWindow` now backpropagates each mean as its share
  ``mean / (N / n)`` when ``begin`` is given the window's sample count ``N``, and :class:`PlannedWindow`
  shows that this is bitwise. ``TrainStep.forward_backward`` does not pass it yet (step.py is the lead's):
  the fp16 accumulation cases are marked xfail until it does.
* Accumulation in fp32/bf16 backpropagates each micro-batch's raw loss sum (``mean x n``) and multiplies
  the gradients by ``1 / N`` in the clipping's pass: bitwise the plain loop's ``loss / accum_steps`` when
  ``n`` and ``N`` are powers of two (8 and 16 here), as scaling by a power of two is exact; with other sizes
  the two round differently (both are the window's mean to within float32 rounding).

:func:`run_parity` is also what ``bench/gpu_check.py --cases parity`` runs on CUDA.
"""

from __future__ import annotations

import copy
import math
import warnings
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from stabletrain import Task, Trainer, load_config
from stabletrain.numerics import unique_params
from stabletrain.policies.accumulation import AccumulationWindow, sums_safe
from stabletrain.policies.optim import build_optimizer
from stabletrain.policies.precision import PrecisionPolicy
from stabletrain.policies.schedule import LRSchedule
from stabletrain.step import build_step

STEPS, BATCH, WARMUP, MIN_LR_RATIO = 50, 8, 10, 0.1
PEAK_LR, WEIGHT_DECAY, BETAS, EPS, MAX_NORM = 1e-2, 0.1, (0.9, 0.95), 1e-8, 1.0
INIT_SCALE, GROWTH_INTERVAL = 2.0**24, 10  # fp16: the first steps overflow; the scale grows every 10 clean steps
NONFINITE_STEP, OVERFLOW_STEP = 21, 31  # steps (from 1): an inf input; targets x 3000 (fp16's backward overflows)
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: Why fp16 with accumulation is not bitwise yet: the fix in step.py that the lead applies (see the docstring).
STEP_PASSES_NO_PLAN = ("step.py: TrainStep.forward_backward calls self.window.begin() without the window's sample count, "
                       "so fp16 accumulation normalizes by the running count (the first micro-batch backpropagated k times "
                       "its share: the scaler overflows where loss / accum_steps does not); fix: "
                       "self.window.begin(num_samples=sum(n for n, _ in micro_batches))")


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def make_data(accum: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for STEPS windows of ``accum`` micro-batches of BATCH samples, in order, with the plants."""
    g = torch.Generator().manual_seed(1)
    per_step = accum * BATCH
    x, y = torch.randn(STEPS * per_step, 8, generator=g), torch.randn(STEPS * per_step, 4, generator=g)
    x[(NONFINITE_STEP - 1) * per_step] = math.inf
    y[(OVERFLOW_STEP - 1) * per_step:OVERFLOW_STEP * per_step] *= 3e3
    return x, y


def windows(x: torch.Tensor, y: torch.Tensor, accum: int, device: torch.device) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    xs, ys = x.to(device).split(BATCH), y.to(device).split(BATCH)
    return [list(zip(xs[s * accum:(s + 1) * accum], ys[s * accum:(s + 1) * accum])) for s in range(STEPS)]


def loss_fn(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch[0]).float(), batch[1])


def lr_factor(n: int) -> float:
    """The lr multiplier after ``n`` applied steps: linear warmup, then cosine to MIN_LR_RATIO (as LRSchedule)."""
    warm = min((n + 1) / WARMUP, 1.0)
    progress = min(max((n - WARMUP) / (STEPS - WARMUP), 0.0), 1.0)
    return warm * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


def scaler_state(device: torch.device) -> dict[str, Any]:
    return torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL).state_dict()


@dataclass
class Run:
    """What a run leaves: its model, optimizer and scaler, and per step (applied, clipped)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None
    flags: list[tuple[bool, bool]]


def hand_written_loop(model: nn.Module, batches: list, precision: str, device: torch.device) -> Run:
    """The reference: the loop a careful user writes with torch alone (nanoGPT's step, skip-aware)."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # A tensor lr: a fused optimizer reads it on the device, so the schedule needs no sync.
    optimizer = torch.optim.AdamW(groups, lr=torch.tensor(PEAK_LR, device=device), betas=BETAS, eps=EPS, fused=True)
    scaler = (torch.amp.GradScaler(device.type, init_scale=INIT_SCALE, growth_interval=GROWTH_INTERVAL)
              if precision == "fp16" else None)
    dtype = AUTOCAST.get(precision)

    def set_lr(applied_steps: int) -> None:
        for group in optimizer.param_groups:
            group["lr"].fill_(PEAK_LR * lr_factor(applied_steps))

    applied_steps, flags = 0, []
    set_lr(0)
    for window in batches:
        optimizer.zero_grad(set_to_none=True)
        for batch in window:
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = loss_fn(model, batch) / len(window)
            (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        applied = bool(torch.isfinite(norm))  # one sync per step: a reference loop may
        if scaler is not None:
            scaler.step(optimizer)  # skips on the inf check unscale_ made
            scaler.update()
        elif applied:
            optimizer.step()
        if applied:  # the schedule holds on a skipped step
            applied_steps += 1
            set_lr(applied_steps)
        flags.append((applied, applied and float(norm) > MAX_NORM))
    return Run(model, optimizer, scaler, flags)


def config(precision: str, accum: int, device: torch.device) -> Any:
    return load_config(None, [
        "task=mlp", f"device={device.type}", f"precision={precision}", f"accum.steps={accum}", f"train.batch_size={BATCH}",
        f"train.max_steps={STEPS}", f"optim.lr={PEAK_LR}", f"optim.weight_decay={WEIGHT_DECAY}", f"optim.beta1={BETAS[0]}",
        f"optim.beta2={BETAS[1]}", f"optim.eps={EPS}", f"clip.max_norm={MAX_NORM}", f"sched.warmup_steps={WARMUP}",
        "sched.decay=cosine", f"sched.min_lr_ratio={MIN_LR_RATIO}", "data.shuffle=false", "log.every=10", "eval.every=0",
        "ckpt.every=0", "capture.incidents=false", "log.progress=false", "log.tensorboard=false", "train.gc_freeze=false"])


def precision_policy(precision: str, device: torch.device) -> PrecisionPolicy:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16 on CPU warns that it is meant for tests
        policy = PrecisionPolicy(precision, device)
    if policy.scaler is not None:
        policy.load_state_dict({"mode": precision, "scaler": scaler_state(device)})
    return policy


class PlannedWindow(AccumulationWindow):
    """An accumulation window given the window's sample count, as ``TrainStep.forward_backward`` should give it.

    Stands in for the one-line change to step.py (``self.window.begin(num_samples=...)``) until the lead makes it.
    """

    def __init__(self, params: list[torch.Tensor], num_samples: int, *, sums: bool) -> None:
        self.planned = num_samples
        super().__init__(params, sums=sums)

    def begin(self, num_samples: int | None = None) -> None:
        super().begin(num_samples or self.planned)


def stabletrain_step(model: nn.Module, batches: list, precision: str, device: torch.device, *,
                     planned: bool = False) -> Run:
    """The step ``build_step`` builds, fed the same windows (``planned``: with a :class:`PlannedWindow`)."""
    cfg = config(precision, len(batches[0]), device)
    policy = precision_policy(precision, device)
    optimizer = build_optimizer(unique_params(model), cfg.optim, device)
    schedule = LRSchedule(optimizer, WARMUP, STEPS, "cosine", MIN_LR_RATIO)
    parts: dict[str, Any] = {"schedule": schedule}
    if planned:
        params = list(model.parameters())
        parts["window"] = PlannedWindow(params, len(batches[0]) * BATCH, sums=sums_safe(params, policy))
    step = build_step(cfg, model, optimizer, policy, **parts)
    flags = []
    for window in batches:
        out = step([(len(batch[0]), batch) for batch in window], loss_fn)
        flags.append((bool(out["applied"]), bool(out["clipped"])))
    return Run(model, optimizer, policy.scaler, flags)


def stabletrain_trainer(model: nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str, accum: int,
                        device: torch.device) -> Run:
    """The built-in loop: ``Trainer.fit`` over the same samples in order (its guard skips the non-finite step)."""
    task = Task(model=model, train_data=TensorDataset(x, y), loss=loss_fn, name="parity")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = Trainer(config(precision, accum, device), task=task)
    if trainer.precision.scaler is not None:
        trainer.precision.load_state_dict({"mode": precision, "scaler": scaler_state(device)})
    train_step, outs = trainer.train_step, []

    def recorded(*args: Any, **kwargs: Any) -> dict[str, torch.Tensor]:  # the step's flags, read after the run
        out = train_step(*args, **kwargs)
        outs.append((out["applied"], out["clipped"]))
        return out

    trainer.train_step = recorded
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit()
    flags = [(bool(applied), bool(clipped)) for applied, clipped in outs]
    return Run(trainer.module, trainer.optimizer, trainer.precision.scaler, flags)


def bits(t: torch.Tensor | float) -> torch.Tensor:
    t = torch.as_tensor(t).detach().reshape(-1).cpu()
    return t.contiguous().view(torch.uint8)


def differences(a: Run, b: Run) -> list[str]:
    """Where two runs' final states differ, bit for bit (empty: identical)."""
    out = []
    if a.flags != b.flags:
        steps = [i + 1 for i, (fa, fb) in enumerate(zip(a.flags, b.flags)) if fa != fb]
        out.append(f"(applied, clipped) differ at steps {steps[:5]}: {[a.flags[s - 1] for s in steps[:5]]} vs "
                   f"{[b.flags[s - 1] for s in steps[:5]]}")
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        if not torch.equal(bits(p), bits(q)):
            out.append(f"{name}: max |diff| {(p.detach().double() - q.detach().double()).abs().max().item():.3g}")
        sa, sb = a.optimizer.state[p], b.optimizer.state[q]
        if sorted(sa) != sorted(sb):
            out.append(f"{name}: optimizer state keys {sorted(sa)} vs {sorted(sb)}")
            continue
        out += [f"{name}: optimizer {k} differs" for k in sa if not torch.equal(bits(sa[k]), bits(sb[k]))]
    for i, (ga, gb) in enumerate(zip(a.optimizer.param_groups, b.optimizer.param_groups)):
        if not torch.equal(bits(torch.as_tensor(ga["lr"], dtype=torch.float32)),
                           bits(torch.as_tensor(gb["lr"], dtype=torch.float32))):
            out.append(f"param group {i}: lr {float(ga['lr'])!r} vs {float(gb['lr'])!r}")
    if (a.scaler is None) != (b.scaler is None) or (a.scaler is not None and a.scaler.state_dict() != b.scaler.state_dict()):
        out.append(f"GradScaler state {a.scaler and a.scaler.state_dict()} vs {b.scaler and b.scaler.state_dict()}")
    return out


def run_parity(precision: str, accum: int, device: torch.device, how: str = "step") -> dict[str, Any]:
    """Train the hand-written loop and stabletrain (``how``: step, planned (the step with a PlannedWindow), trainer).

    Returns the differences (empty: bitwise equal) and what happened: steps skipped and clipped.
    """
    model = make_model().to(device)
    reference, ours = copy.deepcopy(model), copy.deepcopy(model)
    x, y = make_data(accum)
    batches = windows(x, y, accum, device)
    hand = hand_written_loop(reference, batches, precision, device)
    if how == "trainer":
        run = stabletrain_trainer(ours, x, y, precision, accum, device)
    else:
        run = stabletrain_step(ours, batches, precision, device, planned=how == "planned")
    return {"precision": precision, "accum": accum, "how": how, "differences": differences(hand, run),
            "skipped": [i + 1 for i, (applied, _) in enumerate(hand.flags) if not applied],
            "clipped": sum(clipped for _, clipped in hand.flags), "steps": len(run.flags)}


#: (precision, accum steps, why it is not bitwise yet or None).
CASES = [("fp32", 1, None), ("bf16", 1, None), ("fp16", 1, None),
         ("fp32", 2, None), ("bf16", 2, None), ("fp16", 2, None)]
CPU = torch.device("cpu")


def planted_problems(result: dict[str, Any]) -> list[str]:
    """What the run did not meet of what was planted (empty: all of it): the skips, clipping on some steps only."""
    skipped, problems = result["skipped"], []
    if result["steps"] != STEPS:
        problems.append(f"{result['steps']} steps, not {STEPS}")
    planted = [NONFINITE_STEP] + ([OVERFLOW_STEP] if result["precision"] == "fp16" else [])
    if not set(planted) <= set(skipped):
        problems.append(f"skipped steps {skipped} lack the planted {planted}")
    if result["precision"] == "fp16" and skipped[:3] != [1, 2, 3]:  # the scaler's warm-up from 2**24
        problems.append(f"skipped steps {skipped}: the GradScaler did not overflow on steps 1-3")
    if result["precision"] != "fp16" and skipped != planted:
        problems.append(f"skipped steps {skipped}, expected {planted}")
    if not 0 < result["clipped"] < STEPS - len(skipped):
        problems.append(f"clipping fired on {result['clipped']} of {STEPS - len(skipped)} applied steps")
    return problems


def check(result: dict[str, Any]) -> None:
    assert not planted_problems(result), planted_problems(result)
    if result["precision"] == "fp16":  # here the scale also grows back into an overflow: a skip after the warm-up run
        regrown = [s for i, s in enumerate(result["skipped"], 1) if s != i and s not in (NONFINITE_STEP, OVERFLOW_STEP)]
        assert regrown, result["skipped"]
    assert not result["differences"], "\n".join(result["differences"])


@pytest.mark.parametrize("precision, accum, gap", [pytest.param(p, a, g, id=f"{p}-accum{a}",
                         marks=[pytest.mark.xfail(reason=g, strict=True)] if g else []) for p, a, g in CASES])
def test_the_step_is_bitwise_the_hand_written_loop(precision, accum, gap):
    result = run_parity(precision, accum, CPU)
    check(result)


def test_fp16_accumulation_is_bitwise_once_the_step_gives_the_window_its_sample_count():
    result = run_parity("fp16", 2, CPU, how="planned")
    check(result)


@pytest.mark.parametrize("precision, accum", [("fp32", 1), ("bf16", 2), ("fp16", 1)])
def test_the_trainer_loop_is_bitwise_the_hand_written_loop(precision, accum):
    result = run_parity(precision, accum, CPU, how="trainer")
    check(result)


def test_a_window_given_its_sample_count_backpropagates_each_mean_as_its_share():
    window = AccumulationWindow([], sums=False)  # a GradScaler's window (no raw sums)
    window.begin(num_samples=24)
    assert window.takes_mean(last=False)
    assert window.take_mean(torch.tensor(3.0), torch.tensor(8.0)).item() == 1.0  # 3 / (24 / 8)
    assert window.take_mean(torch.tensor(6.0), torch.tensor(16.0)).item() == 4.0  # 6 / (24 / 16)
    assert window.mean_loss.item() == 5.0 and window.global_count.item() == 24.0 and window.grad_scale is None
    with pytest.raises(ValueError, match="task loss: a per-item mean and then a"):
        window.normalize(torch.tensor(1.0), torch.tensor(1.0), last=True)
    window.begin()  # no count given: the running count, as before
    assert not window.takes_mean(last=True)
