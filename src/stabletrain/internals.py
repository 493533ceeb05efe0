"""Every reach into a private internal of torch, of the host trainers and of Python: in one module, each checked.

stabletrain needs a few things no public API gives without a host-device sync or without changing what
the host computes. Each reach is one function here; each checks that the internal exists (and has the
shape relied on) and otherwise raises :class:`InternalMissing`, one line naming the library, its
version and what to do. ``tests/test_internals.py`` exercises every one of them against the installed
versions, so an upgrade that removes one fails there, not in a user's run; ``tests/test_private_reaches.py``
fails on a reach anywhere else in the package.

=====================================  ==================================================================
reach                                  why there is no public way
=====================================  ==================================================================
``GradScaler._scale``                  the scale as a device tensor (``get_scale()`` reads it on the host)
``GradScaler._growth_tracker``         kept and put back with the scale, so a replay restores the scaler
                                       exactly (``state_dict()`` reads both on the host)
``GradScaler._per_optimizer_states``   the inf check ``unscale_`` recorded: our verdict joins it, so the
                                       scaler skips a step the sentinel rejects (no ``.item()``)
``Optimizer._step_supports_amp_scaling``  whether ``step()`` reads ``found_inf`` (fused AdamW/Adam/SGD)
``optimizer.found_inf``/``grad_scale``    the device flag a fused optimizer skips on (GradScaler's protocol)
``OptimizedModule._orig_mod``          the module inside ``torch.compile``'s wrapper (its eager forward and its
                                       own parameter names, without ``_orig_mod.``)
a compiled method's ``__code__``       Lightning's ``torch.compile(module)`` wraps the module's own methods in
(a file of ``torch._dynamo``)          place: a wrapper is told by its code's file (torch names none of them)
``sys._getframe``                      the Hugging Face ``Trainer`` that runs a callback: its callbacks are
                                       not handed the trainer (``StableTrainCallback(trainer=...)`` avoids it)
``torch.serialization._save``,         ``torch.save`` without the zip's per-record CRC32 for this one file
``torch._C.PyTorchFileWriter``         (``set_crc32_options`` is process-wide): the checkpoint writer takes
                                       its own CRC32 of every byte as it passes (5 ms of CPU per 9.7 MiB save)
``torch.utils._python_dispatch``       ``TorchDispatchMode``, the base of a mode that sees every aten op (the
                                       non-finite locator, the amp check); torch exports it nowhere else
``OpOverload._schema``                 whether an aten op writes into an input (its arguments' alias info)
``torch._C._current_graph_task_id``,   whether an op runs inside a backward, and the autograd node running it
``torch._C._current_autograd_node``    (its forward's traceback, under anomaly mode)
``Tensor._version``                    a tensor's in-place write counter: a value read before is still valid
``Variable._execution_engine``         ``queue_callback``: run after the backward's whole graph, in order with
                                       DDP's own final callback (which waits on the gradient all-reduce)
``FSDPModule._get_fsdp_state()``,      the unsharded gradient FSDP2 accumulates between syncs, outside
``FSDPParam._unsharded_param``,        ``param.grad``: the accumulation window rescales it in place
``.unsharded_accumulated_grad``
``torch.utils._pytree``                flatten and rebuild nested state with torch's own node registry (the
                                       containers DCP's state dicts and a user's registered types are made of)
``LocalElasticAgent``'s                torchrun's agent: hand a restart the failure before it, and end the
``_monitor_workers`` and               restarts on a refusal (torchrun has no hook for either); the name
``_remaining_restarts``;               ``torch.distributed.launcher.api`` builds its agent from
``launcher.api.LocalElasticAgent``
``_async_process_executor``'s          DCP's checkpoint process, ended as its own ``__del__`` ends it before the
``_CHECKPOINT_PROCESS``                rank exits (else it dies on a closed pipe with an EOFError traceback)
``ArgumentParser._actions``            the actions of a parser, to complete one's help when it is shown
=====================================  ==================================================================
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["InternalMissing", "scaler_scale", "scaler_state", "set_scaler_state", "scaler_found_inf", "join_found_inf",
           "join_scaler_found_inf", "skips_on_device", "set_found_inf", "clear_found_inf", "found_inf_set",
           "fused_skip", "find_caller", "eager_module", "unwrap", "is_compiled", "compiled_methods",
           "eager_methods", "save_without_record_crcs", "dispatch_mode_base",
           "op_writes_input", "in_backward", "current_autograd_node", "tensor_version", "queue_backward_callback",
           "fsdp_param_records", "fsdp_pending_grads", "tree_map", "tree_flatten", "tree_unflatten",
           "tree_flatten_with_keys", "restarting_agent", "restarts_left", "end_restarts", "use_elastic_agent",
           "parser_actions", "end_dcp_process"]

T = TypeVar("T")


class InternalMissing(RuntimeError):
    """A private internal stabletrain relies on is not there (a library version it does not support)."""

    def __init__(self, library: str, what: str, hint: str = "") -> None:
        try:
            import importlib.metadata as md
            version = md.version(library)
        except Exception:
            version = "unknown"
        super().__init__(f"stabletrain needs {what}, which {library} {version} does not have"
                         + (f"; {hint}" if hint else "; install a version stabletrain supports (see pyproject.toml)"))


def _require(obj: Any, attr: str, library: str, what: str) -> Any:
    if not hasattr(obj, attr):
        raise InternalMissing(library, f"{what} ({type(obj).__name__}.{attr})")
    return getattr(obj, attr)


# -- torch.amp.GradScaler ------------------------------------------------------------------------------

def scaler_scale(scaler: torch.amp.GradScaler) -> Tensor | None:
    """The scaler's current scale as its device tensor (no sync); None before its first ``scale()``."""
    return _require(scaler, "_scale", "torch", "GradScaler's device-side scale")


