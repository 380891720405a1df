"""The instruction implementations shared by `nki.language` and `nki.isa`.

Owns what one instruction does: operand checks (engine and buffer rules, partition
dimension, shapes, dtypes), masks, the vectorised host computation on whole tiles (fp32
engine math, rounding to the output dtype on write, fp32 PSUM accumulation), and the call
that charges it to its engine. `language.py` and `isa.py` are thin argument-parsing layers
over these functions.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np
import torch

from . import dtypes as _dt
from .errors import DTypeError, EngineRuleError, NKIError, ShapeError
from .simulator import Run, current
from .indexing import IndexExpr, Predicate
from .tile import HBM_KINDS, Tile

Scalar = (int, float, bool, np.integer, np.floating, np.bool_)


# --------------------------------------------------------------------------- operator tables
def _np_or_none(name):
    return getattr(np, name, None)


ALU: dict = {}      # op object -> torch binary function
REDUCE: dict = {}   # op object -> reduction name
ACT: dict = {}      # op object -> torch unary function
IS_BITVEC: set = set()


def register_alu(fn: Callable, *ops) -> None:
    for o in ops:
        if o is not None:
            ALU[o] = fn


def register_act(fn: Callable, *ops) -> None:
    for o in ops:
        if o is not None:
            ACT[o] = fn


def register_reduce(name: str, *ops) -> None:
    for o in ops:
        if o is not None:
            REDUCE[o] = name


register_alu(torch.add, np.add)
register_alu(torch.sub, np.subtract)
register_alu(torch.mul, np.multiply)
register_alu(torch.div, np.divide, np.true_divide)
register_alu(torch.maximum, np.maximum, np.max, np.amax)
register_alu(torch.minimum, np.minimum, np.min, np.amin)
register_alu(torch.pow, np.power)
register_alu(lambda a, b: (a == b).float(), np.equal)
register_alu(lambda a, b: (a != b).float(), np.not_equal)
register_alu(lambda a, b: (a > b).float(), np.greater)
register_alu(lambda a, b: (a >= b).float(), np.greater_equal)
register_alu(lambda a, b: (a < b).float(), np.less)
register_alu(lambda a, b: (a <= b).float(), np.less_equal)
register_alu(lambda a, b: ((a != 0) & (b != 0)).float(), np.logical_and)
register_alu(lambda a, b: ((a != 0) | (b != 0)).float(), np.logical_or)
register_alu(lambda a, b: ((a != 0) ^ (b != 0)).float(), np.logical_xor)
for _name, _fn in (("bitwise_and", torch.bitwise_and), ("bitwise_or", torch.bitwise_or),
                   ("bitwise_xor", torch.bitwise_xor), ("left_shift", torch.bitwise_left_shift),
                   ("right_shift", torch.bitwise_right_shift)):
    register_alu(_fn, _np_or_none(_name))
    IS_BITVEC.add(_np_or_none(_name))
register_reduce("sum", np.add, np.sum)
register_reduce("max", np.max, np.amax, np.maximum)
register_reduce("min", np.min, np.amin, np.minimum)
register_reduce("prod", np.multiply, np.prod)
register_reduce("all", np.logical_and, np.all)
register_reduce("any", np.logical_or, np.any)
register_act(torch.exp, np.exp)
register_act(torch.log, np.log)
register_act(torch.tanh, np.tanh)
register_act(torch.sqrt, np.sqrt)
register_act(torch.square, np.square)
register_act(torch.abs, np.abs, np.absolute)
register_act(torch.sin, np.sin)
register_act(torch.cos, np.cos)
register_act(torch.tan, np.tan)
register_act(torch.arctan, np.arctan)
register_act(torch.sign, np.sign)
register_act(torch.neg, np.negative)
register_act(torch.reciprocal, np.reciprocal)
register_act(torch.floor, np.floor)
register_act(torch.ceil, np.ceil)
register_act(torch.trunc, np.trunc)
register_act(lambda x: x, np.copy)


def alu(op: Any) -> Callable:
    try:
        return ALU[op]
    except (KeyError, TypeError):
        raise NKIError(f"{getattr(op, '__name__', op)!r} is not an ALU operator", rule="operator") from None


def act(op: Any) -> Callable:
    try:
        return ACT[op]
    except (KeyError, TypeError):
        raise NKIError(f"{getattr(op, '__name__', op)!r} is not an activation function",
                       rule="operator") from None


# --------------------------------------------------------------------------- operand helpers
def is_scalar(x: Any) -> bool:
    return isinstance(x, Scalar)


def scalar_value(x: Any) -> float:
    return x.item() if hasattr(x, "item") else x


def on_chip(t: Tile, what: str, allow_hbm: bool = False) -> None:
    if t.buf.kind in HBM_KINDS:
        if allow_hbm:
            return
        raise EngineRuleError(f"{what} is an HBM tensor; compute engines read and write only SBUF "
                              f"and PSUM: nl.load it into SBUF first")
    t.check_tile(what)


def values(x: Any, run: Run) -> torch.Tensor | float:
    """fp32 values of a tile operand (the engines compute in fp32), or the scalar itself."""
    if isinstance(x, Tile):
        if x.buf.tdtype in _dt.FLOAT_DTYPES:
            return x.float32()
        v = x.torch()
        return v.to(torch.int64) if v.dtype in (torch.uint16, torch.uint32) else v
    return scalar_value(x)


def as_2d(v, ndim: int):
    """A partition-only tile ([P] or [P, 1]) broadcasts along every free dimension of a
    higher-rank tile, like a [P, 1, ..., 1] tile."""
    if isinstance(v, torch.Tensor) and 1 <= v.dim() < ndim and all(s == 1 for s in v.shape[1:]):
        return v.view(v.shape[0], *([1] * (ndim - 1)))
    return v


def shape_2d(shape: tuple, ndim: int) -> tuple:
    return (shape[0],) + (1,) * (ndim - 1) if len(shape) == 1 and ndim > 1 else shape


def broadcast_shape(shapes: Sequence[tuple]) -> tuple:
    """numpy broadcasting of tile shapes ([P] vectors act as [P, 1])."""
    nd = max(len(s) for s in shapes)
    out = [1] * nd
    for s in shapes:
        s = shape_2d(tuple(s), nd)
        off = nd - len(s)
        for i, n in enumerate(s):
            cur = out[off + i]
            if n != cur and n != 1:
                if cur != 1:
                    raise ShapeError(f"tile shapes {[tuple(x) for x in shapes]} do not broadcast")
                out[off + i] = n
    return tuple(out)


def out_dtype(dtype: Any, *inputs: Any) -> torch.dtype:
    if dtype is not None:
        return _dt.to_torch(dtype)
    best = None
    for x in inputs:
        if isinstance(x, Tile):
            d = x.buf.tdtype
            if best is None or (d.is_floating_point and (not best.is_floating_point or d.itemsize > best.itemsize)):
                best = d
    return best or torch.float32


RESULT = "~result"  # name of buffers the simulator allocated for an instruction's result


def new_tile(run: Run, shape: tuple, tdtype: torch.dtype, buffer: str = "sbuf") -> Tile:
    return Tile.whole(run.allocate(buffer, tuple(shape), tdtype, name=RESULT))


def check_compute_dtype(run: Run, tdtype: torch.dtype, what: str) -> None:
    if tdtype == torch.float64:
        raise DTypeError(f"{what}: float64 is not a hardware type on {run.target.name}; "
                         f"use float32 (or bfloat16)")


# --------------------------------------------------------------------------- masks
def mask_narrowing(mask: Any, tiles: Sequence[Tile]) -> tuple[list, Predicate | None]:
    """Turn single-variable mask constraints into (axis, lo, hi) ranges; return the rest."""
    if mask is None or mask is True or (isinstance(mask, np.bool_) and mask):
        return [], None
    if mask is False or (isinstance(mask, np.bool_) and not mask):
        return [(None, 0, 0, -1)], None   # statically false: the instruction does nothing
    if not isinstance(mask, Predicate):
        raise NKIError("mask= must be a predicate on nl.arange indices, e.g. (i < n)", rule="mask")
    bounds: dict = {}
    rest = []
    for c in mask.constraints:
        if len(c.terms) != 1:
            rest.append(c)
            continue
        (v, a), = c.terms
        lo, hi = bounds.get((v.pos, v.size), (0, v.size - 1))
        # a*v + const >= 0
        if a > 0:
            lo = max(lo, math.ceil(-c.const / a))
        else:
            hi = min(hi, math.floor(c.const / -a))
        bounds[(v.pos, v.size)] = (lo, hi)
    return [(pos, size, lo, hi) for (pos, size), (lo, hi) in bounds.items()], (
        Predicate(tuple(rest)) if rest else None)


def offsets_of(ranges: list, ndim: int) -> tuple:
    """Start of the narrowed iteration space along each axis (for predicates)."""
    off = [0] * ndim
    for pos, size, lo, hi in ranges:
        if pos is not None and pos < ndim:
            off[pos] = lo
    return tuple(off)


def narrow(t: Any, ranges: list) -> Any:
    if not isinstance(t, Tile) or not ranges:
        return t
    for pos, size, lo, hi in ranges:
        if pos is None:
            return t.narrow(0, 0, 0) if t.shape else t
        if pos < len(t.shape) and t.shape[pos] == size and size > 1:
            t = t.narrow(pos, lo, max(0, hi - lo + 1))
    return t


# --------------------------------------------------------------------------- writes
def write(run: Run, dst: Tile, result: torch.Tensor | float, pred: Predicate | None = None,
          accumulate: bool = False) -> None:
    """Store an fp32 (or integer) result into `dst`, rounding to dst's dtype."""
    if not run.compute:
        return
    dst.buf.prepare_write()
    from .tile import GatherTile
    scatter = dst if isinstance(dst, GatherTile) else None  # indirect store: gather, update, scatter
    view = dst.torch()
    if isinstance(result, torch.Tensor) and result.shape != view.shape:
        if result.numel() == view.numel():
            result = result.reshape(view.shape)
        else:
            result = result.expand(view.shape) if result.dim() == view.dim() else \
                as_2d(result, view.dim()).expand(view.shape)
    if pred is not None:
        keep = pred.evaluate(view.shape, getattr(run, "offsets", None))
        if not isinstance(result, torch.Tensor):
            result = torch.tensor(result, dtype=torch.float32)
        if accumulate:
            result = torch.where(keep, result, torch.zeros((), dtype=result.dtype))
        else:
            result = torch.where(keep, result, view)
    if accumulate:
        view.add_(result)
    elif isinstance(result, torch.Tensor):
        view.copy_(result)
    elif view.dtype.is_floating_point:  # a float32 value rounds as the hardware casts it
        view.copy_(torch.tensor(float(result), dtype=torch.float32).expand(view.shape))
    else:
        view.fill_(result)
    if scatter is not None:
        scatter.scatter(view)


