"""NKI-lib kernels registered as torch ops (namespace `nki_kernels`), usable on CPU and
neuron tensors, in eager mode and under torch.compile.

- `rmsnorm(x, weight, eps)`: any leading shape; backward through the `rmsnorm_bwd` kernel.
- `flash_attention(q, k, v, causal, scale)`: [S, d] single-head attention (forward kernel).
- `attention(q, k, v, causal, scale, window)`: [B, H, S, d] multi-head attention (GQA/MQA,
  causal, sliding window) with the forward and backward flash-attention kernels.
- `paged_decode_attention(q, kv_cache, block_table, context_lens, scale)`: a few new tokens
  per sequence against vLLM's paged KV cache through each sequence's block table.
- `router_topk(x, w, k)`, `grouped_matmul(x, w, block_expert)`: MoE routing and the blockwise
  grouped matmul (forward only: no weight-gradient kernel yet).
- `fp8_scaled_matmul(a, b, scale_a, scale_b, out_dtype)`: fp8 a @ b with tensor-wise or
  row-wise fp32 scales, bf16 or fp32 out (forward only).
"""
from __future__ import annotations

import warnings

import torch

from ..nki import nki_op, register_autograd
from ..ops import policy
from . import attention, norms
from . import decode_attention, fp8_matmul, moe
from . import flash_attention as mha

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


# -- multi-head flash attention (flash_attention.py): [B*H, S, d] layouts, GQA, masks ----------
def _heads(q, *rest):
    return (q.shape[0],)


# (each op computes with its host path unless NKI_SIMULATOR=1, and is charged its kernel's time)
attention_fwd_op = nki_op("nki_kernels::attention_fwd", mha.attention_fwd, num_outputs=2, host=mha.host_fwd,
                          grid=_heads, arg_types={"scale": float, "causal": bool, "window": int})
attention_bwd_op = nki_op("nki_kernels::attention_bwd", mha.attention_bwd, num_outputs=3, host=mha.host_bwd,
                          grid=_heads, arg_types={"scale": float, "causal": bool, "window": int})


def _attention_setup(ctx, inputs, output):
    q, k, v, scale, causal, window = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.args = (scale, causal, window)


def _attention_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = attention_bwd_op(q, k, v, out, grad_out.contiguous(), lse, *ctx.args)
    group = q.shape[0] // k.shape[0]
    if group > 1:  # per query head -> per key/value head (a GQA group shares one)
        dk = dk.unflatten(0, (k.shape[0], group)).sum(1)
        dv = dv.unflatten(0, (k.shape[0], group)).sum(1)
    return dq, dk, dv, None, None, None


