"""FlexAttention with score_mod and block masks (causal, sliding window, document masking)
compiled for neuron, forward and backward, against the eager reference on neuron."""
import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

B, H, S, D = 1, 2, 128, 16
WINDOW = 32
DOCUMENTS = torch.tensor([0] * 40 + [1] * 50 + [2] * 38)


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= WINDOW)


def document(b, h, q, kv):
    docs = DOCUMENTS_ON_DEVICE
    return (docs[q] == docs[kv]) & (q >= kv)


def relative_bias(score, b, h, q, kv):
    return score + (q - kv).to(score.dtype) * 0.05 - h * 0.1


DOCUMENTS_ON_DEVICE = DOCUMENTS.to("neuron")
MASKS = {"causal": causal, "sliding_window": sliding_window, "document": document}


@pytest.mark.parametrize("mask", ["causal", "sliding_window", "document"])
def test_flex_attention_matches_eager_forward_and_backward(mask):
    torch.manual_seed(0)
    block_mask = create_block_mask(MASKS[mask], B, H, S, S, device="neuron")
    q, k, v = (torch.randn(B, H, S, D, device="neuron", requires_grad=True) for _ in range(3))
    score_mod = relative_bias if mask != "causal" else None

    compiled = torch.compile(flex_attention, backend="neuron")
    out = compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
    grads = torch.autograd.grad(out.sum(), (q, k, v))

    want = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if mask != "causal":  # the mask matters: a query attends to nothing beyond it
        dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        assert not torch.allclose(out, dense, atol=1e-3)
