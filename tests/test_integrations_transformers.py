"""The Hugging Face adapter on a real transformers.Trainer and a tiny random-init GPT-2 (never a download)."""

from __future__ import annotations

import contextlib
import json
import re
import sys
import warnings

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from integration_models import TRAP_TOKEN, OurSyncs, gpt2, outlier_pairs, token_rows, trap_gpt2  # noqa: E402

from stabletrain.callbacks import Callback as StableCallback  # noqa: E402
from stabletrain.incident_replay import diagnose_incident  # noqa: E402
from stabletrain.integrations.transformers import STATE_FILE, StableTrainCallback  # noqa: E402
from stabletrain.records.bundles import load_bundle  # noqa: E402
from stabletrain.records.events import EVENT_KINDS, METRIC_KEYS  # noqa: E402
from stabletrain.records.jsonl import read_jsonl  # noqa: E402
from stabletrain.report import load_run, write_report  # noqa: E402

pytestmark = [pytest.mark.slow,  # slow: a real Hugging Face Trainer per test
              pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning", "ignore::DeprecationWarning")]
transformers.logging.set_verbosity_error()
BATCH = 4


class StepLosses(StableCallback):
    """Test-only: every step's loss and pre-clip grad norm on the host (a sync per step)."""

    def __init__(self):
        self.losses, self.norms = {}, {}

    def on_step_end(self, state, out):
        self.losses[state.step] = float(out["loss"])
        self.norms[state.step] = float(out["grad_norm"])


def trainer_for(model, callback, tmp_path, *, max_steps, rows=None, **kw):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=max_steps, per_device_train_batch_size=BATCH, learning_rate=1e-3,
        use_cpu=True, report_to=kw.pop("report_to", []), logging_steps=kw.pop("logging_steps", 1000),
        save_strategy=kw.pop("save_strategy", "no"),
        train_sampling_strategy="sequential", seed=kw.pop("seed", 0), dataloader_num_workers=0, disable_tqdm=True, **kw)
    return transformers.Trainer(model=model, args=args, train_dataset=rows or token_rows(max_steps * BATCH),
                                callbacks=[callback])


def test_the_callbacks_it_does_not_take_from_the_others_name_the_trainers_own(tmp_path):
    """clip_max_norm= (the Lightning callback's and the Monitor's) got only 'unexpected option' and the list."""
    with pytest.raises(TypeError, match=r"^unexpected option 'clip_max_norm' \(the HF Trainer clips by "
                                        r"TrainingArguments.max_grad_norm\); the options are "):
        StableTrainCallback(run_dir=tmp_path / "run", clip_max_norm=1.0)


def test_the_callback_added_twice_is_refused_when_the_trainer_is_built(tmp_path):
    """A trial: the same callback added twice trained until 'training_step did not run through stabletrain's watch (was
    training_step replaced after train() began?)'; two of them each wrote a run directory. Either is one clear line,
    when the Trainer is built."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, use_cpu=True, report_to=[],
                                          disable_tqdm=True)
    cb = StableTrainCallback(run_dir=tmp_path / "run")
    for callbacks in ([cb, cb], [StableTrainCallback(run_dir=tmp_path / "a"), StableTrainCallback(run_dir=tmp_path / "b")]):
        with pytest.raises(ValueError, match=r"^StableTrainCallback: the Trainer's callbacks hold more than one; one "
                                             r"watches a run and writes its directory: remove the others$"):
            transformers.Trainer(model=gpt2(), args=args, train_dataset=token_rows(2 * BATCH), callbacks=callbacks)
    assert not (tmp_path / "run").exists()
    # the list fixed (a notebook's cell run again), the same callback watches the Trainer built now (a review: it kept
    # the refused Trainer and refused again)
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=token_rows(2 * BATCH), callbacks=[cb])
    assert cb.trainer is trainer
    # one more added after the Trainer was built (trainer.add_callback): refused when train() begins, before a step
    trainer.add_callback(StableTrainCallback(run_dir=tmp_path / "late"))
    with pytest.raises(ValueError, match=r"^StableTrainCallback: the Trainer's callbacks hold more than one; one watches"):
        trainer.train()
    assert trainer.state.global_step == 0 and not (tmp_path / "run").exists() and not (tmp_path / "late").exists()


def test_the_mirror_leaves_the_trainers_own_logging_as_it_is(tmp_path):
    """Our figures ride the Trainer's own logs at its logging_steps: it logs no more often for them (it logged at every
    one of our intervals, its loss then averaged over 4 steps instead of its 1000, its trackers written 250x as often)."""
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=4)
    trainer = trainer_for(gpt2(), cb, tmp_path, max_steps=10)
    trainer.train()
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]
    assert [r["step"] for r in records] == [4, 8, 10]
    assert isinstance(records[-1]["update_norm"], float)  # the run's last step measured its update too (a trial: "nan")
    assert [h["step"] for h in trainer.state.log_history] == [10]  # the Trainer's own end-of-training summary only
    summary = trainer.state.log_history[0]
    assert "train_runtime" in summary and "loss" not in summary
    # Neither the summary (train() returns it) nor an evaluation's metrics get our figures
    metrics = trainer.evaluate(eval_dataset=token_rows(8))
    assert "eval_loss" in metrics and not [k for d in (summary, metrics) for k in d if k.startswith("stabletrain/")]


def test_the_mirror_reaches_the_trainers_own_trackers(tmp_path):
    """report_to's trackers ran their on_log before ours and never saw the figures the mirror added: TensorBoard's
    now has them, at the Trainer's logging steps."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=4)
    trainer = trainer_for(gpt2(), cb, tmp_path, max_steps=8, logging_steps=4, report_to=["tensorboard"])
    trainer.train()
    (events,) = {p.parent for p in (tmp_path / "hf").rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events)).Reload()
    assert [e.step for e in acc.Scalars("train/stabletrain/grad_norm_max")] == [4, 8]
    assert [e.step for e in acc.Scalars("train/loss")] == [4, 8]  # the Trainer's own, as it logged them


