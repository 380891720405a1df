"""The performance model: modeled device time of an aten op, a copy or a collective.

This module owns `op_cost` (one eager kernel for one aten op, from the op's name and the
dtypes and shapes of its tensors), `launch_cost`, `copy_cost` and `collective_cost`, and the
`Cost` record they return. Formulas are first-principles over the target's figures
(targets.py) and reuse the per-instruction helpers (instructions.py):

- An eager kernel streams its operands HBM -> SBUF -> engines -> SBUF -> HBM in tiles, and
  the engines overlap with the DMA across tiles, so
      duration = max(busiest engine's time, HBM traffic / bandwidth) + fixed latency,
  where the fixed latency is the un-overlapped first load and last store (two DMA fixed
  latencies). `bound` names the larger term ("latency" when the fixed part dominates).
- Matmul-like ops are tiled onto the 128x128 Tensor engine (stationary K, M <= 128, moving
  N <= 512, ceil-division, each pass paying its fixed issue cost), at the dtype's own rate;
  PSUM results are evacuated by the Vector and Scalar engines; HBM traffic assumes output
  blocks that fit half of SBUF.
- Elementwise ops run on Vector (transcendentals on Scalar), reductions/softmax/norms on
  Vector (+ Scalar for exp), gather/scatter/sort/index on GpSimd (indirect DMA: one
  descriptor per index), copies on DMA.
- A host fallback (fallback=True, or any float64/complex/unsupported dtype) costs the round
  trip of its inputs and outputs over the host link plus the host's own compute time.
- Unknown ops are priced like an elementwise op over their bytes; op_cost never raises for
  an op name.

FLOP counts are nominal (2*M*N*K for matmuls, one per element for elementwise ops, a few per
element for softmax/norms) and are 0 for pure data movement and host fallbacks.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch

from .instructions import contraction_rows, dma_timing, engine_seconds, matmul_pass_cycles
from .taxonomy import base_name, op_category, split_names
from .targets import Target, get_target

__all__ = [
    "Cost",
    "TensorSig",
    "op_cost",
    "launch_cost",
    "copy_cost",
    "collective_cost",
    "paged_attention_cost",
    "kv_cache_write_cost",
    "op_category",
    "COLLECTIVE_KINDS",
    "COPY_KINDS",
]

TensorSig = tuple[torch.dtype, tuple[int, ...]]

COPY_KINDS = ("h2d", "d2h", "d2d")
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast",
                    "reduce", "gather", "scatter", "send", "recv", "barrier")

# Assumption: an eager elementwise kernel works on [128, 2048] tiles (1 MiB of fp32 per
# buffer, so input, output and their double buffers fit SBUF); each tile instruction pays
# the engine's fixed instruction cost.
TILE_FREE_ELEMS = 2048
# Assumption: a counter-based RNG (Philox-like) needs ~4 GpSimd passes per random value.
RNG_PASSES = 4


@dataclass(frozen=True, slots=True)
class Cost:
    """Modeled cost of one unit of device work.

    duration_s: device time; engine: the busiest resource ("tensor", "vector", "scalar",
    "gpsimd", "dma", "host" for host fallbacks, "link" for collectives); flops: nominal
    floating-point work done on the device; bytes: HBM bytes moved (host-link or link bytes
    for transfers); bound: "compute", "memory" or "latency". Frozen: results are cached and
    shared, use dataclasses.replace to derive a modified one.
    """

    duration_s: float
    engine: str
    flops: float
    bytes: float
    bound: str
    fallback: bool = False


# ----------------------------------------------------------------------------------------------
# small helpers
# ----------------------------------------------------------------------------------------------

def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _nbytes(sig: TensorSig) -> int:
    dtype, shape = sig
    return _numel(shape) * dtype.itemsize


def _total_bytes(sigs: Sequence[TensorSig]) -> int:
    return sum(_nbytes(s) for s in sigs)


def _lanes(elements: float, target: Target) -> float:
    """Elements each partition lane handles when `elements` spread over all partitions."""
    return math.ceil(elements / target.partitions)


def _tiles(lane_elements: float) -> int:
    return max(1, math.ceil(lane_elements / TILE_FREE_ELEMS))


def _is_integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex)


@dataclass
class _Work:
    """What one kernel asks of the machine, before combining into a Cost."""

    engine_s: dict[str, float]
    hbm_bytes: float
    flops: float
    engine: str = ""          # reported engine, when not simply the busiest one
    dma_latencies: int = 2    # un-overlapped DMA fixed latencies: the first load, the last store
    host_sync_s: float = 0.0  # a read-back the host waits for after the kernel (a data-dependent size)


def _finish(target: Target, work: _Work) -> Cost:
    compute_s = max((s for e, s in work.engine_s.items() if e != "dma"), default=0.0)
    # Assumption: contiguous eager operands move at the lesser of HBM and DMA bandwidth;
    # a kernel that is only a DMA (a copy) is bound by that DMA's own shape-aware time.
    streaming_s = work.hbm_bytes / min(target.hbm_bytes_per_s, target.dma_bytes_per_s)
    memory_s = max(streaming_s, work.engine_s.get("dma", 0.0))
    fixed_s = work.dma_latencies * target.dma_fixed_latency_s
    engine = work.engine or (max(work.engine_s, key=work.engine_s.__getitem__) if work.engine_s else "dma")
    fixed_s += work.host_sync_s
    if fixed_s >= max(compute_s, memory_s):
        bound = "latency"
    else:
        bound = "compute" if compute_s >= memory_s else "memory"
    return Cost(max(compute_s, memory_s) + fixed_s, engine, float(work.flops), float(work.hbm_bytes), bound)


def _engine_passes(target: Target, engine: str, elements: float, passes: float) -> float:
    """Seconds for `passes` tile-wise passes of an engine over `elements` elements."""
    lane = _lanes(elements, target)
    return engine_seconds(target, engine, lane * passes, math.ceil(_tiles(lane) * passes))


def _int64_factor(target: Target, *groups: Sequence[TensorSig]) -> int:
    # trn1 has no native int64: each int64 element is two int32 operations (assumption).
    if target.native_int64:
        return 1
    return 2 if any(dtype == torch.int64 for sigs in groups for dtype, _ in sigs) else 1


def _elements(*groups: Sequence[TensorSig]) -> int:
    """Element count of the largest tensor in the first non-empty group."""
    for sigs in groups:
        if sigs:
            return max(_numel(shape) for _, shape in sigs)
    return 0


# ----------------------------------------------------------------------------------------------
# matmul family on the Tensor engine
# ----------------------------------------------------------------------------------------------

def _matmul_dtype(target: Target, dtype: torch.dtype) -> torch.dtype:
    """The rate a matmul runs at: its own dtype's, FP8 as the target runs FP8 (`_fp8_rate_dtype`),
    or FP32's for types the Tensor engine has no rate for (integers; assumption: computed through
    the FP32 path)."""
    if dtype in _FP8_TYPES:
        return _fp8_rate_dtype(target, dtype)
    try:
        target.peak_flops(dtype)
        return dtype
    except TypeError:
        return torch.float32


def _tile_sizes(extent: int, tile: int) -> tuple[tuple[int, int], ...]:
    """((tile width, count), ...) of a ceil-division tiling of `extent`."""
    full, rest = divmod(extent, tile)
    return tuple((w, n) for w, n in ((tile, full), (rest, 1 if rest else 0)) if n)


def _output_block(target: Target) -> int:
    """Side of the square output block a matmul keeps on chip: the largest multiple of the
    moving tile whose fp32 accumulator fits half of usable SBUF (the other half holds the
    double-buffered operand panels)."""
    side = math.isqrt(target.sbuf_usable_bytes // 2 // 4)
    return max(target.gemm_moving_fmax, side // target.gemm_moving_fmax * target.gemm_moving_fmax)


def _gemm(target: Target, dtype: torch.dtype, *, batch: int, m: int, n: int, k: int,
          a_bytes: float, b_bytes: float, other_bytes: float, k_tiles: int | None = None,
          repeat: float = 1.0) -> _Work:
    """C[m, n] = A[m, k] @ B[k, n], `batch` times, `repeat` such products (backward)."""
    dtype = _matmul_dtype(target, dtype)
    if k_tiles is None:
        k_tiles = math.ceil(k / contraction_rows(target, dtype))
    pass_cycles = sum(count_m * count_n * matmul_pass_cycles(target, dtype, width_n, width_m)
                      for width_m, count_m in _tile_sizes(m, target.gemm_stationary_fmax)
                      for width_n, count_n in _tile_sizes(n, target.gemm_moving_fmax))
    tensor_s = repeat * batch * k_tiles * pass_cycles / target.clock_hz("tensor")
    # PSUM -> SBUF evacuation of every output tile, shared by Vector and Scalar (both read
    # PSUM): each handles a share proportional to its clock, one element per lane-cycle.
    m_tiles = math.ceil(m / target.partitions)
    lane_elements = repeat * batch * m_tiles * n
    tiles = repeat * batch * m_tiles * math.ceil(n / target.psum_fmax)
    both_hz = target.clock_hz("vector") + target.clock_hz("scalar")
    evacuation_s = (lane_elements + tiles * target.instruction_fixed_cycles) / both_hz
    # HBM traffic: A is re-read once per output block column, B once per block row.
    block = _output_block(target)
    hbm = repeat * (a_bytes * math.ceil(n / block) + b_bytes * math.ceil(m / block)) + other_bytes
    flops = 2.0 * repeat * batch * m * n * k
    return _Work({"tensor": tensor_s, "vector": evacuation_s, "scalar": evacuation_s}, hbm, flops,
                 engine="tensor")


def _matmul_work(target: Target, name: str, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work | None:
    """Shapes of the matmul family -> _Work, or None when the signature is not understood."""
    has_bias = name in ("addmm", "_addmm_activation", "baddbmm", "addbmm", "addmv")
    operands = ins[1:3] if has_bias else ins[:2]
    if len(operands) < 2:
        return None
    (a_dtype, a), (_, b) = operands
    bias_bytes = _nbytes(ins[0]) if has_bias else 0
    if name == "linear":  # x[..., K] @ w[N, K]^T (+ bias[N])
        k, n = a[-1], b[0]
        m, batch = _numel(a[:-1]), 1
        bias_bytes = _total_bytes(ins[2:3])
    elif name in ("mv", "addmv"):
        m, k, n, batch = a[0], a[1], 1, 1
    elif name in ("dot", "vdot", "inner") and len(a) == 1:
        m, k, n, batch = 1, a[0], 1, 1
    elif name in ("outer", "ger"):
        m, k, n, batch = a[0], 1, b[0], 1
    elif len(a) >= 2 and len(b) == 2:  # mm, addmm, matmul with a 2-D right operand
        k, n = a[-1], b[-1]
        m, batch = _numel(a[:-1]), 1
    elif len(a) >= 3 and len(b) >= 3:  # bmm, baddbmm, addbmm, batched matmul
        m, k, n = a[-2], a[-1], b[-1]
        out_shape = outs[0][1] if outs else ()
        batch = _numel(out_shape[:-2]) if len(out_shape) >= 3 else max(_numel(a[:-2]), _numel(b[:-2]))
        if name == "addbmm":
            batch = a[0]
    elif len(a) == 1 and len(b) >= 2:  # vector @ (batched) matrix
        m, k, n = 1, a[0], b[-1]
        batch = _numel(b[:-2])
    elif len(a) >= 2 and len(b) == 1:  # (batched) matrix @ vector
        m, k, n, batch = _numel(a[:-1]), a[-1], 1, 1
    elif len(a) == 1 and len(b) == 1:
        m, k, n, batch = 1, a[0], 1, 1
    else:
        return None
    out_bytes = _total_bytes(outs) if outs else m * n * batch * a_dtype.itemsize
    return _gemm(target, a_dtype, batch=batch, m=m, n=n, k=k, a_bytes=_nbytes(operands[0]),
                 b_bytes=_nbytes(operands[1]), other_bytes=out_bytes + bias_bytes)


# ---- FP8 and grouped (mixture-of-experts) matmuls -----------------------------------------------

_FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)
_SCALE_TYPES = (torch.float8_e8m0fnu,)   # MX block scales: one exponent byte per 32 elements
_fp8_warned: set[str] = set()


def _fp8_rate_dtype(target: Target, dtype: torch.dtype) -> torch.dtype:
    """The dtype whose Tensor-engine rate an FP8 matmul gets. A target with no FP8 rate above
    BF16 (trn1: cFP8, hardware.md) runs FP8 as cFP8: e4m3's rate, which is BF16's; that is
    warned about once per target, since an FP8 recipe then buys no speed there."""
    key = "fp8_e5m2" if dtype in (torch.float8_e5m2, torch.float8_e5m2fnuz) else "fp8_e4m3"
    own = getattr(target, f"{key}_flops")
    if own > target.bf16_flops:
        return torch.float8_e5m2 if key == "fp8_e5m2" else torch.float8_e4m3fn
    if target.name not in _fp8_warned:
        _fp8_warned.add(target.name)
        warnings.warn(f"{target.name} has no FP8 rate above BF16 ({target.fp8_note}): FP8 matmuls are modeled as "
                      f"cFP8 at {target.fp8_e4m3_flops / 1e12:.0f} TFLOPS a core, the BF16 rate", UserWarning,
                      stacklevel=3)
    return torch.float8_e4m3fn if target.fp8_e4m3_flops > 0 else torch.bfloat16


def _k_block(target: Target, ins: Sequence[TensorSig], m: int, k: int) -> int | None:
    """The K extent one scale covers in a block-scaled matmul (32 for MX's e8m0 scales, 128 for
    float32 block scales), or None for tensor-wise/row-wise scales (applied once, in the
    PSUM evacuation)."""
    scales = ins[2:4]
    if any(dtype in _SCALE_TYPES for dtype, _ in scales):
        return 32
    if scales and _numel(scales[0][1]) > max(m, 1) and k > 128:
        return 128
    return None


def _block_scale_s(target: Target, k_block: int | None, dtype: torch.dtype, *, batch: int, m: int, n: int,
                   k: int) -> float:
    """Extra PSUM-evacuation time of block scales the Tensor engine cannot apply itself: each
    K block's partial product leaves PSUM and is scaled into an SBUF accumulator (a multiply-add
    over the output per block, shared by Vector and Scalar, which both read PSUM; assumption).
    MXFP8 on a target whose FP8 is MX (trn3) scales in the array: no extra work."""
    if k_block is None or ("MX" in target.fp8_note and k_block == 32):
        return 0.0
    blocks = math.ceil(k / k_block)
    lane_elements = batch * math.ceil(m / target.partitions) * n * blocks
    instructions = batch * blocks * math.ceil(m / target.partitions) * math.ceil(n / target.psum_fmax)
    both_hz = target.clock_hz("vector") + target.clock_hz("scalar")
    return (lane_elements + instructions * target.instruction_fixed_cycles) / both_hz


def _scaled_matmul_work(target: Target, name: str, ins: Sequence[TensorSig],
                        outs: Sequence[TensorSig]) -> _Work | None:
    """`_scaled_mm`, `_scaled_mm_v2`: a [M, K] @ b [K, N] at the FP8 rate plus its scaling."""
    if len(ins) < 2 or len(ins[0][1]) != 2 or len(ins[1][1]) != 2:
        return None
    (dtype, (m, k)), (_, (_, n)) = ins[0], ins[1]
    work = _gemm(target, dtype, batch=1, m=m, n=n, k=k, a_bytes=_nbytes(ins[0]), b_bytes=_nbytes(ins[1]),
                 other_bytes=_total_bytes(ins[2:]) + _total_bytes(outs))
    extra = _block_scale_s(target, _k_block(target, ins, m, k), dtype, batch=1, m=m, n=n, k=k)
    work.engine_s["vector"] += extra
    work.engine_s["scalar"] += extra
    return work


def _grouped_matmul_work(target: Target, name: str, ins: Sequence[TensorSig],
                         outs: Sequence[TensorSig]) -> _Work | None:
    """`_grouped_mm`, `_scaled_grouped_mm`: one kernel of G per-group GEMMs on the Tensor engine.

    Layouts (PyTorch's): 2d x 3d ([M, K] rows split by offs, [G, K, N]), 3d x 3d, 3d x 2d
    (columns split), 2d x 2d (K split: weight gradients, out [G, M, N]). The signature carries
    no group sizes, so groups are assumed balanced (M / G rows each, ceil-tiled per group);
    every expert's weights are read once."""
    if len(ins) < 2 or not outs:
        return None
    (dtype, a), (_, b) = ins[0], ins[1]
    out = outs[0][1]
    if len(a) == 2 and len(b) == 3:
        groups, m, k, n = b[0], math.ceil(a[0] / max(b[0], 1)), a[1], b[2]
    elif len(a) == 3 and len(b) == 3:
        groups, m, k, n = a[0], a[1], a[2], b[2]
    elif len(a) == 3 and len(b) == 2:
        groups, m, k, n = a[0], a[1], a[2], math.ceil(b[1] / max(a[0], 1))
    elif len(a) == 2 and len(b) == 2 and len(out) == 3:
        groups, m, k, n = out[0], a[0], math.ceil(a[1] / max(out[0], 1)), b[1]
    else:
        return None
    work = _gemm(target, dtype, batch=groups, m=m, n=n, k=k, a_bytes=_nbytes(ins[0]), b_bytes=_nbytes(ins[1]),
                 other_bytes=_total_bytes(ins[2:]) + _total_bytes(outs))
    if name != "_grouped_mm":
        mx = any(d in _SCALE_TYPES for d, _ in ins[2:4])
        extra = _block_scale_s(target, 32 if mx else None, dtype, batch=groups, m=m, n=n, k=k)
        work.engine_s["vector"] += extra
        work.engine_s["scalar"] += extra
    return work


# Assumption: dequantizing one int4 weight element on Vector takes 3 passes (unpack the nibble:
# shift and mask; then (q - 8) * scale + zero as one fused multiply-add).
INT4_DEQUANT_PASSES = 3


def _int4_matmul_work(target: Target, name: str, ins: Sequence[TensorSig],
                      outs: Sequence[TensorSig]) -> _Work | None:
    """`_weight_int4pack_mm`: x [M, K] @ W^T with W [N, K] packed as int4 (tinygemm). The packed
    weight streams from HBM at half a byte an element, Vector dequantizes each weight tile to
    BF16 in SBUF once, the Tensor engine multiplies at the BF16 rate."""
    if len(ins) < 3 or len(ins[0][1]) != 2 or len(ins[1][1]) != 4:
        return None
    (dtype, (m, k)), (_, packed) = ins[0], ins[1]
    n = packed[0] * 8
    work = _gemm(target, dtype, batch=1, m=m, n=n, k=k, a_bytes=_nbytes(ins[0]), b_bytes=_nbytes(ins[1]),
                 other_bytes=_total_bytes(ins[2:]) + _total_bytes(outs))
    work.engine_s["vector"] += _engine_passes(target, "vector", n * k, INT4_DEQUANT_PASSES)
    return work


def _histogram_work(target: Target, name: str, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work:
    """`histc`, `bincount` over E elements into B bins. Few bins (B <= psum_fmax, e.g. a router's
    experts): each element's bin index on Vector, compared against all B bins and summed down
    the partitions (B passes over E / 128 lanes). Many bins: a scatter-add of ones (GpSimd,
    one indirect descriptor per element)."""
    elements = _elements(ins[:1])
    bins = _numel(outs[0][1]) if outs else 1
    if bins > target.psum_fmax:
        return _scatter_work(target, ins, outs)
    vector_s = _engine_passes(target, "vector", elements, 1 + bins)
    return _Work({"vector": vector_s}, _total_bytes(ins) + _total_bytes(outs), float(elements * bins))


# ---- float64 arithmetic, emulated ---------------------------------------------------------------

# Elementwise float64 arithmetic the device runs without a host round trip: the NeuronCore has no
# FP64 unit, so each element is computed by an IEEE-exact software routine (unpack sign/exponent/
# mantissa, integer multiply-add with carries, normalise, round to nearest even) on the GpSimd
# engine, whose cores run general-purpose C code (neuron-core-v2.rst: "eight fully-programmable
# 512-bit wide vector processors, which can execute general purpose C-code"; 8 x 16 32-bit lanes,
# one a partition). The routine is one GpSimd instruction a tile: its integer operations cost a
# lane-cycle each, its issue cost is paid once, not once per integer operation as a chain of
# Vector instructions would pay it. Mixed-precision recipes use it for small scale tensors
# (torchao's float8 scale math); anything else in float64 (matmuls, transcendentals, reductions
# but amax/amin) stays a host fallback.
FP64_EMULATED_OPS = frozenset(split_names(
    "add sub rsub mul div reciprocal neg abs clamp clamp_min clamp_max maximum minimum where",
    "eq ne lt le gt ge sign floor ceil trunc round amax amin masked_fill"))
# Ops that only move or re-encode data (copies, fills, concatenation, dtype casts): any dtype,
# float64 and complex too, is device data for them (the runtime's DATA_MOVEMENT policy).
DATA_MOVEMENT_OPS = frozenset(split_names(
    "_local_scalar_dense clone _to_copy copy empty_like cat stack fill zero contiguous convert_element_type"))
# Assumption: ~40 integer instructions an element (a softfloat add/mul with 32-bit limbs);
# division and reciprocal iterate Newton steps on the mantissa, about twice that. A cast to or
# from float64 re-biases the exponent and shifts the mantissa across two 32-bit words (~8); a
# float64 copy moves bytes (1 pass).
FP64_EMULATION_PASSES = 40
FP64_DIVISION_PASSES = 80
FP64_CAST_PASSES = 8


# Selections of float64 data (compactions and indexing) run on the device too: they compute nothing
# in float64. The selected values move as bytes; nonzero's flags test each 64-bit element against
# zero as two 32-bit integer words (the high word's sign bit cleared, -0.0 being zero; a NaN is
# nonzero). Complex data stays a host fallback.
FP64_SELECTION_OPS = frozenset({"nonzero", "masked_select", "argwhere", "nonzero_static", "index"})
# Extra Vector passes a float64 element's zero test takes: clear the sign bit, OR the two words.
FP64_ZERO_TEST_PASSES = 2


def _has_fp64(sigs: Sequence[TensorSig]) -> bool:
    return any(dtype == torch.float64 for dtype, _ in sigs) and not any(dtype.is_complex for dtype, _ in sigs)


def _fp64_emulated(op: str, sigs: Sequence[TensorSig]) -> bool:
    name = base_name(op)
    return (name in FP64_EMULATED_OPS or name in DATA_MOVEMENT_OPS) and _has_fp64(sigs)


def _fp64_selection(op: str, sigs: Sequence[TensorSig]) -> bool:
    return base_name(op) in FP64_SELECTION_OPS and _has_fp64(sigs)


def _fp64_passes(op: str, sigs: Sequence[TensorSig]) -> int:
    name = base_name(op)
    if name in DATA_MOVEMENT_OPS:
        return FP64_CAST_PASSES if len({dtype for dtype, _ in sigs}) > 1 else 1
    return FP64_DIVISION_PASSES if name in ("div", "reciprocal") else FP64_EMULATION_PASSES


def _fp64_emulated_cost(target: Target, op: str, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> Cost:
    elements = max(_elements(outs), _elements(ins))
    lane = _lanes(elements, target)
    gpsimd_s = engine_seconds(target, "gpsimd", lane * _fp64_passes(op, ins + outs), _tiles(lane))
    work = _Work({"gpsimd": gpsimd_s},
                 _total_bytes(ins) + _total_bytes(outs), float(elements))
    return _finish(target, work)


# Ops priced by the functions above, by base name (before the category taxonomy is consulted).
_SPECIAL_WORK: dict[str, Callable[..., _Work | None]] = {
    "_scaled_mm": _scaled_matmul_work, "_scaled_mm_v2": _scaled_matmul_work,
    "_grouped_mm": _grouped_matmul_work, "_scaled_grouped_mm": _grouped_matmul_work,
    "_scaled_grouped_mm_v2": _grouped_matmul_work, "_weight_int4pack_mm": _int4_matmul_work,
    "histc": _histogram_work, "bincount": _histogram_work,
}


def _conv_work(target: Target, name: str, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work | None:
    """Convolution as weight-stationary GEMMs, one per kernel offset (the input window shifts
    under the array): M = C_out/groups, N = batch * output pixels, K = C_in/groups per pass.
    Assumption: the shifted windows are re-used from SBUF, so HBM sees each tensor once."""
    backward = "backward" in name
    if backward:  # (grad_output, input, weight) -> (grad_input, grad_weight, grad_bias)
        if len(ins) < 3:
            return None
        grad_out, x, w = ins[0], ins[1], ins[2]
        y_shape = grad_out[1]
        # grad_input and grad_weight are each a GEMM of the forward's size. Callers may
        # truncate long signatures, so fewer than two visible gradients count as two
        # unless the signature is short enough to be complete.
        produced = [o for o in outs if o[1] in (x[1], w[1])]
        complete = len(ins) + len(outs) < 4
        repeat = float(len(produced) if complete and produced else 2)
    else:
        if len(ins) < 2 or not outs:
            return None
        x, w = ins[0], ins[1]
        y_shape = outs[0][1]
        repeat = 1.0
    x_shape, w_shape = x[1], w[1]
    if len(x_shape) < 3 or len(w_shape) != len(x_shape) or len(y_shape) != len(x_shape):
        return None
    batch, c_in = x_shape[0], x_shape[1]
    kernel = _numel(w_shape[2:])
    transposed = _numel(y_shape[2:]) > _numel(x_shape[2:]) and w_shape[0] == c_in
    if transposed:  # weight [C_in, C_out/g, k...]: the GEMM runs over input pixels
        groups = max(1, c_in // w_shape[0]) if w_shape[0] else 1
        m, k_per_group, pixels = w_shape[1], c_in // groups, batch * _numel(x_shape[2:])
    else:
        groups = max(1, c_in // w_shape[1]) if w_shape[1] else 1
        m, k_per_group, pixels = w_shape[0] // groups, w_shape[1], batch * _numel(y_shape[2:])
    dtype = x[0]
    k_tiles = kernel * math.ceil(k_per_group / contraction_rows(target, _matmul_dtype(target, dtype)))
    return _gemm(target, dtype, batch=groups, m=m, n=pixels, k=k_per_group * kernel,
                 a_bytes=_nbytes(w), b_bytes=0, other_bytes=_total_bytes(ins) - _nbytes(w) + _total_bytes(outs),
                 k_tiles=k_tiles, repeat=repeat)


def _attention_work(target: Target, name: str, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work | None:
    """softmax(Q K^T) V as in flash attention: QK^T and PV on the Tensor engine, P transposed
    on it too, exp on Scalar, row max and rescaling on Vector. Assumptions: no causal mask
    (the signature does not say; full cost), K and V of one head stay in SBUF when they fit
    half of it, else they are re-read for every 128-row query tile. The backward pass is five
    matmuls of the same sizes (2.5x the forward's two) and three Vector passes."""
    backward = "backward" in name
    qkv = ins[1:4] if backward else ins[:3]  # backward inputs start with grad_out
    if len(qkv) < 3 or any(len(shape) < 2 for _, shape in qkv):
        return None
    (dtype, q), (_, k), (_, v) = qkv
    heads = _numel(q[:-2])
    l, e, s, ev = q[-2], q[-1], k[-2], v[-1]
    repeat = 2.5 if backward else 1.0
    scores = _gemm(target, dtype, batch=heads, m=l, n=s, k=e, a_bytes=0, b_bytes=0, other_bytes=0, repeat=repeat)
    values = _gemm(target, dtype, batch=heads, m=l, n=ev, k=s, a_bytes=0, b_bytes=0, other_bytes=0, repeat=repeat)
    blocks = heads * math.ceil(l / target.partitions) * math.ceil(s / target.partitions)
    transpose_s = blocks * matmul_pass_cycles(target, _matmul_dtype(target, dtype), target.partitions,
                                              target.partitions) / target.clock_hz("tensor")
    score_elements = heads * l * s
    exp_s = _engine_passes(target, "scalar", score_elements, 1)
    vector_s = _engine_passes(target, "vector", score_elements, 3 if backward else 1)
    kv_bytes_per_head = (_nbytes(qkv[1]) + _nbytes(qkv[2])) / max(1, _numel(k[:-2]))
    rereads = 1 if kv_bytes_per_head <= target.sbuf_usable_bytes / 2 else math.ceil(l / target.partitions)
    hbm = _total_bytes(ins) + _total_bytes(outs) + (rereads - 1) * (_nbytes(qkv[1]) + _nbytes(qkv[2]))
    engine_s = {
        "tensor": scores.engine_s["tensor"] + values.engine_s["tensor"] + repeat * transpose_s,
        "scalar": exp_s + values.engine_s["scalar"],
        "vector": vector_s + values.engine_s["vector"],
    }
    flops = scores.flops + values.flops + 5.0 * score_elements
    return _Work(engine_s, hbm, flops, engine="tensor")


def paged_attention_cost(q_lens: Sequence[int], kv_lens: Sequence[int], *, heads: int, kv_heads: int,
                         head_size: int, dtype: torch.dtype, block_size: int, causal: bool = True,
                         target: Target | None = None) -> Cost:
    """One paged-attention kernel over a batch of sequences, as a serving step runs it (prefill
    chunks and decodes together): sequence i has q_lens[i] new queries that attend to its
    kv_lens[i] cached tokens, read from the KV cache block by block through its block table.

    Per sequence and KV head, the heads // kv_heads query heads sharing it are packed into the
    stationary rows (GQA), so QK^T is [q*group, d] x [d, s] and PV [q*group, s] x [s, d] on the
    Tensor engine; a causal mask lets a flash kernel skip the key tiles past the diagonal
    (assumption: the live fraction is the mean attended length over s). exp on Scalar, the
    running max and rescale on Vector, as in flash attention. K and V are fetched by indirect
    DMA, one descriptor per (block, KV head) row of K and of V, and read once per sequence: the
    cost grows with the cached context, not with the batch's padded length."""
    target = target or get_target()
    group = max(1, heads // max(1, kv_heads))
    itemsize = dtype.itemsize
    engine_s = {"tensor": 0.0, "scalar": 0.0, "vector": 0.0, "dma": 0.0}
    hbm = 0.0
    flops = 0.0
    for q, s in zip(q_lens, kv_lens):
        q, s = int(q), int(s)
        if q <= 0 or s <= 0:
            continue
        attended = s - (q - 1) / 2 if causal else float(s)  # mean keys each query sees
        live = max(attended, 1.0) / s
        rows = q * group
        scores = _gemm(target, dtype, batch=kv_heads, m=rows, n=s, k=head_size, a_bytes=0, b_bytes=0,
                       other_bytes=0, repeat=live)
        values = _gemm(target, dtype, batch=kv_heads, m=rows, n=head_size, k=s, a_bytes=0, b_bytes=0,
                       other_bytes=0, repeat=live)
        score_elements = heads * q * attended
        engine_s["tensor"] += scores.engine_s["tensor"] + values.engine_s["tensor"]
        engine_s["scalar"] += _engine_passes(target, "scalar", score_elements, 1) + values.engine_s["scalar"]
        engine_s["vector"] += _engine_passes(target, "vector", score_elements, 1) + values.engine_s["vector"]
        kv_bytes = 2 * kv_heads * s * head_size * itemsize
        blocks = math.ceil(s / block_size)
        engine_s["dma"] += _indirect_dma_s(target, 2 * blocks * kv_heads, kv_bytes)
        hbm += kv_bytes + 2 * heads * q * head_size * itemsize  # K, V read; Q read, O written
        flops += scores.flops + values.flops + 5.0 * score_elements
    if not hbm:
        return Cost(0.0, "tensor", 0.0, 0.0, "latency")
    return _finish(target, _Work(engine_s, hbm, flops, engine="tensor"))


def _paged_decode_cost(target: Target, ins: Sequence[TensorSig]) -> Cost | None:
    """`decode_attention(q [B, T, Hq, d], kv_cache [blocks, Hkv, 2 * bs, d], block_table
    [B, max_blocks], ...)` (kernels/decode_attention.py) by `paged_attention_cost`, each sequence
    attending to the table's full width (the blocks the kernel walks). None for other shapes."""
    if len(ins) < 3 or [len(shape) for _, shape in ins[:3]] != [4, 4, 2]:
        return None
    (dtype, q), (_, kv), (_, table) = ins[:3]
    b, t, hq, d = (int(x) for x in q)
    hk, bs = int(kv[1]), int(kv[2]) // 2
    return paged_attention_cost([t] * b, [int(table[1]) * bs] * b, heads=hq, kv_heads=hk, head_size=d, dtype=dtype,
                                block_size=bs, target=target)


def kv_cache_write_cost(tokens: int, *, kv_heads: int, head_size: int, dtype: torch.dtype,
                        target: Target | None = None) -> Cost:
    """Writing a step's new keys and values into their KV-cache slots: an indirect DMA
    scatter, one descriptor per (token, KV head) row of K and of V (the slot mapping decides
    each row's block and offset), plus the slot indices read once."""
    target = target or get_target()
    if tokens <= 0:
        return Cost(0.0, "dma", 0.0, 0.0, "latency")
    return _finish(target, _kv_cache_write_work(target, tokens, kv_heads, head_size, dtype))


def _kv_cache_write_work(target: Target, tokens: int, kv_heads: int, head_size: int, dtype: torch.dtype) -> _Work:
    nbytes = 2 * tokens * kv_heads * head_size * dtype.itemsize
    rows = 2 * tokens * kv_heads
    dma_s = _indirect_dma_s(target, rows, nbytes)
    address_s = _engine_passes(target, "gpsimd", tokens, 1)
    return _Work({"gpsimd": address_s, "dma": dma_s}, 2 * nbytes + 8 * tokens, 0.0, engine="dma")


def _reshape_and_cache_work(target: Target, name: str, ins: Sequence[TensorSig],
                            outs: Sequence[TensorSig]) -> _Work | None:
    """The serving KV-cache write (`neuron_serving::reshape_and_cache`): reads key [tokens,
    kv_heads, head_size], value and the slot mapping, writes the cache (dtype from outs[0])."""
    if len(ins) < 1 or len(outs) < 1 or len(ins[0][1]) != 3:
        return None
    tokens, kv_heads, head_size = ins[0][1]
    if tokens <= 0:
        return _Work({"dma": 0.0}, 0.0, 0.0, engine="dma")
    return _kv_cache_write_work(target, tokens, kv_heads, head_size, outs[0][0])


_SPECIAL_WORK["reshape_and_cache"] = _reshape_and_cache_work


# ----------------------------------------------------------------------------------------------
# Vector / Scalar / GpSimd / DMA kernels
# ----------------------------------------------------------------------------------------------

def _elementwise_work(target: Target, ins: Sequence[TensorSig], outs: Sequence[TensorSig], *,
                      engine: str = "vector", passes: float = 1.0, flops_per_element: float = 1.0,
                      elements: float | None = None, scalar_passes: float = 0.0) -> _Work:
    if elements is None:
        elements = _elements(outs, ins)
    passes *= _int64_factor(target, ins or outs)  # the operands computed on
    engine_s = {engine: _engine_passes(target, engine, elements, passes)}
    if scalar_passes:
        engine_s["scalar"] = engine_s.get("scalar", 0.0) + _engine_passes(target, "scalar", elements, scalar_passes)
    hbm = _total_bytes(ins) + _total_bytes(outs)
    return _Work(engine_s, hbm, flops_per_element * elements)


def _index_inputs(ins: Sequence[TensorSig]) -> list[TensorSig]:
    """Index tensors: integer/bool inputs after the first (the first is the indexed tensor)."""
    return [s for s in ins[1:] if _is_integer(s[0])]


def _indirect_dma_s(target: Target, rows: int, nbytes: float) -> float:
    """Busy time of an indirect DMA moving `rows` runs (one descriptor per index)."""
    if rows <= 0 or nbytes <= 0:
        return 0.0
    return dma_timing(target, nbytes, descriptors=rows, src="hbm", dst="hbm").busy_s


def _gather_work(target: Target, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work:
    """Gathers (embedding, index_select, gather, index): GpSimd computes addresses for each
    index and the DMA moves one run per index; only the gathered rows cross HBM, not the
    whole source. A boolean index (x[mask]) selects by compaction (`_compaction_work`), and
    gathers without an index input stream their input through GpSimd."""
    index = _index_inputs(ins)
    out_bytes = _total_bytes(outs)
    if any(dtype == torch.bool for dtype, _ in index):
        return _compaction_work(target, "index", ins, outs)
    if not index:
        return _elementwise_work(target, ins, outs, engine="gpsimd", flops_per_element=0)
    rows = sum(_numel(shape) for _, shape in index)
    dma_s = _indirect_dma_s(target, rows, out_bytes)
    address_s = _engine_passes(target, "gpsimd", rows, _int64_factor(target, index))
    hbm = _total_bytes(index) + 2 * out_bytes  # read the gathered runs, write the result
    return _Work({"gpsimd": max(address_s, dma_s)}, hbm, 0.0, engine="gpsimd")


# Ops whose output size is the number of selected elements: the host reads the count back
# before it can size the result (as CUDA's nonzero synchronises), so the kernel's time includes
# that device-to-host read. nonzero_static has a static size and no read-back.
DATA_DEPENDENT_SIZE_OPS = frozenset({"nonzero", "masked_select", "argwhere", "index"})
COMPACTION_OPS = DATA_DEPENDENT_SIZE_OPS | {"nonzero_static"}


def _compaction_work(target: Target, name: str, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work:
    """Stream compaction: nonzero, argwhere, masked_select, x[mask] (index with a boolean index),
    nonzero_static. Over the E elements of the (broadcast) mask: one Vector pass makes the 0/1
    flags (`!= 0`), a prefix sum gives each selected element its output slot (an in-partition
    scan pass plus a pass adding each partition's offset, from a cross-partition scan of the 128
    partition totals), then GpSimd computes each element's value (nonzero: its d coordinates, a
    divide/modulo pair per dimension) and packs the selected ones to the front of its partition's
    tile. The output is dense: each partition's selected elements of a tile land in one contiguous
    range of it, so the DMA stores one run per partition and tile, not one per element. HBM: the
    inputs read once, the output written, the count written. A mask over leading dimensions
    (x[row_mask]) selects whole rows instead: one HBM -> HBM run per selected row. Ops in DATA_DEPENDENT_SIZE_OPS also pay the count's read-back to the host."""
    masks = [shape for dtype, shape in ins[1:] if dtype == torch.bool] if name == "index" else []
    elements = sum(map(_numel, masks)) if masks else max((_numel(shape) for _, shape in ins), default=0)
    out_bytes = _total_bytes(outs)
    coordinates = outs[0][1][-1] if name in ("nonzero", "argwhere", "nonzero_static") and outs and len(outs[0][1]) == 2 else 1
    factor = _int64_factor(target, outs)
    tests_fp64 = name in ("nonzero", "argwhere", "nonzero_static") and ins and ins[0][0] == torch.float64
    zero_test = FP64_ZERO_TEST_PASSES if tests_fp64 else 0
    vector_s = _engine_passes(target, "vector", elements, 3 + zero_test)  # flags, scan, partition offsets
    address_s = _engine_passes(target, "gpsimd", elements, (1 + 2 * coordinates) * factor)
    count_bytes = torch.int64.itemsize
    read = _total_bytes(ins)
    rows = _numel(outs[0][1][:1]) if outs and outs[0][1] else 0
    if masks and outs and _numel(outs[0][1]) > elements:  # x[row_mask]: selected rows copied HBM -> HBM
        dma_s = dma_timing(target, out_bytes, descriptors=rows, src="hbm", dst="hbm").busy_s if rows else 0.0
        read = _total_bytes([(torch.bool, shape) for shape in masks]) + out_bytes
    else:
        runs = target.partitions * _tiles(_lanes(elements, target)) if out_bytes else 0
        dma_s = dma_timing(target, out_bytes, descriptors=runs, src="sbuf", dst="hbm").busy_s if runs else 0.0
    work = _Work({"vector": vector_s, "gpsimd": address_s, "dma": dma_s},
                 read + out_bytes + count_bytes, 0.0, engine="gpsimd")
    if name in DATA_DEPENDENT_SIZE_OPS:
        work.host_sync_s = _host_transfer_s(target, count_bytes)
    return work


_SPECIAL_WORK.update({name: _compaction_work for name in COMPACTION_OPS - {"index"}})


def _scatter_work(target: Target, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work:
    """Scatters (index_put, scatter_add, embedding backward): one run per index, read-modify-
    write of the destination rows (assumption: accumulate is the common case), and the
    values read once. The destination is the output; an input of its shape is the
    destination passed in place, other floating inputs are the values. A destination no
    input provides (embedding backward) is freshly allocated and zeroed first."""
    index = _index_inputs(ins)
    destination = outs[0][1] if outs else None
    values = [s for s in ins if not _is_integer(s[0]) and s[1] != destination]
    rows = sum(_numel(shape) for _, shape in index)
    value_bytes = _total_bytes(values) or rows * (outs[0][0].itemsize if outs else 4)
    dma_s = _indirect_dma_s(target, rows, 2 * value_bytes)
    address_s = _engine_passes(target, "gpsimd", rows, _int64_factor(target, index))
    in_place = any(s[1] == destination for s in ins)
    zeroing = 0 if in_place else _total_bytes(outs)
    hbm = _total_bytes(index) + 3 * value_bytes + zeroing
    return _Work({"gpsimd": max(address_s, dma_s)}, hbm, 0.0, engine="gpsimd")


def _sort_work(target: Target, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work:
    """Sorts and friends on GpSimd: a bitonic network, n/2 * log2(n) * (log2(n)+1) / 2
    compare-exchanges over the sorted dimension (assumption: the last one), one per lane-cycle."""
    if not ins:
        return _elementwise_work(target, ins, outs, engine="gpsimd")
    shape = ins[0][1]
    length = shape[-1] if shape else 1
    stages = math.log2(max(2, length))
    passes = stages * (stages + 1) / 2
    return _elementwise_work(target, ins, outs, engine="gpsimd", passes=passes, flops_per_element=0,
                             elements=_numel(shape))


def _copy_work(target: Target, name: str, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work:
    """Device copies: DMA HBM -> HBM, unless the dtype changes (then a Vector cast)."""
    sources = ins[1:] if name == "copy" and len(ins) > 1 else ins  # copy_(self, src): self is written only
    written = _total_bytes(outs) if outs else _total_bytes(sources)
    converting = bool(outs) and any(s[0] != outs[0][0] for s in sources)
    if converting:
        return _elementwise_work(target, sources, outs, flops_per_element=0)
    dma_s = dma_timing(target, written, contiguous_bytes=written, src="hbm", dst="hbm").busy_s
    return _Work({"dma": dma_s}, _total_bytes(sources) + written, 0.0, engine="dma", dma_latencies=1)


def _optimizer_work(target: Target, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> _Work:
    """Fused Adam(W)/SGD over lists: per parameter element ~6 Vector passes (moments, bias
    correction, update, weight decay) and one Scalar sqrt; reads params, grads and two
    moments, writes params and moments. The parameter count is a quarter of the non-scalar
    input elements (params, grads, exp_avg, exp_avg_sq)."""
    tensors = [s for s in ins if _numel(s[1]) > 1]
    elements = sum(_numel(s[1]) for s in tensors) / 4
    read = _total_bytes(tensors)
    written = _total_bytes(outs) if outs else read * 3 / 4
    engine_s = {"vector": _engine_passes(target, "vector", elements, 6),
                "scalar": _engine_passes(target, "scalar", elements, 1)}
    return _Work(engine_s, read + written, 12.0 * elements)


def _foreach_elements(ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> float:
    # Outputs (the written tensors) give the work; in-place calls without outputs are
    # assumed binary (self list, other list).
    if outs:
        return sum(_numel(s[1]) for s in outs)
    return sum(_numel(s[1]) for s in ins) / 2


def _scalar_read_cost(target: Target, ins: Sequence[TensorSig]) -> Cost:
    """item(): one element read back to the host over the host link."""
    return copy_cost(sum(s[0].itemsize for s in ins[:1]), "d2h", target)


_FLOPS_PER_ELEMENT = {"softmax": 5.0, "softmax_backward": 3.0, "norm": 7.0, "norm_backward": 10.0}


# Kernel libraries above this floor (torchneuron.kernels) price some categories by simulating
# the NKI kernel that does the work: pricer(target, op name, ins, outs) -> seconds or None.
_KERNEL_PRICERS: dict[str, Callable] = {}


def register_kernel_pricer(category: str, pricer: Callable | None) -> None:
    """Price `category` ("attention", ...) by `pricer`: it returns the modeled seconds of the
    kernel that runs the op (e.g. its NKI kernel's simulated latency), or None where it has
    no kernel for the shapes (the formula prices those). FLOPs and bytes stay the formula's.
    None unregisters."""
    if pricer is None:
        _KERNEL_PRICERS.pop(category, None)
    else:
        _KERNEL_PRICERS[category] = pricer
    _cache.clear()


def _device_cost(target: Target, op: str, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> Cost:
    category = op_category(op)
    pricer = _KERNEL_PRICERS.get(category)
    if pricer is not None:
        cost = _formula_cost(target, op, category, ins, outs)
        seconds = pricer(target, base_name(op), ins, outs)
        if seconds is not None:
            return replace(cost, duration_s=float(seconds), engine="tensor", bound="compute")
        return cost
    return _formula_cost(target, op, category, ins, outs)


def _formula_cost(target: Target, op: str, category: str, ins: Sequence[TensorSig],
                  outs: Sequence[TensorSig]) -> Cost:
    name = base_name(op)
    work: _Work | None = None
    special = _SPECIAL_WORK.get(name)
    if special is not None and (work := special(target, name, ins, outs)) is not None:
        return _finish(target, work)
    if category == "view":
        return Cost(0.0, "dma", 0.0, 0.0, "latency")
    if category == "paged_attention" and (cost := _paged_decode_cost(target, ins)) is not None:
        return cost
    if category == "scalar_read":
        return _scalar_read_cost(target, ins)
    if category == "matmul":
        work = _matmul_work(target, name, ins, outs)
    elif category == "conv":
        work = _conv_work(target, name, ins, outs)
    elif category == "attention":
        work = _attention_work(target, name, ins, outs)
    elif category == "transcendental":
        work = _elementwise_work(target, ins, outs, engine="scalar")
        if name.endswith("_backward"):  # derivative on Scalar, product with grad on Vector
            work.engine_s["vector"] = _engine_passes(target, "vector", _elements(outs, ins), 1)
    elif category == "reduction":
        elements = _elements(ins)
        passes = 2.0 if name in ("var", "std", "var_mean", "std_mean", "norm", "linalg_vector_norm") else 1.0
        work = _elementwise_work(target, ins, outs, passes=passes, elements=elements)
    elif category == "scan":
        work = _elementwise_work(target, ins, outs)
    elif category in ("softmax", "softmax_backward", "norm", "norm_backward"):
        elements = _elements(ins)
        forward = category in ("softmax", "norm")
        work = _elementwise_work(target, ins, outs, passes=2.0 if forward else 3.0,
                                 scalar_passes=1.0 if forward else 0.0, elements=elements,
                                 flops_per_element=_FLOPS_PER_ELEMENT[category])
    elif category == "gather":
        work = _gather_work(target, ins, outs)
    elif category == "scatter":
        work = _scatter_work(target, ins, outs)
    elif category == "sort":
        work = _sort_work(target, ins, outs)
    elif category == "copy":
        work = _copy_work(target, name, ins, outs)
    elif category == "fill":  # memset: write only
        work = _elementwise_work(target, (), outs or ins[:1], flops_per_element=0)
    elif category == "random":
        work = _elementwise_work(target, (), outs or ins[:1], engine="gpsimd", passes=RNG_PASSES,
                                 flops_per_element=0)
        if "dropout" in name:  # mask and scale the input on Vector
            work.engine_s["vector"] = _engine_passes(target, "vector", _elements(ins), 2)
            work.hbm_bytes += _total_bytes(ins)
    elif category == "iota":
        work = _elementwise_work(target, (), outs, engine="gpsimd", flops_per_element=0)
    elif category == "optimizer":
        work = _optimizer_work(target, ins, outs)
    elif category in ("foreach", "foreach_transcendental"):
        engine = "scalar" if category == "foreach_transcendental" else "vector"
        work = _elementwise_work(target, ins, outs, engine=engine, elements=_foreach_elements(ins, outs))
    elif category == "pool":
        work = _elementwise_work(target, ins, outs, elements=max(_elements(ins), _elements(outs)))
    if work is None:  # elementwise, unknown ops, and signatures the specific models reject
        work = _elementwise_work(target, ins, outs)
    return _finish(target, work)


# ----------------------------------------------------------------------------------------------
# host fallback, copies, collectives, launch
# ----------------------------------------------------------------------------------------------

def _host_transfer_s(target: Target, nbytes: float) -> float:
    """One host<->device transfer: a PCIe round trip to set it up, the DMA's fixed latency,
    and the bytes at the host link's rate (targets.py states the PCIe assumption)."""
    if nbytes <= 0:
        return 0.0
    return target.host_link_latency_s + target.dma_fixed_latency_s + nbytes / target.host_link_bytes_per_s


def _fallback_cost(target: Target, ins: Sequence[TensorSig], outs: Sequence[TensorSig]) -> Cost:
    """The op ran on the host CPU: its inputs went device->host, its outputs host->device.
    Host compute time is added by op_cost from `host_seconds`."""
    read, written = _total_bytes(ins), _total_bytes(outs)
    duration = _host_transfer_s(target, read) + _host_transfer_s(target, written)
    streaming = (read + written) / target.host_link_bytes_per_s
    bound = "memory" if streaming > duration - streaming else "latency"
    return Cost(duration, "host", 0.0, float(read + written), bound, fallback=True)


def launch_cost(target: Target | None = None) -> float:
    """Seconds of device time to dispatch one eager kernel (Target.kernel_launch_s states the
    assumption: doorbell and completion over PCIe plus one DMA to fetch the instructions)."""
    return (target or get_target()).kernel_launch_s


def copy_cost(nbytes: int, kind: str, target: Target | None = None) -> Cost:
    """A copy of `nbytes` contiguous bytes: "h2d"/"d2h" over the host link (PCIe), "d2d"
    within HBM by DMA (read and write both cross HBM)."""
    target = target or get_target()
    if kind not in COPY_KINDS:
        raise ValueError(f"unknown copy kind {kind!r}; expected one of {', '.join(COPY_KINDS)}")
    if nbytes <= 0:
        return Cost(0.0, "dma", 0.0, 0.0, "latency")
    if kind == "d2d":
        timing = dma_timing(target, nbytes, contiguous_bytes=nbytes, src="hbm", dst="hbm")
        duration, fixed = timing.latency_s, target.dma_fixed_latency_s
        moved = 2.0 * nbytes
    else:
        duration = _host_transfer_s(target, nbytes)
        fixed = target.host_link_latency_s + target.dma_fixed_latency_s
        moved = float(nbytes)
    bound = "latency" if fixed >= duration - fixed else "memory"
    return Cost(duration, "dma", 0.0, moved, bound)


# Ring algorithms: (steps as a function of ranks n, fraction of nbytes each rank sends).
# nbytes is the full buffer: the all_reduce buffer, all_gather's gathered output,
# reduce_scatter's unscattered input, all_to_all's whole send buffer.
_RING: dict[str, tuple[Callable[[int], int], Callable[[int], float]]] = {
    "all_reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "all_gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "reduce_scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "all_to_all": (lambda n: n - 1, lambda n: (n - 1) / n),
    "gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    "broadcast": (lambda n: n - 1, lambda n: 1.0),   # pipelined along the ring
    "reduce": (lambda n: n - 1, lambda n: 1.0),      # pipelined along the ring
    "send": (lambda n: 1, lambda n: 1.0),
    "recv": (lambda n: 1, lambda n: 1.0),
    "barrier": (lambda n: 2 * (n - 1), lambda n: 0.0),  # an all_reduce of nothing
}
_COLLECTIVE_ALIASES = {
    "allreduce": "all_reduce", "allgather": "all_gather", "all_gather_into_tensor": "all_gather",
    "_allgather_base": "all_gather", "all_gather_single": "all_gather",
    "reducescatter": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
    "alltoall": "all_to_all", "all_to_all_single": "all_to_all", "alltoall_base": "all_to_all",
}


def collective_link_bytes_per_s(target: Target, ranks: int) -> float:
    """Per-rank ring bandwidth. Ranks within one chip exchange through HBM by DMA (each byte
    read and written in HBM: half the HBM bandwidth, capped by DMA); across chips, the chip's
    NeuronLink bandwidth shared by its cores."""
    if ranks <= target.cores_per_chip:
        return min(target.dma_bytes_per_s, target.hbm_bytes_per_s / 2)
    return target.neuronlink_bytes_per_s


def collective_cost(kind: str, nbytes: int, ranks: int, target: Target | None = None) -> Cost:
    """Ring collective over `ranks` logical cores: steps * link_step_latency_s + fraction *
    nbytes / per-rank bandwidth (all_reduce: 2(n-1) steps, 2(n-1)/n of the bytes). The
    reduction arithmetic runs on the collective-compute cores at line rate (not charged)."""
    target = target or get_target()
    canonical = _COLLECTIVE_ALIASES.get(kind, kind)
    if canonical not in _RING:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(COLLECTIVE_KINDS)}")
    if ranks <= 1:
        return Cost(0.0, "link", 0.0, 0.0, "latency")
    steps_of, fraction_of = _RING[canonical]
    sent = fraction_of(ranks) * max(0, nbytes)
    latency_s = steps_of(ranks) * target.link_step_latency_s
    transfer_s = sent / collective_link_bytes_per_s(target, ranks)
    bound = "memory" if transfer_s > latency_s else "latency"
    return Cost(latency_s + transfer_s, "link", 0.0, sent, bound)


# ----------------------------------------------------------------------------------------------
# op_cost: the cached entry point
# ----------------------------------------------------------------------------------------------

_cache: dict[tuple, Cost] = {}
_CACHE_LIMIT = 1 << 16


def _runs_on_host(target: Target, sigs: Sequence[TensorSig]) -> bool:
    """FP8 data a target lacks is still device data: modeled as cFP8 (`_fp8_rate_dtype`)."""
    return any(not target.supports(dtype) and dtype not in _FP8_TYPES + _SCALE_TYPES for dtype, _ in sigs)


def runs_on_host(op: str, sigs: Sequence[TensorSig], target: Target | None = None) -> bool:
    """Whether an op with these (dtype, shape) operands is a host fallback for its dtypes: a dtype
    the NeuronCore has no type for (float64, complex) that is neither emulated float64 arithmetic
    nor data movement nor a selection (FP64_SELECTION_OPS). FP8 types a generation lacks run
    as cFP8 (trn1's e5m2)."""
    return (not _fp64_emulated(op, sigs) and not _fp64_selection(op, sigs)
            and _runs_on_host(target or get_target(), sigs))


def op_cost(op: str, inputs: Sequence[TensorSig], outputs: Sequence[TensorSig],
            target: Target | None = None, *, fallback: bool = False,
            host_seconds: float | None = None) -> Cost:
    """Modeled cost of one eager kernel for aten op `op` ("aten::mm", "aten::add.Tensor", ...).

    inputs/outputs: (dtype, shape) of each tensor argument/result, in schema order (pass
    the written tensors as outputs for in-place and out= ops). fallback=True, or any dtype
    the target lacks (float64, complex, ...), prices a host-CPU fallback: transfers over the
    host link plus `host_seconds`. Never raises for an unknown op. Cached by signature.
    """
    target = target or get_target()
    inputs, outputs = tuple(inputs), tuple(outputs)
    key = (op, inputs, outputs, target.name, fallback)
    cost = _cache.get(key)
    if cost is None:
        if not fallback and _fp64_emulated(op, inputs + outputs):
            cost = _fp64_emulated_cost(target, op, inputs, outputs)
        elif fallback or (_runs_on_host(target, inputs + outputs) and not _fp64_selection(op, inputs + outputs)):
            cost = _fallback_cost(target, inputs, outputs)
        else:
            cost = _device_cost(target, op, inputs, outputs)
        if len(_cache) >= _CACHE_LIMIT:
            _cache.clear()
        _cache[key] = cost
    if host_seconds and cost.fallback:
        transfer = cost.duration_s
        bound = "compute" if host_seconds >= transfer else cost.bound
        cost = replace(cost, duration_s=transfer + host_seconds, bound=bound)
    return cost


def clear_cache() -> None:
    """Drop cached op costs (e.g. after editing a Target in a test)."""
    _cache.clear()
