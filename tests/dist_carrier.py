"""A torchrun worker: one DDP step whose window numbers travel with the gradients, in a given parameter dtype.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_carrier.py DTYPE OUT.json

Rank 0 of 12 samples holds 7, rank 1 holds 5 (unequal counts). Rank 0 writes the window's global count and
mean loss and the largest gradient error against one process on all 12 samples. float32/float64 buckets
carry the numbers appended to bucket 0; a low-precision bucket sends them in a second, concurrent all-reduce.
"""

import json
import sys

import torch
import torch.distributed as dist

from stabletrain.accumulation import AccumulationWindow
from stabletrain.distributed import register_grad_flag


def main(dtype_name: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)
    reference.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    flag = register_grad_flag(ddp, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(12, 4, generator=g).to(dtype), torch.randn(12, 1, generator=g).to(dtype)
    mine = list(range(0, 7)) if rank == 0 else list(range(7, 12))
    window = AccumulationWindow(list(model.parameters()))
    flag.reset()
    window.begin()
    loss_sum = ((ddp(x[mine]) - y[mine]) ** 2).sum().float()
    window.normalize(loss_sum, torch.tensor(float(len(mine))), last=True, carrier=flag).backward()
    grads = [p.grad.float() * window.grad_scale for p in model.parameters()]
    (((reference(x) - y) ** 2).sum().float() / 12).backward()
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"count": float(window.global_count), "mean_loss": float(window.mean_loss),
                       "reference_loss": float(((reference(x) - y) ** 2).float().mean()),
                       "grad_err": max(float((a - p.grad.float()).abs().max()) for a, p in zip(grads, reference.parameters())),
                       "grad_scale": max(float(p.grad.float().abs().max()) for p in reference.parameters())}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
