"""Row-wise kernels on [rows, cols] tensors: softmax, RMSNorm, LayerNorm, transpose.

Rows map to the 128 partitions (a masked tail tile covers rows % 128), the whole row lives
along the free dimension, statistics are per-partition reductions.
"""
from __future__ import annotations

from .. import nki
from ..nki import isa as nisa
from ..nki import language as nl

P = nl.tile_size.pmax


@nki.jit
def softmax(x):
    """Softmax over the last dimension: exp(x - max) with the row sum fused into the
    activation (Scalar engine), then one multiply by the reciprocal."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    rows, cols = x.shape
    for t in nl.affine_range((rows + P - 1) // P):
        ip = t * P + nl.arange(P)[:, None]
        jf = nl.arange(cols)[None, :]
        valid = ip < rows
        xt = nl.load(x[ip, jf], mask=valid)
        neg_max = nisa.tensor_reduce(nl.max, xt, axis=1, negate=True, keepdims=True, mask=valid,
                                     dtype=nl.float32)
        row_sum = nl.ndarray((P, 1), dtype=nl.float32)
        e = nisa.activation(op=nl.exp, data=xt, bias=neg_max, reduce_op=nl.add, reduce_res=row_sum,
                            mask=valid, dtype=nl.float32)
        inv = nisa.reciprocal(row_sum, mask=valid)
        y = nisa.tensor_scalar(e, nl.multiply, inv, mask=valid, dtype=x.dtype)
        nl.store(out[ip, jf], value=y, mask=valid)
    return out


@nki.jit
def rmsnorm(x, weight, eps: float = 1e-6):
    """x / sqrt(mean(x^2) + eps) * weight over the last dimension."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    rows, cols = x.shape
    w = nl.load(weight.reshape((1, cols))).broadcast_to((P, cols))
    for t in nl.affine_range((rows + P - 1) // P):
        ip = t * P + nl.arange(P)[:, None]
        jf = nl.arange(cols)[None, :]
        valid = ip < rows
        xt = nl.load(x[ip, jf], mask=valid)
        sq_sum = nl.ndarray((P, 1), dtype=nl.float32)
        nisa.activation(op=nl.square, data=xt, reduce_op=nl.add, reduce_res=sq_sum, mask=valid,
                        dtype=nl.float32)
        rstd = nisa.tensor_scalar(sq_sum, nl.multiply, 1.0 / cols, op1=nl.add, operand1=eps, mask=valid)
        rstd = nl.rsqrt(rstd, mask=valid)
        y = nisa.scalar_tensor_tensor(data=xt, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                                      operand1=w, mask=valid, dtype=x.dtype)
        nl.store(out[ip, jf], value=y, mask=valid)
    return out


@nki.jit
def layernorm(x, weight, bias, eps: float = 1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias, statistics from bn_stats/bn_aggr."""
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    rows, cols = x.shape
    fmax = nl.tile_size.bn_stats_fmax
    chunks = (cols + fmax - 1) // fmax
    w = nl.load(weight.reshape((1, cols))).broadcast_to((P, cols))
    b = nl.load(bias.reshape((1, cols))).broadcast_to((P, cols))
    for t in nl.affine_range((rows + P - 1) // P):
        ip = t * P + nl.arange(P)[:, None]
        jf = nl.arange(cols)[None, :]
        valid = ip < rows
        xt = nl.load(x[ip, jf], mask=valid)
        stats = nl.ndarray((P, 6 * chunks), dtype=nl.float32)
        for c in nl.affine_range(chunks):
            jc = nl.arange(fmax)[None, :]
            stats[ip - t * P, c * 6 + nl.arange(6)[None, :]] = nisa.bn_stats(
                xt[ip - t * P, c * fmax + jc], mask=valid & (c * fmax + jc < cols), dtype=nl.float32)
        mv = nisa.bn_aggr(stats, mask=valid)
        rstd = nl.rsqrt(nl.add(mv[:, 1:2], eps, mask=valid), mask=valid)
        xn = nisa.tensor_scalar(xt, nl.subtract, mv[:, 0:1], op1=nl.multiply, operand1=rstd, mask=valid,
                                dtype=nl.float32)
        y = nl.add(nl.multiply(xn, w, mask=valid), b, mask=valid, dtype=x.dtype)
        nl.store(out[ip, jf], value=y, mask=valid)
    return out


@nki.jit
def transpose(x):
    """[R, C] -> [C, R] through the Tensor engine, 128x128 blocks (sizes multiples of 128)."""
    rows, cols = x.shape
    out = nl.ndarray((cols, rows), dtype=x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range(rows // P):
        for j in nl.affine_range(cols // P):
            blk = nl.load(x[i * P:(i + 1) * P, j * P:(j + 1) * P])
            t = nisa.nc_transpose(blk)
            nl.store(out[j * P:(j + 1) * P, i * P:(i + 1) * P], value=nl.copy(t, dtype=x.dtype))
    return out


@nki.jit
def rmsnorm_bwd(x, weight, grad, eps: float = 1e-6):
    """Gradients of rmsnorm: with r = rsqrt(mean(x^2) + eps) and u = grad * weight,
    dx = r * u - x * r^3 * mean(u * x) (per row), dw = sum over rows of grad * x * r (a
    partition-axis sum, done on the Tensor engine as ones^T @ (grad * x * r))."""
    rows, cols = x.shape
    dx = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    dw = nl.ndarray((1, cols), dtype=weight.dtype, buffer=nl.shared_hbm)
    w = nl.load(weight.reshape((1, cols))).broadcast_to((P, cols))
    ones = nl.full((P, 1), 1.0, dtype=nl.float32)
    chunk = nl.tile_size.gemm_moving_fmax
    n_chunks = (cols + chunk - 1) // chunk
    dw_acc = nl.zeros((1, cols), dtype=nl.float32)
    for t in nl.sequential_range((rows + P - 1) // P):
        n = min(P, rows - t * P)
        xt = nl.load(x[t * P:t * P + n, :], dtype=nl.float32)
        gt = nl.load(grad[t * P:t * P + n, :], dtype=nl.float32)
        ss = nl.ndarray((n, 1), dtype=nl.float32)
        nisa.activation(op=nl.square, data=xt, reduce_op=nl.add, reduce_res=ss)
        r = nl.rsqrt(nisa.tensor_scalar(ss, nl.multiply, 1.0 / cols, op1=nl.add, operand1=eps))
        u = nl.multiply(gt, w[0:n, :])
        ux = nl.ndarray((n, 1), dtype=nl.float32)
        prod = nl.multiply(u, xt)
        ux[...] = nl.sum(prod, axis=1, keepdims=True)
        coef = nl.multiply(nl.multiply(nl.multiply(r, r), r), nl.multiply(ux, 1.0 / cols))
        dx_t = nisa.scalar_tensor_tensor(data=u, op0=nl.multiply, operand0=r, op1=nl.subtract,
                                         operand1=nisa.tensor_scalar(xt, nl.multiply, coef))
        nl.store(dx[t * P:t * P + n, :], value=nl.copy(dx_t, dtype=x.dtype))
        gxr = nisa.tensor_scalar(nl.multiply(gt, xt), nl.multiply, r)
        for c in nl.affine_range(n_chunks):
            c0, c1 = c * chunk, min(cols, (c + 1) * chunk)
            part = nisa.nc_matmul(ones[0:n, :], gxr[:, c0:c1])
            dw_acc[:, c0:c1] = nl.add(dw_acc[:, c0:c1], part)
    nl.store(dw, value=nl.copy(dw_acc, dtype=weight.dtype))
    return dx, dw
