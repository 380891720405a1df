"""Index algebra of NKI kernels: what kernels write inside `tile[...]`, `mask=` and `affine_select`.

Owns
- index expressions: `nl.arange`, `nl.mgrid`, affine arithmetic on them (`IndexExpr`,
  `IndexVar`, `ArangeRoot`), evaluated over an index grid;
- the predicates (`i < n`, `&`) used as masks and by `affine_select`;
- `nl.par_dim` (the partition dimension of a buffer shape) and `nl.ds` (a dynamic slice).

Tiles (tile.py) map these expressions onto buffer dimensions.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from .errors import NKIError


class IndexExpr:
    """An affine expression `sum(coef * var) + const` over arange variables."""

    __slots__ = ("terms", "const")

    def __init__(self, terms: tuple, const: int):
        self.terms = terms  # ((IndexVar, coef), ...)
        self.const = const

    @staticmethod
    def of(x: Any) -> "IndexExpr":
        if isinstance(x, IndexExpr):
            return x
        if isinstance(x, (int,)) or hasattr(x, "__index__"):
            return IndexExpr((), int(x))
        raise NKIError(f"cannot use {type(x).__name__} in an index expression", rule="index")

    def _combine(self, other: Any, sign: int) -> "IndexExpr":
        o = IndexExpr.of(other)
        acc: dict = {}
        for v, c in self.terms:
            acc[v] = acc.get(v, 0) + c
        for v, c in o.terms:
            acc[v] = acc.get(v, 0) + sign * c
        return IndexExpr(tuple((v, c) for v, c in acc.items() if c), self.const + sign * o.const)

    def __add__(self, o): return self._combine(o, 1)
    __radd__ = __add__
    def __sub__(self, o): return self._combine(o, -1)
    def __rsub__(self, o): return IndexExpr.of(o)._combine(self, -1)

    def __mul__(self, k):
        if isinstance(k, IndexExpr):
            if k.terms:
                raise NKIError("index expressions must be affine (no var * var)", rule="index")
            k = k.const
        k = int(k)
        return IndexExpr(tuple((v, c * k) for v, c in self.terms if c * k), self.const * k)
    __rmul__ = __mul__

    def __neg__(self): return self * -1

    def __floordiv__(self, k):
        if self.terms:
            raise NKIError("index expressions must be affine (no division of an arange)", rule="index")
        return IndexExpr((), self.const // int(k))

    # comparisons build predicates, normalised to `expr >= 0`
    def __lt__(self, o): return Predicate(((IndexExpr.of(o) - self) - 1,))
    def __le__(self, o): return Predicate((IndexExpr.of(o) - self,))
    def __gt__(self, o): return Predicate(((self - o) - 1,))
    def __ge__(self, o): return Predicate((self - o,))
    __hash__ = object.__hash__

    def variables(self) -> list["IndexVar"]:
        return [v for v, _ in self.terms]

    def evaluate(self, shape: Sequence[int], offsets: Sequence[int] | None = None) -> torch.Tensor:
        """Values of the expression over a grid of `shape` (vars at their positions); a
        narrowed grid starts at `offsets` along each axis."""
        out = torch.full([1] * len(shape), self.const, dtype=torch.int64)
        for v, c in self.terms:
            view = [1] * len(shape)
            n = shape[v.pos] if v.pos < len(shape) else v.size
            view[v.pos] = n
            start = offsets[v.pos] if offsets and v.pos < len(offsets) else 0
            out = out + c * torch.arange(start, start + n, dtype=torch.int64).view(view)
        return out


class IndexVar(IndexExpr):
    """One `nl.arange` axis: values 0..size-1 placed at axis `pos` of an `ndim`-d index grid."""

    __slots__ = ("size", "pos", "ndim")

    def __init__(self, size: int, pos: int = 0, ndim: int = 1):
        self.size, self.pos, self.ndim = int(size), pos, ndim
        IndexExpr.__init__(self, ((self, 1),), 0)

    def __repr__(self):
        return f"arange({self.size})@{self.pos}/{self.ndim}"


class ArangeRoot(IndexExpr):
    """`nl.arange(a, b)` before it is placed with `[:, None]`-style indexing."""

    __slots__ = ("size", "start")

    def __init__(self, start: int, stop: int):
        self.size, self.start = stop - start, start
        var = IndexVar(self.size, 0, 1)
        IndexExpr.__init__(self, ((var, 1),), start)

    def __getitem__(self, key) -> IndexExpr:
        key = key if isinstance(key, tuple) else (key,)
        slots = [i for i, k in enumerate(key) if k is not None]
        if len(slots) != 1:
            raise NKIError("arange indexing must place exactly one axis, e.g. [:, None]", rule="index")
        var = IndexVar(self.size, slots[0], len(key))
        return IndexExpr(((var, 1),), self.start) if self.start else var


class Predicate:
    """A conjunction of affine constraints `expr >= 0`, used as `mask=` and by affine_select."""

    __slots__ = ("constraints",)

    def __init__(self, constraints: tuple):
        self.constraints = constraints

    def __and__(self, other: "Predicate | bool") -> "Predicate | bool":
        if isinstance(other, Predicate):
            return Predicate(self.constraints + other.constraints)
        return self if other else False   # a compile-time condition

    __rand__ = __and__

    def evaluate(self, shape: Sequence[int], offsets: Sequence[int] | None = None) -> torch.Tensor:
        out = torch.ones([1] * len(shape), dtype=torch.bool)
        for c in self.constraints:
            out = out & (c.evaluate(shape, offsets) >= 0)
        return out.expand(*shape)


class MGrid:
    """`nl.mgrid[0:P, 0:F]`: a tuple-like of placed aranges with `.p`, `.x`, `.y`, `.z`."""

    def __getitem__(self, key) -> "GridIndex":
        key = key if isinstance(key, tuple) else (key,)
        out = []
        for i, s in enumerate(key):
            start, stop = (s.start or 0), s.stop
            var = IndexVar(stop - start, i, len(key))
            e = IndexExpr(((var, s.step or 1),), start) if (start or (s.step or 1) != 1) else var
            out.append(e)
        return GridIndex(out)


class GridIndex(tuple):
    p = property(lambda self: self[0])
    x = property(lambda self: self[1])
    y = property(lambda self: self[2])
    z = property(lambda self: self[3])


class par_dim:  # noqa: N801 - NKI spelling
    """Marks the partition dimension in a buffer shape: `(n, nl.par_dim(128), 512)`."""

    __slots__ = ("size",)

    def __init__(self, size: int):
        self.size = int(size)

    def __index__(self):
        return self.size

    def __int__(self):
        return self.size

    def __repr__(self):
        return f"par_dim({self.size})"


def ds(start: Any, size: int) -> slice:
    """`nl.ds(start, size)`: a dynamic slice `start:start+size`."""
    return slice(start, start + size)
