"""Starting a run's processes and restarting them: torchrun for ``dist.nproc > 1``, a supervisor for one process.

No torch here: a launcher or a supervisor never holds it (its memory, its import time), only the ranks do.

Three ways a run is launched, and who restarts it when one of its processes dies (``run.max_restarts``)::

    stabletrain train dist.nproc=2 ...         launch(): torchrun's elastic agent, --max-restarts N
                                               (stabletrain.distributed.elastic: torchrun that says why)
    stabletrain train run.max_restarts=3 ...   supervise(): this process starts the run as its child and
                                               starts it again when it dies
    torchrun --max-restarts=3 -m stabletrain   your torchrun restarts the ranks; they resume by themselves

Either way the restarted process finds the run's LAST_GOOD and continues from it, and its rank 0 decides whether the
restart may go ahead (:mod:`stabletrain.services.restarts`: the same failure again, a checkpoint that is not trusted).
What the launcher knows of the death (the exit code or signal, the rank, its pid, the last line it printed, when)
reaches the restarted processes in their environment (:data:`RESTART_ENV`, a JSON list of every death so far:
:func:`death_record`). A death once the restarts are used up is said in one line and recorded in the run directory
as a ``stop`` (:func:`restarts_used_up`).

A run that ends with one of :data:`FINAL_EXITS` that stabletrain decided is never restarted: it finished or was stopped
by a signal (0), stabletrain refused its input (2), it refused to restart into the same failure (:data:`EXIT_GAVE_UP`), it
applied no update (:data:`EXIT_NO_UPDATE`), a restart would meet its guard's stop (:data:`EXIT_STALLED`), or it was
interrupted (130). Each but 0 counts only where the process wrote it down as it exited (``records.launches.note_final``):
the same code from the task's own ``sys.exit`` or ``os._exit`` is a crash like any other, restarted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any

from ..process import children, die_with_parent, parent_pid, process_start_time
from ..records.launches import as_parent, drop_notes, final_exit, note_stop, noted_run_dir, reached_training, stopped_outside_line
from .continuing import continue_line, from_last_good

__all__ = ["launch", "supervise", "die_with_parent", "LAUNCHER_ENV", "LAUNCH_MARK_ENV", "RESTART_ENV", "LAUNCH_START_ENV",
           "SUPERVISED_ENV", "EXIT_GAVE_UP", "EXIT_NO_UPDATE", "EXIT_STALLED", "FINAL_EXITS", "death_record", "describe_exit",
           "leave_word",
           "process_start_time", "restart_backoff_s", "quick_deaths", "QUICK_DEATH_S", "restarted_by_parent", "UNSHARED_STORE",
           "under_torchrun", "resume_command", "default_run_dir", "with_death", "RUN_DIR_NOTE_ENV", "note_run_dir",
           "run_dir_note",
           "restarts_used_up", "sweep_orphans"]

#: Set by :func:`launch` for torchrun and so its ranks: the launcher's pid (a rank checks its parent's parent).
LAUNCHER_ENV = "STABLETRAIN_LAUNCHER_PID"
#: The same pid, kept by every process of the launch (a rank pops :data:`LAUNCHER_ENV`): what :func:`sweep_orphans` reads.
LAUNCH_MARK_ENV = "STABLETRAIN_LAUNCH"
#: A restarted process's environment: what the launcher knows of the death it restarts after (JSON).
RESTART_ENV = "STABLETRAIN_RESTART"
#: When (seconds since the epoch) the first launch's outermost stabletrain process started: its goodput counts from there.
LAUNCH_START_ENV = "STABLETRAIN_LAUNCH_START"
#: Set in the child of :func:`supervise`: it trains, and leaves the restarting to its parent.
SUPERVISED_ENV = "STABLETRAIN_SUPERVISED"
#: Exit codes of a run that refused to restart into the same failure again (the launchers then stop too), of one that
#: trained to train.max_steps and applied no update (every step skipped: again would too), and of one the guard stopped
#: as stalled or on fp16 skips no loss scale fixes (its guard's ``final_stop``: a restart would meet the same stop).
EXIT_GAVE_UP, EXIT_NO_UPDATE, EXIT_STALLED = 3, 4, 5
#: Exit codes after which a run is never restarted (see the module docstring).
FINAL_EXITS = (0, 2, EXIT_GAVE_UP, EXIT_NO_UPDATE, EXIT_STALLED, 130)
#: For a torchrun that restarts its ranks: a rendezvous store of their own per attempt. The store torchrun's agent shares
#: with them by default outlives an attempt, and a restart's ranks can read the addresses of the attempt before and fail
#: to connect (gloo: "connectFullMesh failed ... Connection refused"; pytorch/pytorch#135712, seen with torch 2.13 here).
UNSHARED_STORE = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
#: Set by a launcher that restarts the run (:func:`supervise`, :mod:`.elastic`) for its processes: a file where the one
#: that opens the run directory writes its path (:func:`note_run_dir`), for the launcher to record there a death it
#: does not restart (:func:`restarts_used_up`).
RUN_DIR_NOTE_ENV = "STABLETRAIN_RUN_DIR_NOTE"


def under_torchrun() -> bool:
    """Return whether this process was started by torchrun (or another env:// launcher) with > 1 process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def default_run_dir(cfg: Any, task_name: str | None = None) -> Path:
    """``runs/<task name>-<timestamp>``: the task's ``Task.name`` when known, else the config's task spec.

    Under a torchrun that may restart the ranks (``--max-restarts`` > 0), ``runs/<task spec>-<torchrun's run id>``
    instead: the restarted ranks must find the run their predecessors started.
    """
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0) > 0:
        return Path("runs") / f"{cfg.task.split(':')[-1].replace('/', '_')}-{run_id}"
    name = (task_name or cfg.task.split(":")[-1]).replace("/", "_").replace(":", "_")
    return Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"


