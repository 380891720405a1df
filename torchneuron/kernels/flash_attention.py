"""Flash attention forward and backward for many heads, in NKI (destination-first ISA).

Layouts (natural, as torch holds them): q [BHq, Sq, d], k and v [BHkv, Sk, d] with heads
batch-major (index b * H + h), so query head i uses key/value head i // (BHq // BHkv): GQA
and MQA. d <= 128, Sq and Sk multiples of 128. One SPMD program per query head.

Forward, per head: K^T [d, Sk] and V [Sk, d] are loaded once (DMA transposes K) and stay
in SBUF (Sk <= 32K at d = 128); per 128-query tile and key block of up to 1024 keys:
scores in two PSUM banks (Tensor engine), their row maxima (Vector engine, fused with the
causal / sliding-window mask by `range_select` on diagonal blocks), exp(scale * (s - m))
with its row sums in the Scalar engine's reduction registers, P transposed 128 keys at a
time on the Tensor engine into one PSUM bank, copied to SBUF by the Scalar (3/4) and Vector
(1/4) engines, multiplied with V into a PSUM accumulator, rescaled into the running output;
the [128, 1] bookkeeping (running max, -scale * max, running sum) runs on the otherwise idle
GpSimd engine. Phase A (scores, maxima) of the next step is issued before phase B of the
current one, so two steps are in flight. A step is bound by the Scalar and Vector engines
(the maxima, exps and P^T copies each touch every score once), not by the Tensor engine.
Outputs: out [BHq, Sq, d] and the log-sum-exp lse [BHq, Sq, 1] (natural log of sum
exp(scale * s)) that backward reuses.

Backward (FlashAttention-2 order), per query head: per group of four 128-key tiles (their
dK and dV accumulate in two PSUM banks), over the query tiles they see: S and
P = exp(scale * S - lse) are recomputed, dV += P^T dO, dP = dO V^T, dS = P * (dP - D) with
D = rowsum(dO * O), dK += scale * dS^T Q, dQ += scale * dS K (summed over the group's key
tiles in PSUM, then added once to an fp32 accumulator in SBUF: a Vector-engine add per
pair was the step's critical path). dK and dV are per query head; the op sums them over a
GQA group.

Masks: `causal` keeps key j <= query i; `window` > 0 also drops j <= i - window (the
window counts the query itself, as SDPA's sliding-window masks do).
"""
from __future__ import annotations

import math

import numpy as np

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl

P = 128           # partitions: query tile, key chunk
BANK = 512        # fp32 scores per PSUM bank
KBLOCK = 1024     # keys per softmax step (two PSUM banks; two steps are in flight)
NEG = -3.0e38     # masked score (rounds to -inf below fp32)
KGROUP = 4            # backward: key tiles whose dK, dV accumulate together (one PSUM bank each)
LOOKAHEAD = 1         # phase A of this many later steps is issued before phase B of a step
VECTOR_COPY_SHARE = 4  # the Vector engine copies 1/4 of P^T out of PSUM, the Scalar engine the rest


def itemsize(dtype) -> int:
    """Bytes of a kernel tile's dtype (an NKI dtype or a numpy one)."""
    size = getattr(dtype, "itemsize", None)
    return size if isinstance(size, int) else np.dtype(dtype).itemsize


def check_shapes(q, k, v, what: str) -> tuple:
    """(BHq, Sq, d, BHkv, Sk, group) after validating the layout; raises naming the rule."""
    bhq, sq, d = q.shape
    bhk, sk, dk = k.shape
    if tuple(v.shape) != (bhk, sk, dk) or dk != d:
        raise ValueError(f"{what}: k {tuple(k.shape)} and v {tuple(v.shape)} must both be [BHkv, Sk, d] "
                         f"with q's d = {d}")
    if d > P:
        raise ValueError(f"{what}: head dim {d} is over {P} (one contraction pass)")
    if sq % P or sk % P:
        raise ValueError(f"{what}: sequence lengths must be multiples of {P}, got Sq={sq}, Sk={sk}")
    if bhq % bhk:
        raise ValueError(f"{what}: {bhq} query heads are not a multiple of {bhk} key/value heads")
    if sk * 2 * 2 > 160 * 1024:
        raise ValueError(f"{what}: Sk={sk} does not fit K^T and V in SBUF (at most 32768 keys)")
    return bhq, sq, d, bhk, sk, bhq // bhk


