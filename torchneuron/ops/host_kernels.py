"""Device kernels written in Python, for ops the host CPU has no kernel for (or not for a dtype).

The eager fallback runs an op as the CPU kernel on zero-copy CPU aliases of its arguments. A few
ops the NeuronCore runs have no such CPU kernel: integer `histc` (CUDA has one, the CPU does
not), `_scaled_grouped_mm`, `_scaled_mm_v2`'s block-scaled recipes. Their device kernels are
Python functions over host views registered as the ops' PrivateUse1 kernels. `device_kernel`
wraps such a function so it behaves as any device op does: queued work runs first (adaptive
eager), operands must share one neuron device, results land in fresh device memory, and the op
is charged to the device timeline once, priced by the performance model under its aten name
(so it runs on the modeled NeuronCore: not a CPU fallback, allowed in strict mode), unless the
work log is paused (inside a compiled graph, whose plan charges the op as one of its kernels).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import torch

from torchneuron.hardware.model import TensorSig, launch_cost, op_cost
from torchneuron.hardware.worklog import charge
from torchneuron.runtime import _C, host_view, worklog

__all__ = ["check_on_meta", "device_kernel", "register"]


def _neuron(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "neuron"


def _flatten(obj: Any) -> list[Any]:
    if isinstance(obj, (list, tuple)):
        return [y for x in obj for y in _flatten(x)]
    return [obj]


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(x, fn) for x in obj)
    return fn(obj)


def _sig(t: torch.Tensor) -> TensorSig:
    return t.dtype, tuple(t.shape)


def _meta(t: Any) -> Any:
    if not isinstance(t, torch.Tensor):
        return t
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def check_on_meta(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> None:
    """Runs `op`'s meta function on meta copies of the arguments, which raises PyTorch's own
    error for a bad signature (the checks CUDA's kernel makes)."""
    meta = [[_meta(x) for x in a] if isinstance(a, (list, tuple)) else _meta(a) for a in args]
    op(*meta, **{k: _meta(v) for k, v in kwargs.items()})


def device_kernel(op: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator: `fn(*args)` computing on CPU tensors becomes the neuron kernel of aten op `op`
    ("aten::histc"). The wrapped kernel maps neuron arguments to host views, runs `fn`, copies
    its tensor results to the arguments' device and charges `op_cost(op, inputs, outputs)`."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def kernel(*args: Any, **kwargs: Any) -> Any:
            tensors = [t for t in _flatten(list(args) + list(kwargs.values())) if isinstance(t, torch.Tensor)]
            devices = {t.device for t in tensors if _neuron(t)}
            if len(devices) > 1:
                a, b = sorted(map(str, devices))[:2]
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, {a} and {b}!")
            device = devices.pop()
            for t in tensors:
                if not _neuron(t) and t.dim() != 0:
                    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                       f"devices, {device} and {t.device}! ({op} on neuron)")
            if _C.adaptive_pending():
                _C.adaptive_flush()  # queued ops write memory this kernel reads
            to_host = lambda x: host_view(x) if _neuron(x) else x  # noqa: E731
            with torch.no_grad():
                result = fn(*_map(args, to_host), **{k: _map(v, to_host) for k, v in kwargs.items()})

            def to_device(o: Any) -> Any:
                if not isinstance(o, torch.Tensor):
                    return o
                d = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=device)
                with torch.no_grad():
                    host_view(d).copy_(o)
                return d

            out = _map(result, to_device)
            outs = [t for t in _flatten(out) if isinstance(t, torch.Tensor)]
            if worklog.is_enabled():  # paused: the op is part of work charged another way (a compiled plan)
                cost = op_cost(op, [_sig(t) for t in tensors if _neuron(t)], [_sig(t) for t in outs])
                charge(op, dataclasses.replace(cost, duration_s=cost.duration_s + launch_cost()), device=device.index)
            return out

        return kernel

    return wrap


_libraries: dict[str, torch.library.Library] = {}


def register(op: str, kernel: Callable[..., Any]) -> None:
    """Registers `kernel` as the PrivateUse1 kernel of `op` ("aten::histc", "aten::_grouped_mm")."""
    namespace, name = op.split("::", 1)
    if namespace not in _libraries:
        _libraries[namespace] = torch.library.Library(namespace, "IMPL")
    _libraries[namespace].impl(name, kernel, "PrivateUse1")
