"""The Lightning adapter on a real lightning.Trainer: run directory, no per-step sync, a planted NaN, fp16, resume."""

from __future__ import annotations

import json
import logging
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch.utils.data import DataLoader, TensorDataset

L = pytest.importorskip("lightning")
from integration_models import BAD_POSITION, Net, OurSyncs, outlier_pairs  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.loggers import CSVLogger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from stabletrain.callbacks import Callback as StableCallback  # noqa: E402
from stabletrain.incident_replay import diagnose_incident  # noqa: E402
from stabletrain.integrations.lightning import StableTrainCallback  # noqa: E402
from stabletrain.internals import compiled_methods  # noqa: E402
from stabletrain.records.captured import lightning_loss as _lightning_loss  # noqa: E402
from stabletrain.records.events import EVENT_KINDS, METRIC_KEYS  # noqa: E402
from stabletrain.records.jsonl import read_jsonl  # noqa: E402
from stabletrain.report import load_run, write_report  # noqa: E402

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
pytestmark = [pytest.mark.slow,  # slow: a real Lightning Trainer per test
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning")]

BATCH = 8


class LitNet(L.LightningModule):
    """A small LightningModule around the shared Net (sqrt layer: NaN for a planted sample)."""

    def __init__(self, lr: float = 1e-2, fused: bool = True, reinit: bool = False, seed: int = 0):
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(seed)
        self.net = Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def on_fit_start(self):
        if self.hparams.reinit:  # a host-side hook that silently re-initializes a layer
            self.net.fc2.reset_parameters()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, fused=self.hparams.fused)


def loader(n_steps, bad_index=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n_steps * BATCH, 4, generator=g)
    y = torch.randn(n_steps * BATCH, 1, generator=g)
    if bad_index is not None:
        x[bad_index, 0] = -100.0
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def fit(module, callback, n_steps, *, bad_index=None, ckpt_path=None, max_steps=None, **trainer_kw):
    """Fit on ``n_steps`` batches per epoch for ``max_steps`` (default: one epoch)."""
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=max_steps or n_steps, accelerator="cpu", logger=trainer_kw.pop("logger", False),
                        enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[callback, *trainer_kw.pop("callbacks", [])],
                        enable_checkpointing=trainer_kw.pop("enable_checkpointing", False), **trainer_kw)
    trainer.fit(module, loader(n_steps, bad_index), ckpt_path=ckpt_path)
    return trainer


def test_clean_run_metrics_mirror_and_report(tmp_path):
    torch.manual_seed(0)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5)
    trainer = fit(LitNet(), cb, 12, gradient_clip_val=0.05, logger=CSVLogger(tmp_path / "csv"), log_every_n_steps=1)
    records, problems = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert not problems and [r["step"] for r in records] == [5, 10, 12]
    assert set(records[0]) <= set(METRIC_KEYS)
    assert records[0]["clip_rate"] == 1.0 and records[0]["grad_norm_post_clip"] <= 0.05 * (1 + 1e-5)
    assert records[0]["grad_norm"] > 0.05 and records[0]["lr"] == pytest.approx(1e-2)
    assert records[-1]["samples_seen"] == 12 * BATCH and records[0]["top_grad_layers"]
    # ||update|| of each interval's last step, measured around the host's own optimizer step; the run's last too (12: a
    # trial read "nan" there, the host's last step unknown to the session)
    assert all(0 < r["update_norm"] and 0 < r["update_ratio"] < 1 for r in records)
    # Mirrored into Lightning's own logging at the boundaries, and only there (a logger writing every step must not
    # repeat an interval's figures at each: it did, from log_dict in the batch-end hook).
    assert trainer.callback_metrics["stabletrain/grad_norm"] == pytest.approx(records[1]["grad_norm"], rel=1e-6)
    import csv

    (rows_file,) = (tmp_path / "csv").rglob("metrics.csv")
    mirrored = [r for r in csv.DictReader(rows_file.open()) if r.get("stabletrain/grad_norm")]
    assert [int(r["step"]) for r in mirrored] == [5, 10]  # (the last, short interval is closed after the last batch)
    assert [float(r["stabletrain/grad_norm"]) for r in mirrored] == pytest.approx([r["grad_norm"] for r in records[:2]],
                                                                                  rel=1e-6)
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["integration"] == "lightning" and config["host"]["gradient_clip_val"] == 0.05
    assert config["clip"]["max_norm"] == 0.05 and config["optim"]["name"] == "AdamW"
    snapshot = json.loads((tmp_path / "run" / "snapshot.json").read_text())
    assert snapshot["host_versions"]["lightning"] and snapshot["init_signal"]["summary"]
    events, _ = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert all(e["kind"] in EVENT_KINDS for e in events) and not any(e["kind"] == "init_overwritten" for e in events)
    assert "LitNet" in write_report(tmp_path / "run").read_text()


