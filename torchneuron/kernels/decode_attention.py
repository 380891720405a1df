"""Decode (paged) attention in NKI: a few new query tokens per sequence against a KV cache
held in fixed-size blocks named by a block table.

Layouts:
- q [B, T, Hq, d]: T new tokens per sequence (T * Hq / Hkv * Hkv <= 128 score rows);
- k_cache [num_blocks, d, Hkv, bs]: each block's keys stored transposed (d rows, each holding
  every head's bs keys), the layout the Tensor engine contracts over d with;
- v_cache [num_blocks, bs, Hkv, d]: vLLM's value layout, keys on partitions for P V;
  either loads a whole block, every head, with one DMA of Hkv * bs- or Hkv * d-element rows;
- block_table [B, max_blocks] int32: the cache block of each sequence's i-th bs keys;
- context_lens [B, 1] int32: keys each sequence holds, the T new ones included (token t of a
  sequence sees keys < len - T + t + 1).
bs divides 128 or is a multiple of 128; d <= 128. Output [B, T, Hq, d].

One SPMD program per sequence. Every key/value head's scores share one PSUM tile (rows
ordered head, token, query head of the group), so the softmax runs once for all heads; the
kernel walks `max_blocks` blocks of the table in chunks of 512 keys (entries past a
sequence's length must name some valid block; their keys are masked), loading each block
by its table entry at run time (a dynamic DMA offset), so it streams K and V from HBM once.
"""
from __future__ import annotations

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl

P = 128
CHUNK = 512
NEG = -3.0e38


