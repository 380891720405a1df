"""Running ranks on one machine: the device of each local rank, `spawn` and `RankPool` with deadlines.

`local_device()` is neuron:<LOCAL_RANK> when this process has that many logical NeuronCores
(TORCHNEURON_DEVICE_COUNT), else ranks share them round-robin. `spawn(fn, n)` runs `fn` as ranks
0..n-1 of a local job (env:// rendezvous on 127.0.0.1 and a free port, as torchrun sets up), returns
each rank's result, and never hangs: a failing rank or a missed deadline stops every rank and raises
with the failing rank's traceback. `RankPool(n).run(fn)` does the same on ranks kept alive between
jobs (tests and benchmarks pay each rank's `import torch` once).
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
    """A rank of a job raised (the message holds its traceback), died, or the job missed its deadline."""


def _job_env(rank: int, world_size: int, port: int, env: dict[str, str]) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size)})
    os.environ.update(env)


def _run_job(job: int, rank: int, fn: Callable[..., Any], args: tuple, results: Any) -> None:
    try:
        results.put((job, rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001  (reported to the parent, which raises it)
        results.put((job, rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _rank_main(fn: Callable[..., Any], rank: int, world_size: int, port: int, args: tuple, env: dict[str, str],
               threads: int, results: Any) -> None:
    _job_env(rank, world_size, port, env)
    torch.set_num_threads(threads)
    _run_job(0, rank, fn, args, results)
    results.close()
    results.join_thread()  # the result is in the pipe: skip the interpreter's slow teardown
    os._exit(0)


def _next_task(tasks: Any, parent: int) -> Any:
    """The next job, or None to stop (asked to, or orphaned: the parent died without asking)."""
    while os.getppid() == parent:
        try:
            return tasks.get(timeout=2.0)
        except queue_module.Empty:
            continue
    return None


def _pool_main(rank: int, world_size: int, tasks: Any, results: Any, threads: int) -> None:
    torch.set_num_threads(threads)
    base, parent = dict(os.environ), os.getppid()
    while (task := _next_task(tasks, parent)) is not None:
        job, fn, args, port, env = task
        _job_env(rank, world_size, port, env)
        _run_job(job, rank, fn, args, results)
        os.environ.clear()  # a job's environment does not leak into the next
        os.environ.update(base)


def _collect(job: int, processes: list, results: Any, timeout: float, allow_exit: bool = False) -> list[Any]:
    """Results of `job` from every rank, in rank order; RankFailed on a failure, a death or the deadline."""
    world_size = len(processes)
    outcome: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(outcome) < world_size:
        try:
            tag, rank, ok, value = results.get(timeout=0.2)
        except queue_module.Empty:
            dead = [r for r, p in enumerate(processes) if r not in outcome and p.exitcode not in (None, 0)]
            if dead and not allow_exit:
                raise RankFailed(f"rank {dead[0]} exited with code {processes[dead[0]].exitcode} before returning")
            outcome.update(dict.fromkeys(dead))
            if time.monotonic() > deadline:
                missing = [r for r in range(world_size) if r not in outcome]
                raise RankFailed(f"ranks {missing} did not finish within {timeout:.0f} s") from None
            continue
        if tag != job:
            continue
        if not ok:
            raise RankFailed(f"rank {rank} failed:\n{value}")
        outcome[rank] = value
    return [outcome[rank] for rank in range(world_size)]


def _stop(processes: list, grace: float) -> None:
    for process in processes:
        process.join(timeout=grace)
        if process.is_alive():
            process.kill()
            process.join(timeout=5)


def _threads(world_size: int, threads: int | None) -> int:
    return threads or max(1, (os.cpu_count() or 1) // world_size)


def spawn(fn: Callable[..., Any], world_size: int, args: tuple = (), *, timeout: float = 120.0,
          env: dict[str, str] | None = None, threads: int | None = None, allow_exit: bool = False) -> list[Any]:
    """Runs `fn(*args)` in `world_size` fresh processes (ranks 0..n-1) and returns their results in
    rank order. `fn` must be importable (module level) and return something picklable; each rank gets
    `threads` intra-op threads (default: the host's cores shared out). Raises RankFailed when a rank
    raises or dies (with `allow_exit`, a rank that exits gives None instead), or when the job takes
    longer than `timeout` seconds; all ranks are stopped."""
    context = mp.get_context("spawn")
    results = context.Queue()
    port, threads = free_port(), _threads(world_size, threads)
    processes = [context.Process(target=_rank_main, daemon=True,
                                 args=(fn, rank, world_size, port, args, dict(env or {}), threads, results))
                 for rank in range(world_size)]
    for process in processes:
        process.start()
    try:
        return _collect(0, processes, results, timeout, allow_exit)
    finally:
        _stop(processes, grace=5)


class RankPool:
    """`world_size` rank processes kept alive between jobs, so each job skips the seconds of
    `import torch` per rank. `run()` is `spawn()` on the pool: a job gets its own rendezvous port
    (and should create and destroy its process group; a left-over one is destroyed). A failed or
    late job stops the pool; the next `run()` starts a fresh one."""

    def __init__(self, world_size: int, threads: int | None = None):
        self.world_size = world_size
        self._threads = _threads(world_size, threads)
        self._processes: list = []
        self._job = 0

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self._results = context.Queue()
        self._tasks = [context.Queue() for _ in range(self.world_size)]
        self._processes = [
            context.Process(target=_pool_main, daemon=True,
                            args=(rank, self.world_size, self._tasks[rank], self._results, self._threads))
            for rank in range(self.world_size)]
        for process in self._processes:
            process.start()

    def run(self, fn: Callable[..., Any], args: tuple = (), *, timeout: float = 120.0,
            env: dict[str, str] | None = None) -> list[Any]:
        if not self._processes or any(not p.is_alive() for p in self._processes):
            self.close()
            self._start()
        self._job += 1
        port = free_port()
        for tasks in self._tasks:
            tasks.put((self._job, fn, args, port, dict(env or {})))
        try:
            return _collect(self._job, self._processes, self._results, timeout)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stops the rank processes (idempotent)."""
        if not self._processes:
            return
        for tasks, process in zip(self._tasks, self._processes):
            if process.is_alive():
                tasks.put(None)
        _stop(self._processes, grace=2)
        self._processes = []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
