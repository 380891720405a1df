"""`nki.language` (nl): the tile-level NKI language.

Owns the public names kernels use: dtypes, buffers (`sbuf`, `psum`, `hbm`, `shared_hbm`),
`tile_size`, allocation (`ndarray`, `zeros`, `full`, ...), `load`/`store`, indexing helpers
(`arange`, `mgrid`, `ds`, `par_dim`), loop iterators, SPMD queries, and the math functions
that return new tiles. Each call is one (sometimes two) hardware instructions executed by
`engines.py`; arithmetic on tiles (`a + b`, `t[...] += x`) maps here too.
"""
from __future__ import annotations

import builtins
import sys as _sys
from typing import Any, Sequence

import numpy as np
import torch

from . import dtypes as _dt
from . import engines as _E
from .dtypes import (bfloat16, float4_e2m1fn_x4, float8_e4m3, float8_e4m3fn, float8_e4m3fn_x4,  # noqa: F401
                     float8_e5m2, float8_e5m2_x4, tfloat32)
from .errors import NKIError, ShapeError
from .simulator import current
from . import tile as _tile
from .indexing import ArangeRoot, GridIndex, IndexExpr, MGrid, Predicate, ds, par_dim  # noqa: F401
from .tile import Tile  # noqa: F401

# ----------------------------------------------------------------------------- dtypes
float32, float16, int8, int16, int32, uint8, uint16, uint32 = (
    np.float32, np.float16, np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32)
int64, bool_ = np.int64, np.bool_


def finfo(dtype: Any):
    """Float limits of an NKI dtype (`nl.finfo(nl.bfloat16).min`)."""
    return torch.finfo(_dt.to_torch(dtype))


# ----------------------------------------------------------------------------- buffers
class _Buffer(str):
    """A memory name (`nl.sbuf`, `nl.psum`, ...). Calling it returns itself (allocator API)."""

    def __call__(self, *args, **kwargs):
        return self

    def mod_alloc(self, *args, **kwargs):
        return self

    def auto_alloc(self, *args, **kwargs):
        return self


class ModAlloc(str):
    """A direct allocation (`nki.compiler.sbuf.mod_alloc(...)`): leading block dimensions
    rotate over `tiles` physical buffers, so capacity is charged for those only."""

    def __new__(cls, kind: str, tiles: tuple = (), base: int | None = None):
        obj = str.__new__(cls, kind)
        obj.tiles = tuple(int(t) for t in tiles)
        obj.base = base
        return obj


sbuf = _Buffer("sbuf")
psum = _Buffer("psum")
hbm = _Buffer("hbm")
private_hbm = _Buffer("private_hbm")
shared_hbm = _Buffer("shared_hbm")


class _TileSize:
    """`nl.tile_size`: hardware tile limits (hardware.md, "Tiles and instructions")."""

    pmax = 128
    gemm_stationary_fmax = 128
    gemm_moving_fmax = 512
    psum_fmax = 512
    bn_stats_fmax = 512
    psum_min_align = 4
    sbuf_min_align = 1

    @property
    def total_available_sbuf_size(self) -> int:
        from ..hardware.targets import get_target
        return get_target().sbuf_usable_bytes_per_partition


tile_size = _TileSize()


class fp32:  # noqa: N801
    min = float(np.finfo(np.float32).min)
    max = float(np.finfo(np.float32).max)


class bfp16:  # noqa: N801
    min = -3.3895313892515355e38
    max = 3.3895313892515355e38


# ----------------------------------------------------------------------------- indexing
mgrid = MGrid()


def arange(*args: int) -> ArangeRoot:
    """`nl.arange(stop)` / `nl.arange(start, stop)`: an index axis, placed with [:, None]."""
    start, stop = (0, args[0]) if len(args) == 1 else (args[0], args[1])
    return ArangeRoot(int(start), int(stop))


# ----------------------------------------------------------------------------- loops
def affine_range(*args: int, **kwargs) -> range:
    """Parallel loop: iterations carry no dependency and may overlap on the engines."""
    return range(*args)


def static_range(*args: int, **kwargs) -> range:
    """Fully unrolled loop (same semantics as affine_range in the simulator)."""
    return range(*args)


def sequential_range(*args: int, **kwargs):
    """Loop with a carried dependency: iterations run in order on every engine (the
    compiler may not interleave them); data dependencies are tracked as everywhere."""
    run = current()
    run.flush()
    run.seq_depth += 1
    try:
        for i in range(*args):
            run.new_iteration()
            yield i
    finally:
        run.seq_depth -= 1


