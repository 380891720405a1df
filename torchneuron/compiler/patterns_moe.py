"""Mixture-of-experts substitution: transformers' grouped-matmul fallback -> `torchneuron::grouped_mm`.

Under torch.compile, transformers (integrations/moe.py, `_can_use_grouped_mm`) sends the MoE
experts of any model whose weights are not bfloat16 (Mixtral, Qwen-MoE, GPT-OSS, DeepSeek-V3,
Jamba, ...) to its custom op `transformers::grouped_mm_fallback(input, weight, offs)`: a host
loop over `offs.tolist()`, and so is its registered backward, which AOTAutograd traces with fake
tensors and cannot run (DataDependentOutputException on `aten._local_scalar_dense`). The neuron
device runs a grouped matmul of any float type as one Tensor-engine kernel (`aten::_grouped_mm`,
ops/scaled_mm.py), so on neuron tensors the compiler replaces each such call, in whatever form
Dynamo recorded it (the op packet or an overload), with `torchneuron::grouped_mm`: the same
products (rows past the last group zero, as the fallback leaves them), whose backward is the
same op again, traced without reading `offs`.

`torchneuron::grouped_mm(a, b, offs)` is `torch._grouped_mm(a, b, offs)` for the layouts with
groups (`offs[g]` ends group g), in float32, bfloat16 and float16:

- 2d x 3d: a [M, K] rows split by offs, b [G, K, N] -> [M, N] (the experts' forward);
- 2d x 2d: a [K, M], b [M, N], M split by offs -> [G, K, N] (the experts' weight gradients);
- 3d x 2d: a [G, M, K], b [K, N], columns split by offs -> [M, N].

For each, grad_a = grouped_mm(grad, b^T, offs) and grad_b = grouped_mm(a^T, grad, offs) are
again one of the three.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.fx import Node

FALLBACK_OP = "transformers::grouped_mm_fallback"
FLOAT_TYPES = (torch.float32, torch.bfloat16, torch.float16)
_FALLBACK_ARGUMENTS = ("input", "weight", "offs")


def _result_shape(a: Tensor, b: Tensor, offs: Tensor) -> tuple[int, ...]:
    """The result's shape, or the ValueError naming the operands the op takes."""
    layout = (a.dim(), b.dim())
    # (K of a, K of b, number of groups) of each layout
    sizes = {(2, 3): lambda: (a.shape[1], b.shape[1], b.shape[0]),
             (2, 2): lambda: (a.shape[1], b.shape[0], offs.shape[0]),
             (3, 2): lambda: (a.shape[2], b.shape[0], a.shape[0])}.get(layout, lambda: (0, 1, 0))
    k_a, k_b, groups = sizes()
    if (k_a != k_b or offs.dim() != 1 or offs.shape[0] != groups or offs.dtype not in (torch.int32, torch.int64)
            or a.dtype != b.dtype or a.dtype not in FLOAT_TYPES):
        raise ValueError(
            f"torchneuron::grouped_mm: takes a [M, K] x b [G, K, N], a [K, M] x b [M, N] or a [G, M, K] x "
            f"b [K, N] of one float type with offs [G] int32/int64; got a {tuple(a.shape)} {a.dtype}, "
            f"b {tuple(b.shape)} {b.dtype}, offs {tuple(offs.shape)} {offs.dtype}")
    if layout == (2, 3):
        return a.shape[0], b.shape[2]
    if layout == (2, 2):
        return offs.shape[0], a.shape[0], b.shape[1]
    return a.shape[1], b.shape[1]


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    """Grouped matmul of a and b, groups ended by offs (see the module's layouts)."""
    _result_shape(a, b, offs)
    return torch._grouped_mm(a, b, offs.to(torch.int32)).contiguous()


def _grouped_mm_fake(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
    return a.new_empty(_result_shape(a, b, offs))


grouped_mm = torch.library.custom_op("torchneuron::grouped_mm", _grouped_mm, mutates_args=())
grouped_mm.register_fake(_grouped_mm_fake)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
    a, b, offs = ctx.saved_tensors
    grad_a = grouped_mm(grad, b.transpose(-2, -1), offs) if ctx.needs_input_grad[0] else None
    grad_b = grouped_mm(a.transpose(-2, -1), grad, offs) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b, None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


def _value(arg: Any) -> Any:
    """The example (fake) value Dynamo recorded for a graph node, or the argument itself."""
    return arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, Node) else arg


def _fallback_arguments(node: Node) -> dict[str, Any]:
    bound = dict(zip(_FALLBACK_ARGUMENTS, node.args))
    bound.update(node.kwargs)
    return bound


def _is_fallback_call(node: Node) -> bool:
    target = node.target
    packet = target.overloadpacket if isinstance(target, torch._ops.OpOverload) else target
    return (node.op == "call_function" and isinstance(packet, torch._ops.OpOverloadPacket)
            and packet._qualified_op_name == FALLBACK_OP)


def is_grouped_mm_fallback(node: Node) -> bool:
    """A call of transformers' fallback on neuron float operands the device's grouped matmul takes."""
    if not _is_fallback_call(node):
        return False
    args = _fallback_arguments(node)
    a, b, offs = (_value(args.get(name)) for name in _FALLBACK_ARGUMENTS)
    if not all(isinstance(t, Tensor) and t.device.type == "neuron" for t in (a, b, offs)):
        return False
    if a.dim() != 2 or b.dim() != 3:
        return False
    try:
        _result_shape(a, b, offs)
    except ValueError:
        return False  # transformers' op raises its own error for the call
    return True


def rewrite_grouped_mm_fallback(node: Node) -> Node:
    """The fallback call -> `torchneuron::grouped_mm(input, weight, offs)`."""
    args = _fallback_arguments(node)
    with node.graph.inserting_before(node):
        out = node.graph.call_function(torch.ops.torchneuron.grouped_mm.default,
                                       tuple(args[name] for name in _FALLBACK_ARGUMENTS))
    example = _value(node)
    if example is not None:
        out.meta["example_value"] = example
    return out
