"""Kernel entry points: `nki.jit`, SPMD grids, `simulate_kernel`, `baremetal`, `benchmark`,
`profile`.

Owns the life of one kernel call: wrap the caller's arrays as HBM tensors (zero-copy for
reads, staged on first write), run the kernel body once per SPMD instance inside a `Run`,
turn failures into errors that carry the kernel's file and line (how the programs run and
meet at collectives is programs.py's), commit staged outputs
only on success, and return results in the caller's array type. Modeled latency and
per-engine utilisation of the last call are kept on the kernel (`kernel.last_stats`).
"""
from __future__ import annotations

import functools
import gc
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from .. import settings
from ..hardware.targets import TARGETS, Target, get_target
from . import dtypes as _dt
from .errors import DTypeError, KernelError, NKIError, traceback_location
from .on_device import call_on_device, has_neuron_tensors
from .programs import NeedsCooperative, make_programs
from .scheduler import Scheduler
from .simulator import Run, set_current, active
from .tile import Buffer, Tile
from .typing import TensorType


@dataclass
class KernelStats:
    """What one simulated kernel call cost on the modeled NeuronCore."""

    target: str
    latency_s: float
    instructions: int
    engine_busy_s: dict = field(default_factory=dict)
    engine_instructions: dict = field(default_factory=dict)
    sbuf_peak_bytes: int = 0
    psum_peak_bytes: int = 0
    trace: list = field(default_factory=list)
    flops: float = 0.0
    hbm_bytes: float = 0.0
    psum_spill_bytes: int = 0  # bytes a partition of PSUM tiles the allocator moved to SBUF

    @property
    def latency_us(self) -> float:
        return self.latency_s * 1e6

    @property
    def utilisation(self) -> dict:
        span = self.latency_s or 1.0
        return {e: b / span for e, b in self.engine_busy_s.items()}


def _target(platform_target: str | None) -> Target:
    """jit(platform_target=...) > $NEURON_PLATFORM_TARGET_OVERRIDE, read per call as NKI does
    (unless $TORCHNEURON_TARGET is set, which the process target already honours) > the
    process target (`torchneuron.set_target` / $TORCHNEURON_TARGET)."""
    config = settings.current()
    name = platform_target or (None if config.target else config.platform_target_override)
    if name:
        name = str(name).lower().replace("gen2", "trn1").replace("gen3", "trn2").replace("gen4", "trn3")
        if name not in TARGETS:
            raise ValueError(f"unknown Neuron target {name!r}; supported: {', '.join(TARGETS)}")
        return TARGETS[name]
    return get_target()


