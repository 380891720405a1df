"""`nki.isa` (nisa): one call, one hardware instruction.

Owns argument parsing for both generations of the ISA API: the legacy form that returns a
new tile (`y = nisa.activation(op=nl.exp, data=x)`) and the destination-first form of
NKI 0.3+ (`nisa.activation(dst=y, op=nl.exp, data=x)` or `nisa.activation(y, nl.exp, x)`),
which writes into `dst`. The work itself is done by `engines.py`.
"""
from __future__ import annotations

import enum
from typing import Any

import numpy as np
import torch

from . import constants  # noqa: F401 - nisa.constants
from . import engines as _E
from .constants import dge_mode, matmul_perf_mode, oob_mode, reduce_cmd  # noqa: F401
from .registers import (VirtualRegister, register_alloc, register_load, register_move,  # noqa: F401
                        register_store)
from .selection import max8, nc_find_index8, nc_match_replace8, range_select  # noqa: F401
from .errors import NKIError, ShapeError
from .simulator import current
from .indexing import IndexExpr, Predicate
from .tile import Tile

tensor_engine = "tensor"
vector_engine = "vector"
scalar_engine = "scalar"
gpsimd_engine = "gpsimd"
unknown_engine = ""
dma_engine = "dma"


class engine(str, enum.Enum):  # noqa: N801 - NKI 0.3 spelling (nisa.engine.vector)
    tensor = "tensor"
    vector = "vector"
    scalar = "scalar"
    gpsimd = "gpsimd"
    unknown = ""
    dma = "dma"


class nc_version(enum.IntEnum):  # noqa: N801
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version() -> nc_version:
    return nc_version({"trn1": 2, "trn2": 3, "trn3": 4}.get(current().target.name, 3))


def core_barrier(data: Tile, cores: Any = (0, 1), **kwargs: Any) -> None:
    """Wait until every core in `cores` has reached this point with `data` written. On one
    core it orders nothing beyond program order and costs one sync instruction; across the
    cores of an `nl.nc(n)` grid the programs meet as at a collective (collectives.py)."""
    run = current()
    if run.ncores > 1:
        from .collectives import barrier_across_cores
        barrier_across_cores(data, cores)
        return
    run.issue("sync", [data], [data], partitions=1, free_elems=1, dtype=data.buf.tdtype)


def _eng(e: Any) -> str:
    return e.value if isinstance(e, engine) else (e or "")


def _take_dst(args: tuple, kwargs: dict, new_form: bool, first: str = "") -> tuple[Tile | None, tuple]:
    """Split off the destination: `dst=` by keyword, or the leading positional tile in the
    destination-first form (`new_form`, or a positional tile while `first`, the operand the
    legacy form takes first, comes by keyword: `nisa.tensor_tensor(t, data1=a, data2=b, op=f)`)."""
    if "dst" in kwargs:
        return kwargs.pop("dst"), args
    if new_form or (first and first in kwargs and args and isinstance(args[0], Tile)):
        return args[0], args[1:]
    return None, args


def _tiles_leading(args: tuple) -> int:
    n = 0
    for a in args:
        if not isinstance(a, Tile):
            break
        n += 1
    return n


def _finish(dst: Tile | None, result: Tile) -> Tile:
    return result if dst is None else dst


# ----------------------------------------------------------------------------- Tensor engine
def nc_matmul(*args, **kwargs) -> Tile:
    """dst (+)= stationary.T @ moving on the Tensor engine: [K,M] x [K,N] -> [M,N] fp32 PSUM."""
    dst, args = _take_dst(args, kwargs, _tiles_leading(args) >= 3, "stationary")
    names = ("stationary", "moving")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    accumulate = kwargs.pop("accumulate", None)
    out = _E.matmul(vals["stationary"], vals["moving"], dst,
                    accumulate=True if accumulate is None else bool(accumulate),
                    mask=kwargs.get("mask"))
    return out


