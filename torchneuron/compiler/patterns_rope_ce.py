"""Substitution of rotary embeddings and cross-entropy with NKI-lib kernels on the Dynamo graph.

patterns.py runs these `Substitution`s before autograd (so backward is the kernels' own):

- RoPE, transformers' `apply_rotary_pos_emb`: `x * cos + cat(-x[..., d/2:], x[..., :d/2]) * sin`
  (either operand order) on a [B, H, S, d] neuron tensor with cos/sin of x's dtype shaped
  [B or 1, 1, S, d] that need no gradient -> `kernels.rope_ce_ops.apply_rope`
  (`nki_kernels::rope`).
- `F.cross_entropy(logits [T, V], labels [T])` (no class weights or label smoothing, T a
  multiple of 128) -> `rope_ce_ops.cross_entropy` (`nki_kernels::ce_fwd`); and when the logits
  come only from `F.linear(h, W)` (through `.float()` and views: transformers' ForCausalLMLoss
  upcasts and flattens them) and nothing else reads them, the fused
  `rope_ce_ops.linear_cross_entropy` (`nki_kernels::linear_ce_fwd`): the logits never exist.

Only neuron tensors of static shape and float dtype are substituted; otherwise the graph is left
alone. Each matched site is substituted only where the kernel's modeled plan, forward and backward,
is cheaper than the generic ops' (site_price.py: at small sizes the kernels' fixed costs lose to the
plan's fused generic ops, and the generic loss fuses into the head's matmul);
TORCHNEURON_COMPILE_ROPE_CE_KERNELS=1 substitutes wherever the kernels apply, =0 never.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.fx import Node

from torchneuron.compiler import site_price
from torchneuron.compiler.substitution import FLOAT_TYPES, Substitution, example_value
from torchneuron.kernels import cross_entropy as ce
from torchneuron.kernels import rope as rp
from torchneuron.kernels import rope_ce_ops
from torchneuron.nki import typing as nt

ADD = (operator.add, torch.add)
MUL = (operator.mul, torch.mul)
NEG = (operator.neg, torch.neg)
CROSS_ENTROPY = (F.cross_entropy, torch._C._nn.cross_entropy_loss)
LINEAR = (F.linear, torch._C._nn.linear)


def _enabled() -> bool:
    return site_price.mode() != "off"


def _call(node: Any, targets: tuple) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _static_neuron(value: Any, dtypes: tuple = FLOAT_TYPES) -> bool:
    return (isinstance(value, torch.Tensor) and value.device.type == "neuron" and value.dtype in dtypes
            and all(isinstance(s, int) for s in value.shape))


# -- RoPE ------------------------------------------------------------------------------------------
def _half_of(node: Any, x: Node, first: bool) -> bool:
    """node is x[..., :d/2] (first) or x[..., d/2:]."""
    if not _call(node, (operator.getitem,)) or node.args[0] is not x:
        return False
    index = node.args[1]
    half = example_value(x).shape[-1] // 2
    want = slice(None, half, None) if first else slice(half, None, None)
    return isinstance(index, tuple) and len(index) == 2 and index[0] is Ellipsis and index[1] == want


def _is_rotate_half(node: Any, x: Node) -> bool:
    """node is cat((-x[..., d/2:], x[..., :d/2]), dim=-1)."""
    if not _call(node, (torch.cat,)):
        return False
    parts = node.args[0] if node.args else node.kwargs.get("tensors")
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if not isinstance(parts, (list, tuple)) or len(parts) != 2 or dim not in (-1, 3):
        return False
    neg, low = parts
    return _call(neg, NEG) and _half_of(neg.args[0], x, first=False) and _half_of(low, x, first=True)


def _products(node: Any) -> list[tuple[Any, Any]]:
    """Both orders of a product's operands ([] if node is no product of two)."""
    if not _call(node, MUL) or len(node.args) != 2 or node.kwargs:
        return []
    a, b = node.args
    return [(a, b), (b, a)]