def test_clean_run_metrics_mirror_and_report(tmp_path):
    figures = StepLosses()
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=4, callbacks=[figures])
    trainer = trainer_for(gpt2(), cb, tmp_path, max_steps=10, max_grad_norm=0.05, logging_steps=4)
    trainer.train()
    records, problems = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert not problems and [r["step"] for r in records] == [4, 8, 10]
    assert set(records[0]) <= set(METRIC_KEYS)
    assert records[0]["clip_rate"] == 1.0 and records[0]["grad_norm_post_clip"] <= 0.05 * (1 + 1e-5)
    assert records[0]["tokens_per_s"] > 0 and records[-1]["samples_seen"] == 10 * BATCH
    # ||update|| of each interval's last step, measured around the host's own optimizer step.
    assert all(0 < r["update_norm"] and 0 < r["update_ratio"] < 1 for r in records[:2])
    # The pre-clip norm is the Trainer's own (it logs the last step's at its logging steps).
    logged = [h for h in trainer.state.log_history if "stabletrain/grad_norm_max" in h]
    assert [h["step"] for h in logged] == [4, 8]
    assert logged[0]["grad_norm"] == pytest.approx(figures.norms[4], rel=1e-6)  # its step-4 norm is ours
    assert logged[0]["loss"] == pytest.approx(records[0]["loss"], rel=1e-4)  # HF's mean over the same 4 steps
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["integration"] == "transformers" and config["host"]["max_grad_norm"] == 0.05
    # what the optimizer's groups step with: the Trainer's weight decay (0 by default) and lr, not AdamW's own defaults
    # (a new-user trial: 'weight_decay: 0.01' beside the host's 0.0), the lr before the schedule's first factor
    assert config["optim"]["weight_decay"] == trainer.args.weight_decay == 0.0, config["optim"]
    assert config["optim"]["lr"] == trainer.args.learning_rate, config["optim"]
    snapshot = json.loads((tmp_path / "run" / "snapshot.json").read_text())
    assert snapshot["host_versions"]["transformers"] and snapshot["init_signal"]["summary"]
    events, _ = read_jsonl(tmp_path / "run" / "events.jsonl")
    assert all(e["kind"] in EVENT_KINDS for e in events) and not events
    assert "GPT2LMHeadModel" in write_report(tmp_path / "run").read_text()


def test_no_host_sync_between_log_boundaries(tmp_path):
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=4)
    trainer = trainer_for(gpt2(), cb, tmp_path, max_steps=12)
    with OurSyncs(lambda: cb.session.step if cb.session is not None else -1) as counter:
        trainer.train()
    steps = sorted({s for s, _ in counter.calls})
    assert set(steps) <= {-1, 0, 4, 8, 12}, counter.calls  # -1/0: init fingerprint and signal report, once
    assert sum(1 for s, _ in counter.calls if s == 8) == 1


def test_planted_nan_is_skipped_captured_and_traced(tmp_path, capfd):
    bad_sample = 2 * BATCH + 1  # step 3, position 1 (sequential sampling)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5)
    model = trap_gpt2()
    trainer_for(model, cb, tmp_path, max_steps=6, rows=token_rows(6 * BATCH, trap_at=bad_sample)).train()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    run = load_run(tmp_path / "run")
    assert run.metrics[0]["num_nonfinite"] == 1 and run.metrics[0]["num_skipped"] == 1  # the bad step alone
    incident = run.counted_events("incident")[0]
    d = incident.extra["diagnosis"]
    assert incident.step == 3
    assert (d["stage"], d["op"], d["direction"], d["module"]) == ("activations", "aten.sqrt.default", "forward",
                                                                  "transformer.wte")
    assert d["bad_positions"] == [{"micro_batch": 0, "position": 1}] and d["reproduces"] is True
    lines = console_incident_lines(capfd)  # the host's console: exactly one line, as the built-in loop's
    assert len(lines) == 1 and lines[0].startswith(
        "stabletrain: incident at step 3: op: first non-finite value (activations): aten.sqrt.default in "
        "forward of module "), lines
    folder = tmp_path / "run" / "incidents" / "step_000003"
    batch = load_bundle(folder)["config"]["task_args"]["batches"][0]
    assert (batch["input_ids"] == TRAP_TOKEN).any(1).tolist() == [False, True, False, False]
    fresh = diagnose_incident(folder)  # a fresh replay: the model rebuilt from its class and config
    assert (fresh["module"], fresh["bad_samples"]) == ("transformer.wte", [1])
    assert fresh["first_nonfinite_param"] is not None