def _loop_iterations(start: int, stop: int, step: int):
    """Iterations of a loop the hardware runs (not unrolled): in order on every engine, each
    paying a compare-and-branch (one instruction's issue cost)."""
    run = current()
    run.flush()
    run.seq_depth += 1
    try:
        for i in range(start, stop, step):
            run.new_iteration()
            run.issue("sync", [], [], partitions=1, free_elems=1, dtype=torch.int32)
            yield i
    finally:
        run.seq_depth -= 1


def _bounds(start: Any, stop: Any, step: Any, what: str) -> tuple[int, int, int]:
    from .registers import register_value
    if stop is None:
        start, stop = 0, start
    step = int(step)
    if step <= 0:
        raise NKIError(f"{what}: step must be a positive compile-time int, got {step}", rule="loop")
    return register_value(start, what), register_value(stop, what), step


def dynamic_range(start: Any, stop: Any = None, step: int = 1):
    """A loop the hardware runs with bounds known at run time (ints or registers)."""
    lo, hi, st = _bounds(start, stop, step, "dynamic_range")
    return _loop_iterations(lo, hi, st)


def fori_loop(lower: Any, upper: Any, body_fun: Any, step: int = 1) -> None:
    """`for i in range(lower, upper, step): body_fun(i)` as a hardware loop; `i` is a register."""
    from .registers import VirtualRegister
    lo, hi, st = _bounds(lower, upper, step, "fori_loop")
    for i in _loop_iterations(lo, hi, st):
        body_fun(VirtualRegister(i))


def while_loop(init: Any, body_fun: Any) -> None:
    """`r = init; while r != 0: r = body_fun(r)` as a hardware loop (registers)."""
    from .registers import VirtualRegister, register_value
    r = init
    run = current()
    run.flush()
    run.seq_depth += 1
    try:
        while register_value(r, "while_loop") != 0:
            run.new_iteration()
            run.issue("sync", [], [], partitions=1, free_elems=1, dtype=torch.int32)
            r = body_fun(r if isinstance(r, VirtualRegister) else VirtualRegister(register_value(r, "while_loop")))
    finally:
        run.seq_depth -= 1


range = builtins.range  # noqa: A001 - `nl.range`: a specialization-time (unrolled) loop


class _LoopReduce:
    """Value of `nl.loop_reduce(x, op, loop_indices)`: assigning it reduces into the target
    across the loop's iterations (the first iteration assigns)."""

    __slots__ = ("value", "op", "first", "mask", "dtype")

    def __init__(self, value, op, first, mask, dtype):
        self.value, self.op, self.first, self.mask, self.dtype = value, op, first, mask, dtype


def loop_reduce(x: Tile, op: Any, loop_indices: Sequence[int], *, mask: Any = None, dtype: Any = None,
                **kwargs) -> "_LoopReduce":
    """Reduce `x` with `op` over the iterations of the loops in `loop_indices` into the tensor
    the result is assigned to."""
    first = builtins.all(int(i) == 0 for i in loop_indices)
    return _LoopReduce(x, op, first, mask, dtype)


# ----------------------------------------------------------------------------- SPMD
def program_id(axis: int) -> int:
    pid = current().program_id
    if axis >= len(pid):
        raise NKIError(f"program_id({axis}) but the launch grid has {len(pid)} dimensions", rule="spmd")
    return pid[axis]


def num_programs(axes: int | None = None) -> int:
    grid = current().grid
    if axes is None:
        return int(np.prod(grid)) if grid else 1
    return grid[axes] if axes < len(grid) else 1


def program_ndim() -> int:
    return len(current().grid)


class nc:  # noqa: N801
    """`nl.nc(n)`: a launch-grid dimension spread over n physical NeuronCores."""

    def __init__(self, n: int):
        self.n = int(n)

    def __index__(self):
        return self.n


def spmd_dim(*args):
    return args[0] if len(args) == 1 else int(np.prod([int(a) for a in args]))


# ----------------------------------------------------------------------------- allocation
def _split_shape(shape: Any) -> tuple[tuple, int]:
    if isinstance(shape, (int, par_dim)):
        shape = (shape,)
    dims, pdim = [], 0
    for i, s in enumerate(shape):
        if isinstance(s, par_dim):
            pdim = i
        dims.append(int(s))
    return tuple(dims), pdim


