"""NKI MoE kernels (torchneuron.kernels.moe) against torch: router top-K and the blockwise
grouped matmul, through their registered ops, and their errors on unsupported shapes."""
import pytest
import torch

from torchneuron.kernels import torch_ops as ops


@pytest.fixture(params=["kernel", "host"], autouse=True)
def path(request, monkeypatch):
    """The ops compute with the NKI kernel (NKI_SIMULATOR=1) or with their host path."""
    monkeypatch.setenv("NKI_SIMULATOR", "1" if request.param == "kernel" else "0")
    return request.param


def test_router_topk_matches_torch_softmax_topk():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 256, generator=g).bfloat16()
    w = (torch.randn(256, 16, generator=g) * 0.1).bfloat16()
    weights, experts = ops.router_topk(x, w, 2)
    probs = torch.softmax(x.float() @ w.float(), -1)
    top, idx = torch.topk(probs, 2)
    torch.testing.assert_close(weights, top / top.sum(-1, keepdim=True), atol=1e-3, rtol=1e-3)
    assert torch.equal(experts.long(), idx)


def test_grouped_matmul_multiplies_each_block_by_its_expert():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3 * 512, 256, generator=g).bfloat16()
    w = torch.randn(4, 256, 512, generator=g).bfloat16()
    block_expert = torch.tensor([2, 0, 2])
    out = ops.grouped_matmul(x, w, block_expert)
    ref = torch.cat([x[i * 512:(i + 1) * 512].float() @ w[e].float() for i, e in enumerate(block_expert.tolist())])
    assert (out.float() - ref).abs().max() <= 1e-2 * ref.abs().max()


def test_moe_kernels_name_unsupported_shapes():
    with pytest.raises(Exception, match="1 <= k <= 8"):
        ops.router_topk(torch.randn(128, 128), torch.randn(128, 16), 9)
    with pytest.raises(Exception, match="block_expert"):
        ops.grouped_matmul(torch.randn(100, 128), torch.randn(2, 128, 512), torch.tensor([0]))
