"""Tiles and buffers: the memory side of the simulator (the index expressions tiles are
indexed with are indexing.py's).

Owns
- `Buffer`: one allocation in HBM, SBUF or PSUM, its host storage (a torch tensor, or none
  in timing-only runs), its partition dimension and its capacity charge;
- `Tile`: an affine view of a buffer, which is what kernels hold. A view maps each of its
  dimensions to buffer dimensions with integer coefficients, so slices, `nl.ds`, arange
  expressions, transposed and strided access patterns and broadcasts are all one type.
  Views are bounds-checked lazily, when an instruction uses them (after masks narrow them),
  and materialise as a zero-copy `as_strided` of the buffer.
"""
from __future__ import annotations

import itertools
from typing import Any, Iterable, Sequence

import torch

from . import dtypes as _dt
from .errors import NKIError, OutOfBoundsError, PartitionDimError
from .indexing import IndexExpr, IndexVar

HBM_KINDS = frozenset({"hbm", "shared_hbm", "private_hbm"})
ON_CHIP = frozenset({"sbuf", "psum"})
_ids = itertools.count(1)


# --------------------------------------------------------------------------- buffers
class Buffer:
    """One allocation. `data` is the host storage (None in timing-only runs)."""

    __slots__ = ("kind", "shape", "tdtype", "data", "pdim", "strides", "id", "version",
                 "_f32", "_f32_version", "orig", "staged", "charge", "pool", "name", "__weakref__")

    def __init__(self, kind: str, shape: tuple, tdtype: torch.dtype, data: torch.Tensor | None,
                 pdim: int = 0, name: str = "", orig: torch.Tensor | None = None):
        self.kind, self.shape, self.tdtype, self.data, self.pdim = kind, shape, tdtype, data, pdim
        st, acc = [], 1
        for n in reversed(shape):
            st.append(acc)
            acc *= n
        self.strides = tuple(reversed(st))
        self.id = next(_ids)
        self.version = 0
        self._f32 = None
        self._f32_version = -1
        self.orig = orig          # caller's tensor this HBM buffer wraps (copy-on-write)
        self.staged = False
        self.charge = None        # (pool, bytes) released when the buffer dies
        self.pool = None
        self.name = name

    def __del__(self):
        if self.charge is not None and self.pool is not None:
            try:
                self.pool.release(self.charge)
            except Exception:  # interpreter shutdown
                pass

    coarse = False  # dependency tracking at whole-buffer granularity

    def storage(self) -> torch.Tensor:
        return self.data

    def float32(self) -> torch.Tensor:
        """fp32 copy of the storage, cached until the buffer is written again."""
        if self.tdtype == torch.float32:
            return self.data
        if self._f32_version != self.version:
            self._f32 = self.data.float()
            self._f32_version = self.version
        return self._f32

    def prepare_write(self) -> None:
        """Called before every write: stage caller-owned storage, invalidate caches."""
        self.version += 1
        if self.orig is not None and not self.staged and self.data is not None:
            self.data = self.data.clone()
            self.staged = True


class AliasBuffer(Buffer):
    """A reshaped view of another buffer (same memory, its own logical shape)."""

    __slots__ = ("parent",)
    coarse = True

    def __init__(self, parent: Buffer, shape: tuple):
        Buffer.__init__(self, parent.kind, shape, parent.tdtype, None, 0, parent.name)
        self.parent = parent
        self.id = parent.id

    def storage(self) -> torch.Tensor:
        d = self.parent.storage()
        return None if d is None else d.view(self.shape)

    def float32(self) -> torch.Tensor:
        return self.parent.float32().view(self.shape)

    def prepare_write(self) -> None:
        self.parent.prepare_write()