def test_the_snapshot_holds_the_hosts_seed_and_determinism_not_stabletrains_defaults(tmp_path, monkeypatch):
    """A new user's trial: seed_everything(7) and Trainer(deterministic=True), yet snapshot.json read seed 0 and
    deterministic false (stabletrain's own config defaults, which this run never used)."""
    monkeypatch.setenv("PL_GLOBAL_SEED", "0")  # (put back after: seed_everything writes it, and the process goes on)
    L.seed_everything(7)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        fit(LitNet(), StableTrainCallback(run_dir=tmp_path / "run", log_every=5), 2, deterministic=True)
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])  # (Lightning leaves its setting on)
    snapshot = json.loads((tmp_path / "run" / "snapshot.json").read_text())
    assert (snapshot["seed"], snapshot["deterministic"]) == (7, True)
    monkeypatch.delenv("PL_GLOBAL_SEED")
    fit(LitNet(), StableTrainCallback(run_dir=tmp_path / "unseeded", log_every=5), 2)
    snapshot = json.loads((tmp_path / "unseeded" / "snapshot.json").read_text())
    assert (snapshot["seed"], snapshot["deterministic"]) == (None, False)  # none given: none said


def test_no_host_sync_between_log_boundaries(tmp_path):
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5)
    with OurSyncs(lambda: cb.session.step if cb.session is not None else -1) as counter:
        fit(LitNet(), cb, 15, gradient_clip_val=1.0)
    steps = sorted({s for s, _ in counter.calls})
    assert set(steps) <= {-1, 0, 5, 10, 15}, counter.calls  # -1/0: the init fingerprint and signal report, once
    assert sum(1 for s, _ in counter.calls if s == 10) == 1


def test_planted_nan_is_skipped_captured_and_traced(tmp_path, capfd):
    bad_step = 3
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5)
    module = LitNet()
    fit(module, cb, 8, bad_index=(bad_step - 1) * BATCH + BAD_POSITION)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    run = load_run(tmp_path / "run")
    assert run.metrics[0]["num_nonfinite"] == 1 and run.metrics[0]["num_skipped"] == 1  # the bad step alone
    incident = run.counted_events("incident")[0]
    d = incident.extra["diagnosis"]
    assert incident.step == bad_step
    assert (d["stage"], d["op"], d["direction"], d["module"]) == ("activations", "aten.sqrt.default", "forward",
                                                                  "net.root")
    assert d["bad_positions"] == [{"micro_batch": 0, "position": BAD_POSITION}] and d["reproduces"] is True
    lines = console_incident_lines(capfd)  # the host's console: exactly one line, as the built-in loop's
    assert len(lines) == 1 and lines[0].startswith(
        f"stabletrain: incident at step {bad_step}: op: first non-finite value (activations): aten.sqrt.default in "
        "forward of module "), lines
    # `stabletrain diagnose` in a fresh state: the LightningModule is rebuilt from its class and hparams.
    fresh = diagnose_incident(tmp_path / "run" / "incidents" / f"step_{bad_step:06d}")
    assert (fresh["module"], fresh["bad_samples"], fresh["first_nonfinite_param"]) == ("net.root", [BAD_POSITION],
                                                                                      "net.fc1.weight")



