"""Substitution of Llama's SwiGLU MLP with the NKI-lib SwiGLU kernels on the Dynamo graph.

patterns.py runs this `Substitution` before autograd (so backward is the kernel's own):
transformers' LlamaMLP, `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with SiLU and no biases,
i.e. `F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)` (either operand order of the
product), where nothing else reads the gate, up, SiLU or product nodes ->
`kernels.norm_mlp_ops.swiglu_mlp` (`nki_kernels::swiglu_fwd` / `swiglu_bwd`): the [tokens, F]
intermediates never go to HBM.

Only neuron tensors of static shape and one float dtype that the kernels take (tokens, hidden
and intermediate sizes multiples of 128, the hidden size fitting SBUF) are substituted;
otherwise the graph is left alone. Off unless TORCHNEURON_COMPILE_ROPE_CE_KERNELS=1 (the switch
of the NKI-lib substitutions that are not yet a modeled win at every size).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from torchneuron.compiler.patterns_rope_ce import LINEAR, MUL, _call, _enabled, _static_neuron
from torchneuron.compiler.substitution import example_value
from torchneuron.compiler.substitution import Substitution
from torchneuron.kernels import norm_mlp as nm
from torchneuron.kernels import norm_mlp_ops
from torchneuron.nki import typing as nt

SILU = (F.silu, torch._C._nn.silu)


def _linear_bias(node: Node) -> Any:
    """The bias argument of an F.linear call node (None when it has none)."""
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def _bias_free_linear(node: Any) -> tuple[Any, Any] | None:
    """(input, weight) of F.linear(input, weight) without bias read by one node only, else None."""
    if not _call(node, LINEAR) or len(node.users) != 1 or _linear_bias(node) is not None:
        return None
    return node.args[0], node.args[1]


def _silu_input(node: Any) -> Any:
    """x when node is F.silu(x) (not in place) read by one node only, else None."""
    if not _call(node, SILU) or len(node.users) != 1:
        return None
    inplace = node.args[1] if len(node.args) > 1 else node.kwargs.get("inplace", False)
    return None if inplace else node.args[0]


def swiglu_operands(node: Node) -> tuple[Node, Node, Node, Node] | None:
    """(x, Wg, Wu, Wd) when node is F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)."""
    if not _call(node, LINEAR):
        return None
    product, wd = node.args[0], node.args[1]
    if _linear_bias(node) is not None or not _call(product, MUL) or len(product.users) != 1 or len(product.args) != 2 \
            or product.kwargs:
        return None
    for gated, up in (product.args, product.args[::-1]):
        gate = _bias_free_linear(_silu_input(gated))
        up_proj = _bias_free_linear(up)
        if gate is not None and up_proj is not None and gate[0] is up_proj[0]:
            return gate[0], gate[1], up_proj[1], wd
    return None


def _is_swiglu(node: Node) -> bool:
    operands = swiglu_operands(node) if _enabled() else None
    if operands is None:
        return False
    x, wg, wu, wd = (example_value(n) for n in operands)
    if not all(_static_neuron(t) for t in (x, wg, wu, wd)) or len({t.dtype for t in (x, wg, wu, wd)}) != 1:
        return False
    d = x.shape[-1]
    try:
        nm.check_swiglu(nt.tensor[(x.numel() // max(1, d), d), x.dtype], wg, wu, wd)
    except nm.UnsupportedInput:
        return False
    return True


def _rewrite_swiglu(node: Node) -> Node:
    with node.graph.inserting_before(node):
        out = node.graph.call_function(norm_mlp_ops.swiglu_mlp, swiglu_operands(node))
    out.meta["example_value"] = example_value(node)
    return out


SUBSTITUTIONS = [Substitution("swiglu", _is_swiglu, _rewrite_swiglu)]