def same_partitions(dst: Tile, src_shape: tuple, what: str) -> None:
    if dst.shape and src_shape and dst.shape[0] != src_shape[0]:
        raise ShapeError(f"{what}: destination has {dst.shape[0]} partitions, result has {src_shape[0]}")
    n_dst = dst.per_partition()
    n_src = 1
    for s in src_shape[1:]:
        n_src *= s
    if n_dst != n_src:
        raise ShapeError(f"{what}: destination {tuple(dst.shape)} and result {tuple(src_shape)} differ "
                         f"in elements per partition")


# --------------------------------------------------------------------------- instructions
def elementwise(kind: str, fn: Callable, inputs: Sequence[Any], *, dtype: Any = None,
                dst: Tile | None = None, mask: Any = None, engine: str = "",
                out_shape: tuple | None = None, accumulate: bool = False) -> Tile:
    """Shared body of tensor_tensor / tensor_scalar / activation / copy / select ...:
    `fn` receives fp32 values (tiles as tensors, scalars as numbers)."""
    run = current()
    tiles = [x for x in inputs if isinstance(x, Tile)]
    for t in tiles:
        on_chip(t, kind)
    if out_shape is None:
        out_shape = broadcast_shape([t.shape for t in tiles]) if tiles else dst.shape
    tdtype = dst.buf.tdtype if dst is not None else out_dtype(dtype, *inputs)
    check_compute_dtype(run, tdtype, kind)
    fresh = dst is None
    if fresh:
        dst = new_tile(run, out_shape, tdtype)
    else:
        on_chip(dst, f"{kind} destination")
        same_partitions(dst, out_shape, kind)
    full = dst
    ranges, pred = mask_narrowing(mask, tiles + [dst])
    if ranges:
        inputs = [narrow(x, ranges) for x in inputs]
        dst = narrow(dst, ranges)
        tiles = [x for x in inputs if isinstance(x, Tile)]
    for t in tiles:
        t.region()
    dst.region()
    run.offsets = offsets_of(ranges, len(dst.shape))
    if run.compute:
        nd = max([len(t.shape) for t in tiles] + [len(dst.shape)])
        vals = [as_2d(values(x, run), nd) for x in inputs]
        write(run, dst, fn(*vals), pred, accumulate)
    reads = tiles + ([dst] if accumulate else [])
    cost = dict(partitions=dst.shape[0] if dst.shape else 1, free_elems=max(
        [t.per_partition() for t in tiles] + [dst.per_partition()]), dtype=tdtype)
    if fresh:
        run.issue_value(kind, reads, dst, engine, **cost)
        run.pending_ranges = ranges
    else:
        run.issue(kind, reads, [dst], engine, **cost)
    return full


