"""Device time of the RoPE and linear cross-entropy ops from their NKI kernels' simulated latency.

`install()` registers pricers for the performance model's categories "nki_rope"
(`nki_kernels::rope`) and "nki_linear_cross_entropy" (`nki_kernels::linear_ce_fwd` / `_bwd`, `ce_fwd` / `ce_bwd`), so
the ops, in eager mode and in compiled graphs, are charged what `rope.rope` and
`cross_entropy.linear_ce_fwd` / `linear_ce_bwd` take on the modeled NeuronCore. Kernels run
timing-only (typed placeholders), cached per shape, dtype and target. Problems too large to
simulate whole are extended linearly from two smaller runs (assumptions):
- RoPE: head groups are alike (same instructions on the same tables): linear in the heads
  past four full instruction groups a table (fitted from two and four: the first group's ramp-up
  is in both);
- cross-entropy over given logits (`ce_fwd` / `ce_bwd`): 128-token tiles are alike: linear in
  the tiles past `CE_LOGITS_FIT_TILES`;
- linear cross-entropy: 512-entry vocabulary chunks are alike: linear in the vocabulary past
  `CE_FIT_VOCAB`; token blocks are alike: linear in the tokens past two blocks (the block's
  W streaming included in both fits).
Operands the kernels refuse return None and keep the formula's price.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from ..hardware import model as _model
from ..hardware.targets import Target
from ..nki import typing as nt
from . import cross_entropy as ce
from . import rope as rp

ROPE_SIM_ELEMENTS = 1 << 26   # x elements up to which RoPE is simulated whole
CE_SIM_TILES = 4096           # (token tiles x vocabulary chunks x D / 128) simulated whole
CE_FIT_VOCAB = (2048, 4096)
CE_LOGITS_FIT_TILES = (4, 8)  # token tiles of the logits-input kernels' fits
_FLOATS = (torch.bfloat16, torch.float16, torch.float32)


def _extend(latency: Callable[[int], float], size: int, fit1: int, fit2: int) -> float:
    """latency(size), simulated when size <= fit2, else linear from the fits at fit1 and fit2."""
    if size <= fit2:
        return latency(size)
    short, long = latency(fit1), latency(fit2)
    return long + (long - short) / (fit2 - fit1) * (size - fit2)


@functools.lru_cache(maxsize=256)
def _rope_run(target: Target, n: int, s: int, d: int, c: int, dtype: torch.dtype) -> float:
    args = (nt.tensor[(n, s, d), dtype], nt.tensor[(c, s, d), dtype], nt.tensor[(c, s, d), dtype])
    return rp.rope.run(args, {}, target=target)[1].latency_s


def rope_kernel_seconds(target: Target, n: int, s: int, d: int, c: int, dtype: torch.dtype) -> float:
    """Modeled latency of the RoPE kernel on x [n, s, d] with c tables (module doc)."""
    if n * s * d <= ROPE_SIM_ELEMENTS:
        return _rope_run(target, n, s, d, c, dtype)
    group = max(1, rp.FREE // (min(rp.FREE // d, s // rp.P or 1) * d))  # heads an instruction covers
    per_table = n // c
    return _extend(lambda heads: _rope_run(target, heads * c, s, d, c, dtype), per_table, 2 * group, 4 * group)


def rope_seconds(target: Target, name: str, ins: Sequence, outs: Sequence) -> float | None:
    """The pricer of `nki_kernels::rope(x, cos, sin)`: None for operands the kernel refuses."""
    if len(ins) < 3 or ins[0][0] not in _FLOATS:
        return None
    try:
        n, s, d, c = rp.check_shapes(*(nt.tensor[shape, dtype] for dtype, shape in ins[:3]))
    except ValueError:
        return None
    return rope_kernel_seconds(target, n, s, d, c, ins[0][0])


@functools.lru_cache(maxsize=256)
def _ce_run(target: Target, backward: bool, t: int, d: int, v: int, dtype: torch.dtype) -> float:
    args = (nt.tensor[(t, d), dtype], nt.tensor[(v, d), dtype], nt.tensor[(t, 1), torch.int32])
    if backward:
        args += (nt.tensor[(t, 1), torch.float32], nt.tensor[(t, 1), torch.float32])
        return ce.linear_ce_bwd.run(args, {}, target=target)[1].latency_s
    return ce.linear_ce_fwd.run(args, {}, target=target)[1].latency_s


def ce_kernel_seconds(target: Target, backward: bool, t: int, d: int, v: int, dtype: torch.dtype) -> float:
    """Modeled latency of the forward or backward linear cross-entropy kernel (module doc)."""
    def tiles(tokens: int, vocab: int) -> int:
        return tokens // ce.P * -(-vocab // ce.CHUNK) * d // ce.P

    def at(tokens: int, vocab: int) -> float:
        if tiles(tokens, vocab) <= CE_SIM_TILES:
            return _ce_run(target, backward, tokens, d, vocab, dtype)
        return _extend(lambda vv: _ce_run(target, backward, tokens, d, vv, dtype), vocab, *CE_FIT_VOCAB)

    if tiles(t, v) <= CE_SIM_TILES:
        return at(t, v)
    block = ce.block_tiles(t, d, dtype.itemsize, backward) * ce.P
    return _extend(lambda tokens: at(tokens, v), t, block, 2 * block)


@functools.lru_cache(maxsize=256)
def ce_logits_kernel_seconds(target: Target, backward: bool, t: int, v: int, dtype: torch.dtype) -> float:
    """Modeled latency of ce_fwd / ce_bwd over logits [t, v]: 128-token tiles are alike, so
    linear in the tiles past CE_LOGITS_FIT_TILES."""
    def run(tokens: int) -> float:
        args = (nt.tensor[(tokens, v), dtype], nt.tensor[(tokens, 1), torch.int32])
        if backward:
            args += (nt.tensor[(tokens, 1), torch.float32], nt.tensor[(tokens, 1), torch.float32])
        return (ce.ce_bwd if backward else ce.ce_fwd).run(args, {}, target=target)[1].latency_s
    fit1, fit2 = (tiles * ce.P for tiles in CE_LOGITS_FIT_TILES)
    return _extend(run, t, fit1, fit2)


def linear_ce_seconds(target: Target, name: str, ins: Sequence, outs: Sequence) -> float | None:
    """The pricer of `nki_kernels::linear_ce_fwd(h, w, labels)`, `linear_ce_bwd(h, w, labels,
    lse, grad)` and of `ce_fwd(logits, labels)`, `ce_bwd(logits, labels, lse, grad)`: None for
    operands the kernels refuse."""
    if name in ("ce_fwd", "ce_bwd"):
        if len(ins) < 2 or ins[0][0] not in _FLOATS:
            return None
        try:
            t, v = ce.check_logits(*(nt.tensor[shape, dtype] for dtype, shape in ins[:2]), what=name)
        except ValueError:
            return None
        return ce_logits_kernel_seconds(target, name == "ce_bwd", t, v, ins[0][0])
    if len(ins) < 3 or ins[0][0] not in _FLOATS or ins[1][0] != ins[0][0]:
        return None
    try:
        t, d, v = ce.check_shapes(*(nt.tensor[shape, dtype] for dtype, shape in ins[:3]), what=name)
        return ce_kernel_seconds(target, name.endswith("bwd"), t, d, v, ins[0][0])
    except ValueError:  # (UnsupportedInput too: e.g. a hidden size whose W chunk does not fit SBUF)
        return None


def install() -> None:
    """Price the RoPE and linear cross-entropy ops by their NKI kernels (at torchneuron's import)."""
    _model.register_kernel_pricer("nki_rope", rope_seconds)
    _model.register_kernel_pricer("nki_linear_cross_entropy", linear_ce_seconds)


__all__ = ["ce_kernel_seconds", "install", "linear_ce_seconds", "rope_kernel_seconds", "rope_seconds"]
