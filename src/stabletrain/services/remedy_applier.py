"""The remedy applier: put a verified remedy on the live run (``guard.on_nonfinite=remedy``, or ``remedy=DIR:NAME``).

A service the loop calls by name:

- :meth:`RemedyApplier.act` at an incident under ``guard.on_nonfinite=remedy``: after the capture and its
  diagnosis, replay the incident under the remedies that need no code change
  (:func:`stabletrain.remedy_search.search_remedies`, ``live_only``: skip samples, one module in fp32, a lower LR,
  a tighter clip, a rollback with a lower LR), apply the best that cures it and record a ``remedy`` event
  with its evidence; when none cures, say so and fall back to ``remedy.fallback``.
- :meth:`RemedyApplier.by_hand` when fit starts with ``remedy.apply=INCIDENT_DIR:NAME`` (``stabletrain train
  --resume RUN remedy.apply=...``): apply that candidate of the incident's ``remedy.json``, once.

How a remedy acts on the run: the GradScaler's settings through the precision policy's state, a lower LR
through :meth:`~stabletrain.policies.schedule.LRSchedule.scale`
(the schedule's state holds it; it stays for the rest of the run — the replay verified it over K steps, and
nothing says the old LR is safe after them), a rollback by loading that checkpoint (newer ones, from the bad
trajectory, are discarded and LAST_GOOD moves back), skipped samples by the data stream's ``drop`` (its
state holds them, so an incident capture's replay drops them too), one module in
fp32 by hooks on the model (they stay on it after fit: the remedy is part of how it trains), a clip by
the clipper's threshold. It applies from the run's state at the log boundary: the bad steps since the
incident were skipped (a skip leaves the state as before the step), and an update that broke the
parameters is undone only by a rollback remedy. The applied remedies are in every checkpoint
(:meth:`state_dict`) and are put back on resume. One process only: under DDP/FSDP it falls back.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from pathlib import Path
from typing import Any

from .. import console
from ..diagnostics.cures import Remedy, SkipSamples, remedy_from_dict
from ..records.bundles import BUNDLE_FILE, REMEDY_FILE, incident_order
from ..remedy_search import search_remedies
from ..runstate import RunState
from ..seeding import kept_rng
from .capture import IN_MEMORY

__all__ = ["RemedyApplier"]


class RemedyApplier:
    """Apply verified remedies to the live run and keep them across checkpoints (see the module docstring).

    ``state``: the run's :class:`~stabletrain.runstate.RunState` (the parts a remedy acts on).
    """

    def __init__(self, state: RunState) -> None:
        self.state = state
        self.applied: list[dict[str, Any]] = []  # what was applied, when, and the evidence
        self.last_rollback: dict[str, Any] | None = None  # the last rollback a remedy made (an on_rollback's info)
        self._hooks = contextlib.ExitStack()
        self.seconds = 0.0  # wall time spent in act(): searches, applying, their rollbacks

    # -- the run's record ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"applied": copy.deepcopy(self.applied)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the applied remedies and put back what no other part's state holds (hooks, clip).

        Called after the data stream's and the schedule's own states are loaded (they hold dropped samples, LR).
        """
        self._hooks.close()
        self.state.clipper.max_norm = self.state.cfg.clip.max_norm
        self.applied = copy.deepcopy(list(state.get("applied", [])))
        for entry in self.applied:
            self._install(remedy_from_dict(entry["remedy"]))

    def _install(self, remedy: Remedy) -> None:
        if isinstance(remedy, SkipSamples):
            self.state.stream.drop |= set(remedy.samples)
        self._hooks.enter_context(remedy.installed(self.state.module, self.state.optimizer))
        if remedy.max_norm is not None:
            self.state.clipper.max_norm = remedy.max_norm

    # -- applying -----------------------------------------------------------------------------

    def act(self, decision: Any, found: dict[str, Any]) -> bool:
        """``guard.on_nonfinite=remedy`` at an incident: search, apply the best cure; return whether one was applied.

        ``decision``: the guard's (its ``action`` becomes ``continue``, ``rollback`` (state restored by a
        rollback remedy) or, when nothing cures, ``remedy.fallback``). ``found``: the capture's result. Its wall
        time adds to :attr:`seconds` (the goodput ledger books it to the incident, not to validation).
        """
        t0 = time.perf_counter()
        try:
            return self._act(decision, found)
        finally:
            self.seconds += time.perf_counter() - t0

    def _act(self, decision: Any, found: dict[str, Any]) -> bool:
        state = self.state
        cfg = state.cfg.remedy
        if decision.negligible and decision.first_incident is None:  # spikes between negligible losses: nothing to cure
            decision.action = "continue"  # (their steps were skipped on the device, as on_spike=skip does)
            return True
        incident, why, record = found.get("path"), None, None
        contradicted = self._contradicted(decision)
        if contradicted is not None:
            why = contradicted
        elif state.dist.enabled:
            why = "remedies are searched and applied on one process only"
        elif incident is None:
            why = f"the incident was not captured ({self._uncaptured(decision)})"
        elif len(self.applied) >= cfg.max_applied:
            why = f"{len(self.applied)} remedies applied already (remedy.max_applied={cfg.max_applied})"
        else:
            if state.ckpt is not None:
                state.ckpt.wait()  # a save in flight is a rollback point the search should see
            try:
                with kept_rng():  # the replays seed and draw: the run's own streams must not notice
                    # The capture's bundle and diagnosis as it holds them: its files are their record, not read back.
                    bundle, diagnosis = (found.get(key) for key in IN_MEMORY)  # the capture's, in memory
                    # (no further than the run goes: an 80-step run's cure at step 75 was verified over steps 75-95)
                    left = state.cfg.train.max_steps - int(found.get("step") or state.step)
                    record = search_remedies(incident, state.task, steps=max(1, min(cfg.steps, left)), device=str(state.device),
                                             live_only=True, drop=self.state.stream.drop, bundle=bundle,
                                             diagnosis=diagnosis)
            except Exception as err:  # a search that fails must not take the run down with it
                why = f"the remedy search failed ({type(err).__name__}: {err})"
        params_bad = decision.params_bad_at is not None or decision.after_update
        best = None
        if record is not None:
            # A remedy applied for this incident's step before, which it met again, did not cure it live: not again.
            def key(remedy: dict[str, Any], at: Any) -> tuple[Any, str]:
                return at, json.dumps(remedy, sort_keys=True)

            tried = {key(e["remedy"], e["incident_step"]) for e in self.applied}
            # Applied live, a cure must start where its replay did: at the incident's step (the run stands there), or
            # from a checkpoint it rolls back to. One replayed from the step before changed an update the run has
            # made already: applied now it would not be what was verified (stabletrain remedy still lists it).
            skip = next(c for c in record["candidates"] if c["baseline"])
            # A rollback trains its stretch again (under a lower LR): worth it only when skipping the step does not cure.
            skip_cures = skip["verdict"] == "cures" and not params_bad
            def unusable(c: dict[str, Any]) -> str | None:  # why a cure cannot be applied live, or None
                rollback = c["remedy"]["kind"] == "rollback-lr"
                if key(c["remedy"], record["step"]) in tried:
                    return "applied for this step before"
                if not rollback and c.get("first_step", record["step"]) < record["step"]:
                    return f"from the update of step {c['first_step']}, which the run has made already"
                if params_bad and not rollback:
                    return "the parameters are bad already: only a rollback can apply"
                return None

            best = next((c for c in record["candidates"] if c["verdict"] == "cures" and not c["baseline"]
                         and unusable(c) is None and not (skip_cures and c["remedy"]["kind"] == "rollback-lr")), None)
            draw = record["failure_class"] == "dropout" and not params_bad  # another step draws other masks
            if best is None and (skip_cures or draw):  # the step's skip was all it needed
                decision.action = "continue"
                detail = str(skip.get("detail"))  # (a burst's: its windows after it too, each skipped as it spikes)
                what = "its window and " + detail.split(" and ", 1)[1] if " after it" in detail else "its step"
                line = (f"no remedy needed for the {record['failure_class']} incident at step {record['step']}: skipping "
                        + (f"{what} cures it on the replay ({skip['evidence']})" if skip_cures else
                           "its step was all (its dropout masks made it; the next steps draw their own)"))
                before = [c for c in record["candidates"] if c["verdict"] == "cures" and not c["baseline"]  # (the rule
                          and (unusable(c) or "").startswith("from the update of step")]  # that kept them off, above)
                line += (f"; {', '.join(dict.fromkeys(c['name'] for c in before))} cure{'s' if len(before) == 1 else ''} it"
                         f"{' too' if skip_cures else ''} from the update of step {before[0]['first_step']}, which the run "
                         "had made already (`stabletrain remedy` lists them)" if before else "")
                state.event(state.step, "remedy", line, incident=incident, applied=None)
                if state.run is not None:  # said as an applied one is
                    console.say(line)
                return True
            if best is None:
                cures = any(c["verdict"] == "cures" and not c["baseline"] for c in record["candidates"])
                why = ("no cure can be applied now (" if cures else "no candidate cures it (") + ", ".join(
                    f"{c['name']}: {c['verdict']}" + (f" ({unusable(c)})" if c["verdict"] == "cures" and unusable(c) else
                                                      " (applied for this step before)" if unusable(c) ==
                                                      "applied for this step before" else "")
                    for c in record["candidates"]) + ")"
        if best is None:
            fallback = cfg.fallback
            decision.action = "stop" if fallback == "skip" and params_bad else "continue" if fallback == "skip" else fallback
            decision.reason += f"; no remedy applied: {why}; remedy.fallback={fallback}"
            guard = state.guard  # a fallback rollback counts as the guard's own: guard.max_rollbacks caps both
            if decision.action == "rollback" and guard.num_rollbacks >= guard.cfg.max_rollbacks:
                decision.action = "stop"
                decision.reason += f", after {guard.num_rollbacks} rollbacks (guard.max_rollbacks)"
                fallback += f" (a stop: {guard.num_rollbacks} rollbacks already, guard.max_rollbacks)"
            elif decision.action == "rollback":
                guard.num_rollbacks += 1
            at = found.get("step", decision.first_incident if decision.first_incident is not None else
                           next(iter(decision.spike_steps), state.step))
            line = f"no remedy applied for the incident at step {at}: {why}; falling back to remedy.fallback={fallback}"
            state.event(state.step, "remedy", line, incident=incident, applied=None, incident_step=at, why=why,
                        fallback=fallback)
            if state.dist.is_main and state.run is not None:  # said as an applied one is (under DDP too)
                console.say(line)
            return False
        remedy = remedy_from_dict(best["remedy"])
        # The cures ranked above it that cannot apply now, said (a new user read remedy.json's best, update-clip, live,
        # beside a rollback applied, with no word of why)
        above = [c for c in record["candidates"][:record["candidates"].index(best)]
                 if c["verdict"] == "cures" and not c["baseline"] and unusable(c)]
        passed = "; ".join(f"{c['name']} cures it too but {unusable(c)}" for c in above[:3])
        self.apply(remedy, incident, best, record, passed=passed)
        decision.action = "rollback" if remedy.rollback_step is not None else "continue"
        return True

    def _contradicted(self, decision: Any) -> str | None:
        """Why the last applied cure's replay does not hold for the live run, or None: the run met this incident on a
        step that replay verified finite and free of spikes (the replay does not reproduce the run: a state outside
        the checkpoint, a nondeterministic step). Searching again would verify on the same replay: not done."""
        last = self.applied[-1] if self.applied else None
        span = last.get("verified_steps") if last is not None and not last.get("by_hand") else None
        at = decision.first_incident if decision.first_incident is not None else next(iter(decision.spike_steps), None)
        if span is None or at is None or not span[0] <= at <= span[1]:
            return None
        return (f"the live run departs from the replay that verified {last['name']} (applied at step {last['from_step']}): "
                f"there steps {span[0]}-{span[1]} were finite with no spike, here step {at} is an incident; the replay "
                "does not reproduce the run (state outside the checkpoint? stabletrain check resume names it), so a "
                "search would verify on it again")

    def _uncaptured(self, decision: Any) -> str:
        """Why the decision's incident has no capture (its ``found`` is empty)."""
        state = self.state
        capture = state.cfg.capture
        if not capture.incidents:
            return "capture.incidents=false"
        if state.run is None:
            return "no run directory"
        if decision.first_incident is None and not capture.spikes:  # a spike
            return "capture.spikes=false"
        if decision.first_incident is None and state.guard.num_spike_captures >= capture.max_spikes:
            return f"the run's spike captures are spent: capture.max_spikes={capture.max_spikes}"
        return "no good state to replay from"

    def by_hand(self) -> None:
        """Apply config key ``remedy.apply`` (INCIDENT_DIR:NAME, or INCIDENT_DIR:N for the table's row N) when fit
        starts, unless it was applied already."""
        spec = self.state.cfg.remedy.apply
        if not spec:
            return
        incident, _, name = str(spec).rpartition(":")
        path = Path(incident) / REMEDY_FILE
        if not incident or not name:
            raise ValueError(f"config key 'remedy.apply': expected INCIDENT_DIR:NAME, got {spec!r}")
        if not Path(incident).is_dir():
            raise FileNotFoundError(f"config key 'remedy.apply' ({spec!r}): no incident folder {incident!r} (it does not "
                                    "exist); expected RUN_DIR/incidents/step_N:NAME")
        folder = Path(incident)
        folders = sorted((f for f in (folder / "incidents").glob("step_*") if ".superseded-" not in f.name), key=incident_order)
        if (not path.is_file() and not (folder / BUNDLE_FILE).is_file()
                and ((folder / "incidents").is_dir() or (folder / "metrics.jsonl").is_file())):  # a run dir for an incident
            raise FileNotFoundError(f"config key 'remedy.apply' ({spec!r}): {incident!r} is a run directory, not an incident "
                                    "folder; " + (f"its incidents: {', '.join(f.name for f in folders)} (remedy.apply="
                                                  f"{folders[0]}:{name})" if folders else "the run has no incidents to remedy"))
        if not path.is_file():
            raise FileNotFoundError(f"config key 'remedy.apply' ({spec!r}): no {REMEDY_FILE} in {incident!r}; run "
                                    f"stabletrain remedy {incident} first")
        run = self.state.run
        owner = Path(incident).resolve().parent.parent
        if run is not None and owner != Path(run.path).resolve():  # a cure verified on another run's state and data
            raise ValueError(f"config key 'remedy.apply' ({spec!r}): the incident belongs to another run ({str(owner)!r}), "
                             f"not this one ({str(run.path)!r}): its cure was verified on that run's state and data; "
                             "apply a cure of this run's own incidents (RUN_DIR/incidents/step_N)")
        record = json.loads(path.read_text(encoding="utf-8"))
        row = _candidate(record.get("candidates", []), name, spec, incident)
        earlier = [a for a in self.applied if a.get("incident") == str(Path(incident)) and a.get("by_hand")]
        if any(a.get("remedy") == row["remedy"] for a in earlier):
            return  # a resume of a run it was applied to already: it is in the checkpoint
        if earlier and name.isdigit():  # the same spec on a resume, but remedy.json was ranked again since
            raise ValueError(f"config key 'remedy.apply' ({spec!r}): row {name} of {REMEDY_FILE} is now {row['name']} "
                             f"({row.get('detail')}), but {earlier[-1].get('name')} ({earlier[-1].get('detail')}) was "
                             "applied by hand for that incident (the file was written again since?); name it by its "
                             "name, or leave remedy.apply out on this resume")
        if row.get("verdict") == "fails":  # (a trial: applied, "fails on the replay" in its own event, the NaN back)
            cures = [c["name"] for c in record.get("candidates", []) if c.get("verdict") == "cures"]
            raise ValueError(f"config key 'remedy.apply' ({spec!r}): {row['name']} failed on the replay of the incident "
                             f"({row.get('evidence') or 'see remedy.json'}): there is no cure in it to apply; "
                             + (f"those that cured: {', '.join(cures)}" if cures else "no candidate cured it"))
        remedy = remedy_from_dict(row["remedy"])
        if not remedy.live:
            raise ValueError(f"config key 'remedy.apply' ({spec!r}): {name} needs a code change "
                             f"({getattr(remedy, 'change', '')}) "
                             "or a restart with another config; it cannot be applied to a live run")
        first = row.get("first_step", record.get("step"))
        # (dropping samples holds from any step: the data, not the state). The update of step ``first`` is the cure's
        # own: made by the run already where it resumes past it, or at it for a cure of the update that led into the
        # incident (step - 1: a spike's loss is the state's before its step)
        if (remedy.rollback_step is None and not isinstance(remedy, SkipSamples) and isinstance(first, int)
                and (first < self.state.step or first == self.state.step < int(record.get("step", first)))):
            rollbacks = [c["name"] for c in record.get("candidates", [])
                         if c.get("verdict") == "cures" and c.get("remedy", {}).get("kind") == "rollback-lr"]
            raise ValueError(f"config key 'remedy.apply' ({spec!r}): {row['name']} was verified from the update of step "
                             f"{first}, but this run resumes at step {self.state.step}: the updates since were made "
                             "without it, so its verdict does not hold here; "
                             + (f"apply a cure that rolls back first ({', '.join(rollbacks)})" if rollbacks else
                                "none of its cures rolls back; a run with guard.on_"
                                f"{'spike' if record.get('anomaly', _anomaly(incident)) == 'spike' else 'nonfinite'}=remedy "
                                "applies a cure at the incident itself, where its replay starts"))
        self.apply(remedy, str(Path(incident)), row, record, by_hand=True)
        if remedy.rollback_step is not None:  # (the loop fires it for a live cure's: TensorBoard purges what it trains again)
            self.state.callbacks.fire("on_rollback", self.state, self.last_rollback)

    def apply(self, remedy: Remedy, incident: str, row: dict[str, Any], record: dict[str, Any], *,
              by_hand: bool = False, passed: str = "") -> None:
        """Put ``remedy`` on the run now (a rollback first loads its checkpoint); record the ``remedy`` event."""
        state = self.state
        from_step = state.step
        if remedy.rollback_step is not None:
            if state.ckpt is None:
                raise ValueError(f"remedy {remedy.name}: a rollback needs the run's checkpoints (no run directory)")
            applied = self.applied
            target = state.ckpt.root / f"step_{remedy.rollback_step:06d}"
            if not target.is_dir():  # (pruned by ckpt.keep, or never written): said, not "meta.json is missing"
                raise ValueError(f"remedy {remedy.name}: it rolls back to the checkpoint of step {remedy.rollback_step}, "
                                 f"which is gone ({target} does not exist: pruned by ckpt.keep={state.cfg.ckpt.keep}?)")
            loaded = state.ckpt.load(target)
            # What the run decided never to train on again (rollbacks' windows and named samples, later remedies' samples)
            # stays decided: the older checkpoint's stream holds none of it (a review: they were trained on again).
            skip, drop = set(state.stream.skip), set(state.stream.drop)
            with self.state.guard.counters_kept():
                self.state.load_state_dict(loaded.state)  # also puts back the remedies that checkpoint had
            state.stream.skip, state.stream.drop = state.stream.skip | skip, state.stream.drop | drop
            state.ckpt.discard_after(remedy.rollback_step)  # the checkpoints of the bad trajectory
            if state.run is not None:  # its metrics lines: to metrics.superseded.jsonl, as a rollback's
                state.run.drop_metrics_after(state.step, by="remedy")
            self.load_state_dict({"applied": applied})
            self.last_rollback = {"from_step": from_step, "to_step": state.step, "path": str(loaded.path),
                                  "skipped_windows": [], "reason": f"remedy {remedy.name}: rolled back to step {state.step}"}
        if remedy.lr_factor != 1.0:
            self.state.schedule.scale(remedy.lr_factor)
        current = self.state.precision_policy.state_dict()
        if remedy.precision_state(current) is not current:  # the GradScaler's settings: its state holds them
            self.state.precision_policy.load_state_dict(remedy.precision_state(current))
        self._install(remedy)
        entry = {"name": remedy.name, "remedy": remedy.to_dict(), "detail": remedy.detail, "at_step": state.step,
                 "from_step": from_step, "incident": incident, "incident_step": record.get("step"),
                 "failure_class": record.get("failure_class"), "verdict": row.get("verdict"),
                 "evidence": row.get("evidence"), "by_hand": by_hand,
                 # the steps its replay judged finite and spike-free (a later incident among them: the replay was not
                 # the run's; see _contradicted)
                 **({"verified_steps": [int(row["first_step"]), min(int(row["trajectory"][-1]["step"]),
                                                                    int(record.get("later_incident") or 1 << 62) - 1)]}
                    if row.get("first_step") is not None and row.get("trajectory") and row.get("verdict") == "cures"
                    else {})}
        self.applied.append(entry)
        later = record.get("later_incident")  # judged only up to a later incident every candidate met alike
        how = ("by hand (config key 'remedy.apply')" if by_hand else
               f"verified on the steps up to {later - 1}, before a later incident at step {later}" if later else
               f"verified on {record.get('steps')} steps after it")
        cost = record.get("timings") or {}  # the search's: every candidate's replay (by hand: the offline search's)
        if cost.get("steps_replayed") is not None:
            entry["search"] = {"steps_replayed": cost["steps_replayed"], "seconds": round(float(cost.get("total_s", 0)), 3)}
        if state.run is not None:  # when it was applied (a rollback's own step is in its detail)
            spent = (f"; the search replayed {cost['steps_replayed']} steps in {float(cost.get('total_s', 0)):.2f} s"
                     if "search" in entry and not by_hand else "")
            # Live, the incident's own step was skipped as it ran (its replay trained it without them): said, so the run's
            # skip count and this line agree (a new user read 'cures on the replay' beside '1 of 100 steps skipped').
            at = record.get("step")
            live = (f"; step {at} itself was skipped as it ran, the samples are left out of every window from now on"
                    if isinstance(remedy, SkipSamples) and not by_hand and isinstance(at, int) and at <= from_step else "")
            console.say(f"remedy at step {from_step}: {remedy.name} ({remedy.detail}), {row.get('verdict')} on the "
                        f"replay{spent}{live}" + (f" ({passed})" if passed else ""))
        state.event(state.step, "remedy", f"applied {remedy.name} ({remedy.detail}) for the {record.get('failure_class')} "
                    f"incident at step {record.get('step')}, {how}: {row.get('verdict')}, {row.get('evidence')}",
                    **{k: v for k, v in entry.items() if k != "evidence"}, candidate_evidence=row.get("evidence"),
                    **({"passed_over": passed} if passed else {}))


