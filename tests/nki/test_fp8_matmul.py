"""NKI fp8 scaled matmul (torchneuron.kernels.fp8_matmul) against a float64 reference, through
its registered op, with the kernel simulated on data and with its host path; and its errors."""
import pytest
import torch

from torchneuron.kernels import torch_ops as ops

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@pytest.fixture(params=["kernel", "host"], autouse=True)
def path(request, monkeypatch):
    """The op computes with the NKI kernel (NKI_SIMULATOR=1) or with its host path."""
    monkeypatch.setenv("NKI_SIMULATOR", "1" if request.param == "kernel" else "0")
    return request.param


def _operands(dtype, row_wise, m=256, k=384, n=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = (torch.randn(m, k, generator=g) * 4).to(dtype)
    b = torch.randn(k, n, generator=g).to(dtype)
    if row_wise:
        return a, b, torch.rand(m, 1, generator=g) + 0.5, torch.rand(1, n, generator=g) + 0.5
    return a, b, torch.tensor(0.75), torch.tensor(1.25)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("row_wise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", FP8, ids=["e4m3fn", "e5m2"])
def test_fp8_scaled_matmul_matches_float64_reference(dtype, row_wise, out_dtype):
    a, b, sa, sb = _operands(dtype, row_wise)
    out = ops.fp8_scaled_matmul(a, b, sa, sb, out_dtype)
    ref = (a.double() @ b.double()) * sa.double() * sb.double()  # fp8 values are exact in float64
    assert out.dtype == out_dtype and out.shape == ref.shape
    # fp32 accumulation of K = 384 products: relative error a few ulp of fp32 times sqrt(K);
    # bf16 output: one rounding, half an ulp (2^-9) of each element's magnitude.
    err = (out.double() - ref).abs()
    bound = ref.abs() * 2 ** -8 + 1e-3 if out_dtype == torch.bfloat16 else ref.abs().max() * 1e-5
    assert (err <= bound).all(), f"max error {err.max().item()}"


def test_fp8_scaled_matmul_mixed_fp8_operands_and_one_block():
    a, _, sa, sb = _operands(torch.float8_e4m3fn, True, m=128, k=128, n=512)
    b = torch.randn(128, 512).to(torch.float8_e5m2)
    out = ops.fp8_scaled_matmul(a, b, sa, sb, torch.float32)
    ref = (a.double() @ b.double()) * sa.double() * sb.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-3)


def test_fp8_scaled_matmul_names_bad_input():
    a, b, sa, sb = _operands(torch.float8_e4m3fn, False, m=128, k=128, n=512)
    with pytest.raises(Exception, match=r"fp8 scaled_matmul: a must be float8_e4m3fn or float8_e5m2"):
        ops.fp8_scaled_matmul(a.bfloat16(), b, sa, sb)
    with pytest.raises(Exception, match=r"fp8 scaled_matmul: the contraction sizes differ"):
        ops.fp8_scaled_matmul(a, torch.cat([b, b]), sa, sb)
    with pytest.raises(Exception, match=r"fp8 scaled_matmul: scales must be tensor-wise .* or row-wise"):
        ops.fp8_scaled_matmul(a, b, torch.ones(128, 1), torch.ones(1, 256))
    with pytest.raises(Exception, match=r"fp8 scaled_matmul: need M and K multiples of 128, N of 512"):
        ops.fp8_scaled_matmul(a, b[:, :256], sa, sb)
    with pytest.raises(ValueError, match=r"fp8 scaled_matmul: out_dtype must be bfloat16 or float32"):
        ops.fp8_scaled_matmul(a, b, sa, sb, torch.float16)


def test_fp8_scaled_matmul_on_neuron_tensors_matches_cpu():
    a, b, sa, sb = _operands(torch.float8_e5m2, True, m=128, k=256, n=512, seed=2)
    out = ops.fp8_scaled_matmul(a.to("neuron"), b.to("neuron"), sa.to("neuron"), sb.to("neuron"))
    assert out.device.type == "neuron"
    assert torch.equal(out.cpu(), ops.fp8_scaled_matmul(a, b, sa, sb))
