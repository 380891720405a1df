"""DDP on two neuron ranks against one rank training alone on the same per-rank batch.

Host: the 2-rank DDP step's wall time over the one-rank step's (goal: at most 1.3x). Both run in the
same rank processes, interleaved in rounds: first each rank steps its own copy of the model with no
communication (two ranks busy, as under DDP: on a small shared machine CPU contention would otherwise
dominate the ratio), then both step with DDP; medians over all rounds and ranks. Device: the modeled
step time on the target (trn2) for one rank alone, for DDP as scheduled (gradient buckets
all-reduced on the communication stream while backward continues), and for DDP with collectives
charged on the compute stream (no overlap).

    python bench/distributed.py [--width 512] [--depth 4] [--batch 64] [--bucket-mb 1] [--rounds 6]
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from torchneuron.distributed import RankPool


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 16)).to("neuron")


def _modeled_now() -> float:
    from torchneuron.hardware.timeline import get_timeline
    from torchneuron.runtime import worklog

    torch.neuron.synchronize()
    worklog.drain()
    return get_timeline(torch.neuron.current_device()).synchronize()


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def _timed(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
           steps: int) -> tuple[list[float], float]:
    """Host seconds of each step, and the modeled device seconds of the last one."""
    host = []
    for _ in range(steps):
        device_start = _modeled_now()
        start = time.perf_counter()
        _step(model, optimizer, x, y)
        host.append(time.perf_counter() - start)
        device = _modeled_now() - device_start
    return host, device


def _job(width: int, depth: int, batch: int, bucket_mb: float, rounds: int, steps: int, target: str) -> dict:
    import torchneuron
    from torchneuron.distributed.work import set_overlap
    from torchneuron.hardware import timeline

    torchneuron.set_target(target)
    dist.init_process_group("neuron")
    rank = dist.get_rank()
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(batch, width, generator=generator).to("neuron")
    y = torch.randn(batch, 16, generator=generator).to("neuron")
    alone = _model(width, depth)
    alone_optimizer = torch.optim.SGD(alone.parameters(), lr=1e-3)
    ddp = DistributedDataParallel(_model(width, depth), bucket_cap_mb=bucket_mb)
    ddp_optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    for _ in range(3):  # warm up (DDP rebuilds its buckets after the first step)
        _step(ddp, ddp_optimizer, x, y)
        _step(alone, alone_optimizer, x, y)
    comm: list[float] = []

    def on_entry(entry: timeline.TimelineEntry) -> None:
        if entry.name.startswith("c10d::"):
            comm.append(entry.duration_s)

    out: dict = {"alone": [], "ddp": []}
    for _ in range(rounds):
        host, out["alone_device"] = _timed(alone, alone_optimizer, x, y, steps)  # both ranks, no communication
        out["alone"] += host
        dist.barrier()
        timeline.add_listener(on_entry)
        comm.clear()
        host, out["ddp_device"] = _timed(ddp, ddp_optimizer, x, y, 1)
        out["comm_device"] = sum(comm)
        timeline.remove_listener(on_entry)
        set_overlap(False)
        _, out["ddp_serial_device"] = _timed(ddp, ddp_optimizer, x, y, 1)
        set_overlap(True)
        more, _ = _timed(ddp, ddp_optimizer, x, y, steps - 1)
        out["ddp"] += host + more
        dist.barrier()
    out["parameters"] = sum(p.numel() for p in alone.parameters())
    out["buckets"] = ddp._get_ddp_logging_data().get("num_buckets_reduced", None)
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per round and mode")
    parser.add_argument("--target", default="trn2")
    args = parser.parse_args()
    with RankPool(2, threads=1) as pool:
        ranks = pool.run(_job, (args.width, args.depth, args.batch, args.bucket_mb, args.rounds, args.steps,
                                args.target), timeout=600)
    first = ranks[0]
    alone = statistics.median(t for r in ranks for t in r["alone"])
    ddp = statistics.median(t for r in ranks for t in r["ddp"])
    compute = first["alone_device"]
    overlapped = max(r["ddp_device"] for r in ranks)
    serial = max(r["ddp_serial_device"] for r in ranks)
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"torch {torch.__version__}, 1 intra-op thread per rank")
    print(f"model: MLP {args.depth}x{args.width} ({first['parameters'] / 1e6:.2f} M parameters), {args.batch} rows "
          f"per rank, DDP buckets of {args.bucket_mb} MB")
    print(f"host step:  1 rank alone {alone * 1e3:.2f} ms | 2-rank DDP {ddp * 1e3:.2f} ms | "
          f"ratio {ddp / alone:.2f}x (goal <= 1.3x)")
    print(f"modeled {args.target} step: 1 rank alone {compute * 1e6:.1f} us | 2-rank DDP with overlap "
          f"{overlapped * 1e6:.1f} us | without overlap {serial * 1e6:.1f} us "
          f"(all-reduces {first['comm_device'] * 1e6:.1f} us, {(serial - overlapped) * 1e6:.1f} us of them hidden)")


if __name__ == "__main__":
    main()
