"""Flash-attention forward (one head): softmax(q k^T * scale) v without materialising the
scores, with an online softmax over key blocks.

Layout (contraction on partitions, as the Tensor engine wants): q_t [d, Sq], k_t [d, Sk],
v [Sk, d], d <= 128, Sq a multiple of 128, Sk a multiple of 512 (or at most 512 and a
multiple of 128). Output [Sq, d].
Per 128-query tile: scores [128, 512] in PSUM per key block; running max m, running sum l
and the unnormalised output acc live in SBUF (fp32); p is transposed 128 keys at a time on
the Tensor engine to multiply with v.
"""
from __future__ import annotations

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl

TQ, TK, TV = 128, 512, 128
NEG = -30000.0


@nki.jit
def flash_attention_fwd(q_t, k_t, v, scale: float = 1.0, causal: bool = False):
    d, sq = q_t.shape
    sk = k_t.shape[1]
    tk = min(TK, sk)  # key block: 512, or all keys when fewer
    assert d <= 128 and sq % TQ == 0 and sk % tk == 0 and tk % TV == 0, \
        f"flash_attention_fwd: need d <= 128, Sq % 128 == 0, Sk % {tk} == 0 (got d={d}, Sq={sq}, Sk={sk})"
    out = nl.ndarray((sq, d), dtype=q_t.dtype, buffer=nl.shared_hbm)
    for qi in nl.affine_range(sq // TQ):
        q_tile = nl.load(q_t[:, qi * TQ:(qi + 1) * TQ])
        m = nl.full((TQ, 1), NEG, dtype=nl.float32)
        l = nl.zeros((TQ, 1), dtype=nl.float32)
        acc = nl.zeros((TQ, d), dtype=nl.float32)
        n_blocks = sk // tk
        if causal:
            n_blocks = min(n_blocks, ((qi + 1) * TQ + tk - 1) // tk)
        for kj in nl.sequential_range(n_blocks):
            k_tile = nl.load(k_t[:, kj * tk:(kj + 1) * tk])
            s_psum = nisa.nc_matmul(q_tile, k_tile)
            s = nisa.tensor_scalar(s_psum, nl.multiply, scale, dtype=nl.float32)
            if causal:
                ip = nl.arange(TQ)[:, None]
                jf = nl.arange(tk)[None, :]
                s = nisa.affine_select(pred=(qi * TQ + ip >= kj * tk + jf), on_true_tile=s,
                                       on_false_value=NEG)
            m_blk = nisa.tensor_reduce(nl.max, s, axis=1, keepdims=True)
            m_new = nl.maximum(m, m_blk)
            neg_m = nl.multiply(m_new, -1.0)
            row_sum = nl.ndarray((TQ, 1), dtype=nl.float32)
            p = nisa.activation(op=nl.exp, data=s, bias=neg_m, reduce_op=nl.add, reduce_res=row_sum,
                                dtype=v.dtype)
            alpha = nisa.activation(op=nl.exp, data=m, bias=neg_m)
            l[...] = nisa.scalar_tensor_tensor(data=l, op0=nl.multiply, operand0=alpha,
                                               op1=nl.add, operand1=row_sum)
            pv = nl.zeros((TQ, d), dtype=nl.float32, buffer=nl.psum)
            for c in nl.affine_range(tk // TV):
                p_t = nl.copy(nisa.nc_transpose(p[:, c * TV:(c + 1) * TV]), dtype=v.dtype)
                v_tile = nl.load(v[kj * tk + c * TV:kj * tk + (c + 1) * TV, :])
                pv += nisa.nc_matmul(p_t, v_tile)
            acc[...] = nisa.scalar_tensor_tensor(data=acc, op0=nl.multiply, operand0=alpha,
                                                 op1=nl.add, operand1=pv)
            m[...] = nl.copy(m_new)
        inv_l = nisa.reciprocal(l)
        nl.store(out[qi * TQ:(qi + 1) * TQ, :], value=nisa.tensor_scalar(acc, nl.multiply, inv_l,
                                                                        dtype=out.dtype))
    return out
