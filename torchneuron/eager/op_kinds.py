"""What adaptive eager mode may do with each aten op, decided once per operator.

`op_info(func)` classifies an OpOverload:

- VIEW: aliases an input and reads no data (`view`, `transpose`, ...): runs immediately;
- QUEUE: reads and writes device data through its arguments only, so it can wait in the
  queue: a functional op (its outputs are allocated now and filled at flush), an in-place op
  mutating only `self`, or an out= variant writing only its `out` arguments (and foreach
  versions of these);
- ALLOCATE: reads only its tensor arguments' metadata and writes fresh memory (`empty_like`,
  `new_zeros`, ...): runs immediately;
- SYNC: anything else (random ops, host-only ops, data-dependent shapes, custom and c10d
  ops): the queue is flushed first and the op runs immediately, so stream order and random
  numbers stay eager's. Copies to or from the host are SYNC by their arguments (queue.cpp).

An op with no tensor argument (a factory, a profiler marker) reads no device data: it runs
immediately, without a flush, unless it draws random numbers.

`FUSIBLE` ops are queued ops a fused kernel may contain (the rest of the queued ops run one
by one at flush). How a queued op's outputs are shaped is learnt by the C++ queue, per op and
argument signature, from the first call (eager/csrc/queue.cpp).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from torchneuron.hardware.taxonomy import op_category
from torchneuron.ops import policy

VIEW, QUEUE, SYNC, ALLOCATE = "view", "queue", "sync", "allocate"
FUSIBLE_CATEGORIES = frozenset({"elementwise", "transcendental", "copy", "fill", "iota", "reduction", "softmax",
                                "softmax_backward", "norm", "norm_backward", "matmul", "foreach",
                                "foreach_transcendental", "optimizer", "gather", "scatter", "attention"})
# Functional ops the model files under "view" (no data movement on the device) that fuse freely.
FUSIBLE_OPS = frozenset({"aten::_unsafe_view", "aten::clone", "aten::alias_copy", "aten::view_copy"})
# Ops with tensor arguments that read only their metadata and write fresh memory.
ALLOCATORS = frozenset({"aten::new_empty_strided", "aten::new_empty", "aten::empty_like", "aten::new_zeros",
                        "aten::new_ones", "aten::new_full", "aten::zeros_like", "aten::ones_like",
                        "aten::full_like"})
# Tagged `nondeterministic_seeded` for their dropout argument, but the host kernel refuses any
# dropout: they never draw random numbers, so they queue and fuse like any op.
NEVER_RANDOM = frozenset({"aten::_scaled_dot_product_flash_attention_for_cpu"})
NEVER_QUEUED = frozenset({"aten::_copy_from", "aten::_copy_from_and_resize", "aten::_local_scalar_dense",
                          "aten::equal", "aten::set_", "aten::resize_", "aten::record_stream", "aten::item"})


@dataclass(frozen=True)
class OpInfo:
    kind: str
    fusible: bool = False
    random: bool = False           # draws from a generator: never reordered
    inplace: bool = False          # mutates self (or every tensor of the self list) and returns it
    writes_out: bool = False       # an out= variant: writes its `out` arguments only and returns them
    out_names: tuple[str, ...] = ()  # those arguments (keyword-only, last)
    tensor_positions: tuple[int, ...] = ()  # positional Tensor arguments (for traceable_overload)


def _mutates_only_self(schema: torch._C.FunctionSchema) -> bool:
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return len(written) == 1 and written[0].name == "self" and not any(a.is_out for a in schema.arguments)


def _writes_only_out(schema: torch._C.FunctionSchema) -> bool:
    written = [a for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    return bool(written) and all(a.is_out for a in written) and len(schema.returns) == len(written)


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
    seeded = torch.Tag.nondeterministic_seeded in func.tags and base not in NEVER_RANDOM
    random = seeded or bool(policy.fallback_policy(name) & policy.IMPLICIT_RNG) \
        or any(str(a.type).startswith("Generator") for a in schema.arguments)
    if random or base in NEVER_QUEUED or torch.Tag.inplace_view in func.tags \
            or torch.Tag.data_dependent_output in func.tags or torch.Tag.dynamic_output_shape in func.tags \
            or not policy.runs_natively(name):
        return OpInfo(SYNC, random=random)
    fusible = op_category(name) in FUSIBLE_CATEGORIES or base in FUSIBLE_OPS
    if schema.is_mutable:
        if _mutates_only_self(schema):
            return OpInfo(QUEUE, fusible=fusible, inplace=True)
        if _writes_only_out(schema):  # functional ops reach the device as their out= variant too
            return OpInfo(QUEUE, fusible=fusible, writes_out=True,
                          out_names=tuple(a.name for a in schema.arguments if a.is_out))
        return OpInfo(SYNC)
    if not schema.returns or any(str(r.type) not in ("Tensor", "List[Tensor]") for r in schema.returns):
        return OpInfo(SYNC)
    return OpInfo(QUEUE, fusible=fusible)


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


def flat_tensors(value: Any) -> list[torch.Tensor]:
    """The tensors in `value` (a tensor, or nested lists and tuples), in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flat_tensors(v)]
    return []