def scaler_state(scaler: torch.amp.GradScaler) -> tuple[Tensor, Tensor] | None:
    """Clones of (scale, growth tracker) on the device (no sync); None before the scaler's first ``scale()``."""
    scale = scaler_scale(scaler)
    tracker = _require(scaler, "_growth_tracker", "torch", "GradScaler's device-side growth tracker")
    if scale is None or tracker is None:
        return None
    return scale.detach().clone(), tracker.detach().clone()


def set_scaler_state(scaler: torch.amp.GradScaler, state: tuple[Tensor, Tensor] | None,
                     where: Tensor | None = None) -> None:
    """Put back a :func:`scaler_state` in place (no sync); ``where`` (device bool): only where it is True."""
    if state is None:
        return
    scale, tracker = scaler_scale(scaler), _require(scaler, "_growth_tracker", "torch", "GradScaler's growth tracker")
    if scale is None or tracker is None:
        return
    if where is None:
        scale.copy_(state[0])
        tracker.copy_(state[1])
    else:
        scale.copy_(torch.where(where, state[0], scale))
        tracker.copy_(torch.where(where, state[1], tracker))


def scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> list[Tensor]:
    """The per-device inf flags ``scaler.unscale_(optimizer)`` recorded (empty when it has not unscaled yet)."""
    states = _require(scaler, "_per_optimizer_states", "torch", "GradScaler's per-optimizer inf check")
    state = states[id(optimizer)]
    if not isinstance(state, dict) or "found_inf_per_device" not in state:
        raise InternalMissing("torch", "GradScaler's per-optimizer 'found_inf_per_device'")
    return list(state["found_inf_per_device"].values())


def join_scaler_found_inf(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, skip: Tensor) -> Tensor | None:
    """Make the scaler skip ``optimizer``'s next step where ``skip`` (device bool) is True; no sync.

    Returns the scaler's own verdict before the join (whether it found an inf), or None when the scaler
    has not unscaled ``optimizer`` yet (nothing to join: its ``step`` will check and unscale itself).
    """
    found = scaler_found_inf(scaler, optimizer)
    if not found:
        return None
    own = torch.stack([t.to(skip.device) for t in found]).sum() > 0
    first = found[0]
    first.copy_(torch.maximum(first, skip.to(first.dtype).to(first.device)))
    return own


# -- fused optimizers: found_inf ------------------------------------------------------------------------

def skips_on_device(optimizer: Any) -> bool:
    """Whether ``optimizer.step()`` reads a ``found_inf`` flag (fused AdamW/Adam/SGD), so it can skip without a sync."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def set_found_inf(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """Have a fused optimizer's next ``step()`` skip where ``skip`` (device bool) is True (grads already unscaled)."""
    optimizer.grad_scale = None
    optimizer.found_inf = skip.float()


def found_inf_set(optimizer: torch.optim.Optimizer) -> Tensor | None:
    """The ``found_inf`` flag set on a fused optimizer for its next step (by a GradScaler or :func:`set_found_inf`)."""
    return getattr(optimizer, "found_inf", None)


def join_found_inf(optimizer: torch.optim.Optimizer, skip: Tensor) -> None:
    """Also skip where ``skip`` (device bool) is True, keeping the ``found_inf`` a GradScaler already set (its scale stays)."""
    existing = found_inf_set(optimizer)
    optimizer.found_inf = torch.maximum(existing, skip.float().to(existing.device))


