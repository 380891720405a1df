"""Streams and events of the `neuron` device (torch.neuron.Stream, Event, stream(), ...).

They are PyTorch's generic torch.Stream / torch.Event bound to the neuron device guard: ops go to
the calling thread's current stream, waits and records are logged in order, and the device
timeline turns them into modeled device time (Event.elapsed_time returns modeled milliseconds).
Host execution is synchronous, so queries are always complete on the host side.
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron.runtime.device import device_index


class Stream(torch.Stream):
    """A neuron stream: a queue on one device's timeline (like torch.cuda.Stream)."""

    def __new__(cls, device: Any = None, priority: int = 0, **kwargs: Any) -> "Stream":
        if "stream_id" in kwargs:  # re-wrapping an existing stream
            return super().__new__(cls, priority=priority, **kwargs)
        return super().__new__(cls, device=torch.device("neuron", device_index(device)), priority=priority)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, torch.Stream) and (self.device, self.stream_id) == (other.device, other.stream_id)

    def __hash__(self) -> int:
        return hash((self.device, self.stream_id))

    def __repr__(self) -> str:
        return f"<torch.neuron.Stream device={self.device} stream_id={self.stream_id}>"


class _NeuronEventType(type):
    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, torch.Event) and obj.device.type == "neuron"


class Event(metaclass=_NeuronEventType):
    """A neuron event: a point on a stream of the device timeline (like torch.cuda.Event).

    Instances are plain torch.Event objects on a neuron device (torch's C++ methods accept only
    that exact type); `isinstance(e, torch.neuron.Event)` holds for them.
    """

    def __new__(cls, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                device: Any = None) -> torch.Event:
        return torch.Event(device=torch.device("neuron", device_index(device)), enable_timing=enable_timing,
                           blocking=blocking, interprocess=interprocess)


def _wrap(stream: torch.Stream) -> Stream:
    return Stream(stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type)


def current_stream(device: Any = None) -> Stream:
    return _wrap(torch.accelerator.current_stream(torch.device("neuron", device_index(device))))


def default_stream(device: Any = None) -> Stream:
    current = torch.accelerator.current_stream(torch.device("neuron", device_index(device)))
    return Stream(stream_id=0, device_index=current.device_index, device_type=current.device_type)


def set_stream(stream: torch.Stream) -> None:
    torch.accelerator.set_stream(stream)


class StreamContext:
    """Makes `stream` current on its device for the block (and its device current), then restores."""

    def __init__(self, stream: torch.Stream | None):
        self.stream = stream
        self.previous: torch.Stream | None = None
        self.previous_device = -1

    def __enter__(self):
        if self.stream is None:
            return self
        from torchneuron.runtime.device import current_device, set_device

        self.previous_device = current_device()
        set_device(self.stream.device_index)
        self.previous = torch.accelerator.current_stream(self.stream.device)
        torch.accelerator.set_stream(self.stream)
        return self

    def __exit__(self, *exc):
        if self.stream is None:
            return False
        from torchneuron.runtime.device import set_device

        torch.accelerator.set_stream(self.previous)
        set_device(self.previous_device)
        return False


def is_current_stream_capturing() -> bool:
    """Whether the current stream is capturing a graph (CUDA graphs): neuron has no graph capture, so never."""
    return False


def stream(stream: torch.Stream | None) -> StreamContext:
    """Context manager selecting `stream` (None: no change), like torch.cuda.stream."""
    return StreamContext(stream)