def reduce_values(name: str, v: torch.Tensor, axes: tuple) -> torch.Tensor:
    if name == "sum":
        return v.sum(dim=axes)
    if name == "max":
        return v.amax(dim=axes)
    if name == "min":
        return v.amin(dim=axes)
    if name == "prod":
        out = v
        for a in sorted(axes, reverse=True):
            out = out.prod(dim=a)
        return out
    if name == "all":
        return (v != 0).flatten(1).all(dim=1).float() if axes else v
    if name == "any":
        return (v != 0).flatten(1).any(dim=1).float() if axes else v
    if name in ("bitwise_or", "bitwise_and"):
        raise NKIError("bitvec reductions are not supported by this simulator", rule="operator")
    raise NKIError(f"unknown reduction {name}", rule="operator")


def norm_axes(axis: Any, ndim: int, what: str) -> tuple:
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    axes = tuple(int(a) % ndim for a in axes)
    if 0 in axes:
        raise ShapeError(f"{what}: cannot reduce the partition dimension (axis 0) on the Vector "
                         f"engine; transpose first or use nc_matmul with a ones vector")
    return axes


def reduce(kind: str, name: str, data: Tile, axis: Any, *, dtype: Any = None, dst: Tile | None = None,
           keepdims: bool = False, negate: bool = False, scale: float = 1.0, mask: Any = None,
           engine: str = "") -> Tile:
    run = current()
    on_chip(data, kind)
    axes = norm_axes(axis, len(data.shape), kind)
    shape = tuple((1 if i in axes else s) for i, s in enumerate(data.shape)) if keepdims else \
        tuple(s for i, s in enumerate(data.shape) if i not in axes)
    tdtype = dst.buf.tdtype if dst is not None else out_dtype(dtype, data)
    fresh = dst is None
    if fresh:
        dst = new_tile(run, shape, tdtype)
    else:
        on_chip(dst, f"{kind} destination")
        same_partitions(dst, shape, kind)
    ranges, pred = mask_narrowing(mask, [data, dst])
    src, out = narrow(data, ranges), narrow(dst, ranges)
    src.region()
    out.region()
    if run.compute:
        v = values(src, run)
        r = reduce_values(name, v, axes)
        if negate:
            r = -r
        if scale != 1.0:
            r = r * scale
        write(run, out, r, None)
    cost = dict(partitions=src.shape[0], free_elems=src.per_partition(), dtype=tdtype)
    if fresh:
        run.issue_value(kind, [src], out, engine, **cost)
        run.pending_ranges = ranges
    else:
        run.issue(kind, [src], [out], engine, **cost)
    return dst


