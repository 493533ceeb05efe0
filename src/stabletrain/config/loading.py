"""Loading a config: YAML, then dotted ``key=value`` overrides, built into the dataclass tree and validated.

Unknown keys and bad values raise :class:`~stabletrain.config.values.ConfigError`, naming the dotted key
and the value seen, whether the config comes from YAML, overrides or Python.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
import types
import typing
import warnings
from pathlib import Path
from typing import Any, Literal

import yaml

from ..console import StableTrainWarning
from ..errors import brief
from ..tasks.arguments import TaskError, check_builtin_task_args
from .moved import move_old_keys
from .schema import Config, check_remedy_capture
from .values import ConfigError, coerce, section_at, type_hints

__all__ = ["load_config", "load_yaml", "key_line", "apply_override", "config_from_dict", "config_to_dict", "config_hash"]


def _build(cls: type, data: dict[str, Any], prefix: str = "") -> Any:
    """Build dataclass ``cls`` from ``data``, raising ConfigError on unknown keys and bad values."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix.rstrip('.') or '<root>'}': expected a mapping, got {brief(data)}")
    hints = type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        if name not in fields:
            raise ConfigError(f"unknown config key '{key}' (known here: {', '.join(fields)})")
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value if value is not None else {}, key + ".")
        else:
            kwargs[name] = coerce(key, value, tp)
    return cls(**kwargs)


def config_to_dict(cfg: Any) -> dict[str, Any]:
    """Return the config as plain nested dicts (every default written out)."""
    return dataclasses.asdict(cfg)


def config_hash(cfg: Config | dict[str, Any]) -> str:
    """Return a short stable hash of the resolved config (or of what an adapter's ``config.yaml`` holds: a dict)."""
    blob = json.dumps(cfg if isinstance(cfg, dict) else config_to_dict(cfg), sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class _YamlLoader(yaml.SafeLoader):
    """PyYAML's safe loader, also reading ``3e-4`` and ``1E5`` as floats.

    PyYAML follows YAML 1.1, whose floats need a dot (``3.0e-4``): ``lr: 3e-4`` would be the string
    "3e-4". YAML 1.2 (and Python, and the command line) read it as a number; so do we.
    """


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str, source: str = "<string>") -> Any:
    """Parse YAML ``text`` (``3e-4`` is a float); a syntax error is a ConfigError naming ``source``, line and column.

    A key set twice in one mapping is a ConfigError naming both lines (YAML would keep the last silently).
    """
    return _parse_yaml(text, source)[0]


def _parse_yaml(text: str, source: str) -> tuple[Any, dict[str, int]]:
    """(the data of ``text``, {dotted key: its 1-based line}); a list item's key is ``key[i]``."""
    loader = _YamlLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict[str, int] = {}
        _key_lines(node, "", source, lines, ())
        return loader.construct_document(node) if node is not None else None, lines  # merges `<<` after _key_lines
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    finally:
        loader.dispose()


def key_line(path: str | Path, key: str) -> int | None:
    """The line of the dotted ``key`` in the YAML config file at ``path`` (None: not set there, or not readable)."""
    try:
        return _parse_yaml(Path(path).read_text(encoding="utf-8"), f"config file {str(path)!r}")[1].get(key)
    except (OSError, ConfigError):
        return None