def nc_transpose(*args, **kwargs) -> Tile:
    """[P, F] -> [F, P] on the Tensor engine (into PSUM) or the Vector engine (<= 32x32)."""
    dst, args = _take_dst(args, kwargs, _tiles_leading(args) >= 2, "data")
    data = args[0] if args else kwargs.pop("data")
    return _E.transpose_pe(data, dst, _eng(kwargs.get("engine")))


# ----------------------------------------------------------------------------- Scalar engine
def activation(*args, **kwargs) -> Tile:
    """op(data * scale + bias) on the Scalar engine, optionally reducing into reduce_res."""
    dst, args = _take_dst(args, kwargs, bool(args) and isinstance(args[0], Tile))
    names = ("op", "data", "bias", "scale")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    op, data = vals["op"], vals["data"]
    bias, scale = vals.get("bias"), vals.get("scale", 1.0)
    fn = _E.act(op)
    inputs = [data]
    has_scale = isinstance(scale, Tile) or scale != 1.0
    if has_scale:
        inputs.append(scale)
    if bias is not None:
        inputs.append(bias)

    def compute(x, *rest):
        i = 0
        if has_scale:
            x = x * rest[i]
            i += 1
        if bias is not None:
            x = x + rest[i]
        return fn(x)
    out = _E.elementwise("activation", compute, inputs, dtype=kwargs.get("dtype"), dst=dst,
                         mask=kwargs.get("mask"), out_shape=data.shape, engine=_eng(kwargs.get("engine")))
    cmd = kwargs.get("reduce_cmd", reduce_cmd.reset_reduce if kwargs.get("reduce_res") is not None
                     else reduce_cmd.idle)
    _accumulate_registers(out, cmd, kwargs.get("reduce_res"), kwargs.get("reduce_op", np.add))
    return out


def _accumulate_registers(data: Tile, cmd: "reduce_cmd", res: Tile | None, op: Any) -> None:
    """The Scalar engine's 128 reduction registers (one per partition), driven by reduce_cmd."""
    run = current()
    if cmd is reduce_cmd.idle and res is None:
        return
    regs = getattr(run, "act_regs", None)
    if regs is None or cmd in (reduce_cmd.reset, reduce_cmd.reset_reduce):
        regs = run.act_regs = torch.zeros(data.shape[0])
    if cmd in (reduce_cmd.reduce, reduce_cmd.reset_reduce) and run.compute:
        v = _E.values(data, run)
        regs = run.act_regs = regs[:v.shape[0]] + v.reshape(v.shape[0], -1).sum(dim=1)
    if res is not None:
        if run.compute:
            _E.write(run, res, regs)
        # the registers are the Scalar engine's: reading them out is its own small instruction
        run.issue("tensor_reduce", [data], [res], "scalar", partitions=data.shape[0], free_elems=1,
                  dtype=res.buf.tdtype)


def activation_reduce(*args, **kwargs) -> Tile:
    return activation(*args, **kwargs)


def _reduce_into(res: Tile, data: Tile, op: Any) -> None:
    """The fused free-axis reduction of activation / tensor_scalar_reduce (no extra charge
    beyond its own small instruction)."""
    run = current()
    name = _E.REDUCE.get(op, "sum")
    if run.compute:
        v = _E.values(data, run)
        r = _E.reduce_values(name, v.reshape(v.shape[0], -1), (1,))
        _E.write(run, res, r)
    run.issue("tensor_reduce", [data], [res], partitions=data.shape[0], free_elems=1,
              dtype=res.buf.tdtype)


def exponential(*args, **kwargs) -> Tile:
    dst, args = _take_dst(args, kwargs, _tiles_leading(args) >= 2, "data")
    data = args[0] if args else kwargs.pop("data")
    return activation(op=np.exp, data=data, dst=dst, **kwargs) if dst is not None else \
        activation(op=np.exp, data=data, **kwargs)


