"""Modeled Trainium time per request: what each engine step costs on the device timeline, and
the requests that step served.

The driver worker (rank 0) reads its device's timeline before and after every step (forward
pass and sampling) and gives each request scheduled in the step the step's modeled duration:
a batched step makes every request in it wait for all of it. Until a request's first output
token, that time adds to its modeled time to first token (TTFT); afterwards to its decode time,
whose mean per output token is its modeled TPOT. Device time before a request's first step (while
it queues behind other requests) is not counted.

Records go, one JSON line per request per step, to a file in $TORCHNEURON_SERVING_TIMING_DIR
(set by the platform in the process that creates the engine, inherited by its workers), written
before the step's tokens leave the worker; `TimingReader` (the server side) follows the file.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from torchneuron import eager, settings
from torchneuron.hardware import get_target
from torchneuron.hardware import timeline as device_timeline
from torchneuron.runtime import _C as fast

ENV = "TORCHNEURON_SERVING_TIMING_DIR"
FILE = "requests.jsonl"


def device_now(device: torch.device) -> float:
    """The device's modeled clock (seconds): when its last charged work ends."""
    device_timeline.flush_pending()
    clocks = device_timeline.get_timeline(device.index or 0).streams()
    return max(clocks.values(), default=0.0)


@dataclass
class RequestTime:
    """Modeled device seconds of one request so far."""

    ttft_s: float = 0.0
    decode_s: float = 0.0
    output_tokens: int = 0
    steps: int = 0

    @property
    def tpot_s(self) -> float | None:
        return self.decode_s / (self.output_tokens - 1) if self.output_tokens > 1 else None

    def as_dict(self) -> dict[str, Any]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "decode_s": self.decode_s,
                "output_tokens": self.output_tokens, "steps": self.steps}


@dataclass
class StepTimer:
    """Charges each step's modeled time to its requests (driver worker only writes records)."""

    device: torch.device
    requests: dict[str, RequestTime] = field(default_factory=dict)
    _file: Any = None
    _open: tuple[float, list[str]] | None = None
    _last_read: tuple[int, float] | None = None  # (timeline entries, clock) at the last reading

    def _clock(self) -> float:
        """device_now, without draining the work log when nothing was charged or recorded since
        the last reading (a step's start right after the previous step's end): the clock has
        not moved then."""
        timeline = device_timeline.get_timeline(self.device.index or 0)
        last = self._last_read
        if last is not None and last[0] == timeline.entries and not fast.worklog_pending() and not eager.pending():
            return last[1]
        now = device_now(self.device)
        self._last_read = (timeline.entries, now)
        return now

    def __post_init__(self) -> None:
        directory = settings.current().serving_timing_dir
        driver = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if directory and os.path.isdir(directory) and driver:
            self._file = open(os.path.join(directory, FILE), "a", buffering=1)

    def begin(self, scheduler_output: Any) -> None:
        """A step starts: the requests it schedules and the device clock now."""
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self.requests.pop(req_id, None)
        scheduled = list(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        self._open = (self._clock(), scheduled) if scheduled else None

    def end(self, output_counts: dict[str, int]) -> None:
        """The step's tokens are sampled: output_counts[req] is the request's output length now."""
        if self._open is None:
            return
        start, scheduled = self._open
        self._open = None
        duration = self._clock() - start
        for req_id in scheduled:
            record = self.requests.get(req_id)
            if record is None:
                record = self.requests[req_id] = RequestTime()
            if record.output_tokens == 0:
                record.ttft_s += duration
            else:
                record.decode_s += duration
            record.output_tokens = output_counts.get(req_id, record.output_tokens)
            record.steps += 1
        if self._file is not None and scheduled:
            target = json.dumps(get_target().name)
            self._file.write("".join(_line(req_id, target, self.requests[req_id]) for req_id in scheduled))


def _line(req_id: str, target: str, record: RequestTime) -> str:
    """One request's record as a JSON line (`target` already JSON), formatted directly: the worker
    writes one per request per step."""
    tpot = record.tpot_s
    return (f'{{"id": {json.dumps(req_id)}, "target": {target}, "ttft_s": {record.ttft_s!r}, '
            f'"tpot_s": {"null" if tpot is None else repr(tpot)}, "decode_s": {record.decode_s!r}, '
            f'"output_tokens": {record.output_tokens}, "steps": {record.steps}}}\n')


class TimingReader:
    """Follows the timing file of one engine: the latest record of each request id."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, FILE)
        self.records: dict[str, dict[str, Any]] = {}
        self._offset = 0

    def refresh(self) -> dict[str, dict[str, Any]]:
        if os.path.exists(self.path):
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
            complete = data.rfind(b"\n") + 1
            self._offset += complete
            for line in data[:complete].splitlines():
                record = json.loads(line)
                self.records[record.pop("id")] = record
        return self.records

    def find(self, response_id: str) -> list[dict[str, Any]]:
        """Records of the engine requests behind one OpenAI response id (a random id, which vLLM's
        engine request ids contain; n > 1 makes several)."""
        records = self.refresh()
        return [r for req_id, r in records.items() if response_id and response_id in req_id]

    def for_request(self, request_id: str) -> dict[str, Any] | None:
        """The record of an offline `LLM` request (`RequestOutput.request_id`; the engine appends
        a random suffix after a dash)."""
        records = self.refresh()
        for req_id, record in records.items():
            if req_id == request_id or req_id.rsplit("-", 1)[0] == request_id:
                return record
        return None