def ndarray(shape: Any, dtype: Any = np.float32, buffer: Any = sbuf, name: str = "",
            **kwargs) -> Tile:
    """Allocate a tensor in `buffer` (`sbuf` default, `psum`, `hbm`, `shared_hbm`).
    `address=(start_partition, byte_offset)` places it (NKI 0.4+ direct allocation): the
    kernel manages the memory, so capacity is checked by address range, not by liveness."""
    return _alloc(shape, dtype, buffer, None, name, kwargs.get("address"))


def _alloc(shape, dtype, buffer, fill, name="", address=None) -> Tile:
    run = current()
    dims, pdim = _split_shape(shape)
    kind = str(buffer or "sbuf")
    tdtype = _dt.to_torch(dtype)
    if kind == "shared_hbm":
        key = run.shared_count
        run.shared_count += 1
        buf = run.shared.get(key)
        if buf is None or buf.shape != dims:
            buf = run.shared[key] = run.allocate(kind, dims, tdtype, pdim, fill, name)
        return Tile.whole(buf)
    base = getattr(buffer, "base", None)
    if address is not None and kind in ("sbuf", "psum"):
        start, base = int(address[0]), int(address[1])
        if start + (dims[pdim] if dims else 1) > run.target.partitions:
            raise ShapeError(f"{kind} tensor of shape {dims} placed at partition {start} ends past "
                             f"partition {run.target.partitions - 1}")
    t = Tile.whole(run.allocate(kind, dims, tdtype, pdim, 0 if (fill is not None and kind == "psum")
                                else None if kind in ("sbuf",) else fill, name,
                                blocks=getattr(buffer, "tiles", None), base=base))
    if fill is not None and kind == "sbuf" or (kind == "psum" and fill):
        _E.memset(t, fill, fresh=True)
    # A zeroed PSUM tile costs nothing: the first matmul accumulating into it starts a new
    # accumulation group (the compiler drops the memset).
    return t


def zeros(shape: Any, dtype: Any = np.float32, buffer: Any = sbuf, name: str = "", **kw) -> Tile:
    return _alloc(shape, dtype, buffer, 0.0, name)


def ones(shape: Any, dtype: Any = np.float32, buffer: Any = sbuf, name: str = "", **kw) -> Tile:
    return _alloc(shape, dtype, buffer, 1.0, name)


def full(shape: Any, fill_value: float, dtype: Any = np.float32, buffer: Any = sbuf, name: str = "",
         **kw) -> Tile:
    return _alloc(shape, dtype, buffer, fill_value, name)


def empty_like(x: Tile, dtype: Any = None, buffer: Any = None, **kw) -> Tile:
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer)


def zeros_like(x: Tile, dtype: Any = None, buffer: Any = None, **kw) -> Tile:
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer)


def ones_like(x: Tile, dtype: Any = None, buffer: Any = None, **kw) -> Tile:
    return ones(x.shape, dtype or x.dtype, buffer or x.buffer)


def shared_constant(value: Any, dtype: Any = None, **kw) -> Tile:
    """A constant HBM tensor from a host array."""
    run = current()
    t = torch.as_tensor(np.asarray(value))
    tdtype = _dt.to_torch(dtype) if dtype is not None else t.dtype
    buf = run.allocate("shared_hbm", tuple(t.shape), tdtype)
    if run.compute:
        buf.data.copy_(t)
    return Tile.whole(buf)


# ----------------------------------------------------------------------------- memory
def load(src: Tile, *, mask: Any = None, dtype: Any = None, **kwargs) -> Tile:
    """DMA an HBM tensor (access pattern) into a new SBUF tile."""
    run = current()
    if not isinstance(src, Tile):
        raise NKIError("nl.load needs an HBM tensor (or an indexed part of one)", rule="load")
    tdtype = _dt.to_torch(dtype) if dtype is not None else src.buf.tdtype
    if not src.shape:  # a scalar element loads as a [1, 1] tile
        src = Tile(src.buf, (1, 1), src.base, ((), ()))
    dst = Tile.whole(run.allocate("sbuf", tuple(src.shape), tdtype))
    _E.dma(dst, src, mask, "nl.load", fresh=True)
    return dst