# ----------------------------------------------------------------------------- Vector engine
def tensor_tensor(*args, **kwargs) -> Tile:
    """Element-wise data1 <op> data2 on the Vector engine."""
    new = len(args) >= 3 and isinstance(args[0], Tile) and isinstance(args[2], Tile)
    dst, args = _take_dst(args, kwargs, new, "data1")
    names = ("data1", "data2", "op")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    d1, d2 = vals["data1"], vals["data2"]
    if d1.buf.kind == "psum" and d2.buf.kind == "psum":
        from .errors import EngineRuleError
        raise EngineRuleError("tensor_tensor: data1 and data2 cannot both be in PSUM")
    fn = _E.alu(vals["op"])
    return _E.elementwise("tensor_tensor", fn, [d1, d2], dtype=kwargs.get("dtype"), dst=dst,
                          mask=kwargs.get("mask"), engine=_eng(kwargs.get("engine")))


def _scalar_operand(x: Any) -> Any:
    if isinstance(x, Tile) and len(x.shape) >= 1 and x.per_partition() != 1:
        raise ShapeError(f"tensor_scalar operand must be a scalar or a [P, 1] vector, got {tuple(x.shape)}")
    return x


def tensor_scalar(*args, **kwargs) -> Tile:
    """(data <op0> operand0) <op1> operand1, operands scalars or per-partition vectors."""
    new = len(args) >= 2 and isinstance(args[0], Tile) and isinstance(args[1], Tile)
    dst, args = _take_dst(args, kwargs, new, "data")
    names = ("data", "op0", "operand0", "reverse0", "op1", "operand1", "reverse1")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    data = vals["data"]
    f0 = _E.alu(vals["op0"])
    o0 = _scalar_operand(vals["operand0"])
    r0 = vals.get("reverse0", False)
    op1 = vals.get("op1")
    f1 = _E.alu(op1) if op1 is not None else None
    o1 = _scalar_operand(vals.get("operand1"))
    r1 = vals.get("reverse1", False)
    inputs = [data, o0] + ([o1] if f1 is not None else [])

    def compute(x, a, b=None):
        x = f0(a, x) if r0 else f0(x, a)
        if f1 is not None:
            x = f1(b, x) if r1 else f1(x, b)
        return x
    return _E.elementwise("tensor_scalar", compute, inputs, dtype=kwargs.get("dtype"), dst=dst,
                          mask=kwargs.get("mask"), out_shape=data.shape, engine=_eng(kwargs.get("engine")))


def tensor_scalar_reduce(*args, **kwargs) -> Tile:
    reduce_res = kwargs.pop("reduce_res")
    reduce_op = kwargs.pop("reduce_op", np.add)
    out = tensor_scalar(*args, **kwargs)
    _reduce_into(reduce_res, out, reduce_op)
    return out


def scalar_tensor_tensor(*args, **kwargs) -> Tile:
    """(data <op0> operand0) <op1> operand1; operand0 a scalar/vector, operand1 a full tile."""
    new = bool(args) and isinstance(args[0], Tile) and len(args) >= 2 and isinstance(args[1], Tile)
    dst, args = _take_dst(args, kwargs, new, "data")
    names = ("data", "op0", "operand0", "op1", "operand1", "reverse0", "reverse1")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    data = vals["data"]
    f0, f1 = _E.alu(vals["op0"]), _E.alu(vals["op1"])
    r0, r1 = vals.get("reverse0", False), vals.get("reverse1", False)

    def compute(x, a, b):
        x = f0(a, x) if r0 else f0(x, a)
        return f1(b, x) if r1 else f1(x, b)
    return _E.elementwise("scalar_tensor_tensor", compute,
                          [data, _scalar_operand(vals["operand0"]), vals["operand1"]],
                          dtype=kwargs.get("dtype"), dst=dst, mask=kwargs.get("mask"),
                          out_shape=data.shape)


