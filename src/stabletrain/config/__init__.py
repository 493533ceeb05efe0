"""The run configuration: a tree of dataclasses, loaded from YAML, overridden by dotted ``key=value``.

Unknown keys and bad values raise :class:`ConfigError`, naming the dotted key and the value seen,
whether the config comes from YAML, overrides or Python (:meth:`Config.validate`).

This package is the one source for the config's keys, types, defaults, help and validation
(:mod:`.schema`, :mod:`.values`), for loading it (:mod:`.loading`; a key that moved: :mod:`.moved`), and for
flattening and diffing
configs and the keys that may change when a run is resumed (:mod:`.diff`). ``stabletrain.config`` is
its face: import these names from here.
"""

from .adapter import AdapterOptions, host_precision
from .diff import (
                   ABSENT,
                   RESHARD_SAFE_KEYS,
                   RESUME_SAFE_KEYS,
                   ConfigDiff,
                   diff_configs,
                   dotted_key,
                   flatten_config,
                   format_config_diff,
                   resume_refusal_message,
                   resume_safe_text,
)
from .loading import apply_override, config_from_dict, config_hash, config_to_dict, load_config, load_yaml
from .moved import MOVED_KEYS, move_old_keys
from .schema import (
                   RANGES,
                   TRACKERS,
                   AccumConfig,
                   CaptureConfig,
                   CkptConfig,
                   ClipConfig,
                   Config,
                   DataConfig,
                   DistConfig,
                   EvalConfig,
                   GuardConfig,
                   LogConfig,
                   MlflowConfig,
                   OptimConfig,
                   RemedyConfig,
                   RunConfig,
                   SchedConfig,
                   TrainConfig,
                   WandbConfig,
                   check_range,
                   describe_keys,
)
from .values import ConfigError

__all__ = [
    "Config",
    "ConfigError",
    "TrainConfig",
    "AccumConfig",
    "ClipConfig",
    "OptimConfig",
    "SchedConfig",
    "DataConfig",
    "MlflowConfig",
    "WandbConfig",
    "LogConfig",
    "EvalConfig",
    "CkptConfig",
    "GuardConfig",
    "CaptureConfig",
    "RemedyConfig",
    "DistConfig",
    "RunConfig",
    "TRACKERS",
    "RANGES",
    "check_range",
    "load_config",
    "load_yaml",
    "apply_override",
    "config_from_dict",
    "config_to_dict",
    "config_hash",
    "describe_keys",
    "flatten_config",
    "dotted_key",
    "diff_configs",
    "format_config_diff",
    "ConfigDiff",
    "ABSENT",
    "RESUME_SAFE_KEYS",
    "RESHARD_SAFE_KEYS",
    "resume_safe_text",
    "resume_refusal_message",
    "MOVED_KEYS",
    "move_old_keys",
    "AdapterOptions",
    "host_precision",
]
