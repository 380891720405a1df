"""Chrome-trace output: device tracks merged into torch.profiler's (Kineto's) host trace.

This module owns the trace format of the neuron profile. `merge_device_tracks` takes the
JSON Kineto wrote and
- drops the profiler's bookkeeping slices (see linking.BOOKKEEPING) and the placeholder
  "GPU n" process labels Kineto emits for devices it does not know;
- adds one process per neuron device ("neuron:0 (modeled)") with one thread per stream, a
  complete slice ("ph": "X") per device event carrying engine, FLOPs, bytes, bound, fallback,
  source line and module path in `args`, and a flow arrow from the host op that issued it;
- adds a counter track of allocated device memory when memory was profiled.

Device slices are in modeled device time; each device's first event of a cycle is placed at the
host time the cycle started, later ones at their modeled offsets from it. Host slices keep wall
time. `write_trace` writes a trace with device tracks only (no Kineto trace available).
Both Perfetto (ui.perfetto.dev) and chrome://tracing open the result.
"""
from __future__ import annotations

import gzip
import json
import os
from typing import Any, Iterable

from torchneuron.profiler.capture import DeviceCapture, DeviceEvent
from torchneuron.profiler.linking import BOOKKEEPING

DEVICE_PID_BASE = 1_000_000  # pid of device n's process in the trace: DEVICE_PID_BASE + n


_GZIP_MAGIC = b"\x1f\x8b"


def load_json(path: str) -> dict:
    """A Chrome trace as Kineto or torch wrote it: gzip'd or not whatever the file is named (told
    apart by gzip's magic bytes), and with any bytes of invalid UTF-8 in its strings (Kineto copies
    op and frame names byte for byte) read as U+FFFD instead of failing the export."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == _GZIP_MAGIC:
        data = gzip.decompress(data)
    return json.loads(data.decode("utf-8", errors="replace"))


def save_json(data: dict, path: str) -> None:
    tmp = path + ".tmp"
    opener = gzip.open if path.endswith(".gz") else open
    with opener(tmp, "wt") as f:
        f.write(json.dumps(data, separators=(",", ":")))  # one-shot: json's C encoder
    os.replace(tmp, path)


def _without_bookkeeping(events: list[dict]) -> list[dict]:
    hidden_spans: dict[tuple, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("name") in BOOKKEEPING:
            hidden_spans.setdefault((e.get("pid"), e.get("tid")), []).append((e["ts"], e["ts"] + e.get("dur", 0)))
    placeholder = {e.get("pid") for e in events if e.get("ph") == "M" and e.get("name") == "process_labels"
                   and str(e.get("args", {}).get("labels", "")).startswith("GPU ")}

    def keep(e: dict) -> bool:
        if e.get("pid") in placeholder and e.get("ph") == "M":
            return False
        spans = hidden_spans.get((e.get("pid"), e.get("tid")))
        if spans and e.get("ph") == "X":
            ts = e["ts"]
            return not any(a <= ts <= b for a, b in spans)
        return True
    return [e for e in events if keep(e)]


def _device_args(ev: DeviceEvent) -> dict[str, Any]:
    args: dict[str, Any] = {
        "kind": ev.kind, "engine": ev.engine, "bound": ev.bound, "flops": ev.flops, "bytes": ev.bytes,
        "fallback": ev.fallback, "modeled": True, "stream": ev.stream,
    }
    if ev.shapes:
        args["shapes"] = ev.shapes
    if ev.source_file:
        args["source"] = f"{ev.source_file}:{ev.source_line}:{ev.source_function}"
    if ev.module_path or ev.module_type:
        args["module"] = ev.module_path or f"<{ev.module_type}>"
    if ev.phase != "other":
        args["phase"] = ev.phase
    if ev.forward_source:
        args["forward_source"] = ev.forward_source
    if ev.host_op:
        args["host_op"] = ev.host_op
    if ev.copy_kind:
        args["copy"] = ev.copy_kind
    return args


def device_trace_events(captures: Iterable[DeviceCapture], base_ns: int,
                        host_ops: dict[int, tuple[Any, Any, float]] | None = None) -> list[dict]:
    """Trace events of the device tracks; `host_ops` maps External id -> (pid, tid, ts) of host
    slices, for flow arrows. `base_ns` is the trace's time base (its ts are us since it)."""
    out: list[dict] = []
    named: set[tuple[int, int]] = set()
    flow = 0
    for capture in captures:
        offset_us = (capture.start_ns - base_ns) / 1e3
        for ev in capture.events:
            pid = DEVICE_PID_BASE + ev.device
            if (pid, -1) not in named:
                named.add((pid, -1))
                out.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0,
                            "args": {"name": f"neuron:{ev.device} (modeled device time, {capture.target})"}})
                out.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                            "args": {"sort_index": pid}})
            if (pid, ev.stream) not in named:
                named.add((pid, ev.stream))
                out.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": ev.stream,
                            "args": {"name": f"stream {ev.stream}"}})
            ts = offset_us + ev.start_us
            out.append({"ph": "X", "cat": f"neuron_{ev.kind}", "name": ev.name, "pid": pid, "tid": ev.stream,
                        "ts": ts, "dur": ev.duration_us, "args": _device_args(ev)})
            host = host_ops.get(ev.host_op_id) if host_ops and ev.host_op_id >= 0 else None
            if host is not None:
                flow += 1
                out.append({"ph": "s", "cat": "neuron_launch", "name": "launch", "id": flow,
                            "pid": host[0], "tid": host[1], "ts": host[2]})
                out.append({"ph": "f", "bp": "e", "cat": "neuron_launch", "name": "launch", "id": flow,
                            "pid": pid, "tid": ev.stream, "ts": ts})
        for sample in capture.memory:
            out.append({"ph": "C", "name": "neuron memory allocated", "pid": DEVICE_PID_BASE + sample.device,
                        "ts": offset_us + (sample.device_time_us if sample.device_time_us == sample.device_time_us
                                           else sample.host_time_us),
                        "args": {"bytes": sample.allocated_bytes}})
    return out


def merge_device_tracks(trace: dict, captures: list[DeviceCapture]) -> dict:
    """Kineto's trace dict with bookkeeping removed and the device tracks added (in place)."""
    events = _without_bookkeeping(trace.get("traceEvents", []))
    base_ns = int(trace.get("baseTimeNanoseconds", 0))
    host_ops: dict[int, tuple[Any, Any, float]] = {}
    for e in events:
        if e.get("ph") == "X":
            ext = e.get("args", {}).get("External id")
            if ext is not None and e.get("cat") == "cpu_op":
                host_ops.setdefault(int(ext), (e["pid"], e["tid"], e["ts"]))
    events.extend(device_trace_events(captures, base_ns, host_ops))
    trace["traceEvents"] = events
    trace.setdefault("otherData", {})["torchneuron"] = (
        "neuron tracks show modeled device time (performance model of the target), aligned at the profile start")
    return trace


def write_trace(path: str, captures: list[DeviceCapture]) -> None:
    """A trace of the device tracks alone (ts relative to the first capture's start)."""
    base = min((c.start_ns for c in captures), default=0)
    save_json({"traceEvents": device_trace_events(captures, base), "displayTimeUnit": "ms"}, path)
