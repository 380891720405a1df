"""nki.isa instructions against torch references, in the legacy (returning) form and the
destination-first form of NKI 0.3+."""
import numpy as np
import torch

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl


def _run(body, *arrays, out_shapes):
    """Run `body(tiles...) -> list of tiles` in a kernel; return the stored results."""
    @nki.jit
    def kernel(*args):
        outs = [nl.ndarray(s, dtype=nl.float32, buffer=nl.shared_hbm) for s in out_shapes]
        res = body(*[nl.load(a) for a in args])
        for o, r in zip(outs, res):
            nl.store(o, value=r)
        return outs
    return kernel(*arrays)


def test_nc_matmul_both_forms():
    a, b = torch.randn(128, 96), torch.randn(128, 400)

    def body(x, y):
        legacy = nl.copy(nisa.nc_matmul(x, y))
        dst = nl.ndarray((96, 400), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst, x, y)
        nisa.nc_matmul(dst=dst, stationary=x, moving=y)          # accumulates
        return [legacy, nl.copy(dst)]
    legacy, twice = _run(body, a, b, out_shapes=[(96, 400), (96, 400)])
    assert torch.allclose(legacy, a.T @ b, atol=1e-4)
    assert torch.allclose(twice, 2 * (a.T @ b), atol=1e-4)


def test_nc_transpose_tensor_and_vector_engines():
    a = torch.randn(128, 64)
    s = torch.randn(32, 16)

    def body(x, y):
        t = nl.copy(nisa.nc_transpose(x))
        dst = nl.ndarray((16, 32), dtype=nl.float32)
        nisa.nc_transpose(dst, y, engine=nisa.vector_engine)
        return [t, dst]
    t, v = _run(body, a, s, out_shapes=[(64, 128), (16, 32)])
    assert torch.equal(t, a.T) and torch.equal(v, s.T)


def test_activation_scale_bias_and_reduce():
    a, sc, bi = torch.randn(128, 256), torch.rand(128, 1), torch.randn(128, 1)

    def body(x, s, b):
        red = nl.ndarray((128, 1), dtype=nl.float32)
        y = nisa.activation(op=nl.exp, data=x, scale=s, bias=b, reduce_op=nl.add, reduce_res=red)
        dst = nl.ndarray((128, 256), dtype=nl.float32)
        nisa.activation(dst, nl.tanh, x, scale=2.0)
        return [y, red, dst]
    y, red, t = _run(body, a, sc, bi, out_shapes=[(128, 256), (128, 1), (128, 256)])
    want = torch.exp(a * sc + bi)
    assert torch.allclose(y, want, rtol=1e-5)
    assert torch.allclose(red[:, 0], want.sum(1), rtol=1e-4)
    assert torch.allclose(t, torch.tanh(2 * a), atol=1e-6)


def test_tensor_tensor_scalar_reduce_copy_reciprocal():
    a, b, v = torch.randn(64, 200), torch.randn(64, 200), torch.rand(64, 1) + 0.5

    def body(x, y, c):
        tt = nisa.tensor_tensor(x, y, op=nl.multiply)
        ts = nisa.tensor_scalar(x, np.subtract, c, op1=np.multiply, operand1=3.0)
        tsr = nisa.tensor_scalar(data=x, op0=nl.subtract, operand0=c, reverse0=True)
        mx = nisa.tensor_reduce(np.max, x, axis=(1,), keepdims=True, negate=True)
        cp = nisa.tensor_copy(x, dtype=nl.bfloat16)
        rc = nisa.reciprocal(c)
        dst = nl.ndarray((64, 200), dtype=nl.float32)
        nisa.tensor_tensor(dst, x, y, nl.add)
        return [tt, ts, tsr, mx, cp, rc, dst]
    shapes = [(64, 200), (64, 200), (64, 200), (64, 1), (64, 200), (64, 1), (64, 200)]
    tt, ts, tsr, mx, cp, rc, dst = _run(body, a, b, v, out_shapes=shapes)
    assert torch.allclose(tt, a * b)
    assert torch.allclose(ts, (a - v) * 3, atol=1e-6)
    assert torch.allclose(tsr, v - a)
    assert torch.equal(mx[:, 0], -a.amax(1))
    assert torch.equal(cp, a.bfloat16().float())
    assert torch.allclose(rc, 1 / v)
    assert torch.allclose(dst, a + b)


def test_scan_and_scalar_tensor_tensor():
    a, b = torch.rand(32, 64), torch.randn(32, 64)
    z = torch.randn(32, 1)

    def body(x, y, s):
        scan = nisa.tensor_tensor_scan(x, y, initial=0.0, op0=np.multiply, op1=np.add)
        stt = nisa.scalar_tensor_tensor(data=x, op0=nl.multiply, operand0=s, op1=nl.add, operand1=y)
        return [scan, stt]
    scan, stt = _run(body, a, b, z, out_shapes=[(32, 64), (32, 64)])
    h, ref = torch.zeros(32), torch.empty(32, 64)
    for i in range(64):
        h = a[:, i] * h + b[:, i]
        ref[:, i] = h
    assert torch.allclose(scan, ref, atol=1e-5)
    assert torch.allclose(stt, a * z + b)


def test_select_iota_memset():
    a = torch.randn(128, 128)

    def body(x):
        ip, jf = nl.arange(128)[:, None], nl.arange(128)[None, :]
        causal = nisa.affine_select(pred=(ip >= jf), on_true_tile=x, on_false_value=-1.0)
        io = nisa.iota(ip * 128 + jf, dtype=nl.float32)
        ms = nl.ndarray((128, 128), dtype=nl.float32)
        nisa.memset(ms, 2.5)
        return [causal, io, ms]
    causal, io, ms = _run(body, a, out_shapes=[(128, 128)] * 3)
    tri = torch.ones(128, 128).tril().bool()
    assert torch.equal(causal, torch.where(tri, a, torch.tensor(-1.0)))
    assert torch.equal(io, torch.arange(128 * 128, dtype=torch.float32).view(128, 128))
    assert torch.all(ms == 2.5)


def test_bn_stats_aggr_give_mean_and_variance():
    a = torch.randn(128, 1024) * 3 + 1

    def body(x):
        stats = nl.ndarray((128, 12), dtype=nl.float32)
        for c in nl.affine_range(2):
            stats[:, c * 6:(c + 1) * 6] = nisa.bn_stats(x[:, c * 512:(c + 1) * 512])
        return [nisa.bn_aggr(stats)]
    mv, = _run(body, a, out_shapes=[(128, 2)])
    assert torch.allclose(mv[:, 0], a.mean(1), atol=1e-5)
    assert torch.allclose(mv[:, 1], a.var(1, unbiased=False), rtol=1e-4)


@nki.jit
def _dma_kernel(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=a)
    nisa.dma_copy(out, t)
    return out


def test_dma_copy_both_directions():
    a = torch.randn(128, 300)
    assert torch.equal(_dma_kernel(a), a)


def test_tensor_partition_reduce():
    a = torch.randn(128, 64)

    def body(x):
        return [nisa.tensor_partition_reduce(np.add, x), nisa.tensor_partition_reduce(np.max, x)]
    s, m = _run(body, a, out_shapes=[(1, 64), (1, 64)])
    assert torch.allclose(s[0], a.sum(0), atol=1e-5) and torch.equal(m[0], a.amax(0))
