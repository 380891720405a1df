"""The statistics ops of nn.SyncBatchNorm on neuron.

SyncBatchNorm accepts CUDA, XPU and the PrivateUse1 device, and computes with five ops that only
CUDA implements (there is no CPU kernel for the fallback to run): per-replica statistics, their
all-gathered combination, the normalisation, and the two halves of the backward pass. They are
registered here for neuron as compositions of device ops, with CUDA's semantics: statistics in the
data's accumulation dtype (float32 for half-precision data), running statistics updated with the
unbiased variance of the whole global batch.
"""
from __future__ import annotations

import torch

_registrations: list[torch.library.Library] = []


def _channels(t: torch.Tensor) -> list[int]:
    """The dimensions reduced over: all but the channel dimension (1)."""
    return [d for d in range(t.dim()) if d != 1]


def _per_channel(v: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return v.reshape([1, -1] + [1] * (like.dim() - 2))


def _acc(t: torch.Tensor) -> torch.dtype:
    return torch.float32 if t.dtype in (torch.float16, torch.bfloat16) else t.dtype


def batch_norm_stats(input: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x = input.to(_acc(input))
    var, mean = torch.var_mean(x, dim=_channels(x), correction=0)
    return mean, torch.rsqrt(var + eps)


def batch_norm_gather_stats_with_counts(input, mean, invstd, running_mean, running_var, momentum: float,
                                        eps: float, counts) -> tuple[torch.Tensor, torch.Tensor]:
    counts = counts.to(mean.dtype).reshape(-1, 1)
    total = counts.sum()
    global_mean = (mean * counts).sum(0) / total
    var = 1.0 / (invstd * invstd) - eps  # each replica's biased variance
    global_var = (counts * (var + (mean - global_mean) ** 2)).sum(0) / total
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(global_mean.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        unbiased = global_var * (total / (total - 1))
        running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
    return global_mean, torch.rsqrt(global_var + eps)


def batch_norm_elemt(input, weight, bias, mean, invstd, eps: float) -> torch.Tensor:
    acc = _acc(input)
    out = (input.to(acc) - _per_channel(mean, input)) * _per_channel(invstd, input)
    if weight is not None:
        out = out * _per_channel(weight.to(acc), input)
    if bias is not None:
        out = out + _per_channel(bias.to(acc), input)
    return out.to(input.dtype)


def batch_norm_backward_reduce(grad_out, input, mean, invstd, weight, input_g: bool, weight_g: bool,
                               bias_g: bool):
    acc = mean.dtype
    dims = _channels(input)
    dy = grad_out.to(acc)
    sum_dy = dy.sum(dims)
    sum_dy_xmu = (dy * (input.to(acc) - _per_channel(mean, input))).sum(dims)
    param_dtype = weight.dtype if weight is not None else acc
    grad_weight = (sum_dy_xmu * invstd).to(param_dtype) if weight_g else None
    grad_bias = sum_dy.to(param_dtype) if bias_g else None
    return (sum_dy if input_g else None), (sum_dy_xmu if input_g else None), grad_weight, grad_bias


def batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, sum_dy, sum_dy_xmu, count) -> torch.Tensor:
    acc = mean.dtype
    total = count.to(acc).sum()
    scale = _per_channel(invstd, input)
    if weight is not None:
        scale = scale * _per_channel(weight.to(acc), input)
    xmu = input.to(acc) - _per_channel(mean, input)
    grad = grad_out.to(acc) - _per_channel(sum_dy / total, input) \
        - xmu * _per_channel(invstd * invstd * sum_dy_xmu / total, input)
    return (grad * scale).to(input.dtype)


def install() -> None:
    """Registers the five ops for the neuron device (idempotent)."""
    if _registrations:
        return
    lib = torch.library.Library("aten", "IMPL")
    for fn in (batch_norm_stats, batch_norm_gather_stats_with_counts, batch_norm_elemt, batch_norm_backward_reduce,
               batch_norm_backward_elemt):
        lib.impl(fn.__name__, fn, "PrivateUse1")
    _registrations.append(lib)
