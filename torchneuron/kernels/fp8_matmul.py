"""FP8 scaled matmul in NKI: out[M, N] = (a @ b) * scale_a * scale_b, as `torch._scaled_mm`.

`scaled_matmul(a_t, b, scale_a, scale_b, fp32_out)`: a_t [K, M] (a transposed: the stationary
operand, as `matmul.py`'s kernels take it) and b [K, N], both float8_e4m3fn or float8_e5m2
(the two may differ); fp32 accumulation in PSUM over all of K; fp32 scales either
- tensor-wise: scale_a and scale_b one element each ([1, 1]), or
- row-wise: scale_a [M, 1] (one per row of a) and scale_b [1, N] (one per column of b),
applied while PSUM is evacuated to SBUF by one instruction per output tile (`tensor_scalar`
with the product of the two scales, or `scalar_tensor_tensor` with a's scale per partition
and b's scales broadcast over the partitions), which also rounds to the output dtype: bf16,
or fp32 when `fp32_out`. M a multiple of 128, K of 128, N of 512.

Blocking: a block of BN x 512 columns of b, all of K, is loaded once; for each block of
BM x 128 columns of a_t (all of K) the block's BM x BN output tiles accumulate their whole
contraction in PSUM, so no partial sums leave PSUM. `host_scaled_matmul` computes the same
numbers with torch (fp8 values are exact in fp32).
"""
from __future__ import annotations

import torch

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl

TK, TM, TN = 128, 128, 512
BM, BN = 8, 4  # output tiles of a block: 8 x 128 rows of a, 4 x 512 columns of b
SBUF_BLOCK_BYTES = 96 * 1024  # per partition for a block's a and b strips (half of trn2's 192 KiB)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _torch_dtype(t) -> torch.dtype:
    """The torch dtype of a torch tensor or of an NKI tensor / placeholder."""
    from ..nki.dtypes import to_torch
    return to_torch(t.dtype)


def check_operands(a_t, b, scale_a, scale_b) -> tuple[int, int, int, bool]:
    """(M, K, N, row_wise) of scaled_matmul's operands, or the ValueError naming the rule broken."""
    name = "fp8 scaled_matmul"
    for what, t in (("a", a_t), ("b", b)):
        if _torch_dtype(t) not in FP8_DTYPES:
            raise ValueError(f"{name}: {what} must be float8_e4m3fn or float8_e5m2, got {_torch_dtype(t)}; "
                             f"quantize it first (e.g. torchao's float8 tensors or x.to(torch.float8_e4m3fn))")
    if len(a_t.shape) != 2 or len(b.shape) != 2:
        raise ValueError(f"{name}: a_t [K, M] and b [K, N] must be 2-D, got {tuple(a_t.shape)} and {tuple(b.shape)}")
    (k, m), (kb, n) = a_t.shape, b.shape
    if k != kb:
        raise ValueError(f"{name}: the contraction sizes differ: a_t [K={k}, M] but b [K={kb}, N]")
    if m % TM or k % TK or n % TN:
        raise ValueError(f"{name}: need M and K multiples of {TM}, N of {TN}; got M={m}, K={k}, N={n} "
                         f"(pad the operands)")
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    for what, t in (("scale_a", scale_a), ("scale_b", scale_b)):
        if _torch_dtype(t) != torch.float32:
            raise ValueError(f"{name}: {what} must be float32, got {_torch_dtype(t)}")
    if sa == (1, 1) and sb == (1, 1):
        return m, k, n, False
    if sa == (m, 1) and sb == (1, n):
        return m, k, n, True
    raise ValueError(f"{name}: scales must be tensor-wise (scale_a [1, 1], scale_b [1, 1]) or row-wise "
                     f"(scale_a [M={m}, 1], scale_b [1, N={n}]); got scale_a {sa}, scale_b {sb}")


def _block(tiles: int, most: int) -> int:
    """The largest block of at most `most` tiles that divides `tiles`."""
    return max(d for d in range(1, min(tiles, most) + 1) if tiles % d == 0)


