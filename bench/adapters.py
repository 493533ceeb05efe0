"""Step time with vs without each adapter, per host trainer, in lockstep, on the same GPT-2-sized model.

For each host (a plain loop with ``stabletrain.Monitor``, Lightning with its ``StableTrainCallback``, the
Hugging Face ``Trainer`` with its ``StableTrainCallback``) two runs train the same model from the same init
on the same data in one process, one bare and one with the adapter, each in a thread of its own, taking
turns step by step (lockstep: step k of one, then step k of the other, never both at once; which side goes
first alternates per round), so a burst of load from elsewhere hits both sides alike. Both sides use the
host's own fused AdamW and global-norm clipping at 1.0. Each step is timed from the host's step-start hook
(first in its callback list) to its step-end hook (last), so the adapter's own hooks are inside the clock;
the first ``warmup`` steps (the init fingerprint, the signal report, the run directory's creation) are
not. Printed per host: the median over log intervals of (adapter interval time) / (bare interval time) —
whole intervals, so the adapter's once-per-interval sync, jsonl, TensorBoard and snapshot are in it —
with the quartiles, and the mean step times. Target: at most 1.03 on the default GPT-sized step on CPU.

The adapters' capture (an incident's state from before the bad step) costs one copy of the model, the
optimizer state and the loss scale per log interval, into reused host buffers (on CUDA on a side stream),
plus a reference to (on CUDA: a host copy of) each step's batch: the last line prints that copy's time per
interval and per step, and the host memory it holds, measured on its own on the same model.

    python bench/adapters.py                      # GPT-2 small-ish (6 x 384, seq 128, batch 8), 3 rounds
    python bench/adapters.py --hosts loop lightning --rounds 5
    python bench/adapters.py --quick              # smoke run: a tiny model, 1 round, few steps (not a measurement)
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def gpt2(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=max(args.width // 64, 2),
                                      vocab_size=args.vocab, n_positions=args.seq, bos_token_id=0, eos_token_id=0))


def rows(args: argparse.Namespace, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (n, args.seq), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


class Turns:
    """Two runs in two threads taking turns step by step; each step's wall time per side (0: bare, 1: adapter)."""

    def __init__(self, first: int) -> None:
        self.cond = threading.Condition()
        self.turn, self.done = first, [False, False]
        self.times: list[list[float]] = [[], []]
        self._t0 = [0.0, 0.0]

    def begin(self, side: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.turn == side or self.done[1 - side])
        self._t0[side] = time.perf_counter()

    def end(self, side: int) -> None:
        self.times[side].append(time.perf_counter() - self._t0[side])
        with self.cond:
            self.turn = 1 - side
            self.cond.notify_all()

    def finish(self, side: int) -> None:
        with self.cond:
            self.done[side] = True
            self.turn = 1 - side
            self.cond.notify_all()


# -- one timed run per host and side ---------------------------------------------------------------------


def run_loop(base: torch.nn.Module, data: list, args: argparse.Namespace, adapter: bool, run_dir: Path,
             turns: Turns) -> None:
    from stabletrain import Monitor

    side = int(adapter)
    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batches = []
    for i in range(0, len(data), args.batch):
        chunk = data[i:i + args.batch]
        batches.append({k: torch.stack([r[k] for r in chunk]) for k in chunk[0]})

    def loss_fn(m, b):
        return m(**b).loss

    monitor = Monitor(model, opt, run_dir=run_dir, clip_max_norm=1.0, log_every=args.log_every,
                      loss_fn=loss_fn) if adapter else None
    for batch in batches[: args.warmup + args.steps]:
        turns.begin(side)
        loss = loss_fn(model, batch)
        if monitor is not None:
            monitor.backward(loss, batch)
            monitor.step()
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        turns.end(side)
    if monitor is not None:
        monitor.close()


def run_lightning(base: torch.nn.Module, data: list, args: argparse.Namespace, adapter: bool, run_dir: Path,
                  turns: Turns) -> None:
    import lightning as L

    from stabletrain.integrations.lightning import StableTrainCallback

    side = int(adapter)

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = copy.deepcopy(base)

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)

    class Begin(L.Callback):  # first in the list: the clock starts before any other callback's hook
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            turns.begin(side)

    class End(L.Callback):  # last: it stops after every other callback's hook
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            turns.end(side)

    ours = [StableTrainCallback(run_dir=run_dir, log_every=args.log_every)] if adapter else []
    trainer = L.Trainer(max_steps=args.warmup + args.steps, accelerator="auto", devices=1, gradient_clip_val=1.0,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Begin(), *ours, End()])
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=False)
    trainer.fit(Lit(), loader)


