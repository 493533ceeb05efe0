"""The clip verdict says what its numbers say: a threshold above the typical grad norm fires on the tail (a surge), never
advises the value it already has, names the optimizer's family by its class and bases (an AdamW subclass is Adam's),
and never tells of a clip that enlarges a step."""

import json
import re

import pytest
import torch

from stabletrain.records.provenance import optimizer_names
from stabletrain.report import health_summary, load_run

# The run (an AdamW subclass, LRBump, whose LR jumps x200 at step 60; clip.max_norm=1): its 12 log intervals of
# 10 steps as recorded, (clip_rate, grad_norm, grad_norm_max, grad_norm_post_clip).
LRJUMP = [(0.1, 0.6508, 1.1885, 0.6320), (0.0, 0.5903, 0.8853, 0.5903), (0.0, 0.6409, 0.9958, 0.6409),
          (0.0, 0.5996, 0.8970, 0.5996), (0.1, 0.6147, 1.0234, 0.6123), (0.0, 0.6618, 0.9117, 0.6618),
          (1.0, 8.8878, 14.6366, 1.0), (1.0, 3.3741, 7.5122, 1.0), (1.0, 1.4083, 2.1340, 1.0),
          (0.4, 0.9035, 1.5215, 0.7930), (0.1, 0.6441, 1.0015, 0.6439), (0.0, 0.6032, 0.9772, 0.6032)]