def restarted_by_parent() -> bool:
    """Whether a parent restarts this process when it dies: :func:`supervise`'s child, or a rank of torchrun's."""
    return bool(os.environ.get(SUPERVISED_ENV)) or "TORCHELASTIC_RUN_ID" in os.environ


#: A restarted attempt that died sooner than this after it started is a quick death: the wait before the next grows.
QUICK_DEATH_S = 10.0


def restart_backoff_s(quick: int) -> float:
    """Seconds to wait before a restart, after ``quick`` restarted attempts in a row that died within :data:`QUICK_DEATH_S`.

    None before the first restart and after a restarted attempt that ran longer (``quick`` 0: a failure after a
    healthy stretch; every second waited is lost goodput, and the dead process's resources are already freed);
    then 1, 2, 4, ... s, at most 30 s, while the restarts keep dying in their start-up (a port, a device, a file
    system not yet back). A restart that cannot help is stopped by what the run's record shows
    (:mod:`stabletrain.services.restarts`), not by this wait.
    """
    return 0.0 if quick <= 0 else min(2.0 ** (quick - 1), 30.0)


def quick_deaths(quick: int, lived_s: float, *, restarted: bool, trained: bool = False) -> int:
    """The count of quick deaths in a row (:func:`restart_backoff_s`) after an attempt that lived ``lived_s`` seconds;
    ``restarted``: the attempt was itself a restart (a first attempt's death, however soon, counts none); ``trained``:
    it got through its start-up (its fit began: ``records.launches.reached_training``): a death in training is none."""
    return quick + 1 if restarted and lived_s < QUICK_DEATH_S and not trained else 0


