"""FlexAttention on the neuron device, eager and compiled.

- `enable()` lets `torch.nn.attention.flex_attention` accept neuron tensors, for forward
  and backward (PyTorch checks a fixed list of device types; on neuron, eager FlexAttention
  runs PyTorch's reference implementation through the runtime).
- `decompose(gm)` replaces the `flex_attention` and `flex_attention_backward` higher-order
  ops of a post-autograd graph by the ATen ops of that same reference implementation, with
  `score_mod` and the block mask's `mask_mod` inlined, so compiled results match eager.
  The inlined nodes are tagged (`NKI_META_KEY`) so the kernel plan prices each call as one
  NKI flash-attention kernel, not as the materialised score matrix.
"""
from __future__ import annotations

import contextlib
import itertools
import operator
from typing import Any

import torch
from torch.fx import GraphModule, Node

NKI_META_KEY = "torchneuron_nki_kernel"   # node.meta: the NKI kernel call a node belongs to
NKI_OPS_KEY = "torchneuron_nki_ops"       # gm.meta: NKI kernel call -> the OpSpec it is priced as
# The ops of the performance model whose cost an NKI flash-attention kernel has.
PRICED_AS = {"flex_attention": "aten::_scaled_dot_product_flash_attention",
             "flex_attention_backward": "aten::_scaled_dot_product_flash_attention_backward"}
_ids = itertools.count()


def enable() -> None:
    """Accept neuron tensors in torch.nn.attention.flex_attention (idempotent)."""
    import torch.nn.attention.flex_attention as flex

    original = flex._validate_device
    if getattr(original, "_torchneuron", False):
        return

    def validate_device(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type == "neuron" and key.device.type == "neuron" and value.device.type == "neuron":
            return
        original(query, key, value)

    validate_device._torchneuron = True  # type: ignore[attr-defined]
    flex._validate_device = validate_device


def _hops() -> dict[Any, Any]:
    from torch._higher_order_ops.flex_attention import (
        flex_attention, flex_attention_backward, sdpa_dense, sdpa_dense_backward,
    )

    return {flex_attention: ("flex_attention", sdpa_dense),
            flex_attention_backward: ("flex_attention_backward", sdpa_dense_backward)}


def _batchable(subgraph: GraphModule) -> GraphModule:
    """A copy of a score_mod/mask_mod subgraph whose casts are aten ops: the reference
    implementation vmaps it, and prims casts have no batching rule (vmap would unroll them
    element by element)."""
    copy = GraphModule(subgraph, copy_graph(subgraph.graph))
    for node in copy.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.prims.convert_element_type.default:
            node.target = torch.ops.aten._to_copy.default
            node.args, node.kwargs = (node.args[0],), {"dtype": node.args[1]}
    copy.recompile()
    return copy


def copy_graph(graph: torch.fx.Graph) -> torch.fx.Graph:
    new = torch.fx.Graph()
    output = new.graph_copy(graph, {})
    new.output(output)
    return new


def _materialize(gm: GraphModule, arg: Any) -> Any:
    """Graph arguments -> values for the reference implementation (subgraphs become modules)."""
    if isinstance(arg, Node):
        if arg.op == "get_attr":
            value = getattr(gm, arg.target)
            return _batchable(value) if isinstance(value, GraphModule) else value
        return arg.meta["val"]
    if isinstance(arg, (tuple, list)):
        return type(arg)(_materialize(gm, a) for a in arg)
    return arg


def _inline(gm: GraphModule, node: Node, traced: GraphModule, tensor_args: list[Node], tag: str) -> None:
    """Copies `traced` into `gm` before `node` (its placeholders are `tensor_args`) and makes the
    users of `node` use the copy's outputs."""
    env: dict[Node, Any] = {}
    placeholders = iter(tensor_args)
    output = None
    with gm.graph.inserting_before(node):
        for inner in traced.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "output":
                output = torch.fx.node.map_arg(inner.args[0], lambda n: env[n])
            elif inner.op == "get_attr":
                name = f"_flex_const_{next(_ids)}"
                value = getattr(traced, inner.target)
                if isinstance(value, torch.nn.Module):
                    gm.add_submodule(name, value)
                elif isinstance(value, torch.Tensor):
                    gm.register_buffer(name, value)
                else:
                    setattr(gm, name, value)
                env[inner] = gm.graph.get_attr(name)
                env[inner].meta.update(inner.meta)
            else:
                env[inner] = gm.graph.node_copy(inner, lambda n: env[n])
                env[inner].meta[NKI_META_KEY] = tag
    for user in list(node.users):
        if user.op == "call_function" and user.target is operator.getitem:
            user.replace_all_uses_with(output[user.args[1]])
            gm.graph.erase_node(user)
    if node.users:
        raise RuntimeError(f"flex attention node {node.name} has users other than getitem")
    gm.graph.erase_node(node)


def _priced_op(name: str, tensors: list[torch.Tensor], outputs: Any) -> Any:
    """The flash-attention op a FlexAttention call is priced as: forward (q, k, v) -> (out, lse);
    backward (grad_out, q, k, v, out, lse) -> (dq, dk, dv)."""
    from torchneuron.compiler.plan import OpSpec, TensorSpec

    if name == "flex_attention":
        inputs = tensors[:3]
    else:  # flex_attention_backward(query, key, value, out, logsumexp, grad_out, ...)
        inputs = [tensors[5]] + tensors[:5]
    leaves = [t for t in torch.utils._pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    return OpSpec(PRICED_AS[name], tuple(map(TensorSpec.of, inputs)), tuple(map(TensorSpec.of, leaves[:3])))


def decompose(gm: GraphModule) -> int:
    """Replaces FlexAttention higher-order ops by their reference ATen implementation."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchneuron.compiler.decompositions import core_decompositions

    hops = _hops()
    count = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in hops:
            continue
        name, reference = hops[node.target]
        values = _materialize(gm, node.args)
        flat, spec = torch.utils._pytree.tree_flatten(values)
        arg_nodes, _ = torch.utils._pytree.tree_flatten(
            torch.fx.node.map_arg(node.args, lambda n: n))
        positions = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
        tensor_nodes = [arg_nodes[i] for i in positions]

        def run(*tensors: torch.Tensor) -> Any:
            leaves = list(flat)
            for i, t in zip(positions, tensors):
                leaves[i] = t
            return reference(*torch.utils._pytree.tree_unflatten(leaves, spec))

        tensors = [flat[i] for i in positions]
        with torch._guards.detect_fake_mode(tensors) or contextlib.nullcontext():
            traced = make_fx(run, decomposition_table=core_decompositions(), tracing_mode="real")(*tensors)
        tag = f"{name}_{next(_ids)}"
        gm.meta.setdefault(NKI_OPS_KEY, {})[tag] = _priced_op(name, tensors, node.meta["val"])
        _inline(gm, node, traced, tensor_nodes, tag)
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count
