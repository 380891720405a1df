"""Modeled Trainium time per request: what each engine step costs on the device timeline, and
the requests that step served.

The driver worker (rank 0) reads its device's timeline around the engine's steps (forward pass
and sampling) and gives each request scheduled in a step the step's modeled duration: a batched
step makes every request in it wait for all of it. Until a request's first output token, that time
adds to its modeled time to first token (TTFT); afterwards to its decode time, whose mean per output
token is its modeled TPOT. Device time before a request's first step (while it queues behind other
requests) is not counted.

Reading the clock drains the work log, so it is read per *window*, not per step: consecutive steps
that schedule the same requests, all past their first token, charge each of them the same decode
time whichever way the window's time splits into steps, so the window is read once at its end. A
window ends when the scheduled requests change, after a step with a prefill (TTFT stays exact),
before a step that may finish one of its requests (the last token's step: a request's final
record is always exact), with speculative decoding (a step's token count varies) and at most every
`WINDOW_STEPS` steps.

Records go, one JSON line per request per window, to a file in $TORCHNEURON_SERVING_TIMING_DIR
(set by the platform in the process that creates the engine, inherited by its workers), written
before the window's last tokens leave the worker; `TimingReader` (the server side) follows the
file. A request's record is complete when its last token is returned.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from torchneuron import eager, settings
from torchneuron.hardware import get_target
from torchneuron.hardware import timeline as device_timeline
from torchneuron.runtime import _C as fast

ENV = "TORCHNEURON_SERVING_TIMING_DIR"
FILE = "requests.jsonl"
WINDOW_STEPS = 16  # the most steps one reading of the clock (and one record per request) covers


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
class _Window:
    """Steps that schedule the same requests, read as one: since `start` (device clock)."""

    start: float
    ids: set[str]
    decoding: bool  # every request had its first token at the start: later steps may join
    # per request that may stop on a token: (its runner state, token count cap, stop token ids)
    stops: list[tuple[Any, int, frozenset[int]]]
    always_ends: bool  # a request may stop at any step (stop strings, a pooling or unknown request)
    steps: int = 0


@dataclass
class StepTimer:
    """Charges each step's modeled time to its requests (driver worker only writes records).

    `states`: the model runner's request states by id (output token ids, sampling parameters),
    read when a window opens and when one of its steps ends; `max_model_len` caps every request."""

    device: torch.device
    states: Mapping[str, Any] = field(default_factory=dict)
    max_model_len: int | None = None
    requests: dict[str, RequestTime] = field(default_factory=dict)
    _file: Any = None
    _window: _Window | None = None
    _last_read: tuple[int, float] | None = None  # (timeline entries, clock) at the last reading

    def __post_init__(self) -> None:
        directory = settings.current().serving_timing_dir
        driver = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        if directory and os.path.isdir(directory) and driver:
            self._file = open(os.path.join(directory, FILE), "a", buffering=1)

    def _clock(self) -> float:
        """device_now, without draining the work log when nothing was charged or recorded since
        the last reading (a step's start right after the previous window's end): the clock has
        not moved then."""
        timeline = device_timeline.get_timeline(self.device.index or 0)
        last = self._last_read
        if last is not None and last[0] == timeline.entries and not fast.worklog_pending() and not eager.pending():
            return last[1]
        now = device_now(self.device)
        self._last_read = (timeline.entries, now)
        return now

    def begin(self, scheduler_output: Any) -> None:
        """A step starts: the requests it schedules. It joins the open window if that one decodes
        the same requests; otherwise the open window ends and a new one starts at the clock now."""
        for req_id in getattr(scheduler_output, "finished_req_ids", ()) or ():
            self.requests.pop(req_id, None)
        scheduled = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        speculative = bool(getattr(scheduler_output, "scheduled_spec_decode_tokens", None))
        window = self._window
        if window is not None:
            if window.decoding and not speculative and scheduled.keys() == window.ids:
                return
            self._close()
        if scheduled:
            self._window = self._open(scheduled, speculative)

    def end(self) -> None:
        """The step's tokens are sampled (the runner's states hold them): the window ends here if
        this step had a prefill, may have finished a request, or completes WINDOW_STEPS steps."""
        window = self._window
        if window is None:
            return
        window.steps += 1
        if not window.decoding or window.always_ends or window.steps >= WINDOW_STEPS or any(
                len(state.output_token_ids) >= cap or state.output_token_ids[-1] in stops
                for state, cap, stops in window.stops):
            self._close()

    def _open(self, scheduled: Mapping[str, int], speculative: bool) -> _Window:
        records = self.requests
        decoding, always_ends, stops = not speculative, False, []
        for req_id in scheduled:
            record = records.get(req_id)
            if record is None:
                record = records[req_id] = RequestTime()
            if record.output_tokens == 0:
                decoding = False
            state = self.states.get(req_id)
            params = getattr(state, "sampling_params", None)
            if params is None or params.stop or getattr(params, "repetition_detection", None) is not None:
                always_ends = True
                continue
            cap = self.max_model_len - state.num_prompt_tokens if self.max_model_len else 1 << 62
            if params.max_tokens is not None:
                cap = min(cap, params.max_tokens)
            stop_ids = frozenset(params.stop_token_ids or ()) | (
                frozenset() if params.eos_token_id is None else {params.eos_token_id})
            stops.append((state, cap, stop_ids))
        return _Window(self._clock(), set(scheduled), decoding, stops, always_ends)

    def _close(self) -> None:
        """Charges the open window's time to its requests and writes their records."""
        window, self._window = self._window, None
        duration = self._clock() - window.start
        records = self.requests
        for req_id in window.ids:
            record = records.get(req_id)
            if record is None:  # finished before the window was read
                continue
            if record.output_tokens == 0:
                record.ttft_s += duration
            else:
                record.decode_s += duration
            state = self.states.get(req_id)
            if state is not None:
                record.output_tokens = len(state.output_token_ids)
            record.steps += window.steps
        if self._file is not None:
            target = json.dumps(get_target().name)
            self._file.write("".join(_line(req_id, target, records[req_id]) for req_id in window.ids
                                     if req_id in records))


def _line(req_id: str, target: str, record: RequestTime) -> str:
    """One request's record as a JSON line (`target` already JSON), formatted directly: the worker
    writes one per request per window."""
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
