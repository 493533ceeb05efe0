"""Locate the first non-finite value: the op, its module, forward or backward, origin or propagation.

These are the replay tools (DESIGN.md, "detect cheaply, diagnose on replay"): every one of them
reads values on the host after each op, so they cost a host-device sync per op and are meant for
re-running the one step that went wrong, never for every step of a run.

- :class:`NonFiniteLocator` watches every aten op of a forward/backward (a ``TorchDispatchMode``)
  and names the module that ran it (``torch.utils.module_tracker.ModuleTracker``)::

      with NonFiniteLocator(model) as loc:
          loss = model(x).logsumexp(-1).mean()
          loss.backward()
      if loc.first is not None:
          print(loc.first.describe())   # aten.log.default in forward of module 'layers.2' (origin: ...)

- :func:`stabletrain.diagnostics.bisection.bisect_samples` finds the dataset indices that make a batch go bad.
- :func:`stabletrain.diagnostics.anomaly.anomaly_trace` replays under ``torch.autograd.detect_anomaly``
  and returns the Python stack of the forward call behind the first non-finite value.

The stacks recorded hold the user's frames only (:mod:`.stacks`).
"""

from __future__ import annotations

import contextlib
import math
import re
import weakref
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.module_tracker import ModuleTracker

from ..internals import current_autograd_node, dispatch_mode_base, in_backward, op_writes_input, tensor_version
from .node_modules import NodeModules, is_labelled, node_module
from .stacks import keep_user_entries, user_stack

__all__ = ["NonFiniteLocator", "NonFiniteOp", "DOMAIN_OPS"]

# Ops that only move a value from Python into a tensor: an inf they produce is a constant someone wrote.
_CONSTANT_OPS = {"aten.lift_fresh.default", "aten.lift_fresh_copy.default", "aten.scalar_tensor.default"}
# Ops returning uninitialized memory: whatever bits they hold (NaN included) are not values yet.
_UNINITIALIZED_OPS = {"aten.empty.memory_format", "aten.empty_like.default", "aten.empty_strided.default",
                      "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty_permuted.default"}
_MUTATING: dict[Any, bool] = {}


