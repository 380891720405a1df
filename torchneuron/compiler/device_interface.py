"""Dynamo's DeviceInterface for the `neuron` device.

Dynamo and Inductor reach a device's runtime (current device, streams, synchronisation,
properties) through `torch._dynamo.device_interface`; this module owns that adapter, which
forwards to `torch.neuron`. `get_device_properties()` returns the runtime's
`NeuronDeviceProperties`, whose `multi_processor_count` Inductor reads for its heuristics.
"""
from __future__ import annotations

from typing import Any

import torch
from torch._dynamo.device_interface import DeviceInterface, register_interface_for_device


def _neuron() -> Any:
    return torch.neuron  # type: ignore[attr-defined]


class NeuronInterface(DeviceInterface):
    """torch.neuron seen through Dynamo's device-agnostic runtime interface."""

    class device:  # noqa: N801  (Dynamo looks the context manager up under this name)
        def __new__(cls, device: torch.types.Device) -> Any:
            return _neuron().device(device)

    class Event(torch.Event):
        def __new__(cls, *args: Any, **kwargs: Any) -> torch.Event:
            return _neuron().Event(*args, **kwargs)

    class Stream(torch.Stream):
        def __new__(cls, *args: Any, **kwargs: Any) -> torch.Stream:
            return _neuron().Stream(*args, **kwargs)

    class Worker:
        @staticmethod
        def set_device(device: int) -> None:
            _neuron().set_device(device)

        @staticmethod
        def current_device() -> int:
            return _neuron().current_device()

        @staticmethod
        def get_device_properties(device: torch.types.Device = None) -> Any:
            return _neuron().get_device_properties(device)

    @staticmethod
    def current_device() -> int:
        return _neuron().current_device()

    @staticmethod
    def set_device(device: torch.types.Device) -> None:
        _neuron().set_device(device)

    @staticmethod
    def maybe_exchange_device(device: int) -> int:
        previous = _neuron().current_device()
        if device >= 0 and device != previous:
            _neuron().set_device(device)
        return previous

    exchange_device = maybe_exchange_device

    @staticmethod
    def device_count() -> int:
        return _neuron().device_count()

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def stream(stream: torch.Stream) -> Any:
        return _neuron().stream(stream)

    @staticmethod
    def current_stream() -> torch.Stream:
        return _neuron().current_stream()

    @staticmethod
    def set_stream(stream: torch.Stream) -> None:
        _neuron().set_stream(stream)

    @staticmethod
    def _set_stream_by_id(stream_id: int, device_index: int, device_type: int) -> None:
        _neuron().set_stream(torch.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type))

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        return int(_neuron().current_stream(device_idx).stream_id)

    @staticmethod
    def synchronize(device: torch.types.Device = None) -> None:
        _neuron().synchronize(device)

    @staticmethod
    def get_compute_capability(device: torch.types.Device = None) -> str:
        return _neuron().get_device_properties(device).core_type

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True

    @staticmethod
    def memory_allocated(device: torch.types.Device = None) -> int:
        return _neuron().memory_allocated(device)

    @staticmethod
    def is_triton_capable(device: torch.types.Device = None) -> bool:
        return False


def register() -> None:
    """Makes Dynamo and Inductor find `NeuronInterface` for "neuron" and "neuron:N"."""
    register_interface_for_device("neuron", NeuronInterface)
    for index in range(_neuron().device_count()):
        register_interface_for_device(f"neuron:{index}", NeuronInterface)