def store(dst: Tile, value: Any, *, mask: Any = None, **kwargs) -> None:
    """DMA a tile into an HBM tensor (access pattern)."""
    if not isinstance(value, Tile):
        run = current()
        tmp = Tile.whole(run.allocate("sbuf", tuple(dst.shape), dst.buf.tdtype))
        _E.memset(tmp, value)
        value = tmp
    if dst.buf.kind not in ("hbm", "shared_hbm", "private_hbm"):
        _assign(dst, value)
        return
    _E.dma(dst, value, mask, "nl.store")


def load_transpose2d(src: Tile, *, mask: Any = None, dtype: Any = None, **kwargs) -> Tile:
    """DMA a [A, B] HBM tensor into a [B, A] SBUF tile (element-wise descriptors)."""
    if len(src.shape) != 2:
        raise ShapeError("load_transpose2d needs a 2-D source")
    a, b = src.shape
    t = Tile(src.buf, (b, a), src.base, (src.maps[1], src.maps[0]))
    return load(t, mask=mask, dtype=dtype)


def _assign(dst: Tile, value: Any) -> None:
    """`dst[...] = value`: retarget the instruction that produced value, else copy."""
    run = current()
    if isinstance(value, _LoopReduce):
        if value.first:
            _assign(dst, value.value)
        else:
            _E.elementwise("tensor_tensor", _E.alu(value.op), [dst, value.value], dst=dst, mask=value.mask)
        return
    if not isinstance(value, Tile):
        if dst.buf.kind in ("hbm", "shared_hbm", "private_hbm"):
            store(dst, value)
        else:
            _E.memset(dst, value)
        return
    if (value.buf is dst.buf and value.shape == dst.shape and value.base == dst.base
            and value.maps == dst.maps):
        return
    dst_hbm = dst.buf.kind in ("hbm", "shared_hbm", "private_hbm")
    src_hbm = value.buf.kind in ("hbm", "shared_hbm", "private_hbm")
    if not dst_hbm and not src_hbm and run.retarget(value, dst):
        if run.pending[0] != "dma":
            dst.check_tile("assignment destination")
        ranges = run.pending_ranges
        v, d = _E.narrow(value, ranges), _E.narrow(dst, ranges)
        _E.same_partitions(dst, value.shape, "assignment")
        run.pending = run.pending[:2] + (d,) + run.pending[3:]
        if run.compute:
            _E.write(run, d, v.torch())
        return
    if dst_hbm or src_hbm:
        _E.dma(dst, value, None, "assignment")
    else:
        _E.elementwise("tensor_copy", lambda x: x, [value], dst=dst)


def _inplace(dst: Tile, other: Any, op: str) -> Tile:
    """`dst += x` and friends; a matmul result added into PSUM accumulates in place."""
    run = current()
    if (op == "add" and isinstance(other, Tile) and dst.buf.kind == "psum"
            and run.pending is not None and run.pending[0] == "nc_matmul"
            and run.pending[2].buf is other.buf):
        _E.same_partitions(dst, other.shape, "PSUM accumulation")
        run.retarget(other, dst, accumulate=True)
        if run.compute:
            _E.write(run, dst, other.torch(), accumulate=True)
        return dst
    fn = {"add": torch.add, "subtract": torch.sub, "multiply": torch.mul, "divide": torch.div}[op]
    _binary(fn, dst, other, dst=dst)
    return dst


# ----------------------------------------------------------------------------- math
def _binary(fn, x, y, *, dtype=None, mask=None, dst=None, **kw) -> Tile:
    if not isinstance(x, Tile) and not isinstance(y, Tile):
        return fn(torch.as_tensor(x), torch.as_tensor(y)).item()
    tiles = [t for t in (x, y) if isinstance(t, Tile)]
    scalar_like = len(tiles) == 1 or any(
        _is_column(t, other) for t, other in ((x, y), (y, x)) if isinstance(t, Tile) and isinstance(other, Tile))
    kind = "tensor_scalar" if scalar_like else "tensor_tensor"
    return _E.elementwise(kind, fn, [x, y], dtype=dtype, mask=mask, dst=dst)


def _is_column(t: Tile, other: Tile) -> bool:
    """t is a per-partition vector ([P], [P, 1]) broadcast against a wider tile."""
    return (len(t.shape) == 1 or t.per_partition() == 1) and other.per_partition() > 1


