"""Fusion: groups a partitioned graph's device ops into the kernels the NeuronCore runs.

Greedy, in topological order, over the ops' roles (from the performance model's op
categories):

- pointwise ops (elementwise, transcendental, casts, copies, fills) join the kernel of one of
  their inputs: chains of pointwise ops, the prologue and epilogue of reductions (softmax,
  norms: statistics and normalisation in one pass over SBUF), and matmul epilogues (bias,
  activation, residual, cast on the PSUM result before it goes back to HBM);
- reductions (sums, norms, softmax, losses) join a kernel over the same or a larger
  iteration space: of pointwise ops, of reductions, or of a matmul whose result tiles they
  reduce (a norm's backward statistics) or whose input they read too (a bias gradient summed
  from the output gradient the weight gradient's matmul loads);
- matmuls join the kernel of their prologue (a norm or pointwise chain producing their input,
  which they read from SBUF: norm + projection), or the kernel of another matmul or reduction
  reading the same input (a linear layer's backward: input and weight gradients from one load
  of the output gradient); a matmul of a matmul's result starts a kernel of its own;
- everything else (NKI kernels, convolutions, gathers and scatters, sorts, random, host
  fallbacks) is a kernel of its own;
- a pointwise op reading the results of several open pointwise kernels of which none feeds
  another merges them first (horizontal fusion: an optimizer's updates of its states, begun
  from different inputs, meet in the parameter update and become one multi-tensor kernel).
  Kernels are emitted in dependency order.

Pointwise ops without tensor inputs (fills, iotas, scalar constants, 0-d tensors of a program's
float arguments) are generated inside the kernels that read them: they are no kernel and no HBM
read. A copy writing a result back into a graph input (an input mutation) is that result's
kernel writing to another address: it joins the kernel producing the result.

A join never creates a cycle between kernels (a kernel may not both feed and consume
another), never mixes placements, and never grows a kernel past `MAX_OPS` computing ops (the
write-backs of an optimizer's updated state into its inputs do not count).

SBUF capacity: a kernel applies statistics to the data they were reduced from (a softmax
subtracting a row's max, a norm dividing by a row's deviation) in one pass only if the row stays
on chip: a partition holds its float32 working copy in half its usable SBUF (the other half
stages the tiles moving in and out). A wider row (a softmax over a large vocabulary, a batch norm
over many pixels) is reduced while it streams through, and read again from HBM by a kernel after
it: an op re-reading the data of a wide reduction of a kernel does not join that kernel. An op
that both reduces and applies a wide row (softmax, a norm, kept whole) is a kernel of its own.

Views and `getitem` are free: they belong to no kernel, and reading through one reads the
viewed bytes. `build_kernels` turns groups into `KernelSpec`s with the tensors each kernel reads
from and writes to HBM.
"""
from __future__ import annotations

import heapq
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_leaves

from torchneuron.compiler.flex_attention import NKI_META_KEY
from torchneuron.compiler.partition import DEVICE, HOST, Partition, is_transparent, node_tensors, op_name
from torchneuron.compiler.plan import KernelSpec, OpSpec, TensorSpec
from torchneuron.hardware.taxonomy import op_category
from torchneuron.hardware.targets import Target, get_target

MAX_OPS = 64
INLINE_META_KEY = "torchneuron_inline_constant"
COPY_ = torch.ops.aten.copy_.default
# (a foreach op is pointwise over each tensor of its lists: chains of them, an optimizer step, are
# one multi-tensor kernel)
POINTWISE = frozenset({"elementwise", "transcendental", "copy", "fill", "iota", "foreach", "foreach_transcendental"})
REDUCTION = frozenset({"reduction", "softmax", "softmax_backward", "norm", "norm_backward", "scan"})
MATMUL = frozenset({"matmul"})
# Ops the NeuronCore runs as kernels from the NKI library, and the aten op each is priced as.
NKI_KERNELS: dict[str, str] = {
    "torchneuron::flash_attention": "aten::_scaled_dot_product_flash_attention",
    "torchneuron::flash_attention_backward": "aten::_scaled_dot_product_flash_attention_backward",
    "torchneuron::grouped_mm": "aten::_grouped_mm",  # patterns_moe.py: one grouped Tensor-engine kernel
    # NKI-lib ops substituted by patterns_rope_ce.py, priced as themselves (kernels/pricing_rope_ce.py)
    **{f"nki_kernels::{name}": f"nki_kernels::{name}"
       for name in ("rope", "linear_ce_fwd", "linear_ce_bwd", "ce_fwd", "ce_bwd")},
}


