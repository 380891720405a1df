"""Autograd's device worker threads, turned off for backward passes on neuron only.

PyTorch's autograd engine runs the backward functions of a non-CPU device on a worker thread of
that device, handing each over from the calling thread. For a device whose kernels run on the host
that hand-off buys nothing and costs 100-200 us a training step, so a backward pass rooted on neuron
tensors (`loss.backward()`, `torch.autograd.grad` of neuron outputs) runs on the calling thread.
The switch is autograd's own (`torch.autograd.set_multithreading_enabled`), set for that pass alone:
every other backward pass (CUDA, CPU) keeps the engine's default. `TORCHNEURON_AUTOGRAD_THREADS=1`
keeps the worker threads for neuron too.

Both `torch.autograd.backward` and `torch.autograd.grad` start the engine through
`torch.autograd._engine_run_backward`; `install()` wraps that function.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from torchneuron import settings

_installed = False


def _rooted_on_neuron(outputs: Sequence[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == "neuron" for t in outputs)


def _scoped(run_backward: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(run_backward)
    def run(t_outputs: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
        if not _rooted_on_neuron(t_outputs) or not torch._C._is_multithreading_enabled():
            return run_backward(t_outputs, *args, **kwargs)
        torch._C._set_multithreading_enabled(False)
        try:
            return run_backward(t_outputs, *args, **kwargs)
        finally:
            torch._C._set_multithreading_enabled(True)

    run.__torchneuron_scoped__ = True
    return run


def install() -> None:
    """Runs backward passes rooted on neuron tensors without worker threads (idempotent)."""
    global _installed
    if _installed or settings.current().autograd_threads:
        return
    original = torch.autograd._engine_run_backward
    if not getattr(original, "__torchneuron_scoped__", False):
        torch.autograd._engine_run_backward = _scoped(original)
    _installed = True