class Kernel:
    """A `@nki.jit` kernel. Call it with torch tensors, numpy arrays, neuron tensors or
    `nt.tensor` placeholders; index it with a launch grid for SPMD: `kernel[2, 4](a, b)`."""

    def __init__(self, fn: Callable, *, grid: tuple = (), platform_target: str | None = None,
                 **options: Any):
        self.fn = fn
        self.grid = grid
        self.platform_target = platform_target
        self.options = options
        self.last_stats: KernelStats | None = None
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: Any) -> "Kernel":
        grid = grid if isinstance(grid, tuple) else (grid,)
        k = Kernel(self.fn, grid=grid, platform_target=self.platform_target, **self.options)
        k._parent = self
        return k

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if active() is not None:  # a kernel calling a kernel: plain function call
            return self.fn(*args, **kwargs)
        if has_neuron_tensors(args, kwargs):
            return call_on_device(self, args, kwargs)
        out, stats = self.run(args, kwargs)
        return out

    # ------------------------------------------------------------------------------------
    def run(self, args: tuple, kwargs: dict, *, trace: bool = False,
            target: Target | None = None) -> tuple[Any, KernelStats]:
        """Simulate one call; returns (outputs in the caller's array type, KernelStats)."""
        results, stats = self._run_calls([(tuple(args), dict(kwargs))], trace, target)
        return results[-1], stats

    def run_ranks(self, calls: list[tuple[tuple, dict]], *, trace: bool = False,
                  target: Target | None = None) -> tuple[list, KernelStats]:
        """Simulate a multi-rank launch: rank r calls the kernel with `calls[r]` (args, kwargs),
        its own inputs and its own shared HBM, on its own NeuronCore; the ranks meet at
        `nki.collectives`. Returns (each rank's outputs, KernelStats of the whole launch)."""
        if self.grid:
            raise NKIError(f"a multi-rank launch runs one program per rank; launch the kernel "
                           f"without a grid (got grid {self.grid})", rule="spmd")
        return self._run_calls([(tuple(a), dict(k)) for a, k in calls], trace, target)

    def _run_calls(self, calls: list, trace: bool, target: Target | None) -> tuple[list, KernelStats]:
        """Programs run one after another until a collective spans several of them; then the
        launch restarts with the programs as cooperating threads (programs.py), and this
        kernel keeps launching that way."""
        root = getattr(self, "_parent", self)
        if not getattr(root, "_cooperative", False):
            try:
                return self._launch(calls, trace, target, cooperative=False)
            except NeedsCooperative:
                root._cooperative = True  # nothing was committed: the caller's tensors are intact
        return self._launch(calls, trace, target, cooperative=True)

    def _launch(self, calls: list, trace: bool, target: Target | None,
                cooperative: bool) -> tuple[list, KernelStats]:
        values = [v for args, kwargs in calls for v in itertools.chain(args, kwargs.values())]
        timing_only = any(isinstance(a, TensorType) for a in values)
        run = Run(target or _target(self.platform_target), compute=not timing_only, trace=trace)
        want_numpy = any(isinstance(a, np.ndarray) for a in values)
        calls = [([self._wrap(run, a) for a in args], {k: self._wrap(run, v) for k, v in kwargs.items()})
                 for args, kwargs in calls]
        grid = tuple(int(g) for g in self.grid) or (1,)
        ncores = 1
        for g in self.grid:
            if hasattr(g, "n") and not isinstance(g, int):
                ncores = max(ncores, g.n)
        # A launch whose programs meet at collectives runs one rank per NeuronCore (AWS's ranks
        # are NeuronCores): each program gets its own engines' timeline.
        programs = len(calls) if len(calls) > 1 else int(np.prod(grid))
        timelines = max(ncores, programs) if cooperative or len(calls) > 1 else ncores
        scheds = [run.sched] + [Scheduler(keep_trace=trace) for _ in range(timelines - 1)]
        run.ncores = ncores
        set_current(run)
        results: list = []
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # whole-tile ops are small: thread wake-ups would dominate
        gc_was_on = gc.isenabled()
        gc.disable()  # tiles and access records form no cycles; collections only cost time here
        try:
            run.grid = grid if self.grid else ()
            run.programs = make_programs(run, run.grid, scheds, cooperative, calls)
            results = run.programs.run_all(lambda p: self.fn(*p.call[0], **p.call[1]))
        except NKIError:
            raise
        except Exception as e:  # the kernel's own code failed: name its line
            raise KernelError(f"kernel {self.fn.__name__} raised {type(e).__name__}: {e}",
                              location=traceback_location(e.__traceback__)) from e
        finally:
            set_current(None)
            torch.set_num_threads(threads)
            if gc_was_on:
                gc.enable()
        latency = max(s.makespan for s in scheds)
        busy: dict = {}
        counts: dict = {}
        for s in scheds:
            for k, v in s.busy.items():
                busy[k] = busy.get(k, 0.0) + v / len(scheds)
            for k, v in s.counts.items():
                counts[k] = counts.get(k, 0) + v
        pools = [p.pools for p in run.programs.programs if p.pools] or [(run.sbuf, run.psum)]
        stats = KernelStats(run.target.name, latency, run.instructions, busy, counts,
                            max(sb.peak for sb, _ in pools), max(ps.peak for _, ps in pools),
                            [r for s in scheds for r in s.trace], run.flops, run.hbm_bytes,
                            sum(ps.spill_total for _, ps in pools))
        self.last_stats = stats
        parent = getattr(self, "_parent", None)
        if parent is not None:
            parent.last_stats = stats
        # commit staged writes to the caller's tensors only now that the kernel succeeded
        if run.compute:
            for buf in run.inputs:
                if buf.staged:
                    buf.orig.copy_(buf.data.view(buf.orig.shape) if buf.orig.is_contiguous()
                                   else buf.data)
        returned = results if len(calls) > 1 else results[-1:]  # a grid returns its last program's
        return [self._unwrap(r, want_numpy, run) for r in returned], stats

    # ------------------------------------------------------------------------------------
    def _wrap(self, run: Run, a: Any) -> Any:
        if isinstance(a, TensorType):
            return Tile.whole(Buffer("hbm", a.shape, _dt.to_torch(a.dtype), None, 0, "input"))
        if isinstance(a, np.ndarray):
            name = a.dtype.name
            if name in ("bfloat16", "float8_e4m3fn", "float8_e4m3", "float8_e5m2"):  # ml_dtypes
                raw = torch.from_numpy(a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8))
                t = raw.view(_dt.to_torch("float8_e4m3fn" if name == "float8_e4m3" else name))
            else:
                t = torch.from_numpy(a)
            return self._wrap_tensor(run, t)
        if isinstance(a, torch.Tensor):
            return self._wrap_tensor(run, a)
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, (np.ndarray, torch.Tensor)) for x in a):
            return type(a)(self._wrap(run, x) for x in a)
        return a

    def _wrap_tensor(self, run: Run, t: torch.Tensor) -> Tile:
        if t.device.type != "cpu":
            raise NKIError(f"kernel inputs must be CPU, numpy or neuron tensors, got {t.device}",
                           rule="inputs")
        if t.dtype == torch.float64:
            raise DTypeError("float64 input: float64 is not a hardware type on Trainium; "
                             "cast to float32 (or bfloat16) before calling the kernel")
        t = t.detach()
        data = t if t.is_contiguous() else t.contiguous()
        buf = Buffer("hbm", tuple(t.shape), t.dtype, data, 0, "input", orig=t)
        if data is not t:
            buf.staged = True  # already a private copy
        run.inputs.append(buf)
        return Tile.whole(buf)

    def _unwrap(self, result: Any, want_numpy: bool, run: Run) -> Any:
        if isinstance(result, Tile):
            if not run.compute:  # timing-only: outputs are placeholders of their shape and dtype
                return TensorType(result.shape, result.dtype)
            t = result.torch()
            if result.buf.orig is not None and result.is_whole:
                t = result.buf.orig
            elif not result.is_whole:
                t = t.clone()
            if want_numpy:
                nd = _dt.numpy_dtype(t.dtype)
                if nd is None:
                    return t
                if t.dtype == torch.bfloat16 or "float8" in str(t.dtype):
                    return t.view(torch.uint8 if t.dtype.itemsize == 1 else torch.int16).numpy().view(nd)
                return t.numpy()
            return t
        if isinstance(result, (list, tuple)):
            return type(result)(self._unwrap(r, want_numpy, run) for r in result)
        if isinstance(result, dict):
            return {k: self._unwrap(v, want_numpy, run) for k, v in result.items()}
        return result