def clear_found_inf(optimizer: torch.optim.Optimizer) -> None:
    for name in ("grad_scale", "found_inf"):
        if name in vars(optimizer):
            delattr(optimizer, name)


@contextlib.contextmanager
def fused_skip(optimizer: torch.optim.Optimizer, skip: Tensor) -> Iterator[None]:
    """Within the block, ``optimizer.step()`` (a fused one) skips where ``skip`` is True."""
    set_found_inf(optimizer, skip)
    try:
        yield
    finally:
        clear_found_inf(optimizer)


# -- Python: the caller that runs us --------------------------------------------------------------------

def find_caller(predicate: Callable[[Any], bool], max_depth: int = 40) -> Any:
    """The ``self`` of the nearest calling frame for which ``predicate(self)`` holds, else None (the HF Trainer)."""
    getframe = getattr(sys, "_getframe", None)
    if getframe is None:
        raise InternalMissing("python", "sys._getframe", "pass the trainer explicitly")
    frame = getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if candidate is not None and predicate(candidate):
            return candidate
        frame = frame.f_back
    return None


# -- torch.compile ---------------------------------------------------------------------------------------

def eager_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module inside ``torch.compile``'s wrapper (an ``OptimizedModule``; ``model`` itself when it is none).

    The wrapper's parameters and state-dict keys carry an ``_orig_mod.`` prefix and its forward is compiled;
    the module inside holds the same tensors under their own names and runs eagerly.
    """
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")  # not imported: nothing was compiled (and no import cost)
    while eval_frame is not None and isinstance(model, eval_frame.OptimizedModule):
        try:
            model = model._orig_mod
        except (AttributeError, KeyError):  # the wrapper's own __getattr__ raises KeyError for it
            raise InternalMissing("torch", "the module inside a torch.compile wrapper (OptimizedModule._orig_mod)") from None
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside ``DistributedDataParallel`` and ``torch.compile`` wrappers, in either order (``model`` when none):
    what an adapter names, checks, snapshots and replays (no ``_orig_mod.``; the diagnosis runs it eagerly)."""
    model = eager_module(model)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = eager_module(model.module)
    return model


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a ``torch.compile`` wrapper (``OptimizedModule``), outside or inside a DDP wrapper, or
    a module whose own methods were compiled in place (:func:`compiled_methods`: Lightning's way)."""
    if eager_module(model) is not model:
        return True
    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and eager_module(model.module) is not model.module:
        return True
    return bool(compiled_methods(unwrap(model)))


def compiled_methods(model: torch.nn.Module) -> list[str]:
    """The names of ``model``'s own methods that ``torch.compile`` wrapped in place, on the instance.

    Lightning's ``trainer.fit(torch.compile(module))`` sets compiled wrappers of the module's ``forward``,
    ``training_step``, ... as instance attributes: functions of torch's dynamo wrapping (``__wrapped__``) this very
    module's method. A deep copy keeps them, running the live module's parameters (:func:`eager_methods` hides them).
    """
    cls, names = type(model), []
    for name, fn in vars(model).items():
        inner = getattr(fn, "__wrapped__", None)
        if (getattr(inner, "__self__", None) is model and getattr(inner, "__func__", None) is getattr(cls, name, None)
                and "_dynamo" in getattr(getattr(fn, "__code__", None), "co_filename", "")):
            names.append(name)
    return names


@contextlib.contextmanager
def eager_methods(model: torch.nn.Module) -> Iterator[None]:
    """``model`` with its in-place compiled methods (:func:`compiled_methods`) hidden meanwhile: its class's own
    run, eagerly, on the parameters of whatever module calls them (a deep copy made meanwhile: its own)."""
    saved = {name: vars(model).pop(name) for name in compiled_methods(model)}
    try:
        yield
    finally:
        vars(model).update(saved)

# -- torch.save ------------------------------------------------------------------------------------------

def save_without_record_crcs(obj: Any, fh: Any) -> None:
    """``torch.save(obj, fh)`` into the binary file object ``fh``, without the zip's CRC32 of each record.

    ``torch.load`` reads the file as any other (it does not check those CRCs; ``unzip -t`` would report them);
    the caller checksums the bytes itself. Only this call is affected: ``torch.serialization.set_crc32_options``
    would switch the CRCs off for every thread's saves.
    """
    import pickle

    import torch.serialization as serialization

    writer_cls = _require(torch._C, "PyTorchFileWriter", "torch", "torch.save's zip writer")
    save = _require(serialization, "_save", "torch", "torch.save's pickling into an open zip writer")
    alignment = _require(serialization, "_get_storage_alignment", "torch", "torch.save's storage alignment")()
    try:
        writer = writer_cls(fh, False, alignment)  # (file, compute_crc32, storage alignment)
    except TypeError:
        raise InternalMissing("torch", "a zip writer that can leave out the per-record CRC32 "
                                       "(PyTorchFileWriter(file, compute_crc32, alignment))") from None
    save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)  # (..., _disable_byteorder_record) as torch.save
    writer.write_end_of_file()
    fh.flush()