def describe_exit(code: int) -> str:
    """``"was killed by SIGKILL"`` for a negative exit code (a signal), else ``"exited with code N"``."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def death_record(code: int, *, rank: int | None, pid: int | None, restart: int | None, max_restarts: int,
                 last_line: str | None = None, by: str, when: float | None = None,
                 peer_line: str | None = None) -> dict[str, Any]:
    """What :data:`RESTART_ENV` holds for each death (:func:`with_death`): how a process of the run ended, and which
    restart follows.

    ``code``: its exit code (negative: the signal that killed it); ``rank``: its global rank (None: unknown);
    ``restart``: the number of the restart that follows (1 for the first; None: none, they are used up); ``by``: who
    saw it (the supervisor, torchrun); ``when``: when it was seen to end (default: now); ``peer_line``: what another
    rank that failed with it said ("rank 1: ...").
    """
    return {"exitcode": code, "signal": signal.Signals(-code).name if code < 0 and -code in _SIGNALS else None,
            "rank": rank, "pid": pid, "last_line": last_line, "restart": restart, "max_restarts": max_restarts,
            "by": by, "time": round(when if when is not None else time.time(), 3),
            **({"peer_line": peer_line} if peer_line else {})}


_SIGNALS = {s.value for s in signal.Signals}

#: The deaths :data:`RESTART_ENV` keeps (the newest): enough for every restart of a run.
DEATHS_KEPT = 64


def with_death(held: str | None, record: dict[str, Any]) -> str:
    """:data:`RESTART_ENV`'s new value: the deaths it ``held`` (a JSON list) and ``record`` after them.

    Every death, not only the last: a restarted process that dies in its own start-up records nothing, and the
    one restarted after it records each restart the run went through (:mod:`stabletrain.services.restarts`).
    """
    try:
        deaths = json.loads(held) if held else []
    except ValueError:
        deaths = []
    deaths = deaths if isinstance(deaths, list) else [deaths]
    return json.dumps([*deaths, record][-DEATHS_KEPT:])


#: Whether this thread trains for ``stabletrain train`` (the command line) rather than a script's own ``Trainer``.
BY_THE_CLI: ContextVar[bool] = ContextVar("stabletrain_by_the_cli", default=False)


def resume_command(run_dir: str | Path | None) -> str:
    """How to resume ``run_dir`` once this launch stops: as it was launched. Under a torchrun of the user's own (no
    stabletrain launcher named in the environment) the same torchrun command, which a plain ``--resume`` on one process
    is refused as (a trial was told the plain one); else stabletrain's. A script's own Trainer (not the command line:
    :data:`BY_THE_CLI`) is resumed by the script, its Trainer made with ``resume=True``."""
    if not BY_THE_CLI.get():
        return (f"the script again{' under the same torchrun command' if under_torchrun() else ''}, its "
                f"Trainer(cfg, run_dir={str(run_dir)!r}, resume=True)")
    if under_torchrun() and not os.environ.get(RUN_DIR_NOTE_ENV):
        return f"the same torchrun command ({os.environ['WORLD_SIZE']} processes) with --resume {run_dir}"
    return f"stabletrain train --resume {run_dir}"


def note_run_dir(path: str | Path) -> None:
    """Tell the launcher that restarts this process which run directory it opened (:data:`RUN_DIR_NOTE_ENV`), once: the
    first one a process of the run opens is the run's (a trial's opened after it is not). Never raises."""
    note = os.environ.get(RUN_DIR_NOTE_ENV)
    with contextlib.suppress(OSError):
        if note and not Path(note).read_text(encoding="utf-8").strip():
            Path(note).write_text(str(Path(path).resolve()), encoding="utf-8")


def run_dir_note(env: Any) -> Path:
    """A new empty file for :func:`note_run_dir`, named in ``env`` (the run's processes' environment); the launcher
    removes it when the run ends. One ``env`` names already (:func:`launch`'s, for torchrun's agent) is kept."""
    if env.get(RUN_DIR_NOTE_ENV) and env.get(LAUNCHER_ENV) == str(os.getppid()) and Path(env[RUN_DIR_NOTE_ENV]).is_file():
        return Path(env[RUN_DIR_NOTE_ENV])
    fd, name = tempfile.mkstemp(prefix="stabletrain-run-dir-")
    os.close(fd)
    env[RUN_DIR_NOTE_ENV] = name
    return Path(name)


def restarts_used_up(death: dict[str, Any], note: Path, *, who: str) -> int:
    """Say in one line that ``who`` died (``death``: its :func:`death_record`) and the run's restarts are used up, record it
    as a ``stop`` event in the run directory named in ``note`` (where one was); return 1, or 128 + the killing signal."""
    from .. import console
    from ..records.jsonl import read_jsonl
    from ..records.rundir import RunDir

    code, limit, pid, last = death["exitcode"], death["max_restarts"], death.get("pid"), death.get("last_line")
    run_dir, step, told = noted_run_dir(note), None, None
    if run_dir is not None:  # its last record: the metrics lines, and the events since the last launch began
        events = read_jsonl(run_dir / "events.jsonl")[0]
        marks = [i for i, e in enumerate(events) if e.get("kind") in ("restart", "resume")]
        records = [*read_jsonl(run_dir / "metrics.jsonl")[0], *events[marks[-1] if marks else 0:]]
        step = max((r["step"] for r in records if isinstance(r.get("step"), int)), default=0)
        told = next((e for e in reversed(events[marks[-1] if marks else 0:]) if e.get("kind") in ("crash", "stop")), None)
    if told and not limit:  # a rank recorded and said its own crash (or stop): nothing to add, no second record
        return 1 if code >= 0 else 128 - code
    died = f"{who}{f' (pid {pid})' if pid else ''} {describe_exit(code)}{f' (its last line: {last!r})' if last else ''}"
    line = (f"{died}, and its {limit} restart(s) are used up (run.max_restarts={limit}); not restarted again" if limit else
            f"{died}; not restarted (run.max_restarts=0)")
    why = str((told or {}).get("reason", "")).removeprefix("stopping: ")  # (a crash, a signal's stop: to resume; the
    if run_dir is not None and told:  # guard's stop, resumed as it is, may stop there again: each is the record)
        resumable = told["kind"] == "crash" or why.startswith("stopped by ") or bool(told.get("task_exit"))
        line += (f"; its {told['kind']} is recorded in {run_dir / 'events.jsonl'}{continue_line(run_dir)}" if resumable else
                 f"; the guard stopped it{'' if last and why in last else f' ({why})'}, recorded in "
                 f"{run_dir / 'events.jsonl'}: read why before resuming it as it is (it may stop there again)")
    elif run_dir is not None:  # (not "restart refused: ...", a launch that refused: the goodput counts those)
        try:
            run = RunDir(run_dir, resume=True)
            try:
                run.event(step or 0, "stop", (f"the run's {limit} restart(s) were used up (run.max_restarts={limit}) when "
                          f"{died}; not restarted again" if limit else f"{died}; not restarted (run.max_restarts=0)")
                          + (f"; a resume continues{kept}" if (kept := from_last_good(run_dir)) else ""), cause=death)
            finally:
                run.close()
            line += f". Recorded in {run_dir / 'events.jsonl'} (its last record: step {step})"
        except (OSError, ValueError) as err:  # (a full disk): the line still says it
            line += f". Not recorded in {run_dir} ({type(err).__name__}: {err})"
        line += continue_line(run_dir)
    console.error(line)
    return 1 if code >= 0 else 128 - code


def sweep_orphans(launcher: int) -> list[int]:
    """SIGKILL what a launch left behind: processes that carry its mark (:data:`LAUNCH_MARK_ENV` = ``launcher``) and are no
    longer under it (a killed rank's DCP checkpoint process and its resource tracker, reparented, holding the console's
    pipe). Returns their pids. ``/proc`` only (Linux); a process whose environment cannot be read is not ours."""
    parents = {int(e.name): parent_pid(int(e.name)) for e in (Path("/proc").glob("[0-9]*") if Path("/proc").is_dir() else [])}
    tree = {launcher}
    while more := {p for p, pp in parents.items() if pp in tree} - tree:  # the launcher's descendants
        tree |= more
    mark, killed = f"{LAUNCH_MARK_ENV}={launcher}".encode(), []
    for pid in set(parents) - tree:
        try:
            if mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        except OSError:  # gone, or not ours to read
            continue
    return killed


def leave_word(err: BaseException) -> None:
    """Under torchrun: write ``err``'s first line to the rank's error file (``TORCHELASTIC_ERROR_FILE``), for its agent.

    torchrun reads it when the rank exits: its failure table shows it, and :mod:`.elastic` hands it to the
    restarted ranks as the failed rank's last line. Nothing without torchrun's variable; never raises.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or isinstance(err, (KeyboardInterrupt, SystemExit)):
        return
    text = str(err).strip().splitlines()
    with contextlib.suppress(OSError):
        Path(path).write_text(json.dumps({"message": f"{type(err).__name__}: {text[0] if text else ''}"[:500],
                                          "timestamp": int(time.time())}))


