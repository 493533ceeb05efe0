"""GPU check (run on a CUDA machine, in one call, under 5 minutes): bf16, fp16, fp16+SGD, an incident, a spike, DDP, FSDP2,
parity.

For each precision case it trains the default ``gpt`` task through ``Trainer``, asserts that no
host-device sync happens between log intervals (``torch.cuda.set_sync_debug_mode("error")`` armed by
a callback, :class:`SyncGuard`, for every step and lifted only for the loop's designed boundaries),
checks that loss fell and nothing was skipped beyond the fp16 scaler's warm-up, that the periodic
checkpoints were written in the background (training blocked only for the check and the staging
copy into pinned host buffers; LAST_GOOD at the last step) and that the incident snapshot lives in
pinned host memory, and prints tokens/s and the step-time ratio against a bare loop with the same
optimizer (fused AdamW, or fused SGD with momentum).

The ``snapshot`` case times the step with and without the interval's incident snapshot (its copies on a
side stream into pinned memory; the ratio is what the snapshot costs training). The ``incident`` case
plants a NaN loss weight on one sample late in a log interval: the capture must
replay from the interval's host snapshot (at most log.every - 1 steps; CUDA -> pinned, non-blocking)
and the diagnosis name the sample. The ``spike`` case weights one sample's loss x200 at step 78 (bf16): captured
as a finite spike, its counterfactual replays on the GPU must reproduce it, name that sample and verify the step without
it normal. The ``ddp`` case runs 2 processes on the one GPU (gloo: NCCL needs
a device per rank) under torchrun: one collective per step (the gradient all-reduce, carrying the
window's numbers), no host conversion between boundaries on the training thread (counted with
:class:`stabletrain.syncs.SyncCounter`: gloo's CUDA path synchronizes in its own worker thread by
design, so the CUDA sync debug mode cannot be armed there), loss falls, background checkpoints.
The ``fsdp`` case runs the same 2 processes with ``dist.strategy=fsdp`` in bf16 (FSDP2's
``MixedPrecisionPolicy``): every parameter an fp32 DTensor shard holding about half the model, a
block's forward computing on bf16 gathered weights, fp32 optimizer state, exactly the step's
documented all-reduces (the window's numbers, the global grad norm, the post-update check, and the
update norm on an interval's last step) and no other, no host conversion between boundaries, loss
falls, nothing skipped, LAST_GOOD at the last step; it prints peak memory and tokens/s.
The ``parity`` case runs ``tests/test_parity.py``'s check on this GPU: the step ``build_step`` builds and the
``Trainer`` against a hand-written torch loop (autocast, GradScaler in fp16, ``clip_grad_norm_``, fused AdamW,
warmup + cosine held on skipped steps), 50 steps with planted skips and overflows, in fp32, bf16 and fp16,
with and without accumulation: final parameters, optimizer state, lr and scaler state bitwise equal. A case
the test marks xfail (a fix waiting in step.py) is printed as a known gap, and a known gap that is bitwise now
says so; any other difference fails.

    python bench/gpu_check.py            # exits 1 on any failed assertion; 0 with a note without CUDA
    python bench/gpu_check.py --cases bf16 ddp fsdp
    python bench/gpu_check.py --cases parity
    python bench/gpu_check.py --cpu-smoke  # the script's own logic on CPU: few steps, no CUDA checks (not a GPU check)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from stabletrain import Trainer, load_config, resolve_task
from stabletrain.callbacks import Callback, RunState

STEPS = 200
CPU_SMOKE = os.environ.get("GPU_CHECK_CPU_SMOKE") == "1"  # --cpu-smoke (inherited by the ddp workers)
if CPU_SMOKE:
    STEPS = 30
#: --cpu-smoke: the device and a small gpt (appended to every case's config).
SMOKE_ARGS = (["device=cpu", "task_args.n_layer=1", "task_args.n_embd=64", "task_args.seq_len=32",
               "task_args.max_bytes=300000", "eval.batches=2"] if CPU_SMOKE else [])
COMMON = [f"train.max_steps={STEPS}", "log.every=20", "eval.every=100", "train.batch_size=32", "log.progress=false"]
#: (name, config overrides): the default optimizer (fused AdamW) in bf16 and fp16, and fused SGD under the scaler.
CASES = [
    ("bf16", ["precision=bf16"]),
    ("fp16", ["precision=fp16"]),
    ("fp16-sgd", ["precision=fp16", "optim.name=sgd", "optim.lr=0.1", "optim.momentum=0.9"]),
]


class SyncGuard(Callback):
    """Make any host-device sync between log boundaries raise: ``set_sync_debug_mode("error")`` on, except there.

    The loop syncs by design only at its boundaries: the one-time init fingerprint check and the step-0
    checkpoint before the first step, and at a log/eval/checkpoint step after its ``on_step_end``: eval,
    the interval's reduce, the guard acting on it (an incident's capture, a rollback), the checkpoint's
    finiteness check and staging (its write runs in a background thread, which touches no CUDA stream
    but its copies' events), and the next interval's incident snapshot. So the mode is lifted in
    ``on_step_end`` of such a step and armed again when the boundary's last act, the recorder's
    ``mark_interval_start``, returns (:meth:`attach` wraps it); before step 1 it is armed at the first
    ``on_step_end``. ``armed_steps`` counts the steps that ran armed, so a check that never armed is seen.
    """

    def __init__(self) -> None:
        self.armed, self.armed_steps, self.fitting = False, 0, False

    def attach(self, trainer: Trainer) -> None:
        """Arm after each interval start (the recorder's snapshot is the last thing a boundary does)."""
        recorder, mark, state = trainer.recorder, trainer.recorder.mark_interval_start, trainer.state

        def marked() -> None:
            mark()
            if self.fitting and 0 < state.step < state.cfg.train.max_steps:  # (at fit start the step-0 checkpoint follows)
                self._set(True)

        recorder.mark_interval_start = marked

    def _set(self, armed: bool) -> None:
        if not CPU_SMOKE:
            torch.cuda.set_sync_debug_mode("error" if armed else 0)
        self.armed = armed

    @staticmethod
    def _boundary(state: RunState) -> bool:
        cfg, step = state.cfg, state.step
        return (step >= cfg.train.max_steps or step % cfg.log.every == 0 or bool(cfg.eval.every and step % cfg.eval.every == 0)
                or bool(cfg.ckpt.every and step % cfg.ckpt.every == 0))

    def on_fit_start(self, state: RunState) -> None:
        self.fitting = True  # the step-0 checkpoint follows; armed at the first on_step_end

    def on_step_end(self, state: RunState, out: dict[str, Any]) -> None:
        self.armed_steps += self.armed
        if self._boundary(state):
            self._set(False)
        elif not self.armed:
            self._set(True)

    def on_fit_end(self, state: RunState, record: dict[str, Any]) -> None:
        self.fitting = False
        self._set(False)


def bare_optimizer(model: torch.nn.Module, cfg: Any) -> torch.optim.Optimizer:
    """The config's optimizer, fused, written out by hand (weight decay on matrices only, as stabletrain does)."""
    o = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    if o.name == "sgd":
        return torch.optim.SGD(groups, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov, fused=True)
    if o.name == "adam":
        return torch.optim.Adam(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)
    return torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, fused=True)


def bare_step_time(task: Any, cfg: Any, steps: int) -> float:
    model = copy.deepcopy(task.model).cuda()
    opt = bare_optimizer(model, cfg)
    scaler = torch.amp.GradScaler("cuda") if cfg.precision == "fp16" else None
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float16
    bs = cfg.train.batch_size
    batches = [torch.utils.data.default_collate([task.train_data[i] for i in range(b * bs, (b + 1) * bs)]) for b in range(8)]
    batches = [[t.cuda(non_blocking=True) for t in b] for b in batches]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for s in range(steps):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=dtype):
            loss_sum, count = task.loss(model, batches[s % len(batches)])
            loss = loss_sum / count
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip.max_norm)
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / steps


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def check_background_checkpoints(name: str, trainer: Trainer, failures: list[str]) -> dict[str, Any]:
    """The periodic checkpoints were written in the background, LAST_GOOD is at the end, the snapshot is pinned."""
    events = [json.loads(x) for x in (trainer.run.path / "events.jsonl").read_text().splitlines() if x.strip()]
    saved = [e for e in events if e["kind"] == "checkpoint"]
    cfg = trainer.cfg
    want = sorted({0, cfg.train.max_steps, *range(cfg.ckpt.every or cfg.train.max_steps, cfg.train.max_steps + 1,
                                                 cfg.ckpt.every or cfg.train.max_steps)})
    if sorted(e["step"] for e in saved) != want:
        failures.append(f"{name}: checkpoints at {sorted(e['step'] for e in saved)}, expected {want}; "
                        f"events: {[e['kind'] for e in events if e['kind'].startswith('checkpoint')]}")
    good = trainer.ckpt.latest_good()
    if good is None or good.name != f"step_{cfg.train.max_steps:06d}":
        failures.append(f"{name}: LAST_GOOD names {good.name if good else None} after the run")
    # (while no writer process runs, a small step-0 save and a last one are written in the loop's thread)
    periodic = [e for e in saved if 0 < e["step"] < cfg.train.max_steps]
    if any(not e["blocked_s"] < e["seconds"] for e in periodic):
        failures.append(f"{name}: a checkpoint blocked for all of its time: {[(e['blocked_s'], e['seconds']) for e in periodic]}")
    snapshot = trainer.recorder.snapshot
    if snapshot is None or not (CPU_SMOKE or all(t.is_pinned() for t in snapshot["model"].values())):
        failures.append(f"{name}: the incident snapshot is not in pinned host memory")
    return {"ckpt_blocked_ms": round(median([e["blocked_s"] for e in saved]) * 1e3, 2),
            "ckpt_total_ms": round(median([e["seconds"] for e in saved]) * 1e3, 2)}


