"""Eager semantics on neuron: aliasing, in-place, out=, autograd, random, conv, SDPA, policy."""
import math
import warnings

import pytest
import torch
import torch.nn.functional as F

import torchneuron


def test_views_alias_and_version_counter():
    x = torch.zeros(4, 4, device="neuron")
    row = x[1]
    row.add_(1)
    assert x.sum().item() == 4
    assert row._base is x
    v = x._version
    x.mul_(2)
    assert x._version > v and row._version == x._version
    t = x.t()
    assert t.is_contiguous() is False and t.data_ptr() == x.data_ptr()


def test_out_variant_resizes():
    out = torch.empty(0, device="neuron")
    torch.add(torch.ones(3, device="neuron"), 2, out=out)
    assert out.shape == (3,) and out.device.type == "neuron" and out.tolist() == [3.0, 3.0, 3.0]


def test_indexing_with_cpu_and_neuron_indices():
    x = torch.arange(10.0, device="neuron")
    assert x[torch.tensor([1, 3])].tolist() == [1.0, 3.0]
    assert x[torch.tensor([2, 4], device="neuron")].tolist() == [2.0, 4.0]
    x[torch.tensor([0])] = 5.0
    assert x[0].item() == 5.0
    assert x[x > 7].tolist() == [8.0, 9.0]


def test_autograd_matches_cpu():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(4 * 6 * 6, 5))
    import copy

    md = copy.deepcopy(m).to("neuron")
    x = torch.randn(2, 3, 8, 8)
    m(x).square().mean().backward()
    md(x.to("neuron")).square().mean().backward()
    for p, q in zip(m.parameters(), md.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, atol=1e-5, rtol=1e-4)


def test_random_same_seed_same_numbers():
    torch.manual_seed(7)
    a = [torch.randn(5, device="neuron"), torch.rand(3, device="neuron"), torch.randint(0, 9, (4,), device="neuron")]
    torch.manual_seed(7)
    b = [torch.randn(5), torch.rand(3), torch.randint(0, 9, (4,))]
    for x, y in zip(a, b):
        assert torch.equal(x.cpu(), y)
    torch.neuron.manual_seed(3)
    d1 = F.dropout(torch.ones(100, device="neuron"), 0.5)
    torch.neuron.manual_seed(3)
    d2 = F.dropout(torch.ones(100, device="neuron"), 0.5)
    assert torch.equal(d1.cpu(), d2.cpu()) and 20 < (d1 == 0).sum().item() < 80
    state = torch.neuron.get_rng_state()
    r1 = torch.randn(3, device="neuron")
    torch.neuron.set_rng_state(state)
    assert torch.equal(torch.randn(3, device="neuron").cpu(), r1.cpu())
    g = torch.Generator(device="neuron").manual_seed(11)
    assert torch.equal(torch.randn(4, device="neuron", generator=g).cpu(),
                       torch.randn(4, generator=torch.Generator().manual_seed(11)))


def test_sdpa_and_embedding_match_cpu():
    q, k, v = (torch.randn(2, 4, 8, 16) for _ in range(3))
    out = F.scaled_dot_product_attention(q.neuron(), k.neuron(), v.neuron(), is_causal=True)
    torch.testing.assert_close(out.cpu(), F.scaled_dot_product_attention(q, k, v, is_causal=True))
    import copy

    emb = torch.nn.Embedding(10, 4)
    ids = torch.tensor([[1, 2], [3, 9]])
    torch.testing.assert_close(copy.deepcopy(emb).to("neuron")(ids.neuron()).cpu(), emb(ids))


def test_sdpa_runs_the_fused_attention_kernel_when_cpu_would():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(2, 3, 17, 8, requires_grad=True) for _ in range(3))
    qn, kn, vn = (t.detach().neuron().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
    # PyTorch's backend contract: the device's fused attention op (the flash kernel inside), forward and backward
    assert "FusedAttentionOverrideable" in type(out.grad_fn).__name__
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(expected)
    expected.backward(grad)
    out.backward(grad.neuron())
    torch.testing.assert_close(out.cpu(), expected)
    for mine, theirs in ((qn, q), (kn, k), (vn, v)):
        torch.testing.assert_close(mine.grad.cpu(), theirs.grad)
    # the user's backend switch is respected: math only means the math path
    with sdpa_kernel(SDPBackend.MATH):
        math = F.scaled_dot_product_attention(qn, kn, vn, is_causal=True)
    assert "FusedAttentionOverrideable" not in type(math.grad_fn).__name__
    torch.testing.assert_close(math.cpu(), expected.detach(), atol=1e-5, rtol=1e-5)
    dropped = F.scaled_dot_product_attention(qn, kn, vn, dropout_p=0.5)  # dropout: math, with the CPU's mask
    assert "FusedAttentionOverrideable" not in type(dropped.grad_fn).__name__


def test_dtypes():
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64, torch.bool, torch.uint8):
        x = torch.ones(3, dtype=dtype, device="neuron")
        assert x.dtype == dtype and x.cpu().tolist() == torch.ones(3, dtype=dtype).tolist()


