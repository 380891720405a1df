"""scaled_dot_product_attention on neuron follows PyTorch's contract for an out-of-tree backend.

`_fused_sdp_choice` returns SDPBackend.OVERRIDEABLE, and the device implements
`_scaled_dot_product_fused_attention_overrideable` and its backward (runtime/csrc/attention.cpp):
masks (boolean and additive, broadcast), causal, scale, dropout, grouped-query attention, 3-D
inputs; values and gradients match the CPU's SDPA.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEV = "neuron"
aten = torch.ops.aten


def _qkv(b=2, hq=4, hk=4, lq=6, lk=7, e=8, ev=8, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    shape = (lambda h, l, d: (h, l, d)) if b is None else (lambda h, l, d: (b, h, l, d))
    return (torch.randn(shape(hq, lq, e), dtype=dtype), torch.randn(shape(hk, lk, e), dtype=dtype),
            torch.randn(shape(hk, lk, ev), dtype=dtype))


def _compare(q, k, v, atol=1e-5, rtol=1e-4, mask=None, **kwargs):
    """SDPA forward and backward (q, k, v and a floating mask's gradients) on CPU and neuron."""
    cpu = [t.clone().requires_grad_(t.is_floating_point()) for t in (q, k, v)]
    dev = [t.to(DEV).requires_grad_(t.is_floating_point()) for t in (q, k, v)]
    cpu_mask = dev_mask = None
    if mask is not None:
        cpu_mask = mask.clone().requires_grad_(mask.is_floating_point())
        dev_mask = mask.to(DEV).requires_grad_(mask.is_floating_point())
    out_cpu = F.scaled_dot_product_attention(*cpu, attn_mask=cpu_mask, **kwargs)
    out_dev = F.scaled_dot_product_attention(*dev, attn_mask=dev_mask, **kwargs)
    torch.testing.assert_close(out_dev.cpu(), out_cpu, atol=atol, rtol=rtol)
    grad = torch.randn(out_cpu.shape, dtype=out_cpu.dtype)
    out_cpu.backward(grad)
    out_dev.backward(grad.to(DEV))
    for a, b in zip(cpu + [cpu_mask], dev + [dev_mask]):
        if a is not None and a.grad is not None:
            torch.testing.assert_close(b.grad.cpu(), a.grad, atol=atol, rtol=rtol)


def test_choice_is_overrideable():
    q, k, v = (t.to(DEV) for t in _qkv())
    assert torch._fused_sdp_choice(q, k, v) == SDPBackend.OVERRIDEABLE.value
    # with dropout, math draws the CPU's mask for the same seed (the OpInfo gate compares with CPU)
    assert torch._fused_sdp_choice(q, k, v, dropout_p=0.1, is_causal=True) == SDPBackend.MATH.value
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # math disabled: the fused kernel runs the dropout
        assert torch._fused_sdp_choice(q, k, v, dropout_p=0.1) == SDPBackend.OVERRIDEABLE.value
    with sdpa_kernel(SDPBackend.MATH):  # the user's choice of backend is respected
        assert torch._fused_sdp_choice(q, k, v) == SDPBackend.MATH.value
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # CUDA code asking for flash gets the device's fused kernel
        assert torch._fused_sdp_choice(q, k, v) == SDPBackend.OVERRIDEABLE.value


def test_the_overrideable_op_runs():
    q, k, v = (t.to(DEV).requires_grad_() for t in _qkv())
    out = F.scaled_dot_product_attention(q, k, v)
    assert out.grad_fn.name() == "ScaledDotProductFusedAttentionOverrideableBackward0"
    result = aten._scaled_dot_product_fused_attention_overrideable(q, k, v)
    assert result[1].shape == (2, 4, 6) and result[1].dtype == torch.float32  # logsumexp, as the meta function
    assert result[4] == 6 and result[5] == 7


@pytest.mark.parametrize("case", [
    dict(),
    dict(is_causal=True),
    dict(scale=0.3),
    dict(lk=6, is_causal=True, scale=0.5),
    dict(ev=5),  # value head size differs from the query's
    dict(b=None),  # 3-D (heads, length, head size)
], ids=str)
def test_matches_cpu(case):
    kwargs = {k: case[k] for k in ("is_causal", "scale") if k in case}
    shapes = {k: case[k] for k in ("b", "lk", "ev") if k in case}
    _compare(*_qkv(**shapes), **kwargs)


@pytest.mark.parametrize("mask_shape", [(6, 7), (2, 1, 6, 7), (1, 4, 1, 7)], ids=str)
def test_masks(mask_shape):
    q, k, v = _qkv()
    torch.manual_seed(3)
    boolean = torch.rand(mask_shape) > 0.3
    _compare(q, k, v, mask=boolean)
    additive = torch.randn(mask_shape)
    _compare(q, k, v, mask=additive)  # an additive mask that needs a gradient gets one


def test_fully_masked_rows_are_zero_as_on_cpu():
    q, k, v = _qkv()
    mask = torch.ones(6, 7, dtype=torch.bool)
    mask[2] = False
    _compare(q, k, v, mask=mask)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype):
    _compare(*_qkv(dtype=dtype), atol=2e-2, rtol=2e-2, is_causal=True)


