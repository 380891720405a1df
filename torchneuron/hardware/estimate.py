"""`estimate()`: what a region of code would cost on Trainium, from the device timeline.

This module owns the `estimate` context manager and the `Estimate` report. It observes every
entry enqueued on any device timeline inside the region through the timeline's listener API
and summarises them: modeled device time, FLOPs, bytes, achieved FLOP/s, MFU, time per
engine and a per-op table.

    with torchneuron.hardware.estimate("trn2") as est:
        model(x).sum().backward()
    print(est)            # table; est.device_time_s, est.mfu, est.per_op, ...

Definitions:
- device_time_s: the span of the work enqueued in the region, from the earliest start to the
  latest end over all devices and streams (work on parallel streams overlaps).
- mfu: achieved FLOP/s over the *BF16* Tensor-engine peak of one core of the target, the
  usual convention for training; `mfu_against(dtype)` uses another dtype's peak. With work
  on several devices, achieved FLOP/s is per device (total FLOPs / devices / span).
- FLOPs are the model's nominal counts; host fallbacks contribute none.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .targets import Target, get_target, set_target
from .timeline import TimelineEntry, add_listener, flush_pending, remove_listener

__all__ = ["Estimate", "OpRow", "estimate"]


@dataclass
class OpRow:
    """Totals of one op name inside an estimate region."""

    name: str
    count: int = 0
    time_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    engine: str = ""
    fallbacks: int = 0


@dataclass
class Estimate:
    """Summary of the timeline work enqueued inside an `estimate()` region."""

    target: Target
    device_time_s: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    engine_time_s: dict[str, float] = field(default_factory=dict)
    entries: int = 0
    devices: int = 0
    _rows: dict[str, OpRow] = field(default_factory=dict, repr=False)
    _start: float = field(default=float("inf"), repr=False)
    _end: float = field(default=float("-inf"), repr=False)
    _device_ids: set = field(default_factory=set, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    # ---- observation -------------------------------------------------------------------------
    def observe(self, entry: TimelineEntry) -> None:
        """Listener: account one timeline entry."""
        cost = entry.cost
        duration = entry.end_s - entry.start_s
        with self._lock:
            self.entries += 1
            self.flops += cost.flops
            self.bytes += cost.bytes
            self.engine_time_s[cost.engine] = self.engine_time_s.get(cost.engine, 0.0) + duration
            self._start = min(self._start, entry.start_s)
            self._end = max(self._end, entry.end_s)
            self._device_ids.add(entry.device)
            row = self._rows.get(entry.name)
            if row is None:
                row = self._rows[entry.name] = OpRow(entry.name, engine=cost.engine)
            row.count += 1
            row.time_s += duration
            row.flops += cost.flops
            row.bytes += cost.bytes
            row.fallbacks += cost.fallback
            self.device_time_s = self._end - self._start
            self.devices = len(self._device_ids)

    # ---- derived figures ---------------------------------------------------------------------
    @property
    def achieved_flops(self) -> float:
        """FLOP/s per device over the region's span."""
        if self.device_time_s <= 0:
            return 0.0
        return self.flops / max(1, self.devices) / self.device_time_s

    @property
    def mfu(self) -> float:
        """achieved_flops / the target's BF16 peak per core."""
        return self.mfu_against(torch.bfloat16)

    def mfu_against(self, dtype: torch.dtype | str) -> float:
        """achieved_flops / the target's Tensor-engine peak for `dtype`."""
        return self.achieved_flops / self.target.peak_flops(dtype)

    @property
    def per_op(self) -> list[OpRow]:
        """One row per op name, the most expensive first."""
        with self._lock:
            rows = [OpRow(**vars(row)) for row in self._rows.values()]
        return sorted(rows, key=lambda row: (-row.time_s, row.name))

    def __str__(self) -> str:
        lines = [
            f"estimate on {self.target.name} ({self.target.core_type}): "
            f"{self.entries} items on {self.devices} device(s)",
            f"  device time {_seconds(self.device_time_s)}, {self.flops / 1e9:.3f} GFLOP, "
            f"{self.bytes / 1e6:.3f} MB, {self.achieved_flops / 1e12:.2f} TFLOP/s, "
            f"MFU {100 * self.mfu:.1f}% of BF16 peak",
            "  engines: " + ", ".join(f"{engine} {_seconds(t)}" for engine, t in
                                      sorted(self.engine_time_s.items(), key=lambda kv: -kv[1])),
            f"  {'op':<48} {'count':>7} {'time':>11} {'%':>6} {'GFLOP':>10} {'MB':>10}  engine",
        ]
        total = sum(row.time_s for row in self._rows.values()) or 1.0
        for row in self.per_op:
            fallback = " (host fallback)" if row.fallbacks else ""
            lines.append(f"  {row.name[:48]:<48} {row.count:>7} {_seconds(row.time_s):>11} "
                         f"{100 * row.time_s / total:>5.1f}% {row.flops / 1e9:>10.3f} "
                         f"{row.bytes / 1e6:>10.3f}  {row.engine}{fallback}")
        return "\n".join(lines)


def _seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if value >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value / 1e-9:.1f} ns"


@contextmanager
def estimate(target: str | None = None) -> Iterator[Estimate]:
    """Observe the device work enqueued inside the region and summarise it on exit.

    `target` ("trn1", "trn2", "trn3") switches the current target for the region and
    restores the previous one afterwards; None keeps the current target.
    """
    previous = get_target()
    chosen = set_target(target) if target is not None else previous
    report = Estimate(target=chosen)
    flush_pending()  # work issued before the region is not part of it
    add_listener(report.observe)
    try:
        yield report
    finally:
        flush_pending()
        remove_listener(report.observe)
        if chosen is not previous:
            set_target(previous.name)
