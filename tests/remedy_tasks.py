"""Tasks with a planted fault of each failure class, for the failure-class and remedy tests.

Each is a task factory (``task=remedy_tasks:NAME``: tests/ is on ``sys.path``), small enough to train,
capture, diagnose and replay under remedies in seconds on a CPU.
"""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F
from faults import L2Normalize, LogSoftmax, Stack
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from stabletrain import Task


def _mse(model: nn.Module, batch) -> Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def _slow_mse(model: nn.Module, batch) -> Tensor:
    time.sleep(0.05)  # a run a test can SIGKILL mid-way
    return _mse(model, batch)


def sqrt_zero_task(bad_index: int = 13, n: int = 32, seed: int = 0, slow: bool = False,
                   also: int | None = None) -> Task:
    """op: sample ``bad_index`` is all zeros, so ``layers.1``'s sqrt(sum x^2) is sqrt(0) and its backward NaN.

    ``slow``: the loss sleeps 50 ms (a run to kill mid-way). ``also``: a second all-zero sample.
    """
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    x[bad_index] = 0.0
    if also is not None:
        x[also] = 0.0
    y = torch.randn(n, 1, generator=g)
    torch.manual_seed(seed)
    model = Stack(nn.Linear(8, 16, bias=False), L2Normalize(), nn.Linear(16, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_slow_mse if slow else _mse, name="sqrt-zero")


def _nll(model: nn.Module, batch) -> Tensor:
    x, y = batch
    return F.nll_loss(model(x), y)


def log_softmax_task(bad_index: int = 5, n: int = 32, seed: int = 0) -> Task:
    """op: sample ``bad_index``'s features x1e4, so its logits spread by thousands: softmax rounds its target's
    probability to 0 and ``layers.1``'s log of it is -inf (the NLL loss inf)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    x[bad_index] *= 1e4
    y = torch.randint(0, 4, (n,), generator=g)
    torch.manual_seed(seed)
    model = Stack(nn.Linear(8, 4), LogSoftmax())
    return Task(model=model, train_data=TensorDataset(x, y), loss=_nll, name="log-softmax")


def diverging_task(n: int = 64, scale: float = 1.0, seed: int = 0) -> Task:
    """divergence: linear regression whose inputs' scale makes a large enough SGD lr grow the loss geometrically."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g) * scale
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(seed)
    return Task(model=Stack(nn.Linear(8, 1)), train_data=TensorDataset(x, y), loss=_mse, name="diverging")


class Rescaled(nn.Module):
    """``fc(x) * scale``: with ``fc``'s weights x 1/scale, the same function, but fc's own output is huge."""

    def __init__(self, n: int, scale: float) -> None:
        super().__init__()
        self.fc, self.scale = nn.Linear(n, n), scale
        with torch.no_grad():
            self.fc.weight.mul_(1.0 / scale)
            self.fc.bias.mul_(1.0 / scale)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x) * self.scale


def fp16_overflow_task(n: int = 32, seed: int = 0) -> Task:
    """overflow: ``layers.1.fc``'s output (~1e5) exceeds float16's 65504 under fp16 autocast; fine in fp32."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g) * 4
    y = torch.randn(n, 1, generator=g)
    torch.manual_seed(seed)
    model = Stack(nn.Linear(8, 16), Rescaled(16, 1e-5), nn.Linear(16, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="fp16-overflow")


def fp16_nan_grads_task(n: int = 32, seed: int = 0) -> Task:
    """fp16, a GradScaler that cannot recover: ``layers.0`` outputs zeros for every sample, so ``layers.1``'s
    sqrt(0) makes every step's gradients NaN; the loss stays finite, and each step is the scaler's overflow."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 1, generator=g)
    torch.manual_seed(seed)
    model = Stack(nn.Linear(8, 16, bias=False), L2Normalize(), nn.Linear(16, 1))
    with torch.no_grad():
        model.layers[0].weight.zero_()
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="fp16-nan-grads")


