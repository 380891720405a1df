"""NKI-lib kernels registered as torch ops (namespace `nki_kernels`), usable on CPU and
neuron tensors, in eager mode and under torch.compile.

- `rmsnorm(x, weight, eps)`: any leading shape; backward through the `rmsnorm_bwd` kernel.
- `flash_attention(q, k, v, causal, scale)`: [S, d] single-head attention (forward kernel).
"""
from __future__ import annotations

import torch

from ..nki import nki_op, register_autograd
from . import attention, norms

rmsnorm_op = nki_op("nki_kernels::rmsnorm", norms.rmsnorm)
rmsnorm_bwd_op = nki_op("nki_kernels::rmsnorm_bwd", norms.rmsnorm_bwd, num_outputs=2)
flash_attention_fwd_op = nki_op("nki_kernels::flash_attention_fwd", attention.flash_attention_fwd)


def _rmsnorm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps


def _rmsnorm_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    dx, dw = rmsnorm_bwd_op(x, weight, grad.contiguous(), ctx.eps)
    return dx, dw.reshape(weight.shape), None


register_autograd(rmsnorm_op, _rmsnorm_backward, setup_context=_rmsnorm_setup)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dimension with the NKI kernel (rows of any leading shape)."""
    shape = x.shape
    return rmsnorm_op(x.reshape(-1, shape[-1]).contiguous(), weight, eps).reshape(shape)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                    scale: float | None = None) -> torch.Tensor:
    """softmax(q k^T * scale) v for one head, q/k/v [S, d] (S a multiple of 512, or of 128 up
    to 512; d <= 128)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return flash_attention_fwd_op(q.T.contiguous(), k.T.contiguous(), v.contiguous(), scale, causal)
