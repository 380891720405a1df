"""The processed profile: a directory of Parquet tables, their schema, a manifest and a trace.

This module owns the on-disk format (`SCHEMA` is its single definition: every table, column,
type, unit and meaning; `schema.json` is written from it) and its reader.

    PROFILE_DIR/
      events.parquet            one row per unit of device work (kernels, copies, collectives)
      kernels.parquet           device work grouped by kernel name and signature
      nki_instructions.parquet  instructions of NKI kernels, per engine
      dma.parquet               data transfers (host<->device copies, device copies, NKI DMAs)
      memory.parquet            device memory after each piece of work (profile_memory=True)
      collectives.parquet       collectives and how much of each is hidden behind compute
      host_ops.parquet          torch.profiler's CPU ops with the device time they issued
      summary.parquet           one row per device: totals, peak memory, data quality
      schema.json  manifest.json  trace.json

Tables are written one file at a time (tmp file + rename) and manifest.json last, so an
interrupted export leaves a directory the reader recognises as partial. Readable with pandas
(`pd.read_parquet`), polars or DuckDB (`SELECT * FROM 'PROFILE_DIR/events.parquet'`).
"""
from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from torchneuron.hardware.targets import get_target
from torchneuron.profiler.capture import DeviceCapture
from torchneuron.profiler.overlap import busy_intervals, interval_overlap

FORMAT = "torchneuron-profile"
VERSION = 1

