"""Cost of a stabletrain checkpoint against plain torch.save / torch.load of the same state.

The state is the default gpt task's ``Trainer.state_dict()`` after two steps (so AdamW has its
moments). Rounds interleave the two so drift in disk or CPU speed hits both alike; medians are
reported. A manager save = finiteness check + write + fsync (file, meta.json, directories) + verify
(sha256 re-read, weights_only mmap load, finiteness) + LAST_GOOD + prune; a manager load = sha256 +
weights_only load + finiteness. Plain save/load do none of that (no fsync, default weights_only load).

    python bench/checkpoint.py [--rounds 7] [--dir /path/on/the/disk/to/measure]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stabletrain import Trainer, load_config
from stabletrain.checkpoint import CheckpointManager
from stabletrain.config import config_hash, config_to_dict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    args = parser.parse_args()

    cfg = load_config(None, ["task=gpt", "log.progress=false", "log.tensorboard=false", "train.max_steps=2"])
    trainer = Trainer(cfg)
    trainer.fit()
    state = trainer.state_dict()
    meta = {"config": config_to_dict(cfg), "config_hash": config_hash(cfg)}
    num_params = sum(p.numel() for p in trainer.params)

    work = Path(tempfile.mkdtemp(prefix="stabletrain-bench-", dir=args.dir))
    try:
        manager = CheckpointManager(work / "checkpoints", keep=2)
        plain = work / "plain.pt"
        times: dict[str, list[float]] = {"manager_save": [], "plain_save": [], "manager_load": [], "plain_load": []}
        parts: dict[str, list[float]] = {}
        for step in range(1, args.rounds + 1):
            t0 = time.perf_counter()
            res = manager.save(state, step, meta)
            times["manager_save"].append(time.perf_counter() - t0)
            for k, v in res.timings.items():
                parts.setdefault(k, []).append(v)

            t0 = time.perf_counter()
            torch.save(state, plain)
            times["plain_save"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            manager.load()
            times["manager_load"].append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            torch.load(plain)
            times["plain_load"].append(time.perf_counter() - t0)
        size = res.num_bytes
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"state: gpt default ({num_params / 1e6:.2f} M params, AdamW moments), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {args.rounds} interleaved rounds, medians, dir {work.parent}")
    print(f"checkpoint size: state.pt {size / 2**20:.2f} MiB (plain torch.save: same bytes, it is torch.save)")
    print(f"save: manager {med['manager_save'] * 1e3:8.1f} ms   plain {med['plain_save'] * 1e3:8.1f} ms   "
          f"ratio {med['manager_save'] / med['plain_save']:.2f}x")
    print("      manager save = " + ", ".join(f"{k.removesuffix('_s')} {statistics.median(v) * 1e3:.1f} ms"
                                          for k, v in parts.items()))
    print(f"load: manager {med['manager_load'] * 1e3:8.1f} ms   plain {med['plain_load'] * 1e3:8.1f} ms   "
          f"ratio {med['manager_load'] / med['plain_load']:.2f}x")


if __name__ == "__main__":
    main()
