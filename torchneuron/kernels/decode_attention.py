"""Decode (paged) attention in NKI, in vLLM's paged KV-cache layout: a few new query tokens per
sequence against the keys and values its block table names (prefix-cached blocks shared by
several sequences are simply named by several tables).

Layouts (those of the serving backend, serving/llm/attention.py: vLLM's CPU attention backend
with its "vec" kernels, the ISA vLLM picks for block sizes that are multiples of 32 on x86 hosts
without AMX):
- q [B, T, Hq, d]: T new tokens per sequence (vLLM's [tokens, Hq, d] query of a decode batch);
- kv_cache [num_blocks, Hkv, 2 * bs, d]: vLLM's [num_blocks, Hkv, bs, 2 * d] cache viewed with
  its K and V halves as rows; per block and key/value head, the keys transposed (a [d, bs] slab:
  K^T, d rows of bs keys), then the values (a [bs, d] slab); each slab is one contiguous run;
- block_table [B, max_blocks] int32: the cache block of each sequence's i-th bs keys;
- context_lens [B, 1] int32: keys each sequence holds, the T new ones included (token t of a
  sequence sees keys < len - T + t + 1).
Constraints: bf16 / fp16 / fp32; d <= 128; Hq a multiple of Hkv; T * Hq <= 128 score rows; bs
divides 128 or is a multiple of it up to 512. Output [B, T, Hq, d] in q's dtype.

One SPMD program per sequence. Every key/value head's scores share one PSUM tile (rows ordered
head, token, query head of the group), so the softmax runs once for all heads; the kernel walks
`max_blocks` blocks of the table in chunks of 512 keys (entries past a sequence's length must
name some valid block; their keys are masked), loading each block by its table entry at run
time (a dynamic DMA offset): each head's K^T slab as it lies (d on partitions, as the Tensor
engine contracts over d), the values of all heads with one transposing DMA of Hkv slabs (a DMA
per head's slab uses only half the DMA queues below 64 KB), put back with keys on partitions
for P V by PE transposes. K and V stream from HBM once. With bs * d * itemsize under 64 KB the
per-head K^T loads are what bounds the kernel (bench/nki_kernels.py: block size 128 vs 256).
Scores, softmax statistics and the output accumulate in fp32; P is cast to the input dtype for
the P V matmul.
"""
from __future__ import annotations

import torch

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl
from ..nki.dtypes import to_torch

P = 128
CHUNK = 512
NEG = -3.0e38
PSUM_BANK = 2048  # bytes of a partition's PSUM bank
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class UnsupportedInput(ValueError):
    """Well-formed operands the kernel does not take (a head dim, dtype, query rows or block
    size outside its constraints): callers may fall back to `generic`."""


def check_shapes(q, kv_cache, block_table) -> tuple:
    """(B, T, Hq, d, Hkv, bs, max_blocks, group) of valid operands; raises naming the rule."""
    if len(q.shape) != 4 or len(kv_cache.shape) != 4 or len(block_table.shape) != 2:
        raise ValueError(f"decode_attention: q must be [B, T, Hq, d], kv_cache [blocks, Hkv, 2 * block_size, d] "
                         f"and block_table [B, max_blocks]; got {tuple(q.shape)}, {tuple(kv_cache.shape)}, "
                         f"{tuple(block_table.shape)}")
    b, t, hq, d = q.shape
    _, hk, rows, dk = kv_cache.shape
    dtype, kv_dtype = to_torch(q.dtype), to_torch(kv_cache.dtype)
    if dtype not in DTYPES or kv_dtype != dtype:
        raise UnsupportedInput(f"decode_attention: q and kv_cache must share one dtype of bf16, fp16 or fp32; "
                        f"got {dtype} and {kv_dtype}")
    if dk != d or rows % 2:
        raise ValueError(f"decode_attention: kv_cache must be [blocks, Hkv, 2 * block_size, d] with q's head dim "
                         f"d = {d}; got {tuple(kv_cache.shape)}")
    if d > P:
        raise UnsupportedInput(f"decode_attention: head dim {d} is over {P} (the kernel contracts over d in one "
                               f"pass of {P} partitions); the kernel takes head dims <= {P}")
    if hq % hk:
        raise ValueError(f"decode_attention: {hq} query heads are not a multiple of {hk} key/value heads")
    if t * hq > P:
        raise UnsupportedInput(f"decode_attention: T * Hq = {t * hq} score rows (T = {t} new tokens, {hq} query "
                               f"heads) is over {P}, the partitions of one score tile")
    bs = rows // 2
    if not (P % bs == 0 or (bs % P == 0 and bs <= CHUNK)):
        raise UnsupportedInput(f"decode_attention: block size {bs} must divide {P} or be a multiple of it up to "
                               f"{CHUNK} (the keys of one score tile)")
    if block_table.shape[0] != b:
        raise ValueError(f"decode_attention: block_table has {block_table.shape[0]} rows for {b} sequences")
    return b, t, hq, d, hk, bs, block_table.shape[1], hq // hk


