"""Printing a neuron tensor reads it on the host, as torch-neuronx does for XLA tensors.

PyTorch formats CUDA tensors with ops on the device (including float64 ones); on a NeuronCore
those would be CPU fallbacks, so the values are copied to the host once and formatted there. The
printed suffix still says device='neuron:N'.
"""
from __future__ import annotations

import torch
import torch._tensor_str as tensor_str_module

_original_tensor_str = tensor_str_module._tensor_str


def _tensor_str(self: torch.Tensor, indent: int) -> str:
    if self.device.type == "neuron":
        self = self.cpu()
    return _original_tensor_str(self, indent)


def install() -> None:
    tensor_str_module._tensor_str = _tensor_str
