"""Accumulation: k micro-batches give the same update as one big batch, tail and variable length included."""

import pytest
import torch
from helpers import cfg, regression_task, varlen_task
from torch.utils.data import default_collate

from stabletrain import Trainer
from stabletrain.distributed.carrier import WindowCarrier
from stabletrain.policies.accumulation import AccumulationWindow, as_sum_count

RTOL = 1e-5  # fp32: only summation order differs


def _grads(model):
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def _collate(task, idx):
    return default_collate([task.train_data[i] for i in idx])


def _big(task, idx):
    task.model.zero_grad(set_to_none=True)
    loss_sum, count = as_sum_count(task.loss(task.model, _collate(task, idx)), len(idx))
    (loss_sum / count).backward()
    return _grads(task.model)


def _window(task, chunks):
    task.model.zero_grad(set_to_none=True)
    window = AccumulationWindow(list(task.model.parameters()))
    for i, idx in enumerate(chunks):
        loss_sum, count = as_sum_count(task.loss(task.model, _collate(task, idx)), len(idx))
        window.normalize(loss_sum, count, last=i == len(chunks) - 1).backward()
    return _grads(task.model), window


def _naive(task, chunks):
    task.model.zero_grad(set_to_none=True)
    for idx in chunks:
        loss_sum, count = as_sum_count(task.loss(task.model, _collate(task, idx)), len(idx))
        (loss_sum / count / len(chunks)).backward()
    return _grads(task.model)


@pytest.mark.parametrize("make", [regression_task, varlen_task], ids=["mean-loss-tail", "varlen-sum-count"])
def test_window_equals_big_batch_and_naive_differs(make):
    torch.manual_seed(0)
    task = make()
    chunks = [list(range(0, 8)), list(range(8, 16)), list(range(16, 24)), list(range(24, 27))]  # short tail
    everything = [i for c in chunks for i in c]
    g_big = _big(task, everything)
    g_acc, window = _window(task, chunks)
    g_naive = _naive(task, chunks)
    scale = g_big.abs().max()
    assert torch.allclose(g_acc, g_big, rtol=0, atol=RTOL * scale), (g_acc - g_big).abs().max()
    naive_err = (g_naive - g_big).abs().max()
    assert naive_err > 100 * RTOL * scale, f"the naive mean-of-means should be visibly wrong here, err={naive_err}"
    # The logged loss is the unscaled per-item mean of the whole window.
    with torch.no_grad():
        loss_sum, count = as_sum_count(task.loss(task.model, _collate(task, everything)), len(everything))
    assert torch.allclose(window.mean_loss, loss_sum / count, rtol=1e-6)


@pytest.mark.parametrize("make", [regression_task, varlen_task], ids=["mean-loss-tail", "varlen-sum-count"])
def test_a_summing_window_backpropagates_raw_sums_and_its_grad_scale_gives_the_big_batch_mean(make):
    torch.manual_seed(0)
    task = make()
    params = list(task.model.parameters())
    chunks = [list(range(0, 8)), list(range(8, 16)), list(range(16, 19))]  # short tail
    everything = [i for c in chunks for i in c]
    g_big = _big(task, everything)
    task.model.zero_grad(set_to_none=True)
    window = AccumulationWindow(params, sums=True)
    raw = []
    for i, idx in enumerate(chunks):
        loss_sum, count = as_sum_count(task.loss(task.model, _collate(task, idx)), len(idx))
        out = window.normalize(loss_sum, count, last=i == len(chunks) - 1)
        assert out is loss_sum  # no division, and no rescale of the grads accumulated so far
        out.backward()
        raw.append(loss_sum.detach())
    g = _grads(task.model) * window.grad_scale  # what the step's clip pass multiplies by
    assert torch.allclose(g, g_big, rtol=0, atol=RTOL * g_big.abs().max()), (g - g_big).abs().max()
    assert window.global_count == len(everything) if make is regression_task else window.global_count > len(everything)
    assert torch.allclose(window.mean_loss, sum(raw) / window.global_count, rtol=1e-6)