def _candidate(candidates: list[dict[str, Any]], name: str, spec: str, incident: str) -> dict[str, Any]:
    """The remedy.json row ``remedy.apply`` names: by its name, or by its number in the table (``stabletrain remedy``'s
    ``#`` column) where one name covers several (module-fp32 for each module it tried)."""
    where = f"config key 'remedy.apply' ({spec!r})"
    if name.isdigit():
        if not 1 <= int(name) <= len(candidates):
            raise ValueError(f"{where}: {REMEDY_FILE} has rows 1-{len(candidates)}, not {name}")
        return candidates[int(name) - 1]
    rows = [(n, c) for n, c in enumerate(candidates, 1) if c.get("name") == name]
    if not rows:
        raise ValueError(f"{where}: {REMEDY_FILE} has no candidate {name!r}; it has "
                         f"{', '.join(c.get('name', '?') for c in candidates)}")
    if len(rows) > 1:
        raise ValueError(f"{where}: {name!r} names {len(rows)} candidates ("
                         + "; ".join(f"row {n}: {c.get('detail')}, {c.get('verdict')}" for n, c in rows)
                         + f"); name one by its row: remedy.apply={incident}:{rows[0][0]}")
    return rows[0][1]


def _anomaly(incident: str | Path) -> str | None:
    """The incident's anomaly ("spike" or "nonfinite") from its diagnosis.json (a remedy.json from before it said it)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads((Path(incident) / "diagnosis.json").read_text(encoding="utf-8")).get("anomaly")
    return None
