"""Eager numerics for adaptive eager's fused programs: which ops the generated code computes, and
which it calls as the eager kernel.

Adaptive eager promises plain eager's results bit for bit, and the device's eager kernels are
ATen's CPU kernels. Inductor's generated code rounds like them only for some ops. Measured
against ATen (float32 and bfloat16, `emulate_precision_casts` on):

- the same: IEEE arithmetic (`+ - * /`, reciprocal), comparisons, selection, min/max and
  clamps, rounding to integers, casts, and every op that only moves data;
- different by an ulp or more:
  - transcendentals: ATen calls MKL's vector math (sqrt, exp, log, sin, tanh, erf...) or its own
    polynomials (gelu);
  - reductions, softmax, norms and losses: another summation order;
  - ops whose ATen kernel fuses a multiply-add (`add`/`sub` with `alpha`, lerp, addcmul);
  - float iotas (`arange`, `linspace`), which ATen accumulates in double;
  - remainder, fmod, rounding division;
  - scatters that accumulate (another order);
  - division by a constant, which Inductor turns into a multiplication by its reciprocal on
    every device but "cpu";
  - in half precision, constants that the dtype cannot hold: ATen rounds fill values and the
    scalar operand of add and sub to the dtype, generated code does not.

So a program generates code only for `EXACT` ops whose arguments avoid those cases, and calls
every other op as the eager kernel (Inductor's per-node fallback). Its decomposition table keeps
those ops whole, so a call is the very kernel eager runs. The kernel plan still fuses them: on the
NeuronCore they are part of the fused kernel like any other op (kept whole, a norm or a softmax
is priced as one op).

A foreach op called as the eager kernel whose results are copied back into its inputs (an
optimizer's update) is called tensor by tensor, as ATen's CPU foreach kernels compute it: Inductor
would make it in place, and an in-place op called as the eager kernel returns no list to index.

`rounding_as_eager()` marks the compilation of a program; the pipeline then calls
`mark_eager_calls(gm)` after planning.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import operator
from typing import Any, Callable, Iterator

import torch
from torch.fx import GraphModule, Node

from torchneuron.compiler.lowerings import register_eager_kernel_lowering
from torchneuron.hardware.taxonomy import base_name, op_category

# Ops whose generated code rounds as ATen's kernel (their base names, without the in-place "_"),
# besides the model's "view" category. A name missing here only costs speed: the op is called.
EXACT: frozenset[str] = frozenset("""
    add sub rsub mul div neg abs relu clamp clamp_min clamp_max maximum minimum fmax fmin where
    eq ne lt le gt ge logical_and logical_or logical_not logical_xor bitwise_and bitwise_or
    bitwise_xor bitwise_not sign sgn signbit masked_fill threshold threshold_backward hardtanh
    hardtanh_backward leaky_relu leaky_relu_backward hardsigmoid hardswish square reciprocal floor
    ceil trunc round frac isnan isinf isposinf isneginf isfinite nan_to_num copysign heaviside
    copy _copy_from clone contiguous _to_copy to convert_element_type lift_fresh_copy cat stack
    constant_pad_nd flip roll repeat expand_copy permute_copy t_copy transpose_copy view_copy
    _reshape_copy slice_scatter select_scatter diagonal_scatter as_strided_scatter select_backward
    slice_backward fill zero zeros ones full zeros_like ones_like full_like new_zeros new_ones
    new_full scalar_tensor empty empty_like empty_strided index_select gather index embedding take
    take_along_dim _unsafe_index