S, I, F, B = pa.string(), pa.int64(), pa.float64(), pa.bool_()
_SOURCE = [
    ("source_file", S, "", "file of the user's frame that issued the work (outside torch/torchneuron)"),
    ("source_line", I, "", "line in source_file"),
    ("source_function", S, "", "function (qualified name) of that frame"),
]
SCHEMA: dict[str, tuple[str, list[tuple[str, pa.DataType, str, str]]]] = {
    "events": ("One row per unit of device work: eager kernels, fused kernels, compiled graphs, NKI "
               "kernels, copies and collectives, in the order they were charged. Times are modeled device "
               "time relative to the start of the device's first event in the profile (cycle).", [
        ("id", I, "", "event id, unique within the profile"),
        ("cycle", I, "", "profiling cycle (schedule active period) the event belongs to"),
        ("device", I, "", "neuron device index"),
        ("stream", I, "", "stream id on the device (0 = default stream)"),
        ("kind", S, "", "op | copy | fused | graph | nki | collective | other"),
        ("name", S, "", "name as charged (aten ops with overload: aten::sum.dim_IntList)"),
        ("op", S, "", "aten op without overload (torch.profiler's name), or the charged name"),
        ("category", S, "", "performance-model category: matmul, elementwise, transcendental, reduction, ..."),
        ("engine", S, "", "busiest resource: tensor, vector, scalar, gpsimd, dma, host (CPU fallback), link"),
        ("bound", S, "", "what limits it in the model: compute, memory or latency"),
        ("start_us", F, "us", "modeled device start"),
        ("duration_us", F, "us", "modeled device duration (includes launch_us)"),
        ("end_us", F, "us", "start_us + duration_us"),
        ("flops", F, "FLOP", "nominal floating-point operations"),
        ("bytes", F, "B", "bytes moved (HBM for kernels, host link for host copies, link for collectives)"),
        ("fallback", B, "", "ran on the host CPU (no NeuronCore implementation, or float64/complex operands)"),
        ("host_fallback_us", F, "us", "host wall time of a CPU fallback's computation"),
        ("launch_us", F, "us", "modeled kernel launch cost included in duration_us"),
        ("copy_kind", S, "", "h2d | d2h | d2d for copies, empty otherwise"),
        ("dtype", S, "", "dtype of the first tensor operand (f32, bf16, ...)"),
        ("shapes", S, "", "operand signatures: inputs -> outputs"),
        *_SOURCE,
        ("module_path", S, "", "nn.Module path of the innermost module (named_modules() name, '' = root)"),
        ("module_type", S, "", "class of that module"),
        ("phase", S, "", "forward | backward | optimizer | other"),
        ("autograd_node", S, "", "autograd node that ran backward work (AddmmBackward0)"),
        ("forward_source", S, "", "for backward work: file:line:function of the forward op"),
        ("host_time_us", F, "us", "host wall time when issued, since the cycle started"),
        ("thread", I, "", "Python thread ident of the issuing thread"),
        ("host_op", S, "", "torch.profiler CPU op that issued it ('' when not linked)"),
        ("host_op_id", I, "", "that op's id (External id in the Chrome trace), -1 when not linked"),
    ]),
    "kernels": ("Device work grouped by (device, kind, name, shapes): one row per distinct kernel.", [
        ("device", I, "", "neuron device index"),
        ("kind", S, "", "as in events"),
        ("name", S, "", "as in events"),
        ("category", S, "", "as in events"),
        ("shapes", S, "", "as in events"),
        ("dtype", S, "", "as in events"),
        ("engine", S, "", "engine of the longest call"),
        ("bound", S, "", "bound of the longest call"),
        ("count", I, "", "number of calls"),
        ("total_us", F, "us", "summed device time"),
        ("mean_us", F, "us", "mean device time per call"),
        ("max_us", F, "us", "longest call"),
        ("flops", F, "FLOP", "summed FLOPs"),
        ("bytes", F, "B", "summed bytes"),
        ("arithmetic_intensity", F, "FLOP/B", "flops / bytes"),
        ("achieved_flops_per_s", F, "FLOP/s", "flops / device time"),
        ("peak_flops_per_s", F, "FLOP/s", "Tensor-engine peak of the target for the kernel's dtype (0 = none)"),
        ("achieved_bytes_per_s", F, "B/s", "bytes / device time"),
        ("fallback_count", I, "", "calls that ran on the host CPU"),
        ("launch_us", F, "us", "summed launch cost"),
        ("share", F, "", "fraction of the device's summed device time"),
        *_SOURCE,
    ]),
    "nki_instructions": ("Instructions of NKI kernels as the simulator scheduled them (when the kernel "
                         "attached its trace: meta['instructions']).", [
        ("event_id", I, "", "events.id of the kernel"),
        ("kernel", S, "", "kernel name"),
        ("device", I, "", "neuron device index"),
        ("engine", S, "", "engine or DMA queue that executed the instruction"),
        ("instruction", S, "", "instruction kind (nc_matmul, tensor_tensor, dma, ...)"),
        ("start_us", F, "us", "modeled start (device time, as events.start_us)"),
        ("duration_us", F, "us", "modeled duration"),
        ("where", S, "", "kernel source location of the instruction"),
    ]),
    "dma": ("Data transfers: copies between host and device or within the device, and DMA instructions of "
            "NKI kernels.", [
        ("event_id", I, "", "events.id of the copy or kernel"),
        ("device", I, "", "neuron device index"),
        ("kind", S, "", "h2d | d2h | d2d | nki"),
        ("bytes", F, "B", "bytes transferred (NaN when unknown)"),
        ("start_us", F, "us", "modeled start"),
        ("duration_us", F, "us", "modeled duration"),
        ("bytes_per_s", F, "B/s", "bytes / duration"),
        *_SOURCE,
    ]),
    "memory": ("Device memory right after a piece of work was issued (torch.profiler profile_memory=True).", [
        ("event_id", I, "", "events.id of the work"),
        ("device", I, "", "neuron device index"),
        ("host_time_us", F, "us", "host wall time since the cycle started"),
        ("device_time_us", F, "us", "modeled device time at the end of that work"),
        ("allocated_bytes", I, "B", "bytes allocated on the device"),
        ("reserved_bytes", I, "B", "bytes reserved by the allocator"),
        ("delta_bytes", I, "B", "allocated_bytes minus the previous sample's on that device"),
    ]),
    "collectives": ("Collectives and how much of each one compute on the same device hid.", [
        ("event_id", I, "", "events.id"),
        ("device", I, "", "neuron device index"),
        ("stream", I, "", "stream id"),
        ("name", S, "", "collective name"),
        ("bytes", F, "B", "bytes sent over the link"),
        ("start_us", F, "us", "modeled start"),
        ("duration_us", F, "us", "modeled duration"),
        ("overlapped_us", F, "us", "part of the duration during which other streams computed"),
        ("exposed_us", F, "us", "duration_us - overlapped_us: communication nothing hides"),
        *_SOURCE,
    ]),
    "host_ops": ("torch.profiler's CPU ops (host wall time) with the modeled device time they issued.", [
        ("id", I, "", "torch.profiler event id (External id in the Chrome trace)"),
        ("name", S, "", "op name"),
        ("thread", I, "", "torch.profiler thread id (-1 for Python-stack events)"),
        ("start_us", F, "us", "host start since the trace started"),
        ("duration_us", F, "us", "host wall time"),
        ("self_cpu_us", F, "us", "host time excluding child ops"),
        ("device_us", F, "us", "modeled device time of the work it issued (with children)"),
        ("self_device_us", F, "us", "modeled device time of the work it issued itself"),
        ("depth", I, "", "nesting depth (0 = top level)"),
    ]),
    "summary": ("One row per device: totals of the profile and notes on its completeness.", [
        ("device", I, "", "neuron device index"),
        ("target", S, "", "Trainium target of the performance model (trn1, trn2, trn3)"),
        ("cycles", I, "", "profiling cycles recorded"),
        ("events", I, "", "device events"),
        ("span_us", F, "us", "first start to last end over all streams"),
        ("busy_us", F, "us", "time at least one stream was busy"),
        ("idle_us", F, "us", "span_us - busy_us"),
        ("device_time_us", F, "us", "summed duration of all events (streams may overlap)"),
        ("flops", F, "FLOP", "summed FLOPs"),
        ("bytes", F, "B", "summed bytes"),
        ("launch_us", F, "us", "summed launch cost"),
        ("fallback_count", I, "", "events run on the host CPU"),
        ("fallback_us", F, "us", "their modeled device time"),
        ("h2d_bytes", F, "B", "bytes copied host to device"),
        ("d2h_bytes", F, "B", "bytes copied device to host"),
        ("copy_us", F, "us", "modeled time of host<->device copies"),
        ("collective_us", F, "us", "modeled time of collectives"),
        ("collective_exposed_us", F, "us", "part of it not hidden by compute"),
        ("peak_memory_bytes", I, "B", "peak allocated device memory in the profile (-1 = not profiled)"),
        ("peak_flops_bf16", F, "FLOP/s", "target's BF16 Tensor-engine peak per core"),
        ("hbm_bytes_per_s", F, "B/s", "target's HBM bandwidth per core"),
        ("launch_cost_us", F, "us", "target's modeled launch cost per eager kernel"),
        ("dropped_events", I, "", "events not recorded past TORCHNEURON_PROFILER_MAX_EVENTS"),
        ("unlinked_events", I, "", "events not attributed to a torch.profiler op"),
        ("start_unix_ns", I, "ns", "wall-clock time the first cycle started"),
    ]),
}