# -- torch dispatch and autograd: the replay tools --------------------------------------------------------

def dispatch_mode_base() -> type:
    """``TorchDispatchMode``: subclass it for a mode whose ``__torch_dispatch__`` sees every aten op."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        raise InternalMissing("torch", "TorchDispatchMode (torch.utils._python_dispatch)") from None
    return TorchDispatchMode


def op_writes_input(func: Any) -> bool:
    """Whether the aten op ``func`` (an ``OpOverload``) writes into one of its arguments (in place, ``out=``)."""
    schema = _require(func, "_schema", "torch", "an aten op's schema")
    return any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)


@functools.cache
def _engine() -> tuple[Callable[[], int], Callable[[], Any]]:
    return (_require(torch._C, "_current_graph_task_id", "torch", "the autograd engine's current graph task"),
            _require(torch._C, "_current_autograd_node", "torch", "the autograd node being run"))


def in_backward() -> bool:
    """Whether this thread is inside the autograd engine's backward (an op dispatched now is part of it)."""
    return _engine()[0]() != -1


def current_autograd_node() -> Any:
    """The autograd ``Node`` the engine is running on this thread (None outside a backward)."""
    return _engine()[1]() if in_backward() else None


def tensor_version(t: Tensor) -> int | None:
    """The tensor's in-place write counter (shared with its views); None where it keeps none (inference mode)."""
    try:
        return t._version
    except RuntimeError:  # an inference tensor
        return None
    except AttributeError:
        raise InternalMissing("torch", "a tensor's in-place write counter (Tensor._version)") from None


def queue_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running backward has run its whole graph, after the callbacks queued before it.

    Only from inside a backward (a hook). DDP queues its own such callback, which waits on the gradient
    all-reduce: one queued earlier runs before it, one queued from there runs after it.
    """
    engine = _require(torch.autograd.Variable, "_execution_engine", "torch", "the autograd engine")
    _require(engine, "queue_callback", "torch", "the autograd engine's final callbacks")(fn)


# -- FSDP2 ----------------------------------------------------------------------------------------------

def fsdp_param_records(model: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter records (``FSDPParam``) of every module ``fully_shard`` wrapped under ``model``.

    Checked once here, so that :func:`fsdp_pending_grads` never misses a gradient in silence: a torch whose
    records no longer have the unsharded parameter or the accumulated gradient raises now.
    """
    from torch.distributed.fsdp import FSDPModule

    out: list[Any] = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            state = _require(module, "_get_fsdp_state", "torch", "FSDP2's state of a sharded module")()
            groups = getattr(state, "_fsdp_param_groups", None)  # a list in newer torch, one group in older
            if groups is None:
                group = _require(state, "_fsdp_param_group", "torch", "FSDP2's parameter group of a module")
                groups = [] if group is None else [group]
            for group in groups:
                out.extend(_require(group, "fsdp_params", "torch", "FSDP2's parameter records"))
    for cls in {type(fp) for fp in out}:
        declared = {name for klass in cls.__mro__ for name in getattr(klass, "__annotations__", {})}
        for name in ("_unsharded_param", "unsharded_accumulated_grad"):
            if name not in declared:
                raise InternalMissing("torch", f"the gradient FSDP2 accumulates between syncs ({cls.__name__}.{name})",
                                      "stabletrain would leave it unscaled; use dist.strategy=ddp or a supported torch")
    return out


def fsdp_pending_grads(records: Sequence[Any]) -> list[Tensor]:
    """The unsharded gradients FSDP2 holds for ``records`` (:func:`fsdp_param_records`) between syncs.

    The tensors themselves: scaling one in place scales what FSDP2 will reduce-scatter. The accumulated
    gradient in the reduce dtype where a mixed-precision policy made one, else the unsharded parameter's.
    """
    out = []
    for fp in records:
        if fp.unsharded_accumulated_grad is not None:
            out.append(fp.unsharded_accumulated_grad)
            continue
        param = getattr(fp, "_unsharded_param", None)  # None until its first all-gather (declared: checked above)
        if param is not None and param.grad is not None:
            out.append(param.grad)
    return out


# -- torch.utils._pytree ----------------------------------------------------------------------------------