def tensor_reduce(*args, **kwargs) -> Tile:
    """Reduce free axes of data with op (add, max, min, multiply), optionally negated."""
    dst, args = _take_dst(args, kwargs, bool(args) and isinstance(args[0], Tile))
    names = ("op", "data", "axis")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    op = vals["op"]
    name = _E.REDUCE.get(op)
    if name is None:
        raise NKIError(f"{getattr(op, '__name__', op)!r} is not a reduction operator", rule="operator")
    return _E.reduce("tensor_reduce", name, vals["data"], vals["axis"], dtype=kwargs.get("dtype"),
                     dst=dst, keepdims=kwargs.get("keepdims", False) or (dst is not None),
                     negate=kwargs.get("negate", False), mask=kwargs.get("mask"))


def tensor_copy(*args, **kwargs) -> Tile:
    """Copy (and cast) a tile within SBUF/PSUM on the Vector, Scalar or GpSimd engine."""
    dst, args = _take_dst(args, kwargs, _tiles_leading(args) >= 2, "src")
    src = args[0] if args else kwargs.pop("src")
    eng = _eng(kwargs.get("engine"))
    if eng == "gpsimd" and (src.buf.kind == "psum" or (dst is not None and dst.buf.kind == "psum")):
        from .errors import EngineRuleError
        raise EngineRuleError("tensor_copy: the GpSimd engine cannot access PSUM")
    return _E.elementwise("tensor_copy", lambda v: v, [src], dtype=kwargs.get("dtype"), dst=dst,
                          mask=kwargs.get("mask"), out_shape=src.shape, engine=eng)


def reciprocal(*args, **kwargs) -> Tile:
    dst, args = _take_dst(args, kwargs, _tiles_leading(args) >= 2, "data")
    data = args[0] if args else kwargs.pop("data")
    return _E.elementwise("reciprocal", torch.reciprocal, [data], dtype=kwargs.get("dtype"), dst=dst,
                          mask=kwargs.get("mask"), engine=_eng(kwargs.get("engine")))


def tensor_tensor_scan(*args, **kwargs) -> Tile:
    """Per partition: res[:, i] = (data0[:, i] <op0> res[:, i-1]) <op1> data1[:, i]."""
    new = len(args) >= 4 and isinstance(args[0], Tile) and not callable(args[3])
    dst, args = _take_dst(args, kwargs, new, "data0")
    names = ("data0", "data1", "initial", "op0", "op1", "reverse0", "reverse1")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    f0, f1 = _E.alu(vals["op0"]), _E.alu(vals["op1"])
    r0, r1 = vals.get("reverse0", False), vals.get("reverse1", False)
    init = vals["initial"]

    def compute(d0, d1, *rest):
        p = d0.shape[0]
        d0 = d0.reshape(p, -1)
        d1 = d1.expand(p, -1) if d1.shape[0] == 1 else d1.reshape(p, -1)
        prev = (rest[0].reshape(p, 1) if rest else torch.full((p, 1), float(init))).reshape(p)
        if f0 is torch.mul and f1 is torch.add and not r0 and not r1:
            return _linear_scan(d0, d1, prev)
        out = torch.empty_like(d0)
        for i in range(d0.shape[1]):
            x = f0(prev, d0[:, i]) if r0 else f0(d0[:, i], prev)
            prev = f1(d1[:, i], x) if r1 else f1(x, d1[:, i])
            out[:, i] = prev
        return out
    inputs = [vals["data0"], vals["data1"]] + ([init] if isinstance(init, Tile) else [])
    return _E.elementwise("tensor_tensor_scan", compute, inputs, dtype=kwargs.get("dtype"), dst=dst,
                          mask=kwargs.get("mask"), out_shape=vals["data0"].shape)