def _key_lines(node: Any, path: str, source: str, lines: dict[str, int], above: tuple[int, ...]) -> None:
    """Record in ``lines`` the line of each key under the YAML ``node`` at dotted ``path``; a key twice is a ConfigError.

    ``above``: the ids of the nodes above, so that an alias of an enclosing node (a recursive structure) ends the walk.
    """
    if id(node) in above:
        return
    above = (*above, id(node))
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` is overridden by the keys beside it, as YAML means it
            key, line = f"{path}.{key_node.value}" if path else key_node.value, key_node.start_mark.line + 1
            if key_node.value in seen:
                raise ConfigError(f"{source}: config key '{key}' is set twice, on lines {seen[key_node.value]} and {line} "
                                  "(the last would win); keep one", key=key)
            seen[key_node.value] = lines[key] = line
            _key_lines(value_node, key, source, lines, above)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[f"{path}[{i}]"] = item.start_mark.line + 1
            _key_lines(item, f"{path}[{i}]", source, lines, above)


#: How Python writes null; on the command line it means null for a key that takes null and no string (clip.max_norm).
_PYTHON_NULLS = ("none", "None")


def _parse_value(text: str, source: str, parts: list[str]) -> Any:
    # A YAML scalar or flow collection: 3e-4 -> float, true -> bool, null -> None, [1, 2] -> list.
    if text.strip() in _PYTHON_NULLS and _takes_null_not_string(parts):
        return None
    return load_yaml(text, source) if text != "" else ""


def _takes_null_not_string(parts: list[str]) -> bool:
    """Whether the config key at the dotted path ``parts`` is declared ``X | None`` with no string among its types."""
    cls: Any = Config
    for part in parts:
        if not dataclasses.is_dataclass(cls):
            return False
        cls = type_hints(cls).get(part)
    if typing.get_origin(cls) not in (typing.Union, types.UnionType):
        return False
    args = typing.get_args(cls)
    return type(None) in args and not any(a is str or typing.get_origin(a) is Literal for a in args)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Apply one dotted ``key=value`` override to the plain dict ``data`` in place."""
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected dotted key=value (e.g. optim.lr=3e-4)")
    key, text = override.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override {override!r}: empty key")
    *path, last = key.split(".")
    section_at(data, path, f"override {override!r}")[last] = _parse_value(text, f"override {override!r}", [*path, last])


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: dict[str, Any] | None = None, *, base_source: str = "the base config") -> Config:
    """Load a Config from ``base`` (plain dicts), then an optional YAML file, then dotted overrides; validate it.

    A key that moved (:data:`~stabletrain.config.moved.MOVED_KEYS`) is read at its new place, with one
    :class:`~stabletrain.console.StableTrainWarning` line per source that used one (``base_source`` names the base).
    A built-in task's ``task_args`` are checked here too, without torch (names and types; the values are kept as
    given): a Config built in Python, or read back from a run, is left to :func:`stabletrain.tasks.resolve_task`.
    """
    data: dict[str, Any] = _moved(copy.deepcopy(base or {}), base_source)
    source, lines = "", {}  # the file's, and {dotted key: line} of the keys set in it
    if path is not None:
        p = Path(path)
        source = f"config file {str(p)!r}"
        try:
            text = p.read_text()
        except OSError as err:
            raise ConfigError(f"{source}: cannot read it ({err.strerror})") from None
        loaded, lines = _parse_yaml(text, source)
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{source}: expected a mapping at the top, got {type(loaded).__name__}")
        data = _deep_merge(data, _moved(loaded, source))
    overlay: dict[str, Any] = {}
    for override in overrides:
        apply_override(overlay, override)
    clash = _clash(data, overlay)  # a section the file gave as a value, which an override's key under it would replace
    if clash is not None:  # (silently: 'train: 5' in the file and train.max_steps=2 trained; a new user's trial)
        value = _get(data, clash)
        where = f"{source}, line {lines[clash]}: " if clash in lines else f"{source}: " if source else ""
        raise ConfigError(f"{where}config key '{clash}': expected a mapping, got {brief(value)}", key=clash)
    data = _deep_merge(data, _moved(overlay, "the overrides"))
    try:
        cfg = _build(Config, data).validate()
        check_remedy_capture(cfg)
        try:
            check_builtin_task_args(cfg.task, cfg.task_args)
        except TaskError as err:  # (its key, for the file's line below: 'task_args.NAME')
            named = re.search(r"'(task_args\.[\w.]+)'", str(err))
            raise ConfigError(str(err), key=named.group(1) if named else None) from None
    except ConfigError as err:
        key = err.key or ""
        line = lines.get(key)
        if key and base and line is None and not _set_in(overlay, key) and _set_in(base, key):  # the base's (a resumed
            raise ConfigError(f"{base_source}: {err}", key=err.key) from None  # run's config.yaml): named, as a file's is
        if line is None or _set_in(overlay, key):  # about no key of the file, or its value came from the command line
            raise
        raise ConfigError(f"{source}, line {line}: {err}", key=err.key) from None
    warmup_given = _set_in(overlay, "sched.warmup_steps") or "sched.warmup_steps" in lines  # (the default's: a smoke run's)
    if warmup_given and cfg.sched.warmup_steps > cfg.train.max_steps:  # (equal: the last step runs at the peak)
        warnings.warn(f"config key 'sched.warmup_steps': {cfg.sched.warmup_steps} > train.max_steps="
                      f"{cfg.train.max_steps}: the run ends inside its warm-up, its lr never reaches the schedule's peak "
                      "(lower sched.warmup_steps, or sched.warmup_steps=0)", StableTrainWarning, stacklevel=2)
    given = [k for k in ("dist.checkpoint", "dist.reshard_after_forward") if _set_in(overlay, k) or k in lines]
    if given and cfg.dist.strategy != "fsdp":  # (a resumed run's config.yaml holds every key: only what was given now)
        warnings.warn(f"config key{'s' * (len(given) > 1)} {', '.join(given)}: fsdp only, no effect under dist.strategy="
                      f"{cfg.dist.strategy}", StableTrainWarning, stacklevel=2)
    return cfg


def _clash(data: dict[str, Any], overlay: dict[str, Any], prefix: str = "") -> str | None:
    """The dotted key of the first section ``overlay`` sets keys under that ``data`` holds as a plain value, or None."""
    for key, value in overlay.items():
        if not isinstance(value, dict) or data.get(key) is None:
            continue
        if not isinstance(data[key], dict):
            return prefix + key
        found = _clash(data[key], value, f"{prefix}{key}.")
        if found is not None:
            return found
    return None


def _get(data: dict[str, Any], key: str) -> Any:
    for part in key.split("."):
        data = data[part]
    return data


def _set_in(data: dict[str, Any], key: str) -> bool:
    """Whether the plain nested dicts ``data`` hold the dotted ``key`` (a list item, ``callbacks[1]``: the list)."""
    node: Any = data
    for part in re.sub(r"\[\d+\]", "", key).split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def _moved(data: dict[str, Any], source: str) -> dict[str, Any]:
    note = move_old_keys(data, source)
    if note is not None:
        warnings.warn(note, StableTrainWarning, stacklevel=3)
    return data


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config from plain dicts (e.g. a run dir's ``config.yaml``); an old key is read at its new place."""
    data = copy.deepcopy(data)
    move_old_keys(data, "a saved config")
    return _build(Config, data).validate()
