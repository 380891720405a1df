"""Our NKI kernels (torchneuron.kernels) against torch references, and the matmul
optimisation levels getting faster in modeled latency."""
import pytest
import torch

import torchneuron.nki as nki
import torchneuron.nki.language as nl
import torchneuron.nki.typing as nt
from torchneuron.kernels import attention, elementwise, matmul, norms


def test_tensor_add_single_and_spmd():
    a, b = torch.randn(300, 700), torch.randn(300, 700)
    assert torch.equal(elementwise.tensor_add(a, b), a + b)
    a, b = torch.randn(256, 1024).bfloat16(), torch.randn(256, 1024).bfloat16()
    assert torch.equal(elementwise.tensor_add_grid(a, b), a + b)


@pytest.mark.parametrize("level", list(matmul.LEVELS))
def test_matmul_levels_match_torch(level):
    at, b = torch.randn(1024, 512).bfloat16(), torch.randn(1024, 1024).bfloat16()
    out = matmul.LEVELS[level](at, b)
    ref = at.float().T @ b.float()
    assert out.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-1)
    # fp32 accumulation and one rounding at the end: within one bf16 ulp of the exact result
    assert torch.all((out.float() - ref).abs() <= ref.abs() * 2 ** -8 + 1e-3)


def test_matmul_levels_get_faster():
    lat = {}
    for name, kernel in matmul.LEVELS.items():
        bench = nki.benchmark(kernel)
        bench(nt.tensor[[2048, 2048], nl.bfloat16], nt.tensor[[2048, 2048], nl.bfloat16])
        lat[name] = bench.benchmark_result.nc_latency.get_latency_percentile(50)
    order = list(matmul.LEVELS)
    assert all(lat[a] > lat[b] for a, b in zip(order, order[1:])), lat
    # the best level approaches the Tensor engine's bf16 roofline
    roof_us = 2 * 2048 ** 3 / 79e12 * 1e6
    assert roof_us < lat["fully_blocked"] < 1.5 * roof_us


def test_transpose():
    x = torch.randn(256, 384).bfloat16()
    assert torch.equal(norms.transpose(x), x.T)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_softmax_rmsnorm_layernorm(dtype, tol):
    x = torch.randn(300, 1000).to(dtype)
    w, b = torch.randn(1000).to(dtype), torch.randn(1000).to(dtype)
    xf, wf, bf = x.float(), w.float(), b.float()
    assert torch.allclose(norms.softmax(x).float(), torch.softmax(xf, -1), atol=tol)
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * wf
    assert torch.allclose(norms.rmsnorm(x, w).float(), ref, atol=tol * 10, rtol=tol)
    ref = torch.nn.functional.layer_norm(xf, (1000,), wf, bf)
    assert torch.allclose(norms.layernorm(x, w, b).float(), ref, atol=tol * 10, rtol=tol)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_forward(causal):
    s, d = 512, 64
    q, k, v = torch.randn(s, d), torch.randn(s, d), torch.randn(s, d)
    out = attention.flash_attention_fwd(q.T.contiguous(), k.T.contiguous(), v, d ** -0.5, causal)
    ref = torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal)[0]
    assert torch.allclose(out, ref, atol=1e-5)
