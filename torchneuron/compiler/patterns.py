"""Substitution of recognised patterns with NKI kernels, on the graph Dynamo captured.

It runs before autograd (so a kernel's backward is its own NKI kernel, not the derivative of
a decomposition) over the torch-level graph. Each `Substitution` recognises a call and, when
the NKI kernel supports the arguments, rewrites it into calls of an op from host_stand_ins.py.

Built in: `torch.nn.functional.scaled_dot_product_attention` (without dropout or grouped
query attention, one head size for queries, keys and values, on float32/bfloat16/float16
neuron tensors, with a causal flag or an
additive/boolean mask that needs no gradient) -> `torchneuron::flash_attention`; transformers'
MoE `transformers::grouped_mm_fallback` on neuron -> `torchneuron::grouped_mm` (patterns_moe.py);
RoPE and cross-entropy (patterns_rope_ce.py) and Llama's SwiGLU MLP (patterns_norm_mlp.py) -> NKI-lib's
kernels, at the sites where the kernels' modeled price is lower (site_price.py).
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from torchneuron.compiler import host_stand_ins  # noqa: F401  (defines the torchneuron:: ops)
from torchneuron.compiler import patterns_moe
from torchneuron.compiler import patterns_norm_mlp, patterns_rope_ce
from torchneuron.compiler.substitution import FLOAT_TYPES, Substitution  # noqa: F401  (part of this API)
from torchneuron.compiler.substitution import example_value as _example

SDPA_TARGETS = (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention)


def _sdpa_arguments(node: Node) -> dict[str, Any]:
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
    bound = dict(zip(names, node.args))
    bound.update(node.kwargs)
    return bound


def _is_flash_attention(node: Node) -> bool:
    if node.op != "call_function" or node.target not in SDPA_TARGETS:
        return False
    args = _sdpa_arguments(node)
    if args.get("dropout_p", 0.0) != 0.0 or args.get("enable_gqa", False):
        return False
    if not all(isinstance(args.get(k), (bool, type(None))) for k in ("is_causal",)):
        return False
    if not isinstance(args.get("scale"), (float, int, type(None))):
        return False
    q, k, v = (_example(args[name]) for name in ("query", "key", "value"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and t.device.type == "neuron" and t.dtype == q.dtype
               for t in (q, k, v)):
        return False
    if q.dtype not in FLOAT_TYPES or k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        return False
    # The kernel has one head size for q, k and v: attention whose values have another head size
    # than its queries (DeepSeek's multi-head latent attention) stays scaled_dot_product_attention.
    if not q.shape[-1] == k.shape[-1] == v.shape[-1]:
        return False
    mask = args.get("attn_mask")
    if mask is not None:
        example = _example(mask)
        if not isinstance(example, torch.Tensor) or example.requires_grad:
            return False
        if example.dtype not in (torch.bool, q.dtype) or args.get("is_causal"):
            return False
    return True


def _rewrite_flash_attention(node: Node) -> Node:
    args = _sdpa_arguments(node)
    graph = node.graph
    mask = args.get("attn_mask")
    with graph.inserting_before(node):
        example = _example(mask)
        if isinstance(example, torch.Tensor) and example.dtype == torch.bool:
            # The kernel adds its mask to the scores: True (attend) -> 0, False -> -inf, as
            # scaled_dot_product_attention converts a boolean mask itself.
            additive = graph.call_function(torch.where, (mask, 0.0, float("-inf")))
            mask = graph.call_method("to", (additive, _example(args["query"]).dtype))
        fused = graph.call_function(torch.ops.torchneuron.flash_attention.default,
                                    (args["query"], args["key"], args["value"], mask,
                                     bool(args.get("is_causal") or False), args.get("scale")))
        out = graph.call_function(operator.getitem, (fused, 0))
    example = _example(node)
    if example is not None:
        out.meta["example_value"] = example
    return out


SUBSTITUTIONS: list[Substitution] = [
    Substitution("flash_attention", _is_flash_attention, _rewrite_flash_attention),
    Substitution("grouped_mm", patterns_moe.is_grouped_mm_fallback, patterns_moe.rewrite_grouped_mm_fallback),
]
SUBSTITUTIONS += patterns_rope_ce.SUBSTITUTIONS + patterns_norm_mlp.SUBSTITUTIONS


def _erase_unused(graph: torch.fx.Graph, nodes: list[Node]) -> None:
    """Erases the nodes a rewrite left without users, and their inputs left so, recursively
    (what the replaced pattern computed: the kernel computes it now)."""
    stack, erased = list(nodes), set()
    while stack:
        node = stack.pop()
        if node in erased or node.users or node.op not in ("call_function", "call_method") or node.is_impure():
            continue  # (a node two erased nodes read is on the stack twice)
        stack.extend(node.all_input_nodes)
        graph.erase_node(node)
        erased.add(node)


def substitute(gm: GraphModule) -> dict[str, int]:
    """Applies every substitution to the graph; returns how often each applied."""
    counts = {s.name: 0 for s in SUBSTITUTIONS}
    live = set(gm.graph.nodes)
    for node in list(gm.graph.nodes):
        if node not in live:  # erased by an earlier rewrite
            continue
        for substitution in SUBSTITUTIONS:
            if substitution.matches(node):
                replacement = substitution.rewrite(node)
                node.replace_all_uses_with(replacement)
                inputs = node.all_input_nodes
                gm.graph.erase_node(node)
                _erase_unused(gm.graph, inputs)
                counts[substitution.name] += 1
                live = set(gm.graph.nodes)
                break
    if any(counts.values()):
        gm.recompile()
    return counts
