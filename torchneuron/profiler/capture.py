"""Capture of device activity while a profile is recording: the hot path of the profiler.

This module owns `DeviceCapture`: between `start()` and `stop()` it sees every unit of work
charged to any device timeline (through the timeline's listener API) and attributes it to the
Python code that issued it. It produces `DeviceEvent`s; everything else (linking to
torch.profiler events, traces, tables, analysis) works on those afterwards.

How attribution stays exact and cheap:
- eager ops and copies reach the timeline through the C++ work log. While capturing, the work
  log notes an issuer context right after appending each record, *inside* the call that issued
  it, in C++ (runtime/csrc/contexts.cpp): the Python stack walked once (the innermost frame
  outside torch/torchneuron/the standard library is the source line; `forward` frames of
  nn.Modules give the module chain), the autograd node, the host time. Records are still priced
  in batches (every BATCH records, or when anyone drains); the drain hook pairs each op/copy
  record with the context noted for it, in order, and the timeline entries the drain enqueues
  arrive in the same order.
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


_Module = torch.nn.Module
_context_record = fast.context_record
_record_contexts = fast.record_contexts


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
    separate; `ctx[i]` is the context of entry i (-1: none), `batch[i]/index[i]` its work-log record.
    Contexts are noted in C++ while recording (contexts.cpp) and become columns at take_contexts()."""

    def __init__(self) -> None:
        self.where: list[tuple] = []          # per context: (code, line, inner module, outer module, in_optimizer)
        self.t_ns: list[int] = []
        self.thread: list[int] = []
        self.seq: list[int] = []
        self.node: list[str] = []             # autograd node name ("" outside backward)
        self.memory: dict[int, tuple] = {}    # context -> (device, allocated, peak, reserved)
        self.device, self.stream = array("q"), array("q")
        self.start, self.end = array("d"), array("d")
        self.name: list[str] = []
        self.cost: list[Any] = []
        self.meta: list[dict | None] = []     # None for work-log entries
        self.batch, self.index, self.ctx = array("q"), array("q"), array("q")
        self.batches: list[np.ndarray] = []

    @staticmethod
    def add_context(frame: Any) -> int:
        """Notes the context of work charged from Python, issued from `frame`; returns its index."""
        return _context_record(frame)

    def take_contexts(self) -> None:
        """Ends context recording and keeps every context as columns."""
        where, node, seq, t_ns, thread = fast.contexts_take()
        self.where, self.node = where, node
        self.seq, self.t_ns, self.thread = (np.frombuffer(b, dtype=np.int64).tolist() for b in (seq, t_ns, thread))

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
        self._assigned = 0  # record contexts (contexts.cpp) already paired with a drained record
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
        fast.contexts_start(_code_info, _classify_code, _Module, self._on_context if self.profile_memory else None)
        self._threshold_before = int(runtime_ops().worklog_threshold())
        runtime_ops().set_worklog_threshold(BATCH)
        return self

    def stop(self) -> "DeviceCapture":
        """Stops recording and turns what was recorded into DeviceEvents (idempotent)."""
        global _active
        if not self._running:
            return self
        try:
            fast.contexts_stop()
            worklog.drain()
        finally:
            runtime_ops().set_worklog_threshold(self._threshold_before)
            self.store.take_contexts()
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
    def _on_context(self, ctx: int) -> None:
        """Called after each context is noted, when profiling memory: the allocator's statistics."""
        device = int(runtime_ops().current_device())
        self.store.memory[ctx] = (device, *_device_stats(device))

    def _on_drain(self, records: np.ndarray) -> None:
        """A batch of records is about to be priced: pair each op/copy record with its context."""
        kinds = records["kind"]
        work = (0,) if len(records) == 1 and kinds[0] <= worklog.COPY else \
            np.flatnonzero(kinds <= worklog.COPY).tolist()
        if not work:
            return
        batch = len(self.store.batches)
        self.store.batches.append(records)
        contexts = _record_contexts(self._assigned, len(work))  # fewer for records logged before start()
        self._assigned += len(contexts)
        contexts += [-1] * (len(work) - len(contexts))
        names = op_names(records["op_id"][list(work)].tolist())
        for i, name, ctx in zip(work, names, contexts):
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
        self.unmatched += len(self._pending) + max(0, len(self.store.where) - self._assigned - charged)
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
