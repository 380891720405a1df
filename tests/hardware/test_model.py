"""The op-level model: roofline, tiling, dtypes, fallbacks, copies, collectives."""
import math
import warnings

import pytest
import torch

from torchneuron.hardware.model import Cost, collective_cost, copy_cost, launch_cost, op_category, op_cost
from torchneuron.hardware.targets import TARGETS, set_target

TRN1, TRN2, TRN3 = (TARGETS[n] for n in ("trn1", "trn2", "trn3"))
BF16, FP32 = torch.bfloat16, torch.float32


def mm(m, k, n, dtype=BF16, target=TRN2):
    return op_cost("aten::mm", [(dtype, (m, k)), (dtype, (k, n))], [(dtype, (m, n))], target)


def add(numel, dtype=BF16, target=TRN2, op="aten::add.Tensor"):
    sig = (dtype, (numel,))
    return op_cost(op, [sig, sig], [sig], target)


def test_large_bf16_matmul_is_compute_bound_near_peak():
    cost = mm(8192, 8192, 8192)
    ideal = 2 * 8192 ** 3 / TRN2.peak_flops(BF16)
    assert cost.bound == "compute" and cost.engine == "tensor"
    assert ideal <= cost.duration_s <= 1.10 * ideal
    assert cost.flops == 2 * 8192 ** 3


def test_large_elementwise_add_is_memory_bound():
    numel = 1 << 26
    cost = add(numel)
    moved = 3 * numel * 2
    assert cost.bound == "memory" and cost.engine == "vector"
    assert cost.bytes == moved
    assert cost.duration_s == pytest.approx(moved / TRN2.hbm_bytes_per_s, rel=0.01)


def test_fp32_matmul_is_slower_by_the_spec_ratio():
    spec = TRN2.peak_flops(BF16) / TRN2.peak_flops(FP32)  # 79 / 20
    ratio = mm(8192, 8192, 8192, FP32).duration_s / mm(8192, 8192, 8192).duration_s
    assert ratio == pytest.approx(spec, rel=0.05)


def test_time_grows_monotonically_with_size():
    times = [mm(n, n, n).duration_s for n in (1, 16, 64, 128, 129, 256, 512, 513, 1024, 2048, 4096)]
    assert times == sorted(times)
    adds = [add(n).duration_s for n in (1, 1000, 10 ** 5, 10 ** 7, 10 ** 8)]
    assert adds == sorted(adds) and adds[-1] > 100 * adds[0]


def test_time_jumps_at_tile_boundaries():
    # M and K: 128 rows of the array (fp32 keeps these shapes compute-bound)
    assert mm(129, 8192, 8192, FP32).duration_s / mm(128, 8192, 8192, FP32).duration_s > 1.8
    assert mm(8192, 129, 8192, FP32).duration_s / mm(8192, 128, 8192, FP32).duration_s > 1.8
    # N: 512-column moving tiles (a 1-column tail pass still pays the stationary load)
    assert mm(8192, 8192, 513).duration_s / mm(8192, 8192, 512).duration_s > 1.2
    # within a tile, one more row costs (almost) nothing
    assert mm(128, 8192, 8192, FP32).duration_s / mm(127, 8192, 8192, FP32).duration_s < 1.02


def test_trn3_is_faster_than_trn2_on_fp8():
    fp8 = torch.float8_e4m3fn
    trn2, trn3 = mm(8192, 8192, 8192, fp8, TRN2), mm(8192, 8192, 8192, fp8, TRN3)
    assert trn3.duration_s < trn2.duration_s
    assert trn2.duration_s / trn3.duration_s == pytest.approx(315 / 158, rel=0.1)


def test_trn1_models_fp8_as_cfp8_at_the_bf16_rate_and_warns_once(monkeypatch):
    from torchneuron.hardware import model

    monkeypatch.setattr(model, "_fp8_warned", set())
    model.clear_cache()
    with pytest.warns(UserWarning, match="cFP8"):
        e5m2 = mm(4096, 4096, 4096, torch.float8_e5m2, TRN1)
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        e4m3 = mm(4096, 4096, 4096, torch.float8_e4m3fn, TRN1)
    assert not later  # once per target
    bf16 = mm(4096, 4096, 4096, torch.bfloat16, TRN1)
    assert not e5m2.fallback and e5m2.engine == "tensor"
    assert e5m2.duration_s == pytest.approx(e4m3.duration_s, rel=0.05)
    assert e4m3.duration_s == pytest.approx(bf16.duration_s, rel=0.1)