def guarded_trainer(cfg: Any, task: Any, run_dir: Path) -> tuple[Trainer, SyncGuard]:
    """A Trainer with a :class:`SyncGuard` attached: a host sync between log intervals raises."""
    guard = SyncGuard()
    trainer = Trainer(cfg, task=task, run_dir=run_dir, callbacks=[guard])
    guard.attach(trainer)
    return trainer, guard


def fit_guarded(trainer: Trainer, guard: SyncGuard, name: str, failures: list[str]) -> bool:
    """Run ``trainer.fit()``; a sync between log intervals is a failure (returns False)."""
    try:
        trainer.fit()
    except RuntimeError as err:
        failures.append(f"{name}: a sync between log intervals at step {trainer.step}: {err}")
        return False
    finally:
        guard._set(False)
    return True


def run_case(name: str, overrides: list[str], tmp: Path, failures: list[str]) -> None:
    cfg = load_config(None, [*overrides, *COMMON, *SMOKE_ARGS])
    task = resolve_task(cfg.task, cfg.task_args)
    bare = bare_step_time(task, cfg, 50) if not CPU_SMOKE else float("nan")
    trainer, guard = guarded_trainer(cfg, task, tmp / name)
    t0 = time.perf_counter()
    if not fit_guarded(trainer, guard, name, failures):
        return
    wall = time.perf_counter() - t0
    hist = trainer.history
    skipped = sum(r["num_skipped"] for r in hist)
    tok_s = median([r["tokens_per_s"] for r in hist[1:]])
    step_s = median([r["step_time_s"] for r in hist[1:]])
    ckpt = check_background_checkpoints(name, trainer, failures)
    print(json.dumps({"case": name, "precision": cfg.precision, "optimizer": type(trainer.optimizer).__name__,
                      "steps": trainer.step, "armed_steps": guard.armed_steps, "wall_s": round(wall, 1),
                      "first_loss": round(hist[0]["loss"], 4), "last_loss": round(hist[-1]["loss"], 4),
                      "val_loss": round(hist[-1].get("val_loss", float("nan")), 4), "skipped": skipped,
                      "loss_scale": hist[-1]["loss_scale"], "tokens_per_s": round(tok_s),
                      "step_ms": round(step_s * 1e3, 2), "bare_step_ms": round(bare * 1e3, 2),
                      "overhead_ratio": round(step_s / bare, 3), **ckpt}), flush=True)
    # Every step but the first runs armed; fewer means the guard did not check.
    if guard.armed_steps < STEPS - 2:
        failures.append(f"{name}: the sync guard was armed for only {guard.armed_steps} of {trainer.step} steps")
    if not hist[-1]["loss"] < hist[0]["loss"]:
        failures.append(f"{name}: loss did not fall ({hist[0]['loss']:.4f} -> {hist[-1]['loss']:.4f})")
    if skipped > (20 if cfg.precision == "fp16" else 0):
        failures.append(f"{name}: {skipped} skipped steps")


