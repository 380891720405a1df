"""nki.language against torch references: memory, indexing, masks, math, dtypes, loops, SPMD."""
import numpy as np
import pytest
import torch

import torchneuron.nki as nki
import torchneuron.nki.language as nl


@nki.jit
def _copy_kernel(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.load(a))
    return out


def test_load_store_roundtrip_keeps_dtype_and_values():
    for dt in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
        a = (torch.randn(64, 96) * 10).to(dt)
        out = _copy_kernel(a)
        assert out.dtype == dt and torch.equal(out, a)


def test_numpy_in_numpy_out():
    a = np.random.rand(32, 16).astype(np.float32)
    out = _copy_kernel(a)
    assert isinstance(out, np.ndarray) and np.array_equal(out, a)


@nki.jit
def _index_kernel(a):
    out = nl.ndarray((128, 64), dtype=a.dtype, buffer=nl.shared_hbm)
    i = nl.mgrid[0:128, 0:32]
    t = nl.ndarray((2, nl.par_dim(128), 32), dtype=a.dtype)
    t[0, i.p, i.x] = nl.load(a[i.p, i.x])                       # mgrid
    t[1] = nl.load(a[0:128, nl.ds(32, 32)])                        # slices + ds
    ip, jf = nl.arange(128)[:, None], nl.arange(32)[None, :]
    nl.store(out[ip, 32 + jf], value=t[1, ip, jf])
    nl.store(out[:, 0:32], value=t[0])
    return out


def test_indexing_forms_agree():
    a = torch.randn(128, 64)
    assert torch.equal(_index_kernel(a), a)