def matmul(stationary: Tile, moving: Tile, dst: Tile | None = None, *, accumulate: bool = True,
           mask: Any = None, what: str = "nc_matmul") -> Tile:
    """dst[M, N] (+)= stationary[K, M].T @ moving[K, N] on the Tensor engine, fp32 in PSUM."""
    run = current()
    operands = []
    for t in (stationary, moving):
        if isinstance(t, Tile) and t.buf.kind == "psum" and t.buf.name == RESULT:
            # an instruction result whose placement the kernel left to the compiler: it is
            # moved to SBUF (one charged copy), as the compiler does
            t = elementwise("tensor_copy", lambda v: v, [t])
            run.flush()
        operands.append(t)
    stationary, moving = operands
    for t, name in ((stationary, "stationary"), (moving, "moving")):
        if not isinstance(t, Tile):
            raise EngineRuleError(f"{what}: {name} operand must be an SBUF tile")
        if t.buf.kind != "sbuf":
            raise EngineRuleError(f"{what}: the {name} operand is in {t.buf.kind.upper()}; the Tensor "
                                  f"engine reads matmul operands from SBUF only")
        t.check_tile(f"{what} {name}")
        if t.buf.tdtype not in _dt.MATMUL_DTYPES:
            raise DTypeError(f"{what}: the Tensor engine does not multiply {t.buf.tdtype} "
                             f"(supported: fp8 e4m3/e5m2, bf16, fp16, tf32, fp32)")
    k, m = stationary.shape[0], stationary.per_partition()
    k2, n = moving.shape[0], moving.per_partition()
    if k != k2:
        raise ShapeError(f"{what}: contraction (partition) sizes differ: stationary {k}, moving {k2}",
                         rule="matmul-shape")
    limits = ((k, run.target.partitions, "contraction K (partition dim)"),
              (m, run.target.gemm_stationary_fmax, "stationary free size M"),
              (n, run.target.gemm_moving_fmax, "moving free size N"))
    for v, lim, name in limits:
        if v > lim:
            raise ShapeError(f"{what}: {name} = {v} exceeds {lim}; tile the matmul "
                             f"(stationary [K<=128, M<=128], moving [K<=128, N<=512])", rule="matmul-shape")
    fresh = dst is None
    if fresh:
        dst = new_tile(run, (m, n), torch.float32, "psum")
        accumulate = False
    else:
        if dst.buf.kind != "psum":
            raise EngineRuleError(f"{what}: the result must be written to PSUM, not {dst.buf.kind.upper()}")
        dst.check_tile(f"{what} destination")
        if dst.shape[0] != m or dst.per_partition() != n:
            raise ShapeError(f"{what}: destination {tuple(dst.shape)} does not match result ({m}, {n})",
                             rule="matmul-shape")
        if dst.buf.tdtype != torch.float32:
            raise DTypeError(f"{what}: PSUM accumulation is fp32; destination is {dst.buf.tdtype}")
    stationary.region()
    moving.region()
    dst.region()
    if run.compute:
        torch.set_num_threads(run.threads)  # the one op big enough to use the host's cores
        a = stationary.float32().reshape(k, m)
        b = moving.float32().reshape(k, n)
        dst.buf.prepare_write()
        out = dst.torch()
        out = out.view(m, n) if out.is_contiguous() else None
        if out is not None:
            if accumulate:
                out.addmm_(a.T, b)
            else:
                torch.mm(a.T, b, out=out)
        else:
            write(run, dst, a.T @ b, None, accumulate)
        torch.set_num_threads(1)
    run.flops += 2.0 * k * m * n
    cost = dict(partitions=m, free_elems=n, moving_free=n, contraction=k, dtype=stationary.buf.tdtype)
    reads = [stationary, moving] + ([dst] if accumulate else [])
    if fresh:
        run.issue_value("nc_matmul", reads, dst, **cost)
        run.pending_ranges = []
    else:
        run.issue("nc_matmul", reads, [dst], **cost)
    return dst


