"""Flash attention forward and backward for many heads, in NKI (destination-first ISA).

Layouts (natural, as torch holds them): q [BHq, Sq, d], k and v [BHkv, Sk, d] with heads
batch-major (index b * H + h), so query head i uses key/value head i // (BHq // BHkv): GQA
and MQA. d <= 128, Sq and Sk multiples of 128. One SPMD program per query head.

Forward, per head, two passes per group of four 128-query tiles (QGROUP). K^T [d, Sk] and
[V | 1] [Sk, d + 1] are loaded once (DMA transposes K) and stay in SBUF (Sk <= 32K at
d = 128). Pass 1: S = Q K^T a PSUM bank (512 keys) at a time and its exact row maxima m
(Vector engine, fused with the causal / sliding-window mask by `range_select` where a bank
crosses it); -m, rounded to the input dtype, is PE-transposed into a row. Pass 2, per 128
keys: S^T - m straight from the Tensor engine (keys on partitions, the group's 512 queries
on the free axis; -m enters through the contraction as an extra row of Q^T over a row of
ones in K^T when d < 128 and d % 32 == 0, else through a rank-1 matmul into the same bank),
P^T = exp(scale * (S^T - m)) in one Scalar-engine instruction, then P^T [V | 1] accumulates
O and the row sums l of each query tile in PSUM over all keys: no P transposes, no PSUM
copies of P, no running rescale. Finally out = O / l and lse = scale * m + log l.
The Tensor engine bounds a step (pass 1 and pass 2 both multiply Q and K: 2.1x the useful
matmul time at d = 128); the Vector engine (maxima) and the Scalar engine (exps) each
touch every score once. Rounding -m to the input dtype is exact for the softmax (the same
shift is in lse); in fp16 it needs |q.k| <= 65504.
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

P = 128        # partitions: query tile, key chunk
BANK = 512     # fp32 scores per PSUM bank
KBLOCK = 1024  # rows per DMA load of a resident tensor
NEG = -3.0e38  # masked score (rounds to -inf below fp32)
QGROUP = 4     # forward: query tiles sharing pass 2 (512 query columns: one PSUM bank of S^T)
KGROUP = 4     # backward: key tiles whose dK (and dV) accumulate in one PSUM bank
LOOKAHEAD = 1  # backward: phase A of this many later pairs is issued before phase B of a pair

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


def _crosses_mask(q0: int, q1: int, k0: int, k1: int, causal: bool, window: int) -> bool:
    """Whether some (query, key) pair of queries q0..q1 and keys k0..k1 (inclusive) is masked."""
    if causal and k1 > q0:
        return True
    return window > 0 and k0 <= q1 - window


def _needs_mask(qi: int, k0: int, k1: int, causal: bool, window: int) -> bool:
    """Whether keys [k0, k1) cross a mask edge for query tile qi."""
    return _crosses_mask(qi * P, qi * P + P - 1, k0, k1 - 1, causal, window)


def _load_rows(dst, src, h: int, s: int, d: int, r0: int, n: int, transposed: bool) -> None:
    """Rows r0 .. r0 + n of src[h] ([BH, S, d] in HBM) into dst: transposed, dst is [d, n]
    (DMA transposes); natural, dst is [128, n / 128, d] (row r0 + t * 128 + p on partition p)."""
    if transposed:
        nisa.dma_transpose(dst=dst, src=src[h, r0:r0 + n, :])
    else:
        nisa.dma_copy(dst=dst, src=src.ap([[d, P], [P * d, n // P], [1, d]], offset=(h * s + r0) * d))


def _load_kv(k, v, kv: int, sk: int, d: int, fold: bool):
    """K^T [d, Sk] (with a row of ones below it when `fold`) and V with a column of ones,
    [128 keys, Sk/128, d + 1] (loaded once per head, KBLOCK keys at a time, K and V of the
    first keys first): P^T V then also yields the row sums."""
    k_t = nl.ndarray((d + fold, sk), dtype=k.dtype, buffer=nl.sbuf)
    if fold:
        nisa.memset(dst=k_t[d:d + 1, :], value=1.0, engine=nisa.gpsimd_engine)
    v_aug = nl.ndarray((P, sk // P, d + 1), dtype=v.dtype, buffer=nl.sbuf)
    for c in range(0, sk, KBLOCK):
        n = min(KBLOCK, sk - c)
        _load_rows(k_t[:d, c:c + n], k, kv, sk, d, c, n, True)
        _load_rows(v_aug[:, c // P:(c + n) // P, :d], v, kv, sk, d, c, n, False)
    nisa.memset(dst=v_aug[:, :, d:], value=1.0, engine=nisa.gpsimd_engine)
    return k_t, v_aug


def _row_max(q_t, k_t, qi: int, col: int, sk: int, d: int, causal: bool, window: int):
    """Pass 1 for query tile qi (columns col.. of q_t): its row maxima over the keys it sees,
    [128, 1] fp32, from S in PSUM a bank at a time (Vector engine; masked banks through
    `range_select`, which fuses the mask with the maximum)."""
    k_lo, k_hi = _key_range(qi, sk, causal, window)
    banks = [(s0, min(s0 + BANK, k_hi)) for s0 in range(k_lo, k_hi, BANK)]
    m = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    if not banks:  # no key visible (a window past Sk): l = 0, so out and lse are NaN, as softmax's
        nisa.memset(dst=m, value=NEG, engine=nisa.gpsimd_engine)
        return m
    part_max = nl.ndarray((P, len(banks)), dtype=nl.float32, buffer=nl.sbuf)
    bounds = _bounds(qi, causal, window, sk) if causal or window else None
    for j, (s0, s1) in enumerate(banks):
        s_ps = nl.ndarray((P, s1 - s0), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=s_ps, stationary=q_t[:d, col:col + P], moving=k_t[:d, s0:s1])
        if _needs_mask(qi, s0, s1, causal, window):
            s_sb = nl.ndarray((P, s1 - s0), dtype=nl.float32, buffer=nl.sbuf)
            nisa.range_select(dst=s_sb, on_true_tile=s_ps, comp_op0=nl.greater_equal, comp_op1=nl.less,
                              bound0=bounds[0], bound1=bounds[1], range_start=float(s0), on_false_value=NEG,
                              reduce_res=part_max[:, j:j + 1], reduce_op=nl.maximum,
                              reduce_cmd=nisa.reduce_cmd.reset_reduce)
        else:
            nisa.tensor_reduce(dst=part_max[:, j:j + 1], op=nl.maximum, data=s_ps, axis=1)
    nisa.tensor_reduce(dst=m, op=nl.maximum, data=part_max, axis=1)
    return m


def _shift_row(m, neg_row, col: int, dtype):
    """-m rounded to the input dtype, [128, 1] (returned), and transposed into neg_row's
    columns col.. (a [1, 128] PE transpose): the per-query shift pass 2 adds to S^T."""
    neg_m = nl.ndarray((P, 1), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=neg_m, data=m, op0=nl.multiply, operand0=-1.0, engine=nisa.gpsimd_engine)
    row_ps = nl.ndarray((1, P), dtype=dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=row_ps, data=neg_m)
    nisa.tensor_copy(dst=neg_row[:, col:col + P], src=row_ps, engine=nisa.scalar_engine)
    return neg_m


def _key_bounds(k0: int, causal: bool, window: int, sq: int):
    """Per-key [128, 1] tiles for the keys k0..k0+127: first query that sees the key and one
    past the last (fp32)."""
    lo = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    hi = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    if causal:
        nisa.iota(lo, [[1, 1]], k0, 1)
    else:
        nisa.memset(dst=lo, value=0.0, engine=nisa.gpsimd_engine)
    if window > 0:
        nisa.iota(hi, [[1, 1]], k0 + window, 1)
    else:
        nisa.memset(dst=hi, value=float(sq), engine=nisa.gpsimd_engine)
    return lo, hi


def _query_span(k0: int, g0: int, g1: int, causal: bool, window: int) -> tuple[int, int]:
    """Query tiles' range [qa, qb) within [g0, g1) that sees some key of k0..k0+127."""
    qa = max(g0, k0) if causal else g0
    qb = min(g1, (k0 + P - 1 + window + P - 1) // P * P) if window > 0 else g1
    return qa, qb


def _probs_t(k_t, q_t, neg_row, ones, k0: int, qa: int, qb: int, g0: int, scale: float, dtype,
             causal: bool, window: int, sq: int):
    """Pass 2 for keys k0..k0+127 and queries qa..qb-1: P^T = exp(scale * (S^T - m)), keys on
    partitions, straight from the Tensor engine: S^T = K Q^T and -m added in the same PSUM
    bank, by the contraction itself when Q^T carries -m as an extra row over K^T's row of
    ones (`ones` is None), else by a rank-1 matmul ones^T x -m. No transpose, no PSUM copy."""
    n = qb - qa
    st_ps = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=st_ps, stationary=k_t[:, k0:k0 + P], moving=q_t[:, qa - g0:qb - g0])
    if ones is not None:
        nisa.nc_matmul(dst=st_ps, stationary=ones, moving=neg_row[:, qa - g0:qb - g0])
    src = st_ps
    if _crosses_mask(qa, qb - 1, k0, k0 + P - 1, causal, window):
        lo, hi = _key_bounds(k0, causal, window, sq)
        src = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.range_select(dst=src, on_true_tile=st_ps, comp_op0=nl.greater_equal, comp_op1=nl.less,
                          bound0=lo, bound1=hi, range_start=float(qa), on_false_value=NEG)
    p_t = nl.ndarray((P, n), dtype=dtype, buffer=nl.sbuf)
    nisa.activation(dst=p_t, op=nl.exp, data=src, scale=scale)
    return p_t


