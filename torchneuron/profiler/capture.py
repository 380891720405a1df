"""Capture of device activity while a profile is recording: the hot path of the profiler.

This module owns `DeviceCapture`: between `start()` and `stop()` it sees every unit of work
charged to any device timeline (through the timeline's listener API) and attributes it to the
Python code that issued it. It produces `DeviceEvent`s; everything else (linking to
torch.profiler events, traces, tables, analysis) works on those afterwards.

How attribution stays exact and cheap:
- eager ops and copies reach the timeline through the C++ work log. While capturing, the work
  log's drain threshold is 1, so the C++ fallback hands every record to Python (the
  `_worklog_full` callback) *inside* the call that issued it. The drain hook then walks the
  Python stack once: the innermost frame outside torch/torchneuron/the standard library is the
  source line; `forward` frames of nn.Modules give the module chain. The timeline entries that
  the same drain enqueues are matched to these records in order.
- work charged from Python (`torchneuron.runtime.charge`: NKI kernels, fused kernels, compiled
  graphs, collectives) is attributed from the stack at the time of the charge.
- backward ops carry the autograd node that ran them; its sequence number is the one the
  forward op had, which links them to the forward op's module.
Everything expensive (decoding signatures, module paths) happens in `stop()`.
"""
from __future__ import annotations

import collections
import os
import sys
import sysconfig
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from torchneuron.hardware import timeline as device_timeline
from torchneuron.hardware.model import classify
from torchneuron.hardware.targets import get_target
from torchneuron.runtime import worklog
from torchneuron.runtime.extension import ops

__all__ = ["DeviceEvent", "DeviceCapture", "MemorySample", "active_capture"]

DEFAULT_THRESHOLD = 1 << 15  # the work log's drain threshold outside profiling (worklog.cpp)
MAX_EVENTS = int(os.environ.get("TORCHNEURON_PROFILER_MAX_EVENTS", "2000000"))


@dataclass(slots=True)
class DeviceEvent:
    """One unit of device work as the profiler reports it (times in microseconds of modeled
    device time, relative to the device's clock when the profile started)."""

    id: int
    device: int
    stream: int
    kind: str            # op | copy | fused | graph | nki | collective | other
    name: str            # as charged (aten ops with their overload: "aten::sum.dim_IntList")
    op: str              # aten op without overload ("aten::sum"), or the charged name
    category: str        # the performance model's op category ("matmul", "elementwise", ...)
    engine: str
    bound: str
    start_us: float
    duration_us: float
    flops: float
    bytes: float
    fallback: bool
    host_fallback_us: float
    launch_us: float     # modeled launch cost included in duration_us
    copy_kind: str       # h2d | d2h | d2d | ""
    dtype: str
    shapes: str
    source_file: str
    source_line: int
    source_function: str
    module_path: str
    module_type: str
    phase: str           # forward | backward | optimizer | other
    autograd_node: str
    forward_source: str  # for backward work: the forward op's source line
    host_time_us: float  # host wall time when issued, relative to the profile's start
    thread: int
    host_op: str = ""    # the torch.profiler op it is linked to (filled by linking)
    host_op_id: int = -1
    meta: dict | None = None


@dataclass(slots=True)
class MemorySample:
    """Device memory right after a piece of work was issued (profile_memory=True)."""

    event_id: int
    device: int
    host_time_us: float
    device_time_us: float
    allocated_bytes: int
    reserved_bytes: int


# ------------------------------------------------------------------------------------------------
# Stack walking
# ------------------------------------------------------------------------------------------------
_INTERNAL, _USER, _OPTIM = 0, 1, 2
_code_class: dict[Any, int] = {}
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_USER_PKG_DIRS = (os.path.join(_PKG_DIR, "examples") + os.sep,)
_STDLIB_DIRS = tuple({sysconfig.get_paths()["stdlib"] + os.sep, sysconfig.get_paths()["platstdlib"] + os.sep})
_SITE_DIRS = tuple({sysconfig.get_paths()["purelib"] + os.sep, sysconfig.get_paths()["platlib"] + os.sep})
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep


def _classify_code(code: Any) -> int:
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
    _code_class[code] = cls
    return cls


_Module = torch.nn.Module


def _where(frame: Any) -> tuple:
    """(code, line, innermost module, outermost module, in_optimizer) of the Python stack."""
    user_code = None
    line = 0
    inner = outer = None
    optim = False
    f = frame
    get = _code_class.get
    while f is not None:
        code = f.f_code
        cls = get(code)
        if cls is None:
            cls = _classify_code(code)
        if user_code is None:
            if cls == _USER:
                user_code, line = code, f.f_lineno
            elif cls == _OPTIM:
                optim = True
        if code.co_name == "forward" and code.co_argcount:
            module = f.f_locals.get(code.co_varnames[0])
            if isinstance(module, _Module):
                if inner is None:
                    inner = module
                outer = module
        f = f.f_back
    return user_code, line, inner, outer, optim


# ------------------------------------------------------------------------------------------------
# The capture session
# ------------------------------------------------------------------------------------------------
_active: "DeviceCapture | None" = None
_worklog_file = worklog.__file__


