"""Tasks: what to train. The built-in ``gpt`` and ``mlp`` tasks and the contract a user's task fulfils.

A user's task is a factory ``module:function`` that takes no arguments (or the ``task_args`` of the
config as keyword arguments) and returns a :class:`Task`::

    # mypkg/mytask.py
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset
    import stabletrain

    def make_task() -> stabletrain.Task:
        x = torch.randn(512, 8); y = (x.sum(1) > 0).long()
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        def loss(model, batch):
            inputs, labels = batch
            return nn.functional.cross_entropy(model(inputs).float(), labels)  # a scalar mean
        return stabletrain.Task(model=model, train_data=TensorDataset(x, y), loss=loss)

``loss(model, batch)`` returns a scalar mean, or a ``(sum, count)`` pair (count = the tokens or
samples it covers) so that accumulation normalizes exactly by the whole window's count. Batches are
made with torch's ``default_collate`` unless the task gives ``collate``.

``task_args`` are checked against the factory's signature before it is called, like config keys: an
unknown name is an error, and a value is converted to the parameter's annotated type (``int``,
``float``, ``str``, ``bool``, a ``Literal`` of choices, a ``list``, ``tuple`` or ``dict`` of those, or ``X |
None``; without an annotation, the type of its default) or rejected naming the key (``config key 'task_args.depth':
expected an integer, got 'abc'``). Other annotations are passed through unchecked. ``stabletrain tasks`` lists each
argument with its type, default and the one-line meaning from the factory docstring's ``Args:``.
A built-in task's ``task_args`` are checked with the rest of the config, before torch is imported
(:mod:`.arguments` describes the built-in factories' arguments); importing this package does not import torch.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import brief, user_frames, user_location
from .arguments import (
    BUILTIN_TASKS,
    CHECKED_DEFAULTS,
    SIMPLE_TYPES,
    TaskArg,
    TaskError,
    builtin_task_arguments,
    check_task_args,
    checkable,
)

if TYPE_CHECKING:  # torch: imported by the factories and resolve_task, not here (the config checks task_args without it)
    from torch import nn
    from torch.utils.data import Dataset

__all__ = ["Task", "TaskError", "TaskArg", "resolve_task", "check_task", "task_arguments", "task_defaults", "task_factory",
           "BUILTIN_TASKS"]


@dataclass
class Task:
    """What to train: the model, the data and the loss.

    Attributes:
        model: the module to train (moved to the run's device by the loop).
        train_data: a map-style Dataset (``__len__`` and ``__getitem__``).
        loss: ``loss(model, batch)`` -> scalar mean, or ``(sum, count)``.
        val_data: optional map-style Dataset for validation loss.
        collate: optional ``collate(list_of_samples) -> batch``; default ``default_collate``.
        name: shown in the run dir name and the report.
        data_fingerprint: optional string identifying the data (recorded in ``snapshot.json``).
        count_unit: what ``count`` counts in a ``(sum, count)`` loss ("tokens" or "samples").
        optimizer: optional ``optimizer(named_params) -> torch.optim.Optimizer`` replacing the config's
            ``optim.name`` and the other ``optim.*`` keys (its own lr is the peak the LR schedule scales; fused
            optimizers skip on the device).
        blocks: optional submodules of ``model`` that ``dist.strategy=fsdp`` shards one by one (each its own
            ``fully_shard`` unit); default: the children of every outermost ``nn.ModuleList`` (a transformer's blocks).
    """

    model: nn.Module
    train_data: Dataset
    loss: Callable[[nn.Module, Any], Any]
    val_data: Dataset | None = None
    collate: Callable[[list[Any]], Any] | None = None
    name: str = "task"
    data_fingerprint: str | None = None
    count_unit: str = "samples"
    info: dict[str, Any] = field(default_factory=dict)
    optimizer: Callable[[list[tuple[str, nn.Parameter]]], Any] | None = None
    blocks: list[nn.Module] | None = None


def _builtin(name: str) -> Callable[..., Task]:
    if name == "gpt":
        from .gpt import make_task
    elif name == "mlp":
        from .mlp import make_task
    else:  # pragma: no cover - guarded by BUILTIN_TASKS
        raise KeyError(name)
    return make_task


def import_object(spec: str, key: str, expected: str = "'module:function'", kind: str = "callable") -> Any:
    """Return the object named by ``'module:name'`` (the current directory importable, as with ``python -m``).

    ``key``: the config key it came from, named in every error (a :class:`TaskError`). A module that is
    found but imports a package that is not installed is told apart from one that is not found: the
    error names the missing package and the line that imports it. Anything else the module raises
    while it is imported (a SyntaxError, its own top-level code) propagates: the CLI shows it as the
    user's error (:func:`stabletrain.errors.task_part`: "task module").
    """
    if ":" not in spec:
        raise TaskError(f"config key '{key}': expected {expected}, got {spec!r}")
    module_name, name = spec.split(":", 1)
    if "/" in module_name or "\\" in module_name or module_name.startswith(".") or (
            module_name.endswith(".py") and Path(module_name).is_file()):  # (not a package's submodule named py)
        parts = re.split(r"[\\/]", module_name.removesuffix(".py"))
        dotted = ".".join(part for part in parts if part not in ("", ".", ".."))
        raise TaskError(f"config key '{key}': {module_name!r} (from {spec!r}) is a file's path, not a module's name: name "
                        "it as Python imports it" + (f", {key}={dotted}:{name}" if dotted else "") + " (from the folder "
                        "that holds it, or with that folder on PYTHONPATH)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the user's project directory is importable
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or ""
        if missing and missing != module_name and not module_name.startswith(missing + "."):
            where = user_location(err)  # the module was found: an import inside it failed
            raise TaskError(f"config key '{key}': module {module_name!r} (from {spec!r}) was found, but "
                            f"{f'its import at {where}' if where else 'an import inside it'} failed: "
                            f"No module named {missing!r}; install that package in this environment "
                            f"({sys.executable}) or fix the import") from None
        raise TaskError(f"config key '{key}': cannot import module {module_name!r} from {spec!r} ({err}); "
                        "is it on PYTHONPATH?") from None
    obj = getattr(module, name, None)
    if obj is None:
        raise TaskError(f"config key '{key}': module {module_name!r} has no {kind} {name!r} (from {spec!r})")
    return obj


def _import_factory(spec: str) -> Callable[..., Task]:
    factory = import_object(spec, "task", f"a built-in task ({', '.join(BUILTIN_TASKS)}) or 'module:function'")
    if not callable(factory):
        raise TaskError(f"config key 'task': {spec!r} is not callable")
    return factory


#: Task factories that moved: the name an older bundle's config gives -> where it lives now.
MOVED = {"stabletrain.integrations.replay:captured_task": "stabletrain.records.captured:captured_task"}


def task_factory(spec: str) -> Callable[..., Task]:
    """Return the factory named by ``spec``: a built-in task's name or ``module:function``."""
    return _builtin(spec) if spec in BUILTIN_TASKS else _import_factory(MOVED.get(spec, spec))


def _arg_help(doc: str | None) -> dict[str, str]:
    """Return {name: one-line meaning} from a docstring's Google-style ``Args:`` section."""
    out: dict[str, str] = {}
    lines = inspect.cleandoc(doc or "").splitlines()
    if "Args:" not in [line.strip() for line in lines]:
        return out
    start = [line.strip() for line in lines].index("Args:") + 1
    current = None
    for line in lines[start:]:
        if not line.strip() or not line.startswith(" "):
            break
        name, sep, text = line.strip().partition(":")
        if sep and line.startswith("    ") and not line.startswith("     ") and name.isidentifier():
            current, out[name] = name, text.strip()
        elif current is not None:
            out[current] += " " + line.strip()
    return out


def task_arguments(spec_or_factory: str | Callable[..., Task]) -> list[TaskArg]:
    """Return the arguments of a task factory (a spec as in ``resolve_task``, or the factory), in order.

    An argument is checked against its annotation when that is ``int``, ``float``, ``str``, ``bool``, a ``Literal``, a
    ``list``, ``tuple`` or ``dict`` (of those, or of anything) or ``X | None`` of those; without an annotation, against the
    type of its default.
    """
    factory = task_factory(spec_or_factory) if isinstance(spec_or_factory, str) else spec_or_factory
    try:
        hints = typing.get_type_hints(factory)
    except Exception:  # an annotation that cannot be resolved: check by defaults only
        hints = {}
    docs = _arg_help(factory.__doc__)
    args = []
    for p in inspect.signature(factory).parameters.values():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        tp = hints.get(p.name)
        if tp is None and p.default is not p.empty and p.default is not None and type(p.default) in CHECKED_DEFAULTS:
            tp = type(p.default)
        if p.default is None and tp is not None and checkable(tp) and not _takes_none(tp):
            tp = typing.Optional[tp]  # (`hidden: list = None`: Python 3.11 no longer adds the Optional itself)
        args.append(TaskArg(p.name, tp if tp is not None and checkable(tp) else None, p.default, docs.get(p.name, "")))
    return args


def _takes_none(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)


def task_defaults(spec: str, *, imports: bool = True) -> dict[str, Any] | None:
    """The defaults of task ``spec``'s factory, ``{name: default}`` for each argument that has a plain one (None, a bool,
    number or string): what a ``task_args`` key left out is. A built-in task's without torch; None where the factory's
    signature cannot be read (it cannot be imported, or has none), and, with ``imports=False``, where reading it would
    import a module not imported yet (a report or a compare runs no user code)."""
    if not imports and spec not in BUILTIN_TASKS and spec.split(":")[0] not in sys.modules:
        return None
    try:
        args = builtin_task_arguments(spec) if spec in BUILTIN_TASKS else task_arguments(spec)
    except KeyboardInterrupt:
        raise
    except BaseException:  # (importing a user's module may raise anything, a SystemExit of its argparse too)
        return None
    return {a.name: a.default for a in args if a.default is None or type(a.default) in SIMPLE_TYPES}


def resolve_task(spec: str, task_args: dict[str, Any] | None = None) -> Task:
    """Build the task named by ``spec`` (a built-in name or ``module:function``) with ``task_args``.

    The arguments are checked and converted first (see the module docstring); a bad one is a TaskError.
    """
    factory = task_factory(spec)
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in inspect.signature(factory).parameters.values())
    task_args = check_task_args(spec, task_args or {}, task_arguments(factory), takes_kwargs=takes_kwargs)
    try:
        task = factory(**task_args)
    except TaskError:
        raise  # stabletrain's own words on what it could not build (an adapter's replay task), as they are
    except (TypeError, ValueError) as err:
        if user_frames(err):  # raised inside the user's factory: keep its traceback (the CLI names the factory)
            raise
        raise TaskError(f"task {spec!r} with task_args {brief(task_args)}: {err}") from None
    if not isinstance(task, Task):
        raise TaskError(f"task factory {spec!r} returned {type(task).__name__}, expected a stabletrain.Task")
    check_task(task, f"task {spec!r}")
    if task.name == "task":
        task.name = spec if spec in BUILTIN_TASKS else spec.split(":")[-1]
    return task


def check_task(task: Task, what: str = "Trainer(task=...)") -> Task:
    """``task`` as the loop can train it, else a TaskError naming ``what`` and the part that is not (``task`` itself)."""
    from torch import nn

    if not isinstance(task, Task):
        raise TaskError(f"{what}: expected a stabletrain.Task, got {type(task).__name__}")
    if not isinstance(task.model, nn.Module):
        raise TaskError(f"{what}: Task.model is {type(task.model).__name__}, expected a torch.nn.Module")
    if not hasattr(task.train_data, "__len__") or not hasattr(task.train_data, "__getitem__"):
        raise TaskError(f"{what}: Task.train_data must be a map-style Dataset (__len__ and __getitem__), got "
                        f"{type(task.train_data).__name__}")
    if len(task.train_data) == 0:
        raise TaskError(f"{what}: Task.train_data is empty")
    if not callable(task.loss):
        raise TaskError(f"{what}: Task.loss must be callable as loss(model, batch), got {type(task.loss).__name__}")
    if task.count_unit not in ("tokens", "samples"):  # (a trial's "tokenz" read 'items/s' in the report, unsaid)
        raise TaskError(f"{what}: Task.count_unit must be 'tokens' or 'samples', got {task.count_unit!r}")
    if not isinstance(task.name, str):
        raise TaskError(f"{what}: Task.name must be a string, got {type(task.name).__name__} {task.name!r}")
    for key in ("collate", "optimizer"):
        if getattr(task, key) is not None and not callable(getattr(task, key)):
            raise TaskError(f"{what}: Task.{key} must be callable or None, got {type(getattr(task, key)).__name__}")
    return task