class SkippingNet(LitNet):
    """Returns None from training_step for the batches ``skip`` (Lightning's documented way to skip a batch)."""

    def __init__(self, skip=(), **kw):
        super().__init__(**kw)
        self.skip = set(skip)

    def training_step(self, batch, batch_idx):
        return None if batch_idx in self.skip else super().training_step(batch, batch_idx)


def test_a_training_step_that_returns_none_is_lightnings_own_skip_not_a_bad_step(tmp_path, capfd):
    """A review: a training_step returning None (no backward) read as a NaN loss, a skip and a 'not reproducible'
    incident; under on_nonfinite='stop' the fit ended half way. A step whose every micro-batch returned None is
    Lightning's own skip (not judged nor recorded); one of two (accumulation) is replayed as it ran, without it."""
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5, on_nonfinite="stop")
    bad_batch = 18  # optimizer step 10 of Lightning's (accumulating 2); batches 2 and 3 (step 2) and 13 return None
    module = SkippingNet(skip=(2, 3, 13))
    trainer = fit(module, cb, 24, bad_index=bad_batch * BATCH + BAD_POSITION, max_steps=12, accumulate_grad_batches=2)
    run = load_run(tmp_path / "run")
    assert [e.kind for e in run.counted_events("stop")] == ["stop"] and trainer.global_step == 11  # at its boundary (10)
    (incident,) = run.counted_events("incident")
    d = incident.extra["diagnosis"]
    assert incident.step == 9 and d["reproduces"] is True, d["summary"]  # step 2 was Lightning's skip: not counted
    assert d["bad_positions"] == [{"micro_batch": 0, "position": BAD_POSITION}], d["bad_positions"]
    assert sum(r["num_nonfinite"] for r in run.metrics) == 1
    # (a trial: the stop ended the fit with no line at all; the events and the report had it)
    said = [x for x in capfd.readouterr().out.splitlines() if " run stops at step" in x]
    assert len(said) == 1 and said[0].startswith("stabletrain: the lightning run stops at step 10: non-finite"), said


def test_the_step_0_signal_report_runs_once_while_the_first_steps_are_lightnings_own_skips(tmp_path, monkeypatch):
    """A review: the report's 'once' was 'step 0 and no micro-batch pending'; a host skip keeps step 0 and clears what is
    pending, so a run whose first batches return None ran it (a model copy, a forward and backward, syncs) on each."""
    import stabletrain.integrations.core as core

    calls = []
    real = core.host_signal
    monkeypatch.setattr(core, "host_signal", lambda *a, **k: calls.append(1) or real(*a, **k))
    fit(SkippingNet(skip=(0, 1, 2)), StableTrainCallback(run_dir=tmp_path / "run", log_every=5), 8)
    assert len(calls) == 1


class SelfCallNet(LitNet):
    """The usual pattern: ``training_step`` calls ``self(x)``, the module's own forward."""

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)


def test_a_training_step_that_calls_self_is_replayed_and_traced(tmp_path):
    # The replay runs training_step as the module's call: its self(x) ran training_step again, on x (a ValueError
    # unpacking it): no step-0 report, and every incident 'captured' without an op, module or sample.
    bad_step = 3
    fit(SelfCallNet(), StableTrainCallback(run_dir=tmp_path / "run", log_every=5), 8,
        bad_index=(bad_step - 1) * BATCH + BAD_POSITION)
    d = load_run(tmp_path / "run").counted_events("incident")[0].extra["diagnosis"]
    assert (d["op"], d["module"], d["bad_positions"]) == ("aten.sqrt.default", "net.root",
                                                         [{"micro_batch": 0, "position": BAD_POSITION}]), d
    assert (tmp_path / "run" / "init_signal.json").exists()


