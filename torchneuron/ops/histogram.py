"""`histc` and `bincount` on neuron, for every dtype CUDA takes.

Mixture-of-experts routers count tokens per expert with `torch.histc` on integer expert ids
(transformers does so on every device but cpu/mps). CUDA's histc takes every real dtype; the
CPU kernel only floating ones. On the NeuronCore a histogram is a scatter-add of ones into bins
(GpSimd), so both ops are device ops here: floating inputs bin exactly as the CPU kernel does,
integer inputs as CUDA's kernel does, in int64 arithmetic:
    bin = (x - min) * bins // (max - min), the top edge folded into the last bin,
values outside [min, max] ignored, the result in the input's dtype; min == max takes the data's
own range (widened by one each side when that is a single value), as on CUDA.
"""
from __future__ import annotations

import torch

from .host_kernels import device_kernel, register


def _integer_histc(x: torch.Tensor, bins: int, low: int, high: int) -> torch.Tensor:
    if bins <= 0:
        raise RuntimeError(f"torch.histogram(): bins must be > 0, but got {bins} for dimension 0")
    if low == high and x.numel() > 0:
        low, high = int(x.min()), int(x.max())
    if low == high:
        low, high = low - 1, high + 1
    if low > high:
        raise RuntimeError("torch.histc: max must be larger than min")
    values = x.reshape(-1).to(torch.int64)
    index = ((values - low) * bins).div(high - low, rounding_mode="floor").clamp_(0, bins - 1)
    inside = ((values >= low) & (values <= high)).to(x.dtype)
    return torch.zeros(bins, dtype=x.dtype).scatter_add_(0, index, inside)


@device_kernel("aten::histc")
def histc(x: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> torch.Tensor:  # noqa: A002
    if x.is_floating_point():
        return torch.histc(x, bins, min, max)
    return _integer_histc(x, bins, int(min), int(max))


@device_kernel("aten::bincount")
def bincount(x: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
    return torch.bincount(x, weights, minlength)


def install() -> None:
    register("aten::histc", histc)
    register("aten::bincount", bincount)