def role(node: Node) -> str:
    """"pointwise", "reduction", "matmul" or "opaque" (a kernel of its own)."""
    name = op_name(node)
    if name in NKI_KERNELS or not isinstance(node.target, torch._ops.OpOverload):
        return "opaque"
    if node.target.namespace not in ("aten", "prims"):
        return "opaque"
    category = op_category(name)
    if category in POINTWISE:
        return "pointwise"
    if category in REDUCTION:
        return "reduction"
    if category in MATMUL:
        return "matmul"
    return "opaque"


# Ops normalising by a row's statistics, and the length of that row from their arguments.
_ROW_STATISTICS = frozenset({"softmax", "softmax_backward", "norm", "norm_backward"})


def row_elements(node: Node) -> int | None:
    """Elements of the row whose statistics `node` (a softmax, a norm, their backward) computes
    and applies; None for other ops, or where the arguments do not say."""
    name = op_name(node).split("::")[-1]
    packet = name.split(".")[0].rstrip("_")
    args = node.args
    inputs, _ = node_tensors(node)
    if not inputs:
        return None
    shape = [_int(d) for d in inputs[0].shape]
    if packet in ("_softmax", "_log_softmax", "softmax", "log_softmax", "_safe_softmax"):
        return shape[args[1] % len(shape)] if shape else 1
    if packet in ("_softmax_backward_data", "_log_softmax_backward_data"):
        return shape[args[2] % len(shape)] if shape else 1
    if packet in ("native_layer_norm", "layer_norm", "rms_norm", "_fused_rms_norm"):
        return _product(args[1])
    if packet == "native_layer_norm_backward" or packet == "_fused_rms_norm_backward":
        return _product(args[2])
    if packet == "native_group_norm":
        return _int(args[4]) // max(_int(args[6]), 1) * _int(args[5])
    if packet == "native_group_norm_backward":
        return _int(args[6]) // max(_int(args[8]), 1) * _int(args[7])
    if "batch_norm" in packet or packet == "instance_norm":
        return _numel(inputs[0]) // shape[1] if len(shape) > 1 and shape[1] else None
    return None


def _int(value) -> int:
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        return int(hint) if hint is not None else 0
    return int(value)


def _product(dims) -> int:
    result = 1
    for d in dims:
        result *= _int(d)
    return result


def reduced_elements(node: Node) -> int | None:
    """Elements reduced into each output element of a reduction-role `node` (a row's length);
    None where its tensors do not say."""
    row = row_elements(node)
    if row is not None:
        return row
    inputs, outputs = node_tensors(node)
    if not inputs or not outputs:
        return None
    return _numel(inputs[0]) // max(_numel(outputs[0]), 1)


def row_fits_on_chip(node: Node, target: Target) -> bool:
    """Whether the row `node` reduces fits a partition's SBUF budget (the module docstring)."""
    elements = reduced_elements(node)
    return elements is None or elements * 4 <= target.sbuf_usable_bytes_per_partition // 2


def _is_tensor(node: Node) -> bool:
    return isinstance(node.meta.get("val"), torch.Tensor)


def _size(node: Node) -> int:
    inputs, outputs = node_tensors(node)
    sizes = [_numel(t) for t in inputs + outputs]
    return max(sizes, default=0)


