"""Work handles of the neuron backend, and where collectives sit on the device timeline.

Host side: a collective's data moves (gloo over host views) when it is issued, so its Work is complete
on the host at once; point-to-point transfers stay pending until waited on (a send completes only when
the peer receives). Device side, as with NCCL streams: each process group has a communication stream
per device; a collective is charged there (the performance model's `collective_cost`) after that stream
waits for the issuing stream, and ends at an event. `wait()` makes the waiter's current stream wait for
that event, so compute issued between a collective and its wait overlaps it on the timeline. Futures
(`get_future`, used by DDP) carry the same event through c10's device-aware futures. `set_overlap(False)`
(TORCHNEURON_DIST_OVERLAP=0) charges collectives on the issuing stream instead, for what-if timings.
"""
from __future__ import annotations

import datetime
from typing import Callable

import torch
import torch.distributed as dist

from torchneuron import settings
from torchneuron.hardware.model import collective_cost
from torchneuron.hardware.timeline import get_timeline, recording_enabled
from torchneuron.hardware.worklog import charge, drain

_overlap = settings.current().dist_overlap


def set_overlap(enabled: bool) -> None:
    """Collectives on their group's own stream (True, the default, as with NCCL) or on the issuing
    stream (False: communication never overlaps compute; for what-if comparisons)."""
    global _overlap
    _overlap = bool(enabled)


class CommStreams:
    """The communication stream of one process group on each device it has used."""

    def __init__(self) -> None:
        self._streams: dict[int, torch.Stream] = {}

    def get(self, device: int) -> torch.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.neuron.Stream(device=device)
        return stream

    def charge(self, kind: str, nbytes: int, ranks: int, device: int, meta: dict | None = None) -> torch.Event | None:
        """Charges one collective to `device`'s communication stream, ordered after the work already
        issued on the current stream. Returns the event at its end (None when timing is off)."""
        return self.charge_timed(kind, nbytes, ranks, device, meta)[0]

    def charge_timed(self, kind: str, nbytes: int, ranks: int, device: int, meta: dict | None = None,
                     after: torch.Event | None = None, not_before: float = 0.0) -> tuple[torch.Event | None, float]:
        """`charge`, ordered after `after` (an event of the issuing stream) instead of the current
        stream's work when given, and starting no earlier than the modeled time `not_before`.
        Returns (the end event, the modeled start); (None, -1) when timing is off."""
        if not recording_enabled():
            return None, -1.0
        comm = self.get(device) if _overlap else torch.neuron.current_stream(device)
        if after is None:
            comm.wait_stream(torch.neuron.current_stream(device))
        else:
            comm.wait_event(after)
        if not_before > 0:
            drain()
            get_timeline(device).wait_until(comm.stream_id, not_before)
        start, _ = charge(f"c10d::{kind}", collective_cost(kind, nbytes, ranks), device=device,
                          stream=comm.stream_id, meta=meta)
        end = torch.neuron.Event(device=device)
        end.record(comm)
        return end, start


class NeuronWork(dist.Work):
    """A collective's handle. `finish` (if any) completes the host side: it runs once, on the first
    wait or future request, and its error is re-raised by every later wait."""

    def __init__(self, result: list[torch.Tensor], device: int | None = None, end: torch.Event | None = None,
                 stream: torch.Stream | None = None, finish: Callable[[], None] | None = None):
        super().__init__()
        self._result = result
        self._device = device
        self._end = end
        self._stream = stream
        self._finish = finish
        self._error: BaseException | None = None

    def _complete_on_host(self) -> None:
        if self._finish is not None:
            finish, self._finish = self._finish, None
            try:
                finish()
            except BaseException as error:  # noqa: BLE001  (kept and re-raised on every wait)
                self._error = error
        if self._error is not None:
            raise self._error

    def block_current_stream(self) -> None:
        """Device side only: the current stream waits for the collective to end."""
        if self._end is not None:
            torch.neuron.current_stream(self._device).wait_event(self._end)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self._complete_on_host()
        self.block_current_stream()
        return True

    def synchronize(self) -> None:
        self.wait()

    def is_completed(self) -> bool:
        return self._finish is None

    def is_success(self) -> bool:
        return self._finish is None and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def result(self) -> list[torch.Tensor]:
        return self._result

    def set_source(self, source: Callable[[], int]) -> None:
        """For a receive from any source: `source()` tells the sender once the host side is done."""
        self._source = source

    def _source_rank(self) -> int:
        self._complete_on_host()
        source = getattr(self, "_source", None)
        return source() if source is not None else -1

    source_rank = _source_rank

    def get_future(self) -> torch.futures.Future:
        """A completed future of the result; waiting on it joins the collective's end on the device."""
        self._complete_on_host()
        if self._end is None:
            future: torch.futures.Future = torch.futures.Future()
            future.set_result(self._result)
            return future
        future = torch.futures.Future(devices=[torch.device("neuron", self._device)])
        with torch.neuron.stream(self._stream):  # the future's completion event lands on the comm stream
            future.set_result(self._result)
        return future


class CoalescedWork(NeuronWork):
    """One handle over several works (the end of a coalescing block)."""

    def __init__(self, works: list[NeuronWork]):
        super().__init__([t for w in works for t in w.result()])
        self._works = works

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self._works:
            work.wait(timeout)
        return True

    def get_future(self) -> torch.futures.Future:
        for work in self._works:
            work.wait()
        future: torch.futures.Future = torch.futures.Future()
        future.set_result(self._result)
        return future