def rope_operands(node: Node) -> tuple[Node, Node, Node] | None:
    """(x, cos, sin) when node is x * cos + rotate_half(x) * sin, else None."""
    if not _call(node, ADD) or len(node.args) != 2 or node.kwargs:
        return None
    for direct, rotated in (node.args, node.args[::-1]):
        for x, cos in _products(direct):
            for cat, sin in _products(rotated):
                if isinstance(x, Node) and _is_rotate_half(cat, x):
                    return x, cos, sin
    return None


def _is_rope(node: Node) -> bool:
    operands = rope_operands(node) if _enabled() else None
    if operands is None:
        return False
    x, cos, sin = (example_value(n) for n in operands)
    out = example_value(node)
    if not all(_static_neuron(t) for t in (x, cos, sin, out)) or x.dim() != 4:
        return False
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.requires_grad or sin.requires_grad:
        return False
    if out.shape != x.shape or out.dtype != x.dtype or cos.shape != sin.shape:
        return False
    b, h, s, d = x.shape
    if cos.dim() != 4 or cos.shape[1] != 1 or tuple(cos.shape[2:]) != (s, d) or cos.shape[0] not in (1, b):
        return False
    table = nt.tensor[(cos.shape[0], s, d), x.dtype]
    try:
        rp.check_shapes(nt.tensor[(b * h, s, d), x.dtype], table, table)
    except rp.UnsupportedInput:
        return False
    return site_price.kernel_chosen("rope", rope_reference, rope_ce_ops.apply_rope, (x, cos, sin))


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one tensor: the computation the pattern matches."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _rewrite_rope(node: Node) -> Node:
    x, cos, sin = rope_operands(node)
    with node.graph.inserting_before(node):
        out = node.graph.call_function(rope_ce_ops.apply_rope, (x, cos, sin))
    out.meta["example_value"] = example_value(node)
    return out


# -- cross-entropy ---------------------------------------------------------------------------------
_CE_NAMES = ("input", "target", "weight", "size_average", "ignore_index", "reduce", "reduction", "label_smoothing")


def _ce_arguments(node: Node) -> dict[str, Any]:
    bound = dict(zip(_CE_NAMES, node.args))
    bound.update(node.kwargs)
    return bound


def _is_cross_entropy(node: Node) -> bool:
    if not _enabled() or not _call(node, CROSS_ENTROPY):
        return False
    args = _ce_arguments(node)
    if any(args.get(k) is not None for k in ("weight", "size_average", "reduce")):
        return False
    if args.get("label_smoothing", 0.0) != 0.0 or args.get("reduction", "mean") not in ("mean", "sum", "none"):
        return False
    if not isinstance(args.get("ignore_index", -100), int):
        return False
    logits, labels = example_value(args["input"]), example_value(args["target"])
    integer = (torch.int64, torch.int32)
    if not _static_neuron(logits) or not _static_neuron(labels, integer) or logits.dim() != 2:
        return False
    return labels.shape == logits.shape[:1] and logits.shape[0] % ce.P == 0 and _ce_kernel(node) is not None


def _ce_kernel(node: Node) -> str | None:
    """Which kernel a matched cross-entropy site becomes: 'fused' (linear_cross_entropy, when the
    head can fuse and that is chosen), 'logits' (cross_entropy over the logits) or None. A head
    producing the logits is part of the site priced: the generic plan fuses the loss into the
    head's matmul."""
    args = _ce_arguments(node)
    constants = (args.get("ignore_index", -100), args.get("reduction", "mean"))
    logits, labels = example_value(args["input"]), example_value(args["target"])
    head = head_of(args["input"])
    if head is None:
        chosen = site_price.kernel_chosen("cross_entropy", _ce_reference, rope_ce_ops.cross_entropy, (logits, labels),
                                          constants)
        return "logits" if chosen else None
    h, w, shared = (example_value(head[0]), example_value(head[1]), head[2])
    constants += (logits.dtype, shared)
    if fused_head(args["input"]) is not None and site_price.kernel_chosen(
            "linear_cross_entropy", _head_ce_reference, _linear_ce_kernel, (h, w, labels), constants):
        return "fused"
    chosen = site_price.kernel_chosen("cross_entropy_after_head", _head_ce_reference, _head_ce_kernel, (h, w, labels),
                                      constants)
    return "logits" if chosen else None


def _ce_reference(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    return F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction=reduction)


