"""nki.collectives: collectives between the programs (ranks) of a launch equal numpy's, cost
shows on the kernel's modeled latency, bad input fails with a clear error (never a hang).

Tolerances: data-movement collectives (gather, all-to-all, permutes) copy bits: exact. fp32
reductions are compared at 1e-6 (the simulator and numpy may add the ranks in a different
order: a few ulp). bf16 reductions round once from fp32, as the reference does; the two fp32
sums may differ by an ulp and so round to neighbouring bf16 values: rtol 2**-7 (one bf16 ulp).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import torchneuron.nki as nki
import torchneuron.nki.collectives as ncc
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl
from torchneuron.nki.errors import CollectiveError, DTypeError, KernelError, ShapeError

ROWS, COLS = 8, 16
DTYPES = {"fp32": (torch.float32, 1e-6), "bf16": (torch.bfloat16, 2.0 ** -7)}


def _close(got: torch.Tensor, want, rtol: float) -> None:
    want = want.float().numpy() if isinstance(want, torch.Tensor) else np.asarray(want, dtype=np.float32)
    np.testing.assert_allclose(got.float().numpy(), want, rtol=rtol, atol=rtol)


def _launch(call, dst_shape, n: int, buffer=nl.private_hbm):
    """A kernel over n programs: rank r copies x[r] into a `buffer` src, runs `call(src, dst)`
    and writes its dst to out[r] (out is shared by the programs)."""

    @nki.jit
    def kernel(x):
        r = nl.program_id(0)
        src = nl.ndarray(x.shape[1:], dtype=x.dtype, buffer=buffer)
        nisa.dma_copy(dst=src, src=x[r])
        dst = nl.ndarray(dst_shape, dtype=x.dtype, buffer=buffer)
        call(src, dst)
        out = nl.ndarray((n,) + tuple(dst_shape), dtype=x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[r], src=dst)
        return out

    return kernel[n]


def _inputs(n: int, dtype: torch.dtype, rows: int = ROWS) -> torch.Tensor:
    return torch.randn(n, rows, COLS).to(dtype)


def _everyone(n):
    return ncc.ReplicaGroup([list(range(n))])


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("op,ref", [(nl.add, np.sum), (nl.maximum, np.max), (nl.minimum, np.min)])
def test_all_reduce(n, dtype, op, ref):
    tdtype, rtol = DTYPES[dtype]
    x = _inputs(n, tdtype)
    k = _launch(lambda s, d: ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(n), op=op),
                (ROWS, COLS), n)
    out = k(x)
    want = ref(x.float().numpy(), axis=0)
    for r in range(n):
        _close(out[r], torch.tensor(want).to(tdtype), rtol)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_all_reduce_sbuf(n, dtype):
    tdtype, rtol = DTYPES[dtype]
    x = _inputs(n, tdtype)
    k = _launch(lambda s, d: ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(n), op=nl.add),
                (ROWS, COLS), n, buffer=nl.sbuf)
    out = k(x)
    want = torch.tensor(x.float().numpy().sum(0)).to(tdtype)
    for r in range(n):
        _close(out[r], want, rtol)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("buffer,dim", [(nl.private_hbm, 0), (nl.sbuf, 0), (nl.sbuf, 1)])
def test_all_gather(n, dtype, buffer, dim):
    tdtype, _ = DTYPES[dtype]
    x = _inputs(n, tdtype)
    shape = (ROWS * n, COLS) if dim == 0 else (ROWS, COLS * n)
    k = _launch(lambda s, d: ncc.all_gather(srcs=[s], dsts=[d], replica_group=_everyone(n), collective_dim=dim),
                shape, n, buffer=buffer)
    out = k(x)
    want = torch.cat(list(x), dim)
    for r in range(n):
        assert torch.equal(out[r], want)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_reduce_scatter(n, dtype):
    tdtype, rtol = DTYPES[dtype]
    x = _inputs(n, tdtype)
    k = _launch(lambda s, d: ncc.reduce_scatter(srcs=[s], dsts=[d], replica_group=_everyone(n),
                                                collective_dim=0, op=nl.add), (ROWS // n, COLS), n)
    out = k(x)
    total = x.float().numpy().sum(0)
    for r in range(n):
        _close(out[r], torch.tensor(total[r * ROWS // n:(r + 1) * ROWS // n]).to(tdtype), rtol)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_all_to_all(n, dtype):
    tdtype, _ = DTYPES[dtype]
    x = _inputs(n, tdtype)
    k = _launch(lambda s, d: ncc.all_to_all(srcs=[s], dsts=[d], replica_group=_everyone(n), collective_dim=0),
                (ROWS, COLS), n)
    out = k(x)
    c = ROWS // n
    for r in range(n):  # rank r receives chunk r of every rank, in rank order
        assert torch.equal(out[r], torch.cat([x[s, r * c:(r + 1) * c] for s in range(n)]))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_collective_permute_and_ring(n, dtype):
    tdtype, _ = DTYPES[dtype]
    x = _inputs(n, tdtype)
    swap = [(r, r ^ 1) for r in range(n)]
    out = _launch(lambda s, d: ncc.collective_permute(srcs=[s], dsts=[d], source_target_pairs=swap),
                  (ROWS, COLS), n)(x)
    for r in range(n):
        assert torch.equal(out[r], x[r ^ 1])
    ring = _launch(lambda s, d: ncc.collective_permute_implicit(srcs_by_channel=[[s]], dsts_by_channel=[[d]],
                                                                replica_group=_everyone(n)), (ROWS, COLS), n)(x)
    for r in range(n):  # each rank receives its predecessor's
        assert torch.equal(ring[r], x[(r - 1) % n])


def test_collective_permute_implicit_reduce():
    n = 4
    x = _inputs(n, torch.float32)

    def call(s, d):
        ncc.collective_permute_implicit_reduce(srcs0_by_channel=[[s]], srcs1_by_channel=[[s]],
                                               dsts_by_channel=[[d]], replica_group=_everyone(n), op=nl.add)

    out = _launch(call, (ROWS, COLS), n)(x)
    for r in range(n):
        assert torch.equal(out[r], 2 * x[(r - 1) % n])


def test_replica_groups_and_rank_queries():
    n = 4
    x = _inputs(n, torch.float32)
    pairs = ncc.ReplicaGroup([[0, 1], [2, 3]])
    strided = ncc.ReplicaGroup.from_partition_op(4, ncc.rg_partition_op.mod, 2)
    assert strided.rank_lists == [[0, 2], [1, 3]]
    assert ncc.ReplicaGroup.from_partition_op(8, ncc.rg_partition_op.div, 4).rank_lists == [[0, 1, 2, 3], [4, 5, 6, 7]]
    seen = {}

    def call(s, d):
        ncc.all_reduce(srcs=[s], dsts=[d], replica_group=pairs, op=nl.add)
        ncc.all_reduce(srcs=[d], dsts=[s], replica_group=strided, op=nl.add)
        nisa.dma_copy(dst=d, src=s)
        seen[int(ncc.rank_id())] = int(ncc.self_index_in_replica_group(strided))

    out = _launch(call, (ROWS, COLS), n)(x)
    xs = x.numpy()
    pair_sums = [xs[0] + xs[1], xs[0] + xs[1], xs[2] + xs[3], xs[2] + xs[3]]
    for r in range(n):  # then summed over ranks {r, r ^ 2}: every rank ends with the total
        _close(out[r], pair_sums[r] + pair_sums[r ^ 2], 1e-6)
    assert seen == {0: 0, 1: 0, 2: 1, 3: 1}


def test_rank_id_as_dynamic_offset():
    @nki.jit
    def kernel(table):
        out = nl.ndarray((nl.num_programs(0), COLS), dtype=table.dtype, buffer=nl.shared_hbm)
        r = ncc.rank_id()
        row = nl.ndarray((1, COLS), dtype=table.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=row, src=table.ap(pattern=[[COLS, 1], [1, COLS]], scalar_offset=r, indirect_dim=0))
        nisa.dma_copy(dst=out[nl.program_id(0):nl.program_id(0) + 1, :], src=row)
        return out

    table = torch.randn(3, COLS)
    assert torch.equal(kernel[3](table), table)


def test_tensor_parallel_matmul_all_reduce():
    """Row-parallel linear: each rank multiplies its K-shard, the partial products are summed
    with an all-reduce, then every rank applies relu and scales: equals the unsharded math."""
    n, m, k, f = 4, 64, 512, 128
    x = torch.randn(m, k)
    w = torch.randn(k, f)
    shard = k // n

    @nki.jit
    def kernel(xt, w):
        r = nl.program_id(0)
        xs = nl.ndarray((shard, m), dtype=xt.dtype, buffer=nl.sbuf)
        ws = nl.ndarray((shard, f), dtype=w.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs, src=xt[r * shard:(r + 1) * shard, :])
        nisa.dma_copy(dst=ws, src=w[r * shard:(r + 1) * shard, :])
        acc = nl.ndarray((m, f), dtype=nl.float32, buffer=nl.psum)
        nisa.nc_matmul(acc, xs, ws)
        partial = nl.ndarray((m, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=partial, src=acc)
        total = nl.ndarray((m, f), dtype=nl.float32, buffer=nl.sbuf)
        ncc.all_reduce(srcs=[partial], dsts=[total], replica_group=ncc.ReplicaGroup([list(range(n))]), op=nl.add)
        y = nl.ndarray((m, f), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.relu, data=total, scale=0.5)
        out = nl.ndarray((n, m, f), dtype=nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[r], src=y)
        return out

    out = kernel[n](x.T.contiguous(), w)
    want = torch.relu(0.5 * (x.double() @ w.double())).float()
    for r in range(n):  # fp32 matmul over K=512 in 4 shards: a few ulp of the output's scale
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-4)


def _all_reduce_latency(rows: int) -> float:
    x = torch.randn(2, rows, COLS)
    k = _launch(lambda s, d: ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(2), op=nl.add),
                (rows, COLS), 2)
    k(x)
    return k.last_stats


def _copy_latency(rows: int) -> float:
    x = torch.randn(2, rows, COLS)
    k = _launch(lambda s, d: nisa.dma_copy(dst=d, src=s), (rows, COLS), 2)
    k(x)
    return k.last_stats


def test_cost_shows_on_latency_and_grows_with_bytes():
    from torchneuron.hardware.model import collective_cost
    small, large = _all_reduce_latency(8), _all_reduce_latency(2048)
    copy = _copy_latency(8)
    assert small.latency_s > copy.latency_s  # the collective is on the kernel's critical path
    # (the modeled ring cost of the bytes, at least; the copy replaced it in `copy`)
    assert small.latency_s >= collective_cost("all_reduce", 8 * COLS * 4, 2, None).duration_s
    assert large.latency_s > small.latency_s
    assert large.latency_s - small.latency_s >= (collective_cost("all_reduce", 2048 * COLS * 4, 2, None).duration_s
                                                 - collective_cost("all_reduce", 8 * COLS * 4, 2, None).duration_s)


def test_aws_style_kernel_through_the_import_alias():
    """A kernel written against AWS's module names (`nki.collectives`, shared_hbm buffers,
    keyword arguments) runs unmodified under `nki` / `neuronxcc.nki`."""
    nki.install_import_alias()
    try:
        import nki as aws_nki
        import nki.collectives as aws_ncc
        import nki.isa as aws_nisa
        import nki.language as aws_nl
        from nki.collectives import ReplicaGroup

        @aws_nki.jit
        def summed(inp, rg):
            src = aws_nl.ndarray(inp.shape, dtype=inp.dtype, buffer=aws_nl.shared_hbm, name="src")
            dst = aws_nl.ndarray(inp.shape, dtype=inp.dtype, buffer=aws_nl.shared_hbm, name="dst")
            out = aws_nl.ndarray(inp.shape, dtype=inp.dtype, buffer=aws_nl.shared_hbm)
            aws_nisa.dma_copy(dst=src, src=inp)
            aws_ncc.all_reduce(dsts=[dst], srcs=[src], op=aws_nl.add, replica_group=rg)
            aws_nisa.dma_copy(dst=out, src=dst)
            return out

        x = np.random.randn(ROWS, COLS).astype(np.float32)
        np.testing.assert_allclose(summed[2](x, ReplicaGroup([[0, 1]])), 2 * x, rtol=1e-6)
    finally:
        nki.uninstall_import_alias()


# ---------------------------------------------------------------------------------- errors
def _run_error(call, n=2, shape=(ROWS, COLS), buffer=nl.private_hbm, rows=ROWS):
    return _launch(call, shape, n, buffer=buffer)(_inputs(n, torch.float32, rows))


def test_deadlock_is_an_error_not_a_hang():
    def only_rank0(s, d):
        if nl.program_id(0) == 0:
            ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(2), op=nl.add)

    with pytest.raises(CollectiveError, match=r"deadlock.*rank 0 waits.*all_reduce.*\[1\] finished"):
        _run_error(only_rank0)


def test_different_collectives_across_ranks():
    def mixed(s, d):
        if nl.program_id(0) == 0:
            ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(2), op=nl.add)
        else:
            ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(2), op=nl.maximum)

    with pytest.raises(CollectiveError, match="rank 0 calls all_reduce.*'add'.*rank 1 calls all_reduce.*'maximum'"):
        _run_error(mixed)


def test_mismatched_shapes_across_ranks():
    @nki.jit
    def kernel(x):
        r = nl.program_id(0)
        rows = 4 if r == 0 else 8
        src = nl.ndarray((rows, COLS), dtype=x.dtype, buffer=nl.private_hbm)
        dst = nl.ndarray((rows, COLS), dtype=x.dtype, buffer=nl.private_hbm)
        ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=_everyone(2), op=nl.add)
        return x

    with pytest.raises(CollectiveError, match=r"\(4, 16\).*\(8, 16\)"):
        kernel[2](torch.zeros(1))


def test_group_beyond_the_grid():
    call = lambda s, d: ncc.all_reduce(srcs=[s], dsts=[d], replica_group=ncc.ReplicaGroup([[0, 1, 2, 3]]),
                                       op=nl.add)
    with pytest.raises(CollectiveError, match=r"names rank 2.*2 program\(s\).*kernel\[4\]"):
        _run_error(call)


def test_rank_outside_every_rank_list():
    call = lambda s, d: ncc.all_reduce(srcs=[s], dsts=[d], replica_group=ncc.ReplicaGroup([[0]]), op=nl.add)
    with pytest.raises(CollectiveError, match="rank 1 is in no rank-list"):
        _run_error(call)


def test_overlapping_rank_lists():
    with pytest.raises(CollectiveError, match="rank 1 is in two rank-lists"):
        ncc.ReplicaGroup([[0, 1], [1, 2]])


def test_unsupported_op_and_dtype():
    call = lambda s, d: ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(2), op=nl.multiply)
    with pytest.raises(CollectiveError, match="use nl.add, nl.minimum or nl.maximum"):
        _run_error(call)

    @nki.jit
    def fp8(x):
        src = nl.ndarray((ROWS, COLS), dtype=nl.float8_e4m3, buffer=nl.private_hbm)
        ncc.all_reduce(srcs=[src], dsts=[src], replica_group=_everyone(2), op=nl.add)
        return x

    with pytest.raises(DTypeError, match="cannot reduce.*float8"):
        fp8[2](torch.zeros(1))


def test_memory_and_shape_rules():
    mixed = lambda s, d: ncc.all_reduce(srcs=[s], dsts=[nl.ndarray(s.shape, dtype=s.dtype, buffer=nl.sbuf)],
                                        replica_group=_everyone(2), op=nl.add)
    with pytest.raises(CollectiveError, match="mix HBM and SBUF"):
        _run_error(mixed)
    sbuf_a2a = lambda s, d: ncc.all_to_all(srcs=[s], dsts=[d], replica_group=_everyone(2), collective_dim=0)
    with pytest.raises(CollectiveError, match="must be on HBM"):
        _run_error(sbuf_a2a, buffer=nl.sbuf)
    gather_dim1 = lambda s, d: ncc.all_gather(srcs=[s], dsts=[d], replica_group=_everyone(2), collective_dim=1)
    with pytest.raises(CollectiveError, match="collective_dim=1 is not supported on HBM"):
        _run_error(gather_dim1, shape=(ROWS, 2 * COLS))
    wrong_dst = lambda s, d: ncc.all_gather(srcs=[s], dsts=[d], replica_group=_everyone(2), collective_dim=0)
    with pytest.raises(ShapeError, match=r"dst has shape \(8, 16\).*\(16, 16\)"):
        _run_error(wrong_dst)
    not_a_list = lambda s, d: ncc.all_reduce(srcs=s, dsts=[d], replica_group=_everyone(2), op=nl.add)
    with pytest.raises(CollectiveError, match=r"srcs=\[t\]"):
        _run_error(not_a_list)
    uneven = lambda s, d: ncc.reduce_scatter(srcs=[s], dsts=[d], replica_group=_everyone(4), collective_dim=0,
                                             op=nl.add)
    with pytest.raises(ShapeError, match="does not split into 4"):
        _run_error(uneven, n=4, rows=6, shape=(1, COLS))


def test_kernel_errors_in_one_rank_stop_the_launch():
    def boom(s, d):
        ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(2), op=nl.add)
        if nl.program_id(0) == 1:
            raise ValueError("rank 1 broke")

    with pytest.raises(KernelError, match="rank 1 broke"):
        _run_error(boom)


def test_ring_permute_on_sbuf_with_two_channels():
    """nki-library's fine-grained all-gather runs the implicit ring permute on SBUF, a channel
    per half of the tile."""
    n, half = 4, ROWS // 2

    def call(s, d):
        ncc.collective_permute_implicit(srcs_by_channel=[[s[0:half, :]], [s[half:ROWS, :]]],
                                        dsts_by_channel=[[d[0:half, :]], [d[half:ROWS, :]]],
                                        replica_group=_everyone(n), channel_ids=[0, 1])
        assert int(ncc.collective_permute_implicit_current_processing_rank_id(1, _everyone(n))) == \
            (nl.program_id(0) - 1) % n

    x = _inputs(n, torch.float32)
    out = _launch(call, (ROWS, COLS), n, buffer=nl.sbuf)(x)
    for r in range(n):
        assert torch.equal(out[r], x[(r - 1) % n])


# ------------------------------------------------------------------ one kernel call per rank
def _aws_style(collective, out_shape):
    """AWS's pattern: a collective cannot read the kernel's I/O tensors, so each rank copies its
    input to a shared-HBM src, runs the collective into a shared-HBM dst and copies that out."""

    @nki.jit
    def kernel(inp, replica_group):
        src = nl.ndarray(inp.shape, dtype=inp.dtype, buffer=nl.shared_hbm, name="src")
        dst = nl.ndarray(out_shape, dtype=inp.dtype, buffer=nl.shared_hbm, name="dst")
        out = nl.ndarray(out_shape, dtype=inp.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=src, src=inp)
        collective(src, dst, replica_group)
        nisa.dma_copy(dst=out, src=dst)
        return out

    return kernel


@pytest.mark.parametrize("n", [2, 4])
def test_simulate_ranks_gives_each_rank_its_inputs_and_shared_hbm(n):
    xs = [np.random.randn(ROWS, COLS).astype(np.float32) for _ in range(n)]
    group = ncc.ReplicaGroup([list(range(n))])
    gather = _aws_style(lambda s, d, rg: ncc.all_gather(srcs=[s], dsts=[d], replica_group=rg, collective_dim=0),
                        (ROWS * n, COLS))
    outs = nki.simulate_ranks(gather, [{"inp": x, "replica_group": group} for x in xs])
    for out in outs:
        assert np.array_equal(out, np.concatenate(xs))
    scatter = _aws_style(lambda s, d, rg: ncc.reduce_scatter(srcs=[s], dsts=[d], replica_group=rg,
                                                             collective_dim=0, op=nl.add), (ROWS // n, COLS))
    outs = nki.simulate_ranks(scatter, [(x, group) for x in xs])
    total = np.sum(xs, axis=0)
    c = ROWS // n
    for r, out in enumerate(outs):
        np.testing.assert_allclose(out, total[r * c:(r + 1) * c], rtol=1e-6, atol=1e-6)
    assert scatter.last_stats.latency_s > 0


def test_simulate_ranks_rank_id_and_errors():
    @nki.jit
    def whoami(x):
        out = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.shared_hbm)
        reg = ncc.rank_id()
        t = nl.ndarray((1, 1), dtype=nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=t, value=int(reg))
        nisa.dma_copy(dst=out, src=t)
        return out

    outs = nki.simulate_ranks(whoami, [(np.zeros(1, np.float32),)] * 3)
    assert [int(o[0, 0]) for o in outs] == [0, 1, 2]
    with pytest.raises(nki.NKIError, match="without a grid"):
        whoami[2].run_ranks([((np.zeros(1, np.float32),), {})] * 2)


def test_collectives_of_a_subgroup_do_not_shift_the_others():
    """Ranks 0-1 all-reduce among themselves first; then all four ranks all-reduce. Ranks 2-3
    make one collective, ranks 0-1 two: calls match per rank-list, not per rank."""
    n = 4
    x = _inputs(n, torch.float32)

    def call(s, d):
        if nl.program_id(0) < 2:
            ncc.all_reduce(srcs=[s], dsts=[d], replica_group=ncc.ReplicaGroup([[0, 1]]), op=nl.add)
            nisa.dma_copy(dst=s, src=d)
        ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(n), op=nl.add)

    out = _launch(call, (ROWS, COLS), n)(x)
    xs = x.numpy()
    want = 2 * (xs[0] + xs[1]) + xs[2] + xs[3]
    for r in range(n):
        _close(out[r], want, 1e-6)


def test_timing_only_run_prices_the_collective():
    """Typed placeholders (no data) give the modeled latency of the same kernel run with data."""
    import torchneuron.nki.typing as nt
    k = _launch(lambda s, d: ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(4), op=nl.add),
                (ROWS, COLS), 4)
    k(_inputs(4, torch.float32))
    with_data = k.last_stats.latency_s
    out = k(nt.tensor[(4, ROWS, COLS), nl.float32])
    assert isinstance(out, nt.TensorType) and k.last_stats.latency_s == pytest.approx(with_data)


def test_sbuf_collective_skips_the_hbm_round_trip():
    """The same all-reduce costs less SBUF-to-SBUF (DMA rate) than through HBM (half its
    bandwidth, as the ring model charges), and each rank's instruction shows in the trace."""
    def duration(buffer) -> float:
        k = _launch(lambda s, d: ncc.all_reduce(srcs=[s], dsts=[d], replica_group=_everyone(2), op=nl.add),
                    (128, 512), 2, buffer=buffer)
        _, stats = k.run((_inputs(2, torch.float32, rows=128).repeat(1, 1, 32),), {}, trace=True)
        records = [r for r in stats.trace if r.kind == "all_reduce"]
        assert len(records) == 2 and {r.engine for r in records} == {"dma"}
        return records[0].end - records[0].start

    assert duration(nl.sbuf) < duration(nl.private_hbm)


