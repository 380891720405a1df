"""The `torch.neuron` module: everything torch.cuda users reach for, for the neuron device.

Assembled from the runtime (devices, memory, streams, generators), the hardware (the properties
of the modeled target) and the ops (the CPU-fallback counters and strict mode).

Audited against the torch.cuda functions transformers, accelerate, vLLM, diffusers and torchao call
through a device module (`getattr(torch, device_type)`, `torch.get_device_module()`); what CUDA alone
has (CUDA graphs and memory pools, NVML utilisation and temperature, NVTX, cuBLAS handles, the
arch list of the build) is absent, so feature checks (`hasattr`) see it absent.
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron.hardware.properties import (
    NeuronDeviceProperties, get_device_capability, get_device_name, get_device_properties,
)
from torchneuron.ops.policy import fallback_counts, is_strict, reset_fallback_counts, set_strict
from torchneuron.runtime import device as _device
from torchneuron.runtime import memory, random  # noqa: F401  (torch.neuron.memory / .random, as torch.cuda's)
from torchneuron.runtime.device import (
    _is_compiled, _is_in_bad_fork, _lazy_init, can_device_access_peer, current_device, device, device_count,
    device_of, get_amp_supported_dtype, is_available, is_bf16_supported, is_initialized, is_tf32_supported,
    set_device, synchronize,
)
from torchneuron.runtime.memory import (
    empty_cache, get_per_process_memory_fraction, ipc_collect, max_memory_allocated, max_memory_reserved,
    mem_get_info, memory_allocated, memory_reserved, memory_stats, memory_summary, reset_accumulated_memory_stats,
    reset_max_memory_allocated, reset_peak_memory_stats, set_per_process_memory_fraction,
)
from torchneuron.runtime.random import (
    get_rng_state, get_rng_state_all, initial_seed, manual_seed, manual_seed_all, seed, seed_all,
    set_rng_state, set_rng_state_all,
)
from torchneuron.runtime.streams import (
    Event, Stream, StreamContext, current_stream, default_stream, is_current_stream_capturing, set_stream, stream,
)

OutOfMemoryError = torch.OutOfMemoryError  # what the device's allocator raises past its capacity


def init() -> None:
    """Initialises the device now (PyTorch does it lazily before the first device use)."""
    _lazy_init()


def __getattr__(name: str) -> Any:
    # torch.cuda's flag, read by torch.utils.checkpoint: only an initialised device gets its RNG state
    # stashed and restored around a recomputation (so dropout draws the forward's mask again).
    if name == "_initialized":
        return _device.is_initialized()
    raise AttributeError(f"module 'torch.neuron' has no attribute '{name}'")


__all__ = [
    "Event", "NeuronDeviceProperties", "OutOfMemoryError", "Stream", "StreamContext", "can_device_access_peer",
    "current_device", "current_stream", "default_stream", "device", "device_count", "device_of", "empty_cache",
    "fallback_counts", "get_amp_supported_dtype", "get_device_capability", "get_device_name",
    "get_device_properties", "get_per_process_memory_fraction", "get_rng_state", "get_rng_state_all", "init",
    "initial_seed", "ipc_collect",
    "is_available", "is_bf16_supported", "is_current_stream_capturing", "is_initialized", "is_strict",
    "is_tf32_supported", "manual_seed", "manual_seed_all", "max_memory_allocated", "max_memory_reserved",
    "mem_get_info", "memory", "memory_allocated", "memory_reserved", "memory_stats", "memory_summary", "random",
    "reset_accumulated_memory_stats", "reset_fallback_counts", "reset_max_memory_allocated",
    "reset_peak_memory_stats", "seed", "seed_all", "set_device", "set_rng_state", "set_rng_state_all",
    "set_per_process_memory_fraction", "set_stream", "set_strict", "stream", "synchronize", "_is_compiled",
    "_is_in_bad_fork", "_lazy_init",
]
