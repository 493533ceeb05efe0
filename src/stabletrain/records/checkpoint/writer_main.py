"""The checkpoint writer process's side (``python -m stabletrain.records.checkpoint.writer_main FD PARENT MAIN``).

See :mod:`.writer` for what it does and how long it lives. It answers the training process's requests on
the socket it was handed (``FD``): a shared block (its descriptor follows the request), a save (the
skeleton to fill with the block's slots, then :meth:`~.manager.CheckpointManager.write_staged`), exit.
"""

from __future__ import annotations

import mmap
import os
import pickle
import signal
import socket
import sys
import time
from typing import Any

from .writer import READY_ID, WRITER_NICENESS, exit_with_parent, recv, send

__all__ = ["serve", "main"]


def _lower_priority() -> None:
    try:
        os.nice(WRITER_NICENESS)
    except OSError:  # refused (a sandbox): it runs as training does
        pass


def serve(sock: socket.socket) -> None:
    """Answer requests until told to exit or the socket closes (the writer process's main loop)."""
    import torch

    torch.set_num_threads(1)
    from .arena import fill_slots, slot_tensors
    from .files import CheckpointError
    from .manager import CheckpointManager

    blocks: dict[int, list[Any]] = {}  # id -> [mmap, slot tensors of its current layout]
    send(sock, {"rid": READY_ID})  # imported: serving from now on (a save meanwhile is written by training itself)

    def drop(bid: int) -> None:
        entry = blocks.pop(bid, None)
        if entry is not None:
            entry[1] = None
            try:
                entry[0].close()
            except BufferError:
                pass

    while True:
        msg = recv(sock)
        if msg is None or msg["op"] == "exit":
            return
        if msg["op"] == "block":
            _, fds, _, _ = socket.recv_fds(sock, 1, 1)
            try:
                blocks[msg["id"]] = [mmap.mmap(fds[0], msg["size"]), None]
            finally:
                os.close(fds[0])
            continue
        for bid in msg["drop"]:
            drop(bid)
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            entry = blocks[msg["block"]] if msg["block"] is not None else [None, []]
            if msg["specs"] is not None and entry[0] is not None:
                entry[1] = slot_tensors(entry[0], msg["specs"])
            state = fill_slots(pickle.loads(msg["skeleton"]), entry[1])
            manager = CheckpointManager(msg["root"], msg["keep"], require_finite=msg["require_finite"])
            result = manager.write_staged(state, msg["step"], msg["meta"], dict(msg["timings"]),
                                          tmp=msg.get("tmp"), dcp=msg.get("dcp"), check=True)
            del state
            reply: dict[str, Any] = {"rid": msg["rid"], "result": result, "wall_s": time.perf_counter() - t0,
                                     "cpu_s": time.process_time() - cpu0}
        except Exception as err:  # noqa: BLE001  (every failure is the save's, told to the training process)
            path = getattr(err, "path", None)
            reply = {"rid": msg["rid"], "error": type(err).__name__, "message": str(err),
                     "path": str(path) if path is not None else None, "problems": list(getattr(err, "problems", [])),
                     "checkpoint_error": isinstance(err, CheckpointError)}
        send(sock, reply)


def main(argv: list[str]) -> None:
    fd, parent, from_main = int(argv[0]), int(argv[1]), argv[2] == "1"
    exit_with_parent(parent, kernel_signal=from_main)
    for sig in (signal.SIGINT, signal.SIGTERM):  # meant for training, which saves once more: we write that save
        signal.signal(sig, signal.SIG_IGN)
    _lower_priority()
    try:
        serve(socket.socket(fileno=fd))
    except (OSError, EOFError):  # the socket broke: the training process is gone (killed) or has given up on us
        # Quietly: a traceback here lands on the training process's console, where a restart's line quoted it as the
        # dead rank's last words. The training process, if alive, reports a writer that died as a failed save.
        os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
