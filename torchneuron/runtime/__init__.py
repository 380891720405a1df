"""The software NeuronCore runtime: devices, memory, streams, events, generators.

`register()` loads the C++ library and makes `neuron` a PyTorch device: renames PrivateUse1,
installs `torch.neuron`, generates tensor/module/storage methods (`.neuron()`, `.is_neuron`),
and connects the C++ hot path to its Python policy and device timeline.
"""
from __future__ import annotations

import os

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
    from torchneuron.ops import conv_layout, policy, printing
    from torchneuron.runtime import memory, worklog

    policy.install()
    conv_layout.install()
    printing.install()
    worklog.install()
    memory.configure_capacity()
    if os.environ.get("TORCHNEURON_AUTOGRAD_THREADS", "0") != "1":
        # The autograd engine runs a non-CPU device's backward on a worker thread of its own; for a
        # device whose kernels run on the host that hand-off costs 100-200 us a step and buys nothing.
        torch.autograd.set_multithreading_enabled(False)
    _registered = True
