"""RMSNorm fused with the projection after it, and Llama's SwiGLU MLP, in NKI; forward and backward.

- `rmsnorm_linear_fwd(x [T, D], w_norm [1, D], w [N, D], eps) -> (y [T, N], rstd [T, 1] fp32)`:
  y = rmsnorm(x) @ w^T with rmsnorm(x) = x * rstd * w_norm, rstd = rsqrt(mean(x^2) + eps) (w the
  q/k/v projections' weights stacked: one QKV matmul). The normalised x never goes to HBM.
- `rmsnorm_linear_bwd(x, w_norm, w, rstd, dy [T, N], eps) -> (dx [T, D], dw_norm [1, D] fp32,
  dw [N, D] fp32)`.
- `swiglu_fwd(x [T, D], wg [F, D], wu [F, D], wd [D, F]) -> y [T, D]`: down(silu(gate(x)) * up(x)).
  The [T, F] intermediates never go to HBM.
- `swiglu_bwd(x, wg, wu, wd, dy [T, D]) -> (dx [T, D], dwg [F, D], dwu [F, D], dwd [D, F] fp32)`:
  gate and up are recomputed (nothing of the forward is saved but x).

T and D multiples of 128, F a multiple of 128, any N; bf16 / fp16 / fp32 operands of one dtype,
fp32 accumulation (PSUM), activations rounded to the input dtype before the next matmul.

Schedule. RMSNorm + linear: tokens in blocks of `rmsnorm_linear_tiles(...)` 128-token tiles;
per tile the statistics (Scalar engine square-and-sum), x * rstd * w_norm rounded once, and its
transpose (Tensor engine, 128 x 128) kept in SBUF as the block's stationary operand; W^T streams
through in 512-column chunks, loaded once per block by one transposing DMA. Backward keeps the
block's x, normalised x, dy and dy^T in SBUF and streams W in 512-row chunks: dxn += dy @ W
(fp32 in SBUF), dW = dy^T @ xn accumulated over the block in PSUM (blocks after the first add
into the fp32 result in HBM); then per tile the norm's backward (dx, and w_norm's gradient as a
ones^T matmul over the partitions).

SwiGLU: tokens in blocks of up to 512 (x^T the moving operand); F in chunks of 128 computed
transposed, gate^T and up^T [128 f, tokens] = W^T-chunk^T @ x^T, so h^T = silu(g^T) * u^T is
already the down projection's stationary operand: y += h @ Wd^T-chunk accumulated in fp32 SBUF.
Each weight chunk is put in the layout its matmul wants once (transposing DMAs) and kept in HBM
scratch in that layout, so later token blocks read it back contiguously (`_Staged`). Backward,
pass 1 (token blocks outer) per F chunk recomputes g^T, u^T, forms dh^T = Wd-chunk^T @ dy^T,
dg^T = dh^T * u^T * silu'(g^T) and du^T = dh^T * silu(g^T) (Scalar/Vector/GpSimd engines),
dx += dg @ Wg + du @ Wu, and writes h, dg, du tokens-major to HBM scratch; pass 2 (F groups
outer, tokens the contraction) sums the weight gradients over all tokens in fp32 SBUF and writes
each once.
"""
from __future__ import annotations

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl
from .cross_entropy import _blocks, _itemsize, _load_transposed

P = 128
CHUNK = 512               # output columns a PSUM bank holds in fp32
SBUF_BUDGET = 160 * 1024  # bytes a partition a token block and a streamed weight chunk may take
SWIGLU_TOKENS = 512       # tokens a SwiGLU block at most (the gate/up matmuls' moving operand)
F_GROUP = 2               # SwiGLU forward: intermediate chunks of 128 whose down products PSUM sums
PSUM_BANKS = 8            # [128, 512] fp32 accumulators PSUM holds
GRAD_TOKEN_TILES = 2      # SwiGLU backward pass 2: 128-token tiles a weight-gradient block sums in PSUM
GRAD_GROUP_MAX = 4        # SwiGLU backward pass 2: intermediate chunks of 128 whose gradients SBUF holds


class UnsupportedInput(ValueError):
    """Operands the RMSNorm-linear / SwiGLU kernels do not take (the ops fall back to generic code)."""


def check_rmsnorm_linear(x, w_norm, w, what: str = "rmsnorm_linear kernel") -> tuple[int, int, int]:
    """(T, D, N) of the operands, or UnsupportedInput naming the kernel's constraint."""
    if len(x.shape) != 2 or len(w.shape) != 2 or tuple(w_norm.shape) != (1, x.shape[-1]) \
            or w.shape[1] != x.shape[1]:
        raise UnsupportedInput(f"{what}: need x [T, D], w_norm [1, D] and w [N, D]; got x {tuple(x.shape)}, "
                               f"w_norm {tuple(w_norm.shape)}, w {tuple(w.shape)}")
    t, d = x.shape
    if t % P or d % P:
        raise UnsupportedInput(f"{what}: tokens T={t} and hidden size D={d} must be multiples of {P}")
    rmsnorm_linear_tiles(t, d, w.shape[0], _itemsize(x.dtype), backward=True, what=what)
    return t, d, w.shape[0]


