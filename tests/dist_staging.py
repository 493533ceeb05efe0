"""A torchrun worker: stage a state every rank holds alike, each rank its share, then complete it on every rank.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_staging.py OUT_DIR

or as a scenario of a shared world (tests/dist_world.py: ``dist_staging:main`` with ``[OUT_DIR]``).

Each rank writes ``OUT_DIR/rank_R.json``: the bytes it staged against the whole, how many tensors it left
to the others, and whether the completed state equals the original bitwise (tied weights still one tensor).
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from multiproc import end_worker

from stabletrain.records.staging import StateStager, Withheld, fill_withheld


def main(argv: list[str]) -> None:
    """Stage, complete and compare under the default process group (already initialized)."""
    out = argv[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same state on every rank, as DDP keeps it
    emb = torch.nn.Embedding(50, 16)
    head = torch.nn.Linear(16, 50, bias=False)
    head.weight = emb.weight  # tied
    model = torch.nn.Sequential(emb, torch.nn.Linear(16, 64), torch.nn.Linear(64, 16), head)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.arange(8)).sum().backward()
    opt.step()
    state = {"model": model.state_dict(), "optimizer": opt.state_dict()["state"]}
    stager = StateStager()
    total = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in model.parameters()}.values())
    total += sum(t.numel() * t.element_size() for s in state["optimizer"].values() for t in s.values())
    staged, _ = stager.stage(state, share=(rank, world))
    withheld = sum(isinstance(v, Withheld) for v in staged["model"].values())
    mine = stager.num_bytes
    full = fill_withheld(staged)
    equal = all(torch.equal(full["model"][k], v) for k, v in state["model"].items()) and all(
        torch.equal(full["optimizer"][i][n], v) for i, s in state["optimizer"].items() for n, v in s.items())
    tied = full["model"]["0.weight"] is full["model"]["3.weight"]
    staged2, _ = stager.stage(state, share=(rank, world))  # the next interval reuses this rank's buffers
    reused = all(a is b for a, b in zip(staged2["model"].values(), staged["model"].values()) if isinstance(a, torch.Tensor))
    Path(out, f"rank_{rank}.json").write_text(json.dumps({"mine": mine, "total": total, "withheld": withheld,
                                                          "equal": equal, "tied": tied, "reused": reused}))


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(sys.argv[1:])
    end_worker()
