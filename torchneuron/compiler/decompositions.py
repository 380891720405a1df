"""Decompositions: the table AOTAutograd uses to lower a captured graph to the core op set.

The core op set is what the rest of the pipeline understands: ATen's core ops and prims
(pointwise, reductions, matmuls, views, indexing), plus the ops the NeuronCore runs as whole
kernels. The table is Inductor's (so every op that remains has a lowering or a fallback),
minus:

- ops kept whole because they are one NKI kernel, a fused device kernel or one activation
  instruction (`KEEP_WHOLE`); Inductor's code for the host calls their eager kernels, so their
  results are eager's too;
- random decompositions: random ops stay the ops eager runs, drawing the same numbers from
  the device generator as eager does with the same seed (Inductor's `fallback_random`).

Adaptive eager's fused programs (`program_decompositions`) keep whole every op they call as the
eager kernel (eager_numerics.py), and turn foreach ops taking a list of scalars into their
overloads taking a list of 0-d tensors, where that rounds as eager does: an optimizer's bias
corrections arrive as such a list, and Inductor has no lowering for these overloads, so they
would run as ATen calls, tensor by tensor, instead of fusing with the update around them.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten

# Never decompose these: each is a single NeuronCore kernel in the plan (attention, dropout), or a
# single instruction of the Scalar engine, whose activation functions include GELU and SiLU and
# their derivatives (decomposed, they would be priced as a chain of Vector-engine instructions).
KEEP_WHOLE: tuple[Any, ...] = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten.native_dropout.default,
    aten.gelu.default,
    aten.gelu_backward.default,
    aten.silu.default,
    aten.silu_backward.default,
)


def _inductor_table() -> dict[Any, Callable[..., Any]]:
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    with inductor_config.patch(fallback_random=True):
        return select_decomp_table()


def core_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table of the neuron compiler (a fresh dict)."""
    table = dict(_inductor_table())
    for op in KEEP_WHOLE:
        table.pop(op, None)
    return table


_FULL_PRECISION = (torch.float32, torch.float64)


def _scalar_tensors(tensors: list[torch.Tensor], scalars: list) -> list[torch.Tensor] | None:
    """The scalars as 0-d tensors of the tensors' dtype, as ATen's kernels read them; None unless
    every tensor is full-precision float (other dtypes round or promote a scalar differently)."""
    if any(t.dtype not in _FULL_PRECISION for t in tensors):
        return None
    return [torch.full((), s, dtype=t.dtype, device=t.device) for t, s in zip(tensors, scalars)]


def _as_list_op(list_op: Any) -> Callable[..., Any]:
    """`_foreach_<op>.ScalarList(tensors, scalars)` as `list_op(tensors, scalar_tensors)`."""
    def decomposition(tensors: list[torch.Tensor], scalars: list) -> Any:
        scalar_tensors = _scalar_tensors(tensors, scalars)
        return NotImplemented if scalar_tensors is None else list_op(tensors, scalar_tensors)

    return decomposition


def _addcdiv(tensors: list[torch.Tensor], t1: list[torch.Tensor], t2: list[torch.Tensor], scalars: list) -> Any:
    """ATen's CPU order, `self + value * t1 / t2` left to right (Inductor's lowering divides first)."""
    scalar_tensors = _scalar_tensors(tensors, scalars)
    if scalar_tensors is None:
        return NotImplemented
    return aten._foreach_add.List(tensors, aten._foreach_div.List(aten._foreach_mul.List(t1, scalar_tensors), t2))


# ScalarList overloads (functional: programs are traced without mutations) on float32 and float64
# tensors -> the List overloads, which Inductor fuses into one multi-tensor kernel. Not addcmul:
# ATen's float32 kernel fuses its last multiply-add, which no ATen op expresses.
_SCALAR_LIST_OPS: dict[Any, Callable[..., Any]] = {
    aten._foreach_add.ScalarList: _as_list_op(aten._foreach_add.List),
    aten._foreach_sub.ScalarList: _as_list_op(aten._foreach_sub.List),
    aten._foreach_mul.ScalarList: _as_list_op(aten._foreach_mul.List),
    aten._foreach_div.ScalarList: _as_list_op(aten._foreach_div.List),
    aten._foreach_clamp_min.ScalarList: _as_list_op(aten._foreach_clamp_min.List),
    aten._foreach_clamp_max.ScalarList: _as_list_op(aten._foreach_clamp_max.List),
    aten._foreach_maximum.ScalarList: _as_list_op(aten._foreach_maximum.List),
    aten._foreach_minimum.ScalarList: _as_list_op(aten._foreach_minimum.List),
    aten._foreach_addcdiv.ScalarList: _addcdiv,
}


def _round_decimals(x: torch.Tensor, decimals: int = 0) -> Any:
    """ATen's CPU kernel step by step: in float32 for half-precision inputs, a true division by
    the power of ten (Inductor's decomposition multiplies by its reciprocal; kept whole, the op
    trips Inductor's no-op removal)."""
    if not x.is_floating_point():
        return NotImplemented
    scale = 10.0 ** abs(decimals)
    y = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = aten.mul(aten.round(aten.div(y, scale)), scale) if decimals < 0 else \
        aten.div(aten.round(aten.mul(y, scale)), scale)
    return y.to(x.dtype)


# Decompositions of the programs only (the float ones rounding as the eager kernels do).
_PROGRAM_ONLY: dict[Any, Callable[..., Any]] = {**_SCALAR_LIST_OPS, aten.round.decimals: _round_decimals}


def program_decompositions() -> dict[Any, Callable[..., Any]]:
    """The table of adaptive eager's programs: the core table without the ops a program calls as
    the eager kernel, with foreach ops over lists of scalars as their overloads over lists of 0-d
    tensors, and rounding to decimals as ATen computes it (a fresh dict)."""
    from torchneuron.compiler.eager_numerics import program_table

    return {**program_table(core_decompositions()), **_PROGRAM_ONLY}


class _CoreTable(dict):
    """The core table as compile_fx's `decompositions`. Inductor pickles its compile options into
    its on-disk cache keys, and some decompositions are C++ functions, which do not pickle: this
    table pickles as the function that builds it (what it holds is part of the pipeline's
    VERSION, which the cache keys include too)."""

    def __reduce__(self) -> tuple:
        return core_decompositions, ()


def for_compile_fx() -> dict[Any, Callable[..., Any]] | None:
    """What to pass as compile_fx's `decompositions`: None when the table equals Inductor's own
    under the neuron configuration (then Inductor selects it itself), the core table otherwise."""
    inductor = _inductor_table()
    return None if not any(op in inductor for op in KEEP_WHOLE) else _CoreTable(core_decompositions())
