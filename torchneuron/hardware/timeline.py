"""The device timeline: modeled time on each logical device, one clock per stream.

This module owns `DeviceTimeline` (one per device index), the registry of timelines, and the
listener API through which the profiler and `estimate()` observe every piece of work charged
to any timeline. A listener sees entries one by one, or, when it registers a batch function, the
work-log records of one drain as one `EntryBatch` of columns (no object per entry: the profiler's
cost per recorded op).

Semantics:
- Each stream is an in-order queue with its own clock in seconds of device time. Work
  enqueued on a stream starts at that stream's clock and advances it by the work's modeled
  duration. Streams do not contend with each other (assumption: independent queues; the
  model charges each kernel as if it had the engines to itself).
- An event records a stream's clock; waiting on it joins a stream's clock to it
  (clock = max(clock, t)); synchronize joins every stream to the latest clock.
- A stream first used after a synchronize starts at the synchronized time, not at zero.
- Only modeled device time lives here. Host wall time is never mixed in.
- `recording_enabled()` reads TORCHNEURON_TIMELINE (0 disables recording); callers on hot
  paths check it once and skip enqueue entirely when off.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from torchneuron import settings

from .model import Cost

__all__ = [
    "DeviceTimeline",
    "TimelineEntry",
    "EntryBatch",
    "get_timeline",
    "all_timelines",
    "reset_all",
    "add_listener",
    "remove_listener",
    "recording_enabled",
    "add_pending_source",
    "flush_pending",
]


@dataclass(frozen=True, slots=True)
class TimelineEntry:
    """One unit of work as charged to a timeline: device index, stream id, a name (usually
    the aten op, "copy_h2d", a kernel name...), start and end in seconds of device time, the
    Cost, and free-form metadata from the caller."""

    device: int
    stream: int
    name: str
    start_s: float
    end_s: float
    cost: Cost
    meta: dict[str, Any] | None = None

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True, slots=True)
class EntryBatch:
    """Work-log records charged by one drain, as columns: entry i ran on `device[i]`, `stream[i]`
    from `start_s[i]` to `end_s[i]` at `cost[i]`, named `name[i]`; `record[i]` is its index among
    the drained records and `meta[i]` its TimelineEntry metadata. In the records' order."""

    device: list[int]
    stream: list[int]
    name: list[str]
    start_s: list[float]
    end_s: list[float]
    cost: list[Cost]
    meta: list[dict[str, Any]]
    record: list[int]

    def __len__(self) -> int:
        return len(self.record)

    def entries(self) -> Iterator[TimelineEntry]:
        """The batch as TimelineEntry objects, in order."""
        for i in range(len(self.record)):
            yield TimelineEntry(self.device[i], self.stream[i], self.name[i], self.start_s[i], self.end_s[i],
                                self.cost[i], dict(self.meta[i]))


Listener = Callable[[TimelineEntry], None]
BatchListener = Callable[[EntryBatch], None]

# Listeners of all timelines. Replaced (never mutated) on add/remove, so enqueue can read it
# without a lock and an empty tuple costs one truth test.
_listeners: tuple[Listener, ...] = ()
_batch_listeners: dict[Listener, BatchListener] = {}
_listeners_lock = threading.Lock()


_listeners_watchers: list[Callable[[], None]] = []


def on_listeners_change(fn: Callable[[], None]) -> None:
    """Call `fn()` after every listener added or removed (the work log folds records only while
    there is none)."""
    _listeners_watchers.append(fn)


def add_listener(fn: Listener, batches: BatchListener | None = None) -> None:
    """Call `fn(entry)` for every entry enqueued on any timeline from now on; with `batches`,
    the work-log records of a drain reach `batches(EntryBatch)` instead, in one call."""
    global _listeners
    with _listeners_lock:
        _listeners = _listeners + (fn,)
        if batches is not None:
            _batch_listeners[fn] = batches
    for watcher in _listeners_watchers:
        watcher()


def deliver(batch: EntryBatch) -> None:
    """Hands the entries of one drain to every listener: as the batch where it takes batches,
    else entry by entry."""
    for fn in _listeners:
        batches = _batch_listeners.get(fn)
        if batches is not None:
            batches(batch)
        else:
            for entry in batch.entries():
                fn(entry)


def has_listeners() -> bool:
    return bool(_listeners)


def remove_listener(fn: Listener) -> None:
    """Stop calling `fn`; unknown listeners are ignored."""
    global _listeners
    with _listeners_lock:
        listeners = list(_listeners)
        if fn in listeners:
            listeners.remove(fn)
        _listeners = tuple(listeners)
        if fn not in _listeners:
            _batch_listeners.pop(fn, None)
    for watcher in _listeners_watchers:
        watcher()


# Producers of device work that is recorded but not yet priced (the runtime's work log). Readers
# of the timeline call flush_pending() first so they see every piece of work issued so far.
_pending_sources: list[Callable[[], None]] = []


def add_pending_source(flush: Callable[[], None]) -> None:
    """Register `flush()`, which charges work recorded elsewhere to the timelines."""
    if flush not in _pending_sources:
        _pending_sources.append(flush)


def flush_pending() -> None:
    """Charge all recorded-but-unpriced work (call before reading clocks or entries)."""
    for flush in _pending_sources:
        flush()


def recording_enabled() -> bool:
    """False when TORCHNEURON_TIMELINE is off ("0", "false", ...): charge nothing."""
    return settings.current().timeline


