"""int4 weight-only matmuls on neuron: tinygemm's ops `_convert_weight_to_int4pack` and
`_weight_int4pack_mm` (CUDA-only in PyTorch; torchao's `Int4WeightOnlyConfig` with
`int4_packing_format="tile_packed_to_4d"` calls them).

The packed weight is a device format, as it is on CUDA (whose tensor-core tiles the CPU's
`_for_cpu` variants do not share). On neuron it keeps PyTorch's shape and dtype
([n / 8, k / (inner_k_tiles * 16), 32, inner_k_tiles / 2] int32) and is tiled as that shape
says: entry [i, j] holds rows 8i..8i+7 and K columns j * 16 * inner_k_tiles onwards of the plain
nibble-packed weight (two 4-bit values a byte, high nibble first, as `_convert_weight_to_int4pack`
receives it), row after row. So torchao's slices of the packed tensor along N (dim 0) and K
(dim 1) are again valid packed weights.

The matmul computes what the CPU's int4 kernel `_weight_int4pack_mm_for_cpu` computes for the
same 4-bit values, group size and scales/zeros (tinygemm's `(q - 8) * scale + zero`): the tiles
are unpacked, handed to that kernel, and its result is the device's, so a model quantized on
neuron generates what the same quantized weights give on the CPU.
"""
from __future__ import annotations

import torch

from .host_kernels import check_on_meta, device_kernel, register


def _tiled(plain: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    """[n, k / 2] uint8 (plain nibbles) -> the 4-D int32 device layout."""
    n, half_k = plain.shape
    tile = inner_k_tiles * 8  # bytes of one row within a K tile (16 * inner_k_tiles values)
    blocks = plain.reshape(n // 8, 8, half_k // tile, tile).permute(0, 2, 1, 3).contiguous()
    return blocks.view(torch.int32).reshape(n // 8, half_k // tile, 32, inner_k_tiles // 2)


def _plain(packed: torch.Tensor) -> torch.Tensor:
    """The 4-D int32 device layout -> [n, k / 2] uint8 (plain nibbles)."""
    n8, k_tiles, _, half_inner = packed.shape
    tile = half_inner * 16
    blocks = packed.contiguous().view(torch.uint8).reshape(n8, k_tiles, 8, tile)
    return blocks.permute(0, 2, 1, 3).reshape(n8 * 8, k_tiles * tile)


def _values(plain: torch.Tensor) -> torch.Tensor:
    """[n, k / 2] uint8 -> [n, k] int32 4-bit values (high nibble first)."""
    return torch.stack([plain >> 4, plain & 15], dim=-1).reshape(plain.shape[0], -1).to(torch.int32)


@device_kernel("aten::_convert_weight_to_int4pack")
def convert_weight_to_int4pack(w: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
    check_on_meta(torch.ops.aten._convert_weight_to_int4pack.default, w, inner_k_tiles)
    n, half_k = w.shape
    if inner_k_tiles not in (2, 4, 8) or n % 8 or (2 * half_k) % (inner_k_tiles * 16):
        raise RuntimeError(f"_convert_weight_to_int4pack: a [{n}, {2 * half_k}] weight with inner_k_tiles="
                           f"{inner_k_tiles} (2, 4 or 8): n must be a multiple of 8 and k of "
                           f"{16 * inner_k_tiles}; pad the weight (torchao pads k to 1024)")
    return _tiled(w.contiguous(), inner_k_tiles)


@device_kernel("aten::_weight_int4pack_mm")
def weight_int4pack_mm(x: torch.Tensor, w: torch.Tensor, q_group_size: int,
                       q_scale_and_zeros: torch.Tensor) -> torch.Tensor:
    n, k = w.shape[0] * 8 if w.dim() == 4 else -1, x.shape[-1]
    torch._check(x.dim() == 2, lambda: "x must be a 2D tensor")
    torch._check(w.dim() == 4 and w.dtype == torch.int32,
                 lambda: f"w must be a 4D int32 tensor (from _convert_weight_to_int4pack), got {w.dim()}D {w.dtype}")
    torch._check(x.dtype in (torch.float32, torch.float16, torch.bfloat16),
                 lambda: f"expected x to be f32/f16/bf16, got {x.dtype}")
    torch._check(w.shape[1] * w.shape[3] * 32 == k,
                 lambda: f"x has {k} columns but the packed weight holds {w.shape[1] * w.shape[3] * 32}")
    torch._check(q_group_size in (32, 64, 128, 256) and k % q_group_size == 0,
                 lambda: f"q_group_size must be 32, 64, 128 or 256 and divide K={k}, got {q_group_size}")
    torch._check(tuple(q_scale_and_zeros.shape) == (k // q_group_size, n, 2),
                 lambda: f"qScaleAndZeros must be [{k // q_group_size}, {n}, 2], got {list(q_scale_and_zeros.shape)}")
    values = _values(_plain(w))
    pad = -n % 16  # the CPU kernel packs N in 16s (CUDA's in 8s): padded rows are computed, then dropped
    values = torch.nn.functional.pad(values, (0, 0, 0, pad))
    scale_and_zeros = torch.nn.functional.pad(q_scale_and_zeros, (0, 0, 0, pad))
    cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(values, 2 * w.shape[-1])
    out = torch.ops.aten._weight_int4pack_mm_for_cpu(x, cpu_packed, q_group_size, scale_and_zeros)
    return out[:, :n].contiguous() if pad else out


def install() -> None:
    register("aten::_convert_weight_to_int4pack", convert_weight_to_int4pack)
    register("aten::_weight_int4pack_mm", weight_int4pack_mm)