def _blocks(m: int, k: int, n: int) -> tuple[int, int, int]:
    """(bm, bn, K tiles): output tiles per block, shrunk (b's first) until a block's operand
    strips over all of K fit SBUF_BLOCK_BYTES a partition (fp8: one byte an element)."""
    bm, bn, kt = _block(m // TM, BM), _block(n // TN, BN), k // TK
    while kt * (bm * TM + bn * TN) > SBUF_BLOCK_BYTES and bm * bn > 1:
        bn, bm = (_block(n // TN, bn - 1), bm) if bn > 1 else (bn, _block(m // TM, bm - 1))
    if kt * (bm * TM + bn * TN) > SBUF_BLOCK_BYTES:
        raise ValueError(f"fp8 scaled_matmul: K={k} is too long for one pass over K in SBUF "
                         f"(at most {SBUF_BLOCK_BYTES // (TM + TN) * TK}); split K and add the results")
    return bm, bn, kt


def _broadcast_rows(src, cols: int, offset: int = 0):
    """`cols` fp32 values of HBM row `src` from `offset`, replicated over the 128 partitions
    (one DMA whose partition stride is 0)."""
    tile = nl.ndarray((TM, cols), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=src.ap([[0, TM], [1, cols]], offset=offset))
    return tile


@nki.jit
def scaled_matmul(a_t, b, scale_a, scale_b, fp32_out: bool = False):
    m, k, n, row_wise = check_operands(a_t, b, scale_a, scale_b)
    bm, bn, KT = _blocks(m, k, n)
    out_dtype = nl.float32 if fp32_out else nl.bfloat16
    out = nl.ndarray((m, n), dtype=out_dtype, buffer=nl.shared_hbm)
    if not row_wise:  # one factor for every element: scale_a * scale_b on each partition
        scale = _broadcast_rows(scale_a, 1)
        nisa.tensor_tensor(dst=scale, data1=scale, data2=_broadcast_rows(scale_b, 1), op=nl.multiply)
    for nb in nl.affine_range(n // (TN * bn)):
        col0 = nb * bn * TN
        b_blk = nl.ndarray((KT, nl.par_dim(TK), bn * TN), dtype=b.dtype)
        for kt in nl.affine_range(KT):
            b_blk[kt] = nl.load(b[kt * TK:(kt + 1) * TK, col0:col0 + bn * TN])
        if row_wise:
            scale_cols = _broadcast_rows(scale_b, bn * TN, offset=col0)
        for mb in nl.affine_range(m // (TM * bm)):
            a_blk = nl.ndarray((KT, nl.par_dim(TK), bm * TM), dtype=a_t.dtype)
            for kt in nl.affine_range(KT):
                a_blk[kt] = nl.load(a_t[kt * TK:(kt + 1) * TK, mb * bm * TM:(mb + 1) * bm * TM])
            for i in nl.affine_range(bm):
                row = (mb * bm + i) * TM
                if row_wise:
                    scale_rows = nl.load(scale_a[row:row + TM, :])
                for j in nl.affine_range(bn):
                    acc = nl.zeros((TM, TN), nl.float32, buffer=nl.psum)
                    for kt in nl.affine_range(KT):
                        acc += nisa.nc_matmul(a_blk[kt, :, i * TM:(i + 1) * TM], b_blk[kt, :, j * TN:(j + 1) * TN])
                    o_sb = nl.ndarray((TM, TN), dtype=out_dtype, buffer=nl.sbuf)
                    if row_wise:  # (acc * scale_a[row]) * scale_b[col], rounded once to out_dtype
                        nisa.scalar_tensor_tensor(dst=o_sb, data=acc, op0=nl.multiply, operand0=scale_rows,
                                                  op1=nl.multiply, operand1=scale_cols[:, j * TN:(j + 1) * TN])
                    else:
                        nisa.tensor_scalar(dst=o_sb, data=acc, op0=nl.multiply, operand0=scale)
                    nl.store(out[row:row + TM, col0 + j * TN:col0 + (j + 1) * TN], value=o_sb)
    return out


def host_scaled_matmul(a_t: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       fp32_out: bool = False) -> torch.Tensor:
    """scaled_matmul's result computed with torch on the host: the same fp32 products and scale
    order (fp8 values are exact in fp32; the sums' order differs only within fp32 rounding)."""
    _, _, _, row_wise = check_operands(a_t, b, scale_a, scale_b)
    acc = a_t.float().T @ b.float()
    out = acc * scale_a * scale_b if row_wise else acc * (scale_a * scale_b)
    return out.to(torch.float32 if fp32_out else torch.bfloat16)


def flops(m: int, k: int, n: int) -> float:
    return 2.0 * m * k * n
