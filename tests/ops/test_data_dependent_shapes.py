"""Ops with data-dependent output shapes (nonzero, masked_select, argwhere, x[mask],
nonzero(as_tuple=True)) run natively on the NeuronCore in every dtype but complex: no CPU fallback, accepted in strict mode,
results bit-equal to the CPU's in eager, adaptive eager and compiled mode (with unbacked SymInts
and with a graph break), and priced by the performance model as a compaction kernel plus the
count's read-back to the host."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo

import torchneuron
import torchneuron.eager
from torchneuron.compiler.program import recorded_plans
from torchneuron.hardware import model
from torchneuron.hardware.estimate import estimate
from torchneuron.hardware.targets import TARGETS

# float64 too: a selection computes nothing in float64 (hardware.model.FP64_SELECTION_OPS)
DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64)

OPS = {
    "nonzero": lambda x, m: torch.nonzero(x),
    "nonzero_tuple": lambda x, m: torch.nonzero(x, as_tuple=True),
    "argwhere": lambda x, m: torch.argwhere(x),
    "masked_select": lambda x, m: torch.masked_select(x, m),
    "masked_select_broadcast": lambda x, m: torch.masked_select(x, m[0]),
    "bool_index": lambda x, m: x[m],
    "bool_index_rows": lambda x, m: x[m[:, 0, 0]],
    "bool_index_columns": lambda x, m: x[:, m[0, :, 0]],
}


def _sample(dtype: torch.dtype, shape=(5, 7, 3)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if dtype == torch.bool:
        x = torch.rand(shape, generator=g) > 0.5
    elif dtype.is_floating_point:
        x = torch.randn(shape, generator=g).mul(torch.rand(shape, generator=g) > 0.4).to(dtype)
        x.view(-1)[3] = float("nan")  # NaN is nonzero
        x.view(-1)[4] = -0.0          # negative zero is zero
    else:
        x = torch.randint(-2 if dtype.is_signed else 0, 3, shape, generator=g).to(dtype)
    mask = torch.rand(shape, generator=g) > 0.5
    return x, mask


def _assert_bit_equal(got, want) -> None:
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.device.type == "neuron"
        assert g.dtype == w.dtype and g.shape == w.shape
        g = g.cpu()
        if w.dtype.is_floating_point:
            assert torch.equal(g.view(torch.int16 if w.itemsize == 2 else torch.int32),
                               w.view(torch.int16 if w.itemsize == 2 else torch.int32))
        else:
            assert torch.equal(g, w)


@pytest.fixture
def strict():
    torchneuron.reset_fallback_counts()
    torchneuron.set_strict(True)
    try:
        yield
    finally:
        torchneuron.set_strict(False)
    assert torchneuron.fallback_counts() == {}


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", OPS)
def test_eager_matches_cpu_without_fallback(op, dtype, mode, strict):
    x, mask = _sample(dtype)
    want = OPS[op](x, mask)
    torchneuron.eager.set_eager_mode(mode)
    try:
        got = OPS[op](x.to("neuron"), mask.to("neuron"))
    finally:
        torchneuron.eager.set_eager_mode("eager")
    _assert_bit_equal(got, want)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (), (1,), (4, 0, 2)], ids=str)
def test_empty_and_scalar_inputs(shape, strict):
    x = torch.ones(shape)
    for fn in (torch.nonzero, torch.argwhere, lambda t: t[t > 0], lambda t: torch.masked_select(t, t > 0)):
        _assert_bit_equal(fn(x.to("neuron")), fn(x))
    none = torch.zeros(shape)
    _assert_bit_equal(torch.nonzero(none.to("neuron")), torch.nonzero(none))


def test_adaptive_program_flushes_at_the_data_dependent_size(strict):
    """Queued ops before a compaction are flushed into it; ops after it use its size. The
    programs take Python floats (unbacked float symbols of the fused programs) that change from
    call to call, beside the data-dependent sizes."""
    x = torch.randn(64, 16)

    def program(t, scale, threshold):
        y = (t * scale + 1.25).relu()
        selected = y[y > threshold]                   # needs y computed: flushes the queued ops
        count = torch.nonzero(y > threshold).shape[0]  # a Python int from a device sync
        z = selected.exp().sum() * count + torch.masked_select(t, t < 0).abs().mean() * scale
        return z, selected, y.argwhere()

    torchneuron.eager.set_eager_mode("adaptive")
    try:
        for scale, threshold in ((3.0, 1.5), (2.5, 1.75), (0.75, 0.5)):  # later calls reuse cached programs
            want = program(x, scale, threshold)
            got = program(x.to("neuron"), scale, threshold)
            torch.testing.assert_close(got[0].cpu(), want[0], rtol=1e-6, atol=0)
            _assert_bit_equal(got[1:], want[1:])
    finally:
        torchneuron.eager.set_eager_mode("eager")


def test_autograd_through_masked_select_and_bool_index(strict):
    x = torch.randn(6, 5)
    mask = x > 0
    xs = [x.clone().requires_grad_(), x.to("neuron").requires_grad_()]
    for t, m in zip(xs, (mask, mask.to("neuron"))):
        (t[m].pow(2).sum() + torch.masked_select(t, ~m).sum() * 3).backward()
    _assert_bit_equal(xs[1].grad, xs[0].grad)


def _graph(t, m):
    y = t * 2
    z = y[m]
    return z.sum() + torch.nonzero(m).shape[0], torch.nonzero(m), torch.masked_select(t, m) + 1


@pytest.mark.parametrize("capture", [True, False], ids=["unbacked", "graph_break"])
@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_compiled_matches_cpu(capture, mode, strict):
    torch._dynamo.reset()
    compiled = torch.compile(_graph, backend="neuron")
    torchneuron.eager.set_eager_mode(mode)
    try:
        with torch._dynamo.config.patch(capture_dynamic_output_shape_ops=capture):
            for rows in (6, 6, 9):  # a new mask count at the same and at another input size
                x = torch.randn(rows, 4)
                m = x > 0.2
                want = _graph(x, m)
                with recorded_plans() as plans:
                    got = compiled(x.to("neuron"), m.to("neuron"))
                torch.testing.assert_close(got[0].cpu(), want[0])
                _assert_bit_equal(got[1:], want[1:])
                assert plans, "no compiled graph ran"
                if capture:
                    _assert_compaction_priced(plans, int(m.sum()))
    finally:
        torchneuron.eager.set_eager_mode("eager")
        torch._dynamo.reset()


def _assert_compaction_priced(plans, count: int) -> None:
    """The compaction is part of the graph; its count is an unbacked size symbol bound to this
    call's count (read from the graph's outputs) when the plan is priced."""
    ops = {op.op for plan, _ in plans for k in plan.kernels for op in k.ops}
    assert any("nonzero" in name for name in ops), ops
    unbacked = {s for plan, _ in plans for s in plan.unbacked_defaults}
    assert unbacked and all(s.startswith("u") for s in unbacked), unbacked
    bound = [b for plan, b in plans if plan.unbacked]
    assert any(b[s] == count for b in bound for s in b if s in unbacked), (bound, count)


TRN2 = TARGETS["trn2"]


def test_model_prices_a_compaction_not_a_per_element_gather():
    """masked_select/x[mask] used to be priced as a gather with one indirect descriptor per mask
    element (the bool mask taken for an index): a compaction stores dense runs instead."""
    n = 2048 * 2048
    ins, outs = [(torch.float32, (2048, 2048)), (torch.bool, (2048, 2048))], [(torch.float32, (n // 2,))]
    select = model.op_cost("aten::masked_select", ins, outs, TRN2)
    index = model.op_cost("aten::index.Tensor", ins, outs, TRN2)
    compare = model.op_cost("aten::gt.Scalar", ins[:1], ins[1:], TRN2)  # making the mask: one pass
    assert not select.fallback and select.duration_s == index.duration_s
    # a few Vector/GpSimd passes over the mask: within a small factor of one elementwise pass
    # (the per-element gather was ~70x that)
    assert compare.duration_s < select.duration_s < 4 * compare.duration_s
    # the bytes: values and mask read once, the selection and its count written
    assert select.bytes == n * 4 + n + (n // 2) * 4 + 8


def test_model_charges_the_count_read_back():
    """A tiny nonzero is latency: the kernel plus the host's read of the count over PCIe, which
    nonzero_static (a static size) does not pay."""
    ins, outs = [(torch.bool, (8,))], [(torch.int64, (3, 1))]
    dynamic = model.op_cost("aten::nonzero", ins, outs, TRN2)
    static = model.op_cost("aten::nonzero_static", ins, [(torch.int64, (8, 1))], TRN2)
    read_back = model.copy_cost(8, "d2h", TRN2).duration_s
    assert dynamic.bound == "latency" and not dynamic.fallback
    assert dynamic.duration_s == pytest.approx(static.duration_s + read_back, rel=1e-6)


def test_nonzero_scales_with_its_coordinates():
    """nonzero computes d coordinates per element: more GpSimd passes for a 4-d input than for a 1-d one."""
    n = 1 << 22
    flat = model.op_cost("aten::nonzero", [(torch.bool, (n,))], [(torch.int64, (n // 2, 1))], TRN2)
    four = model.op_cost("aten::nonzero", [(torch.bool, (16, 16, 128, 128))], [(torch.int64, (n // 2, 4))], TRN2)
    assert four.duration_s > 1.5 * flat.duration_s


def test_float64_compaction_is_a_device_kernel_testing_words_not_a_host_fallback():
    """float64 data is compacted on the device (its zero test is integer work on the two 32-bit
    words of each element); complex data has no such kernel and stays a host fallback."""
    n = 1 << 20
    f32 = model.op_cost("aten::nonzero", [(torch.float32, (n,))], [(torch.int64, (n // 2, 1))], TRN2)
    f64 = model.op_cost("aten::nonzero", [(torch.float64, (n,))], [(torch.int64, (n // 2, 1))], TRN2)
    assert not f64.fallback and f64.engine == f32.engine and f64.duration_s > f32.duration_s
    assert f64.bytes == f32.bytes + 4 * n  # the float64 input read once
    assert not model.runs_on_host("aten::masked_select", [(torch.float64, (n,)), (torch.bool, (n,))], TRN2)
    assert model.runs_on_host("aten::masked_select", [(torch.complex64, (n,)), (torch.bool, (n,))], TRN2)
    assert model.op_cost("aten::nonzero", [(torch.complex64, (n,))], [(torch.int64, (n // 2, 1))], TRN2).fallback


def test_eager_timeline_charges_the_device_kernel(strict):
    x = torch.randn(256, 256, device="neuron")
    with estimate("trn2") as est:
        torch.nonzero(x > 0)
        x[x > 1]
    rows = {row.name: row for row in est.per_op}
    assert "aten::nonzero" in rows and rows["aten::nonzero"].time_s > model.copy_cost(8, "d2h", TRN2).duration_s
    assert not any(getattr(row, "fallback", False) for row in rows.values())


@pytest.mark.parametrize("mode", ["eager", "adaptive"])
def test_opinfo_samples_of_the_compaction_ops(mode):
    """The OpInfo gates' sweep (tests/ops/opinfo_sweep.py) of just these ops, in float32, bfloat16
    and float16: every sample matches the CPU and none falls back to the host."""
    from tests.ops.opinfo_sweep import sweep
    from tests.ops.test_opinfo_adaptive import adaptive_sweep

    names = {"nonzero", "nonzero_static", "masked_select", "argwhere", "masked_scatter"}
    torchneuron.reset_fallback_counts()
    if mode == "eager":
        result = sweep((torch.float32, torch.bfloat16, torch.float16), names)
    else:
        result = adaptive_sweep(names)
    assert result.ops_run >= 10 and result.samples_passed >= 30, (result.ops_run, result.samples_passed)
    assert result.failures == {} and result.samples_failed == 0
    assert torchneuron.fallback_counts() == {}
