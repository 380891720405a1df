"""Cost of one NeuronCore instruction: the interface the NKI simulator schedules with.

This module owns the per-instruction model: which engine executes an instruction kind and
how long it keeps that engine busy, from the engine clocks and the Tensor-engine geometry of
the target (targets.py). The whole-op model (model.py) builds on the helpers here, so an
eager op and the same work written as NKI instructions are priced by one set of formulas.

Rules (each an assumption, stated where used):
- Vector, Scalar and GpSimd process the 128 partitions in parallel, one element per
  partition lane per cycle at the engine's clock, plus `instruction_fixed_cycles` (64) per
  instruction. So the time depends on the free size, not on the partition count.
- A matmul pass streams the moving tile through the 128x128 array one column per
  `cycles_per_moving_column` cycles (1 for BF16, ~4 for FP32 from the published rates),
  while the next stationary tile (M columns, one a cycle) loads behind it; a pass costs
  max(N * cycles_per_column, M) + `matmul_issue_cycles`.
- DMA cost depends on the transfer's shape: contiguous runs become descriptors, spread over
  the core's 16 queues; each descriptor pays a fixed overhead and moves whole 64-byte
  bursts; HBM bandwidth caps the total; a fixed latency covers trigger to completion.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .targets import Target, dtype_key, get_target

__all__ = [
    "ENGINES",
    "INSTRUCTION_KINDS",
    "InstructionTiming",
    "instruction_cost",
    "instruction_timing",
    "contraction_rows",
    "cycles_per_moving_column",
    "matmul_pass_cycles",
    "engine_seconds",
    "dma_timing",
    "itemsize",
]

ENGINES: tuple[str, ...] = ("tensor", "vector", "scalar", "gpsimd", "dma", "sync")

# Engine that executes each instruction kind by default (NKI ISA: nki.isa.* docs).
_DEFAULT_ENGINE: dict[str, str] = {
    "nc_matmul": "tensor",
    "nc_transpose": "tensor",
    "activation": "scalar",
    "activation_reduce": "scalar",
    "tensor_tensor": "vector",
    "tensor_scalar": "vector",
    "tensor_scalar_reduce": "vector",
    "tensor_reduce": "vector",
    "tensor_copy": "vector",
    "tensor_tensor_scan": "vector",
    "scalar_tensor_tensor": "vector",
    "reciprocal": "vector",
    "bn_stats": "vector",
    "bn_aggr": "vector",
    "memset": "vector",
    "psum_accumulate": "vector",
    "affine_select": "gpsimd",
    "iota": "gpsimd",
    "select": "gpsimd",
    "gpsimd": "gpsimd",
    "tensor_partition_reduce": "gpsimd",
    "dma": "dma",
    "sync": "sync",
}
INSTRUCTION_KINDS: tuple[str, ...] = tuple(_DEFAULT_ENGINE)

# Assumption: one descriptor carries at most 64 KiB, and a transfer of few long runs is
# split further so it spreads over all queues, but never into pieces under 4 KiB ("each DMA
# transfer is by default parallelized up to 16 DMA engines, depending on the shape" -
# nki-dma-overview).
DMA_MAX_DESCRIPTOR_BYTES = 64 * 1024
DMA_MIN_SPLIT_BYTES = 4 * 1024
_MEMORIES = ("hbm", "sbuf", "psum", "host", "")

_ITEMSIZE_BY_NAME = {"tf32": 4, "tfloat32": 4, "fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2,
                     "fp16": 2, "float16": 2, "fp8_e4m3": 1, "float8_e4m3": 1,
                     "fp8_e5m2": 1, "float8_e5m2": 1}


@dataclass(frozen=True, slots=True)
class InstructionTiming:
    """`busy_s`: how long the engine is occupied; `latency_s`: when the result is ready
    (>= busy_s; larger only for DMA, whose fixed latency overlaps other transfers)."""

    engine: str
    busy_s: float
    latency_s: float


def itemsize(dtype: torch.dtype | str) -> int:
    """Bytes per element of a torch dtype or of a dtype name such as "bfloat16"/"tf32"."""
    if isinstance(dtype, torch.dtype):
        return dtype.itemsize
    name = str(dtype).lower().removeprefix("torch.")
    if name in _ITEMSIZE_BY_NAME:
        return _ITEMSIZE_BY_NAME[name]
    try:  # numpy dtypes and names like "int32"
        import numpy as np
        return np.dtype(name).itemsize
    except TypeError as error:
        raise TypeError(f"unknown dtype {dtype!r}") from error


def contraction_rows(target: Target, dtype: torch.dtype | str) -> int:
    """Rows (K) one matmul pass contracts: 128, or 256 in FP8 "double row" mode
    (hardware.md: NeuronCore-v3 FP8 K = 256)."""
    key = dtype_key(dtype) or ""
    if target.fp8_double_row and key.startswith("fp8"):
        return 2 * target.partitions
    return target.partitions


def cycles_per_moving_column(target: Target, dtype: torch.dtype | str) -> float:
    """Tensor-engine cycles to stream one moving column through the array.

    Derived from the published per-core peak: a pass of N columns does
    2 * rows * 128 * N FLOPs, so at peak it takes 2 * rows * 128 * clock / peak cycles per
    column (BF16: ~1.0 on every generation; FP32: ~4; FP8 double row: ~1 with K = 256).
    """
    rows = contraction_rows(target, dtype)
    return 2 * rows * target.gemm_stationary_fmax * target.clock_hz("tensor") / target.peak_flops(dtype)


def matmul_pass_cycles(target: Target, dtype: torch.dtype | str, moving_columns: float,
                       stationary_columns: float) -> float:
    """Tensor-engine cycles of one pass (one nc_matmul): the moving tile streams while the
    next stationary tile loads (one column a cycle), plus the issue bubble."""
    streaming = moving_columns * cycles_per_moving_column(target, dtype)
    return max(streaming, stationary_columns) + target.matmul_issue_cycles


def engine_seconds(target: Target, engine: str, elements_per_lane: float, instructions: int = 1) -> float:
    """Seconds a Vector/Scalar/GpSimd engine needs for `elements_per_lane` elements on each
    partition lane, issued as `instructions` instructions (each paying the fixed cost)."""
    cycles = elements_per_lane + instructions * target.instruction_fixed_cycles
    return cycles / target.clock_hz(engine)


def dma_timing(target: Target, nbytes: float, *, contiguous_bytes: float = 0, descriptors: int = 0,
               src: str = "hbm", dst: str = "sbuf", rows: int = 0) -> InstructionTiming:
    """Timing of one DMA transfer of `nbytes` made of contiguous runs.

    Run length: `contiguous_bytes` if given, else nbytes / descriptors if descriptors are
    given, else one run per row (`rows`, e.g. partitions), else one run. Runs are split
    into descriptors of at most 64 KiB (and long runs of a transfer with few runs into pieces
    of >= 4 KiB so all queues share them); descriptors spread evenly over the DMA queues;
    a queue spends `dma_descriptor_overhead_s` per descriptor and moves whole HBM bursts
    at its own rate. Each HBM side of the transfer also caps it at the core's HBM bandwidth
    (HBM->HBM crosses HBM twice). `dma_fixed_latency_s` is added to the latency only.
    """
    for memory in (src, dst):
        if memory not in _MEMORIES:
            raise ValueError(f"unknown memory {memory!r}; expected one of hbm, sbuf, psum, host")
    if nbytes <= 0:
        return InstructionTiming("dma", 0.0, target.dma_fixed_latency_s)
    if contiguous_bytes > 0:
        run = min(float(contiguous_bytes), float(nbytes))
        runs = math.ceil(nbytes / run)
        if descriptors > runs:  # caller knows better (e.g. runs straddling a boundary)
            runs = descriptors
    elif descriptors > 0:
        runs = descriptors
        run = nbytes / runs
    else:
        runs = max(rows, 1)
        run = nbytes / runs
    spread = min(math.ceil(target.dma_engines / runs), int(run // DMA_MIN_SPLIT_BYTES))
    pieces = max(math.ceil(run / DMA_MAX_DESCRIPTOR_BYTES), spread, 1)
    count = runs * pieces
    piece = run / pieces
    moved = math.ceil(piece / target.hbm_burst_bytes) * target.hbm_burst_bytes
    queues = min(target.dma_engines, count)
    rounds = math.ceil(count / queues)
    busy = rounds * (target.dma_descriptor_overhead_s + moved / target.dma_engine_bytes_per_s)
    hbm_crossings = (src == "hbm") + (dst == "hbm")
    if hbm_crossings:
        busy = max(busy, hbm_crossings * count * moved / target.hbm_bytes_per_s)
    return InstructionTiming("dma", busy, busy + target.dma_fixed_latency_s)


def _check_tile(kind: str, partitions: int, free_elems: int, target: Target) -> None:
    if not 0 <= partitions <= target.partitions:
        raise ValueError(f"{kind}: partitions={partitions} is outside 0..{target.partitions}")
    if free_elems < 0:
        raise ValueError(f"{kind}: free_elems={free_elems} is negative")


def _matmul_timing(target: Target, dtype: torch.dtype | str, *, contraction: int, stationary: int,
                   moving: int) -> InstructionTiming:
    rows = contraction_rows(target, dtype)
    limits = (("contraction (K)", contraction, rows),
              ("stationary free size (M, passed as partitions)", stationary, target.gemm_stationary_fmax),
              ("moving free size (N)", moving, target.gemm_moving_fmax))
    for what, value, limit in limits:
        if not 0 <= value <= limit:
            raise ValueError(f"nc_matmul: {what} = {value} exceeds the array limit {limit} "
                             f"on {target.name}; split the matmul into tiles")
    seconds = matmul_pass_cycles(target, dtype, moving, stationary) / target.clock_hz("tensor")
    return InstructionTiming("tensor", seconds, seconds)


def _transpose_dtype(target: Target, dtype: torch.dtype | str) -> torch.dtype | str:
    # A transpose is a matmul against the identity; types without a matmul rate move at the
    # FP32 rate (4-byte lanes).
    try:
        target.peak_flops(dtype)
        return dtype
    except TypeError:
        return torch.float32


def instruction_timing(kind: str, *, partitions: int, free_elems: int, dtype: torch.dtype | str,
                       target: Target | None = None, moving_free: int = 0, contraction: int = 0,
                       nbytes: int = 0, contiguous_bytes: int = 0, descriptors: int = 0,
                       src: str = "", dst: str = "", engine: str = "") -> InstructionTiming:
    """Engine, busy time and latency of one instruction. See `instruction_cost`."""
    target = target or get_target()
    if kind not in _DEFAULT_ENGINE:
        raise ValueError(f"unknown instruction kind {kind!r}; known: {', '.join(INSTRUCTION_KINDS)}")
    engine = engine or _DEFAULT_ENGINE[kind]
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; engines: {', '.join(ENGINES)}")

    if kind == "dma":
        size = nbytes or partitions * free_elems * itemsize(dtype)
        return dma_timing(target, size, contiguous_bytes=contiguous_bytes, descriptors=descriptors,
                          src=src or "hbm", dst=dst or "sbuf", rows=partitions)
    if kind == "nc_matmul":
        return _matmul_timing(target, dtype, contraction=contraction or target.partitions,
                              stationary=partitions, moving=moving_free or free_elems)
    _check_tile(kind, partitions, free_elems, target)
    if kind == "nc_transpose":
        # in [P, F] -> out [F, P] = in^T @ I: F stationary columns, P moving columns.
        if free_elems > target.gemm_stationary_fmax:
            raise ValueError(f"nc_transpose: free size {free_elems} exceeds {target.gemm_stationary_fmax}")
        return _matmul_timing(target, _transpose_dtype(target, dtype), contraction=partitions,
                              stationary=free_elems, moving=partitions)
    if engine == "sync":
        # Assumption: a semaphore/barrier instruction costs only the fixed issue cost, counted
        # at the Scalar engine's clock (the Sync engine's clock is not published).
        seconds = target.instruction_fixed_cycles / target.clock_hz("scalar")
        return InstructionTiming("sync", seconds, seconds)
    if engine in ("tensor", "dma"):
        raise ValueError(f"{kind} cannot run on the {engine} engine")
    seconds = engine_seconds(target, engine, free_elems)
    return InstructionTiming(engine, seconds, seconds)


def instruction_cost(kind: str, *, partitions: int, free_elems: int, dtype: torch.dtype | str,
                     target: Target | None = None, moving_free: int = 0, contraction: int = 0,
                     nbytes: int = 0, contiguous_bytes: int = 0, descriptors: int = 0,
                     src: str = "", dst: str = "", engine: str = "") -> tuple[str, float]:
    """(engine, seconds) of one NeuronCore instruction on `target` (default: current).

    kind: one of INSTRUCTION_KINDS. Shapes:
    - "nc_matmul": `contraction` = K partitions (<= 128; 256 for FP8 double row),
      `partitions` = M stationary free size (<= 128), `moving_free` = N (<= 512; defaults to
      free_elems). Raises ValueError beyond the array's limits, UnsupportedDtypeError for a
      dtype without Tensor-engine rate.
    - "nc_transpose": input tile [partitions, free_elems], both <= 128, on the Tensor engine.
    - Vector/Scalar/GpSimd kinds: a [partitions, free_elems] tile; time grows with
      free_elems only. `engine=` overrides the default engine (NKI lets e.g. tensor_copy or
      tensor_scalar run on vector, scalar or gpsimd).
    - "dma": `nbytes` (default partitions*free_elems*itemsize), `contiguous_bytes` per run
      (default one run per partition row), or `descriptors`; src/dst in hbm, sbuf, psum.

    The seconds returned are the latency: when a dependent instruction may start. For DMA
    that includes the ~1 us fixed latency that overlaps other transfers on the same queues;
    `instruction_timing` separates busy time from latency for schedulers that overlap.
    """
    timing = instruction_timing(kind, partitions=partitions, free_elems=free_elems, dtype=dtype,
                                target=target, moving_free=moving_free, contraction=contraction,
                                nbytes=nbytes, contiguous_bytes=contiguous_bytes,
                                descriptors=descriptors, src=src, dst=dst, engine=engine)
    return timing.engine, timing.latency_s
