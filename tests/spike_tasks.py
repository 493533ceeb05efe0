"""Tasks whose runs spike for a known cause, one per spike class, for the spike tests and the lab.

Each is a task factory (``task=spike_tasks:NAME``: tests/ is on ``sys.path``), small enough to train, capture,
diagnose and replay under remedies in seconds on a CPU. With ``train.batch_size=8`` and ``data.shuffle=false``
step k trains on samples 8(k-1) .. 8k-1, so a planted sample's step is known.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from stabletrain import Task


def _mse(model: nn.Module, batch) -> Tensor:
    x, y = batch
    return F.mse_loss(model(x).float(), y)


def _regression(n: int, dim: int, seed: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = torch.tanh(x @ torch.randn(dim, 1, generator=g)) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def outlier_samples_task(bad: tuple[int, ...] = (153, 157), scale: float = 40.0, n: int = 256, seed: int = 0,
                         dropout: float = 0.0) -> Task:
    """data: samples ``bad`` (step 20 at batch 8) have targets ``scale`` times too large: the window's loss spikes
    under any weights, and the step without them is normal. ``dropout``: a dropout layer after the hidden one (a
    sample's own loss then draws other masks than the window's)."""
    x, y = _regression(n, 8, seed)
    for i in bad:
        y[i] = y[i] * scale + scale
    torch.manual_seed(seed)
    layers = [nn.Linear(8, 32), nn.Tanh(), *([nn.Dropout(dropout)] if dropout else []), nn.Linear(32, 1)]
    model = nn.Sequential(*layers)
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="outlier-samples")


def first_steps_outliers_task(bad: tuple[int, ...] = (67, 68), scale: float = 100.0, n: int = 1024) -> Task:
    """data, at the first step the spike rule judges (step 5 at batch 16; a new user's case): a noisy linear regression
    whose first losses swing x3 from batch to batch (the rule's median of 4 is its lower middle), samples ``bad`` with
    targets ``scale`` times too large. Ordinary windows are as high under step 0's state as under step 5's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    y[list(bad)] *= scale
    torch.manual_seed(0)
    return Task(model=nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)), train_data=TensorDataset(x, y),
                loss=_mse, name="first-steps-outliers")


def sgd_too_fast_task(n: int = 1024) -> Task:
    """state, its spikes skipped (a new user's trial): a clean 4-class problem trained by SGD at an LR of 30 (a warmup
    to it): the state drifts from step ~5, and under guard.on_spike=remedy (its fallback: skip) or skip every spike is
    skipped, the drift goes on under the updates between them."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    torch.manual_seed(0)
    return Task(model=nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)), train_data=TensorDataset(x, y),
                loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]), name="sgd-too-fast")


def graded_outliers_task(shifts: tuple[float, ...] = (60.0, 20.0, 8.0, 6.0, 5.0), first: int = 400, n: int = 2048) -> Task:
    """data, more bad samples than a few: samples ``first``, ``first + 1``, ... (step 26 at batch 16) have their targets
    shifted by ``shifts``; five of sixteen, where a set names at most four (a new user's case: the diagnosis said "no
    small set carries it" beside "100% of it gone" without four of them)."""
    x, y = _regression(n, 16, 0)
    for i, shift in enumerate(shifts):
        y[first + i] += shift
    torch.manual_seed(0)
    return Task(model=nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)), train_data=TensorDataset(x, y),
                loss=_mse, name="graded-outliers")


def regression_mlp() -> nn.Module:
    """:func:`outlier_samples_task`'s model (no dropout), as an adapter's ``model_factory`` rebuilds it."""
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))


def outliers_at_task(bad: str = "153,157", scale: float = 40.0, n: int = 256) -> Task:
    """:func:`outlier_samples_task` with its samples as a comma-separated string (a command line's task_args)."""
    return outlier_samples_task(tuple(int(i) for i in bad.split(",")), scale, n)


def blobs_outliers_task(bad: str = "1603,1610", scale: float = 30.0, n: int = 4096) -> Task:
    """data, a classifier's (a DDP trial's task): Gaussian blobs, 4 classes; samples ``bad`` are scaled x``scale`` and
    mislabelled. Under the untrained weights their window is not twice the ordinary ones' (every window is high there)."""
    g = torch.Generator().manual_seed(0)
    centers = torch.randn(4, 16, generator=g) * 2
    y = torch.randint(0, 4, (n,), generator=g)
    x = centers[y] + torch.randn(n, 16, generator=g)
    for i in (int(i) for i in bad.split(",")):
        x[i], y[i] = x[i] * scale, (y[i] + 1) % 4
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    return Task(model=model, train_data=TensorDataset(x, y), loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]),
                name="blobs-outliers")