class Regressor(torch.nn.Module):
    """A model the Trainer trains as it trains any: ``forward(**batch)`` returns its loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = torch.nn.Linear(4, 16), torch.nn.Linear(16, 1)

    def forward(self, x, labels=None):
        out = self.fc2(torch.tanh(self.fc1(x)))
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


@pytest.mark.parametrize("on_spike", ["skip"])  # (warn, the default: the Lightning test)
def test_a_loss_spike_is_captured_and_its_samples_named_and_verified(tmp_path, on_spike, capfd):
    """Samples at positions 1 and 2 of step 15 (mid-interval) carry targets x40 off: captured from the interval's
    start, diagnosed as data with those positions named and their removal verified, as in the built-in loop."""
    n, step = 30, 15
    x, y = outlier_pairs(n, step, (1, 2), BATCH)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=10, on_spike=on_spike)
    trainer_for(Regressor(), cb, tmp_path, max_steps=n, rows=[{"x": a, "labels": b} for a, b in zip(x, y)]).train()
    run = load_run(tmp_path / "run")
    (incident,) = run.counted_events("incident")
    d = json.loads((tmp_path / "run" / "incidents" / f"step_{step:06d}" / "diagnosis.json").read_text())
    assert (incident.step, d["anomaly"], d["failure_class"], d["bad_samples"]) == (step, "spike", "data", [1, 2])
    assert d["bad_positions"] == [{"micro_batch": 0, "position": 1}, {"micro_batch": 0, "position": 2}]
    assert d["reproduces"] is True and d["samples"]["without"]["ratio"] < 2.0, d["summary"]
    assert run.metrics[1]["num_skipped"] == (1 if on_spike == "skip" else 0)
    assert [e.step for e in run.counted_events("spike")] == [step]
    lines = console_incident_lines(capfd)  # the host's console: exactly one line, as the built-in loop's
    said = "spike (skipped: on_spike=skip)" if on_spike == "skip" else "spike"  # (the host's console counts no skips)
    assert len(lines) == 1 and lines[0].startswith(f"stabletrain: {said} at step {step}: data: samples 1, 2 carry "), lines
    from stabletrain.incident_replay import diagnose_incident  # a plain torch module is rebuilt by its class, as a

    # Monitor's is (a trial: 'use a model class ... built from its config (a PreTrainedModel)', no replay)
    again = diagnose_incident(tmp_path / "run" / "incidents" / f"step_{step:06d}", out="diagnosis.replayed.json")
    assert (again["failure_class"], again["bad_samples"]) == ("data", [1, 2]), again["summary"]


def test_a_plain_module_that_needs_arguments_gets_no_class_recipe_but_the_hint():
    """A review: a class rebuilt as cls() that needs arguments (or was built with others) read a raw TypeError, or
    replayed another model; the HF callback has no model_factory=: no recipe, and the hint says what rebuilds."""
    from stabletrain.records.captured import REBUILD_HINT, model_recipe

    assert model_recipe(Regressor(), "transformers") == {"kind": "class", "class": f"{__name__}:Regressor"}
    assert model_recipe(Wide(8), "transformers") is None
    assert "a PreTrainedModel (rebuilt from its config) or one built with no arguments" in REBUILD_HINT["transformers"]


class Wide(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.fc = torch.nn.Linear(4, width)


def test_a_spike_under_gradient_accumulation_is_weighed_on_its_own_items(tmp_path, capfd):
    """gradient_accumulation_steps=2: the Trainer divides each micro-batch's token loss by the whole window's
    num_items_in_batch and sums the two. The replay averaged them (half the Trainer's loss: 'not reproducible: no spike
    by the guard's rule'), and a window without some samples kept the whole window's count (any removal looked like a
    cure). Now the step's loss is the Trainer's own, and the samples are named, verified on their own items' mean."""
    from integration_models import SEQ

    n, step, batch, accum = 100, 95, 4, 2
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 64, (n * batch * accum,), generator=g)
    ids = (starts[:, None] + torch.arange(SEQ)[None]) % 64
    bad = ((step - 1) * batch * accum + 1, (step - 1) * batch * accum + 2)
    rows = [{"input_ids": r, "labels": (r + 32) % 64 if i in bad else r.clone()} for i, r in enumerate(ids)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=n, per_device_train_batch_size=batch, gradient_accumulation_steps=accum,
        learning_rate=3e-2, use_cpu=True, report_to=[], logging_steps=1000, save_strategy="no",
        train_sampling_strategy="sequential", seed=0, dataloader_num_workers=0, disable_tqdm=False, warmup_steps=0,
        lr_scheduler_type="constant")
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=10)
    with contextlib.redirect_stderr(sys.stdout):  # one log of both streams, as `python train.py > log 2>&1` writes
        transformers.Trainer(model=gpt2(), args=args, train_dataset=rows, callbacks=[cb]).train()
    folder = tmp_path / "run" / "incidents" / f"step_{step:06d}"
    live = json.loads((folder / "diagnosis.json").read_text())
    assert (live["failure_class"], live["bad_samples"], live["reproduces"]) == ("data", [1, 2], True), live["summary"]
    # The Trainer's own bar drawn into that log (carriage returns, no newline): the line starts on a line of its own,
    # not inside the bar's last redraw (it read '...162.21it/s]stabletrain: spike at step 250').
    lines = capfd.readouterr().out.split("\n")
    assert any(x.startswith(f"stabletrain: spike at step {step}: data: samples 1, 2 carry ") for x in lines), lines[-20:]
    bundle = load_bundle(folder)
    host = bundle["config"]["task_args"]["host"]
    # the replay's loss is the Trainer's (the sum of its two micro-batch losses), checked within OBSERVED_RTOL["host"]
    assert abs(live["loss"] - bundle["observed"]["host_loss"]) <= 1e-4 * abs(live["loss"]), live
    assert host["window_items"] == batch * accum * SEQ  # the labels of both micro-batches counted
    # without samples 1 and 2 the window is the ordinary windows' level, on its own 6 rows' tokens
    assert live["samples"]["without"]["ratio"] < 1.5, live["samples"]
    fresh = diagnose_incident(folder)  # in a new process's way: the model and loss rebuilt from their recipes
    assert fresh["loss"] == live["loss"] and fresh["samples"] == live["samples"], (fresh["summary"], live["summary"])


