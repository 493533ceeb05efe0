"""What one remedy search costs (``stabletrain remedy``), in training steps, on the default gpt task's incident.

A gpt run whose training sample N carries a NaN loss weight (bench/sentinel.py's (b): the same planted
incident) is captured and diagnosed by the loop; then :func:`stabletrain.remedy_search.search_remedies` replays
it under every candidate that fits its class and the skip-step baseline, over the incident's window and
K windows after it. Its wall time is divided by the run's median healthy step (the steps the run itself
took before the incident, on this machine, under its load). Stated bound: about (K + 1) x candidates
steps plus one load; a candidate that fails stops at its first bad step, so a search is often cheaper.

    python bench/remedy.py                # default gpt, K = 20: about 1 minute on 2 idle CPU cores, more under load
    python bench/remedy.py --steps 5 --quick   # smoke run (smaller gpt), not a measurement
"""

from __future__ import annotations

import argparse
import copy
import itertools
import statistics
import sys
import tempfile
import time
from pathlib import Path

from overhead import load_average  # bench/ is the script's directory
from sentinel import IncidentClock, WeightedChunks, weighted_lm_loss

from stabletrain import Trainer, load_config, resolve_task
from stabletrain.data import EpochOrder
from stabletrain.remedy_search import format_table, search_remedies


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="K: windows replayed after the incident's (default 20)")
    ap.add_argument("--bad-step", type=int, default=12, help="the step whose batch holds the planted NaN")
    ap.add_argument("--quick", action="store_true", help="a smaller gpt (smoke run, not a measurement)")
    args = ap.parse_args()
    small = ["task_args.n_layer=2", "task_args.n_embd=64", "task_args.seq_len=64", "task_args.max_bytes=400000"]
    overrides = ["task=gpt", "device=cpu", "log.progress=false", "log.tensorboard=false", "log.every=5",
                 *(small if args.quick else [])]
    cfg = load_config(None, [*overrides, f"train.max_steps={args.bad_step + 1}", "run.overwrite=true"])
    task = resolve_task(cfg.task, cfg.task_args)
    order = EpochOrder(len(task.train_data), cfg.train.batch_size, cfg.seed, cfg.data.shuffle)
    bad_index = order.micro_batches(0)[args.bad_step - 1][3]  # the 4th sample of step bad_step's batch
    nan_task = copy.copy(task)
    nan_task.model = copy.deepcopy(task.model)
    nan_task.train_data = WeightedChunks(task.train_data, bad_index)
    nan_task.loss = weighted_lm_loss
    nan_task.val_data = None
    with tempfile.TemporaryDirectory() as tmp:
        clock = IncidentClock()
        Trainer(cfg, task=nan_task, run_dir=Path(tmp) / "nan", callbacks=[clock]).fit()
        incident = Path(tmp) / "nan" / "incidents" / f"step_{args.bad_step:06d}"
        if not (incident / "diagnosis.json").exists():
            sys.exit(f"no incident diagnosed at {incident}")
        step = statistics.median(b - a for a, b in itertools.pairwise(clock.stamps[2:args.bad_step - 1]))
        t0 = time.perf_counter()
        record = search_remedies(incident, nan_task, steps=args.steps, device="cpu")
        total = time.perf_counter() - t0
    print(format_table(record))
    n = len(record["candidates"])
    t = record["timings"]
    print(f"planted NaN weight in training sample {bad_index} (step {args.bad_step}); median healthy step "
          f"{step * 1e3:.1f} ms")
    print(f"remedy search: {total:.2f} s = {total / step:.1f} steps for {n} candidates x (K + 1) = {n * (args.steps + 1)} "
          f"steps at most ({t['steps_replayed']} replayed; load {t['load_s'] / step:.1f} steps)  [{load_average()}]",
          flush=True)


if __name__ == "__main__":
    main()
