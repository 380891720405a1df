"""The work log's records, as the runtime writes them: layout, kinds, flags and on/off switch.

The hot path (csrc/worklog.cpp) appends one fixed-size record per op, copy, event or
synchronisation; `take()` hands the pending ones over as a numpy structured array. Turning them
into device time (pricing with the performance model, replaying on the timeline) is the
hardware's job: torchneuron/hardware/worklog.py.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

from torchneuron.runtime import _C
from torchneuron.runtime.extension import runtime_ops

# Defined once, in C++ (csrc/neuron.h: WorkKind, WorkFlags, WorkRecord), exported through _C.
OP, COPY, EVENT_RECORD, EVENT_WAIT, SYNC_DEVICE, SYNC_STREAM, SYNC_EVENT, FOLDED = (
    _C.WORK_KINDS[k] for k in ("OP", "COPY", "EVENT_RECORD", "EVENT_WAIT", "SYNC_DEVICE", "SYNC_STREAM", "SYNC_EVENT",
                               "FOLDED"))
FALLBACK, HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE = (
    _C.WORK_FLAGS[k] for k in ("FALLBACK", "HOST_TO_DEVICE", "DEVICE_TO_HOST", "DEVICE_TO_DEVICE"))
MAX_SIGS = _C.MAX_SIGS
FOLD_ENGINES = _C.FOLD_ENGINES  # engines a FOLDED record's busy seconds cover (its sigs, as float64)
RECORD = np.dtype(_C.WORK_RECORD_DTYPE)

# c10::ScalarType codes (c10/core/ScalarType.h) -> torch dtypes
_SCALAR_TYPES = [torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.float32,
                 torch.float64, torch.complex32, torch.complex64, torch.complex128, torch.bool, torch.qint8,
                 torch.quint8, torch.qint32, torch.bfloat16, torch.quint4x2, torch.quint2x4, torch.bits1x8,
                 torch.bits2x4, torch.bits4x2, torch.bits8, torch.bits16, torch.float8_e5m2, torch.float8_e4m3fn,
                 torch.float8_e5m2fnuz, torch.float8_e4m3fnuz, torch.uint16, torch.uint32, torch.uint64,
                 *(getattr(torch, f"uint{bits}") for bits in range(1, 8)),
                 *(getattr(torch, f"int{bits}") for bits in range(1, 8)),
                 torch.float8_e8m0fnu, torch.float4_e2m1fn_x2]  # 44: MX block scales, 45: packed FP4

_op_names: list[str] = []


def op_name(op_id: int) -> str:
    """The operator name of a record's op_id ("" for records without an op)."""
    if op_id >= len(_op_names):
        _op_names.extend(runtime_ops().op_names(len(_op_names)))
    return _op_names[op_id] if op_id >= 0 else ""


def op_names(op_ids: list[int]) -> list[str]:
    """op_name of each of a batch of records' op_ids."""
    if op_ids and max(op_ids) >= len(_op_names):
        _op_names.extend(runtime_ops().op_names(len(_op_names)))
    names = _op_names
    return [names[i] if i >= 0 else "" for i in op_ids]


def signature(sig: np.void) -> tuple[torch.dtype, tuple[int, ...]]:
    """(dtype, shape) of one tensor signature of a record."""
    ndim = int(sig["ndim"])
    sizes = sig["sizes"]
    if ndim <= 4:
        shape = tuple(int(s) for s in sizes[:ndim])
    else:  # leading dims were folded into the first
        shape = tuple(int(s) for s in sizes)
    return _SCALAR_TYPES[int(sig["dtype"])], shape


def take() -> np.ndarray:
    """The pending records (oldest first), removed from the log."""
    raw = runtime_ops().worklog_drain()
    if raw.numel() == 0:
        return np.empty(0, dtype=RECORD)
    return np.frombuffer(raw.numpy(), dtype=RECORD)


def set_folding(on: bool) -> bool:
    """Turns folding on or off (returns whether it was on): records whose price was taught are
    summed per stream into FOLDED records as they are appended (csrc/worklog.cpp). Only while
    nobody needs the records one by one."""
    return bool(_C.worklog_fold(bool(on)))


def learn_price(key: bytes, seconds: float, engine: int) -> None:
    """Teaches folding the price of records with price key `key` (a record's bytes, its device,
    stream, aux and host_seconds words zeroed): `seconds` on engine number `engine`."""
    _C.worklog_learn_price(key, float(seconds), int(engine))


def forget_prices() -> None:
    """Drops every taught price (what was folded at them stays charged as it was)."""
    _C.worklog_forget_prices()


def set_enabled(on: bool) -> None:
    """Turns recording of device work on or off (TORCHNEURON_TIMELINE=0 starts with it off)."""
    runtime_ops().set_worklog_enabled(bool(on))


def is_enabled() -> bool:
    return bool(runtime_ops().worklog_enabled())


@contextlib.contextmanager
def worklog_paused() -> Iterator[None]:
    """Eager ops issued inside are not recorded as device work: for ops that belong to work charged
    another way (a fused kernel's host code, moving a result into a buffer handed out earlier,
    compilation)."""
    runtime = runtime_ops()
    was_enabled = bool(runtime.worklog_enabled())
    if was_enabled:
        runtime.set_worklog_enabled(False)
    try:
        yield
    finally:
        if was_enabled:
            runtime.set_worklog_enabled(True)


def check_layout() -> None:
    """Fails when the library's record differs from RECORD (a stale _C.so: rebuild it)."""
    assert runtime_ops().worklog_record_size() == RECORD.itemsize, "WorkRecord layout differs between C++ and Python"
