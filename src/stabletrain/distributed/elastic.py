"""torchrun, telling the ranks it restarts what died: ``python -m stabletrain.distributed.elastic TORCHRUN_ARGS``.

The same command line as ``torchrun`` (``python -m torch.distributed.run``), the same elastic agent
(:class:`~torch.distributed.elastic.agent.server.local_elastic_agent.LocalElasticAgent`, ``--max-restarts``),
with two things added where the agent checks on its workers (``_monitor_workers``, the method an agent
subclass implements; :func:`stabletrain.internals.restarting_agent`):

- when a worker has failed and the agent will restart the group, the failure it saw first (its global
  rank, pid, exit code or signal, and when) joins the deaths before it in the agent's environment
  (:data:`RESTART_ENV`), which the restarted workers inherit; then it waits :func:`restart_backoff_s` (none before the first
  restart, nor after restarted workers that ran :data:`~.launch.QUICK_DEATH_S` or longer: the survivors,
  whose collectives fail at once on a dead peer, have left or are stopped by the agent's SIGTERM, and an
  in-flight checkpoint of theirs is waited for as they exit);
- a worker that exits with one of :data:`FINAL_EXITS` that stabletrain decided (it refused its input, or refused to
  restart into the same failure again: written down as it exited, ``records.launches.note_final``) ends the restarts:
  the agent stops as when ``--max-restarts`` is used up (the same code from the task's own ``sys.exit`` is a crash);
- each attempt's ranks get a rendezvous store of their own (:data:`~.launch.UNSHARED_STORE`);
- a failure once the restarts are used up ends in one line that names the rank that died first, recorded in the run
  directory as a ``stop`` (:func:`~.launch.restarts_used_up`), not in torchrun's traceback.

``stabletrain train dist.nproc=N run.max_restarts=K`` runs this. Where torch no longer has the pieces
this relies on (:func:`agent_class` checks them), it says so in one line and runs plain torchrun: the
restarts still happen, their records then say less about the cause.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .. import console
from ..internals import InternalMissing, end_restarts, restarting_agent, restarts_left, use_elastic_agent
from ..records.launches import asked_stop, drop_notes, final_exit, noted_run_dir, reached_training, stopped_outside_line
from .last_line import printed_last
from .launch import (
    EXIT_GAVE_UP,
    EXIT_NO_UPDATE,
    EXIT_STALLED,
    FINAL_EXITS,
    LAUNCH_START_ENV,
    RESTART_ENV,
    RUN_DIR_NOTE_ENV,
    UNSHARED_STORE,
    death_record,
    quick_deaths,
    restart_backoff_s,
    restarts_used_up,
    run_dir_note,
    with_death,
)

__all__ = ["agent_class", "main"]


def agent_class() -> type:
    """Return the agent class torchrun should use (a LocalElasticAgent subclass).

    Raises :class:`~stabletrain.internals.InternalMissing` where torch lacks what it relies on (torchrun's agent
    built from a module-level name, its check on its workers, its count of restarts left: see the internals).
    """
    restarts_seen = quick = 0
    started = time.time()

    def failed(agent: Any, max_restarts: int, failures: dict[int, Any]) -> None:
        nonlocal restarts_seen, quick, started
        note = os.environ.get(RUN_DIR_NOTE_ENV)  # (the launcher's: where rank 0 names the run directory)
        asked = {-sig for sig in asked_stop(Path(note) if note else None)}
        if any(_final(f, note) or f.exitcode in asked for f in failures.values()):
            end_restarts(agent)  # the run refused (restarting would meet the same refusal), or the stop asked for
            return
        if restarts_left(agent) <= 0:
            return
        restarts_seen += 1
        rank, first = min(failures.items(), key=lambda item: _secondary(item[1]))
        os.environ[RESTART_ENV] = with_death(os.environ.get(RESTART_ENV), death_record(
            first.exitcode, rank=rank, pid=first.pid, restart=restarts_seen, max_restarts=max_restarts,
            by="torchrun (stabletrain.distributed.elastic)", when=time.time(),
            last_line=_last_line(first), peer_line=_peer_line(failures, rank)))
        os.environ.pop(LAUNCH_START_ENV, None)  # the restarted ranks' launch starts with them
        quick = quick_deaths(quick, time.time() - started, restarted=restarts_seen > 1,
                             trained=reached_training(noted_run_dir(Path(note) if note else None), started))
        time.sleep(restart_backoff_s(quick))
        started = time.time()

    return restarting_agent(failed)


def _final(failure: Any, note: Path | str | None) -> bool:
    """Whether a worker's exit ends the run: one of :data:`FINAL_EXITS` that stabletrain decided (not its task's own)."""
    return failure.exitcode in FINAL_EXITS and final_exit(note, getattr(failure, "pid", None), failure.exitcode)


def _secondary(failure: Any) -> int:
    """How likely a failure is the consequence of another (0: a root cause, such as a signal no one here sent).

    torchrun's own ``SIGTERM`` stops the ranks that were still running; a rank that lost its peer says so
    (:class:`~stabletrain.distributed.peers.PeerLostError`, through its error file).
    """
    if failure.exitcode < 0:
        return 2 if -failure.exitcode == signal.SIGTERM else 0
    return 2 if (_message(failure) or "").startswith("PeerLostError") else 1


def _peer_line(failures: dict[int, Any], root: int) -> str | None:
    """What another failed rank said (its error file) when it lost rank ``root``: a SIGKILLed rank says nothing, and
    its peer's line tells where the run was ('... after step 57')."""
    said = [(rank, _message(f)) for rank, f in sorted(failures.items()) if rank != root]
    # (a lost peer's where and when, without its advice to resume or restart: a trial's line ran on to '... comi...')
    said = [(rank, text.split("; ")[0] if text and text.startswith("PeerLostError") else text) for rank, text in said]
    return next((text if f"rank {rank}:" in text else f"rank {rank}: {text}" for rank, text in said if text), None)