def transpose_pe(data: Tile, dst: Tile | None = None, engine: str = "") -> Tile:
    """[P, F] -> [F, P]: on the Tensor engine (into PSUM) or, for <= 32x32, the Vector engine."""
    run = current()
    on_chip(data, "nc_transpose")
    p, f = data.shape[0], data.per_partition()
    use_vector = engine == "vector" or (not engine and dst is not None and dst.buf.kind == "sbuf"
                                        and p <= 32 and f <= 32)
    if use_vector and (p > 32 or f > 32):
        raise ShapeError(f"nc_transpose on the Vector engine handles at most 32x32, got {p}x{f}")
    if not use_vector:
        if data.buf.kind != "sbuf":
            raise EngineRuleError("nc_transpose on the Tensor engine reads SBUF only")
        if p > 128 or f > 128:
            raise ShapeError(f"nc_transpose on the Tensor engine handles at most 128x128, got {p}x{f}")
    fresh = dst is None
    tdtype = data.buf.tdtype if use_vector else (torch.float32 if data.buf.tdtype == torch.float32
                                                 else data.buf.tdtype)
    if fresh:
        dst = new_tile(run, (f, p), tdtype, "sbuf" if use_vector else "psum")
    else:
        on_chip(dst, "nc_transpose destination")
        if not use_vector and dst.buf.kind != "psum":
            raise EngineRuleError("nc_transpose on the Tensor engine writes PSUM only")
        same_partitions(dst, (f, p), "nc_transpose")
    data.region()
    dst.region()
    if run.compute:
        write(run, dst, values(data, run).reshape(p, f).T, None)
    kind = "tensor_copy" if use_vector else "nc_transpose"
    cost = dict(partitions=p, free_elems=f, dtype=data.buf.tdtype)
    if fresh:
        run.issue_value(kind, [data], dst, "vector" if use_vector else "", **cost)
        run.pending_ranges = []
    else:
        run.issue(kind, [data], [dst], "vector" if use_vector else "", **cost)
    return dst