def _key_range(qi: int, sk: int, causal: bool, window: int) -> tuple[int, int]:
    """First and end key (multiples of 128) a query tile can see."""
    hi = min(sk, (qi + 1) * P) if causal else sk
    lo = 0
    if window > 0:
        lo = max(0, (qi * P - window + 1) // P * P)
    return lo, hi


def _bounds(qi: int, causal: bool, window: int, sk: int):
    """Per-query [P, 1] tiles: first allowed key and one past the last (fp32)."""
    lo = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    hi = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    if window > 0:
        nisa.iota(lo, [[1, 1]], qi * P - window + 1, 1)
    else:
        nisa.memset(dst=lo, value=0.0, engine=nisa.gpsimd_engine)
    if causal:
        nisa.iota(hi, [[1, 1]], qi * P + 1, 1)
    else:
        nisa.memset(dst=hi, value=float(sk), engine=nisa.gpsimd_engine)
    return lo, hi


def _needs_mask(qi: int, k0: int, k1: int, causal: bool, window: int) -> bool:
    """Whether keys [k0, k1) cross a mask edge for query tile qi."""
    q0, q1 = qi * P, qi * P + P - 1
    if causal and k1 - 1 > q0:
        return True
    return window > 0 and k0 <= q1 - window


def _load_kv(k, v, kv: int, sk: int, d: int):
    """K^T [d, Sk] and V as [128 keys, Sk/128, d] in SBUF (loaded once per head)."""
    k_t = nl.ndarray((d, sk), dtype=k.dtype, buffer=nl.sbuf)
    v_sb = nl.ndarray((P, sk // P, d), dtype=v.dtype, buffer=nl.sbuf)
    for c in range(sk // KBLOCK + (sk % KBLOCK > 0)):
        n = min(KBLOCK, sk - c * KBLOCK)
        nisa.dma_transpose(dst=k_t[:, c * KBLOCK:c * KBLOCK + n], src=k[kv, c * KBLOCK:c * KBLOCK + n, :])
    # v[kv] rows r = t * 128 + p land on partition p, slot t
    nisa.dma_copy(dst=v_sb, src=v.ap([[d, P], [P * d, sk // P], [1, d]], offset=kv * sk * d))
    return k_t, v_sb


class _Tile:
    """Running softmax state of one 128-query tile."""

    def __init__(self, q, h: int, qi: int, d: int, causal: bool, window: int, sk: int):
        self.qi = qi
        self.q_t = nl.ndarray((d, P), dtype=q.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=self.q_t, src=q[h, qi * P:(qi + 1) * P, :])
        self.m = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.m, value=NEG, engine=nisa.gpsimd_engine)
        self.l_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.l_sum, value=0.0, engine=nisa.gpsimd_engine)
        self.acc = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=self.acc, value=0.0, engine=nisa.gpsimd_engine)
        self.lo, self.hi = _bounds(qi, causal, window, sk)


def _scores(t: _Tile, k_t, b0: int, b1: int, causal: bool, window: int):
    """Phase A of a key block: scores (PSUM, or SBUF where masked) and their row maxima."""
    banks = [(s0, min(s0 + BANK, b1)) for s0 in range(b0, b1, BANK)]
    part_max = nl.ndarray((P, len(banks)), dtype=nl.float32, buffer=nl.sbuf)
    scores = []
    for j, (s0, s1) in enumerate(banks):
        s_ps = nl.ndarray((P, s1 - s0), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=s_ps, stationary=t.q_t, moving=k_t[:, s0:s1])
        if _needs_mask(t.qi, s0, s1, causal, window):
            s_sb = nl.ndarray((P, s1 - s0), dtype=nl.float32, buffer=nl.sbuf)
            nisa.range_select(dst=s_sb, on_true_tile=s_ps, comp_op0=nl.greater_equal, comp_op1=nl.less,
                              bound0=t.lo, bound1=t.hi, range_start=float(s0), on_false_value=NEG,
                              reduce_res=part_max[:, j:j + 1], reduce_op=nl.maximum,
                              reduce_cmd=nisa.reduce_cmd.reset_reduce)
            scores.append(s_sb)
        else:
            nisa.tensor_reduce(dst=part_max[:, j:j + 1], op=nl.maximum, data=s_ps, axis=1)
            scores.append(s_ps)
    return banks, scores, part_max


def _running_max(m_new, m_old, part_max) -> None:
    """m_new = max(m_old, the block's per-bank maxima) in one or two GpSimd instructions (SBUF only)."""
    cols = part_max.shape[1]
    src = m_old
    for c in range(0, cols, 2):
        hi = min(c + 2, cols)
        kw = dict(op1=nl.maximum, operand1=part_max[:, c + 1:c + 2]) if hi - c == 2 else {}
        nisa.tensor_scalar(dst=m_new, data=src, op0=nl.maximum, operand0=part_max[:, c:c + 1],
                           engine=nisa.gpsimd_engine, **kw)
        src = m_new


def _transpose_into_pv(pv, probs, banks, v_sb, dtype) -> None:
    """pv += P V: P^T 128 keys at a time on the Tensor engine into PSUM tiles of up to a
    bank, each copied to SBUF once, its last `1 / VECTOR_COPY_SHARE` chunks by the Vector
    engine and the rest by the Scalar engine, then multiplied with V."""
    chunks = [(j, c) for j, (s0, s1) in enumerate(banks) for c in range((s1 - s0) // P)]
    per_tile = BANK * 4 // (P * itemsize(dtype))  # chunks of P^T in one PSUM bank
    for g in range(0, len(chunks), per_tile):
        group = chunks[g:g + per_tile]
        pt_ps = nl.ndarray((P, len(group), P), dtype=dtype, buffer=nl.psum)
        for i, (j, c) in enumerate(group):
            nisa.nc_transpose(dst=pt_ps[:, i, :], data=probs[j][:, c * P:(c + 1) * P])
        pt = nl.ndarray((P, len(group), P), dtype=dtype, buffer=nl.sbuf)
        split = len(group) - len(group) // VECTOR_COPY_SHARE
        nisa.tensor_copy(dst=pt[:, :split, :], src=pt_ps[:, :split, :], engine=nisa.scalar_engine)
        if split < len(group):
            nisa.tensor_copy(dst=pt[:, split:, :], src=pt_ps[:, split:, :], engine=nisa.vector_engine)
        for i, (j, c) in enumerate(group):
            nisa.nc_matmul(dst=pv, stationary=pt[:, i, :], moving=v_sb[:, (banks[j][0] + c * P) // P, :])


def _accumulate(t: _Tile, v_sb, banks, scores, part_max, scale: float, dtype, d: int) -> None:
    """Phase B: new running max, P = exp(scale * (s - m)), P^T V into the running output.

    The Scalar and Vector engines, not the Tensor engine, bound a step, so: the [P, 1]
    bookkeeping runs on the GpSimd engine (SBUF operands only); the row sums stay in the
    Scalar engine's reduction registers across the step's exps (one read-out); the P^T
    copies are shared by the Scalar and Vector engines."""
    m_new = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    _running_max(m_new, t.m, part_max)
    neg = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg, data=m_new, op0=nl.multiply, operand0=-scale, engine=nisa.gpsimd_engine)
    alpha = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=alpha, op=nl.exp, data=t.m, bias=neg, scale=scale)
    blk_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    probs = []
    for j, (s0, s1) in enumerate(banks):  # the exps back to back, summing in the registers
        p_sb = nl.ndarray((P, s1 - s0), dtype=dtype, buffer=nl.sbuf)
        nisa.activation(dst=p_sb, op=nl.exp, data=scores[j], bias=neg, scale=scale,
                        reduce_cmd=nisa.reduce_cmd.reduce if j else nisa.reduce_cmd.reset_reduce,
                        reduce_res=blk_sum if j == len(banks) - 1 else None, reduce_op=nl.add)
        probs.append(p_sb)
    pv = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.psum)
    _transpose_into_pv(pv, probs, banks, v_sb, dtype)
    nisa.tensor_scalar(dst=t.l_sum, data=t.l_sum, op0=nl.multiply, operand0=alpha, op1=nl.add,
                       operand1=blk_sum, engine=nisa.gpsimd_engine)
    nisa.scalar_tensor_tensor(dst=t.acc, data=t.acc, op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=pv)
    t.m = m_new


def _finish(t: _Tile, out, lse, h: int, scale: float, dtype, d: int) -> None:
    inv = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv, data=t.l_sum)
    o_sb = nl.ndarray((P, d), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o_sb, data=t.acc, op0=nl.multiply, operand0=inv, engine=nisa.gpsimd_engine)
    nisa.dma_copy(dst=out[h, t.qi * P:(t.qi + 1) * P, :], src=o_sb)
    lse_sb = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=lse_sb, op=nl.log, data=t.l_sum)
    nisa.scalar_tensor_tensor(dst=lse_sb, data=t.m, op0=nl.multiply, operand0=scale, op1=nl.add, operand1=lse_sb)
    nisa.dma_copy(dst=lse[h, t.qi * P:(t.qi + 1) * P, :], src=lse_sb)


@nki.jit
def attention_fwd(q, k, v, scale: float = 1.0, causal: bool = False, window: int = 0):
    bhq, sq, d, bhk, sk, group = check_shapes(q, k, v, "attention_fwd")
    out = nl.ndarray((bhq, sq, d), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((bhq, sq, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    h = nl.program_id(0)
    k_t, v_sb = _load_kv(k, v, h // group, sk, d)
    # every (query tile, key block) step; phase A (scores, maxima) of the next step is issued
    # before phase B (softmax, PV) of this one, so the engines work on two steps at once
    steps = []
    for qi in range(sq // P):
        k_lo, k_hi = _key_range(qi, sk, causal, window)
        blocks = [(b0, min(b0 + KBLOCK, k_hi)) for b0 in range(k_lo, k_hi, KBLOCK)]
        steps += [(qi, b0, b1, i == len(blocks) - 1) for i, (b0, b1) in enumerate(blocks)]
    tiles: dict = {}

    def phase_a(step):
        qi, b0, b1, _ = step
        if qi not in tiles:
            tiles[qi] = _Tile(q, h, qi, d, causal, window, sk)
        return _scores(tiles[qi], k_t, b0, b1, causal, window)

    in_flight = [phase_a(s) for s in steps[:LOOKAHEAD]]
    for i, step in enumerate(steps):
        if i + LOOKAHEAD < len(steps):
            in_flight.append(phase_a(steps[i + LOOKAHEAD]))
        _accumulate(tiles[step[0]], v_sb, *in_flight.pop(0), scale, q.dtype, d)
        if step[3]:
            _finish(tiles.pop(step[0]), out, lse, h, scale, q.dtype, d)
    return out, lse


def _resident(src, h: int, s: int, d: int, transposed: bool):
    """One head of a [BH, S, d] tensor in SBUF: natural as [128, S/128, d] (row t*128 + p on
    partition p) or transposed as [d, S]."""
    if transposed:
        dst = nl.ndarray((d, s), dtype=src.dtype, buffer=nl.sbuf)
        for c in range(0, s, KBLOCK):
            n = min(KBLOCK, s - c)
            nisa.dma_transpose(dst=dst[:, c:c + n], src=src[h, c:c + n, :])
        return dst
    dst = nl.ndarray((P, s // P, d), dtype=src.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=dst, src=src.ap([[d, P], [P * d, s // P], [1, d]], offset=h * s * d))
    return dst


def _pair_visible(qi: int, kj: int, causal: bool, window: int) -> bool:
    """Whether any key of tile kj is visible to a query of tile qi."""
    if causal and kj > qi:
        return False
    return not (window > 0 and kj * P + P - 1 <= qi * P - window)


@nki.jit
def attention_bwd(q, k, v, o, do, lse, scale: float = 1.0, causal: bool = False, window: int = 0):
    """Gradients (dq [BHq, Sq, d], dk and dv [BHq, Sk, d] per query head) of attention_fwd."""
    bhq, sq, d, bhk, sk, group = check_shapes(q, k, v, "attention_bwd")
    isz = itemsize(q.dtype)
    resident = (3 * sq // P * d + 2 * sq + sk // P * d + 2 * sk + sq // P * d) * isz + sq // P * d * 4
    if resident > 180 * 1024:
        raise ValueError(f"attention_bwd: Sq={sq}, Sk={sk} at d={d} need {resident} B a partition for Q, K, V, "
                         "O, dO and dQ in SBUF; at most 180 KiB (8192 each at d = 128 in bf16)")
    dq = nl.ndarray((bhq, sq, d), dtype=q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray((bhq, sk, d), dtype=q.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((bhq, sk, d), dtype=q.dtype, buffer=nl.shared_hbm)
    h = nl.program_id(0)
    kv = h // group
    q_n, q_t = _resident(q, h, sq, d, False), _resident(q, h, sq, d, True)
    do_n, do_t = _resident(do, h, sq, d, False), _resident(do, h, sq, d, True)
    k_n, k_t = _resident(k, kv, sk, d, False), _resident(k, kv, sk, d, True)
    v_t = _resident(v, kv, sk, d, True)
    nq = sq // P
    # -lse and D = rowsum(dO * O) per query tile, [128, nq] fp32
    neg_lse = nl.ndarray((P, nq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=neg_lse, src=lse.ap([[1, P], [P, nq], [1, 1]], offset=h * sq))
    nisa.tensor_scalar(dst=neg_lse, data=neg_lse, op0=nl.multiply, operand0=-1.0, engine=nisa.gpsimd_engine)
    o_n = _resident(o, h, sq, d, False)
    dsum = nl.ndarray((P, nq), dtype=nl.float32, buffer=nl.sbuf)
    for qi in range(nq):
        prod = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=prod, data1=do_n[:, qi, :], data2=o_n[:, qi, :], op=nl.multiply,
                           engine=nisa.gpsimd_engine)
        nisa.tensor_reduce(dst=dsum[:, qi:qi + 1], op=nl.add, data=prod, axis=1)
    dq_acc = nl.ndarray((P, nq, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=dq_acc, value=0.0, engine=nisa.gpsimd_engine)
    bounds: dict = {}

    def phase_a(qi: int, kj: int):
        """S, its mask, P = exp(scale * S - lse), dP = dO V^T for one (query, key) tile pair."""
        s_ps = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=s_ps, stationary=q_t[:, qi * P:(qi + 1) * P], moving=k_t[:, kj * P:(kj + 1) * P])
        s_in = s_ps
        if _needs_mask(qi, kj * P, kj * P + P, causal, window):
            if qi not in bounds:
                bounds[qi] = _bounds(qi, causal, window, sk)
            lo, hi = bounds[qi]
            s_in = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.range_select(dst=s_in, on_true_tile=s_ps, comp_op0=nl.greater_equal, comp_op1=nl.less,
                              bound0=lo, bound1=hi, range_start=float(kj * P), on_false_value=NEG)
        p_sb = nl.ndarray((P, P), dtype=q.dtype, buffer=nl.sbuf)
        nisa.activation(dst=p_sb, op=nl.exp, data=s_in, bias=neg_lse[:, qi, :], scale=scale)
        dp_ps = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=dp_ps, stationary=do_t[:, qi * P:(qi + 1) * P], moving=v_t[:, kj * P:(kj + 1) * P])
        return p_sb, dp_ps

    def phase_b(qi: int, kj: int, p_sb, dp_ps, dv_ps, dk_ps, dq_ps) -> None:
        """dV += P^T dO, dS = P (dP - D), dK += dS^T Q, dQ += dS K (dQ in PSUM: `dq_ps`)."""
        nisa.nc_matmul(dst=dv_ps, stationary=p_sb, moving=do_n[:, qi, :])
        ds = nl.ndarray((P, P), dtype=q.dtype, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=ds, data=dp_ps, op0=nl.subtract, operand0=dsum[:, qi:qi + 1],
                                  op1=nl.multiply, operand1=p_sb)
        nisa.nc_matmul(dst=dk_ps, stationary=ds, moving=q_n[:, qi, :])
        dst_ps = nl.ndarray((P, P), dtype=q.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=dst_ps, data=ds)
        ds_t = nl.ndarray((P, P), dtype=q.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=ds_t, src=dst_ps, engine=nisa.scalar_engine)
        nisa.nc_matmul(dst=dq_ps, stationary=ds_t, moving=k_n[:, kj, :])

    def store_dkv(k0: int, n: int, dv_ps, dk_ps) -> None:
        """dV and scale * dK of key tiles k0 .. k0 + n - 1 to HBM (one copy and DMA each)."""
        rows = [[d, P], [P * d, n], [1, d]]
        for src, dst, mult in ((dv_ps, dv, 1.0), (dk_ps, dk, scale)):
            out_sb = nl.ndarray((P, n, d), dtype=q.dtype, buffer=nl.sbuf)
            nisa.activation(dst=out_sb, op=nl.copy, data=src[:, :n, :], scale=mult)
            nisa.dma_copy(dst=dst.ap(rows, offset=(h * sk + k0 * P) * d), src=out_sb)

    # FlashAttention-2 order: groups of KGROUP key tiles outer (their dK, dV accumulate in two
    # PSUM banks), query tiles inner; a query tile's dQ sums over the group's key tiles in
    # PSUM, then once into SBUF (the Vector engine's add per pair was its critical path)
    nk = sk // P
    pairs = [(qi, kj) for kg in range(0, nk, KGROUP) for qi in range(nq)
             for kj in range(kg, min(kg + KGROUP, nk)) if _pair_visible(qi, kj, causal, window)]
    in_flight = [phase_a(*pair) for pair in pairs[:LOOKAHEAD]]
    acc = dq_ps = None
    for i, (qi, kj) in enumerate(pairs):
        if i + LOOKAHEAD < len(pairs):
            in_flight.append(phase_a(*pairs[i + LOOKAHEAD]))
        kg = kj // KGROUP * KGROUP
        if acc is None:
            acc = tuple(nl.ndarray((P, KGROUP, d), dtype=nl.float32, buffer=nl.psum) for _ in range(2))
        if dq_ps is None:
            dq_ps = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.psum)
        phase_b(qi, kj, *in_flight.pop(0), acc[0][:, kj - kg, :], acc[1][:, kj - kg, :], dq_ps)
        nxt = pairs[i + 1] if i + 1 < len(pairs) else (None, -1)
        same_group = nxt[1] // KGROUP * KGROUP == kg
        if nxt[0] != qi or not same_group:
            nisa.tensor_tensor(dst=dq_acc[:, qi, :], data1=dq_acc[:, qi, :], data2=dq_ps, op=nl.add)
            dq_ps = None
        if not same_group:
            store_dkv(kg, min(KGROUP, nk - kg), *acc)
            acc = None
    seen = {p[1] for p in pairs}
    for kj in range(sk // P):  # key tiles no query sees get zero gradients
        if kj not in seen:
            zero = nl.ndarray((P, d), dtype=q.dtype, buffer=nl.sbuf)
            nisa.memset(dst=zero, value=0.0, engine=nisa.gpsimd_engine)
            nisa.dma_copy(dst=dk[h, kj * P:(kj + 1) * P, :], src=zero)
            nisa.dma_copy(dst=dv[h, kj * P:(kj + 1) * P, :], src=zero)
    dq_sb = nl.ndarray((P, nq, d), dtype=q.dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=dq_sb, data=dq_acc, op0=nl.multiply, operand0=scale, engine=nisa.gpsimd_engine)
    nisa.dma_copy(dst=dq.ap([[d, P], [P * d, nq], [1, d]], offset=h * sq * d), src=dq_sb)
    return dq, dk, dv


def flops(bhq: int, sq: int, sk: int, d: int, causal: bool, window: int = 0, backward: bool = False) -> float:
    """Useful matmul FLOPs (QK^T and PV; backward: 2.5x: S, dP, dV, dK, dQ) of the visible
    (unmasked) score entries."""
    seen = 0
    for i in range(sq):
        hi = min(sk, i + 1) if causal else sk
        lo = max(0, i - window + 1) if window > 0 else 0
        seen += max(0, hi - lo)
    per = 4 * d * seen * bhq
    return per * (2.5 if backward else 1.0)


def _mask(sq: int, sk: int, causal: bool, window: int):
    import torch
    i, j = torch.arange(sq).view(-1, 1), torch.arange(sk).view(1, -1)
    keep = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window > 0:
        keep &= j > i - window
    return keep


def host_fwd(q, k, v, scale: float = 1.0, causal: bool = False, window: int = 0):
    """attention_fwd's result computed with torch on the host, the kernel's numerics: fp32
    scores and sums, P rounded to the input dtype before P V, the output cast back."""
    import torch
    check_shapes(q, k, v, "attention_fwd")
    g = q.shape[0] // k.shape[0]
    kf, vf = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    s = (q.float() @ kf.transpose(1, 2)).masked_fill(~_mask(q.shape[1], k.shape[1], causal, window), -math.inf)
    m = s.amax(-1, keepdim=True)
    p = torch.exp(scale * (s - m))
    l_sum = p.sum(-1, keepdim=True)
    out = (p.to(q.dtype).float() @ vf) / l_sum
    return out.to(q.dtype), scale * m + torch.log(l_sum)


def host_bwd(q, k, v, o, do, lse, scale: float = 1.0, causal: bool = False, window: int = 0):
    """attention_bwd's results computed with torch on the host (fp32, P and dS rounded to the
    input dtype before their matmuls, as in the kernel); dK, dV per query head."""
    import torch
    check_shapes(q, k, v, "attention_bwd")
    g = q.shape[0] // k.shape[0]
    kf, vf = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    s = (q.float() @ kf.transpose(1, 2)).masked_fill(~_mask(q.shape[1], k.shape[1], causal, window), -math.inf)
    p = torch.exp(scale * s - lse).to(q.dtype).float()
    dof = do.float()
    dv = p.transpose(1, 2) @ dof
    dp = dof @ vf.transpose(1, 2)
    ds = (p * (dp - (dof * o.float()).sum(-1, keepdim=True))).to(q.dtype).float()
    dq = scale * ds @ kf
    dk = scale * ds.transpose(1, 2) @ q.float()
    return dq.to(q.dtype), dk.to(q.dtype), dv.to(q.dtype)


def reference(q, k, v, scale: float, causal: bool, window: int = 0):
    """softmax(scale q k^T + mask) v in fp32 with torch (test oracle), GQA by repetition."""
    import torch
    g = q.shape[0] // k.shape[0]
    kf, vf = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    s = scale * q.float() @ kf.transpose(1, 2)
    i = torch.arange(q.shape[1]).view(-1, 1)
    j = torch.arange(k.shape[1]).view(1, -1)
    keep = torch.ones_like(s[0], dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window > 0:
        keep &= j > i - window
    s = s.masked_fill(~keep, -math.inf)
    return torch.softmax(s, -1) @ vf, torch.logsumexp(s, -1, keepdim=True)
