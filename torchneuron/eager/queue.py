"""The op queue of adaptive eager mode: a TorchDispatchMode in front of the runtime's fallback.

Every aten op reaches `AdaptiveMode.__torch_dispatch__` below autograd. Ops on neuron tensors
are handled by their `OpInfo` (ops.py):

- a queued op gets its outputs now, as real device buffers shaped by meta kernels, and waits;
  storage identity, views, aliasing and autograd therefore stay exactly eager's. The first
  time an op is seen with an argument signature it runs unqueued instead, and shows whether
  its meta kernel and out= variant reproduce it (ops.learn_output_plan);
- a view op runs now (it reads no data); a view of a queued result is also recorded, so a
  fused kernel can compute through it;
- an op that only allocates (`empty_like`, a factory) runs now: it reads no device data;
- any other op flushes the queue and then runs, so random numbers, host reads (`item`,
  `.cpu()`, printing), NKI kernels and collectives see every earlier op done.

A queued op whose argument aliases a pending result it does not track (a tensor autograd
saved, say) flushes first, and so does one issued on another stream or device than the queued
ops (a flush runs them on the stream they were issued on). The queue also flushes when it is
long and when the mode is turned off; under `torch.use_deterministic_algorithms(True)` every op
runs unqueued. A flush hands the entries to fusion.py, which runs them in order, fused where it
pays, below autograd as they were queued. Host-only ops pass through (see `_call` for the
ZeroTensor cases a dispatch mode must work around).
"""
from __future__ import annotations

import bisect
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._C._dynamo.eval_frame import set_eval_frame
from torch.utils._python_dispatch import TorchDispatchMode

from torchneuron.eager.ops import (ALLOCATE, QUEUE, UNQUEUEABLE, VIEW, OpInfo, allocate, flat_tensors,
                                   known_output_plan, learn_output_plan, op_info)
from torchneuron.eager.recording import worklog_paused
from torchneuron.runtime import _C as fast  # the runtime's entry points for per-op Python code

MAX_QUEUE = 1024
FLOAT = ("float",)  # a float argument in a signature (its value is kept apart)
aten = torch.ops.aten
TO_COPY = aten._to_copy.default
NO_NEURON, SOME_NEURON, ALL_NEURON = 0, 1, 2  # where an op's tensors are (fast.signature; plain
# Tensors and Parameters only count as ALL_NEURON: a subclass may keep its data elsewhere)


class Entry:
    """One queued op, or one recorded view of a queued result.

    `tensors`, `signature` and `floats` are the tensor arguments in order, the arguments'
    signature (tensors as dtype/shape/strides, floats as FLOAT) and the float values;
    `produced` are the tensors the op creates (its output buffers, or a view's results)."""

    __slots__ = ("func", "info", "args", "kwargs", "outs", "result", "is_view", "tensors", "signature", "floats",
                 "produced", "via_out")

    def __init__(self, func: Any, info: OpInfo | None, args: tuple, kwargs: dict, outs: list, result: Any,
                 tensors: list[torch.Tensor], signature: Any, floats: list[float], is_view: bool = False,
                 via_out: bool = False) -> None:
        self.func, self.info, self.args, self.kwargs = func, info, args, kwargs
        self.outs, self.result, self.is_view, self.via_out = outs, result, is_view, via_out
        self.tensors, self.signature, self.floats = tensors, signature, floats
        self.produced = flat_tensors(result) if is_view else flat_tensors(outs)

    def run_eagerly(self) -> None:
        """Runs the op as plain eager would (its functional outputs via the out= variant)."""
        if self.is_view:
            return
        info = self.info
        if info.inplace:
            self.func(*self.args, **self.kwargs)
        elif self.via_out:
            kwargs = dict(self.kwargs)
            kwargs.update(zip(info.out_names, self.outs))
            info.out_overload(*self.args, **kwargs)
        else:
            results = self.func(*self.args, **self.kwargs)
            results = results if isinstance(results, (list, tuple)) and len(self.outs) > 1 else [results]
            with worklog_paused():  # moving the result into the handed-out buffer is not device work
                for buffer, value in zip(self.produced, flat_tensors(results)):
                    buffer.copy_(value)

    def release(self) -> None:
        """Drops every reference to tensors (after a fused program took over the entry)."""
        self.args = self.kwargs = self.outs = self.result = self.tensors = self.produced = None


