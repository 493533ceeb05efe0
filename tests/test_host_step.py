"""The judging half over a host's own optimizer step (stabletrain.host_step), below the adapters."""

from __future__ import annotations

import warnings

import pytest
import torch

from stabletrain.config import Config
from stabletrain.host_step import HostStep
from stabletrain.numerics import grad_norms
from stabletrain.policies.guard import Guard


@pytest.mark.parametrize("verdict", ["bad", "good"])
def test_a_non_fused_step_under_a_scaler_that_has_not_unscaled_is_skipped_after_its_inf_check(verdict):
    """A review: transformers 4.40-4.5x with fp16, a non-fused optimizer and max_grad_norm=0 does not unscale before
    on_pre_optimizer_step: no inf check to join yet, so the bad step's grads were dropped there, and scaler.step then
    raised 'No inf checks were recorded for this optimizer'. They are dropped in the step's pre-hook, after that check."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    guard = Guard(Config().guard, torch.device("cpu"), scaled=True)
    step = HostStep(model, opt, scaler, guard, list(model.parameters()), host_clip=None, own_clip=None, may_skip=True,
                    check_params=False, skip_hint="fused=True")
    loss = model(torch.randn(2, 4)).sum()
    scaler.scale(loss).backward()  # finite grads: the scaler alone would step
    before = [p.detach().clone() for p in model.parameters()]
    norm, per = grad_norms(list(model.parameters()))
    judged = torch.tensor(float("nan")) if verdict == "bad" else loss.detach()  # the step's loss as the host saw it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step.before_step(judged, norm, per, grads_scaled=True)
        scaler.step(opt)
    scaler.update()
    out = step.after_step(2.0)
    moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters())]
    assert moved == ([False, False] if verdict == "bad" else [True, True])
    assert bool(out["applied"]) is (verdict == "good")
    step.close()


def test_a_replays_own_clip_of_still_scaled_grads_is_the_live_ones_bitwise():
    """A review: a fused optimizer under a GradScaler unscales inside its step, so its grads still hold the scale when
    stabletrain clips them (clip_max_norm, on the unscaled norm); Lightning's replay clipped them with
    clip_grad_norm_ on their scaled norm, a factor ~65536x smaller, and replayed updates ~65536x too small."""
    from stabletrain.host_step import clip_as_judged

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    guard = Guard(Config().guard, torch.device("cpu"), scaled=True)
    step = HostStep(model, opt, scaler, guard, list(model.parameters()), host_clip=None, own_clip=0.5, may_skip=True,
                    check_params=False, skip_hint="")
    scaler.scale(model(torch.randn(8, 4)).pow(2).sum()).backward()
    scaled = [p.grad.clone() for p in model.parameters()]
    norm, per = grad_norms(list(model.parameters()))
    step.before_step(torch.tensor(1.0), norm, per, grads_scaled=True)  # the live clip
    live = [p.grad.clone() for p in model.parameters()]
    for p, g in zip(model.parameters(), scaled):
        p.grad = g.clone()
    clip_as_judged(list(model.parameters()), 0.5, step)
    assert all(torch.equal(a, p.grad) for a, p in zip(live, model.parameters()))
    assert float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in live]))) == pytest.approx(
        0.5 * float(scaler.get_scale()), rel=1e-4)  # clipped to 0.5 unscaled, the scale still on
    step.after_step(8.0)
    step.close()

