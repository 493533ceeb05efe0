"""Tasks and helpers for the restart tests: a sample that cannot be read, and finding a launch's processes."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from torch.utils.data import Dataset

from stabletrain.tasks import Task


class _BadSample(Dataset):
    """``inner`` whose sample ``index`` fails when read: ``fault`` "raise" (OSError) or "kill" (SIGKILL to its reader)."""

    def __init__(self, inner: Dataset, index: int, fault: str) -> None:
        self.inner, self.index, self.fault = inner, index, fault

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        if i == self.index and self.fault == "raise":  # the same crash at the same step on every launch
            raise OSError(f"sample {i}: read error (the file is damaged)")
        if i == self.index:  # a DataLoader worker killed (the OOM killer's pick)
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return self.inner[i]


def unreadable_sample_task(bad_index: int = 45, num_samples: int = 64) -> Task:
    """The built-in mlp task whose training sample ``bad_index`` raises OSError when read."""
    from stabletrain.tasks.mlp import make_task

    task = make_task(num_samples=num_samples, width=16, depth=2)
    task.train_data = _BadSample(task.train_data, bad_index, "raise")
    return task


def killed_worker_task(index: int = 45, num_samples: int = 64) -> Task:
    """The built-in mlp task whose training sample ``index`` SIGKILLs the process that reads it (run with data.workers)."""
    from stabletrain.tasks.mlp import make_task

    task = make_task(num_samples=num_samples, width=16, depth=2)
    task.train_data = _BadSample(task.train_data, index, "kill")
    return task


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = (Path("/proc") / str(pid) / "environ").read_bytes().decode("utf-8", "replace")
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.split("\0") if "=" in kv)


def children(pid: int) -> list[int]:
    """The pids whose parent is ``pid``."""
    from multiproc import child_pids

    kids = child_pids(pid)
    if kids is not None:
        return kids
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def ranks_of(agent: int) -> dict[int, int]:
    """{global rank: pid} of the ranks torchrun's agent ``agent`` runs now (its own children, not theirs)."""
    return {int(e["RANK"]): pid for pid in children(agent) if "RANK" in (e := _environ(pid))}


def alive(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_gone(pids, timeout: float = 10.0) -> list[int]:
    """Wait up to ``timeout`` s for ``pids`` to end; return those still running."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]



def slow_start_task(sleep: float = 3.0, **kwargs) -> Task:
    """The built-in mlp task whose factory takes ``sleep`` s (a launch a test kills before its first checkpoint)."""
    from stabletrain.tasks.mlp import make_task

    time.sleep(sleep)
    return make_task(**kwargs)


class _ExitAt(Dataset):
    """``inner`` whose sample ``index``, read by rank ``rank``, ends the process with exit code ``code`` once (``marker``,
    a file, remembers it): ``sys.exit`` (a library's own exit) or, ``hard``, ``os._exit``; it prints a line first."""

    def __init__(self, inner: Dataset, index: int, code: int, marker: str, rank: int, hard: bool) -> None:
        self.inner, self.index, self.code, self.marker, self.rank, self.hard = inner, index, code, marker, rank, hard

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        import os
        import sys

        if i == self.index and int(os.environ.get("RANK", "0")) == self.rank and not Path(self.marker).exists():
            Path(self.marker).write_text("exited\n")
            print(f"TASK: exiting with code {self.code}", flush=True)
            if self.hard:
                os._exit(self.code)
            sys.exit(self.code)
        return self.inner[i]


def exit_code_task(code: int = 3, index: int = 45, marker: str = "", rank: int = 0, hard: bool = False,
                   num_samples: int = 64) -> Task:
    """The built-in mlp task whose training sample ``index`` ends the process reading it with exit code ``code``, once."""
    from stabletrain.tasks.mlp import make_task

    task = make_task(num_samples=num_samples, width=16, depth=2)
    task.train_data = _ExitAt(task.train_data, index, code, marker, rank, hard)
    return task


def factory_death_task(counter: str = "") -> Task:
    """A task whose factory ends its process (``os._exit(9)``) on every launch, before any checkpoint; each call adds a line
    to the file ``counter``."""
    import os

    with open(counter, "a", encoding="utf-8") as fh:
        fh.write("called\n")
    print("TASK: dying in the factory", flush=True)
    os._exit(9)


def exit_call_task(message: str = "", bare: bool = False, index: int = 45, marker: str = "") -> Task:
    """:func:`exit_code_task` whose sample ``index`` calls ``sys.exit(message)``, or ``sys.exit()`` where ``bare``, once."""
    from stabletrain.tasks.mlp import make_task

    task = make_task(num_samples=64, width=16, depth=2)
    task.train_data = _ExitAt(task.train_data, index, None if bare else message, marker, 0, False)
    return task