_NUMBER_TENSOR_DTYPES = {bool: torch.bool, int: torch.int64, float: torch.float64, complex: torch.complex128}


def _materialized(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value._is_zerotensor():
        return torch.zeros(value.shape, dtype=value.dtype, device=value.device)
    return value


def _call(func: Any, info: OpInfo, args: tuple, kwargs: dict, tensors: list[torch.Tensor] = ()) -> Any:
    """Runs an op the queue passes through, working around what any dispatch mode meets in
    PyTorch's ZeroTensor handling (efficient zero tensors, as some CPU gradients are):
    - a ZeroTensor reaches a mode as a tensor with no memory, and calling the op on it from the
      mode reads a null pointer: it is passed as real zeros;
    - a wrapped-number tensor reaches a mode as a Python number, which an op refuses where it
      takes `self` (the ZeroTensor decompositions call `expand(1, size)`): such a call is retried
      with the numbers as 0-d tensors."""
    if any(t._is_zerotensor() for t in tensors):
        args, kwargs = pytree.tree_map(_materialized, (args, kwargs))
    try:
        return func(*args, **kwargs)
    except RuntimeError as error:  # the argument parser's refusal: nothing ran
        numbers = [i for i in info.tensor_positions if i < len(args) and type(args[i]) in _NUMBER_TENSOR_DTYPES]
        if not numbers or "Expected a value of type 'Tensor'" not in str(error):
            raise
    args = tuple(torch.tensor(a, dtype=_NUMBER_TENSOR_DTYPES[type(a)]) if i in numbers else a
                 for i, a in enumerate(args))
    return func(*args, **kwargs)


class AdaptiveMode(TorchDispatchMode):
    """Queues device ops and runs them fused at the next flush (see the module docstring)."""

    def __init__(self, executor: Any) -> None:
        super().__init__()
        self.executor = executor          # fusion.Executor: runs a flushed queue
        self.entries: list[Entry] = []
        self.pending: dict[int, torch.Tensor] = {}   # id -> queued result or recorded view
        self.starts: list[int] = []       # sorted start addresses of pending buffers
        self.ends: dict[int, int] = {}
        self.flushing = False
        self.lane: tuple[int, int] = (-1, -1)   # (device, stream id) the queued ops were issued on
        self.stream: torch.Stream | None = None
        self.stats = {"queued": 0, "unqueued": 0, "flushes": 0}

    # ---- the queue ---------------------------------------------------------------------------
    def _aliases_untracked(self, tensor: torch.Tensor) -> bool:
        """A tensor sharing memory with a pending buffer, but not one the queue tracks."""
        if not self.starts or id(tensor) in self.pending or tensor.numel() == 0:  # (cheap tests first)
            return False
        address = tensor.data_ptr()
        i = bisect.bisect_right(self.starts, address) - 1
        return i >= 0 and address < self.ends[self.starts[i]]

    def _track(self, tensor: torch.Tensor) -> None:
        self.pending[id(tensor)] = tensor
        storage = tensor.untyped_storage()
        if storage.nbytes():
            start = storage.data_ptr()
            bisect.insort(self.starts, start)
            self.ends[start] = start + storage.nbytes()

    def flush(self) -> None:
        """Runs every queued op, in order."""
        if not self.entries or self.flushing:
            return
        entries, stream = self.entries, self.stream
        self.entries, self.pending, self.starts, self.ends = [], {}, [], {}
        self.flushing = True
        self.stats["flushes"] += 1
        current = torch.accelerator.current_stream(stream.device)
        try:
            if current != stream:  # run on the stream the ops were issued on
                torch.accelerator.set_stream(stream)
            # The ops were queued below autograd; a flush from user code (flush(), a timeline
            # reader, printing) must not record them in the autograd graph or bump versions again.
            with torch._C._AutoDispatchBelowADInplaceOrView():
                self.executor.run(entries)
        finally:
            if current != stream:
                torch.accelerator.set_stream(current)
            self.flushing = False

    def _run_now(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self.flush()
        self.stats["unqueued"] += 1
        return func(*args, **kwargs)

    def _enqueue(self, func: Any, info: OpInfo, args: tuple, kwargs: dict, tensors: list[torch.Tensor],
                 signature: Any, floats: list[float]) -> Any:
        device = tensors[0].device
        lane = (device.index, fast.current_stream_id(device.index))
        if lane != self.lane:  # a queue holds the ops of one stream of one device
            self.flush()
            self.lane, self.stream = lane, torch.accelerator.current_stream(device)
        if info.inplace:
            result = args[0] if func._schema.returns else None
            outs: list = []
            via_out = False
        else:
            key = (id(func), signature)
            plan = known_output_plan(key)
            if plan is None:  # first seen with this signature: runs now, and shows how to queue it
                result = self._run_now(func, args, kwargs)
                learn_output_plan(func, info, key, args, kwargs, result)
                return result
            if plan is UNQUEUEABLE:
                return self._run_now(func, args, kwargs)
            outs = [allocate(spec, device) for spec in plan.specs]
            result = outs[0] if len(outs) == 1 else tuple(outs)
            via_out = plan.via_out
        entry = Entry(func, info, args, kwargs, outs, result, tensors, signature, floats, via_out=via_out)
        self.entries.append(entry)
        for tensor in entry.produced:
            self._track(tensor)
        self.stats["queued"] += 1
        if len(self.entries) >= MAX_QUEUE:
            self.flush()
        return result

    def _record_view(self, func: Any, args: tuple, kwargs: dict, tensors: list[torch.Tensor], signature: Any,
                     floats: list[float]) -> Any:
        result = func(*args, **kwargs)
        if self.pending and any(id(t) in self.pending for t in tensors):
            entry = Entry(func, None, args, kwargs, [], result, tensors, signature, floats, is_view=True)
            self.entries.append(entry)
            for view in entry.produced:
                self.pending[id(view)] = view
        return result

    # ---- dispatch ------------------------------------------------------------------------------
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # __torch_dispatch__ below turns Dynamo off itself, without torch's generic wrapper

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Dynamo must never trace the queue (an op issued from a frame Dynamo is evaluating lands
        # here): what torch's disable wrapper does for dispatch modes, at a fraction of its cost.
        prior = set_eval_frame(None)
        try:
            return self._dispatch(func, args, kwargs or {})
        finally:
            set_eval_frame(prior)

    def _dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if self.flushing:
            return func(*args, **kwargs)
        info = op_info(func)
        # The arguments' signature: tensors as (dtype, sizes, strides), lists and tuples as tuples of
        # their items', floats as FLOAT (their values kept apart), anything else as itself.
        signature, tensors, floats, placement = fast.signature(args, kwargs, FLOAT)
        if not tensors:
            if info.random:
                return self._run_now(func, args, kwargs)
            return _call(func, info, args, kwargs)  # a factory: reads no device data, writes fresh memory
        if placement != ALL_NEURON:  # some tensor is on another device or of a tensor subclass
            if placement == SOME_NEURON:
                return self._run_now(func, args, kwargs)
            return _call(func, info, args, kwargs, tensors)  # host-only work never touches queued buffers
        if info.kind == VIEW:
            return self._record_view(func, args, kwargs, tensors, signature, floats)
        if info.kind == ALLOCATE:
            return func(*args, **kwargs)
        if info.kind != QUEUE or torch.are_deterministic_algorithms_enabled():
            return self._run_now(func, args, kwargs)
        if func is TO_COPY and kwargs.get("device") is not None and torch.device(kwargs["device"]).type != "neuron":
            return self._run_now(func, args, kwargs)
        if self.starts:
            pending = self.pending
            for tensor in tensors:
                if id(tensor) not in pending and self._aliases_untracked(tensor):
                    self.flush()
                    break
        return self._enqueue(func, info, args, kwargs, tensors, signature, floats)
