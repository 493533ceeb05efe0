"""What a stabletrain checkpoint blocks training for, against plain torch.save / torch.load of the same state.

The state is the default gpt task's ``Trainer.state_dict()`` after two steps (so AdamW has its
moments). Rows, each a median over interleaved rounds (drift in disk or CPU speed hits all alike):

* blocked, manager: ``CheckpointManager.save_async`` until it returns = the finiteness check + the
  staging copy into reused host buffers; the write, fsync, verification, LAST_GOOD and pruning then run
  in a background thread (waited for off the clock, before the next row).
* blocked, in the loop: ``CheckpointKeeper.save`` as the fit loop calls it = the above plus building
  ``state_dict()`` and the meta; compared with ``torch.save(trainer.state_dict())`` (which builds it too).
* plain torch.save of the same state (no fsync, no verification): the target is blocked <= 1.1x this.
* the staging copy alone and the finiteness check alone (the two parts of the blocked time).
* in the background: write + fsync, verify (sha256 re-read, weights_only mmap load, finiteness), prune.
* synchronous ``CheckpointManager.save`` (everything inline: what training waited for before).
* load: manager (sha256 + weights_only load + finiteness) against plain torch.load.

    python bench/checkpoint.py [--rounds 9] [--dir /path/on/the/disk/to/measure]
    python bench/checkpoint.py --quick      # smoke run: a smaller gpt, 2 rounds (not a measurement)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from overhead import QUICK_ARGS, load_average  # bench/ is the script's directory

from stabletrain import Trainer, load_config
from stabletrain.records.checkpoint.files import first_nonfinite
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.records.staging import StateStager
from stabletrain.config import config_hash, config_to_dict


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a smaller gpt, 2 rounds (not a measurement)")
    args = parser.parse_args()
    overrides = QUICK_ARGS["gpt"] if args.quick else []
    rounds = 2 if args.quick else args.rounds

    work = Path(tempfile.mkdtemp(prefix="stabletrain-bench-", dir=args.dir))
    try:
        cfg = load_config(None, ["task=gpt", *overrides, "log.progress=false", "log.tensorboard=false",
                                 "train.max_steps=2", "ckpt.every=0", "eval.every=0"])
        trainer = Trainer(cfg, run_dir=work / "run")
        trainer.fit()
        state = trainer.state_dict()
        meta = {"config": config_to_dict(cfg), "config_hash": config_hash(cfg)}
        num_params = sum(p.numel() for p in trainer.params)
        manager = CheckpointManager(work / "checkpoints", keep=2)
        sync_manager = CheckpointManager(work / "sync", keep=2)
        keeper, fit_state = trainer.keeper, trainer.state
        stager = StateStager()
        plain = work / "plain.pt"
        rows = ("blocked_manager", "blocked_keeper", "plain_save", "plain_save_with_state_dict", "stage", "check",
                "sync_save", "manager_load", "plain_load")
        times: dict[str, list[float]] = {k: [] for k in rows}
        background: dict[str, list[float]] = {}

        def timed(key: str, fn):
            t0 = time.perf_counter()
            out = fn()
            times[key].append(time.perf_counter() - t0)
            return out

        step = 10
        for _ in range(rounds):
            step += 1
            pending = timed("blocked_manager", lambda: manager.save_async(state, step, meta))
            res = pending.result()  # off the clock
            for k in ("write_s", "verify_s", "prune_s"):
                background.setdefault(k, []).append(res.timings[k])
            fit_state.step = step
            timed("blocked_keeper", lambda: keeper.save(fit_state, True))
            keeper.finished(wait=True)
            timed("plain_save", lambda: torch.save(state, plain))
            timed("plain_save_with_state_dict", lambda: torch.save(trainer.state_dict(), plain))
            timed("stage", lambda: stager.stage(state))
            timed("check", lambda: first_nonfinite(state, ("model", "optimizer")))
            timed("sync_save", lambda: sync_manager.save(state, step, meta))
            timed("manager_load", lambda: manager.load())
            timed("plain_load", lambda: torch.load(plain))
        size = res.num_bytes
        trainer.run.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    bg = {k: statistics.median(v) * 1e3 for k, v in background.items()}
    print(f"state: gpt{' (quick: smaller)' if args.quick else ' default'} ({num_params / 1e6:.2f} M params, AdamW "
          f"moments), state.pt {size / 2**20:.2f} MiB; torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{rounds} interleaved rounds, medians, dir {work.parent}; {load_average()}")
    print(f"blocked, manager.save_async   {med['blocked_manager']:8.1f} ms   plain torch.save {med['plain_save']:8.1f} ms"
          f"   ratio {med['blocked_manager'] / med['plain_save']:.2f}x (target <= 1.1)")
    print(f"blocked, in the loop (keeper)  {med['blocked_keeper']:8.1f} ms   torch.save(state_dict()) "
          f"{med['plain_save_with_state_dict']:8.1f} ms   ratio {med['blocked_keeper'] / med['plain_save_with_state_dict']:.2f}x")
    print(f"  of which: staging copy alone {med['stage']:.1f} ms, finiteness check alone {med['check']:.1f} ms")
    print(f"  in the background: write+fsync {bg['write_s']:.1f} ms, verify {bg['verify_s']:.1f} ms, "
          f"prune {bg['prune_s']:.1f} ms")
    print(f"synchronous manager.save (all inline) {med['sync_save']:8.1f} ms   ratio "
          f"{med['sync_save'] / med['plain_save']:.2f}x plain torch.save")
    print(f"load: manager {med['manager_load']:8.1f} ms   plain {med['plain_load']:8.1f} ms   "
          f"ratio {med['manager_load'] / med['plain_load']:.2f}x")


if __name__ == "__main__":
    main()
