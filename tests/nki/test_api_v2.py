"""NKI 0.4+ API pieces that AWS's kernel library (nki-library) relies on: access patterns
(`tensor.ap`) with dtype reinterpretation and scalar / vector (indirect) offsets, scatter
stores, N-d `dma_transpose`, the pattern forms of `iota` / `affine_select`, `NKIObject`
dataclasses, hardware loops over registers (`fori_loop`, `while_loop`, `dynamic_range`),
PSUM spill, and the numpy-in / numpy-out contract with ml_dtypes bf16."""
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest
import torch

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
import torchneuron.nki.typing as nt


def _rand(*shape):
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


def test_ap_views_hbm_and_sbuf_row_major():
    """ap over HBM: [[stride, count], ...] in elements, with an offset; over SBUF the first
    pair steps partitions (stride = the partition row)."""
    @nki.jit
    def k(x):
        out = nl.ndarray((32, 16), dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((32, 64), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.ap([[128, 32], [1, 64]], offset=64))      # right half of rows 0..31
        nisa.dma_copy(dst=out, src=t.ap([[64, 32], [2, 16]], offset=1))       # odd columns 1..31
        return out
    x = _rand(64, 128)
    np.testing.assert_array_equal(nki.simulate_kernel(k, x), x[:32, 64:][:, 1:33:2])


def test_ap_reinterprets_dtype():
    @nki.jit
    def k(x):
        out = nl.ndarray((4, 8), dtype=nl.int16, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x.ap([[8, 4], [1, 8]], dtype=nl.int16))
        return out
    x = _rand(4, 4)
    np.testing.assert_array_equal(nki.simulate_kernel(k, x), x.view(np.int16).reshape(4, 8))


def test_ap_scalar_offset_selects_a_row_at_run_time():
    @nki.jit
    def k(x, row):
        out = nl.ndarray((1, 32), dtype=x.dtype, buffer=nl.shared_hbm)
        r = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=r, src=row)
        nisa.dma_copy(dst=out, src=x.ap([[32, 1], [1, 32]], scalar_offset=r, indirect_dim=0))
        return out
    x = _rand(10, 32)
    np.testing.assert_array_equal(nki.simulate_kernel(k, x, np.array([[7]], np.int32)), x[7:8])