def run_transformers(base: torch.nn.Module, data: list, args: argparse.Namespace, adapter: bool,
                     run_dir: Path, turns: Turns) -> None:
    import transformers

    from stabletrain.integrations.transformers import StableTrainCallback

    side = int(adapter)

    class Begin(transformers.TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            turns.begin(side)

    class End(transformers.TrainerCallback):
        def on_step_end(self, a, state, control, **kw):
            turns.end(side)

    ours = [StableTrainCallback(run_dir=run_dir, log_every=args.log_every)] if adapter else []
    targs = transformers.TrainingArguments(
        output_dir=str(run_dir.parent / f"hf-{run_dir.name}"), max_steps=args.warmup + args.steps,
        per_device_train_batch_size=args.batch, learning_rate=1e-4, max_grad_norm=1.0, report_to=[],
        logging_steps=10**6, save_strategy="no", train_sampling_strategy="sequential", disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = transformers.Trainer(model=copy.deepcopy(base), args=targs, train_dataset=data,
                                   callbacks=[Begin(), *ours, End()])
    trainer.train()


RUNNERS = {"loop": run_loop, "lightning": run_lightning, "transformers": run_transformers}


def lockstep(host: str, base: torch.nn.Module, data: list, args: argparse.Namespace, tmp: Path, rnd: int) -> Turns:
    """One round: the bare run and the adapter's run in two threads, taking turns step by step."""
    turns = Turns(first=rnd % 2)
    errors: list[BaseException] = []

    def side(adapter: bool) -> None:
        try:
            RUNNERS[host](base, data, args, adapter, tmp / f"{host}-{rnd}-{int(adapter)}", turns)
        except BaseException as err:  # reported once both threads end
            errors.append(err)
        finally:
            turns.finish(int(adapter))

    threads = [threading.Thread(target=side, args=(a,)) for a in (False, True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return turns


def snapshot_cost(base: torch.nn.Module, args: argparse.Namespace, repeats: int = 15) -> str:
    """The interval snapshot's copy on its own: model + AdamW state (after one step), median over ``repeats``."""
    from stabletrain.records.staging import IntervalSnapshot

    model = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = {k: torch.stack([r[k] for r in rows(args, args.batch)]) for k in ("input_ids", "labels")}
    model(**batch).loss.backward()
    opt.step()
    snap, times = IntervalSnapshot(), []
    for _ in range(repeats):
        t0 = time.perf_counter()
        snap.take({"model": model.state_dict(), "optimizer": opt.state_dict()}, 0)
        snap.before_update()
        snap.get()
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    return (f"snapshot: {ms:.1f} ms per interval = {ms / args.log_every:.2f} ms per step at log_every={args.log_every}; "
            f"host memory {snap.num_bytes / 2**20:.0f} MiB (model + optimizer state); kept batches "
            f"{args.log_every * args.batch * args.seq * 8 * 2 / 2**20:.2f} MiB per interval")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", nargs="+", default=list(RUNNERS), choices=list(RUNNERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="timed steps per run (a multiple of --log-every)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=384)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 round, few steps")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup, args.log_every = 1, 4, 2, 2
        args.layers, args.width, args.seq, args.batch, args.vocab = 2, 64, 32, 4, 256
    if args.steps % args.log_every:
        parser.error("--steps must be a multiple of --log-every (the timed window then holds whole log intervals)")
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    import transformers

    transformers.logging.set_verbosity_error()
    base = gpt2(args)
    data = rows(args, (args.warmup + args.steps) * args.batch)
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model: GPT-2 {args.layers} x {args.width}, seq {args.seq}, batch {args.batch}, {n_params / 1e6:.1f}M "
          f"parameters; {args.rounds} round(s) of {args.steps} timed steps (+{args.warmup} warm-up), "
          f"log_every={args.log_every}, torch threads {torch.get_num_threads()}")
    print(f"{'host':<14}{'bare s/step':>13}{'adapter s/step':>16}{'ratio (median)':>16}   interval quartiles")
    with tempfile.TemporaryDirectory() as tmp:
        for host in args.hosts:
            ratios, bare, ours = [], [], []
            for rnd in range(args.rounds):
                turns = lockstep(host, base, data, args, Path(tmp), rnd)
                b, a = (t[args.warmup:] for t in turns.times)
                bare += b
                ours += a
                for i in range(0, len(b) - args.log_every + 1, args.log_every):  # whole log intervals
                    ratios.append(sum(a[i:i + args.log_every]) / sum(b[i:i + args.log_every]))
            q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
            print(f"{host:<14}{statistics.mean(bare):>13.4f}{statistics.mean(ours):>16.4f}"
                  f"{statistics.median(ratios):>16.3f}   {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f} "
                  f"({len(ratios)} intervals)", flush=True)
    print(snapshot_cost(base, args))
    if args.quick:
        print("(--quick: a smoke run, not a measurement)")


if __name__ == "__main__":
    main()
