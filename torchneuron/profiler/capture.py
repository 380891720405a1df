"""Capture of device activity while a profile is recording: the hot path of the profiler.

This module owns `DeviceCapture`: between `start()` and `stop()` it sees every unit of work
charged to any device timeline (through the timeline's listener API) and attributes it to the
Python code that issued it. It produces `DeviceEvent`s; everything else (linking to
torch.profiler events, traces, tables, analysis) works on those afterwards.

How attribution stays exact and cheap:
- eager ops and copies reach the timeline through the C++ work log. While capturing, the work
  log's record hook is the capture's (`_C.set_worklog_record_hook`), so the C++ fallback calls
  Python right after appending each record, *inside* the call that issued it, with the issuing
  frame. The capture walks the Python stack once there: the innermost frame outside
  torch/torchneuron/the standard library is the source line; `forward` frames of nn.Modules give
  the module chain. Records are still priced in batches (every BATCH records, or when anyone
  drains); the drain hook pairs each op/copy record with its context in order, and the timeline
  entries the drain enqueues arrive in the same order.
- work charged from Python (`torchneuron.hardware.charge`: NKI kernels, fused kernels, compiled
  graphs, collectives) is attributed from the stack at the time of the charge.
- backward ops carry the autograd node that ran them; its sequence number is the one the
  forward op had, which links them to the forward op's module.
Everything expensive (decoding signatures, module paths) happens in `stop()`. Assumption: one
thread issues neuron work at a time (records of concurrent threads may swap contexts).
"""
from __future__ import annotations

import collections
import os
import sys
import sysconfig
import threading
import time
from array import array
from typing import Any

import numpy as np
import torch

from torchneuron import settings
from torchneuron.hardware import timeline as device_timeline
from torchneuron.hardware.targets import get_target
from torchneuron.hardware import worklog
from torchneuron.profiler.attribution import build_events
from torchneuron.profiler.events import DeviceEvent, MemorySample
from torchneuron.runtime import _C as fast  # the runtime's entry points for per-call Python code
from torchneuron.runtime.extension import runtime_ops
from torchneuron.runtime.worklog import op_names

__all__ = ["DeviceEvent", "DeviceCapture", "MemorySample", "active_capture"]

MAX_EVENTS = settings.current().profiler_max_events


# ------------------------------------------------------------------------------------------------
# Stack walking
# ------------------------------------------------------------------------------------------------
_INTERNAL, _USER, _OPTIM = 0, 1, 2
# id(code) -> (class, name of a `forward` function's first argument or None). Keyed by id(code),
# not by the code object: hashing a code object rehashes its bytecode, names and constants every
# time (about 2 us for nn.Module._call_impl), once per frame per record. The code objects are kept
# alive here, so their ids are never reused while they are keys.
_code_info: dict[int, tuple[int, str | None]] = {}
_code_refs: list[Any] = []
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_USER_PKG_DIRS = (os.path.join(_PKG_DIR, "examples") + os.sep,)
_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["platstdlib"] + os.sep})
_SITE_DIRS = tuple({sysconfig.get_paths()["purelib"] + os.sep, sysconfig.get_paths()["platlib"] + os.sep})
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep


def _classify_code(code: Any) -> tuple[int, str | None]:
    """(class, self argument of a `forward`) of a code object, stored in _code_info."""
    path = code.co_filename
    if path.startswith(_OPTIM_DIR):
        cls = _OPTIM
    elif path.startswith(_USER_PKG_DIRS):
        cls = _USER
    elif path.startswith((_TORCH_DIR, _PKG_DIR)) or path.startswith("<frozen") or (
            path.startswith(_STDLIB_DIRS) and not path.startswith(_SITE_DIRS)):
        cls = _INTERNAL
    else:
        cls = _USER
    info = (cls, code.co_varnames[0] if code.co_name == "forward" and code.co_argcount else None)
    _code_info[id(code)] = info
    _code_refs.append(code)
    return info


def _code_class(code: Any) -> int:
    info = _code_info.get(id(code))
    return (info or _classify_code(code))[0]


_Module = torch.nn.Module
_current_node = torch._C._current_autograd_node
_next_sequence_nr = torch._C._autograd._get_sequence_nr
_NO_SEQUENCE = 2**63
_time_ns = time.time_ns
_get_ident = threading.get_ident
_stack_where = fast.stack_where
_set_record_hook = fast.set_worklog_record_hook


def _where(frame: Any) -> tuple:
    """(code, line, innermost module, outermost module, in_optimizer) of the Python stack: the
    innermost user frame's code and line, the nn.Modules of the `forward` frames around it, and
    whether a torch.optim frame lies below the user frame. Walked in C++ (runtime/csrc/stack_where.cpp)."""
    return _stack_where(frame, _code_info, _classify_code, _Module)


# ------------------------------------------------------------------------------------------------
# The capture session
# ------------------------------------------------------------------------------------------------
_active: "DeviceCapture | None" = None


