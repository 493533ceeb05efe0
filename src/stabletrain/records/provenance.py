"""Where a run came from: its snapshot (code, libraries, device, seed, data), the git state, and stabletrain's own output.

The snapshot's ``git.dirty`` counts the user's changes only: folders stabletrain writes (run directories,
``runs/``, ``check --out`` and ``lab --out`` folders, marked with :data:`OUTPUT_MARKER`) are not dirt.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..config import Config, config_hash
from ..fileio import check_folder
from .jsonl import json_safe
from .launches import last_launch

__all__ = ["HF_TRAINING_ARGS", "OUTPUT_MARKER", "build_snapshot", "git_info", "installed_versions", "is_stabletrain_output",
           "mark_output_dir", "optimizer_names", "optimizer_config", "other_task", "launch_snapshot", "threads_changed"]

#: The file that marks a folder stabletrain writes outside a run directory (``check --out``, ``lab --out``),
#: so that the snapshot's ``git.dirty`` does not count it as a change to the user's code.
OUTPUT_MARKER = ".stabletrain-output"
#: What makes a folder a run directory: RunDir creates both first thing.
_RUN_FILES = ("metrics.jsonl", "events.jsonl")


def mark_output_dir(path: str | Path) -> Path:
    """Create ``path`` (parents too) and mark it as stabletrain's output (:data:`OUTPUT_MARKER`); return it."""
    path = check_folder(path)
    path.mkdir(parents=True, exist_ok=True)
    marker = path / OUTPUT_MARKER
    if not marker.exists():
        marker.write_text("written by stabletrain: a snapshot's git.dirty does not count this folder\n", encoding="utf-8")
    return path


def _is_output_root(path: Path) -> bool:
    return (path / OUTPUT_MARKER).is_file() or all((path / name).is_file() for name in _RUN_FILES)


def is_stabletrain_output(path: str | Path) -> bool:
    """Whether ``path`` is a folder of stabletrain's own output, not the user's.

    That is a run directory (its ``metrics.jsonl`` and ``events.jsonl``), a folder marked with
    :data:`OUTPUT_MARKER` (``stabletrain check`` and ``lab`` output), or a folder holding nothing but
    such folders (``runs/``). A file, a symlink, or a folder with anything else in it is not.
    """
    path = Path(path)
    if path.is_symlink() or not path.is_dir():
        return False
    if _is_output_root(path):
        return True
    entries = list(path.iterdir())
    return bool(entries) and all(is_stabletrain_output(e) for e in entries)


def _porcelain_paths(status: str) -> list[str]:
    """The paths of ``git status --porcelain -z`` (a rename's both paths), relative to the repository root."""
    paths, fields = [], status.split("\0")
    i = 0
    while i < len(fields):
        entry = fields[i]
        i += 1
        if len(entry) < 4:
            continue
        paths.append(entry[3:])
        if entry[0] in "RC":  # -z puts a rename's source in the next field
            paths.append(fields[i])
            i += 1
    return paths


def _inside_output(root: Path, rel: str) -> bool:
    """Whether the repo path ``rel`` is stabletrain's output or lies inside a folder that is."""
    path = root / rel.rstrip("/")
    if is_stabletrain_output(path):
        return True
    return any(_is_output_root(parent) for parent in path.parents if parent != root and root in parent.parents)


def git_info(path: Path) -> dict[str, Any]:
    """Return the git commit, dirty flag and a hash of the dirty diff for the repo holding ``path``.

    stabletrain's own output (run directories, ``runs/``, check and lab folders: :func:`is_stabletrain_output`)
    is not dirt: a run of unchanged code after ``stabletrain check`` wrote its folder is not dirty.
    """
    def git(*args: str, cwd: Path = path) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        root = Path(git("rev-parse", "--show-toplevel").strip())
        changed = [p for p in _porcelain_paths(git("status", "--porcelain", "-z", cwd=root)) if not _inside_output(root, p)]
        diff = git("diff", "HEAD", "--", *[f":(literal){p}" for p in changed], cwd=root) if changed else ""
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(changed),
            "diff_sha256": hashlib.sha256(diff.encode()).hexdigest()[:16] if changed else None}


def threads_changed(run_dir: Path, device: torch.device, world: int = 1) -> str | None:
    """One line where this launch's CPU threads differ from the run's launch before (``snapshot.json``): CPU kernels
    split their sums by thread, so a resume on another count is not bitwise the uninterrupted run (a trial lost it
    without a word). None: the same, not recorded, not on the CPU, or on another world size than the launch before
    (``world``: this one's; its resume already says it is not bitwise)."""
    before = last_launch(run_dir)
    last = (before.get("device") or {}).get("num_threads")
    now = torch.get_num_threads()
    if device.type != "cpu" or not isinstance(last, int) or last == now or int(before.get("world_size") or 1) != world:
        return None
    return (f"torch's CPU threads: {now} in this launch, {last} in the one before (OMP_NUM_THREADS, torch.set_num_threads): "
            "CPU kernels split their sums by thread, so the resumed steps are not bitwise the uninterrupted run's (launch "
            f"with OMP_NUM_THREADS={last} to continue it bitwise)")


def code_dir(task: str | None) -> Path:
    """Where the run's code is, for its git state: the folder of a ``module:function`` task's module (imported by now),
    else the working directory (a built-in task; an adapter's script). A task run from another folder was recorded
    with that folder's repository, or none (a trial compared two runs of one task: 'git.commit e25eea52b7 | null')."""
    name = str(task).split(":", 1)[0] if task and ":" in str(task) else ""
    where = getattr(sys.modules.get(name), "__file__", None) if name and name.split(".")[0] != "stabletrain" else None
    if not where:
        return Path.cwd()
    folder = Path(where).resolve().parent
    # An installed package's (site-packages, the interpreter's own tree) is no project's: its enclosing repository, a
    # pyenv checkout, is not the run's code
    installed = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    if "site-packages" in folder.parts or "dist-packages" in folder.parts or any(p in folder.parents for p in installed):
        return Path.cwd()
    return folder