def planted_run(name: str, bad_step: int, position: int, weight: float, every: int, tmp: Path,
                failures: list[str]) -> tuple[Trainer, int, list[dict[str, Any]], float] | None:
    """Train the bf16 gpt to ``bad_step + 2`` with the loss of the sample at ``position`` of step ``bad_step`` weighted by
    ``weight`` (NaN: a non-finite step), under the sync guard: (trainer, that sample, the run's events, start time), or
    None when the run failed (said in ``failures``)."""
    from sentinel import WeightedChunks, weighted_lm_loss  # bench/ is the script's directory

    from stabletrain.data import EpochOrder

    cfg = load_config(None, ["precision=bf16", f"train.max_steps={bad_step + 2}", f"log.every={every}", "eval.every=0",
                             "train.batch_size=32", "log.progress=false", *SMOKE_ARGS])
    task = resolve_task(cfg.task, cfg.task_args)
    order = EpochOrder(len(task.train_data), cfg.train.batch_size, cfg.seed, cfg.data.shuffle)
    bad_index = order.micro_batches(0)[bad_step - 1][position]
    task.train_data, task.loss, task.val_data = WeightedChunks(task.train_data, bad_index, weight), weighted_lm_loss, None
    trainer, guard = guarded_trainer(cfg, task, tmp / name)
    t0 = time.perf_counter()
    if not fit_guarded(trainer, guard, name, failures):
        return None
    events = [json.loads(x) for x in (trainer.run.path / "events.jsonl").read_text().splitlines() if x.strip()]
    return trainer, bad_index, events, t0