def test_a_model_the_trainer_compiles_is_recorded_compiled_and_diagnosed_eagerly(tmp_path):
    # torch_compile=True: the Trainer trains a torch.compile wrapper, and its callbacks are handed the model inside
    # it; the record says the run was compiled (the replay is eager and does not compare a finite loss bitwise).
    # The "eager" backend: dynamo's wrapper as inductor's, without compiling kernels on the CPU.
    bad_sample = 2 * BATCH + 1
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5)
    trainer = trainer_for(trap_gpt2(), cb, tmp_path, max_steps=4, rows=token_rows(4 * BATCH, trap_at=bad_sample),
                          torch_compile=True, torch_compile_backend="eager")
    trainer.train()
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    cfg = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert cfg["train"] == {"compile": True} and cfg["host"]["torch_compile"] is True
    d = load_run(tmp_path / "run").counted_events("incident")[0].extra["diagnosis"]
    assert (d["module"], d["reproduces"]) == ("transformer.wte", True)
    diagnosis = json.loads((tmp_path / "run" / "incidents" / "step_000003" / "diagnosis.json").read_text())
    assert (diagnosis["replay_mode"], diagnosis["run_compiled"]) == ("eager", True)


def test_bf16_autocast_and_a_grad_scaler_where_the_trainer_scales_the_loss(tmp_path):
    cb = StableTrainCallback(run_dir=tmp_path / "bf16", log_every=4)
    trainer_for(gpt2(), cb, tmp_path, max_steps=4, bf16=True).train()
    record = load_run(tmp_path / "bf16").metrics[0]
    assert record["loss_scale"] == 1.0 and record["num_skipped"] == 0
    assert yaml.safe_load((tmp_path / "bf16" / "config.yaml").read_text())["precision"] == "bf16"

    # fp16 with a GradScaler: accelerate makes none on CPU, so give its accelerator one (as on a GPU).
    cb = StableTrainCallback(run_dir=tmp_path / "fp16", log_every=5)
    model = trap_gpt2()
    trainer = trainer_for(model, cb, tmp_path, max_steps=6, fp16=True,
                          rows=token_rows(6 * BATCH, trap_at=2 * BATCH))
    trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    trainer.accelerator.native_amp = True
    trainer.train()
    run = load_run(tmp_path / "fp16")
    assert run.metrics[0]["loss_scale"] == 2.0**9  # the scaler backed off once, on the NaN step
    assert run.metrics[0]["num_nonfinite"] == 1 and run.metrics[0]["num_skipped"] == 1
    assert run.counted_events("incident")[0].extra["diagnosis"]["module"] == "transformer.wte"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_resume_from_the_trainers_checkpoint_keeps_metrics_and_guard(tmp_path):
    rows = token_rows(12 * BATCH)
    ref_losses = StepLosses()
    ref = StableTrainCallback(run_dir=tmp_path / "ref", log_every=5, init_check=False, callbacks=[ref_losses])
    trainer_for(gpt2(), ref, tmp_path / "a", max_steps=12, rows=rows).train()

    first = StableTrainCallback(run_dir=tmp_path / "run", log_every=5, init_check=False)
    trainer_for(gpt2(), first, tmp_path / "b", max_steps=12, rows=rows, save_strategy="steps", save_steps=7).train()
    ckpt = tmp_path / "b" / "hf" / "checkpoint-7"
    assert (ckpt / STATE_FILE).exists()
    # A new process resumes from the Trainer's own checkpoint; the run directory goes on.
    later = StepLosses()
    again = StableTrainCallback(run_dir=tmp_path / "run2", log_every=5, init_check=False, callbacks=[later])
    (tmp_path / "run2").mkdir()
    for name in ("config.yaml", "snapshot.json", "metrics.jsonl", "events.jsonl"):  # the run dir as it was at step 7
        lines = (tmp_path / "run" / name).read_text().splitlines(keepends=True)
        keep = [ln for ln in lines if not name.endswith(".jsonl") or json.loads(ln)["step"] <= 7]
        (tmp_path / "run2" / name).write_text("".join(keep))
    trainer_for(gpt2(seed=1), again, tmp_path / "b", max_steps=12, rows=rows).train(resume_from_checkpoint=str(ckpt))
    assert sorted(later.losses) == list(range(8, 13))  # our step count continues
    for step in range(8, 13):  # the Trainer resumes exactly: so do our per-step figures
        assert later.losses[step] == ref_losses.losses[step]
    a, b = load_run(tmp_path / "ref").metrics, load_run(tmp_path / "run2").metrics
    assert [r["step"] for r in b] == [5, 10, 12]
    for key in ("loss", "loss_max", "grad_norm", "grad_norm_max", "samples_seen", "tokens_seen"):
        assert [r[key] for r in a] == pytest.approx([r[key] for r in b], rel=1e-6), key
    torch.testing.assert_close(ref.session.guard.state_dict()["window"], again.session.guard.state_dict()["window"],
                               rtol=1e-6, atol=0, equal_nan=True)
    assert [e.kind for e in load_run(tmp_path / "run2").events].count("resume") == 1


