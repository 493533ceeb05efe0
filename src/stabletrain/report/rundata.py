"""Read a run directory into plain Python data for the report: never a crash on a bad line.

Reads only files (DESIGN.md, principle 5): ``config.yaml``, ``snapshot.json``, ``metrics.jsonl``,
``events.jsonl``. A malformed line or a value of the wrong type becomes a *problem* naming the file
and line (``"RUN/metrics.jsonl:12: ..."``); the rest of the run is still read.

A resumed (or rolled back) run appends to the same files, so a step may be logged twice. The latest
metrics record of a step wins, and an event written before a ``resume``, ``rollback`` or ``remedy`` event for
a step after the point training went back to is marked ``superseded`` (that stretch was trained again),
with the kind of the event that went back (``superseded_by``): it stays in the timeline but is not
counted. After a resume it is a duplicate (the same steps run again, bitwise); after a rollback or a
remedy's rollback it is history the run changed course after, which the health summary still tells.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..records.events import EVENT_KINDS, METRIC_KEYS, REPLAY_KINDS
from ..records.jsonl import read_jsonl

__all__ = ["RunData", "Event", "load_run", "not_stabletrain", "as_number", "KNOWN_METRIC_KEYS", "x_of"]

# The documented keys (stabletrain.records.events.METRIC_KEYS) plus the interval length this reader derives;
# any other numeric key (a later version's, a user's) is shown under "other metrics".
KNOWN_METRIC_KEYS = frozenset(METRIC_KEYS) | {"interval_steps"}

_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def as_number(value: Any) -> float | None:
    """Return ``value`` as a float ("nan"/"inf"/"-inf" strings included), or None if it is not a number."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in _NONFINITE:
        return _NONFINITE[value.lower()]
    return None


@dataclass
class Event:
    """One line of ``events.jsonl``; ``extra`` holds every field beyond step, kind, reason, time."""

    step: int
    kind: str
    reason: str
    time: float | None
    extra: dict[str, Any]
    superseded: bool = False
    superseded_by: str | None = None  # the kind of the event that went back past it: resume, rollback or remedy


def x_of(rec: dict[str, Any], key: str, x: str = "step") -> Any:
    """Where a record's ``key`` is drawn on the ``x`` axis: an adapter's val_loss at its ``val_step`` (the step its host's
    evaluation measured, logged in a later interval's record), anything else at the record's own ``x``."""
    return rec.get("val_step", rec.get(x)) if key == "val_loss" and x == "step" else rec.get(x)


