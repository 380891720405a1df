"""The `torch.neuron` module: everything torch.cuda users reach for, for the neuron device.

Assembled from the runtime (devices, memory, streams, generators), the hardware (the properties
of the modeled target) and the ops (the CPU-fallback counters and strict mode).
"""
from __future__ import annotations

from torchneuron.hardware.properties import (
    NeuronDeviceProperties, get_device_capability, get_device_name, get_device_properties,
)
from torchneuron.ops.policy import fallback_counts, is_strict, reset_fallback_counts, set_strict
from torchneuron.runtime.device import (
    _is_in_bad_fork, current_device, device, device_count, device_of, get_amp_supported_dtype, is_available,
    is_initialized, set_device, synchronize,
)
from torchneuron.runtime.memory import (
    empty_cache, max_memory_allocated, max_memory_reserved, mem_get_info, memory_allocated, memory_reserved,
    memory_stats, memory_summary, reset_accumulated_memory_stats, reset_peak_memory_stats,
)
from torchneuron.runtime.random import (
    get_rng_state, get_rng_state_all, initial_seed, manual_seed, manual_seed_all, seed, seed_all,
    set_rng_state, set_rng_state_all,
)
from torchneuron.runtime.streams import Event, Stream, StreamContext, current_stream, default_stream, set_stream, stream


def init() -> None:
    """Nothing to initialise lazily: the runtime is ready once torchneuron is imported."""


# torch.cuda's flag, read by torch.utils.checkpoint: only an initialised device gets its RNG state
# stashed and restored around a recomputation (so dropout draws the forward's mask again).
_initialized = True


__all__ = [
    "Event", "NeuronDeviceProperties", "Stream", "StreamContext", "current_device", "current_stream",
    "default_stream", "device", "device_count", "device_of", "empty_cache", "fallback_counts",
    "get_amp_supported_dtype", "get_device_capability", "get_device_name", "get_device_properties",
    "get_rng_state", "get_rng_state_all", "init", "initial_seed", "is_available", "is_initialized", "is_strict",
    "manual_seed", "manual_seed_all", "max_memory_allocated", "max_memory_reserved", "mem_get_info",
    "memory_allocated", "memory_reserved", "memory_stats", "memory_summary", "reset_accumulated_memory_stats",
    "reset_fallback_counts", "reset_peak_memory_stats", "seed", "seed_all", "set_device", "set_rng_state",
    "set_rng_state_all", "set_stream", "set_strict", "stream", "synchronize", "_is_in_bad_fork",
]