@dataclass
class NonFiniteOp:
    """One aten op whose floating output held a NaN or an Inf.

    Attributes:
        op: the aten overload, e.g. ``"aten.log.default"``.
        direction: ``"forward"`` or ``"backward"`` (it ran inside the autograd engine).
        module: the innermost module running it, in the model's ``named_modules()`` naming
            (``""`` is the root model); None when no module was running (e.g. a loss computed
            outside the model, or the optimizer).
        origin: True when every floating input was finite (an intended ``-inf`` mask counts as
            finite, see ``tolerate_masks``), so this op created the bad value; False when it only
            propagated one it was given.
        kind: ``"nan"``, ``"inf"`` or ``"nan+inf"`` (what the output held).
        num_nonfinite: how many output elements are NaN or Inf; ``numel`` how many elements in all.
        nonfinite_inputs: positions (among the op's tensor inputs) of the inputs that were not finite.
        autograd_node: in backward, the autograd node running it (e.g. ``"SqrtBackward0"``).
        op_index: how many aten ops the locator saw before this one.
        stack: the Python stack that ran it (forward), or of the forward call that created its
            autograd node (backward; only under ``torch.autograd.detect_anomaly``), else None.
        masked_in_forward: for the first origin, in forward, inside a module: True when the output of
            that module call held only finite values (the bad value was masked out, e.g. by
            ``torch.where``, and never reached the module's output), False when it did not; else None
            (None too where that output holds no tensor the locator can read: see :func:`_output_tensors`).
        backward_op: when ``masked_in_forward``: the first op of the backward pass whose output was
            non-finite (a masked branch still gets a gradient: ``0 / 0`` in ``Log2Backward0``), or None.
        input_range: (min, largest magnitude) of the finite values of its first floating-point input, or None
            (a log or sqrt of -0.5 is out of the op's domain; of -1e-7 beside 1.0, a rounding's).
        param_inputs: which of its inputs are parameters (autocast's cast of a weight, not of the module's input), and
            ``param_names`` their names (a log of a learned scale an update moved below 0).
    """

    op: str
    direction: str
    module: str | None
    origin: bool
    kind: str
    num_nonfinite: int
    numel: int
    input_shapes: list[list[int]]
    input_dtypes: list[str]
    output_shapes: list[list[int]]
    output_dtypes: list[str]
    nonfinite_inputs: list[int] = field(default_factory=list)
    autograd_node: str | None = None
    op_index: int = 0
    stack: str | None = None
    masked_in_forward: bool | None = None
    backward_op: NonFiniteOp | None = None
    input_range: list[float] | None = None
    param_inputs: list[int] = field(default_factory=list)
    param_names: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def where(self) -> str:
        """Return e.g. ``"forward of module 'layers.2'"``."""
        if self.module is None:
            place = "outside any module"
        elif self.module == "":
            place = "of the root module"
        else:
            place = f"of module {self.module!r}"
        node = f" ({self.autograd_node})" if self.autograd_node else ""
        return f"{self.direction}{node} {place}"

    def describe(self) -> str:
        """Return one line: op, direction, module, origin or propagation, dtypes."""
        how = "origin: inputs finite" if self.origin else "propagated: a non-finite input"
        dtypes = ",".join(sorted(set(self.output_dtypes)))
        text = f"{self.op} in {self.where()} ({how}; {self.kind} in {self.num_nonfinite}/{self.numel} {dtypes} elements)"
        if self.masked_in_forward:
            text += "; made finite again before the module's output in forward (masked, clamped or saturated)"
            if self.backward_op is not None:
                text += (f", non-finite again in backward at {self.backward_op.op} "
                         f"({self.backward_op.autograd_node or 'no autograd node'})")
        return text


def _is_mutating(func: Any) -> bool:
    """Return whether ``func`` writes into one of its inputs (its inputs must be checked before it runs)."""
    known = _MUTATING.get(func)
    if known is None:
        known = _MUTATING[func] = op_writes_input(func)
    return known


def _leaves(tree: Any) -> list[Any]:
    """The leaves of an op's arguments or outputs, in order: tuples, lists and dicts walked, all else a leaf."""
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in _leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in _leaves(item)]
    return [tree]


def _output_tensors(out: Any, depth: int = 6, seen: set[int] | None = None) -> list[Tensor]:
    """The tensors of a module call's output: also inside a dataclass, a named tuple, a dict (Hugging Face's
    ``ModelOutput`` is both) or a plain object's attributes (``types.SimpleNamespace``); not inside another module,
    nor past ``depth`` levels (the op-level :func:`_leaves` walks containers only: it runs on every op)."""
    if isinstance(out, Tensor):
        return [out]
    seen = seen if seen is not None else set()
    if depth == 0 or id(out) in seen or isinstance(out, (str, bytes, nn.Module, type)):
        return []
    seen.add(id(out))
    if isinstance(out, dict):
        items = list(out.values())
    elif isinstance(out, (tuple, list, set, frozenset)):
        items = list(out)
    elif is_dataclass(out):
        items = [getattr(out, f.name, None) for f in fields(out)]
    else:
        items = list(getattr(out, "__dict__", {}).values())
    return [t for item in items for t in _output_tensors(item, depth - 1, seen)]


def _floating(tensors: list[Any]) -> list[Tensor]:
    return [t for t in tensors if isinstance(t, Tensor) and (t.is_floating_point() or t.is_complex())]


