"""A torchrun worker: DDP windows whose numbers travel with the gradients, one way, in a given parameter dtype.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/dist_carrier.py WAY DTYPE OUT.json

or as scenarios of a shared world (tests/dist_world.py: ``dist_carrier:main`` with ``[WAY, DTYPE, OUT.json]``).

WAY: ``param`` (stabletrain.distributed.carrier.data_parallel with a window of raw sums: the numbers ride a
parameter of DDP's own, or the comm hook where the model has no float32/float64 parameter), ``hook``
(register_carrier_hook, raw sums) or ``hook-scaled`` (register_carrier_hook, a window normalized by its
running count, as with a GradScaler). Two windows of two micro-batches (no_sync on the first); rank 0
holds 7 of the 12 samples (4 + 3), rank 1 holds 5 (3 + 2): unequal counts. Rank 0 writes, per window,
the global count and mean loss and the largest gradient error against one process on all 12 samples.
"""

import json
import sys

import torch
import torch.distributed as dist
from multiproc import end_worker

from stabletrain.distributed.carrier import data_parallel, register_carrier_hook
from stabletrain.policies.accumulation import AccumulationWindow


def main(argv: list[str]) -> None:
    """Run one WAY and DTYPE under the default process group (already initialized); rank 0 writes OUT.json."""
    way, dtype_name, out = argv
    rank = dist.get_rank()
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(dtype)
    reference.load_state_dict(model.state_dict())
    names = [n for n, _ in model.named_parameters()]
    if way == "param":
        ddp, carrier = data_parallel(model, None, sums=True)
    else:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        carrier = register_carrier_hook(ddp)
    g = torch.Generator().manual_seed(1)
    results = []
    for _ in range(2):
        x, y = torch.randn(12, 4, generator=g).to(dtype), torch.randn(12, 1, generator=g).to(dtype)
        micro = [[0, 1, 2, 3], [4, 5, 6]] if rank == 0 else [[7, 8, 9], [10, 11]]
        window = AccumulationWindow(list(model.parameters()), sums=way != "hook-scaled")
        for p in model.parameters():
            p.grad = None
        carrier.reset()
        window.begin()
        for i, mine in enumerate(micro):
            last = i == len(micro) - 1
            with (ddp.no_sync() if not last else torch.enable_grad()):
                loss_sum = ((ddp(x[mine]) - y[mine]) ** 2).sum().float()
            window.normalize(loss_sum, torch.tensor(float(len(mine))), last=last, carrier=carrier).backward()
        scale = window.grad_scale if window.grad_scale is not None else 1.0
        grads = [p.grad.float() * scale for p in model.parameters()]
        for p in reference.parameters():
            p.grad = None
        (((reference(x) - y) ** 2).sum().float() / 12).backward()
        results.append({"count": float(window.global_count), "mean_loss": float(window.mean_loss),
                        "reference_loss": float(((reference(x) - y) ** 2).float().mean()),
                        "grad_err": max(float((a - p.grad.float()).abs().max()) for a, p in zip(grads, reference.parameters())),
                        "grad_scale": max(float(p.grad.float().abs().max()) for p in reference.parameters()),
                        "names": [n for n, _ in model.named_parameters()] == names and len(model.state_dict()) == 4,
                        "rides_a_param": carrier.param is not None})
    if rank == 0:
        with open(out, "w") as fh:
            json.dump(results, fh)


if __name__ == "__main__":
    dist.init_process_group("gloo")
    main(sys.argv[1:])
    end_worker()
