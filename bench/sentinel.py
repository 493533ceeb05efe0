"""What the NaN/Inf sentinel costs: always on, per incident, and against running under anomaly mode.

(a) Steady-state overhead of the sentinel: one gpt Trainer whose sentinel a callback switches on and
    off from one log interval to the next (ABBA blocks). Off: ``trainer.guard.observe`` replaced by a
    function returning constant ``ok=True, finite=True, spike=False`` device tensors, the step's
    post-update parameter check off (``trainer.step_fn.check_params``) and ``capture.incidents`` off (which
    also drops the incident snapshot copied into host buffers at each interval start).
    Target: ratio <= 1.01 on gpt. ``--lockstep`` also runs it as separate runs (``guard.check_params=false
    capture.incidents=false`` + the constant observe) beside a bare loop.
(b) The cost of one incident in training steps: a gpt run whose training sample N carries a NaN loss
    weight; the loop captures the bad step (the recorder replays from the interval's host snapshot,
    at most log.every - 1 steps, or from LAST_GOOD with ``capture.memory_snapshot=false``, and writes the
    bundle; timed by a callback from its ``on_log`` to its ``on_incident``) and ``diagnose_incident``
    replays it under the precise tools; both are divided by the median step, and the diagnosis's own
    record splits its time by phase (``timings``) and counts its passes (``passes``). Target: capture +
    diagnosis <= 20 steps wherever the incident falls (``--bad-step``: which step carries the NaN).
(c) A short run under ``torch.autograd.detect_anomaly()`` against the plain run (what users do today
    to find a NaN, for the whole job).
(d) The cost of one finite loss spike: a sample of step 40 weighs x100 in the loss; the boundary captures the spike
    and its counterfactual replays diagnose it (stabletrain.counterfactual), timed from ``on_log`` to
    ``on_incident``, in median steps. A run without a spike pays nothing for it.

Timing follows bench/overhead.py: each Trainer runs ``fit()`` in lockstep with a hand-written bare
loop (a callback runs one bare step beside each built-in step, its time taken off the built-in clock),
so load from other processes on a shared machine hits both alike; each variant's time is normalized
by the bare steps it ran beside, per log interval, and variants alternate round by round. The ratio
of two variants is the ratio of their median normalized times. One-time setup and checkpoints are off
the clock (as in bench/overhead.py); (c) also prints the whole-run wall ratio with setup included.
Only public surface is used: callbacks, ``trainer.guard``, ``trainer.step_fn``, ``trainer.cfg``.

    python bench/sentinel.py                  # (a), (b) and (c) on gpt, about 3-4 minutes on 2 CPU cores
    python bench/sentinel.py --parts a --rounds 10
    python bench/sentinel.py --quick          # smoke run (smaller gpt, few blocks), not a measurement
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import itertools
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from overhead import (  # bench/ is the script's directory
    QUICK_ARGS,
    BareLoop,
    load_average,
    lockstep_round,
    make_trainer,
)
from torch import Tensor, nn
from torch.utils.data import Dataset

from stabletrain import Trainer, load_config, resolve_task
from stabletrain.callbacks import Callback, RunState
from stabletrain.data import EpochOrder
from stabletrain.incident_replay import diagnose_incident


def without_sentinel(trainer: Trainer) -> None:
    """Replace the sentinel's per-step work by constants (the caller also sets check_params/capture off)."""
    true = torch.ones((), dtype=torch.bool, device=trainer.device)
    false = torch.zeros((), dtype=torch.bool, device=trainer.device)

    def observe(loss: Tensor, grad_norm: Tensor, inputs_ok: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        return true, true, false

    trainer.guard.observe = observe


class Variant:
    """One way to run the built-in loop: config overrides, a patch on the Trainer, a context around fit()."""

    def __init__(self, name: str, overrides: list[str] = (), patch: Callable[[Trainer], None] | None = None,
                 fit_context: Callable[[], Any] = contextlib.nullcontext) -> None:
        self.name, self.overrides, self.patch, self.fit_context = name, list(overrides), patch, fit_context


def compare(task: Any, base: list[str], variants: list[Variant], rounds: int, warmup: int, steps: int,
            tmp: Path) -> dict[str, dict[str, Any]]:
    """Run each variant once per round in lockstep with a bare loop; return per-variant normalized times."""
    init = copy.deepcopy(task.model.state_dict())
    out = {v.name: {"norm": [], "builtin": [], "bare": [], "fit_s": [], "bare_step": []} for v in variants}
    for i in range(rounds):
        order = variants if i % 2 == 0 else variants[::-1]  # neither variant always goes first
        for v in order:
            cfg = load_config(None, base + [f"train.max_steps={warmup + steps + 1}", "run.overwrite=true"] + v.overrides)
            models = []
            for _ in range(2):
                model = copy.deepcopy(task.model)
                model.load_state_dict(init)
                models.append(model)
            trainer = make_trainer(task, models[0], cfg, tmp / f"{v.name}{i}")
            if v.patch is not None:
                v.patch(trainer)
            bare = BareLoop(task, models[1], cfg)
            with v.fit_context():
                r = lockstep_round(trainer, bare, warmup, steps,
                                   bare_context=lambda: torch.autograd.set_detect_anomaly(False))
            every = cfg.log.every
            o = out[v.name]
            o["norm"] += [b / a for b, a in zip(r["builtin"], r["bare"])]
            o["builtin"] += [b / every for b in r["builtin"]]
            o["bare"] += [a / every for a in r["bare"]]
            o["bare_step"].append(sum(r["bare"]) / steps)
            o["fit_s"].append(r["fit_s"])
    return out


def ratio_line(out: dict[str, dict[str, Any]], a: str, b: str) -> tuple[float, str]:
    na, nb = statistics.median(out[a]["norm"]), statistics.median(out[b]["norm"])
    sa, sb = statistics.median(out[a]["builtin"]), statistics.median(out[b]["builtin"])
    return na / nb, (f"{a} {sa * 1e3:.2f} ms/step ({na:.3f}x bare), {b} {sb * 1e3:.2f} ms/step ({nb:.3f}x bare); "
                     f"{len(out[a]['norm'])} log intervals each")


# -- (a) ---------------------------------------------------------------------------------------


def part_a(task: Any, rounds: int, warmup: int, steps: int, tmp: Path, overrides: list[str] = ()) -> float:
    variants = [Variant("sentinel"),
                Variant("without", ["guard.check_params=false", "capture.incidents=false"], patch=without_sentinel)]
    out = compare(task, ["task=gpt", *overrides], variants, rounds, warmup, steps, tmp)
    ratio, detail = ratio_line(out, "sentinel", "without")
    print(f"(a) {detail}")
    print(f"sentinel overhead: ratio {ratio:.3f} (target <= 1.01)  [{load_average()}]", flush=True)
    return statistics.median(out["sentinel"]["builtin"])


class SentinelToggle(Callback):
    """Switch the sentinel on and off from one log interval to the next and time each interval.

    Appended after the built-in callbacks: its ``on_log`` runs after the sinks wrote, so an interval is
    timed from one ``on_log`` to the next (its steps and its log), and the mode it sets holds for the
    next interval's steps. Checkpoints (from this ``on_log`` to ``on_checkpoint`` at the same boundary)
    are taken off the clock, as in bench/overhead.py.
    """

    def __init__(self, trainer: Trainer, warmup: int) -> None:
        self.trainer, self.warmup = trainer, warmup
        self.real_observe = trainer.guard.observe
        without_sentinel(trainer)
        self.const_observe = trainer.guard.observe
        self.k, self.last, self.mark, self.excluded = 0, 0.0, 0.0, 0.0
        self.times: list[tuple[bool, float]] = []

    @staticmethod
    def on_for(k: int) -> bool:
        return k % 4 in (0, 3)  # ABBA: on, off, off, on

    def set_mode(self, on: bool) -> None:
        t = self.trainer
        t.guard.observe = self.real_observe if on else self.const_observe
        t.step_fn.check_params = on  # the step's post-update parameter check (guard.check_params at build time)
        t.cfg.capture.incidents = on  # read at each boundary (and the interval's host snapshot with it)

    def on_fit_start(self, state: RunState) -> None:
        self.set_mode(True)
        self.last = self.mark = time.perf_counter()

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        self.mark = time.perf_counter()
        now = self.mark - self.excluded
        if state.step > self.warmup:
            self.times.append((self.on_for(self.k), now - self.last))
            self.k += 1
        self.last = now
        self.set_mode(self.on_for(self.k))

    def on_checkpoint(self, state: RunState, info: dict[str, Any]) -> None:
        self.excluded += time.perf_counter() - self.mark


def part_a_paired(task: Any, blocks: int, warmup: int, tmp: Path, overrides: list[str] = ()) -> float:
    """The same Trainer with the sentinel switched on and off from one log interval to the next.

    Intervals run in ABBA blocks (on, off, off, on): neighbours see the same machine load and neither
    mode always comes first. Each block gives one ratio (on time / off time over its four
    intervals); the median over blocks isolates the sentinel: ``guard.observe``, the post-update
    parameter check and the interval's incident snapshot (``capture.memory_snapshot``, on by default). Returns
    the median step time with it on.
    """
    every = load_config(None, ["task=gpt", *overrides]).log.every
    cfg = load_config(None, ["task=gpt", *overrides, "log.progress=false", "run.overwrite=true",
                             f"train.max_steps={warmup + 4 * blocks * every + every}"])
    trainer = make_trainer(task, copy.deepcopy(task.model), cfg, tmp / "paired")
    toggle = SentinelToggle(trainer, warmup)
    trainer.callbacks.append(toggle)
    trainer.fit()
    times = toggle.times
    ratios = []
    for i in range(0, len(times) - 3, 4):
        block = times[i:i + 4]
        on_t = sum(t for m, t in block if m)
        off_t = sum(t for m, t in block if not m)
        ratios.append(on_t / off_t)
    on = [t for m, t in times if m]
    off = [t for m, t in times if not m]
    ratio = statistics.median(ratios)
    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratio] * 3
    print(f"(a) one run, sentinel on/off in {len(ratios)} ABBA blocks of log intervals; median step with sentinel "
          f"{statistics.median(on) / every * 1e3:.2f} ms, without {statistics.median(off) / every * 1e3:.2f} ms")
    print(f"sentinel overhead: ratio {ratio:.4f} (target <= 1.01); block ratios quartiles "
          f"{q[0]:.4f} / {q[1]:.4f} / {q[2]:.4f}  [{load_average()}]", flush=True)
    return statistics.median(on) / every