def _last_line(failure: Any) -> str | None:
    """The failed worker's last line: its error message, or, where it exited with a code and left none (a task's own
    ``sys.exit``), the last line it printed (:mod:`.last_line`). A worker killed by a signal said nothing of its death."""
    printed = printed_last(os.environ.get(RUN_DIR_NOTE_ENV), failure.pid) if failure.exitcode >= 0 else None
    return _message(failure) or printed


def _message(failure: Any) -> str | None:
    """The failed worker's own error message, when it left one in torchrun's error file."""
    data = getattr(failure, "error_file_data", None) or {}
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    text = str(message).strip() if message else ""
    return console.clipped(text.splitlines()[-1]) if text and text != "<NONE>" else None


def main(argv: list[str] | None = None) -> None:
    """Run torchrun's command line with :func:`agent_class`'s agent."""
    from torch.distributed import run as torchrun

    os.environ.setdefault(*UNSHARED_STORE)  # a restart's ranks must not read the attempt before's addresses
    try:
        use_elastic_agent(agent_class())
    except InternalMissing as err:
        restarts = " (restarts still happen; their records say less about the cause)" if torchrun.parse_args(
            argv).max_restarts else ""
        print(f"stabletrain: warning: {err}; running plain torchrun{restarts}", file=sys.stderr, flush=True)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    note = run_dir_note(os.environ)  # rank 0 names its run directory there (the ranks inherit this environment)
    for name in ("api", "errors.error_handler"):
        logging.getLogger(f"torch.distributed.elastic.multiprocessing.{name}").addFilter(_said_here)
    try:
        torchrun.main(argv)
    except ChildFailedError as err:
        final = told_exit(err, lambda failure: _final(failure, note))
        failures = getattr(err, "failures", None) or {}
        asked = [-f.exitcode for f in failures.values() if -f.exitcode in asked_stop(note)]  # the launcher passed a stop
        if final is None and asked:  # on: ranks outside their training loop (start-up, end) died of it, no handler there
            console.say(stopped_outside_line(asked[0], ranks=True), sys.stderr)
            sys.exit(128 + asked[0])
        if final is None and failures and not any(_final(f, note) for f in failures.values()):
            rank, first = min(failures.items(), key=lambda item: _secondary(item[1]))  # the restarts are used up
            final = restarts_used_up(death_record(
                first.exitcode, rank=rank, pid=first.pid, restart=None, max_restarts=torchrun.parse_args(argv).max_restarts,
                by="torchrun (stabletrain.distributed.elastic)", last_line=_last_line(first),
                peer_line=_peer_line(failures, rank)), note, who=f"rank {rank}")
        if final is None:
            raise
        sys.exit(final)  # its exit code, without torchrun's banner of a failure the rank has told already
    finally:
        drop_notes(note)


def _said_here(record: logging.LogRecord) -> bool:
    """Keep the agent's log lines but those about a failure that a rank's own line or this launcher's says already:
    "failed (exitcode: 2) local_rank: 0 ...", the error file's format notes, "Sending process N closing signal"."""
    text = record.getMessage()
    return not (record.name.endswith("error_handler") or text.startswith("failed (exitcode") or "closing signal" in text)


def told_exit(err: Any, decided: Any = lambda failure: True) -> int | None:
    """The exit code of a launch whose ranks refused (their input: 2, or to restart into the same failure: 3), or were
    interrupted by a second Ctrl-C (130), and said so; None where another rank crashed as well (torchrun's table of
    failures is then what tells it). ``decided(failure)``: whether stabletrain decided a failure's code (:func:`_final`):
    one it did not is the task's own exit, a crash."""
    failures = getattr(err, "failures", {}).values()
    stopped = {-signal.SIGTERM, -signal.SIGINT}
    codes = {getattr(f, "exitcode", None) if f.exitcode in stopped or decided(f) else 1 for f in failures}
    told = (EXIT_GAVE_UP, 2, EXIT_NO_UPDATE, EXIT_STALLED, 130)
    final = next((code for code in told if code in codes), None)
    return final if final is not None and codes <= {*told, *stopped} else None


if __name__ == "__main__":
    main()