def run_incident(tmp: Path, failures: list[str]) -> None:
    """A NaN loss weight on one sample of step 38, late in the interval (20, 40]: captured from the host snapshot."""

    from stabletrain.records.bundles import load_bundle

    bad_step, every = 38, 20
    planted = planted_run("incident", bad_step, 3, float("nan"), every, tmp, failures)
    if planted is None:
        return
    trainer, bad_index, events, t0 = planted
    incident = next((e for e in events if e["kind"] == "incident"), None)
    bundle_dir = trainer.run.path / "incidents" / f"step_{bad_step:06d}"
    found = (incident or {}).get("diagnosis", {}).get("bad_samples")
    print(json.dumps({"case": "incident", "step": (incident or {}).get("step"), "replayed_steps": trainer.recorder.replayed_steps,
                      "bad_samples": found, "planted": bad_index, "wall_s": round(time.perf_counter() - t0, 1),
                      "summary": (incident or {}).get("diagnosis", {}).get("summary")}), flush=True)
    if incident is None or not (bundle_dir / "bundle.pt").exists():
        failures.append(f"incident: not captured ({[e['kind'] for e in events]})")
        return
    if trainer.recorder.replayed_steps is None or trainer.recorder.replayed_steps > every - 1:
        failures.append(f"incident: the capture replayed {trainer.recorder.replayed_steps} steps (at most {every - 1})")
    if not found or bad_index not in found:
        failures.append(f"incident: the diagnosis named {found}, not the planted sample {bad_index}")
    if load_bundle(bundle_dir)["step"] != bad_step:
        failures.append("incident: the bundle is of another step")



def run_spike(tmp: Path, failures: list[str]) -> None:
    """A finite spike: one sample of step 78 with its loss weighted x200 (late in the interval (60, 80]), bf16. The
    capture replays from the interval's host snapshot, and the counterfactual replays on the GPU must reproduce the
    step (within bf16's tolerance), name the sample and verify that the step without it is normal."""


    bad_step, every = 78, 20
    planted = planted_run("spike", bad_step, 5, 200.0, every, tmp, failures)
    if planted is None:
        return
    trainer, bad_index, events, t0 = planted
    incident = next((e for e in events if e["kind"] == "incident"), None)
    folder = trainer.run.path / "incidents" / f"step_{bad_step:06d}"
    d = json.loads((folder / "diagnosis.json").read_text()) if (folder / "diagnosis.json").exists() else {}
    print(json.dumps({"case": "spike", "step": (incident or {}).get("step"), "anomaly": (incident or {}).get("anomaly"),
                      "replayed_steps": trainer.recorder.replayed_steps, "failure_class": d.get("failure_class"),
                      "bad_samples": d.get("bad_samples"), "planted": bad_index, "reproduces": d.get("reproduces"),
                      "without_ratio": ((d.get("samples") or {}).get("without") or {}).get("ratio"),
                      "diagnosis_s": round((d.get("timings") or {}).get("total_s", float("nan")), 2),
                      "wall_s": round(time.perf_counter() - t0, 1), "summary": d.get("summary")}), flush=True)
    if incident is None or incident.get("anomaly") != "spike" or incident["step"] != bad_step:
        failures.append(f"spike: not captured at step {bad_step} ({[(e['kind'], e['step']) for e in events]})")
        return
    if trainer.recorder.replayed_steps is None or trainer.recorder.replayed_steps > every - 1:
        failures.append(f"spike: the capture replayed {trainer.recorder.replayed_steps} steps (at most {every - 1})")
    if (d.get("failure_class"), d.get("bad_samples"), d.get("reproduces")) != ("data", [bad_index], True):
        failures.append(f"spike: diagnosed {d.get('failure_class')}, samples {d.get('bad_samples')}, reproduces "
                        f"{d.get('reproduces')}; planted sample {bad_index} ({d.get('summary')})")


