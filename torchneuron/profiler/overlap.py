"""Interval arithmetic on device events: busy time, overlap, idle gaps.

Owns the small helpers tables.py and analysis.py share. Events are anything with
"start_us"/"end_us" keys (dict rows) or a (start, end) pair.
"""
from __future__ import annotations

import bisect
from typing import Iterable, Mapping


def _pair(e: Mapping | tuple) -> tuple[float, float]:
    return (e["start_us"], e["end_us"]) if isinstance(e, Mapping) else (e[0], e[1])


def busy_intervals(events: Iterable[Mapping | tuple]) -> list[tuple[float, float]]:
    """The union of the events' intervals, as sorted disjoint (start, end) pairs."""
    merged: list[list[float]] = []
    for start, end in sorted(_pair(e) for e in events):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def interval_overlap(interval: tuple[float, float], merged: list[tuple[float, float]]) -> float:
    """Length of `interval` covered by the disjoint sorted intervals `merged`."""
    start, end = interval
    i = max(0, bisect.bisect_right(merged, (start, float("inf"))) - 1)
    covered = 0.0
    while i < len(merged) and merged[i][0] < end:
        a, b = merged[i]
        covered += max(0.0, min(b, end) - max(a, start))
        i += 1
    return covered


def gaps(events: Iterable[Mapping | tuple], min_gap_us: float = 0.0) -> list[tuple[float, float]]:
    """Idle (start, end) gaps between the busy intervals of `events`, longer than min_gap_us."""
    merged = busy_intervals(events)
    return [(a[1], b[0]) for a, b in zip(merged, merged[1:]) if b[0] - a[1] > min_gap_us]
