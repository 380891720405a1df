"""PyTorch bridge: NKI kernels on `neuron` tensors, as torch custom ops, with autograd.

Owns
- `call_on_device`: a `@nki.jit` kernel called with neuron tensors runs on their CPU views
  and its modeled latency is charged to the device timeline;
- `nki_op`: registers a kernel as a `torch.library` custom op with a fake (meta)
  implementation, so it works in eager mode and under `torch.compile`;
- `register_autograd` for a backward kernel.
"""
from __future__ import annotations

from typing import Any


def _is_neuron(x: Any) -> bool:
    import torch
    return isinstance(x, torch.Tensor) and x.device.type == "neuron"


def has_neuron_tensors(args: tuple, kwargs: dict) -> bool:
    return any(_is_neuron(a) for a in args) or any(_is_neuron(v) for v in kwargs.values())


def call_on_device(kernel, args: tuple, kwargs: dict) -> Any:
    raise NotImplementedError("the neuron device is not available yet")