def launch_snapshot(device: torch.device, precision: str, task: str | None = None) -> dict[str, Any]:
    """What identifies one launch of a run: when, the command, the code, the libraries, the device, the precision (a
    resume's own, in ``snapshot.json``'s ``resumes``: it may run elsewhere, on another world size, other code).
    ``task``: the config's, whose module's repository is the code's (:func:`code_dir`)."""
    dev: dict[str, Any] = {"type": device.type, "cpu": platform.processor() or platform.machine(),
                           "num_threads": torch.get_num_threads()}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        dev.update(name=props.name, total_memory_mib=props.total_memory // 2**20, capability=f"{props.major}.{props.minor}")
    return {
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": sys.argv,
        "cwd": os.getcwd(),
        "git": git_info(code_dir(task)),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "stabletrain": __version__,
                     "numpy": __import__("numpy").__version__},
        "platform": platform.platform(),
        "device": dev,
        "precision": precision,
    }


def build_snapshot(cfg: Config, device: torch.device, precision: str, data_fingerprint: str | None,
                   extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Return what identifies a run: code, libraries, device, seed, data, config hash (its first launch's)."""
    snap = {
        **launch_snapshot(device, precision, cfg.task),
        "seed": cfg.seed,
        "deterministic": cfg.deterministic,
        "data_fingerprint": data_fingerprint,
        "config_hash": config_hash(cfg),
    }
    snap.update(extra or {})
    return snap


#: The ``transformers.TrainingArguments`` a Hugging Face run's ``config.yaml`` records under ``host``.
HF_TRAINING_ARGS = ("output_dir", "max_steps", "num_train_epochs", "per_device_train_batch_size",
                    "gradient_accumulation_steps", "learning_rate", "weight_decay", "max_grad_norm", "lr_scheduler_type",
                    "warmup_steps", "optim", "fp16", "bf16", "label_smoothing_factor", "seed", "logging_steps", "save_steps",
                    "torch_compile")


def host_reproducibility(host: str, host_config: dict[str, Any]) -> dict[str, Any]:
    """snapshot.json's ``seed`` and ``deterministic`` for a host's run, not stabletrain's config defaults: the seed the
    host was given (the HF Trainer's ``args.seed``; Lightning's ``seed_everything``, from ``PL_GLOBAL_SEED``; None where
    none is known: a ``Monitor``'s own loop) and whether torch's deterministic algorithms are on as its fit starts."""
    seed = host_config.get("seed", os.environ.get("PL_GLOBAL_SEED") if host == "lightning" else None)
    return {"seed": int(seed) if str(seed).lstrip("-").isdigit() else seed,
            "deterministic": torch.are_deterministic_algorithms_enabled()}


def installed_versions(*names: str) -> dict[str, str]:
    """The installed version of each distribution in ``names`` (one not installed is left out)."""
    import importlib.metadata as md

    out = {}
    for name in names:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return out


def optimizer_names(optimizer: Any) -> dict[str, Any]:
    """snapshot.json's ``optimizer`` (its class name; None without one) and ``optimizer_bases`` (the class and its bases, by
    name: a subclass under a name of its own, ``class LRBump(AdamW)``, is known by its base's)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # an accelerate / Lightning wrapper holds the torch one
    if inner is None:
        return {"optimizer": None}
    return {"optimizer": type(inner).__name__, "optimizer_bases": [c.__name__ for c in type(inner).__mro__ if c is not object]}


def optimizer_config(optimizer: Any) -> dict[str, Any]:
    """The optimizer's class and hyperparameters, for ``config.yaml``: each as its param groups hold it (what steps), one
    value where every group has the same, else the list of the groups' (the HF Trainer's decay and no-decay groups). The
    lr is a group's ``max_lr`` (OneCycleLR's peak) or ``initial_lr`` where a scheduler set one (a warm-up's first lr is
    0); momentum and betas, which a
    scheduler may cycle, and a key no group has, are the constructor's."""
    inner = getattr(optimizer, "optimizer", optimizer)  # an accelerate / Lightning wrapper holds the torch one
    groups = getattr(inner, "param_groups", None) or []
    out = {"name": type(inner).__name__}
    for key, default in getattr(inner, "defaults", {}).items():
        values = ([json_safe(g.get("max_lr", g.get("initial_lr", g[key])) if key == "lr" else g[key]) for g in groups if key in g]
                  if key not in ("momentum", "betas") else []) or [json_safe(default)]
        out[key] = values[0] if all(v == values[0] for v in values) else values
    return out


def other_task(run_dir: str | Path, task: Any, spec: str) -> str | None:
    """Why ``task``, built from the config's task ``spec``, is not the task the run in ``run_dir`` trained (its snapshot's
    ``task_name``: a ``Task`` handed to the ``Trainer`` as an object is not in the config); None when it is, or unknown."""
    try:
        trained = json.loads((Path(run_dir) / "snapshot.json").read_text(encoding="utf-8")).get("task_name")
    except (OSError, ValueError, AttributeError):
        return None
    name = getattr(task, "name", None)
    if not trained or not name or trained == name:
        return None
    return (f"the run trained task {trained!r} (handed to the Trainer as an object), but its config names task "
            f"{spec!r}" + (f" ({name!r})" if name != spec else ""))