def launch(nproc: int, argv: list[str], *, max_restarts: int = 0) -> int:
    """Run torchrun (``--standalone --nproc_per_node NPROC``) on ``-m stabletrain ARGV``; return its exit code.

    ``max_restarts`` > 0: torchrun's elastic agent restarts every rank when one dies, at most that many times
    (``--max-restarts``), through :mod:`stabletrain.distributed.elastic`, which tells the restarted ranks what died
    (without restarts too: a rank's refusal or death ends in its own line, not in torchrun's traceback). torchrun runs
    in a session of its own, so a terminal's Ctrl-C reaches the launcher alone: SIGTERM and SIGINT are passed on once,
    to the ranks themselves (each checkpoints at the boundary they agree on and exits 0, so the agent ends as a
    finished launch; torchrun's agent, which would signal them again and call the stop a failure, only where no rank
    has started yet, or :data:`GRACE_S` after the ranks ended without the agent ending). A launcher killed outright
    (SIGKILL) takes torchrun and the ranks with it (:func:`die_with_parent`). An agent that dies of a signal itself is
    said, with how to continue (the run directory rank 0 named: :func:`note_run_dir`)."""
    cmd = [sys.executable, "-m", "stabletrain.distributed.elastic", "--standalone", f"--nproc_per_node={nproc}",
           f"--max-restarts={max_restarts}", "-m", "stabletrain", *argv]
    launcher = os.getpid()
    env = {**os.environ, LAUNCHER_ENV: str(launcher), LAUNCH_MARK_ENV: str(launcher), **as_parent()}
    env.setdefault(LAUNCH_START_ENV, str(process_start_time() or time.time()))
    note = run_dir_note(env)  # (where rank 0 names its run directory: for the line of an agent killed outright)
    if max_restarts:
        env.setdefault(*UNSHARED_STORE)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # In the child between fork and exec (the launcher runs no other thread): the mark survives the exec.
    proc = subprocess.Popen(cmd, env=env, preexec_fn=lambda: die_with_parent(parent=launcher), start_new_session=True)

    sent: list[int] = []
    # A stop asked for while no rank runs after some did: the run finished and the agent is ending (it exits 0 by
    # itself), or the agent is between restarts (it is told after GRACE_S): (signal, when)
    pending: list[tuple[int, float]] = []
    seen = [False]  # ranks were found running

    def deliver(signum: int) -> bool:
        ranks = children(proc.pid)
        for pid in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
        seen[0] = seen[0] or bool(ranks)
        return bool(ranks)

    def forward(signum: int, frame: Any) -> None:
        sent.append(signum)
        note_stop(note, signum)  # for the agent: ranks outside their loop die of it, asked for
        if deliver(signum):  # the ranks
            return
        if seen[0]:
            pending.append((signum, time.monotonic()))
            return
        with contextlib.suppress(ProcessLookupError):  # none started yet: the agent
            os.kill(proc.pid, signum)

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            try:
                code = proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                if pending and time.monotonic() - pending[0][1] > GRACE_S:  # not ending by itself: a restart's gap
                    with contextlib.suppress(ProcessLookupError):  # (once, the first asked for: its ranks in start-up
                        os.kill(proc.pid, pending[0][0])  # may not take a signal yet; the agent stops them)
                    pending.clear()
                elif not seen[0]:
                    deliver(0)  # (signal 0: only looks)
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        # No process of the launch outlives it (only at its end: a tracker's service a rank started detached, e.g.
        # reparented by its own double fork, is the run's while it runs)
        sweep_orphans(launcher)
        run_dir = note.read_text(encoding="utf-8").strip() if note.is_file() else ""
        drop_notes(note)
    from .. import console

    if code < 0 and -code in sent:  # the stop asked for where no rank was running to take it
        when = "between torchrun's restarts of the ranks" if seen[0] else "before the ranks started"
        console.say(f"stopped by {signal.Signals(-code).name} {when}", sys.stderr)
        return 128 + -code
    if code < 0:  # the agent itself died of a signal (its ranks with it): no restart can come from it
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        console.error(f"torchrun's agent (pid {proc.pid}) was killed by {name}; its ranks stopped with it and nothing "
                      f"restarts them. Continue the run: the same command with run.resume=auto (or stabletrain train "
                      f"--resume {run_dir or 'RUN_DIR'})")
        return 128 + -code
    return code