def run_snapshot(tmp: Path, failures: list[str]) -> None:
    """The incident snapshot's cost: the same bf16 gpt with ``capture.memory_snapshot=true`` and ``false``, 3 rounds each.

    On CUDA the parameters' and optimizer state's copies run on the recorder's side stream (into pinned
    buffers) and the optimizer step waits for them on the device: the ratio of the median step times
    (``step_time_s`` of the intervals after the first) is what the snapshot costs training.
    """
    steps, every = (60 if not CPU_SMOKE else 20), 10
    times: dict[str, list[float]] = {"true": [], "false": []}
    stream = pinned = None
    for r in range(3):
        for snap in (("true", "false") if r % 2 == 0 else ("false", "true")):
            cfg = load_config(None, ["precision=bf16", f"train.max_steps={steps}", f"log.every={every}", "eval.every=0",
                                     "ckpt.every=0", "train.batch_size=32", "log.progress=false",
                                     f"capture.memory_snapshot={snap}", *SMOKE_ARGS])
            trainer, guard = guarded_trainer(cfg, resolve_task(cfg.task, cfg.task_args), tmp / f"snapshot-{snap}-{r}")
            if not fit_guarded(trainer, guard, "snapshot", failures):
                return
            times[snap].append(median([h["step_time_s"] for h in trainer.history[1:]]))
            if snap == "true":
                recorder = trainer.recorder
                stream = recorder.engine.snapshot._stream is not None  # the IntervalSnapshot's side stream (CUDA)
                held = recorder.snapshot or {}
                pinned = all(t.is_pinned() for t in held.get("model", {}).values()) if not CPU_SMOKE else None
    on, off = median(times["true"]), median(times["false"])
    print(json.dumps({"case": "snapshot", "step_ms_snapshot": round(on * 1e3, 2), "step_ms_without": round(off * 1e3, 2),
                      "ratio": round(on / off, 3), "side_stream": stream, "pinned": pinned}), flush=True)
    if not CPU_SMOKE and not (stream and pinned):
        failures.append(f"snapshot: expected the copies on a side stream into pinned memory (side_stream={stream}, "
                        f"pinned={pinned})")


#: The loop's designed sync points (frames): a host conversion outside all of them is a stray sync.
SYNC_BOUNDARIES = ("_log", "evaluate", "save", "on_fit_start", "on_main", "mark_interval_start",
                   "run_init_signal")  # (the step-0 signal report on the first batch, once: log.init_signal)
DDP_STEPS = 60 if not CPU_SMOKE else 40
DDP_ARGS = ["precision=bf16", "device=cuda", "dist.backend=gloo", f"train.max_steps={DDP_STEPS}", "log.every=20",
            "ckpt.every=20", "eval.every=0", "train.batch_size=16", "accum.steps=2", "log.progress=false"]