def rmsnorm_linear_tiles(t: int, d: int, n: int, itemsize: int, backward: bool,
                         what: str = "rmsnorm_linear kernel") -> int:
    """128-token tiles a block keeps in SBUF next to the streamed weight chunk: forward the
    normalised x^T; backward dy, dy^T and the fp32 dxn (at most 4: the PSUM banks' share)."""
    per_tile = d * itemsize if not backward else d * 4 + 2 * n * itemsize
    fixed = d * CHUNK // P * itemsize + 4 * d * 4 + t // P * 4  # weight chunk, fp32 temporaries, rstd
    if fixed + per_tile > SBUF_BUDGET:
        raise UnsupportedInput(f"{what}: hidden size D={d} with N={n} outputs does not fit a weight chunk and "
                               f"one token tile in SBUF ({fixed + per_tile} B a partition; at most {SBUF_BUDGET})")
    tiles = max(1, min(t // P, (SBUF_BUDGET - fixed) // per_tile))
    return min(tiles, 4) if backward else tiles


def check_swiglu(x, wg, wu, wd, what: str = "swiglu kernel") -> tuple[int, int, int]:
    """(T, D, F) of the operands, or UnsupportedInput naming the kernel's constraint."""
    if len(x.shape) != 2 or len(wg.shape) != 2 or tuple(wu.shape) != tuple(wg.shape) or len(wd.shape) != 2:
        raise UnsupportedInput(f"{what}: need x [T, D], wg and wu [F, D], wd [D, F]; got x {tuple(x.shape)}, "
                               f"wg {tuple(wg.shape)}, wu {tuple(wu.shape)}, wd {tuple(wd.shape)}")
    t, d = x.shape
    f = wg.shape[0]
    if wg.shape[1] != d or tuple(wd.shape) != (d, f):
        raise UnsupportedInput(f"{what}: wg/wu {tuple(wg.shape)} must be [F, {d}] and wd {tuple(wd.shape)} "
                               f"[{d}, F]")
    if t % P or d % P or f % P:
        raise UnsupportedInput(f"{what}: tokens T={t}, hidden size D={d} and intermediate size F={f} must be "
                               f"multiples of {P}")
    swiglu_tiles(t, d, _itemsize(x.dtype), backward=True, what=what)
    swiglu_grad_group(d, f, _itemsize(x.dtype), what)
    return t, d, f


def swiglu_tiles(t: int, d: int, itemsize: int, backward: bool, what: str = "swiglu kernel") -> int:
    """128-token tiles of a SwiGLU block (at most SWIGLU_TOKENS tokens): per tile x^T and the
    fp32 output accumulator (backward dx's, and dy^T), next to the weight chunks in flight
    (forward a group of F_GROUP down-projection rows and two gate/up chunks, double buffered;
    backward the five chunks one F chunk needs) and the chunk's fp32 intermediates."""
    per_tile = d * (4 + (2 if backward else 1) * itemsize)
    fixed = (5 if backward else 2 * F_GROUP + 5) * d * itemsize + 10 * SWIGLU_TOKENS * 4
    if fixed + per_tile > SBUF_BUDGET:
        raise UnsupportedInput(f"{what}: hidden size D={d} does not fit a token tile and the weight chunks in "
                               f"SBUF ({fixed + per_tile} B a partition; at most {SBUF_BUDGET})")
    return max(1, min(t // P, SWIGLU_TOKENS // P, (SBUF_BUDGET - fixed) // per_tile))


def swiglu_grad_group(d: int, f: int, itemsize: int = 2, what: str = "swiglu_bwd") -> int:
    """Intermediate chunks of 128 whose weight gradients the backward's pass 2 sums in SBUF at
    once: three fp32 [128, D] accumulators a chunk, next to GRAD_TOKEN_TILES tiles of x and dy
    and the chunks' h, dg and du."""
    per_chunk = 3 * d * 4 + 3 * GRAD_TOKEN_TILES * P * itemsize
    fixed = 2 * GRAD_TOKEN_TILES * d * itemsize
    if fixed + per_chunk > SBUF_BUDGET:
        raise UnsupportedInput(f"{what}: hidden size D={d} does not fit one chunk's weight-gradient "
                               f"accumulators in SBUF ({fixed + per_chunk} B a partition; at most {SBUF_BUDGET})")
    return max(1, min(GRAD_GROUP_MAX, f // P, (SBUF_BUDGET - fixed) // per_chunk))


# -- shared pieces ---------------------------------------------------------------------------------
def _row_broadcast(v, d: int, dtype):
    """A [1, d] HBM vector on every partition: [128, d]."""
    tile = nl.ndarray((P, d), dtype=dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=tile, src=v.ap([[0, P], [1, d]], offset=0))
    return tile


def _transpose_into(dst, src, rows: int, cols: int, dtype, on_vector: bool = False) -> None:
    """dst[0:cols, 0:rows] = src[0:rows, 0:cols]^T (<= 128 x 128) through the Tensor engine,
    out of PSUM on the Scalar (or Vector) engine."""
    tr = nl.ndarray((P, P), dtype=dtype, buffer=nl.psum)
    nisa.nc_transpose(dst=tr[0:cols, 0:rows], data=src)
    nisa.tensor_copy(dst=dst, src=tr[0:cols, 0:rows], engine=nisa.vector_engine if on_vector else nisa.scalar_engine)


def _accumulate(acc_sb, psum) -> None:
    nisa.tensor_tensor(dst=acc_sb, data1=acc_sb, data2=psum, op=nl.add)


def _store_grad(dst_rows, acc, rows: int, cols: int, first: bool) -> None:
    """A block's share of a weight gradient, [rows, cols] fp32 in PSUM, into HBM: written by
    the first block, added to the earlier blocks' share by the others."""
    out = nl.ndarray((P, cols), dtype=nl.float32, buffer=nl.sbuf)
    if first:
        nisa.activation(dst=out[0:rows, :], op=nl.copy, data=acc[0:rows, :])
    else:
        nisa.dma_copy(dst=out[0:rows, :], src=dst_rows)
        _accumulate(out[0:rows, :], acc[0:rows, :])
    nisa.dma_copy(dst=dst_rows, src=out[0:rows, :])


def _norm_tile(x, w_n, row0: int, d: int, eps: float, rstd_dst):
    """One 128-token tile of x (its dtype), rstd into rstd_dst [128, 1], and x * rstd * w_norm
    rounded once to x's dtype."""
    xt = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x[row0:row0 + P, :])
    sq = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
    ss = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq, op=nl.square, data=xt, reduce_res=ss, reduce_op=nl.add)
    nisa.tensor_scalar(dst=ss, data=ss, op0=nl.multiply, operand0=1.0 / d, op1=nl.add, operand1=eps,
                       engine=nisa.gpsimd_engine)
    nisa.activation(dst=rstd_dst, op=nl.rsqrt, data=ss)
    xn = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=xn, data=xt, op0=nl.multiply, operand0=rstd_dst, op1=nl.multiply, operand1=w_n)
    return xt, xn


def _subs(n: int) -> list[tuple[int, int]]:
    """128-row pieces (start, end) of n rows."""
    return [(a, min(n, a + P)) for a in range(0, n, P)]


# -- RMSNorm + linear ----------------------------------------------------------------------------
@nki.jit
def rmsnorm_linear_fwd(x, w_norm, w, eps: float = 1e-6):
    t, d, n_out = check_rmsnorm_linear(x, w_norm, w, "rmsnorm_linear_fwd")
    y = nl.ndarray((t, n_out), dtype=x.dtype, buffer=nl.shared_hbm)
    rstd = nl.ndarray((t, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    w_n = _row_broadcast(w_norm, d, nl.float32)
    for t0, nt in _blocks(t, rmsnorm_linear_tiles(t, d, n_out, _itemsize(x.dtype), backward=False)):
        xn_t = nl.ndarray((P, d // P, nt * P), dtype=x.dtype, buffer=nl.sbuf)
        r = nl.ndarray((P, nt), dtype=nl.float32, buffer=nl.sbuf)
        for ti in range(nt):
            _, xn = _norm_tile(x, w_n, t0 + ti * P, d, eps, r[:, ti:ti + 1])
            for c in range(d // P):
                _transpose_into(xn_t[:, c, ti * P:(ti + 1) * P], xn[:, c * P:(c + 1) * P], P, P, x.dtype)
        nisa.dma_copy(dst=rstd.ap([[1, P], [P, nt]], offset=t0), src=r)
        for n0 in range(0, n_out, CHUNK):
            n = min(CHUNK, n_out - n0)
            w_t = _load_transposed(w, n0, n, d)
            for ti in range(nt):
                acc = nl.ndarray((P, n), dtype=nl.float32, buffer=nl.psum)
                for c in range(d // P):
                    nisa.nc_matmul(dst=acc, stationary=xn_t[:, c, ti * P:(ti + 1) * P], moving=w_t[:, c, 0:n])
                out = nl.ndarray((P, n), dtype=x.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=out, src=acc, engine=nisa.vector_engine if ti % 2 else nisa.scalar_engine)
                nisa.dma_copy(dst=y[t0 + ti * P:t0 + (ti + 1) * P, n0:n0 + n], src=out)
    return y, rstd


def _norm_backward(dxn, xt, w_n, r, d: int, dx_dst, ones, dwn_acc) -> None:
    """The RMSNorm's backward of one tile from dxn (fp32, the gradient of the normalised x):
    dx = r * u - x * r^3 * mean(u * x) with u = dxn * w_norm, and w_norm's gradient
    sum_tokens(dxn * x * r) added into dwn_acc [1, d] (a ones^T matmul over the partitions)."""
    u = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=u, data1=dxn, data2=w_n, op=nl.multiply)
    prod = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
    dot = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=prod, data1=u, data2=xt, op=nl.multiply, engine=nisa.gpsimd_engine)
    nisa.tensor_reduce(dst=dot, op=nl.add, data=prod, axis=1)
    coef = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=coef, data1=r, data2=r, op=nl.multiply)
    nisa.tensor_tensor(dst=coef, data1=coef, data2=r, op=nl.multiply)
    nisa.scalar_tensor_tensor(dst=coef, data=coef, op0=nl.multiply, operand0=-1.0 / d, op1=nl.multiply,
                              operand1=dot)
    xc = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=xc, data=xt, op0=nl.multiply, operand0=coef, engine=nisa.gpsimd_engine)
    nisa.scalar_tensor_tensor(dst=dx_dst, data=u, op0=nl.multiply, operand0=r, op1=nl.add, operand1=xc)
    nisa.tensor_tensor(dst=prod, data1=dxn, data2=xt, op=nl.multiply, engine=nisa.gpsimd_engine)
    nisa.tensor_scalar(dst=prod, data=prod, op0=nl.multiply, operand0=r, engine=nisa.gpsimd_engine)
    for c0 in range(0, d, CHUNK):
        c1 = min(d, c0 + CHUNK)
        part = nl.ndarray((1, c1 - c0), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=part, stationary=ones, moving=prod[:, c0:c1])
        _accumulate(dwn_acc[:, c0:c1], part)


def _psum_blocks(d: int, tiles: int) -> list[tuple[int, int]]:
    """Column blocks (start, end) of D whose [128, 512] fp32 chunks for `tiles` rows of tiles
    fill at most the 8 PSUM banks."""
    width = max(1, PSUM_BANKS // tiles) * CHUNK
    return [(c0, min(d, c0 + width)) for c0 in range(0, d, width)]


def _chunks(c0: int, c1: int) -> list[tuple[int, int]]:
    return [(a, min(c1, a + CHUNK)) for a in range(c0, c1, CHUNK)]


@nki.jit
def rmsnorm_linear_bwd(x, w_norm, w, rstd, dy, eps: float = 1e-6):
    t, d, n_out = check_rmsnorm_linear(x, w_norm, w, "rmsnorm_linear_bwd")
    dx = nl.ndarray((t, d), dtype=x.dtype, buffer=nl.shared_hbm)
    dwn = nl.ndarray((1, d), dtype=nl.float32, buffer=nl.shared_hbm)
    dw = nl.ndarray((n_out, d), dtype=nl.float32, buffer=nl.shared_hbm)
    w_n = _row_broadcast(w_norm, d, nl.float32)
    ones = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=ones, value=1.0, engine=nisa.gpsimd_engine)
    dwn_acc = nl.ndarray((1, d), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=dwn_acc, value=0.0, engine=nisa.gpsimd_engine)
    r_all = nl.ndarray((P, t // P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=r_all, src=rstd.ap([[1, P], [P, t // P]], offset=0))
    n_subs = _subs(n_out)
    # phase 1, per token block: dxn = dy @ W (W streamed in [128, block] slabs, dxn in PSUM), then
    # the norm's backward: dx, and w_norm's gradient
    for t0, nt in _blocks(t, rmsnorm_linear_tiles(t, d, n_out, _itemsize(x.dtype), backward=True)):
        dy_n = nl.ndarray((P, nt, n_out), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=dy_n, src=dy.ap([[n_out, P], [P * n_out, nt], [1, n_out]], offset=t0 * n_out))
        dy_t = nl.ndarray((P, len(n_subs), nt * P), dtype=x.dtype, buffer=nl.sbuf)
        for ti in range(nt):
            for j, (a, b) in enumerate(n_subs):
                _transpose_into(dy_t[0:b - a, j, ti * P:(ti + 1) * P], dy_n[:, ti, a:b], P, b - a, x.dtype)
        dxn = nl.ndarray((P, nt, d), dtype=nl.float32, buffer=nl.sbuf)
        for c0, c1 in _psum_blocks(d, nt):
            accs = [[nl.ndarray((P, b - a), dtype=nl.float32, buffer=nl.psum) for a, b in _chunks(c0, c1)]
                    for _ in range(nt)]
            for j, (a, b) in enumerate(n_subs):
                slab = nl.ndarray((P, c1 - c0), dtype=w.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=slab[0:b - a, :], src=w[a:b, c0:c1])
                for ti in range(nt):
                    for k, (e0, e1) in enumerate(_chunks(c0, c1)):
                        nisa.nc_matmul(dst=accs[ti][k], stationary=dy_t[0:b - a, j, ti * P:(ti + 1) * P],
                                       moving=slab[0:b - a, e0 - c0:e1 - c0])
            for ti in range(nt):
                for k, (e0, e1) in enumerate(_chunks(c0, c1)):
                    nisa.tensor_copy(dst=dxn[:, ti, e0:e1], src=accs[ti][k],
                                     engine=nisa.scalar_engine if k % 2 else nisa.vector_engine)
        for ti in range(nt):
            row0 = t0 + ti * P
            xt = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=xt, src=x[row0:row0 + P, :])
            dx_t = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
            col = row0 // P
            _norm_backward(dxn[:, ti, :], xt, w_n, r_all[:, col:col + 1], d, dx_t, ones, dwn_acc)
            nisa.dma_copy(dst=dx[row0:row0 + P, :], src=dx_t)
    nisa.dma_copy(dst=dwn, src=dwn_acc)
    # phase 2: dW = dy^T @ xn, output-stationary: a [512 n, block] piece of dW accumulates over
    # every token tile in PSUM, xn's columns recomputed from x, rstd and w_norm as they stream
    for n0 in range(0, n_out, CHUNK):
        subs = _subs(min(CHUNK, n_out - n0))
        for c0, c1 in _psum_blocks(d, len(subs)):
            accs = [[nl.ndarray((P, b - a), dtype=nl.float32, buffer=nl.psum) for a, b in _chunks(c0, c1)]
                    for _ in subs]
            for ti in range(t // P):
                dyt = nl.ndarray((P, CHUNK), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=dyt[:, 0:subs[-1][1]], src=dy[ti * P:(ti + 1) * P, n0:n0 + subs[-1][1]])
                xc = nl.ndarray((P, c1 - c0), dtype=x.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=xc, src=x[ti * P:(ti + 1) * P, c0:c1])
                xn = nl.ndarray((P, c1 - c0), dtype=x.dtype, buffer=nl.sbuf)
                nisa.scalar_tensor_tensor(dst=xn, data=xc, op0=nl.multiply, operand0=r_all[:, ti:ti + 1],
                                          op1=nl.multiply, operand1=w_n[:, c0:c1],
                                          engine=nisa.gpsimd_engine if ti % 2 else nisa.vector_engine)
                for j, (a, b) in enumerate(subs):
                    for k, (e0, e1) in enumerate(_chunks(c0, c1)):
                        nisa.nc_matmul(dst=accs[j][k][0:b - a, :], stationary=dyt[:, a:b],
                                       moving=xn[:, e0 - c0:e1 - c0])
            for j, (a, b) in enumerate(subs):
                for k, (e0, e1) in enumerate(_chunks(c0, c1)):
                    out = nl.ndarray((P, e1 - e0), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.activation(dst=out[0:b - a, :], op=nl.copy, data=accs[j][k][0:b - a, :])
                    nisa.dma_copy(dst=dw[n0 + a:n0 + b, e0:e1], src=out[0:b - a, :])
    return dx, dwn, dw


# -- SwiGLU MLP ----------------------------------------------------------------------------------
def _projection_t(w_t, x_t, d: int, rows: int):
    """[128 f, rows] fp32 PSUM = (x @ W-chunk^T)^T over D/128 matmuls."""
    acc = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.psum)
    for c in range(d // P):
        nisa.nc_matmul(dst=acc, stationary=w_t[:, c, :], moving=x_t[:, c, 0:rows])
    return acc


class _Staged:
    """One weight's 128-wide intermediate chunks in the layout a matmul wants, made once and
    reused by every token block: the first block loads chunk k from the weight (`load`, a
    transposing or strided DMA) and writes it to HBM scratch in that layout; later blocks read
    the scratch back in one contiguous run a partition."""

    def __init__(self, w, chunks: int, shape: tuple, load):
        self.dtype, self.shape, self.load = w.dtype, shape, load
        self.free = 1
        for n in shape[1:]:
            self.free *= n
        self.scratch = nl.ndarray((chunks, P, self.free), dtype=w.dtype, buffer=nl.hbm)

    def chunk(self, k: int, first: bool):
        tile = nl.ndarray(self.shape, dtype=self.dtype, buffer=nl.sbuf)
        flat = tile if len(self.shape) == 2 else tile.reshape((P, self.free))
        if first:
            self.load(tile, k)
            nisa.dma_copy(dst=self.scratch[k], src=flat)
        else:
            nisa.dma_copy(dst=flat, src=self.scratch[k])
        return tile


def _rows_transposed(w, d: int):
    """Loader of rows 128 k.. of a [F, D] weight as [128 d, D/128, 128 f] (a stationary W^T chunk)."""
    def load(tile, k: int) -> None:
        nisa.dma_transpose(dst=tile, src=w.ap([[d, P], [P, d // P], [1, P]], offset=k * P * d))
    return load


def _columns_transposed(w, d: int, f: int):
    """Loader of columns 128 k.. of a [D, F] weight as [128 f, D] (the down projection's moving rows)."""
    def load(tile, k: int) -> None:
        nisa.dma_transpose(dst=tile, src=w.ap([[f, d], [1, P]], offset=k * P))
    return load


def _columns(w, d: int, f: int):
    """Loader of columns 128 k.. of a [D, F] weight as [128 d, D/128, 128 f] (d on partitions)."""
    def load(tile, k: int) -> None:
        nisa.dma_copy(dst=tile, src=w.ap([[f, P], [P * f, d // P], [1, P]], offset=k * P))
    return load


@nki.jit
def swiglu_fwd(x, wg, wu, wd):
    t, d, f = check_swiglu(x, wg, wu, wd, "swiglu_fwd")
    y = nl.ndarray((t, d), dtype=x.dtype, buffer=nl.shared_hbm)
    dchunks = [(c0, min(d, c0 + CHUNK)) for c0 in range(0, d, CHUNK)]
    stationary = (P, d // P, P)
    wg_t, wu_t = (_Staged(w, f // P, stationary, _rows_transposed(w, d)) for w in (wg, wu))
    wd_r = _Staged(wd, f // P, (P, d), _columns_transposed(wd, d, f))
    for block, (t0, nt) in enumerate(_blocks(t, swiglu_tiles(t, d, _itemsize(x.dtype), backward=False))):
        rows, first = nt * P, block == 0
        x_t = _load_transposed(x, t0, rows, d)
        y_acc = nl.ndarray((P, nt, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=y_acc, value=0.0, engine=nisa.gpsimd_engine)
        for g0 in range(0, f, F_GROUP * P):  # F_GROUP chunks of 128: their down products add in PSUM
            h_ts, wd_rows = [], []  # (the previous group's are free)
            for k in range(g0 // P, min(f, g0 + F_GROUP * P) // P):
                g = _projection_t(wg_t.chunk(k, first), x_t, d, rows)
                u = _projection_t(wu_t.chunk(k, first), x_t, d, rows)
                s = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=s, op=nl.silu, data=g)
                h_t = nl.ndarray((P, rows), dtype=x.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(dst=h_t, data1=s, data2=u, op=nl.multiply)
                h_ts.append(h_t)
                wd_rows.append(wd_r.chunk(k, first))
            for ti in range(nt):
                for j, (c0, c1) in enumerate(dchunks):
                    acc = nl.ndarray((P, c1 - c0), dtype=nl.float32, buffer=nl.psum)
                    for h_t, rows_k in zip(h_ts, wd_rows):
                        nisa.nc_matmul(dst=acc, stationary=h_t[:, ti * P:(ti + 1) * P], moving=rows_k[:, c0:c1])
                    nisa.tensor_tensor(dst=y_acc[:, ti, c0:c1], data1=y_acc[:, ti, c0:c1], data2=acc, op=nl.add,
                                       engine=nisa.gpsimd_engine if j % 2 else nisa.vector_engine)
        for ti in range(nt):
            out = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=y_acc[:, ti, :], engine=nisa.scalar_engine)
            nisa.dma_copy(dst=y[t0 + ti * P:t0 + (ti + 1) * P, :], src=out)
    return y


def _tokens_major(src_t, nt: int, dtype):
    """[128 f, nt * 128 tokens] -> [128 tokens, nt, 128 f] (Tensor-engine transposes)."""
    dst = nl.ndarray((P, nt, P), dtype=dtype, buffer=nl.sbuf)
    for ti in range(nt):
        _transpose_into(dst[:, ti, :], src_t[:, ti * P:(ti + 1) * P], P, P, dtype)
    return dst


def _tokens_view(a, t0: int, nt: int, c0: int, width: int):
    """a[t0 + 128 i + p, c0:c0 + width] of a row-major [T, C] HBM tensor as [128 p, nt i, width]."""
    c = a.shape[1]
    return a.ap([[c, P], [P * c, nt], [1, width]], offset=t0 * c + c0)


def _swiglu_bwd_gates(x, dy, dx, weights, acts, t: int, d: int, f: int) -> None:
    """Pass 1 of the backward, token blocks outer: per F chunk g^T, u^T and dh^T recomputed,
    dg^T and du^T formed, dx += dg @ Wg + du @ Wu in fp32 SBUF; h, dg and du go to HBM scratch
    tokens-major ([T, F], `acts`) for the weight gradients of pass 2."""
    (wg_t, wu_t, wd_c, wg, wu), (h_s, dg_s, du_s) = weights, acts
    dchunks = [(c0, min(d, c0 + CHUNK)) for c0 in range(0, d, CHUNK)]
    for block, (t0, nt) in enumerate(_blocks(t, swiglu_tiles(t, d, _itemsize(x.dtype), backward=True))):
        rows, first = nt * P, block == 0
        x_t = _load_transposed(x, t0, rows, d)
        dy_t = _load_transposed(dy, t0, rows, d)
        dx_acc = nl.ndarray((P, nt, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=dx_acc, value=0.0, engine=nisa.gpsimd_engine)
        for k in range(f // P):
            f0 = k * P
            g = _projection_t(wg_t.chunk(k, first), x_t, d, rows)
            u = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf)  # (dh is in PSUM too)
            nisa.tensor_copy(dst=u, src=_projection_t(wu_t.chunk(k, first), x_t, d, rows),
                             engine=nisa.scalar_engine)
            dh = _projection_t(wd_c.chunk(k, first), dy_t, d, rows)  # dh^T = (dy @ Wd[:, chunk])^T
            sig = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(dst=sig, op=nl.sigmoid, data=g)
            s = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=s, data1=sig, data2=g, op=nl.multiply)
            h_t = nl.ndarray((P, rows), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=h_t, data1=s, data2=u, op=nl.multiply, engine=nisa.gpsimd_engine)
            du_t = nl.ndarray((P, rows), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=du_t, data1=dh, data2=s, op=nl.multiply)
            # silu'(g) = sig + s * (1 - sig) = sig + s - s * sig
            dsilu = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dsilu, data1=s, data2=sig, op=nl.multiply, engine=nisa.gpsimd_engine)
            nisa.tensor_tensor(dst=dsilu, data1=s, data2=dsilu, op=nl.subtract, engine=nisa.gpsimd_engine)
            nisa.tensor_tensor(dst=dsilu, data1=dsilu, data2=sig, op=nl.add, engine=nisa.gpsimd_engine)
            dgu = nl.ndarray((P, rows), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dgu, data1=dh, data2=u, op=nl.multiply)
            dg_t = nl.ndarray((P, rows), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(dst=dg_t, data1=dgu, data2=dsilu, op=nl.multiply)
            wg_rows = nl.ndarray((P, d), dtype=wg.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=wg_rows, src=wg[f0:f0 + P, :])
            wu_rows = nl.ndarray((P, d), dtype=wu.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=wu_rows, src=wu[f0:f0 + P, :])
            for ti in range(nt):  # dx[tile] += dg @ Wg[chunk] + du @ Wu[chunk]
                for j, (c0, c1) in enumerate(dchunks):
                    acc = nl.ndarray((P, c1 - c0), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(dst=acc, stationary=dg_t[:, ti * P:(ti + 1) * P], moving=wg_rows[:, c0:c1])
                    nisa.nc_matmul(dst=acc, stationary=du_t[:, ti * P:(ti + 1) * P], moving=wu_rows[:, c0:c1])
                    nisa.tensor_tensor(dst=dx_acc[:, ti, c0:c1], data1=dx_acc[:, ti, c0:c1], data2=acc, op=nl.add,
                                       engine=nisa.gpsimd_engine if j % 2 else nisa.vector_engine)
            for src_t, scratch in ((h_t, h_s), (dg_t, dg_s), (du_t, du_s)):
                nisa.dma_copy(dst=_tokens_view(scratch, t0, nt, f0, P), src=_tokens_major(src_t, nt, x.dtype))
        for ti in range(nt):
            out = nl.ndarray((P, d), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=out, src=dx_acc[:, ti, :], engine=nisa.scalar_engine)
            nisa.dma_copy(dst=dx[t0 + ti * P:t0 + (ti + 1) * P, :], src=out)


def _swiglu_bwd_weights(x, dy, acts, grads, t: int, d: int, f: int) -> None:
    """Pass 2, F groups outer and tokens the contraction: for SWIGLU_GRAD_GROUP chunks of 128
    intermediate rows, dWg = dg^T @ x, dWu = du^T @ x and dWd = dy^T @ h summed over every
    token block in fp32 SBUF (PSUM over a block's tiles) and written to HBM once."""
    (h_s, dg_s, du_s), (dwg, dwu, dwd) = acts, grads
    dchunks = [(c0, min(d, c0 + CHUNK)) for c0 in range(0, d, CHUNK)]
    group = swiglu_grad_group(d, f, _itemsize(x.dtype))
    for g0 in range(0, f, group * P):
        width = min(f, g0 + group * P) - g0
        acc_g, acc_u = (nl.ndarray((P, width // P, d), dtype=nl.float32, buffer=nl.sbuf) for _ in range(2))
        acc_d = nl.ndarray((P, d // P, width), dtype=nl.float32, buffer=nl.sbuf)
        for acc in (acc_g, acc_u, acc_d):
            nisa.memset(dst=acc, value=0.0, engine=nisa.gpsimd_engine)
        for t0, nt in _blocks(t, GRAD_TOKEN_TILES):
            x_n, dy_n = (nl.ndarray((P, nt, d), dtype=x.dtype, buffer=nl.sbuf) for _ in range(2))
            nisa.dma_copy(dst=x_n, src=_tokens_view(x, t0, nt, 0, d))
            nisa.dma_copy(dst=dy_n, src=_tokens_view(dy, t0, nt, 0, d))
            h_n, dg_n, du_n = (nl.ndarray((P, nt, width), dtype=x.dtype, buffer=nl.sbuf) for _ in range(3))
            for tile, scratch in ((h_n, h_s), (dg_n, dg_s), (du_n, du_s)):
                nisa.dma_copy(dst=tile, src=_tokens_view(scratch, t0, nt, g0, width))
            j = 0
            for acc_w, src in ((acc_g, dg_n), (acc_u, du_n)):  # dW[chunk] += d?^T @ x
                for k in range(width // P):
                    for c0, c1 in dchunks:
                        part = nl.ndarray((P, c1 - c0), dtype=nl.float32, buffer=nl.psum)
                        for ti in range(nt):
                            nisa.nc_matmul(dst=part, stationary=src[:, ti, k * P:(k + 1) * P], moving=x_n[:, ti, c0:c1])
                        nisa.tensor_tensor(dst=acc_w[:, k, c0:c1], data1=acc_w[:, k, c0:c1], data2=part, op=nl.add,
                                           engine=nisa.gpsimd_engine if j % 2 else nisa.vector_engine)
                        j += 1
            for c in range(d // P):  # dWd[rows of d, group] += dy^T @ h
                part = nl.ndarray((P, width), dtype=nl.float32, buffer=nl.psum)
                for ti in range(nt):
                    nisa.nc_matmul(dst=part, stationary=dy_n[:, ti, c * P:(c + 1) * P], moving=h_n[:, ti, :])
                nisa.tensor_tensor(dst=acc_d[:, c, :], data1=acc_d[:, c, :], data2=part, op=nl.add,
                                   engine=nisa.gpsimd_engine if c % 2 else nisa.vector_engine)
        for k in range(width // P):
            nisa.dma_copy(dst=dwg[g0 + k * P:g0 + (k + 1) * P, :], src=acc_g[:, k, :])
            nisa.dma_copy(dst=dwu[g0 + k * P:g0 + (k + 1) * P, :], src=acc_u[:, k, :])
        nisa.dma_copy(dst=dwd.ap([[f, P], [P * f, d // P], [1, width]], offset=g0), src=acc_d)


@nki.jit
def swiglu_bwd(x, wg, wu, wd, dy):
    t, d, f = check_swiglu(x, wg, wu, wd, "swiglu_bwd")
    dx = nl.ndarray((t, d), dtype=x.dtype, buffer=nl.shared_hbm)
    grads = (nl.ndarray((f, d), dtype=nl.float32, buffer=nl.shared_hbm),
             nl.ndarray((f, d), dtype=nl.float32, buffer=nl.shared_hbm),
             nl.ndarray((d, f), dtype=nl.float32, buffer=nl.shared_hbm))
    stationary = (P, d // P, P)
    weights = (_Staged(wg, f // P, stationary, _rows_transposed(wg, d)),
               _Staged(wu, f // P, stationary, _rows_transposed(wu, d)),
               _Staged(wd, f // P, stationary, _columns(wd, d, f)), wg, wu)
    acts = tuple(nl.ndarray((t, f), dtype=x.dtype, buffer=nl.hbm) for _ in range(3))  # h, dg, du
    _swiglu_bwd_gates(x, dy, dx, weights, acts, t, d, f)
    _swiglu_bwd_weights(x, dy, acts, grads, t, d, f)
    return (dx,) + grads


# -- host paths (the kernels' numerics) ------------------------------------------------------------
def _rstd_host(x, eps: float):
    import torch
    return torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)


def host_rmsnorm_linear_fwd(x, w_norm, w, eps: float = 1e-6):
    """rmsnorm_linear_fwd with torch on the host: fp32 statistics, the normalised x rounded once
    to x's dtype, the matmul in fp32 rounded once."""
    check_rmsnorm_linear(x, w_norm, w)
    rstd = _rstd_host(x, eps)
    xn = (x.float() * rstd * w_norm.float()).to(x.dtype)
    return (xn.float() @ w.float().T).to(x.dtype), rstd


def host_rmsnorm_linear_bwd(x, w_norm, w, rstd, dy, eps: float = 1e-6):
    """rmsnorm_linear_bwd with torch on the host (fp32 throughout, dx rounded once)."""
    check_rmsnorm_linear(x, w_norm, w)
    xf, r, wn = x.float(), rstd.float(), w_norm.float()
    xn = (xf * r * wn).to(x.dtype).float()
    dyf = dy.float()
    dxn = dyf @ w.float()
    u = dxn * wn
    dot = (u * xf).sum(-1, keepdim=True)
    dx = u * r - xf * r.pow(3) * dot / x.shape[-1]
    dwn = (dxn * xf * r).sum(0, keepdim=True)
    return dx.to(x.dtype), dwn, dyf.T @ xn


def host_swiglu_fwd(x, wg, wu, wd):
    """swiglu_fwd with torch on the host: gate and up in fp32, h rounded once to x's dtype."""
    import torch.nn.functional as F
    check_swiglu(x, wg, wu, wd)
    xf = x.float()
    h = (F.silu(xf @ wg.float().T) * (xf @ wu.float().T)).to(x.dtype)
    return (h.float() @ wd.float().T).to(x.dtype)


def host_swiglu_bwd(x, wg, wu, wd, dy):
    """swiglu_bwd with torch on the host: fp32 arithmetic, h, dg and du rounded to x's dtype as
    the kernel's next matmuls read them."""
    import torch
    check_swiglu(x, wg, wu, wd)
    xf, dyf = x.float(), dy.float()
    g, u = xf @ wg.float().T, xf @ wu.float().T
    sig = torch.sigmoid(g)
    s = g * sig
    dh = dyf @ wd.float()
    h = (s * u).to(x.dtype).float()
    du = (dh * s).to(x.dtype).float()
    dg = (dh * u * (sig + s - s * sig)).to(x.dtype).float()
    return (dg @ wg.float() + du @ wu.float()).to(x.dtype), dg.T @ xf, du.T @ xf, dyf.T @ h


# -- work the kernels must do (the benchmark's roofline) -------------------------------------------
def rmsnorm_linear_flops(t: int, d: int, n: int, backward: bool = False) -> int:
    """Matmul FLOPs: forward x @ W^T; backward dy @ W and dy^T @ xn."""
    return 2 * t * d * n * (2 if backward else 1)


def rmsnorm_linear_bytes(t: int, d: int, n: int, itemsize: int, backward: bool = False) -> int:
    """Bytes at least moved: x and W in, y out; backward x, W and dy in, dx and fp32 dW out."""
    if backward:
        return (2 * t * d + n * d + t * n) * itemsize + n * d * 4
    return (t * d + n * d + t * n) * itemsize


def swiglu_flops(t: int, d: int, f: int, backward: bool = False) -> int:
    """Matmul FLOPs: forward three [T, D] x [D, F]-sized matmuls; backward (gate and up
    recomputed) 2 + 1 (dh) + 2 (dx) + 3 (weight gradients)."""
    return 2 * t * d * f * (8 if backward else 3)


def swiglu_bytes(t: int, d: int, f: int, itemsize: int, backward: bool = False) -> int:
    """Bytes at least moved: x and the three weights in, y out; backward also dy in, dx and the
    three fp32 weight gradients out."""
    if backward:
        return (3 * t * d + 3 * f * d) * itemsize + 3 * f * d * 4
    return (2 * t * d + 3 * f * d) * itemsize
