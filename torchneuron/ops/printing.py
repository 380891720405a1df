"""Printing a neuron tensor reads it on the host, as torch-neuronx does for XLA tensors.

PyTorch formats CUDA tensors with ops on the device (including float64 ones); on a NeuronCore
those would be CPU fallbacks, so the values are copied to the host once and formatted there. The
printed suffix still says device='neuron:N'. This module is the one place that patches
`torch._tensor_str`; other floors run code before a tensor is formatted through
`add_before_print` (adaptive eager flushes its queue there).
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch._tensor_str as tensor_str_module

_original_tensor_str = tensor_str_module._tensor_str
_original_str = tensor_str_module._str
_before_print: list[Callable[[], None]] = []


def _tensor_str(self: torch.Tensor, indent: int) -> str:
    if self.device.type == "neuron":
        self = self.cpu()
    return _original_tensor_str(self, indent)


def _str(self: torch.Tensor, *args: Any, **kwargs: Any) -> str:
    for hook in _before_print:
        hook()
    return _original_str(self, *args, **kwargs)


def add_before_print(fn: Callable[[], None]) -> None:
    """`fn()` runs each time a tensor is about to be formatted (str, repr, print)."""
    if fn not in _before_print:
        _before_print.append(fn)


def remove_before_print(fn: Callable[[], None]) -> None:
    if fn in _before_print:
        _before_print.remove(fn)


def install() -> None:
    tensor_str_module._tensor_str = _tensor_str
    tensor_str_module._str = _str