def fit_counting(trainer: Trainer, depth: int = 12) -> tuple[list[tuple[int, list[str]]], list[Any]]:
    """Run ``trainer.fit()``; return its ``dist.all_reduce`` calls and its stray host conversions on this thread.

    An all-reduce is (the trainer's step, its innermost calling frames); a stray conversion is one outside
    every frame of :data:`SYNC_BOUNDARIES` among its ``depth`` innermost.
    """
    import torch.distributed as dist

    from stabletrain.syncs import SyncCounter

    calls: list[tuple[int, list[str]]] = []
    real = dist.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:  # stabletrain looks it up at call time (none inside a step)
        calls.append((trainer.step, [f.name for f in traceback.extract_stack()[-12:]]))
        return real(*args, **kwargs)

    dist.all_reduce = counted
    try:
        with SyncCounter(lambda: trainer.step, depth=depth) as syncs:
            trainer.fit()
    finally:
        dist.all_reduce = real
    return calls, [(c.step, c.op, c.where[-4:]) for c in syncs.calls if not any(b in c.where for b in SYNC_BOUNDARIES)]


def ddp_worker(out: Path) -> None:
    """One rank of the ddp case (under torchrun): train, count collectives and host conversions, write rank 0's view."""
    import torch.distributed as dist

    from stabletrain.distributed.group import process_group

    cfg = load_config(None, [*DDP_ARGS, f"run.dir={out / 'run'}", *SMOKE_ARGS])
    with process_group(cfg.dist.backend, cfg.dist.timeout_s) as ctx:
        trainer = Trainer(cfg, run_dir=cfg.run.dir)
        group, train_step, extra = dist.group.WORLD, trainer.train_step, {}

        def counted_step(*args: Any, **kwargs: Any) -> Any:  # every collective of the step, DDP's C++ all-reduce too
            before = group._get_sequence_number_for_group()
            out = train_step(*args, **kwargs)
            data = trainer.model._get_ddp_logging_data()  # after the second step's rebuild its first bucket is capped
            buckets = len(str(data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes", "")).split(","))  # (1 MiB)
            if trainer.step != 1:  # the second step also has DDP's one-time bucket rebuild (two broadcasts)
                ran = group._get_sequence_number_for_group() - before - buckets
                extra[ran] = extra.get(ran, 0) + 1
            return out

        trainer.train_step = counted_step
        calls, stray = fit_counting(trainer)
        in_step = [w for _, w in calls if "forward_backward" in w or "update" in w]
        if ctx.is_main:
            good = trainer.ckpt.latest_good()
            (out / "rank0.json").write_text(json.dumps({
                "steps": trainer.step, "first_loss": trainer.history[0]["loss"], "last_loss": trainer.history[-1]["loss"],
                "stray_syncs": stray[:5], "num_stray_syncs": len(stray), "python_all_reduce_in_step": in_step[:3],
                "collectives_beyond_buckets": extra, "rides_a_param": trainer.step_fn.carrier.param is not None,
                "last_good": good.name if good else None}))


def run_torchrun(name: str, tmp: Path, failures: list[str]) -> dict[str, Any] | None:
    """Run this script's ``--NAME-worker`` on 2 processes on the one GPU; return rank 0's figures (None if it failed)."""
    out = tmp / name
    out.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(Path(__file__).resolve()),
           f"--{name}-worker", str(out)]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "4"})
    if res.returncode != 0:
        failures.append(f"{name}: torchrun failed ({res.returncode}): {res.stderr[-2000:]}")
        return None
    r = json.loads((out / "rank0.json").read_text())
    print(json.dumps({"case": name, **r, "wall_s": round(time.perf_counter() - t0, 1)}), flush=True)
    return r


def run_ddp(tmp: Path, failures: list[str]) -> None:
    r = run_torchrun("ddp", tmp, failures)
    if r is None:
        return
    if r["num_stray_syncs"]:
        failures.append(f"ddp: {r['num_stray_syncs']} host conversions between boundaries on the training thread: "
                        f"{r['stray_syncs']}")
    if r["python_all_reduce_in_step"] or set(r["collectives_beyond_buckets"]) != {"0"} or not r["rides_a_param"]:
        failures.append("ddp: a step ran more than DDP's own all-reduce of its buckets (the window's numbers ride a "
                        f"parameter): {r['python_all_reduce_in_step']}, {r['collectives_beyond_buckets']}, "
                        f"rides a parameter: {r['rides_a_param']}")
    if not r["last_loss"] < r["first_loss"]:
        failures.append(f"ddp: loss did not fall ({r['first_loss']:.4f} -> {r['last_loss']:.4f})")
    if r["last_good"] != f"step_{DDP_STEPS:06d}":
        failures.append(f"ddp: LAST_GOOD names {r['last_good']} after the run")


