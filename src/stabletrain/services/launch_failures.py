"""What ended each launch of a run, read from its ``events.jsonl``, and whether a restart may follow it.

:func:`last_failure` tells the failure of the launch whose events are last (its ``crash``, its ``stop`` and the
``incident`` before it, or no record at all: a launcher's word then names the death, :func:`death_failure`);
:func:`restart_chain` gathers the restarts (and ``run.resume=auto`` resubmissions) since the run was last started or
resumed by hand; :func:`refusal` applies the crash-loop rules to them. Pure reading: the decisions and their records are
:mod:`stabletrain.services.restarts`'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..distributed.launch import describe_exit
from ..records.checkpoint.manager import step_of
from ..records.launches import started_over

__all__ = ["Failure", "SOON_AFTER_LOAD", "last_failure", "refusal", "restart_chain", "launch_marks", "landed", "tried",
           "death_failure", "exitcode", "loaded_then_nonfinite"]


#: A checkpoint whose load is followed this many steps or fewer by a non-finite step is not trusted again.
SOON_AFTER_LOAD = 10


@dataclass
class Failure:
    """What ended a launch, as its records tell: the text for a person, and what identifies it."""

    kind: str  # "crash" | "stop" | "exit" (a process died without a record of why: a signal, a lost peer)
    text: str
    key: list[Any] | None  # equal keys: the same failure (None: only its progress tells it apart)
    progress: bool  # the launch wrote a checkpoint past the one it started from
    resumed_step: int | None  # the step it resumed from (None: it started the run)
    last_step: int  # the last step it is known to have reached
    nonfinite_step: int | None = None  # its first non-finite step
    trained: bool = True  # False: it recorded its restart and died before resuming (in its start-up)
    fell_back: bool = False  # its resume skipped a checkpoint that did not verify (LAST_GOOD is not what it loaded)

    def record(self) -> dict[str, Any]:
        return {"kind": self.kind, "text": self.text, "key": self.key, "progress": self.progress}


def launch_marks(events: list[dict[str, Any]]) -> list[int]:
    """The indices of ``events``' ``restart`` and ``resume`` events: the last launch's own events follow the last one."""
    return [i for i, e in enumerate(events) if e.get("kind") in ("restart", "resume")]


def last_failure(events: list[dict[str, Any]], last_logged: int = 0) -> Failure:
    """The failure of the launch whose events are last in ``events`` (``last_logged``: metrics.jsonl's last step)."""
    marks = launch_marks(events)
    own = events[marks[-1] + 1:] if marks else events
    # a restart's and a resume's step: the one resumed (a restart that started the run over: none, as the first launch)
    mark = events[marks[-1]] if marks else {}
    resumed = None if not marks or mark.get("kind") == "restart" and started_over(mark) else int(mark["step"])
    steps = [int(e["step"]) for e in own if isinstance(e.get("step"), int)]
    trained = not (mark.get("kind") == "restart" and mark.get("checkpoint") is not None)
    if not trained:  # it recorded its restart and died before resuming: the metrics lines are the launch's before
        last_logged = 0
    last = max([last_logged, *steps, resumed or 0])
    progress = any(e.get("kind") == "checkpoint" and (resumed is None or int(e["step"]) > resumed) for e in own)
    nonfinite = next((int(e["step"]) for e in own if e.get("kind") == "nonfinite"), None)
    crash = next((e for e in reversed(own) if e.get("kind") == "crash"), None)
    stop = next((e for e in reversed(own) if e.get("kind") == "stop"  # (a refusal's own stop: the failure it refused)
                 and not str(e.get("reason", "")).startswith(("restart refused", "resubmission refused"))), None)
    common = {"progress": progress, "resumed_step": resumed, "last_step": last, "nonfinite_step": nonfinite,
              "trained": trained,  # (a resume's skipped checkpoints are written just before its own event)
              "fell_back": bool(marks) and marks[-1] > 0 and events[marks[-1] - 1].get("kind") == "checkpoint_skipped"}
    if crash is not None:
        step = int(crash.get("failed_step", crash["step"]))
        return Failure("crash", f"crashed at step {step}: {crash['reason']}",
                       ["crash", crash.get("error"), crash.get("location"), step], **common)
    if stop is not None and stop.get("task_exit"):  # the task's own sys.exit(0): an end it asked for, nothing to repeat
        return Failure("stop", f"stopped at step {stop['step']}: {str(stop['reason']).split('stopping: ', 1)[-1]}", None,
                       **common)
    if stop is not None:
        incident = next((e for e in reversed(own) if e.get("kind") == "incident" and e["step"] <= stop["step"]), None)
        kind = ((incident.get("diagnosis") or {}).get("failure_class") if incident else None)
        met = f" (incident at step {incident['step']}{f': {kind}' if kind else ''})" if incident else ""
        # (SIGTERM, SIGINT: a preemption or a person, no failure to repeat)
        signalled = str(stop["reason"]).removeprefix("stopping: ").startswith("stopped by")
        return Failure("stop", f"stopped at step {stop['step']}: {stop['reason'].removeprefix('stopping: ')}{met}",
                       None if signalled else ["stop", incident["step"] if incident else stop["step"], kind,
                                               stop["reason"] if not incident else None], **common)
    # (a launch its supervisor refused to restart: the death it refused over, told and keyed by the launcher's word)
    told = next((e["failure"] for e in reversed(own) if e.get("kind") == "stop" and isinstance(e.get("failure"), dict)
                 and e["failure"].get("key")), None)
    if told is not None:
        return Failure(str(told.get("kind", "exit")), str(told.get("text")), list(told["key"]), **common)
    return Failure("exit", "ended without a record of why", None, **common)


def refusal(failure: Failure, chain: list[dict[str, Any]], max_repeats: int) -> str | None:
    """Why the run must not restart after ``failure`` (None: it may), given the restart events before it.

    ``chain``: the ``restart`` events since the run was last started or resumed by hand, oldest first; each
    holds the failure its restart followed. Refused once ``max_repeats`` restarts in a row met the same
    failure, or ``max_repeats`` + 1 launches in a row ended without a new checkpoint.
    """
    same = 0
    for event in reversed(chain):
        if failure.key is None or (event.get("failure") or {}).get("key") != failure.key:
            break
        same += 1
    if same >= max_repeats:
        return f"the same failure ended {same + 1} launches in a row ({failure.text})"
    stuck = 0
    if not failure.progress:
        stuck = 1
        for event in reversed(chain):
            if (event.get("failure") or {}).get("progress", True):
                break
            stuck += 1
    if stuck >= max_repeats + 1:
        return f"{stuck} launches in a row ended before writing a new checkpoint (the last {failure.text})"
    return None


def landed(failure: Failure, good: Path | None) -> Failure:
    """``failure`` with progress where LAST_GOOD (``good``) is past the checkpoint its launch resumed from: a save that
    landed although its ``checkpoint`` event did not (the event is written at the boundary after the write; a trial's
    SIGKILL in between left two of them out, and such launches read as stuck, the crash-loop rule's)."""
    if failure.progress or good is None or failure.fell_back:  # (fell back: LAST_GOOD is past what it loaded)
        return failure
    return replace(failure, progress=step_of(good) > (-1 if failure.resumed_step is None else failure.resumed_step))


def restart_chain(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``restart`` events since a launch last started or resumed the run by hand (a resume not after a restart).

    A resume under ``run.resume=auto`` (its event's ``auto``: a resubmission, a Slurm requeue) continues the chain: it
    adds the failure of the launch before it (``kind`` "requeue"), so the same failure met again submission after
    submission is a crash loop too. Such a launch counts toward the same-failure rule only, not the rule of launches
    without a new checkpoint (a preempted job may be requeued many times between two checkpoints)."""
    chain: list[dict[str, Any]] = []
    previous = None
    for i, e in enumerate(events):
        kind = e.get("kind")
        if kind == "restart":
            chain.append(e)
        elif kind == "resume" and e.get("auto"):  # (a resubmission: also right after a restart whose launch wrote none)
            chain = [*chain, {"kind": "requeue", "failure": {**last_failure(events[:i]).record(), "progress": True}}]
        elif kind == "resume" and previous != "restart":
            chain = []
        if kind in ("restart", "resume"):
            previous = kind
    return chain


def tried(chain: list[dict[str, Any]]) -> str:
    """What the chain of restarts (and resubmissions) before a refusal tried, for its line."""
    restarts = [e for e in chain if e.get("kind") == "restart"]
    last = restarts[-1] if restarts else None
    where = (last.get("checkpoint") or ("step 0 (no checkpoint was written yet)" if started_over(last)
                                        else "the newest checkpoint that verified")) if last else None
    again = len(chain) - len(restarts)
    return (f"{len(restarts)} restart(s)" + (f" and {again} resubmission(s) (run.resume=auto)" if again else "")
            + " so far" + (f", the last from {where}" if where else ""))


def death_failure(failure: Failure, cause: dict[str, Any]) -> Failure:
    """``failure`` (a launch that died without a record of why) told and keyed by its launcher's word ``cause``.

    A process that exited by itself said why in its last line (a rank's error message): the words are part of what
    identifies it. One killed by a signal said nothing of its death: its last line is whatever it printed before
    (a progress line, a restart's own announcement), so only the signal, the rank and the step tell it apart.
    """
    code, last = exitcode(cause), cause.get("last_line")
    said = []  # a signal's: where it was (an exit's own words say what it met)
    if code < 0:
        said = ([f"its last record: step {failure.last_step}"] if failure.trained else
                [f"in its start-up, resuming from step {failure.last_step}"])
    said += [f"its last line: {last!r}"] if last else []
    text = f"ended as rank {cause.get('rank')} {describe_exit(code)}" + (f" ({'; '.join(said)})" if said else "")
    # (its last step too: the same words later on are another failure; a pid or an address in them is not its identity)
    pids = r"(?i)(pid(?:\(s\)|s)?\W{0,3})\d+(?:,\s*\d+)*"  # 'pid 42', 'pid=42', torch's 'pid(s) 42, 43'
    words = re.sub(r"0x[0-9a-fA-F]+", "0x_", re.sub(pids, r"\1_", last)) if code >= 0 and last else None
    return replace(failure, text=text, key=["exit", cause.get("rank"), code, words, failure.last_step])


def exitcode(cause: dict[str, Any]) -> int:
    """The death's exit code (a launcher that could not read it wrote None: taken as 1)."""
    code = cause.get("exitcode")
    return code if isinstance(code, int) else 1


def loaded_then_nonfinite(failure: Failure, good: Path) -> bool:
    """Whether the launch met a non-finite step soon after loading LAST_GOOD, and wrote no checkpoint since."""
    return (failure.resumed_step is not None and failure.nonfinite_step is not None and not failure.progress
            and good.name == f"step_{failure.resumed_step:06d}"
            and failure.nonfinite_step - failure.resumed_step <= SOON_AFTER_LOAD)
