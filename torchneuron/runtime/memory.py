"""Device memory API of torch.neuron: capacity, statistics, caching, summaries.

Statistics come from the C++ caching allocator through torch.accelerator's memory API, so
`torch.neuron.memory_allocated()` and `torch.accelerator.memory_allocated("neuron")` agree.
The capacity of each device defaults to the target's HBM per logical NeuronCore and can be
overridden with TORCHNEURON_MEMORY_CAPACITY (bytes, or a size such as "8GiB").
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from torchneuron import settings
from torchneuron.runtime.device import device_count, device_index
from torchneuron.runtime.extension import runtime_ops


def configure_capacity(default_nbytes: int) -> None:
    """Sets every device's capacity from TORCHNEURON_MEMORY_CAPACITY, else to `default_nbytes`."""
    override = settings.current().memory_capacity
    nbytes = override if override is not None else int(default_nbytes)
    for index in range(device_count()):
        runtime_ops().set_memory_capacity(index, nbytes)


def set_capacity(nbytes: int, device: Any = None) -> None:
    """Changes the modeled HBM capacity of one device (all devices when device is "all")."""
    indices = range(device_count()) if device == "all" else [device_index(device)]
    for index in indices:
        runtime_ops().set_memory_capacity(index, int(nbytes))


def capacity(device: Any = None) -> int:
    return int(runtime_ops().memory_capacity(device_index(device)))


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    """Limits this process to `fraction` (0 to 1) of the device's capacity, as torch.cuda's: an
    allocation that would reserve more raises torch.OutOfMemoryError (after freeing the cache)."""
    if not isinstance(fraction, (float, int)) or isinstance(fraction, bool):
        raise TypeError(f"Invalid type for fraction argument: {type(fraction).__name__}, must be a float")
    runtime_ops().set_memory_fraction(device_index(device), float(fraction))


def get_per_process_memory_fraction(device: Any = None) -> float:
    """The share of the device's capacity this process may reserve (1.0 unless set)."""
    return float(runtime_ops().memory_fraction(device_index(device)))


def _dev(device: Any) -> torch.device:
    return torch.device("neuron", device_index(device))


def memory_stats(device: Any = None) -> "OrderedDict[str, Any]":
    return torch.accelerator.memory_stats(_dev(device))


def memory_allocated(device: Any = None) -> int:
    return torch.accelerator.memory_allocated(_dev(device))


def max_memory_allocated(device: Any = None) -> int:
    return torch.accelerator.max_memory_allocated(_dev(device))


def memory_reserved(device: Any = None) -> int:
    return torch.accelerator.memory_reserved(_dev(device))


def max_memory_reserved(device: Any = None) -> int:
    return torch.accelerator.max_memory_reserved(_dev(device))


def reset_peak_memory_stats(device: Any = None) -> None:
    torch.accelerator.reset_peak_memory_stats(_dev(device))


def reset_accumulated_memory_stats(device: Any = None) -> None:
    torch.accelerator.reset_accumulated_memory_stats(_dev(device))


def reset_max_memory_allocated(device: Any = None) -> None:
    """torch.cuda's older name: resets the peak of allocated memory (now all peaks, as CUDA does)."""
    reset_peak_memory_stats(device)


def ipc_collect() -> None:
    """torch.cuda.ipc_collect frees memory other processes released after receiving it over IPC; neuron
    memory is never shared between processes that way (tensors sent to other processes are copied), so
    there is nothing left to collect."""


def empty_cache() -> None:
    torch.accelerator.empty_cache()


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(free, total) bytes of the device's modeled HBM."""
    return torch.accelerator.get_memory_info(_dev(device))


def _fmt(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.2f} GiB"


def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
    """A human-readable table of the allocator statistics of one device."""
    index = device_index(device)
    stats = memory_stats(index)
    rows = [
        ("Allocated memory", "allocated_bytes.all", _fmt),
        ("Active memory", "active_bytes.all", _fmt),
        ("Requested memory", "requested_bytes.all", _fmt),
        ("Reserved memory", "reserved_bytes.all", _fmt),
        ("Allocations", "allocation.all", str),
        ("Active allocs", "active.all", str),
        ("Reserved segments", "segment.all", str),
    ]
    width = 75
    lines = ["=" * width, f" Neuron memory summary, device neuron:{index} (capacity {_fmt(capacity(index))})",
             "-" * width, f" {'Metric':<22}|{'Cur Usage':>12} |{'Peak Usage':>12} |{'Tot Alloc':>12} |{'Tot Freed':>12}",
             "-" * width]
    for label, key, fmt in rows:
        cells = [fmt(stats.get(f"{key}.{kind}", 0)) for kind in ("current", "peak", "allocated", "freed")]
        lines.append(f" {label:<22}|" + "|".join(f"{c:>12} " for c in cells))
    if not abbreviated:
        lines.append("-" * width)
        lines.append(f" Cached free blocks: {_fmt(runtime_ops().cached_bytes(index))}   "
                     f"Out-of-memory errors: {stats.get('num_ooms', 0)}   Retries: {stats.get('num_alloc_retries', 0)}")
    lines.append("=" * width)
    return "\n".join(lines)
