"""The checkpoint writer process: writes, verifies and installs what a background save staged, beside training.

A background save (:meth:`~.manager.CheckpointManager.save_async`) blocks training only for one copy
of the state into shared memory (:mod:`.arena`); then this process checks the copy's finiteness,
pickles and writes state.pt and meta.json, fsyncs, verifies, renames, moves LAST_GOOD and prunes, the
same code as a synchronous save (:meth:`~.manager.CheckpointManager.write_staged`). A thread in the
training process did this before, its Python under training's GIL: a Python-bound loop waited for the
writer's pickling (the mlp, a core free: +8 ms per save against +1.4-3.4 ms from this process). A
process has a GIL of its own; at nice +10 it costs training the CPU it uses (~20 ms per save of the
default gpt's 9.7 MiB), which is all it costs where training leaves a core free, and what it takes
from training where training keeps every core busy (docs/benchmarks.md, Checkpoints).

One writer per training process, started at its first background save (``python -m
stabletrain.records.checkpoint.writer_main``: a fresh interpreter, ~1 CPU-second to import torch, once),
shared by every :class:`~.manager.CheckpointManager` of the process, fed over a socket pair: once per
shared block its file descriptor (``SCM_RIGHTS``), once per layout change the slots' shapes and dtypes,
and per save the skeleton, step and meta (a few KB). Replies come back tagged with their request.

Lifetime. The writer never outlives the training process: it exits when its parent is gone (the
kernel's ``PR_SET_PDEATHSIG`` where the parent's main thread started it, and a watch of its parent
pid every 0.2 s everywhere), at the parent's exit (:func:`close_writer`, at exit) and on the socket's
EOF. It ignores SIGINT and SIGTERM, which a terminal or a scheduler sends to the whole process group:
training answers them with a last checkpoint, which this process writes. A writer that dies (killed,
out of memory) during a save is a failed save, reported once (:class:`WriterDied`); the next save starts another.
One that dies between saves is said once (:attr:`Writer.ready`, asked before a save) and costs no save.
A writer that hangs alive (a disk that never answers) is waited for, as a thread would be.
"""

from __future__ import annotations

import atexit
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ... import console
from ...process import arm_death_signal

__all__ = ["Writer", "WriterDied", "writer", "running_writer", "close_writer", "exit_with_parent", "WRITER_MODULE",
           "WRITER_NICENESS", "READY_ID"]

