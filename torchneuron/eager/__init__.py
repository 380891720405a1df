"""torchneuron.eager: adaptive eager mode.

    torchneuron.eager.set_eager_mode("adaptive")   # or TORCHNEURON_EAGER_MODE=adaptive

Eager ops on neuron tensors are queued instead of run one by one; at a flush, runs
of queued ops are fused by heuristics and dispatched as one kernel each, compiled once and
cached by their signature (queue_fusion.py). Results (bit for bit), stream order, random numbers and
aliasing are plain eager's: a fused program generates code only for ops whose generated code
rounds as the eager kernel does, and calls the eager kernel for the others (transcendentals,
reductions, norms; torchneuron/compiler/eager_numerics.py). Reading data on the host (`item`,
`.cpu()`, printing), an NKI kernel, a collective or any op that cannot wait flushes the queue
first, and so do `flush()` and the device timeline's readers. Off under
`torch.use_deterministic_algorithms(True)`.

The queue is C++, inside the device's fallback (eager/csrc/queue.cpp: about a microsecond
per op); queue.py and queue_fusion.py are its Python side, called once per new op and once per new
sequence of queued ops. The mode is on for the thread that enables it (the thread autograd's
backward runs on, as the runtime keeps autograd single-threaded). Fused kernels are compiled by
the function registered with `set_kernel_compiler` (the compiler package registers Inductor's).
"""
from __future__ import annotations

import contextlib
from typing import Iterator

from torchneuron import settings
from torchneuron.ops import printing
from torchneuron.eager.queue_fusion import Executor, KernelCompiler
from torchneuron.eager.queue import flush_records, queue_kind
from torchneuron.runtime import _C as fast  # the runtime's entry points for per-op Python code

__all__ = ["flush", "forget_programs", "get_eager_mode", "pending", "set_eager_mode", "set_kernel_compiler", "stats", "suspended"]

MODES = ("eager", "adaptive")
_executor = Executor()
_enabled = False
_planned_for: Executor | None = None  # the executor the C++ queue's cached plans call into


def set_kernel_compiler(compiler: KernelCompiler | None) -> None:
    """Registers `compiler(fn, example_inputs, n_inputs) -> runner`, which compiles a replay
    function of a run of queued ops (its first `n_inputs` tensors are the run's inputs, the rest
    the output buffers it writes) into a fused program called as `runner(list_of_tensors)`."""
    _executor.compiler = compiler


def set_eager_mode(mode: str) -> None:
    """"adaptive" queues and fuses eager ops on neuron tensors; "eager" runs them one by one."""
    global _enabled, _planned_for
    if mode not in MODES:
        raise ValueError(f"unknown eager mode {mode!r}; expected one of {', '.join(MODES)}")
    if mode == "adaptive" and not _enabled:
        _install_hooks()
        if _planned_for is not _executor:  # plans call into an executor's kernels
            fast.adaptive_forget_plans()
            _planned_for = _executor
        fast.adaptive_enable(True)
        _enabled = True
        _flush_before_printing(True)
    elif mode == "eager" and _enabled:
        fast.adaptive_enable(False)  # flushes first
        _enabled = False
        _flush_before_printing(False)


def get_eager_mode() -> str:
    return "adaptive" if _enabled else "eager"


def flush() -> None:
    """Runs every queued op now (a no-op in eager mode)."""
    if _enabled:
        fast.adaptive_flush()


def pending() -> int:
    """How many ops (and views of queued results) wait in the queue."""
    return fast.adaptive_pending() if _enabled else 0


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Flushes the queue and lets ops run unqueued inside (for code reading device memory
    directly, such as compiled graphs)."""
    if not _enabled:
        yield
        return
    prior = fast.adaptive_suspend(True)
    try:
        yield
    finally:
        fast.adaptive_suspend(prior)


def stats() -> dict[str, int]:
    """Counters: ops queued and unqueued, flushes (and how many a cached plan ran), fused runs and
    ops, eager ops, compiles."""
    result = dict(_executor.stats)
    for name, value in fast.adaptive_stats().items():
        result[name] = result.get(name, 0) + value
    return result


def forget_programs() -> None:
    """Forgets every fused program and cached plan (the next runs are seen, and compiled, anew):
    for measuring warm-up from cold."""
    flush()
    _executor.sequences.clear()
    _executor.volatile.clear()
    fast.adaptive_forget_plans()


def _flush_records(records: list) -> tuple[list, bool]:
    return flush_records(_executor, records)


_hooks_installed = False


def _install_hooks() -> None:
    """The C++ queue's Python side, and readers of the device timeline (estimate(), elapsed times)
    flush the queue first."""
    global _hooks_installed
    if _hooks_installed:
        return
    fast.adaptive_set_callbacks(queue_kind, _flush_records)
    from torchneuron.hardware import timeline

    add = getattr(timeline, "add_pending_source", None)
    if add is not None:
        add(_flush_and_drain)
    _hooks_installed = True


def _flush_and_drain() -> None:
    if _enabled and fast.adaptive_pending():
        from torchneuron.hardware.worklog import drain

        flush()
        drain()


def _flush_before_printing(on: bool) -> None:
    """Printing a tensor flushes the queue before formatting starts (its reads would flush it
    anyway, op by op)."""
    if on:
        printing.add_before_print(flush)
    else:
        printing.remove_before_print(flush)


def configure_from_env() -> None:
    """Applies TORCHNEURON_EAGER_MODE (eager | adaptive)."""
    mode = settings.current().eager_mode
    if mode:
        set_eager_mode(mode)
