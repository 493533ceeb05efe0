"""A task factory's arguments (``task_args``): their types, how a value is checked against one, and the built-in tasks'.

Torch-free, so that a run of a built-in task has its ``task_args`` checked with the rest of its config, before
torch is imported (:func:`check_builtin_task_args`, called by :func:`stabletrain.config.load_config`): the
built-in factories import torch, so :data:`BUILTIN_TASK_ARGS` describes their signatures (a test holds the two
equal). A user's factory (``module:function``) is checked by :func:`stabletrain.tasks.resolve_task`, from its
signature, once its module is imported.
"""

from __future__ import annotations

import inspect
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..errors import brief

__all__ = ["TaskError", "TaskArg", "BUILTIN_TASKS", "BUILTIN_TASK_ARGS", "builtin_task_arguments", "check_task_args",
           "check_builtin_task_args", "SIMPLE_TYPES", "checkable"]


class TaskError(ValueError):
    """A task spec cannot be resolved or its factory returned something unusable."""


@dataclass(frozen=True)
class TaskArg:
    """One argument of a task factory, for help and validation.

    Attributes:
        name: the keyword (set as ``task_args.<name>``).
        annotation: the type it is checked against (None: not checked).
        default: its default (``inspect.Parameter.empty`` when it has none).
        help: its one-line meaning, from the factory docstring's ``Args:`` section ("" when absent).
    """

    name: str
    annotation: Any
    default: Any
    help: str

    @property
    def type_text(self) -> str:
        """Return the type as help shows it: ``int``, ``float``, ``relu | tanh | gelu``, ``int | None``."""
        return _type_text(self.annotation)

    @property
    def required(self) -> bool:
        return self.default is inspect.Parameter.empty


#: The built-in tasks' arguments as their factories declare them (``make_task`` in tasks/gpt.py and tasks/mlp.py,
#: which import torch): task -> {name: (type, default)}, in signature order. A test compares them.
BUILTIN_TASK_ARGS: dict[str, dict[str, tuple[Any, Any]]] = {
    "gpt": {"n_layer": (int, 4), "n_head": (int, 4), "n_embd": (int, 128), "seq_len": (int, 128),
            "dropout": (float, 0.0), "max_bytes": (int, 4_000_000)},
    "mlp": {"num_samples": (int, 4096), "in_dim": (int, 32), "width": (int, 128), "depth": (int, 3),
            "num_classes": (int, 10), "activation": (Literal["relu", "tanh", "gelu"], "relu"), "dropout": (float, 0.0),
            "data_seed": (int, 1234)},
}
#: The built-in tasks' names (``task=gpt``, ``task=mlp``).
BUILTIN_TASKS = tuple(BUILTIN_TASK_ARGS)


def builtin_task_arguments(spec: str) -> list[TaskArg]:
    """Return the built-in task ``spec``'s arguments from :data:`BUILTIN_TASK_ARGS` (no help text), without torch."""
    return [TaskArg(name, tp, default, "") for name, (tp, default) in BUILTIN_TASK_ARGS[spec].items()]


def check_task_args(spec: str, task_args: dict[str, Any], args: Sequence[TaskArg], *,
                    takes_kwargs: bool = False) -> dict[str, Any]:
    """Return ``task_args`` with each value converted to its argument's type (a new dict; the input is not changed).

    Raises TaskError naming the key for a name the task does not take (unless ``takes_kwargs``: the factory
    has ``**kwargs``) or a value its type refuses.
    """
    names = [a.name for a in args]
    for key in task_args:
        if key not in names and not takes_kwargs:
            raise TaskError(f"unknown config key 'task_args.{key}' for task {spec!r} (it takes: {', '.join(names) or 'none'})")
    checked = dict(task_args)
    for arg in args:
        if arg.name in checked and arg.annotation is not None:
            checked[arg.name] = _coerce_arg(arg.name, checked[arg.name], arg.annotation)
    return checked


def check_builtin_task_args(spec: str, task_args: dict[str, Any]) -> None:
    """Raise TaskError for a ``task_args`` key the built-in task ``spec`` does not take, or a value of the wrong type.

    Nothing to check (and nothing imported) for a user's factory ``module:function``.
    """
    if spec in BUILTIN_TASK_ARGS:
        check_task_args(spec, task_args, builtin_task_arguments(spec))


