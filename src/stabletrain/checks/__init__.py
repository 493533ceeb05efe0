"""The doctor: ``stabletrain check``. Each check is a function ``check(ctx) -> CheckResult``.

A check builds what it needs from the :class:`CheckContext` (a fresh, seeded task from the same
factory the run would use), measures, and returns pass/fail with its numbers. New checks register
with :func:`register`; ``stabletrain check NAME ...`` runs them and prints a table (or ``--json``).
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..config import Config
from ..precision import resolve_device
from ..seeding import seed_everything
from ..tasks import Task, resolve_task

__all__ = ["CheckResult", "CheckContext", "register", "CHECKS", "run_checks", "format_table", "DEFAULT_CHECKS", "fixed_batch"]


@dataclass
class CheckResult:
    """The outcome of one check: pass/fail, a one-line summary, its numbers and detail lines."""

    name: str
    passed: bool
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CheckContext:
    """What a check may use: the resolved config, the device, and fresh seeded tasks."""

    cfg: Config
    task_factory: Callable[[], Task] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return resolve_device(self.cfg.device)

    def make_task(self, seed: int | None = None) -> Task:
        """Return a freshly built task (new model with its init) after seeding every RNG."""
        seed_everything(self.cfg.seed if seed is None else seed)
        if self.task_factory is not None:
            return self.task_factory()
        return resolve_task(self.cfg.task, self.cfg.task_args)


def fixed_batch(task: Task, num_samples: int, device: torch.device | None = None, start: int = 0) -> tuple[list[int], Any]:
    """Return (dataset indices, collated batch) of ``num_samples`` consecutive training samples."""
    n = min(num_samples, len(task.train_data) - start)
    indices = list(range(start, start + n))
    collate = task.collate or torch.utils.data.default_collate
    batch = collate([task.train_data[i] for i in indices])
    if device is not None:
        from ..data import move_to

        batch = move_to(batch, device)
    return indices, batch


CHECKS: dict[str, Callable[[CheckContext], CheckResult]] = {}
_ORDER: dict[str, int] = {}
DEFAULT_CHECKS: list[str] = []


def register(name: str, order: int = 100, default: bool = True) -> Callable:
    """Register ``check(ctx) -> CheckResult`` under ``name``.

    ``order`` sorts the checks in listings and in a plain ``stabletrain check`` (which runs every
    check registered with ``default=True``).
    """

    def deco(fn: Callable[[CheckContext], CheckResult]) -> Callable[[CheckContext], CheckResult]:
        CHECKS[name] = fn
        _ORDER[name] = order
        if default and name not in DEFAULT_CHECKS:
            DEFAULT_CHECKS.append(name)
        DEFAULT_CHECKS.sort(key=lambda n: _ORDER[n])
        return fn

    return deco


def run_checks(ctx: CheckContext, names: list[str] | None = None) -> list[CheckResult]:
    """Run the named checks (default: every default check) in order; an exception fails that check."""
    _load_builtin_checks()
    names = names or list(DEFAULT_CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        raise ValueError(f"unknown check {unknown[0]!r}; known checks: {', '.join(CHECKS)}")
    results = []
    for name in names:
        t0 = time.perf_counter()
        try:
            result = CHECKS[name](ctx)
        except Exception as err:  # a check that crashes is a failed check, with the reason
            result = CheckResult(name, False, f"the check raised {type(err).__name__}: {err}",
                                 details=traceback.format_exc().splitlines()[-6:])
        result.seconds = round(time.perf_counter() - t0, 3)
        results.append(result)
    return results


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_table(results: list[CheckResult]) -> str:
    """Return the results as a plain-text table with the numbers and details under each check."""
    width = max([len(r.name) for r in results] + [5])
    lines = [f"{'check':<{width}}  result  summary", f"{'-' * width}  ------  {'-' * 40}"]
    for r in results:
        lines.append(f"{r.name:<{width}}  {'PASS' if r.passed else 'FAIL':<6}  {r.summary}")
        if r.numbers:
            lines.append(" " * (width + 10) + ", ".join(f"{k}={_fmt(v)}" for k, v in r.numbers.items()))
        for d in r.details:
            lines.append(" " * (width + 10) + d)
    passed = sum(r.passed for r in results)
    lines.append(f"{passed} passed, {len(results) - passed} failed")
    return "\n".join(lines)


def to_json(results: list[CheckResult]) -> str:
    return json.dumps([r.to_dict() for r in results], indent=2, default=str)


_LOADED = False


def _load_builtin_checks() -> None:
    """Import the modules that register the built-in checks (lazily, to keep imports light)."""
    global _LOADED
    if _LOADED:
        return
    import importlib
    import pkgutil

    for mod in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        importlib.import_module(f"{__name__}.{mod.name}")
    _LOADED = True