FSDP_STEPS = DDP_STEPS
FSDP_ARGS = [*DDP_ARGS, "dist.strategy=fsdp"]
#: The all-reduces stabletrain issues inside an FSDP step, each at most once, by the function that issues it:
#: the window's (loss sum, count) (accumulation), the global grad norm and the post-update check (fsdp.py),
#: and ||update|| on a log interval's last step. FSDP2's own all-gathers and reduce-scatters are not all-reduces.
FSDP_STEP_ALL_REDUCES = ("normalize", "grad_norms", "all_params_finite", "update_norms")


def fsdp_worker(out: Path) -> None:
    """One rank of the fsdp case (under torchrun): train in bf16, record what FSDP computes in and what the step issues."""
    from torch import nn

    from stabletrain.distributed.group import process_group

    cfg = load_config(None, [*FSDP_ARGS, f"run.dir={out / 'run'}", *SMOKE_ARGS])
    with process_group(cfg.dist.backend, cfg.dist.timeout_s) as ctx:
        trainer = Trainer(cfg, run_dir=cfg.run.dir)
        block = trainer.module.blocks[0]  # an FSDP unit of its own: its Linear layers run on the gathered weights
        linear = next(m for m in block.modules() if isinstance(m, nn.Linear))
        compute: set[str] = set()
        hook = linear.register_forward_pre_hook(lambda m, args: compute.add(str(m.weight.dtype)))
        try:
            calls, stray = fit_counting(trainer, depth=40)  # deep: the checkpoint's gather runs far below "save"
        finally:
            hook.remove()
        per_step: dict[int, list[str]] = {}
        for step, where in calls:
            if "train_step" in where:  # inside the step (the trainer's step counter is the previous one's)
                issuer = next((f for f in FSDP_STEP_ALL_REDUCES if f in where), "other: " + " < ".join(where[-4:]))
                per_step.setdefault(step, []).append(issuer)
        params = list(trainer.module.parameters())
        local = sum(getattr(p, "_local_tensor", p).numel() for p in params)
        state_dtypes = {str(v.dtype) for st in trainer.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0}
        if ctx.is_main:
            hist, good = trainer.history, trainer.ckpt.latest_good()
            (out / "rank0.json").write_text(json.dumps({
                "steps": trainer.step, "first_loss": hist[0]["loss"], "last_loss": hist[-1]["loss"],
                "skipped": sum(r["num_skipped"] for r in hist), "compute_dtypes": sorted(compute),
                "param_kinds": sorted({type(p).__name__ for p in params}),
                "param_dtypes": sorted({str(p.dtype) for p in params}), "optimizer_state_dtypes": sorted(state_dtypes),
                "local_fraction": round(local / sum(p.numel() for p in params), 4), "num_stray_syncs": len(stray),
                "stray_syncs": stray[:5], "step_all_reduces": sorted({tuple(sorted(v)) for v in per_step.values()}),
                "steps_with_all_reduces": len(per_step), "last_good": good.name if good else None,
                "peak_memory_mib": round(hist[-1]["peak_memory_mib"]),
                "tokens_per_s": round(median([r["tokens_per_s"] for r in hist[1:]]))}))


def run_fsdp(tmp: Path, failures: list[str]) -> None:
    r = run_torchrun("fsdp", tmp, failures)
    if r is None:
        return
    if r["compute_dtypes"] != ["torch.bfloat16"]:
        failures.append(f"fsdp: a block's forward ran on {r['compute_dtypes']} weights, not bf16 (MixedPrecisionPolicy)")
    if r["param_kinds"] != ["DTensor"] or r["param_dtypes"] != ["torch.float32"]:
        failures.append(f"fsdp: parameters are {r['param_kinds']} {r['param_dtypes']}, not fp32 DTensor shards")
    if r["optimizer_state_dtypes"] != ["torch.float32"]:
        failures.append(f"fsdp: optimizer state in {r['optimizer_state_dtypes']}, not fp32")
    if not r["local_fraction"] < 0.6:
        failures.append(f"fsdp: rank 0 holds {r['local_fraction']:.0%} of the parameters (2 ranks: about half)")
    if r["num_stray_syncs"]:
        failures.append(f"fsdp: {r['num_stray_syncs']} host conversions between boundaries on the training thread: "
                        f"{r['stray_syncs']}")
    required = {"normalize", "grad_norms"}  # every step; the parameter check and update norm on the interval's last
    bad = [c for c in r["step_all_reduces"] if not required <= set(c) or len(c) != len(set(c))
           or not set(c) <= set(FSDP_STEP_ALL_REDUCES)]
    if bad or r["steps_with_all_reduces"] != FSDP_STEPS:
        failures.append(f"fsdp: a step's all-reduces were {bad or r['step_all_reduces']} over {r['steps_with_all_reduces']} "
                        f"of {FSDP_STEPS} steps; expected each of {sorted(required)} once (all_params_finite, update_norms "
                        "at most once)")
    if not r["last_loss"] < r["first_loss"]:
        failures.append(f"fsdp: loss did not fall ({r['first_loss']:.4f} -> {r['last_loss']:.4f})")
    if r["skipped"]:
        failures.append(f"fsdp: {r['skipped']} skipped steps")
    if r["last_good"] != f"step_{FSDP_STEPS:06d}":
        failures.append(f"fsdp: LAST_GOOD names {r['last_good']} after the run")


