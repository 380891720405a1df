"""`NeuronCommunicator`: vLLM's device communicator over the `neuron` c10d backend.

vLLM creates each parallel group's device group with the platform's `dist_backend` ("neuron"),
so the base communicator's collectives (all-reduce, all-gather, reduce-scatter, gather,
broadcast, send/recv) already run on torchneuron's backend: on neuron tensors, charged to the
device timeline as NeuronLink/HBM transfers. This class only checks that the group really is
a neuron one, so a misconfigured run fails at start instead of silently reducing on the host.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase


class NeuronCommunicator(DeviceCommunicatorBase):
    def __init__(self, cpu_group: dist.ProcessGroup, device: torch.device | None = None,
                 device_group: dist.ProcessGroup | None = None, unique_name: str = "",
                 use_all2all: bool = False, **kwargs) -> None:
        super().__init__(cpu_group, device, device_group, unique_name, use_all2all=use_all2all, **kwargs)
        if self.world_size > 1 and device_group is not None and dist.get_backend(device_group) != "neuron":
            raise RuntimeError(f"vLLM's device group {unique_name!r} uses the {dist.get_backend(device_group)!r} "
                               "backend; the neuron platform needs 'neuron' (import torchneuron first).")
        if self.use_all2all:
            from vllm.distributed.device_communicators.all2all import AgRsAll2AllManager

            self.all2all_manager = AgRsAll2AllManager(self.cpu_group)