def _make_binary(name: str, fn, *np_aliases):
    def op(x, y, *, dtype=None, mask=None, **kwargs):
        return _binary(fn, x, y, dtype=dtype, mask=mask)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Element-wise `{name}` of two tiles (or a tile and a scalar), on the Vector engine."
    _E.register_alu(fn, op, *np_aliases)
    return op


add = _make_binary("add", torch.add)
subtract = _make_binary("subtract", torch.sub)
multiply = _make_binary("multiply", torch.mul)
divide = _make_binary("divide", torch.div)
maximum = _make_binary("maximum", torch.maximum)
minimum = _make_binary("minimum", torch.minimum)
power = _make_binary("power", torch.pow)
equal = _make_binary("equal", lambda a, b: (a == b).float())
not_equal = _make_binary("not_equal", lambda a, b: (a != b).float())
greater = _make_binary("greater", lambda a, b: (a > b).float())
greater_equal = _make_binary("greater_equal", lambda a, b: (a >= b).float())
less = _make_binary("less", lambda a, b: (a < b).float())
less_equal = _make_binary("less_equal", lambda a, b: (a <= b).float())
logical_and = _make_binary("logical_and", lambda a, b: ((a != 0) & (b != 0)).float())
logical_or = _make_binary("logical_or", lambda a, b: ((a != 0) | (b != 0)).float())
logical_xor = _make_binary("logical_xor", lambda a, b: ((a != 0) ^ (b != 0)).float())
mod = _make_binary("mod", torch.remainder)
fmod = _make_binary("fmod", torch.fmod)
bitwise_and = _make_binary("bitwise_and", torch.bitwise_and)
bitwise_or = _make_binary("bitwise_or", torch.bitwise_or)
bitwise_xor = _make_binary("bitwise_xor", torch.bitwise_xor)
left_shift = _make_binary("left_shift", torch.bitwise_left_shift)
right_shift = _make_binary("right_shift", torch.bitwise_right_shift)
for _b in (bitwise_and, bitwise_or, bitwise_xor, left_shift, right_shift):
    _E.IS_BITVEC.add(_b)


def _make_unary(name: str, fn, *np_aliases, engine: str = ""):
    def op(x, *, dtype=None, mask=None, **kwargs):
        if not isinstance(x, Tile):
            return fn(torch.as_tensor(float(x))).item()
        return _E.elementwise("activation", fn, [x], dtype=dtype, mask=mask, engine=engine)
    op.__name__ = op.__qualname__ = name
    op.__doc__ = f"Element-wise `{name}`, on the Scalar engine (activation function)."
    _E.register_act(fn, op, *np_aliases)
    return op


def _gelu_tanh(x):
    return torch.nn.functional.gelu(x, approximate="tanh")


exp = _make_unary("exp", torch.exp)
log = _make_unary("log", torch.log)
sqrt = _make_unary("sqrt", torch.sqrt)
rsqrt = _make_unary("rsqrt", torch.rsqrt)
square = _make_unary("square", torch.square)
tanh = _make_unary("tanh", torch.tanh)
sigmoid = _make_unary("sigmoid", torch.sigmoid)
relu = _make_unary("relu", torch.relu)
gelu = _make_unary("gelu", torch.nn.functional.gelu)
gelu_apprx_tanh = _make_unary("gelu_apprx_tanh", _gelu_tanh)
silu = _make_unary("silu", torch.nn.functional.silu)
softplus = _make_unary("softplus", torch.nn.functional.softplus)
mish = _make_unary("mish", torch.nn.functional.mish)
erf = _make_unary("erf", torch.erf)
sin = _make_unary("sin", torch.sin)
cos = _make_unary("cos", torch.cos)
tan = _make_unary("tan", torch.tan)
arctan = _make_unary("arctan", torch.arctan)
abs = _make_unary("abs", torch.abs)  # noqa: A001
sign = _make_unary("sign", torch.sign)
negative = _make_unary("negative", torch.neg)
reciprocal = _make_unary("reciprocal", torch.reciprocal)
ceil = _make_unary("ceil", torch.ceil, engine="vector")
floor = _make_unary("floor", torch.floor, engine="vector")
trunc = _make_unary("trunc", torch.trunc, engine="vector")
invert = _make_unary("invert", torch.bitwise_not, engine="vector")
logical_not = _make_unary("logical_not", lambda a: (a == 0).float(), engine="vector")
identity = _make_unary("identity", lambda a: a)


