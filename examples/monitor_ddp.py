"""stabletrain.Monitor around your own DistributedDataParallel loop, on two processes.

    torchrun --standalone --nproc_per_node=2 examples/monitor_ddp.py

Every rank builds its Monitor around the DDP model; rank 0 writes runs/ddp-loop. A NaN in one rank's
batch (planted at step 7 on rank 1) is skipped on both ranks: the verdict reaches every rank through the
gradients, without a collective of stabletrain's own, and the incident names the rank and the sample.
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import stabletrain


def loss_fn(model, batch):  # module level: `stabletrain diagnose` can replay it in a new process too
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def main():
    dist.init_process_group("gloo")  # "nccl" on GPUs
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    loader = [(torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)) for _ in range(30)]
    if rank == 1:
        loader[6][0][5, 0] = float("nan")  # a bad sample on rank 1 at step 7
    with stabletrain.Monitor(model, optimizer, run_dir="runs/ddp-loop", loss_fn=loss_fn, overwrite=True) as monitor:
        for batch in loader:
            loss = loss_fn(model, batch)
            monitor.backward(loss, batch)
            monitor.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
