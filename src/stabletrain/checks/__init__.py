"""The doctor: ``stabletrain check``. Each check is a function ``check(ctx) -> CheckResult``.

A check builds what it needs from the :class:`CheckContext` (a fresh, seeded task from the same
factory the run would use), measures, and returns pass/fail with its numbers. New checks register
with :func:`register`; ``stabletrain check NAME ...`` runs them and prints a table (or ``--json``).

A check that writes files asks :meth:`CheckContext.output_path` for each: they go under
``options["out_dir"]`` (``stabletrain check --out DIR``; default :data:`DEFAULT_OUT_DIR`), and the CLI
prints where. A check that raises fails; when the exception came from the task's own code the
result names the part of the task (loss, dataset item, ...) and shows the user's frames, once.

Importing this package does not import torch: the built-in checks' modules do, and they are imported when a check
runs; ``stabletrain check --help`` and ``--list`` read their names and one-line descriptions from :mod:`.registry`.
"""

from __future__ import annotations

import json
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import console
from ..config import Config
from ..errors import TaskCodeError, batch_note, format_user_traceback, half_params, task_part, user_location
from ..records.jsonl import json_safe
from ..tasks import Task, TaskError, resolve_task
from .registry import require_known

if TYPE_CHECKING:  # torch: imported where a check needs it, so that --help and --list answer without it
    import torch

__all__ = ["CheckResult", "CheckContext", "register", "CHECKS", "run_checks", "format_table", "DEFAULT_CHECKS",
           "DEFAULT_OUT_DIR"]

#: Where checks write their files without ``options["out_dir"]``: a folder of its own, never loose files in the cwd.
DEFAULT_OUT_DIR = "stabletrain-check"
#: The ``.gitignore`` written in an output folder the checks create: stabletrain's output, not the user's code.
GITIGNORE = "# written by stabletrain check: its output, not your code\n*\n"


@dataclass
class CheckResult:
    """The outcome of one check: pass/fail, a one-line summary, its numbers and detail lines."""

    name: str
    passed: bool
    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)
    details: list[str] = field(default_factory=list)
    seconds: float = 0.0
    warning: bool = False  # passed, but with a caveat the user must read (shown as WARN)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CheckContext:
    """What a check may use: the resolved config, the device, fresh seeded tasks, and where to write files.

    ``options``: ``compare`` (init schemes), ``out_dir`` (default :data:`DEFAULT_OUT_DIR`).
    ``written``: the files the checks wrote, in order (via :meth:`output_path`).
    """

    cfg: Config
    task_factory: Callable[[], Task] | None = None
    options: dict[str, Any] = field(default_factory=dict)
    written: list[Path] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        from ..policies.precision import resolve_device

        return resolve_device(self.cfg.device)

    @property
    def out_dir(self) -> Path:
        return Path(self.options.get("out_dir") or DEFAULT_OUT_DIR)

    def output_path(self, name: str) -> Path:
        """Return ``out_dir / name`` for a file a check is about to write (the folder is created and marked as
        stabletrain's output, so a run's ``git.dirty`` does not count it; the file recorded).

        A folder the checks create gets a ``.gitignore`` that ignores everything in it: ``stabletrain check`` run
        inside a repository leaves nothing for ``git status`` to list. A folder that was there before is left so.
        """
        from ..records.provenance import mark_output_dir

        created = not self.out_dir.exists()
        mark_output_dir(self.out_dir)
        if created:
            (self.out_dir / ".gitignore").write_text(GITIGNORE, encoding="utf-8")
        path = self.out_dir / name
        if path not in self.written:
            self.written.append(path)
        return path

    def preflight(self, names: list[str] | None = None) -> None:
        """Refuse what train refuses before its first step, once (one line, exit 2), not in every check: a check ``names``
        has not (the task's module imported first: it may register its own), a device this machine lacks, a model with
        nothing to train (lazy or meta parameters, none trainable)."""
        from ..policies.optim import check_materialized
        from ..tasks import task_factory

        if names:
            _load_builtin_checks()
            if self.task_factory is None:
                task_factory(self.cfg.task)  # (imported, not called)
            require_known(names, CHECKS)
        _ = self.device  # (resolved: a device this machine lacks raises)
        task = self.make_task()
        check_materialized(task.model, self.cfg.task if self.task_factory is None else task.name)

    def make_task(self, seed: int | None = None) -> Task:
        """Return a freshly built task (new model with its init) after seeding every RNG."""
        from ..seeding import seed_everything

        seed_everything(self.cfg.seed if seed is None else seed)
        if self.task_factory is not None:
            return self.task_factory()
        return resolve_task(self.cfg.task, self.cfg.task_args)


