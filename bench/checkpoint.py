"""What checkpoints cost training: interleaved windows of one run, with and without saves; and per save.

Default: the default gpt task trains ONE run whose steps are cut into windows of ``--window`` (10) steps;
the windows take turns between three checkpoint cadences, in an order rotated per round: no save,
a save every 10 steps and a save every 2 steps (``ckpt.every`` is set for each window's boundaries as
the window begins). A window's time is the wall time of its steps, each from the end of the step
before (so a boundary's work, the save included, counts in the step after it). Per round, each
cadence's window time over the no-save window's; the median over ``--rounds`` rounds is the ratio
(targets: every 10 <= 1.02x, every 2 <= 1.10x); with 10-step windows, the every-10 window is the 10 steps
after one save. One run and adjacent windows: the drift between separate runs (page cache, CPU
frequency, other processes) hits every cadence alike, and many short rounds keep a burst of another
process from deciding the median.

Per save, from the run's checkpoint events: the time the loop was blocked (``blocked_s``: the
staging copy into shared memory and the hand-over), the writer's wall time and CPU (``write_s``,
``write_cpu_s``: the writer process's, kernel time included: its finiteness check, torch.save, the CRC32,
fsyncs, verification, LAST_GOOD, pruning), a wait for it at the
next save (``waited_s``), and the slowdown of the steps it was written beside against as many before
it (``slowdown``; where saves come every 10 steps or more often, the steps before one had a save of their
own). Beside the figures, the cores used meanwhile by training, by the writer and by other processes
(/proc/stat's busy time less the first two): rows measured while others used a sizeable fraction of a
core are noise on a 2-core machine, and a writer can only be free where training leaves a core idle.

``--blocking`` adds the older micro rows: ``save_async`` until it returns against a plain
``torch.save`` of the same state, the staging copy and the finiteness check alone, a synchronous
save, and loading (medians of interleaved rounds).

    python bench/checkpoint.py [--rounds 15] [--window 10] [--dir /path/on/the/disk/to/measure]
    python bench/checkpoint.py --blocking --rounds 9
    python bench/checkpoint.py --quick      # smoke run: a smaller gpt, 2 rounds of 10 steps (not a measurement)
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
from stabletrain.callbacks import Callback
from stabletrain.config import config_hash, config_to_dict
from stabletrain.records.checkpoint import writer as writer_module
from stabletrain.records.checkpoint.files import first_nonfinite
from stabletrain.records.checkpoint.manager import CheckpointManager
from stabletrain.records.staging import StateStager

TARGETS = {10: 1.02, 2: 1.10}  # the default gpt's, per cadence (ckpt.every)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of the three windows (and of --blocking's rows)")
    parser.add_argument("--window", type=int, default=10, help="steps per window (a multiple of 10)")
    parser.add_argument("--dir", default=None, help="where to write (default: the system temp dir)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: a smaller gpt, 2 rounds (not a measurement)")
    parser.add_argument("--blocking", action="store_true", help="also the blocking micro rows")
    parser.add_argument("--task", default="gpt", help="the built-in task to train (default gpt)")
    parser.add_argument("--every", type=int, nargs=2, default=[10, 2], metavar=("A", "B"),
                        help="the two cadences (ckpt.every) beside no save; --window must be a multiple of both")
    args = parser.parse_args()
    overrides = QUICK_ARGS.get(args.task, []) if args.quick else []
    rounds = 2 if args.quick else args.rounds
    window = 10 if args.quick else args.window
    if window % 10 or any(window % every for every in args.every):
        parser.error(f"--window: a multiple of 10 (the log interval) and of --every {args.every}, got {window}")
    windows(args, overrides, rounds, window)
    if args.blocking:
        blocking(args, overrides, rounds)


def machine_busy_s() -> float | None:
    """CPU seconds every process on the machine has used since boot (/proc/stat), or None off Linux."""
    try:
        with open("/proc/stat") as fh:
            fields = [int(x) for x in fh.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> tuple[float, float]:
    """CPU seconds of this process, and of its checkpoint writer process (running: not in RUSAGE_CHILDREN)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    writer = 0.0
    current = writer_module.running_writer()
    if current is not None:
        try:
            fields = Path(f"/proc/{current.pid}/stat").read_text().rsplit(")", 1)[1].split()
            writer = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return usage.ru_utime + usage.ru_stime, writer