@functools.cache
def _pytree() -> Any:
    try:
        from torch.utils import _pytree as pytree
    except ImportError:
        raise InternalMissing("torch", "torch.utils._pytree") from None
    for name in ("tree_map", "tree_flatten", "tree_unflatten", "tree_flatten_with_path", "MappingKey",
                 "SequenceKey", "GetAttrKey"):
        _require(pytree, name, "torch", "torch's pytree")
    return pytree


def tree_map(fn: Callable[[Any], Any], tree: Any) -> Any:
    """``tree`` rebuilt with ``fn`` applied to each leaf (containers: those torch's pytree knows, as registered)."""
    return _pytree().tree_map(fn, tree)


def tree_flatten(tree: Any) -> tuple[list[Any], Any]:
    """(the leaves of ``tree`` in order, the spec :func:`tree_unflatten` rebuilds it from)."""
    return _pytree().tree_flatten(tree)


def tree_unflatten(leaves: Sequence[Any], spec: Any) -> Any:
    return _pytree().tree_unflatten(list(leaves), spec)


def tree_flatten_with_keys(tree: Any) -> tuple[list[tuple[tuple[str, ...], Any]], Any]:
    """(each leaf with its path as strings: dict keys, list indices, namedtuple field names; the spec)."""
    pytree = _pytree()
    mapping, sequence, attr = pytree.MappingKey, pytree.SequenceKey, pytree.GetAttrKey

    def part(k: Any) -> str:
        return str(k.key if isinstance(k, mapping) else k.idx if isinstance(k, sequence) else k.name if isinstance(k, attr)
                   else k)

    leaves, spec = pytree.tree_flatten_with_path(tree)
    return [(tuple(part(k) for k in path), leaf) for path, leaf in leaves], spec


# -- torchrun's elastic agent -----------------------------------------------------------------------------

def restarting_agent(on_failure: Callable[[Any, int, dict[int, Any]], None]) -> type:
    """A ``LocalElasticAgent`` subclass that calls ``on_failure(agent, max_restarts, failures)`` on a failed check.

    The agent calls it where it checks on its workers and finds one failed, before it decides to restart
    them (``failures``: global rank -> torch's ``ProcessFailure``). Install it with :func:`use_elastic_agent`.
    """
    try:
        from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
        from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
        from torch.distributed.launcher import api
    except ImportError as err:
        raise InternalMissing("torch", f"torchrun's elastic agent ({err})") from None
    if getattr(api, "LocalElasticAgent", None) is not LocalElasticAgent:
        raise InternalMissing("torch", "a launcher that builds torch.distributed.launcher.api.LocalElasticAgent")
    _require(LocalElasticAgent, "_monitor_workers", "torch", "the elastic agent's check on its workers")
    if "_remaining_restarts" not in SimpleElasticAgent.__init__.__code__.co_names:  # the attribute __init__ sets
        raise InternalMissing("torch", "the elastic agent's count of restarts left (_remaining_restarts)")

    class RestartingAgent(LocalElasticAgent):  # type: ignore[misc, valid-type]
        """LocalElasticAgent that tells stabletrain of each failure it sees (:func:`restarting_agent`)."""

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.is_failed():
                on_failure(self, worker_group.spec.max_restarts, result.failures)
            return result

    return RestartingAgent


def restarts_left(agent: Any) -> int:
    """How many more times the elastic ``agent`` will restart its workers."""
    return agent._remaining_restarts


def end_restarts(agent: Any) -> None:
    """Have the elastic ``agent`` stop at this failure, as when ``--max-restarts`` is used up."""
    agent._remaining_restarts = 0


def use_elastic_agent(cls: type) -> None:
    """Have torchrun (``torch.distributed.run.main``, in this process) build its agent from ``cls``."""
    from torch.distributed.launcher import api

    api.LocalElasticAgent = cls


# -- torch.distributed.checkpoint ----------------------------------------------------------------------

def end_dcp_process() -> None:
    """End this process's DCP checkpoint process (``async_save``'s PROCESS kind) as its ``__del__`` does: TERMINATE, join."""
    executor = sys.modules.get("torch.distributed.checkpoint._async_process_executor")  # not imported: none started
    process = None if executor is None else _require(executor, "_CHECKPOINT_PROCESS", "torch", "DCP's checkpoint process")
    if process is not None:
        executor._CHECKPOINT_PROCESS = None
        process.__del__()


# -- argparse --------------------------------------------------------------------------------------------

def parser_actions(parser: Any) -> list[Any]:
    """The ``argparse.Action`` of each argument ``parser`` has (its ``add_argument`` results, in order)."""
    return list(_require(parser, "_actions", "python", "argparse's list of a parser's actions"))
