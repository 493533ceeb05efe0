"""Remedy candidates: small, named, serialisable fixes that a replay of an incident can try (``stabletrain remedy``).

Each candidate is a frozen dataclass with a short :attr:`~Remedy.name` (what ``--only`` selects), the
failure classes it fits (:data:`FITS`), a ``to_dict`` / :func:`remedy_from_dict` round trip (what
``remedy.json``, the ``remedy`` event and a checkpoint hold), and its effect on a replay or a live run,
through what the step already has:

- which samples a window keeps (:meth:`Remedy.keep`: skip the step, skip named samples);
- hooks on the model while it runs (:meth:`Remedy.installed`: one module in fp32, an eps guard on an op);
- the LR factor, the clip threshold, the precision mode, the GradScaler's state and the rollback point (what
  the driver reads: :attr:`Remedy.lr_factor`, :attr:`Remedy.max_norm`, :attr:`Remedy.precision`,
  :meth:`Remedy.precision_state`, :attr:`Remedy.rollback_step`).

:func:`~stabletrain.diagnostics.candidates.candidates_for` picks the candidates that fit a diagnosis. The driver
that replays them through the run's one step is :mod:`stabletrain.remedy_search`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import linecache
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

__all__ = ["Remedy", "SkipStep", "SkipSamples", "ModuleFP32", "Precision", "Scaler", "LowerLR", "RollbackLR", "TighterClip",
           "EpsGuard", "UpdateClip", "AdamEps", "remedy_from_dict", "CANDIDATE_NAMES", "guarded_op"]


@dataclass(frozen=True)
class Remedy:
    """A fix to try. Subclasses set :attr:`kind` and override what they change; the base changes nothing."""

    kind: ClassVar[str] = ""
    #: Whether a live run can apply it without a code change (``guard.on_nonfinite=remedy``).
    live: ClassVar[bool] = True
    #: 0: a local fix (some samples, one module, one op); 1: it changes the whole run (its LR, clip, precision).
    scope: ClassVar[int] = 0

    @property
    def name(self) -> str:
        """The short name ``--only`` selects and the table shows."""
        return self.kind

    @property
    def detail(self) -> str:
        """What it does, in a few words."""
        return self.kind

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (a tuple as a list): what remedy.json, an event and a checkpoint hold."""
        return {"kind": self.kind, **{k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(self).items()}}

    def keep(self, indices: list[list[int]], at: int) -> list[list[int]]:
        """The dataset indices of a window's micro-batches to train on (``at``: its place after the incident's own
        window, 0; the step before it, -1)."""
        return indices

    @contextlib.contextmanager
    def installed(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        """Hooks on ``model`` (and ``optimizer``) while the block runs (removed after it)."""
        yield

    def precision_state(self, state: dict[str, Any]) -> dict[str, Any]:
        """The precision policy's state to train with (``PrecisionPolicy.state_dict``'s format): unchanged here."""
        return state

    #: A spike's replay starts from the step before it (its loss is the state's: the update that led in must change).
    earlier: ClassVar[bool] = False
    lr_factor: ClassVar[float] = 1.0
    max_norm: ClassVar[float | None] = None  # None: the run's clip
    precision: ClassVar[str | None] = None  # None: the run's precision
    rollback_step: ClassVar[int | None] = None  # None: from the incident's pre-step state


@dataclass(frozen=True)
class SkipStep(Remedy):
    """The "just skip the step" baseline: drop the incident's window (and the ``windows - 1`` after it, a burst of
    spikes by the rule, as ``guard.on_spike=skip`` would), train on the rest as before."""

    windows: int = 1
    kind: ClassVar[str] = "skip-step"

    @property
    def detail(self) -> str:
        more = self.windows - 1
        return "drop the incident's window" + (f" and the {more} after it (a burst)" if more else "")

    def keep(self, indices: list[list[int]], at: int) -> list[list[int]]:
        return [[] for _ in indices] if 0 <= at < self.windows else indices


@dataclass(frozen=True)
class SkipSamples(Remedy):
    """Drop the named samples from every window they are in (from now on)."""

    samples: tuple[int, ...] = ()
    positions: bool = False  # the samples are places in the step's batch (an adapter's), not dataset indices
    kind: ClassVar[str] = "skip-samples"

    @property
    def detail(self) -> str:
        many = len(self.samples) > 1
        if self.positions:
            return f"drop position{'s' if many else ''} {', '.join(map(str, self.samples))} of the step's batch"
        return f"drop sample{'s' if many else ''} {', '.join(map(str, self.samples))}"

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if not self.positions:  # (dataset indices: the record as it always was)
            del out["positions"]
        return out

    def keep(self, indices: list[list[int]], at: int) -> list[list[int]]:
        drop = set(self.samples)
        return [[i for i in group if i not in drop] for group in indices]


def _float32(x: Any) -> Any:
    return x.float() if isinstance(x, Tensor) and x.is_floating_point() else x


@dataclass(frozen=True)
class ModuleFP32(Remedy):
    """Run one module in float32: autocast off around it, its floating inputs cast to float32."""

    module: str = ""
    kind: ClassVar[str] = "module-fp32"

    @property
    def detail(self) -> str:
        return f"module '{self.module}' in fp32 (autocast off around it)"

    @contextlib.contextmanager
    def installed(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        target = model.get_submodule(self.module)
        device = next((p.device.type for p in target.parameters()), "cpu")
        stack: list[Any] = []

        def pre(_module: nn.Module, args: tuple) -> tuple:
            ctx = torch.autocast(device, enabled=False)
            ctx.__enter__()
            stack.append(ctx)
            return tuple(_float32(a) for a in args)

        def post(_module: nn.Module, _args: tuple, out: Any) -> None:
            stack.pop().__exit__(None, None, None)

        handles = [target.register_forward_pre_hook(pre), target.register_forward_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


@dataclass(frozen=True)
class Precision(Remedy):
    """Train the whole run in another precision: bf16 instead of fp16 (the same exponent range as fp32, no loss scale),
    or fp32 (a ``precision`` spike: the same step normal in fp32). Its name is the mode (``bf16``, ``fp32``).

    Not applied to a live run (its precision policy is built with it): restart with ``precision=bf16`` (or fp32).
    """

    mode: str = "bf16"
    kind: ClassVar[str] = "bf16"
    live: ClassVar[bool] = False
    scope: ClassVar[int] = 1

    @property
    def name(self) -> str:
        return self.mode

    @property
    def detail(self) -> str:
        return f"precision={self.mode}"

    @property
    def precision(self) -> str:  # type: ignore[override]
        return self.mode


@dataclass(frozen=True)
class Scaler(Remedy):
    """fp16: restart the GradScaler at ``init_scale`` and back off by ``backoff`` on an overflow (a steeper back-off)."""

    init_scale: float = 1024.0
    backoff: float = 0.25
    kind: ClassVar[str] = "scaler"

    @property
    def detail(self) -> str:
        return f"GradScaler scale {self.init_scale:g}, backoff x{self.backoff:g}"

    def precision_state(self, state: dict[str, Any]) -> dict[str, Any]:
        if not state.get("scaler"):
            return state
        return {**state, "scaler": {**state["scaler"], "scale": float(self.init_scale), "backoff_factor": float(self.backoff)}}


@dataclass(frozen=True)
class LowerLR(Remedy):
    """Multiply the LR by ``factor`` (for the next ``steps`` steps; 0: for good)."""

    factor: float = 0.5
    steps: int = 0
    kind: ClassVar[str] = "lr"
    earlier: ClassVar[bool] = True
    scope: ClassVar[int] = 1

    @property
    def name(self) -> str:
        return f"lr-x{self.factor:g}"

    @property
    def detail(self) -> str:
        return f"lr x{self.factor:g}" + (f" for {self.steps} steps" if self.steps else "")

    @property
    def lr_factor(self) -> float:  # type: ignore[override]
        return self.factor


@dataclass(frozen=True)
class RollbackLR(LowerLR):
    """Go back to the checkpoint of step ``step`` (before the growth began) and train on with the LR x ``factor``."""

    step: int = 0
    kind: ClassVar[str] = "rollback-lr"

    @property
    def name(self) -> str:
        return f"rollback-lr-x{self.factor:g}"

    @property
    def detail(self) -> str:
        return f"back to step {self.step}, lr x{self.factor:g}" + (f" for {self.steps} steps" if self.steps else "")

    @property
    def rollback_step(self) -> int:  # type: ignore[override]
        return self.step


@dataclass(frozen=True)
class TighterClip(Remedy):
    """Clip the global grad norm at ``limit``: the mean pre-clip norm of the last healthy interval (metrics.jsonl)."""

    limit: float = 1.0
    kind: ClassVar[str] = "clip"
    earlier: ClassVar[bool] = True
    scope: ClassVar[int] = 1

    @property
    def detail(self) -> str:
        return f"clip.max_norm={self.limit:.3g}"

    @property
    def max_norm(self) -> float:  # type: ignore[override]
        return self.limit


#: The torch functions an eps guard intercepts, per guarded op, and which argument it keeps away from 0.
_GUARDED: dict[str, tuple[tuple[Any, ...], int]] = {
    "sqrt": ((torch.sqrt, Tensor.sqrt), 0), "rsqrt": ((torch.rsqrt, Tensor.rsqrt), 0),
    "log": ((torch.log, Tensor.log), 0), "log2": ((torch.log2, Tensor.log2), 0), "log10": ((torch.log10, Tensor.log10), 0),
    "pow": ((torch.pow, Tensor.pow, Tensor.__pow__), 0), "div": ((torch.div, Tensor.div, Tensor.__truediv__), 1),
}


def guarded_op(op: str | None, autograd_node: str | None) -> str | None:
    """The op an eps guard would clamp: from the backward node (``SqrtBackward0`` -> sqrt) or the aten op name."""
    for text, pattern in ((autograd_node, r"^(\w+?)Backward\d*$"), (op, r"^aten\.(\w+?)(_)?\.")):
        m = re.match(pattern, text or "")
        if m and m.group(1).lower() in _GUARDED:
            return m.group(1).lower()
    return None


class _Clamp(TorchFunctionMode):
    """Keep the guarded argument of ``op`` at least ``eps`` away from 0 (its sign kept; >= eps for sqrt/log)."""

    def __init__(self, op: str, eps: float) -> None:
        super().__init__()
        self.funcs, self.arg = _GUARDED[op]
        self.eps, self.signed = eps, op in ("pow", "div")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.funcs and len(args) > self.arg and isinstance(args[self.arg], Tensor):
            x = args[self.arg]
            # An eps below the dtype's smallest normal (1e-12 in float16) would round to 0: keep it representable.
            eps = max(self.eps, torch.finfo(x.dtype).tiny) if x.is_floating_point() else self.eps
            if self.signed:
                x = torch.where(x.abs() < eps, torch.where(x < 0, -eps, eps), x)
            else:
                x = x.clamp_min(eps)
            args = (*args[:self.arg], x, *args[self.arg + 1:])
        return func(*args, **kwargs)


#: A log of what underflows to 0 in float (a softmax's or a sigmoid's far tail) has a form that never computes the 0.
_LOG_OF = {"softmax": "log_softmax (torch.log_softmax / F.log_softmax)", "sigmoid": "F.logsigmoid"}


def _stable_form(op: str, where: str) -> str:
    """'; better, ...' where the user's line takes the log of a softmax or a sigmoid (read from ``where``, file:line)."""
    path, _, line = where.rpartition(":")
    text = linecache.getline(path, int(line)) if op.startswith("log") and line.isdigit() else ""
    found = next((f for f in _LOG_OF if re.search(rf"\b{f}\(", text)), None)
    return f"; better, compute the log in one op: {_LOG_OF[found]} never rounds to log(0)" if found else ""


@dataclass(frozen=True)
class EpsGuard(Remedy):
    """Clamp the input of ``op`` (the denominator of div) to ``eps`` inside ``module``: a replay-only stand-in for
    the code change :attr:`change` says to make at ``where`` (file:line)."""

    module: str = ""
    op: str = "sqrt"
    eps: float = 1e-12
    where: str = ""
    kind: ClassVar[str] = "eps-guard"
    live: ClassVar[bool] = False

    @property
    def detail(self) -> str:
        where = f"in '{self.module}'" if self.module else "in the root module"
        return f"{self.op} input {'|x| >= ' if self.op == 'div' else '>= '}{self.eps:g} {where}"

    @property
    def change(self) -> str:
        """The code change to make (at :attr:`where`)."""
        arg = "the denominator" if self.op == "div" else f"the input of {self.op}"
        at = f" at {self.where}" if self.where else ""
        how = ("x.clamp_min(eps)" if self.op not in ("div", "pow") else  # (what the replay did: 0 itself becomes +eps)
               "torch.where(x.abs() < eps, torch.where(x < 0, -eps, eps), x)")
        return f"keep {arg} away from 0{at}: {how} with eps={self.eps:g}{_stable_form(self.op, self.where)}"

    @contextlib.contextmanager
    def installed(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        target = model.get_submodule(self.module)
        modes: list[_Clamp] = []

        def pre(_module: nn.Module, _args: tuple) -> None:
            mode = _Clamp(self.op, self.eps)
            mode.__enter__()
            modes.append(mode)

        def post(_module: nn.Module, _args: tuple, _out: Any) -> None:
            modes.pop().__exit__(None, None, None)

        handles = [target.register_forward_pre_hook(pre), target.register_forward_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


@dataclass(frozen=True)
class UpdateClip(Remedy):
    """Clip one parameter's update to ``ratio`` x its norm (its recent typical update/weight ratio, with room).

    An optimizer step pre-hook keeps the parameter, a post-hook scales back an update larger than that: a layer
    whose update jumps (a surge in Adam's second moment) moves no further than it usually does.
    """

    param: str = ""
    ratio: float = 1e-3
    kind: ClassVar[str] = "update-clip"
    earlier: ClassVar[bool] = True

    @property
    def detail(self) -> str:
        return f"'{self.param}' update <= {self.ratio:.3g} x its norm"

    @contextlib.contextmanager
    def installed(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        if optimizer is None:
            yield
            return
        p = model.get_parameter(self.param)
        kept: list[Tensor] = []

        def pre(*_: Any) -> None:
            kept[:] = [p.detach().clone()]

        def post(*_: Any) -> None:
            if not kept:
                return
            with torch.no_grad():
                before = kept.pop()
                delta = p - before
                limit = self.ratio * before.norm()
                p.copy_(before + delta * torch.clamp(limit / (delta.norm() + 1e-12), max=1.0))

        handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()


@dataclass(frozen=True)
class AdamEps(Remedy):
    """Give one parameter its own Adam param group with a larger ``eps`` (about the typical sqrt(v) there): a
    coordinate whose second moment is tiny can no longer make an update many times the others'. Replayed here;
    on a run it is a code change (the optimizer's param groups: :attr:`change`)."""

    param: str = ""
    eps: float = 1e-6
    kind: ClassVar[str] = "adam-eps"
    earlier: ClassVar[bool] = True
    live: ClassVar[bool] = False

    @property
    def detail(self) -> str:
        return f"Adam eps={self.eps:.3g} for '{self.param}'"

    @property
    def change(self) -> str:
        return f"put {self.param} in its own optimizer param group with eps={self.eps:.3g}"

    @contextlib.contextmanager
    def installed(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> Iterator[None]:
        if optimizer is not None:
            p = model.get_parameter(self.param)
            for group in optimizer.param_groups:
                if any(q is p for q in group["params"]) and len(group["params"]) > 1:
                    group["params"] = [q for q in group["params"] if q is not p]
                    optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": [p],
                                               "eps": float(self.eps)})
                    break
            else:
                for group in optimizer.param_groups:
                    if any(q is p for q in group["params"]):
                        group["eps"] = float(self.eps)
        yield


_KINDS: dict[str, type[Remedy]] = {c.kind: c for c in (SkipStep, SkipSamples, ModuleFP32, Precision, Scaler, LowerLR,
                                                       RollbackLR, TighterClip, EpsGuard, UpdateClip, AdamEps)}
#: The candidate names ``--only`` accepts (a lower LR and a rollback carry their factor: lr-x0.5, rollback-lr-x0.1).
CANDIDATE_NAMES = ("skip-step", "skip-samples", "module-fp32", "bf16", "fp32", "scaler", "lr-x0.5", "lr-x0.1", "rollback-lr-x0.5",
                   "rollback-lr-x0.1", "clip", "eps-guard", "update-clip", "adam-eps")


def remedy_from_dict(d: dict[str, Any]) -> Remedy:
    """Rebuild a remedy from :meth:`Remedy.to_dict` (a ValueError naming the kind when it is unknown)."""
    kind = d.get("kind")
    cls = _KINDS.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"remedy kind {kind!r} is not one of {', '.join(_KINDS)}")
    fields = {f.name for f in dataclasses.fields(cls)}
    args = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in fields}
    return cls(**args)