class Windows(Callback):
    """Sets ``ckpt.every`` for each window's boundaries and notes when each step ends."""

    def __init__(self, cfg, warmup: int, window: int, rounds: int, cadences: tuple[int, int, int]) -> None:
        self.cfg, self.warmup, self.window = cfg, warmup, window
        self.order = [cadences[(i + r) % 3] for r in range(rounds) for i in range(3)]
        self.ends: dict[int, float] = {}
        self.busy: list[float | None] = []  # machine busy and own CPU at the first window's start and the last's end
        self.own: list[tuple[float, float]] = []

    def cadence(self, step: int) -> int | None:
        """The cadence of the window holding ``step`` (None outside the windows)."""
        w = (step - self.warmup - 1) // self.window
        return self.order[w] if step > self.warmup and w < len(self.order) else None

    def on_step_end(self, state, out) -> None:
        self.ends[state.step] = time.perf_counter()
        nxt = self.cadence(state.step + 1)  # this step's boundary is timed in the next step: its window's cadence
        self.cfg.ckpt.every = nxt if nxt is not None else 10
        if state.step in (self.warmup, self.warmup + self.window * len(self.order)):
            self.busy.append(machine_busy_s())
            self.own.append(own_cpu_s())


def windows(args: argparse.Namespace, overrides: list[str], rounds: int, window: int) -> None:
    warmup = 20
    cadences = (0, *args.every)
    work = Path(tempfile.mkdtemp(prefix="stabletrain-bench-ckpt-", dir=args.dir))
    try:  # the writer process starts (a fresh interpreter imports torch: ~1 CPU-second) before the run, off the record
        CheckpointManager(work / "warm", require_finite=None).save_async({"x": torch.zeros(1)}, 0).result()
        steps = warmup + 3 * rounds * window + 1
        cfg = load_config(None, [f"task={args.task}", *overrides, "log.progress=false", f"train.max_steps={steps}",
                                 "ckpt.every=10", "eval.every=0"])
        clock = Windows(cfg, warmup, window, rounds, cadences)
        trainer = Trainer(cfg, run_dir=work / "run", callbacks=[clock])  # the same cfg object: the callback sets it
        t0 = time.perf_counter()
        trainer.fit()
        wall = time.perf_counter() - t0
        events = [json.loads(x) for x in (work / "run" / "events.jsonl").read_text().splitlines() if x.strip()]
        num_params = sum(p.numel() for p in trainer.params)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    ends = clock.ends
    step_s = {j: ends[j] - ends[j - 1] for j in ends if j - 1 in ends}
    per_round: list[dict[int, float]] = []
    for r in range(rounds):
        times = {}
        for i in range(3):
            w = 3 * r + i
            first = warmup + w * window + 1
            times[clock.order[w]] = sum(step_s[j] for j in range(first, first + window))
        per_round.append(times)
    saves = {e["step"]: e for e in events if e["kind"] == "checkpoint"}
    failed = [e for e in events if e["kind"] == "checkpoint_failed"]
    span = sum(sum(t.values()) for t in per_round)
    training, writer = ((clock.own[1][i] - clock.own[0][i]) / span for i in (0, 1))
    others = None
    if len(clock.busy) == 2 and None not in clock.busy:
        others = max(0.0, (clock.busy[1] - clock.busy[0]) / span - training - writer)
    base = statistics.median(t[0] / window for t in per_round)
    print(f"checkpoint cost, {args.task}{' (quick: smaller)' if args.quick else ' default'} ({num_params / 1e6:.2f} M params), "
          f"one run of {steps} steps ({wall:.0f} s), {rounds} rounds of 3 interleaved {window}-step windows; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; {load_average()}")
    print(f"  cores used meanwhile: training {training:.2f}, the checkpoint writer {writer:.2f}"
          + (f", other processes {others:.2f}" if others is not None else ""))
    print(f"  no save: {base * 1e3:.1f} ms per step (median window)")
    for every in cadences[1:]:
        ratios = [t[every] / t[0] for t in per_round]
        extra = statistics.median((t[every] - t[0]) / (window // every) for t in per_round)
        target = f"; target <= {TARGETS[every]:.2f}" if every in TARGETS and args.task == "gpt" else ""
        print(f"  a save every {every:>2} steps: {statistics.median(ratios):.3f}x (rounds "
              f"{', '.join(f'{x:.3f}' for x in ratios)}{target}), +{extra * 1e3:.1f} ms per save")
    if failed:
        print(f"  FAILED saves: {len(failed)} ({failed[0]['reason']})")

    def in_cadence(every: int) -> list[dict]:
        return [e for s, e in saves.items() if clock.cadence(s + 1) == every and s + 1 in step_s]

    for every in cadences[1:]:
        got = in_cadence(every)
        if not got:
            continue
        def med(key: str, got: list[dict] = got) -> float:
            values = [e[key] for e in got if e.get(key) is not None]
            return statistics.median(values) * 1e3 if values else float("nan")

        slow = [e["slowdown"] for e in got if e.get("slowdown") is not None]
        waited = [e.get("waited_s", 0.0) for e in got]
        print(f"  per save (every {every}, {len(got)} saves, medians): blocked {med('blocked_s'):.1f} ms, writer "
              f"{med('write_s'):.1f} ms wall / {med('write_cpu_s'):.1f} ms CPU, waited for at the next save "
              f"{statistics.median(waited) * 1e3:.1f} ms (max {max(waited) * 1e3:.0f})"
              + (f"; events' slowdown of the steps it was written beside {statistics.median(slow):.3f}x" if slow else ""))
    first = cadences[1]
    if first == window:  # one save per window: the window is the steps after it
        after = [t[first] / window for t in per_round]
        print(f"  the slowdown after a save: the {window} steps after one (an every-{first} window, its blocked time "
              f"included) {statistics.median(after) * 1e3:.1f} ms per step against {base * 1e3:.1f} without "
              f"({statistics.median(t[first] / t[0] for t in per_round):.3f}x)")


def blocking(args: argparse.Namespace, overrides: list[str], rounds: int) -> None:
    """The blocking micro rows (see the module docstring)."""
    work = Path(tempfile.mkdtemp(prefix="stabletrain-bench-", dir=args.dir))
    try:
        cfg = load_config(None, ["task=gpt", *overrides, "log.progress=false", "log.tensorboard=false",
                                 "train.max_steps=2", "ckpt.every=0", "eval.every=0"])
        trainer = Trainer(cfg, run_dir=work / "run")
        trainer.fit()
        state = trainer.state_dict()
        meta = {"config": config_to_dict(cfg), "config_hash": config_hash(cfg)}
        manager = CheckpointManager(work / "checkpoints", keep=2)
        sync_manager = CheckpointManager(work / "sync", keep=2)
        stager = StateStager()
        plain = work / "plain.pt"
        rows = ("blocked_manager", "plain_save", "stage", "check", "sync_save", "manager_load", "plain_load")
        times: dict[str, list[float]] = {k: [] for k in rows}
        background: dict[str, list[float]] = {}

        def timed(key: str, fn):
            t0 = time.perf_counter()
            out = fn()
            times[key].append(time.perf_counter() - t0)
            return out

        manager.save_async(state, 1, meta).result()  # the writer process starts: off the record
        for step in range(10, 10 + rounds):
            pending = timed("blocked_manager", lambda step=step: manager.save_async(state, step, meta))
            res = pending.result()  # off the clock
            for k in ("write_s", "verify_s", "prune_s"):
                background.setdefault(k, []).append(res.timings[k])
            background.setdefault("writer", []).append(res.write_wall_s)
            background.setdefault("write_cpu", []).append(res.write_cpu_s)
            timed("plain_save", lambda: torch.save(state, plain))
            timed("stage", lambda: stager.stage(state))
            timed("check", lambda: first_nonfinite(state, ("model", "optimizer")))
            timed("sync_save", lambda step=step: sync_manager.save(state, step, meta))
            timed("manager_load", lambda: manager.load())
            timed("plain_load", lambda: torch.load(plain))
        size = res.num_bytes
        trainer.run.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    bg = {k: statistics.median(v) * 1e3 for k, v in background.items()}
    print(f"blocking rows: state.pt {size / 2**20:.2f} MiB, {rounds} interleaved rounds, medians; {load_average()}")
    print(f"  blocked, manager.save_async {med['blocked_manager']:7.1f} ms   plain torch.save {med['plain_save']:7.1f} ms   "
          f"ratio {med['blocked_manager'] / med['plain_save']:.2f}x")
    print(f"  a staging copy into private buffers alone {med['stage']:.1f} ms, the finiteness check alone {med['check']:.1f} ms")
    print(f"  the writer process: {bg['writer']:.1f} ms wall (write+fsync {bg['write_s']:.1f}, verify {bg['verify_s']:.1f}, "
          f"prune {bg['prune_s']:.1f}), {bg['write_cpu']:.1f} ms CPU per save")
    print(f"  synchronous manager.save {med['sync_save']:7.1f} ms ({med['sync_save'] / med['plain_save']:.2f}x plain torch.save)")
    print(f"  load: manager {med['manager_load']:7.1f} ms   plain {med['plain_load']:7.1f} ms   "
          f"ratio {med['manager_load'] / med['plain_load']:.2f}x")


if __name__ == "__main__":
    main()
