"""Lab 3: accumulation over an epoch whose length is not a multiple of k, and the loss that gets logged.

Three copies of one model train one epoch with SGD (no momentum, so parameter differences are
gradient differences times the lr), on the windows :class:`~stabletrain.data.WindowStream` cuts
(k micro-batches, fewer at the end of the epoch, the last micro-batch short):

- ``window``: :class:`~stabletrain.step.TrainStep` over the k micro-batches (the loop's one step: each
  micro-batch's loss sum is divided by the items of the whole window);
- ``big``: the same step over one batch holding all the window's samples (the reference);
- ``naive``: the chapter's loop, each micro-batch mean divided by k, then ``optimizer.step()``.

Then one window of variable-length sequences, where the task loss returns ``(sum over tokens,
tokens)``: the step normalizes by the window's tokens; a per-token *mean* loss (the same step, but a
scalar mean: each micro-batch weighted by its sequences) gives the mean of means.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from ..data import EpochOrder, WindowStream
from ..policies.precision import PrecisionPolicy
from ..seeding import seed_everything
from ..step import TrainStep
from ..tasks.mlp import make_mlp, make_task
from . import Claim, LabResult, new_figure, save_figure

#: fp32 equivalence: max |param diff| after the epoch, relative to max |param| (summation order only).
RTOL = 1e-5
#: A wrong normalization must differ by at least this many tolerances.
WRONG_MIN = 100.0
LR = 0.5


class VarLenSequences(Dataset):
    """Sequences of 1..max_len tokens (padded, with a mask) with a per-token regression target."""

    def __init__(self, n: int, max_len: int = 12, dim: int = 3, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = torch.randint(1, max_len + 1, (n,), generator=g)
        self.x = torch.randn(n, max_len, dim, generator=g)
        self.y = torch.randn(n, max_len, generator=g)
        self.mask = (torch.arange(max_len)[None, :] < self.lengths[:, None]).float()

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor, Tensor]:
        return self.x[i], self.y[i], self.mask[i]


def token_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    """(sum of squared errors over real tokens, number of real tokens): the task contract's (sum, count)."""
    x, y, mask = batch
    err = (model(x).squeeze(-1) - y) ** 2
    return (err * mask).sum(), mask.sum()


def token_mean_loss(model: nn.Module, batch: tuple[Tensor, Tensor, Tensor]) -> Tensor:
    """The same loss as a per-token mean of the micro-batch: what accumulation turns into a mean of means."""
    loss_sum, count = token_loss(model, batch)
    return loss_sum / count


def _max_diff(a: nn.Module, b: nn.Module) -> float:
    return max(float((p.detach() - q.detach()).abs().max()) for p, q in zip(a.parameters(), b.parameters()))


def _max_abs(m: nn.Module) -> float:
    return max(float(p.detach().abs().max()) for p in m.parameters())


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, fused=True)  # fused: the step can skip on the device


