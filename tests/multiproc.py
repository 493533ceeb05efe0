"""Starting real processes from the tests: the CLI and torchrun, with tests/ importable and one thread each."""

import json
import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
FAST = ["log.progress=false", "log.tensorboard=false"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def env() -> dict[str, str]:
    """The environment for a child: tests/ on PYTHONPATH (task factories, workers), one thread per process."""
    return {**os.environ, "PYTHONPATH": str(TESTS) + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


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
