"""Starting real processes from the tests: the CLI and torchrun, with tests/ importable and one thread each."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).parent
FAST = ["log.progress=false", "log.tensorboard=false"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def env() -> dict[str, str]:
    """The environment for a child: tests/ on PYTHONPATH (task factories, workers), one thread per process."""
    return {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def train_cli(*args, timeout=240):
    """``python -m stabletrain train ARGS`` (with :data:`FAST`) to its end, whatever its exit code: the finished process."""
    return subprocess.run([sys.executable, "-m", "stabletrain", "train", *args, *FAST], env=env(), capture_output=True,
                          text=True, timeout=timeout)


def run(cmd, timeout=240):
    """Run ``cmd`` to completion; fail the test with the tail of its output when it exits non-zero."""
    res = subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{' '.join(map(str, cmd))}\nstdout:\n{res.stdout[-3000:]}\nstderr:\n{res.stderr[-3000:]}"
    return res


def stabletrain(*args):
    """The command line of ``stabletrain train`` without a progress bar or TensorBoard."""
    return [sys.executable, "-m", "stabletrain", "train", *FAST, *args]


def events(run_dir):
    """The run's events.jsonl as a list of dicts."""
    return [json.loads(x) for x in (Path(run_dir) / "events.jsonl").read_text().splitlines() if x.strip()]


def steps_logged(run_dir):
    """The last step metrics.jsonl records (0 before the first line; a line being written counts as not there)."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = [x for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except json.JSONDecodeError:
        return 0


def wait_for_step(proc, run_dir, step, timeout=120):
    """Wait until the run ``proc`` writes to ``run_dir`` has logged ``step``; fail if it ends or times out first."""
    t0 = time.time()
    while steps_logged(run_dir) < step:
        assert proc.poll() is None, f"the run ended before step {step}: {proc.communicate()}"
        assert time.time() - t0 < timeout, f"the run never reached step {step}"
        time.sleep(0.01)


def child_pids(pid):
    """The pids whose parent is ``pid``, from each of its threads' ``/proc/PID/task/TID/children`` (a few small reads;
    the tests poll it every 10 ms while a run trains beside them): a scan of every process's ``stat`` cost ~2 ms of CPU a
    call. None where the kernel has no such file (a scan then)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(x) for x in f.read().split()]
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"):
                return None
        except (OSError, ValueError):
            pass
    return out


def descendants(pid):
    """Return the pids of ``pid``'s descendants (from /proc: torchrun starts each rank in its own session)."""
    out, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        if kids is None:
            return _descendants_by_scan(pid)
        out += kids
        todo += kids
    return out


def _descendants_by_scan(pid):
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    out, todo = [], [pid]
    while todo:
        parent = todo.pop()
        kids = [c for c, p in parents.items() if p == parent]
        out += kids
        todo += kids
    return out


def end_worker() -> None:
    """End a torchrun test worker whose results are on disk: meet the other ranks, then exit at once.

    The interpreter's own teardown is skipped: there gloo's worker threads can still hold Python objects
    (a DDP comm hook's futures), and destroying them aborts the process ('terminate called without an
    active exception', SIGABRT; pytorch/pytorch#179291), rarely, and more often on a busy machine.
    """
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class World:
    """One 2-rank torchrun world that runs several scenarios in turn (``dist_world.py``); each test reads its own.

    ``World(root, [(name, "module:function", [args...]), ...])`` starts the world and waits for it; a
    module-scoped fixture holds it. :meth:`check` fails the test that reads a scenario which failed (its
    traceback on each rank), did not run (which one failed first) or left no result (the world's output).
    """

    def __init__(self, root, scenarios, timeout=600):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        spec = self.root / "scenarios.json"
        spec.write_text(json.dumps([[name, target, [str(a) for a in args]] for name, target, args in scenarios]))
        self.results = self.root / "results"
        self.res = subprocess.run([*TORCHRUN, str(TESTS / "dist_world.py"), str(spec), str(self.results)], env=env(),
                                  capture_output=True, text=True, timeout=timeout)

    def check(self, name):
        """Fail unless scenario ``name`` ran to the end on both ranks."""
        for rank in (0, 1):
            path = self.results / name / f"rank_{rank}.json"
            assert path.exists(), (f"scenario {name!r}: no result from rank {rank} (world exit code {self.res.returncode})"
                                   f"\nstdout:\n{self.res.stdout[-3000:]}\nstderr:\n{self.res.stderr[-3000:]}")
            outcome = json.loads(path.read_text())
            assert outcome["ok"], f"scenario {name!r} on rank {rank}:\n{outcome['error']}"


def cli(*args):
    """A :class:`World` scenario's target and arguments: what each rank of ``stabletrain train ARGS`` runs."""
    return "stabletrain.cli:main", ["train", *FAST, *args]