def _gelu_dx(x):
    cdf = 0.5 * (1.0 + torch.erf(x * 0.7071067811865476))
    return cdf + x * torch.exp(-0.5 * x * x) * 0.3989422804014327


def _silu_dx(x):
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


gelu_dx = _make_unary("gelu_dx", _gelu_dx)
silu_dx = _make_unary("silu_dx", _silu_dx)
erf_dx = _make_unary("erf_dx", lambda x: 1.1283791670955126 * torch.exp(-x * x))


def _gelu_sigmoid(x):
    return x * torch.sigmoid(1.702 * x)


def _gelu_sigmoid_dx(x):
    s = torch.sigmoid(1.702 * x)
    return s + 1.702 * x * s * (1 - s)


# GELU's sigmoid approximation x*sigmoid(1.702x) (NKI's Swish activation) and its derivative
gelu_apprx_sigmoid = _make_unary("gelu_apprx_sigmoid", _gelu_sigmoid)
gelu_apprx_sigmoid_dx = _make_unary("gelu_apprx_sigmoid_dx", _gelu_sigmoid_dx)


class NKIObject:
    """Base class NKI kernels derive their configuration objects from (NKI 0.4+): on the
    hardware compiler it marks a class whose instances the tracer may pass around; on the
    software NeuronCore every Python object can be.

    Like NKI's, a subclass's plain class attributes (`size = None`) become fields, so that
    `@dataclass` over it takes them as keyword arguments."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        import dataclasses
        own = cls.__dict__.get("__annotations__")
        ann = dict(own) if own else {}
        for name, value in list(cls.__dict__.items()):
            if name.startswith("__") or name in ann or callable(value) or isinstance(
                    value, (staticmethod, classmethod, property)):
                continue
            ann[name] = Any
            if isinstance(value, (list, dict, set)):
                setattr(cls, name, dataclasses.field(default_factory=lambda v=value: type(v)(v)))
        cls.__annotations__ = ann


def copy(x: Tile, *, dtype: Any = None, mask: Any = None, **kwargs) -> Tile:
    """Copy a tile (e.g. PSUM -> SBUF), casting to `dtype`."""
    return _E.elementwise("tensor_copy", lambda v: v, [x], dtype=dtype, mask=mask)


_E.register_act(lambda v: v, copy)


def static_cast(x: Any, dtype: Any, **kwargs) -> Any:
    """Cast a tile (Vector engine copy) or, outside a kernel, a host array."""
    if isinstance(x, Tile):
        return copy(x, dtype=dtype)
    tdtype = _dt.to_torch(dtype)
    if isinstance(x, torch.Tensor):
        return x.to(tdtype)
    if isinstance(x, (list, tuple)):
        return type(x)(static_cast(v, dtype) for v in x)
    nd = _dt.numpy_dtype(tdtype)
    if isinstance(x, np.ndarray) and nd is not None:
        return x.astype(nd)
    return torch.as_tensor(np.asarray(x)).to(tdtype)  # numpy cannot hold it: a torch tensor


def where(condition: Tile, x: Any, y: Any, *, dtype=None, mask=None, **kwargs) -> Tile:
    return _E.elementwise("tensor_tensor", lambda c, a, b: torch.where(c != 0, a, b),
                          [condition, x, y], dtype=dtype or (x.dtype if isinstance(x, Tile) else None),
                          mask=mask)


def _reducer(name: str, np_aliases=()):
    def op(x: Tile, axis: Any, *, dtype=None, mask=None, keepdims: bool = False, **kwargs) -> Tile:
        return _E.reduce("tensor_reduce", name, x, axis, dtype=dtype, keepdims=keepdims, mask=mask)
    op.__name__ = {"sum": "sum", "max": "max", "min": "min", "prod": "prod", "all": "all",
                   "any": "any"}[name]
    op.__doc__ = f"Reduce free axes with `{name}` on the Vector engine."
    _E.register_reduce(name, op)
    return op


sum = _reducer("sum")  # noqa: A001
max = _reducer("max")  # noqa: A001
min = _reducer("min")  # noqa: A001
prod = _reducer("prod")
all = _reducer("all")  # noqa: A001
_E.register_reduce("sum", add)
_E.register_reduce("max", maximum)
_E.register_reduce("min", minimum)
_E.register_reduce("prod", multiply)
_E.register_alu(torch.maximum, max)
_E.register_alu(torch.minimum, min)


def mean(x: Tile, axis: Any, *, dtype=None, mask=None, keepdims: bool = False, **kwargs) -> Tile:
    """Mean over free axes: one Vector-engine reduction with the 1/n scale folded in."""
    axes = _E.norm_axes(axis, len(x.shape), "mean")
    n = 1
    for a in axes:
        n *= x.shape[a]
    return _E.reduce("tensor_reduce", "sum", x, axis, dtype=dtype, keepdims=keepdims, mask=mask,
                     scale=1.0 / n)


def var(x: Tile, axis: Any, *, dtype=None, mask=None, **kwargs) -> Tile:
    m = mean(x, axis, keepdims=True, mask=mask)
    return mean(square(subtract(x, m, mask=mask), mask=mask), axis, dtype=dtype, mask=mask)


def matmul(x: Tile, y: Tile, transpose_x: bool = False, *, mask: Any = None, **kwargs) -> Tile:
    """x @ y on the Tensor engine (result in PSUM, fp32). With transpose_x the left operand is
    given as [K, M]; otherwise it is transposed on the Tensor engine first."""
    if not transpose_x:
        x = copy(_E.transpose_pe(x))
    return _E.matmul(x, y, None, mask=mask, what="nl.matmul")


def transpose(x: Tile, *, dtype: Any = None, mask: Any = None, **kwargs) -> Tile:
    """2-D transpose of a tile (Tensor engine through PSUM, copied back to SBUF)."""
    t = _E.transpose_pe(x)
    return copy(t, dtype=dtype or x.dtype) if t.buf.kind == "psum" else t


def broadcast_to(x: Tile, shape: Sequence[int]) -> Tile:
    return x.broadcast_to(shape)


def expand_dims(x: Tile, axis: int) -> Tile:
    shape = list(x.shape)
    shape.insert(axis, 1)
    maps = list(x.maps)
    maps.insert(axis, ())
    return Tile(x.buf, tuple(shape), x.base, tuple(maps))


def dropout(x: Tile, rate: Any, *, dtype: Any = None, mask: Any = None, **kwargs) -> Tile:
    """Zero elements with probability `rate` (Vector engine); survivors are not rescaled,
    as in NKI's dropout instruction."""
    def fn(v, p):
        keep = torch.rand(v.shape) >= (p if not isinstance(p, torch.Tensor) else p.expand(v.shape))
        return v * keep
    return _E.elementwise("tensor_scalar", fn, [x, rate], dtype=dtype, mask=mask)