# -- (b) ---------------------------------------------------------------------------------------


class WeightedChunks(Dataset):
    """gpt's byte chunks with a per-sample loss weight: 1.0, or ``weight`` (NaN by default) for the planted sample."""

    def __init__(self, inner: Dataset, bad_index: int, weight: float = float("nan")) -> None:
        self.inner, self.bad_index, self.weight = inner, bad_index, weight

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        x, y = self.inner[i]
        return x, y, torch.tensor(self.weight if i == self.bad_index else 1.0)


def weighted_lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, int]:
    """gpt's summed next-byte loss with each sample's tokens weighted by the sample's weight."""
    x, y, w = batch
    per_token = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten(), reduction="none").view_as(y)
    return (per_token.sum(1) * w).sum(), y.numel()


class IncidentClock(Callback):
    """Stamp each step's end, and time the incident capture: from this ``on_log`` to its ``on_incident``.

    Appended after the built-in callbacks, so between the two hooks at a boundary runs only the
    built-in ``on_incident``: the recorder's capture (replay + bundle; diagnosis off in this run).
    """

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.capture_s: list[float] = []
        self.infos: list[dict[str, Any]] = []
        self.mark = 0.0

    def on_step_end(self, state: RunState, out: dict[str, Any]) -> None:
        self.stamps.append(time.perf_counter())

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        self.mark = time.perf_counter()

    def on_incident(self, state: RunState, info: dict[str, Any]) -> None:
        self.capture_s.append(time.perf_counter() - self.mark)
        self.infos.append(dict(info))


