"""Device selection of the `neuron` device (torch.neuron.* functions); hardware/properties.py
gives the properties.

Logical devices are NeuronCores of the chosen target (`TORCHNEURON_TARGET`); their number comes
from `TORCHNEURON_DEVICE_COUNT` (default 2), read once when the runtime library loads.
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron.runtime.extension import ops

def is_available() -> bool:
    """The software NeuronCore is always available."""
    return True


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return int(ops().device_count())


def current_device() -> int:
    return int(ops().current_device())


def device_index(device: Any = None, optional: bool = True) -> int:
    """Index of `device` (an int, "neuron:1", torch.device or None = the current device)."""
    if device is None:
        return current_device()
    if isinstance(device, int):
        index = device
    else:
        device = torch.device(device)
        if device.type != "neuron":
            raise ValueError(f"Expected a neuron device, got {device}")
        if device.index is None:
            return current_device()
        index = device.index
    if not 0 <= index < device_count():
        raise IndexError(
            f"Invalid device index neuron:{index}: this process has {device_count()} neuron device(s) "
            "(set TORCHNEURON_DEVICE_COUNT before importing torch to change it)."
        )
    return index


def set_device(device: Any) -> None:
    ops().set_device(device_index(device))


class device:
    """Context manager that changes the current neuron device (like torch.cuda.device)."""

    def __init__(self, device: Any):
        self.index = -1 if device is None else device_index(device)
        self.previous = -1

    def __enter__(self):
        if self.index >= 0:
            self.previous = current_device()
            set_device(self.index)
        return self

    def __exit__(self, *exc):
        if self.previous >= 0:
            set_device(self.previous)
        return False


class device_of(device):
    """Context manager that makes the device of tensor `obj` current."""

    def __init__(self, obj: torch.Tensor):
        super().__init__(obj.get_device() if obj.device.type == "neuron" else None)


def synchronize(device: Any = None) -> None:
    """Waits for all work on the device (joins the device timeline's streams)."""
    torch.accelerator.synchronize(torch.device("neuron", device_index(device)))


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]