@pytest.mark.parametrize("on_spike", ["warn"])  # (the device-side skip: the Hugging Face test)
def test_a_loss_spike_is_captured_and_its_samples_named_and_verified(tmp_path, on_spike, capfd):
    """Samples at positions 1 and 5 of step 15 (mid-interval) carry targets x40 off: the spike is captured from the
    interval's start, diagnosed as data with those positions named and their removal verified (the step without them
    normal by the guard's rule), as in the built-in loop; under on_spike=skip the step is skipped on the device."""
    n, step = 30, 15
    x, y = outlier_pairs(n, step, (1, 5), BATCH)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=10, on_spike=on_spike)
    module = LitNet()
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=n, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb], enable_checkpointing=False)
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False))
    run = load_run(tmp_path / "run")
    (incident,) = run.counted_events("incident")
    d = incident.extra["diagnosis"]
    assert (incident.step, incident.extra["anomaly"], d["failure_class"], d["bad_samples"]) == (step, "spike", "data", [1, 5])
    assert d["bad_positions"] == [{"micro_batch": 0, "position": 1}, {"micro_batch": 0, "position": 5}]
    full = json.loads((tmp_path / "run" / "incidents" / f"step_{step:06d}" / "diagnosis.json").read_text())
    assert full["reproduces"] is True and full["samples"]["without"]["ratio"] < 2.0, full["summary"]
    assert run.metrics[1]["num_skipped"] == (1 if on_spike == "skip" else 0)
    assert [e.step for e in run.counted_events("spike")] == [step]
    lines = console_incident_lines(capfd)  # the host's console: exactly one line, as the built-in loop's
    assert len(lines) == 1 and lines[0].startswith(f"stabletrain: spike at step {step}: data: samples 1, 5 carry "), lines
    # capture.spikes / capture.max_spikes are adapter options too (a trial found no way to spare a host the captures)
    cb = StableTrainCallback(run_dir=tmp_path / "uncaptured", log_every=10, capture_spikes=False)
    assert (cb.options.capture_spikes, StableTrainCallback(max_spikes=2).options.max_spikes) == (False, 2)
    torch.manual_seed(0)
    L.Trainer(max_steps=n, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
              callbacks=[cb], enable_checkpointing=False).fit(LitNet(), DataLoader(TensorDataset(x, y), batch_size=BATCH))
    run = load_run(tmp_path / "uncaptured")
    assert [e.step for e in run.counted_events("spike")] == [step] and not run.counted_events("incident")