def part_b(task: Any, step_s: float | None, tmp: Path, bad_step: int = 20, repeats: int = 3,
           overrides: list[str] = ()) -> None:
    cfg = load_config(None, ["task=gpt", *overrides, f"train.max_steps={max(20, bad_step)}", "run.overwrite=true",
                             "capture.diagnose=false"])
    order = EpochOrder(len(task.train_data), cfg.train.batch_size, cfg.seed, cfg.data.shuffle)
    bad_index = order.micro_batches(0)[bad_step - 1][3]  # the 4th sample of step `bad_step`'s batch
    nan_task = copy.copy(task)
    nan_task.model = copy.deepcopy(task.model)
    nan_task.train_data = WeightedChunks(task.train_data, bad_index)
    nan_task.loss = weighted_lm_loss
    nan_task.val_data = None
    clock = IncidentClock()
    trainer = Trainer(cfg, task=nan_task, run_dir=tmp / "nan", callbacks=[clock])
    trainer.fit()
    incident = tmp / "nan" / "incidents" / f"step_{bad_step:06d}"
    if not (incident / "bundle.pt").exists() or not clock.capture_s:
        raise RuntimeError(f"no incident captured at {incident}; events: {(tmp / 'nan' / 'events.jsonl').read_text()}")
    stamps = clock.stamps
    run_step = statistics.median(b - a for a, b in itertools.pairwise(stamps[2:bad_step - 1]))
    step = step_s if step_s is not None else run_step
    times, runs = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runs.append(diagnose_incident(incident, nan_task, device="cpu"))
        times.append(time.perf_counter() - t0)
    diag = statistics.median(times)
    diagnosis = runs[times.index(diag)] if diag in times else runs[-1]
    found = diagnosis.get("bad_samples")
    print(f"(b) planted NaN in training sample {bad_index} (step {bad_step}); diagnosis says: {diagnosis.get('summary')}")
    print(f"    stage={diagnosis.get('stage')} op={diagnosis.get('op')} bad_samples={found} "
          f"reproduces={diagnosis.get('reproduces')} -> "
          f"{'correct' if found and bad_index in found else 'NOT the planted sample'}")
    print(f"    median step {step * 1e3:.2f} ms ({'from (a)' if step_s is not None else 'from this run'}; "
          f"this run's healthy steps {run_step * 1e3:.2f} ms)")
    source = "the interval's host snapshot" if cfg.capture.memory_snapshot else "LAST_GOOD"
    print(f"    capture (replay of {trainer.recorder.replayed_steps} steps from {source}, + bundle write): "
          f"{clock.capture_s[0]:.2f} s = {clock.capture_s[0] / step:.1f} steps")
    print(f"diagnosis cost: {diag:.2f} s = {diag / step:.1f} median steps "
          f"(median of {repeats}: {', '.join(f'{t:.2f}' for t in times)} s)  [{load_average()}]")
    t, n = diagnosis["timings"], diagnosis["passes"]
    print(f"    phases of that run, in steps: load {t['load_s'] / step:.1f}, replays {t['replays_s'] / step:.1f} "
          f"({n['replays']} forward/backward under the locator, {n['updates']} update), bisection "
          f"{t['bisection_s'] / step:.1f} ({n['bisection']} subsets, {n['bisection_forward_only']} stopped at a "
          f"non-finite loss before their backward), anomaly {t['anomaly_s'] / step:.1f} ({n['anomaly']} pass)")
    total = (clock.capture_s[0] + diag) / step
    print(f"incident cost: capture + diagnosis = {total:.1f} steps (target <= 20)", flush=True)