#: How often the launcher looks for its ranks (``/proc``) and for a stop it holds.
POLL_S = 0.5
#: A stop asked for after the ranks ended is held this long for the agent to end by itself (a finished run), then sent.
GRACE_S = 3.0


#: How a restarted child starts its output (its restart's own line, its resume's): not the last line a death quotes.
_ANNOUNCED = (b"stabletrain: restart ", b"stabletrain: resumed from ")


class _Tee(threading.Thread):
    """Copy a child's output stream to ours as it comes (bytes, unchanged), keeping its last line (not the line that
    announces its own restart: a child killed in its start-up printed nothing else, and quoting that line nested
    every earlier restart's text into the next)."""

    def __init__(self, source: Any, fd: int, lines: list[str]) -> None:
        super().__init__(daemon=True)
        self.source, self.fd, self.lines = source, fd, lines

    def run(self) -> None:
        from .. import console

        tail = b""
        while True:
            try:
                chunk = os.read(self.source.fileno(), 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            with contextlib.suppress(OSError):
                os.write(self.fd, chunk)
            tail = (tail + chunk)[-4096:]
            done = [line for line in tail.replace(b"\r", b"\n").split(b"\n")[:-1]
                    if line.strip() and not line.startswith(_ANNOUNCED)]
            heads = [line for line in done if line[:1] not in (b" ", b"\t", b"(")]  # not a message's continuation
            if done:
                self.lines.append(console.clipped((heads or done)[-1].decode("utf-8", "replace").strip()))
                del self.lines[:-1]


def supervise(argv: list[str], *, max_restarts: int) -> int:
    """Train ``stabletrain ARGV`` in a child process; start it again when it dies, at most ``max_restarts`` times.

    The one-process counterpart of torchrun's elastic agent. The child's stdout and stderr pass through
    this process unchanged (so the child draws no progress bar: it prints a line per log interval), which
    keeps the last line it printed for the restart's record. A child that ends with one of :data:`FINAL_EXITS`
    it decided is not restarted (the module docstring); nor is one after this process got SIGTERM or SIGINT,
    which it passes on (the child checkpoints and stops). Before a restart it waits :func:`restart_backoff_s` (none
    before the first, nor after a restarted child that ran :data:`QUICK_DEATH_S` or longer or reached its fit).
    The child dies with this process (:func:`die_with_parent`), in a session of its own, so a terminal's
    Ctrl-C reaches it once, through here. Returns the child's exit code (1 once the restarts are used up).
    """
    me = os.getpid()
    stopping: list[int] = []  # the stops asked for
    sent: list[int] = []  # those passed on to a child
    busy = [False]  # pass_on() running (a stop's handler may run inside it, between two of its bytecodes)
    env = {**os.environ, SUPERVISED_ENV: "1", "PYTHONUNBUFFERED": "1", **as_parent(),
           LAUNCH_START_ENV: os.environ.get(LAUNCH_START_ENV) or str(process_start_time() or time.time())}
    env.pop(RESTART_ENV, None)
    note = run_dir_note(env)
    restart = quick = 0
    proc: subprocess.Popen | None = None

    def forward(signum: int, frame: Any) -> None:
        stopping.append(signum)
        pass_on()

    def pass_on() -> None:  # each stop once to the child (one that came while it was being started: once it is known)
        if busy[0]:  # a handler inside pass_on: the running one sends its stop (it reads stopping again before it ends)
            return
        busy[0] = True
        try:
            while proc is not None and proc.returncode is None and len(sent) < len(stopping):  # (not to one that died)
                sent.append(stopping[len(sent)])
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(sent[-1])
        finally:
            busy[0] = False
        if proc is not None and proc.returncode is None and len(sent) < len(stopping):  # (one after its last look)
            pass_on()

    old = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            lines: list[str] = []
            started = time.time()
            proc = subprocess.Popen([sys.executable, "-m", "stabletrain", *argv], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, start_new_session=True,
                                    preexec_fn=lambda: die_with_parent(parent=me))
            pass_on()
            tees = [_Tee(proc.stdout, sys.stdout.fileno(), lines), _Tee(proc.stderr, sys.stderr.fileno(), lines)]
            for tee in tees:
                tee.start()
            code = proc.wait()
            ended = time.time()
            for tee in tees:  # a grandchild (a DataLoader worker) may hold the pipes a moment longer
                tee.join(timeout=5)
            if code < 0 and -code in stopping:  # the stop asked for, taken by a child still in its start-up
                from .. import console

                console.say(stopped_outside_line(-code, ranks=False), sys.stderr)
                return 128 - code
            if stopping or code in FINAL_EXITS and final_exit(note, proc.pid, code):
                return code
            if restart >= max_restarts:
                return restarts_used_up(death_record(
                    code, rank=0, pid=proc.pid, restart=None, max_restarts=max_restarts, last_line=lines[-1] if lines
                    else None, by="stabletrain's supervisor", when=ended), note, who="the run's process")
            restart += 1
            env[RESTART_ENV] = with_death(env.get(RESTART_ENV), death_record(
                code, rank=0, pid=proc.pid, restart=restart, max_restarts=max_restarts,
                last_line=lines[-1] if lines else None, by="stabletrain's supervisor", when=ended))
            env.pop(LAUNCH_START_ENV, None)  # a restarted child's own start is its launch's
            quick = quick_deaths(quick, ended - started, restarted=restart > 1,
                                 trained=reached_training(noted_run_dir(note), started))
            time.sleep(restart_backoff_s(quick))
            if stopping:
                return code
    finally:
        drop_notes(note)
        for sig, handler in old.items():
            signal.signal(sig, handler)