class DeviceTimeline:
    """Stream clocks and engine busy times of one logical device."""

    def __init__(self, device: int) -> None:
        self.device = device
        self._lock = threading.Lock()
        self._clocks: dict[int, float] = {}
        self._floor = 0.0                 # the last synchronize: where new streams start
        self._engine_busy: dict[str, float] = {}
        self._entries = 0

    # ---- charging work ---------------------------------------------------------------------
    def enqueue(self, stream_id: int, cost: Cost, name: str, meta: dict | None = None) -> tuple[float, float]:
        """Charge `cost` to stream `stream_id`; returns (start, end) in device seconds."""
        duration = cost.duration_s
        with self._lock:
            start = self._clocks.get(stream_id, self._floor)
            end = start + duration
            self._clocks[stream_id] = end
            engine = cost.engine
            self._engine_busy[engine] = self._engine_busy.get(engine, 0.0) + duration
            self._entries += 1
        if _listeners:
            entry = TimelineEntry(self.device, stream_id, name, start, end, cost, meta)
            for fn in _listeners:
                fn(entry)
        return start, end

    # ---- clocks, events, joins -----------------------------------------------------------
    def advance(self, stream_id: int, duration_s: float, engine_busy: dict[str, float], count: int) -> float:
        """Charge `count` back-to-back items of total `duration_s` to a stream at once (no listener
        sees them: callers use it only when there are none). Returns the stream's new clock."""
        with self._lock:
            end = self._clocks.get(stream_id, self._floor) + duration_s
            self._clocks[stream_id] = end
            for engine, busy in engine_busy.items():
                self._engine_busy[engine] = self._engine_busy.get(engine, 0.0) + busy
            self._entries += count
        return end

    def advance_each(self, stream_id: int, durations: np.ndarray, engine_busy: dict[str, float]
                     ) -> tuple[np.ndarray, np.ndarray]:
        """Charge back-to-back items of the given durations (seconds) to a stream at once and return
        their (starts, ends), the clocks `enqueue` would give one by one. No listener sees them: the
        caller delivers them (`deliver`)."""
        with self._lock:
            clocks = np.cumsum(np.concatenate(([self._clocks.get(stream_id, self._floor)], durations)))
            self._clocks[stream_id] = float(clocks[-1])
            for engine, busy in engine_busy.items():
                self._engine_busy[engine] = self._engine_busy.get(engine, 0.0) + busy
            self._entries += len(durations)
        return clocks[:-1], clocks[1:]

    def now(self, stream_id: int) -> float:
        """The stream's clock: when its last enqueued work ends."""
        with self._lock:
            return self._clocks.get(stream_id, self._floor)

    def record_event(self, stream_id: int) -> float:
        """An event recorded on the stream completes at the stream's current clock."""
        return self.now(stream_id)

    def wait_until(self, stream_id: int, t: float) -> float:
        """Later work on the stream starts no earlier than `t`; returns the new clock."""
        with self._lock:
            clock = max(self._clocks.get(stream_id, self._floor), t)
            self._clocks[stream_id] = clock
            return clock

    def wait_stream(self, waiter_id: int, waitee_id: int) -> float:
        """The waiter's later work starts after everything enqueued so far on the waitee."""
        return self.wait_until(waiter_id, self.now(waitee_id))

    def synchronize(self) -> float:
        """Join all streams: every clock becomes the latest one, which is returned."""
        with self._lock:
            latest = max(self._clocks.values(), default=self._floor)
            latest = max(latest, self._floor)
            for stream_id in self._clocks:
                self._clocks[stream_id] = latest
            self._floor = latest
            return latest

    # ---- statistics --------------------------------------------------------------------------
    def engine_busy_s(self) -> dict[str, float]:
        """Seconds of work charged to each engine since the last reset."""
        with self._lock:
            return dict(self._engine_busy)

    @property
    def entries(self) -> int:
        """Number of items enqueued since the last reset."""
        return self._entries

    def stream_ids(self) -> list[int]:
        """Ids of the streams used since the last reset."""
        with self._lock:
            return list(self._clocks)

    def streams(self) -> dict[int, float]:
        """Clock of every stream used since the last reset."""
        with self._lock:
            return dict(self._clocks)

    def reset(self) -> None:
        """Back to time zero: forget streams, clocks and busy times."""
        with self._lock:
            self._clocks.clear()
            self._engine_busy.clear()
            self._floor = 0.0
            self._entries = 0

    def __repr__(self) -> str:
        return f"DeviceTimeline(device={self.device}, streams={self.streams()})"


_timelines: dict[int, DeviceTimeline] = {}
_registry_lock = threading.Lock()


def get_timeline(device_index: int) -> DeviceTimeline:
    """The timeline of logical device `device_index` (created on first use)."""
    timeline = _timelines.get(device_index)
    if timeline is None:
        if device_index < 0:
            raise ValueError(f"device index must be >= 0, got {device_index}")
        with _registry_lock:
            timeline = _timelines.setdefault(device_index, DeviceTimeline(device_index))
    return timeline


def all_timelines() -> list[DeviceTimeline]:
    """Every timeline created so far, by device index."""
    with _registry_lock:
        return [_timelines[index] for index in sorted(_timelines)]


def reset_all() -> None:
    """Reset every timeline to time zero."""
    for timeline in all_timelines():
        timeline.reset()
