"""numerics: the post-update finiteness check cannot overflow, and it reads NaN and Inf exactly."""

from __future__ import annotations

import math

import pytest
import torch

from stabletrain.numerics import all_params_finite
from stabletrain.records.checkpoint.files import first_nonfinite

HUGE_FP32 = torch.full((1000,), 1e30)  # finite, but its L2 norm's squares (1e60) overflow fp32
HUGE_BF16 = torch.full((64,), 1e35, dtype=torch.bfloat16)


def test_huge_finite_weights_are_finite():
    # What the fused L2 norm (the check before) made of them: inf, so "non-finite value in the parameters".
    assert [math.isinf(float(n)) for n in torch._foreach_norm([HUGE_FP32, HUGE_BF16])] == [True, True]
    assert bool(all_params_finite([HUGE_FP32])) and bool(all_params_finite([HUGE_BF16]))
    assert bool(all_params_finite([torch.randn(8, 8), HUGE_FP32, HUGE_BF16, torch.zeros(0)]))
    assert bool(all_params_finite([torch.full((4,), torch.finfo(torch.float32).max)]))
    assert bool(all_params_finite([]))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_real_nan_or_inf_is_caught_next_to_huge_weights(bad, dtype):
    w = torch.randn(1000).to(dtype)
    w[517] = bad
    flag = all_params_finite([HUGE_FP32, w, HUGE_BF16])
    assert flag.dtype == torch.bool and flag.shape == () and not bool(flag)


def test_the_fused_path_used_off_cpu_reads_max_abs_exactly():
    # On CUDA the check is one _foreach_norm(ord=inf) pass: max |x|, NaN-propagating, no squares.
    nan = torch.tensor([1.0, math.nan])
    norms = torch._foreach_norm([HUGE_FP32, HUGE_BF16, nan, torch.tensor([-math.inf])], ord=math.inf)
    assert [bool(torch.isfinite(n)) for n in norms] == [True, True, False, False]


def test_checkpoint_first_nonfinite_rechecks_what_its_norm_flags():
    # checkpoint.first_nonfinite also starts from an L2 norm, but rechecks each flagged tensor exactly.
    state = {"model": {"a": HUGE_FP32, "b": HUGE_BF16}}
    assert first_nonfinite(state) is None
    state["model"]["c"] = torch.tensor([1.0, math.inf])
    assert first_nonfinite(state) == "model.c"


@pytest.mark.gpu
def test_on_cuda_one_fused_pass_without_a_sync():
    params = [HUGE_FP32.cuda(), HUGE_BF16.cuda(), torch.randn(4096, 4096, device="cuda")]
    torch.cuda.set_sync_debug_mode("error")
    try:
        ok = all_params_finite(params)
        params[2][7, 7] = math.nan
        bad = all_params_finite(params)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert bool(ok) and not bool(bad)


def test_both_finite_is_false_for_nan_or_inf_in_either_and_true_for_huge_finite_values():
    from stabletrain.numerics import both_finite

    big = torch.finfo(torch.float32).max
    t = torch.tensor
    assert bool(both_finite(t(1.0), t(big))) and bool(both_finite(t(big), t(big)))  # no sum that could overflow
    for bad in (math.nan, math.inf, -math.inf):
        assert not bool(both_finite(t(bad), t(1.0))) and not bool(both_finite(t(1.0), t(bad)))


def test_buffers_kept_puts_back_a_buffer_the_forward_replaced_or_added_and_restores_values():
    """A causal-mask cache grown from 2x2 to 8x8 in the forward (a new tensor of another shape) raised in copy_; one the
    forward added stayed; a BatchNorm's statistics come back to their values."""
    from torch import nn

    from stabletrain.numerics import buffers_kept

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("mask", torch.ones(2, 2))
            self.register_buffer("cache", None, persistent=False)
            self.norm = nn.BatchNorm1d(8)

        def forward(self, x):
            self.mask = torch.tril(torch.ones(x.shape[0], x.shape[0]))  # grown: a new tensor
            if self.cache is None:
                self.cache = x.detach().clone()
            return self.norm(self.mask @ x)

    model = Masked()
    mask, mean = model.mask, model.norm.running_mean.clone()
    with buffers_kept(model):
        model(torch.randn(8, 8))
        assert model.mask.shape == (8, 8) and not torch.equal(model.norm.running_mean, mean)
    assert model.mask is mask and torch.equal(mask, torch.ones(2, 2))
    assert "cache" not in dict(model.named_buffers()) and torch.equal(model.norm.running_mean, mean)
    assert model.cache is None  # (a cache registered as None and filled on first use: None again, still registered)
    model(torch.randn(8, 8))  # and the forward that fills it runs as before
    assert model.cache.shape == (8, 8)
