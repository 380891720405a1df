"""What adaptive eager mode may do with each aten op, decided once per operator.

`op_info(func)` classifies an OpOverload:

- VIEW: aliases an input and reads no data (`view`, `transpose`, ...): runs immediately;
- QUEUE: reads and writes device data through its arguments only, so it can wait in the
  queue: a functional op (its outputs are allocated now and filled at flush, through its
  `out=` variant when it has one), or an in-place op mutating only `self` (and foreach
  versions of both);
- ALLOCATE: reads only its tensor arguments' metadata and writes fresh memory (`empty_like`,
  `new_zeros`, ...): runs immediately;
- SYNC: anything else (random ops, host-only ops, data-dependent shapes, custom and c10d
  ops): the queue is flushed first and the op runs immediately, so stream order and random
  numbers stay eager's. Copies to or from the host are SYNC by their arguments (queue.py).

An op with no tensor argument (a factory, a profiler marker) reads no device data: it runs
immediately, without a flush, unless it draws random numbers.

`FUSIBLE` ops are queued ops a fused kernel may contain (the rest of the queued ops run one
by one at flush). The first time a functional op is seen with an argument signature it runs
unqueued, and `learn_output_plan` records whether, and how, it can be queued with that
signature afterwards (`known_output_plan`): its outputs' shapes, strides and dtypes from its
meta kernel, checked against what the device kernel made, and whether its out= variant fills
them faithfully.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree

from torchneuron.hardware.model import classify
from torchneuron.ops import policy
from torchneuron.runtime import _C as fast  # the runtime's entry points for per-op Python code

VIEW, QUEUE, SYNC, ALLOCATE = "view", "queue", "sync", "allocate"
FUSIBLE_CATEGORIES = frozenset({"elementwise", "transcendental", "copy", "fill", "iota", "reduction", "softmax",
                                "softmax_backward", "norm", "norm_backward", "matmul", "foreach",
                                "foreach_transcendental", "optimizer", "gather", "scatter"})
# Functional ops the model files under "view" (no data movement on the device) that fuse freely.
FUSIBLE_OPS = frozenset({"aten::_unsafe_view", "aten::clone", "aten::alias_copy", "aten::view_copy"})
# Ops with tensor arguments that read only their metadata and write fresh memory.
ALLOCATORS = frozenset({"aten::new_empty_strided", "aten::new_empty", "aten::empty_like", "aten::new_zeros",
                        "aten::new_ones", "aten::new_full", "aten::zeros_like", "aten::ones_like",
                        "aten::full_like"})
NEVER_QUEUED = frozenset({"aten::_copy_from", "aten::_copy_from_and_resize", "aten::_local_scalar_dense",
                          "aten::equal", "aten::set_", "aten::resize_", "aten::record_stream", "aten::item"})


@dataclass(frozen=True)
class OpInfo:
    kind: str
    fusible: bool = False
    random: bool = False           # draws from a generator: never reordered
    inplace: bool = False          # mutates self (or every tensor of the self list) and returns it
    out_overload: Any = None       # the .out variant a functional op runs as at flush
    out_names: tuple[str, ...] = ()
    tensor_positions: tuple[int, ...] = ()  # positional Tensor arguments (for traceable_overload)


def _argument_key(schema: torch._C.FunctionSchema) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]


def _out_variant(func: torch._ops.OpOverload) -> tuple[Any, tuple[str, ...]]:
    schema = func._schema
    wanted = _argument_key(schema)
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        args = candidate._schema.arguments
        outs = tuple(a.name for a in args if a.is_out)
        if outs and len(outs) == len(schema.returns) and _argument_key(candidate._schema) == wanted:
            return candidate, outs
    return None, ()


def _mutates_only_self(schema: torch._C.FunctionSchema) -> bool:
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return len(written) == 1 and written[0].name == "self" and not any(a.is_out for a in schema.arguments)


def _is_view(schema: torch._C.FunctionSchema) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)


def _classify(func: torch._ops.OpOverload) -> OpInfo:
    info = _kind_of(func)
    if isinstance(func, torch._ops.OpOverload):
        positions = tuple(i for i, a in enumerate(func._schema.arguments)
                          if str(a.type) == "Tensor" and not a.kwarg_only)
        info = dataclasses.replace(info, tensor_positions=positions)
    return info


def _kind_of(func: torch._ops.OpOverload) -> OpInfo:
    if not isinstance(func, torch._ops.OpOverload):
        return OpInfo(SYNC, random=True)
    if func.namespace == "profiler":
        return OpInfo(SYNC)  # markers: run in place, no data
    if func.namespace != "aten":
        return OpInfo(SYNC, random=True)  # unknown effects: keep it in order
    schema = func._schema
    name = func.name()
    base = name.split(".")[0]
    if _is_view(schema):
        return OpInfo(VIEW)
    if base in ALLOCATORS and not schema.is_mutable:  # not their out= overloads
        return OpInfo(ALLOCATE)
    random = torch.Tag.nondeterministic_seeded in func.tags or bool(policy.classify_op(name) & policy.IMPLICIT_RNG) \
        or any(str(a.type).startswith("Generator") for a in schema.arguments)
    if random or base in NEVER_QUEUED or torch.Tag.inplace_view in func.tags \
            or torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags \
            or not policy.runs_natively(name):
        return OpInfo(SYNC, random=random)
    fusible = classify(name) in FUSIBLE_CATEGORIES or base in FUSIBLE_OPS
    if schema.is_mutable:
        if _mutates_only_self(schema):
            return OpInfo(QUEUE, fusible=fusible, inplace=True)
        return OpInfo(SYNC)
    if not schema.returns or any(str(r.type) not in ("Tensor", "Tensor[]") for r in schema.returns):
        return OpInfo(SYNC)
    out, names = _out_variant(func)  # without one, results are copied into the handed-out buffers
    return OpInfo(QUEUE, fusible=fusible, out_overload=out, out_names=names)


_infos: dict[int, OpInfo] = {}   # by id(): OpOverload hashes in Python, this is the per-op hot path
_classified: list[Any] = []      # keeps each classified op alive, so its id is never reused


def op_info(func: Any) -> OpInfo:
    info = _infos.get(id(func))
    if info is None:
        info = _infos[id(func)] = _classify(func)
        _classified.append(func)
    return info


_NUMBERS = (int, float, bool)
_scalar_overloads: dict[tuple, Any] = {}


def traceable_overload(func: Any, args: tuple) -> Any:
    """`func`, or the overload taking a Scalar where `args` pass a Python number for a Tensor
    argument (a wrapped number, as `x * 2` reaches aten): `mul.Tensor` -> `mul.Scalar`. Graph
    tracing cannot wrap the number itself. None when no such overload exists."""
    positions = op_info(func).tensor_positions
    for i in positions:
        if i < len(args) and type(args[i]) in _NUMBERS:
            break
    else:
        return func  # the common case: no Python number where a Tensor goes
    numbers = tuple(i for i in positions if i < len(args) and type(args[i]) in _NUMBERS)
    key = (func, numbers)
    if key not in _scalar_overloads:
        schema = func._schema
        wanted = [(a.name, "number" if i in numbers else str(a.type)) for i, a in enumerate(schema.arguments)]
        match = None
        for name in func.overloadpacket.overloads():
            candidate = getattr(func.overloadpacket, name)
            if [(a.name, str(a.type)) for a in candidate._schema.arguments] == wanted:
                match = candidate
                break
        _scalar_overloads[key] = match
    return _scalar_overloads[key]


# ---------------------------------------------------------------------------------------------
# What queueing an op needs: its outputs' metadata, learnt once per op and signature
# ---------------------------------------------------------------------------------------------

OutputSpec = tuple[tuple[int, ...], tuple[int, ...], torch.dtype]
UNQUEUEABLE = object()


@dataclass(frozen=True)
class OutputPlan:
    """How a queued functional op gets its outputs: buffers shaped by `specs` (an OutputSpec per
    return, or a list of them for Tensor[] returns), filled at flush through the op's out=
    variant when `via_out`, else by the functional op and a copy."""

    specs: list
    via_out: bool


_plans: dict[Any, Any] = {}


def known_output_plan(key: Any) -> Any:
    """The OutputPlan learnt for `key` (an op and its arguments' signature), UNQUEUEABLE, or None
    when the op was never seen with that signature."""
    return _plans.get(key)


def learn_output_plan(func: Any, info: OpInfo, key: Any, args: tuple, kwargs: dict, result: Any) -> None:
    """Learns from an op that just ran (with `result`) whether it can be queued with this
    signature: only if its meta kernel predicts exactly the outputs the device kernel made, and
    it fills them through its out= variant only if that gives the same values. The meta
    function may disagree with the CPU kernel (bfloat16 layer norm statistics), and an out=
    variant may not be the functional op (a 0-d `out` of binary_cross_entropy is resized)."""
    specs = _meta_specs(func, args, kwargs)
    if specs is UNQUEUEABLE or specs != _specs_of(func, result):
        _plans[key] = UNQUEUEABLE
        return
    via_out = info.out_overload is not None and _out_variant_reproduces(info, specs, args, kwargs, result)
    _plans[key] = OutputPlan(specs, via_out)


def _returns(func: Any, result: Any) -> list:
    return list(result) if isinstance(result, (tuple, list)) and len(func._schema.returns) > 1 else [result]


def _specs_of(func: Any, result: Any) -> Any:
    results = _returns(func, result)
    if any(r is None for r in results):  # an output it skips (convolution_backward's output_mask)
        return UNQUEUEABLE
    return [[_spec(t) for t in r] if isinstance(r, (list, tuple)) else _spec(r) for r in results]


def _to_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(_to_meta(v) for v in value)
    return value


def _meta_specs(func: Any, args: tuple, kwargs: dict) -> Any:
    try:
        with torch.no_grad():
            return _specs_of(func, func(*_to_meta(args), **_to_meta(kwargs)))
    except Exception:
        return UNQUEUEABLE


def _spec(t: torch.Tensor) -> OutputSpec:
    return tuple(t.shape), tuple(t.stride()), t.dtype


def _out_variant_reproduces(info: OpInfo, specs: list, args: tuple, kwargs: dict, result: Any) -> bool:
    """Runs the out= variant into fresh buffers (off the device timeline) and compares. It runs on
    copies of the arguments: some ops write arguments their schema does not mark as written
    (native_batch_norm's running statistics)."""
    from torchneuron.eager.recording import worklog_paused
    from torchneuron.runtime import host_view

    expected = flat_tensors(result)
    outs = [allocate(spec, expected[0].device) for spec in specs]
    try:
        with worklog_paused(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args, kwargs = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
            info.out_overload(*args, **kwargs, **dict(zip(info.out_names, outs)))
    except Exception:
        return False
    got = flat_tensors(outs)
    return len(got) == len(expected) and all(_same(host_view(a), host_view(b)) for a, b in zip(got, expected))


def allocate(spec: Any, device: torch.device) -> Any:
    """A device buffer (or list of them) for an OutputSpec (or list of them)."""
    if isinstance(spec, list):
        return [allocate(s, device) for s in spec]
    shape, stride, dtype = spec
    return fast.empty_strided(shape, stride, dtype, device.index)


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` (a tensor, or nested lists and tuples), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat_tensors(v)]
    return []


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape or a.stride() != b.stride() or a.dtype != b.dtype:
        return False
    if a.is_floating_point() or a.is_complex():
        return bool(((a == b) | (a.isnan() & b.isnan())).all())
    return torch.equal(a, b)
