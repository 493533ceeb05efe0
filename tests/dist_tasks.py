"""A torchrun worker for the distributed tests: train, then leave each rank's view of the run on disk.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_tasks.py OUT_DIR [--count-syncs]
        [--count-collectives] [--states] key=value ...

or as a scenario of a shared world (tests/dist_world.py: ``dist_tasks:main`` with the same arguments).

Each rank writes ``OUT_DIR/rank_R.pt``: its final parameters, its metrics history, with
``--count-syncs`` every Tensor->host conversion it made (step, function, the calling frames), and with
``--count-collectives`` every torch.distributed collective it called (step, collective, the calling frames)
and how many collectives each step ran (see count_collectives), with ``--states`` the model and optimizer
state after each step.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))

import torch
from torch.overrides import TorchFunctionMode

from stabletrain import Trainer, load_config
from stabletrain.callbacks import Callback
from stabletrain.distributed.group import process_group

SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__, torch.Tensor.__int__,
         torch.Tensor.__index__, torch.Tensor.numpy}


class CountSyncs(TorchFunctionMode):
    """Record (trainer step, function, calling frames) for each Tensor -> Python conversion (as test_syncs does)."""

    def __init__(self, trainer: Trainer) -> None:
        super().__init__()
        self.trainer, self.calls = trainer, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            stack = [f.name for f in traceback.extract_stack()[:-1]]
            files = [f.filename for f in traceback.extract_stack()[-8:]]
            if not any("torch/utils/data" in f for f in files):  # DataLoader's host-side base seed
                self.calls.append((self.trainer.step, func.__name__, stack[-40:]))
        return func(*args, **(kwargs or {}))


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier",
               "reduce_scatter_tensor", "all_gather_into_tensor")


@contextlib.contextmanager
def count_collectives(trainer: Trainer) -> Iterator[list]:
    """Wrap torch.distributed's Python collectives to record each call; record each step's count of ALL collectives.

    Python calls: (step, name, calling frames). Each optimizer step also appends (step, "step", [collectives
    the process group ran during it, DDP's buckets]): the group's sequence number counts every collective,
    DDP's own C++ all-reduce included, which no Python wrapper sees. torch.distributed's own functions are put
    back on the way out (a shared world runs other scenarios after this one).
    """
    import torch.distributed as dist

    calls = []
    train_step, group = trainer.train_step, dist.group.WORLD

    def counted_step(*args, **kwargs):
        before = group._get_sequence_number_for_group()
        out = train_step(*args, **kwargs)
        buckets = trainer.model._get_ddp_logging_data().get("bucket_sizes", "")
        calls.append((trainer.step, "step", [group._get_sequence_number_for_group() - before, len(buckets.split(","))]))
        return out

    trainer.train_step = counted_step

    def wrap(name, fn):
        def recorded(*args, **kwargs):
            calls.append((trainer.step, name, [f.name for f in traceback.extract_stack()[:-1]][-40:]))
            return fn(*args, **kwargs)
        return recorded

    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


class RecordStates(Callback):
    """``--states``: the trainer's model and optimizer state after each step (the first time the step ends)."""

    def __init__(self, states: dict, trainer) -> None:
        self.states, self.trainer = states, trainer

    def on_step_end(self, state, out) -> None:
        if state.step not in self.states:
            full = self.trainer.state_dict()
            self.states[state.step] = copy.deepcopy({"model": full["model"], "optimizer": full["optimizer"]})


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    count = "--count-syncs" in argv
    collectives = "--count-collectives" in argv
    record_states = "--states" in argv
    overrides = [a for a in argv[1:] if a not in ("--count-syncs", "--count-collectives", "--states")]
    cfg = load_config(None, overrides)
    with process_group(cfg.dist.backend, cfg.dist.timeout_s) as ctx:
        states: dict[int, dict] = {}
        trainer = Trainer(cfg, run_dir=cfg.run.dir)
        if record_states:
            trainer.callbacks.append(RecordStates(states, trainer))
        counter = CountSyncs(trainer) if count else None
        with (count_collectives(trainer) if collectives else contextlib.nullcontext()) as calls:
            with counter if counter is not None else contextlib.nullcontext():
                trainer.fit()
        out.mkdir(parents=True, exist_ok=True)
        torch.save({"params": {k: v.detach().clone() for k, v in trainer.module.state_dict().items()},
                    "history": trainer.history, "syncs": counter.calls if counter else None, "world": ctx.world,
                    "collectives": calls, "states": states,
                    "step": trainer.step}, out / f"rank_{ctx.rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1:])
