"""List scheduler over the NeuronCore engines.

Owns the modeled timeline of one kernel run. Resources are the compute engines (tensor,
vector, scalar, gpsimd) and the core's DMA subsystem. An instruction becomes ready when
every instruction it depends on has completed: read-after-write, write-after-read and
write-after-write on overlapping buffer regions (bounding boxes per buffer). It is then
placed at the earliest time its resource is free for its busy time, filling earlier idle
gaps when it fits (the compiler's list scheduling reorders independent instructions; the
engines themselves run in parallel). Its results are available `latency` after it starts
(latency >= busy; larger for DMA, whose fixed latency overlaps other transfers).

The scheduler is online: each instruction is placed as it is issued.
"""
from __future__ import annotations

from bisect import bisect_right
from itertools import product
from dataclasses import dataclass, field


def _overlap(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return True
    for (alo, ahi), (blo, bhi) in zip(a, b):
        if alo > bhi or blo > ahi:
            return False
    return True


def _covers(a: tuple | None, b: tuple | None) -> bool:
    if a is None:
        return True
    if b is None:
        return False
    for (alo, ahi), (blo, bhi) in zip(a, b):
        if alo > blo or ahi < bhi:
            return False
    return True


class Timeline:
    """Busy intervals of one resource, merged and sorted; places work in the first gap.

    Gaps narrower than the shortest instruction seen on the resource can never be used and
    are closed; a search that passes `SCAN` intervals without a fitting gap places the
    instruction after the last one (keeps placement O(log n) on long, fragmented timelines).
    """

    __slots__ = ("starts", "ends", "min_busy")
    SCAN = 256

    def __init__(self):
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.min_busy = float("inf")

    def place(self, ready: float, busy: float) -> float:
        starts, ends = self.starts, self.ends
        if 0 < busy < self.min_busy:
            self.min_busy = busy
        i = bisect_right(ends, ready)  # first interval ending after `ready`
        t = ready
        n = len(starts)
        if n - i > self.SCAN:
            stop = i + self.SCAN
            while i < stop and starts[i] < t + busy:
                if ends[i] > t:
                    t = ends[i]
                i += 1
            if i == stop:
                i, t = n, max(ready, ends[-1])
        while i < n and starts[i] < t + busy:
            if ends[i] > t:
                t = ends[i]
            i += 1
        # occupy [t, t + busy): insert at i, merging with neighbours closer than any instruction
        e = t + busy
        gap = self.min_busy
        if i > 0 and t - ends[i - 1] < gap:
            i -= 1
            if e > ends[i]:
                ends[i] = e
            if i + 1 < len(starts) and starts[i + 1] - ends[i] < gap:
                if ends[i + 1] > ends[i]:
                    ends[i] = ends[i + 1]
                del starts[i + 1], ends[i + 1]
        elif i < n and starts[i] - e < gap:
            starts[i] = t
        else:
            starts.insert(i, t)
            ends.insert(i, e)
        return t

    @property
    def end(self) -> float:
        return self.ends[-1] if self.ends else 0.0


class BoxIndex:
    """Access records of one buffer: [box, completion, live] entries. Few entries are kept
    in a flat list; past `FLAT` they are bucketed on a grid whose cell is the first box's
    extent, so tiled access patterns query only nearby entries."""

    __slots__ = ("flat", "cell", "cells", "big")
    FLAT = 24

    def __init__(self):
        self.flat: list | None = []
        self.cell = None
        self.cells: dict = {}
        self.big: list = []          # grid mode: entries spanning many cells or the whole buffer

    def _keys(self, box):
        if box is None:
            return None
        cell = self.cell
        ranges = []
        count = 1
        for (lo, hi), c in zip(box, cell):
            a, b = lo // c, hi // c
            count *= b - a + 1
            if count > 16:
                return None
            ranges.append(range(a, b + 1))
        return product(*ranges)

    def add(self, box, end: float) -> None:
        entry = [box, end, True]
        flat = self.flat
        if flat is not None:
            flat.append(entry)
            if len(flat) > self.FLAT:
                self._to_grid()
            return
        self._insert(entry)

    def _to_grid(self) -> None:
        entries, self.flat = self.flat, None
        first = next((e[0] for e in entries if e[0] is not None), None)
        self.cell = tuple(max(1, hi - lo + 1) for lo, hi in first) if first else None
        for e in entries:
            self._insert(e)

    def _insert(self, entry) -> None:
        keys = self._keys(entry[0]) if self.cell is not None else None
        if keys is None:
            self.big.append(entry)
            return
        cells = self.cells
        for k in keys:
            lst = cells.get(k)
            if lst is None:
                cells[k] = [entry]
            else:
                lst.append(entry)

    def _lists(self, box) -> list:
        if self.flat is not None:
            return [self.flat]
        keys = self._keys(box) if self.cell is not None else None
        if keys is None:
            return list(self.cells.values()) + [self.big]
        cells = self.cells
        out = [self.big]
        for k in keys:
            lst = cells.get(k)
            if lst:
                out.append(lst)
        return out

    def latest(self, box, bound: float) -> float:
        """Max completion over live entries overlapping `box` (at least `bound`)."""
        for lst in self._lists(box):
            for e in lst:
                if e[1] > bound and e[2] and _overlap(box, e[0]):
                    bound = e[1]
        return bound

    def drop_covered(self, box) -> None:
        """Entries inside `box` are dominated by a write to `box` (it waited for them)."""
        if box is None:
            self.flat, self.cell, self.cells, self.big = [], None, {}, []
            return
        for lst in self._lists(box):
            dead = False
            for e in lst:
                if e[2] and _covers(box, e[0]):
                    e[2] = False
                    dead = True
            if dead:
                lst[:] = [e for e in lst if e[2]]


class _Accesses:
    __slots__ = ("writes", "reads")

    def __init__(self):
        self.writes = BoxIndex()
        self.reads = BoxIndex()


@dataclass
class Record:
    """One scheduled instruction, kept for profiles."""

    kind: str
    engine: str
    start: float
    end: float
    where: str = ""


@dataclass
class Scheduler:
    keep_trace: bool = False
    busy: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    trace: list = field(default_factory=list)
    makespan: float = 0.0
    floor: float = 0.0  # nothing starts before this (kernel start on this core)
    _timelines: dict = field(default_factory=dict)
    _order: dict = field(default_factory=dict)  # engine -> earliest start (sequential order)
    _acc: dict = field(default_factory=dict)

    def ready(self, reads, writes) -> float:
        """Earliest start the dependencies of an instruction with these accesses allow."""
        acc = self._acc
        ready = self.floor
        for key, box in reads:
            a = acc.get(key)
            if a is not None:
                ready = a.writes.latest(box, ready)
        for key, box in writes:
            a = acc.get(key)
            if a is not None:
                ready = a.reads.latest(box, a.writes.latest(box, ready))
        return ready

    def issue(self, kind: str, engine: str, busy: float, latency: float, reads, writes,
              where: str = "", not_before: float = 0.0) -> float:
        """Place one instruction; `reads`/`writes` are lists of (buffer_id, box or None).
        `not_before`: an outside constraint on its start (a collective waits for the other
        ranks). Returns its completion time."""
        acc = self._acc
        ready = max(self.ready(reads, writes), not_before)
        tl = self._timelines.get(engine)
        if tl is None:
            tl = self._timelines[engine] = Timeline()
        start = tl.place(max(ready, self._order.get(engine, 0.0)), busy)
        end = start + max(latency, busy)
        self.busy[engine] = self.busy.get(engine, 0.0) + busy
        self.counts[engine] = self.counts.get(engine, 0) + 1
        if end > self.makespan:
            self.makespan = end
        for key, box in reads:
            a = acc.get(key)
            if a is None:
                a = acc[key] = _Accesses()
            a.reads.add(box, end)
        for key, box in writes:
            a = acc.get(key)
            if a is None:
                a = acc[key] = _Accesses()
            # records covered by this write are dominated by it (it waited for them)
            a.writes.drop_covered(box)
            a.reads.drop_covered(box)
            a.writes.add(box, end)
        if self.keep_trace:
            self.trace.append(Record(kind, engine, start, end, where))
        return end

    def order_point(self) -> None:
        """Later instructions start no earlier than each engine's last busy moment."""
        for eng, tl in self._timelines.items():
            self._order[eng] = tl.end

    def forget(self, key: int) -> None:
        """A buffer died: its accesses can no longer constrain anything."""
        self._acc.pop(key, None)

    def barrier(self) -> None:
        """Everything issued later starts after everything issued so far."""
        self.floor = self.makespan

    def utilisation(self) -> dict:
        """Busy fraction of the kernel's latency per engine."""
        span = self.makespan or 1.0
        return {eng: b / span for eng, b in self.busy.items()}