def _finish(o_ps, neg_m, out, lse, h: int, q0: int, scale: float, dtype, d: int) -> None:
    """out = O / l and lse = scale * m + log l for the query tile at q0, O and l in o_ps."""
    inv = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.reciprocal(dst=inv, data=o_ps[:, d:d + 1])
    o_sb = nl.ndarray((P, d), dtype=dtype, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=o_sb, data=o_ps[:, :d], op0=nl.multiply, operand0=inv)
    nisa.dma_copy(dst=out[h, q0:q0 + P, :], src=o_sb)
    lse_sb = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=lse_sb, op=nl.log, data=o_ps[:, d:d + 1])
    nisa.scalar_tensor_tensor(dst=lse_sb, data=neg_m, op0=nl.multiply, operand0=-scale, op1=nl.add,
                              operand1=lse_sb)
    nisa.dma_copy(dst=lse[h, q0:q0 + P, :], src=lse_sb)


@nki.jit
def attention_fwd(q, k, v, scale: float = 1.0, causal: bool = False, window: int = 0):
    bhq, sq, d, bhk, sk, group = check_shapes(q, k, v, "attention_fwd")
    out = nl.ndarray((bhq, sq, d), dtype=q.dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((bhq, sq, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    h = nl.program_id(0)
    # -m rides in the contraction as row d of Q^T when that row is free and starts a partition
    # quadrant (the engines address partitions from 0, 32, 64 or 96); else a rank-1 matmul
    fold = d < P and d % 32 == 0

    def load_q(g0: int):
        """Q^T of the query group at g0, [d (+ the shift row), up to QGROUP * 128]."""
        n = min(sq, g0 + QGROUP * P) - g0
        q_t = nl.ndarray((d + fold, n), dtype=q.dtype, buffer=nl.sbuf)
        _load_rows(q_t[:d, :], q, h, sq, d, g0, n, True)
        return q_t

    q_next = load_q(0)  # before K and V: the first group's pass 1 starts with their first keys
    k_t, v_aug = _load_kv(k, v, h // group, sk, d, fold)
    ones = None
    if not fold:
        ones = nl.ndarray((1, P), dtype=q.dtype, buffer=nl.sbuf)
        nisa.memset(dst=ones, value=1.0, engine=nisa.gpsimd_engine)
    per_bank = BANK // (d + 1)  # [128, d + 1] fp32 accumulators in one PSUM bank
    for g0 in range(0, sq, QGROUP * P):
        g1 = min(sq, g0 + QGROUP * P)
        tiles = (g1 - g0) // P
        q_t = q_next
        if g1 < sq:
            q_next = load_q(g1)
        # pass 1: each query tile's row maxima, as a shift row for pass 2
        neg_row = q_t[d:d + 1, :] if fold else nl.ndarray((1, g1 - g0), dtype=q.dtype, buffer=nl.sbuf)
        neg_m = [_shift_row(_row_max(q_t, k_t, g0 // P + t, t * P, sk, d, causal, window), neg_row, t * P,
                            q.dtype) for t in range(tiles)]
        # pass 2: per 128 keys, P^T for the group's query tiles that see them, times [V | 1]
        accs = [nl.ndarray((P, min(per_bank, tiles - b), d + 1), dtype=nl.float32, buffer=nl.psum)
                for b in range(0, tiles, per_bank)]
        for k0 in range(0, sk, P):
            qa, qb = _query_span(k0, g0, g1, causal, window)
            if qa >= qb:
                continue
            p_t = _probs_t(k_t, q_t, neg_row, ones, k0, qa, qb, g0, scale, q.dtype, causal, window, sq)
            for t in range((qa - g0) // P, (qb - g0) // P):
                acc = accs[t // per_bank][:, t % per_bank, :]
                nisa.nc_matmul(dst=acc, stationary=p_t[:, t * P - (qa - g0):(t + 1) * P - (qa - g0)],
                               moving=v_aug[:, k0 // P, :])
        for t in range(tiles):
            _finish(accs[t // per_bank][:, t % per_bank, :], neg_m[t], out, lse, h, g0 + t * P, scale,
                    q.dtype, d)
    return out, lse


def _residents(specs: list, d: int) -> list:
    """One head of each [BH, S, d] tensor of `specs` ((tensor, head, S, transposed) each) in
    SBUF, natural [128, S/128, d] or transposed [d, S] (see _load_rows), loaded KBLOCK rows
    at a time with the first rows of every tensor first, so the first tiles' work starts
    before the rest arrives."""
    tiles = [nl.ndarray((d, n) if tr else (P, n // P, d), dtype=src.dtype, buffer=nl.sbuf)
             for src, _, n, tr in specs]
    for c in range(0, max(spec[2] for spec in specs), KBLOCK):
        for (src, h, n, tr), dst in zip(specs, tiles):
            if c < n:
                w = min(KBLOCK, n - c)
                _load_rows(dst[:, c:c + w] if tr else dst[:, c // P:(c + w) // P, :], src, h, n, d, c, w, tr)
    return tiles


def _pair_visible(qi: int, kj: int, causal: bool, window: int) -> bool:
    """Whether any key of tile kj is visible to a query of tile qi."""
    if causal and kj > qi:
        return False
    return not (window > 0 and kj * P + P - 1 <= qi * P - window)


@nki.jit
def attention_bwd(q, k, v, o, do, lse, scale: float = 1.0, causal: bool = False, window: int = 0):
    """Gradients (dq [BHq, Sq, d], dk and dv [BHq, Sk, d] per query head) of attention_fwd."""
    bhq, sq, d, bhk, sk, group = check_shapes(q, k, v, "attention_bwd")
    isz = q.dtype.itemsize if isinstance(getattr(q.dtype, "itemsize", None), int) else np.dtype(q.dtype).itemsize
    resident = (3 * sq // P * d + 2 * sq + sk // P * d + 2 * sk + sq // P * d) * isz + sq // P * d * 4
    if resident > 180 * 1024:
        raise ValueError(f"attention_bwd: Sq={sq}, Sk={sk} at d={d} need {resident} B a partition for Q, K, V, "
                         "O, dO and dQ in SBUF; at most 180 KiB (8192 each at d = 128 in bf16)")
    dq = nl.ndarray((bhq, sq, d), dtype=q.dtype, buffer=nl.shared_hbm)
    dk = nl.ndarray((bhq, sk, d), dtype=q.dtype, buffer=nl.shared_hbm)
    dv = nl.ndarray((bhq, sk, d), dtype=q.dtype, buffer=nl.shared_hbm)
    h = nl.program_id(0)
    kv = h // group
    nq = sq // P
    # -lse and D = rowsum(dO * O) per query tile, [128, nq] fp32
    neg_lse = nl.ndarray((P, nq, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=neg_lse, src=lse.ap([[1, P], [P, nq], [1, 1]], offset=h * sq))
    nisa.tensor_scalar(dst=neg_lse, data=neg_lse, op0=nl.multiply, operand0=-1.0, engine=nisa.gpsimd_engine)
    q_t, k_t, do_t, v_t, do_n, o_n, q_n, k_n = _residents(
        [(q, h, sq, True), (k, kv, sk, True), (do, h, sq, True), (v, kv, sk, True), (do, h, sq, False),
         (o, h, sq, False), (q, h, sq, False), (k, kv, sk, False)], d)
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
    scores, the row maximum's shift rounded to the input dtype, P rounded to it before P V
    and before its fp32 row sums, the output cast back."""
    import torch
    check_shapes(q, k, v, "attention_fwd")
    g = q.shape[0] // k.shape[0]
    kf, vf = k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0)
    s = (q.float() @ kf.transpose(1, 2)).masked_fill(~_mask(q.shape[1], k.shape[1], causal, window), -math.inf)
    m = -(-s.amax(-1, keepdim=True)).to(q.dtype).float()
    p = torch.exp(scale * (s - m)).to(q.dtype).float()
    l_sum = p.sum(-1, keepdim=True)
    out = (p @ vf) / l_sum
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