def test_float64_elementwise_arithmetic_is_emulated_on_the_gpsimd_engine():
    sig = (torch.float64, (1 << 16,))
    cost = op_cost("aten::mul.Tensor", [sig, sig], [sig], TRN2)
    native = op_cost("aten::mul.Tensor", [(torch.float32, (1 << 16,))] * 2, [(torch.float32, (1 << 16,))], TRN2)
    assert not cost.fallback and cost.engine == "gpsimd"
    assert cost.bound == "compute" and 4 * native.duration_s < cost.duration_s  # tens of integer ops an element
    # a scale (one element) is one C routine on GpSimd: its ~40 integer ops, one instruction issue
    one = (torch.float64, ())
    scale = op_cost("aten::mul.Tensor", [one, one], [one], TRN2)
    routine_s = (40 + TRN2.instruction_fixed_cycles) / TRN2.clock_hz("gpsimd")
    assert scale.duration_s == pytest.approx(routine_s + 2 * TRN2.dma_fixed_latency_s)
    complex_sig = (torch.complex64, (1 << 16,))
    assert op_cost("aten::mul.Tensor", [complex_sig] * 2, [complex_sig], TRN2).fallback


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_float64_and_complex_are_host_fallbacks_not_errors(dtype):
    sig = (dtype, (1 << 20,))
    cost = op_cost("aten::atan2", [sig, sig], [sig], TRN2)
    nbytes = 3 * (1 << 20) * dtype.itemsize
    assert cost.fallback and cost.engine == "host" and cost.flops == 0
    assert cost.bytes == nbytes
    # each direction: a PCIe round trip + a DMA latency, and the bytes at the link rate
    fixed = 2 * (TRN2.host_link_latency_s + TRN2.dma_fixed_latency_s)
    assert cost.duration_s == pytest.approx(fixed + nbytes / TRN2.host_link_bytes_per_s)
    with_host = op_cost("aten::atan2", [sig, sig], [sig], TRN2, host_seconds=0.5)
    assert with_host.duration_s == pytest.approx(cost.duration_s + 0.5)
    assert with_host.bound == "compute"


def test_explicit_fallback_flag():
    sig = (FP32, (1024, 1024))
    device = op_cost("aten::erfinv", [sig], [sig], TRN2)
    host = op_cost("aten::erfinv", [sig], [sig], TRN2, fallback=True, host_seconds=1e-3)
    assert not device.fallback and host.fallback
    assert host.duration_s > 1e-3


@pytest.mark.parametrize(("op", "engine"), [
    ("aten::add.Tensor", "vector"),
    ("aten::exp", "scalar"),
    ("aten::gelu", "scalar"),
    ("aten::_softmax", "vector"),
    ("aten::native_layer_norm", "vector"),
    ("aten::sum.dim_IntList", "vector"),
    ("aten::copy_", "dma"),
    ("aten::cat", "dma"),
    ("aten::mm", "tensor"),
    ("aten::addmm", "tensor"),
])
def test_ops_run_on_their_engine(op, engine):
    sig = (BF16, (256, 256))
    inputs = [(BF16, (256,)), sig, sig] if op == "aten::addmm" else [sig, sig]
    assert op_cost(op, inputs, [sig], TRN2).engine == engine


def test_gathers_pay_for_gathered_rows_not_the_table():
    indices, out = (torch.int64, (8, 512)), (BF16, (8, 512, 1024))
    small = op_cost("aten::embedding", [(BF16, (1000, 1024)), indices], [out], TRN2)
    large = op_cost("aten::embedding", [(BF16, (1_000_000, 1024)), indices], [out], TRN2)
    assert small.engine == large.engine == "gpsimd"
    assert small.duration_s == large.duration_s
    # one index per element (gather along the last dim) is descriptor-bound: much slower
    elementwise = op_cost("aten::gather", [(BF16, (4096, 1024)), (torch.int64, (4096, 1024))],
                          [(BF16, (4096, 1024))], TRN2)
    rows = op_cost("aten::index_select", [(BF16, (100_000, 1024)), (torch.int64, (4096,))],
                   [(BF16, (4096, 1024))], TRN2)
    assert elementwise.duration_s > 10 * rows.duration_s