def test_in_place_ring_permute():
    """src and dst the same buffer on every rank: each rank still receives its predecessor's
    original data (all reads happen before any write)."""
    n = 4
    x = _inputs(n, torch.float32)

    def call(s, d):
        ncc.collective_permute_implicit(srcs_by_channel=[[s]], dsts_by_channel=[[s]], replica_group=_everyone(n))
        nisa.dma_copy(dst=d, src=s)

    out = _launch(call, (ROWS, COLS), n)(x)
    for r in range(n):
        assert torch.equal(out[r], x[(r - 1) % n])


def test_grid_ranks_sharing_a_dst_that_must_differ():
    """AWS's kernels keep dst in nl.shared_hbm: per rank on the device, shared by a grid's
    programs here. An all-gather tolerates that (every rank gets the same), a reduce-scatter
    cannot and says how to fix it."""
    gather = _aws_style(lambda s, d, rg: ncc.all_gather(srcs=[s], dsts=[d], replica_group=rg, collective_dim=0),
                        (2 * ROWS, COLS))
    x = np.random.randn(ROWS, COLS).astype(np.float32)
    assert np.array_equal(gather[2](x, _everyone(2)), np.concatenate([x, x]))
    scatter = _aws_style(lambda s, d, rg: ncc.reduce_scatter(srcs=[s], dsts=[d], replica_group=rg,
                                                             collective_dim=0, op=nl.add), (ROWS // 2, COLS))
    with pytest.raises(CollectiveError, match="same shared_hbm tensor.*simulate_ranks"):
        scatter[2](x, _everyone(2))