def test_raw_sums_only_without_a_grad_scaler_and_without_fp16_parameters():
    from types import SimpleNamespace

    from stabletrain.policies.accumulation import sums_safe

    w = [torch.zeros(2)]
    assert sums_safe(w, SimpleNamespace(scaler=None))
    assert sums_safe([torch.zeros(2, dtype=torch.bfloat16)], SimpleNamespace(scaler=None))
    assert not sums_safe(w, SimpleNamespace(scaler=object()))  # fp16 + GradScaler: the loss scale x a raw sum overflows
    assert not sums_safe([torch.zeros(2, dtype=torch.float16)], SimpleNamespace(scaler=None))


def test_as_sum_count_contract():
    s, c = as_sum_count(torch.tensor(2.0), 4)
    assert (s.item(), c.item()) == (8.0, 4.0)
    s, c = as_sum_count((torch.tensor(6.0), 3), 99)
    assert (s.item(), c.item()) == (6.0, 3.0)
    with pytest.raises(ValueError, match="shape"):
        as_sum_count(torch.ones(3), 3)
    with pytest.raises(ValueError, match="scalar mean or a \\(sum, count\\)"):
        as_sum_count("nope", 3)


def _train(accum, batch, steps, n=60, make=regression_task):
    torch.manual_seed(0)
    task = make()
    task.train_data = torch.utils.data.Subset(task.train_data, range(n))
    c = cfg(f"accum.steps={accum}", f"train.batch_size={batch}", f"train.max_steps={steps}", "log.every=1",
            "clip.max_norm=null", "optim.lr=0.01", "sched.warmup_steps=0")
    trainer = Trainer(c, task=task)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("make", [regression_task, varlen_task], ids=["mean-loss", "varlen"])
def test_trainer_accumulation_matches_big_batch_across_an_epoch_tail(make):
    # 60 samples: batch 16 -> steps of 16,16,16,12; batch 4 x accum 4 -> windows of 4,4,4,3 micro-batches.
    big = _train(1, 16, 6, make=make)
    acc = _train(4, 4, 6, make=make)
    assert big.stream.epoch == acc.stream.epoch == 1
    for a, b in zip(big.model.parameters(), acc.model.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), (a - b).abs().max()
    losses_big = [r["loss"] for r in big.history]
    losses_acc = [r["loss"] for r in acc.history]
    assert losses_acc == pytest.approx(losses_big, rel=1e-5)


class FakeCarrier:
    """Stands in for the comm hook's carrier (stabletrain.distributed.carrier.register_carrier_hook): takes what the
    window carries."""

    travels, averaged = True, False

    def carry(self, payload, scale, loss):
        self.payload, self.scale, self.received = payload, scale, None
        return loss


def test_a_carried_window_sums_each_ranks_unnormalized_gradient_to_the_exact_global_mean(monkeypatch):
    """What the DDP comm hook does, written out for two simulated ranks (see stabletrain.policies.accumulation)."""
    monkeypatch.setattr(AccumulationWindow, "_world", lambda self: 2)
    torch.manual_seed(0)
    task = varlen_task()
    params = list(task.model.parameters())
    # Different item counts on the ranks, a short window on rank 1, and one micro-batch with no items at all.
    ranks = {0: [list(range(0, 6)), list(range(6, 13)), list(range(13, 15))], 1: [list(range(20, 24)), list(range(24, 27))]}
    empty = (1, 0)  # rank 1's first micro-batch: every token masked out (count 0)
    sums, windows, carriers = [], [], []
    for r, chunks in ranks.items():
        task.model.zero_grad(set_to_none=True)
        window, carrier = AccumulationWindow(params), FakeCarrier()
        for i, idx in enumerate(chunks):
            x, y, mask = _collate(task, idx)
            if (r, i) == empty:
                mask = torch.zeros_like(mask)
            loss_sum, count = as_sum_count(task.loss(task.model, (x, y, mask)), len(idx))
            window.normalize(loss_sum, count, last=i == len(chunks) - 1, carrier=carrier).backward()
        sums.append(_grads(task.model) * carrier.scale)  # the hook: this rank's unnormalized sum
        windows.append(window)
        carriers.append(carrier)
    received = carriers[0].payload + carriers[1].payload  # the all-reduce of the carried numbers
    for c in carriers:
        c.received = received
    everything = [i for r, chunks in ranks.items() for i, idx in enumerate(chunks) if (r, i) != empty for i in idx]
    g_big = _big(task, everything)
    for window in windows:  # every rank ends with the same exact global mean
        g = (sums[0] + sums[1]) * window.grad_scale
        assert torch.isfinite(g).all()
        assert torch.allclose(g, g_big, rtol=0, atol=RTOL * g_big.abs().max()), (g - g_big).abs().max()
        with torch.no_grad():
            loss_sum, count = as_sum_count(task.loss(task.model, _collate(task, everything)), len(everything))
        assert window.global_count == count and torch.allclose(window.mean_loss, loss_sum / count, rtol=1e-6)