WRITER_MODULE = "stabletrain.records.checkpoint.writer_main"  # the writer process's entry point
#: How much lower (in nice steps) the writer runs than training, where the OS allows it.
WRITER_NICENESS = 10
_PARENT_POLL_S = 0.2
_RANK_VARS = frozenset(("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                        "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT"))
_HEADER = struct.Struct("<Q")
#: The id of the writer's first message, sent once its imports are done: it serves from then on (requests count from 1).
READY_ID = 0


class WriterDied(RuntimeError):
    """The writer process ended while a save was in flight (or could not be reached)."""


# -- framing: a length, then a pickle (both ends are this module: the pickles are our own) ------------

def send(sock: socket.socket, obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)))
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """Read exactly ``n`` bytes; None on EOF (the other end is gone)."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def recv(sock: socket.socket) -> Any:
    """Read one message; None on EOF."""
    head = _recv_exact(sock, _HEADER.size)
    if head is None:
        return None
    body = _recv_exact(sock, _HEADER.unpack(head)[0])
    return None if body is None else pickle.loads(body)


# -- the training process's side -----------------------------------------------------------------------

class Writer:
    """The training process's handle on its writer process: send requests, collect replies by id.

    Thread-safe: a save's sender may be a helper thread (waiting for CUDA copies or DCP shards first).
    """

    def __init__(self) -> None:
        import stabletrain

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Not a rank: torchrun's variables stay with training (whatever reads them must not take this for one).
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS and not k.startswith("TORCHELASTIC_")}
        root = str(Path(stabletrain.__file__).resolve().parents[1])  # this stabletrain, whatever sys.path said
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["OMP_NUM_THREADS"] = "1"  # it computes nothing in parallel: no thread pool to spin on training's cores
        main = threading.current_thread() is threading.main_thread()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", WRITER_MODULE, str(theirs.fileno()), str(os.getpid()), "1" if main else "0"],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL)
        except OSError as err:
            ours.close()
            raise WriterDied(f"the checkpoint writer process could not be started ({err})") from err
        finally:
            theirs.close()
        self.sock = ours
        self.owner = os.getpid()
        self.dead: str | None = None  # why it is gone, once it is
        self._send_lock, self._recv_lock = threading.Lock(), threading.Lock()
        self._replies: dict[int, dict[str, Any]] = {}
        self._ids = 0
        self._drops: list[int] = []  # shared blocks released here, to release there with the next message
        self._ready = False  # its READY_ID message came: it imported what it needs and serves

    @property
    def ready(self) -> bool:
        """Whether the writer serves already (a fresh interpreter imports torch first: ~1-2 s). Never blocks."""
        if self.gone():
            return False
        if not self._ready:
            try:
                self._ready = self.poll(READY_ID) is not None
            except WriterDied:
                return False
        return self._ready

    def gone(self) -> bool:
        """Whether the process has ended. Asked before a save (none in flight: the manager waits for the last), so one that
        ended unnoticed died idle (killed, out of memory): said once, and no save is sent to it."""
        if self.dead is None and self.proc.poll() is not None:
            self._died()
            console.warn(f"{self.dead} between saves, none in flight (nothing lost); the next save starts another")
        return self.dead is not None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _next_id(self) -> int:
        self._ids += 1
        return self._ids

    def add_block(self, size: int, fd: int) -> int:
        """Hand the writer a shared block (its ``fd``, ``size`` bytes); return the id requests name it by."""
        with self._send_lock:
            bid = self._next_id()
            self._guarded(lambda: (send(self.sock, {"op": "block", "id": bid, "size": size}),
                                   socket.send_fds(self.sock, [b"F"], [fd])))
        return bid

    def drop_block(self, bid: int) -> None:
        """Let the writer unmap block ``bid`` (with the next message). Never blocks: safe from a finalizer."""
        self._drops.append(bid)

    def submit(self, request: dict[str, Any]) -> int:
        """Send a save request; return its id. Raises :class:`WriterDied` when the writer is gone."""
        with self._send_lock:
            rid = self._next_id()
            drops, self._drops = self._drops, []
            self._guarded(lambda: send(self.sock, {**request, "op": "save", "rid": rid, "drop": drops}))
        return rid

    def poll(self, rid: int) -> dict[str, Any] | None:
        """The reply to request ``rid`` if it has come, else None. Never blocks; raises WriterDied if the writer is gone."""
        if rid in self._replies:
            return self._replies.pop(rid)
        if not self._recv_lock.acquire(blocking=False):
            return None  # another thread is reading: it files this reply too
        try:
            while self.dead is None and select.select([self.sock], [], [], 0)[0]:
                self._read_one()
        finally:
            self._recv_lock.release()
        if rid in self._replies:
            return self._replies.pop(rid)
        if self.dead is not None:
            raise WriterDied(self.dead)
        return None

    def wait(self, rid: int) -> dict[str, Any]:
        """Wait for the reply to request ``rid``; raises WriterDied if the writer ends first."""
        while True:
            with self._recv_lock:
                if rid in self._replies:
                    return self._replies.pop(rid)
                if self.dead is not None:
                    raise WriterDied(self.dead)
                self._read_one()

    def _read_one(self) -> None:
        try:
            msg = recv(self.sock)
        except OSError:
            msg = None
        if msg is None:
            self._died()
        else:
            self._replies[msg["rid"]] = msg

    def _guarded(self, send: Any) -> None:
        if self.dead is not None:
            raise WriterDied(self.dead)
        try:
            send()
        except OSError as err:
            self._died()
            raise WriterDied(self.dead) from err

    def _died(self) -> None:
        """Note that the writer is gone, and reap it (a zombie would look alive to whoever checks its pid)."""
        if self.dead is not None:
            return
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # it closed its end and lives on: make sure it is gone
            self.proc.kill()
            code = self.proc.wait()
        how = (f"killed by {signal.Signals(-code).name}" if code < 0 and -code in signal.valid_signals()
               else f"exited with code {code}")
        self.dead = f"the checkpoint writer process (pid {self.proc.pid}) {how}"
        self.sock.close()

    def close(self, timeout: float = 10.0) -> None:
        """Ask the writer to finish and exit (it has no save in flight: the manager waited); kill it if it does not."""
        if self.dead is None:
            try:
                with self._send_lock:
                    send(self.sock, {"op": "exit"})
                self.proc.wait(timeout=timeout)
            except (OSError, subprocess.TimeoutExpired, KeyboardInterrupt):  # (a second Ctrl-C at exit: go now)
                self.proc.kill()
                self.proc.wait()
            self.dead = f"the checkpoint writer process (pid {self.proc.pid}) was closed"
            self.sock.close()


_lock = threading.Lock()
_writer: Writer | None = None


def writer() -> Writer:
    """This process's writer, started if there is none (or it died). Raises WriterDied when it cannot start."""
    global _writer
    with _lock:
        current = _writer
        if current is None or current.owner != os.getpid() or current.gone():  # (a fork's child: its own)
            current = _writer = Writer()
        return current


def running_writer() -> Writer | None:
    """This process's writer if it runs now (a test or a bench reads its pid), else None. Starts nothing."""
    current = _writer
    return current if current is not None and current.dead is None and current.owner == os.getpid() else None


def close_writer() -> None:
    """Stop this process's writer, if it runs (at exit; a test that counts processes may call it)."""
    global _writer
    with _lock:
        current, _writer = _writer, None
    if current is not None and current.owner == os.getpid():
        current.close()


atexit.register(close_writer)


# -- both ends -------------------------------------------------------------------------------------------

def exit_with_parent(parent: int, *, kernel_signal: bool = False) -> None:
    """Make this process exit when ``parent`` is gone: a thread polls our parent pid every 0.2 s.

    ``kernel_signal``: also arm Linux's ``PR_SET_PDEATHSIG`` (SIGKILL at once), which fires when the parent
    *thread* that started us exits: only for a process started from its parent's main thread.
    Exits at once when ``parent`` is already gone.
    """
    if kernel_signal:
        arm_death_signal()
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(_PARENT_POLL_S)
            if os.getppid() != parent:  # reparented: the training process is gone
                os._exit(1)

    threading.Thread(target=watch, name="stabletrain-parent-watch", daemon=True).start()
