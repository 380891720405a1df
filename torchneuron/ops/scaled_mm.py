"""Grouped and block-scaled matmuls on neuron: `_grouped_mm`, `_scaled_grouped_mm`, `_scaled_mm`
and `_scaled_mm_v2` where the CPU has no kernel.

What the Tensor engine computes for an FP8 matmul: FP8 operands, products accumulated in FP32,
the scales applied to the FP32 result (per tensor, row, or K block), the output in the requested
dtype. The kernels here compute exactly that on the host: the operands' FP8 values upcast to
float32, block scales expanded over the elements they scale, one float32 matmul, then the cast.

- `_grouped_mm`: the CPU's own (composite) kernel, run as one device op, so the performance
  model charges one grouped matmul on the Tensor engine instead of a host loop of launches. Any
  strides (the CPU's kernel wants rows 16 bytes apart: other operands are copied so for it), and
  rows or columns past the last group are zero.
- `_scaled_grouped_mm` and `_scaled_grouped_mm_v2` (`F.scaled_grouped_mm`; no CPU kernels):
  row-wise float32 scales or MXFP8 (1x32 blocks of float8_e8m0fnu scales, 32_4_4-swizzled per
  group) for the four layouts PyTorch documents (2d x 3d forward, 3d x 3d, 3d x 2d, 2d x 2d with
  groups along K for weight gradients); `offs[i]` ends group i.
- `_scaled_mm` / `_scaled_mm_v2` with block scales (1x128 and 128x128, and MX: 1x32 blocks of
  float8_e8m0fnu scales in the 32_4_4 swizzled layout): tensor-wise and row-wise recipes stay
  with the CPU's portable kernel. On a host with AMX int8 ATen sends those to oneDNN instead,
  whose FP8 GEMM was far slower on such a host (512^3: 2.1 s against 0.03 s; 2048^3: over 600 s
  against 0.1 s) and skips PyTorch's checks of the scales; `portable_cpu_kernels()` keeps every
  host the same.

Bad input gets PyTorch's own error: each kernel first runs the op's meta function (CUDA's
rules: row-major A, column-major B, the scale shapes and dtypes).
"""
from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F

from .host_kernels import check_on_meta, device_kernel, register

_BLOCK_RECIPES = {F.ScalingType.BlockWise1x128.value: (1, 128), F.ScalingType.BlockWise128x128.value: (128, 128),
                  F.ScalingType.BlockWise1x32.value: (1, 32)}


@contextlib.contextmanager
def portable_cpu_kernels() -> Iterator[None]:
    """ATen's CPU `_scaled_mm`s run their portable kernel (FP8 upcast to float32, fp32 GEMM, and the
    checks CUDA makes) instead of oneDNN's, which ATen picks on hosts with AMX int8. The switch is
    process-wide (torch.backends.mkldnn.enabled) while the block runs."""
    was_enabled = torch._C._get_mkldnn_enabled()
    torch._C._set_mkldnn_enabled(False)
    try:
        yield
    finally:
        torch._C._set_mkldnn_enabled(was_enabled)


def _group_bounds(offs: torch.Tensor) -> list[tuple[int, int]]:
    ends = offs.tolist()
    return list(zip([0] + ends[:-1], ends))


# ---- _grouped_mm ----------------------------------------------------------------------------