def test_grouped_query_attention():
    q, k, v = _qkv(hq=6, hk=2)
    _compare(q, k, v, enable_gqa=True)
    _compare(q, k, v, enable_gqa=True, is_causal=True)


def test_dropout():
    """Dropout's mask comes from the device generator: seeded runs repeat, and the backward uses the
    forward's mask (checked against attention computed by hand with the mask the op reports)."""
    q, k, v = (t.to(DEV) for t in _qkv(lq=16, lk=16))
    torch.manual_seed(5)
    first = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.manual_seed(5)
    again = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)
    torch.testing.assert_close(again, first)
    assert not torch.allclose(first, F.scaled_dot_product_attention(q, k, v))
    cpu = [t.cpu() for t in (q, k, v)]
    torch.manual_seed(5)  # the same seed draws the CPU's mask
    torch.testing.assert_close(first.cpu(), F.scaled_dot_product_attention(*cpu, dropout_p=0.5))

    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    result = aten._scaled_dot_product_fused_attention_overrideable(*leaves, dropout_p=0.5, return_debug_mask=True)
    out, keep = result[0], result[8].cpu()
    kept = keep.float().mean().item()
    assert 0.35 < kept < 0.65  # about half the probabilities survive
    ref = [t.detach().cpu().requires_grad_() for t in leaves]
    probs = torch.softmax(ref[0] @ ref[1].transpose(-2, -1) / 8 ** 0.5, -1)
    expected = (probs * keep / 0.5) @ ref[2]
    torch.testing.assert_close(out.cpu(), expected, atol=1e-5, rtol=1e-4)
    grad = torch.randn(expected.shape)
    expected.backward(grad)
    out.backward(grad.to(DEV))
    for a, b in zip(ref, leaves):
        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=1e-5, rtol=1e-4)


def test_math_only_still_matches():
    with sdpa_kernel(SDPBackend.MATH):
        _compare(*_qkv(), is_causal=True)


@pytest.mark.parametrize("batched", [True, False], ids=["4-D", "3-D"])
def test_half_precision_takes_the_cpus_kernel(batched):
    """Neuron runs the flash kernel exactly where the CPU does (4-D inputs) and the CPU's float32 math
    elsewhere (3-D): bf16 gradients of the two kernels differ by more than bf16's tolerance on some
    data (the OpInfo gate's causal 3-D sample found it), so values and gradients match CPU closely."""
    for seed in range(8):
        q, k, v = _qkv(b=4 if batched else None, hq=3, hk=3, lq=3, lk=6, dtype=torch.bfloat16, seed=seed)
        _compare(q, k, v, atol=1e-2, rtol=1e-2, is_causal=True)


def test_mask_with_strided_last_dim_takes_the_cpus_kernel():
    """A float mask laid out heads-innermost (T5's relative position bias, permuted from
    [L, S, H]) has last stride H. PyTorch's CPU choice takes flash for it on the CPU but not on
    other devices; neuron asks the choice with CPU aliases, so it runs the same kernel and gives
    the CPU's values bit for bit, forward and backward."""
    q, k, v = _qkv(lq=16, lk=16)
    bias = torch.randn(2, 16, 16, 4).permute(0, 3, 1, 2)  # [B, H, L, S], stride(-1) == 4
    assert bias.stride(-1) == 4
    dev_bias = torch.empty_strided(bias.shape, bias.stride(), device=DEV).copy_(bias)
    assert dev_bias.stride() == bias.stride()
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    dev = [t.to(DEV).requires_grad_() for t in (q, k, v)]
    out_cpu = F.scaled_dot_product_attention(*cpu, attn_mask=bias, scale=1.0)
    out_dev = F.scaled_dot_product_attention(*dev, attn_mask=dev_bias, scale=1.0)
    torch.testing.assert_close(out_dev.cpu(), out_cpu, atol=0, rtol=0)
    grad = torch.randn(out_cpu.shape)
    out_cpu.backward(grad)
    out_dev.backward(grad.to(DEV))
    for a, b in zip(cpu, dev):
        torch.testing.assert_close(b.grad.cpu(), a.grad, atol=0, rtol=0)
