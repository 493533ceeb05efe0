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
* in the background: write + fsync (state.pt's CRC32 taken as the bytes pass), verify (size, meta.json,
  the pickle scanned for what weights_only refuses; no re-read), prune; and the background thread's own CPU
  per save (``write_cpu_s``: on a machine whose cores training keeps busy, every CPU-second of it is
  taken from training).
* synchronous ``CheckpointManager.save`` (everything inline: what training waited for before).
* load: manager (CRC32 re-read + weights_only load + finiteness) against plain torch.load.
* wall time: what checkpoints cost a whole run, not only what they block. The default gpt trains
  ``--wall-steps`` (40; the issue's figures are at 60) steps with its defaults (run dir, metrics, TensorBoard, snapshot) and ``ckpt.every``
  0 (only the end's checkpoint, which every variant writes), 10 and 2; the variants take turns in each of
  ``--wall-rounds`` rounds (order rotated), ``fit()`` timed whole; each round's ratio to ckpt.every=0, and
  the median. Beside it, the blocked time the run's checkpoint events record (``blocked_s``) and the
  background CPU per save (``write_cpu_s``): the rest of the extra wall time is the background write
  competing with training for the cores. Each run also says how many cores other processes used
  meanwhile (/proc/stat's busy time less this process's CPU): wall rows measured while others used a
  sizeable fraction of a core are noise. Target <= 1.03 at every 10 steps.

    python bench/checkpoint.py [--rounds 9] [--dir /path/on/the/disk/to/measure]
    python bench/checkpoint.py --wall-only --wall-rounds 5   # only the wall-time rows
    (the default gpt takes ~0.6-1 s a step on 2 cores: the wall rows' 6 runs of 40 steps take ~4 minutes;
    --wall-rounds 3 --wall-steps 60, the issue's setting, ~9)
    python bench/checkpoint.py --quick      # smoke run: a smaller gpt, 2 rounds (not a measurement)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
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
    parser.add_argument("--wall-rounds", type=int, default=2, help="rounds of the wall-time rows (0: none)")
    parser.add_argument("--wall-steps", type=int, default=40, help="steps per wall-time run")
    parser.add_argument("--wall-only", action="store_true", help="only the wall-time rows")
    args = parser.parse_args()
    overrides = QUICK_ARGS["gpt"] if args.quick else []
    rounds = 2 if args.quick else args.rounds
    if not args.wall_only:
        blocking(args, overrides, rounds)
    if args.wall_rounds:
        wall_time(args, overrides, 2 if args.quick else args.wall_rounds)


def machine_busy_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (/proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def wall_time(args: argparse.Namespace, overrides: list[str], rounds: int) -> None:
    """The wall time of whole runs with a checkpoint every 10 and every 2 steps against only the end's (see above)."""
    variants = (0, 10, 2)
    seconds: dict[int, list[float]] = {v: [] for v in variants}
    blocked: dict[int, list[float]] = {v: [] for v in variants}
    write_cpu: dict[int, list[float]] = {v: [] for v in variants}  # background CPU per save, every save
    others: list[float] = []  # cores other processes used, per run
    saves: dict[int, int] = {}
    ratios: dict[int, list[float]] = {v: [] for v in variants[1:]}
    with tempfile.TemporaryDirectory(dir=args.dir) as warm:  # imports, first allocations: off the record
        cfg = load_config(None, ["task=gpt", *overrides, "log.progress=false", "train.max_steps=2", "eval.every=0"])
        Trainer(cfg, run_dir=Path(warm) / "run").fit()
    for r in range(rounds):
        order = variants[r % 3:] + variants[:r % 3]
        times = {}
        for every in order:
            work = Path(tempfile.mkdtemp(prefix="stabletrain-bench-wall-", dir=args.dir))
            try:
                cfg = load_config(None, ["task=gpt", *overrides, "log.progress=false", f"train.max_steps={args.wall_steps}",
                                         f"ckpt.every={every}", "eval.every=0"])
                trainer = Trainer(cfg, run_dir=work / "run")  # off the clock
                busy0, own0, t0 = machine_busy_s(), own_cpu_s(), time.perf_counter()
                trainer.fit()
                times[every] = time.perf_counter() - t0
                if busy0 is not None:
                    others.append(max(0.0, (machine_busy_s() - busy0) - (own_cpu_s() - own0)) / times[every])
                events = [json.loads(x) for x in (work / "run" / "events.jsonl").read_text().splitlines() if x.strip()]
                ckpts = [e for e in events if e["kind"] == "checkpoint"]
                saves[every] = len(ckpts)
                blocked[every].append(sum(e.get("blocked_s", 0.0) for e in ckpts))
                write_cpu[every].extend(e["write_cpu_s"] for e in ckpts if "write_cpu_s" in e)
            finally:
                shutil.rmtree(work, ignore_errors=True)
        for every in variants:
            seconds[every].append(times[every])
        for every in variants[1:]:
            ratios[every].append(times[every] / times[0])
        print(f"  wall round {r + 1}/{rounds}: " + ", ".join(f"ckpt.every={v} {times[v]:.2f} s" for v in variants)
              + (f"; others used {statistics.mean(others[-3:]):.2f} cores" if others else ""), flush=True)
    base = statistics.median(seconds[0])
    print(f"wall time, gpt{' (quick: smaller)' if args.quick else ' default'}, {args.wall_steps} steps, {rounds} "
          f"interleaved rounds, medians; {load_average()}"
          + (f"; other processes used {statistics.mean(others):.2f} cores on average (max {max(others):.2f})"
             if others else ""))
    all_cpu = [x for v in variants for x in write_cpu[v]]
    if all_cpu:
        print(f"  background CPU per save (write_cpu_s of {len(all_cpu)} saves): median {statistics.median(all_cpu) * 1e3:.1f} ms")
    print(f"  ckpt.every=0 (the end's checkpoint only): {base:.2f} s, {saves[0]} save(s), blocked "
          f"{statistics.median(blocked[0]) * 1e3:.0f} ms")
    for every in variants[1:]:
        extra = statistics.median(seconds[every]) - base
        print(f"  ckpt.every={every}: {statistics.median(ratios[every]):.3f}x (rounds {', '.join(f'{x:.3f}' for x in ratios[every])}; "
              f"target <= 1.03 at 10), {saves[every]} saves, +{extra * 1e3:.0f} ms wall, of which blocked "
              f"{(statistics.median(blocked[every]) - statistics.median(blocked[0])) * 1e3:.0f} ms")


def blocking(args: argparse.Namespace, overrides: list[str], rounds: int) -> None:
    """The blocking rows (see above)."""

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
            background.setdefault("write_cpu_s", []).append(res.write_cpu_s)
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
          f"prune {bg['prune_s']:.1f} ms (wall); the thread's own CPU {bg['write_cpu_s']:.1f} ms per save")
    print(f"synchronous manager.save (all inline) {med['sync_save']:8.1f} ms   ratio "
          f"{med['sync_save'] / med['plain_save']:.2f}x plain torch.save")
    print(f"load: manager {med['manager_load']:8.1f} ms   plain {med['plain_load']:8.1f} ms   "
          f"ratio {med['manager_load'] / med['plain_load']:.2f}x")


if __name__ == "__main__":
    main()
