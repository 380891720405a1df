"""torchneuron.compiler: the torch.compile backend `neuron`.

    model = torch.compile(model, backend="neuron")          # or:
    torch.compiler.set_default_backend("neuron"); model.compile()

`register()` (called when torchneuron is imported, so with `import torch`) makes the name
known without importing Dynamo: it registers the backend and the Dynamo device interface
when `torch._dynamo` is first imported, and lets FlexAttention accept neuron tensors when
`torch.nn.attention.flex_attention` is. Inductor's code generation for the device is
registered on first use of the backend (`register_inductor()`). See backend.py for the
pipeline and config.py for the environment variables. A graph's first calls run with ATen
kernels while its C++ builds in the background (tiered.py; `wait_for_builds()`, `build_stats()`).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings
from typing import Any, Callable

__all__ = ["NeuronCompileError", "build_stats", "neuron_backend", "register", "register_inductor", "wait_for_builds"]


def neuron_backend(gm: Any, example_inputs: list[Any], **kwargs: Any) -> Callable[..., Any]:
    """The `neuron` torch.compile backend (imports the compiler on first use)."""
    from torchneuron.compiler.backend import neuron_backend as compile_graph

    return compile_graph(gm, example_inputs, **kwargs)


def wait_for_builds(timeout: float | None = None) -> bool:
    """Waits for the compiled graphs' C++ kernels building in the background (tiered mode,
    TORCHNEURON_COMPILE_TIERED); False if `timeout` seconds passed first."""
    from torchneuron.compiler import tiered

    return tiered.wait(timeout)


def build_stats() -> dict[str, float]:
    """Tiered execution's counters: builds, their seconds, ATen-tier calls, switches (tiered.stats)."""
    from torchneuron.compiler import tiered

    return tiered.stats()


def __getattr__(name: str) -> Any:
    if name == "NeuronCompileError":
        from torchneuron.compiler.errors import NeuronCompileError

        return NeuronCompileError
    raise AttributeError(name)


def _register_dynamo() -> None:
    from torch._dynamo.backends.registry import _COMPILER_FNS, register_backend

    from torchneuron.compiler import device_interface

    if "neuron" not in _COMPILER_FNS:
        register_backend(neuron_backend, name="neuron")
    device_interface.register()


def register_inductor() -> None:
    """Registers Inductor's C++ code generation and the graph pipeline for "neuron" (idempotent)."""
    from torchneuron.compiler.registration import register_inductor as register_codegen

    _register_dynamo()
    register_codegen()


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `callback` once, right after module `name` has been imported."""

    def __init__(self, name: str, callback: Callable[[], None]) -> None:
        self.name, self.callback, self.loader = name, callback, None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self.loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        try:
            self.callback()
        except Exception as error:  # never break `import torch._dynamo`
            warnings.warn(f"torchneuron could not register the 'neuron' torch.compile backend: {error}")


_hooked = False


def _compile_fused_run(replay: Callable[..., None], example_inputs: list[Any], n_inputs: int,
                       float_hints: tuple[float, ...] = ()) -> Callable[[list], Any]:
    from torchneuron.compiler.eager_kernels import compile_replay

    return compile_replay(replay, example_inputs, n_inputs, float_hints)


def _enable_flex_attention() -> None:
    from torchneuron.compiler import flex_attention

    flex_attention.enable()


def _after_import(name: str, callback: Callable[[], None]) -> None:
    if name in sys.modules:
        callback()
    else:
        sys.meta_path.insert(0, _AfterImport(name, callback))


def register() -> None:
    """Makes `backend="neuron"` resolvable by torch.compile without importing Dynamo now, and
    gives adaptive eager mode its kernel compiler."""
    global _hooked
    from torchneuron import eager

    eager.set_kernel_compiler(_compile_fused_run)
    if _hooked:
        return
    _hooked = True
    _after_import("torch._dynamo", _register_dynamo)
    _after_import("torch.nn.attention.flex_attention", _enable_flex_attention)