def jit(fn: Callable | None = None, *, mode: str = "auto", platform_target: str | None = None,
        **options: Any) -> Any:
    """Decorator: `@nki.jit` or `@nki.jit(platform_target="trn2", ...)`."""
    if fn is None:
        return lambda f: jit(f, mode=mode, platform_target=platform_target, **options)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, platform_target=platform_target, **options)


def _as_kernel(kernel: Any) -> Kernel:
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)


def simulate_kernel(kernel: Any, *args: Any, **kwargs: Any) -> Any:
    """Run a kernel on host arrays and return its outputs (NKI's CPU simulation entry point)."""
    out, _ = _as_kernel(kernel).run(args, kwargs)
    return out


def simulate_ranks(kernel: Any, inputs: list) -> list:
    """Run `kernel` as the ranks of one collective launch (AWS: one process per NeuronCore, each
    with its own inputs): rank r gets `inputs[r]`, a dict of keyword arguments or a tuple of
    positional ones. Returns each rank's outputs; `kernel.last_stats` covers the launch."""
    calls = [((), dict(x)) if isinstance(x, dict) else (tuple(x), {}) for x in inputs]
    if not calls:
        raise NKIError("simulate_ranks: give one input set per rank (a list of dicts or tuples)",
                       rule="spmd")
    k = _as_kernel(kernel)
    outs, _ = k.run_ranks(calls)
    if k is not kernel and isinstance(kernel, Kernel):
        kernel.last_stats = k.last_stats
    return outs


def simulate(kernel: Any = None, **options: Any) -> Any:
    """`nki.simulate(kernel)(*args)` / `nki.simulate(kernel, *args)` forms."""
    k = _as_kernel(kernel)
    return lambda *a, **kw: simulate_kernel(k, *a, **kw)