def _rows_aligned(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy of it whose rows (columns, if column-major) start 16 bytes apart: the CPU
    kernel's rule (CUDA's too), not the NeuronCore's, whose DMA reads any stride."""
    align = 16 // t.element_size()
    lead = t.stride(-2) if t.stride(-1) == 1 else t.stride(-1)
    if lead % align == 0:
        return t
    cols = t.shape[-1]
    aligned = t.new_empty(*t.shape[:-1], -(-cols // align) * align)[..., :cols]
    return aligned.copy_(t)


def _zero_uncovered(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """Zeroes the rows (2d x 3d) or columns (3d x 2d) past the last group: PyTorch leaves them
    unspecified (the CPU kernel leaves whatever memory held), transformers' fallback and the
    backward of a masked MoE layer need zeros there."""
    if offs is None or offs.numel() == 0 or a.dim() == b.dim():
        return out
    end = int(offs[-1])
    if a.dim() == 2:
        out[end:].zero_()
    else:
        out[..., end:].zero_()
    return out


@device_kernel("aten::_grouped_mm")
def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The CPU's grouped kernel on operands of any stride; rows past the last group are zero."""
    out = torch._grouped_mm(_rows_aligned(a), _rows_aligned(b), offs, bias, out_dtype)
    return _zero_uncovered(out, a, b, offs)


# ---- _scaled_grouped_mm ---------------------------------------------------------------------

def _scale_grouped_result(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                          scale_b: torch.Tensor, offs: torch.Tensor | None) -> torch.Tensor:
    """The float32 grouped product `out` times its row-wise scales, per layout."""
    if a.dim() == 3 and b.dim() == 3:
        return out * scale_a.float()[:, :, None] * scale_b.float()[:, None, :]
    bounds = _group_bounds(offs)
    if a.dim() == 2 and b.dim() == 2:  # groups along K: out [G, M, N]
        groups, m, n = out.shape
        return out * scale_a.float().view(groups, m, 1) * scale_b.float().view(groups, 1, n)
    scaled = torch.zeros_like(out)
    for g, (start, end) in enumerate(bounds):
        if a.dim() == 2:  # rows of group g use expert g's column scales
            scaled[start:end] = out[start:end] * scale_a.float()[start:end, None] * scale_b.float()[g]
        else:             # 3d x 2d: columns of group g use batch g's row scales
            scaled[:, start:end] = out[:, start:end] * scale_a.float()[g][:, None] * scale_b.float()[start:end]
    return scaled


def _mx_pieces(x: torch.Tensor, bounds: list[tuple[int, int]] | None, split: str) -> list[tuple]:
    """Indexes of the per-group [rows, K] pieces of an operand's [..., rows, K] view: a batch
    entry of a 3d operand, a slice of rows (groups along M or N) or of K (groups along K)."""
    if x.dim() == 3:
        return [(g,) for g in range(x.shape[0])]
    if split == "rows":
        return [(slice(s, e), slice(None)) for s, e in bounds]
    return [(slice(None), slice(s, e)) for s, e in bounds]


def _mx_block_size(rows: int, k: int) -> int:
    """e8m0 scales of a [rows, K] piece in the 32_4_4 layout: [rows, ceil(K / 32)] padded to 128x4 tiles."""
    return math.ceil(rows / 128) * 128 * math.ceil(math.ceil(k / 32) / 4) * 4


def _mx_dequantize(name: str, view: torch.Tensor, scale: torch.Tensor, pieces: list[tuple]) -> torch.Tensor:
    """float32 values of an MXFP8 operand: `view` is its [..., rows, K] view, each group piece's
    e8m0 scales one 32_4_4-swizzled block (`_mx_block_size`): row `g` of a 3d operand's
    [G, blocked] scales, or, for a 2d operand, the pieces' blocks concatenated in group order
    (an empty group has none), as CUDA's MXFP8 grouped GEMM reads them."""
    parts = [view[index] for index in pieces]
    sizes = [_mx_block_size(*part.shape) for part in parts]
    if view.dim() == 2:
        if scale.numel() != sum(sizes):
            raise RuntimeError(f"_scaled_grouped_mm (MXFP8): {name} has {scale.numel()} e8m0 scales; its groups' "
                               f"32_4_4-swizzled blocks ([rows, ceil(K / 32)] each, padded to 128x4 tiles) "
                               f"take {sum(sizes)}")
        starts = [sum(sizes[:g]) for g in range(len(sizes))]
        blocks = [scale.reshape(-1)[s:s + size] for s, size in zip(starts, sizes)]
    else:
        blocks = list(scale)
    out = torch.zeros(view.shape, dtype=torch.float32)
    for index, part, grid in zip(pieces, parts, blocks):
        rows, k = part.shape
        if rows and k:
            out[index] = part.float() * _expand(_unswizzle_32_4_4(grid, rows, math.ceil(k / 32)), rows, k, 1, 32)
    return out


def _mx_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                   offs: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.Tensor:
    """MXFP8 `_scaled_grouped_mm`: both operands dequantized with their 1x32 e8m0 block scales
    (powers of two: exact in float32), one float32 grouped product, the cast."""
    bounds = None if offs is None else _group_bounds(offs)
    split = "k" if a.dim() == 2 and b.dim() == 2 else "rows"  # a 2d b's rows (N) split in 3d x 2d
    a32 = _mx_dequantize("scale_a", a, scale_a, _mx_pieces(a, bounds, split))
    b_view = b.transpose(-2, -1)  # [..., N, K]
    b32 = _mx_dequantize("scale_b", b_view, scale_b, _mx_pieces(b, bounds, split)).transpose(-2, -1)
    out = torch._grouped_mm(a32, b32, offs, out_dtype=torch.float32)
    return out.to(out_dtype or torch.bfloat16)


def _scaled_grouped(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                    offs: torch.Tensor | None, bias: torch.Tensor | None, scale_result: torch.Tensor | None,
                    out_dtype: torch.dtype | None, use_fast_accum: bool) -> torch.Tensor:
    """The host computation of both scaled grouped matmul ops, after `_scaled_grouped_mm`'s checks."""
    check_on_meta(torch.ops.aten._scaled_grouped_mm.default, a, b, scale_a, scale_b, offs, bias, scale_result,
                   out_dtype, use_fast_accum)
    if scale_a.dtype == torch.float8_e8m0fnu:
        return _mx_grouped_mm(a, b, scale_a, scale_b, offs, out_dtype)
    out = torch._grouped_mm(a.float(), b.float(), offs, out_dtype=torch.float32)
    return _scale_grouped_result(out, a, b, scale_a, scale_b, offs).to(out_dtype or torch.bfloat16)


@device_kernel("aten::_scaled_grouped_mm")
def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                      offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                      scale_result: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                      use_fast_accum: bool = False) -> torch.Tensor:
    return _scaled_grouped(a, b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)


_GROUPED_RECIPES = {(F.ScalingType.RowWise.value, F.SwizzleType.NO_SWIZZLE.value): torch.float32,
                    (F.ScalingType.BlockWise1x32.value, F.SwizzleType.SWIZZLE_32_4_4.value): torch.float8_e8m0fnu}


@device_kernel("aten::_scaled_grouped_mm_v2")
def scaled_grouped_mm_v2(a: torch.Tensor, b: torch.Tensor, scale_a: list[torch.Tensor], recipe_a: list[int],
                         swizzle_a: list[int], scale_b: list[torch.Tensor], recipe_b: list[int],
                         swizzle_b: list[int], offs: torch.Tensor | None = None, bias: torch.Tensor | None = None,
                         out_dtype: torch.dtype | None = None, contraction_dim: list[int] = (),
                         use_fast_accum: bool = False) -> torch.Tensor:
    """`F.scaled_grouped_mm`: row-wise float32 scales or MXFP8 (BlockWise1x32 e8m0 scales,
    SWIZZLE_32_4_4), the recipes CUDA's grouped GEMM has; the same kernel as `_scaled_grouped_mm`."""
    sides = []
    for name, scales, recipe, swizzle in (("a", scale_a, recipe_a, swizzle_a), ("b", scale_b, recipe_b, swizzle_b)):
        key = (recipe[0] if len(recipe) == 1 else None, swizzle[0] if swizzle else F.SwizzleType.NO_SWIZZLE.value)
        if len(scales) != 1 or key not in _GROUPED_RECIPES or scales[0].dtype != _GROUPED_RECIPES[key]:
            raise NotImplementedError(
                f"scaled_grouped_mm on neuron: scale_{name} with recipe {list(recipe)}, swizzle {list(swizzle)} and "
                f"dtypes {[s.dtype for s in scales]}; supported are ScalingType.RowWise float32 scales (no swizzle) "
                f"and ScalingType.BlockWise1x32 float8_e8m0fnu scales with SwizzleType.SWIZZLE_32_4_4 (MXFP8)")
        sides.append(key)
    if sides[0] != sides[1]:
        raise NotImplementedError(f"scaled_grouped_mm on neuron: both operands take one recipe; got {sides}")
    if contraction_dim and tuple(contraction_dim) not in ((-1, -2), (a.dim() - 1, b.dim() - 2)):
        raise NotImplementedError(f"scaled_grouped_mm on neuron: contraction_dim {list(contraction_dim)}; only "
                                  f"the last dim of mat_a with the second-to-last of mat_b is supported")
    return _scaled_grouped(a, b, scale_a[0], scale_b[0], offs, bias, None, out_dtype, use_fast_accum)


# ---- block-scaled _scaled_mm ------------------------------------------------------------------

def _unswizzle_32_4_4(scale: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[rows, cols] block scales from cuBLAS's swizzled layout: 128x4 tiles, row-major over tiles,
    each tile stored as (row % 32, row // 32, col)."""
    row_tiles, col_tiles = math.ceil(rows / 128), math.ceil(cols / 4)
    tiles = scale.reshape(row_tiles, col_tiles, 32, 4, 4)
    return tiles.permute(0, 3, 2, 1, 4).reshape(row_tiles * 128, col_tiles * 4)[:rows, :cols]


def _expand(blocks: torch.Tensor, rows: int, cols: int, block_rows: int, block_cols: int) -> torch.Tensor:
    """A [rows, cols] scale matrix: element (r, c) is blocks[r // block_rows, c // block_cols]."""
    full = blocks.float().repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return full[:rows, :cols]


def _block_scaled_mm(a: torch.Tensor, b: torch.Tensor, blocks_a: torch.Tensor, blocks_b: torch.Tensor, block_a: tuple[int, int],
                     block_b: tuple[int, int], bias: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.Tensor:
    """a [M, K] @ b [K, N] with a's block scales `blocks_a` ([ceil(M/ra), ceil(K/ca)]) and b's
    `blocks_b` ([ceil(K/rb), ceil(N/cb)]), accumulated in float32."""
    (m, k), n = a.shape, b.shape[1]
    a32 = a.float() * _expand(blocks_a, m, k, *block_a)
    b32 = b.float() * _expand(blocks_b, k, n, *block_b)
    out = a32 @ b32
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or a.dtype)


def _v1_blocks(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor):
    """The block scales of `_scaled_mm`'s block-wise layouts (as its meta function tells them
    apart), or None for tensor-wise and row-wise scales and unknown layouts (the CPU kernel's)."""
    (m, k), n = a.shape, b.shape[1]
    kb, mb, nb = math.ceil(k / 128), math.ceil(m / 128), math.ceil(n / 128)
    if scale_a.dtype == scale_b.dtype == torch.float8_e8m0fnu:  # MX: 1x32 blocks, swizzled
        k32 = math.ceil(k / 32)
        return _unswizzle_32_4_4(scale_a, m, k32), (1, 32), _unswizzle_32_4_4(scale_b, n, k32).t(), (32, 1)
    if scale_a.dim() != 2 or scale_b.dim() != 2 or scale_a.numel() == 1 or (
            tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)):
        return None
    shapes = (tuple(scale_a.shape), tuple(scale_b.shape))
    if shapes == ((m, kb), (kb, nb)):
        return scale_a, (1, 128), scale_b, (128, 128)
    if shapes == ((m, kb), (kb, n)):
        return scale_a, (1, 128), scale_b, (128, 1)
    if shapes == ((mb, kb), (kb, n)):
        return scale_a, (128, 128), scale_b, (128, 1)
    return None


def _v2_blocks(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b):
    """The block scales of `_scaled_mm_v2`'s block recipes (meta-checked layouts)."""
    (m, k), n = a.shape, b.shape[1]
    kb = math.ceil(k / 128)
    ra, rb = recipe_a[0], recipe_b[0]
    if ra == F.ScalingType.BlockWise1x32.value:
        k32 = math.ceil(k / 32)
        return (_unswizzle_32_4_4(scale_a[0], m, k32), (1, 32), _unswizzle_32_4_4(scale_b[0], n, k32).t(), (32, 1))
    sa, sb = scale_a[0], scale_b[0]
    blocks_a = sa if ra == F.ScalingType.BlockWise1x128.value else sa[:kb].t()   # [M, Kb] or [Mb, Kb]
    blocks_b = sb.t() if rb == F.ScalingType.BlockWise1x128.value else sb[:kb]   # [Kb, N] or [Kb, Nb]
    return blocks_a, _BLOCK_RECIPES[ra], blocks_b, (128, 1) if rb == F.ScalingType.BlockWise1x128.value else (128, 128)


@device_kernel("aten::_scaled_mm")
def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None = None, scale_result: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, use_fast_accum: bool = False) -> torch.Tensor:
    blocks = _v1_blocks(a, b, scale_a, scale_b) if a.dim() == 2 and b.dim() == 2 else None
    if blocks is None:  # tensor-wise and row-wise: the CPU kernel (and its errors)
        with portable_cpu_kernels():
            return torch._scaled_mm(a, b, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum)
    check_on_meta(torch.ops.aten._scaled_mm.default, a, b, scale_a, scale_b, bias, scale_result, out_dtype,
                   use_fast_accum)
    return _block_scaled_mm(a, b, blocks[0], blocks[2], blocks[1], blocks[3], bias, out_dtype)


@device_kernel("aten::_scaled_mm_v2")
def scaled_mm_v2(a: torch.Tensor, b: torch.Tensor, scale_a: list[torch.Tensor], recipe_a: list[int],
                 swizzle_a: list[int], scale_b: list[torch.Tensor], recipe_b: list[int], swizzle_b: list[int],
                 bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 contraction_dim: list[int] = (), use_fast_accum: bool = False) -> torch.Tensor:
    if not (len(recipe_a) == len(recipe_b) == 1 and recipe_a[0] in _BLOCK_RECIPES and recipe_b[0] in _BLOCK_RECIPES):
        with portable_cpu_kernels():
            return torch._scaled_mm_v2(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b, bias,
                                       out_dtype, list(contraction_dim), use_fast_accum)
    check_on_meta(torch.ops.aten._scaled_mm_v2.default, a, b, list(scale_a), recipe_a, swizzle_a, list(scale_b),
                   recipe_b, swizzle_b, bias, out_dtype, list(contraction_dim), use_fast_accum)
    blocks_a, block_a, blocks_b, block_b = _v2_blocks(a, b, scale_a, recipe_a, swizzle_a, scale_b, recipe_b, swizzle_b)
    return _block_scaled_mm(a, b, blocks_a, blocks_b, block_a, block_b, bias, out_dtype)


def install() -> None:
    register("aten::_grouped_mm", grouped_mm)
    register("aten::_scaled_grouped_mm", scaled_grouped_mm)
    register("aten::_scaled_grouped_mm_v2", scaled_grouped_mm_v2)
    register("aten::_scaled_mm", scaled_mm)
    register("aten::_scaled_mm_v2", scaled_mm_v2)