def active_capture() -> "DeviceCapture | None":
    """The capture currently recording, if any (e.g. so an NKI kernel can keep its trace)."""
    return _active


BATCH = 4096  # records priced per drain while capturing


class _Store:
    """What a capture recorded, as columns (arrays and lists of shared objects): recording adds no
    per-record object the garbage collector has to traverse, which would otherwise cost more than
    the recording itself in long profiles.

    Contexts (who issued work, one per issuing call or charge) and entries (timeline items) are
    separate; `ctx[i]` is the context of entry i (-1: none), `batch[i]/index[i]` its work-log record."""

    def __init__(self) -> None:
        self.where: list[tuple] = []          # interned _where() results
        self.t_ns, self.thread, self.seq = array("q"), array("q"), array("q")
        self.node: list[str] = []             # autograd node name ("" outside backward)
        self.memory: dict[int, tuple] = {}    # context -> (device, allocated, peak, reserved)
        self.device, self.stream = array("q"), array("q")
        self.start, self.end = array("d"), array("d")
        self.name: list[str] = []
        self.cost: list[Any] = []
        self.meta: list[dict | None] = []     # None for work-log entries
        self.batch, self.index, self.ctx = array("q"), array("q"), array("q")
        self.batches: list[np.ndarray] = []
        self._interned: dict[tuple, tuple] = {}  # keyed by ids (see _code_class): no code hashing
        self._last_frame: Any = None
        self._last_lasti = -1
        self._last_where: tuple = ()

    def add_context(self, frame: Any) -> int:
        # One call (a foreach op, loss.backward()) often issues many records from the same frame
        # at the same instruction: the stack is the same, walk it once. Only torch/torchneuron
        # frames are kept between records (they are alive during such calls), never user frames,
        # whose locals must not outlive them.
        if frame is None or frame is not self._last_frame or frame.f_lasti != self._last_lasti:
            where = _where(frame)
            code, line, inner, outer, optim = where
            self._last_where = self._interned.setdefault((id(code), line, id(inner), id(outer), optim), where)
            keep = frame is not None and _code_class(frame.f_code) != _USER
            self._last_frame, self._last_lasti = (frame, frame.f_lasti) if keep else (None, -1)
        self.where.append(self._last_where)
        node = _current_node()
        if node is not None:
            self.node.append(type(node).__name__)
            seq = node._sequence_nr()  # nodes outside the forward's numbering (AccumulateGrad) have UINT64_MAX
            self.seq.append(seq if seq < _NO_SEQUENCE else -1)
        else:
            self.node.append("")
            self.seq.append(_next_sequence_nr() - 1)  # the sequence number the op's autograd node got
        self.t_ns.append(_time_ns())
        self.thread.append(_get_ident())
        return len(self.t_ns) - 1

    def add_entry(self, entry: device_timeline.TimelineEntry, batch: int, index: int, ctx: int,
                  meta: dict | None) -> None:
        self.device.append(entry.device)
        self.stream.append(entry.stream)
        self.start.append(entry.start_s)
        self.end.append(entry.end_s)
        self.name.append(entry.name)
        self.cost.append(entry.cost)
        self.meta.append(meta)
        self.batch.append(batch)
        self.index.append(index)
        self.ctx.append(ctx)

    def __len__(self) -> int:
        return len(self.start)