def _run(path, rows, optimizer="LRBump", threshold=1.0, bases=None):
    """A run directory with what the clip verdict reads: config, the snapshot's optimizer (``bases``: its class and bases
    as a run records them), one metrics record per 10-step interval."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"clip:\n  max_norm: {threshold}\noptim:\n  name: adamw\n")
    (path / "snapshot.json").write_text(json.dumps({"optimizer": optimizer, **({"optimizer_bases": bases} if bases else {})}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": 10 * (i + 1), "loss": 1.0, "clip_rate": r, "grad_norm": n, "grad_norm_max": m, "grad_norm_post_clip": p})
        + "\n" for i, (r, n, m, p) in enumerate(rows)))
    h = health_summary(load_run(path))
    return h, next((lvl, text) for lvl, text in h.sentences if text.startswith("Clipping fired on"))


class LRBump(torch.optim.AdamW):
    """An AdamW under a name of its own (the issue's)."""


class Plain(torch.optim.SGD):
    """An SGD under a name that does not say so."""


def test_a_threshold_above_the_typical_grad_norm_is_said_to_clip_the_tail_not_ordinary_steps(tmp_path):
    h, (level, text) = _run(tmp_path / "lrjump", LRJUMP)
    f = h.figures
    assert f["grad_norm_median"] == pytest.approx(0.6475, abs=1e-4) and f["clip_rate"] == pytest.approx(37 / 120)
    assert f["clip_rate_late"] == pytest.approx(3.5 / 6) and f["clip_cut_late"] == pytest.approx(0.2061, abs=1e-3)
    assert text == ("Clipping fired on 31% of steps (37 of 120; threshold 1), 58% in the second half, a median cut of 21% "
                    "to the gradient norm there (over its log intervals): a surge of the grad norm, not a low threshold. "
                    "The threshold is above the typical grad norm (median 0.6475), so the clip fired only on the tail, the "
                    "31% of steps whose grad norm exceeded 1: 30 of them in steps 61-90, where the grad norm's interval "
                    "mean rose to 8.888 (x13.7 the median). There the clip capped the gradients' norm at 1, as a guard "
                    "should; what needs a look is why the grad norm rose (the spikes and incidents of those steps, a "
                    "learning rate too high, bad data), not clip.max_norm.")
    assert (level, f["clip_verdict"], f["clip_surges"]) == ("warn", "tail", [(61, 90)])
    # what the line said: false against its own numbers
    for wrong in ("below the typical grad norm", "to about 1 ", "as if the learning rate", "too often"):
        assert wrong not in text, wrong

    # No surge, a heavy tail: 30% of every late interval clipped at a median of 0.5; its peaks (2.5) are worth a retune
    h, (level, text) = _run(tmp_path / "heavy", [(0.3, 0.5, 2.5, 0.4)] * 10)
    assert (level, h.figures["clip_verdict"]) == ("warn", "tail")
    assert ("often, from the tail of the grad norm. The threshold is above the typical grad norm (median 0.5), so the clip "
            "fired only on the tail, the 30% of steps whose grad norm exceeded 1, spread over the second half (none of its "
            "log intervals had most of its steps clipped); to clip fewer of them, set clip.max_norm to about 2.5 (the "
            "median of each interval's largest grad norm).") in text
    # ... whose peaks are the threshold itself: no advice to set the value it has
    text = _run(tmp_path / "peaks", [(0.3, 0.5, 1.02, 0.4)] * 10)[1][1]
    assert text.endswith("(none of its log intervals had most of its steps clipped).") and "set clip.max_norm" not in text


def test_the_clip_effect_names_the_family_the_optimizer_stepped_as_and_never_a_larger_step(tmp_path):
    below = [(1.0, 2.5, 3.0, 1.0)] * 10  # every step clipped, the grad norm 2.5x the threshold
    # An AdamW subclass under its own name, as a run records it (its bases): Adam's effect, by its name
    h, (level, text) = _run(tmp_path / "bump", below, bases=optimizer_names(LRBump([torch.nn.Parameter(torch.ones(1))]))[
        "optimizer_bases"])
    assert (level, h.figures["clip_verdict"]) == ("warn", "most")
    assert ("The threshold is below the typical grad norm (median 2.5), so the clip, not the gradient, sets the size of "
            "most updates; with LRBump, an optimizer of Adam's family, the update size barely changes (it divides by the "
            "clipped gradients' RMS)") in text
    assert "learning rate were" not in text and "plain gradient step" not in text
    # An SGD subclass whose name does not say so: SGD's smaller step, 1/2.5 = 0.4x
    plain = optimizer_names(Plain([torch.nn.Parameter(torch.ones(1))], lr=0.1))["optimizer_bases"]
    text = _run(tmp_path / "plain", below, optimizer="Plain", bases=plain)[1][1]
    assert "with Plain, an optimizer of SGD's family, the update shrinks as if the learning rate were about 0.4x as large" in text
    # No bases recorded (a run from before they were): the name alone, and the plain gradient step's LR a smaller one
    text = _run(tmp_path / "unknown", below)[1][1]
    assert "with LRBump every clipped gradient is rescaled to the same norm (for a plain gradient step, as if the " \
           "learning rate were about 0.4x as large)" in text
    # Most late steps clipped by a threshold just above the median (0.9): a close threshold, and no LR factor (it
    # would be 1/0.9 = 1.1x, a clip that enlarged the step)
    text = _run(tmp_path / "close", [(0.8, 0.9, 1.5, 0.6)] * 10, optimizer="SGD")[1][1]
    assert "The threshold is close to the typical grad norm (median 0.9)" in text
    assert "with SGD the clipped updates shrink" in text and "learning rate were" not in text


def test_a_run_records_its_optimizers_class_and_bases_in_its_snapshot(tmp_path):
    """What the clip verdict names the family by: the built-in loop's own optimizer, and an adapter's (Monitor)."""
    from helpers import cfg

    from stabletrain import Monitor, Trainer

    Trainer(cfg("train.max_steps=2", "eval.every=0", "ckpt.every=0"), run_dir=tmp_path / "run").fit()
    snapshot = json.loads((tmp_path / "run" / "snapshot.json").read_text())
    assert snapshot["optimizer"] == "AdamW" and snapshot["optimizer_bases"][0] == "AdamW", snapshot
    assert "Optimizer" in snapshot["optimizer_bases"], snapshot
    model = torch.nn.Linear(2, 1)
    with Monitor(model, LRBump(model.parameters()), run_dir=tmp_path / "mon", log_every=1) as mon:
        mon.backward(model(torch.ones(1, 2)).sum())
        mon.step()
    snapshot = json.loads((tmp_path / "mon" / "snapshot.json").read_text())
    assert snapshot["optimizer"] == "LRBump" and snapshot["optimizer_bases"][:2] == ["LRBump", "AdamW"]


def test_a_run_whose_last_intervals_were_all_skipped_says_so_in_the_loss_and_clip_lines(tmp_path):
    """A new-user trial: fp16's forward overflowed from step 31 and every step to the stop at 50 was skipped. The report
    read 'Train loss 1.082 → 0.7617 (first → last interval)' and 'Clipping fired on 100% of steps (28 of 28), 0% in the
    second half: healthy ... rarely after': the last intervals had no finite loss and the second half no applied step."""
    path = tmp_path / "run"
    path.mkdir()
    (path / "config.yaml").write_text("clip:\n  max_norm: 1.0\noptim:\n  name: adamw\n")
    rows = [{"step": 10, "loss": 1.082, "clip_rate": 1.0, "grad_norm": 3.0, "grad_norm_post_clip": 1.0, "num_skipped": 2},
            {"step": 20, "loss": 0.9, "clip_rate": 1.0, "grad_norm": 2.0, "grad_norm_post_clip": 1.0, "num_skipped": 0},
            {"step": 30, "loss": 0.7616, "clip_rate": 1.0, "grad_norm": 2.0, "grad_norm_post_clip": 1.0, "num_skipped": 0},
            {"step": 40, "loss": "nan", "clip_rate": 0.0, "grad_norm": "nan", "num_skipped": 10},
            {"step": 50, "loss": "nan", "clip_rate": 0.0, "grad_norm": "nan", "num_skipped": 10}]
    (path / "metrics.jsonl").write_text("".join(json.dumps({"interval_steps": 10, **r}) + "\n" for r in rows))
    h = health_summary(load_run(path))
    text = " ".join(t for _, t in h.sentences)
    assert ("Train loss 1.082 → 0.7616 (first → last finite interval); from step 31 on no step's loss was finite "
            "(2 intervals after step 30)") in text, text
    assert ("Clipping fired on 100% of the applied steps (28 of 28; threshold 1); the second half of the run applied no "
            "step (every one skipped, below): no verdict on it.") in text, text
    # Its last finite interval's last two steps non-finite too (their events say so): the stretch began at step 29, not
    # 31 (a trial: 'from step 151 on' where step 150 was non-finite as well)
    (path / "events.jsonl").write_text("".join(json.dumps({"step": s, "kind": "nonfinite", "reason": "non-finite loss",
                                                           "loss": float("nan")}) + "\n" for s in (25, 29, 30, 31)))
    text = " ".join(t for _, t in health_summary(load_run(path)).sentences)
    assert "from step 29 on no step's loss was finite (2 intervals after step 30)" in text, text
    assert "healthy" not in text and h.figures["clip_verdict"] == "none late"


def test_at_log_every_1_whether_the_loss_rose_is_read_over_ten_step_stretches(tmp_path):
    """log.every=1: the loss sentence compared one step's loss with another's, and a run whose batches' losses scatter
    (0.3-0.7 about a flat 0.5, one lucky 0.1) 'rose x4.5 from its best interval's mean', in the report and the last line.
    Read over 10-step stretches: no rise there; a real rise (a divergence at log.every=1) is still said, in those terms."""
    import random

    rng = random.Random(0)
    path = tmp_path / "run"
    path.mkdir()
    (path / "config.yaml").write_text("log:\n  every: 1\n")
    losses = [2.0 - 0.015 * s for s in range(1, 101)] + [0.5 + rng.uniform(-0.2, 0.2) for _ in range(100)]
    losses[150], losses[-1] = 0.1, 0.45
    rows = [{"step": s, "interval_steps": 1, "loss": x, "loss_min": x, "loss_steps": 1} for s, x in enumerate(losses, 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    h = health_summary(load_run(path))
    text = " ".join(t for _, t in h.sentences)
    assert "rose" not in text and "loss_rose" not in h.figures, text
    losses[-20:] = [0.5 * 1.3 ** k for k in range(1, 21)]  # diverging: every step of the last 10 far above the best
    rows = [{"step": s, "interval_steps": 1, "loss": x, "loss_min": x, "loss_steps": 1} for s, x in enumerate(losses, 1)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    h = health_summary(load_run(path))
    text = " ".join(t for _, t in h.sentences)
    assert re.search(r"; it rose x[\d.]+ \(the mean of its last 10 steps, [\d.]+\) from its best 10 steps' mean, "
                     r"[\d.]+ at step \d+", text), text
    assert h.figures["loss_rose"]["best_of"] == "its best 10 steps"
    # A review: a run of 20 such steps (two stretches) compares them, not steps; a finite step between non-finite ones (a
    # stretch of 1) is no 'best 1 steps' mean'
    for n, lucky in ((20, 10), (200, 150)):
        flat = [0.5 + rng.uniform(-0.2, 0.2) for _ in range(n)]
        flat[lucky] = 0.1
        rows = [{"step": s, "interval_steps": 1, "loss": x, "loss_min": x, "loss_steps": 1} for s, x in enumerate(flat, 1)]
        if n == 200:  # steps 150 and 152 non-finite: step 151's lucky loss stands alone
            rows = [r for r in rows if r["step"] not in (150, 152)]
            rows += [{"step": s, "interval_steps": 1, "loss": "nan", "loss_steps": 0} for s in (150, 152)]
            rows.sort(key=lambda r: r["step"])
        (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        h = health_summary(load_run(path))
        text = " ".join(t for _, t in h.sentences)
        assert "rose" not in text and "loss_rose" not in h.figures, (n, text)
    # (a review) a rise whose last steps alternate with non-finite ones: judged up to the last whole stretch, said so
    rose = [0.5 + rng.uniform(-0.1, 0.1) for _ in range(170)] + [3.0] * 20
    rows = [{"step": s, "interval_steps": 1, "loss": x, "loss_min": x, "loss_steps": 1} for s, x in enumerate(rose, 1)]
    rows += [{"step": s, "interval_steps": 1, "loss": 3.0 if s % 2 else "nan", "loss_min": 3.0, "loss_steps": s % 2}
             for s in range(191, 201)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = " ".join(t for _, t in health_summary(load_run(path)).sentences)
    assert re.search(r"; it rose x[\d.]+ \(the mean of its last 10 steps to step 191, 3\) from its best 10 steps' mean",
                     text), text


def test_an_end_interval_lifted_by_a_spike_of_known_loss_reads_without_it_where_the_median_is_no_lower(tmp_path):
    """A new user's Lightning run (135 steps, a spike at 121, log every 10): its 5-step tail merged into the interval of
    the spike read 'Train loss 1.288 -> 0.01125 (first -> last interval with the 5-step one after it)', the spike's
    0.068 in it: the median of the last intervals was no lower (the loss still falling). Its own steps without the
    spike's (known from its event) are the end: 0.00722."""
    logged = [(10, 1.28833, 1.13576, 10), (20, 0.98156, 0.82994, 10), (30, 0.63941, 0.45397, 10), (40, 0.33884, 0.19089, 10),
              (50, 0.15901, 0.10415, 10), (60, 0.06508, 0.03779, 10), (70, 0.03525, 0.02214, 10), (80, 0.02063, 0.01469, 10),
              (90, 0.01274, 0.00854, 10), (100, 0.01185, 0.0089, 10), (110, 0.0091, 0.00756, 10), (120, 0.00712, 0.00607, 10),
              (130, 0.01281, 0.00505, 10), (135, 0.00812, 0.00515, 5)]
    (tmp_path / "config.yaml").write_text("train:\n  max_steps: 135\nlog:\n  every: 10\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(
        {"step": s, "loss": m, "loss_min": low, "loss_steps": n, "interval_steps": n}) + "\n" for s, m, low, n in logged))
    (tmp_path / "events.jsonl").write_text(json.dumps({"step": 121, "kind": "spike", "time": 1.7e9, "loss": 0.06765,
                                                       "reason": "loss spike"}) + "\n")
    text = next(t for _, t in health_summary(load_run(tmp_path)).sentences if t.startswith("Train loss"))
    assert text.startswith("Train loss 1.288 → 0.007218 (first interval → last interval without its spike step: the last "
                           "interval's mean, 0.01125, is lifted by a loss spike at step 121"), text
