"""Links captured device work to torch.profiler's own events (the native integration).

This module owns what happens to a torch.profiler result once its FunctionEvents exist:
- the profiler's bookkeeping (the `torchneuron::_worklog_full` callback through which the C++
  work log asks Python to price a full log, and everything nested in it) is removed, so
  `events()`, `key_averages()` and tables show only the user's ops;
- every DeviceEvent becomes a device-side FunctionEvent (device_type PrivateUse1, named
  "neuron: <kernel>", its time range the modeled device interval) and is attached to the CPU op
  that issued it as a kernel (`FunctionEvent.append_kernel`), as Kineto does for CUDA kernels.
  So `device_time_total`, `self_device_time_total` and the "Self NEURON"/"NEURON total" columns
  of `key_averages().table()` report modeled device time, for ops and kernels alike.

Matching is by host time: the capture notes `time.time_ns()` inside the issuing call (the work
log's record hook for eager ops and copies, the charge for work charged from Python), which lies
inside that call's profiler event (same clock as Kineto's): the owner is the innermost CPU op
containing that instant.
"""
from __future__ import annotations

import bisect
from typing import Any, Iterable

from torch.autograd import DeviceType
from torch.autograd.profiler_util import FunctionEvent

from torchneuron.profiler.capture import DeviceCapture, DeviceEvent

BOOKKEEPING = frozenset({"torchneuron::_worklog_full"})
_TOLERANCE_US = 25.0  # clock conversion slack when no interval contains the instant
_MAX_SCAN = 4096


def bookkeeping_ids(events: Iterable[Any]) -> set[int]:
    """ids (Python object ids) of bookkeeping events and everything nested inside them."""
    hidden: set[int] = set()
    stack = [e for e in events if e.name in BOOKKEEPING]
    while stack:
        e = stack.pop()
        if id(e) not in hidden:
            hidden.add(id(e))
            stack.extend(e.cpu_children)
    return hidden


class _Intervals:
    """Innermost-interval lookup over FunctionEvents (times in us from the trace start)."""

    def __init__(self, events: list[Any]) -> None:
        self.events = sorted(events, key=lambda e: e.time_range.start)
        self.starts = [e.time_range.start for e in self.events]

    def innermost(self, t: float, tolerance: float = 0.0) -> Any | None:
        i = bisect.bisect_right(self.starts, t) - 1
        for j in range(i, max(-1, i - _MAX_SCAN), -1):
            if self.events[j].time_range.end >= t:
                return self.events[j]
        if tolerance > 0.0:  # nearest start within the tolerance
            candidates = [k for k in (i, i + 1) if 0 <= k < len(self.events)
                          and abs(self.starts[k] - t) <= tolerance]
            if candidates:
                return self.events[min(candidates, key=lambda k: abs(self.starts[k] - t))]
        return None


def link(function_events: list[Any], captures: list[DeviceCapture],
         trace_start_ns: int) -> tuple[list[Any], list[FunctionEvent], dict[str, int]]:
    """Attaches each captured device event to its issuing op among `function_events` (the events
    of one profiling cycle, times relative to `trace_start_ns`). Returns the events without the
    bookkeeping ones, the new device-side FunctionEvents, and counts {"linked", "unlinked", "hidden"}."""
    hidden = bookkeeping_ids(function_events)
    ops = _Intervals([e for e in function_events if id(e) not in hidden and not e.is_async
                      and e.device_type.name == "CPU"])
    linked = unlinked = 0
    device_events = []
    next_id = max((e.id for e in function_events), default=0) + 1
    use_device = function_events[0].use_device if function_events else "neuron"
    for capture in captures:
        offset = (capture.start_ns - trace_start_ns) / 1e3
        for ev in capture.events:
            owner = ops.innermost(offset + ev.host_time_us, _TOLERANCE_US if ev.kind in ("op", "copy") else 0.0)
            device_events.append(_device_function_event(ev, offset, next_id, owner, use_device))
            next_id += 1
            if owner is None:
                unlinked += 1
                continue
            owner.append_kernel(kernel_name(ev), ev.device, ev.duration_us)
            ev.host_op, ev.host_op_id = owner.name, int(owner.id)
            linked += 1
    for e in function_events:
        if e.cpu_parent is not None and id(e.cpu_parent) in hidden:
            e.cpu_parent = None
    kept = [e for e in function_events if id(e) not in hidden]
    return kept, device_events, {"linked": linked, "unlinked": unlinked, "hidden": len(hidden)}


def kernel_name(ev: DeviceEvent) -> str:
    """Name of a device event's row in torch.profiler tables: "neuron: aten::addmm",
    "neuron: copy h2d"."""
    return f"neuron: copy {ev.copy_kind}" if ev.copy_kind else f"neuron: {ev.name}"


def _device_function_event(ev: DeviceEvent, offset_us: float, event_id: int, owner: Any,
                           use_device: str | None) -> FunctionEvent:
    start = offset_us + ev.start_us
    fe = FunctionEvent(
        id=event_id, name=kernel_name(ev), thread=ev.stream, start_us=start, end_us=start + ev.duration_us,
        overload_name="", input_shapes=[], stack=[], concrete_inputs=[], kwinputs={},
        use_device=use_device or "neuron", device_type=DeviceType.PrivateUse1, device_index=ev.device,
        device_resource_id=ev.stream, flops=ev.flops, trace_name=ev.name,
        linked_correlation_id=int(owner.id) if owner is not None else 0)
    return fe