class NoLogNet(LitNet):
    """LitNet without ``self.log`` in ``training_step``: Lightning 2.6's ``self.log`` does not trace under torch
    2.13's dynamo (it inspects the signature of the compiled method), with or without stabletrain."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)


def test_a_module_lightning_compiles_in_place_is_diagnosed_eagerly_on_its_own_copy(tmp_path):
    # trainer.fit(torch.compile(module)) trains the LightningModule itself, with compiled wrappers of its forward and
    # training_step set on the instance. The diagnosis deep-copies the module: the copy kept the wrappers of the live
    # module's methods, so it ran the live module (the incident named 'Net.root' and "not reproducible"). The
    # "eager" backend: dynamo's wrappers as inductor's, without compiling kernels on the CPU.
    bad_step = 3
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5)
    module = NoLogNet()
    fit(torch.compile(module, backend="eager"), cb, 8, bad_index=(bad_step - 1) * BATCH + BAD_POSITION)
    assert {"forward", "training_step"} <= set(compiled_methods(module))  # the host's compiled methods are back
    assert all(torch.isfinite(p).all() for p in module.parameters())
    run = load_run(tmp_path / "run")
    assert run.metrics[0]["num_skipped"] == 1 and run.counted_events("incident")[0].step == bad_step
    d = run.counted_events("incident")[0].extra["diagnosis"]
    assert (d["op"], d["module"], d["reproduces"]) == ("aten.sqrt.default", "net.root", True)
    assert d["bad_positions"] == [{"micro_batch": 0, "position": BAD_POSITION}]
    diagnosis = json.loads((tmp_path / "run" / "incidents" / f"step_{bad_step:06d}" / "diagnosis.json").read_text())
    assert (diagnosis["replay_mode"], diagnosis["run_compiled"]) == ("eager", True)
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"] == {"compile": True}
    signal = json.loads((tmp_path / "run" / "init_signal.json").read_text())  # hooks on the eager forward
    assert [layer["name"] for layer in signal["layers"]] == ["net.fc1", "net.act", "net.root", "net.fc2"]


def test_the_lightning_loss_puts_back_a_forward_the_host_set_on_the_module():
    # The diagnosis's loss runs training_step as the module's call through an instance forward; it deleted the one
    # Lightning's compile had set there (the host's model then trained uncompiled).
    module = NoLogNet()
    own = module.forward = lambda x: module.net(x)
    loss = _lightning_loss(module, (torch.rand(2, 4), torch.randn(2, 1)))
    assert vars(module)["forward"] is own and loss.shape == ()


def test_non_fused_optimizer_skips_with_one_read_per_step(tmp_path):
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=4, init_check=False)
    module = LitNet(fused=False)
    fit(module, cb, 4, bad_index=BATCH + 1)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert load_run(tmp_path / "run").metrics[0]["num_skipped"] == 1  # the bad step alone


def test_fp16_where_lightning_scales_the_loss(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=4)
    module = LitNet(fused=False)  # non-fused: Lightning unscales before on_before_optimizer_step
    fit(module, cb, 8, bad_index=2 * BATCH, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    run = load_run(tmp_path / "run")
    assert run.metrics[0]["loss_scale"] == 2.0**9  # the NaN step: the scaler's found_inf backs the scale off once
    assert run.metrics[0]["num_nonfinite"] == 1 and run.metrics[0]["num_skipped"] == 1  # the bad step alone
    assert run.metrics[1]["loss_scale"] == 2.0**9 and run.metrics[1]["num_skipped"] == 0  # held steps: no back-off
    assert run.counted_events("incident")[0].extra["diagnosis"]["module"] == "net.root"
    assert all(torch.isfinite(p).all() for p in module.parameters())
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["precision"] == "fp16"


class StepLosses(StableCallback):
    """Test-only: every step's loss on the host (a sync per step, which is why no real callback does this)."""

    def __init__(self):
        self.losses = {}

    def on_step_end(self, state, out):
        self.losses[state.step] = float(out["loss"])


class GivenLosses(L.Callback):
    """Test-only: each micro-batch's loss as Lightning hands it to the backward (divided by accumulate_grad_batches)."""

    def __init__(self):
        self.given = []

    def on_before_backward(self, trainer, pl_module, loss):
        self.given.append(float(loss))


def test_an_epochs_short_last_window_logs_its_own_mean_loss_not_a_third_of_it(tmp_path):
    """A trial: 5 batches at accumulate_grad_batches=3 (windows of 3 and 2): Lightning divides every micro-batch's loss
    by 3, the short window's too; its step was recorded at the sum of what was backpropagated, 2/3 of its mean (1/3 for a
    window of one: a false dip each epoch, into the spike rule's median too). The step's mean loss is what is logged."""
    steps, given = StepLosses(), GivenLosses()
    fit(LitNet(), StableTrainCallback(run_dir=tmp_path / "run", log_every=1, callbacks=[steps]), 5, max_steps=2,
        accumulate_grad_batches=3, callbacks=[given])
    assert len(given.given) == 5 and list(steps.losses) == [1, 2]
    assert steps.losses[1] == pytest.approx(sum(given.given[:3]), rel=1e-6)  # a whole window: the sum of thirds, its mean
    assert steps.losses[2] == pytest.approx(sum(given.given[3:]) * 3 / 2, rel=1e-6)  # the mean of its 2 micro-batches
    records, _ = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["loss"] for r in records] == pytest.approx([steps.losses[1], steps.losses[2]], rel=1e-6)