def _numel(t: torch.Tensor) -> int:
    numel = t.numel()
    if isinstance(numel, torch.SymInt):  # symbolic: plan with the size hint
        hint = numel.node.hint
        return int(hint) if hint is not None else 0
    return int(numel)


@dataclass(eq=False)
class Group:
    """A kernel being formed: its nodes, placement, role, iteration size and the kernels that
    consume its results (for the cycle check)."""

    index: int
    placement: str
    role: str
    nodes: list[Node] = field(default_factory=list)
    size: int = 0
    open: bool = True
    succs: set["Group"] = field(default_factory=set)
    streamed: set[Node] = field(default_factory=set)   # data of its reductions whose rows leave SBUF
    computing: int = 0                                   # its ops but write-backs into graph inputs


class _Grouper:
    """Assigns nodes, in topological order, to kernels (see the module docstring)."""

    def __init__(self, partition: Partition, target: Target) -> None:
        self.partition, self.target = partition, target
        self.groups: list[Group] = []
        self.group_of: dict[Node, Group] = {}
        self.nki_calls: dict[str, Group] = {}

    def source(self, node: Node) -> Group | None:
        """The kernel producing `node`'s value (through views and getitem)."""
        return self.group_of.get(node)

    def reaches(self, start: Group, goal: Group) -> bool:
        stack, seen = [start], {start}
        while stack:
            group = stack.pop()
            if group is goal:
                return True
            for succ in group.succs - seen:
                seen.add(succ)
                stack.append(succ)
        return False

    def can_join(self, group: Group, node_role: str, size: int, producers: list[Group],
                 inputs: Sequence[Node] = ()) -> bool:
        """Whether a node of `node_role` and iteration `size`, reading `inputs`, the results of
        `producers`, may join `group` (the module docstring's rules)."""
        if not group.open or group.placement != DEVICE or group.computing >= MAX_OPS:
            return False
        if group.streamed and any(_base(a) in group.streamed for a in inputs):
            return False  # re-reads a wide row the kernel reduced: from HBM, in a later kernel
        if node_role == "matmul" and group.role == "matmul" and group in producers:
            return False  # a matmul of a matmul's result waits for its last accumulation
        if node_role != "matmul" and size > group.size and group.role != "pointwise":
            return False
        return not any(other is not group and self.reaches(group, other) for other in producers)

    def siblings(self, node: Node, inputs: list[Node], producers: list[Group]) -> list[Group]:
        """Kernels of earlier readers of `node`'s inputs (by their data, through views)."""
        found: dict[Group, None] = {}
        for arg in inputs:
            base = _base(arg)
            for reader in _consumers(base):
                group = self.group_of.get(reader)
                if group is not None and group not in producers and reader is not node:
                    found[group] = None
        return list(found)

    def merge_independent(self, producers: list[Group]) -> None:
        """Merges the open pointwise kernels among `producers` of which none feeds another into
        one (horizontal fusion: an optimizer's updates of each state, meeting in the parameter
        update), so that the op reading them all joins a single kernel."""
        mergeable = [g for g in producers if g.open and g.placement == DEVICE and g.role == "pointwise"]
        if len(mergeable) < 2:
            return
        keep = max(mergeable, key=lambda g: g.size)
        for other in mergeable:
            if other is keep or keep.computing + other.computing > MAX_OPS \
                    or self.reaches(keep, other) or self.reaches(other, keep):
                continue
            for node, group in self.group_of.items():
                if group is other:
                    self.group_of[node] = keep
            for group in self.groups:
                if other in group.succs:
                    group.succs.discard(other)
                    group.succs.add(keep)
            keep.nodes.extend(other.nodes)
            keep.computing += other.computing
            keep.size = max(keep.size, other.size)
            keep.succs |= other.succs - {keep}
            keep.streamed |= other.streamed
            other.nodes, other.open, other.succs = [], False, set()

    def add(self, node: Node) -> None:
        inputs = [a for a in tree_leaves((node.args, node.kwargs)) if isinstance(a, Node)]
        if is_transparent(node):
            sources = [self.source(a) for a in inputs[:1]]
            if sources and sources[0] is not None:
                self.group_of[node] = sources[0]
            return
        placement = self.partition.of(node)
        if placement is None or placement not in (DEVICE, HOST):
            return
        producers = [g for g in dict.fromkeys(self.source(a) for a in inputs) if g is not None]
        node_role = role(node) if placement == DEVICE else "opaque"
        wide = node_role == "reduction" and not row_fits_on_chip(node, self.target)
        if wide and op_category(op_name(node)) in _ROW_STATISTICS:
            node_role = "opaque"                # reduces and applies in passes over HBM: alone
        if placement == DEVICE and node_role == "pointwise" and not any(map(_is_tensor, inputs)):
            node.meta[INLINE_META_KEY] = True   # a constant (of symbolic scalars too), generated where it is read
            return
        size = _size(node)
        chosen = None
        call = node.meta.get(NKI_META_KEY)
        writeback = node.target is COPY_ and isinstance(node.args[0], Node) and node.args[0].op == "placeholder"
        if writeback and len(producers) == 1 and producers[0].placement == DEVICE:
            chosen = producers[0]               # the producing kernel stores into the input
        elif call is not None:  # part of an NKI kernel inlined as ATen ops (FlexAttention)
            chosen = self.nki_calls.get(call)
            if chosen is None:
                chosen = self.nki_calls[call] = Group(len(self.groups), placement, "opaque", open=False)
                self.groups.append(chosen)
        elif node_role != "opaque":
            if node_role == "pointwise" and len(producers) > 1:
                self.merge_independent(producers)
                producers = [g for g in dict.fromkeys(self.source(a) for a in inputs) if g is not None]
            # a producer's kernel first; else a sibling's (another reader of the same data: the
            # statistics of a norm's backward are reductions of one input, read in one pass)
            candidates = sorted(producers, key=lambda g: -g.size) + self.siblings(node, inputs, producers)
            for group in candidates:
                if self.can_join(group, node_role, size, producers, inputs):
                    chosen = group
                    break
        if chosen is None:
            chosen = Group(len(self.groups), placement, node_role, open=node_role != "opaque")
            self.groups.append(chosen)
        chosen.nodes.append(node)
        chosen.computing += not writeback
        chosen.size = max(chosen.size, size)
        if wide:
            chosen.streamed.update(_base(a) for a in inputs[:1])
        if node_role == "matmul" or (node_role == "reduction" and chosen.role == "pointwise"):
            chosen.role = node_role
        self.group_of[node] = chosen
        for producer in producers:
            if producer is not chosen:
                producer.succs.add(chosen)


