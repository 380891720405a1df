"""Running ranks on one machine: the device of each local rank, and `spawn` with a deadline.

`local_device()` is neuron:<LOCAL_RANK> when this process has that many logical NeuronCores
(TORCHNEURON_DEVICE_COUNT), else ranks share them round-robin. `spawn(fn, n)` runs `fn` as ranks
0..n-1 of a local job (env:// rendezvous on 127.0.0.1 and a free port, as torchrun sets up), returns
each rank's result, and never hangs: a failing rank or a missed deadline stops every rank and raises
with the failing rank's traceback.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable

import torch


def local_device() -> torch.device:
    """The neuron device of this process's local rank (LOCAL_RANK, default 0)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("neuron", local_rank % max(1, torch.neuron.device_count()))


def select_local_device() -> torch.device:
    """Makes `local_device()` current (what torchrun users otherwise do by hand); returns it."""
    device = local_device()
    torch.neuron.set_device(device.index)
    return device


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankFailed(RuntimeError):
    """A rank of a spawned job raised (the message holds its traceback) or the job missed its deadline."""


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, env: dict[str, str],
               threads: int, results: Any) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    os.environ.update(env)
    torch.set_num_threads(threads)
    try:
        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001  (reported to the parent, which raises it)
        results.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout: float = 120.0,
          env: dict[str, str] | None = None, threads: int | None = None) -> list[Any]:
    """Runs `fn(*args)` in `world_size` fresh processes (ranks 0..n-1) and returns their results in
    rank order. `fn` must be importable (module level) and return something picklable; each rank gets
    `threads` intra-op threads (default: the host's cores shared out). Raises RankFailed when a rank
    raises or dies, or when the job takes longer than `timeout` seconds; all ranks are stopped."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    threads = threads or max(1, (os.cpu_count() or 1) // world_size)
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(fn, rank, world_size, port, args, dict(env or {}), threads, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    outcome: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcome) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(processes) if r not in outcome and p.exitcode not in (None, 0)]
                if dead:
                    raise RankFailed(f"rank {dead[0]} exited with code {processes[dead[0]].exitcode} "
                                     f"before returning") from None
                if time.monotonic() > deadline:
                    missing = [r for r in range(world_size) if r not in outcome]
                    raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f} s") from None
                continue
            if not ok:
                raise RankFailed(f"rank {rank} failed:\n{value}")
            outcome[rank] = value
    finally:
        for process in processes:
            process.join(timeout=5 if len(outcome) == world_size else 0.5)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
        results.close()
    return [outcome[rank] for rank in range(world_size)]