def _load_unit(kv_cache, table, u0: int, w: int, hk: int, bs: int, d: int) -> tuple:
    """K^T and V^T [d, Hkv, w] of one sequence's keys u0 .. u0 + w (one unit: a block, or the
    blocks of 128 keys), block by block through its table row: per block, the [Hkv, bs, d] keys
    (then values) in one transposing DMA. Each unit has its own tiles, so the DMAs of different
    units do not wait on each other."""
    slab = bs * d  # one (block, head) K or V run; a block's heads are 2 * slab apart
    k_t = nl.ndarray((d, hk, w), dtype=kv_cache.dtype, buffer=nl.sbuf)
    v_t = nl.ndarray((d, hk, w), dtype=kv_cache.dtype, buffer=nl.sbuf)
    for i in range(u0 // bs, (u0 + w) // bs):
        blk = table[0:1, i:i + 1]  # the block's number, read at run time
        kk = i * bs - u0
        for h in range(hk):  # K^T of a head: its [d, bs] slab as is, d on partitions
            nisa.dma_copy(dst=k_t[:, h, kk:kk + bs], src=kv_cache.ap([[bs, d], [1, bs]], offset=h * 2 * slab,
                                                                     scalar_offset=blk, indirect_dim=0))
        # V of every head, [Hkv, bs, d] in HBM -> [d, bs, Hkv] into v_t[:, h, kk:kk + bs]
        nisa.dma_transpose(dst=v_t.ap([[hk * w, d], [1, bs], [w, hk]], offset=kk),
                           src=kv_cache.ap([[2 * slab, hk], [d, bs], [1, d]], offset=slab, scalar_offset=blk,
                                           indirect_dim=0))
    return k_t, v_t


def _load_chunk(kv_cache, table, c0: int, n: int, unit: int, hk: int, bs: int, d: int) -> list:
    """[(key offset in the chunk, K^T, V^T)] of the units of keys c0 .. c0 + n."""
    return [(u, *_load_unit(kv_cache, table, c0 + u, min(unit, n - u), hk, bs, d)) for u in range(0, n, unit)]


@nki.jit
def decode_attention(q, kv_cache, block_table, context_lens, scale: float = 1.0):
    b, t, hq, d, hk, bs, maxb, g = check_shapes(q, kv_cache, block_table)
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
    heads_per_bank = max(1, PSUM_BANK // (d * to_torch(kv_cache.dtype).itemsize))
    unit = max(bs, P)  # keys loaded into one pair of tiles
    chunk = unit * max(1, CHUNK // unit)  # keys of one online-softmax step
    starts = list(range(0, keys, chunk))
    ahead = _load_chunk(kv_cache, table, 0, min(chunk, keys), unit, hk, bs, d)
    for j, c0 in enumerate(starts):
        n = min(chunk, keys - c0)
        units = ahead
        if j + 1 < len(starts):  # the next chunk's loads are issued before this chunk's compute
            ahead = _load_chunk(kv_cache, table, starts[j + 1], min(chunk, keys - starts[j + 1]), unit, hk, bs, d)
        s_ps = nl.ndarray((rows, n), dtype=nl.float32, buffer=nl.psum)
        for u, k_t, _ in units:
            for h in range(hk):
                nisa.nc_matmul(dst=s_ps[h * tg:(h + 1) * tg, u:u + k_t.shape[2]], stationary=q_t[h],
                               moving=k_t[:, h, :])
        # V back to keys on partitions for P V: PE transposes of 128 keys, heads grouped per PSUM bank
        v_sb = nl.ndarray((P, (n + P - 1) // P, hk, d), dtype=kv_cache.dtype, buffer=nl.sbuf)
        for u, _, v_t in units:
            for c in range(0, v_t.shape[2], P):
                w, col = min(P, v_t.shape[2] - c), (u + c) // P
                for h0 in range(0, hk, heads_per_bank):
                    nh = min(heads_per_bank, hk - h0)
                    vt_ps = nl.ndarray((w, nh, d), dtype=kv_cache.dtype, buffer=nl.psum)
                    for h in range(nh):
                        nisa.nc_transpose(dst=vt_ps[:, h, :], data=v_t[:, h0 + h, c:c + w])
                    nisa.tensor_copy(dst=v_sb[0:w, col, h0:h0 + nh, :], src=vt_ps,
                                     engine=nisa.vector_engine if (col + h0) % 2 else nisa.scalar_engine)
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


def _attend(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
            scale: float, round_p: bool) -> torch.Tensor:
    """Attention through the block tables with torch ops (any device), scores and sums in fp32;
    `round_p` rounds the softmax numerators to q's dtype before P V, as the kernel's p tile."""
    b, t, hq, d = q.shape
    hk, bs = kv_cache.shape[1], kv_cache.shape[2] // 2
    g = hq // hk
    maxb = block_table.shape[1]
    # every sequence's blocks: [B, max_blocks, Hkv, 2 * bs, d] -> K, V [B, Hkv, keys, d]
    gathered = kv_cache[block_table.long()].transpose(1, 2)
    k = gathered[:, :, :, :bs].reshape(b, hk, maxb, d, bs).transpose(-1, -2).reshape(b, hk, maxb * bs, d).float()
    v = gathered[:, :, :, bs:].reshape(b, hk, maxb * bs, d).float()
    qh = q.float().view(b, t, hk, g, d).permute(0, 2, 1, 3, 4).reshape(b, hk, t * g, d)  # rows (token, member)
    scores = (qh @ k.transpose(-1, -2)).view(b, hk, t, g, maxb * bs)
    # token i of a sequence sees keys < len - T + i + 1
    seen = context_lens.reshape(b, 1, 1, 1, 1).long() - t + 1 + torch.arange(t, device=q.device).view(1, 1, t, 1, 1)
    keys = torch.arange(maxb * bs, device=q.device).view(1, 1, 1, 1, -1)
    scores = scores.masked_fill(keys >= seen, float("-inf"))
    p = torch.exp(scale * (scores - scores.amax(-1, keepdim=True)))
    total = p.sum(-1, keepdim=True)
    if round_p:
        p = p.to(q.dtype).float()
    out = (p / total).view(b, hk, t * g, maxb * bs) @ v
    return out.view(b, hk, t, g, d).permute(0, 2, 1, 3, 4).reshape(b, t, hq, d).to(q.dtype)


def host(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
         scale: float = 1.0) -> torch.Tensor:
    """decode_attention's result computed with torch on the host, with the kernel's numerics:
    scores, softmax statistics and P V accumulate in fp32 from the input-dtype operands, P is
    rounded to the input dtype before P V (as the kernel's p tile), the output cast back. CPU
    operands (the host views of device tensors) run one C++ kernel of those numerics,
    `torchneuron::paged_decode_attention_host`; others the same steps as torch ops."""
    check_shapes(q, kv_cache, block_table)
    if q.device.type == "cpu" and kv_cache.device.type == "cpu":  # one C++ kernel (ops/csrc/decode_attention.cpp)
        return torch.ops.torchneuron.paged_decode_attention_host(q, kv_cache, block_table, context_lens, scale)
    return _attend(q, kv_cache, block_table, context_lens, scale, round_p=True)


def generic(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
            scale: float) -> torch.Tensor:
    """The same attention for operands the kernel does not take (UnsupportedInput), as plain torch
    ops on the tensors' device (fp32 softmax, no kernel constraints)."""
    return _attend(q, kv_cache, block_table, context_lens, scale, round_p=False)


def reference(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
              scale: float) -> torch.Tensor:
    """Gather each sequence's keys through its block table and attend in fp32, one sequence
    and token at a time (the test oracle)."""
    b, t, hq, d = q.shape
    hk, bs = kv_cache.shape[1], kv_cache.shape[2] // 2
    g = hq // hk
    out = torch.empty(b, t, hq, d)
    for s in range(b):
        n = int(context_lens.reshape(-1)[s])
        blocks = block_table[s, :(n + bs - 1) // bs].long()
        cache = kv_cache[blocks].float().transpose(0, 1)   # [hk, blocks, 2 * bs, d]
        keys = cache[:, :, :bs].reshape(hk, -1, d, bs).transpose(-1, -2).reshape(hk, -1, d)[:, :n]  # K^T slabs
        vals = cache[:, :, bs:].reshape(hk, -1, d)[:, :n]
        for tok in range(t):
            seen = n - t + tok + 1
            qh = q[s, tok].float().view(hk, g, d)
            w = torch.softmax(scale * qh @ keys[:, :seen].transpose(1, 2), -1)
            out[s, tok] = (w @ vals[:, :seen]).reshape(hq, d)
    return out
