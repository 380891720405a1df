"""Lowerings the neuron compiler adds to Inductor's table: calling an op's eager kernel."""
from __future__ import annotations

import torch


def register_eager_kernel_lowering(target: torch._ops.OpOverload) -> None:
    """Gives Inductor a lowering that calls `target`'s eager kernel, with the layout constraint
    Inductor's implicit fallback would choose for a forward graph (its kernels take any strides).
    Registered here because the implicit path refuses, when the `CI` environment variable is set,
    any op that has a decomposition, and the neuron compiler keeps some such ops whole on purpose
    (decompositions.KEEP_WHOLE, adaptive eager's eager_numerics)."""
    from torch._inductor.lowering import make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    constraint = tag_to_layout_constraint(get_layout_constraint_tag(target, with_default=True))
    make_fallback(target, layout_constraint=constraint, warn=False, override_decomp=True)