class FlatBuffer(AliasBuffer):
    """Another buffer's memory seen as flat rows (HBM: one row; SBUF/PSUM: one row a
    partition), possibly reinterpreted as another dtype: what access patterns address."""

    __slots__ = ()

    def __init__(self, parent: Buffer, tdtype: torch.dtype):
        on_chip = parent.kind in ("sbuf", "psum")
        nbytes = parent.tdtype.itemsize
        for n in parent.shape:
            nbytes *= n
        p = parent.shape[parent.pdim] if on_chip and parent.shape else 1
        row = nbytes // p
        if row % tdtype.itemsize:
            raise NKIError(f"cannot view {row} B rows of a {parent.kind} tensor as {tdtype}: "
                           f"the row size is not a multiple of {tdtype.itemsize} B", rule="tile-shape")
        shape = (p, row // tdtype.itemsize) if on_chip else (row // tdtype.itemsize,)
        if on_chip and parent.pdim:
            raise NKIError(f"access patterns on a {parent.kind} tensor whose partition dimension is not "
                           "its first are not supported; allocate it partition-first", rule="partition-dim")
        AliasBuffer.__init__(self, parent, shape)
        self.tdtype = tdtype

    def storage(self) -> torch.Tensor:
        d = self.parent.storage()
        return None if d is None else d.reshape(-1).view(self.tdtype).view(self.shape)

    def float32(self) -> torch.Tensor:
        d = self.storage()
        return d if d.dtype == torch.float32 else d.float()


# --------------------------------------------------------------------------- tiles (views)
class Tile:
    """An affine view of a buffer; what NKI kernels call tensors and tiles."""

    __slots__ = ("buf", "shape", "base", "maps", "_region", "__weakref__")
    __array_priority__ = 1000  # numpy scalars defer to our operators

    def __init__(self, buf: Buffer, shape: tuple, base: tuple, maps: tuple):
        self.buf, self.shape, self.base, self.maps = buf, shape, base, maps
        self._region = None

    @staticmethod
    def whole(buf: Buffer) -> "Tile":
        return Tile(buf, buf.shape, (0,) * len(buf.shape), tuple(((d, 1),) for d in range(len(buf.shape))))

    # -- metadata ---------------------------------------------------------------------------
    @property
    def dtype(self):
        return _dt.to_nki(self.buf.tdtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def buffer(self) -> str:
        return self.buf.kind

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"Tile({self.buf.kind}, shape={tuple(self.shape)}, dtype={self.dtype})"

    def __iter__(self):
        raise TypeError("NKI tiles are not iterable; index them instead")

    def __bool__(self):
        raise NKIError("a tile's value is not known at trace time; NKI control flow cannot depend "
                       "on tile contents", rule="control-flow")

    @property
    def is_whole(self) -> bool:
        return self.shape == self.buf.shape and not any(self.base) and all(
            m == ((d, 1),) for d, m in enumerate(self.maps))

    # -- indexing ---------------------------------------------------------------------------
    def __getitem__(self, key) -> "Tile":
        return self._index(key)

    def __setitem__(self, key, value) -> None:
        dst = self._index(key)
        if value is dst:
            return
        _ops()._assign(dst, value)

    def _index(self, key) -> "Tile":
        if not isinstance(key, tuple):
            key = (key,)
        if any(k is Ellipsis for k in key):
            i = next(i for i, k in enumerate(key) if k is Ellipsis)
            fill = len(self.shape) - (len(key) - 1)
            key = key[:i] + (slice(None),) * fill + key[i + 1:]
        if len(key) > len(self.shape):
            extra = key[len(self.shape):]
            if not all(_unit_index(k) for k in extra):
                raise OutOfBoundsError(f"too many indices ({len(key)}) for a tile of rank {len(self.shape)}")
            # a [P] vector is a [P, 1] tile: trailing unit indices address its implicit dims
            pad = len(extra)
            return Tile(self.buf, self.shape + (1,) * pad, self.base, self.maps + ((),) * pad)._index(key)
        if len(key) < len(self.shape):
            key = key + (slice(None),) * (len(self.shape) - len(key))
        has_expr = False
        dynamic = [j for j, k in enumerate(key) if isinstance(k, Tile)]
        if dynamic:
            return self._gather(key, dynamic)
        for k in key:
            if isinstance(k, IndexExpr):
                has_expr = True
        # per old dim: (const, ((newdim, coef), ...)); new shape
        specs = []
        if not has_expr:
            new_shape = []
            shape, maps0, base = self.shape, self.maps, list(self.base)
            simple = True
            out_maps = []
            for j, k in enumerate(key):
                n = shape[j]
                if isinstance(k, slice):
                    step = k.step or 1
                    if step <= 0:
                        raise NKIError("negative slice steps are not supported", rule="index")
                    start = 0 if k.start is None else int(k.start)
                    stop = n if k.stop is None else int(k.stop)
                    if start < 0:
                        start += n
                    if stop < 0:
                        stop += n
                    size = max(0, -(-(stop - start) // step))
                    specs.append((start, ((len(new_shape), step),)))
                    new_shape.append(size)
                    mj = maps0[j]
                    if len(mj) == 1:
                        d, m = mj[0]
                        base[d] += m * start
                        out_maps.append(((d, m * step),))
                    else:
                        simple = False
                else:
                    c = int(k)
                    if c < 0:
                        c += n
                    specs.append((c, ()))
                    for d, m in maps0[j]:
                        base[d] += m * c
            if simple:  # every dimension maps to one buffer dimension: compose directly
                return Tile(self.buf, tuple(new_shape), tuple(base), tuple(out_maps))
        else:
            ndim, slot = 0, 0
            for k in key:
                if isinstance(k, IndexExpr):
                    for v in k.variables():
                        ndim = max(ndim, v.ndim)
            new_shape = [1] * ndim
            for j, k in enumerate(key):
                if isinstance(k, slice):
                    start = 0 if k.start is None else int(k.start)
                    stop = self.shape[j] if k.stop is None else int(k.stop)
                    while slot < ndim and new_shape[slot] != 1:
                        slot += 1
                    if slot >= ndim:
                        raise NKIError("cannot mix slices and aranges in this index", rule="index")
                    new_shape[slot] = stop - start
                    specs.append((start, ((slot, k.step or 1),)))
                    slot += 1
                elif isinstance(k, IndexExpr):
                    terms = []
                    for v, c in k.terms:
                        if new_shape[v.pos] not in (1, v.size):
                            raise NKIError(f"index axis {v.pos} has conflicting sizes "
                                           f"{new_shape[v.pos]} and {v.size}", rule="index")
                        new_shape[v.pos] = v.size
                        terms.append((v.pos, c))
                    specs.append((k.const, tuple(terms)))
                else:
                    specs.append((int(k), ()))
        base = list(self.base)
        maps: list[dict] = [dict() for _ in new_shape]
        for j, (c, terms) in enumerate(specs):
            for d, m in self.maps[j]:
                base[d] += m * c
                for nd, a in terms:
                    maps[nd][d] = maps[nd].get(d, 0) + m * a
        return Tile(self.buf, tuple(new_shape), tuple(base),
                    tuple(tuple(mp.items()) for mp in maps))

    def _gather(self, key: tuple, dynamic: list) -> "GatherTile":
        """Indirect access (a tile of indices along one dimension, one index per partition):
        the access pattern of an indirect DMA."""
        if len(dynamic) != 1:
            raise NKIError("only one tile-valued (dynamic) index per access is supported", rule="index")
        j = dynamic[0]
        index = key[j]
        if index.per_partition() != 1:
            raise NKIError("a dynamic index must hold one index per partition ([P, 1])", rule="index")
        ndim = max([v.ndim for k in key if isinstance(k, IndexExpr) for v in k.variables()] or [2])
        var = IndexVar(index.shape[0], 0, ndim)
        view = self._index(key[:j] + (var,) + key[j + 1:])
        return GatherTile(view, index)

    # -- access patterns (NKI 0.4+ `tensor.ap`) ---------------------------------------------
    def ap(self, pattern: Sequence, offset: int = 0, dtype: Any = None, scalar_offset: Any = None,
           vector_offset: "Tile | None" = None, indirect_dim: int | None = None) -> "Tile":
        """A view through an access pattern: `pattern` is [[stride, count], ...], outermost
        first, in elements of `dtype` (default the tensor's) over the tensor's row-major
        memory; on-chip, the first pair steps over partitions (its stride a multiple of the
        partition row). `scalar_offset` (a [1, 1] tile or register) moves the view by that
        many steps of base dimension `indirect_dim`; `vector_offset` (an [n, 1] tile of
        indices) gives each of the first pair's n rows its own index (indirect DMA)."""
        from .dtypes import to_torch
        buf = self.buf
        tdtype = to_torch(dtype) if dtype is not None else buf.tdtype
        # element offset of this view (and of indirect_dim's stride) in the buffer's memory
        base_el = sum(b * st for b, st in zip(self.base, buf.strides))
        scale = buf.tdtype.itemsize / tdtype.itemsize
        if base_el * scale != int(base_el * scale):
            raise NKIError("access pattern: the view's start is not aligned to the new dtype", rule="tile-shape")
        off = int(base_el * scale) + int(offset)
        if scalar_offset is not None:
            if indirect_dim is None:
                raise NKIError("ap(scalar_offset=...) needs indirect_dim (the dimension it indexes)", rule="index")
            off += _scalar_value(scalar_offset) * int(buf.strides[indirect_dim] * scale)
        flat = FlatBuffer(buf, tdtype)
        pattern = [(int(st), int(n)) for st, n in pattern]
        shape = tuple(n for _, n in pattern)
        if flat.kind in ("sbuf", "psum"):
            row = flat.shape[1]
            s0 = pattern[0][0]
            if s0 % row and pattern[0][1] > 1:
                raise NKIError(f"access pattern on {flat.kind}: the first (partition) stride {s0} is not "
                               f"a multiple of the partition row ({row} elements)", rule="partition-dim")
            maps = [((0, s0 // row),)] + [((1, st),) for st, _ in pattern[1:]]
            base = (off // row, off % row)
        else:
            maps = [((0, st),) for st, _ in pattern]
            base = (off,)
        view = Tile(flat, shape, base, tuple(maps))
        if vector_offset is not None:
            return GatherTile(view, vector_offset)
        return view

    # -- view transforms --------------------------------------------------------------------
    def narrow(self, dim: int, start: int, length: int) -> "Tile":
        base = list(self.base)
        for d, m in self.maps[dim]:
            base[d] += m * start
        shape = list(self.shape)
        shape[dim] = length
        return Tile(self.buf, tuple(shape), tuple(base), self.maps)

    def broadcast_to(self, shape: Sequence[int]) -> "Tile":
        shape = tuple(int(s) for s in shape)
        src_shape, src_maps = self.shape, self.maps
        if len(src_shape) < len(shape):  # a [P] vector broadcasts like [P, 1]
            pad = len(shape) - len(src_shape)
            src_shape = src_shape + (1,) * pad
            src_maps = src_maps + ((),) * pad
        if len(shape) != len(src_shape):
            raise NKIError(f"broadcast_to {shape} from {self.shape}: ranks differ", rule="tile-shape")
        maps = []
        for n_old, n_new, m in zip(src_shape, shape, src_maps):
            if n_old == n_new:
                maps.append(m)
            elif n_old == 1:
                maps.append(tuple((d, 0) for d, _ in m) or ())
            else:
                raise NKIError(f"cannot broadcast {self.shape} to {shape}", rule="tile-shape")
        return Tile(self.buf, shape, self.base, tuple(maps))

    def reshape(self, shape: Sequence[int]) -> "Tile":
        """Reshape a whole contiguous tensor (HBM tensors, as `tensor.reshape` in NKI)."""
        shape = tuple(int(s) for s in shape)
        n = 1
        for s in shape:
            n *= s
        if not self.is_whole or n != self.numel():
            raise NKIError(f"reshape {self.shape} -> {shape} needs a whole contiguous tensor",
                           rule="tile-shape")
        return Tile.whole(AliasBuffer(self.buf, shape))

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    # -- checks and materialisation ---------------------------------------------------------
    def region(self) -> tuple:
        """Bounding box in buffer coordinates; raises OutOfBoundsError if outside the buffer."""
        r = self._region
        if r is not None:
            return r
        if not all(self.shape):  # an empty access (statically false mask) touches nothing
            r = self._region = tuple((b, b - 1) for b in self.base)
            return r
        lo = list(self.base)
        hi = list(self.base)
        for n, mp in zip(self.shape, self.maps):
            for d, m in mp:
                if m > 0:
                    hi[d] += m * (n - 1)
                else:
                    lo[d] += m * (n - 1)
        for d, size in enumerate(self.buf.shape):
            if lo[d] < 0 or hi[d] >= size:
                raise OutOfBoundsError(
                    f"access [{lo[d]}, {hi[d]}] of dimension {d} is out of bounds for "
                    f"{self.buf.kind} tensor of shape {tuple(self.buf.shape)}")
        r = self._region = tuple(zip(lo, hi))
        return r

    def check_tile(self, what: str = "operand") -> None:
        """An on-chip tile used by an engine: dimension 0 must be the partition dimension."""
        b = self.buf
        if not self.shape:
            raise PartitionDimError(f"{what} is a scalar view; instructions need a tile")
        p = self.shape[0]
        if p > 128:
            raise PartitionDimError(f"{what} partition dimension is {p}; hardware has 128 partitions (pmax)")
        m0 = self.maps[0]
        if p > 1 and not (len(m0) == 1 and m0[0][0] == b.pdim) and not all(m == 0 for _, m in m0):
            raise PartitionDimError(f"{what}: the first dimension of an on-chip tile must index the "
                                    f"partition dimension of its {b.kind} tensor")
        for mp in self.maps[1:]:
            for d, m in mp:
                if d == b.pdim and m:
                    raise PartitionDimError(f"{what}: only the first dimension may index partitions")

    def torch(self) -> torch.Tensor:
        """Zero-copy torch view of the storage (after a bounds check)."""
        self.region()
        data = self.buf.storage()
        st = self.buf.strides
        off = 0
        for d, b in enumerate(self.base):
            off += b * st[d]
        strides = []
        for mp in self.maps:
            s = 0
            for d, m in mp:
                s += m * st[d]
            strides.append(s)
        return data.as_strided(self.shape, strides, off + data.storage_offset())

    def float32(self) -> torch.Tensor:
        """fp32 values of the view (cached conversion of the whole buffer for low precision)."""
        self.region()
        if self.buf.tdtype == torch.float32:
            return self.torch()
        f = self.buf.float32()
        st = self.buf.strides
        off = sum(b * st[d] for d, b in enumerate(self.base))
        strides = [sum(m * st[d] for d, m in mp) for mp in self.maps]
        return f.as_strided(self.shape, strides, off)

    def per_partition(self) -> int:
        n = 1
        for s in self.shape[1:]:
            n *= s
        return n

    # -- operators (defined in language.py) -------------------------------------------------
    def __add__(self, o): return _ops().add(self, o)
    def __radd__(self, o): return _ops().add(o, self)
    def __sub__(self, o): return _ops().subtract(self, o)
    def __rsub__(self, o): return _ops().subtract(o, self)
    def __mul__(self, o): return _ops().multiply(self, o)
    def __rmul__(self, o): return _ops().multiply(o, self)
    def __truediv__(self, o): return _ops().divide(self, o)
    def __rtruediv__(self, o): return _ops().divide(o, self)
    def __neg__(self): return _ops().negative(self)
    def __pow__(self, o): return _ops().power(self, o)
    def __lt__(self, o): return _ops().less(self, o)
    def __le__(self, o): return _ops().less_equal(self, o)
    def __gt__(self, o): return _ops().greater(self, o)
    def __ge__(self, o): return _ops().greater_equal(self, o)
    def __and__(self, o): return _ops().bitwise_and(self, o)
    def __or__(self, o): return _ops().bitwise_or(self, o)
    def __xor__(self, o): return _ops().bitwise_xor(self, o)
    __hash__ = object.__hash__

    def __iadd__(self, o): return _ops()._inplace(self, o, "add")
    def __isub__(self, o): return _ops()._inplace(self, o, "subtract")
    def __imul__(self, o): return _ops()._inplace(self, o, "multiply")
    def __itruediv__(self, o): return _ops()._inplace(self, o, "divide")


class GatherTile(Tile):
    """A view whose first (partition) dimension is addressed through a tile of indices:
    row p reads the buffer at index[p] along one dimension. Readable by DMA only."""

    __slots__ = ("index", "anchor")

    def __init__(self, view: Tile, index: Tile):
        Tile.__init__(self, view.buf, view.shape, view.base, view.maps)
        self.index = index
        self.anchor = view

    def narrow(self, dim: int, start: int, length: int) -> "GatherTile":
        view = self.anchor.narrow(dim, start, length)
        index = self.index.narrow(0, start, length) if dim == 0 else self.index
        if dim == 0:  # rows keep their own indices: the anchor stays at row 0
            view = Tile(self.anchor.buf, view.shape, self.anchor.base, view.maps)
        return GatherTile(view, index)

    @property
    def is_whole(self) -> bool:
        return False

    def region(self):
        """Rows are only known at run time: the access covers the whole buffer."""
        return None

    def torch(self) -> torch.Tensor:
        return self.buf.storage().reshape(-1)[self.flat_index()]

    def scatter(self, values: torch.Tensor) -> None:
        """Indirect store: row p of `values` goes to the buffer at index[p]."""
        data = self.buf.storage()
        flat = data.reshape(-1)
        if flat.data_ptr() != data.data_ptr() or not data.is_contiguous():
            raise NKIError("indirect store into a non-contiguous tensor", rule="index")
        flat[self.flat_index()] = values.to(flat.dtype).reshape(self.shape)

    def flat_index(self) -> torch.Tensor:
        """Element offsets in the buffer's row-major storage of every element of the view."""
        st = self.buf.strides
        flat = torch.zeros(self.shape, dtype=torch.int64)
        nd = len(self.shape)
        for i, (n, mp) in enumerate(zip(self.shape, self.maps)):
            step = sum(m * st[d] for d, m in mp) if i else 0
            view = [1] * nd
            view[i] = n
            flat = flat + step * torch.arange(n).view(view)
        (d0, m0), = self.maps[0]
        idx = self.index.torch().reshape(-1).to(torch.int64)
        lo = int(idx.min()) * m0 + self.base[d0] if idx.numel() else 0
        hi = int(idx.max()) * m0 + self.base[d0] if idx.numel() else 0
        if idx.numel() and (lo < 0 or hi >= self.buf.shape[d0]):
            raise OutOfBoundsError(f"dynamic index values [{lo}, {hi}] are out of bounds for dimension "
                                   f"{d0} of {self.buf.kind} tensor of shape {tuple(self.buf.shape)}")
        off = sum(b * st[d] for d, b in enumerate(self.base))
        return flat + off + (idx * m0 * st[d0]).view([-1] + [1] * (nd - 1))

    def float32(self) -> torch.Tensor:
        return self.torch().float()


def _scalar_value(x: Any) -> int:
    """The integer a dynamic offset holds: a register, a [1, 1] tile, or an int. In a
    timing-only run values are unknown and the offset counts as 0 (it moves no cost)."""
    if isinstance(x, Tile):
        if x.buf.storage() is None:
            return 0
        return int(x.torch().reshape(-1)[0].item())
    value = getattr(x, "value", x)
    return 0 if value is None else int(value)


def _unit_index(k) -> bool:
    if isinstance(k, slice):
        return (k.start in (None, 0)) and (k.stop in (None, 1))
    return isinstance(k, int) and k == 0


_operators: Any = None  # nki.language, which defines the tiles' arithmetic (set_operators)


def set_operators(namespace: Any) -> None:
    """Gives tiles their operators (`a + b`, `a[i] = b`, ...): nki.language calls this once it is
    defined, so the index algebra here needs nothing from the language above it."""
    global _operators
    _operators = namespace


def _ops() -> Any:
    if _operators is None:
        raise RuntimeError("Tile arithmetic needs torchneuron.nki.language: import torchneuron.nki first.")
    return _operators


def flatten_tiles(obj: Any) -> Iterable[Tile]:
    if isinstance(obj, Tile):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from flatten_tiles(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from flatten_tiles(o)
