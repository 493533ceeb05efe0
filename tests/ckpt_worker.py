"""A torchrun worker and callbacks for the checkpoint tests (resharding, DCP): train or resume, recording windows.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/ckpt_worker.py OUT_DIR key=value ...

``resume=RUN_DIR`` resumes RUN_DIR (the other keys must be the run's, as the CLI would take them from its
config.yaml). Each rank writes ``OUT_DIR/rank_R.pt``: its windows ``(step, epoch, start, indices)``, its
metrics history, its torch RNG state right after the resume, its final full parameters and its step.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch

from stabletrain.callbacks import Callback


class SlowSteps(Callback):
    """Sleep ``STABLETRAIN_TEST_SLEEP`` seconds (default 0) after each step, so a test can kill a run mid-way."""

    def on_step_end(self, state, out):
        import time

        time.sleep(float(os.environ.get("STABLETRAIN_TEST_SLEEP", "0")))


class WriterReady(Callback):
    """At the fit's start, start this process's checkpoint writer and wait until it serves (its imports done), so the
    run's saves go to it from the first: a small save that comes before it serves is written by training itself."""

    def on_fit_start(self, state):
        import time

        from stabletrain.records.checkpoint.writer import writer

        channel, deadline = writer(), time.monotonic() + 120
        while not channel.ready and time.monotonic() < deadline:
            time.sleep(0.02)
        assert channel.ready, "the checkpoint writer did not start serving within 120 s"


class FailShardWrite(Callback):
    """Rank 1's DCP writes of every sharded checkpoint after step 0 fail as a full disk would (OSError ENOSPC)."""

    def on_fit_start(self, state):
        import errno

        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        if int(os.environ.get("RANK", "0")) != 1:
            return
        real = FileSystemWriter.write_data

        def write_data(writer, plan, planner):
            if "step_000000" not in str(writer.path):
                raise OSError(errno.ENOSPC, "No space left on device (planted)")
            return real(writer, plan, planner)

        FileSystemWriter.write_data = write_data


class PlantNaN(Callback):
    """After step ``STABLETRAIN_TEST_NAN_STEP`` (default 2), write a NaN into rank 1's shard of ``layers.1.fc.weight``.

    The step's own checks have passed by then, so only the checkpoint's check of every rank's shards sees it.
    """

    def on_step_end(self, state, out):
        if state.step != int(os.environ.get("STABLETRAIN_TEST_NAN_STEP", "2")) or state.dist.rank != 1:
            return
        param = dict(state.module.named_parameters())["layers.1.fc.weight"]
        with torch.no_grad():
            param.to_local()[0, 0] = float("nan")


class SigtermAtFitEnd(Callback):
    """At the fit's end (after the loop let go of its signal handler), SIGTERM to this process: as torchrun's agent
    sends one to every rank when another dies, while the rank is still on its way out."""

    def on_fit_end(self, state, record):
        os.kill(os.getpid(), signal.SIGTERM)


def record_windows(trainer) -> list[tuple[int, int, int, list[list[int]]]]:
    """Wrap ``trainer.stream.next_window`` to record (step it trains, epoch, start, micro-batch indices) per window."""
    seen = []
    pull = trainer.stream.next_window

    def recorded():
        w = pull()
        seen.append((trainer.step + 1, w.epoch, w.start, [list(i) for i in w.indices]))
        return w

    trainer.stream.next_window = recorded
    return seen


def main(argv: list[str]) -> None:
    from stabletrain import Trainer, load_config
    from stabletrain.distributed.group import process_group

    out = Path(argv[0])
    cfg = load_config(None, argv[1:])
    with process_group(cfg.dist.backend, cfg.dist.timeout_s) as ctx:
        trainer = Trainer(cfg, run_dir=cfg.resume or cfg.run.dir, resume=bool(cfg.resume))
        rng = torch.get_rng_state()
        windows = record_windows(trainer)
        trainer.fit()
        full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in trainer.module.named_parameters()}
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"windows": windows, "history": trainer.history, "rng": rng, "params": full, "world": ctx.world,
                    "step": trainer.step}, out / f"rank_{ctx.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
