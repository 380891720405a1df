"""Substitution of RMSNorm + projections and Llama's SwiGLU MLP with NKI-lib's kernels on the Dynamo graph.

patterns.py runs these `Substitution`s before autograd (so backward is the kernels' own):

- transformers' LlamaRMSNorm whose output only bias-free projections read (q/k/v after the input
  norm, gate/up after the post-attention norm) -> `kernels.norm_mlp_ops.rmsnorm_linear`
  (`nki_kernels::rmsnorm_linear_fwd` / `_bwd`: the normalised x stays in SBUF, one matmul over
  the stacked weights); not where its projections are the gate and up of a SwiGLU MLP substituted;
- transformers' LlamaMLP, `down_proj(act_fn(gate_proj(x)) * up_proj(x))` with SiLU and no biases,
i.e. `F.linear(F.silu(F.linear(x, Wg)) * F.linear(x, Wu), Wd)` (either operand order of the
product), where nothing else reads the gate, up, SiLU or product nodes ->
`kernels.norm_mlp_ops.swiglu_mlp` (`nki_kernels::swiglu_fwd` / `swiglu_bwd`): the [tokens, F]
intermediates never go to HBM.

Only neuron tensors of static shape and one float dtype that the kernels take (tokens, hidden
and intermediate sizes multiples of 128, the hidden size fitting SBUF) are substituted;
otherwise the graph is left alone. A matched site is substituted where the kernels' modeled plan is
cheaper than the generic ops' (site_price.py; TORCHNEURON_COMPILE_ROPE_CE_KERNELS=1: wherever the
kernels apply, =0: never).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import Node

from torchneuron.compiler import site_price
from torchneuron.compiler.patterns_rope_ce import ADD, LINEAR, MUL, _call, _enabled, _linear_bias, _products, _static_neuron
from torchneuron.compiler.substitution import example_value
from torchneuron.compiler.substitution import Substitution
from torchneuron.kernels import norm_mlp as nm
from torchneuron.kernels import norm_mlp_ops
from torchneuron.nki import typing as nt

SILU = (F.silu, torch._C._nn.silu)


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
    return site_price.kernel_chosen("swiglu", norm_mlp_ops.swiglu_reference, norm_mlp_ops.swiglu_mlp, (x, wg, wu, wd))


def _rewrite_swiglu(node: Node) -> Node:
    with node.graph.inserting_before(node):
        out = node.graph.call_function(norm_mlp_ops.swiglu_mlp, swiglu_operands(node))
    out.meta["example_value"] = example_value(node)
    return out


# -- RMSNorm + projections --------------------------------------------------------------------------
def _method(node: Any, name: str) -> bool:
    return isinstance(node, Node) and node.op == "call_method" and node.target == name


def _cast_dtype(node: Any) -> torch.dtype | None:
    """d when node is t.to(d) (a dtype only), else None."""
    if not _method(node, "to"):
        return None
    if len(node.args) == 2 and isinstance(node.args[1], torch.dtype) and not node.kwargs:
        return node.args[1]
    if len(node.args) == 1 and set(node.kwargs) == {"dtype"}:
        return node.kwargs["dtype"]
    return None


def _inverse_rms(node: Any, upcast: Node) -> float | None:
    """eps when node is torch.rsqrt(upcast.pow(2).mean(-1, keepdim=True) + eps), read once, else None."""
    if not _call(node, (torch.rsqrt,)) or len(node.users) != 1:
        return None
    add = node.args[0]
    if not _call(add, ADD) or len(add.users) != 1 or len(add.args) != 2 or not isinstance(add.args[1], float):
        return None
    mean, eps = add.args
    if not _method(mean, "mean") or len(mean.users) != 1 or mean.args[1:] not in ((-1,), ([-1],)) \
            or mean.kwargs != {"keepdim": True}:
        return None
    square = mean.args[0]
    if not _method(square, "pow") or len(square.users) != 1 or square.args != (upcast, 2) or square.kwargs:
        return None
    return eps


def rmsnorm_operands(node: Node) -> tuple[Node, Node, float] | None:
    """(x, w_norm, eps) when node is transformers' LlamaRMSNorm of x:
    `w_norm * (x.to(float32) * rsqrt(x.to(float32).pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)`."""
    for w_norm, cast in _products(node):
        if _cast_dtype(cast) is None or len(cast.users) != 1:
            continue
        scaled = cast.args[0]
        for upcast, inverse in _products(scaled):
            if len(scaled.users) != 1 or _cast_dtype(upcast) != torch.float32 or len(upcast.users) != 2:
                continue
            eps = _inverse_rms(inverse, upcast)
            x = upcast.args[0]
            if eps is not None and isinstance(x, Node) and getattr(example_value(x), "dtype", None) == _cast_dtype(cast):
                return x, w_norm, eps
    return None


def _projections(node: Node) -> list[Node] | None:
    """The bias-free F.linear(node, W) calls that are all node's readers (W a graph input), else None."""
    users = list(node.users)
    if not users or not all(_call(u, LINEAR) and u.args[0] is node and _linear_bias(u) is None
                            and isinstance(u.args[1], Node) and u.args[1].op in ("placeholder", "get_attr")
                            for u in users):
        return None
    return users