def _linear_scan(a: torch.Tensor, b: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
    """h_i = a_i * h_{i-1} + b_i, sequential in fp32 (the engine's order) but in chunks."""
    out = torch.empty_like(a)
    h = h0.clone()
    for i in range(a.shape[1]):
        h = torch.addcmul(b[:, i], a[:, i], h)
        out[:, i] = h
    return out


# ----------------------------------------------------------------------------- GpSimd engine
def _pattern_values(shape: tuple, pattern: Any, offset: Any, channel_multiplier: Any) -> torch.Tensor:
    """offset + partition * channel_multiplier + sum_k index_k * step_k over the free
    elements of a [P, ...] tile, the free elements enumerated by `pattern` [[step, num], ...]
    (outermost first): the affine value of NKI 0.4+ iota / affine_select."""
    free = 1
    for n in shape[1:]:
        free *= n
    nums = [int(n) for _, n in pattern]
    total = 1
    for n in nums:
        total *= n
    if total != free:
        raise ShapeError(f"pattern {pattern} covers {total} elements a partition; the tile {tuple(shape)} "
                         f"has {free}")
    val = torch.zeros(nums, dtype=torch.float64)
    for k, (step, n) in enumerate(pattern):
        view = [1] * len(nums)
        view[k] = int(n)
        val = val + float(step) * torch.arange(int(n), dtype=torch.float64).view(view)
    chan = torch.arange(shape[0], dtype=torch.float64).view(-1, 1) * float(channel_multiplier)
    out = float(offset) + chan + val.reshape(1, -1)
    return out.reshape(shape)


def iota(*args, **kwargs) -> Tile:
    """Materialise an affine expression of nl.arange indices as a tile (GpSimd engine); NKI
    0.4+ form `iota(dst, pattern, offset, channel_multiplier=0)`."""
    dst, args = _take_dst(args, kwargs, bool(args) and isinstance(args[0], Tile))
    if "pattern" in kwargs or (args and isinstance(args[0], (list, tuple))):
        names = ("pattern", "offset", "channel_multiplier")
        vals = dict(zip(names, args))
        vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
        shape = dst.shape
        return _E.elementwise("iota", lambda: _pattern_values(shape, vals["pattern"], vals.get("offset", 0),
                                                              vals.get("channel_multiplier", 0)),
                              [], dst=dst, out_shape=shape)
    expr = args[0] if args else kwargs.pop("expr")
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype", np.int32)
    run = current()
    if isinstance(expr, IndexExpr):
        nd = max([v.ndim for v in expr.variables()] or [1])
        shape = [1] * nd
        for v in expr.variables():
            shape[v.pos] = v.size
        shape = tuple(shape)
    else:
        shape = dst.shape
    return _E.elementwise("iota", lambda: _E.iota_values(expr, shape), [], dtype=dtype,
                          dst=dst, out_shape=shape, mask=kwargs.get("mask"))


def affine_select(*args, **kwargs) -> Tile:
    """out = pred ? on_true_tile : on_false_value, pred an affine predicate (GpSimd)."""
    dst, args = _take_dst(args, kwargs, bool(args) and isinstance(args[0], Tile))
    if "pattern" in kwargs or (args and isinstance(args[0], (list, tuple))):
        return _affine_select_pattern(dst, args, kwargs)
    names = ("pred", "on_true_tile", "on_false_value")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    pred = vals["pred"]
    if not isinstance(pred, Predicate):
        raise NKIError("affine_select needs an affine predicate such as (i_p >= i_f)", rule="affine_select")
    t = vals["on_true_tile"]
    fv = float(vals["on_false_value"])
    shape = t.shape

    def compute(x):
        keep = pred.evaluate(x.shape, current().offsets)
        return torch.where(keep, x, torch.tensor(fv, dtype=x.dtype))
    return _E.elementwise("affine_select", compute, [t], dtype=kwargs.get("dtype"), dst=dst,
                          mask=kwargs.get("mask"), out_shape=shape)


def _affine_select_pattern(dst: Tile, args: tuple, kwargs: dict) -> Tile:
    """NKI 0.4+ form: dst = cmp_op(affine value, 0) ? on_true_tile : on_false_value."""
    names = ("pattern", "offset", "channel_multiplier", "on_true_tile", "on_false_value", "cmp_op")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    t = vals["on_true_tile"]
    fv = float(vals["on_false_value"])
    cmp = vals.get("cmp_op") or _equal
    shape = t.shape
    pattern, offset, mult = vals["pattern"], vals.get("offset", 0), vals.get("channel_multiplier", 0)

    def compute(x):
        value = _pattern_values(tuple(x.shape), pattern, offset, mult)
        keep = _E.alu(cmp)(value, torch.zeros((), dtype=value.dtype)) != 0
        return torch.where(keep, x, torch.tensor(fv, dtype=x.dtype))
    return _E.elementwise("affine_select", compute, [t], dst=dst, out_shape=shape)


def _equal(a, b):
    return a == b


def memset(*args, **kwargs) -> Tile:
    """Fill a tile with a constant (Vector engine). Legacy: memset(shape, value, dtype)."""
    if "dst" in kwargs or (args and isinstance(args[0], Tile)):
        dst, args = _take_dst(args, kwargs, True)
        value = args[0] if args else kwargs.pop("value")
        return _E.memset(dst, value, kwargs.get("mask"), engine=_eng(kwargs.get("engine")))
    shape = args[0] if args else kwargs.pop("shape")
    value = args[1] if len(args) > 1 else kwargs.pop("value")
    dtype = args[2] if len(args) > 2 else kwargs.pop("dtype")
    from . import language as nl
    t = nl.ndarray(shape, dtype=dtype)
    return _E.memset(t, value, kwargs.get("mask"))


def dropout(*args, **kwargs) -> Tile:
    dst, args = _take_dst(args, kwargs, _tiles_leading(args) >= 2, "data")
    data = args[0] if args else kwargs.pop("data")
    prob = args[1] if len(args) > 1 else kwargs.pop("prob")
    from . import language as nl
    out = nl.dropout(data, prob, dtype=kwargs.get("dtype"))
    return out if dst is None else _copy_into(dst, out)


def _copy_into(dst: Tile, value: Tile) -> Tile:
    from . import language as nl
    nl._assign(dst, value)
    return dst


# ----------------------------------------------------------------------------- statistics
def bn_stats(*args, **kwargs) -> Tile:
    """Per partition (count, mean, var*count) of even and odd elements: 6 values."""
    dst, args = _take_dst(args, kwargs, _tiles_leading(args) >= 2, "data")
    data = args[0] if args else kwargs.pop("data")
    if data.per_partition() > 512:
        raise ShapeError(f"bn_stats: free size {data.per_partition()} exceeds bn_stats_fmax 512")

    def compute(x):
        x = x.reshape(x.shape[0], -1)
        out = []
        for part in (x[:, 0::2], x[:, 1::2]):
            n = part.shape[1]
            m = part.mean(dim=1) if n else torch.zeros(x.shape[0])
            v = ((part - m[:, None]) ** 2).sum(dim=1) if n else torch.zeros(x.shape[0])
            out += [torch.full((x.shape[0],), float(n)), m, v]
        return torch.stack(out, dim=1)
    return _E.elementwise("bn_stats", compute, [data], dtype=kwargs.get("dtype"), dst=dst,
                          mask=kwargs.get("mask"), out_shape=(data.shape[0], 6))


def bn_aggr(*args, **kwargs) -> Tile:
    """Combine bn_stats groups (count, mean, var*count) into (mean, variance) per partition."""
    dst, args = _take_dst(args, kwargs, _tiles_leading(args) >= 2, "data")
    data = args[0] if args else kwargs.pop("data")

    def compute(x):
        x = x.reshape(x.shape[0], -1, 3)
        n, m, vn = x[..., 0], x[..., 1], x[..., 2]
        total = n.sum(dim=1).clamp_min(1e-30)
        mean = (n * m).sum(dim=1) / total
        var = (vn + n * (m - mean[:, None]) ** 2).sum(dim=1) / total
        return torch.stack([mean, var], dim=1)
    return _E.elementwise("bn_aggr", compute, [data], dtype=kwargs.get("dtype"), dst=dst,
                          mask=kwargs.get("mask"), out_shape=(data.shape[0], 2))


# ----------------------------------------------------------------------------- DMA
def dma_copy(*args, **kwargs) -> Tile:
    """Copy between HBM and SBUF (either direction) with the DMA engines; casts dtype."""
    dst = kwargs.pop("dst", None)
    src = kwargs.pop("src", None)
    if dst is None:
        dst, args = args[0], args[1:]
    if src is None:
        src = args[0]
    return _E.dma(dst, src, kwargs.get("mask"), "dma_copy")


_DMA_TRANSPOSE_AXES = {2: (1, 0), 3: (2, 1, 0), 4: (3, 1, 2, 0)}


def dma_transpose(*args, **kwargs) -> Tile:
    """Transpose while copying (DMA engine): a 2-D source is permuted (1, 0), 3-D (2, 1, 0),
    4-D (3, 1, 2, 0), or as `axes` says (one of those)."""
    dst, args = _take_dst(args, kwargs, _tiles_leading(args) >= 2, "src")
    src = args[0] if args else kwargs.pop("src")
    axes = kwargs.get("axes")
    nd = len(src.shape)
    if nd not in _DMA_TRANSPOSE_AXES:
        raise ShapeError(f"dma_transpose: the source has {nd} dimensions; it takes 2, 3 or 4")
    axes = tuple(axes) if axes is not None else _DMA_TRANSPOSE_AXES[nd]
    if axes != _DMA_TRANSPOSE_AXES[nd]:
        raise ShapeError(f"dma_transpose: axes {axes} are not supported for a {nd}-D source; "
                         f"supported: {_DMA_TRANSPOSE_AXES[nd]}")
    if src.buf.kind in ("sbuf", "psum"):
        src.check_tile("dma_transpose source")
    t = Tile(src.buf, tuple(src.shape[a] for a in axes), src.base, tuple(src.maps[a] for a in axes))
    if dst is None:
        run = current()
        dst = Tile.whole(run.allocate("sbuf", t.shape, src.buf.tdtype))
    # Assumption: the DMA engine's transpose reads the source's contiguous rows and permutes
    # them on the way, so descriptors follow the source's own layout (no published penalty).
    return _E.dma(dst, t, kwargs.get("mask"), "dma_transpose", src_checked=True, layout=src)


def tensor_partition_reduce(*args, **kwargs) -> Tile:
    """Reduce across partitions (axis 0) with op (add, max, ...) on the GpSimd engine:
    [P, F] -> [1, F]."""
    dst, args = _take_dst(args, kwargs, bool(args) and isinstance(args[0], Tile))
    names = ("op", "data")
    vals = dict(zip(names, args))
    vals.update({k: kwargs.pop(k) for k in names if k in kwargs})
    data = vals["data"]
    name = _E.REDUCE.get(vals["op"])
    if name is None:
        raise NKIError(f"{getattr(vals['op'], '__name__', vals['op'])!r} is not a reduction operator",
                       rule="operator")

    def compute(x):
        return _E.reduce_values(name, x.reshape(x.shape[0], -1).T, (1,)).reshape((1,) + tuple(x.shape[1:]))
    return _E.elementwise("tensor_partition_reduce", compute, [data], dtype=kwargs.get("dtype"), dst=dst,
                          out_shape=(1,) + tuple(data.shape[1:]), mask=kwargs.get("mask"))