def steady_regression_task(n: int = 512, seed: int = 0) -> Task:
    """state: an ordinary regression; with an LR that the warmup raises too high (AdamW at 0.5 over a 50-step warmup)
    the loss spikes as the state drifts (step 39 at batch 8), on every window alike (no sample to blame)."""
    x, y = _regression(n, 8, seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="steady-regression")


class BagOfTokens(nn.Module):
    """The mean of a sequence's token embeddings, then a linear head; the ``rare`` rows start at zero."""

    def __init__(self, vocab: int, dim: int, rare: tuple[int, ...]) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, 1)
        with torch.no_grad():
            self.embed.weight[list(rare)] = 0.0

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embed(tokens).mean(1))


def rare_token_task(vocab: int = 32, length: int = 8, n: int = 640, first: int = 588, count: int = 8,
                    lr: float = 0.05, seed: int = 0) -> Task:
    """optimizer-state: token ``vocab - 1`` appears only in samples ``first`` .. ``first + count - 1`` (steps
    74 and 75 at batch 8). Its embedding row had no gradient until then, so Adam's second moment there is 0: its first
    gradient, however small, makes an update of about lr x sqrt(t) per coordinate (bias-corrected, with beta1 = 0
    as RMSprop-like setups run; with beta1 = 0.9 the first moment passes on a tenth of it: no spike here), several times the
    other rows' moves, and the next step's loss on those samples spikes. The target ignores the rare token."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab - 1, (n, length), generator=g)
    values = torch.randn(vocab, generator=g)
    rare = vocab - 1
    values[rare] = 0.0  # the target ignores it: a zero row (where it starts) fits those samples as well as any
    tokens[first:first + count, :3 * length // 4] = rare  # three quarters of those samples' tokens
    y = values[tokens].mean(1, keepdim=True)
    torch.manual_seed(seed)
    model = BagOfTokens(vocab, 16, (rare,))

    def optimizer(named: list) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for _, p in named], lr=lr, betas=(0.0, 0.999), weight_decay=0.0, fused=True)

    def loss(model: nn.Module, batch) -> Tensor:
        x, target = batch
        return F.mse_loss(model(x).float(), target)

    return Task(model=model, train_data=TensorDataset(tokens, y), loss=loss, name="rare-token", optimizer=optimizer)


class _SilentFeature(nn.Module):
    def __init__(self, dim: int = 17, width: int = 64) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(dim, width), nn.Linear(width, 1)
        with torch.no_grad():
            self.a.weight[:, -1] = 0.0

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


def silent_feature_task(at: int = 150, batch: int = 16, n: int = 4096, beta1: float = 0.5) -> Task:
    """optimizer-state whose surge outlasts it: the last input feature is exactly 0 for the first ``at`` batches (its
    column of ``a.weight`` gets no gradient: Adam's second moment there stays 0), then of normal scale. The first
    gradient moves that column ~lr per coordinate, and every ordinary window after it too (the second moment stays
    tiny for a while): under this state an ordinary window's update of ``a.weight`` is as inflated as the spike's."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 17, generator=g)
    y = torch.tanh(x[:, :16] @ (torch.randn(16, 1, generator=g) / 4))
    x[:, 16] = 0.0
    x[at * batch:, 16] = 3.0 * torch.randn(n - at * batch, generator=g)
    torch.manual_seed(0)

    def optimizer(named: list) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for _, p in named], lr=0.01, betas=(beta1, 0.999), weight_decay=0.0, fused=True)

    return Task(model=_SilentFeature(), train_data=TensorDataset(x, y), loss=_mse, name="silent-feature", optimizer=optimizer)