@nki.jit
def _strided_kernel(a):
    # transposed and strided access patterns: out[j, i] = a[i, 2 j]
    out = nl.ndarray((a.shape[1] // 2, a.shape[0]), dtype=a.dtype, buffer=nl.shared_hbm)
    ip, jf = nl.arange(a.shape[0])[:, None], nl.arange(a.shape[1] // 2)[None, :]
    t = nl.load(a[ip, 2 * jf])
    nl.store(out[jf, ip], value=t)
    return out


def test_affine_access_patterns():
    a = torch.randn(16, 40)
    assert torch.equal(_strided_kernel(a), a[:, ::2].T)


@nki.jit
def _masked_add(a, b):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    rows = a.shape[0]
    for t in nl.affine_range((rows + 127) // 128):
        ip = t * 128 + nl.arange(128)[:, None]
        jf = nl.arange(a.shape[1])[None, :]
        x = nl.load(a[ip, jf], mask=ip < rows)
        y = nl.load(b[ip, jf], mask=ip < rows)
        nl.store(out[ip, jf], value=x + y, mask=ip < rows)
    return out


def test_mask_covers_ragged_tail():
    a, b = torch.randn(200, 48), torch.randn(200, 48)
    assert torch.allclose(_masked_add(a, b), a + b)


@nki.jit
def _math_kernel(a, b):
    outs = [nl.ndarray(a.shape, dtype=nl.float32, buffer=nl.shared_hbm) for _ in range(10)]
    x, y = nl.load(a), nl.load(b)
    vals = [nl.add(x, y), nl.subtract(x, y), nl.multiply(x, 3.0), nl.exp(x), nl.log(nl.exp(y)),
            nl.square(x), nl.rsqrt(nl.exp(x)), nl.maximum(x, y), 2.0 - x / 4.0, -x]
    for o, v in zip(outs, vals):
        nl.store(o, value=v)
    return outs


def test_elementwise_math():
    a, b = torch.randn(64, 128), torch.randn(64, 128)
    got = _math_kernel(a, b)
    want = [a + b, a - b, a * 3, a.exp(), b, a * a, torch.rsqrt(a.exp()), torch.maximum(a, b),
            2 - a / 4, -a]
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-5, atol=1e-5)


@nki.jit
def _reduce_kernel(a):
    x = nl.load(a)
    res = [nl.ndarray((a.shape[0], 1), dtype=nl.float32, buffer=nl.shared_hbm) for _ in range(3)]
    nl.store(res[0], value=nl.sum(x, axis=1, keepdims=True))
    nl.store(res[1], value=nl.max(x, axis=[1], keepdims=True))
    nl.store(res[2], value=nl.mean(x, axis=1, keepdims=True))
    return res


def test_reductions():
    a = torch.randn(100, 300)
    s, m, mu = _reduce_kernel(a)
    assert torch.allclose(s[:, 0], a.sum(1), atol=1e-4)
    assert torch.equal(m[:, 0], a.amax(1))
    assert torch.allclose(mu[:, 0], a.mean(1), atol=1e-6)


@nki.jit
def _matmul_kernel(x, yt, y):
    out = nl.ndarray((x.shape[0], y.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    out2 = nl.ndarray((x.shape[0], y.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    xs, ys = nl.load(x), nl.load(y)
    nl.store(out, value=nl.copy(nl.matmul(xs, ys)))                                # transposes x
    nl.store(out2, value=nl.copy(nl.matmul(nl.transpose(xs), ys, transpose_x=True)))
    return out, out2


def test_matmul_and_transpose():
    x, y = torch.randn(96, 64), torch.randn(64, 256)
    a, b = _matmul_kernel(x, y.T.contiguous(), y)
    assert torch.allclose(a, x @ y, atol=1e-4) and torch.allclose(b, x @ y, atol=1e-4)


@nki.jit
def _cast_kernel(a, dt):
    out = nl.ndarray(a.shape, dtype=dt, buffer=nl.shared_hbm)
    nl.store(out, value=nl.static_cast(nl.load(a), dt))
    return out


@pytest.mark.parametrize("dt,tdt", [(nl.bfloat16, torch.bfloat16), (nl.float8_e4m3, torch.float8_e4m3fn),
                                    (nl.float8_e5m2, torch.float8_e5m2), (nl.float16, torch.float16)])
def test_low_precision_rounding_matches_torch(dt, tdt):
    a = torch.randn(32, 64) * 4
    out = _cast_kernel(a, dt)
    assert out.dtype == tdt and torch.equal(out.float(), a.to(tdt).float())


@nki.jit
def _bf16_matmul(at, b):
    out = nl.ndarray((at.shape[1], b.shape[1]), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((at.shape[1], b.shape[1]), nl.float32, buffer=nl.psum)
    for k in nl.affine_range(at.shape[0] // 128):
        acc += nl.matmul(nl.load(at[k * 128:(k + 1) * 128, :]), nl.load(b[k * 128:(k + 1) * 128, :]),
                         transpose_x=True)
    nl.store(out, value=nl.copy(acc))
    return out


def test_matmul_accumulates_bf16_products_in_fp32():
    at = torch.randn(1024, 64).bfloat16()
    b = torch.randn(1024, 128).bfloat16()
    got = _bf16_matmul(at, b)
    exact = at.double().T @ b.double()
    assert (got.double() - exact).abs().max() < 1e-3          # fp32 accumulation
    assert (torch.matmul(at.T, b).double() - exact).abs().max() > 1e-3  # bf16 output would not


@nki.jit
def _dropout_kernel(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=nl.dropout(nl.load(a), 0.5))
    return out


def test_dropout_zeroes_about_the_rate():
    a = torch.ones(128, 512)
    out = _dropout_kernel(a)
    frac = (out == 0).float().mean().item()
    assert 0.45 < frac < 0.55 and set(out.unique().tolist()) <= {0.0, 1.0}


def test_tile_size_constants():
    ts = nl.tile_size
    assert (ts.pmax, ts.gemm_stationary_fmax, ts.gemm_moving_fmax, ts.psum_fmax, ts.bn_stats_fmax) == \
        (128, 128, 512, 512, 512)


@nki.jit
def _spmd_kernel(a):
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    i, j = nl.program_id(0), nl.program_id(1)
    assert nl.num_programs(0) == 2 and nl.num_programs(1) == 3
    t = nl.load(a[i * 128:(i + 1) * 128, j * 64:(j + 1) * 64])
    nl.store(out[i * 128:(i + 1) * 128, j * 64:(j + 1) * 64], value=t * float(10 * i + j))
    return out


def test_spmd_grid_program_ids():
    a = torch.ones(256, 192)
    out = _spmd_kernel[2, 3](a)
    want = torch.tensor([[10 * i + j for j in range(3)] for i in range(2)], dtype=torch.float32)
    assert torch.equal(out, want.repeat_interleave(128, 0).repeat_interleave(64, 1))


@nki.jit
def _loops_kernel(a):
    out = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.zeros((128, 1), dtype=nl.float32)
    for i in nl.sequential_range(4):
        acc[...] = nl.add(acc, nl.sum(nl.load(a[:, i * 32:(i + 1) * 32]), axis=1, keepdims=True))
    for i in nl.static_range(2):
        acc[...] = nl.multiply(acc, 1.0)
    nl.store(out, value=acc)
    return out


def test_loop_iterators():
    a = torch.randn(128, 128)
    assert torch.allclose(_loops_kernel(a)[:, 0], a.sum(1), atol=1e-4)


@nki.jit
def _loop_reduce_kernel(a):
    out = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.shared_hbm)
    acc = nl.ndarray((128, 1), dtype=nl.float32)
    for i in nl.affine_range(4):
        s = nl.sum(nl.load(a[:, i * 16:(i + 1) * 16]), axis=1, keepdims=True)
        acc[...] = nl.loop_reduce(s, op=np.add, loop_indices=(i,))
    nl.store(out, value=acc)
    return out


def test_loop_reduce_accumulates_over_iterations():
    a = torch.randn(128, 64)
    assert torch.allclose(_loop_reduce_kernel(a)[:, 0], a.sum(1), atol=1e-5)


@nki.jit
def _gather_rows(table, idx):
    out = nl.ndarray((idx.shape[0], table.shape[1]), dtype=table.dtype, buffer=nl.shared_hbm)
    jf = nl.arange(table.shape[1])[None, :]
    rows = nl.load(table[nl.load(idx), jf])   # indirect DMA: one row index per partition
    nl.store(out, value=rows)
    return out


def test_indirect_load_gathers_rows():
    table = torch.randn(1000, 64)
    idx = torch.randint(0, 1000, (128, 1), dtype=torch.int32)
    assert torch.equal(_gather_rows(table, idx), table[idx[:, 0].long()])
    with pytest.raises(nki.OutOfBoundsError):
        _gather_rows(table, torch.full((128, 1), 1000, dtype=torch.int32))