def test_resume_from_lightnings_checkpoint_keeps_metrics_and_guard(tmp_path):
    # Two epochs of 7 batches; the first fit stops after epoch 1, where Lightning checkpoints (our state in it).
    ckpts, first_losses, later_losses = tmp_path / "ckpts", StepLosses(), StepLosses()
    first = StableTrainCallback(run_dir=tmp_path / "run", log_every=5, init_check=False, callbacks=[first_losses])
    fit(LitNet(), first, 7, max_steps=7, enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=ckpts, save_top_k=-1)])
    (ckpt,) = ckpts.glob("*.ckpt")
    assert torch.load(ckpt, weights_only=False)["callbacks"]["StableTrainCallback"]["step"] == 7
    again = StableTrainCallback(run_dir=tmp_path / "run", log_every=5, init_check=False, callbacks=[later_losses])
    fit(LitNet(seed=1), again, 7, max_steps=14, ckpt_path=str(ckpt))
    losses = {**first_losses.losses, **later_losses.losses}
    assert sorted(later_losses.losses) == list(range(8, 15))  # our step count continues from the checkpoint's
    run = load_run(tmp_path / "run")
    records = {r["step"]: r for r in run.metrics}
    assert sorted(records) == [5, 7, 10, 14]  # 7: the first fit's end logged its partial interval
    # The interval across the resume holds steps 6-7 (restored from the checkpoint) and 8-10 (after it).
    assert records[10]["loss"] == pytest.approx(sum(losses[s] for s in range(6, 11)) / 5, rel=1e-6)
    assert records[10]["samples_seen"] == 10 * BATCH
    guard = again.session.guard.state_dict()
    assert int(guard["num_seen"]) == 14  # the spike window goes on with the first fit's losses in it
    assert guard["window"][:14].tolist() == pytest.approx([losses[s] for s in range(1, 15)], rel=1e-6)
    assert [e.kind for e in run.events].count("resume") == 1


def test_a_resume_from_an_older_lightning_checkpoint_supersedes_the_metrics_lines_after_it(tmp_path):
    """A trial: a fit to step 14 resumed from its step-7 checkpoint left steps 10 and 14 twice in metrics.jsonl (the
    first trajectory's beside the resumed one's); as the built-in loop's resume, they go to metrics.superseded.jsonl."""
    ckpts = tmp_path / "ckpts"
    fit(LitNet(), StableTrainCallback(run_dir=tmp_path / "run", log_every=5, init_check=False), 7, max_steps=14,
        enable_checkpointing=True, callbacks=[ModelCheckpoint(dirpath=ckpts, save_top_k=-1, every_n_train_steps=7)])
    (at7,) = [c for c in ckpts.glob("*.ckpt") if "step=7" in c.name]
    fit(LitNet(seed=1), StableTrainCallback(run_dir=tmp_path / "run", log_every=5, init_check=False), 7, max_steps=14,
        ckpt_path=str(at7))
    run = load_run(tmp_path / "run")
    assert [r["step"] for r in run.metrics] == [5, 10, 14]
    superseded = read_jsonl(tmp_path / "run" / "metrics.superseded.jsonl")[0]
    assert [r["step"] for r in superseded] == [10, 14]
    assert [e.extra.get("superseded_metrics") for e in run.events if e.kind == "resume"] == [2]


