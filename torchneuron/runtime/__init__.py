"""The software NeuronCore runtime: devices, memory, streams, events, generators.

`register()` loads the C++ library and makes `neuron` a PyTorch device: renames PrivateUse1,
installs `torch.neuron`, generates tensor/module/storage methods (`.neuron()`, `.is_neuron`),
and connects the C++ hot path to its Python policy and device timeline.
"""
from __future__ import annotations

import torch

from torchneuron.runtime.extension import load_runtime_library, ops

_registered = False


def charge(name: str, cost, device: int | None = None, stream: int | None = None, meta: dict | None = None):
    """Charges a unit of device work (a hardware.model Cost) to the device timeline; see worklog.charge."""
    from torchneuron.runtime.worklog import charge as _charge

    return _charge(name, cost, device, stream, meta)


def host_view(tensor: torch.Tensor) -> torch.Tensor:
    """A zero-copy CPU tensor over a neuron tensor's bytes (keeps the device memory alive)."""
    with torch.no_grad():
        return ops().host_view(tensor)


def register() -> None:
    """Makes `neuron` a PyTorch device (idempotent)."""
    global _registered
    if _registered:
        return
    load_runtime_library()
    torch.utils.rename_privateuse1_backend("neuron")
    from torchneuron.runtime import neuron_module

    torch._register_device_module("neuron", neuron_module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
    from torchneuron.ops import policy, printing, sync_batch_norm
    from torchneuron.runtime import autograd_threads, memory, worklog

    policy.install()
    printing.install()
    sync_batch_norm.install()
    worklog.install()
    memory.configure_capacity()
    autograd_threads.install()  # backward passes on neuron run on the calling thread (not process-wide)
    _registered = True