CHECKS: dict[str, Callable[[CheckContext], CheckResult]] = {}
_ORDER: dict[str, int] = {}
DEFAULT_CHECKS: list[str] = []


def cast_wholesale(model: Any) -> str | None:
    """A detail line where ``model``'s trainable parameters are stored in float16/bfloat16 (the ``.half()`` mistake the amp check
    names): their rounding, not the loss or the code under check, fails a check made at float32's tolerance (a trial:
    accum blamed 'in-batch negatives', clip gave no reason, overfit said 'precision=fp32'). None: float32 weights."""
    half = half_params(model)
    return None if half is None else (
        f"{half[0]}: the model was cast wholesale (.half()/.bfloat16(), as the amp check says), and its rounding, not the "
        "code under check, is what this check measures: keep float32 weights and let autocast choose (precision=bf16)")


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
    from ..policies.accumulation import LossContractError

    _load_builtin_checks()
    names = names or list(DEFAULT_CHECKS)
    require_known(names, CHECKS)
    results = []
    seen: dict[tuple[str, str, str], str] = {}  # a task error -> the first check it failed
    with console.each_once():  # (the checks' runs of one task say the same line about it once, not once per run)
        for name in names:
            t0 = time.perf_counter()
            try:
                result = CHECKS[name](ctx)
            except (TaskError, LossContractError):  # the task breaks its contract (a dataset without __len__, a loss
                raise  # of the wrong shape): one line, exit 2, as train says it, not the same failure in every check
            except Exception as err:  # a check that crashes is a failed check, with the reason
                result = _crashed(name, err, seen)
            result.seconds = round(time.perf_counter() - t0, 3)
            results.append(result)
    return results


def _crashed(name: str, err: Exception, seen: dict[tuple[str, str, str], str]) -> CheckResult:
    """A failed result for a check that raised: the task's part and the user's frames (once), else the last frames."""
    part = task_part(err)
    if part is None:
        return CheckResult(name, False, f"the check raised {type(err).__name__}: {err}",
                           details="".join(traceback.format_exception(err)).rstrip().splitlines()[-6:])
    where = user_location(err)  # the same user line fails each check (its message may vary with the batch)
    key = (type(err).__name__, part, where if where is not None else str(err))
    if key in seen:
        message = (str(err).splitlines() or [""])[0]
        return CheckResult(name, False, f"the task's {part} raised {type(err).__name__}: {message} "
                                        f"(the same error as in the {seen[key]} check: traceback there)")
    seen[key] = name
    summary = (str(TaskCodeError(part, err)).splitlines() or [""])[0]
    note = batch_note(err, part)  # a batch of strings: say so before the traceback
    return CheckResult(name, False, summary,
                       details=[*([note] if note else []), *format_user_traceback(err).rstrip().splitlines()])


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def format_table(results: list[CheckResult]) -> str:
    """Return the results as a plain-text table with the numbers and details under each check."""
    width = max([len(r.name) for r in results] + [5])
    lines = [f"{'check':<{width}}  result  summary", f"{'-' * width}  ------  {'-' * 40}"]
    for r in results:
        verdict = "FAIL" if not r.passed else "WARN" if r.warning else "PASS"
        lines.append(f"{r.name:<{width}}  {verdict:<6}  {r.summary}")
        shown = {k: v for k, v in r.numbers.items() if not isinstance(v, (list, dict))}  # tables: in details, --json
        if shown:
            lines.append(" " * (width + 10) + ", ".join(f"{k}={_fmt(v)}" for k, v in shown.items()))
        for d in r.details:
            lines.append(" " * (width + 10) + d)
    passed = sum(r.passed for r in results)
    warned = sum(r.passed and r.warning for r in results)
    lines.append(f"{passed} passed, {len(results) - passed} failed" + (f" ({warned} with a warning)" if warned else ""))
    return "\n".join(lines)


def to_json(results: list[CheckResult]) -> str:
    """Strict JSON (a NaN measured is spelled "nan": jq and browsers read it)."""
    return json.dumps(json_safe([r.to_dict() for r in results]), indent=2, allow_nan=False)


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
