"""DDP on two neuron ranks against one rank training alone on the same per-rank batch.

Host: the 2-rank DDP step's wall time over the one-rank step's (goal: at most 1.3x). Both run in the
same rank processes, interleaved in rounds: first each rank steps its own copy of the model with no
communication (two ranks busy, as under DDP: on a small shared machine CPU contention would otherwise
dominate the ratio), then both step with DDP; medians over all rounds and ranks. Device: the modeled
step time on the target (trn2) for one rank alone, for DDP as scheduled (gradient buckets
all-reduced on the communication stream while backward continues), and for DDP with collectives
charged on the compute stream (no overlap).

    python bench/distributed.py [--width 512] [--depth 4] [--batch 256] [--buckets-mb 25 1] [--rounds 5]
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


def _model(width: int, depth: int, device: str = "neuron") -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 16)).to(device)


def _modeled_now() -> float:
    from torchneuron.hardware.timeline import get_timeline
    from torchneuron.hardware import worklog

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


def _job(width: int, depth: int, batch: int, buckets_mb: tuple[float, ...], rounds: int, steps: int,
         target: str) -> dict:
    import torchneuron
    from torchneuron.distributed.work import set_overlap
    from torchneuron.hardware import timeline

    torchneuron.set_target(target)
    dist.init_process_group("neuron")
    generator = torch.Generator().manual_seed(dist.get_rank())
    data = {"cpu": (torch.randn(batch, width, generator=generator), torch.randn(batch, 16, generator=generator))}
    data["neuron"] = tuple(t.to("neuron") for t in data["cpu"])
    gloo = dist.new_group(backend="gloo")
    runs = {"alone": _model(width, depth)}
    runs.update({mb: DistributedDataParallel(_model(width, depth), bucket_cap_mb=mb) for mb in buckets_mb})
    runs["cpu alone"] = _model(width, depth, "cpu")  # the host's own ceiling: stock DDP on CPU tensors over gloo
    runs["cpu gloo"] = DistributedDataParallel(_model(width, depth, "cpu"), process_group=gloo)
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=1e-3) for name, model in runs.items()}
    inputs = {name: data["cpu" if str(name).startswith("cpu") else "neuron"] for name in runs}
    for _ in range(3):  # warm up (DDP rebuilds its buckets after the first step)
        for name, model in runs.items():
            _step(model, optimizers[name], *inputs[name])
    comm: list[float] = []

    def on_entry(entry: timeline.TimelineEntry) -> None:
        if entry.name.startswith("c10d::"):
            comm.append(entry.duration_s)

    out: dict = {name: {"host": []} for name in runs}
    for _ in range(rounds):  # every rank runs every mode in turn: "alone" has no communication
        for name, model in runs.items():
            timeline.add_listener(on_entry)
            comm.clear()
            host, out[name]["device"] = _timed(model, optimizers[name], *inputs[name], steps)
            out[name]["comm"] = sum(comm) / steps
            timeline.remove_listener(on_entry)
            out[name]["host"] += host
            if name in buckets_mb:
                set_overlap(False)
                _, out[name]["serial"] = _timed(model, optimizers[name], *inputs[name], 1)
                set_overlap(True)
            dist.barrier()
    out["parameters"] = sum(p.numel() for p in runs["alone"].parameters())
    dist.destroy_process_group()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch", type=int, default=256, help="rows per rank")
    parser.add_argument("--buckets-mb", type=float, nargs="+", default=[25.0, 1.0],
                        help="DDP bucket caps to compare (25: DDP's default)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per round and mode")
    parser.add_argument("--target", default="trn2")
    args = parser.parse_args()
    with RankPool(2, threads=1) as pool:
        ranks = pool.run(_job, (args.width, args.depth, args.batch, tuple(args.buckets_mb), args.rounds, args.steps,
                                args.target), timeout=900)
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"torch {torch.__version__}, 2 rank processes with 1 intra-op thread each; "
          f"cross-rank checks {'on' if os.environ.get('TORCHNEURON_DIST_CHECKS', '1') != '0' else 'off'}")
    print(f"model: MLP {args.depth}x{args.width} ({ranks[0]['parameters'] / 1e6:.2f} M parameters), {args.batch} rows "
          f"per rank, SGD; medians of {args.rounds * args.steps} steps per rank")
    def host(name: object) -> float:
        return statistics.median(t for r in ranks for t in r[name]["host"])

    alone, alone_device = host("alone"), ranks[0]["alone"]["device"]
    print(f"{'':30}{'host step':>12}{'ratio':>8}   modeled {args.target} step: overlapped | serial | all-reduces")
    print(f"{'1 rank alone':30}{alone * 1e3:>9.2f} ms{1:>7.2f}x   {alone_device * 1e6:>10.1f} us")
    for mb in args.buckets_mb:
        overlapped, serial = (max(r[mb][key] for r in ranks) for key in ("device", "serial"))
        print(f"{f'2-rank DDP, {mb:g} MB buckets':30}{host(mb) * 1e3:>9.2f} ms{host(mb) / alone:>7.2f}x   "
              f"{overlapped * 1e6:>10.1f} us | {serial * 1e6:.1f} us | {ranks[0][mb]['comm'] * 1e6:.1f} us")
    print(f"{'CPU tensors: 1 rank alone':30}{host('cpu alone') * 1e3:>9.2f} ms{1:>7.2f}x")
    print(f"{'CPU tensors: 2-rank gloo DDP':30}{host('cpu gloo') * 1e3:>9.2f} ms"
          f"{host('cpu gloo') / host('cpu alone'):>7.2f}x   (stock PyTorch on this host, for reference)")
    print("goal: host ratio <= 1.3x. serial: collectives charged on the compute stream (no overlap)")


if __name__ == "__main__":
    main()
