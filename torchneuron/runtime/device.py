"""Device selection of the `neuron` device (torch.neuron.* functions); hardware/properties.py
gives the properties.

Logical devices are NeuronCores of the chosen target (`TORCHNEURON_TARGET`); their number comes
from `TORCHNEURON_DEVICE_COUNT` (default 2), read once when the runtime library loads.

Initialisation is lazy, as CUDA's: PyTorch calls `_lazy_init` before the first tensor on the
device is made from Python. A process forked after that has inherited a device its parent owns
(on Trainium, the parent's NeuronCores and their runtime state): like CUDA, the child refuses to
initialise it again and says to use the 'spawn' start method. A child forked before any device
use initialises normally (DataLoader workers that never touch the device are unaffected).
"""
from __future__ import annotations

import os
import threading
from typing import Any

import torch

from torchneuron.runtime.extension import runtime_ops

_initialized = False
_in_bad_fork = False
_init_lock = threading.Lock()


def is_available() -> bool:
    """The software NeuronCore is always available."""
    return True


def _lazy_init() -> None:
    """Initialises the device for this process (PyTorch calls it before the first device use)."""
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if _initialized:
            return
        if _in_bad_fork:
            raise RuntimeError(
                "Cannot re-initialize neuron in forked subprocess. To use neuron with multiprocessing, you must "
                "use the 'spawn' start method (torch.multiprocessing.set_start_method('spawn') or "
                "multiprocessing.get_context('spawn')).")
        _initialized = True


def is_initialized() -> bool:
    """Whether this process has initialised the device (False in a child forked after its parent did)."""
    return _initialized and not _in_bad_fork


def _is_in_bad_fork() -> bool:
    return _in_bad_fork


def _after_fork_in_child() -> None:
    global _initialized, _in_bad_fork
    if _initialized:
        _initialized = False
        _in_bad_fork = True
        runtime_ops().require_device_init()


os.register_at_fork(after_in_child=_after_fork_in_child)


def device_count() -> int:
    return int(runtime_ops().device_count())


def current_device() -> int:
    return int(runtime_ops().current_device())


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
        raise RuntimeError(  # what CUDA raises for an ordinal past its devices (not a new exception type)
            f"Invalid device index neuron:{index}: device index is out of range, this process has "
            f"{device_count()} neuron device(s) (set TORCHNEURON_DEVICE_COUNT before importing torch to change it)."
        )
    return index


def set_device(device: Any) -> None:
    """Makes `device` current; like torch.cuda.set_device, this initialises the device (so DeviceMesh and
    other launch helpers see the choice as the user's and keep it)."""
    index = device_index(device)
    _lazy_init()
    runtime_ops().set_device(index)


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


def is_bf16_supported(including_emulation: bool = True) -> bool:
    """NeuronCores compute bfloat16 natively (their Tensor engine's main dtype), on every target."""
    return True


def is_tf32_supported() -> bool:
    """The Tensor engine takes TF32 operands on every target (shared/hardware.md)."""
    return True


def can_device_access_peer(device: Any, peer_device: Any) -> bool:
    """NeuronCores of one instance reach each other's memory (over the chip or NeuronLink)."""
    return device_index(device) != device_index(peer_device)


def _is_compiled() -> bool:
    """The device's runtime library is built and loaded (importing torchneuron loads it)."""
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    """The dtypes torch.autocast("neuron") casts to, in PyTorch's order (its warning lists them so)."""
    return [torch.float16, torch.bfloat16]