def run(out_dir: Path | None = None, seed: int = 0, *, k: int = 4, num_samples: int = 84, batch_size: int = 8,
        dropout: float = 0.0, num_sequences: int = 16) -> LabResult:
    """Train one epoch three ways and one variable-length window two ways; ``dropout > 0`` breaks the equivalence."""
    seed_everything(seed)
    precision = PrecisionPolicy("fp32", "cpu")
    task = make_task(num_samples=num_samples, in_dim=16, width=32, depth=2, dropout=dropout)
    models = {name: copy.deepcopy(task.model).train() for name in ("window", "big", "naive")}
    steps = {name: TrainStep(models[name], _sgd(models[name]), precision) for name in ("window", "big")}
    naive_opt = _sgd(models["naive"])
    order = EpochOrder(num_samples, batch_size, seed, shuffle=True)
    stream = WindowStream(task.train_data, order, k)
    collate = default_collate

    rows, per_window = [], []
    while True:
        window = stream.next_window()
        if window.epoch > 0:
            break
        micro = [(len(idx), b) for idx, b in zip(window.indices, window.batches)]
        all_idx = [i for idx in window.indices for i in idx]
        big = collate([task.train_data[i] for i in all_idx])
        out_w = steps["window"](micro, task.loss)
        out_b = steps["big"]([(len(all_idx), big)], task.loss)
        naive_opt.zero_grad(set_to_none=True)
        for _, b in micro:  # the chapter's loop: mean / k, whatever the window really holds
            naive_loss = task.loss(models["naive"], b) / k
            naive_loss.backward()
        naive_opt.step()
        rec = {"sizes": [n for n, _ in micro], "logged": float(out_w["loss"]), "big_loss": float(out_b["loss"]),
               "naive_logged": float(naive_loss.detach()), "diff_window": _max_diff(models["window"], models["big"]),
               "diff_naive": _max_diff(models["naive"], models["big"]), "count": float(out_w["count"])}
        per_window.append(rec)
        rows.append([f"epoch window {len(per_window)}", "+".join(map(str, rec["sizes"])), rec["logged"], rec["big_loss"],
                     rec["naive_logged"], rec["diff_window"], rec["diff_naive"]])

    scale = _max_abs(models["big"])
    tol = RTOL * scale
    diff_window = per_window[-1]["diff_window"]
    diff_naive = per_window[-1]["diff_naive"]
    loss_err = max(abs(r["logged"] - r["big_loss"]) / abs(r["big_loss"]) for r in per_window)

    # Variable-length sequences: (sum, count) vs a per-token mean, one window of k micro-batches.
    seq = VarLenSequences(num_sequences, seed=seed)
    seed_everything(seed)
    base = make_mlp(3, 16, 2, 1, activation="tanh")
    var_models = {name: copy.deepcopy(base) for name in ("sum_count", "big", "mean_of_means")}
    per = max(1, num_sequences // k)
    groups = [list(range(i, min(i + per, num_sequences))) for i in range(0, num_sequences, per)]
    micro = [(len(g), collate([seq[i] for i in g])) for g in groups]
    whole = [(num_sequences, collate([seq[i] for i in range(num_sequences)]))]
    out_sc = TrainStep(var_models["sum_count"], _sgd(var_models["sum_count"]), precision)(micro, token_loss)
    out_big = TrainStep(var_models["big"], _sgd(var_models["big"]), precision)(whole, token_loss)
    out_mm = TrainStep(var_models["mean_of_means"], _sgd(var_models["mean_of_means"]), precision)(micro, token_mean_loss)
    var_tol = RTOL * _max_abs(var_models["big"])
    diff_sc = _max_diff(var_models["sum_count"], var_models["big"])
    diff_mm = _max_diff(var_models["mean_of_means"], var_models["big"])
    tokens = [int(b[2].sum()) for _, b in micro]
    rows.append(["var-len window", "+".join(map(str, tokens)) + " tokens", float(out_sc["loss"]), float(out_big["loss"]),
                 float(out_mm["loss"]), diff_sc, diff_mm])
    columns = ["window", "micro-batch sizes", "logged loss", "big-batch loss", "wrong way: logged",
               "max|dθ| step vs big", "max|dθ| wrong vs big"]

    claims = [
        Claim(f"k={k} window normalization matches one big batch over the epoch, short tail included",
              f"{diff_window:.3g}", f"<= {tol:.3g} ({RTOL:g} x max|θ|)", diff_window <= tol),
        Claim("naive /k does not (the tail window is divided by k too)", f"{diff_naive:.3g}",
              f">= {WRONG_MIN:g} x {tol:.3g}", diff_naive >= WRONG_MIN * tol),
        Claim("variable-length (sum, count) matches the big batch", f"{diff_sc:.3g}", f"<= {var_tol:.3g}",
              diff_sc <= var_tol),
        Claim("a per-token mean (mean of means) does not", f"{diff_mm:.3g}", f">= {WRONG_MIN:g} x {var_tol:.3g}",
              diff_mm >= WRONG_MIN * var_tol),
        Claim("the logged loss is the unscaled per-item mean of the window (= the big batch's loss)",
              f"max rel. error {loss_err:.3g}", "<= 1e-06", loss_err <= 1e-6),
    ]
    plots = []
    if out_dir is not None:
        fig, (ax1, ax2) = new_figure(ncols=2, width=5.2, height=3.4)
        x = list(range(1, len(per_window) + 1))
        floor = 1e-12
        ax1.semilogy(x, [max(r["diff_window"], floor) for r in per_window], "o-", label="TrainStep window (sum / items)")
        ax1.semilogy(x, [max(r["diff_naive"], floor) for r in per_window], "s-", label=f"naive mean / {k}")
        ax1.axhline(tol, color="#888", ls="--", lw=1, label="tolerance")
        ax1.set_xlabel("window of the epoch (last = short tail)")
        ax1.set_ylabel("max |θ - θ_big| after the step")
        ax1.set_title(f"k={k}: parameters vs one big batch", fontsize=10)
        ax1.legend(fontsize=7)
        ax2.plot(x, [r["big_loss"] for r in per_window], "o-", label="big-batch loss")
        ax2.plot(x, [r["logged"] for r in per_window], "x--", label="logged by the step")
        ax2.plot(x, [r["naive_logged"] for r in per_window], "s:", label="naive: last micro loss / k")
        ax2.set_xlabel("window of the epoch")
        ax2.set_ylabel("loss")
        ax2.set_title("the logged loss", fontsize=10)
        ax2.legend(fontsize=7)
        plots.append(save_figure(fig, out_dir / "lab3_accumulation.png"))

    setup = (f"mlp task, {num_samples} samples, micro-batch {batch_size}, k={k}: the epoch's windows are "
             f"{', '.join('+'.join(map(str, r['sizes'])) for r in per_window)} samples; SGD lr {LR}, fp32, "
             f"dropout {dropout:g}; then {num_sequences} sequences of 1..12 tokens in {len(groups)} micro-batches; "
             f"the wrong way is the naive mean / k for the epoch and a per-token mean loss for the sequences; seed {seed}")
    numbers = {"diff_window": diff_window, "diff_naive": diff_naive, "tol": tol, "diff_sum_count": diff_sc,
               "diff_mean_of_means": diff_mm, "var_tol": var_tol, "logged_loss_rel_err": loss_err,
               "tail_sizes": per_window[-1]["sizes"], "tokens": tokens}
    return LabResult("3", setup, columns, rows, claims,
                     _explain(per_window, numbers, k, dropout, tokens, float(out_sc["loss"]), float(out_mm["loss"])),
                     plots, numbers)


def _explain(per_window: list[dict[str, Any]], n: dict[str, Any], k: int, dropout: float, tokens: list[int],
             sc_loss: float, mm_loss: float) -> list[str]:
    tail = per_window[-1]
    full = [r for r in per_window if len(r["sizes"]) == k]
    out = []
    tail_items = sum(tail["sizes"])
    s = (f"The epoch ends in a window of {len(tail['sizes'])} micro-batches ({'+'.join(map(str, tail['sizes']))} = "
         f"{tail_items} samples). The step divides each micro-batch's loss sum by those {tail_items} items, so after the "
         f"epoch the parameters differ from one-big-batch training by {n['diff_window']:.3g} ")
    if n["diff_window"] <= n["tol"]:
        s += "(summation order only)."
    else:
        s += (f"(above the tolerance {n['tol']:.3g}: with dropout {dropout:g} each micro-batch draws other masks than the "
              "big batch, so the two compute different functions, not just a different normalization)." if dropout > 0
              else f"(above the tolerance {n['tol']:.3g}).")
    out.append(s)
    if full:
        first = full[0]
        same = "equal within the tolerance" if first["diff_naive"] <= n["tol"] else "already off"
        s = (f"Dividing each micro-batch mean by k={k} is right only for a full window of equal micro-batches: after the "
             f"first window the naive parameters differ by {first['diff_naive']:.3g} ({same}), ")
    else:
        s = "No window was full; "
    if len(tail["sizes"]) < k or len(set(tail["sizes"])) > 1:
        s += (f"and after the tail window by {n['diff_naive']:.3g}, because the tail's gradient was divided by {k} where "
              f"it holds {len(tail['sizes'])} micro-batches of unequal size: its update is about {len(tail['sizes'])}/{k} "
              "of the right one, and the short micro-batch counts as much as a full one.")
    else:
        s += (f"and after the last window by {n['diff_naive']:.3g}: this epoch has no short tail "
              f"({n['tail_sizes']}), so dividing by k happens to be right here.")
    out.append(s)
    out.append(f"With variable-length sequences ({'+'.join(map(str, tokens))} tokens per micro-batch) the (sum, count) "
               f"loss gives the window's per-token mean (loss {sc_loss:.4g}) and matches the big batch to "
               f"{n['diff_sum_count']:.3g}; "
               f"a per-token mean per micro-batch gives the mean of means ({mm_loss:.4g}), which weights a token of a "
               f"short micro-batch more, and moves the parameters {n['diff_mean_of_means']:.3g} away.")
    if n["logged_loss_rel_err"] <= 1e-6:
        logged = (f"The loss the step returns (what the loop logs) equals the big batch's per-item loss to a relative "
                  f"{n['logged_loss_rel_err']:.2g} in every window, tail included (tail: {tail['logged']:.4g}); ")
    else:
        logged = (f"The loss the step returns differs from the big batch's by up to a relative {n['logged_loss_rel_err']:.2g}"
                  f"{' (other dropout masks)' if dropout > 0 else ''}, though it is still the window's per-item mean "
                  f"(tail: {tail['logged']:.4g}); ")
    out.append(logged + f"the naive "
               f"loop's loss variable holds the last micro-batch's loss divided by {k} ({tail['naive_logged']:.4g} in the "
               f"tail), about {tail['logged'] / tail['naive_logged'] if tail['naive_logged'] else float('inf'):.2g}x too "
               "small, which is how a divided loss in the log hides a change of k.")
    return out
