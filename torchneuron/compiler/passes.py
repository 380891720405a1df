"""FX passes over a post-autograd ATen graph: dead code, constant folding, layout and dtype
normalisation.

Each pass rewrites the graph in place, keeps `node.meta["val"]` valid for the nodes it
creates, and returns how many rewrites it made. None of them changes a graph output's
identity (an output never becomes an alias of an input), drops a random op (RNG state must
advance as in eager) or stores new tensors in the module (so Inductor's on-disk cache stays
valid).

- `eliminate_dead_code`: unused pure nodes (random and mutating ops are impure and stay).
- `fold_constants`: pointwise ops over uniform constants (`full`, `scalar_tensor`, ...)
  become one `full`, and algebraic identities (x*1, x+0, x-0, x/1) disappear.
- `normalize_layout`: chains of permutes or views collapse into one; identity permutes and
  views disappear.
- `normalize_dtype`: no-op dtype conversions disappear; a round trip through a wider dtype
  (bf16 -> fp32 -> bf16) disappears; a conversion of a conversion becomes one.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten
prims = torch.ops.prims

UNIFORM_FACTORIES = {aten.full.default: 1, aten.scalar_tensor.default: 0}
IDENTITY_RIGHT = {  # op -> the right operand that leaves the left one unchanged
    aten.mul.Tensor: 1, aten.mul.Scalar: 1, aten.div.Tensor: 1, aten.div.Scalar: 1,
    aten.add.Tensor: 0, aten.add.Scalar: 0, aten.sub.Tensor: 0, aten.sub.Scalar: 0,
}
CONVERSIONS = {prims.convert_element_type.default}
PERMUTES = {aten.permute.default}
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def _is_output_value(node: Node) -> bool:
    return any(user.op == "output" for user in node.users)


def _replace(node: Node, replacement: Node) -> None:
    node.replace_all_uses_with(replacement)
    node.graph.erase_node(node)


def eliminate_dead_code(gm: GraphModule) -> int:
    """Removes nodes whose results nobody uses (FX's purity rules: random and mutating ops stay)."""
    before = len(gm.graph.nodes)
    gm.graph.eliminate_dead_code()
    return before - len(gm.graph.nodes)


def _uniform_value(node: Any) -> Any:
    """The value every element of `node` holds, if it is a uniform constant factory, else None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    index = UNIFORM_FACTORIES.get(node.target)
    if index is None:
        return None
    value = node.args[index]
    return value if isinstance(value, (int, float, bool)) else None


def _fold_uniform(node: Node) -> bool:
    """A pointwise op whose tensor operands are all uniform constants becomes one `full`."""
    if not (isinstance(node.target, torch._ops.OpOverload) and torch.Tag.pointwise in node.target.tags):
        return False
    val = _val(node)
    if not isinstance(val, torch.Tensor) or val.is_complex() or node.kwargs.get("out") is not None:
        return False
    tensor_args = [a for a in node.args if isinstance(a, Node)]
    if not tensor_args or any(_uniform_value(a) is None for a in tensor_args):
        return False
    with torch._subclasses.fake_tensor.unset_fake_temporarily():
        args = [torch.full((), _uniform_value(a), dtype=_val(a).dtype) if isinstance(a, Node) else a
                for a in node.args]
        value = node.target(*args, **node.kwargs).item()
    graph = node.graph
    with graph.inserting_before(node):
        full = graph.call_function(aten.full.default, (list(val.shape), value),
                                   {"dtype": val.dtype, "device": val.device, "pin_memory": False})
    full.meta.update(node.meta)
    _replace(node, full)
    return True


def _drop_identity(node: Node) -> bool:
    """x*1, x/1, x+0, x-0 -> x, when that changes neither dtype, shape nor output identity."""
    identity = IDENTITY_RIGHT.get(node.target)
    if identity is None or len(node.args) < 2 or node.kwargs.get("alpha", 1) != 1:
        return False
    left, right = node.args[0], node.args[1]
    value = right if isinstance(right, (int, float)) and not isinstance(right, bool) else _uniform_value(right)
    if value is None or value != identity or not isinstance(left, Node):
        return False
    out, src = _val(node), _val(left)
    if not (isinstance(out, torch.Tensor) and isinstance(src, torch.Tensor)):
        return False
    if out.dtype != src.dtype or out.shape != src.shape or out.stride() != src.stride():
        return False
    if _is_output_value(node) or left.op == "placeholder":
        return False
    node.replace_all_uses_with(left)
    node.graph.erase_node(node)
    return True


def fold_constants(gm: GraphModule) -> int:
    """Folds pointwise ops over uniform constants and drops algebraic identities."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and (_fold_uniform(node) or _drop_identity(node)):
            changed += 1
    if changed:
        eliminate_dead_code(gm)
    return changed


def _bypass(gm: GraphModule, node: Node, source: Any) -> bool:
    """Replaces a no-op `node` by its `source` (unless it is a graph output or reads an input
    directly, whose identity the caller sees); True when it did."""
    if _is_output_value(node) or not isinstance(source, Node) or source.op == "placeholder":
        return False
    node.replace_all_uses_with(source)
    gm.graph.erase_node(node)
    return True


def _collapse(gm: GraphModule, targets: set, combine: Callable[[Node, Node], Any],
              is_identity: Callable[[Node], bool]) -> int:
    """Rewrites op(op(x, a), b) -> op(x, combine) and removes identities for one op family."""
    changed = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in targets:
            continue
        inner = node.args[0]
        if isinstance(inner, Node) and inner.op == "call_function" and inner.target in targets:
            node.args = (inner.args[0], combine(inner, node)) + tuple(node.args[2:])
            changed += 1
        if is_identity(node) and _bypass(gm, node, node.args[0]):
            changed += 1
    if changed:
        eliminate_dead_code(gm)
    return changed


def normalize_layout(gm: GraphModule) -> int:
    """Collapses chains of permutes and of views; removes identity permutes and views."""
    def compose(inner: Node, outer: Node) -> list[int]:
        first, second = inner.args[1], outer.args[1]
        return [first[i] for i in second]

    def identity_permute(node: Node) -> bool:
        return list(node.args[1]) == list(range(len(node.args[1])))

    def final_shape(inner: Node, outer: Node) -> list:
        return list(outer.args[1])

    def identity_view(node: Node) -> bool:
        src, out = _val(node.args[0]), _val(node)
        return isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor) and src.shape == out.shape \
            and src.stride() == out.stride()

    views = {t for t in VIEWS if t is not aten.reshape.default}
    return _collapse(gm, PERMUTES, compose, identity_permute) + _collapse(gm, views, final_shape, identity_view)