def _dma_runs(t: Tile) -> int:
    """Bytes of the longest contiguous run at the innermost end of an access pattern."""
    st = t.buf.strides
    flat = [sum(m * st[d] for d, m in mp) for mp in t.maps]
    run, expected = 1, 1
    for n, s in zip(reversed(t.shape), reversed(flat)):
        if n == 1:
            continue
        if s != expected:
            break
        run *= n
        expected *= n
    return run * t.buf.tdtype.itemsize


def dma(dst: Tile, src: Tile, mask: Any = None, what: str = "dma_copy", fresh: bool = False,
        src_checked: bool = False, layout: Tile | None = None) -> Tile:
    """A DMA transfer between HBM and SBUF (or SBUF<->SBUF, HBM<->HBM), with dtype cast.
    `src_checked`: the source was checked before a DMA transpose permuted its dimensions;
    `layout`: the access the descriptors follow, when not `src` (a transpose reads the
    source's rows in their own order; the engine permutes them on the way)."""
    run = current()
    # (a PSUM source stored to HBM is staged through SBUF by the compiler; priced as one transfer)
    for t in ((dst,) if src_checked else (src, dst)):
        if t.buf.kind not in HBM_KINDS:
            t.check_tile(what)
    ranges, pred = mask_narrowing(mask, [src, dst])
    src, dst = narrow(src, ranges), narrow(dst, ranges)
    if src.numel() != dst.numel():
        raise ShapeError(f"{what}: source {tuple(src.shape)} and destination {tuple(dst.shape)} "
                         f"have different sizes")
    src.region()
    dst.region()
    if run.compute:
        write(run, dst, src.torch(), pred)
    hbm = dst if dst.buf.kind in HBM_KINDS else (layout if layout is not None else src)
    nbytes = dst.numel() * dst.buf.tdtype.itemsize
    run.hbm_bytes += nbytes * ((src.buf.kind in HBM_KINDS) + (dst.buf.kind in HBM_KINDS))
    cost = dict(partitions=min(src.shape[0] if src.shape else 1, 128),
                free_elems=1, dtype=dst.buf.tdtype, nbytes=nbytes,
                contiguous_bytes=min(_dma_runs(hbm), nbytes), src=_mem(src), dst=_mem(dst))
    if fresh:  # nl.load into a new tile: `t[...] = nl.load(...)` retargets the transfer
        run.issue_value("dma", [src], dst, **cost)
        run.pending_ranges = ranges
    else:
        run.issue("dma", [src], [dst], **cost)
    return dst


def _mem(t: Tile) -> str:
    return "hbm" if t.buf.kind in HBM_KINDS else t.buf.kind


def partition_major(t: Tile) -> Tile:
    """A whole multi-block on-chip tensor (blocks before its par_dim) viewed with the
    partition dimension first, so one instruction can sweep all its blocks."""
    p = t.buf.pdim
    if p == 0 or not t.is_whole:
        return t
    order = [p] + [d for d in range(len(t.shape)) if d != p]
    return Tile(t.buf, tuple(t.shape[d] for d in order), t.base, tuple(t.maps[d] for d in order))


def memset(dst: Tile, value: float, mask: Any = None, fresh: bool = False, engine: str = "") -> Tile:
    run = current()
    full = dst
    dst = partition_major(dst)
    on_chip(dst, "memset")
    ranges, pred = mask_narrowing(mask, [dst])
    d = narrow(dst, ranges)
    d.region()
    if run.compute:
        write(run, d, float(scalar_value(value)), pred)
    cost = dict(partitions=d.shape[0] if d.shape else 1, free_elems=d.per_partition(), dtype=d.buf.tdtype)
    if fresh:  # initialising a new allocation: scheduled once the allocation is bound
        run.issue_value("memset", [], d, engine, **cost)
        run.pending_ranges = ranges
    else:
        run.issue("memset", [], [d], engine, **cost)
    return full


def iota_values(expr: Any, shape: tuple) -> torch.Tensor:
    if isinstance(expr, IndexExpr):
        return expr.evaluate(shape).expand(*shape).float()
    raise NKIError("iota needs an affine expression of nl.arange indices", rule="iota")
