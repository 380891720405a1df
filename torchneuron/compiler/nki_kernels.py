"""Ops that stand for NKI kernels inside compiled graphs.

A pattern the compiler recognises (patterns.py) is replaced by one of these ops, which the
kernel plan treats as a single NKI kernel (fusion.NKI_KERNELS) priced by the performance
model's fused-attention formula. On this software NeuronCore each op runs PyTorch's host
flash-attention kernel over the device buffers (through the runtime's CPU fallback), which
computes the same function as an NKI flash-attention kernel; `torchneuron.kernels` can
register a real NKI implementation for the `neuron` key instead.

- `torchneuron::flash_attention(q, k, v, attn_mask, is_causal, scale) -> (out, logsumexp)`
- `torchneuron::flash_attention_backward(grad_out, q, k, v, out, logsumexp, attn_mask,
  is_causal, scale) -> (grad_q, grad_k, grad_v)`, its derivative.
"""
from __future__ import annotations

import torch
from torch import Tensor

aten = torch.ops.aten


@torch.library.custom_op("torchneuron::flash_attention", mutates_args=())
def flash_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, is_causal: bool,
                    scale: float | None) -> tuple[Tensor, Tensor]:
    """Fused attention softmax(q k^T * scale + mask) v without materialising the scores."""
    out, logsumexp = aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    return out.contiguous(), logsumexp.contiguous()


@flash_attention.register_fake
def _(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, is_causal: bool,
      scale: float | None) -> tuple[Tensor, Tensor]:
    batch, heads, length = query.shape[:3]
    return (query.new_empty((batch, heads, length, value.shape[-1])),
            query.new_empty((batch, heads, length), dtype=torch.float32))


@torch.library.custom_op("torchneuron::flash_attention_backward", mutates_args=())
def flash_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                             logsumexp: Tensor, attn_mask: Tensor | None, is_causal: bool,
                             scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of flash_attention with respect to q, k and v."""
    grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key, value, out, logsumexp, 0.0, is_causal, attn_mask=attn_mask, scale=scale)
    return tuple(g.contiguous() for g in grads)  # type: ignore[return-value]


@flash_attention_backward.register_fake
def _(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor,
      attn_mask: Tensor | None, is_causal: bool, scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    return (query.new_empty(query.shape), key.new_empty(key.shape), value.new_empty(value.shape))


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, attn_mask, is_causal, scale = inputs
    out, logsumexp = output
    ctx.save_for_backward(query, key, value, out, logsumexp, attn_mask)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad_out: Tensor, grad_logsumexp: Tensor):
    query, key, value, out, logsumexp, attn_mask = ctx.saved_tensors
    grad_q, grad_k, grad_v = flash_attention_backward(grad_out.contiguous(), query, key, value, out, logsumexp,
                                                      attn_mask, ctx.is_causal, ctx.scale)
    return grad_q, grad_k, grad_v, None, None, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)