def _exactly_representable(narrow: torch.dtype, wide: torch.dtype) -> bool:
    """Every value of `narrow` is a value of `wide` (so narrow -> wide -> narrow is exact)."""
    if narrow == wide:
        return True
    if narrow.is_floating_point and wide.is_floating_point:
        a, b = torch.finfo(narrow), torch.finfo(wide)
        return b.bits >= a.bits and b.eps <= a.eps and b.max >= a.max and b.tiny <= a.tiny
    if not narrow.is_floating_point and not wide.is_floating_point and narrow != torch.bool \
            and wide != torch.bool:
        a, b = torch.iinfo(narrow), torch.iinfo(wide)
        return b.min <= a.min and b.max >= a.max
    return False


def _conversion(node: Any) -> tuple[Node, torch.dtype] | None:
    """(source, dtype) of a pure dtype conversion node, else None."""
    if not isinstance(node, Node) or node.op != "call_function":
        return None
    if node.target in CONVERSIONS:
        return node.args[0], node.args[1]
    if node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype"} and "dtype" in node.kwargs:
        return node.args[0], node.kwargs["dtype"]
    return None


def _set_source(node: Node, source: Node) -> None:
    node.args = (source,) + tuple(node.args[1:])


def normalize_dtype(gm: GraphModule) -> int:
    """Removes no-op conversions and exact round trips; merges chained conversions."""
    changed = 0
    for node in list(gm.graph.nodes):
        conversion = _conversion(node)
        if conversion is None:
            continue
        source, dtype = conversion
        src_val = _val(source)
        if not isinstance(src_val, torch.Tensor):
            continue
        inner = _conversion(source)
        if inner is not None:
            origin_val = _val(inner[0])
            if isinstance(origin_val, torch.Tensor) and _exactly_representable(origin_val.dtype, src_val.dtype):
                _set_source(node, inner[0])  # the intermediate conversion lost nothing
                source, src_val = inner[0], origin_val
                changed += 1
        if src_val.dtype == dtype and _bypass(gm, node, source):
            changed += 1
    if changed:
        eliminate_dead_code(gm)
    return changed


PASSES: tuple[tuple[str, Callable[[GraphModule], int]], ...] = (
    ("eliminate_dead_code", eliminate_dead_code),
    ("fold_constants", fold_constants),
    ("normalize_layout", normalize_layout),
    ("normalize_dtype", normalize_dtype),
)


def run_passes(gm: GraphModule) -> dict[str, int]:
    """Runs every pass once, in order; returns the number of rewrites of each."""
    counts = {name: fn(gm) for name, fn in PASSES}
    gm.graph.lint()
    gm.recompile()
    return counts


__all__ = ["PASSES", "eliminate_dead_code", "fold_constants", "normalize_dtype", "normalize_layout", "run_passes"]
