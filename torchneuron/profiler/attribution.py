"""Turns a capture's raw material into DeviceEvents: decoding, source lines, module paths, phases.

This module owns the after-the-fact half of capture: decoding work-log records (dtypes, shapes,
copy direction, host time of fallbacks), naming the module chain found on the stack
(`layers.3.mlp`), classifying the phase (forward, backward, optimizer) and giving backward work
the module and forward source line of the op that created its autograd node.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import weakref

import numpy as np
import torch

from torchneuron.hardware.taxonomy import op_category
from torchneuron.hardware.targets import get_target
from torchneuron.profiler.events import DeviceEvent
from torchneuron.runtime import worklog

if TYPE_CHECKING:
    from torchneuron.profiler.capture import DeviceCapture, _Store

_DTYPE_NAMES = {
    "float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64", "int64": "i64", "int32": "i32",
    "int16": "i16", "int8": "i8", "uint8": "u8", "bool": "b1", "complex64": "c64", "complex128": "c128",
}


def _short_dtype(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_NAMES.get(name, name)


_IDENTITY = np.r_[0:8, 16:28, 48:worklog.RECORD.itemsize]  # bytes that decode_record depends on


def decode_record(rec: np.void) -> dict[str, Any]:
    """The fields of one raw work-log record that the profiler reports (but host time)."""
    flags, n_sigs, n_inputs = int(rec["flags"]), int(rec["n_sigs"]), int(rec["n_inputs"])
    sigs = []
    for i in range(n_sigs):
        if int(rec["sigs"][i]["dtype"]) < 0:
            continue
        dtype, shape = worklog.signature(rec["sigs"][i])
        sigs.append((i < n_inputs, _short_dtype(dtype), shape))
    ins = [f"{d}{list(s)}" for is_in, d, s in sigs if is_in]
    outs = [f"{d}{list(s)}" for is_in, d, s in sigs if not is_in]
    copy_kind = ""
    if int(rec["kind"]) == worklog.COPY:
        copy_kind = "d2d" if flags & worklog.DEVICE_TO_DEVICE else ("h2d" if flags & worklog.HOST_TO_DEVICE else "d2h")
    return {
        "fallback": bool(flags & worklog.FALLBACK),
        "copy_kind": copy_kind,
        "dtype": sigs[0][1] if sigs else "",
        "shapes": ", ".join(ins) + (" -> " + ", ".join(outs) if outs else ""),
    }


def _source(code: Any, line: int) -> tuple[str, int, str]:
    if code is None:
        return "", 0, ""
    return code.co_filename, int(line), getattr(code, "co_qualname", code.co_name)


def _kind(meta: dict | None, name: str) -> tuple[str, str]:
    """(kind, category) of work charged from Python. Conventions of the charging code: compiled
    graphs put "graph" (and their kernel kind) in meta, NKI kernels are named "nki::<kernel>",
    collectives "c10d::<collective>"; meta["kind"] may also name the profiler kind directly."""
    meta = meta or {}
    if "graph" in meta:
        return "graph", str(meta.get("kind", "fused"))
    kind = str(meta.get("kind", ""))
    if kind == "nki" or name.startswith("nki::"):
        return "nki", "nki"
    if kind == "collective" or name.startswith("c10d::"):
        return "collective", "collective"
    if kind in ("fused", "graph", "op", "copy"):
        return kind, op_category(name) if kind == "op" else kind
    return "other", kind or "other"


def build_events(capture: "DeviceCapture", store: "_Store") -> list[DeviceEvent]:
    """DeviceEvents, in the order the work was charged, from a capture's column store."""
    launch_us = get_target().kernel_launch_s * 1e6
    events: list[DeviceEvent] = []
    forward_of_seq: dict[int, tuple[str, str, str]] = {}
    backward: list[tuple[DeviceEvent, int]] = []
    decoded_by_key: dict[bytes, dict[str, Any]] = {}
    keys = [np.ascontiguousarray(b.view(np.uint8).reshape(len(b), -1)[:, _IDENTITY]) for b in store.batches]
    for index in range(len(store)):
        meta, name, cost, ctx = store.meta[index], store.name[index], store.cost[index], store.ctx[index]
        batch = store.batch[index]
        decoded, host_fallback_us = {}, 0.0
        if batch >= 0:  # records repeat: decode each distinct one once
            row = store.index[index]
            key = keys[batch][row].tobytes()
            decoded = decoded_by_key.get(key)
            if decoded is None:
                decoded = decoded_by_key[key] = decode_record(store.batches[batch][row])
            if decoded["fallback"]:
                host_fallback_us = float(store.batches[batch][row]["host_seconds"]) * 1e6
        if batch >= 0:
            kind = "copy" if decoded["copy_kind"] else "op"
            category = op_category(name) if kind == "op" else kind
        else:
            kind, category = _kind(meta, name)
        if ctx >= 0:
            code, line, inner, outer, optim = store.where[ctx]
            t_ns, thread, node, seq = store.t_ns[ctx], store.thread[ctx], store.node[ctx], store.seq[ctx]
        else:
            code, line, inner, outer, optim = None, 0, None, None, False
            t_ns, thread, node, seq = capture.start_ns, 0, "", -1
        file, line, function = _source(code, line)
        if node:
            phase = "backward"
        elif optim:
            phase = "optimizer"
        elif inner is not None:
            phase = "forward"
        else:
            phase = "other"
        device = store.device[index]
        origin = capture.origins.get(device, 0.0)
        extra = {k: v for k, v in meta.items() if k not in ("kind", "fallback")} if meta else None
        ev = DeviceEvent(
            id=index, device=device, stream=store.stream[index], kind=kind, name=name,
            op=op_base_name(name), category=category, engine=cost.engine, bound=cost.bound,
            start_us=(store.start[index] - origin) * 1e6, duration_us=(store.end[index] - store.start[index]) * 1e6,
            flops=float(cost.flops), bytes=float(cost.bytes),
            fallback=bool(decoded.get("fallback", cost.fallback)),
            host_fallback_us=host_fallback_us,
            launch_us=launch_us if kind == "op" and category != "scalar_read" else 0.0,
            copy_kind=decoded.get("copy_kind", str((meta or {}).get("copy_kind", ""))),
            dtype=decoded.get("dtype", ""), shapes=decoded.get("shapes", ""),
            source_file=file, source_line=line, source_function=function,
            module_path=module_path(inner, outer), module_type=type(inner).__name__ if inner is not None else "",
            phase=phase, autograd_node=node, forward_source="",
            host_time_us=(t_ns - capture.start_ns) / 1e3, thread=thread, meta=extra or None)
        if phase == "backward":
            backward.append((ev, seq))
        elif seq >= 0 and file and seq not in forward_of_seq:
            forward_of_seq[seq] = (ev.module_path, ev.module_type, f"{file}:{line}:{function}")
        events.append(ev)
    for ev, seq in backward:
        found = forward_of_seq.get(seq)
        if found is not None:
            ev.module_path, ev.module_type, ev.forward_source = found
    return events


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