def test_a_resume_from_an_older_trainer_checkpoint_supersedes_the_metrics_lines_after_it(tmp_path):
    """A trial: a run to step 12 resumed from its checkpoint-7 into the same run directory left steps 10 and 12 twice in
    metrics.jsonl; as the built-in loop's resume, they go to metrics.superseded.jsonl."""
    rows = token_rows(12 * BATCH)
    first = StableTrainCallback(run_dir=tmp_path / "run", log_every=5, init_check=False)
    trainer_for(gpt2(), first, tmp_path / "b", max_steps=12, rows=rows, save_strategy="steps", save_steps=7).train()
    again = StableTrainCallback(run_dir=tmp_path / "run", log_every=5, init_check=False)
    trainer_for(gpt2(seed=1), again, tmp_path / "b", max_steps=12, rows=rows).train(
        resume_from_checkpoint=str(tmp_path / "b" / "hf" / "checkpoint-7"))
    run = load_run(tmp_path / "run")
    assert [r["step"] for r in run.metrics] == [5, 10, 12]
    assert [json.loads(x)["step"] for x in (tmp_path / "run" / "metrics.superseded.jsonl").read_text().splitlines()] == [10, 12]
    assert [e.extra.get("superseded_metrics") for e in run.events if e.kind == "resume"] == [2]


def test_the_record_says_the_precision_that_ran_fp16_asked_on_a_cpu_runs_fp32(tmp_path):
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=2, init_check=False)
    trainer = trainer_for(gpt2(), cb, tmp_path, max_steps=2, fp16=True, seed=5)
    with pytest.warns(UserWarning, match=r"asked for fp16 but runs fp32 on cpu"):
        trainer.train()
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["precision"] == "fp32"
    snapshot = json.loads((tmp_path / "run" / "snapshot.json").read_text())
    # its seed, the Trainer's (a trial read 0, stabletrain's config default, beside args.seed)
    assert (snapshot["precision"], snapshot["seed"], snapshot["deterministic"]) == ("fp32", 5, False)


def console_incident_lines(capfd) -> list[str]:
    """The lines on the console (stdout and stderr, at the file descriptors) that announce an incident or a spike."""
    out, err = capfd.readouterr()
    said = r"stabletrain: (incident|spike)( \(skipped: [^)]*\))? at step \d+: "  # (a skipped spike's says so)
    return [x for x in (out + err).splitlines() if re.match(said, x)]