def test_ap_vector_offset_gathers_and_scatters_rows():
    """Indirect DMA: each partition reads (or writes) the row its index names."""
    @nki.jit
    def k(x, idx):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        i = nl.ndarray((4, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=idx)
        t = nl.ndarray((4, 16), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.ap([[16, 4], [1, 16]], vector_offset=i, indirect_dim=0))
        z = nl.ndarray((8, 16), dtype=x.dtype, buffer=nl.sbuf)
        nisa.memset(dst=z, value=0.0)
        nisa.dma_copy(dst=out, src=z)
        nisa.dma_copy(dst=out.ap([[16, 4], [1, 16]], vector_offset=i, indirect_dim=0), src=t)
        return out
    x = _rand(8, 16)
    idx = np.array([[5], [0], [3], [6]], np.int32)
    want = np.zeros_like(x)
    want[idx[:, 0]] = x[idx[:, 0]]
    np.testing.assert_array_equal(nki.simulate_kernel(k, x, idx), want)


def test_dma_transpose_4d_permutes_3120():
    @nki.jit
    def k(x):
        out = nl.ndarray((64, 1, 1, 32), dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((64, 32), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=t.ap([[32, 64], [1, 1], [1, 1], [1, 32]]), src=x.ap([[64, 32], [1, 1], [1, 1], [1, 64]]))
        nisa.dma_copy(dst=out, src=t.ap([[32, 64], [1, 1], [1, 1], [1, 32]]))
        return out
    x = _rand(32, 64)
    np.testing.assert_array_equal(nki.simulate_kernel(k, x).reshape(64, 32), x.T)


def test_iota_and_affine_select_pattern_forms_build_a_causal_mask():
    """affine value = offset + partition * channel_multiplier + sum(index * step)."""
    @nki.jit
    def k(x):
        out = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        io = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.iota(io, [[1, 16]], 3, 16)
        t = nl.ndarray((16, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.affine_select(t, pattern=[[-1, 16]], offset=0, channel_multiplier=1,
                           on_true_tile=t, on_false_value=-1e30, cmp_op=nl.greater_equal)
        nisa.tensor_tensor(dst=t, data1=t, data2=io, op=nl.add)
        nisa.dma_copy(dst=out, src=t)
        return out
    x = _rand(16, 16)
    p, f = np.meshgrid(np.arange(16), np.arange(16), indexing="ij")
    want = np.where(p - f >= 0, x, -1e30) + (3 + 16 * p + f)
    np.testing.assert_allclose(nki.simulate_kernel(k, x), want, rtol=1e-6)


def test_nkiobject_class_attributes_become_dataclass_fields():
    @dataclass
    class Params(nl.NKIObject):
        size = None
        offsets = []
    p = Params(size=3)
    assert p.size == 3 and p.offsets == [] and Params().offsets is not p.offsets


def _loop_kernel(kind):
    @nki.jit
    def k(x, n):
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        n_sb = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=n_sb, src=n)
        reg = nisa.register_alloc()
        nisa.register_load(reg, n_sb)
        acc = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        t = nl.ndarray(x.shape, dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        if kind == "fori":
            nl.fori_loop(0, reg, lambda i: nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add))
        elif kind == "dynamic":
            for _ in nl.dynamic_range(reg):
                nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
        else:  # while: count the register down to zero through SBUF
            def body(r):
                nisa.tensor_tensor(dst=acc, data1=acc, data2=t, op=nl.add)
                nisa.tensor_scalar(dst=n_sb, data=n_sb, op0=nl.subtract, operand0=1)
                nisa.register_load(r, n_sb)
                return r
            nl.while_loop(reg, body)
        nisa.dma_copy(dst=out, src=acc)
        return out
    return k


@pytest.mark.parametrize("kind", ["fori", "dynamic", "while"])
def test_hardware_loops_run_a_register_count_of_iterations(kind):
    x = _rand(8, 16)
    k = _loop_kernel(kind)
    out3 = nki.simulate_kernel(k, x, np.array([[3]], np.int32))
    lat3 = k.last_stats.latency_s
    np.testing.assert_allclose(out3, 3 * x, rtol=1e-6)
    nki.simulate_kernel(k, x, np.array([[6]], np.int32))
    assert k.last_stats.latency_s > lat3  # every iteration is charged


def test_register_bound_loop_needs_data_in_a_timing_only_run():
    k = _loop_kernel("fori")
    with pytest.raises(nki.NKIError, match="no data"):
        k(nt.tensor[(8, 16), nl.float32], nt.tensor[(1, 1), nl.int32])


def test_numpy_bf16_in_gives_ml_dtypes_bf16_out_and_fp32_min_fill_becomes_minus_inf():
    @nki.jit
    def k(x):
        out = nl.ndarray((2, 8), dtype=x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((2, 8), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.memset(dst=t[:, 0:1], value=-3.4028234663852886e38)  # fp32 min, past bf16's range
        nisa.dma_copy(dst=out, src=t)
        return out
    x = _rand(2, 8).astype(ml_dtypes.bfloat16)
    out = nki.simulate_kernel(k, x)
    assert isinstance(out, np.ndarray) and out.dtype == ml_dtypes.bfloat16
    got = np.asarray(out, dtype=np.float32)
    assert np.all(np.isneginf(got[:, 0]))
    np.testing.assert_array_equal(got[:, 1:], x.astype(np.float32)[:, 1:])


def test_max8_find_index8_match_replace8_give_top8_values_and_indices():
    @nki.jit
    def k(x):
        vals = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        idx = nl.ndarray((4, 8), dtype=nl.uint32, buffer=nl.shared_hbm)
        rest = nl.ndarray((4, 32), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 32), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        v = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        i = nl.ndarray((4, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.max8(dst=v, src=t)
        nisa.nc_find_index8(dst=i, data=t, vals=v)
        nisa.nc_match_replace8(dst=t, data=t, vals=v, imm=float("-inf"))
        nisa.dma_copy(dst=vals, src=v)
        nisa.dma_copy(dst=idx, src=i)
        nisa.dma_copy(dst=rest, src=t)
        return vals, idx, rest
    x = _rand(4, 32)
    vals, idx, rest = nki.simulate_kernel(k, x)
    want = torch.topk(torch.from_numpy(x), 8, dim=1)
    np.testing.assert_array_equal(vals, want.values.numpy())
    np.testing.assert_array_equal(idx.astype(np.int64), want.indices.numpy())
    expect = x.copy()
    np.put_along_axis(expect, want.indices.numpy(), -np.inf, 1)
    np.testing.assert_array_equal(rest, expect)


def test_find_index8_gives_repeated_values_successive_positions():
    @nki.jit
    def k(x, v):
        idx = nl.ndarray((1, 8), dtype=nl.uint32, buffer=nl.shared_hbm)
        t = nl.ndarray((1, 16), dtype=nl.float32, buffer=nl.sbuf)
        vt = nl.ndarray((1, 8), dtype=nl.float32, buffer=nl.sbuf)
        i = nl.ndarray((1, 8), dtype=nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=vt, src=v)
        nisa.nc_find_index8(dst=i, data=t, vals=vt)
        nisa.dma_copy(dst=idx, src=i)
        return idx
    x = np.array([[3, 1, 3, 2, 3, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 5]], np.float32)
    v = np.array([[5, 3, 3, 3, 2, 1, 0, 0]], np.float32)
    np.testing.assert_array_equal(nki.simulate_kernel(k, x, v), [[15, 0, 2, 4, 3, 1, 5, 6]])


def test_range_select_masks_outside_per_partition_bounds_and_reduces_max():
    @nki.jit
    def k(x, lo, hi):
        out = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        mx = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 16), dtype=nl.float32, buffer=nl.sbuf)
        b0 = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        b1 = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        r = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        for dst, src in ((t, x), (b0, lo), (b1, hi)):
            nisa.dma_copy(dst=dst, src=src)
        nisa.range_select(dst=t, on_true_tile=t, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=b0,
                          bound1=b1, reduce_res=r, reduce_op=nl.maximum,
                          reduce_cmd=nisa.reduce_cmd.reset_reduce, range_start=100.0, on_false_value=-9.0)
        nisa.dma_copy(dst=out, src=t)
        nisa.dma_copy(dst=mx, src=r)
        return out, mx
    x = _rand(4, 16)
    lo = np.array([[100], [104], [110], [0]], np.float32)
    hi = np.array([[116], [108], [112], [1]], np.float32)
    out, mx = nki.simulate_kernel(k, x, lo, hi)
    pos = 100 + np.arange(16)
    want = np.where((pos >= lo) & (pos < hi), x, -9.0)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(mx[:, 0], want.max(1))


def test_positional_destination_before_keyword_operands():
    """`nisa.tensor_tensor(t, data1=a, data2=b, op=f)`: the positional tile is the destination."""
    @nki.jit
    def k(x):
        out = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        a = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        nisa.memset(dst=t, value=0.0)
        nisa.tensor_tensor(t, data1=a, data2=a, op=nl.add)
        nisa.dma_copy(dst=out, src=t)
        return out
    x = _rand(4, 8)
    np.testing.assert_array_equal(nki.simulate_kernel(k, x), 2 * x)


def test_partition_scalar_broadcasts_over_every_free_dim():
    @nki.jit
    def k(x, b):
        out = nl.ndarray((4, 2, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 2, 8), dtype=nl.float32, buffer=nl.sbuf)
        bias = nl.ndarray((4, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=bias, src=b)
        nisa.activation(dst=t, op=nl.square, data=t, bias=bias)
        nisa.dma_copy(dst=out, src=t)
        return out
    x, b = _rand(4, 2, 8), _rand(4, 1)
    np.testing.assert_allclose(nki.simulate_kernel(k, x, b), (x + b[:, :, None]) ** 2, rtol=1e-6)


def test_core_barrier_orders_one_core_and_syncs_a_multi_core_grid():
    @nki.jit
    def k(x):
        out = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.core_barrier(data=t, cores=(0, 1))
        nisa.dma_copy(dst=out, src=t)
        return out
    x = _rand(4, 8)
    np.testing.assert_array_equal(nki.simulate_kernel(k, x), x)
    np.testing.assert_array_equal(nki.simulate_kernel(k[nl.nc(2)], x), x)


def test_core_barrier_makes_each_cores_writes_visible_to_the_other():
    """Each core writes its half of a shared tensor, meets the other at the barrier, then reads
    the other core's half: only right if core 0 waits for core 1's write."""
    @nki.jit
    def k(x):
        c = nl.program_id(0)
        shared = nl.ndarray((2, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        mine = nl.ndarray((1, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=mine, src=x[c:c + 1, :])
        nisa.dma_copy(dst=shared[c:c + 1, :], src=mine)
        nisa.core_barrier(data=shared, cores=(0, 1))
        theirs = nl.ndarray((1, 8), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=theirs, src=shared[1 - c:2 - c, :])
        out = nl.ndarray((2, 8), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[c:c + 1, :], src=theirs)
        return out
    x = _rand(2, 8)
    np.testing.assert_array_equal(nki.simulate_kernel(k[nl.nc(2)], x), x[::-1])

    @nki.jit
    def to_a_missing_core(x):
        nisa.core_barrier(data=nl.ndarray((1, 1), dtype=nl.float32, buffer=nl.sbuf), cores=(0, 3))
    with pytest.raises(nki.CollectiveError, match="name cores 0-1"):
        nki.simulate_kernel(to_a_missing_core[nl.nc(2)], x)
