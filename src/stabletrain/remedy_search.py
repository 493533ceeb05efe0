"""Verified remedies: replay an incident under candidate fixes and say, with evidence, which one cures it.

:func:`search_remedies` (``stabletrain remedy INCIDENT_DIR``) rebuilds the run's step from the incident
bundle's exact pre-step state (model, optimizer, schedule, precision, RNG) — or, for a rollback, from the
run's checkpoint before the growth began — and replays the incident's window and the ``steps`` (K)
windows after it through the one :class:`~stabletrain.step.TrainStep`, once per candidate
(:mod:`stabletrain.diagnostics.cures`) and once for the "just skip the step" baseline. The built-in
loop's data stream is deterministic (:class:`~stabletrain.data.WindowStream` over
:class:`~stabletrain.data.EpochOrder`), so the same batches come next as in the run.

Verdicts (:func:`judge`):

- ``cures``: the incident's window and all K after it are finite, no step is a spike by the guard's own
  rule (seeded with the run's losses), and the loss at the end (mean of the last ``END_STEPS`` steps after
  the incident's, the windows every candidate trains on alike) is no worse than the baseline's by more
  than ``LOSS_TOLERANCE`` (relative) — or, where the baseline fails on a divergence, than the loss of the
  run's last interval before the growth began, when it logged one.
- ``fails``: its first bad step (non-finite loss, grad norm or parameters, a spike, or an fp16 overflow
  that takes the GradScaler below ``UNRECOVERABLE_SCALE``) is named. A candidate that drops more than half
  of the replay's samples, or has fewer than half its steps applied, only hides the symptom: it fails.
- ``worse``: finite throughout, but its end loss is worse than that bar by more than the tolerance.

Cost: about (K + 1) x candidates steps plus one load (a rollback also replays the steps from its checkpoint
to the incident); a candidate stops at its first bad step. ``remedy.json`` in the incident directory holds
the whole search (non-finite figures as the strings "nan", "inf"). This module sits beside
:mod:`stabletrain.incident_replay`: it composes the step and the remedies.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .config import config_from_dict
from .config.adapter import in_host_terms
from .config.diff import flatten_config
from .data import EpochOrder, Window, WindowStream, move_to
from .diagnostics.candidates import candidates_for, why_not_offered
from .diagnostics.cures import CANDIDATE_NAMES, Remedy, SkipSamples, SkipStep
from .diagnostics.remedy_verdicts import (
    END_STEPS,
    LOSS_TOLERANCE,
    VERDICTS,
    before_later_incident,
    end_loss,
    format_table,
    healthy_bar,
    judge,
    rank,
)
from .diagnostics.spike_evidence import outlier_sets
from .fileio import atomic_write
from .incident_replay import diagnose_incident, run_history, task_of_run
from .policies.accumulation import loss_sums
from .policies.guard import Guard, routine_overflow, spike_test
from .policies.precision import resolve_device
from .policies.spike_rule import armed_at
from .records.bundles import DIAGNOSIS_FILE, REMEDY_FILE, RUN_REMEDY_FILE, load_bundle
from .records.checkpoint.manager import CheckpointManager
from .records.jsonl import json_safe, read_jsonl, revive
from .replica import KEEP, Replica
from .seeding import set_rng_state
from .services.replay_rule import replay_guard
from .tasks import Task

__all__ = ["search_remedies", "format_table", "judge", "REMEDY_FILE", "LOSS_TOLERANCE", "END_STEPS", "VERDICTS"]

#: A skip-samples candidate takes the outliers of at most this many later windows too (:func:`_extended`).
MAX_EXTENSIONS = 3


class _Incident:
    """What every candidate's replay starts from: the bundle, the config, the task, the run's history.

    ``bundle``: the bundle already in memory (a live capture's); None: read from ``directory``.
    """

    def __init__(self, directory: Path, task: Task | None, device: str | None,
                 bundle: dict[str, Any] | None = None) -> None:
        self.dir = directory
        self.bundle = bundle if bundle is not None else load_bundle(directory)
        if int(self.bundle.get("world_size", 1)) > 1:
            held = ("the incident's step (every rank's batch: stabletrain diagnose replays it)"
                    if "ranks" in self.bundle.get("window", {}) else "its rank's part of the incident's step")
            raise ValueError(f"incident {str(directory)!r} comes from a run of {self.bundle['world_size']} processes; "
                             f"stabletrain remedy replays a one-process run only: the bundle holds {held}, not the windows "
                             "after it that each cure is judged on, drawn from a data order split across the processes")
        empty = [m for m, idx in enumerate(self.bundle["window"]["indices"]) if not idx]
        if empty:
            raise ValueError(f"incident {str(directory)!r}: step {self.bundle['step']}'s batch holds no samples (micro-batch "
                             f"{', '.join(map(str, empty))} empty): no remedy to replay; skip empty batches in the loop")
        self.cfg = config_from_dict(self.bundle["config"])
        self.device = resolve_device(device or self.cfg.device)
        self.task = task if task is not None else task_of_run(self.cfg, directory)
        self.collate = self.task.collate or torch.utils.data.default_collate
        self.step = int(self.bundle["step"])
        # An adapter's bundle (it names its host) keeps only its own step: no stream to draw the K windows after from.
        self.adapter = "host" in self.bundle
        self.drop: set[int] = set()  # samples the run already never trains on (search_remedies sets them)
        self.history = [r for r in run_history(directory) if isinstance(r.get("step"), int) and r["step"] < self.step]
        self.run_dir = directory.resolve().parent.parent
        self.checkpoints = CheckpointManager(self.run_dir / "checkpoints")
        self.rollback_steps = [s for s in (self._step_of(p) for p in self._checkpoint_dirs()) if s is not None and s < self.step]

    def _checkpoint_dirs(self) -> list[Path]:
        return self.checkpoints.checkpoints() if self.checkpoints.root.is_dir() else []

    @staticmethod
    def _step_of(path: Path) -> int | None:
        try:
            return int(path.name.removeprefix("step_"))
        except ValueError:
            return None

    def start(self, remedy: Remedy) -> tuple[dict[str, Any], int, dict[str, Any] | None]:
        """(the state to replay from, the first step's number, the data stream's state) for ``remedy``.

        A spike's loss is the state's before its step: a remedy that changes updates (:attr:`Remedy.earlier`) starts
        from the state before the step before it (the bundle's ``previous``), so the update that led in is its own.
        """
        prev = self.bundle.get("previous")
        if remedy.rollback_step is None and remedy.earlier and prev:
            return prev, self.step - 1, {"epoch": prev.get("epoch", 0), "pos": prev.get("start", 0), "origin": 0}
        if remedy.rollback_step is None:
            w = self.bundle["window"]
            return self.bundle, self.step, {"epoch": w["epoch"], "pos": w["start"], "origin": 0}
        path = self.checkpoints.root / f"step_{remedy.rollback_step:06d}"
        state = self.checkpoints.load(path).state
        return state, int(state["counters"]["step"]) + 1, state["stream"]


def _windows(inc: _Incident, stream_state: dict[str, Any], first: int) -> Iterator[Window]:
    """The windows the run trains on from ``stream_state`` (the built-in loop's deterministic stream).

    An adapter's bundle: its step's own micro-batches (after the step before it's, from ``first`` on), and nothing
    after them.
    """
    task = inc.task
    if inc.adapter:
        groups = ([inc.bundle["previous"]["window"]] if first < inc.step else []) + [inc.bundle["window"]["indices"]]
        for indices in groups:
            yield Window(0, 0, indices, [inc.collate([task.train_data[i] for i in g]) for g in indices])
        return
    order = EpochOrder(len(task.train_data), inc.cfg.train.batch_size, inc.cfg.seed, inc.cfg.data.shuffle)
    stream = WindowStream(task.train_data, order, inc.cfg.accum.steps, collate=task.collate)
    stream.load_state_dict(stream_state)
    stream.drop |= inc.drop
    while True:
        yield stream.next_window()


def _dropped_before(run_dir: Path, step: int) -> set[int]:
    """The samples the run's applied skip-samples remedies (its ``remedy`` events before ``step``) took out."""
    out: set[int] = set()
    for e in read_jsonl(run_dir / "events.jsonl")[0]:
        remedy = e.get("remedy") if e.get("kind") == "remedy" else None
        if isinstance(remedy, dict) and remedy.get("kind") == "skip-samples" and e.get("step", step) < step:
            out |= {int(i) for i in remedy.get("samples", [])}
    return out


def _flagged_after(run_dir: Path, step: int) -> set[int]:
    """The steps after ``step`` the run itself flagged as loss spikes (its ``spike`` events), captured or not."""
    return {int(e["step"]) for e in read_jsonl(run_dir / "events.jsonl")[0]
            if e.get("kind") == "spike" and isinstance(e.get("step"), int) and e["step"] > step}


def _replay(inc: _Incident, remedy: Remedy, num_after: int, probe: int | None = None) -> dict[str, Any]:
    """Replay from ``remedy``'s start through the incident's window and ``num_after`` more; the per-step record.

    ``probe``: stop before that step's update and return its samples' own losses under the state it met, and the
    losses the rule judges it against (``result["probe"]``: :func:`_extended`)."""
    start = time.perf_counter()
    cfg, task, dev = inc.cfg, inc.task, inc.device
    state, first, stream_state = inc.start(remedy)
    replica = Replica(cfg, task, state, dev)
    model = replica.model
    precision = (replica.precision(mode=remedy.precision) if remedy.precision is not None
                 else replica.precision(state=remedy.precision_state(state["precision"])))
    guard = replay_guard(cfg, inc.bundle.get("observed", {}), inc.history,  # the host spike rule
                         state.get("guard") if remedy.rollback_step is not None else None)
    live = None  # guard.on_spike=skip or remedy: the run skips a flagged step's update, so the replay does too (the
    if cfg.guard.on_spike in ("skip", "remedy") and not inc.adapter:  # same rule on the device, from the same window)
        live = Guard(cfg.guard, dev, scaled=precision.scaler is not None)  # fp16: an overflowing spike is one too
        live.load_state_dict(guard.state_dict())
    step = replica.step(precision=precision, lr_factor=remedy.lr_factor,
                        max_norm=remedy.max_norm if remedy.max_norm is not None else KEEP, guard=live)
    windows = _windows(inc, stream_state, first)
    set_rng_state(state["rng"])
    rows: list[dict[str, Any]] = []
    failed: dict[str, Any] | None = None
    recovered, start_loss = remedy.rollback_step is None, None
    recent = [float(r[1]) for r in inc.bundle.get("observed", {}).get("recent") or [] if math.isfinite(float(r[1]))]
    dropped = total = 0
    last = inc.step + (0 if inc.adapter else num_after)
    with remedy.installed(model, step.optimizer):
        for n, window in zip(range(first, last + 1), windows):
            if n == inc.step and window.indices != inc.bundle["window"]["indices"]:
                raise ValueError(f"incident {str(inc.dir)!r}: the data stream's window at step {n} holds samples "
                                 f"{window.indices[0][:4]}..., not the bundle's {inc.bundle['window']['indices'][0][:4]}... "
                                 "(the run skipped windows after a rollback, or its data changed)")
            kept = remedy.keep(window.indices, n - inc.step)
            total += window.num_samples
            dropped += window.num_samples - sum(map(len, kept))
            groups = [(k, b if k == i else move_to(inc.collate([task.train_data[j] for j in k]), dev))
                      for k, i, b in zip(kept, window.indices, window.batches) if k]
            if not groups:
                rows.append({"step": n, "dropped": True})
                continue
            if n == probe:
                return {"probe": _sample_losses(inc, model, precision, [k for k, _ in groups]),
                        "window": [float(v) for v in guard.window.tolist() if math.isfinite(v)]}
            out = step([(len(k), b) for k, b in groups], task.loss, check_params=True)
            loss, norm = float(out["loss"]), float(out["grad_norm"])
            overflow = routine_overflow(bool(out["overflow"]), float(precision.loss_scale()))  # (fp16, as the guard)
            params_ok = bool(out.get("params_finite", torch.tensor(True)))
            row = {"step": n, "loss": loss, "grad_norm": norm, "applied": bool(out["applied"])}
            marked = SimpleNamespace(values={"loss": loss, "finite": float(math.isfinite(loss) and math.isfinite(norm)),
                                             "overflow": float(bool(out["overflow"]))})  # the rule tests its loss too
            window_now = [v for v in guard.window.tolist() if math.isfinite(v)]  # (the rule's losses before this one)
            with np.errstate(over="ignore", invalid="ignore"):  # a diverging loss squared overflows float32
                guard.mark_spikes([marked])
            # Before the rule arms (a run's first steps): spike_ratio^3 x every loss before it, the run's last steps
            # too, at least 2 (an eps-guard's log(1e-12) at step 7, x22 the run's loss, 'cured' a NaN the rule could not
            # yet judge; one loss before is too few: a batch of 8's second loss was x5 its first).
            before = window_now + recent
            early = (marked.values["spike"] <= 0.5 and len(window_now) < armed_at(cfg.guard) and len(before) >= 2
                     and math.isfinite(loss) and loss > cfg.guard.spike_ratio ** 3 * max(before))
            rows.append(row)
            if not math.isfinite(loss) or not params_ok or (not math.isfinite(norm) and not overflow):
                what = ("loss" if not math.isfinite(loss) else "parameters" if not params_ok else
                        f"grad norm (the GradScaler backs off to {float(precision.loss_scale()):g}, below 1)"
                        if bool(out["overflow"]) else "grad norm")
                failed = {"step": n, "why": f"non-finite {what} at step {n} (loss {loss:.4g}, grad norm {norm:.4g})",
                          "kind": what}
                break
            # From a rollback point the losses start where that state is (a divergence under way): until they are back
            # under the rule's bound once, that is recovery, unless the loss climbs past spike_ratio x where it started;
            # after it, a spike is the candidate's own.
            # A candidate that starts at the step before the incident changes that step's update, which comes after its
            # loss: a spike there is the run's own (an earlier spike, applied), not the candidate's.
            spike = (marked.values["spike"] > 0.5 or early) and not (n == first < inc.step and remedy.rollback_step is None)
            recovered = recovered or not spike
            start_loss = loss if start_loss is None else start_loss
            if spike and (recovered or loss > cfg.guard.spike_ratio * start_loss):
                observed = inc.bundle.get("observed", {})  # the run's own loss there (an adapter's: its host's)
                own = observed.get("loss", observed.get("host_loss")) if n == inc.step else None
                same = isinstance(own, (int, float)) and math.isclose(loss, float(own), rel_tol=1e-6)
                failed = {"step": n, "why": f"loss spike at step {n} by the guard's rule (loss {loss:.4g}" + (
                    f", x{loss / max(before):.3g} every loss before it: the rule's early bar" if early else "") + ")" + (
                    "; the run's own loss there: the change never acted on this step"
                    if same and first < n else ""), "kind": "spike"}
                break
    end = end_loss(rows, inc.step) if failed is None else float("nan")
    return {"name": remedy.name, "remedy": remedy.to_dict(), "detail": remedy.detail, "live": remedy.live,
            "scope": remedy.scope,
            "change": getattr(remedy, "change", None), "first_step": first, "steps_replayed": len(rows),
            "rewound_steps": inc.step - first if remedy.rollback_step is not None else 0,
            "dropped_samples": dropped, "total_samples": total,
            "failed": failed, "end_loss": end, "trajectory": rows, "seconds": time.perf_counter() - start}


def _sample_losses(inc: _Incident, model: torch.nn.Module, precision: Any, groups: list[list[int]]) -> list[dict[str, Any]]:
    """Each sample's own loss (a sum over its items, and their count) under ``model`` as it stands: forward only."""
    samples = [([i], move_to(inc.collate([inc.task.train_data[i]]), inc.device)) for g in groups for i in g]
    sums = loss_sums(inc.task.loss, model, samples, precision.autocast())
    return [{"sample": i[0], "loss_sum": s, "count": c} for (i, _), (s, c) in zip(samples, sums)]


def _extended(inc: _Incident, remedy: SkipSamples, result: dict[str, Any], num_after: int) -> dict[str, Any]:
    """A skip-samples candidate that fails at the next window by its loss (a burst of bad samples over consecutive
    windows: the diagnosis names the first window's), replayed again with that window's outliers dropped too
    (:func:`~stabletrain.diagnostics.spike_evidence.outlier_sets`: the fewest whose rest is normal by the guard's rule), along
    the burst's windows, at most :data:`MAX_EXTENSIONS` of them. A later failure after a calm window is another
    incident's, left to it. Returns the last replay's result, with ``extended``: [{step, samples}, ...]."""
    extended: list[dict[str, Any]] = []
    cfg, last = inc.cfg.guard, inc.step
    replayed, seconds, why = result["steps_replayed"], result["seconds"], None
    for _ in range(MAX_EXTENSIONS):
        failed = result["failed"]
        if failed is None or failed["step"] != last + 1 or failed.get("kind") not in ("spike", "loss"):
            break
        last = failed["step"]
        try:  # (a model that cannot take one sample alone, BatchNorm in training, has no per-sample losses)
            probe = _replay(inc, remedy, num_after, probe=failed["step"])
        except Exception as err:  # noqa: BLE001 (the candidate keeps its verdict without the extension; said in it)
            why = f"the samples of step {last} could not be weighed one by one ({type(err).__name__}: {err})"
            break
        window = probe.get("window", [])

        def normal(loss: float, window: list[float] = window) -> bool:  # as the diagnosis's: no spike, under x spike_ratio
            verdict = spike_test(loss, window, cfg)
            return not verdict["spike"] and verdict.get("ratio", 0.0) <= cfg.spike_ratio

        more = next(outlier_sets(probe.get("probe", []), normal), None)
        if not more:
            break
        wider = dataclasses.replace(remedy, samples=tuple(sorted({*remedy.samples, *more})))
        again = _replay(inc, wider, num_after)
        replayed += failed["step"] - result["first_step"] + again["steps_replayed"]  # the probe's and the new replay's
        seconds += again["seconds"]
        if again["failed"] is not None and again["failed"]["step"] <= last:  # no further without them: not taken
            break
        extended.append({"step": last, "samples": sorted(more)})
        remedy, result = wider, again
    out = {**result, "steps_replayed": replayed, "seconds": seconds}  # every replay of the candidate, counted
    return {**out, "extended": extended, **({"extension_error": why} if why else {})} if extended or why else out


def _burst(inc: _Incident, remedy: SkipStep, result: dict[str, Any], num_after: int) -> dict[str, Any]:
    """A data incident's skip-step baseline that fails by a spike at the window right after the ones it drops (a burst
    of bad windows, none of whose few samples carries it), replayed again with that window dropped too, as
    ``guard.on_spike=skip`` does live, along the burst, at most :data:`MAX_EXTENSIONS` windows more."""
    replayed, seconds = result["steps_replayed"], result["seconds"]
    while (result["failed"] is not None and result["failed"].get("kind") == "spike" and remedy.windows <= MAX_EXTENSIONS
           and result["failed"]["step"] == inc.step + remedy.windows):
        remedy = SkipStep(windows=remedy.windows + 1)
        result = _replay(inc, remedy, num_after)
        replayed, seconds = replayed + result["steps_replayed"], seconds + result["seconds"]
    return {**result, "steps_replayed": replayed, "seconds": seconds}  # every replay of the baseline, counted


def search_remedies(directory: str | Path, task: Task | None = None, *, steps: int = 20, only: list[str] | None = None,
                    device: str | None = None, live_only: bool = False, drop: set[int] | None = None,
                    bundle: dict[str, Any] | None = None, diagnosis: dict[str, Any] | None = None) -> dict[str, Any]:
    """Replay ``directory``'s incident under each candidate that fits it and the skip-step baseline; write ``remedy.json``.

    ``steps``: K, the windows replayed after the incident's. ``only``: candidate names
    (:data:`~stabletrain.diagnostics.cures.CANDIDATE_NAMES`); the baseline always runs. ``task``: reuse a
    built task (its model is deep-copied, never touched). ``live_only``: only the candidates a live run can
    apply without a code change or a restart (``guard.on_nonfinite=remedy``). ``drop``: the samples the run
    already never trains on (its stream's ``drop``; default: those of the skip-samples remedies its events.jsonl
    records before the incident). ``bundle``, ``diagnosis``: the incident's bundle and its diagnosis already in
    memory (a live capture's, as :func:`~stabletrain.incident_replay.diagnose_incident` takes the bundle): neither is
    read back from ``directory``, whose files stay their record (default: ``bundle.pt``, and ``diagnosis.json`` or a
    diagnosis made here when it has none). Returns the record written.
    """
    if steps < 1:  # a cure is judged on the windows after the incident's too (0: one step, its end loss unchecked)
        raise ValueError(f"--steps: expected an integer >= 1 (the windows replayed after the incident's), got {steps}")
    unknown = [n for n in only or [] if n not in CANDIDATE_NAMES]
    if unknown:
        raise ValueError(f"--only: unknown candidate {', '.join(unknown)}; the candidates are {', '.join(CANDIDATE_NAMES)}")
    start = time.perf_counter()
    directory = Path(directory)
    inc = _Incident(directory, task, device, bundle)
    inc.drop = set(drop) if drop is not None else _dropped_before(inc.run_dir, inc.step)
    if diagnosis is None:  # a search in a new process (a live one's diagnosis is this process's replay's)
        as_ran = _replay(inc, Remedy(), 0)  # the incident's step replayed as it ran: what the candidates must cure
        if as_ran["failed"] is None:
            last = (as_ran["trajectory"] or [{}])[-1]
            raise ValueError(f"incident {str(directory)!r}: replayed here as it ran, step {inc.step} is finite and no spike "
                             f"(loss {last.get('loss', float('nan')):.4g}): the incident does not reproduce in this process, "
                             "so no cure can be verified (every candidate would 'cure' it). The model or loss rebuilt here "
                             "may not be the one that trained (a hook, or a change made after the model was built), the "
                             "replay may run on another device (--device) or the step was nondeterministic: "
                             f"stabletrain diagnose {directory} says what differs")
        diagnosis_path = directory / DIAGNOSIS_FILE
        diagnosis = revive(json.loads(diagnosis_path.read_text(encoding="utf-8"))) if diagnosis_path.is_file() else {}
    if "failure_class" not in diagnosis:
        diagnosis = diagnose_incident(directory, inc.task, device=str(inc.device), bundle=inc.bundle)
    pool = candidates_for(diagnosis, inc.cfg.precision, inc.history, inc.rollback_steps, inc.cfg.clip.max_norm)
    if only:
        missing = [n for n in only if n not in {c.name for c in pool}]
        if missing:
            why = "; ".join(filter(None, (why_not_offered(n, diagnosis) for n in missing)))
            raise ValueError(f"--only: {', '.join(missing)} does not fit this incident (failure class "
                             f"{diagnosis.get('failure_class')}{': ' + why if why else ''}); its candidates are "
                             f"{', '.join(c.name for c in pool)}")
        pool = [c for c in pool if isinstance(c, SkipStep) or c.name in only]
    if live_only:
        pool = [c for c in pool if c.live]
    load_s = time.perf_counter() - start
    results = [_replay(inc, c, steps) for c in pool]
    burst = diagnosis.get("failure_class") == "data"  # (bad windows; a state's next spikes are no burst to skip)
    results = [_extended(inc, c, r, steps) if isinstance(c, SkipSamples) else _burst(inc, c, r, steps)
               if isinstance(c, SkipStep) and burst else r for c, r in zip(pool, results)]
    later = before_later_incident(results, inc.step, _flagged_after(inc.run_dir, inc.step)) if len(results) > 1 else None
    baseline = results[0]
    healthy = healthy_bar(inc.history, diagnosis)
    typical = (diagnosis.get("spike_window") or {}).get("median")
    # An adapter's spike bundle with no step before it: a remedy that changes updates starts at the spike's own step,
    # whose loss came before any update, and nothing after it is replayed: its one step cannot show an effect.
    untestable = inc.adapter and inc.bundle.get("observed", {}).get("anomaly") == "spike" and not inc.bundle.get("previous")
    for c, r in zip(pool, results):
        if inc.adapter and r is baseline and r["dropped_samples"] == r["total_samples"]:  # the lone step skipped
            r["verdict"], r["evidence"], r["baseline"] = "untestable", (
                "skipping the step leaves nothing of this adapter bundle to replay (it holds the incident's step alone); "
                + ("on_spike='skip' does this live" if inc.bundle.get("observed", {}).get("anomaly") == "spike" else
                   "on_nonfinite='skip' (the default) does this live")), True
            continue
        if untestable and c.earlier and c.rollback_step is None and r is not baseline:
            r["verdict"], r["evidence"], r["baseline"] = "untestable", (
                "it changes the updates, which come after the spike's loss; this adapter bundle holds the spike's step "
                "alone (no step before it to start from, none after it to judge)"), False
            continue
        r["verdict"], r["evidence"] = judge(r, baseline, healthy, typical)
        if r.get("extended"):  # the burst's later windows' outliers, dropped too
            r["evidence"] += "; with the outliers of the windows after it: " + ", ".join(
                f"sample{'s' if len(e['samples']) > 1 else ''} {', '.join(map(str, e['samples']))} at step {e['step']}"
                for e in r["extended"])
        if r.get("extension_error"):
            r["evidence"] += f"; {r['extension_error']}"
        r["baseline"] = r is baseline
    _in_host_terms(inc, results)
    ranked = rank(results)
    total_steps = sum(r["steps_replayed"] for r in results)
    record = {
        "incident": str(directory), "step": inc.step,
        "anomaly": inc.bundle.get("observed", {}).get("anomaly") or diagnosis.get("anomaly") or "nonfinite",
        "failure_class": diagnosis.get("failure_class"),
        "evidence": diagnosis.get("evidence"), "summary": diagnosis.get("summary"), "steps": steps,
        "tolerance": LOSS_TOLERANCE, "end_steps": END_STEPS, "baseline": baseline["name"],
        "note": ("an adapter's bundle keeps only its own step (and the one before it): the verdicts are on those, reported, not "
                 "applied" if inc.adapter else None),
        "later_incident": later,  # every candidate met it alike: judged on the steps before it
        "best": next((r["name"] for r in ranked if r["verdict"] == "cures" and not r["baseline"]), None),
        "candidates": ranked,
        "timings": {"load_s": load_s, "replay_s": time.perf_counter() - start - load_s, "total_s": time.perf_counter() - start,
                    "steps_replayed": total_steps},
    }
    record = json_safe({**record, **({"by_the_run": True} if live_only else {})})  # strict JSON ("nan", "inf" as strings)
    _keep_the_runs_own(directory)
    atomic_write(directory / REMEDY_FILE, json.dumps(record, indent=2, default=str, allow_nan=False) + "\n")
    return record


def _in_host_terms(inc: _Incident, results: list[dict[str, Any]]) -> None:
    """An adapter's run: a candidate that sets the whole run's precision or clip says it in the host's own terms
    (``Trainer(precision="32-true")``, not the built-in loop's ``precision=fp32`` the host has no key for)."""
    if not inc.adapter:
        return
    import yaml

    try:
        config = yaml.safe_load((inc.run_dir / "config.yaml").read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return
    config = flatten_config(config) if isinstance(config, dict) else {}
    host = config.get("integration")
    for r in results:
        kind, remedy = r["remedy"].get("kind"), r["remedy"]
        words = (in_host_terms(host, "precision", remedy.get("mode")) if kind == "bf16" and "mode" in remedy else
                 in_host_terms(host, "clip", remedy.get("limit"), config) if kind == "clip" else None)
        if words:
            r["detail"] = words


def _keep_the_runs_own(directory: Path) -> None:
    """Before a search replaces ``directory``'s remedy.json: the run's own search (``by_the_run``, what it applied from)
    moves to :data:`~stabletrain.records.bundles.RUN_REMEDY_FILE`, once (a rerun of ``stabletrain remedy`` with other
    ``--steps`` replaced it, and the report's Remedies section lost the search the run had applied)."""
    path, kept = directory / REMEDY_FILE, directory / RUN_REMEDY_FILE
    try:
        if not kept.exists() and json.loads(path.read_text(encoding="utf-8")).get("by_the_run"):
            os.replace(path, kept)
    except (OSError, ValueError, AttributeError):  # none there, or not a record: replaced as it is
        pass
