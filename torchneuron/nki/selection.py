"""Vector-engine selection instructions: `max8`, `nc_find_index8`, `nc_match_replace8` (the
building blocks of top-K) and `range_select` (masking by a per-partition index range).

Each is one Vector-engine instruction over the free elements of a [P, F] tile, priced like the
engine's other element-wise instructions (its time grows with F, the partitions run in parallel).
"""
from __future__ import annotations

from typing import Any

import torch

from . import engines as _E
from .constants import reduce_cmd
from .errors import ShapeError
from .simulator import current
from .tile import Tile


def _rows(t: Tile, run) -> torch.Tensor:
    v = _E.values(t, run)
    return v.reshape(v.shape[0], -1)


def _issue(kind: str, reads: list, writes: list, partitions: int, free: int, dtype) -> None:
    current().issue(kind, reads, writes, engine="vector", partitions=partitions, free_elems=free, dtype=dtype)


def max8(dst: Tile, src: Tile, **kwargs: Any) -> Tile:
    """dst[p, :8] = the 8 largest values of src[p, :], largest first."""
    run = current()
    if dst.per_partition() != 8:
        raise ShapeError(f"max8: dst holds {dst.per_partition()} values a partition; it must hold 8")
    if src.per_partition() < 8:
        raise ShapeError(f"max8: src has {src.per_partition()} values a partition; it needs at least 8")
    if run.compute:
        _E.write(run, dst, torch.topk(_rows(src, run), 8, dim=1).values)
    _issue("tensor_reduce", [src], [dst], src.shape[0], src.per_partition(), dst.buf.tdtype)
    return dst


def _first_match(data: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """Per partition, the index of the first element of data equal to each of vals (each value
    matched at a new position: a repeated value finds its next occurrence)."""
    p, f = data.shape
    idx = torch.zeros(vals.shape, dtype=torch.int64)
    taken = torch.zeros_like(data, dtype=torch.bool)
    pos = torch.arange(f).expand(p, f)
    for j in range(vals.shape[1]):
        hit = (data == vals[:, j:j + 1]) & ~taken
        first = torch.where(hit, pos, torch.full_like(pos, f)).min(dim=1).values
        found = first < f
        idx[:, j] = torch.where(found, first, torch.zeros_like(first))
        taken[found, first[found]] = True
    return idx


def nc_find_index8(dst: Tile, data: Tile, vals: Tile, **kwargs: Any) -> Tile:
    """dst[p, j] = index in data[p, :] of the first occurrence of vals[p, j] (8 values)."""
    run = current()
    if run.compute:
        _E.write(run, dst, _first_match(_rows(data, run), _rows(vals, run)).to(torch.float64))
    _issue("tensor_reduce", [data, vals], [dst], data.shape[0], data.per_partition(), dst.buf.tdtype)
    return dst


def nc_match_replace8(dst: Tile, data: Tile, vals: Tile, imm: float, dst_idx: Tile | None = None,
                      **kwargs: Any) -> Tile:
    """dst = data with the first occurrence of each of vals[p, :8] replaced by imm; their
    indices go to dst_idx when given."""
    run = current()
    if run.compute:
        d = _rows(data, run)
        idx = _first_match(d, _rows(vals, run))
        out = d.clone()
        out.scatter_(1, idx, float(imm))
        if dst_idx is not None:
            _E.write(run, dst_idx, idx.to(torch.float64))
        _E.write(run, dst, out.reshape(_E.values(data, run).shape))
    writes = [dst] + ([dst_idx] if dst_idx is not None else [])
    _issue("tensor_tensor", [data, vals], writes, data.shape[0], data.per_partition(), dst.buf.tdtype)
    return dst


def range_select(dst: Tile, on_true_tile: Tile, comp_op0: Any, comp_op1: Any, bound0: Any, bound1: Any,
                 reduce_cmd: reduce_cmd = reduce_cmd.idle, reduce_res: Tile | None = None,
                 reduce_op: Any = None, range_start: float = 0.0, on_false_value: float = 0.0,
                 **kwargs: Any) -> Tile:
    """dst[p, i] = on_true[p, i] where comp_op0(i + range_start, bound0[p]) and
    comp_op1(i + range_start, bound1[p]), else on_false_value; the max of each row goes to
    reduce_res (reset_reduce: replace; reduce: combine with what it holds)."""
    run = current()
    f0, f1 = _E.alu(comp_op0), _E.alu(comp_op1)

    def compute(x, b0, b1):
        rows = x.reshape(x.shape[0], -1)
        pos = torch.arange(rows.shape[1], dtype=torch.float32).view(1, -1) + float(range_start)
        keep = (f0(pos, b0.reshape(-1, 1)) != 0) & (f1(pos, b1.reshape(-1, 1)) != 0)
        fill = torch.tensor(float(on_false_value), dtype=torch.float32)
        return torch.where(keep, rows, fill).reshape(x.shape)
    out = _E.elementwise("tensor_tensor", compute, [on_true_tile, bound0, bound1], dst=dst,
                         out_shape=on_true_tile.shape, engine="vector")
    if reduce_res is not None:
        if run.compute:
            r = _rows(out, run).max(dim=1).values
            if reduce_cmd is reduce_cmd.reduce:
                r = torch.maximum(r, _rows(reduce_res, run).reshape(-1))
            _E.write(run, reduce_res, r)
        _issue("tensor_reduce", [out], [reduce_res], out.shape[0], 1, reduce_res.buf.tdtype)
    return out
