"""Tiny models for the initialization and signal-propagation tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ResidualBlock(nn.Module):
    """Pre-norm residual block ``x + out(relu(fc(norm(x))))``; ``out`` is the branch's output projection."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.out = nn.Linear(width, width)
        self.out.residual_branch_out = True

    def forward(self, x: Tensor) -> Tensor:
        return x + self.out(self.act(self.fc(self.norm(x))))


class ResidualStack(nn.Module):
    """``embed`` -> ``depth`` pre-norm residual blocks -> ``norm`` -> ``head`` (a classifier)."""

    def __init__(self, in_dim: int = 16, width: int = 64, depth: int = 32, num_classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Linear(in_dim, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class CustomInit(nn.Module):
    """A layer that draws its own init in ``__init__`` (std 0.02) over nn.Linear's ``reset_parameters``."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        nn.init.normal_(self.proj.weight, std=0.02)
        nn.init.zeros_(self.proj.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class FunctionalReLUStack(nn.Module):
    """``depth`` Linear(width, width) layers in a ModuleList, each followed by ``torch.relu`` (no activation module),
    then a head; weights N(0, std^2), biases 0 (``std=0.02`` at width 64 shrinks the signal ~0.11x per layer)."""

    def __init__(self, depth: int = 8, width: int = 64, num_classes: int = 10, std: float = 0.02) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


class MixedActivations(nn.Module):
    """Activations every way a forward applies them: a SiLU written by hand (``h * sigmoid(h)``), a Tensor method,
    a functional leaky ReLU behind functional dropout, a GELU module, and a residual sum after the last layer."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(width, width) for _ in range(4))
        self.act = nn.GELU()

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        h = h * torch.sigmoid(h)
        h = self.b(h).relu()
        h = F.leaky_relu(F.dropout(self.c(h), 0.1, training=self.training), 0.2)
        return self.d(self.act(h)) + x


def classification_batch(num: int = 64, in_dim: int = 32, num_classes: int = 10, seed: int = 1) -> tuple[Tensor, Tensor]:
    """Return a fixed (x ~ N(0, 1), random labels) batch."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num, in_dim, generator=g), torch.randint(0, num_classes, (num,), generator=g)


def classification_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


@pytest.fixture
def single_thread():
    """Run a test on one intra-op thread: tiny ops on a busy 2-core machine are much faster so."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RNNModel(nn.Module):
    """pytorch/examples word_language_model's model: encoder, a recurrent module, and a decoder.

    As in the example: one Dropout module used twice (on the embedding and on the RNN's output), the
    sequence dimension first, an optionally tied decoder, and its own ``init_weights`` (encoder and
    decoder uniform in [-0.1, 0.1], decoder bias 0; the LSTM keeps PyTorch's default init).
    """

    def __init__(self, rnn_type: str = "LSTM", ntoken: int = 100, ninp: int = 32, nhid: int = 32, nlayers: int = 2,
                 dropout: float = 0.2, tie_weights: bool = False) -> None:
        super().__init__()
        self.ntoken, self.rnn_type, self.nhid, self.nlayers = ntoken, rnn_type, nhid, nlayers
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = getattr(nn, rnn_type)(ninp, nhid, nlayers, dropout=dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        if tie_weights:
            if nhid != ninp:
                raise ValueError("When using the tied flag, nhid must be equal to emsize")
            self.decoder.weight = self.encoder.weight
        self.init_weights()

    def init_weights(self) -> None:
        initrange = 0.1
        nn.init.uniform_(self.encoder.weight, -initrange, initrange)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -initrange, initrange)

    def forward(self, input: Tensor, hidden):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        output = self.drop(output)
        decoded = self.decoder(output).view(-1, self.ntoken)
        return F.log_softmax(decoded, dim=1), hidden

    def init_hidden(self, bsz: int):
        weight = next(self.parameters())
        if self.rnn_type == "LSTM":
            return (weight.new_zeros(self.nlayers, bsz, self.nhid), weight.new_zeros(self.nlayers, bsz, self.nhid))
        return weight.new_zeros(self.nlayers, bsz, self.nhid)


def lm_batch(ntoken: int = 100, seq_len: int = 35, num: int = 20, seed: int = 1) -> Tensor:
    """Return a fixed (num, seq_len + 1) batch of random token ids."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, ntoken, (num, seq_len + 1), generator=g)


def lm_loss(model: RNNModel, batch: Tensor):
    """word_language_model's loss on a (batch, seq_len + 1) tensor of token ids, as (sum, count) over tokens."""
    data, target = batch[:, :-1].t(), batch[:, 1:].t()  # the example's layout: sequence first
    output, _ = model(data, model.init_hidden(data.shape[1]))
    return F.nll_loss(output, target.reshape(-1), reduction="sum"), target.numel()


def make_lm_task(tie_weights: bool = False, rnn_type: str = "LSTM"):
    """word_language_model as a stabletrain task: 64 random sequences of 36 tokens, ``lm_loss``."""
    from stabletrain.tasks import Task

    model = RNNModel(rnn_type, ntoken=100, ninp=32, nhid=32, nlayers=2, dropout=0.2, tie_weights=tie_weights)
    return Task(model=model, train_data=list(lm_batch(num=64)), loss=lm_loss, count_unit="tokens")


# -- zero-initialized layers and unseeded data randomness (the doctor's checks) ----------------------------


class ZeroHeadLM(nn.Module):
    """``embed`` -> ``body`` (Linear std 0.02, GELU) -> ``head`` whose weight and bias start at 0 (a GPT/DiT-style
    zero-init output layer): at step 0 the logits are 0 and no gradient reaches ``embed`` or ``body``."""

    def __init__(self, vocab: int = 16, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.body = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, vocab)
        nn.init.normal_(self.body[0].weight, std=0.02)
        nn.init.zeros_(self.body[0].bias)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(self.embed(x)))


def _next_token_loss(model: nn.Module, batch: tuple[Tensor, Tensor]):
    x, y = batch
    logits = model(x)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"), torch.tensor(float(y.numel()))


class AugmentedTokens(torch.utils.data.Dataset):
    """64 fixed sequences of 8 tokens; ``augment``: each item's input has one token set to 0 at a position drawn from
    an unseeded ``np.random.default_rng()`` (the same index gives other inputs at every fetch and in every run)."""

    def __init__(self, augment: bool = True, vocab: int = 16) -> None:
        import numpy as np

        g = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(1, vocab, (64, 9), generator=g)
        self.rng = np.random.default_rng() if augment else None

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        x = self.tokens[i, :-1].clone()
        if self.rng is not None:
            x[int(self.rng.integers(0, len(x)))] = 0
        return x, self.tokens[i, 1:]


def zero_head_task(augment: bool = False):
    """``ZeroHeadLM`` on ``AugmentedTokens`` with a (sum, count) loss over tokens."""
    from stabletrain.tasks import Task

    return Task(model=ZeroHeadLM(), train_data=AugmentedTokens(augment), loss=_next_token_loss, count_unit="tokens",
                name="zero-head")


def augmented_task():
    """``zero_head_task`` with the unseeded augmentation on (for ``task=models_init:augmented_task``)."""
    return zero_head_task(augment=True)


class BNBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the identity, then ReLU (torch.relu as a function): a torchvision BasicBlock."""

    def __init__(self, c: int):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.c2, self.b2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


class BNResNet(nn.Module):
    def __init__(self, c: int = 16, blocks: int = 4, zero_init_residual: bool = False):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(*[BNBlock(c) for _ in range(blocks)])
        self.head = nn.Linear(c, 10)
        if zero_init_residual:
            for block in self.blocks:
                nn.init.zeros_(block.b2.weight)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


def bn_resnet_task(zero_init_residual: bool = False):
    """A new user's textbook BN ResNet (PyTorch's default init, normalized inputs)."""
    from stabletrain import Task

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 3, 16, 16, generator=g), torch.randint(0, 10, (256,), generator=g)
    torch.manual_seed(0)
    return Task(model=BNResNet(zero_init_residual=zero_init_residual), train_data=torch.utils.data.TensorDataset(x, y),
                loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), name="bn-resnet")


def _masked_mse(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    x, y, mask = batch
    return (((model(x) - y) ** 2).sum(-1) * mask).sum() / mask.sum()  # the user's own mean: 0/0 on a window of no item


def _masked_sum_count(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    x, y, mask = batch
    return (((model(x) - y) ** 2).sum(-1) * mask).sum(), mask.sum()  # stabletrain's (sum, count): count 0 there


def all_masked_first_task(sum_count: bool = False):
    """A 4-layer ReLU MLP whose loss is a masked mean written by the user; the first 8 samples are all masked out, so
    the first batch (``data.shuffle=false``, ``train.batch_size=8``) has a finite forward and a NaN backward (0/0).
    ``sum_count``: the loss returns (sum, count) instead, stabletrain takes the mean."""
    from stabletrain.tasks import Task

    g = torch.Generator().manual_seed(0)
    x, y, mask = torch.randn(64, 8, generator=g), torch.randn(64, 2, generator=g), torch.ones(64)
    mask[:8] = 0
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    return Task(model=model, train_data=torch.utils.data.TensorDataset(x, y, mask),
                loss=_masked_sum_count if sum_count else _masked_mse, name="masked")
