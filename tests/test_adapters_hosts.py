"""The adapters inside the host configurations people use: a bad step costs exactly that step, nothing else.

Each case trains the same model twice: with stabletrain and a planted NaN, and as the host alone with a
hand-written "skip step k" (its gradients dropped before the optimizer step) and no stabletrain. The final
parameters must be equal (bitwise in fp32, to the precision's tolerance otherwise), the host's random
generators must be where the host alone left them (so a capture neither rewinds nor advances them: the
models use dropout and the steps draw python and numpy numbers too), the bundle must hold the state from
before the bad step, and the diagnosis must name the op, module and sample of the fault, replaying what the
host computed (its own loss: dicts, tuples, ModelOutputs, a compute_loss override, label smoothing,
num_items_in_batch). A healthy control of each mixed-precision case shows no incident and equals the host alone.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from integration_models import BAD_POSITION, VOCAB, Net, TrapEmbedding, batches, token_rows, trap_gpt2
from torch import nn

from stabletrain import Monitor
from stabletrain.report import load_run

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning",
                                                           "ignore::DeprecationWarning")]
BAD_STEP = 3


def _rng():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def _same_rng(a, b):
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


def _bundle(run_dir, step=BAD_STEP):
    return torch.load(run_dir / "incidents" / f"step_{step:06d}" / "bundle.pt", weights_only=True)


def _diagnosis(run_dir):
    (incident,) = load_run(run_dir).counted_events("incident")
    return incident.step, incident.extra["diagnosis"]


def _close(a, b, exact):
    for x, y in zip(a, b):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=2e-3, atol=2e-4)


# -- your own loop: Monitor ----------------------------------------------------------------------------

class DropNet(Net):
    def forward(self, x):
        return self.fc2(F.dropout(self.root(self.act(self.fc1(x)), x), 0.2, self.training))


def _own_loop(monitor_kw=None, *, bad=True, steps=8, scaler=None, dtype=None):
    """The user's loop; with ``monitor_kw`` under a Monitor, else with a hand-written skip of BAD_STEP."""
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = DropNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    data = batches(steps, bad_step=BAD_STEP if bad else None)
    before = None
    monitor = Monitor(model, opt, loss_fn=_drop_loss, clip_max_norm=1.0, log_every=5, scaler=scaler,
                      precision="fp16" if scaler is not None else None, **monitor_kw) if monitor_kw is not None else None
    for step, batch in enumerate(data, 1):
        np.random.rand(), random.random()  # the user's own draws (augmentation, sampling)
        if step == BAD_STEP:
            before = [p.detach().clone() for p in model.parameters()]
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = _drop_loss(model, batch)
        if monitor is not None:
            monitor.backward(loss, batch)
            monitor.step()
            continue
        (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        if step == BAD_STEP and bad:  # the hand-written skip
            opt.zero_grad(set_to_none=True)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    if monitor is not None:
        monitor.close()
    return [p.detach() for p in model.parameters()], before, _rng()


def _drop_loss(model, batch):
    x, y = batch
    return F.mse_loss(model(x), y)


@pytest.mark.parametrize("run_dir", [True, False])
def test_monitor_skips_exactly_the_bad_step_and_leaves_the_rng_where_the_loop_alone_would(tmp_path, run_dir):
    ref, _, ref_rng = _own_loop()
    ours, before, rng = _own_loop({"run_dir": tmp_path / "run" if run_dir else None})
    _close(ours, ref, exact=True)
    assert _same_rng(rng, ref_rng)  # the capture's replay and diagnosis put every generator back
    if run_dir:
        bundle = _bundle(tmp_path / "run")
        assert all(torch.equal(bundle["model"][k], v) for k, v in zip(DropNet().state_dict(), before))
        step, d = _diagnosis(tmp_path / "run")
        assert (step, d["module"], d["op"], d["bad_positions"]) == (
            BAD_STEP, "root", "aten.sqrt.default", [{"micro_batch": 0, "position": BAD_POSITION}])
        assert load_run(tmp_path / "run").metrics[0]["num_skipped"] == 1


def test_monitor_with_the_users_own_grad_scaler_fp16(tmp_path):
    def scaler():
        return torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=1000)

    ref, _, _ = _own_loop(scaler=scaler(), dtype=torch.float16)
    ours, _, _ = _own_loop({"run_dir": tmp_path / "run"}, scaler=scaler(), dtype=torch.float16)
    _close(ours, ref, exact=True)
    assert _diagnosis(tmp_path / "run")[1]["module"] == "root"
    control, _, _ = _own_loop({"run_dir": tmp_path / "ctl"}, bad=False, scaler=scaler(), dtype=torch.float16)
    alone, _, _ = _own_loop(bad=False, scaler=scaler(), dtype=torch.float16)
    _close(control, alone, exact=True)
    assert not load_run(tmp_path / "ctl").counted_events("incident")


