"""The RMSNorm + projection and SwiGLU MLP kernels as torch ops (namespace `nki_kernels`), with autograd.

- `rmsnorm_linear(x, w_norm, weights, eps)`: transformers' LlamaRMSNorm of x [..., D] followed
  by bias-free projections of it (e.g. q/k/v: `weights` [N_i, D] each), as one fused kernel
  whose weight is the projections' weights stacked (one QKV matmul); returns one output per
  weight, and gradients flow to each weight. Ops: `nki_kernels::rmsnorm_linear_fwd`,
  `nki_kernels::rmsnorm_linear_bwd`.
- `swiglu_mlp(x, w_gate, w_up, w_down)`: Llama's MLP down(silu(gate(x)) * up(x)), bias-free.
  Ops: `nki_kernels::swiglu_fwd`, `nki_kernels::swiglu_bwd`.

Each op computes with its kernel's host path (fp32 accumulation, activations rounded to the
input dtype as the kernel rounds them) unless NKI_SIMULATOR=1, and on neuron tensors is charged
the kernel's simulated latency (pricing_norm_mlp.py). Operands a kernel does not take (token
count or hidden size not a multiple of 128, mixed or integer dtypes, a hidden size too large
for SBUF ...) run the generic torch implementation after a one-time warning naming the kernel's
constraint; strict mode (TORCHNEURON_STRICT=1) raises instead.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ..nki import nki_op, register_autograd
from . import norm_mlp as nm
from .rope_ce_ops import FLOAT_TYPES
from .torch_ops import fallback_once

rmsnorm_linear_fwd_op = nki_op("nki_kernels::rmsnorm_linear_fwd", nm.rmsnorm_linear_fwd, num_outputs=2,
                               arg_types={"eps": float}, host=nm.host_rmsnorm_linear_fwd,
                               priced_as="nki_kernels::rmsnorm_linear_fwd")
rmsnorm_linear_bwd_op = nki_op("nki_kernels::rmsnorm_linear_bwd", nm.rmsnorm_linear_bwd, num_outputs=3,
                               arg_types={"eps": float}, host=nm.host_rmsnorm_linear_bwd,
                               priced_as="nki_kernels::rmsnorm_linear_bwd")
swiglu_fwd_op = nki_op("nki_kernels::swiglu_fwd", nm.swiglu_fwd, host=nm.host_swiglu_fwd,
                       priced_as="nki_kernels::swiglu_fwd")
swiglu_bwd_op = nki_op("nki_kernels::swiglu_bwd", nm.swiglu_bwd, num_outputs=4, host=nm.host_swiglu_bwd,
                       priced_as="nki_kernels::swiglu_bwd")


def _rmsnorm_linear_setup(ctx, inputs, output) -> None:
    x, w_norm, w, eps = inputs
    ctx.save_for_backward(x, w_norm, w, output[1])
    ctx.eps = eps


def _rmsnorm_linear_backward(ctx, grad_y, grad_rstd):
    x, w_norm, w, rstd = ctx.saved_tensors
    dx, dwn, dw = rmsnorm_linear_bwd_op(x, w_norm, w, rstd, grad_y.contiguous(), ctx.eps)
    return dx, dwn.to(w_norm.dtype), dw.to(w.dtype), None


register_autograd(rmsnorm_linear_fwd_op, _rmsnorm_linear_backward, setup_context=_rmsnorm_linear_setup)


def _swiglu_setup(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, grad):
    x, wg, wu, wd = ctx.saved_tensors
    dx, dwg, dwu, dwd = swiglu_bwd_op(x, wg, wu, wd, grad.contiguous())
    return dx, dwg.to(wg.dtype), dwu.to(wu.dtype), dwd.to(wd.dtype)


register_autograd(swiglu_fwd_op, _swiglu_backward, setup_context=_swiglu_setup)


def _check_dtypes(what: str, tensors: Sequence[torch.Tensor]) -> None:
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1 or not dtypes <= set(FLOAT_TYPES):
        raise nm.UnsupportedInput(f"{what}: operands must share one of float32/bfloat16/float16, got "
                                  f"{sorted(str(d) for d in dtypes)}")


def rmsnorm_reference(x: torch.Tensor, w_norm: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: w_norm * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)."""
    xf = x.float()
    return w_norm * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def rmsnorm_linear(x: torch.Tensor, w_norm: torch.Tensor, weights: Sequence[torch.Tensor],
                   eps: float = 1e-6) -> tuple[torch.Tensor, ...]:
    """F.linear(rmsnorm(x, w_norm, eps), w) for each w of `weights` ([N_i, D], no bias), x
    [..., D], with the fused NKI kernel: the normalised x never goes to HBM and the projections
    run as one matmul over their stacked weights. Unsupported operands: the generic computation
    (module doc)."""
    weights = list(weights)
    d = x.shape[-1]
    try:
        _check_dtypes("rmsnorm_linear kernel", [x, w_norm, *weights])
        if w_norm.shape != (d,) or not weights:
            raise nm.UnsupportedInput(f"rmsnorm_linear kernel: need w_norm [{d}] and at least one weight, got "
                                      f"w_norm {tuple(w_norm.shape)} and {len(weights)} weights")
        w = weights[0] if len(weights) == 1 else torch.cat(weights, dim=0)
        flat = x.reshape(-1, d)
        nm.check_rmsnorm_linear(flat, w_norm.view(1, d), w)
    except nm.UnsupportedInput as error:
        fallback_once(error)
        normed = rmsnorm_reference(x, w_norm, eps)
        return tuple(F.linear(normed, w) for w in weights)
    y, _ = rmsnorm_linear_fwd_op(flat.contiguous(), w_norm.view(1, d), w.contiguous(), float(eps))
    y = y.view(*x.shape[:-1], w.shape[0])
    return tuple(y.split([wi.shape[0] for wi in weights], dim=-1))


def swiglu_reference(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """LlamaMLP's forward: down(silu(gate(x)) * up(x))."""
    return F.linear(F.silu(F.linear(x, w_gate)) * F.linear(x, w_up), w_down)


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) for x [..., D], w_gate and w_up [F, D], w_down [D, F] (no
    biases) with the fused NKI SwiGLU kernels: the [tokens, F] intermediates stay on chip.
    Unsupported operands: the generic computation (module doc)."""
    d = x.shape[-1]
    try:
        _check_dtypes("swiglu kernel", [x, w_gate, w_up, w_down])
        flat = x.reshape(-1, d)
        nm.check_swiglu(flat, w_gate, w_up, w_down)
    except nm.UnsupportedInput as error:
        fallback_once(error)
        return swiglu_reference(x, w_gate, w_up, w_down)
    y = swiglu_fwd_op(flat.contiguous(), w_gate.contiguous(), w_up.contiguous(), w_down.contiguous())
    return y.view(x.shape)
