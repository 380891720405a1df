"""Device time of the RMSNorm + projection and SwiGLU ops from their NKI kernels' simulated latency.

`install()` registers `norm_mlp_seconds` for the performance model's category "nki_norm_mlp"
(`nki_kernels::rmsnorm_linear_fwd` / `_bwd`, `swiglu_fwd` / `swiglu_bwd`), so the ops, eager
and in compiled graphs, are charged what kernels/norm_mlp.py's kernels take on the modeled
NeuronCore. Kernels run timing-only (typed placeholders), cached per shape, dtype and target.
Problems too large to simulate whole are extended linearly from two smaller runs (assumptions):
- token blocks are alike (the same instructions on another block's rows, the weights streamed
  again): linear in the tokens past two blocks, fitted from one and two;
- the streamed weight chunks of a block are alike: RMSNorm + linear is linear in its outputs N
  past `FIT_OUTPUTS`, SwiGLU in its intermediate size F past `FIT_INTERMEDIATE`.
Operands the kernels refuse return None and keep the formula's price.
"""
from __future__ import annotations

import functools
from typing import Sequence

import torch

from ..hardware import model as _model
from ..hardware.targets import Target
from ..nki import typing as nt
from . import norm_mlp as nm
from .pricing_rope_ce import _extend
from .rope_ce_ops import FLOAT_TYPES

SIM_MATMUL_TILES = 4096          # 128 x 128 x 512 matmul tiles up to which a kernel is simulated whole
FIT_OUTPUTS = (2048, 4096)   # narrower runs are not yet linear in N (T=512, D=256 bwd: +9 us 1k->2k, +22 us 2k->4k)
FIT_INTERMEDIATE = (512, 1024)


@functools.lru_cache(maxsize=256)
def _run(target: Target, name: str, t: int, d: int, n: int, dtype: torch.dtype) -> float:
    """Timing-only latency of one kernel: n is N (RMSNorm + linear) or F (SwiGLU)."""
    x, f32 = nt.tensor[(t, d), dtype], torch.float32
    if name.startswith("rmsnorm_linear"):
        args = (x, nt.tensor[(1, d), dtype], nt.tensor[(n, d), dtype])
        if name.endswith("bwd"):
            args += (nt.tensor[(t, 1), f32], nt.tensor[(t, n), dtype])
        kernel = nm.rmsnorm_linear_bwd if name.endswith("bwd") else nm.rmsnorm_linear_fwd
    else:
        args = (x, nt.tensor[(n, d), dtype], nt.tensor[(n, d), dtype], nt.tensor[(d, n), dtype])
        if name.endswith("bwd"):
            args += (x,)
        kernel = nm.swiglu_bwd if name.endswith("bwd") else nm.swiglu_fwd
    return kernel.run(args, {}, target=target)[1].latency_s


def _block_tokens(name: str, t: int, d: int, n: int, itemsize: int) -> int:
    if name.startswith("rmsnorm_linear"):
        return nm.rmsnorm_linear_tiles(t, d, n, itemsize, backward=name.endswith("bwd")) * nm.P
    return nm.swiglu_tiles(t, d, itemsize, backward=name.endswith("bwd")) * nm.P


def kernel_seconds(target: Target, name: str, t: int, d: int, n: int, dtype: torch.dtype) -> float:
    """Modeled latency of kernel `name` ("rmsnorm_linear_fwd", ..., "swiglu_bwd") over T = t
    tokens, hidden size d and N / F = n: simulated whole when small, else extended (module doc)."""
    fits = FIT_OUTPUTS if name.startswith("rmsnorm_linear") else FIT_INTERMEDIATE

    def tiles(tokens: int, width: int) -> int:
        return tokens // nm.P * (d // nm.P) * -(-width // nm.CHUNK)

    def at(tokens: int) -> float:
        if tiles(tokens, n) <= SIM_MATMUL_TILES or n <= fits[1]:
            return _run(target, name, tokens, d, n, dtype)
        return _extend(lambda width: _run(target, name, tokens, d, width, dtype), n, *fits)

    block = _block_tokens(name, t, d, n, dtype.itemsize)
    if tiles(t, n) <= SIM_MATMUL_TILES or t <= 2 * block:
        return at(t)
    return _extend(at, t, block, 2 * block)


def norm_mlp_seconds(target: Target, name: str, ins: Sequence, outs: Sequence) -> float | None:
    """The pricer of the four ops (their tensor operands in order): None for operands the kernels
    refuse."""
    if len(ins) < 3 or ins[0][0] not in FLOAT_TYPES or any(dtype != ins[0][0] for dtype, _ in ins[:3]):
        return None
    placeholders = [nt.tensor[shape, dtype] for dtype, shape in ins]
    try:
        if name.startswith("rmsnorm_linear"):
            t, d, n = nm.check_rmsnorm_linear(*placeholders[:3], what=name)
        elif name.startswith("swiglu") and len(ins) >= 4:
            t, d, n = nm.check_swiglu(*placeholders[:4], what=name)
        else:
            return None
    except ValueError:
        return None
    return kernel_seconds(target, name, t, d, n, ins[0][0])


def install() -> None:
    """Price the RMSNorm + linear and SwiGLU ops by their NKI kernels (at torchneuron's import)."""
    _model.register_kernel_pricer("nki_norm_mlp", norm_mlp_seconds)


__all__ = ["install", "kernel_seconds", "norm_mlp_seconds"]