SIMPLE_TYPES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
#: The containers a value is checked as (their items too, where the annotation gives their types).
CONTAINERS = {list: "a list", tuple: "a list", dict: "a mapping"}
#: The types of a default an argument without an annotation is checked against.
CHECKED_DEFAULTS = (*SIMPLE_TYPES, *CONTAINERS)


def _type_text(tp: Any) -> str:
    if tp is None:
        return "any"
    if typing.get_origin(tp) is Literal:
        return " | ".join(map(str, typing.get_args(tp)))
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else _type_text(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) in CONTAINERS:
        items = ", ".join("..." if a is Ellipsis else _type_text(a) for a in typing.get_args(tp))
        return f"{typing.get_origin(tp).__name__}[{items}]"
    return getattr(tp, "__name__", str(tp))


def checkable(tp: Any) -> bool:
    if tp in SIMPLE_TYPES or tp in CONTAINERS or typing.get_origin(tp) is Literal:
        return True
    if typing.get_origin(tp) in CONTAINERS:  # its items: checked where their types are, else any
        return True
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return all(a is type(None) or checkable(a) for a in typing.get_args(tp))
    return False


def _coerce_arg(name: str, value: Any, tp: Any) -> Any:
    """Return ``value`` as the type ``tp`` (as config keys are converted) or raise TaskError naming the key."""
    key = f"config key 'task_args.{name}'"
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            raise TaskError(f"{key}: expected one of {', '.join(map(str, typing.get_args(tp)))}, got {brief(value)}")
        return value
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        options = typing.get_args(tp)
        if value is None and type(None) in options:
            return None
        # as config keys: none/None is null, unless a string is what it may be
        if isinstance(value, str) and value in ("none", "None") and type(None) in options and not any(
                a is str or typing.get_origin(a) is Literal and value in typing.get_args(a) for a in options):
            return None
        errors = []
        for arg in (a for a in typing.get_args(tp) if a is not type(None)):
            try:
                return _coerce_arg(name, value, arg)
            except TaskError as err:
                errors.append(str(err).split(": expected ", 1)[1].split(", got ")[0])
        raise TaskError(f"{key}: expected {' or '.join(errors)}{' or null' if type(None) in typing.get_args(tp) else ''}, "
                        f"got {brief(value)}")
    if tp in CONTAINERS or typing.get_origin(tp) in CONTAINERS:
        return _coerce_items(name, value, tp)
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer(),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        # An integer typed on the command line (task_args.steps=30) is read as one: as the string it was typed as.
        str: isinstance(value, str) or isinstance(value, int) and not isinstance(value, bool),
    }[tp]
    if not ok:
        word = value.strip().lower().lstrip("+-") if isinstance(value, str) and tp is float else ""
        how = " (YAML writes infinity .inf, not-a-number .nan)" if word in ("inf", "infinity", "nan") else ""
        raise TaskError(f"{key}: expected {SIMPLE_TYPES[tp]}, got {brief(value)}{how}")
    return tp(value) if tp in (int, float, str) else value


def _coerce_items(name: str, value: Any, tp: Any) -> Any:
    """``value`` as the container ``tp`` (``list``, ``tuple``, ``dict``, bare or with its items' types), each item checked
    where its type is one :func:`checkable` knows (named ``task_args.name[i]``), else kept as it is."""
    kind, items = typing.get_origin(tp) or tp, typing.get_args(tp)
    if not isinstance(value, dict if kind is dict else (list, tuple)):
        typed = f" ({_type_text(tp)})" if items or kind is not list else ""  # (a bare list: "a list (list)" said it twice)
        raise TaskError(f"config key 'task_args.{name}': expected {CONTAINERS[kind]}{typed}, got {brief(value)}")

    def item(key: Any, v: Any, item_tp: Any) -> Any:
        return _coerce_arg(f"{name}[{key}]", v, item_tp) if checkable(item_tp) else v

    if kind is dict:
        return {k: item(k, v, items[1]) if len(items) == 2 else v for k, v in value.items()}
    if kind is tuple and items and items[-1] is not Ellipsis:  # tuple[int, str]: so many items, each of its type
        if len(value) != len(items):
            raise TaskError(f"config key 'task_args.{name}': expected {len(items)} items ({_type_text(tp)}), got "
                            f"{brief(value)}")
        return tuple(item(i, v, t) for i, (v, t) in enumerate(zip(value, items)))
    out = [item(i, v, items[0]) if items else v for i, v in enumerate(value)]
    return tuple(out) if kind is tuple else out