def test_convolution_and_attention_flops():
    x, w, y = (BF16, (8, 64, 32, 32)), (BF16, (128, 64, 3, 3)), (BF16, (8, 128, 32, 32))
    conv = op_cost("aten::convolution_overrideable", [x, w], [y], TRN2)
    assert conv.engine == "tensor"
    assert conv.flops == 2 * 8 * 128 * 32 * 32 * 64 * 3 * 3
    q = (BF16, (2, 8, 1024, 64))
    sdpa = op_cost("aten::_scaled_dot_product_flash_attention_for_cpu", [q, q, q], [q], TRN2)
    assert sdpa.engine == "tensor"
    assert sdpa.flops == pytest.approx(4 * 2 * 8 * 1024 * 1024 * 64 + 5 * 2 * 8 * 1024 * 1024)
    backward = op_cost("aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                       [q, q, q, q, q], [q, q, q], TRN2)
    assert backward.duration_s > 1.5 * sdpa.duration_s


def test_unknown_ops_are_priced_like_elementwise_and_views_are_free():
    sig = (FP32, (1024, 1024))
    assert op_category("aten::definitely_not_an_op") == "elementwise"
    unknown = op_cost("aten::definitely_not_an_op.out", [sig, sig], [sig], TRN2)
    assert unknown.duration_s == op_cost("aten::mul.Tensor", [sig, sig], [sig], TRN2).duration_s
    assert op_cost("weird", [], [], TRN2).duration_s >= 0
    assert op_cost("aten::view", [sig], [sig], TRN2).duration_s == 0.0


def test_tiny_ops_are_latency_bound():
    cost = add(16, FP32)
    assert cost.bound == "latency"
    assert cost.duration_s == pytest.approx(2 * TRN2.dma_fixed_latency_s, rel=0.05)


def test_int64_is_emulated_on_trn1_only():
    # sorting is GpSimd-bound: two int32 operations per int64 element double it on trn1
    def sort(dtype, target):
        sig = (dtype, (1024, 4096))
        return op_cost("aten::sort", [sig], [sig, (torch.int64, sig[1])], target).duration_s

    assert sort(torch.int64, TRN1) / sort(torch.int32, TRN1) == pytest.approx(2.0, rel=0.05)
    assert sort(torch.int64, TRN2) / sort(torch.int32, TRN2) == pytest.approx(1.0, rel=0.05)
    sig = (torch.int64, (1024,))
    assert not op_cost("aten::add.Tensor", [sig, sig], [sig], TRN1).fallback


def test_costs_are_cached_by_signature():
    sig = (BF16, (64, 64))
    first = op_cost("aten::add.Tensor", [sig, sig], [sig], TRN2)
    assert op_cost("aten::add.Tensor", (sig, sig), (sig,), TRN2) is first
    assert op_cost("aten::add.Tensor", [sig, sig], [sig], TRN3) is not first
    assert isinstance(first, Cost)


def test_launch_cost():
    assert launch_cost(TRN2) == pytest.approx(2 * TRN2.host_link_latency_s + TRN2.dma_fixed_latency_s)
    set_target("trn1")  # the default target is the current one
    assert launch_cost() == TRN1.kernel_launch_s


def test_copies():
    nbytes = 1 << 30
    h2d = copy_cost(nbytes, "h2d", TRN2)
    assert h2d.duration_s == pytest.approx(
        TRN2.host_link_latency_s + TRN2.dma_fixed_latency_s + nbytes / TRN2.host_link_bytes_per_s)
    assert copy_cost(nbytes, "d2h", TRN2).duration_s == h2d.duration_s
    d2d = copy_cost(nbytes, "d2d", TRN2)
    assert d2d.duration_s == pytest.approx(2 * nbytes / TRN2.hbm_bytes_per_s + TRN2.dma_fixed_latency_s, rel=0.01)
    assert d2d.duration_s < h2d.duration_s
    assert copy_cost(4, "h2d", TRN2).bound == "latency"
    with pytest.raises(ValueError, match="h2d, d2h, d2d"):
        copy_cost(4, "sideways", TRN2)


@pytest.mark.parametrize("ranks", [2, 8, 16, 64])
def test_all_reduce_matches_the_ring_formula(ranks):
    nbytes = 256 << 20
    bandwidth = (min(TRN2.dma_bytes_per_s, TRN2.hbm_bytes_per_s / 2) if ranks <= TRN2.cores_per_chip
                 else TRN2.neuronlink_chip_bytes_per_s / TRN2.cores_per_chip)
    expected = 2 * (ranks - 1) * TRN2.link_step_latency_s + 2 * (ranks - 1) / ranks * nbytes / bandwidth
    cost = collective_cost("all_reduce", nbytes, ranks, TRN2)
    assert cost.engine == "link"
    assert cost.duration_s == pytest.approx(expected)


def test_other_collectives():
    n, nbytes = 64, 64 << 20
    gather = collective_cost("all_gather", nbytes, n, TRN2)
    reduce = collective_cost("all_reduce", nbytes, n, TRN2)
    assert collective_cost("reduce_scatter", nbytes, n, TRN2).duration_s == gather.duration_s
    assert reduce.duration_s == pytest.approx(2 * gather.duration_s)
    assert collective_cost("all_gather_into_tensor", nbytes, n, TRN2) == gather
    assert collective_cost("barrier", 0, n, TRN2).duration_s == 2 * (n - 1) * TRN2.link_step_latency_s
    assert collective_cost("send", nbytes, 2, TRN2).duration_s < reduce.duration_s
    assert collective_cost("all_reduce", nbytes, 1, TRN2).duration_s == 0.0
    assert math.isclose(collective_cost("broadcast", nbytes, n, TRN3).duration_s,
                        (n - 1) * TRN3.link_step_latency_s + nbytes / TRN3.neuronlink_bytes_per_s)
    with pytest.raises(ValueError, match="all_reduce"):
        collective_cost("allsmash", 1, 2, TRN2)
