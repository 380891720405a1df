"""Device time of attention ops from the NKI flash-attention kernels' simulated latency.

`install()` registers `attention_seconds` with the performance model (hardware.model), so an
SDPA on `neuron` (eager and adaptive: the host runs its own flash kernel, whose numerics the
OpInfo gate checks against CPU) and the compiler's attention substitution are charged what
`flash_attention.attention_fwd` / `attention_bwd` take on the modeled NeuronCore, not a formula.

The kernels are run timing-only (typed placeholders, no data) and the result is cached per
shape, dtype and target. Long problems are not simulated whole; what is simulated and how it
is extended (assumptions):
- query tiles of a head are independent and alike (no causal mask: the op signature does
  not carry it, as the formula assumes): the latency is linear in the query length, fitted
  from runs at 1024 and 2048 queries;
- heads run one after another on the core, the next one's loads overlapping the current
  one's compute: heads x one head's latency, less (heads - 1) x the overlap measured by a
  two-head run;
- lengths round up to the kernels' 128-row tiles (the kernel would pad them).
Shapes the kernels do not take (head dim over 128, unequal q/k and v head dims, a query
head count not a multiple of the key/value heads', or a backward whose K, V, Q, dO do not fit
SBUF) return None and keep the formula's price.

Decode (paged) attention, `decode_attention.decode_attention` (the serving backend's decode
step), is priced the same way by `decode_attention_seconds` (category "paged_attention"),
cached per shape, dtype and target. Its batch and context are extended from short runs when
the problem is larger than `DECODE_SIM_KEYS` keys in all (assumptions):
- sequences are independent and alike (one program each, the same blocks walked): the
  latency is linear in the batch past 4 sequences, fitted from runs of 2 and 4 (the first
  sequence's ramp-up is in both);
- 512-key chunks of a sequence's walk are alike: the one- and two-sequence latencies are
  linear in the context past 2048 keys, fitted from runs at 1024 and 2048 keys.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..hardware import model as _model
from ..hardware.targets import Target
from ..nki import typing as nt
from . import decode_attention as da
from . import flash_attention as fa

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_FIT_QUERIES = (1024, 2048)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _round(n: int) -> int:
    return max(fa.P, -(-int(n) // fa.P) * fa.P)


def _run(target: Target, backward: bool, programs: int, sq: int, sk: int, d: int, dtype: torch.dtype) -> float:
    """Simulated latency of `programs` query heads (each with its own key/value head: a
    program's work does not depend on the GQA group, it loads its key/value head itself)."""
    q = nt.tensor[(programs, sq, d), dtype]
    k = nt.tensor[(programs, sk, d), dtype]
    scale = d ** -0.5
    if backward:
        args = (q, k, k, q, q, nt.tensor[(programs, sq, 1), torch.float32])
        _, stats = fa.attention_bwd[programs].run(args, {"scale": scale}, target=target)
    else:
        _, stats = fa.attention_fwd[programs].run((q, k, k), {"scale": scale}, target=target)
    return stats.latency_s


@functools.lru_cache(maxsize=256)
def kernel_seconds(target: Target, backward: bool, heads: int, sq: int, sk: int, d: int,
                   dtype: torch.dtype) -> float:
    """Modeled latency of the forward or backward kernel over `heads` query heads of `sq`
    queries and `sk` keys (multiples of 128), extended from short runs (module doc)."""
    s1 = min(sq, _FIT_QUERIES[0])
    single = _run(target, backward, 1, s1, sk, d, dtype)
    per_head = single
    if sq > s1:
        s2 = min(sq, _FIT_QUERIES[1])
        per_query = (_run(target, backward, 1, s2, sk, d, dtype) - single) / (s2 - s1)
        per_head = single + per_query * (sq - s1)
    if heads == 1:
        return per_head
    overlap = max(0.0, 2 * single - _run(target, backward, 2, s1, sk, d, dtype))
    return heads * per_head - (heads - 1) * overlap


def attention_seconds(target: Target, name: str, ins: Sequence, outs: Sequence) -> float | None:
    """The performance model's pricer for the attention category (see the module doc)."""
    backward = "backward" in name
    qkv = ins[1:4] if backward else ins[:3]
    if len(qkv) < 3 or any(len(shape) < 2 for _, shape in qkv):
        return None
    (dtype, q), (kdt, k), (_, v) = qkv
    if dtype not in _DTYPES or kdt != dtype:
        return None
    d, dv = int(q[-1]), int(v[-1])
    heads, kv_heads = _numel(q[:-2]), _numel(k[:-2])
    if d != dv or d > fa.P or int(k[-1]) != d or not kv_heads or heads % kv_heads:
        return None
    sq, sk = _round(q[-2]), _round(k[-2])
    try:
        return kernel_seconds(target, backward, heads, sq, sk, d, dtype)
    except ValueError:  # a shape the kernel refuses (e.g. backward operands over SBUF)
        return None


DECODE_SIM_KEYS = 8192  # keys over all sequences up to which a decode step is simulated whole
_FIT_DECODE_KEYS = (1024, 2048)
_FIT_SEQUENCES = (2, 4)


@functools.lru_cache(maxsize=256)
def _decode_run(target: Target, programs: int, t: int, hq: int, hk: int, d: int, bs: int, blocks: int,
                dtype: torch.dtype) -> float:
    """Simulated latency of `programs` sequences walking `blocks` cache blocks each."""
    args = (nt.tensor[(programs, t, hq, d), dtype], nt.tensor[(programs * blocks, hk, 2 * bs, d), dtype],
            nt.tensor[(programs, blocks), torch.int32], nt.tensor[(programs, 1), torch.int32])
    _, stats = da.decode_attention[programs].run(args, {"scale": d ** -0.5}, target=target)
    return stats.latency_s


def _decode_walk(target: Target, programs: int, t: int, hq: int, hk: int, d: int, bs: int, blocks: int,
                 dtype: torch.dtype) -> float:
    """Latency of `programs` sequences of `blocks` blocks each: simulated up to the longer fit
    length, linear in the keys past it (module doc)."""
    fit1, fit2 = (max(1, -(-k // bs)) for k in _FIT_DECODE_KEYS)
    if blocks <= fit2:
        return _decode_run(target, programs, t, hq, hk, d, bs, blocks, dtype)
    short = _decode_run(target, programs, t, hq, hk, d, bs, fit1, dtype)
    long = _decode_run(target, programs, t, hq, hk, d, bs, fit2, dtype)
    return long + (long - short) / (fit2 - fit1) * (blocks - fit2)


def decode_kernel_seconds(target: Target, b: int, t: int, hq: int, hk: int, d: int, bs: int, blocks: int,
                          dtype: torch.dtype) -> float:
    """Modeled latency of the decode-attention kernel over `b` sequences of `t` new tokens, each
    walking `blocks` blocks of `bs` keys: simulated whole when small, else extended (module doc)."""
    if b * blocks * bs <= DECODE_SIM_KEYS:
        return _decode_run(target, b, t, hq, hk, d, bs, blocks, dtype)
    if b <= _FIT_SEQUENCES[0] or b in _FIT_SEQUENCES:
        return _decode_walk(target, b, t, hq, hk, d, bs, blocks, dtype)
    few, more = (_decode_walk(target, n, t, hq, hk, d, bs, blocks, dtype) for n in _FIT_SEQUENCES)
    return more + (more - few) / (_FIT_SEQUENCES[1] - _FIT_SEQUENCES[0]) * (b - _FIT_SEQUENCES[1])


def decode_attention_seconds(target: Target, name: str, ins: Sequence, outs: Sequence) -> float | None:
    """The performance model's pricer for the paged-attention category: `decode_attention(q,
    kv_cache, block_table[, context_lens])` by the kernel (the lengths change nothing: it walks
    the table's width); None for operands it refuses."""
    if len(ins) < 3:
        return None
    try:
        b, t, hq, d, hk, bs, blocks, _ = da.check_shapes(*(nt.tensor[shape, dtype] for dtype, shape in ins[:3]))
    except (TypeError, ValueError):
        return None
    return decode_kernel_seconds(target, b, t, hq, hk, d, bs, blocks, ins[0][0])


def install() -> None:
    """Price attention ops by the NKI kernels (called once when torchneuron is imported)."""
    _model.register_kernel_pricer("attention", attention_seconds)
    _model.register_kernel_pricer("paged_attention", decode_attention_seconds)


__all__ = ["DECODE_SIM_KEYS", "attention_seconds", "decode_attention_seconds", "decode_kernel_seconds", "install",
           "kernel_seconds"]