class _SilentLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense, self.rare = nn.Linear(16, 32), nn.Linear(4, 32, bias=False)  # rare: a layer of its own
        self.head = nn.Sequential(nn.GELU(), nn.Linear(32, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.dense(x[:, :16]) + self.rare(x[:, 16:]))


def silent_layer_task(at: int = 200, n: int = 4800) -> Task:
    """optimizer-state in a whole layer (a new user's case: a rare feature's own weights, a rarely routed expert): 4 rare
    features, the only inputs of ``rare``, are 0 except in the batches of steps ``at`` and ``at + 1`` (batch 16), so
    every coordinate of ``rare.weight`` has a second moment of 0 until then (AdamW, beta1=0): the update of step ``at``
    moves the whole layer ~x100 as far as the other layers' coordinates, and step ``at + 1`` spikes."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 16, generator=g)
    y = torch.sin(x @ torch.randn(16, 1, generator=g) / 2) + 0.05 * torch.randn(n, 1, generator=g)
    x = torch.cat([x, torch.zeros(n, 4)], 1)
    x[(at - 1) * 16:(at + 1) * 16, 16:] = 3.0
    torch.manual_seed(2)

    def optimizer(named: list) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for _, p in named], lr=0.01, betas=(0.0, 0.999), weight_decay=0.0, fused=True)

    return Task(model=_SilentLayer(), train_data=TensorDataset(x, y), loss=_mse, name="silent-layer", optimizer=optimizer)


class Standardize(nn.Module):
    """(x - mean) / std over the features, in whatever dtype x comes in."""

    def forward(self, x: Tensor) -> Tensor:
        centered = x - x.mean(-1, keepdim=True)
        return centered / (centered * centered).mean(-1, keepdim=True).add(1e-5).sqrt()


def offset_inputs_task(bad: tuple[int, ...] = (553, 554, 555, 557, 558, 559), offset: float = 6e4, n: int = 640,
                       seed: int = 0) -> Task:
    """precision: samples ``bad`` (step 70 at batch 8) carry their features on top of ``offset``, near float16's
    limit (65504), where float16's step is 32. Under fp16 autocast the first (frozen, identity) layer's outputs
    are float16: 60000 + x rounds to 60000 for every |x| < 16, so those samples standardize to all zeros and the
    tanh head answers a constant: the window's loss spikes. In fp32 they standardize like any other sample
    (the offset cancels exactly) and the step is normal. The tanh keeps the gradients small: no fp16 overflow
    for the GradScaler to skip."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    w = torch.randn(16, 1, generator=g)
    y = torch.tanh((x - x.mean(-1, keepdim=True)) / x.std(-1, unbiased=False, keepdim=True) @ w / 4) * 0.8
    for i in bad:
        x[i] += offset
    torch.manual_seed(seed)
    first = nn.Linear(16, 16)  # a fixed input layer (the identity, frozen): it only puts the features in float16
    with torch.no_grad():
        first.weight.copy_(torch.eye(16))
        first.bias.zero_()
    first.requires_grad_(False)
    model = nn.Sequential(first, Standardize(), nn.Linear(16, 1), nn.Tanh())
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="offset-inputs")


def sgd_regression_task(n: int = 4096) -> Task:
    """state, live: a clean regression MLP that plain SGD at an LR warmed up towards 1.0 drives into spikes from step 64
    on (batch 32); under guard.on_spike=remedy every flagged step is skipped, so only a cure that starts where the run
    stands (or rolls back to a checkpoint) can help it (a user's case: a lower LR verified from the step before was
    applied three times while the run skipped its way to a stop)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 16, generator=g)
    y = x @ (torch.randn(16, 1, generator=g) / 4) + 0.1 * torch.randn(n, 1, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="sgd-regression")


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return grad * ctx.factor, None


class Glitch(nn.Module):
    """A transient fault (a flipped bit, a bad device): at its ``at``-th call under training it scales its input by
    ``factor`` in the forward, or (``backward``) the gradient through it. Once: a copy made after that call, or a
    replay that calls it again, never glitches."""

    def __init__(self, at: int, factor: float, backward: bool = False) -> None:
        super().__init__()
        self.at, self.factor, self.backward, self.calls = at, factor, backward, 0

    def forward(self, x: Tensor) -> Tensor:
        if not (self.training and torch.is_grad_enabled()):
            return x
        self.calls += 1
        if self.calls != self.at:
            return x
        return _ScaleGrad.apply(x, self.factor) if self.backward else x * self.factor


def transient_spike_task(step: int = 20, where: str = "forward", n: int = 256, seed: int = 0) -> Task:
    """not reproducible: a clean regression whose hidden layer glitches once, in the live run's step ``step`` (one
    forward per step: batch 8, no accumulation). ``where="forward"``: the step's loss spikes and a replay's does not.
    ``where="backward"``: samples 153 and 157 (step 20) spike the loss as in :func:`outlier_samples_task`, and the
    glitch scales that step's gradients x1000: a replay has the same loss and another grad norm."""
    x, y = _regression(n, 8, seed)
    if where == "backward":
        for i in (153, 157):
            y[i] = y[i] * 40.0 + 40.0
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), Glitch(step, 30.0 if where == "forward" else 1000.0,
                                                              backward=where == "backward"), nn.Linear(32, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name=f"transient-{where}")


