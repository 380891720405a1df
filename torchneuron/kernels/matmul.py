"""Tiled matmul at four optimisation levels: C[M, N] = A_T.T @ B with A_T [K, M], B [K, N].

Each level keeps the Tensor engine's tile limits (stationary [128, 128], moving [128, 512],
fp32 accumulation in PSUM) and moves less data than the one before it:
1. `matmul_tiled`: every (m, n, k) step loads both operand tiles;
2. `matmul_hoisted`: an A_T column strip is loaded once per m and reused across n;
3. `matmul_blocked`: blocks of BM x BN output tiles share their loaded strips;
4. `matmul_fully_blocked`: K is blocked too; wide DMA transfers; partial sums kept in SBUF.
"""
from __future__ import annotations

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl

TK, TM, TN = 128, 128, 512


@nki.jit
def matmul_tiled(a_t, b):
    K, M = a_t.shape
    _, N = b.shape
    c = nl.ndarray((M, N), dtype=a_t.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TM):
        for n in nl.affine_range(N // TN):
            acc = nl.zeros((TM, TN), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TK):
                a_tile = nl.load(a_t[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                b_tile = nl.load(b[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                acc += nisa.nc_matmul(a_tile, b_tile)
            nl.store(c[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], value=nl.copy(acc, dtype=c.dtype))
    return c


@nki.jit
def matmul_hoisted(a_t, b):
    K, M = a_t.shape
    _, N = b.shape
    KT = K // TK
    c = nl.ndarray((M, N), dtype=a_t.dtype, buffer=nl.shared_hbm)
    for m in nl.affine_range(M // TM):
        a_strip = nl.ndarray((KT, nl.par_dim(TK), TM), dtype=a_t.dtype)
        for k in nl.affine_range(KT):
            a_strip[k] = nl.load(a_t[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
        for n in nl.affine_range(N // TN):
            b_strip = nl.ndarray((KT, nl.par_dim(TK), TN), dtype=b.dtype)
            for k in nl.affine_range(KT):
                b_strip[k] = nl.load(b[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
            acc = nl.zeros((TM, TN), nl.float32, buffer=nl.psum)
            for k in nl.affine_range(KT):
                acc += nisa.nc_matmul(a_strip[k], b_strip[k])
            nl.store(c[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], value=nl.copy(acc, dtype=c.dtype))
    return c


@nki.jit
def matmul_blocked(a_t, b, BM: int = 2, BN: int = 2):
    K, M = a_t.shape
    _, N = b.shape
    KT = K // TK
    c = nl.ndarray((M, N), dtype=a_t.dtype, buffer=nl.shared_hbm)
    for mb in nl.affine_range(M // (TM * BM)):
        a_blk = nl.ndarray((KT, nl.par_dim(TK), BM * TM), dtype=a_t.dtype)
        for k in nl.affine_range(KT):
            a_blk[k] = nl.load(a_t[k * TK:(k + 1) * TK, mb * BM * TM:(mb + 1) * BM * TM])
        for nb in nl.affine_range(N // (TN * BN)):
            b_blk = nl.ndarray((KT, nl.par_dim(TK), BN * TN), dtype=b.dtype)
            for k in nl.affine_range(KT):
                b_blk[k] = nl.load(b[k * TK:(k + 1) * TK, nb * BN * TN:(nb + 1) * BN * TN])
            for i in nl.affine_range(BM):
                for j in nl.affine_range(BN):
                    acc = nl.zeros((TM, TN), nl.float32, buffer=nl.psum)
                    for k in nl.affine_range(KT):
                        acc += nisa.nc_matmul(a_blk[k, :, i * TM:(i + 1) * TM], b_blk[k, :, j * TN:(j + 1) * TN])
                    row, col = (mb * BM + i) * TM, (nb * BN + j) * TN
                    nl.store(c[row:row + TM, col:col + TN], value=nl.copy(acc, dtype=c.dtype))
    return c


@nki.jit
def matmul_fully_blocked(a_t, b, BM: int = 16, BN: int = 2, BK: int = 8):
    K, M = a_t.shape
    _, N = b.shape
    BM, BN, BK = min(BM, M // TM), min(BN, N // TN), min(BK, K // TK)
    c = nl.ndarray((M, N), dtype=a_t.dtype, buffer=nl.shared_hbm)
    for nb in nl.affine_range(N // (TN * BN)):
        # partial sums of one column block of C stay in SBUF across the K blocks
        part = nl.zeros((M // TM, BN, nl.par_dim(TM), TN), dtype=nl.float32)
        for kb in nl.sequential_range(K // (TK * BK)):
            b_blk = nl.ndarray((BK, nl.par_dim(TK), BN * TN), dtype=b.dtype)
            for k in nl.affine_range(BK):
                kk = (kb * BK + k) * TK
                b_blk[k] = nl.load(b[kk:kk + TK, nb * BN * TN:(nb + 1) * BN * TN])
            for mb in nl.affine_range(M // (TM * BM)):
                a_blk = nl.ndarray((BK, nl.par_dim(TK), BM * TM), dtype=a_t.dtype)
                for k in nl.affine_range(BK):
                    kk = (kb * BK + k) * TK
                    a_blk[k] = nl.load(a_t[kk:kk + TK, mb * BM * TM:(mb + 1) * BM * TM])
                for j in nl.affine_range(BN):
                    for i in nl.affine_range(BM):
                        acc = nl.zeros((TM, TN), nl.float32, buffer=nl.psum)
                        for k in nl.affine_range(BK):
                            acc += nisa.nc_matmul(a_blk[k, :, i * TM:(i + 1) * TM], b_blk[k, :, j * TN:(j + 1) * TN])
                        part[mb * BM + i, j] += acc
        for mt in nl.affine_range(M // TM):
            row = nl.ndarray((nl.par_dim(TM), BN * TN), dtype=c.dtype)
            for j in nl.affine_range(BN):
                row[:, j * TN:(j + 1) * TN] = nl.copy(part[mt, j], dtype=c.dtype)
            nl.store(c[mt * TM:(mt + 1) * TM, nb * BN * TN:(nb + 1) * BN * TN], value=row)
    return c


LEVELS = {"tiled": matmul_tiled, "hoisted": matmul_hoisted, "blocked": matmul_blocked,
          "fully_blocked": matmul_fully_blocked}
