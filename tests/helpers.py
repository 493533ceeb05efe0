"""Tiny tasks and models shared by the tests (CPU, fast, deterministic)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

from stabletrain import Task, load_config

FAST = ["log.progress=false", "log.tensorboard=false"]


def cfg(*overrides: str, task: str = "mlp"):
    """A quick CPU config: the mlp task (or ``task``), no progress bar, no TensorBoard unless asked."""
    return load_config(None, [f"task={task}", *FAST, *overrides])


def regression_task(n: int = 64, dim: int = 4, dropout: float = 0.0, seed: int = 0) -> Task:
    """y = x @ w + noise; a scalar-mean MSE loss."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = x @ torch.randn(dim, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)
    layers: list[nn.Module] = [nn.Linear(dim, 16), nn.Tanh()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(16, 1))
    model = nn.Sequential(*layers)
    return Task(model=model, train_data=TensorDataset(x, y), loss=lambda m, b: F.mse_loss(m(b[0]), b[1]), name="regression")


class VarLenSequences(Dataset):
    """Sequences of lengths 1..max_len (padded, with a mask): per-token targets."""

    def __init__(self, n: int = 64, max_len: int = 12, dim: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(1, max_len + 1, (n,), generator=g)
        self.x = torch.randn(n, max_len, dim, generator=g)
        self.y = torch.randn(n, max_len, generator=g)
        self.mask = (torch.arange(max_len)[None, :] < self.lengths[:, None]).float()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i], self.mask[i]


def varlen_loss(model: nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of per-token squared errors over real tokens, number of real tokens)."""
    x, y, mask = batch
    err = (model(x).squeeze(-1) - y) ** 2
    return (err * mask).sum(), mask.sum()


def varlen_task(seed: int = 0) -> Task:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    return Task(model=model, train_data=VarLenSequences(seed=seed), loss=varlen_loss, name="varlen", count_unit="tokens")


class PoisonAt(nn.Module):
    """Wrap a model; multiply its output by ``value`` (e.g. nan or inf) on the listed forward calls."""

    def __init__(self, inner: nn.Module, calls: set[int], value: float = float("nan")) -> None:
        super().__init__()
        self.inner, self.calls, self.value, self.n = inner, set(calls), value, 0

    def forward(self, x):
        out = self.inner(x)
        self.n += 1
        if self.n in self.calls:
            out = out * self.value
        return out


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def make_user_task(width: int = 16) -> Task:
    """A user factory, importable as ``helpers:make_user_task`` (tests put tests/ on sys.path)."""
    task = regression_task()
    task.model = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))
    return task


def slow_mlp_task(sleep: float = 0.02, **kwargs) -> Task:
    """The built-in mlp task whose loss sleeps ``sleep`` s per micro-batch (so a test can kill it mid-run)."""
    import time

    from stabletrain.tasks.mlp import make_task

    task = make_task(**kwargs)
    inner = task.loss

    def loss(model, batch):
        time.sleep(sleep)
        return inner(model, batch)

    task.loss = loss
    return task


def nan_sample_task(bad_index: int = 37, n: int = 64) -> Task:
    """The regression task with one NaN input at dataset index ``bad_index``."""
    task = regression_task(n=n)
    x, y = task.train_data.tensors
    x = x.clone()
    x[bad_index, 1] = float("nan")
    task.train_data = TensorDataset(x, y)
    return task


def nan_samples_task(bad_indices: list[int], n: int = 64) -> Task:
    """The regression task with a NaN input at each dataset index in ``bad_indices``."""
    task = nan_sample_task(bad_indices[0], n)
    x, y = task.train_data.tensors
    x[list(bad_indices), 1] = float("nan")
    return task


class _NanGradRows(torch.autograd.Function):
    """Identity forward; backward multiplies each row's gradient by its weight (NaN: a NaN gradient, finite loss)."""

    @staticmethod
    def forward(ctx, out, weight):
        ctx.save_for_backward(weight)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad * weight.reshape(-1, *([1] * (grad.dim() - 1))), None


def grad_nan_sample_task(bad_index: int = 37, n: int = 64) -> Task:
    """The regression task whose sample ``bad_index`` gives a finite loss and NaN gradients (its backward only)."""
    task = regression_task(n=n)
    x, y = task.train_data.tensors
    weight = torch.ones(n)
    weight[bad_index] = float("nan")
    task.train_data = TensorDataset(x, y, weight)
    task.loss = lambda m, b: F.mse_loss(_NanGradRows.apply(m(b[0]), b[2]), b[1])
    return task


from stabletrain.callbacks import Callback  # noqa: E402  (below the tasks: the callbacks used by tests)
from stabletrain.records.staging import clone_state  # noqa: E402


class PreStepState(Callback):
    """Keep a copy of ``trainer``'s whole state at the end of step ``step`` (= the state before step ``step + 1``).

    Added after the trainer is built (``trainer.callbacks.append``). Under FSDP ``state_dict()`` is the full
    state, a gather every rank joins: keep the callback on every rank.
    """

    def __init__(self, step: int, trainer) -> None:
        self.step, self.trainer, self.state = step, trainer, None

    def on_step_end(self, state, out):
        if state.step == self.step:
            self.state = clone_state(self.trainer.state_dict())


