"""Hooks into torch.profiler: neuron device activity inside `torch.profiler.profile`.

This module owns the (reversible) patches that make an unmodified
`torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.PrivateUse1])`
record neuron work. Kineto has no Python plug-in for PrivateUse1 activity, so:

- `_KinetoProfile.start_trace` / `stop_trace` (called by `start()/stop()`, `with`, and every
  schedule cycle's RECORD phase) start and stop a DeviceCapture when the activities include
  PrivateUse1; the finished captures are kept on the underlying autograd profiler object
  (several with `acc_events=True`);
- `torch.autograd.profiler.profile._ensure_function_events` (which builds `events()` and
  `key_averages()`) links device work to the ops that issued it (see linking.py);
- `_KinetoProfile.export_chrome_trace` adds the device tracks to Kineto's JSON (trace.py),
  which also covers `on_trace_ready=tensorboard_trace_handler(...)`.

`captures_of(prof)` returns the captures of a profile for the Parquet export.
"""
from __future__ import annotations

import functools
import os
import tempfile
import warnings
from typing import Any, Callable

import torch.autograd.profiler as autograd_profiler
from torch.profiler import ProfilerActivity
from torch.profiler.profiler import _KinetoProfile

from torchneuron.profiler.capture import DeviceCapture
from torchneuron.profiler.linking import link
from torchneuron.profiler.trace import load_json, merge_device_tracks, save_json

_patched: dict[tuple[type, str], Callable] = {}


def _records_neuron(prof: _KinetoProfile) -> bool:
    return ProfilerActivity.PrivateUse1 in getattr(prof, "activities", ())


def _patch(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    if (cls, name) in _patched:
        return
    original = getattr(cls, name)
    _patched[(cls, name)] = original
    setattr(cls, name, functools.wraps(original)(make(original)))


def install() -> None:
    """Makes torch.profiler record neuron device activity (idempotent)."""
    _patch(_KinetoProfile, "start_trace", _start_trace)
    _patch(_KinetoProfile, "stop_trace", _stop_trace)
    _patch(_KinetoProfile, "export_chrome_trace", _export_chrome_trace)
    _patch(autograd_profiler.profile, "_ensure_function_events", _ensure_function_events)


def uninstall() -> None:
    """Restores torch.profiler's original methods."""
    for (cls, name), original in list(_patched.items()):
        setattr(cls, name, original)
    _patched.clear()


def installed() -> bool:
    return bool(_patched)


def _start_trace(original: Callable) -> Callable:
    def start_trace(self: _KinetoProfile) -> None:
        capture = None
        if _records_neuron(self):  # started first: its own setup stays out of the host trace
            try:
                capture = DeviceCapture(profile_memory=self.profile_memory).start()
            except RuntimeError as e:  # another profile is recording: keep torch.profiler working
                warnings.warn(f"torchneuron profiler: device activity not recorded: {e}", stacklevel=3)
        try:
            original(self)
        except BaseException:
            if capture is not None:
                capture.stop()
            raise
        self._torchneuron_capture = capture
    return start_trace


def _stop_trace(original: Callable) -> Callable:
    def stop_trace(self: _KinetoProfile) -> None:
        capture: DeviceCapture | None = getattr(self, "_torchneuron_capture", None)
        self._torchneuron_capture = None
        inner = self.profiler
        if inner is not None:
            inner._torchneuron_host_trace = None  # a new Kineto result is coming
            if capture is not None:
                if getattr(inner, "_torchneuron_captures", None) is None:
                    inner._torchneuron_captures = []
                inner._torchneuron_captures.append(capture)
        try:
            original(self)  # with acc_events this already builds the cycle's events
        finally:
            if capture is not None:
                capture.stop()  # after Kineto stopped: its final drain stays out of the host trace
        if inner is not None:
            _link_pending(inner)
        if capture is not None and not capture.events:
            warnings.warn("torchneuron profiler: no neuron device work was recorded in this profile "
                          "(were the model and inputs moved to 'neuron'?)", stacklevel=3)
    return stop_trace


def _ensure_function_events(original: Callable) -> Callable:
    def ensure(self: autograd_profiler.profile) -> Any:
        fresh = self._function_events is None
        earlier = {id(e) for e in (self._old_function_events or ())}  # acc_events: previous cycles
        result = original(self)
        if fresh and self._function_events is not None:
            self._torchneuron_cycle = [e for e in self._function_events if id(e) not in earlier]
            _link_pending(self)
        return result
    return ensure


def _link_pending(inner: autograd_profiler.profile) -> None:
    """Links the finished, not yet linked captures to the events of the latest cycle, once both exist."""
    cycle = getattr(inner, "_torchneuron_cycle", None)
    captures = [c for c in getattr(inner, "_torchneuron_captures", None) or ()
                if not c.running and not c.linked]
    if cycle is None or not captures or inner._function_events is None or inner.kineto_results is None:
        return
    kept, device_events, stats = link(cycle, captures, inner.kineto_results.trace_start_ns())
    in_cycle = {id(e) for e in cycle}
    inner._function_events[:] = kept + device_events + [e for e in inner._function_events if id(e) not in in_cycle]
    inner._torchneuron_cycle = None
    inner._torchneuron_link = stats
    for capture in captures:
        capture.linked = True


def _export_chrome_trace(original: Callable) -> Callable:
    def export_chrome_trace(self: _KinetoProfile, path: str, *args: Any, **kwargs: Any) -> Any:
        captures = captures_of(self)
        if not captures:
            return original(self, path, *args, **kwargs)
        try:
            self.events()  # links device events to host ops (for flow arrows)
        except RuntimeError:  # trace_only profiles have no events: no flow arrows
            pass
        # Kineto saves a result once; keep the host trace so later exports (and export_profile) work
        host = getattr(self.profiler, "_torchneuron_host_trace", None)
        result = None
        if host is None:
            fd, tmp = tempfile.mkstemp(suffix=".json", dir=os.path.dirname(os.path.abspath(path)) or None)
            os.close(fd)
            try:
                result = original(self, tmp, *args, **kwargs)
                host = self.profiler._torchneuron_host_trace = load_json(tmp)
            finally:
                os.remove(tmp)
        merged = dict(host, traceEvents=list(host.get("traceEvents", [])))
        save_json(merge_device_tracks(merged, captures), path)
        return result
    return export_chrome_trace


def captures_of(prof: Any) -> list[DeviceCapture]:
    """The finished device captures of a torch.profiler.profile (or autograd profiler)."""
    inner = getattr(prof, "profiler", prof)
    return list(getattr(inner, "_torchneuron_captures", None) or [])