def fp16_stall_task(n: int = 80, seed: int = 0) -> Task:
    """An fp16 run that stalls without ever skipping 20 steps in a row: in 9 of every 10 batches (batch 8, in
    order) one sample is 1e6 times too large, so the float16 forward overflows (a non-finite loss: skipped, and
    the GradScaler backs off); the tenth batch is normal, but by then the scale has fallen so far that its
    gradients underflow to 0. The parameters never move."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    x[[i for i in range(0, n, 8) if (i // 8) % 10 != 9]] *= 1e6
    y = torch.randn(n, 1, generator=g)
    torch.manual_seed(seed)
    return Task(model=Stack(nn.Linear(8, 16), nn.Linear(16, 1)), train_data=TensorDataset(x, y), loss=_mse,
                name="fp16-stall")


def lr_jump_task(jump_at: int = 20, factor: float = 1000.0, n: int = 256, seed: int = 0) -> Task:
    """state, a burst that goes on: a regression under :class:`~spike_tasks.StepCountedAdamW`, whose updates are x1000
    from its 20th on (a schedule bug inside the optimizer; batch 8, constant LR): the loss spikes at step 24 and at
    every step after it."""
    from spike_tasks import StepCountedAdamW

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    torch.manual_seed(seed)
    return Task(model=Stack(nn.Linear(8, 16), nn.Linear(16, 1)), train_data=TensorDataset(x, y), loss=_mse, name="lr-jump",
                optimizer=lambda named: StepCountedAdamW([p for _, p in named], jump_at, factor, lr=1e-3, weight_decay=0.0,
                                                         fused=True))


def fp16_big_loss_task(factor: float = 1e6, n: int = 64, seed: int = 0) -> Task:
    """overflow outside any module: the loss is ``factor`` x the MSE (in fp32), so the gradients entering the float16
    matmuls' backward overflow at every scale the GradScaler backs off to, down to below 1 (step 17 from 65536)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = torch.randn(n, 1, generator=g)
    torch.manual_seed(seed)
    return Task(model=Stack(nn.Linear(8, 16), nn.Linear(16, 1)), train_data=TensorDataset(x, y),
                loss=lambda m, b: factor * _mse(m, b), name="fp16-big-loss")


class _LearnedScale(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.fc = nn.Linear(d, 1)
        self.s = nn.Parameter(torch.tensor(1.0))  # a learned variance, parametrized directly: it can cross 0

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x)


def learned_scale_task(n: int = 256, seed: int = 0) -> Task:
    """A heteroscedastic loss with log(s) of a learned variance s: under SGD at lr 1 an update moves s below 0 and
    log(s) is NaN at every sample (a new user's trial)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x.sum(-1, keepdim=True) * 0.3 + 0.1 * torch.randn(n, 1, generator=g)
    torch.manual_seed(seed)

    def loss(m: nn.Module, b) -> Tensor:
        r = (m(b[0]) - b[1]) ** 2
        return (r / (2 * m.s)).mean() + 0.5 * torch.log(m.s)

    return Task(model=_LearnedScale(), train_data=TensorDataset(x, y), name="learned-scale", loss=loss)


def log_of_output_task(n: int = 512, seed: int = 2) -> Task:
    """A Poisson-like loss with log of the model's raw output (a new user's trial): under SGD at lr 3 the first update sends
    every output below 0 and log(out) is NaN at every sample of step 2: no sample's doing and no parameter's own log."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 8, generator=g)
    y = torch.rand(n, generator=g) + 0.5
    model = nn.Linear(8, 1)
    with torch.no_grad():
        model.weight.fill_(0.1)
        model.bias.fill_(1.0)

    def loss(m: nn.Module, b) -> Tensor:
        out = m(b[0]).squeeze(-1)
        return -(torch.log(out) * b[1]).mean() + out.mean()

    return Task(model=model, train_data=TensorDataset(x, y), name="log-of-output", loss=loss)


class _SignalNet(nn.Module):
    def __init__(self, ch: int = 16, classes: int = 4) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv1d(1, ch, 5), nn.InstanceNorm1d(ch)
        self.conv2, self.head = nn.Conv1d(ch, ch, 5), nn.Linear(ch, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.norm1(self.conv1(x.unsqueeze(1))))
        return self.head(torch.relu(self.conv2(h)).mean(-1))


def dc_offset_task(offset: float = 7e4, n: int = 1280, first_bad: int = 960, nbad: int = 5, seed: int = 0) -> Task:
    """A new user's mis-calibrated sensors: 1-D signals whose samples ``first_bad``.. carry a DC offset (step 121 at
    batch 8, data in order) that the instance norm after the first conv removes in fp32; past fp16's range (7e4) the
    conv's fp16 input overflows (a non-finite step); in bf16 the offset's rounding loses the signal (a x140 loss)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    t = torch.arange(32).float()
    phase = torch.rand(n, generator=g) * 2 * math.pi
    x = torch.sin(((y.float() + 1.0) * 2 * math.pi / 16)[:, None] * t[None] + phase[:, None])
    x += 0.1 * torch.randn(n, 32, generator=g) + torch.rand(n, 1, generator=g) * 2 - 1
    x[first_bad:first_bad + nbad] += offset
    torch.manual_seed(seed)
    return Task(model=_SignalNet(), train_data=TensorDataset(x, y), name="dc-offset",
                loss=lambda m, b: F.cross_entropy(m(b[0]).float(), b[1]))