class RampNet(LitNet):
    """A training_step whose loss weight ramps with its own call count (a curriculum): one extra call changes training."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        return min(1.0, self.calls / 5) * super().training_step(batch, batch_idx)


def test_the_init_check_runs_the_training_step_on_a_copy_and_the_host_trains_bitwise_as_without_it(tmp_path):
    """The step-0 signal report called the live module's training_step once more: a counter-driven loss weight
    then trained other parameters (31 calls for 30 steps). On a copy: the same calls, bitwise the same parameters."""
    plain, attached = RampNet(), RampNet()
    fit(plain, L.Callback(), 10)
    fit(attached, StableTrainCallback(run_dir=tmp_path / "run", log_every=5), 10)
    assert (tmp_path / "run" / "init_signal.json").exists()
    assert plain.calls == attached.calls == 10
    for a, b in zip(plain.parameters(), attached.parameters()):
        assert torch.equal(a, b)


class TrainerNet(LitNet):
    """A training_step that asks its trainer for the optimizer (a copy of the module has no trainer)."""

    def training_step(self, batch, batch_idx):
        assert self.optimizers() is not None
        return super().training_step(batch, batch_idx)


def test_the_init_check_falls_back_to_the_live_module_where_the_training_step_needs_its_trainer(tmp_path):
    """A review: a training_step calling self.optimizers() failed on the detached copy ('the loss function that replays
    incidents fails ...') and the run had no init report; it is measured on the live module instead."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit(TrainerNet(), StableTrainCallback(run_dir=tmp_path / "run", log_every=5), 5)
    assert (tmp_path / "run" / "init_signal.json").exists()
    assert not [w for w in seen if "replays incidents fails" in str(w.message)], [str(w.message) for w in seen]


class JumpNet(LitNet):
    """A per-step schedule that multiplies the LR by 50 from step 11, an interval's first step at log_every=5."""

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 if s < 10 else 50.0)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def test_a_per_step_schedule_is_recorded_at_the_lr_each_step_ran_at(tmp_path):
    """Lightning steps a per-step scheduler before the batch-end hook: the interval to step 10 was recorded at the
    next step's LR (0.5, which only step 11 ran at), and a spike's older state (the snapshot at step 10) read 0.5
    too: 'the optimizer's steps grew x37 at the same LR' for an LR x50."""
    fit(JumpNet(), StableTrainCallback(run_dir=tmp_path / "run", log_every=5), 20)
    run = load_run(tmp_path / "run")
    assert [r["lr"] for r in run.metrics][:3] == pytest.approx([1e-2, 1e-2, 0.5])
    (spike,) = [e for e in run.counted_events("incident") if e.extra.get("anomaly") == "spike"]
    summary = spike.extra["diagnosis"]["summary"]
    assert spike.step == 12 and summary.startswith("state:") and "the LR rose x50 since step 10 (0.01 -> 0.5)" in summary


def test_an_init_overwritten_by_a_host_hook_is_an_event(tmp_path, capfd):
    fit(LitNet(reinit=True), StableTrainCallback(run_dir=tmp_path / "run", log_every=5), 5)
    events = [e for e in load_run(tmp_path / "run").events if e.kind == "init_overwritten"]
    assert events and {p["name"] for p in events[0].extra["params"]} == {"net.fc2.weight", "net.fc2.bias"}
    # and one line on the console (it was an event only)
    assert "stabletrain: init overwritten: 2 parameter(s) changed between the model's init and the first step" in (
        capfd.readouterr().out)


@pytest.mark.parametrize("setup", ["manual", "two optimizers"])
def test_unsupported_setups_get_one_line_saying_what_works(tmp_path, setup):
    class Manual(LitNet):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False  # Lightning itself allows several optimizers only so

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            loss = F.mse_loss(self.net(batch[0]), batch[1])
            self.manual_backward(loss)
            opt.step()
            opt.zero_grad()
            return loss

        def configure_optimizers(self):
            opts = [torch.optim.AdamW(self.net.fc1.parameters(), lr=1e-2), torch.optim.AdamW(self.net.fc2.parameters())]
            return opts[0] if setup == "manual" else opts

    message = "automatic optimization" if setup == "manual" else "supports one optimizer"
    with pytest.raises(ValueError, match=message) as err:
        fit(Manual(), StableTrainCallback(run_dir=tmp_path / "run"), 2)
    assert "\n" not in str(err.value) and "stabletrain.Monitor" in str(err.value)


def console_incident_lines(capfd) -> list[str]:
    """The lines on the console (stdout and stderr, at the file descriptors) that announce an incident or a spike."""
    out, err = capfd.readouterr()
    said = r"stabletrain: (incident|spike)( \(skipped: [^)]*\))? at step \d+: "  # (a skipped spike's says so)
    return [x for x in (out + err).splitlines() if re.match(said, x)]