def _accelerate_loop(run_dir=None, bad=True, steps=8):
    """accelerator.prepare, accelerator.backward, accelerator.clip_grad_norm_: the user's loop as it is."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = DropNet()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = accelerator.prepare(model, opt)
    monitor = Monitor(model, opt, run_dir=run_dir, loss_fn=_drop_loss, clip_max_norm=1.0, log_every=5) \
        if run_dir is not False else None
    for step, batch in enumerate(batches(steps, bad_step=BAD_STEP if bad else None), 1):
        loss = _drop_loss(model, batch)
        accelerator.backward(loss)
        norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
        if monitor is not None:
            monitor.step(batch, loss=loss, grad_norm=norm)
            continue
        if step == BAD_STEP and bad:
            opt.zero_grad(set_to_none=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if monitor is not None:
        monitor.close()
    return [p.detach() for p in model.parameters()]


def test_monitor_in_an_accelerate_loop(tmp_path):
    pytest.importorskip("accelerate")
    _close(_accelerate_loop(tmp_path / "run"), _accelerate_loop(False), exact=True)
    step, d = _diagnosis(tmp_path / "run")
    assert (step, d["module"], d["bad_positions"]) == (BAD_STEP, "root", [{"micro_batch": 0, "position": BAD_POSITION}])
    rows = load_run(tmp_path / "run").metrics
    assert rows[0]["grad_norm"] > 0 and rows[0]["grad_norm_post_clip"] <= 1.0 + 1e-5  # the user's pre-clip norm


# -- Lightning ----------------------------------------------------------------------------------------

def _lightning(kind, tmp_path, *, ours, bad=True, steps=6, **cfg):
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from stabletrain.integrations.lightning import StableTrainCallback

    accumulate = cfg.get("accumulate_grad_batches", 1)

    class LitDrop(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = DropNet()

        def training_step(self, batch, batch_idx):
            np.random.rand(), random.random()
            x, y = batch
            loss = F.mse_loss(self.net(x), y)
            return {"loss": loss, "seen": x.shape[0]} if kind == "dict" else loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=cfg.get("fused", True))

    class HandSkip(L.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            if trainer.global_step + 1 == BAD_STEP and bad:
                optimizer.zero_grad(set_to_none=True)

    seen = {}

    class Before(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step + 1 == BAD_STEP and "params" not in seen:
                seen["params"] = {n: p.detach().clone() for n, p in module.named_parameters()}

    g = torch.Generator().manual_seed(0)
    n = steps * accumulate * 8
    x, y = torch.rand(n, 4, generator=g), torch.randn(n, 1, generator=g)
    if bad:
        x[(BAD_STEP - 1) * accumulate * 8 + 8 * (accumulate - 1) + BAD_POSITION, 0] = -100.0
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    own_clip = cfg.pop("clip_max_norm", None)
    callbacks = [StableTrainCallback(run_dir=tmp_path, log_every=4, clip_max_norm=own_clip)] if ours else [HandSkip()]
    if not ours and own_clip is not None:
        class Clip(L.Callback):
            def on_before_optimizer_step(self, trainer, module, optimizer):
                torch.nn.utils.clip_grad_norm_(module.parameters(), own_clip)
        callbacks.append(Clip())
    module = LitDrop()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, callbacks=[*callbacks, Before()],
                        **{k: v for k, v in cfg.items() if k != "fused"})
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False))
    return [p.detach() for p in module.parameters()], seen.get("params"), _rng()


LIGHTNING = {
    "32-accumulate2-clip": dict(precision="32", accumulate_grad_batches=2, gradient_clip_val=1.0),
    "32-dict": dict(precision="32"),
    "bf16-mixed-fused-own-clip": dict(precision="bf16-mixed", clip_max_norm=1.0),
    "16-mixed-accumulate2-clip": dict(precision="16-mixed", fused=False, accumulate_grad_batches=2,
                                      gradient_clip_val=1.0),
}


@pytest.mark.parametrize("name", list(LIGHTNING))
def test_lightning_host_configurations(tmp_path, name):
    cfg = LIGHTNING[name]
    kind = "dict" if name.endswith("dict") else "tensor"
    exact = cfg["precision"] == "32"
    ref, _, ref_rng = _lightning(kind, tmp_path / "ref", ours=False, **dict(cfg))
    ours, before, rng = _lightning(kind, tmp_path / "run", ours=True, **dict(cfg))
    _close(ours, ref, exact)
    assert _same_rng(rng, ref_rng)
    step, d = _diagnosis(tmp_path / "run")
    micro = cfg.get("accumulate_grad_batches", 1) - 1
    assert (step, d["module"], d["op"], d["bad_positions"]) == (
        BAD_STEP, "net.root", "aten.sqrt.default", [{"micro_batch": micro, "position": BAD_POSITION}])
    bundle = _bundle(tmp_path / "run")
    assert all(torch.equal(bundle["model"][n], p) for n, p in before.items())  # the state from before the bad step
    if not exact:  # the healthy control: no incident, the host's own parameters
        control, _, _ = _lightning(kind, tmp_path / "ctl", ours=True, bad=False, **dict(cfg))
        alone, _, _ = _lightning(kind, tmp_path / "alone", ours=False, bad=False, **dict(cfg))
        _close(control, alone, exact=True)
        assert not load_run(tmp_path / "ctl").counted_events("incident")


def test_lightning_refuses_to_clip_a_fused_optimizer_under_mixed_precision_with_a_clear_line(tmp_path):
    with pytest.raises(ValueError, match=r"StableTrainCallback\(clip_max_norm=1.0\)"):
        _lightning("tensor", tmp_path, ours=True, precision="bf16-mixed", gradient_clip_val=1.0)


# -- Hugging Face -------------------------------------------------------------------------------------

class TinyLM(nn.Module):
    """An embedding and a head, returning a dict, a tuple or bare logits; the trap token is NaN in ``emb``."""

    def __init__(self, output: str = "dict"):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.drop, self.head = TrapEmbedding(VOCAB, 16), nn.Dropout(0.1), nn.Linear(16, VOCAB)
        self.output = output

    def forward(self, input_ids, labels=None):
        logits = self.head(self.drop(self.emb(input_ids)))
        if self.output == "logits":
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits} if self.output == "dict" else (loss, logits)


def _logits_trainer():
    import transformers

    class LogitsTrainer(transformers.Trainer):
        """A compute_loss override: the model returns logits, the loss is computed here."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            logits = model(**inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            return (loss, logits) if return_outputs else loss

    return LogitsTrainer