def test_a_gpt2_spike_rediagnosed_from_its_bundle_gives_the_live_numbers(tmp_path):
    """A tiny GPT-2 learns 'the next token is this one + 1'; samples 1 and 2 of step 95 get labels shifted by 32. The
    Trainer divides each micro-batch's summed token loss by num_items_in_batch (the labels counted: 128 here, where the
    shifted loss has 120 terms): a fresh replay from the bundle took the model's own mean instead (x128/120), and
    said 'reproduces' with other numbers than the live diagnosis."""
    from integration_models import SEQ

    n, step, batch = 100, 95, 8
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 64, (n * batch,), generator=g)
    ids = (starts[:, None] + torch.arange(SEQ)[None]) % 64
    bad = ((step - 1) * batch + 1, (step - 1) * batch + 2)
    rows = [{"input_ids": r, "labels": (r + 32) % 64 if i in bad else r.clone()} for i, r in enumerate(ids)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=n, per_device_train_batch_size=batch, learning_rate=3e-2, use_cpu=True,
        report_to=[], logging_steps=1000, save_strategy="no", train_sampling_strategy="sequential", seed=0,
        dataloader_num_workers=0, disable_tqdm=True, warmup_steps=0, lr_scheduler_type="constant")
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=10)
    transformers.Trainer(model=gpt2(), args=args, train_dataset=rows, callbacks=[cb]).train()
    folder = tmp_path / "run" / "incidents" / f"step_{step:06d}"
    live = json.loads((folder / "diagnosis.json").read_text())
    assert (live["failure_class"], live["bad_samples"], live["reproduces"]) == ("data", [1, 2], True), live["summary"]
    assert load_bundle(folder)["config"]["task_args"]["host"]["num_items_in_batch"] == batch * SEQ
    fresh = diagnose_incident(folder)  # the model rebuilt from its class and config, the loss from the recipe
    assert fresh["loss"] == live["loss"] and fresh["samples"] == live["samples"], (fresh["summary"], live["summary"])


def test_a_replay_multiplies_its_loss_by_the_processes_the_trainer_multiplied_by(tmp_path):
    """Under DDP the Trainer divides by all ranks' items and multiplies by the processes (its own rule): the bundle's
    loss_factor (2 in tests/test_adapters_distributed.py) is applied by a replay on one process; a one-process Trainer
    records none (1)."""
    from stabletrain.records.captured import host_loss_factor, loss_from_recipe

    batch = {"input_ids": torch.arange(16).reshape(2, 8), "labels": torch.arange(16).reshape(2, 8)}
    model = gpt2().eval()  # (no dropout draw between the two forwards)
    one = loss_from_recipe({"kind": "transformers"}, {"num_items_in_batch": 32})(model, batch)
    two = loss_from_recipe({"kind": "transformers"}, {"num_items_in_batch": 32, "loss_factor": 2})(model, batch)
    assert torch.isfinite(one) and torch.equal(two, 2 * one)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), use_cpu=True, report_to=[])
    trainer = transformers.Trainer(model=model, args=args, train_dataset=token_rows(4))
    assert trainer.model_accepts_loss_kwargs and host_loss_factor(trainer, torch.tensor(32)) == 1
    assert host_loss_factor(trainer, None) == 1


class ItemsIgnoringRegressor(Regressor):
    """Takes loss kwargs (so the Trainer takes its loss as divided by num_items_in_batch) yet returns a plain mean."""

    def forward(self, x, labels=None, **kwargs):
        return super().forward(x, labels)


@pytest.mark.parametrize("model, warned", [(ItemsIgnoringRegressor, True), (Regressor, False)])
def test_a_loss_the_trainer_takes_as_divided_by_its_items_but_is_a_mean_is_warned_of_once(tmp_path, model, warned):
    """gradient_accumulation_steps=2 and a model taking **kwargs: the Trainer does not divide by the 2 steps (it takes the
    loss as divided by num_items_in_batch), so a mean loss sums its micro-batches' means: said once, at the first step.
    A model without **kwargs gets the Trainer's own division: nothing to say."""
    from stabletrain.console import StableTrainWarning

    x, y = outlier_pairs(8, 100, (), BATCH)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=2)
    with pytest.warns(StableTrainWarning) if warned else contextlib.nullcontext() as caught:
        trainer_for(model(), cb, tmp_path, max_steps=3, rows=[{"x": a, "labels": b} for a, b in zip(x, y)],
                    gradient_accumulation_steps=2).train()
    said = [str(w.message) for w in (caught or []) if "ignores num_items_in_batch" in str(w.message)]
    assert len(said) == (1 if warned else 0), said
    if warned:
        assert "does not divide it by gradient_accumulation_steps=2" in said[0] and "2 micro-batches' means" in said[0]


