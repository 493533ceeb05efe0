"""A torchrun worker that runs several scenarios in turn in one 2-rank world, so tests share its start-up cost.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_world.py SCENARIOS.json RESULTS_DIR

SCENARIOS.json is a list of ``[name, "module:function", [arg, ...]]``; each function is called as
``function(args)`` on every rank, under the one process group (stabletrain's ``process_group`` yields the
group that is already there). ``stabletrain.cli:main`` runs exactly what a rank of ``stabletrain train
dist.nproc=2`` runs after the launcher and torchrun (its return value is the exit code: non-zero fails).

A torchrun world costs each process ~4-5 s of CPU before its first step (``import torch``, stabletrain, and
``torch._dynamo``, which the first ``Optimizer`` imports); a scenario in a shared world pays only its own
training. Before each scenario the global RNGs are seeded from its name, so no scenario starts from the state
another one left (a resume that failed to restore it would not find the right one there by chance).

Each rank writes ``RESULTS_DIR/NAME/rank_R.json``: ``{"ok": true}`` or ``{"ok": false, "error": traceback}``.
After a failure on any rank the remaining scenarios are not run (each gets ``{"ok": false, "error": "not run:
..."}``): a failed collective can leave the ranks out of step. Read with :class:`multiproc.World`.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import random
import sys
import traceback
import zlib
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import numpy as np
import torch
from multiproc import end_worker

from stabletrain.distributed.group import process_group


def _scramble(name: str) -> None:
    seed = zlib.crc32(name.encode())
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _write(results: Path, name: str, rank: int, outcome: dict) -> None:
    (results / name).mkdir(parents=True, exist_ok=True)
    (results / name / f"rank_{rank}.json").write_text(json.dumps(outcome))


def main(spec: str, results_dir: str) -> None:
    scenarios = json.loads(Path(spec).read_text())
    results = Path(results_dir)
    with process_group("gloo", 120.0) as ctx:
        failed = None
        for i, (name, target, args) in enumerate(scenarios):
            _scramble(name)
            module, fn = target.split(":")
            try:
                value = getattr(importlib.import_module(module), fn)(list(args))
                if isinstance(value, int) and value != 0:
                    raise RuntimeError(f"{target} returned exit code {value}")
                outcome = {"ok": True}
            except (Exception, SystemExit):
                outcome = {"ok": False, "error": traceback.format_exc()}
            sys.stdout.flush()
            _write(results, name, ctx.rank, outcome)
            gc.collect()
            try:
                failed = [o for o in ctx.gather_objects(outcome) if not o["ok"]]
            except Exception:  # noqa: BLE001 - the group is gone with the failed scenario
                failed = [{"ok": False}]
            if failed:
                for later, _, _ in scenarios[i + 1:]:
                    _write(results, later, ctx.rank, {"ok": False, "error": f"not run: scenario {name!r} failed first"})
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(1)
        end_worker()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