def baremetal(kernel: Any = None, **options: Any) -> Any:
    """Run on the (software) NeuronCore directly with host arrays; decorator or wrapper."""
    if kernel is None:
        return lambda f: baremetal(f, **options)
    return _as_kernel(kernel) if not isinstance(kernel, Kernel) else kernel


class LatencyResult:
    """Modeled latencies of the benchmark iterations, in microseconds (as NKI reports)."""

    def __init__(self, samples_us: list[float]):
        self.samples_us = samples_us

    def get_latency_percentile(self, percentile: float) -> float:
        return float(np.percentile(np.asarray(self.samples_us), percentile))

    def __repr__(self) -> str:
        return f"LatencyResult(p50={self.get_latency_percentile(50):.3f} us)"


@dataclass
class BenchmarkResult:
    nc_latency: LatencyResult
    stats: KernelStats
    host_wall_s: float


class BenchmarkKernel:
    """`nki.benchmark(...)(kernel)`: calling it simulates the kernel (timing only when given
    placeholders) and fills `benchmark_result.nc_latency` with the modeled latency: the
    kernel's makespan on the NeuronCore's engines, without the host's launch cost (which
    the PyTorch bridge adds when it charges a kernel to the device timeline)."""

    def __init__(self, kernel: Kernel, warmup: int = 2, iters: int = 10, **options: Any):
        self.kernel, self.warmup, self.iters, self.options = kernel, warmup, iters, options
        self.benchmark_result: BenchmarkResult | None = None
        functools.update_wrapper(self, kernel.fn)

    def __getitem__(self, grid: Any) -> "BenchmarkKernel":
        return BenchmarkKernel(self.kernel[grid], self.warmup, self.iters, **self.options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out, stats = self.kernel.run(args, kwargs)
        wall = time.perf_counter() - t0
        # The model is deterministic: every iteration has the same modeled latency.
        samples = [stats.latency_us] * max(1, int(self.iters))
        self.benchmark_result = BenchmarkResult(LatencyResult(samples), stats, wall)
        return out


def benchmark(kernel: Any = None, *, warmup: int = 2, iters: int = 10, **options: Any) -> Any:
    """`nki.benchmark(warmup=5, iters=10)(kernel)` or `nki.benchmark(kernel, ...)`."""
    if kernel is None:
        return lambda k: BenchmarkKernel(_as_kernel(k), warmup, iters, **options)
    return BenchmarkKernel(_as_kernel(kernel), warmup, iters, **options)


class ProfileKernel:
    """`nki.profile(working_directory=...)(kernel)`: runs the kernel with an instruction
    trace and writes it as a Chrome trace (`<save_trace_name>.json`) plus a summary."""

    def __init__(self, kernel: Kernel, working_directory: str = ".", save_trace_name: str = "profile.ntff",
                 **options: Any):
        self.kernel, self.dir, self.name = kernel, working_directory, save_trace_name
        self.stats: KernelStats | None = None

    def __getitem__(self, grid: Any) -> "ProfileKernel":
        return ProfileKernel(self.kernel[grid], self.dir, self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out, stats = self.kernel.run(args, kwargs, trace=True)
        self.stats = stats
        os.makedirs(self.dir, exist_ok=True)
        events = [{"name": r.kind, "ph": "X", "pid": 0, "tid": r.engine, "ts": r.start * 1e6,
                   "dur": (r.end - r.start) * 1e6, "args": {"where": r.where}} for r in stats.trace]
        base = os.path.join(self.dir, os.path.splitext(self.name)[0])
        with open(base + ".json", "w") as f:
            json.dump({"traceEvents": events}, f)
        with open(base + "_summary.json", "w") as f:
            json.dump({"target": stats.target, "latency_us": stats.latency_us,
                       "instructions": stats.instructions, "engine_busy_us":
                       {k: v * 1e6 for k, v in stats.engine_busy_s.items()},
                       "utilisation": stats.utilisation}, f, indent=1)
        return out


def profile(kernel: Any = None, **options: Any) -> Any:
    if kernel is None:
        return lambda k: ProfileKernel(_as_kernel(k), **options)
    return ProfileKernel(_as_kernel(kernel), **options)