def check_shapes(q, k_cache, v_cache, block_table) -> tuple:
    b, t, hq, d = q.shape
    nblk, dk, hk, bs = k_cache.shape
    if dk != d or tuple(v_cache.shape) != (nblk, bs, hk, d):
        raise ValueError(f"decode_attention: k_cache must be [blocks, d, Hkv, bs] and v_cache [blocks, bs, Hkv, d] "
                         f"with q's d = {d}; got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if hq % hk:
        raise ValueError(f"decode_attention: {hq} query heads are not a multiple of {hk} key/value heads")
    if t * hq > P or d > P:
        raise ValueError(f"decode_attention: T * Hq = {t * hq} score rows and d = {d} must be at most {P}")
    if not (P % bs == 0 or bs % P == 0):
        raise ValueError(f"decode_attention: block size {bs} must divide {P} or be a multiple of it")
    maxb = block_table.shape[1]
    return b, t, hq, d, hk, bs, maxb, hq // hk


@nki.jit
def decode_attention(q, k_cache, v_cache, block_table, context_lens, scale: float = 1.0):
    b, t, hq, d, hk, bs, maxb, g = check_shapes(q, k_cache, v_cache, block_table)
    rows, tg = hk * t * g, t * g
    out = nl.ndarray((b, t, hq, d), dtype=q.dtype, buffer=nl.shared_hbm)
    s = nl.program_id(0)
    table = nl.ndarray((1, maxb), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=table, src=block_table[s:s + 1, :])
    # one bound per score row: keys < len - T + t + 1 (rows: head, token, group member)
    hi = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    for h in range(hk):
        for tok in range(t):
            nisa.memset(dst=hi[h * tg + tok * g:h * tg + (tok + 1) * g, :], value=float(tok + 1 - t),
                        engine=nisa.gpsimd_engine)
    length = nl.ndarray((rows, 1), dtype=nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=length, src=context_lens.ap([[0, rows], [1, 1]], offset=s))  # broadcast to every row
    nisa.tensor_tensor(dst=hi, data1=hi, data2=length, op=nl.add, engine=nisa.gpsimd_engine)
    lo = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=lo, value=0.0, engine=nisa.gpsimd_engine)
    # queries transposed per key/value head: q_t[h] [d, T * G] (columns: token, group member)
    q_t = []
    for h in range(hk):
        qt = nl.ndarray((d, tg), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=qt.ap([[tg, d], [g, t], [1, 1], [1, g]]),
                           src=q.ap([[d, g], [hq * d, t], [1, 1], [1, d]], offset=s * t * hq * d + h * g * d))
        q_t.append(qt)
    m = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=m, value=NEG, engine=nisa.gpsimd_engine)
    l_sum = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=l_sum, value=0.0, engine=nisa.gpsimd_engine)
    acc = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0, engine=nisa.gpsimd_engine)
    keys = maxb * bs
    for c0 in range(0, keys, CHUNK):
        n = min(CHUNK, keys - c0)
        k_t = nl.ndarray((d, hk, n), dtype=k_cache.dtype, buffer=nl.sbuf)
        v_sb = nl.ndarray((P, (n + P - 1) // P, hk, d), dtype=v_cache.dtype, buffer=nl.sbuf)
        for i in range(c0 // bs, (c0 + n + bs - 1) // bs):
            blk = table[0:1, i:i + 1]  # the block's number, read at run time
            kk = i * bs - c0
            nisa.dma_copy(dst=k_t[:, :, kk:kk + bs],
                          src=k_cache.ap([[hk * bs, d], [bs, hk], [1, bs]], scalar_offset=blk, indirect_dim=0))
            for r0 in range(0, bs, P):  # bs rows of V land on partitions (key mod 128)
                key = kk + r0
                nr = min(P, bs)
                nisa.dma_copy(dst=v_sb[key % P:key % P + nr, key // P, :, :],
                              src=v_cache.ap([[hk * d, nr], [d, hk], [1, d]], offset=r0 * hk * d,
                                             scalar_offset=blk, indirect_dim=0))
        s_ps = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.psum)
        for h in range(hk):
            nisa.nc_matmul(dst=s_ps[h * tg:(h + 1) * tg, :], stationary=q_t[h], moving=k_t[:, h, :])
        s_sb = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.sbuf)
        m_blk = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=s_sb, on_true_tile=s_ps, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=lo,
                          bound1=hi, range_start=float(c0), on_false_value=NEG, reduce_res=m_blk,
                          reduce_op=nl.maximum, reduce_cmd=nisa.reduce_cmd.reset_reduce)
        m_new = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=m_new, data1=m_blk, data2=m, op=nl.maximum)
        neg = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=neg, data=m_new, op0=nl.multiply, operand0=-scale, engine=nisa.gpsimd_engine)
        alpha = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=alpha, op=nl.exp, data=m, bias=neg, scale=scale)
        p_sb = nl.ndarray((rows, n), dtype=q.dtype, buffer=nl.sbuf)
        row_sum = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=p_sb, op=nl.exp, data=s_sb, bias=neg, scale=scale, reduce_res=row_sum,
                        reduce_op=nl.add)
        pv = nl.ndarray((rows, d), dtype=nl.float32, buffer=nl.psum)
        for c in range(0, n, P):
            w = min(P, n - c)
            pt_ps = nl.ndarray((w, rows), dtype=q.dtype, buffer=nl.psum)
            nisa.nc_transpose(dst=pt_ps, data=p_sb[:, c:c + w])
            pt = nl.ndarray((w, rows), dtype=q.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=pt, src=pt_ps, engine=nisa.scalar_engine)
            for h in range(hk):
                nisa.nc_matmul(dst=pv[h * tg:(h + 1) * tg, :], stationary=pt[:, h * tg:(h + 1) * tg],
                               moving=v_sb[0:w, c // P, h, :])
        nisa.scalar_tensor_tensor(dst=l_sum, data=l_sum, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                  operand1=row_sum)
        nisa.scalar_tensor_tensor(dst=acc, data=acc, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=pv)
        m = m_new
    inv = nl.ndarray((rows, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv, data=l_sum)
    o_sb = nl.ndarray((rows, d), dtype=q.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o_sb, data=acc, op0=nl.multiply, operand0=inv, engine=nisa.gpsimd_engine)
    for h in range(hk):  # rows (head, token, group member) -> out[s, token, h * G + member, :]
        nisa.dma_copy(dst=out.ap([[hq * d, t], [d, g], [1, d]], offset=s * t * hq * d + h * g * d),
                      src=o_sb[h * tg:(h + 1) * tg, :])
    return out


def cache_bytes(b: int, ctx: int, hk: int, d: int, itemsize: int = 2) -> float:
    """K and V bytes a decode step must read: every sequence's context, every kv head."""
    return 2.0 * b * ctx * hk * d * itemsize


def host(q, k_cache, v_cache, block_table, context_lens, scale: float = 1.0):
    """decode_attention's result computed with torch on the host (fp32, cast back)."""
    check_shapes(q, k_cache, v_cache, block_table)
    return reference(q, k_cache, v_cache, block_table, context_lens, scale).to(q.dtype)


def reference(q, k_cache, v_cache, block_table, context_lens, scale: float):
    """Gather each sequence's keys through its block table and attend in fp32 (test oracle)."""
    import torch
    b, t, hq, d = q.shape
    _, _, hk, bs = k_cache.shape
    g = hq // hk
    out = torch.empty(b, t, hq, d)
    for s in range(b):
        n = int(context_lens[s].reshape(-1)[0])
        blocks = block_table[s, :(n + bs - 1) // bs].long()
        keys = k_cache[blocks].float().permute(2, 0, 3, 1).reshape(hk, -1, d)[:, :n]   # [hk, n, d]
        vals = v_cache[blocks].float().permute(2, 0, 1, 3).reshape(hk, -1, d)[:, :n]
        for tok in range(t):
            seen = n - t + tok + 1
            qh = q[s, tok].float().view(hk, g, d)
            w = torch.softmax(scale * qh @ keys[:, :seen].transpose(1, 2), -1)
            out[s, tok] = (w @ vals[:, :seen]).reshape(hq, d)
    return out
