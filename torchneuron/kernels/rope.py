"""Rotary position embedding (RoPE) in NKI, forward and backward, rotate-half convention.

`rope(x [N, S, d], cos [C, S, d], sin [C, S, d])` returns x * cos + rotate_half(x) * sin with
rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2]), as transformers' `apply_rotary_pos_emb`.
N = B * H heads batch-major (row b * H + h), C = 1 (one table for every head) or B (a table
per sequence, the heads of sequence b use table b). `backward=True` applies the adjoint,
g * cos - rotate_half(g * sin): the gradient (for RoPE's tables, whose halves repeat, it is
RoPE with -sin, the inverse rotation).

Schedule: tokens go to partitions in blocks (chunk of 128 * k tokens: token p * k + j on
partition p), so each partition's share of a head is k * d contiguous elements in HBM and the
DMAs move long runs. Per table c and chunk, cos and the signed sin table cat(-sin[:d/2],
sin[d/2:]) are loaded once and kept in SBUF while the heads that use them are loaded, several
at a time, as one [128, heads, k, d] tile: each instruction covers `FREE` elements a
partition. x * cos and one swapped-half product on the GpSimd engine, the other half and the
sum (rounded once to the output dtype) on the Vector engine: all arithmetic is fp32.
"""
from __future__ import annotations

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl

P = 128
FREE = 4096  # elements a partition per instruction (tokens x heads x d)


class UnsupportedInput(ValueError):
    """Operands the RoPE kernel does not take (the op falls back to the generic implementation)."""


def check_shapes(x, cos, sin) -> tuple[int, int, int, int]:
    """(N, S, d, C) of rope's operands, or UnsupportedInput naming the kernel's constraint."""
    if len(x.shape) != 3 or len(cos.shape) != 3 or tuple(cos.shape) != tuple(sin.shape):
        raise UnsupportedInput(f"rope kernel: need x [N, S, d] and cos, sin [C, S, d]; got x {tuple(x.shape)}, "
                               f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    n, s, d = x.shape
    c = cos.shape[0]
    if tuple(cos.shape[1:]) != (s, d) or n % c:
        raise UnsupportedInput(f"rope kernel: cos/sin {tuple(cos.shape)} must be [C, S, d] with S={s}, d={d} and "
                               f"C dividing the {n} heads (one table, or one per sequence)")
    if d % 2 or d > 512:
        raise UnsupportedInput(f"rope kernel: head dim {d} must be even and at most 512")
    return n, s, d, c


def _chunks(s: int, d: int) -> list[tuple[int, int, int]]:
    """(first token, rows, tokens a partition) of each chunk: 128 * k tokens, token
    s0 + p * k + j on partition p (k * d contiguous elements a partition), then a tail tile."""
    k_max = max(1, FREE // d)
    chunks, s0 = [], 0
    while s - s0 >= P:
        k = min(k_max, (s - s0) // P)
        chunks.append((s0, P, k))
        s0 += P * k
    if s0 < s:
        chunks.append((s0, s - s0, 1))
    return chunks


@nki.jit
def rope(x, cos, sin, backward: bool = False):
    n, s, d, c = check_shapes(x, cos, sin)
    out = nl.ndarray((n, s, d), dtype=x.dtype, buffer=nl.shared_hbm)
    half = d // 2
    per_table = n // c
    # the table multiplying the swapped halves: forward cat(-sin1, sin2); backward (the adjoint,
    # g cos - rotate_half(g sin)) cat(sin2, -sin1); both (dst lo, dst hi, source lo, sign)
    signed_halves = ((0, half, half, 1.0), (half, d, 0, -1.0)) if backward else \
        ((0, half, 0, -1.0), (half, d, half, 1.0))
    for t in range(c):
        for s0, rows, k in _chunks(s, d):
            tables = [nl.ndarray((P, 1, k, d), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2)]
            for table, src in zip(tables, (cos, sin)):
                nisa.dma_copy(dst=table[0:rows], src=src.ap([[k * d, rows], [0, 1], [d, k], [1, d]],
                                                            offset=(t * s + s0) * d))
            cos_t, sin_t = tables
            signed = nl.ndarray((P, 1, k, d), dtype=nl.float32, buffer=nl.sbuf)
            for lo, hi, src_lo, sign in signed_halves:
                nisa.tensor_scalar(dst=signed[0:rows, :, :, lo:hi], data=sin_t[0:rows, :, :, src_lo:src_lo + half],
                                   op0=nl.multiply, operand0=sign, engine=nisa.gpsimd_engine)
            g_max = max(1, FREE // (k * d))
            for h0 in range(0, per_table, g_max):
                g = min(g_max, per_table - h0)
                heads = [[k * d, rows], [s * d, g], [d, k], [1, d]]
                offset = ((t * per_table + h0) * s + s0) * d
                xt = nl.ndarray((P, g, k, d), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=xt[0:rows], src=x.ap(heads, offset=offset))
                xr, shape = xt[0:rows], (rows, g, k, d)
                direct = nl.ndarray((P, g, k, d), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=direct[0:rows], data1=xr, data2=cos_t[0:rows].broadcast_to(shape),
                                   op=nl.multiply, engine=nisa.gpsimd_engine)
                swapped = nl.ndarray((P, g, k, d), dtype=nl.float32, buffer=nl.sbuf)
                halves = (((0, half), (half, d), nisa.gpsimd_engine), ((half, d), (0, half), nisa.vector_engine))
                for (lo, hi), (src_lo, src_hi), engine in halves:
                    nisa.tensor_tensor(dst=swapped[0:rows, :, :, lo:hi], data1=xr[:, :, :, src_lo:src_hi],
                                       data2=signed[0:rows, :, :, lo:hi].broadcast_to((rows, g, k, hi - lo)),
                                       op=nl.multiply, engine=engine)
                yt = nl.ndarray((P, g, k, d), dtype=x.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=yt[0:rows], data1=direct[0:rows], data2=swapped[0:rows], op=nl.add,
                                   engine=nisa.vector_engine)
                nisa.dma_copy(dst=out.ap(heads, offset=offset), src=yt[0:rows])
    return out


def host(x, cos, sin, backward: bool = False):
    """rope's result computed with torch on the host, the kernel's numerics (fp32, one rounding)."""
    import torch
    n, s, d, c = check_shapes(x, cos, sin)
    xf = x.float().view(c, n // c, s, d)
    cf, sf = cos.float().unsqueeze(1), sin.float().unsqueeze(1)
    half = d // 2
    if backward:
        scaled = xf * sf
        return (xf * cf - torch.cat((-scaled[..., half:], scaled[..., :half]), dim=-1)).to(x.dtype).view(n, s, d)
    return (xf * cf + torch.cat((-xf[..., half:], xf[..., :half]), dim=-1) * sf).to(x.dtype).view(n, s, d)


def hbm_bytes(n: int, s: int, d: int, c: int, itemsize: int) -> int:
    """Bytes the kernel moves: x in, out, and one cos and sin table per C."""
    return (2 * n + 2 * c) * s * d * itemsize
