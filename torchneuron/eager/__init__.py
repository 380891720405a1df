"""torchneuron.eager: adaptive eager mode.

    torchneuron.eager.set_eager_mode("adaptive")   # or TORCHNEURON_EAGER_MODE=adaptive

Eager ops on neuron tensors are queued instead of run one by one (queue.py); at a flush, runs
of queued ops are fused by heuristics and dispatched as one kernel each, compiled once and
cached by their signature (fusion.py). Results, stream order, random numbers and aliasing are
plain eager's; reading data on the host (`item`, `.cpu()`, printing), an NKI kernel, a
collective or any op that cannot wait flushes the queue first, and so do `flush()` and the
device timeline's readers. Off under `torch.use_deterministic_algorithms(True)`.

The mode is installed on the thread that enables it (the thread autograd's backward runs on,
as the runtime keeps autograd single-threaded). Fused kernels are compiled by the function
registered with `set_kernel_compiler` (the compiler package registers Inductor's).
"""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

from torchneuron.eager.fusion import Executor, KernelCompiler

__all__ = ["flush", "get_eager_mode", "set_eager_mode", "set_kernel_compiler", "stats", "suspended"]

MODES = ("eager", "adaptive")
_executor = Executor()
_mode: Any = None  # the installed queue.AdaptiveMode, if any


def set_kernel_compiler(compiler: KernelCompiler | None) -> None:
    """Registers `compiler(fn, example_inputs, n_inputs) -> runner`, which compiles a replay
    function of a run of queued ops (its first `n_inputs` tensors are the run's inputs, the rest
    the output buffers it writes) into a fused program called as `runner(list_of_tensors)`."""
    _executor.compiler = compiler


def set_eager_mode(mode: str) -> None:
    """"adaptive" queues and fuses eager ops on neuron tensors; "eager" runs them one by one."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"unknown eager mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "adaptive" and _mode is None:
        from torchneuron.eager.queue import AdaptiveMode

        _mode = AdaptiveMode(_executor)
        _mode.__enter__()
        _register_flush_hook()
        _set_runtime_flush_hook(True)
        _flush_before_printing(True)
    elif mode == "eager" and _mode is not None:
        _mode.flush()
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        if _get_current_dispatch_mode() is not _mode:
            raise RuntimeError("set_eager_mode('eager'): another TorchDispatchMode was entered after adaptive "
                               "mode and is still active; exit it first.")
        _mode.__exit__(None, None, None)
        _mode = None
        _flush_before_printing(False)
        _set_runtime_flush_hook(False)


def get_eager_mode() -> str:
    return "adaptive" if _mode is not None else "eager"


def flush() -> None:
    """Runs every queued op now (a no-op in eager mode)."""
    if _mode is not None:
        _mode.flush()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Flushes the queue and lets ops run unqueued inside (for code reading device memory
    directly, such as compiled graphs)."""
    mode = _mode
    if mode is None or mode.flushing:
        yield
        return
    mode.flush()
    mode.flushing = True
    try:
        yield
    finally:
        mode.flushing = False


def stats() -> dict[str, int]:
    """Counters: ops queued and unqueued, flushes, fused runs and ops, eager ops, compiles."""
    result = dict(_executor.stats)
    if _mode is not None:
        result.update(_mode.stats)
    return result


def _flush_and_drain() -> None:
    if _mode is not None and _mode.entries:
        from torchneuron.runtime.worklog import drain

        _mode.flush()
        drain()


def _register_flush_hook() -> None:
    """Readers of the device timeline (estimate(), elapsed times) flush the queue first."""
    from torchneuron.hardware import timeline

    add = getattr(timeline, "add_pending_source", None)
    if add is not None:
        add(_flush_and_drain)


_runtime_hook_library: Any = None


def _set_runtime_flush_hook(on: bool) -> None:
    """Events, waits and synchronisations (C++ device guard) flush the queue first, so queued work
    is timed before them."""
    global _runtime_hook_library
    import torch

    if on and _runtime_hook_library is None:
        _runtime_hook_library = torch.library.Library("torchneuron", "IMPL")
        _runtime_hook_library.impl("_flush_queued_work", flush, "CompositeExplicitAutograd")
    torch.ops.torchneuron.set_flush_hook(on)


_original_str: Any = None


def _flush_before_printing(on: bool) -> None:
    """Tensor printing disables dispatch modes before reading values: flush the queue first."""
    global _original_str
    import torch._tensor_str as tensor_str

    if on and _original_str is None:
        _original_str = tensor_str._str

        def _str(self: Any, *args: Any, **kwargs: Any) -> str:
            flush()
            return _original_str(self, *args, **kwargs)

        tensor_str._str = _str
    elif not on and _original_str is not None:
        tensor_str._str, _original_str = _original_str, None


def configure_from_env() -> None:
    """Applies TORCHNEURON_EAGER_MODE (eager | adaptive)."""
    mode = os.environ.get("TORCHNEURON_EAGER_MODE", "").strip().lower()
    if mode:
        set_eager_mode(mode)