def _hf(model_fn, tmp_path, *, ours, bad=True, steps=5, trainer_cls=None, position=1, **kw):
    transformers = pytest.importorskip("transformers")
    from stabletrain.integrations.transformers import StableTrainCallback

    transformers.logging.set_verbosity_error()
    accumulate = kw.get("gradient_accumulation_steps", 1)
    per_step = 4 * accumulate
    trap = (BAD_STEP - 1) * per_step + position if bad else None
    seen = {}

    class HandSkip(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **k):
            if state.global_step + 1 == BAD_STEP and bad:
                model.zero_grad(set_to_none=True)

    class Before(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **k):
            if state.global_step + 1 == BAD_STEP:
                seen["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}

    model = model_fn()
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf"), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-2,
        use_cpu=True, report_to=[], logging_steps=1000, save_strategy="no", train_sampling_strategy="sequential",
        seed=0, dataloader_num_workers=0, disable_tqdm=True, optim="adamw_torch_fused", **kw)
    cb = StableTrainCallback(run_dir=tmp_path / "run", log_every=4) if ours else HandSkip()
    trainer = (trainer_cls or transformers.Trainer)(model=model, args=args, callbacks=[cb, Before()],
                                                    train_dataset=token_rows(steps * per_step, trap_at=trap))
    trainer.train()
    return [p.detach() for p in model.parameters()], seen.get("params"), _rng()


HF = {
    "dict-output": dict(model=lambda: TinyLM("dict"), module="emb"),
    "tuple-output-no-clip": dict(model=lambda: TinyLM("tuple"), module="emb", max_grad_norm=0.0),
    "compute-loss-override": dict(model=lambda: TinyLM("logits"), module="emb", trainer=_logits_trainer),
    "modeloutput-label-smoothing": dict(model=trap_gpt2, module="transformer.wte", label_smoothing_factor=0.1),
    "num-items-accumulate2": dict(model=trap_gpt2, module="transformer.wte", gradient_accumulation_steps=2, position=5),
    "bf16": dict(model=trap_gpt2, module="transformer.wte", bf16=True, max_grad_norm=1.0),
}


@pytest.mark.parametrize("name", list(HF))
def test_hugging_face_host_configurations(tmp_path, name):
    case = dict(HF[name])
    model_fn, module, trainer = case.pop("model"), case.pop("module"), case.pop("trainer", None)
    position = case.pop("position", 1)
    exact = not case.get("bf16")
    kw = dict(case, trainer_cls=trainer() if trainer else None, position=position)
    ref, _, ref_rng = _hf(model_fn, tmp_path / "ref", ours=False, **kw)
    ours, before, rng = _hf(model_fn, tmp_path / "ours", ours=True, **kw)
    _close(ours, ref, exact)
    assert _same_rng(rng, ref_rng)
    step, d = _diagnosis(tmp_path / "ours" / "run")
    per_micro = 4
    assert (step, d["module"], d["op"], d["bad_positions"]) == (
        BAD_STEP, module, "aten.sqrt.default", [{"micro_batch": position // per_micro, "position": position % per_micro}])
    bundle = _bundle(tmp_path / "ours" / "run")
    assert all(torch.equal(bundle["model"][n], p) for n, p in before.items())  # the state from before the bad step
    if not exact:
        control, _, _ = _hf(model_fn, tmp_path / "ctl", ours=True, bad=False, **kw)
        alone, _, _ = _hf(model_fn, tmp_path / "alone", ours=False, bad=False, **kw)
        _close(control, alone, exact=True)
        assert not load_run(tmp_path / "ctl" / "run").counted_events("incident")