class HookLog(Callback):
    """Record every hook as (hook, step); its state (a counter of steps seen) round-trips through checkpoints."""

    instances: list["HookLog"] = []

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []
        self.steps_seen = 0
        HookLog.instances.append(self)

    def on_fit_start(self, state):
        self.calls.append(("fit_start", state.step))

    def on_step_end(self, state, out):
        self.steps_seen += 1
        self.calls.append(("step_end", state.step))

    def on_log(self, state, record, rows):
        self.calls.append(("log", record["step"]))

    def on_incident(self, state, info):
        self.calls.append(("incident", info["step"]))

    def on_checkpoint(self, state, info):
        self.calls.append(("checkpoint:" + info["kind"], info["step"]))

    def on_resume(self, state, info):
        self.calls.append(("resume", info["step"]))

    def on_rollback(self, state, info):
        self.calls.append(("rollback", info["to_step"]))

    def on_stop(self, state, reason):
        self.calls.append(("stop", state.step))

    def on_fit_end(self, state, record):
        self.calls.append(("fit_end", state.step))

    def state_dict(self):
        return {"steps_seen": self.steps_seen}

    def load_state_dict(self, state):
        self.steps_seen = int(state["steps_seen"])


class SignalAtStep(Callback):
    """Send this process SIGTERM ``count`` times at the end of step ``step`` (env STABLETRAIN_TEST_SIGNAL="step:count").

    Deterministic: the handler runs before the hook returns, so the first signal lands after exactly that
    step, and a second one arrives while the run is still inside it (not a sleep hoping to hit a step).
    """

    def __init__(self) -> None:
        import os

        step, count = os.environ.get("STABLETRAIN_TEST_SIGNAL", "3:1").split(":")
        self.step, self.count = int(step), int(count)

    def on_step_end(self, state, out):
        import os
        import signal

        if state.step == self.step:
            for _ in range(self.count):
                os.kill(os.getpid(), signal.SIGTERM)


class FileSizeLimitAfterFirstCheckpoint(Callback):
    """After the first checkpoint is written, no file of this process may grow past 64 KiB (``RLIMIT_FSIZE``).

    A real failing write without root: the next checkpoint's state.pt (~290 KB for the default mlp) fails
    with EFBIG (Python ignores SIGXFSZ), while the run's small logs (metrics, events) still write.
    """

    def on_checkpoint(self, state, info):
        import resource

        from stabletrain.records.checkpoint.writer import running_writer

        if info["kind"] == "checkpoint":
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            writer = running_writer()  # the checkpoint writer process, which writes the next one
            if writer is not None:
                resource.prlimit(writer.pid, resource.RLIMIT_FSIZE, resource.getrlimit(resource.RLIMIT_FSIZE))


class FillDiskAfterFirstCheckpoint(Callback):
    """After the first checkpoint is written, fill the run directory's filesystem, leaving 64 KiB free.

    On a small tmpfs: the next checkpoint (~290 KB for the default mlp) fails with ENOSPC, while the
    run's small logs still fit.
    """

    def __init__(self) -> None:
        self.done = False

    def on_checkpoint(self, state, info):
        import errno
        import os

        if info["kind"] != "checkpoint" or self.done:
            return
        self.done = True
        filler = state.ckpt.root.parent / "filler.bin"
        with open(filler, "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * (1 << 16))
            except OSError as err:
                assert err.errno == errno.ENOSPC, err
        os.truncate(filler, max(0, filler.stat().st_size - 64 * 1024))


class KillAtLog(Callback):
    """SIGKILL this process at the log boundary of step ``STABLETRAIN_TEST_KILL`` (after every built-in sink wrote it).

    Deterministic, as :class:`SignalAtStep`: user callbacks fire after the built-in ones, so metrics.jsonl and
    the trackers hold that step, and nothing after it runs (no on_fit_end, no flush).
    """

    def __init__(self) -> None:
        import os

        self.step = int(os.environ.get("STABLETRAIN_TEST_KILL", "0"))

    def on_log(self, state, record, rows):
        import os
        import signal

        if state.step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


class FirstSaveFailsThenKilled(Callback):
    """The first launch's step-0 checkpoint fails (no file of the process may grow past 64 KiB: ``RLIMIT_FSIZE``, as a
    sharded save fails whose peer died), it logs steps, and it is SIGKILLed after step ``at``; a restarted launch
    (:data:`~stabletrain.distributed.launch.RESTART_ENV` set) trains as any."""

    def __init__(self, at: int = 4) -> None:
        import os

        from stabletrain.distributed.launch import RESTART_ENV

        self.at = at
        self.first = not os.environ.get(RESTART_ENV)

    def on_fit_start(self, state) -> None:
        import resource

        from stabletrain.records.checkpoint.writer import running_writer

        if self.first:
            resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
            writer = running_writer()
            if writer is not None:
                resource.prlimit(writer.pid, resource.RLIMIT_FSIZE, resource.getrlimit(resource.RLIMIT_FSIZE))

    def on_step_end(self, state, out) -> None:
        import os
        import signal

        if self.first and state.step >= self.at:
            os.kill(os.getpid(), signal.SIGKILL)
