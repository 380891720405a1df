"""The RoPE and linear cross-entropy kernels as torch ops (namespace `nki_kernels`), with autograd.

- `apply_rope(x, cos, sin)`: rotary embedding of x [B, H, S, d] (rotate-half convention, as
  transformers' `apply_rotary_pos_emb`), cos/sin [S, d], [B, S, d] or either with a head axis
  of 1; backward is the same kernel with the inverse rotation. Op: `nki_kernels::rope`.
- `linear_cross_entropy(h, w, labels, ignore_index, reduction)`: cross_entropy(h @ w^T, labels)
  without materialising the logits; gradients for h and w. Ops: `nki_kernels::linear_ce_fwd`,
  `nki_kernels::linear_ce_bwd`.
- `cross_entropy(logits, labels, ignore_index, reduction)`: F.cross_entropy over given [T, V]
  logits (one read forward, one read and one write backward). Ops: `nki_kernels::ce_fwd`,
  `nki_kernels::ce_bwd`.

Each op computes with its kernel's host path (its numerics: fp32 arithmetic, one rounding)
unless NKI_SIMULATOR=1, and on neuron tensors is charged the kernel's simulated latency
(pricing_rope_ce.py). Operands a kernel does not take (odd head dim, token count not a multiple
of 128, integer dtypes, tables that need a gradient ...) run the generic torch implementation
after a one-time warning naming the kernel's constraint; strict mode (TORCHNEURON_STRICT=1)
raises instead.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..nki import nki_op, register_autograd
from . import cross_entropy as ce
from . import rope as rp
from .torch_ops import fallback_once

FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16)

rope_op = nki_op("nki_kernels::rope", rp.rope, host=rp.host, priced_as="nki_kernels::rope")
linear_ce_fwd_op = nki_op("nki_kernels::linear_ce_fwd", ce.linear_ce_fwd, num_outputs=2, host=ce.host_fwd,
                          priced_as="nki_kernels::linear_ce_fwd")
linear_ce_bwd_op = nki_op("nki_kernels::linear_ce_bwd", ce.linear_ce_bwd, num_outputs=2, host=ce.host_bwd,
                          priced_as="nki_kernels::linear_ce_bwd")
ce_fwd_op = nki_op("nki_kernels::ce_fwd", ce.ce_fwd, num_outputs=2, host=ce.host_ce_fwd, priced_as="nki_kernels::ce_fwd")
ce_bwd_op = nki_op("nki_kernels::ce_bwd", ce.ce_bwd, host=ce.host_ce_bwd, priced_as="nki_kernels::ce_bwd")


def _rope_setup(ctx, inputs, output) -> None:
    _, cos, sin, backward = inputs
    ctx.save_for_backward(cos, sin)
    ctx.backward = backward


def _rope_backward(ctx, grad):
    cos, sin = ctx.saved_tensors
    return rope_op(grad.contiguous(), cos, sin, not ctx.backward), None, None, None


register_autograd(rope_op, _rope_backward, setup_context=_rope_setup)


def _linear_ce_setup(ctx, inputs, output) -> None:
    h, w, labels = inputs
    ctx.save_for_backward(h, w, labels, output[1])


def _linear_ce_backward(ctx, grad_loss, grad_lse):
    h, w, labels, lse = ctx.saved_tensors
    dh, dw = linear_ce_bwd_op(h, w, labels, lse, grad_loss.float().contiguous())
    return dh, dw.to(w.dtype), None


register_autograd(linear_ce_fwd_op, _linear_ce_backward, setup_context=_linear_ce_setup)


def _ce_setup(ctx, inputs, output) -> None:
    logits, labels = inputs
    ctx.save_for_backward(logits, labels, output[1])


def _ce_backward(ctx, grad_loss, grad_lse):
    logits, labels, lse = ctx.saved_tensors
    return ce_bwd_op(logits, labels, lse, grad_loss.float().contiguous()), None


register_autograd(ce_fwd_op, _ce_backward, setup_context=_ce_setup)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """cat(-x2, x1) of the last dimension's halves."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_tables(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """cos or sin as the kernel's [C, S, d] (C = 1 or B), or UnsupportedInput."""
    b, _, s, d = x.shape
    t = table.squeeze(1) if table.dim() == 4 and table.shape[1] == 1 else table
    t = t.unsqueeze(0) if t.dim() == 2 else t
    if t.dim() != 3 or tuple(t.shape[1:]) != (s, d) or t.shape[0] not in (1, b):
        raise rp.UnsupportedInput(f"rope kernel: cos/sin {tuple(table.shape)} must be [S, d], [B, S, d] or "
                                  f"[B, 1, S, d] for x {tuple(x.shape)}")
    return t.contiguous()


def _check_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4:
        raise rp.UnsupportedInput(f"rope kernel: x must be [B, H, S, d], got {tuple(x.shape)}")
    if x.dtype not in FLOAT_TYPES or cos.dtype not in FLOAT_TYPES or sin.dtype not in FLOAT_TYPES:
        raise rp.UnsupportedInput(f"rope kernel: x, cos and sin must be float32/bfloat16/float16, got {x.dtype}, "
                                  f"{cos.dtype}, {sin.dtype}")
    if cos.requires_grad or sin.requires_grad:
        raise rp.UnsupportedInput("rope kernel: cos/sin require grad, and the kernel gives gradients for x only")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with the NKI RoPE kernel, x [B, H, S, d]; cos and sin
    [S, d], [B, S, d] or [B, 1, S, d]. Unsupported operands: the generic computation (module doc)."""
    try:
        _check_rope(x, cos, sin)
        cos3, sin3 = _rope_tables(x, cos), _rope_tables(x, sin)
        rp.check_shapes(x.flatten(0, 1), cos3, sin3)
    except rp.UnsupportedInput as error:
        fallback_once(error)
        c, s = (t.unsqueeze(1) if t.dim() == 3 else t for t in (cos, sin))
        return x * c + rotate_half(x) * s
    b, h, s, d = x.shape
    return rope_op(x.reshape(b * h, s, d).contiguous(), cos3, sin3).view(b, h, s, d)