class ProfileError(RuntimeError):
    """A profile directory that cannot be read at all."""


def schema_json() -> dict:
    """The schema of every table, as written to schema.json."""
    return {"format": FORMAT, "version": VERSION, "tables": {
        name: {"description": desc, "columns": [
            {"name": c, "type": str(t), "unit": u, "description": d} for c, t, u, d in cols]}
        for name, (desc, cols) in SCHEMA.items()}}


def _table(name: str, rows: list[dict]) -> pa.Table:
    cols = SCHEMA[name][1]
    return pa.table({c: pa.array([r.get(c) for r in rows], type=t) for c, t, _, _ in cols})


# ------------------------------------------------------------------------------------------------
# Building the rows
# ------------------------------------------------------------------------------------------------
def _event_rows(captures: list[DeviceCapture]) -> list[dict]:
    rows = []
    for cycle, capture in enumerate(captures):
        for ev in capture.events:
            row = {k: getattr(ev, k) for k in ev.__slots__ if k != "meta"}
            row["id"] = len(rows)
            row["cycle"] = cycle
            row["end_us"] = ev.start_us + ev.duration_us
            rows.append(row)
    return rows


def _peak(dtype: str) -> float:
    names = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}
    try:
        return float(get_target().peak_flops(names.get(dtype, dtype)))
    except (TypeError, ValueError, KeyError):
        return 0.0