def _all_finite(tensors: list[Tensor], known_bad: list[bool] | None = None, likely_bad: bool = False) -> list[bool]:
    """Return, per tensor, whether every element is finite (one host sync; a second for those the first cannot clear).

    A NaN or an Inf makes a tensor's sum non-finite, so a finite sum proves the tensor finite in one
    reduction (cheaper than ``isfinite(t).all()``, which writes a mask first); only a tensor whose sum is not
    finite (a bad value, or a sum that overflowed) is then read exactly, by its min and max.
    ``known_bad``: per tensor, already known to be non-finite (not read again); ``likely_bad``: read
    exactly at once (where a non-finite input makes a non-finite output likely).
    """
    if not tensors:
        return []
    device = tensors[0].device
    ok = [False] * len(tensors)
    unknown = [i for i in range(len(tensors)) if not (known_bad and known_bad[i])]
    if unknown and not likely_bad:
        for i, flag in zip(unknown, torch.stack([_finite_sum(tensors[i]).to(device) for i in unknown]).tolist()):
            ok[i] = flag
    unsure = [i for i in unknown if not ok[i]]
    if unsure:
        exact = torch.stack([_finite_exact(tensors[i]).to(device) for i in unsure]).tolist()
        for i, flag in zip(unsure, exact):
            ok[i] = flag
    return ok


def _finite_sum(t: Tensor) -> Tensor:
    """A 0-dim bool: True proves every element of ``t`` finite; False means "look closer" (see _all_finite)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    try:
        return torch.isfinite(t.sum())
    except (RuntimeError, NotImplementedError):  # a dtype without a sum kernel (e.g. float8): the exact check decides
        return torch.zeros((), dtype=torch.bool, device=t.device)


def _finite_exact(t: Tensor) -> Tensor:
    """A 0-dim bool: whether every element of ``t`` is finite (min and max propagate NaN and show +-Inf; no overflow)."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    try:
        low, high = torch.aminmax(t)
    except (RuntimeError, NotImplementedError):  # complex, or a dtype without min/max kernels
        return torch.isfinite(t).all()
    return torch.isfinite(low) & torch.isfinite(high)


class _Mode(dispatch_mode_base()):
    def __init__(self, locator: NonFiniteLocator) -> None:
        super().__init__()
        self.locator = locator

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        loc = self.locator
        if loc.first_origin is not None or (loc.first_only and loc.first is not None):  # done: cost nothing ...
            if not loc._following_backward():
                return func(*args, **kwargs)
            out = func(*args, **kwargs)  # ... unless a masked forward value is followed into backward
            outputs = _floating(_leaves(out))
            if outputs and not all(_all_finite(outputs)):
                loc._record_backward(func, _floating(_leaves((args, kwargs))), outputs)
            return out
        loc.num_ops += 1
        if str(func) in _UNINITIALIZED_OPS:
            out = func(*args, **kwargs)
            for t in _floating(_leaves(out)):
                loc._remember(loc._uninitialized, t)
            return out
        inputs = _floating(_leaves((args, kwargs)))
        known = [loc._known_bad(t) for t in inputs] if loc._nonfinite else None  # read before: not read again
        before = _all_finite(inputs, known) if _is_mutating(func) else None  # an in-place op overwrites its inputs
        # (its input's range too, read before the op writes it, for an in-place log or root: a diagnosis reads it)
        pre_range = (_range(inputs) if before is not None and not loc.first_only and _DOMAIN_OPS.match(str(func))
                     else None)
        out = func(*args, **kwargs)
        outputs = _floating(_leaves(out))
        if not outputs:
            return out
        likely_bad = known is not None and any(k and not loc._is_tolerated(t) for k, t in zip(known, inputs))
        flags = _all_finite(outputs, likely_bad=likely_bad)
        if all(flags):
            return out
        for t, ok in zip(outputs, flags):
            if not ok:
                loc._mark_bad(t)
        loc._record(func, args, kwargs, inputs, before, outputs, known, pre_range)
        return out