# -- (d) ---------------------------------------------------------------------------------------


def part_d(task: Any, step_s: float | None, tmp: Path, bad_step: int = 40, weight: float = 100.0,
           overrides: list[str] = ()) -> None:
    """The cost of one finite loss spike: a sample of step ``bad_step`` weighs ``weight`` in the loss; the boundary
    captures it and the counterfactual replays diagnose it (diagnosis on: timed from on_log to on_incident)."""
    cfg = load_config(None, ["task=gpt", *overrides, f"train.max_steps={bad_step}", "run.overwrite=true",
                             "eval.every=0"])
    order = EpochOrder(len(task.train_data), cfg.train.batch_size, cfg.seed, cfg.data.shuffle)
    bad_index = order.micro_batches(0)[bad_step - 1][3]
    spiky = copy.copy(task)
    spiky.model = copy.deepcopy(task.model)
    spiky.train_data = WeightedChunks(task.train_data, bad_index, weight)
    spiky.loss = weighted_lm_loss
    spiky.val_data = None
    clock = IncidentClock()
    Trainer(cfg, task=spiky, run_dir=tmp / "spike", callbacks=[clock]).fit()
    if not clock.infos or clock.infos[0].get("anomaly") != "spike":
        raise RuntimeError(f"no spike captured; events: {(tmp / 'spike' / 'events.jsonl').read_text()[-2000:]}")
    run_step = statistics.median(b - a for a, b in itertools.pairwise(clock.stamps[2:bad_step - 1]))
    step = step_s if step_s is not None else run_step
    info = clock.infos[0]
    d = info.get("diagnosis") or {}
    print(f"(d) a sample of step {bad_step} ({bad_index}) weighs x{weight:g} in the loss; the spike's diagnosis: "
          f"{d.get('summary')}")
    correct = d.get("failure_class") == "data" and bad_index in (d.get("bad_samples") or [])
    print(f"    -> {'correct' if correct else 'NOT the planted sample'}"
          f"; median step {step * 1e3:.2f} ms; capture replayed {info.get('replayed_steps')} steps in "
          f"{info.get('replay_s', 0.0):.2f} s")
    print(f"spike cost: capture + diagnosis = {clock.capture_s[0]:.2f} s = {clock.capture_s[0] / step:.1f} steps "
          f"[{load_average()}]", flush=True)


