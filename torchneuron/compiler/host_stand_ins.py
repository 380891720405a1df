"""Host stand-ins for NKI kernels in compiled graphs: one op per kernel, run by host ATen.

A pattern the compiler recognises (patterns.py) is replaced by one of these ops, which the
kernel plan treats as a single NKI kernel (graph_fusion.NKI_KERNELS) priced by the performance
model's fused-attention formula. On this software NeuronCore each op runs PyTorch's host
flash-attention kernel over the device buffers (through the runtime's CPU fallback), which
computes the same function as an NKI flash-attention kernel; `torchneuron.kernels` can
register a real NKI implementation for the `neuron` key instead.

- `torchneuron::flash_attention(q, k, v, attn_mask, is_causal, scale) -> (out, logsumexp)`
- `torchneuron::flash_attention_backward(grad_out, q, k, v, out, logsumexp, attn_mask,
  is_causal, scale) -> (grad_q, grad_k, grad_v)`, its derivative.

Once the kernel plan holds an op as its NKI kernel, `lower_to_host(gm)` rewrites it into the
host ATen op it runs as (`HOST_KERNELS`), so the generated code calls that kernel directly
instead of going through the custom op's Python autograd and dispatch layers on every call.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor
from torch.fx import GraphModule

aten = torch.ops.aten


# The host kernels' arguments from the ops' arguments (shared by the ops and lower_to_host).
def _host_forward(query, key, value, attn_mask, is_causal, scale) -> tuple[tuple, dict[str, Any]]:
    return (query, key, value, 0.0, is_causal), {"attn_mask": attn_mask, "scale": scale}


def _host_backward(grad_out, query, key, value, out, logsumexp, attn_mask, is_causal,
                   scale) -> tuple[tuple, dict[str, Any]]:
    return (grad_out, query, key, value, out, logsumexp, 0.0, is_causal), {"attn_mask": attn_mask, "scale": scale}


def _flash_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, is_causal: bool,
                     scale: float | None) -> tuple[Tensor, Tensor]:
    """Fused attention softmax(q k^T * scale + mask) v without materialising the scores."""
    args, kwargs = _host_forward(query, key, value, attn_mask, is_causal, scale)
    return aten._scaled_dot_product_flash_attention_for_cpu(*args, **kwargs)


def _flash_attention_backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor,
                              logsumexp: Tensor, attn_mask: Tensor | None, is_causal: bool,
                              scale: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of flash_attention with respect to q, k and v."""
    args, kwargs = _host_backward(grad_out, query, key, value, out, logsumexp, attn_mask, is_causal, scale)
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(*args, **kwargs)


# Each op's fake is its implementation run on fake tensors (the host kernel's meta function): the
# results have the kernel's layout (heads innermost but one), so the graph around a kernel needs
# no copies to make them contiguous.
flash_attention = torch.library.custom_op("torchneuron::flash_attention", _flash_attention, mutates_args=())
flash_attention.register_fake(_flash_attention)
flash_attention_backward = torch.library.custom_op("torchneuron::flash_attention_backward",
                                                   _flash_attention_backward, mutates_args=())
flash_attention_backward.register_fake(_flash_attention_backward)


def _setup_context(ctx, inputs, output) -> None:
    query, key, value, attn_mask, is_causal, scale = inputs
    out, logsumexp = output
    ctx.save_for_backward(query, key, value, out, logsumexp, attn_mask)
    ctx.is_causal, ctx.scale = is_causal, scale


def _backward(ctx, grad_out: Tensor, grad_logsumexp: Tensor):
    query, key, value, out, logsumexp, attn_mask = ctx.saved_tensors
    grad_q, grad_k, grad_v = flash_attention_backward(grad_out, query, key, value, out, logsumexp,
                                                      attn_mask, ctx.is_causal, ctx.scale)
    return grad_q, grad_k, grad_v, None, None, None


flash_attention.register_autograd(_backward, setup_context=_setup_context)


# op -> (the host ATen op computing the same results, its arguments from the op's arguments)
HOST_KERNELS: dict[Any, tuple[Any, Callable[..., tuple[tuple, dict[str, Any]]]]] = {
    torch.ops.torchneuron.flash_attention.default:
        (aten._scaled_dot_product_flash_attention_for_cpu.default, _host_forward),
    torch.ops.torchneuron.flash_attention_backward.default:
        (aten._scaled_dot_product_flash_attention_for_cpu_backward.default, _host_backward),
}


def _fake(value: Any) -> Any:
    return value.meta["val"] if isinstance(value, torch.fx.Node) else value


def lower_to_host(gm: GraphModule) -> int:
    """Rewrites the NKI-standing ops of a post-autograd graph into their host ATen ops (their
    outputs keep the same positions); returns how many it rewrote."""
    from torch._guards import detect_fake_mode

    rewritten = 0
    for node in list(gm.graph.nodes):
        lowering = HOST_KERNELS.get(node.target) if node.op == "call_function" else None
        if lowering is None:
            continue
        host_op, arguments = lowering
        args, kwargs = arguments(*node.args, **node.kwargs)
        fake_args = [_fake(a) for a in args]
        fake_kwargs = {k: _fake(v) for k, v in kwargs.items()}
        with detect_fake_mode(fake_args) or torch._subclasses.FakeTensorMode():
            node.meta["val"] = host_op(*fake_args, **fake_kwargs)
        node.target, node.args, node.kwargs = host_op, args, kwargs
        rewritten += 1
    if rewritten:
        gm.recompile()
    return rewritten
