"""Partitioning: which ops of a graph the NeuronCore runs and which fall back to the CPU.

Every node that computes gets a placement:

- "device": the NeuronCore runs it (fused into kernels by graph_fusion.py);
- "host": a CPU fallback, by the runtime's policy (`torchneuron.ops.policy`: ops without a
  NeuronCore implementation) or because a tensor has a dtype the target lacks (float64,
  complex). Host ops are charged as host round trips, warned about once per op, and make
  compilation fail in strict mode (TORCHNEURON_STRICT=1);
- "cpu": every tensor it touches lives on the CPU (e.g. an optimizer's step counter): the
  host does it and the device timeline never sees it;
- "comm": a functional collective or its wait (`_c10d_functional`, what DTensor and SimpleFSDP
  trace). It is no kernel of the plan: when it runs, the c10d backend charges the collective to
  its group's communication stream, priced by the collective model and overlapping compute until
  the wait, exactly as in eager mode.

View-like nodes and `getitem` get no placement (they compute nothing).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_leaves

from torchneuron.compiler.errors import NeuronCompileError
from torchneuron.hardware.model import runs_on_host
from torchneuron.hardware.taxonomy import op_category
from torchneuron.hardware.targets import Target, get_target
from torchneuron.ops import policy

DEVICE, HOST, CPU, COMM = "device", "host", "cpu", "comm"
COLLECTIVE_NAMESPACE = "_c10d_functional"


def op_name(node: Node) -> str:
    """"aten::add.Tensor"-style name of a call_function node's target."""
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return target.name()
    if isinstance(target, torch._ops.HigherOrderOperator):
        return f"hop::{target.name()}"
    return getattr(target, "__qualname__", None) or str(target)


def node_tensors(node: Node) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The (fake) tensors a node reads and produces, from the nodes' meta values."""
    inputs = [a.meta.get("val") for a in tree_leaves((node.args, node.kwargs)) if isinstance(a, Node)]
    outputs = tree_leaves(node.meta.get("val"))
    keep = lambda values: [v for v in values if isinstance(v, torch.Tensor)]  # noqa: E731
    return keep(inputs), keep(outputs)


# Functional copies of views (functionalization's output): a fused kernel reads through them.
VIEW_COPIES = frozenset(f"aten::{name}" for name in (
    "as_strided_copy", "view_copy", "permute_copy", "transpose_copy", "t_copy", "expand_copy", "slice_copy",
    "select_copy", "unsqueeze_copy", "squeeze_copy", "alias_copy", "_reshape_copy", "unfold_copy",
    "diagonal_copy", "split_copy", "split_with_sizes_copy", "unbind_copy", "narrow_copy", "detach_copy"))


# Queries of a tensor's metadata: host arithmetic on sizes, no device work.
SIZE_QUERIES = frozenset(f"aten::{name}" for name in ("sym_size", "sym_stride", "sym_numel", "sym_storage_offset"))
_SCALARS = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)


def is_transparent(node: Node) -> bool:
    """Nodes that compute nothing on the device: views (and functional copies of views), getitem
    of a multi-output op, and host arithmetic on symbolic sizes and scalars."""
    if node.op != "call_function":
        return True
    if node.target is operator.getitem:
        return True
    if not isinstance(node.target, torch._ops.OpOverload):
        return isinstance(node.meta.get("val"), _SCALARS)  # operator.mul, sym_float, ... on scalars
    name = op_name(node)
    packet = name.split(".")[0]
    return op_category(name) == "view" or packet in VIEW_COPIES or packet in SIZE_QUERIES


@dataclass
class Partition:
    placements: dict[str, str] = field(default_factory=dict)       # node name -> placement
    host_reasons: dict[str, str] = field(default_factory=dict)     # node name -> why it falls back

    def of(self, node: Node) -> str | None:
        return self.placements.get(node.name)

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for placement in self.placements.values():
            counts[placement] = counts.get(placement, 0) + 1
        return {"counts": counts, "host_ops": dict(self.host_reasons), "placements": dict(self.placements)}


def _fallback_reason(node: Node, tensors: list[torch.Tensor], target: Target) -> str | None:
    """Why a node is a host op, by eager mode's rules: no NeuronCore implementation, or a dtype
    the device has no type for (float64, complex) in an op that neither moves data nor is the
    float64 arithmetic the engines emulate (`hardware.model.runs_on_host`)."""
    name = op_name(node)
    if isinstance(node.target, torch._ops.OpOverload) and not policy.runs_natively(name):
        return "the NeuronCore has no implementation of this op"
    sigs = [(t.dtype, tuple(t.shape)) for t in tensors if t.device.type == "neuron"]
    if runs_on_host(name, sigs, target):
        missing = sorted({str(d).removeprefix("torch.") for d, _ in sigs if runs_on_host(name, [(d, ())], target)})
        return f"{target.name} has no {', '.join(missing) or 'such'} hardware type for this op"
    return None


def partition(gm: GraphModule, target: Target | None = None) -> Partition:
    """Places every computing node; raises NeuronCompileError for a host op in strict mode."""
    target = target or get_target()
    result = Partition()
    warned: set[str] = set()
    for node in gm.graph.nodes:
        if is_transparent(node):
            continue
        inputs, outputs = node_tensors(node)
        tensors = inputs + outputs
        if tensors and all(t.device.type == "cpu" for t in tensors):
            result.placements[node.name] = CPU
            continue
        if op_name(node).startswith(f"{COLLECTIVE_NAMESPACE}::"):
            result.placements[node.name] = COMM
            continue
        reason = _fallback_reason(node, tensors, target)
        if reason is None:
            result.placements[node.name] = DEVICE
            continue
        name = op_name(node)
        if policy.is_strict():
            raise NeuronCompileError(f"{reason} (strict mode forbids CPU fallback; unset TORCHNEURON_STRICT)",
                                     op=name)
        if name not in warned:
            warned.add(name)
            policy.on_fallback(name, f"{reason}; inside a compiled graph")
        result.placements[node.name] = HOST
        result.host_reasons[node.name] = f"{name}: {reason}"
    return result