def test_a_carrier_without_its_hook_is_ignored_and_an_unreduced_window_says_why(monkeypatch):
    task = regression_task()
    window = AccumulationWindow(list(task.model.parameters()))
    carrier = FakeCarrier()
    carrier.travels = False  # e.g. FSDP: nothing travels with the gradients; one process here, so no collective
    loss_sum, count = as_sum_count(task.loss(task.model, _collate(task, range(8))), 8)
    window.normalize(loss_sum, count, last=True, carrier=carrier).backward()
    assert window.grad_scale is None and window.global_count == 8
    monkeypatch.setattr(AccumulationWindow, "_world", lambda self: 2)
    carrier.travels = True
    window.begin()
    window.normalize(loss_sum.detach(), count, last=True, carrier=carrier)
    with pytest.raises(RuntimeError, match="no gradient all-reduce ran after the last micro-batch"):
        _ = window.mean_loss


def test_a_carrier_parameter_takes_the_windows_numbers_as_its_gradient_and_leaves_the_models_alone():
    """DDP's own all-reduce then averages them with the gradients (tests/dist_carrier.py runs it on 2 ranks)."""
    task = regression_task()
    params = list(task.model.parameters())
    carrier = WindowCarrier(param=torch.nn.Parameter(torch.zeros(3)))
    batch = _collate(task, range(8))
    loss_sum, count = as_sum_count(task.loss(task.model, batch), 8)
    loss_sum.backward()
    plain = [p.grad.clone() for p in params]
    task.model.zero_grad(set_to_none=True)
    carrier.reset()
    loss_sum, count = as_sum_count(task.loss(task.model, batch), 8)
    numbers = torch.stack([loss_sum.detach(), count, torch.zeros(())])
    carried = carrier.carry(numbers, None, loss_sum)
    assert torch.equal(carried, loss_sum)
    carried.backward()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, plain))
    assert torch.equal(carrier.param.grad, numbers) and torch.equal(carrier.received, numbers)  # one process: world 1
    carrier.reset()
    assert carrier.param.grad is None and carrier.received is None
    with pytest.raises(RuntimeError, match="carries only windows of raw sums"):
        carrier.carry(numbers, count, loss_sum)


def test_a_window_whose_first_micro_batch_counts_no_items_gives_the_rest_of_the_windows_mean():
    """A review: under a GradScaler (no raw sums) a first micro-batch whose every token was masked out (count 0)
    backpropagated 0/0: NaN gradients, which the step then read as an fp16 overflow and skipped, no incident."""
    torch.manual_seed(0)
    task = regression_task()
    x, y = _collate(task, list(range(8)))

    def masked(keep):
        out = (task.model(x) - y).pow(2).sum(-1)
        return (out * keep).sum(), keep.sum()  # (a mask multiplied in, as padding is: its gradient is 1/count x 0)

    g_big = _big(task, list(range(8)))
    task.model.zero_grad(set_to_none=True)
    window = AccumulationWindow(list(task.model.parameters()))  # (sums=False: the GradScaler's path)
    for i, keep in enumerate((torch.zeros(8, dtype=torch.bool), torch.ones(8, dtype=torch.bool))):
        window.normalize(*masked(keep), last=i == 1).backward()
    g_acc = _grads(task.model)
    assert torch.isfinite(g_acc).all() and torch.allclose(g_acc, g_big, rtol=0, atol=RTOL * g_big.abs().max())
    assert torch.allclose(window.mean_loss, (task.model(x) - y).pow(2).sum(-1).mean(), rtol=1e-6)
