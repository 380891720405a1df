"""Decompositions: the table AOTAutograd uses to lower a captured graph to the core op set.

The core op set is what the rest of the pipeline understands: ATen's core ops and prims
(pointwise, reductions, matmuls, views, indexing), plus the ops the NeuronCore runs as whole
kernels. The table is Inductor's (so every op that remains has a lowering or a fallback),
minus:

- ops kept whole because they are one NKI kernel or a fused device kernel
  (`KEEP_WHOLE`);
- random decompositions: random ops stay the ops eager runs, drawing the same numbers from
  the device generator as eager does with the same seed (Inductor's `fallback_random`).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

aten = torch.ops.aten

# Never decompose these: each is a single NeuronCore kernel in the plan.
KEEP_WHOLE: tuple[Any, ...] = (
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
    aten.native_dropout.default,
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


def for_compile_fx() -> dict[Any, Callable[..., Any]] | None:
    """What to pass as compile_fx's `decompositions`: None when the table equals Inductor's own
    under the neuron configuration (then Inductor selects it itself and its on-disk cache keys
    stay picklable), the table otherwise."""
    inductor = _inductor_table()
    return None if not any(op in inductor for op in KEEP_WHOLE) else core_decompositions()