class DeviceCapture:
    """Records device work between start() and stop(); see the module docstring."""

    def __init__(self, profile_memory: bool = False, max_events: int = MAX_EVENTS) -> None:
        self.profile_memory = profile_memory
        self.max_events = max_events
        self.events: list[DeviceEvent] = []
        self.memory: list[MemorySample] = []
        self.dropped = 0
        self.unmatched = 0
        self.start_ns = self.stop_ns = 0
        self.origins: dict[int, float] = {}  # device -> modeled time (s) of its first event in the profile
        self.target = get_target().name
        self.peak_bytes: dict[int, int] = {}
        self.store = _Store()
        self._assigned = 0  # contexts already paired with a drained record
        self._pending: collections.deque = collections.deque()  # (batch, index, ctx, name) awaiting entries
        self._running = False
        self.linked = False  # attached to torch.profiler's events (integration.py)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "DeviceCapture":
        global _active
        if _active is not None:
            raise RuntimeError("a neuron profile is already recording; profiles cannot nest (stop the "
                               "other torch.profiler.profile first)")
        worklog.drain()  # earlier work is not part of this profile
        self.target = get_target().name
        if self.profile_memory:
            self._peak_at_start = {d: _device_stats(d)[1] for d in range(torch.neuron.device_count())}
        self.start_ns = time.time_ns()
        _active = self
        self._running = True
        worklog.add_drain_hook(self._on_drain)
        device_timeline.add_listener(self._on_entry, batches=self._on_batch)
        _set_record_hook(self._on_record)
        return self

    def stop(self) -> "DeviceCapture":
        """Stops recording and turns what was recorded into DeviceEvents (idempotent)."""
        global _active
        if not self._running:
            return self
        try:
            _set_record_hook(None)
            worklog.drain()
        finally:
            _set_record_hook(None)
            worklog.remove_drain_hook(self._on_drain)
            device_timeline.remove_listener(self._on_entry)
            self._running = False
            if _active is self:
                _active = None
            self.stop_ns = time.time_ns()
        self._finish()
        return self

    @property
    def running(self) -> bool:
        return self._running

    # ---- hot path ----------------------------------------------------------------------------
    def _on_record(self, frame: Any) -> None:
        """Called by the C++ work log right after it appended an op or copy record, inside the
        call that issued it, with the issuing Python frame: note who issued it; price in batches."""
        store = self.store
        ctx = store.add_context(frame)
        if self.profile_memory:
            device = int(runtime_ops().current_device())
            store.memory[ctx] = (device, *_device_stats(device))
        if len(store.t_ns) - self._assigned >= BATCH:
            worklog.drain()

    def _on_drain(self, records: np.ndarray) -> None:
        """A batch of records is about to be priced: pair each op/copy record with its context."""
        kinds = records["kind"]
        work = (0,) if len(records) == 1 and kinds[0] <= worklog.COPY else \
            np.flatnonzero(kinds <= worklog.COPY).tolist()
        if not work:
            return
        batch = len(self.store.batches)
        self.store.batches.append(records)
        available = len(self.store.t_ns)
        names = op_names(records["op_id"][list(work)].tolist())
        for i, name in zip(work, names):
            ctx = self._assigned if self._assigned < available else -1
            self._assigned += ctx >= 0
            self._pending.append((batch, i, ctx, name))

    def _on_entry(self, entry: device_timeline.TimelineEntry) -> None:
        """Every piece of work charged to any timeline: records of the work log arrive in order
        during a drain; anything else was charged from Python by the current caller."""
        meta = entry.meta
        pending = self._pending
        from_log = bool(pending) and pending[0][3] == entry.name and meta is not None and "graph" not in meta
        if len(self.store) >= self.max_events:
            self.dropped += 1
            if from_log:
                self._pending.popleft()
            return
        if from_log:
            batch, index, ctx, _ = pending.popleft()
            self.store.add_entry(entry, batch, index, ctx, None)
        else:
            self.store.add_entry(entry, -1, -1, self.store.add_context(sys._getframe(1)), meta)

    def _on_batch(self, batch: device_timeline.EntryBatch) -> None:
        """The work-log records of one drain, as columns: each pairs with the context _on_drain
        queued for it, in order; stored column by column, without an object per entry."""
        pending = self._pending
        n = len(batch)
        if len(pending) < n or any(pending[i][3] != batch.name[i] for i in (0, n - 1)):
            for entry in batch.entries():  # not the drain _on_drain saw: pair entry by entry
                self._on_entry(entry)
            return
        paired = [pending.popleft() for _ in range(n)]
        store = self.store
        kept = max(0, min(n, self.max_events - len(store)))
        self.dropped += n - kept
        if not kept:
            return
        store.device.extend(batch.device[:kept])
        store.stream.extend(batch.stream[:kept])
        store.start.extend(batch.start_s[:kept])
        store.end.extend(batch.end_s[:kept])
        store.name.extend(batch.name[:kept])
        store.cost.extend(batch.cost[:kept])
        store.meta.extend([None] * kept)
        store.batch.extend([p[0] for p in paired[:kept]])
        store.index.extend([p[1] for p in paired[:kept]])
        store.ctx.extend([p[2] for p in paired[:kept]])

    # ---- after the fact ----------------------------------------------------------------------
    def _finish(self) -> None:
        charged = sum(1 for b in self.store.batch if b < 0)  # contexts taken for charged entries
        self.unmatched += len(self._pending) + max(0, len(self.store.t_ns) - self._assigned - charged)
        self._pending.clear()
        store = self.store
        for device, start in zip(store.device, store.start):
            if start < self.origins.get(device, float("inf")):
                self.origins[device] = start
        self.events = build_events(self, store)
        for ev, ctx in zip(self.events, store.ctx):
            sample = store.memory.get(ctx)
            if sample is not None:
                device, allocated, _, reserved = sample
                self.memory.append(MemorySample(ev.id, device, (store.t_ns[ctx] - self.start_ns) / 1e3,
                                                ev.start_us + ev.duration_us, allocated, reserved))
        if self.profile_memory:
            for device, start_peak in self._peak_at_start.items():
                end_peak = _device_stats(device)[1]
                sampled = max((m.allocated_bytes for m in self.memory if m.device == device), default=0)
                self.peak_bytes[device] = end_peak if end_peak > start_peak else sampled
        self.store = _Store()


def _device_stats(device: int) -> tuple[int, int, int]:
    """(allocated, peak allocated, reserved) bytes of a device, from the allocator's statistics."""
    stats = torch._C._accelerator_getDeviceStats(device)
    allocated = stats["allocated_bytes"]["all"]
    return allocated["current"], allocated["peak"], stats["reserved_bytes"]["all"]["current"]
