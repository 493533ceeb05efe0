"""Staging: copy a nested state into reused host buffers, so the run may go on changing its own.

:class:`StateStager` is the copy a background checkpoint writes from, and the incident recorder's
per-interval snapshot. Under DDP the parameters and optimizer state are the same on every rank, so
the snapshot need not hold them on every rank: ``stage(..., share=(rank, world))`` copies only the
tensors this rank owns (about 1/world of the bytes, assigned the same way on every rank) and leaves a
:class:`Withheld` in place of the others; :func:`fill_withheld` completes a staged state on every rank
with one broadcast per withheld tensor from its owner (the incident capture, rare, does it; the
per-interval copy, every interval, is what shrinks).
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["PLAIN_TYPES", "StateStager", "Withheld", "fill_withheld", "map_leaves",
           "load_optimizer_state_", "state_kept", "state_bytes", "host_memory_available", "snapshot_fits", "split_params",
           "join_params", "clone_state", "equal_states", "tensors_in"]

_PLAIN = (int, float, bool, str, bytes, complex, type(None))  # leaves that cannot change under a writer
#: The types of a state's leaves that are copied as they are (no tensor: nothing to stage).
PLAIN_TYPES = frozenset(_PLAIN)


def _plain_sequence(x: Any) -> bool:
    """A tuple or list of plain values only (e.g. Python's RNG state): staged as one leaf."""
    return type(x) in (tuple, list) and PLAIN_TYPES.issuperset(map(type, x))  # C loops: Python's RNG has 625


@dataclass(eq=False)
class Withheld:
    """A tensor that rank ``owner`` staged in this rank's place (``StateStager.stage(share=...)``)."""

    owner: int
    shape: torch.Size
    dtype: torch.dtype


class StateStager:
    """Copy a nested state into host buffers that are reused from one call to the next (a save's staging copy).

    Each tensor is copied into a CPU tensor of its shape and dtype, kept while the state's layout stays
    the same. A CUDA tensor goes into pinned memory by a non-blocking copy, so staging does not wait for
    the device: :meth:`stage` returns one CUDA event per device, which a reader synchronizes first.
    Tensors that are views of the same memory with the same layout (tied weights) share one buffer, so
    the file holds them once, as ``torch.save`` of the live state would. Containers are rebuilt and other
    leaves deep-copied, so the caller may go on changing its state. Staging again overwrites the buffers (and
    may return the same containers, :meth:`stage`): only after the previous copy is no longer read
    (:class:`~stabletrain.records.checkpoint.manager.CheckpointManager` keeps one save in flight).
    """

    def __init__(self) -> None:
        self._buffers: list[Tensor] = []
        self._specs: list[tuple[torch.Size, torch.dtype, bool]] = []  # each buffer's (shape, dtype, pinned)
        # The last stage of a dict of dicts of tensors (:func:`_params_layout`): (its keys and share, each leaf's
        # (address, shape, strides, dtype), the result, {device: (buffers, the leaves' positions)}).
        self._memo: tuple[list[Any], list[Any], Any, dict[torch.device, tuple[list[Tensor], list[int]]]] | None = None

    @property
    def num_bytes(self) -> int:
        """Host memory the buffers hold."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def stage(self, state: Any, *, share: tuple[int, int] | None = None, stream: Any = None,
              fresh: Collection[str] = ()) -> tuple[Any, list[Any]]:
        """Return (a copy of ``state`` whose tensors are the host buffers, the CUDA events to wait on).

        Dicts (and OrderedDicts), lists and tuples are walked directly (a pytree flatten and unflatten
        cost 4x the walk's Python time on a model's state); other containers are deep-copied.

        ``share=(rank, world)``: ``state`` is the same on every rank (DDP's parameters and optimizer
        state), and every rank stages it together: each distinct tensor, in the walk's order, goes to the
        rank with the fewest bytes so far (the lowest on a tie: the same assignment on every rank); this
        rank copies its own and leaves a :class:`Withheld` for the others (:func:`fill_withheld`).

        ``stream``: a CUDA stream to queue the device-to-host copies on (it first waits for the current
        stream); the caller orders any in-place change of the state after the returned events.

        ``fresh``: keys of ``state`` (a dict) whose values are host copies nothing changes later (made afresh by the
        caller, tensors on the CPU): kept as they are, neither walked nor copied.

        A dict of dicts whose values are tensors or dicts of tensors (the parameters and optimizer state,
        :func:`split_params`) staged again with the same keys, share and tensors (address, shape, strides, dtype)
        reuses the last call's plan: one copy per device into the same buffers, and the same result containers (as
        with its buffers, the last result is this one: the caller changes and keeps neither), without the walk (the
        mlp's parameters and optimizer state: 89 us staged by the walk, 58 us by the plan, the copy 25 us of it).
        """
        layout = _params_layout(state) if not fresh else None
        if layout is not None:
            keys, leaves = layout
            keys.append(share)
            memo = self._memo
            # (no device: under CUDA's unified addressing no device address is a host's)
            sig = [(t.data_ptr(), t.shape, t.stride(), t.dtype) for t in leaves]
            if memo is not None and memo[0] == keys and memo[1] == sig:
                return memo[2], self._copy({device: (dst, [leaves[i] for i in at]) for device, (dst, at) in
                                            memo[3].items()}, stream)
        self._memo = None
        rank, world = share if share is not None else (0, 1)
        load = [0] * world  # bytes assigned to each rank so far
        # Tensors staged so far by address: [(source, its buffer or Withheld), ...]. The same view of the same memory
        # (device, dtype, address, shape, strides) is staged once; the full comparison only where addresses meet.
        shared: dict[int, list[tuple[Tensor, Tensor | Withheld]]] = {}
        copies: dict[torch.device, tuple[list[Tensor], list[Tensor]]] = {}  # source device -> (buffers, sources)
        used = 0  # buffers used so far (one per distinct tensor this rank stages), in the walk's order
        buffers, specs = self._buffers, self._specs

        strided, one = torch.strided, world == 1

        def same_view(a: Tensor, b: Tensor) -> bool:
            return (a.device == b.device and a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride())

        def leaf(x: Tensor) -> Tensor | Withheld:
            nonlocal used
            if x.layout != strided:  # sparse and other layouts: a plain copy (rare in a state dict)
                return x.detach().to("cpu", copy=True)
            at = x.data_ptr()
            seen = shared.get(at)
            if seen is not None:  # tied weights (or another view at the same address)
                for other, buf in seen:
                    if same_view(x, other):
                        return buf
            shape, dtype = x.shape, x.dtype  # (no detach: the copy below runs under no_grad)
            if not one:
                owner = load.index(min(load))
                load[owner] += x.numel() * x.element_size()
                if owner != rank:
                    buf = Withheld(owner, shape, dtype)
                    shared.setdefault(at, []).append((x, buf))
                    return buf
            k, pin = used, x.is_cuda
            buf = (buffers[k] if k < len(specs) and specs[k] == (shape, dtype, pin)
                   else self._buffer(k, x, shape, pin))
            shared.setdefault(at, []).append((x, buf))
            used = k + 1
            device = x.device
            pair = copies.get(device)
            if pair is None:
                pair = copies[device] = ([], [])
            pair[0].append(buf)
            pair[1].append(x)
            return buf

        plain = PLAIN_TYPES

        def walk(x: Any) -> Any:
            t = type(x)
            if t in plain:
                return x
            if t is dict:  # comprehensions, not generators: a state has hundreds of entries; plain values not called,
                # plain tensors (a state dict's, an optimizer's state) straight to leaf()
                return {k: v if (tv := type(v)) in plain else leaf(v) if tv is Tensor else walk(v) for k, v in x.items()}
            if isinstance(x, Tensor):
                return leaf(x)
            if t is OrderedDict:
                return OrderedDict([(k, v if (tv := type(v)) in plain else leaf(v) if tv is Tensor else walk(v))
                                    for k, v in x.items()])
            if t is list:  # a fresh list, so the caller may go on changing its own
                return list(x) if _plain_sequence(x) else [v if type(v) in plain else walk(v) for v in x]
            if t is tuple:  # immutable: kept as it is when it holds plain values only (Python's RNG state)
                return x if _plain_sequence(x) else tuple([v if type(v) in plain else walk(v) for v in x])
            return copy.deepcopy(x)

        out = {k: v if k in fresh else walk(v) for k, v in state.items()} if fresh else walk(state)
        del self._buffers[used:], self._specs[used:]
        if layout is not None and all(x.layout == strided for x in leaves):
            where = {id(x): i for i, x in enumerate(leaves)}  # each copied source's place among the leaves
            self._memo = (keys, sig, out, {device: (dst, [where[id(x)] for x in src]) for device, (dst, src) in
                                           copies.items()})
        return out, self._copy(copies, stream)

    @staticmethod
    def _copy(copies: dict[torch.device, tuple[list[Tensor], list[Tensor]]], stream: Any) -> list[Any]:
        """Copy each device's sources into their buffers (one fused copy per device); the CUDA events to wait on."""
        events = []
        with torch.no_grad():
            for device, (dst, src) in copies.items():
                on_cuda = device.type == "cuda"
                side = stream if on_cuda and stream is not None and stream.device == device else None
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
                    torch._foreach_copy_(dst, src, non_blocking=on_cuda)  # from CUDA into pinned memory: queued, not waited for
                    if on_cuda:
                        event = torch.cuda.Event()
                        event.record(side if side is not None else torch.cuda.current_stream(device))
                        events.append(event)
        return events

    def _buffer(self, k: int, like: Tensor, shape: torch.Size, pin: bool) -> Tensor:
        if k < len(self._buffers):
            buf, spec = self._buffers[k], self._specs[k]
            if spec == (shape, like.dtype, pin):
                return buf
        buf = torch.empty(shape, dtype=like.dtype, pin_memory=pin)
        if k < len(self._buffers):
            self._buffers[k], self._specs[k] = buf, (shape, like.dtype, pin)
        else:
            self._buffers.append(buf)
            self._specs.append((shape, like.dtype, pin))
        return buf


def _params_layout(state: Any) -> tuple[list[Any], list[Tensor]] | None:
    """(the keys, the tensors in order) of a dict of dicts whose values are tensors or dicts of tensors (the parameters
    and the optimizer's per-parameter state); None for any other state."""
    if type(state) is not dict:
        return None
    keys: list[Any] = []
    leaves: list[Tensor] = []
    for key, part in state.items():
        if type(part) is not dict and type(part) is not OrderedDict:
            return None
        keys.append(key)
        for k, v in part.items():
            if type(v) is Tensor:
                keys.append(k)
                leaves.append(v)
            elif type(v) is dict:
                keys.append((k, *v))
                leaves.extend(v.values())
            else:
                return None
        keys.append(None)  # (the part's end)
    return (keys, leaves) if all(type(t) is Tensor for t in leaves) else None


def fill_withheld(staged: Any, device: torch.device | str = "cpu") -> Any:
    """Return ``staged`` (from ``stage(share=...)``) with each :class:`Withheld` replaced by its owner's copy.

    Every rank of the default group calls it on its own staged state: the same structure, in the same order,
    as ``stage`` walked it; each distinct withheld tensor is one broadcast from its owner. ``device``:
    where the collective runs (CPU for gloo; the rank's CUDA device for NCCL, one tensor at a time, so
    device memory stays flat). This rank's own buffers are kept as they are; the rest are new host
    tensors. Containers are rebuilt.
    """
    device = torch.device(device)
    done: dict[int, Tensor] = {}  # id of a staged leaf (a buffer or a Withheld; tied ones are one object) -> result

    rank = dist.get_rank()

    def move(t: Tensor, src: int) -> Tensor:
        if device.type == "cpu":
            dist.broadcast(t, src=src)
            return t
        on_device = t.to(device) if src == rank else torch.empty(t.shape, dtype=t.dtype, device=device)
        dist.broadcast(on_device, src=src)
        return t if src == rank else on_device.to("cpu")

    def leaf(x: Tensor | Withheld) -> Tensor:
        key = id(x)
        if key not in done:
            if isinstance(x, Withheld):
                done[key] = move(torch.empty(x.shape, dtype=x.dtype), x.owner)
            else:  # this rank's own buffer
                done[key] = move(x, rank)
        return done[key]

    return map_leaves(staged, lambda x: leaf(x) if isinstance(x, Withheld) or (isinstance(x, Tensor) and
                                                                            x.layout == torch.strided) else x)


def map_leaves(state: Any, fn: Callable[[Any], Any]) -> Any:
    """Return ``state`` with its containers (dicts, OrderedDicts, lists, tuples) rebuilt and every leaf but the plain
    values (:data:`PLAIN_TYPES`) replaced by ``fn(leaf)``, visited in order (the same order on every rank)."""
    def walk(x: Any) -> Any:
        t = type(x)
        if t in PLAIN_TYPES:
            return x
        if t is dict or t is OrderedDict:
            return t((k, walk(v)) for k, v in x.items())
        if t is list:
            return [walk(v) for v in x]
        if t is tuple:
            return tuple(walk(v) for v in x)
        return fn(x)

    return walk(state)


def equal_states(a: Any, b: Any) -> bool:
    """Whether two nested states hold the same values: dicts by key, sequences in order, tensors bitwise (shape, dtype)."""
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (isinstance(a, Tensor) and isinstance(b, Tensor) and a.shape == b.shape and a.dtype == b.dtype
                and torch.equal(a.detach().cpu(), b.detach().cpu()))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(equal_states(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal_states(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def clone_state(state: Any) -> Any:
    """Return a deep copy of a nested state (dicts, lists, tuples): tensors cloned on their device, containers rebuilt."""
    if isinstance(state, Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return type(state)((k, clone_state(v)) for k, v in state.items())
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(clone_state(v) for v in state)
    return copy.copy(state)


def split_params(local: dict[str, Any], names: set[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the parameters' entries of ``local["model"]`` and the optimizer's per-parameter state, the rest of ``local``).

    The first part changes only in the optimizer's step and, under DDP, is the same on every rank; the rest
    (buffers such as BatchNorm's running statistics, which each rank updates in its own forward, the RNG
    streams, the data position, ...) is this rank's own. ``names``: the parameters' names in the model's state.
    """
    model, optimizer = local["model"], local.get("optimizer", {})
    side = {"model": {k: v for k, v in model.items() if k in names}, "optimizer": optimizer.get("state", {})}
    rest = {**local, "model": type(model)((k, v) for k, v in model.items() if k not in names),
            "optimizer": {k: v for k, v in optimizer.items() if k != "state"}}
    return side, rest


def join_params(side: dict[str, Any] | None, rest: dict[str, Any]) -> dict[str, Any]:
    """Undo :func:`split_params` (the model's entries in any order: ``load_state_dict`` goes by name); ``side`` None: ``rest``."""
    if side is None:
        return rest
    model = type(rest["model"])(rest["model"])
    model.update(side["model"])
    return {**rest, "model": model, "optimizer": {**rest["optimizer"], "state": side["optimizer"]}}


def state_bytes(state: Any, *, share: int = 1) -> int:
    """Host bytes that staging ``state`` takes: each distinct tensor once (tied views count once), ``/ share``.

    ``share``: the number of ranks that split it (``StateStager.stage(share=...)`` under DDP; about 1/world each).
    """
    seen: dict[tuple[Any, ...], int] = {}
    for t in tensors_in(state):
        seen[(t.device, t.dtype, t.data_ptr(), t.shape, t.stride())] = t.numel() * t.element_size()
    return -(-sum(seen.values()) // share)


def host_memory_available() -> int | None:
    """Bytes of host memory available to new allocations without swapping now (Linux ``MemAvailable``); None where unknown.

    What ``capture.memory_snapshot=auto`` measures once when a run starts (:func:`snapshot_fits`).
    """
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def snapshot_fits(per_process: int, fraction: float, *, processes: int = 1,
                  available: int | None = None) -> tuple[bool, int | None]:
    """Whether ``processes`` snapshots of ``per_process`` bytes fit ``fraction`` of the host memory; (fits, budget).

    ``available``: the host's available bytes (default: :func:`host_memory_available`, measured now). Where
    it is unknown the snapshot is taken (fits, budget None), as it was before the rule existed.
    """
    available = host_memory_available() if available is None else available
    if available is None:
        return True, None
    budget = int(available * fraction)
    return per_process * processes <= budget, budget


def tensors_in(state: Any) -> Iterator[Tensor]:
    """The tensors of a nested state (dicts, lists, tuples), in order."""
    if isinstance(state, Tensor):
        yield state
    elif isinstance(state, dict):
        for v in state.values():
            yield from tensors_in(v)
    elif isinstance(state, (list, tuple)):
        for v in state:
            yield from tensors_in(v)


def load_optimizer_state_(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put ``state`` (an ``optimizer.state_dict()``) back into ``optimizer`` in place.

    Unlike ``optimizer.load_state_dict`` the live state tensors and param-group dicts stay the same
    objects (values are copied into them), so a host's wrapper that holds them (Lightning's
    ``LightningOptimizer``, accelerate's ``AcceleratedOptimizer``) still sees the live ones, and nothing
    aliases ``state``'s tensors afterwards. Per-parameter state that ``state`` does not have is dropped;
    state it has and the optimizer does not is made where torch's ``load_state_dict`` would put it.
    """
    groups, saved_groups = optimizer.param_groups, state["param_groups"]
    if len(groups) != len(saved_groups) or any(len(g["params"]) != len(s["params"]) for g, s in zip(groups, saved_groups)):
        raise ValueError("optimizer state: its parameter groups do not match the optimizer's")
    with torch.no_grad():
        for group, saved in zip(groups, saved_groups):
            for key, value in saved.items():
                if key == "params":
                    continue
                live = group.get(key)
                if isinstance(live, Tensor) and isinstance(value, Tensor) and live.shape == value.shape:
                    live.copy_(value)
                else:
                    group[key] = value.detach().clone() if isinstance(value, Tensor) else copy.deepcopy(value)
            fused_like = bool(group.get("fused") or group.get("capturable"))
            for index, param in zip(saved["params"], group["params"]):
                entry = state["state"].get(index)
                if entry is None:
                    optimizer.state.pop(param, None)
                    continue
                live_entry = optimizer.state[param]
                for key, value in entry.items():
                    live = live_entry.get(key)
                    if not isinstance(value, Tensor):
                        live_entry[key] = copy.deepcopy(value)
                    elif isinstance(live, Tensor) and live.shape == value.shape and live.dtype == value.dtype:
                        live.copy_(value)
                    elif key == "step":  # torch keeps a step count on the parameter's device only when fused/capturable
                        live_entry[key] = (value.to(device=param.device, dtype=torch.float32, copy=True) if fused_like
                                           else value.detach().clone())
                    else:
                        dtype = param.dtype if param.is_floating_point() and value.is_floating_point() else value.dtype
                        live_entry[key] = value.to(dtype=dtype, device=param.device, copy=True)
                for key in [k for k in live_entry if k not in entry]:
                    del live_entry[key]


@contextlib.contextmanager
def state_kept(get: Callable[[], Any], put: Callable[[Any], None]) -> Iterator[None]:
    """Let the block change the state: on exit ``put`` gets back what ``get`` returned on entry.

    The state is staged into host buffers of its own (device memory stays flat). The RNG streams are put
    back too, so code after the block draws the same numbers as if it had not run.
    """
    from ..seeding import kept_rng

    with kept_rng():
        saved, ready = StateStager().stage(get())
        for event in ready:
            event.synchronize()
        try:
            yield
        finally:
            put(saved)