def fuse(gm: GraphModule, partition: Partition, target: Target | None = None) -> list[list[Node]]:
    """Groups the graph's computing nodes into kernels for `target` (the current one by default);
    returns them in execution order."""
    grouper = _Grouper(partition, target or get_target())
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        grouper.add(node)
    groups = [g for g in grouper.groups if g.nodes]
    for group in groups:
        group.nodes.sort(key=position.__getitem__)
    return [g.nodes for g in _in_execution_order(groups, position)]


def _in_execution_order(groups: list[Group], position: dict[Node, int]) -> list[Group]:
    """The kernels in an order that runs each after the kernels it reads (merged kernels may
    have moved past their creation order), otherwise by their first op in the graph."""
    pending = {g: 0 for g in groups}
    for group in groups:
        for succ in group.succs:
            if succ in pending and succ is not group:
                pending[succ] += 1
    first = {g: position[g.nodes[0]] for g in groups}
    ready = [(first[g], g.index, g) for g in groups if pending[g] == 0]
    heapq.heapify(ready)
    ordered = []
    while ready:
        _, _, group = heapq.heappop(ready)
        ordered.append(group)
        for succ in group.succs:
            if succ in pending and succ is not group:
                pending[succ] -= 1
                if pending[succ] == 0:
                    heapq.heappush(ready, (first[succ], succ.index, succ))
    assert len(ordered) == len(groups), "kernel dependencies form a cycle"
    return ordered