def _feeds_swiglu(projections: list[Node]) -> bool:
    """Whether the projections are the gate and up of a SwiGLU MLP its kernel takes (that
    substitution keeps the [tokens, F] intermediates on chip; the norm's then stays generic)."""
    for projection in projections:
        for reader in [projection, *projection.users]:  # the up projection, or the SiLU of the gate
            for product in reader.users:
                if _call(product, MUL) and len(product.users) == 1 and _is_swiglu(next(iter(product.users))):
                    return True
    return False


def _norm_projections_reference(x: torch.Tensor, w_norm: torch.Tensor, *weights_and_eps: Any) -> tuple:
    *weights, eps = weights_and_eps
    normed = norm_mlp_ops.rmsnorm_reference(x, w_norm, eps)
    return tuple(F.linear(normed, w) for w in weights)


def _norm_projections_kernel(x: torch.Tensor, w_norm: torch.Tensor, *weights_and_eps: Any) -> tuple:
    *weights, eps = weights_and_eps
    return norm_mlp_ops.rmsnorm_linear(x, w_norm, weights, eps)


def _is_rmsnorm_linear(node: Node) -> bool:
    operands = rmsnorm_operands(node) if _enabled() else None
    projections = _projections(node) if operands is not None else None
    if projections is None:
        return False
    x, w_norm, eps = operands
    tensors = [example_value(n) for n in (x, w_norm, *(p.args[1] for p in projections))]
    if not all(_static_neuron(t) for t in tensors) or len({t.dtype for t in tensors}) != 1:
        return False
    xv, wv, weights = tensors[0], tensors[1], tensors[2:]
    d = xv.shape[-1]
    if tuple(wv.shape) != (d,) or any(w.dim() != 2 or w.shape[1] != d for w in weights):
        return False
    stacked = nt.tensor[(sum(w.shape[0] for w in weights), d), xv.dtype]
    try:
        nm.check_rmsnorm_linear(nt.tensor[(xv.numel() // max(1, d), d), xv.dtype], nt.tensor[(1, d), xv.dtype], stacked)
    except nm.UnsupportedInput:
        return False
    if _feeds_swiglu(projections):  # (after the cheap checks: it may price the SwiGLU site)
        return False
    return site_price.kernel_chosen("rmsnorm_linear", _norm_projections_reference, _norm_projections_kernel, tensors,
                                    (eps,))


def _rewrite_rmsnorm_linear(node: Node) -> Node:
    """One fused call before the first projection; each projection becomes one of its outputs."""
    x, w_norm, eps = rmsnorm_operands(node)
    projections = _projections(node)
    graph = node.graph
    with graph.inserting_before(projections[0]):
        fused = graph.call_function(norm_mlp_ops.rmsnorm_linear, (x, w_norm, [p.args[1] for p in projections], eps))
        outputs = [graph.call_function(operator.getitem, (fused, i)) for i in range(len(projections))]
    for projection, out in zip(projections, outputs):
        out.meta["example_value"] = example_value(projection)
        projection.replace_all_uses_with(out)
        graph.erase_node(projection)
    return outputs[0]  # the norm has no reader left


SUBSTITUTIONS = [Substitution("rmsnorm_linear", _is_rmsnorm_linear, _rewrite_rmsnorm_linear),
                 Substitution("swiglu", _is_swiglu, _rewrite_swiglu)]