@pytest.mark.parametrize("accum", [1, 2])
def test_a_spike_under_a_loss_that_ignores_its_items_is_weighed_on_each_samples_own_mean(tmp_path, accum):
    """A trial: a sequence classifier's loss (a plain mean) in a model taking loss kwargs: the replay multiplied every
    sample's loss by the window's item count (1.44e6 for a true 9e4), the samples went unnamed ('no small set of its
    samples carries it'), or named by the removal search with a false 'the loss couples them'."""
    n, step = 30, 15
    x, y = outlier_pairs(n * accum, (step - 1) * accum + 1, (1, 2), BATCH)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=10)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer_for(ItemsIgnoringRegressor(), cb, tmp_path, max_steps=n, rows=[{"x": a, "labels": b} for a, b in zip(x, y)],
                    gradient_accumulation_steps=accum).train()
    d = json.loads((tmp_path / "run" / "incidents" / f"step_{step:06d}" / "diagnosis.json").read_text())
    assert (d["failure_class"], d["bad_samples"]) == ("data", [1, 2]) and "how" not in d["samples"], d["summary"]
    model = ItemsIgnoringRegressor()  # each sample's loss: its own squared error under the state the step started from
    model.load_state_dict(load_bundle(tmp_path / "run" / "incidents" / f"step_{step:06d}")["model"])
    first = (step - 1) * accum * BATCH
    with torch.no_grad():
        own = {i: model(x[first + i:first + i + 1], y[first + i:first + i + 1])["loss"].item() for i in (1, 2)}
    said = {r["sample"]: r["loss"] for r in d["sample_losses"]}
    assert said[1] == pytest.approx(own[1], rel=1e-4) and said[2] == pytest.approx(own[2], rel=1e-4), (said, own)


class RaisingRegressor(Regressor):
    """Raises in its forward at its ``at``-th training call (the user's own bug, mid-run)."""

    def __init__(self, at):
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x, labels=None):
        self.calls += self.training
        if self.training and self.calls == self.at:
            raise ZeroDivisionError("the user's bug")
        return super().forward(x, labels)


class OutOfMemoryRegressor(Regressor):
    """Runs out of (CPU) memory at its ``at``-th training call while its batch is larger than ``fits``."""

    def __init__(self, at, fits):
        super().__init__()
        self.at, self.fits, self.calls = at, fits, 0

    def forward(self, x, labels=None):
        self.calls += self.training
        if self.training and self.calls == self.at and x.shape[0] > self.fits:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes")
        return super().forward(x, labels)


def test_an_out_of_memory_error_is_a_retry_on_one_process_only():
    """A review: under DDP a rank's retry closed its session as a retry, starting the interval's collective on that rank
    alone while its peers went on into the step's gradient all-reduce. More than one process: a crash, as without it."""
    from types import SimpleNamespace

    from stabletrain.errors import host_retry

    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    one, two = (SimpleNamespace(auto_find_batch_size=True, world_size=n) for n in (1, 2))
    assert host_retry(one, oom, 8, batch=4)["failed_step"] == 8
    assert host_retry(two, oom, 8, batch=4) is None
    assert host_retry(one, oom, 8, batch=1) is None and host_retry(one, ValueError("x"), 8, batch=4) is None


def test_an_out_of_memory_step_the_trainer_retries_at_a_smaller_batch_is_no_crash_and_the_retry_trains_on(tmp_path):
    """A review and a trial: with auto_find_batch_size the Trainer catches an out-of-memory error and trains again from
    its first step at a smaller batch, calling on_train_begin again: the run directory held a logged run, so the new
    session refused it (FileExistsError) and the retry the user asked for died; the attempt's error read as a crash."""
    x, y = outlier_pairs(48, 0, (), BATCH)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5)
    trainer = trainer_for(OutOfMemoryRegressor(at=8, fits=BATCH - 1), cb, tmp_path, max_steps=12,
                          rows=[{"x": a, "labels": b} for a, b in zip(x, y)], auto_find_batch_size=True)
    with pytest.warns(UserWarning, match=r"ran out of memory at step 8 and trains again from its first step at batch size 3 "
                                         r"\(from 4; auto_find_batch_size\)"):
        trainer.train()
    events = read_jsonl(tmp_path / "run" / "events.jsonl")[0]
    assert [e["kind"] for e in events] == ["retry"] and events[0]["failed_step"] == 8, events
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]] == [5, 10, 12]  # the new attempt's
    assert cb.session.closed and trainer.state.global_step == 12 and trainer.state.train_batch_size == 3
    from stabletrain.report.health import health_summary

    said = health_summary(load_run(tmp_path / "run")).sentences  # the report says why the records start over
    assert ("warn", "The Trainer ran out of memory at step 8 and trains again from its first step at batch size 3 "
            "(from 4; auto_find_batch_size): this run directory holds the new attempt.") in said, said
    # at batch size 1 there is no smaller one: accelerate gives up, and the run's end is a crash (a review: no crash was
    # recorded, and a retry flag left behind made the user's next train() wipe the directory)
    cb = StableTrainCallback(run_dir=tmp_path / "run1", log_every=5)
    one = trainer_for(OutOfMemoryRegressor(at=8, fits=0), cb, tmp_path, max_steps=12,
                      rows=[{"x": a, "labels": b} for a, b in zip(x, y)], auto_find_batch_size=True)
    one.args.per_device_train_batch_size = 1
    one._train_batch_size = 1
    with pytest.raises(RuntimeError, match="No executable batch size found"):
        one.train()
    assert read_jsonl(tmp_path / "run1" / "events.jsonl")[0][-1]["kind"] == "crash" and cb._retry is None

    class OutOfMemoryLater(transformers.TrainerCallback):  # out of memory outside the training step (an eval, a hook)
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 7 and state.train_batch_size == BATCH:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 123 bytes")

    cb = StableTrainCallback(run_dir=tmp_path / "run3", log_every=5)
    later = trainer_for(Regressor(), cb, tmp_path, max_steps=12, rows=[{"x": a, "labels": b} for a, b in zip(x, y)],
                        auto_find_batch_size=True)
    later.add_callback(OutOfMemoryLater())
    with pytest.warns(UserWarning, match=r"ran out of memory after step 7 \(outside its training step\) and trains again "
                                         "from its first step at batch size 3"):
        later.train()  # (the session left open: the retry's start finds it)
    events = read_jsonl(tmp_path / "run3" / "events.jsonl")[0]
    assert [e["kind"] for e in events] == ["retry"] and "outside its training step" in events[0]["error"], events
    # without auto_find_batch_size the same error is the run's end: a crash
    cb = StableTrainCallback(run_dir=tmp_path / "run2", log_every=5)
    trainer = trainer_for(OutOfMemoryRegressor(at=8, fits=BATCH - 1), cb, tmp_path, max_steps=12,
                          rows=[{"x": a, "labels": b} for a, b in zip(x, y)])
    with pytest.raises(RuntimeError, match="can't allocate memory"):
        trainer.train()
    assert read_jsonl(tmp_path / "run2" / "events.jsonl")[0][-1]["kind"] == "crash"