def _check_linear_ce(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor) -> None:
    if h.dtype not in FLOAT_TYPES or w.dtype != h.dtype:
        raise ce.UnsupportedInput(f"linear cross-entropy kernel: h and w must share one of float32/bfloat16/"
                                  f"float16, got {h.dtype} and {w.dtype}")
    _check_labels(labels, h.shape[:-1], "linear cross-entropy kernel")
    ce.check_shapes(h.reshape(-1, h.shape[-1]), w, labels.reshape(-1, 1), "linear cross-entropy kernel")
    ce.block_tiles(labels.numel(), h.shape[-1], h.dtype.itemsize, backward=True)


def linear_cross_entropy(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                         reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy(h @ w^T, labels, ignore_index=..., reduction=...) over h [..., D], w [V, D]
    and labels [...], with the fused NKI kernels: the [tokens, V] logits never exist whole.
    The number of tokens and D must be multiples of 128 (else the generic computation, module doc)."""
    _check_reduction(reduction)
    try:
        _check_linear_ce(h, w, labels)
    except ce.UnsupportedInput as error:
        fallback_once(error)
        logits = F.linear(h, w).float()
        return F.cross_entropy(logits.flatten(0, -2), labels.flatten(), ignore_index=ignore_index,
                               reduction=reduction).view(labels.shape if reduction == "none" else ())
    kernel_labels = _kernel_labels(labels, ignore_index)
    per_token, _ = linear_ce_fwd_op(h.reshape(-1, h.shape[-1]).contiguous(), w.contiguous(), kernel_labels)
    return _reduce(per_token, kernel_labels, labels.shape, reduction)


def _kernel_labels(labels: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """labels as the kernels' [T, 1] int32, the ignored ones -1."""
    flat = labels.reshape(-1, 1)
    return torch.where(flat == ignore_index, -1, flat).to(torch.int32)


def _reduce(per_token: torch.Tensor, kernel_labels: torch.Tensor, shape: torch.Size, reduction: str) -> torch.Tensor:
    """F.cross_entropy's reduction of per-token losses (ignored tokens: 0, not counted by mean)."""
    if reduction == "none":
        return per_token.view(shape)
    total = per_token.sum()
    return total if reduction == "sum" else total / (kernel_labels >= 0).sum()


def _check_reduction(reduction: str) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"cross-entropy kernels: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")


def _check_labels(labels: torch.Tensor, shape: torch.Size, what: str) -> None:
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.shape != shape:
        raise ce.UnsupportedInput(f"{what}: labels must be integer class indices shaped {tuple(shape)}, got "
                                  f"{labels.dtype} {tuple(labels.shape)}")


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """F.cross_entropy(logits [T, V], labels [T], ignore_index=..., reduction=...) with the NKI
    cross-entropy kernels over given logits (fp32 log-sum-exp; T a multiple of 128, else the
    generic computation, module doc)."""
    _check_reduction(reduction)
    try:
        if logits.dtype not in FLOAT_TYPES or logits.dim() != 2:
            raise ce.UnsupportedInput(f"cross-entropy kernel: logits must be [T, V] float32/bfloat16/float16, got "
                                      f"{logits.dtype} {tuple(logits.shape)}")
        _check_labels(labels, logits.shape[:1], "cross-entropy kernel")
        ce.check_logits(logits, labels.reshape(-1, 1), "cross-entropy kernel")
    except ce.UnsupportedInput as error:
        fallback_once(error)
        return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)
    kernel_labels = _kernel_labels(labels, ignore_index)
    per_token, _ = ce_fwd_op(logits.contiguous(), kernel_labels)
    return _reduce(per_token, kernel_labels, labels.shape, reduction).to(logits.dtype)
