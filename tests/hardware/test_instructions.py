"""Per-instruction costs: engines, fixed costs, matmul tiles, DMA shapes."""
import pytest
import torch

from torchneuron.hardware.instructions import ENGINES, INSTRUCTION_KINDS, instruction_cost, instruction_timing
from torchneuron.hardware.targets import TARGETS, UnsupportedDtypeError

TRN1, TRN2 = TARGETS["trn1"], TARGETS["trn2"]
BF16 = torch.bfloat16


def cost(kind, target=TRN2, dtype=BF16, **shape):
    shape.setdefault("partitions", 128)
    shape.setdefault("free_elems", 512)
    return instruction_cost(kind, dtype=dtype, target=target, **shape)


def test_engine_names():
    assert ENGINES == ("tensor", "vector", "scalar", "gpsimd", "dma", "sync")
    assert cost("nc_matmul")[0] == "tensor"
    assert cost("activation")[0] == "scalar"
    assert cost("tensor_tensor")[0] == "vector"
    assert cost("iota")[0] == "gpsimd"
    assert cost("dma")[0] == "dma"
    assert cost("tensor_copy", engine="gpsimd")[0] == "gpsimd"
    with pytest.raises(ValueError, match="unknown instruction kind"):
        cost("nc_frobnicate")


def test_elementwise_instruction_is_one_element_per_lane_cycle_plus_fixed_cost():
    engine, seconds = cost("activation", free_elems=1000)
    assert seconds == pytest.approx((1000 + TRN2.instruction_fixed_cycles) / 1.2e9)
    # partitions run in parallel: 1 or 128 partitions cost the same
    assert cost("tensor_tensor", partitions=1)[1] == cost("tensor_tensor", partitions=128)[1]


@pytest.mark.parametrize("kind", [k for k in INSTRUCTION_KINDS
                                  if k not in ("nc_matmul", "nc_transpose", "dma", "sync")])
def test_cost_grows_monotonically_with_free_size(kind):
    times = [cost(kind, free_elems=f)[1] for f in (1, 64, 512, 4096, 65536)]
    assert times == sorted(times) and times[-1] > times[0]


def test_matmul_fp32_is_about_four_times_bf16():
    bf16 = cost("nc_matmul", moving_free=512, contraction=128)[1]
    fp32 = cost("nc_matmul", dtype=torch.float32, moving_free=512, contraction=128)[1]
    assert fp32 / bf16 == pytest.approx(3.9, rel=0.05)


def test_matmul_limits_are_the_array_and_the_moving_tile():
    with pytest.raises(ValueError, match="513"):
        cost("nc_matmul", moving_free=513)
    with pytest.raises(ValueError, match="129"):
        cost("nc_matmul", partitions=129)
    with pytest.raises(ValueError, match="contraction"):
        cost("nc_matmul", contraction=129)
    # FP8 double row contracts 256 rows on NeuronCore-v3, not on v2
    cost("nc_matmul", dtype=torch.float8_e4m3fn, contraction=256)
    with pytest.raises(ValueError, match="contraction"):
        cost("nc_matmul", target=TRN1, dtype=torch.float8_e4m3fn, contraction=256)
    with pytest.raises(UnsupportedDtypeError):
        cost("nc_matmul", target=TRN1, dtype=torch.float8_e5m2)


def test_small_moving_tile_is_bound_by_the_stationary_load():
    # a 1-column pass still waits for the 128-column stationary tile to load
    one = cost("nc_matmul", moving_free=1)[1]
    full = cost("nc_matmul", moving_free=128)[1]
    assert one == pytest.approx(full, rel=0.02)
    assert cost("nc_matmul", moving_free=512)[1] > 3 * full


def test_dma_small_contiguous_runs_cost_more_than_one_big_run():
    nbytes = 1 << 20
    big = cost("dma", nbytes=nbytes, contiguous_bytes=nbytes)[1]
    rows = cost("dma", nbytes=nbytes, contiguous_bytes=8192)[1]
    tiny = cost("dma", nbytes=nbytes, contiguous_bytes=64)[1]
    scattered = cost("dma", nbytes=nbytes, contiguous_bytes=2)[1]
    assert big <= rows < tiny < scattered
    assert tiny > 4 * big
    # a big transfer is HBM-bound: its busy time is its bytes over the core's HBM bandwidth
    timing = instruction_timing("dma", partitions=128, free_elems=0, dtype=BF16, target=TRN2,
                                nbytes=nbytes, contiguous_bytes=nbytes)
    assert timing.busy_s == pytest.approx(nbytes / TRN2.hbm_bytes_per_s, rel=0.01)
    assert timing.latency_s == pytest.approx(timing.busy_s + TRN2.dma_fixed_latency_s)


def test_dma_descriptor_count_and_memories_matter():
    many = cost("dma", nbytes=1 << 20, descriptors=16384)[1]
    few = cost("dma", nbytes=1 << 20, descriptors=128)[1]
    assert many > few
    sbuf_to_sbuf = cost("dma", nbytes=1 << 22, contiguous_bytes=4096, src="sbuf", dst="sbuf")[1]
    hbm_to_hbm = cost("dma", nbytes=1 << 22, contiguous_bytes=4096, src="hbm", dst="hbm")[1]
    assert hbm_to_hbm > sbuf_to_sbuf
    with pytest.raises(ValueError, match="unknown memory"):
        cost("dma", nbytes=64, src="l2")
