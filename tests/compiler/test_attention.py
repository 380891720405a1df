"""Attention under torch.compile(backend="neuron"): scaled_dot_product_attention becomes the NKI
flash-attention kernel in the plan and runs as the host flash-attention kernel, with causal,
boolean and additive masks, forward and backward, matching eager."""
import pytest
import torch
import torch.nn.functional as F

from torchneuron.compiler import host_stand_ins


def attention(q, k, v, mask, causal):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal).sin()


def masks(length):
    keep = torch.ones(length, length, dtype=torch.bool).tril()
    return {"causal": (None, True), "bool": (keep, False),
            "additive": (torch.zeros(length, length).masked_fill(~keep, float("-inf")), False)}


@pytest.mark.parametrize("kind", ["causal", "bool", "additive"])
def test_compiled_attention_matches_eager_forward_and_backward(fresh_dynamo, kind, monkeypatch):
    lowered = []
    original = host_stand_ins.lower_to_host
    monkeypatch.setattr(host_stand_ins, "lower_to_host", lambda gm: lowered.append(original(gm)) or lowered[-1])
    mask, causal = masks(16)[kind]
    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, 4, 16, 8, generator=g) for _ in range(3)]
    eager = [t.to("neuron").requires_grad_() for t in base]
    compiled = [t.to("neuron").requires_grad_() for t in base]
    device_mask = None if mask is None else mask.to("neuron")

    expected = attention(*eager, device_mask, causal)
    expected.sum().backward()
    result = torch.compile(attention, backend="neuron")(*compiled, device_mask, causal)
    result.sum().backward()

    assert sum(lowered) == 2, "forward and backward each run the substituted kernel on the host"
    torch.testing.assert_close(result.cpu(), expected.cpu(), atol=1e-5, rtol=1e-5)
    for mine, reference in zip(compiled, eager):
        torch.testing.assert_close(mine.grad.cpu(), reference.grad.cpu(), atol=1e-5, rtol=1e-5)
    reference = attention(*base, mask, causal)  # and the CPU
    torch.testing.assert_close(result.cpu(), reference, atol=1e-5, rtol=1e-5)


def test_flash_attention_op_results_have_the_kernels_layout():
    q = torch.randn(2, 4, 16, 8, device="neuron")
    out, logsumexp = torch.ops.torchneuron.flash_attention(q, q, q, None, True, None)
    with torch._subclasses.FakeTensorMode() as mode:
        fake = mode.from_tensor(q)
        fake_out, fake_lse = torch.ops.torchneuron.flash_attention(fake, fake, fake, None, True, None)
    assert (out.shape, out.stride()) == (fake_out.shape, fake_out.stride())
    assert (logsumexp.shape, logsumexp.stride()) == (fake_lse.shape, fake_lse.stride())


@pytest.mark.parametrize("dropout", [0.0, 0.3], ids=["flash", "recomputed"])
def test_grouped_query_attention_gradients_of_transposed_heads(fresh_dynamo, dropout):
    """Grouped-query attention (transformers' Llama calls SDPA with enable_gqa on key/value heads
    transposed out of a projection) runs as aten's fused-attention op in compiled graphs, which
    index its gradients in their inputs' layout (the meta function's empty_like): the device's
    backward must return them so, not contiguous after summing the key/value groups."""
    def attention(x, wq, wk, wv):
        q = (x @ wq).view(2, 6, 4, 8).transpose(1, 2)
        k = (x @ wk).view(2, 6, 2, 8).transpose(1, 2)
        v = (x @ wv).view(2, 6, 2, 8).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, dropout_p=dropout)
        return out.transpose(1, 2).reshape(2, 6, 32)

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, 6, 32, generator=g), *(torch.randn(32, n, generator=g) for n in (32, 16, 16))]
    weight = torch.randn(2, 6, 32, generator=g).to("neuron")
    runs = []
    for fn in (attention, torch.compile(attention, backend="neuron")):
        inputs = [t.to("neuron").requires_grad_() for t in base]
        torch.manual_seed(0)  # the same dropout mask in both runs
        (fn(*inputs) * weight).sum().backward()
        runs.append([t.grad.cpu() for t in inputs])
    for compiled, eager in zip(*runs):
        torch.testing.assert_close(compiled, eager, atol=1e-5, rtol=1e-5)


def test_values_of_another_head_size_are_not_substituted(fresh_dynamo):
    """Multi-head latent attention (DeepSeek-V3) gives values another head size than queries and
    keys: the flash kernel has one head size, so the call stays scaled_dot_product_attention and
    matches the CPU forward and backward (it used to fail to compile: "Q/K/V should have the same
    head size")."""
    from torchneuron.compiler import patterns

    g = torch.Generator().manual_seed(0)
    base = [torch.randn(2, 4, 6, d, generator=g) for d in (32, 32, 24)]
    cpu = [t.clone().requires_grad_() for t in base]
    dev = [t.to("neuron").requires_grad_() for t in base]
    matched = []
    original = patterns._is_flash_attention
    try:
        patterns.SUBSTITUTIONS[0] = patterns.Substitution(
            "flash_attention", lambda n: matched.append(original(n)) or matched[-1], patterns._rewrite_flash_attention)
        result = torch.compile(attention, backend="neuron")(*dev, None, True)
    finally:
        patterns.SUBSTITUTIONS[0] = patterns.Substitution("flash_attention", original, patterns._rewrite_flash_attention)
    expected = attention(*cpu, None, True)
    result.sum().backward()
    expected.sum().backward()
    assert matched and not any(matched)
    torch.testing.assert_close(result.cpu(), expected, atol=1e-5, rtol=1e-5)
    for mine, reference in zip(dev, cpu):
        torch.testing.assert_close(mine.grad.cpu(), reference.grad, atol=1e-5, rtol=1e-5)
