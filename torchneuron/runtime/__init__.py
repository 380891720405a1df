"""The software NeuronCore runtime: devices, memory, streams, events, generators.

`register()` loads the C++ library and makes `neuron` a PyTorch device: renames PrivateUse1 and
generates tensor/module/storage methods (`.neuron()`, `.is_neuron`). The floors above connect
the rest (torchneuron/__init__.py): the hardware prices the work log, the ops install the
CPU-fallback policy, the package installs `torch.neuron`.
"""
from __future__ import annotations

import torch

from torchneuron.runtime import autograd_threads
from torchneuron.runtime.extension import load_runtime_library, runtime_ops

_registered = False


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A zero-copy CPU tensor over a neuron tensor's bytes (keeps the device memory alive)."""
    with torch.no_grad():
        return runtime_ops().host_view(tensor)


def register() -> None:
    """Makes `neuron` a PyTorch device (idempotent)."""
    global _registered
    if _registered:
        return
    load_runtime_library()
    torch.utils.rename_privateuse1_backend("neuron")
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
    autograd_threads.install()  # backward passes on neuron run on the calling thread (not process-wide)
    _registered = True