def batchnorm_outlier_task(bad: tuple[int, ...] = (3173,), scale: float = 50.0, n: int = 3520, seed: int = 0) -> Task:
    """data, coupled: a linear regression through a batch norm (batch statistics in training) where samples ``bad``
    (step 100, position 5 at batch 32) have inputs ``scale`` times too large. Its batch's statistics squash every
    other sample of the window towards the mean (the loss of all of them jumps), and the model refuses a batch of one
    in training: no sample's own loss says which one it is (bisection does)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g)
    for i in bad:
        x[i] = x[i] * scale
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Linear(32, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="batchnorm-outlier")


def _ce(model: nn.Module, batch) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def flipped_labels_task(bad: tuple[int, ...] = (802, 805, 806), n: int = 1280, seed: int = 1) -> Task:
    """data, then aftershocks: an MLP classifier on 6 gaussian blobs learns them to a loss of ~6e-5 within 50 steps
    (batch 16); samples ``bad`` (step 51) carry a wrong label, a loss x4e4 its window's median that the window's
    deviation hid (its first, much larger losses are still in it). Under guard.on_spike=warn the step's update is
    applied, and later windows spike under the state it left."""
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(6, 12, generator=g) * 2.0
    y = torch.randint(0, 6, (n,), generator=g)
    x = centers[y] + 0.5 * torch.randn(n, 12, generator=g)
    for i in bad:
        y[i] = (y[i] + 3) % 6
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 6))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_ce, name="flipped-labels")


class QuadrantCNN(nn.Module):
    """Two conv blocks with batch norm, then dropout: a sample's cost is spread over its window, and masks differ."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                               nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                               nn.Flatten(), nn.Dropout(0.2), nn.Linear(16, 4))

    def forward(self, x: Tensor) -> Tensor:
        return self.f(x)


def mislabelled_quadrants_task(bad: tuple[int, ...] = (953, 955, 957), n: int = 1200) -> Task:
    """data, not verifiable by removal: 8x8 images whose bright quadrant is the class; samples ``bad`` (step 120 at
    batch 8) carry another class. Without them the window keeps a few % of its loss (batch norm re-normalises the
    rest, dropout draws new masks), still over the rule's bar: no set is verified and none is named."""
    g = torch.Generator().manual_seed(2)
    y = torch.randint(0, 4, (n,), generator=g)
    x = 0.3 * torch.randn(n, 1, 8, 8, generator=g)
    for c in range(4):
        r, s = divmod(c, 2)
        x[y == c, :, 4 * r:4 * r + 4, 4 * s:4 * s + 4] += 3.0
    for i in bad:
        y[i] = (y[i] + 2) % 4
    torch.manual_seed(0)
    return Task(model=QuadrantCNN(), train_data=TensorDataset(x, y), loss=_ce, name="mislabelled-quadrants")


class StepCountedAdamW(torch.optim.AdamW):
    """AdamW whose own schedule multiplies the LR by ``factor`` from its ``jump_at``-th update on, inside ``step``
    (a schedule bug the param groups never show: their lr stays). It reads Adam's step count, so a replay sees it."""

    def __init__(self, params, jump_at: int, factor: float, until: int | None = None, **kwargs) -> None:
        super().__init__(params, **kwargs)
        self.jump_at, self.factor, self.until = jump_at, factor, until  # (until: its update of that count is normal again)

    def updates_so_far(self) -> int:
        """Adam's own step count: in the state_dict, so a replay from a checkpoint counts as the run did."""
        return next((int(s["step"]) for s in self.state.values() if "step" in s), 0)

    @torch.no_grad()
    def step(self, closure=None):
        if not self.jump_at <= self.updates_so_far() < (self.until or 2**62):
            return super().step(closure)
        kept = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] = g["lr"] * self.factor
        try:
            return super().step(closure)
        finally:
            for g, lr in zip(self.param_groups, kept):
                g["lr"] = lr


def hidden_lr_jump_task(jump_at: int = 150, factor: float = 30.0, lr: float = 3e-3, n: int = 2048) -> Task:
    """state: a tanh regression under :class:`StepCountedAdamW`: from update 151 on its steps are 30x; the loss spikes
    at step 153 (batch 32), ordinary windows too; 0.27% of one layer's coordinates surge x5.5 (not the cause)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = torch.tanh(x @ torch.randn(16, 1, generator=g) / 4) + 0.05 * torch.randn(n, 1, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="hidden-lr-jump",
                optimizer=lambda named: StepCountedAdamW([p for _, p in named], jump_at, factor, lr=lr, weight_decay=0.0,
                                                         fused=True))


def lr_burst_task(jump_at: int = 150, until: int = 153, factor: float = 30.0, n: int = 2048) -> Task:
    """state: a ReLU regression whose optimizer steps 30x on updates 151-153 only (a new user's trial): the loss spikes at
    152, 153 and, larger, 155, ordinary windows too; at 155 a few of fc1.weight's coordinates surged x3.3 in the update of
    step 154, while the weights moved x18 as far as typical steps since step 150."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = torch.tanh(x @ torch.randn(8, 1, generator=g)) + 0.05 * torch.randn(n, 1, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="lr-burst",
                optimizer=lambda named: StepCountedAdamW([p for _, p in named], jump_at, factor, until, lr=0.01,
                                                         weight_decay=0.0, fused=True))