def test_cpu_fallback_is_visible_and_strict_mode_raises():
    torchneuron.reset_fallback_counts()
    a = torch.randn(4, 4, device="neuron")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        q, r = torch.linalg.qr(a)
    torch.testing.assert_close((q @ r).cpu(), a.cpu(), atol=1e-5, rtol=1e-5)
    assert any("linalg_qr" in str(w.message) for w in caught)
    assert torchneuron.fallback_counts().get("aten::linalg_qr", 0) == 1
    d = torch.ones(3, dtype=torch.float64, device="neuron")
    assert (d * 2).exp().sum().item() == pytest.approx(3 * math.exp(2))  # float64 runs, on the host
    assert any(v for k, v in torchneuron.fallback_counts().items() if k.startswith("aten::exp"))
    assert not any(k.startswith("aten::mul") for k in torchneuron.fallback_counts())  # emulated on the device
    torchneuron.set_strict(True)
    try:
        with pytest.raises(NotImplementedError, match="strict mode: aten::linalg_qr"):
            torch.linalg.qr(a)
        assert (a + 1).shape == (4, 4)  # native ops are unaffected
    finally:
        torchneuron.set_strict(False)


def test_autocast_policy_like_cuda():
    lin = torch.nn.Linear(8, 8).to("neuron")
    x = torch.randn(2, 8, device="neuron")
    with torch.autocast("neuron", dtype=torch.bfloat16):
        y = lin(x)
        s = torch.softmax(y, -1)
        lsm = torch.log_softmax(y, -1)
    assert y.dtype == torch.bfloat16
    assert lsm.dtype == torch.float32 and s.dtype == torch.float32  # CUDA's fp32 lists


def test_grad_scaler_on_neuron():
    lin = torch.nn.Linear(4, 1).to("neuron")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("neuron", init_scale=128.0)
    before = lin.weight.detach().cpu().clone()
    with torch.autocast("neuron", dtype=torch.float16):
        loss = lin(torch.randn(3, 4, device="neuron")).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 128.0
    assert not torch.equal(before, lin.weight.detach().cpu())


def test_full_range_seeds():
    torch.manual_seed(2**64 - 1)
    a = torch.randn(3, device="neuron")
    torch.manual_seed(2**64 - 1)
    assert torch.equal(a.cpu(), torch.randn(3))
    torch.neuron.manual_seed(2**63 + 5)
    assert torch.neuron.initial_seed() == 2**63 + 5


def test_checkpoint_recomputation_draws_the_forwards_random_numbers():
    """torch.utils.checkpoint restores the neuron generator before recomputing, as on CUDA:
    the gradient of a checkpointed dropout uses the forward's mask."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    x = torch.ones(1000, device="neuron", requires_grad=True)
    out = checkpoint(lambda h: torch.nn.functional.dropout(h * 1.0, 0.5), x, use_reentrant=False)
    out.sum().backward()
    assert torch.equal(x.grad.cpu(), (out.detach().cpu() != 0).float() * 2)


@pytest.mark.parametrize("call", [
    lambda x, out: torch.mode(x, 1, out=out),
    lambda x, out: torch.median(x, 1, out=out),
    lambda x, out: torch.sort(x, 1, out=out),
], ids=["mode", "median", "sort"])
def test_composite_out_variants_run_as_on_the_cpu(call):
    # Out= overloads served by a composite kernel only (mode.values refused the device: "mode only
    # supports CPU, CUDA and XPU device type") run the CPU's kernel through the fallback, resizing
    # out= tensors by the CPU's rules.
    x = torch.randn(4, 5)
    cpu_out = (torch.empty(0), torch.empty(0, dtype=torch.long))
    dev_out = (torch.empty(0, device="neuron"), torch.empty(0, dtype=torch.long, device="neuron"))
    expected, got = call(x, cpu_out), call(x.to("neuron"), dev_out)
    assert got[0] is dev_out[0] and got[1] is dev_out[1]
    for a, e in zip(dev_out, cpu_out):
        assert a.device.type == "neuron" and a.stride() == e.stride()
        torch.testing.assert_close(a.cpu(), e)
