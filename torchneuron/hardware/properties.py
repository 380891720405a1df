"""What a neuron device is, given the target it models: torch.neuron.get_device_properties() and
friends, and the devices' default memory capacity (the target's HBM per logical NeuronCore)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from torchneuron.hardware.targets import get_target
from torchneuron.runtime import memory
from torchneuron.runtime.device import device_index


@dataclass(frozen=True)
class NeuronDeviceProperties:
    """What torch.neuron.get_device_properties() reports (modelled on CUDA's property object)."""

    name: str
    target: str
    core_type: str
    total_memory: int
    cores_per_chip: int
    multi_processor_count: int  # engines per NeuronCore; Inductor reads this field
    peak_bf16_flops: float
    hbm_bandwidth: float

    def __repr__(self) -> str:
        return (
            f"NeuronDeviceProperties(name='{self.name}', target='{self.target}', core_type='{self.core_type}', "
            f"total_memory={self.total_memory // 2**20}MB, peak_bf16={self.peak_bf16_flops / 1e12:.1f}TFLOPS)"
        )


def get_device_properties(device: Any = None) -> NeuronDeviceProperties:
    index = device_index(device)
    target = get_target()
    return NeuronDeviceProperties(
        name=f"Software NeuronCore ({target.core_type}, {target.name})",
        target=target.name,
        core_type=target.core_type,
        total_memory=memory.capacity(index),
        cores_per_chip=target.cores_per_chip,
        multi_processor_count=5,
        peak_bf16_flops=target.peak_flops(torch.bfloat16),
        hbm_bandwidth=target.hbm_bytes_per_s,
    )


def get_device_name(device: Any = None) -> str:
    return get_device_properties(device).name


def get_device_capability(device: Any = None) -> tuple[int, int]:
    """(generation, 0): NeuronCore-v2 -> (2, 0), v3 -> (3, 0), v4 -> (4, 0)."""
    core = get_device_properties(device).core_type
    return int(core.rsplit("v", 1)[-1]), 0




def configure_memory_capacity() -> None:
    """Sizes every device's memory: TORCHNEURON_MEMORY_CAPACITY, else the target's HBM per core."""
    memory.configure_capacity(int(get_target().hbm_bytes))
