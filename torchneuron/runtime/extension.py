"""Loads the C++ runtime library (torchneuron/runtime/_C.so) into the process.

The library registers the `neuron` device's allocator, device guard, hooks, generators and the
eager fallback with PyTorch's dispatcher; once loaded, it is also importable as the module
`torchneuron.runtime._C` (fast entry points for generated code, csrc/python.cpp). It is built by `pip install --no-build-isolation -e .`
(or `python setup.py build_ext --inplace` in a checkout).
"""
from __future__ import annotations

import os

import torch

from torchneuron import settings

_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_C.so")
_loaded = False


def load_runtime_library() -> None:
    """Loads _C.so once; raises ImportError with the build command if it is missing."""
    global _loaded
    if _loaded:
        return
    if not os.path.exists(_LIBRARY):
        raise ImportError(
            f"torchneuron's C++ runtime is not built ({_LIBRARY} is missing). Build it with "
            "`pip install --no-build-isolation -e .` from the repository root (torch==2.13.0 must be "
            "installed first)."
        )
    torch.ops.load_library(_LIBRARY)
    _configure(settings.current())
    _loaded = True


def _configure(config: settings.Settings) -> None:
    """Hands the C++ runtime the settings it reads (it reads no environment itself)."""
    from torchneuron.runtime import _C

    _C.configure(device_count=config.device_count, plan_cache=not config.adaptive_no_plan_cache)
    runtime_ops().set_strict(config.strict)
    runtime_ops().set_worklog_enabled(config.timeline)


def runtime_ops() -> torch._ops._OpNamespace:
    """The `torch.ops.torchneuron` namespace: the ops the C++ library registers (device, memory,
    random state, work log, fallback counters)."""
    return torch.ops.torchneuron
