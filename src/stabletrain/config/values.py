"""A config value against its declared type: coercion, and the error that names the dotted key."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal

from ..errors import brief

__all__ = ["ConfigError", "coerce", "check_types", "section_at", "type_hints"]


class ConfigError(ValueError):
    """A config key is unknown or its value is invalid; the message names the dotted key.

    ``key``: the dotted key it is about (``callbacks[1]`` for a list item), as given, else the one the message starts
    with (``config key 'optim.lr': ...``); None for an error about no one key (a file that is not YAML).
    """

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        named = _NAMED_KEY.match(message)
        self.key = key if key is not None else named[1] if named else None


_NAMED_KEY = re.compile(r"(?:unknown )?config key '([^']+)'")


def section_at(data: dict[str, Any], parts: list[str], where: str) -> dict[str, Any]:
    """The section of plain nested dicts ``data`` at the dotted path ``parts``, made where missing (in place).

    A value in the way is a ConfigError naming its dotted key and ``where`` the config came from.
    """
    node = data
    for i, part in enumerate(parts):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            key = '.'.join(parts[: i + 1])
            raise ConfigError(f"config key '{key}' holds a value ({child!r}), so {where} cannot set a key under it")
        node = child
    return node


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` converted to the annotated type ``tp`` or raise ConfigError naming ``key``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            read = (" (YAML reads yes/no/on/off/true/false as a boolean)"
                    if isinstance(value, bool) and all(isinstance(c, str) for c in choices) else "")
            raise ConfigError(f"config key '{key}': expected one of {', '.join(map(str, choices))}, got "
                              f"{brief(value)}{read}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        nullable = type(None) in args
        if value is None and nullable:
            return None
        errors: list[ConfigError] = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(key, value, arg)
            except ConfigError as err:
                errors.append(err)
        plain = [e for e in errors if f"config key '{key}': expected " in str(e) and ", got " in str(e)]
        if len(errors) == 1 and (not nullable or not plain):  # (an inner key's error, or another's: as it is)
            raise errors[0]
        if len(plain) < len(errors):
            raise next(e for e in errors if e not in plain)
        wants = [str(e).split(": expected ", 1)[1].rsplit(", got ", 1)[0] for e in errors]  # "one of auto", "true or false"
        # A string where null is allowed may be an attempt at writing null (none, None): say how YAML writes it.
        how = " (null is written null or ~)" if nullable and isinstance(value, str) else ""
        raise ConfigError(f"config key '{key}': expected {_alternatives([*wants, 'null'] if nullable else wants)}, "
                          f"got {brief(value)}{how}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"config key '{key}': expected true or false, got {brief(value)}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"config key '{key}': expected an integer, got {brief(value)}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        word = value.strip().lower().lstrip("+-") if isinstance(value, str) else ""
        how = " (YAML writes infinity .inf, not-a-number .nan)" if word in ("inf", "infinity", "nan") else ""
        raise ConfigError(f"config key '{key}': expected a number, got {brief(value)}{how}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"config key '{key}': expected a string, got {brief(value)}")
    if tp is dict or origin is dict:
        if isinstance(value, dict):
            return dict(value)
        raise ConfigError(f"config key '{key}': expected a mapping, got {brief(value)}")
    if tp is list or origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}': expected a list (e.g. {key}=[a, b]), got {brief(value)}")
        (item,) = typing.get_args(tp) or (Any,)
        return [v if item is Any else coerce(f"{key}[{i}]", v, item) for i, v in enumerate(value)]
    raise AssertionError(f"unsupported config type {tp!r} for {key}")


def _alternatives(wants: list[str]) -> str:
    """What a union key takes: its literal values in one list ("true, false or auto", not "true or false or one of
    auto"), else its parts joined by "or" ("a number or null")."""
    items: list[str] = []
    for want in wants:
        if want.startswith("one of ") or want in ("true or false", "null"):
            items += want.removeprefix("one of ").replace(" or ", ", ").split(", ")
        else:
            return " or ".join(wants)
    return ", ".join(items[:-1]) + " or " + items[-1] if len(items) > 1 else items[0]


def type_hints(cls: type) -> dict[str, Any]:
    """Return the resolved annotations of dataclass ``cls`` (its fields' types)."""
    return typing.get_type_hints(cls)


def check_types(node: Any, cls: type, prefix: str = "") -> None:
    """Check every leaf of the dataclass ``node`` against its annotation (through :func:`coerce`), in place."""
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        key, value, tp = f"{prefix}{f.name}", getattr(node, f.name), hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, tp):
                raise ConfigError(f"config key '{key}': expected a section ({tp.__name__}), got {brief(value)}")
            check_types(value, tp, key + ".")
        else:
            setattr(node, f.name, coerce(key, value, tp))
