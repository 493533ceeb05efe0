"""Workers for the adapters on several processes: Monitor around DDP and the HF Trainer under torchrun, Lightning ddp.

``python -m torch.distributed.run --nproc_per_node=2 dist_adapters.py monitor OUT RUN_DIR``
``python -m torch.distributed.run --nproc_per_node=2 dist_adapters.py transformers OUT RUN_DIR``
``python dist_adapters.py lightning OUT RUN_DIR``  (Lightning starts its second rank itself)

Every rank saves ``OUT/<host>_rank_R.pt``: its final parameters, the steps its session counted, and how many
collectives the process group ran in each step (its sequence number: every collective counts, the host's own
gradient all-reduce included).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))

from integration_models import BAD_POSITION, Net, batches, loss_fn  # noqa: E402
from multiproc import end_worker  # noqa: E402

BAD_STEP, BAD_RANK, STEPS, LOG_EVERY = 3, 1, 8, 4
SPIKE_STEP = 7  # the second interval: the spike rule is armed


def _seq() -> int:
    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()


def detached_nan_loss(model, batch):
    """A loss whose non-finite part has no gradient: NaN loss, finite gradients (the verdict must still travel)."""
    x, y = batch
    return F.mse_loss(model(x), torch.nan_to_num(y)) + (y.sum() * 0).detach()


def monitor(out: Path, run_dir: Path) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from stabletrain import Monitor

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    saved = {}
    for name, bad_in, loss in (("sqrt", "x", loss_fn), ("detached", "y", detached_nan_loss), ("spike", "spike", loss_fn)):
        torch.manual_seed(0)
        model = Net()
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=True)
        data = batches(STEPS, seed=10 + rank)
        if rank == BAD_RANK and bad_in == "spike":  # a finite spike: one huge target on rank 1 at SPIKE_STEP
            data[SPIKE_STEP - 1][1][BAD_POSITION, 0] = 300.0
        elif rank == BAD_RANK:
            x, y = data[BAD_STEP - 1]
            if bad_in == "x":
                x[BAD_POSITION, 0] = -100.0
            else:
                y[BAD_POSITION, 0] = float("nan")
        counts = []
        with Monitor(ddp, opt, run_dir=run_dir / name, log_every=LOG_EVERY, loss_fn=loss) as mon:
            for batch in data:
                before = _seq()
                with mon.autocast():
                    value = loss(ddp, batch)
                mon.backward(value, batch)
                mon.step()
                counts.append(_seq() - before)
        saved[name] = {"params": [p.detach().clone() for p in model.parameters()], "counts": counts,
                       "steps": mon.num_steps, "history": mon.history}
    try:  # the spike rule on each rank's own loss would split the ranks on skipping a step: refused
        probe = DDP(Net())
        Monitor(probe, torch.optim.SGD(probe.parameters(), lr=0.1), on_spike="skip")
        saved["skip_refused"] = None
    except ValueError as err:
        saved["skip_refused"] = str(err)
    torch.manual_seed(0)  # the host alone: a plain DDP loop's own collectives per step
    model = Net()
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, fused=True)
    bare = []
    for batch in batches(STEPS, seed=10 + rank):
        before = _seq()
        loss_fn(ddp, batch).backward()
        opt.step()
        opt.zero_grad()
        bare.append(_seq() - before)
    saved["bare_counts"] = bare
    torch.save(saved, out / f"monitor_rank_{rank}.pt")
    end_worker()


def transformers_main(out: Path, run_dir: Path) -> None:
    import transformers
    from integration_models import BATCH_HF, token_rows, trap_gpt2

    from stabletrain.integrations.transformers import StableTrainCallback

    transformers.logging.set_verbosity_error()
    rank = int(os.environ["RANK"])
    # Accelerate deals batch i to rank i % 2 (sequential sampling): rank 1's step-3 batch is batch 5.
    trap = (2 * (BAD_STEP - 1) + BAD_RANK) * BATCH_HF + 1
    model = trap_gpt2()
    counts: list[int] = []

    class Count(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.before = _seq()

        def on_step_end(self, args, state, control, **kw):
            counts.append(_seq() - self.before)

    def train(callbacks, model):
        counts.clear()
        trainer = transformers.Trainer(model=model, args=args, callbacks=[*callbacks, Count()],
                                       train_dataset=token_rows(4 * STEPS * BATCH_HF, trap_at=trap))
        trainer.train()
        return list(counts)

    cb = StableTrainCallback(run_dir=run_dir, log_every=LOG_EVERY)
    args = transformers.TrainingArguments(
        output_dir=str(out / "hf"), max_steps=STEPS, per_device_train_batch_size=BATCH_HF, learning_rate=1e-3,
        use_cpu=True, report_to=[], logging_steps=1000, save_strategy="no", train_sampling_strategy="sequential",
        seed=0, dataloader_num_workers=0, disable_tqdm=True, ddp_backend="gloo", optim="adamw_torch_fused")
    ours = train([cb], model)
    bare = train([], trap_gpt2())
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "counts": ours, "bare_counts": bare,
                "steps": cb.session.step, "history": cb.session.history}, out / f"transformers_rank_{rank}.pt")
    end_worker()  # the Trainer leaves its gloo group up: the interpreter's teardown could abort (see end_worker)


def lightning_main(out: Path, run_dir: Path) -> None:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from stabletrain.integrations.lightning import StableTrainCallback

    class LitNet(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True)

    counts: list[int] = []
    planted: list[tuple[int, int, int]] = []  # (rank, step, position) of the planted sample, as Lightning dealt it

    class Count(L.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.before = _seq()
            for pos in (batch[0][:, 0] == -100.0).nonzero().flatten().tolist():
                planted.append((trainer.global_rank, batch_idx + 1, pos))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            counts.append(_seq() - self.before)

    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(2 * STEPS * 8, 4, generator=g), torch.randn(2 * STEPS * 8, 1, generator=g)
    # DistributedSampler without shuffling: rank r reads samples r, r + 2, ...; rank 1's step-3 batch is
    # samples 2 * (16 + j) + 1: position BAD_POSITION is sample 2 * (16 + BAD_POSITION) + 1.
    x[2 * (8 * (BAD_STEP - 1) + BAD_POSITION) + BAD_RANK, 0] = -100.0
    loader = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)

    def fit(callbacks, module):
        counts.clear()
        trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            callbacks=[*callbacks, Count()])
        trainer.fit(module, loader)
        return trainer, list(counts)

    module = LitNet()
    cb = StableTrainCallback(run_dir=run_dir, log_every=LOG_EVERY)
    trainer, ours = fit([cb], module)
    where = list(planted)
    _, bare = fit([], LitNet())
    torch.save({"params": [p.detach().clone() for p in module.parameters()], "counts": ours, "bare_counts": bare,
                "planted": where, "steps": cb.session.step, "history": cb.session.history},
               out / f"lightning_rank_{trainer.global_rank}.pt")


if __name__ == "__main__":
    host, out, run_dir = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    out.mkdir(parents=True, exist_ok=True)
    {"monitor": monitor, "transformers": transformers_main, "lightning": lightning_main}[host](out, run_dir)
