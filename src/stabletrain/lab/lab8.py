"""Lab 8: a loss spike — the warning before it, its cause, and the cure a replay verifies.

Two runs of the built-in loop train the same bag-of-tokens regression (the mean of a sequence's token
embeddings, then a linear head) under Adam, on the same data, and both spike at step 75. Each spike is
captured as an incident, diagnosed by counterfactual replays (:mod:`stabletrain.counterfactual`) and replayed
under the remedies that fit its class (:func:`stabletrain.remedy_search.search_remedies`):

- a rare token: token 31 first appears in step 74's window (then in 75's and 76's). Its embedding row had no
  gradient before, so Adam's second moment there is 0 and its first gradient, however small, makes an update of
  lr x sqrt((1 - 0.999^t) / 0.001) per coordinate (beta1 = 0, bias-corrected: 8.4 lr at t = 74) where a coordinate
  with a steady history moves about lr. The moved
  row is wrong for the next windows that hold the token: the loss spikes at step 75. The spike is made by an
  update, so the update shows it first: the embedding's update/weight ratio jumps at step 74, while the loss is
  still normal (Marin saw Adam's update-norm spikes come before their loss spikes).
- two mislabelled samples (targets x20 + 20) in step 75's window: the spike is born in the window itself, high
  under any weights; no update before it could have warned (OLMo 2 traced its gradient spikes to data too).

The per-layer update/weight ratio ``||theta_t - theta_{t-1}|| / ||theta_{t-1}||`` is measured on every step by
this lab's own callback, and compared with the same layer's median over the steps before. The run's own warning
(``guard.precursor``) reads the update of each log interval's last step: a third and a fourth run train the same
two tasks with a log boundary on every step (``log.every=1``, ``guard.precursor_zscore=2.5``: a step's update
is noisier than an interval's), so its ``precursor`` events are what stabletrain itself says before each spike;
the two main runs (``log.every=10``) show what the default reads.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import TensorDataset

from ..callbacks import Callback, RunState
from ..config import load_config
from ..loop import Trainer
from ..records.jsonl import revive
from ..remedy_search import LOSS_TOLERANCE, search_remedies
from ..tasks import Task
from . import Claim, LabResult, new_figure, runs_folder, save_figure

#: The step whose loss spikes in both runs (batch 8, no shuffle: step k trains on samples 8(k-1) .. 8k-1).
SPIKE_STEP = 75
VOCAB, LENGTH, NUM_SAMPLES = 32, 8, 640
RARE = VOCAB - 1
#: The rare token's samples: the last 4 of the windows of steps 74, 75 and 76 (three quarters of their tokens).
RARE_SAMPLES = tuple(8 * step - 4 + j for step in (SPIKE_STEP - 1, SPIKE_STEP, SPIKE_STEP + 1) for j in range(4))
#: The mislabelled samples: the last 2 of step 75's window.
MISLABELLED = (8 * SPIKE_STEP - 2, 8 * SPIKE_STEP - 1)
#: A layer's update ratio this many times its median over the HISTORY steps before it departs from its history.
DEPARTURE = 3.0
HISTORY = 20
#: How many steps before the spike a departure counts as its warning.
LOOKBACK = 5
STEPS = 80
#: The precursor's z-score in the watch runs (the default 3 is set for one update per log interval).
PRECURSOR_Z = 2.5
EVERY = 10  # log.every of the two main runs
COMMON = ["device=cpu", "log.progress=false", "log.tensorboard=false", "train.batch_size=8", f"log.every={EVERY}",
          "data.shuffle=false", "eval.every=0", "sched.warmup_steps=0", "sched.decay=constant", f"train.max_steps={STEPS}"]
RUNS = ("rare token", "mislabelled")


class BagOfTokens(nn.Module):
    """The mean of a sequence's token embeddings, then a linear head; the rare token's row starts at zero."""

    def __init__(self, vocab: int, dim: int, rare: int) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, 1)
        with torch.no_grad():
            self.embed.weight[rare] = 0.0

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(self.embed(tokens).mean(1))


def _loss(model: nn.Module, batch: Any) -> Tensor:
    tokens, target = batch
    return F.mse_loss(model(tokens).float(), target)


def _task(run: str, seed: int, lr: float, beta1: float) -> Task:
    """The regression y = mean of the tokens' values (the rare token's value is 0), with ``run``'s planted spike."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, VOCAB - 1, (NUM_SAMPLES, LENGTH), generator=g)
    values = torch.randn(VOCAB, generator=g)
    values[RARE] = 0.0  # the target ignores the rare token: its zero row (where it starts) fits as well as any
    if run == "rare token":
        tokens[list(RARE_SAMPLES), :3 * LENGTH // 4] = RARE
    y = values[tokens].mean(1, keepdim=True)
    if run == "mislabelled":
        y[list(MISLABELLED)] = y[list(MISLABELLED)] * 20 + 20
    torch.manual_seed(seed)
    model = BagOfTokens(VOCAB, 16, RARE)

    def optimizer(named: list) -> torch.optim.Optimizer:
        # beta1 = 0 (RMSprop-like): with 0.9 the rare row's first update is damped for some thousand steps
        return torch.optim.AdamW([p for _, p in named], lr=lr, betas=(beta1, 0.999), weight_decay=0.0,
                                 fused=True)

    return Task(model=model, train_data=TensorDataset(tokens, y), loss=_loss, name=run.replace(" ", "-"),
                optimizer=optimizer)


class _UpdateRatios(Callback):
    """Each step's per-layer update/weight ratio (kept on the device, read after the run) and the per-step loss and
    spike flag that the log boundaries read anyway.

    A layer is a module with parameters: ``||Δ(its parameters)|| / ||its parameters before the step||`` (a
    one-element bias alone crosses zero now and then, and its own ratio is noise).
    """

    def __init__(self) -> None:
        self.layers: list[str] = []
        self.of = torch.zeros(0, dtype=torch.long)  # each parameter's layer (index into layers)
        self.before: list[Tensor] = []
        self.ratios: list[tuple[int, Tensor]] = []
        self.losses: dict[int, tuple[float, bool]] = {}

    def on_fit_start(self, state: RunState) -> None:
        of = []
        for name, _ in state.named_params:
            layer = name.rpartition(".")[0] or name
            if layer not in self.layers:
                self.layers.append(layer)
            of.append(self.layers.index(layer))
        self.before = [p.detach().clone() for _, p in state.named_params]
        self.of = torch.tensor(of, device=self.before[0].device)

    def on_step_end(self, state: RunState, out: dict[str, Tensor]) -> None:
        now = [p.detach() for _, p in state.named_params]
        zeros = torch.zeros(len(self.layers), device=self.of.device)
        moved = zeros.index_add(0, self.of, torch.stack([(p - b).float().pow(2).sum() for p, b in zip(now, self.before)]))
        size = zeros.index_add(0, self.of, torch.stack([b.float().pow(2).sum() for b in self.before]))
        self.ratios.append((state.step, (moved / size.clamp_min(1e-24)).sqrt()))  # no host sync: read after the run
        self.before = [p.clone() for p in now]

    def on_log(self, state: RunState, record: dict[str, Any], rows: list[Any]) -> None:
        for row in rows:
            self.losses[row.step] = (float(row.values["loss"]), row.values.get("spike", 0.0) > 0.5)

    def trace(self) -> list[dict[str, Any]]:
        """Per step: the loss, the guard's spike flag, each layer's update ratio."""
        return [{"step": step, "loss": self.losses.get(step, (math.nan, False))[0],
                 "spike": self.losses.get(step, (math.nan, False))[1],
                 "ratios": dict(zip(self.layers, ratio.tolist()))} for step, ratio in self.ratios]


def _factors(trace: list[dict[str, Any]]) -> None:
    """Add each step's ratio / the layer's median ratio over the HISTORY steps before it (``factors``), in place."""
    for i, row in enumerate(trace):
        past = trace[max(0, i - HISTORY):i]
        row["factors"] = {n: (r / statistics.median(p["ratios"][n] for p in past) if len(past) >= HISTORY // 2 else math.nan)
                          for n, r in row["ratios"].items()}


def _warning(trace: list[dict[str, Any]], spike: int | None) -> dict[str, Any] | None:
    """The first step within LOOKBACK before ``spike`` whose loss was normal and where a layer's update ratio departed
    (DEPARTURE x its median): {"step", "layer", "ratio", "factor", "lead"}; None when no layer departed."""
    if spike is None:
        return None
    for row in trace:
        if not spike - LOOKBACK <= row["step"] < spike or row["spike"]:
            continue
        departed = {n: f for n, f in row["factors"].items() if f > DEPARTURE}
        if departed:
            layer = max(departed, key=departed.get)
            return {"step": row["step"], "layer": layer, "ratio": row["ratios"][layer], "factor": departed[layer],
                    "lead": spike - row["step"], "loss": row["loss"],
                    "others": {n: f for n, f in row["factors"].items() if n != layer}}
    return None


#: The watch runs: the run's own precursor reading every step's update (no capture: only its warnings are read).
WATCH = ["log.every=1", f"guard.precursor_zscore={PRECURSOR_Z}", "capture.incidents=false", "guard.on_spike=warn"]


def _precursors(run_dir: Path) -> list[dict[str, Any]]:
    """The run's precursor events before SPIKE_STEP: [{"step", "layers": [names]}, ...]."""
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()]
    return [{"step": e["step"], "layers": [layer["name"] for layer in e.get("layers", [])]}
            for e in events if e["kind"] == "precursor" and e["step"] < SPIKE_STEP]


def _watch(run: str, seed: int, lr: float, beta1: float, run_dir: Path) -> list[dict[str, Any]]:
    """Train ``run`` with a log boundary on every step (WATCH): the run's own precursor events before the spike. Its
    console lines are not shown: 'spike at step 75 ... not captured' (this run's, capture.incidents=false) beside the
    main runs' captured spike told a student the lab's spike went uncaptured (a trial's); its events hold them."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        Trainer(load_config(None, [*COMMON, f"seed={seed}", *WATCH]), task=_task(run, seed, lr, beta1),
                run_dir=run_dir).fit()
    return _precursors(run_dir)


def _meet(run: str, seed: int, lr: float, beta1: float, steps: int, run_dir: Path) -> dict[str, Any]:
    """Train ``run``, read its first spike incident's diagnosis and search its remedies; the per-step trace."""
    task = _task(run, seed, lr, beta1)
    watch = _UpdateRatios()
    Trainer(load_config(None, [*COMMON, f"seed={seed}"]), task=task, run_dir=run_dir, callbacks=[watch]).fit()
    trace = watch.trace()
    _factors(trace)
    incidents = sorted((run_dir / "incidents").glob("step_*"))
    out: dict[str, Any] = {"trace": trace, "step": None, "diagnosis": {}, "remedies": {"candidates": [], "best": None}}
    if incidents:
        out["diagnosis"] = revive(json.loads((incidents[0] / "diagnosis.json").read_text(encoding="utf-8")))
        out["step"] = int(out["diagnosis"]["step"])
        out["remedies"] = search_remedies(incidents[0], task, steps=steps, device="cpu")
    out["warning"] = _warning(trace, out["step"])
    out["precursors"] = _precursors(run_dir)  # at log.every=10
    out["watched"] = _watch(run, seed, lr, beta1, run_dir.with_name(run_dir.name + "-watch"))  # at log.every=1
    return out


def run(out_dir: Path | None = None, seed: int = 0, *, lr: float = 0.03, beta1: float = 0.0, steps: int = 6) -> LabResult:
    """Meet a rare token's spike and a mislabelled window's under AdamW at ``lr``; replay both under the remedies for
    ``steps`` windows after the spike.

    ``beta1``: Adam's first-moment decay. At 0.9 (torch's default) momentum damps the rare row's first update to
    (1 - beta1) x its size at 0 (0.84 lr at step 74 instead of 8.4 lr; the factor grows toward 3.2 over thousands of
    steps): that run does not spike here, and the lab's observations on it fail.
    """
    with runs_folder(out_dir, "lab8") as tmp:  # (kept under --out: its lines point there)
        met = {run: _meet(run, seed, lr, beta1, steps, Path(tmp) / run.replace(" ", "-")) for run in RUNS}
    rare, bad = met["rare token"], met["mislabelled"]
    by = {run: {c["name"]: c for c in met[run]["remedies"]["candidates"]} for run in RUNS}

    def verdict(run: str, name: str) -> str:
        return by[run].get(name, {}).get("verdict", "not tried")

    def why(run: str, name: str) -> str:
        c = by[run].get(name, {})
        return (c.get("failed") or {}).get("why", c.get("evidence", "")) if c else ""

    d_rare, d_bad = rare["diagnosis"], bad["diagnosis"]
    cure = rare["remedies"]["best"]
    warn, calm = rare["warning"], bad["warning"]
    before_bad = _largest_factor(bad["trace"], bad["step"])
    claims = [
        Claim(f"both runs spike at step {SPIKE_STEP} and the spike is captured as an incident",
              f"rare token: {rare['step']}, mislabelled: {bad['step']}", f"{SPIKE_STEP}, {SPIKE_STEP}",
              rare["step"] == bad["step"] == SPIKE_STEP),
        Claim("the rare token's spike is optimizer-state and the layer named is embed.weight",
              f"{d_rare.get('failure_class', 'no incident')}, {d_rare.get('blamed_layer')}", "optimizer-state, embed.weight",
              (d_rare.get("failure_class"), d_rare.get("blamed_layer")) == ("optimizer-state", "embed.weight")),
        Claim(f"that layer's update ratio (embed) rose above {DEPARTURE:g}x its median of the {HISTORY} steps before, at "
              "least 1 step before the loss spiked, while the loss was still normal",
              (f"step {warn['step']}: {warn['layer']} {warn['ratio']:.3g} = x{warn['factor']:.3g} its median; the loss "
               f"spiked at step {rare['step']} ({warn['lead']} step{'s' if warn['lead'] > 1 else ''} later)") if warn
              else f"no layer departed in the {LOOKBACK} steps before step {rare['step']}",
              f"embed > x{DEPARTURE:g}, lead >= 1",
              warn is not None and warn["layer"] == "embed" == _layer(d_rare.get("blamed_layer")) and warn["lead"] >= 1),
        Claim("stabletrain's own precursor, reading every step's update (log.every=1), warns before the spike and names "
              "that layer",
              "; ".join(f"step {w['step']}: {', '.join(w['layers'])}" for w in rare["watched"]) or "no precursor event",
              f"a precursor at step {SPIKE_STEP - 5}..{SPIKE_STEP - 1} naming embed.weight",
              any(SPIKE_STEP - LOOKBACK <= w["step"] < SPIKE_STEP and "embed.weight" in w["layers"] for w in rare["watched"])),
        Claim("the remedy replay verifies a cure for it, and skipping the spike's step is none (the moved row remains)",
              f"best: {cure} {verdict('rare token', cure) if cure else ''}; skip-step: {verdict('rare token', 'skip-step')} "
              f"({why('rare token', 'skip-step')})", "a cure that fits the class; skip-step fails",
              cure in ("update-clip", "adam-eps", "lr-x0.5", "lr-x0.1") and verdict("rare token", cure) == "cures"
              and verdict("rare token", "skip-step") == "fails"),
        Claim("the mislabelled window's spike is data and the samples named are the two planted ones",
              f"{d_bad.get('failure_class', 'no incident')}, samples {d_bad.get('bad_samples')}",
              f"data, samples {list(MISLABELLED)}",
              (d_bad.get("failure_class"), d_bad.get("bad_samples")) == ("data", list(MISLABELLED))),
        Claim(f"no update warned of the data spike: no layer's ratio rose above {DEPARTURE:g}x its median in the "
              f"{LOOKBACK} steps before it",
              (f"largest: {before_bad[0]} x{before_bad[1]:.3g} at step {before_bad[2]}" if before_bad else "no steps")
              + (f"; warned at step {calm['step']}" if calm else ""), f"<= x{DEPARTURE:g}",
              bad["step"] is not None and calm is None),
        Claim("nor did stabletrain's own precursor warn of the data spike, reading every step's update",
              "; ".join(f"step {w['step']}: {', '.join(w['layers'])}" for w in bad["watched"]
                        if w["step"] >= SPIKE_STEP - LOOKBACK) or "no precursor event",
              f"none in steps {SPIKE_STEP - LOOKBACK}..{SPIKE_STEP - 1}",
              bad["step"] is not None and not [w for w in bad["watched"] if w["step"] >= SPIKE_STEP - LOOKBACK]),
        Claim("dropping the named samples cures the data spike; a lower LR does not",
              f"skip-samples: {verdict('mislabelled', 'skip-samples')}; lr-x0.1: {verdict('mislabelled', 'lr-x0.1')}",
              "cures; fails", verdict("mislabelled", "skip-samples") == "cures" and verdict("mislabelled", "lr-x0.1") == "fails"),
    ]
    rows = []
    for run in RUNS:
        for c in met[run]["remedies"]["candidates"]:
            end = c["end_loss"] if isinstance(c["end_loss"], float) and math.isfinite(c["end_loss"]) else None
            rows.append([run, c["name"], c["detail"], c["verdict"], (c["failed"] or {}).get("step"), end])
    columns = ["spike", "candidate", "what it does", "verdict", "first bad step", "end loss"]
    tables = [_around(met)]
    plots = _plots(met, out_dir) if out_dir is not None else []
    setup = (f"a bag-of-tokens regression (vocabulary {VOCAB}, 8 tokens a sample, {NUM_SAMPLES} samples, embedding 16 "
             f"+ linear head) under AdamW (lr {lr:g}, betas ({beta1:g}, 0.999), eps 1e-8), batch 8, no shuffle, "
             f"{STEPS} steps, log every {EVERY}, seed {seed}; run 1: token {RARE} first appears at step {SPIKE_STEP - 1} "
             f"(samples {', '.join(f'{RARE_SAMPLES[i]}-{RARE_SAMPLES[i + 3]}' for i in range(0, len(RARE_SAMPLES), 4))}: "
             f"4 in each of steps {SPIKE_STEP - 1}-{SPIKE_STEP + 1}); run 2: samples {MISLABELLED[0]}, "
             f"{MISLABELLED[1]} mislabelled (y x20 + 20); each first spike replayed by stabletrain remedy over its "
             f"window and the {steps} after it; update ratios measured every step by the lab; the run's own "
             f"precursor read in one more run of each with log.every=1, guard.precursor_zscore={PRECURSOR_Z:g}")
    numbers = {"rare": rare, "mislabelled": bad, "departure": DEPARTURE, "history": HISTORY}
    return LabResult("8", setup, columns, rows, claims, _explain(met, by, beta1), plots, numbers, tables)


def _first_update(t: int) -> float:
    """Adam's (beta1 = 0, beta2 = 0.999, bias-corrected) first update of a coordinate at step ``t``, in units of lr."""
    return math.sqrt((1 - 0.999 ** t) / 0.001)


def _layer(param: str | None) -> str | None:
    """The module a parameter name belongs to (``embed.weight`` -> ``embed``)."""
    return param.rpartition(".")[0] or param if param else None


def _largest_factor(trace: list[dict[str, Any]], spike: int | None) -> tuple[str, float, int] | None:
    """(layer, factor, step): the largest departure in the LOOKBACK steps before ``spike``."""
    if spike is None:
        return None
    found = [(f, n, row["step"]) for row in trace if spike - LOOKBACK <= row["step"] < spike
             for n, f in row["factors"].items() if math.isfinite(f)]
    if not found:
        return None
    f, n, step = max(found)
    return n, f, step


def _around(met: dict[str, dict[str, Any]]) -> tuple[str, list[str], list[list[Any]]]:
    """The steps around each spike: the loss, the guard's verdict, each layer's ratio and its factor."""
    names = list(met["rare token"]["trace"][0]["ratios"]) if met["rare token"]["trace"] else []
    rows = []
    for run in RUNS:
        for row in met[run]["trace"]:
            if SPIKE_STEP - 3 <= row["step"] <= SPIKE_STEP + 1:
                rows.append([run, row["step"], row["loss"], row["spike"],
                             *(f"{row['ratios'][n]:.3g} (x{row['factors'][n]:.2g})" for n in names)])
    title = (f"the steps around the spike: loss, the guard's spike rule, and each layer's update/weight ratio "
             f"(x its median of the {HISTORY} steps before)")
    return title, ["run", "step", "loss", "spike", *names], rows


def _plots(met: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    plots = []
    for run, name in zip(RUNS, ("lab8_rare_token.png", "lab8_mislabelled.png")):
        record = met[run]
        trace = [r for r in record["trace"] if r["step"] >= SPIKE_STEP - 25]
        fig, (ax1, ax2) = new_figure(ncols=2, width=5.2, height=4.6)
        x = [r["step"] for r in trace]
        ax1.semilogy(x, [r["loss"] for r in trace], marker=".", color="black", label="loss")
        for i, layer in enumerate(trace[0]["ratios"] if trace else {}):
            color = f"C{i}"
            ax2.semilogy(x, [r["ratios"][layer] for r in trace], marker=".", color=color, label=layer)
            ax2.semilogy(x, [DEPARTURE * r["ratios"][layer] / r["factors"][layer] for r in trace], color=color,
                         linewidth=0.8, linestyle=(0, (4, 3)), alpha=0.7,
                         label=f"{DEPARTURE:g}x its median of {HISTORY} steps" if i == 0 else None)
        warn = record["warning"]
        for ax in (ax1, ax2):
            if record["step"] is not None:
                ax.axvline(record["step"], color="tab:red", linestyle="--", linewidth=1,
                           label=f"loss spike (step {record['step']})")
            if warn is not None:
                ax.axvline(warn["step"], color="tab:purple", linestyle=":", linewidth=1.5,
                           label=f"{warn['layer']}: x{warn['factor']:.2g} its median (step {warn['step']})")
            own = [w for w in record["watched"] if w["step"] >= SPIKE_STEP - LOOKBACK]
            if own:  # the run's own warning (log.every=1)
                ax.axvline(own[0]["step"], color="tab:green", linestyle="-.", linewidth=1.2, alpha=0.8,
                           label=f"stabletrain precursor (step {own[0]['step']})")
            ax.set_xlabel("step")
            ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
        cls = record["diagnosis"].get("failure_class", "no incident")
        ax1.set_ylabel("training loss")
        ax1.set_title(f"{run}: {cls} spike", fontsize=10)
        ax2.set_ylabel("||Δθ|| / ||θ|| per layer")
        ax2.set_title("each layer's update/weight ratio, every step", fontsize=10)
        plots.append(save_figure(fig, out_dir / name))
    fig, axes = new_figure(ncols=2, width=5.2, height=5.0)
    for ax, run in zip(axes, RUNS):
        record = met[run]
        for c in record["remedies"]["candidates"]:
            pts = [(r["step"], r["loss"]) for r in c["trajectory"] if isinstance(r.get("loss"), float)
                   and math.isfinite(r["loss"]) and r["loss"] > 0 and r["step"] >= SPIKE_STEP - 2]
            if pts:
                ax.semilogy(*zip(*pts), marker=".", label=f"{c['name']} ({c['verdict']})")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (replay)")
        ax.set_title(f"{run}: {record['diagnosis'].get('failure_class', 'no incident')} spike, replayed", fontsize=10)
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    plots.append(save_figure(fig, out_dir / "lab8_remedies.png"))
    return plots


def _explain(met: dict[str, dict[str, Any]], by: dict[str, dict[str, Any]], beta1: float) -> list[str]:
    rare, bad = met["rare token"], met["mislabelled"]
    out = []
    d = rare["diagnosis"]
    if rare["step"] is None:
        trace = rare["trace"]
        top = max((r for r in trace if r["step"] >= SPIKE_STEP - LOOKBACK), key=lambda r: r["loss"], default=None)
        at = next((r for r in trace if r["step"] == SPIKE_STEP - 1), None)
        out.append("The rare-token run had no spike by the guard's rule"
                   + (f" (its largest loss from step {SPIKE_STEP - LOOKBACK} on: {top['loss']:.3g} at step {top['step']})"
                      if top else "")
                   + (f"; at step {SPIKE_STEP - 1}, where the token first appears, embed's update ratio was x"
                      f"{at['factors']['embed']:.2g} its median" if at and "embed" in at["factors"] else "")
                   + ": there is nothing to diagnose or cure."
                   + (f" With beta1 = {beta1:g} Adam's first update of a row it never saw is lr x (1 - beta1) x "
                      f"sqrt((1 - 0.999^t) / 0.001) = {(1 - beta1) * _first_update(SPIKE_STEP - 1):.2g} lr at t = "
                      f"{SPIKE_STEP - 1}, not {_first_update(SPIKE_STEP - 1):.2g} lr: momentum damps the surge."
                      if beta1 else ""))
    else:
        warn = rare["warning"]
        lead = (f"Its warning came first: at step {warn['step']}, with the loss still at {warn['loss']:.3g} (normal by the "
                f"guard's rule), {warn['layer']}'s update/weight ratio was {warn['ratio']:.3g}, x{warn['factor']:.3g} its "
                f"median of the {HISTORY} steps before ("
                + ", ".join(f"{n}'s x{f:.2g}" for n, f in warn["others"].items()) + "): the spike is made by an update, "
                "so the update shows it before the loss does." if warn else
                f"No layer's update ratio rose above x{DEPARTURE:g} its median in the {LOOKBACK} steps before it.")
        own = [w for w in rare["watched"] if w["step"] >= SPIKE_STEP - LOOKBACK]
        default = [w["step"] for w in rare["precursors"]]
        read = (SPIKE_STEP // EVERY * EVERY, (SPIKE_STEP // EVERY + 1) * EVERY)  # the interval ends around the spike
        said = ((f" stabletrain's own precursor said so too, reading every step's update: 'precursor at step "
                 f"{own[0]['step']}' naming {', '.join(own[0]['layers'])}" if own else
                 " stabletrain's own precursor, reading every step's update, did not warn")
                + (f"; at the default log.every={EVERY} it reads the update of steps {read[0]} and {read[1]} only, and "
                   + (f"warned at step{'s' if len(default) > 1 else ''} {', '.join(map(str, default))}." if default else
                      "stayed silent: a surge inside an interval is the spike capture's to explain.")))
        out.append(f"The rare-token run spiked at step {rare['step']} (loss {d['loss']:.4g}, x{d['spike_test']['ratio']:.3g} "
                   f"the median of the losses before). {lead}{said}")
        surge = _first_update(SPIKE_STEP - 1)
        out.append(f"The diagnosis replayed the spike's step and the one before it from their exact states and said "
                   f"{d['failure_class']}: {d['evidence']}. Token {RARE} had no gradient until step {SPIKE_STEP - 1}, so "
                   f"Adam's second moment for its row was 0, and with beta1 = 0 its first update is lr x g / sqrt(v_hat) = lr x "
                   f"sqrt((1 - 0.999^t) / 0.001) = {surge:.3g} lr per coordinate at t = {SPIKE_STEP - 1}, however small g "
                   "is, where a coordinate with a steady history moves about lr.")
        cure = rare["remedies"]["best"]
        skip = by["rare token"].get("skip-step", {})
        if cure:
            c = by["rare token"][cure]
            out.append(f"Replayed from the state before step {c['first_step']} with {c['detail']}, it {c['verdict']}: "
                       f"{c['evidence']}. Skipping the spike's step {skip.get('verdict', '-')} "
                       f"({(skip.get('failed') or {}).get('why', skip.get('evidence', ''))}): the cause is the row the update "
                       "moved, not the window, and the next window holding the token meets it again (Marin: skipping the "
                       "bad steps did not shorten recovery).")
        else:
            out.append("No candidate cured the rare token's spike in the replays.")
        typical = (d.get("spike_window") or {}).get("median")
        lagging = [c for c in met["rare token"]["remedies"]["candidates"] if c["verdict"] == "cures" and typical
                   and isinstance(c["end_loss"], float) and c["end_loss"] > (1 + LOSS_TOLERANCE) * typical]
        if lagging:
            out.append("Read each verdict with its bar: " + "; ".join(
                f"{c['name']} cures (no spike, finite), yet ends at {c['end_loss']:.3g}, x{c['end_loss'] / typical:.3g} the "
                f"run's {typical:.3g} before the spike" for c in lagging)
                + ". Where the skip-step baseline itself fails there is no baseline loss to be within tolerance of: "
                "'cures' then says that no spike came, not that the run is as good as before.")
    db = bad["diagnosis"]
    if bad["step"] is None:
        out.append("The mislabelled run did not spike.")
    else:
        largest = _largest_factor(bad["trace"], bad["step"])
        calm = (f"the largest departure in the {LOOKBACK} steps before was {largest[0]}'s x{largest[1]:.3g} (step "
                f"{largest[2]})" if largest else "no step before it was measured")
        jumped = next((r["step"] for r in bad["trace"] if r["step"] >= bad["step"] - LOOKBACK
                       and any(f > DEPARTURE for f in r["factors"].values())), None)
        head = ("with no warning" if bad["warning"] is None else
                f"after a departure at step {bad['warning']['step']} ({bad['warning']['layer']})")
        out.append(f"The mislabelled run spiked at step {bad['step']} (loss {db['loss']:.4g}) {head}: {calm}. "
                   + (f"The updates jump only at step {jumped}, made from the spike's own gradient: the cause is in the "
                      "window, not in any update before it. " if jumped == bad["step"] else "")
                   + f"Diagnosis: {db['failure_class']}: {db['evidence']}.")
        skip = by["mislabelled"].get("skip-samples", {})
        low = by["mislabelled"].get("lr-x0.1", {})
        out.append(f"Dropping samples {', '.join(map(str, db.get('bad_samples') or []))} {skip.get('verdict', 'was not tried')}"
                   f" ({skip.get('evidence', '')}); the LR x0.1 {low.get('verdict', '-')} "
                   f"({(low.get('failed') or {}).get('why', low.get('evidence', ''))}): those samples' loss is high under "
                   "any weights, so no LR on the updates before the window lowers it.")
    out.append("So a per-layer update/weight ratio watched against its own history can warn of a spike that an update "
               "makes (an optimizer-state surge, a drifting state), one step or more before the loss; a spike that the "
               "data makes shows in the loss and the updates at once, and only the replay of its samples names it.")
    return out
