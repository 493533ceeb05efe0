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
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torch.utils.data import Dataset

__all__ = ["Task", "TaskError", "resolve_task", "BUILTIN_TASKS"]


class TaskError(ValueError):
    """A task spec cannot be resolved or its factory returned something unusable."""


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


def _builtin(name: str) -> Callable[..., Task]:
    if name == "gpt":
        from .gpt import make_task
    elif name == "mlp":
        from .mlp import make_task
    else:  # pragma: no cover - guarded by BUILTIN_TASKS
        raise KeyError(name)
    return make_task


BUILTIN_TASKS = ("gpt", "mlp")


def _import_factory(spec: str) -> Callable[..., Task]:
    if ":" not in spec:
        raise TaskError(f"config key 'task': expected a built-in task ({', '.join(BUILTIN_TASKS)}) or 'module:function', got {spec!r}")
    module_name, func_name = spec.split(":", 1)
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: the user's project directory is importable
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        raise TaskError(f"config key 'task': cannot import module {module_name!r} from {spec!r} ({err}); is it on PYTHONPATH?") from None
    factory = getattr(module, func_name, None)
    if factory is None or not callable(factory):
        raise TaskError(f"config key 'task': module {module_name!r} has no callable {func_name!r} (from {spec!r})")
    return factory


def resolve_task(spec: str, task_args: dict[str, Any] | None = None) -> Task:
    """Build the task named by ``spec`` (a built-in name or ``module:function``) with ``task_args``."""
    task_args = dict(task_args or {})
    factory = _builtin(spec) if spec in BUILTIN_TASKS else _import_factory(spec)
    params = inspect.signature(factory).parameters
    takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for key in task_args:
        if key not in params and not takes_kwargs:
            known = ", ".join(params) or "none"
            raise TaskError(f"unknown config key 'task_args.{key}' for task {spec!r} (it takes: {known})")
    try:
        task = factory(**task_args)
    except (TypeError, ValueError) as err:
        raise TaskError(f"task {spec!r} with task_args {task_args}: {err}") from None
    if not isinstance(task, Task):
        raise TaskError(f"task factory {spec!r} returned {type(task).__name__}, expected a stabletrain.Task")
    if not isinstance(task.model, nn.Module):
        raise TaskError(f"task {spec!r}: Task.model is {type(task.model).__name__}, expected a torch.nn.Module")
    if not hasattr(task.train_data, "__len__") or not hasattr(task.train_data, "__getitem__"):
        raise TaskError(f"task {spec!r}: Task.train_data must be a map-style Dataset (__len__ and __getitem__)")
    if len(task.train_data) == 0:
        raise TaskError(f"task {spec!r}: Task.train_data is empty")
    if not callable(task.loss):
        raise TaskError(f"task {spec!r}: Task.loss must be callable as loss(model, batch)")
    if task.name == "task":
        task.name = spec if spec in BUILTIN_TASKS else spec.split(":")[-1]
    return task