# -- (c) ---------------------------------------------------------------------------------------


def part_c(task: Any, rounds: int, warmup: int, steps: int, tmp: Path, overrides: list[str] = ()) -> None:
    variants = [Variant("plain"), Variant("anomaly", fit_context=torch.autograd.detect_anomaly)]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
        out = compare(task, ["task=gpt", *overrides], variants, rounds, warmup, steps, tmp)
    ratio, detail = ratio_line(out, "anomaly", "plain")
    # Whole run, setup and checkpoints included, normalized by the bare steps it ran beside.
    whole = [fa / ba for fa, ba in zip(out["anomaly"]["fit_s"], out["anomaly"]["bare_step"])]
    whole_plain = [fp / bp for fp, bp in zip(out["plain"]["fit_s"], out["plain"]["bare_step"])]
    print(f"(c) {detail}")
    print(f"anomaly mode: ratio {ratio:.2f} per step against the plain run; whole {warmup + steps + 1}-step run "
          f"(setup included) {statistics.median(whole) / statistics.median(whole_plain):.2f}  [{load_average()}]", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="abcd", help="which of (a), (b), (c), (d) to run")
    ap.add_argument("--rounds", type=int, default=6, help="rounds of (a); (c) runs half as many")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--blocks", type=int, default=50, help="ABBA blocks of log intervals in (a)")
    ap.add_argument("--lockstep", action="store_true", help="also run (a) as separate runs beside a bare loop")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per round of (a), a multiple of log.every")
    ap.add_argument("--bad-step", type=int, default=20,
                    help="the step of (b) whose sample carries the NaN (20: the last of its log interval, the "
                         "longest replay)")
    ap.add_argument("--quick", action="store_true",
                    help="a smoke run: a smaller gpt, 2 ABBA blocks, 1 round of (c), 1 diagnosis (not a measurement)")
    args = ap.parse_args()
    overrides = QUICK_ARGS["gpt"] if args.quick else []
    if args.quick:
        args.rounds, args.warmup, args.blocks, args.steps = 2, 5, 2, 10
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {load_average()}", flush=True)
    cfg = load_config(None, ["task=gpt", *overrides])
    task = resolve_task(cfg.task, cfg.task_args)
    step_s = None
    with tempfile.TemporaryDirectory() as tmp:
        if "a" in args.parts:
            step_s = part_a_paired(task, args.blocks, args.warmup, Path(tmp) / "a", overrides)
            if args.lockstep:
                part_a(task, args.rounds, args.warmup, args.steps, Path(tmp) / "a", overrides)
        if "b" in args.parts:
            part_b(task, step_s, Path(tmp) / "b", bad_step=args.bad_step, repeats=1 if args.quick else 3,
                   overrides=overrides)
        if "c" in args.parts:
            part_c(task, max(args.rounds // 2, 1), args.warmup, 10 if args.quick else 20, Path(tmp) / "c", overrides)
        if "d" in args.parts:
            part_d(task, step_s, Path(tmp) / "d", overrides=overrides)


if __name__ == "__main__":
    sys.exit(main())