def dropout_draw_task(n: int = 2048, width: int = 8, p: float = 0.003, seed: int = 0) -> Task:
    """dropout: a clean regression (y = the inputs' sum, no noise) through ``width`` hidden units with a rare dropout
    (``p``) after them. Trained to a tiny loss, a step whose masks drop a unit for one sample spikes on that sample's
    error alone; with dropout off the same window is normal: the draw made the spike, not its samples."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, width), nn.Dropout(p), nn.Linear(width, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="dropout-draw")


def level_shift_task(at_step: int = 30, shift: float = 3.0, n: int = 1024, seed: int = 0) -> Task:
    """data, a level shift: from step ``at_step`` on (batch 8, no shuffle) every target is ``shift`` higher, and stays so:
    the loss moves to a new level (x70) under any weights; no few samples carry it."""
    x, y = _regression(n, 8, seed)
    y[(at_step - 1) * 8:] += shift
    torch.manual_seed(seed)
    return Task(model=regression_mlp(), train_data=TensorDataset(x, y), loss=_mse, name="level-shift")


class CallCountedAdamW(StepCountedAdamW):
    """:class:`StepCountedAdamW` counting its calls on the Python object, outside its state_dict: a replay from a
    checkpoint does not see the jump (its count starts afresh), the live run does."""

    def __init__(self, params, jump_at: int, factor: float, **kwargs) -> None:
        super().__init__(params, jump_at, factor, **kwargs)
        self.calls = 0

    def updates_so_far(self) -> int:
        return self.calls

    def step(self, closure=None):
        try:
            return super().step(closure)
        finally:
            self.calls += 1


def hidden_bump_task(at: int = 50, factor: float = 1000.0, n: int = 2048) -> Task:
    """state, out of the replay's reach: from the optimizer's ``at``-th step its LR is x``factor`` (state it keeps
    outside its state_dict): the live run spikes, a replay from a checkpoint before ``at`` (a rollback's) does not."""
    x, y = _regression(n, 8, 0)
    torch.manual_seed(0)
    return Task(model=regression_mlp(), train_data=TensorDataset(x, y), loss=_mse, name="hidden-bump",
                optimizer=lambda named: CallCountedAdamW([p for _, p in named], at - 1, factor, lr=1e-3, fused=True))


def _sine_regression(n: int, dim: int = 16, seed: int = 0) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.randn(dim, 1, generator=g) / dim ** 0.5
    return x, torch.sin(x @ w * 2) + 0.05 * torch.randn(n, 1, generator=g)


class JumpSGD(torch.optim.Optimizer):
    """Plain SGD whose update is x``factor`` from its ``at``-th step on (its groups' lr stays): an LR too high mid-run.
    ``in_state``: the count lives in its param groups (a replay sees the jump); else on the Python object (a replay from a
    checkpoint counts afresh: the live run's spikes after it do not reproduce there)."""

    def __init__(self, params, lr: float, at: int, factor: float, in_state: bool) -> None:
        super().__init__(params, dict(lr=lr, calls=0))
        self.at, self.factor, self.in_state, self.calls = at, factor, in_state, 0

    @torch.no_grad()
    def step(self, closure=None):
        self.calls += 1
        for g in self.param_groups:
            g["calls"] += 1
            mult = self.factor if (g["calls"] if self.in_state else self.calls) >= self.at else 1.0
            for p in g["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-g["lr"] * mult)


def lr_jump_task(at: int = 55, factor: float = 60.0, in_state: bool = False, n: int = 4096, lr: float = 0.05) -> Task:
    """state, a divergence: SGD whose update is x``factor`` from its ``at``-th step on (:class:`JumpSGD`); at batch 16
    every window is a spike a few steps later, under any data (a new-user trial's, which read 'data: the data moved')."""
    x, y = _sine_regression(n)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="lr-jump",
                optimizer=lambda named: JumpSGD([p for _, p in named], lr, at, factor, in_state))


class OneStepAdamW(torch.optim.AdamW):
    """AdamW that takes its ``at``-th step at x``factor`` its LR and the rest at its own (the count from its own state: a
    replay sees it): one huge update inside the optimizer, which no record's LR shows (a new-user trial's)."""

    def __init__(self, params, at: int, factor: float, **kw) -> None:
        super().__init__(params, **kw)
        self.at, self.factor = at, factor

    def step(self, closure=None):
        count = self.state.get(self.param_groups[0]["params"][0], {}).get("step")
        if (int(count) if count is not None else 0) + 1 != self.at:
            return super().step(closure)
        lrs = [g["lr"] for g in self.param_groups]
        for g in self.param_groups:
            g["lr"] *= self.factor
        try:
            return super().step(closure)
        finally:
            for g, lr in zip(self.param_groups, lrs):
                g["lr"] = lr


def one_step_jump_task(at: int = 60, factor: float = 200.0, n: int = 4096) -> Task:
    """state: one update at x``factor`` the LR at step ``at`` (:class:`OneStepAdamW`), then the run's own; the damaged
    model errs most on a few samples of the windows after it (which read 'data: samples 1018, 1020 carry 90%')."""
    x, y = _sine_regression(n)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.SiLU(), nn.Linear(64, 64), nn.SiLU(), nn.Linear(64, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="one-step-jump",
                optimizer=lambda named: OneStepAdamW([p for _, p in named], at, factor, lr=1e-3, weight_decay=0.0))


def too_high_lr_task(lr: float = 0.3, n: int = 1600) -> Task:
    """state, then spikes in its course: an MLP classifier (labels: the sign of the sum of 4 features, no label noise)
    under Adam at lr 0.3 diverges from step ~63 (batch 32) and spikes every few steps; its later windows' losses sit on
    a few ordinary samples near the boundary that the drifted model gets confidently wrong (a new user's trial: step 85
    named 'data', those samples blamed, weighed under step 80's state, itself inside the drift)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_ce, name="too-high-lr",
                optimizer=lambda named: torch.optim.Adam([p for _, p in named], lr=lr))


class TokenClassifier(nn.Module):
    """Mean-pooled token embeddings, then an MLP over 16 classes."""

    def __init__(self, vocab: int = 64, dim: int = 32, classes: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, 64), nn.GELU(), nn.Linear(64, classes))

    def forward(self, t: Tensor) -> Tensor:
        return self.body(self.embed(t).mean(1))


def mislabelled_token_task(step: int = 140, batch_size: int = 4, n: int = 4096) -> Task:
    """data, in a window of 4: token sequences whose class is their first token mod 16; sample ``(step - 1) * batch_size +
    3`` (559 at step 140) is all token 5 labelled 13, confidently wrong once learnt (a new user's trial: a clean sample of
    its window, at x6 the median by its own spread, was named beside it)."""
    g = torch.Generator().manual_seed(2)
    t = torch.randint(0, 64, (n, 1), generator=g).repeat(1, 12)
    t[:, 8:] = torch.randint(0, 64, (n, 4), generator=g)
    labels = t[:, 0] % 16
    bad = (step - 1) * batch_size + 3
    t[bad], labels[bad] = 5, 13
    torch.manual_seed(0)
    return Task(model=TokenClassifier(), train_data=TensorDataset(t, labels), loss=_ce, name="mislabelled-token")


def noisy_labels_task(n: int = 4000, noise: float = 0.2) -> Task:
    """A new user's healthy run that the rule flagged on a third of its steps: four Gaussian blobs, a fifth of the labels
    drawn at random, trained at batch 2: a batch with a mislabelled sample has x30 the loss of one without, and a third
    of the batches have one. The loss's own spread, not spikes (the run's curve is flat); only a batch of two
    mislabelled samples is rare."""
    g = torch.Generator().manual_seed(3)
    centers = torch.randn(4, 16, generator=g) * 2
    y = torch.randint(0, 4, (n,), generator=g)
    x = centers[y] + torch.randn(n, 16, generator=g)
    g = torch.Generator().manual_seed(5)
    flip = torch.rand(n, generator=g) < noise
    y[flip] = torch.randint(0, 4, (int(flip.sum()),), generator=g)
    torch.manual_seed(0)
    return Task(model=nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4)), train_data=TensorDataset(x, y),
                loss=_ce, name="noisy-labels")


def noisy_labels_centers() -> Tensor:
    """:func:`noisy_labels_task`'s four blob centres (the first draw of its generator)."""
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(3)) * 2