@dataclass
class RunData:
    """What a run directory holds, cleaned: one metrics record per step (sorted), events in file order."""

    path: Path
    config: dict[str, Any] = field(default_factory=dict)
    snapshot: dict[str, Any] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: metrics records a rollback (or a remedy's) went back past: the trajectory the run abandoned, not trained again
    #: the same way (``metrics.superseded.jsonl``, less a resume's bitwise repeats); the plots draw them faded.
    abandoned: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name or str(self.path)

    @property
    def count_unit(self) -> str:
        """What the loss's count counts: "tokens" or "samples" (the snapshot's ``count_unit``).

        A run written before the snapshot recorded it: the built-in task's unit; an adapter's: tokens for the HF Trainer's,
        samples for one whose tokens seen are its samples seen; else "items".
        """
        unit = self.snapshot.get("count_unit")
        if unit in ("tokens", "samples"):
            return unit
        host = self.snapshot.get("integration")
        if host == "transformers":  # (its adapter counts the tokens the loss covers: labels != -100, else the mask or ids)
            return "tokens"
        seen = [(r.get("tokens_seen"), r.get("samples_seen")) for r in self.metrics]
        if host and seen and all(isinstance(t, (int, float)) and t == n for t, n in seen):  # (a Monitor or Lightning run
            return "samples"  # given no count of its own: it counts samples; a trial read "items/s")
        return {"gpt": "tokens", "mlp": "samples"}.get(str(self.cfg("task")), "items")

    @property
    def loss_scaled(self) -> bool:
        """Whether a loss scale was in play: fp16 (with its GradScaler), or a logged scale other than 1."""
        if (self.snapshot.get("precision") or self.cfg("precision")) == "fp16":
            return True
        scales = [r["loss_scale"] for r in self.metrics if isinstance(r.get("loss_scale"), float)]
        return any(math.isfinite(v) and v != 1.0 for v in scales)

    def cfg(self, dotted: str, default: Any = None) -> Any:
        """Return a config value by dotted key, or ``default`` when absent."""
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node

    def series(self, key: str, x: str = "step") -> tuple[list[float], list[float]]:
        """Return (x, y) over the records that have ``key`` (and ``x``); non-finite y values are kept."""
        xs, ys = [], []
        for rec in self.metrics:
            if isinstance(rec.get(key), float) and isinstance(x_of(rec, key, x), (int, float)):
                xs.append(float(x_of(rec, key, x)))
                ys.append(rec[key])
        return xs, ys

    def counted_events(self, *kinds: str) -> list[Event]:
        """Return the events of ``kinds`` (each one of EVENT_KINDS) that count (not superseded by a resume)."""
        unknown = [k for k in kinds if k not in EVENT_KINDS]
        assert not unknown, f"event kinds {unknown} are not in stabletrain.records.events.EVENT_KINDS"
        return [e for e in self.events if e.kind in kinds and not e.superseded]

    def undone_events(self, *kinds: str) -> list[Event]:
        """Return the events of ``kinds`` that a rollback (or a remedy's rollback) went back past: what happened
        before the run changed course (a resume's duplicates are not among them)."""
        unknown = [k for k in kinds if k not in EVENT_KINDS]
        assert not unknown, f"event kinds {unknown} are not in stabletrain.records.events.EVENT_KINDS"
        return [e for e in self.events if e.kind in kinds and e.superseded_by in ("rollback", "remedy")]

    def other_metric_keys(self) -> list[str]:
        """Return the numeric metric keys this report does not know, in first-seen order."""
        seen: dict[str, None] = {}
        for rec in self.metrics:
            for key, value in rec.items():
                if key not in KNOWN_METRIC_KEYS and isinstance(value, float):
                    seen[key] = None
        return list(seen)


def load_run(run_dir: str | Path) -> RunData:
    """Read ``run_dir``; raise only when it is not a run directory at all.

    Raises FileNotFoundError when the folder does not exist and ValueError when it holds none of
    config.yaml, snapshot.json, metrics.jsonl, events.jsonl, or when what it holds is another tool's (see
    :func:`not_stabletrain`). Everything else is a ``problem``.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"run directory {str(path)!r} does not exist")
    names = ("config.yaml", "snapshot.json", "metrics.jsonl", "events.jsonl")
    if not any((path / n).exists() for n in names):
        raise ValueError(f"{str(path)!r} is not a run directory: it holds none of {', '.join(names)}")
    run = RunData(path=path)
    run.config = _read_config(path / "config.yaml", run.problems)
    run.snapshot = _read_snapshot(path / "snapshot.json", run.problems)
    run.metrics = _read_metrics(path / "metrics.jsonl", run.problems)
    run.events = _read_events(path / "events.jsonl", run.problems)
    run.abandoned = _abandoned(path / "metrics.superseded.jsonl", run.metrics)
    why = not_stabletrain(run)
    if why is not None:
        raise ValueError(f"{str(path)!r} is not a stabletrain run directory: {why}")
    return run


def not_stabletrain(run: RunData) -> str | None:
    """Why ``run``'s files are another tool's (None when they are stabletrain's): no line of its metrics.jsonl has a
    step, no line of its events.jsonl is a stabletrain event, its snapshot.json has no config hash, and its config.yaml
    holds no stabletrain key (a key of a section of stabletrain's config, ``clip.max_norm``, ``log.every``, ..., or an
    adapter's ``integration``). A run that has not logged yet passes on its config.yaml alone."""
    if run.metrics or any(e.kind in EVENT_KINDS for e in run.events) or "config_hash" in run.snapshot \
            or _stabletrain_keys(run.config):
        return None
    metrics = run.path / "metrics.jsonl"
    if not metrics.is_file():
        said = "there is no metrics.jsonl"
    else:
        first = next((line.strip() for line in metrics.open(encoding="utf-8", errors="replace") if line.strip()), None)
        said = ("its metrics.jsonl is empty" if first is None else "no line of its metrics.jsonl has a 'step' (line 1: "
                + (first if len(first) <= 80 else first[:79] + "…") + ")")
    if not (run.path / "config.yaml").is_file():
        said += ", and there is no config.yaml"
    else:
        keys = list(run.config)
        held = ", ".join(map(str, keys[:6])) + (f" and {len(keys) - 6} more" if len(keys) > 6 else "")
        said += ", and its config.yaml holds no stabletrain key" + (f" (it holds {held})" if keys else " (it is empty)")
    return said


def _stabletrain_keys(config: dict[str, Any]) -> list[str]:
    """The keys of ``config`` (a config.yaml's mapping) that are stabletrain's own: a section's key (``clip.max_norm``), or
    an adapter's ``integration``."""
    from ..config import Config, flatten_config

    ours = {k for k in flatten_config(Config()) if "." in k}
    return [k for k in flatten_config(config) if k in ours or k == "integration"]


def _abandoned(path: Path, kept: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The superseded records a rollback or a remedy's rollback went back past (``superseded_by``), every one (a
    second rollback over the same steps keeps the first's); a line written before that field: one whose loss is not
    the kept record's of its step (a resume re-logs a step bitwise)."""
    if not path.is_file():
        return []
    now = {r["step"]: r.get("loss") for r in kept}
    out = []
    for raw in read_jsonl(path)[0]:  # (a malformed line there is evidence, not the run's data: skipped)
        step = _step_of(raw)
        if step is None:
            continue
        rec = {"step": step, **{k: v for k, v in ((k, as_number(v)) for k, v in raw.items() if k != "step")
                                if v is not None}}
        by = raw.get("superseded_by")
        if by in ("rollback", "remedy") or (by is None and (step not in now or rec.get("loss") != now[step])):
            out.append(rec)
    return sorted(out, key=lambda r: r["step"])


# -- readers ------------------------------------------------------------------------------------


def _read_config(path: Path, problems: list[str]) -> dict[str, Any]:
    if not path.exists():
        problems.append(f"{path}: missing (the config is not shown)")
        return {}
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8", errors="replace"))
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problems.append(f"{where}: malformed YAML ({getattr(err, 'problem', None) or err})")
        return {}
    if data is None:
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path}:1: expected a mapping, got {type(data).__name__}")
        return {}
    return data


def _read_snapshot(path: Path, problems: list[str]) -> dict[str, Any]:
    if not path.exists():
        problems.append(f"{path}: missing (the snapshot is not shown)")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as err:
        problems.append(f"{path}:{err.lineno}: malformed JSON ({err.msg})")
        return {}
    if not isinstance(data, dict):
        problems.append(f"{path}:1: expected a JSON object, got {type(data).__name__}")
        return {}
    return data


class _Lines:
    """Line numbers of the records ``read_jsonl`` returns, worked out only when a problem needs one."""

    def __init__(self, path: Path) -> None:
        self.path, self._lines = path, None

    def __getitem__(self, index: int) -> int:
        if self._lines is None:
            self._lines = []
            with open(self.path, encoding="utf-8", errors="replace") as fh:
                for lineno, line in enumerate(fh, 1):
                    try:
                        if line.strip() and isinstance(json.loads(line), dict):
                            self._lines.append(lineno)
                    except json.JSONDecodeError:
                        pass
        return self._lines[index]


def _read_records(path: Path, problems: list[str]) -> tuple[list[dict[str, Any]], _Lines]:
    records, found = read_jsonl(path)
    if found and _ends_mid_line(path):
        # A run in progress may be halfway through writing its last line: say so next to that problem.
        with open(path, "rb") as fh:
            last = sum(1 for _ in fh)
        found = [p + " (the last line is incomplete: the run may still be writing it)" if p.startswith(f"{path}:{last}:")
                 else p for p in found]
    problems.extend(found)
    return records, _Lines(path)


def _ends_mid_line(path: Path) -> bool:
    with open(path, "rb") as fh:
        if fh.seek(0, 2) == 0:
            return False
        fh.seek(-1, 2)
        return fh.read(1) != b"\n"


_BAD_STEP = "'step' is missing or not an integer >= 0 (got {!r})"


def _step_of(rec: dict[str, Any]) -> int | None:
    step = rec.get("step")
    if isinstance(step, bool):
        return None
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    return step if isinstance(step, int) and step >= 0 else None


def _read_metrics(path: Path, problems: list[str]) -> list[dict[str, Any]]:
    records, lines = _read_records(path, problems)
    by_step: dict[int, dict[str, Any]] = {}
    for i, rec in enumerate(records):
        step = _step_of(rec)
        if step is None:
            problems.append(f"{path}:{lines[i]}: {_BAD_STEP.format(rec.get('step'))}; line ignored")
            continue
        clean: dict[str, Any] = {"step": step}
        for key, value in rec.items():
            if key == "step":
                continue
            if key in ("top_grad_layers", "top_update_layers"):
                clean[key] = value if isinstance(value, list) else []
                continue
            number = as_number(value)
            if number is not None:
                clean[key] = number
            elif key in KNOWN_METRIC_KEYS:
                problems.append(f"{path}:{lines[i]}: '{key}' is not a number (got {value!r}); value ignored")
        by_step[step] = clean  # the latest record of a step wins (a resumed run re-logs steps)
    metrics = [by_step[s] for s in sorted(by_step)]
    previous = 0
    for rec in metrics:
        rec["interval_steps"] = float(rec["step"] - previous)  # every interval is as long, except maybe the last
        previous = rec["step"]
    return metrics


def _read_events(path: Path, problems: list[str]) -> list[Event]:
    records, lines = _read_records(path, problems)
    events: list[Event] = []
    for i, rec in enumerate(records):
        step = _step_of(rec)
        if step is None:
            problems.append(f"{path}:{lines[i]}: {_BAD_STEP.format(rec.get('step'))}; event ignored")
            continue
        kind = rec.get("kind") if isinstance(rec.get("kind"), str) and rec.get("kind") else "unknown"
        reason = rec.get("reason")
        reason = reason if isinstance(reason, str) else ("" if reason is None else str(reason))
        when = as_number(rec.get("time"))
        extra = {k: v for k, v in rec.items() if k not in ("step", "kind", "reason", "time")}
        if kind in REPLAY_KINDS:
            # Where training went back to: the event's step; a remedy's rollback says it in at_step as well.
            back_to = extra.get("at_step") if kind == "remedy" and isinstance(extra.get("at_step"), int) else step
            for earlier in events:
                if earlier.step > back_to and not earlier.superseded:
                    earlier.superseded, earlier.superseded_by = True, kind  # trained again: the new line counts
        events.append(Event(step, kind, reason, when if when is not None and math.isfinite(when) else None, extra))
    return events