def run_parity(failures: list[str]) -> None:
    """tests/test_parity.py's bitwise check on this device (CPU in a smoke run): every case, the step and the Trainer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    import test_parity as parity

    device = torch.device("cpu" if CPU_SMOKE else "cuda")
    for precision, accum, gap in parity.CASES:
        for how in ("step", "trainer", *(("planned",) if gap else ())):
            t0 = time.perf_counter()
            r = parity.run_parity(precision, accum, device, how)
            planted = parity.planted_problems(r)
            known = gap is not None and how != "planned"  # what the test marks xfail
            print(json.dumps({"case": "parity", "precision": precision, "accum": accum, "how": how,
                              "bitwise": not r["differences"], "known_gap": known, "skipped": r["skipped"],
                              "clipped": r["clipped"], "differences": r["differences"][:4], "planted_problems": planted,
                              "wall_s": round(time.perf_counter() - t0, 2)}), flush=True)
            name = f"parity {precision} accum={accum} {how}"
            if planted:
                failures.append(f"{name}: {'; '.join(planted)}")
            if r["differences"] and not known:
                failures.append(f"{name}: not bitwise the hand-written loop: {'; '.join(r['differences'][:4])}")
            elif known and not r["differences"]:
                print(f"note: {name} is bitwise now; tests/test_parity.py's xfail ({gap[:60]}...) can go", flush=True)


def main() -> int:
    all_cases = [n for n, _ in CASES] + ["incident", "spike", "snapshot", "ddp", "fsdp", "parity"]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=all_cases, choices=all_cases)
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run the script's own logic on CPU (small gpt, few steps, no CUDA checks): not a GPU check")
    ap.add_argument("--ddp-worker", help=argparse.SUPPRESS)
    ap.add_argument("--fsdp-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.ddp_worker:
        ddp_worker(Path(args.ddp_worker))
        return 0
    if args.fsdp_worker:
        fsdp_worker(Path(args.fsdp_worker))
        return 0
    if args.cpu_smoke and not CPU_SMOKE:  # the flag must reach module level (and the ddp workers): rerun with it set
        return subprocess.call([sys.executable, *sys.argv], env={**os.environ, "GPU_CHECK_CPU_SMOKE": "1"})
    if not torch.cuda.is_available() and not CPU_SMOKE:
        print("gpu_check: no CUDA device; nothing to check")
        return 0
    device = torch.cuda.get_device_name() if not CPU_SMOKE else "CPU (smoke run: not a GPU check)"
    print(f"device: {device}, torch {torch.__version__}", flush=True)
    failures: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in CASES:
            if name in args.cases:
                run_case(name, overrides, Path(tmp), failures)
        if "incident" in args.cases:
            run_incident(Path(tmp), failures)
        if "spike" in args.cases:
            run_spike(Path(tmp), failures)
        if "snapshot" in args.cases:
            run_snapshot(Path(tmp), failures)
        if "ddp" in args.cases:
            run_ddp(Path(tmp), failures)
        if "fsdp" in args.cases:
            run_fsdp(Path(tmp), failures)
        if "parity" in args.cases:
            run_parity(failures)
    for f in failures:
        print("FAIL", f)
    print("gpu_check:", "ok" if not failures else f"{len(failures)} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