""".split())
# Overloads of EXACT ops that round differently (rounding division).
INEXACT_OVERLOADS: frozenset[str] = frozenset({"div.Tensor_mode", "div.Scalar_mode"})
# Ops of EXACT whose ATen kernel fuses a multiply-add when given a scale other than 1 (and rounds a
# scalar operand to a half-precision tensor's dtype).
_SCALED = frozenset({"add", "sub", "rsub"})
_REDUCED = frozenset({torch.float16, torch.bfloat16})

_active = contextvars.ContextVar("torchneuron_rounding_as_eager", default=False)


@contextlib.contextmanager
def rounding_as_eager() -> Iterator[None]:
    """Compilations inside generate code only where it rounds as eager (adaptive eager's programs)."""
    token = _active.set(True)
    try:
        yield
    finally:
        _active.reset(token)


def active() -> bool:
    return _active.get()


def _base_name(name: str) -> str:
    """The performance model's base name, a foreach op's without its prefix ("_foreach_add_" -> "add")."""
    return base_name(name).removeprefix("_foreach_")


def exact_op(op: Any) -> bool:
    """Whether generated code for `op` (an OpOverload) rounds as its eager kernel, whatever its arguments."""
    name = op.name() if hasattr(op, "name") else str(op)
    base = _base_name(name)
    overload = f"{base}.{getattr(op, '_overloadname', '')}"
    return (base in EXACT and overload not in INEXACT_OVERLOADS) or op_category(name) == "view"


def _result_dtypes(node: Node) -> set[torch.dtype]:
    values = node.meta.get("val")
    values = values if isinstance(values, (list, tuple)) else [values]
    return {v.dtype for v in values if isinstance(v, torch.Tensor)}


def _numbers(args: Any) -> list[float]:
    """The Python numbers among `args` (through lists; sizes too, which only errs on the safe side)."""
    flat = torch.utils._pytree.tree_leaves(args)
    return [a for a in flat if isinstance(a, (int, float)) and not isinstance(a, bool)]


def _constant_fill(arg: Any) -> bool:
    """Whether `arg` is a node filling a tensor with a value known when compiling (Inductor then
    folds it into the code that reads it)."""
    return (isinstance(arg, Node) and isinstance(arg.target, torch._ops.OpOverload)
            and op_category(arg.target.name()) == "fill"
            and not any(isinstance(a, Node) for a in torch.utils._pytree.tree_leaves((arg.args, arg.kwargs))))


def _exact_reciprocal(value: float) -> bool:
    return value != 0 and math.isfinite(value) and math.frexp(value)[0] in (0.5, -0.5)


def generated_as_eager(node: Node) -> bool:
    """Whether Inductor's code for `node` gives the eager kernel's bits."""
    if not exact_op(node.target):
        return False  # (also on integers: Inductor expects such ops decomposed, as they are elsewhere)
    dtypes = _result_dtypes(node)
    if not any(d.is_floating_point or d.is_complex for d in dtypes):
        return True
    name = _base_name(node.target.name())
    if name in _SCALED and node.kwargs.get("alpha", 1) != 1:
        return False
    if dtypes & _REDUCED:
        # Constants are not rounded to the dtype in generated code; ATen rounds fill values, and
        # the scalar operand of add and sub (not of mul or div), to it first.
        dtype = next(iter(dtypes & _REDUCED))
        if (name in _SCALED or op_category(node.target.name()) == "fill") and any(
                float(torch.tensor(n, dtype=dtype)) != n for n in _numbers((node.args, node.kwargs))):
            return False
    if name == "div" and len(node.args) > 1:
        # Inductor multiplies by the reciprocal of a constant divisor (except on the "cpu" device)
        divisors = torch.utils._pytree.tree_leaves(node.args[1])
        return not any(_constant_fill(d) or (isinstance(d, (int, float)) and not _exact_reciprocal(d))
                       for d in divisors)
    return True


def mark_eager_calls(gm: GraphModule) -> list[str]:
    """Makes Inductor call the eager kernel for every op of `gm` whose generated code would round
    differently (or which the program's decomposition table kept whole, whatever its dtype);
    returns their names."""
    from torch._inductor.lowering import lowerings

    for node in list(gm.graph.nodes):
        if _foreach(node) and not (node.target in lowerings and generated_as_eager(node)) and _copied_back(node):
            _call_per_tensor(gm, node)
    marked = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload) \
                or target.namespace not in ("aten", "prims"):
            continue
        lowered = target in lowerings
        if not lowered:
            register_eager_kernel_lowering(target)
        if not lowered or not generated_as_eager(node):
            node.meta["should_fallback"] = True
            marked.append(node.name)
    return marked


def _foreach(node: Node) -> bool:
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and node.target.namespace == "aten" and node.target.__name__.startswith("_foreach_"))


def _copied_back(node: Node) -> bool:
    """Whether a result of foreach `node` is copied into the tensor of its first list it came from.
    Inductor then makes the node in place, after this module's marking; called as the eager kernel,
    the in-place op returns nothing for the node's other readers to index, and compiling fails."""
    firsts = node.args[0]
    for user in node.users:
        if user.target is not operator.getitem:
            continue
        for reader in user.users:
            if (reader.target is torch.ops.aten.copy_.default and reader.args[1] is user
                    and reader.args[0] is firsts[user.args[1]]):
                return True
    return False


def _per_tensor_overload(packet: Any, values: list[Any]) -> tuple[Any, tuple, dict] | None:
    """The overload of `packet` that takes `values` (a foreach op's arguments for one tensor, in
    schema order), with them split into its positional and keyword arguments."""
    examples = [v.meta["val"] if isinstance(v, Node) else v for v in values]
    for name in packet.overloads():
        schema = getattr(packet, name)._schema
        if "out" in name or len(values) > len(schema.arguments):
            continue
        positional = [i for i, a in enumerate(schema.arguments[:len(values)]) if not a.kwarg_only]
        keywords = {a.name: i for i, a in enumerate(schema.arguments[:len(values)]) if a.kwarg_only}
        try:
            resolved = torch._C._jit_resolve_packet(packet._qualified_op_name, *[examples[i] for i in positional],
                                                    **{k: examples[i] for k, i in keywords.items()})
        except RuntimeError:
            continue
        if resolved == name:
            return (getattr(packet, name), tuple(values[i] for i in positional),
                    {k: values[i] for k, i in keywords.items()})
    return None


def _call_per_tensor(gm: GraphModule, node: Node) -> None:
    """Replaces foreach `node` by its op on each tensor, the computation of ATen's CPU foreach kernels
    (so the same bits), unless some argument or reader does not allow it."""
    schema_args = node.target._schema.arguments
    values = []
    for i, argument in enumerate(schema_args):
        if i < len(node.args):
            values.append(node.args[i])
        elif argument.name in node.kwargs:
            values.append(node.kwargs[argument.name])
        elif argument.has_default_value():
            values.append(argument.default_value)
        else:
            return
    packet = getattr(torch.ops.aten, node.target.__name__.split(".")[0].removeprefix("_foreach_"), None)
    if packet is None or any(user.target is not operator.getitem for user in node.users):
        return
    overloads = []
    for i in range(len(node.meta["val"])):
        per_tensor = [v[i] if isinstance(a.type, torch.ListType) else v for a, v in zip(schema_args, values)]
        found = _per_tensor_overload(packet, per_tensor)
        if found is None:
            return
        overloads.append(found)
    calls = []
    for (target, args, kwargs), result in zip(overloads, node.meta["val"]):
        with gm.graph.inserting_before(node):
            call = gm.graph.call_function(target, args, kwargs)
        call.meta["val"] = result
        calls.append(call)
    for user in list(node.users):
        user.replace_all_uses_with(calls[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(node)


def program_table(table: dict[Any, Callable[..., Any]]) -> dict[Any, Callable[..., Any]]:
    """`table` without the decompositions of ops a program calls as the eager kernel (a fresh dict)."""
    return {op: fn for op, fn in table.items() if exact_op(op)}