def test_an_exception_in_the_trainers_step_is_a_crash_event_and_the_run_is_closed(tmp_path):
    """A review: the Trainer has no exception hook, and only on_train_end detached: a raising train() left no crash
    event, the partial interval unlogged, the run's files open and training_step patched on the instance."""
    n = 12
    x, y = outlier_pairs(n, 0, (), BATCH)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=5)
    trainer = trainer_for(RaisingRegressor(at=8), cb, tmp_path, max_steps=n,
                          rows=[{"x": a, "labels": b} for a, b in zip(x, y)])
    with pytest.raises(ZeroDivisionError):
        trainer.train()
    events = read_jsonl(tmp_path / "run" / "events.jsonl")[0]
    assert events[-1]["kind"] == "crash" and events[-1]["error"] == "ZeroDivisionError", events[-1]
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]] == [5, 7]  # the partial interval too
    assert "training_step" not in vars(trainer) and cb.session.closed


def test_the_trainers_evaluations_are_recorded_at_the_steps_they_measured(tmp_path):
    """A trial: an HF run with eval_strategy='steps' recorded no val_loss (the compare page said '—'). Its eval_loss is
    the next interval record's val_loss, with val_step the step it measured; the report draws it there."""
    from stabletrain.report import load_run

    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=4, init_check=False)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=10, per_device_train_batch_size=BATCH, learning_rate=1e-3, use_cpu=True,
        report_to=[], logging_steps=1000, save_strategy="no", eval_strategy="steps", eval_steps=3,
        train_sampling_strategy="sequential", seed=0, dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=token_rows(10 * BATCH),
                                   eval_dataset=token_rows(8), callbacks=[cb])
    trainer.train()
    evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    assert [s for s, _ in evals] == [3, 6, 9, 10]
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")[0]  # each record: the interval's last evaluation (9's: 10's)
    assert [(r["step"], r.get("val_step"), r.get("val_loss")) for r in rows] == [
        (4, 3, pytest.approx(evals[0][1])), (8, 6, pytest.approx(evals[1][1])), (10, 10, pytest.approx(evals[3][1]))]
    assert load_run(tmp_path / "run").series("val_loss") == ([3.0, 6.0, 10.0], [pytest.approx(evals[i][1]) for i in (0, 1, 3)])
    # evaluated right after a logged step (every 4 with log_every=4): the next record's, as above; the last one (step 8),
    # which no record follows, was lost: the last record's (the interval's last evaluation, step 4's before it)
    cb = StableTrainCallback(run_dir=tmp_path / "run4", log_every=4, init_check=False)
    args = transformers.TrainingArguments(**{**args.to_dict(), "max_steps": 8, "eval_steps": 4,
                                             "output_dir": str(tmp_path / "hf4")})
    trainer = transformers.Trainer(model=gpt2(), args=args, train_dataset=token_rows(8 * BATCH), eval_dataset=token_rows(8),
                                   callbacks=[cb])
    trainer.train()
    evals = [(h["step"], h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h]
    rows = read_jsonl(tmp_path / "run4" / "metrics.jsonl")[0]
    assert [s for s, _ in evals] == [4, 8]
    assert [(r["step"], r.get("val_step"), r.get("val_loss")) for r in rows] == [(4, None, None),
                                                                                (8, 8, pytest.approx(evals[1][1]))]
