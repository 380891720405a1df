"""The memory format of convolutions on neuron, as the CPU's: what eager kernels return and what
fake tensors (torch.compile, export) predict must agree.

A neuron convolution runs the CPU's kernel on the host and returns its results as that kernel lays
them out (runtime/csrc/kernels.cpp): channels_last for channels_last inputs or weights, as on the
CPU and on CUDA. PyTorch's fake tensors predict a convolution's layout from the backend
`torch._C._select_conv_backend` picks; for neuron tensors that is the device's own
("Overrideable") convolution, whose predicted layout is always contiguous, so compiled code would
index the eager kernel's channels_last results wrongly. `install()` makes the selection
(`_select_conv_backend`) and the layout rule (`_conv_determine_backend_memory_format`, whose CPU
rules check the device) answer for neuron tensors as for CPU tensors of the same geometry, dtype
and parameters, so the prediction is the CPU kernel's layout by construction.
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import _disable_current_modes

_select = torch._C._select_conv_backend
_determine = torch._C._conv_determine_backend_memory_format


def _hint(n) -> int:
    return n if isinstance(n, int) else int(n.node.hint)


def _cpu_standin(t):
    """An uninitialised CPU tensor of t's geometry and dtype (backend selection reads only those)."""
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided([_hint(s) for s in t.shape], [_hint(s) for s in t.stride()], dtype=t.dtype)


def _as_on_cpu(fn):
    """fn(input, weight, ...), called with CPU stand-ins of its tensors when `input` is on neuron."""

    def wrapper(input, weight, *args, **kwargs):
        if isinstance(input, torch.Tensor) and input.device.type == "neuron":
            with _disable_current_modes():
                args = tuple(_cpu_standin(a) for a in args)
                kwargs = {k: _cpu_standin(v) for k, v in kwargs.items()}
                return fn(_cpu_standin(input), _cpu_standin(weight), *args, **kwargs)
        return fn(input, weight, *args, **kwargs)

    wrapper.__name__ = wrapper.__qualname__ = fn.__name__
    wrapper.__doc__ = f"torch._C.{fn.__name__}, answering for neuron tensors what it answers for the CPU."
    return wrapper


def install() -> None:
    torch._C._select_conv_backend = _as_on_cpu(_select)
    torch._C._conv_determine_backend_memory_format = _as_on_cpu(_determine)