def relabelled_five_task(n: int = 4000, bad_start: int = 2000, n_bad: int = 5) -> Task:
    """data, more than a quarter of a window (a new user's trial): 10 well-separated Gaussian clusters, samples
    2000-2004 relabelled (label + 5 mod 10), all five in step 126's window of 16 (data.shuffle=false), their losses
    7.8-11.3 against <= 0.023 for the other 11: x345 apart, yet a 'few' was at most 4 of 16 and none was named."""
    g = torch.Generator().manual_seed(2)
    centers = 4 * torch.randn(10, 20, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    x = centers[y] + torch.randn(n, 20, generator=g)
    y[bad_start:bad_start + n_bad] = (y[bad_start:bad_start + n_bad] + 5) % 10
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return Task(model=model, train_data=TensorDataset(x, y), name="relabelled-five",
                loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


class _JumpAdamW(torch.optim.AdamW):
    """AdamW whose update is x``factor`` from its ``at``-th step on (an LR multiplied inside the user's optimizer)."""

    def __init__(self, params, at: int, factor: float, **kw):
        super().__init__(params, **kw)
        self._n, self._at, self._factor = 0, at, factor

    @torch.no_grad()
    def step(self, closure=None):
        self._n += 1
        if self._n < self._at:
            return super().step(closure)
        params = [p for g in self.param_groups for p in g["params"]]
        before = [p.detach().clone() for p in params]
        out = super().step(closure)
        for p, b in zip(params, before):
            p.copy_(b + self._factor * (p - b))
        return out


def update_jump_task(n: int = 8000, at: int = 120, factor: float = 30.0) -> Task:
    """state, long before its spikes (a new user's trial): clean, separable clusters; the user's optimizer multiplies
    every update x30 from its step 120 on (the measured update/weight ratio x21 at the same LR); the loss spikes from
    step ~164 on, each window's loss on a hard, clean sample or two that the over-stepped model gets wrong: 'data',
    those samples named, with no word of the jump 40 steps before (the older state, the interval's start, is in it)."""
    g = torch.Generator().manual_seed(3)
    centers = 2 * torch.randn(10, 20, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    x = centers[y] + torch.randn(n, 20, generator=g)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    return Task(model=model, train_data=TensorDataset(x, y), name="update-jump",
                loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
                optimizer=lambda named: _JumpAdamW([p for _, p in named], at=at, factor=factor, lr=1e-3))


class _RareFeatureNet(nn.Module):
    def __init__(self, din: int = 32, hidden: int = 64):
        super().__init__()
        self.inp, self.out = nn.Linear(din, hidden), nn.Linear(hidden, 1)
        with torch.no_grad():
            self.inp.weight[:, din - 1] = 0.0  # the rare feature's column starts at zero

    def forward(self, x: Tensor) -> Tensor:
        return self.out(torch.tanh(self.inp(x)))


def rare_feature_task(n: int = 4000, rare_steps: str = "125,126", batch: int = 16, rare_value: float = 30.0) -> Task:
    """optimizer-state (a new user's trial): feature 31 is 0 but on half the samples of steps 125 and 126 (data in order,
    ``batch`` a step), where it is ``rare_value``; the target ignores it. Under Adam (beta1 0.5, lr 0.02, no clip) the
    column's tiny second moment lets the update of step 125 surge; a per-layer update clip of 'inp.weight' as a whole
    never engages there (one column's surge barely moves the tensor's update/weight ratio)."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, 32, generator=g)
    x[:, 31] = 0.0
    w = torch.randn(32, 1, generator=g) / 4
    w[31] = 0.0
    y = torch.tanh(x @ w)
    for s in [int(v) for v in rare_steps.split(",") if v]:
        x[(s - 1) * batch:(s - 1) * batch + batch // 2, 31] = rare_value
    torch.manual_seed(0)
    return Task(model=_RareFeatureNet(), train_data=TensorDataset(x, y), name="rare-feature", loss=_mse)


def batchnorm_scaled_task(n: int = 1024, first_bad: int = 720, scale: float = 100.0) -> Task:
    """data, coupled by a batch norm (a new user's trial): a small CNN with BatchNorm2d learns which quadrant of an 8x8
    image is brighter; images ``first_bad`` to ``first_bad + 2`` are scaled x``scale`` (data in order, batch 8: all three
    in step 91's window). Weighed alone, each is normalized by its own statistics and looks ordinary; dropped one at a
    time, the window is worse without a bad one (the other two own the statistics) than without a clean one."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 8, 8, generator=g) * 0.3
    y = torch.randint(0, 4, (n,), generator=g)
    for i in range(n):
        r, c = divmod(int(y[i]), 2)
        x[i, 0, r * 4:(r + 1) * 4, c * 4:(c + 1) * 4] += 1.0
    x[first_bad:first_bad + 3] *= scale
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1, stride=2), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 4))
    return Task(model=model, train_data=TensorDataset(x, y), name="bn-scaled",
                loss=lambda m, b: F.cross_entropy(m(b[0]), b[1]))


def scaled_rows_classifier_task(n: int = 4800, step: int = 150, rows: tuple[int, ...] = (2, 7, 11), scale: float = 50.0
                                ) -> Task:
    """data, the window high under the older state but below guard.spike_ratio times ordinary windows there (a new user's
    trial): a 10-class MLP classifier (batch 16, data in order) whose step ``step`` holds rows ``rows`` of its batch with
    inputs ``scale`` times too large. Under the interval's start the window is x1.8 ordinary windows' loss, x2.1 at the
    spike: most of its excess was there before the updates since (it was called the state's)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(20, 10, generator=g)
    x = torch.randn(n, 20, generator=g)
    y = (x @ w + 0.5 * torch.randn(n, 10, generator=g)).argmax(1)
    x[[(step - 1) * 16 + k for k in rows]] *= scale
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_ce, name="scaled-rows-classifier")


class _Centered(nn.Module):
    """``lin(x) - lin(mean(x)) + bias``: exact in fp32 whatever constant offset ``x`` carries, rounded in bf16."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d, h)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) - self.lin(x.mean(-1, keepdim=True).expand_as(x)) + self.lin.bias


def offset_row_task(bad: int = 100, offset: float = 24000.0, n: int = 512, scale: float = 0.1) -> Task:
    """precision, one row (a new user's trial): sample ``bad`` (step 7 at batch 16) carries a constant offset on its
    input; the model centers its input through a Linear, exact in fp32, rounded in bf16 (bf16's step is 128 at 24000):
    that row alone carries the bf16 spike, which fp32 and ``center`` in fp32 cure."""
    g = torch.Generator().manual_seed(0)
    z = scale * torch.randn(n, 16, generator=g)
    v = torch.randn(16, generator=g) / (4 * scale)
    y = torch.tanh((z - z.mean(-1, keepdim=True)) @ v).unsqueeze(-1) + 0.05 * torch.randn(n, 1, generator=g)
    x = z.clone()
    x[bad] += offset
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("center", _Centered(16, 32))
    model.add_module("act", nn.ReLU())
    model.add_module("head", nn.Linear(32, 1))
    return Task(model=model, train_data=TensorDataset(x, y), loss=_mse, name="offset-row")


def bright_images_cnn_task(n: int = 4096, bad_step: int = 120, n_bad: int = 3, batch: int = 32, scale: float = 100.0
                           ) -> Task:
    """data, coupled by batch norms in a window too large to try every set (a new user's trial): a CNN learns where a
    bright blob sits in 16x16 images; ``n_bad`` images of step ``bad_step``'s batch (data in order) are x``scale``.
    They own the batch statistics: their own losses are 0, the others' high, and dropping one leaves the other two in
    charge; the three whose inputs stand out are the set (the window's 32 have too many sets of up to 8 to try)."""
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 3, 16, 16, generator=g) * 0.5
    for c in range(4):
        r, cc = (c // 2) * 8, (c % 2) * 8
        x[y == c, :, r + 2:r + 6, cc + 2:cc + 6] += 1.5
    x[[(bad_step - 1) * batch + 5 + 9 * k for k in range(n_bad)]] *= scale
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.AdaptiveAvgPool2d(2),
                          nn.Flatten(), nn.Linear(128, 4))
    return Task(model=model, train_data=TensorDataset(x, y), name="bright-images", loss=_ce)


class _TinyLM(nn.Module):
    """A 2-layer pre-LN causal transformer over a 32-token vocabulary, sequences of 24."""

    def __init__(self, vocab: int = 32, length: int = 24, d: int = 64) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(length, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.ln(self.enc(self.tok(x) + self.pos[:x.shape[1]], mask=mask, is_causal=True)))


def _lm_loss(model: nn.Module, batch) -> Tensor:
    (s,) = batch
    return F.cross_entropy(model(s[:, :-1]).reshape(-1, 32).float(), s[:, 1:].reshape(-1))


def repeated_sequence_task(n: int = 4096, bad_step: int = 150, copies: int = 8, batch: int = 16, steps: int = 1) -> Task:
    """data, one sequence repeated (a new user's trial; OLMo's repeated n-grams): sequences follow one of 4 rules
    (next = m * t + c mod 32, 10% noise); ``copies`` of step ``bad_step``'s batch (data in order) are all token 7. Half
    the window, more than the quarter a set may name, each x2.5 the next loss, not far apart: one input, repeated.
    ``steps``: as many batches in a row hold them (a bad shard: a burst)."""
    g = torch.Generator().manual_seed(0)
    rule = torch.randint(0, 4, (n,), generator=g)
    mult, add = torch.tensor([5, 7, 3, 9])[rule], torch.tensor([3, 1, 11, 17])[rule]
    seq = torch.empty(n, 25, dtype=torch.long)
    seq[:, 0] = torch.randint(0, 32, (n,), generator=g)
    for i in range(24):
        seq[:, i + 1] = (mult * seq[:, i] + add) % 32
    noise = torch.rand(n, 25, generator=g) < 0.1
    seq[noise] = torch.randint(0, 32, (int(noise.sum()),), generator=g)
    for k in range(steps):
        start = (bad_step - 1 + k) * batch
        seq[start:start + copies] = 7
    torch.manual_seed(0)
    return Task(model=_TinyLM(), train_data=TensorDataset(seq), loss=_lm_loss, name="repeated-sequence")
