"""The Python side of adaptive eager mode's op queue.

The queue itself is C++ (`eager/csrc/queue.cpp`, inside the device's boxed fallback): it
queues ops, learns their output shapes, tracks where each argument comes from, and replays a
queue it has seen before from a cached plan. It calls Python for two things:

- `queue_kind(name)`: once per operator, what the queue may do with it (op_kinds.op_info);
- `flush_records(records)`: once per queue it has no plan for. The records become `Entry`
  objects, queue_fusion.py's Executor runs them (fusing where it pays), and the plan it followed goes
  back to C++: which entries ran eagerly, which ran as one fused program, and that program's
  inputs and outputs, which C++ checks against its own before caching the plan. A plan that
  depended on a decision Python will revisit (a run seen once is not compiled yet) is not final
  and is not cached.

A record is `(op name, args, kwargs, outs, kind)`: `outs` holds the output buffers handed out
when the op was queued (per return, a tensor or a list), kind says functional, in-place, out=
or view. A view record is a view op of queued memory (its views in `outs`), which a fused
program computes through; an `alias` record stands for a second tensor object over a queued
tensor (an autograd-saved tensor, say).
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron.eager.op_kinds import ALLOCATE, QUEUE, SYNC, VIEW, OpInfo, flat_tensors, op_info, traceable_overload
from torchneuron.runtime.worklog import worklog_paused
from torchneuron.runtime import _C as fast  # the runtime's entry points for per-op Python code

FLOAT = ("float",)  # a float argument in a signature (its value is kept apart)
# record kinds and queue_kind() codes, defined once in C++ (csrc/queue.h: Kind, kRandomBit)
_CODES = fast.QUEUE_KINDS
FUNCTIONAL, INPLACE, VIEW_RECORD, WRITES_OUT = (_CODES[k] for k in ("FUNCTIONAL", "INPLACE", "VIEW", "OUT"))
RANDOM_BIT = _CODES["RANDOM_BIT"]
_KIND_CODES = {SYNC: _CODES["SYNC"], ALLOCATE: _CODES["ALLOCATE"], VIEW: _CODES["VIEW"]}


class Entry:
    """One queued op, or one view of a queued result.

    `tensors`, `signature` and `floats` are the tensor arguments in order, the arguments'
    signature (tensors as dtype/shape/strides, floats as FLOAT) and the float values;
    `produced` are the tensors the op creates (its output buffers, or a view's result); `index`
    is its position in the flushed queue."""

    __slots__ = ("func", "info", "args", "kwargs", "outs", "result", "is_view", "tensors", "signature", "floats",
                 "produced", "index")

    def __init__(self, func: Any, info: OpInfo | None, args: tuple, kwargs: dict, outs: list, result: Any,
                 tensors: list[torch.Tensor], signature: Any, floats: list[float], is_view: bool = False,
                 index: int = 0) -> None:
        self.func, self.info, self.args, self.kwargs = func, info, args, kwargs
        self.outs, self.result, self.is_view, self.index = outs, result, is_view, index
        self.tensors, self.signature, self.floats = tensors, signature, floats
        self.produced = flat_tensors(result) if is_view else flat_tensors(outs)

    def run_eagerly(self) -> None:
        """Runs the op as plain eager would, its functional results moved into the handed-out buffers."""
        if self.is_view:
            return
        results = _call(self.func, self.args, self.kwargs)
        if self.info.inplace or self.info.writes_out:
            return
        results = results if isinstance(results, (list, tuple)) and len(self.outs) > 1 else [results]
        with worklog_paused():  # moving the result into the handed-out buffer is not device work
            for buffer, value in zip(self.produced, flat_tensors(results)):
                buffer.copy_(value)

    def release(self) -> None:
        """Drops every reference to tensors (after a fused program took over the entry)."""
        self.args = self.kwargs = self.outs = self.result = self.tensors = self.produced = None


# Ops the device runs as views though their schema says otherwise: replayed as the view op, so a
# traced program knows its result aliases its input (an in-place op on it changes both).
_AS_VIEW = {torch.ops.aten._unsafe_view.default: torch.ops.aten.view.default}

_NUMBER_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64}


def _call(func: Any, args: tuple, kwargs: dict) -> Any:
    """Runs an op whose wrapped-number tensors came back as Python numbers (`x % 3` reaches the
    device as remainder.Tensor): through its Scalar overload, or with the numbers as 0-d tensors
    where it has none."""
    overload = traceable_overload(func, args)
    if overload is not None:
        return overload(*args, **kwargs)
    positions = op_info(func).tensor_positions
    args = tuple(torch.tensor(a, dtype=_NUMBER_DTYPES[type(a)]) if i in positions and type(a) in _NUMBER_DTYPES
                 else a for i, a in enumerate(args))
    return func(*args, **kwargs)


_resolved: dict[str, Any] = {}


def resolve(name: str) -> Any:
    """The OpOverload named like "aten::add.Tensor" (None if there is none)."""
    func = _resolved.get(name)
    if func is None and name not in _resolved:
        namespace, _, rest = name.partition("::")
        packet_name, _, overload = rest.partition(".")
        try:
            func = getattr(getattr(getattr(torch.ops, namespace), packet_name), overload or "default")
        except (AttributeError, RuntimeError):
            func = None
        _resolved[name] = func
    return func


def queue_kind(name: str) -> int:
    """What the C++ queue may do with an operator: queue.cpp's Kind, plus RANDOM_BIT."""
    func = resolve(name)
    if func is None:
        return _KIND_CODES[SYNC] | RANDOM_BIT  # unknown effects: keep it in order
    info = op_info(func)
    if info.kind == QUEUE:
        code = INPLACE if info.inplace else WRITES_OUT if info.writes_out else FUNCTIONAL
    else:
        code = _KIND_CODES[info.kind]
    return code | (RANDOM_BIT if info.random else 0)


def entries_from_records(records: list) -> list[Entry]:
    entries = []
    for index, (name, args, kwargs, outs, kind) in enumerate(records):
        func = resolve(name)
        signature, tensors, floats, _ = fast.signature(args, kwargs, FLOAT)
        if kind == VIEW_RECORD:
            func = _AS_VIEW.get(func, func)
            result = outs[0] if len(outs) == 1 else outs
            entry = Entry(func, None, args, kwargs, [], result, tensors, signature, floats, is_view=True)
        elif kind == INPLACE:
            result = args[0] if func._schema.returns else None
            entry = Entry(func, op_info(func), args, kwargs, [], result, tensors, signature, floats)
        elif kind == WRITES_OUT:
            entry = Entry(func, op_info(func), args, kwargs, [], None, tensors, signature, floats)
        else:
            result = outs[0] if len(outs) == 1 else tuple(outs)
            entry = Entry(func, op_info(func), args, kwargs, outs, result, tensors, signature, floats)
        entry.index = index
        entries.append(entry)
    return entries


def flush_records(executor: Any, records: list) -> tuple[list, bool]:
    """Runs a flushed queue the C++ side has no plan for; returns (actions, final): the plan
    followed, as (begin, end, fused entry point or None, inputs, outputs) per stretch of entries."""
    entries = entries_from_records(records)
    records.clear()  # the entries hold the only references now: liveness counts them
    return executor.run(entries)