def _head_ce(loss: Callable, h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, ignore_index: int,
             reduction: str, logits_dtype: torch.dtype, shared: bool) -> Any:
    """A head's logits F.linear(h, w) (cast to the loss's dtype, flattened), then `loss` of them;
    the logits are an output too when the graph reads them elsewhere."""
    logits = F.linear(h, w).to(logits_dtype).reshape(-1, w.shape[0])
    out = loss(logits, labels, ignore_index, reduction)
    return (out, logits) if shared else out


def _head_ce_reference(*args: Any) -> Any:
    return _head_ce(_ce_reference, *args)


def _head_ce_kernel(*args: Any) -> Any:
    return _head_ce(rope_ce_ops.cross_entropy, *args)


def _linear_ce_kernel(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, ignore_index: int, reduction: str,
                      _logits_dtype: torch.dtype, _shared: bool) -> torch.Tensor:
    return rope_ce_ops.linear_cross_entropy(h.reshape(-1, h.shape[-1]), w, labels, ignore_index, reduction)


def _single_user(node: Node) -> bool:
    return len(node.users) == 1


def _upcast_or_view(node: Node) -> bool:
    """`.float()`, `.to(torch.float32)`, `.view(...)`, `.reshape(...)` of one tensor."""
    if node.op != "call_method":
        return False
    if node.target == "float":
        return True
    if node.target == "to":
        return node.args[1:] == (torch.float32,) or node.kwargs == {"dtype": torch.float32}
    return node.target in ("view", "reshape")


def head_of(logits: Node) -> tuple[Node, Node, bool] | None:
    """(h, W, shared) when the logits are F.linear(h, W) without bias (through upcasts and views)
    of static neuron tensors of one dtype; shared: something else reads the logits or a step
    of that chain (they are then computed and written either way)."""
    node, shared = logits, False
    while isinstance(node, Node) and _upcast_or_view(node):
        shared = shared or not _single_user(node)
        node = node.args[0]
    if not _call(node, LINEAR) or _linear_bias(node) is not None:
        return None
    h, w = node.args[:2]
    h_val, w_val = example_value(h), example_value(w)
    if not (_static_neuron(h_val) and _static_neuron(w_val)) or h_val.dtype != w_val.dtype:
        return None
    return h, w, shared or not _single_user(node)


def _linear_bias(node: Node) -> Any:
    """The bias argument of an F.linear call node (None when it has none)."""
    return node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")


def fused_head(logits: Node) -> tuple[Node, Node] | None:
    """(h, W) when the logits are only F.linear(h, W) without bias (through upcasts and views)
    and nothing else reads them: the fused linear cross-entropy may replace the head."""
    head = head_of(logits)
    if head is None or head[2]:
        return None
    h, w, _ = head
    h_val, w_val = example_value(h), example_value(w)
    d = h_val.shape[-1]
    tokens = h_val.numel() // d
    try:
        ce.check_shapes(nt.tensor[(tokens, d), h_val.dtype], w_val, nt.tensor[(tokens, 1), torch.int32], "fused head")
        ce.block_tiles(tokens, d, h_val.dtype.itemsize, backward=True)
    except ce.UnsupportedInput:
        return None
    return h, w


def _rewrite_cross_entropy(node: Node) -> Node:
    args = _ce_arguments(node)
    ignore_index, reduction = args.get("ignore_index", -100), args.get("reduction", "mean")
    head = fused_head(args["input"]) if _ce_kernel(node) == "fused" else None
    graph = node.graph
    with graph.inserting_before(node):
        if head is None:
            out = graph.call_function(rope_ce_ops.cross_entropy, (args["input"], args["target"], ignore_index,
                                                                   reduction))
        else:
            h, w = head
            flat = graph.call_method("reshape", (h, -1, example_value(h).shape[-1]))
            out = graph.call_function(rope_ce_ops.linear_cross_entropy, (flat, w, args["target"], ignore_index,
                                                                          reduction))
    out.meta["example_value"] = example_value(node)
    return out


SUBSTITUTIONS = [
    Substitution("rope", _is_rope, _rewrite_rope),
    Substitution("cross_entropy", _is_cross_entropy, _rewrite_cross_entropy),
]