def test_a_warning_about_the_run_points_at_the_users_fit_call_not_at_lightnings_frames(tmp_path):
    """A new-user trial: the non-fused optimizer's warning was attributed to lightning/pytorch/trainer/call.py:228, a
    frame of Lightning's. It points at the user's line that called into the host (here: the trainer.fit in ``fit``)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(LitNet(fused=False), StableTrainCallback(run_dir=tmp_path / "run", log_every=5), 6)
    said = [w for w in caught if "cannot skip a step on the device" in str(w.message)]
    assert said and all(w.filename == __file__ for w in said), [(w.filename, w.lineno) for w in said]
    assert "clip_max_norm" not in str(said[0].message)
    # with gradient_clip_val under mixed precision the hint says where the clip goes then (a trial: 'use fused=True',
    # and Lightning then refused its gradient_clip_val); in fp32 Lightning clips a fused optimizer's gradients itself
    for precision, told in (("bf16-mixed", True), ("32-true", False)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(LitNet(fused=False), StableTrainCallback(run_dir=tmp_path / precision, log_every=5), 6,
                gradient_clip_val=1.0, precision=precision)
        said = [str(w.message) for w in caught if "cannot skip a step on the device" in str(w.message)]
        assert said and (", and clip_max_norm= here for gradient_clip_val (Lightning refuses it then)" in said[0]) == told


class ValNet(LitNet):
    """LitNet with a validation_step that logs val_loss (what the callback records)."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", loss := F.mse_loss(self.net(batch[0]), batch[1]))
        return loss


def test_the_modules_val_loss_is_recorded_at_the_step_it_was_measured(tmp_path):
    """A trial: a LightningModule that logs val_loss every 3 steps got none in metrics.jsonl. The next interval record's
    val_loss, with val_step the step the validation ran after (the sanity check's not recorded)."""
    module = ValNet()
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=4, init_check=False)
    torch.manual_seed(0)
    trainer = L.Trainer(max_steps=10, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb], enable_checkpointing=False, val_check_interval=3,
                        limit_val_batches=2, num_sanity_val_steps=1)
    trainer.fit(module, loader(10), loader(2, seed=1))
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert [(r["step"], r.get("val_step")) for r in rows] == [(4, 3), (8, 6), (10, 9)], rows
    assert all(isinstance(r["val_loss"], float) for r in rows)
    assert load_run(tmp_path / "run").series("val_loss")[0] == [3.0, 6.0, 9.0]
    # validated right after a logged step (every 4 with log_every=4): the next record's, as above; the last one (step 8),
    # which no record follows, was lost: the last record's (the interval's last evaluation, step 4's before it)
    cb = StableTrainCallback(run_dir=tmp_path / "run4", log_every=4, init_check=False)
    trainer = L.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[cb], enable_checkpointing=False, val_check_interval=4, limit_val_batches=2,
                        num_sanity_val_steps=0)
    trainer.fit(ValNet(), loader(8), loader(2, seed=1))
    rows = read_jsonl(tmp_path / "run4" / "metrics.jsonl")[0]
    assert [(r["step"], r.get("val_step")) for r in rows] == [(4, None), (8, 8)], rows
    assert [r.get("val_loss") for r in cb.session.history] == [r.get("val_loss") for r in rows]


def test_a_replays_training_step_outside_the_trainer_does_not_warn_of_its_self_log():
    """stabletrain diagnose / remedy on a Lightning run printed Lightning's 'You are trying to `self.log()` but the
    `self.trainer` reference is not registered' once per replayed step (a new user's trial): the replay's, not theirs."""
    from stabletrain.records.captured import lightning_loss

    class Logs(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.lin(x)

        def training_step(self, batch, batch_idx):
            loss = F.mse_loss(self(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = lightning_loss(Logs(), (torch.randn(8, 4), torch.randn(8, 1)))
    assert loss.ndim == 0 and not [w for w in seen if "self.log()" in str(w.message)], [str(w.message) for w in seen]
