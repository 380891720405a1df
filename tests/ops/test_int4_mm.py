"""tinygemm's int4 weight-only ops on neuron (`_convert_weight_to_int4pack`, `_weight_int4pack_mm`;
CUDA-only in PyTorch): the CPU int4 kernel's results, a packed layout whose N and K slices are
packed weights again, PyTorch's shape rules."""
import pytest
import torch

N, K, GROUP = 16, 256, 32


def on(x):
    return x.to("neuron")


def _weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (N, K), generator=g, dtype=torch.int32)
    scale_and_zeros = torch.stack([torch.rand(K // GROUP, N, generator=g) / 8 + 0.01,
                                   torch.randn(K // GROUP, N, generator=g) / 4], dim=-1).bfloat16()
    x = torch.randn(5, K, generator=g).bfloat16()
    return values, scale_and_zeros, x


def _nibbles(values):
    return (values[:, ::2] << 4 | values[:, 1::2]).to(torch.uint8)


def _cpu(x, values, scale_and_zeros, group=GROUP):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 8)
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, group, scale_and_zeros)


@pytest.mark.parametrize("inner_k_tiles", [2, 4, 8])
def test_weight_int4pack_mm_equals_the_cpu_int4_kernel(inner_k_tiles):
    values, sz, x = _weights()
    packed = torch.ops.aten._convert_weight_to_int4pack(on(_nibbles(values)), inner_k_tiles)
    assert packed.device.type == "neuron" and packed.dtype == torch.int32
    assert tuple(packed.shape) == (N // 8, K // (inner_k_tiles * 16), 32, inner_k_tiles // 2)
    out = torch.ops.aten._weight_int4pack_mm(on(x), packed, GROUP, on(sz))
    assert torch.equal(out.cpu(), _cpu(x, values, sz))


def test_packed_slices_along_n_and_k_are_packed_weights():
    values, sz, x = _weights(1)
    packed = torch.ops.aten._convert_weight_to_int4pack(on(_nibbles(values)), 8)  # [2, 2, 32, 4]
    rows = torch.ops.aten._weight_int4pack_mm(on(x), packed[1:].contiguous(), GROUP, on(sz[:, 8:].contiguous()))
    assert torch.equal(rows.cpu(), _cpu(x, values, sz)[:, 8:])  # output columns are independent
    cols = torch.ops.aten._weight_int4pack_mm(on(x[:, :128].contiguous()), packed[:, :1].contiguous(), GROUP,
                                              on(sz[:4].contiguous()))
    assert torch.equal(cols.cpu(), _cpu(x[:, :128].contiguous(), values[:, :128].contiguous(), sz[:4].contiguous()))


def test_bad_int4_inputs_raise_clear_errors():
    values, sz, x = _weights()
    with pytest.raises(RuntimeError, match="expected w to be uint8"):
        torch.ops.aten._convert_weight_to_int4pack(on(values), 8)
    with pytest.raises(RuntimeError, match="k of 128"):
        torch.ops.aten._convert_weight_to_int4pack(on(_nibbles(values[:, :64])), 8)
    packed = torch.ops.aten._convert_weight_to_int4pack(on(_nibbles(values)), 8)
    with pytest.raises(RuntimeError, match="qScaleAndZeros must be"):
        torch.ops.aten._weight_int4pack_mm(on(x), packed, 64, on(sz))
