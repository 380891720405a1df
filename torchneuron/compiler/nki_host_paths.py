"""NKI-lib ops in a compiled graph run as their host paths, inlined as ATen ops.

An `nki_kernels::*` op (RoPE, the cross-entropy kernels) substituted into a graph by
patterns_rope_ce.py is one kernel of the graph's plan, priced as that NKI kernel (its simulated
latency, kernels/pricing_rope_ce.py). Called as an op from the generated code it would charge
the device timeline itself on top of the plan, and run through the custom op's Python layers on
every call. So once the plan is built, `inline(gm)` replaces each such op by the ATen ops of its
host path (the kernel's numerics: fp32 arithmetic, one rounding), traced on the node's fake
values: Inductor generates host code for them like for the rest of the graph.
"""
from __future__ import annotations

import contextlib
import operator
from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

from torchneuron.kernels import cross_entropy as ce
from torchneuron.kernels import rope as rp
from torchneuron.kernels import rope_ce_ops  # noqa: F401  (defines the nki_kernels:: ops)


def host_paths() -> dict[Any, Callable[..., Any]]:
    """op overload -> the host implementation with the kernel's numerics."""
    ops = torch.ops.nki_kernels
    return {ops.rope.default: rp.host, ops.linear_ce_fwd.default: ce.host_fwd,
            ops.linear_ce_bwd.default: ce.host_bwd, ops.ce_fwd.default: ce.host_ce_fwd,
            ops.ce_bwd.default: ce.host_ce_bwd}


def _trace(host: Callable[..., Any], node: Node) -> tuple[GraphModule, list[Node]]:
    """The host path traced (core ATen ops) on the node's fake arguments, and the argument nodes
    its placeholders stand for."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchneuron.compiler.decompositions import core_decompositions

    args = list(node.args)
    positions = [i for i, a in enumerate(args) if isinstance(a, Node)]
    values = [args[i].meta["val"] for i in positions]

    def run(*tensors: torch.Tensor) -> Any:
        call = list(args)
        for i, t in zip(positions, tensors):
            call[i] = t
        return host(*call)

    with torch._guards.detect_fake_mode(values) or contextlib.nullcontext():
        traced = make_fx(run, decomposition_table=core_decompositions(), tracing_mode="real")(*values)
    return traced, [args[i] for i in positions]


def _splice(gm: GraphModule, node: Node, traced: GraphModule, inputs: list[Node]) -> None:
    """Copies the traced ops before `node` and points node's users (or their getitems) at them."""
    val_map: dict[Node, Any] = dict(zip(traced.graph.find_nodes(op="placeholder"), inputs))
    with gm.graph.inserting_before(node):
        result = gm.graph.graph_copy(traced.graph, val_map)
    if isinstance(result, (tuple, list)):
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(result[user.args[1]])
                gm.graph.erase_node(user)
    else:
        node.replace_all_uses_with(result)
    if node.users:
        raise RuntimeError(f"{node.name} ({node.target}): a user other than getitem reads its results")
    gm.graph.erase_node(node)


def inline(gm: GraphModule) -> int:
    """Replaces the graph's NKI-lib ops by their host paths; returns how many it replaced."""
    paths = host_paths()
    count = 0
    for node in list(gm.graph.nodes):
        host = paths.get(node.target) if node.op == "call_function" else None
        if host is None:
            continue
        traced, inputs = _trace(host, node)
        _splice(gm, node, traced, inputs)
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count