register_autograd(attention_fwd_op, _attention_backward, setup_context=_attention_setup)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
              scale: float | None = None, window: int = 0) -> torch.Tensor:
    """softmax(scale q k^T + mask) v with the NKI flash-attention kernels (forward and, under
    autograd, backward). q [B, Hq, Sq, d], k and v [B, Hkv, Sk, d] (Hq a multiple of Hkv:
    GQA / MQA), d <= 128, S multiples of 128, bf16 / fp16 / fp32. `window` > 0 keeps the
    last `window` keys up to each query (sliding window; with `causal`)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("nki attention: q, k and v must be [B, H, S, d]")
    b, hq, sq, d = q.shape
    hk = k.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)
    out, _ = attention_fwd_op(q.reshape(b * hq, sq, d).contiguous(), k.reshape(b * hk, -1, d).contiguous(),
                              v.reshape(b * hk, -1, d).contiguous(), scale, bool(causal), int(window))
    return out.reshape(b, hq, sq, d)


_warned: set[str] = set()


def fallback_once(error: Exception) -> None:
    """An NKI kernel refused well-formed operands: in strict mode (TORCHNEURON_STRICT=1) raise,
    else warn once per reason that the generic implementation runs instead."""
    if policy.is_strict():
        raise type(error)(f"{error} (strict mode forbids the generic fallback; unset TORCHNEURON_STRICT)") from error
    if str(error) not in _warned:
        _warned.add(str(error))
        warnings.warn(f"{error}; running the generic implementation instead (warned once)", stacklevel=3)


# -- decode (paged) attention (decode_attention.py) --------------------------------------------
# (computes with its host path unless NKI_SIMULATOR=1; on neuron tensors it is charged the kernel's
# latency as kernels/pricing.py prices it: simulated, extended from short runs for large batches)
decode_attention_op = nki_op("nki_kernels::decode_attention", decode_attention.decode_attention,
                             grid=_heads, arg_types={"scale": float}, host=decode_attention.host,
                             priced_as="nki_kernels::decode_attention")


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                           context_lens: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention of q [B, T, Hq, d] (T new tokens per sequence) against each sequence's cached keys
    in vLLM's paged layout: kv_cache [blocks, Hkv, 2 * block_size, d] (per block and head, the
    keys' rows then the values'), block_table [B, max_blocks], context_lens [B] (the new tokens
    included). Returns [B, T, Hq, d]."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    try:
        decode_attention.check_shapes(q, kv_cache, block_table)
    except decode_attention.UnsupportedInput as error:
        fallback_once(error)
        return decode_attention.generic(q, kv_cache, block_table, context_lens, scale)
    if not kv_cache.is_contiguous():
        raise ValueError("paged_decode_attention: kv_cache must be contiguous (the kernel addresses its blocks "
                         "by row-major offsets); pass vLLM's cache tensor itself, viewed as [blocks, Hkv, 2 * bs, d]")
    return decode_attention_op(q.contiguous(), kv_cache, block_table.to(torch.int32).contiguous(),
                               context_lens.to(torch.int32).reshape(-1, 1).contiguous(), scale)


# -- mixture of experts (moe.py) -----------------------------------------------------------------
router_topk_op = nki_op("nki_kernels::router_topk", moe.router_topk, num_outputs=2, arg_types={"k": int},
                        host=moe.host_router_topk)
grouped_matmul_op = nki_op("nki_kernels::grouped_matmul", moe.grouped_matmul, host=moe.host_grouped_matmul)


def router_topk(x: torch.Tensor, w: torch.Tensor, k: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each token (softmax over experts, chosen weights renormalised):
    x [T, H], w [H, E] -> (weights [T, k] fp32, experts [T, k] int32)."""
    return router_topk_op(x.contiguous(), w.contiguous(), int(k))


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, block_expert: torch.Tensor) -> torch.Tensor:
    """x [NB * 512, K] in blocks of 512 tokens, block b times w[block_expert[b]] (w [E, K, N])."""
    return grouped_matmul_op(x.contiguous(), w.contiguous(), block_expert.to(torch.int32).reshape(-1, 1).contiguous())


# -- fp8 scaled matmul (fp8_matmul.py) -------------------------------------------------------------
fp8_scaled_matmul_op = nki_op("nki_kernels::fp8_scaled_matmul", fp8_matmul.scaled_matmul,
                              arg_types={"fp32_out": bool},
                              host=fp8_matmul.host_scaled_matmul)


def fp8_scaled_matmul(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """(a @ b) * scale_a * scale_b as `torch._scaled_mm`: a [M, K] and b [K, N] float8_e4m3fn or
    float8_e5m2; fp32 scales tensor-wise (one element each) or row-wise (scale_a [M, 1],
    scale_b [1, N]); out_dtype bf16 or fp32. M, K multiples of 128, N of 512."""
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"fp8 scaled_matmul: out_dtype must be bfloat16 or float32, got {out_dtype}")
    if a.dim() != 2:
        raise ValueError(f"fp8 scaled_matmul: a must be [M, K], got {tuple(a.shape)}")
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        scale_a, scale_b = scale_a.reshape(1, 1), scale_b.reshape(1, 1)
    return fp8_scaled_matmul_op(a.T.contiguous(), b.contiguous(), scale_a.float().contiguous(),
                                scale_b.float().contiguous(), out_dtype == torch.float32)
