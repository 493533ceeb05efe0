"""The incident snapshot at scale, on paper: host memory and copy time per log interval, from the sizes alone.

The snapshot (``capture.memory_snapshot``) copies the training state into host buffers at every log interval's
start. Its size per rank comes from the parameter count and the optimizer state, and from how the strategy
spreads it over the ranks:

    state           params x (4 + optimizer bytes per parameter): fp32 parameters and, for AdamW, two fp32
                    moments (8 bytes; ``--optimizer-bytes``). Gradients are not in it.
    DDP             every rank holds the whole state; each snapshots its 1/world share of it (the capture
                    completes it with one broadcast per tensor), so per rank: state / world
    FSDP2           every rank holds its shards and snapshots them: state / world
    host (node)     the ranks on one node (``--gpus-per-node``) together: per rank x gpus per node
    copy            per rank, device to pinned host memory at ``--bandwidth-gbs`` GB/s (an assumption: PCIe
                    Gen5 x16 reaches ~50 GB/s one way, and a node's GPUs share its host links and memory
                    bandwidth; 20 GB/s per GPU is the planning figure). On CUDA it runs on a side stream
                    while the step's forward and backward run; the optimizer step waits for it.
    per step        the copy time / ``--log-every``: what a step would pay if nothing overlapped it
    auto            capture.memory_snapshot=auto on a node with ``--host-gib`` of available memory (one column
                    each) and capture.snapshot_memory_fraction=``--fraction``: on when the node's snapshots fit
    fits a GPU      whether training fits a ``--gpu-gib`` device at all: DDP holds params + grads + optimizer
                    state whole on each GPU (16 bytes/param with AdamW); FSDP2 holds 1/world of it (plus
                    activations and the gathered blocks, not counted)

    python bench/snapshot_scale.py                  # the table in docs/nan-inf.md
    python bench/snapshot_scale.py --bandwidth-gbs 10 --host-gib 1024 --log-every 50
"""

from __future__ import annotations

import argparse

MODELS = {"125M": 125e6, "1.3B": 1.3e9, "7B": 7e9, "70B": 70e9}
WORLDS = (8, 64)
STRATEGIES = ("ddp", "fsdp")
GB = 1e9


def rows(args: argparse.Namespace) -> list[dict[str, object]]:
    """One row per (model, world size, strategy): the figures of the module docstring."""
    out = []
    for name, params in MODELS.items():
        state = params * (4 + args.optimizer_bytes)
        for world in WORLDS:
            for strategy in STRATEGIES:
                per_rank = state / world  # DDP: this rank's share; FSDP2: its shards
                node = per_rank * min(args.gpus_per_node, world)
                copy_s = per_rank / (args.bandwidth_gbs * GB)
                on_gpu = params * (4 + 4 + args.optimizer_bytes) / (world if strategy == "fsdp" else 1)
                out.append({
                    "model": name, "world": world, "strategy": strategy, "state_gb": state / GB,
                    "per_rank_gb": per_rank / GB, "node_gb": node / GB, "copy_ms": copy_s * 1e3,
                    "per_step_ms": copy_s * 1e3 / args.log_every,
                    "auto": [node <= args.fraction * host * 2 ** 30 for host in args.host_gib],
                    "fits_gpu": on_gpu <= args.gpu_gib * 2 ** 30, "on_gpu_gb": on_gpu / GB,
                })
    return out


def table(args: argparse.Namespace) -> str:
    autos = [f"auto, {host:g} GiB node" for host in args.host_gib]
    lines = [f"| model | GPUs | strategy | state | host per rank | host per node ({args.gpus_per_node} GPUs) | "
             f"copy per interval | per step (log.every={args.log_every}) | " + " | ".join(autos) + " |",
             "|---" * (8 + len(autos)) + "|"]
    for r in rows(args):
        head = f"| {r['model']} | {r['world']} | {'DDP' if r['strategy'] == 'ddp' else 'FSDP2'} | {r['state_gb']:.1f} GB | "
        if not r["fits_gpu"]:
            lines.append(head + f"training does not fit a {args.gpu_gib:g} GiB GPU ({r['on_gpu_gb']:.0f} GB of params + "
                         "grads + optimizer per GPU) |" + " |" * (3 + len(autos)))
            continue
        lines.append(head + f"{r['per_rank_gb']:.2f} GB | {r['node_gb']:.1f} GB | {r['copy_ms']:.0f} ms | "
                     f"{r['per_step_ms']:.1f} ms | " + " | ".join("on" if a else "off" for a in r["auto"]) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--optimizer-bytes", type=float, default=8.0, help="optimizer state bytes per parameter (AdamW fp32: 8)")
    ap.add_argument("--bandwidth-gbs", type=float, default=20.0, help="device-to-host copy bandwidth per GPU, GB/s")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--host-gib", type=float, nargs="+", default=[256.0, 2048.0],
                    help="host memory available per node at start, GiB (one auto column each)")
    ap.add_argument("--fraction", type=float, default=0.25, help="capture.snapshot_memory_fraction")
    ap.add_argument("--gpu-gib", type=float, default=80.0, help="device memory per GPU, GiB")
    ap.add_argument("--log-every", type=int, default=10)
    args = ap.parse_args()
    print(f"state = params x (4 + {args.optimizer_bytes:g}) bytes; copy at {args.bandwidth_gbs:g} GB/s per GPU "
          f"(assumed); {args.gpus_per_node} GPUs per node; auto: capture.snapshot_memory_fraction={args.fraction:g}")
    print()
    print(table(args))


if __name__ == "__main__":
    main()