def active_capture() -> "DeviceCapture | None":
    """The capture currently recording, if any (e.g. so an NKI kernel can keep its trace)."""
    return _active


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
        self.origins: dict[int, float] = {}
        self.target = get_target().name
        self.peak_bytes: dict[int, int] = {}
        self._raw: list[tuple] = []
        self._pending: collections.deque = collections.deque()
        self._mem_raw: list[tuple] = []
        self._running = False

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "DeviceCapture":
        global _active
        if _active is not None:
            raise RuntimeError("a neuron profile is already recording; profiles cannot nest (stop the "
                               "other torch.profiler.profile first)")
        worklog.drain()  # earlier work is not part of this profile
        self.origins = {tl.device: max(tl.streams().values(), default=0.0) for tl in device_timeline.all_timelines()}
        self.target = get_target().name
        if self.profile_memory:
            self._peak_at_start = {d: _device_stats(d)[1] for d in range(torch.neuron.device_count())}
        self.start_ns = time.time_ns()
        _active = self
        self._running = True
        worklog.add_drain_hook(self._on_drain)
        device_timeline.add_listener(self._on_entry)
        ops().set_worklog_threshold(1)
        return self

    def stop(self) -> "DeviceCapture":
        """Stops recording and turns what was recorded into DeviceEvents (idempotent)."""
        global _active
        if not self._running:
            return self
        try:
            worklog.drain()
        finally:
            ops().set_worklog_threshold(DEFAULT_THRESHOLD)
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
    def _on_drain(self, records: np.ndarray) -> None:
        kinds = records["kind"]
        if len(records) == 1:
            if kinds[0] > worklog.COPY:
                return
            work = (0,)
        else:
            work = np.flatnonzero(kinds <= worklog.COPY).tolist()
            if not work:
                return
        drain_frame = sys._getframe(1)
        caller = drain_frame.f_back
        # a drain the C++ fallback requested runs inside the call that issued the last record
        triggered = caller is not None and caller.f_code.co_filename == _worklog_file and \
            caller.f_code.co_name == "<lambda>"
        where = _where(drain_frame) if triggered else None
        node = torch._C._current_autograd_node()
        seq = node._sequence_nr() if node is not None else torch._C._autograd._get_sequence_nr() - 1
        context = (where, time.time_ns(), threading.get_ident(), node.name() if node is not None else "", seq)
        last = work[-1]
        blob = records.tobytes()
        size = worklog.RECORD.itemsize
        pending = self._pending
        for i in work:
            pending.append((blob[i * size:(i + 1) * size], context if i == last else None))
        if self.profile_memory:
            device = int(records["device"][last])
            self._mem_raw.append((len(self._raw) + len(pending) - 1, device, context[1], *_device_stats(device)))

    def _on_entry(self, entry: device_timeline.TimelineEntry) -> None:
        meta = entry.meta
        if len(self._raw) >= self.max_events:
            self.dropped += 1
            if self._pending and meta is not None and meta.get("kind") in ("op", "copy"):
                self._pending.popleft()
            return
        if meta is not None and meta.get("kind") in ("op", "copy") and self._pending:
            record, context = self._pending.popleft()
            self._raw.append((entry, record, context))
            return
        node = torch._C._current_autograd_node()
        seq = node._sequence_nr() if node is not None else -1
        where = _where(sys._getframe(1))
        self._raw.append((entry, None, (where, time.time_ns(), threading.get_ident(),
                                        node.name() if node is not None else "", seq)))

    # ---- after the fact ----------------------------------------------------------------------
    def _finish(self) -> None:
        self.unmatched += len(self._pending)
        self._pending.clear()
        from torchneuron.profiler.attribution import build_events

        self.events = build_events(self, self._raw)
        by_index = {i: ev for i, ev in enumerate(self.events)}
        for index, device, t_ns, allocated, peak, reserved in self._mem_raw:
            ev = by_index.get(index)
            self.memory.append(MemorySample(
                ev.id if ev else -1, device, (t_ns - self.start_ns) / 1e3,
                (ev.start_us + ev.duration_us) if ev else float("nan"), allocated, reserved))
        if self.profile_memory:
            for device, start_peak in self._peak_at_start.items():
                end_peak = _device_stats(device)[1]
                sampled = max((m.allocated_bytes for m in self.memory if m.device == device), default=0)
                self.peak_bytes[device] = end_peak if end_peak > start_peak else sampled
        self._raw = []
        self._mem_raw = []


def _device_stats(device: int) -> tuple[int, int, int]:
    """(allocated, peak allocated, reserved) bytes of a device, from the allocator's statistics."""
    stats = torch._C._accelerator_getDeviceStats(device)
    allocated = stats["allocated_bytes"]["all"]
    return allocated["current"], allocated["peak"], stats["reserved_bytes"]["all"]["current"]


_roots: "weakref.WeakKeyDictionary[torch.nn.Module, dict[int, str]]" = weakref.WeakKeyDictionary()


def module_path(inner: torch.nn.Module | None, outer: torch.nn.Module | None) -> str:
    """Qualified name of `inner` inside `outer` (as in `outer.named_modules()`), "" for the root."""
    if inner is None or outer is None:
        return ""
    names = _roots.get(outer)
    if names is None or id(inner) not in names:
        names = _roots[outer] = {id(m): n for n, m in outer.named_modules(remove_duplicate=False)}
    return names.get(id(inner), "")


def op_base_name(name: str) -> str:
    """"aten::sum.dim_IntList" -> "aten::sum" (torch.profiler's names carry no overload)."""
    if name.startswith("aten::"):
        return name.split(".", 1)[0]
    return name


def category_of(kind: str, name: str) -> str:
    return classify(name) if kind == "op" else kind