def rand(shape: Any, dtype: Any = np.float32, **kwargs) -> Tile:
    """Uniform [0, 1) random tile (GpSimd engine)."""
    run = current()
    dims, _ = _split_shape(shape)
    t = _E.new_tile(run, dims, _dt.to_torch(dtype))
    return _E.elementwise("iota", lambda: torch.rand(dims), [], dst=t, out_shape=dims)


def random_seed(seed: Any, **kwargs) -> None:
    torch.manual_seed(int(seed) if not isinstance(seed, Tile) else 0)


def shared_identity_matrix(n: int, dtype: Any = np.uint8, **kwargs) -> Tile:
    """An n x n identity matrix in HBM (used to transpose through the Tensor engine)."""
    return shared_constant(np.identity(n), dtype=dtype)


def softmax(x: Tile, axis: Any, *, dtype: Any = None, mask: Any = None, **kwargs) -> Tile:
    m = max(x, axis, keepdims=True, mask=mask)
    e = exp(subtract(x, m, mask=mask), mask=mask)
    s = sum(e, axis, keepdims=True, mask=mask)
    return divide(e, s, dtype=dtype, mask=mask)


def rms_norm(x: Tile, w: Tile, axis: Any, n: int, epsilon: float = 1e-6, *, dtype=None,
             mask=None, **kwargs) -> Tile:
    ss = mean(square(x, mask=mask), axis, keepdims=True, mask=mask)
    r = rsqrt(add(ss, epsilon, mask=mask), mask=mask)
    return multiply(multiply(x, r, mask=mask), w, dtype=dtype, mask=mask)


def device_print(prefix: str, x: Any, **kwargs) -> None:
    run = current()
    if run.compute and isinstance(x, Tile):
        print(prefix, x.torch())
    else:
        print(prefix, x)


def num_partitions() -> int:
    return current().target.partitions


_tile.set_operators(_sys.modules[__name__])  # tiles' operators are this module's functions
