"""The start of a launch: continue the run or start it, and whether a restart may go ahead.

Every launch of ``stabletrain train`` calls :func:`begin_launch` once, every rank, before building the
Trainer; rank 0 decides from the run directory and tells the others. A launch is a restart when the
process that restarts it said so (:data:`~stabletrain.distributed.launch.RESTART_ENV`: stabletrain's
supervisor, or torchrun through :mod:`stabletrain.distributed.elastic`) or when torchrun restarted it
(``TORCHELASTIC_RESTART_COUNT`` > 0 on any rank, or a ``TORCHELASTIC_RUN_ID`` a launch of this run
already had: a node whose agent restarted because the other node's did). A restart continues from
LAST_GOOD, after three checks, in this order, on what the launch before it met (:class:`Failure`, read
from ``events.jsonl``: its ``crash``, its ``stop`` and the ``incident`` before it, or no record at all):

1. the same failure (the same crash, or stop, at the same step) ended ``run.max_repeats`` + 1 launches in a
   row, or that many in a row ended before writing a new checkpoint: no restart; a ``stop`` event and one
   line say what failed and what was tried, and the process exits with
   :data:`~stabletrain.distributed.launch.EXIT_GAVE_UP`, which ends the launcher's restarts too;
2. the launch met a non-finite step at most :data:`SOON_AFTER_LOAD` steps after loading its checkpoint and
   wrote none since: that checkpoint is not trusted again. It is moved whole to ``checkpoints/distrusted/``
   (evidence, not deleted) and LAST_GOOD goes back to the one before it; with none before it left
   (``ckpt.keep``), no restart;
3. nothing to resume (the launch died before its first checkpoint): the run starts again from step 0 in the same
   directory, its record of the death kept (:func:`_start_over`).

Then a ``restart`` event and one console line: the cause (exit code or signal, rank, the last line it
printed), what it met, the checkpoint resumed from and the steps to train again. The evidence of the
failure stays: incidents the redone steps could capture again are renamed ``step_N.superseded-R``, the
metrics lines the resume supersedes go to ``metrics.superseded.jsonl``, events are only appended.

``run.resume=auto`` (not a restart): continue ``run.dir`` when it holds a checkpoint, else start it; one
line says which. A resubmission after the same failure ended the launches before it (:func:`requeue_refusal`) is refused
at its start, with or without a checkpoint.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .. import console
from ..callbacks.goodput_clock import LEDGER_FILE
from ..distributed.launch import EXIT_GAVE_UP, RESTART_ENV, RUN_DIR_NOTE_ENV, default_run_dir, describe_exit
from ..records.bundles import set_aside_incidents
from ..records.checkpoint.files import CheckpointError
from ..records.checkpoint.manager import CheckpointManager, step_of
from ..records.jsonl import read_jsonl
from ..records.launches import refuse_if_running
from ..records.rundir import RunDir
from .launch_failures import (
    SOON_AFTER_LOAD,
    Failure,
    death_failure,
    exitcode,
    landed,
    last_failure,
    launch_marks,
    loaded_then_nonfinite,
    refusal,
    restart_chain,
    tried,
)

__all__ = ["begin_launch", "Launch", "Failure", "last_failure", "refusal", "SOON_AFTER_LOAD", "EXIT_GAVE_UP"]

#: A restart recorded by the launch after it: the launch it started died in its start-up, before recording it.
LATE = " (recorded by a later launch: the one this restart started died in its start-up)"


@dataclass
class Launch:
    """What :func:`begin_launch` decided: resume or start, in which directory, or refuse (the line said why)."""

    resume: bool
    run_dir: Path | None
    refused: str | None = None
    finished: bool = False  # run.resume=auto on a run that reached train.max_steps: nothing to train, nothing written
    requeue: bool = False  # run.resume=auto continues the run: a resubmission (its resume event says so: ``auto``)


def _env_record() -> dict[str, Any]:
    try:
        causes = json.loads(os.environ[RESTART_ENV]) if RESTART_ENV in os.environ else []
    except ValueError:
        causes = []
    causes = causes if isinstance(causes, list) else [causes]  # a launcher of an earlier version: the last death
    return {"causes": [c for c in causes if isinstance(c, dict)],
            "count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            "max": int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0),
            "run_id": os.environ.get("TORCHELASTIC_RUN_ID")}


def _ledger(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run_dir / LEDGER_FILE)[0] if r.get("kind") == "launch"]


def _ledger_last_step(run_dir: Path, events: list[dict[str, Any]]) -> int:
    """The last step the goodput ledger of the last launch records (its ``end`` line: a rank 0 that lost a peer logs no
    event, and its last step may be past its last metrics line), where that launch began after the last launch mark
    (0: it died before its ledger began)."""
    rows = read_jsonl(run_dir / LEDGER_FILE)[0]
    starts = [i for i, r in enumerate(rows) if r.get("kind") == "launch"]
    marks = launch_marks(events)
    since = float(events[marks[-1]].get("time", 0)) if marks else 0.0
    if not starts or float(rows[starts[-1]].get("ready") or 0) < since:
        return 0
    return max((int(r["step"]) for r in rows[starts[-1]:] if isinstance(r.get("step"), int)), default=0)


def begin_launch(cfg: Any, run_dir: Path | None, resume: bool, ctx: Any) -> Launch:
    """Decide whether this launch resumes ``run_dir``; for a restart, check and record it (see the module docstring).

    Every rank calls it (one all_gather_object and one broadcast); rank 0 reads and writes the run directory.
    ``resume``: the command asked for it (``--resume``). Returns the same :class:`Launch` on every rank.
    """
    everyone = ctx.gather_objects(_env_record())
    if run_dir is None and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        run_dir = default_run_dir(cfg)  # torchrun may restart the ranks: the same name each time (its run id)

    def decide() -> Launch:
        if everyone[0]["max"] and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and os.environ.get(
                "LOCAL_WORLD_SIZE") != os.environ.get("WORLD_SIZE"):  # (on one machine the ranks take care of it: group.py)
            console.warn("torchrun may restart these ranks (--max-restarts) on several machines, but shares its "
                         "rendezvous store with them: a restart's ranks can then read the addresses of the attempt before "
                         "and fail to connect (pytorch/pytorch#135712); start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1")
        if run_dir is None:
            return Launch(resume, run_dir)
        ids = {r["run_id"] for r in everyone if r["run_id"]}
        restart = (any(r["causes"] for r in everyone) or any(r["count"] for r in everyone)
                   or bool(ids & {e.get("run_id") for e in _ledger(run_dir)}))
        has_checkpoint = bool(CheckpointManager(run_dir / "checkpoints").checkpoints())
        if restart:
            return _restart(cfg, run_dir, everyone, has_checkpoint)
        # A run at or past train.max_steps, resumed or resubmitted: nothing to train, and its record stays as it is
        # (config.yaml, resume and schedule events; a changed config goes on to the resume, which refuses it; a damaged
        # last checkpoint too, which falls back to the one before it and trains the rest)
        name = CheckpointManager(run_dir / "checkpoints").latest_good() if resume or cfg.run.resume == "auto" else None
        done = name is not None and _finished(cfg, run_dir, name, len(everyone))
        if resume and done:
            console.say(f"nothing to train: the run is at step {step_of(name)} and train.max_steps={cfg.train.max_steps} "
                        f"(raise train.max_steps to train on); {run_dir} is left as it was")
            return Launch(False, run_dir, finished=True)
        if cfg.run.resume == "auto" and not resume:
            refuse_if_running(run_dir)  # (before saying it continues a run another launch still trains)
            # (run.overwrite=true starts over only a run with nothing to continue: said where it does not)
            kept = ("; run.overwrite=true starts over only a run with no checkpoint (run.resume=never to)"
                    if cfg.run.overwrite else "")
            if done:
                console.say(f"run.resume=auto: {run_dir} has finished (LAST_GOOD {name.name}, train.max_steps="
                            f"{cfg.train.max_steps}): nothing to train (raise train.max_steps to train on){kept}")
                return Launch(False, run_dir, finished=True)
            # (with a checkpoint or without: a crash loop that wrote none is met again too, from step 0)
            why, before = requeue_refusal(cfg, run_dir) if (run_dir / "events.jsonl").is_file() else (None, "")
            if why is not None:  # (the same failure, resubmission after resubmission: a requeue cannot help)
                then = (f"continue with: stabletrain train --resume {run_dir}" if has_checkpoint else
                        "start it again without run.resume=auto (it holds no checkpoint to continue)")
                line = f"run.resume=auto: not continuing {run_dir}: {why}; it would meet it again: fix its cause, then {then}"
                run = RunDir(run_dir, resume=True)
                try:
                    run.event(step_of(name) if name else 0, "stop", f"resubmission refused: {why}")
                finally:
                    run.close()
                console.error(line)
                return Launch(False, run_dir, refused=line)
            if has_checkpoint:
                if name is None or _same_config(cfg, name, len(everyone)) is not False:  # (else the resume refuses it in
                    # its own line; None: its meta.json unreadable, which the resume falls back from, saying so)
                    console.say(f"run.resume=auto: {run_dir} holds {f'LAST_GOOD ({name.name})' if name else 'checkpoints'}"
                                f": continuing it{before}{kept}")
                return Launch(True, run_dir, requeue=True)
            if not cfg.run.overwrite and RunDir.holds_trained_run(run_dir):  # (said, not 'starting it' then refused)
                raise FileExistsError(f"run.resume=auto: run directory {str(run_dir)!r} holds a run that trained but no "
                                      "checkpoint to continue it from; pick another run.dir, or pass run.overwrite=true to "
                                      "start it over")
            RunDir.make_folder(run_dir)  # (one that cannot be a run directory: its refusal alone, not 'starting it' first)
            console.say(f"run.resume=auto: {run_dir} holds no checkpoint: starting it")
        return Launch(resume, run_dir)

    return ctx.on_main(decide)


def _finished(cfg: Any, run_dir: Path, checkpoint: Path, world: int) -> bool:
    """Whether ``checkpoint`` (the run's LAST_GOOD) is at or past ``cfg``'s train.max_steps, under a config a resume by
    ``world`` processes takes, and whole (it verifies)."""
    return (step_of(checkpoint) >= cfg.train.max_steps and _same_config(cfg, checkpoint, world)
            and not CheckpointManager(run_dir / "checkpoints").verify(checkpoint))


def _same_config(cfg: Any, checkpoint: Path, world: int) -> bool | None:
    """Whether ``checkpoint``'s config (its meta.json; None where it cannot be read) differs from ``cfg`` in no key a resume
    by ``world`` processes refuses
    a change of (the resume's own rule, :func:`~.checkpoints.resume_diffs`: a resharded one may change more; the mode a
    saved precision=auto trained in is meta.json's, or, in a checkpoint written before it recorded it, what auto resolves to
    on this machine)."""
    from ..config import move_old_keys
    from ..policies.precision import resolve_device, resolve_precision
    from ..records.checkpoint.files import META_FILE
    from .checkpoints import resume_diffs

    try:
        meta = json.loads((checkpoint / META_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    saved = meta.get("config") or {}
    move_old_keys(saved, "the checkpoint's config")
    try:
        trained = meta.get("precision") or resolve_precision(str(saved.get("precision", "auto")),
                                                             resolve_device(str(saved.get("device", "auto"))))
        resolved = resolve_precision(cfg.precision, resolve_device(cfg.device))
    except (ValueError, RuntimeError):  # a device this machine lacks: no mode to compare (the resume says what fails)
        trained, resolved = None, ""
    return not resume_diffs(saved, cfg, trained, resolved, resharded=int(meta.get("world_size", 1)) != world)


def _causes(everyone: list[dict[str, Any]], since: float | None) -> list[dict[str, Any]]:
    """The deaths the ranks' launchers saw after ``since``, one per restart (of a restart's, the first), oldest first."""
    first: dict[Any, dict[str, Any]] = {}
    for cause in (c for r in everyone for c in r["causes"] if since is None or c.get("time", 0) >= since):
        number = cause.get("restart")
        if number not in first or cause.get("time", 0) < first[number].get("time", 0):
            first[number] = cause
    return sorted(first.values(), key=lambda c: c.get("time", 0))


def _restart(cfg: Any, run_dir: Path, everyone: list[dict[str, Any]], has_checkpoint: bool) -> Launch:
    """Check and record this restart, and first each restart before it whose launch died before recording it.

    A restarted process that dies in its start-up (before :func:`begin_launch`) writes no ``restart`` event; its
    launcher's record of the death before it reaches the next restart with its own (:data:`RESTART_ENV` holds
    every death): each gets its event and line, and the crash-loop rule counts it.
    """
    good = CheckpointManager(run_dir / "checkpoints").latest_good() if has_checkpoint else None
    if good is not None and _finished(cfg, run_dir, good, len(everyone)):  # (killed after its last save: no restart)
        console.say(f"the run had trained to train.max_steps={cfg.train.max_steps} (LAST_GOOD {good.name}) when its process "
                    "died: nothing to restart")
        return Launch(False, run_dir, finished=True)
    events, _ = read_jsonl(run_dir / "events.jsonl")
    launches = _ledger(run_dir)
    since = launches[-1].get("start") if launches else None
    restarts = [e for e in events if e.get("kind") == "restart"]
    recorded = {(e.get("cause") or {}).get("time") for e in restarts}
    # (and by number since the last launch recorded: another node's agent saw the same restart a moment apart)
    numbers = {e.get("restart") for e in restarts if since is None or float(e.get("time") or 0) >= since}
    causes = _causes(everyone, since)
    missed = [c for c in causes[:-1] if c.get("time") not in recorded and c.get("restart") not in numbers]
    for cause in missed:  # (each recorded restart marks the launch after it: one that died in its start-up, see
        # last_failure's ``trained``)
        launch = _restart_after(cfg, run_dir, everyone, has_checkpoint, cause, late=True)
        if launch.refused is not None:
            return launch
        has_checkpoint = has_checkpoint or launch.resume
    return _restart_after(cfg, run_dir, everyone, has_checkpoint, causes[-1] if causes else None, late=False)


def _restart_after(cfg: Any, run_dir: Path, everyone: list[dict[str, Any]], has_checkpoint: bool,
                   cause: dict[str, Any] | None, late: bool) -> Launch:
    """Check and record the restart after the death ``cause`` (None: no launcher's word); ``late``: the launch it
    started died in its start-up before recording it."""
    events, _ = read_jsonl(run_dir / "events.jsonl")
    metrics, _ = read_jsonl(run_dir / "metrics.jsonl")
    failure = last_failure(events, max([*(int(m.get("step", 0)) for m in metrics), _ledger_last_step(run_dir, events)]))
    if failure.kind == "exit" and cause:  # no record of why (a signal, another rank's crash: rank 0 writes the
        # events): the launcher's word names it, and the same death at the same step again is the same failure
        failure = death_failure(failure, cause)
    failure = landed(failure, CheckpointManager(run_dir / "checkpoints").latest_good() if has_checkpoint else None)
    chain = restart_chain(events)
    number = (cause or {}).get("restart") or max([r["count"] for r in everyone] + [len(chain) + 1])
    limit = (cause or {}).get("max_restarts") or max(r["max"] for r in everyone) or cfg.run.max_restarts
    who = _who(cause, number)
    run = RunDir(run_dir, resume=True)
    try:
        why = refusal(failure, chain, cfg.run.max_repeats)
        if why is None and not has_checkpoint:  # nothing to resume: the run starts again from step 0, in place
            return _start_over(run, run_dir, failure, number, limit, who, cause, late)
        distrusted: dict[str, Any] = {}
        ckpt = CheckpointManager(run_dir / "checkpoints", keep=cfg.ckpt.keep)
        good = ckpt.latest_good()
        # (not where the launch before met the same stop without that load: the data or the code, not the checkpoint)
        if why is None and good is not None and loaded_then_nonfinite(failure, good) and not (
                chain and failure.key is not None and (chain[-1].get("failure") or {}).get("key") == failure.key):
            try:
                moved, good = ckpt.set_aside(good)
                distrusted = {"distrusted": str(moved.relative_to(run_dir)), "distrusted_step": failure.resumed_step}
            except CheckpointError:
                why = (f"checkpoint step_{failure.resumed_step:06d} led to a non-finite step (step {failure.nonfinite_step}) "
                       f"right after its load and is not trusted, and no older checkpoint is left (ckpt.keep={cfg.ckpt.keep})")
        if why is not None:
            line = (f"not restarting the run after {who}: {why}; tried: {tried(chain)} (run.max_restarts={limit}, "
                    f"run.max_repeats={cfg.run.max_repeats}). See {run_dir / 'events.jsonl'}")
            run.event(failure.last_step, "stop", f"restart refused: {why}", cause=cause, failure=failure.record())
            console.error(line)
            return Launch(False, run_dir, refused=line)
        resumed = step_of(good) if good is not None else failure.last_step
        redone = max(0, failure.last_step - resumed)
        kept = set_aside_incidents(run_dir, resumed, str(number), cfg.remedy.apply)  # (not the one remedy.apply reads)
        note = (f"; step_{failure.resumed_step:06d} led to a non-finite step at step {failure.nonfinite_step}, "
                f"{failure.nonfinite_step - failure.resumed_step} after its load: not trusted again (moved to "
                f"{distrusted['distrusted']}), resuming from the checkpoint before it" if distrusted else "")
        met = "" if failure.kind == "exit" else f"; the launch {failure.text}"
        # A killed launch's last steps are known only up to its last record (a log line, an event): it may have got further.
        again = f"{redone} step{'s' if redone != 1 else ''} to train again" if redone else "no step to train again"
        if failure.kind == "exit" and failure.trained:
            again = (f"{redone} step{'s' if redone != 1 else ''} to train again (more if it trained past step "
                     f"{failure.last_step}, its last record)" if redone else
                     f"its last record is at step {failure.last_step}: any steps it trained past it are trained again "
                     "(how many is not recorded)")
        reason = (f"restart {number}{f' of {limit}' if limit else ''} after {who}{met}{note}; resuming from "
                  f"{good.name if good else '?'}: {again}{LATE if late else ''}")
        # Any outcome the dead launch said (its own events: a step an older timeline saved may be saved again)
        marks = launch_marks(events)
        recorded = {int(e["step"]) for e in events[marks[-1] + 1 if marks else 0:] if isinstance(e.get("step"), int)
                    and e.get("kind") in ("checkpoint", "checkpoint_failed", "checkpoint_withheld")}
        for path in sorted(p for p in ckpt.checkpoints() if good is not None and step_of(p) not in recorded
                           and step_of(p) <= resumed
                           and step_of(p) > (-1 if failure.resumed_step is None else failure.resumed_step)):
            run.event(step_of(path), "checkpoint", f"{path.name}: written by the launch before, which died before its "
                      "next boundary recorded it (recorded at the restart)", path=str(path), recorded_at_restart=True)
        run.event(resumed, "restart", reason, restart=number, max_restarts=limit, cause=cause,
                  failure=failure.record(), checkpoint=good.name if good else None, redone=redone,
                  **distrusted, **({"incidents_kept": kept} if kept else {}), **({"late": True} if late else {}))
        console.say(reason)
        return Launch(True, run_dir)
    finally:
        run.close()


def requeue_refusal(cfg: Any, run_dir: Path) -> tuple[str | None, str]:
    """Why a resubmission under ``run.resume=auto`` must not continue the run (None: it may): the launch before it
    ended with the failure the ``run.max_repeats`` launches before that did (:func:`refusal`'s same-failure rule); and
    how that launch ended, for the line that continues it ("": it trained to its train.max_steps, or it is not known)."""
    events, _ = read_jsonl(run_dir / "events.jsonl")
    metrics, _ = read_jsonl(run_dir / "metrics.jsonl")
    failure = last_failure(events, max([*(int(m.get("step", 0)) for m in metrics), _ledger_last_step(run_dir, events)]))
    rows = read_jsonl(run_dir / LEDGER_FILE)[0]
    end = next((r for r in reversed(rows) if r.get("kind") in ("launch", "end")), {"kind": "end"})  # (no ledger: unknown)
    short = f"at step {end.get('step')}, short of train.max_steps={end.get('max_steps')}"  # (its fit ended: no error)
    said = (f"; the launch before {failure.text}" if failure.kind != "exit" or failure.key is not None else
            "" if end["kind"] == "end" and int(end.get("step") or 0) >= int(end.get("max_steps") or 0) else
            f"; the launch before ended {short} without a record of why (a lost peer, a signal?)" if end["kind"] == "end" else
            f"; the launch before ended without finishing and without a record of why (killed?), its last record at "
            f"step {failure.last_step}")
    return refusal(replace(failure, progress=True), restart_chain(events), cfg.run.max_repeats), console.clipped(said)


def _start_over(run: RunDir, run_dir: Path, failure: Failure, number: int, limit: int, who: str,
                cause: dict[str, Any] | None, late: bool = False) -> Launch:
    """A launch died before its first checkpoint: start the run again from step 0 in the same directory.

    Its record stays: ``events.jsonl`` (with this ``restart`` event: the crash-loop rule counts it), the goodput
    ledger, and its ``config.yaml`` renamed ``config.failed-start-N.yaml`` (a directory holding a ``config.yaml``
    and no trained step would be replaced by a new run's).
    """
    old = run_dir / "config.yaml"
    if old.exists():
        old.rename(run_dir / f"config.failed-start-{number}.yaml")
    # A launch that logged steps before it died with no checkpoint landed (its first save failed or was in flight, as
    # a sharded one whose peer died): those steps are trained again, set aside as a resume sets aside its (the new
    # launch refused a directory whose metrics.jsonl holds a trained step: 'already holds a run')
    superseded, kept = run.drop_metrics_after(-1), set_aside_incidents(run_dir, -1, str(number))
    met = "" if failure.kind == "exit" else f"; the launch {failure.text}"
    reason = (f"restart {number}{f' of {limit}' if limit else ''} after {who}{met}; no checkpoint was written yet: "
              f"starting the run again from step 0{LATE if late else ''}")
    run.event(0, "restart", reason, restart=number, max_restarts=limit, cause=cause, failure=failure.record(),
              checkpoint=None, started_over=True, redone=failure.last_step, **({"late": True} if late else {}),
              **({"superseded_metrics": superseded} if superseded else {}), **({"incidents_kept": kept} if kept else {}))
    console.say(reason)
    return Launch(False, run_dir)


def _who(cause: dict[str, Any] | None, number: int) -> str:
    """"rank 1 (pid 4242) was killed by SIGKILL; its last line: '...'" or what is known without a launcher's word."""
    if not cause:
        own = "" if os.environ.get(RUN_DIR_NOTE_ENV) else (
            "; a torchrun of your own does not say which rank died nor how: its own log above does")
        return f"a process of the run ended (torchrun restarted the ranks: restart count {number}{own})"
    rank = f"rank {cause['rank']}" if cause.get("rank") is not None else "a process"
    pid = f" (pid {cause['pid']})" if cause.get("pid") else ""
    last = (f"; its last line: {cause['last_line']!r}" if cause.get("last_line") else
            f"; then {cause['peer_line']!r}" if cause.get("peer_line") else "")
    return f"{rank}{pid} {describe_exit(exitcode(cause))}{last}"