class NonFiniteLocator:
    """Context manager recording the first aten op whose output holds a NaN or Inf (forward or backward).

    Attributes after (or during) the block:
        first: the first op with a non-finite output (:class:`NonFiniteOp`), even if it only
            propagated a non-finite input (a NaN in the batch or in a weight).
        first_origin: the first op that created a non-finite value from finite inputs; usually
            the same op as ``first``. Once it is found the locator stops checking.
        num_ops: aten ops checked.

    Args:
        model: the model whose ``named_modules()`` names to report (the tracker's names are
            rebased onto it). Call the model's own ``forward`` first inside the block.
        capture_stack: record the Python stack of the first op (forward), or under
            ``detect_anomaly`` the stack of the forward call that created the backward node.
        first_only: stop checking at ``first`` (do not look further for a later origin; a masked
            first origin is still followed into backward). What a replay needs that only compares
            the first op (its op, direction and module) costs no checks past it.
        tolerate_masks: treat ``-inf`` attention masks as intended: an op that writes an inf from
            a Python constant (``full``, ``masked_fill``, ``where`` with ``float("-inf")``), a
            model buffer that holds only ``-inf`` as its non-finite values, and ops computed only from
            such tensors that add no NaN, are not reported. A NaN is always reported.

    When the first origin runs in forward inside a module, the locator checks that module call's
    output (one sync): if it is finite, the bad value was masked out (``torch.where(x > 2, log2(x),
    ...)`` at ``x = 0``) and the origin's ``masked_in_forward`` is True; the locator then watches the
    backward pass until the first op whose output is non-finite, the origin's ``backward_op`` (the
    masked branch's gradient, ``0 / 0`` in ``Log2Backward0``). Otherwise nothing more is checked.

    Works with autocast, on CPU and CUDA. Every op costs a host-device sync while it searches:
    replay only. The ``module`` of an op in backward is the one whose forward made its autograd node
    (:mod:`.node_modules`; ModuleTracker's backward hooks where the node has no label).
    """

    def __init__(self, model: nn.Module | None = None, *, capture_stack: bool = True, tolerate_masks: bool = True,
                 first_only: bool = False) -> None:
        self.model = model
        self._param_names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
        self.capture_stack = capture_stack
        self.first_only = first_only
        self.tolerate_masks = tolerate_masks
        self.first: NonFiniteOp | None = None
        self.first_origin: NonFiniteOp | None = None
        self.num_ops = 0
        self._tolerated: dict[int, weakref.ref] = {}  # intended infs (masks)
        self._uninitialized: dict[int, weakref.ref] = {}  # fresh torch.empty memory: garbage, not values
        # Tensors read as non-finite, with their version: while unchanged (no in-place write to them or to a
        # view of them), an op taking one is not an origin and the tensor need not be read again.
        self._nonfinite: dict[int, tuple[weakref.ref, int]] = {}
        self._names = {name for name, _ in model.named_modules()} if model is not None else None
        self._root = type(model).__name__ if model is not None else None
        self._tracker = ModuleTracker()
        self._mode, self._nodes = _Mode(self), NodeModules(self._module)
        self._watch: nn.Module | None = None  # the module call that ran the forward origin: is its output finite?
        self._entered = contextlib.ExitStack()

    @property
    def found(self) -> bool:
        return self.first is not None

    def __enter__(self) -> NonFiniteLocator:  # noqa: PYI034 (typing.Self needs Python 3.11)
        if self.model is not None and self.tolerate_masks:
            buffers = [b for b in self.model.buffers() if b.is_floating_point()]
            for buf, finite in zip(buffers, _all_finite(buffers)):
                if not finite and not bool((torch.isnan(buf) | torch.isposinf(buf)).any()):
                    self._tolerate(buf)
        with contextlib.ExitStack() as stack:  # left in reverse: the modes, the hook, the tracker
            stack.enter_context(self._tracker)
            stack.callback(nn.modules.module.register_module_forward_hook(self._on_module_output).remove)
            stack.enter_context(self._nodes)
            stack.enter_context(self._mode)
            self._entered = stack.pop_all()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._entered.__exit__(*exc)
        finally:
            self._tolerated.clear()
            self._uninitialized.clear()
            self._nonfinite.clear()
            self._watch = None

    # -- internals ------------------------------------------------------------------------------

    @staticmethod
    def _remember(registry: dict[int, weakref.ref], t: Tensor) -> None:
        key = id(t)
        registry[key] = weakref.ref(t, lambda _, key=key, d=registry: d.pop(key, None))

    @staticmethod
    def _holds(registry: dict[int, weakref.ref], t: Tensor) -> bool:
        ref = registry.get(id(t))
        return ref is not None and ref() is t

    def _mark_bad(self, t: Tensor) -> None:
        version = tensor_version(t)
        if version is not None:
            key = id(t)
            self._nonfinite[key] = (weakref.ref(t, lambda _, key=key, d=self._nonfinite: d.pop(key, None)), version)

    def _known_bad(self, t: Tensor) -> bool:
        entry = self._nonfinite.get(id(t))
        return entry is not None and entry[0]() is t and tensor_version(t) == entry[1]

    def _tolerate(self, t: Tensor) -> None:
        self._remember(self._tolerated, t)

    def _is_tolerated(self, t: Tensor) -> bool:
        return self._holds(self._tolerated, t)

    def _on_module_output(self, module: nn.Module, inputs: Any, output: Any) -> None:
        """When the module call that ran the forward origin returns: did the bad value reach its output?"""
        if self._watch is None or module is not self._watch or self.first_origin is None:
            return
        self._watch = None
        outputs = _floating(_output_tensors(output))  # none readable: unknown (None), never "masked"
        self.first_origin.masked_in_forward = all(_all_finite(outputs)) if outputs else None

    def _following_backward(self) -> bool:
        origin = self.first_origin
        return (origin is not None and bool(origin.masked_in_forward) and origin.backward_op is None
                and in_backward())

    def _record_backward(self, func: Any, inputs: list[Tensor], outputs: list[Tensor]) -> None:
        """Record the first backward op that went non-finite after a masked forward origin."""
        bad_inputs = [i for i, ok in enumerate(_all_finite(inputs)) if not ok]
        assert self.first_origin is not None
        self.first_origin.backward_op = self._op_record(func, inputs, outputs, bad_inputs, not bad_inputs, False)

    def _module(self) -> str | None:
        """Return the innermost running module in the model's naming (None: no module is running)."""
        names = [n for n in self._tracker.parents if n != "Global"]
        if not names:
            return None
        name = max(names, key=lambda n: (n.count("."), n))
        # The tracker names modules from the class name of the first module it saw (the root).
        root, _, rest = name.partition(".")
        rebased = (self._root is None or root == self._root) and (self._names is None or rest in self._names)
        return rest if rebased else name

    def _record(self, func: Any, args: Any, kwargs: Any, inputs: list[Tensor], before: list[bool] | None,
                outputs: list[Tensor], known: list[bool] | None = None, pre_range: list[float] | None = None) -> None:
        if before is not None:
            finite_in = before
        else:
            finite_in = _all_finite(inputs, known)
            for t, ok in zip(inputs, finite_in):  # not written by this op: still as read
                if not ok:
                    self._mark_bad(t)
        if str(func) in _CONSTANT_OPS:  # its input is a Python literal: a NaN/Inf written by hand starts here
            finite_in = [True] * len(inputs)
        # Garbage in fresh torch.empty memory that this op overwrites is not an input value.
        bad_inputs = [i for i, ok in enumerate(finite_in) if not ok and not self._holds(self._uninitialized, inputs[i])]
        # An intended inf (a mask) handed in counts as finite: an op turning it into NaN is the origin.
        untolerated = [i for i in bad_inputs if not self._is_tolerated(inputs[i])]
        if self.tolerate_masks and not untolerated and not _has_nan(outputs):
            from_constant = str(func) in _CONSTANT_OPS or any(
                isinstance(a, float) and math.isinf(a) for a in _leaves((args, kwargs)))
            if bad_inputs or from_constant:
                for t in outputs:
                    self._tolerate(t)
                return
        if _is_view(func) and str(func) not in _CONSTANT_OPS:
            return  # a view of a bad tensor computes nothing: report the op that uses it
        origin = not (untolerated if self.tolerate_masks else bad_inputs)
        if self.first is not None and not origin:
            return
        # its input's range, for the first origin only (what a diagnosis reads), and not where the op overwrote it
        kept = origin and self.first_origin is None and not self.first_only  # the record a diagnosis reads
        rec = self._op_record(func, inputs, outputs, bad_inputs, origin, self.capture_stack,
                              in_range=kept and before is None)
        if kept and pre_range is not None:  # an in-place op's, read before it wrote its input
            rec.input_range = pre_range
        if self.first is None:
            self.first = rec
        if origin:
            self.first_origin = rec
            if rec.direction == "forward" and rec.module is not None and self.model is not None:
                if rec.module == "":
                    self._watch = self.model
                elif self._names is not None and rec.module in self._names:
                    self._watch = self.model.get_submodule(rec.module)

    def _op_record(self, func: Any, inputs: list[Tensor], outputs: list[Tensor], bad_inputs: list[int], origin: bool,
                   capture_stack: bool, in_range: bool = False) -> NonFiniteOp:
        num_bad = sum(int((~torch.isfinite(t)).sum()) for t in outputs)
        has_inf = bool(torch.stack([torch.isinf(t).any().to(outputs[0].device) for t in outputs]).any())
        backward = in_backward()
        node = current_autograd_node()
        stack = None
        if capture_stack:
            if backward:
                tb = node.metadata.get("traceback_") if node is not None else None
                stack = keep_user_entries(list(tb)) if tb else None
            else:
                stack = user_stack()
        has_nan, made_by = _has_nan(outputs), node_module(node)  # made_by: the module whose forward made the node
        return NonFiniteOp(
            op=str(func), direction="backward" if backward else "forward", origin=origin,
            module=made_by if backward and is_labelled(made_by) else self._module(),
            kind="nan+inf" if has_nan and has_inf else ("nan" if has_nan else "inf"), num_nonfinite=num_bad,
            numel=sum(t.numel() for t in outputs), input_shapes=[list(t.shape) for t in inputs],
            input_dtypes=[_dtype(t) for t in inputs], output_shapes=[list(t.shape) for t in outputs],
            output_dtypes=[_dtype(t) for t in outputs], nonfinite_inputs=bad_inputs,
            autograd_node=node.name() if node is not None else None, op_index=self.num_ops - 1, stack=stack,
            input_range=_range(inputs) if in_range else None,
            param_inputs=[i for i, t in enumerate(inputs) if isinstance(t, nn.Parameter)],
            param_names=[self._param_names.get(id(t), "?") for t in inputs if isinstance(t, nn.Parameter)])


