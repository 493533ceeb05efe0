"""The strategy owns the checkpoint's format (Strategy.save_checkpoint); the keeper writes what it makes, no branch."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import torch
from helpers import cfg

from stabletrain.distributed.strategy import CheckpointSave, FSDPStrategy, Strategy

KEEPER = Path(__file__).resolve().parents[1] / "src" / "stabletrain" / "services" / "checkpoints.py"


def test_one_process_checkpoint_is_the_whole_state_written_inline():
    strategy = Strategy(cfg(), SimpleNamespace(enabled=False, world=1, rank=0), torch.device("cpu"))
    state = {"model": {"w": torch.ones(2)}, "rng": {}, "stream": {}}
    save = strategy.save_checkpoint(lambda **kw: state, ckpt=None, step=3)
    assert isinstance(save, CheckpointSave)
    assert save.whole is state and save.meta == {} and save.withheld is None and save.inline_ok
    strategy.wait_for_checkpoint()  # nothing in flight: returns


def test_fsdp_under_a_full_checkpoint_saves_as_the_base_gathering_every_rank_s_rng_and_position():
    dist = SimpleNamespace(enabled=True, world=2, rank=0, gather_objects=lambda obj: [obj, obj])
    strategy = FSDPStrategy(cfg("dist.checkpoint=full"), dist, torch.device("cpu"))
    save = strategy.save_checkpoint(lambda **kw: {"rng": 1, "stream": 2}, ckpt=None, step=3)
    assert save.whole["ranks"] == [{"rng": 1, "stream": 2}] * 2 and save.meta == {"world_size": 2} and save.inline_ok
    strategy.wait_for_checkpoint()  # no DCP saver was made


def test_the_checkpoint_keeper_holds_no_sharded_save():
    tree = ast.parse(KEEPER.read_text(encoding="utf-8"))
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(m and m.endswith("checkpoint.shards") for m in imported)
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not names & {"sharded", "replicated", "shard_saver"}