def _kernel_rows(events: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for e in events:
        groups.setdefault((e["device"], e["kind"], e["name"], e["shapes"]), []).append(e)
    totals: dict[int, float] = {}
    for e in events:
        totals[e["device"]] = totals.get(e["device"], 0.0) + e["duration_us"]
    rows = []
    for (device, kind, name, shapes), evs in groups.items():
        longest = max(evs, key=lambda e: e["duration_us"])
        total = sum(e["duration_us"] for e in evs)
        flops, nbytes = sum(e["flops"] for e in evs), sum(e["bytes"] for e in evs)
        rows.append({
            "device": device, "kind": kind, "name": name, "category": longest["category"], "shapes": shapes,
            "dtype": longest["dtype"], "engine": longest["engine"], "bound": longest["bound"], "count": len(evs),
            "total_us": total, "mean_us": total / len(evs), "max_us": longest["duration_us"],
            "flops": flops, "bytes": nbytes, "arithmetic_intensity": flops / nbytes if nbytes else 0.0,
            "achieved_flops_per_s": flops / (total * 1e-6) if total else 0.0,
            "peak_flops_per_s": _peak(longest["dtype"]) if flops else 0.0,
            "achieved_bytes_per_s": nbytes / (total * 1e-6) if total else 0.0,
            "fallback_count": sum(1 for e in evs if e["fallback"]),
            "launch_us": sum(e["launch_us"] for e in evs),
            "share": total / totals[device] if totals[device] else 0.0,
            "source_file": longest["source_file"], "source_line": longest["source_line"],
            "source_function": longest["source_function"],
        })
    rows.sort(key=lambda r: -r["total_us"])
    return rows


def _instruction(rec: Any) -> tuple[str, str, float, float, str]:
    if isinstance(rec, dict):
        return (str(rec.get("kind", "")), str(rec.get("engine", "")), float(rec.get("start", 0.0)),
                float(rec.get("end", 0.0)), str(rec.get("where", "")))
    if isinstance(rec, (tuple, list)):
        return str(rec[0]), str(rec[1]), float(rec[2]), float(rec[3]), str(rec[4]) if len(rec) > 4 else ""
    return rec.kind, rec.engine, float(rec.start), float(rec.end), getattr(rec, "where", "")


def _instruction_trace(meta: dict | None) -> list:
    """An NKI kernel's scheduled instructions, if its charge attached them: meta["trace"] (the
    simulator's Records, or dicts/tuples with kind, engine, start, end, where; seconds from the
    kernel start), or meta["instructions"] when that is such a list rather than a count."""
    if not meta:
        return []
    for key in ("trace", "instructions"):
        value = meta.get(key)
        if isinstance(value, (list, tuple)):
            return list(value)
    return []


def _detail_rows(captures: list[DeviceCapture], events: list[dict]) -> dict[str, list[dict]]:
    """nki_instructions, dma, memory and collectives rows."""
    nki, dma, memory, collectives = [], [], [], []
    flat = [ev for capture in captures for ev in capture.events]
    hiding: dict[tuple[int, int], list[tuple[float, float]]] = {}  # compute on other streams

    def hidden_by(device: int, stream: int) -> list[tuple[float, float]]:
        if (device, stream) not in hiding:
            hiding[(device, stream)] = busy_intervals(
                e for e in events if e["device"] == device and e["stream"] != stream and e["kind"] != "collective")
        return hiding[(device, stream)]
    for ev, row in zip(flat, events):
        src = {k: row[k] for k in ("source_file", "source_line", "source_function")}
        if row["kind"] == "copy":
            dma.append({"event_id": row["id"], "device": row["device"], "kind": row["copy_kind"],
                        "bytes": row["bytes"], "start_us": row["start_us"], "duration_us": row["duration_us"],
                        "bytes_per_s": row["bytes"] / (row["duration_us"] * 1e-6) if row["duration_us"] else 0.0,
                        **src})
        for rec in _instruction_trace(ev.meta):
            kind, engine, start, end, where = _instruction(rec)
            start_us = row["start_us"] + start * 1e6
            nki.append({"event_id": row["id"], "kernel": row["name"], "device": row["device"], "engine": engine,
                        "instruction": kind, "start_us": start_us, "duration_us": (end - start) * 1e6,
                        "where": where})
            if kind.startswith("dma") or engine.startswith(("dma", "q")):
                dma.append({"event_id": row["id"], "device": row["device"], "kind": "nki", "bytes": float("nan"),
                            "start_us": start_us, "duration_us": (end - start) * 1e6, "bytes_per_s": float("nan"),
                            **src})
        if row["kind"] == "collective":
            hidden = interval_overlap((row["start_us"], row["end_us"]), hidden_by(row["device"], row["stream"]))
            collectives.append({"event_id": row["id"], "device": row["device"], "stream": row["stream"],
                                "name": row["name"], "bytes": row["bytes"], "start_us": row["start_us"],
                                "duration_us": row["duration_us"], "overlapped_us": hidden,
                                "exposed_us": row["duration_us"] - hidden, **src})
    previous: dict[int, int] = {}
    offset = 0
    for capture in captures:
        for m in capture.memory:
            memory.append({"event_id": offset + m.event_id if m.event_id >= 0 else -1, "device": m.device,
                           "host_time_us": m.host_time_us, "device_time_us": m.device_time_us,
                           "allocated_bytes": m.allocated_bytes, "reserved_bytes": m.reserved_bytes,
                           "delta_bytes": m.allocated_bytes - previous.get(m.device, m.allocated_bytes)})
            previous[m.device] = m.allocated_bytes
        offset += len(capture.events)
    return {"nki_instructions": nki, "dma": dma, "memory": memory, "collectives": collectives}


def _int64(value: int) -> int:
    """An id torch.profiler reports as unsigned 64-bit, as the int64 column holds it: Python-stack events
    (with_stack=True) have thread 2**64 - 1, which is -1 here."""
    value = int(value)
    return value - (1 << 64) if value >= 1 << 63 else value


def _host_op_rows(prof: Any) -> list[dict]:
    try:
        function_events = prof.events() if hasattr(prof, "events") else None
    except Exception:  # noqa: BLE001 - trace_only profiles have no events
        return []
    cpu = [e for e in function_events or () if e.device_type.name == "CPU" and not e.is_async]
    depth: dict[int, int] = {}
    total: dict[int, float] = {}
    for e in sorted(cpu, key=lambda e: e.time_range.start):  # parents start before their children
        parent = e.cpu_parent
        depth[id(e)] = depth.get(id(parent), -1) + 1 if parent is not None else 0
    for e in sorted(cpu, key=lambda e: -depth[id(e)]):  # children first: device time with children
        own = sum(k.duration for k in e.kernels)
        total[id(e)] = total.get(id(e), 0.0) + own
        if e.cpu_parent is not None:
            total[id(e.cpu_parent)] = total.get(id(e.cpu_parent), 0.0) + total[id(e)]
    return [{"id": _int64(e.id), "name": e.name, "thread": _int64(e.thread), "start_us": e.time_range.start,
             "duration_us": e.time_range.elapsed_us(), "self_cpu_us": float(e.self_cpu_time_total),
             "device_us": total[id(e)], "self_device_us": float(sum(k.duration for k in e.kernels)),
             "depth": depth[id(e)]} for e in cpu]


def _summary_rows(captures: list[DeviceCapture], events: list[dict], collectives: list[dict]) -> list[dict]:
    target = get_target()
    devices = sorted({e["device"] for e in events}) or [0]
    rows = []
    for device in devices:
        evs = [e for e in events if e["device"] == device]
        busy = busy_intervals(evs)
        span = (max(e["end_us"] for e in evs) - min(e["start_us"] for e in evs)) if evs else 0.0
        busy_us = sum(b - a for a, b in busy)
        copies = [e for e in evs if e["copy_kind"] in ("h2d", "d2h")]
        colls = [c for c in collectives if c["device"] == device]
        peaks = [c.peak_bytes[device] for c in captures if device in c.peak_bytes]
        rows.append({
            "device": device, "target": captures[0].target if captures else target.name, "cycles": len(captures),
            "events": len(evs), "span_us": span, "busy_us": busy_us, "idle_us": max(0.0, span - busy_us),
            "device_time_us": sum(e["duration_us"] for e in evs), "flops": sum(e["flops"] for e in evs),
            "bytes": sum(e["bytes"] for e in evs), "launch_us": sum(e["launch_us"] for e in evs),
            "fallback_count": sum(1 for e in evs if e["fallback"]),
            "fallback_us": sum(e["duration_us"] for e in evs if e["fallback"]),
            "h2d_bytes": sum(e["bytes"] for e in copies if e["copy_kind"] == "h2d"),
            "d2h_bytes": sum(e["bytes"] for e in copies if e["copy_kind"] == "d2h"),
            "copy_us": sum(e["duration_us"] for e in copies),
            "collective_us": sum(c["duration_us"] for c in colls),
            "collective_exposed_us": sum(c["exposed_us"] for c in colls),
            "peak_memory_bytes": max(peaks) if peaks else -1,
            "peak_flops_bf16": float(target.peak_flops("bfloat16")), "hbm_bytes_per_s": float(target.hbm_bytes_per_s),
            "launch_cost_us": target.kernel_launch_s * 1e6,
            "dropped_events": sum(c.dropped for c in captures),
            "unlinked_events": sum(1 for e in evs if e["host_op_id"] < 0),
            "start_unix_ns": min((c.start_ns for c in captures), default=0),
        })
    return rows


# ------------------------------------------------------------------------------------------------
# Writing and reading
# ------------------------------------------------------------------------------------------------
def _captures(prof: Any) -> list[DeviceCapture]:
    if isinstance(prof, DeviceCapture):
        return [prof]
    if isinstance(prof, (list, tuple)):
        return list(prof)
    from torchneuron.profiler.integration import captures_of

    return captures_of(prof)


def write_profile(prof: Any, path: str, *, trace: bool = True) -> str:
    """Writes the processed profile of `prof` (torch.profiler.profile, DeviceCapture or a list of
    captures) to directory `path`; returns `path`. Raises ValueError when nothing was recorded."""
    captures = _captures(prof)
    if not captures:
        raise ValueError("this profile has no neuron device activity: profile with activities=[ProfilerActivity.CPU, "
                         "ProfilerActivity.PrivateUse1] and let at least one cycle finish before exporting")
    host_ops = _host_op_rows(prof) if not isinstance(prof, (DeviceCapture, list, tuple)) else []
    events = _event_rows(captures)
    details = _detail_rows(captures, events)
    tables = {"events": events, "kernels": _kernel_rows(events), **details, "host_ops": host_ops,
              "summary": _summary_rows(captures, events, details["collectives"])}
    os.makedirs(path, exist_ok=True)
    stale = os.path.join(path, "manifest.json")
    if os.path.exists(stale):
        os.remove(stale)
    with open(os.path.join(path, "schema.json"), "w") as f:
        json.dump(schema_json(), f, indent=1)
    written = {}
    for name, rows in tables.items():
        file = os.path.join(path, f"{name}.parquet")
        pq.write_table(_table(name, rows), file + ".tmp")
        os.replace(file + ".tmp", file)
        written[name] = {"file": f"{name}.parquet", "rows": len(rows)}
    notes: list[str] = []
    if trace:
        from torchneuron.profiler.trace import write_trace

        trace_path = os.path.join(path, "trace.json")
        try:
            if not hasattr(prof, "export_chrome_trace") or isinstance(prof, DeviceCapture):
                raise RuntimeError("no host trace")
            prof.export_chrome_trace(trace_path)
        except RuntimeError as e:
            write_trace(trace_path, captures)
            notes.append(f"trace.json has the device tracks only (host trace unavailable: {e})")
    dropped = sum(c.dropped for c in captures)
    if dropped:
        notes.append(f"{dropped} device events were not recorded (TORCHNEURON_PROFILER_MAX_EVENTS="
                     f"{captures[0].max_events}); totals cover the recorded ones only")
    manifest = {"format": FORMAT, "version": VERSION, "complete": True, "tables": written,
                "trace": "trace.json" if trace else None, "created_unix": time.time(), "torch": torch.__version__,
                "target": captures[0].target, "notes": notes}
    with open(stale + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(stale + ".tmp", stale)
    return path


@dataclass
class Profile:
    """A profile directory as read back: pandas DataFrames by table name, what could not be read."""

    path: str
    tables: dict[str, Any] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    manifest: dict = field(default_factory=dict)

    def __getitem__(self, name: str) -> Any:
        return self.tables[name]

    def has(self, name: str) -> bool:
        return name in self.tables and len(self.tables[name]) > 0


def _is_profile_dir(path: str) -> bool:
    return os.path.exists(os.path.join(path, "manifest.json")) or any(
        os.path.exists(os.path.join(path, f"{name}.parquet")) for name in SCHEMA)


def profile_runs(path: str) -> list[str]:
    """The profile directories directly inside `path`, oldest first: `profile_dir_handler(path)` writes
    one per profiling cycle (`<host>_<pid>_step<N>`). Empty if `path` is itself a profile directory."""
    if not os.path.isdir(path) or _is_profile_dir(path):
        return []
    runs = [os.path.join(path, entry) for entry in os.listdir(path)]
    runs = [run for run in runs if os.path.isdir(run) and _is_profile_dir(run)]

    def age(run: str) -> tuple[float, int, str]:
        step = re.search(r"_step(\d+)$", run)
        return os.path.getmtime(run), int(step.group(1)) if step else -1, run
    return sorted(runs, key=age)


def read_profile(path: str) -> Profile:
    """Reads every table it can; missing or damaged parts are listed in `problems`. Raises
    ProfileError only when `path` is not a directory or holds no readable table at all."""
    import pandas as pd

    if not os.path.isdir(path):
        raise ProfileError(f"{path}: not a directory; pass the directory written by "
                           "torchneuron.profiler.export_profile(prof, DIR)")
    profile = Profile(path)
    manifest_path = os.path.join(path, "manifest.json")
    try:
        with open(manifest_path) as f:
            profile.manifest = json.load(f)
    except FileNotFoundError:
        profile.problems.append("manifest.json is missing: the export was interrupted or this is not a "
                                "torchneuron profile; reporting from the tables that are readable")
    except (OSError, ValueError) as e:
        profile.problems.append(f"manifest.json is unreadable ({e}); reporting from the readable tables")
    if profile.manifest and profile.manifest.get("format") != FORMAT:
        profile.problems.append(f"manifest.json: format {profile.manifest.get('format')!r} is not {FORMAT!r}")
    for note in profile.manifest.get("notes", []):
        profile.problems.append(note)
    listed = profile.manifest.get("tables", {})
    for name, (_, cols) in SCHEMA.items():
        file = os.path.join(path, f"{name}.parquet")
        if not os.path.exists(file):
            if name in listed or profile.manifest:
                profile.problems.append(f"{name}.parquet is missing")
            continue
        try:  # strings as categoricals: they repeat a lot, and a big profile must fit in memory
            strings = [c for c, t, _, _ in cols if t == S]
            df = pq.read_table(file, read_dictionary=strings).to_pandas()
        except Exception as e:  # noqa: BLE001 - any damage: report and go on
            profile.problems.append(f"{name}.parquet is unreadable ({type(e).__name__}: {str(e)[:120]})")
            continue
        missing = [c for c, _, _, _ in cols if c not in df.columns]
        if missing:
            profile.problems.append(f"{name}.parquet lacks columns {', '.join(missing)}")
            for c in missing:
                df[c] = pd.Series(dtype="object")
        expected = listed.get(name, {}).get("rows")
        if expected is not None and expected != len(df):
            profile.problems.append(f"{name}.parquet has {len(df)} rows, the manifest says {expected}")
        profile.tables[name] = df
    if not profile.tables:
        raise ProfileError(f"{path}: no readable profile table (expected events.parquet, kernels.parquet, ...); "
                           + "; ".join(profile.problems))
    return profile