#: The ops whose input's range tells a value out of their domain (a log or a root of one below 0), and their aten names
#: (in place and ``out=`` too).
DOMAIN_OPS = ("sqrt", "rsqrt", "log", "log2", "log10")
_DOMAIN_OPS = re.compile(rf"aten\.({'|'.join(DOMAIN_OPS)})_?\.")


def _range(inputs: list[Tensor]) -> list[float] | None:
    """(min, largest magnitude) of the finite values of the first floating-point input: two reductions and one host read
    (no boolean index, whose copies cost a multiple of the input); None where it holds no finite value."""
    x = next((t.detach() for t in inputs if t.is_floating_point() and t.numel()), None)
    if x is None:
        return None
    finite = torch.isfinite(x)
    low, big = torch.stack([torch.where(finite, x, math.inf).amin(), torch.where(finite, x.abs(), 0.0).amax()]).tolist()
    return [low, big] if math.isfinite(low) else None


def _has_nan(tensors: list[Tensor]) -> bool:
    return bool(torch.stack([torch.isnan(t).any().to(tensors[0].device) for t in tensors]).any())


def _is_view(func: Any) -> bool:
    return bool(getattr(func, "is_view", False)) or str(func) in ("aten.detach.default", "aten.alias.default")


def _dtype(t: Tensor) -> str:
    return str(t.dtype).replace("torch.", "")