# ---------------------------------------------------------------------------------------------
# Kernel specs: what each group reads and writes in HBM
# ---------------------------------------------------------------------------------------------

def _spec(value) -> TensorSpec | None:
    return TensorSpec.of(value)


def _op_spec(node: Node) -> OpSpec:
    inputs, outputs = node_tensors(node)
    name = op_name(node)
    return OpSpec(NKI_KERNELS.get(name, name), tuple(map(_spec, inputs)), tuple(map(_spec, outputs)))


def _base(node: Node) -> Node:
    while node.op == "call_function" and is_transparent(node) and node.target is not operator.getitem:
        args = [a for a in node.args if isinstance(a, Node)]
        if not args:
            break
        node = args[0]
    return node


def _consumers(node: Node) -> list[Node]:
    """Computing users of `node`, looking through views and getitem; the output node counts."""
    found, stack = [], list(node.users)
    while stack:
        user = stack.pop()
        if user.op == "call_function" and is_transparent(user):
            stack.extend(user.users)
        else:
            found.append(user)
    return found


def build_kernels(groups: list[list[Node]], partition: Partition,
                  nki_ops: dict[str, OpSpec] | None = None) -> list[KernelSpec]:
    """Kernel specs of the groups, in order. A group of nodes inlined from one NKI kernel call
    has one op, the one `nki_ops` prices that call as."""
    nki_ops = nki_ops or {}
    members = {node: i for i, group in enumerate(groups) for node in group}
    kernels = []
    for i, group in enumerate(groups):
        reads: dict[Node, TensorSpec] = {}
        writes: list[TensorSpec] = []
        for node in group:
            for arg in tree_leaves((node.args, node.kwargs)):
                if not isinstance(arg, Node) or members.get(_base(arg)) == i or _base(arg).meta.get(INLINE_META_KEY):
                    continue
                if node.target is COPY_ and arg is node.args[0]:
                    continue  # the destination of a copy is written, not read
                spec = _spec(arg.meta.get("val"))
                if spec is not None and arg not in reads:
                    reads[arg] = spec
            if any(members.get(user) != i for user in _consumers(node)):
                writes.extend(s for s in map(_spec, tree_leaves(node.meta.get("val"))) if s is not None)
        placement = partition.of(group[0]) or DEVICE
        call = group[0].meta.get(NKI_META_KEY)
        ops = [nki_ops[call]] if call in nki_ops else [_op_spec(n) for n in group]
        kind = "nki" if call in nki_ops else "host" if placement == HOST else _kind(group)
        kernels.append(KernelSpec(_kernel_name(group, kind, i), kind, ops, list(reads.values()), writes, placement,
                                  [n.name for n in group]))
    return kernels


def _kind(group: list[Node]) -> str:
    if len(group) == 1:
        return "nki" if op_name(group[0]) in NKI_KERNELS else "op"
    roles = {role(n) for n in group}
    if "matmul" in roles:
        return "matmul"
    return "reduction" if "reduction" in roles else "pointwise"


def _kernel_name(group: list[Node], kind: str, index: int) -> str:
    """"fused_matmul_3", "nki_flash_attention_5", "host_linalg_svd_7", "mm_2" ..."""
    call = group[0].meta.get(NKI_META_KEY)
    first = call.rsplit("_", 1)[0] if call else op_name(group[0]).split("::")[-1].split(".")[0]
    if kind in ("nki", "host"):
        return f"{kind}_{first}_{index}"
    if kind == "op":
        return f"{first}_{index}"
    return f"fused_{kind}_{index}"
