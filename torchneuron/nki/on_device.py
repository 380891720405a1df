"""A `@nki.jit` kernel called with neuron tensors: it runs on zero-copy CPU views of their device
memory, outputs land in new neuron tensors, and the kernel's modeled latency (plus one kernel
launch) is charged to the device timeline of that device."""
from __future__ import annotations

from typing import Any, Callable

import torch

from torchneuron.hardware.model import Cost, launch_cost
from torchneuron.hardware.worklog import charge
from torchneuron.runtime import host_view


def _is_neuron(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "neuron"


def has_neuron_tensors(args: tuple, kwargs: dict) -> bool:
    return any(_is_neuron(a) for a in args) or any(_is_neuron(v) for v in kwargs.values())


def _map(obj: Any, fn: Callable[[Any], Any]) -> Any:
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map(o, fn) for o in obj)
    if isinstance(obj, dict):
        return {k: _map(v, fn) for k, v in obj.items()}
    return fn(obj)


def call_on_device(kernel: Any, args: tuple, kwargs: dict, host: Callable | None = None,
                   timing: Callable[[], Any] | None = None) -> Any:
    """Run `kernel` on neuron tensors: simulate on their host views, charge the device. With
    `host`, compute `host(*args)` on the views instead and charge `timing()`'s KernelStats
    (the kernel's timing-only run): the fast path of an op whose numerics match the kernel."""
    devices = {a.device for a in list(args) + list(kwargs.values()) if _is_neuron(a)}
    if len(devices) > 1:
        raise RuntimeError(f"NKI kernel {kernel.__name__} got tensors on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    views: dict[int, torch.Tensor] = {}

    def to_host(x):
        if _is_neuron(x):
            h = host_view(x)
            views[h.data_ptr()] = x
            return h
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            raise RuntimeError(f"NKI kernel {kernel.__name__}: tensor on {x.device}; expected neuron")
        return x

    # host views are inference tensors: the kernel reads and writes them in inference mode
    with torch.neuron.device(device.index if device.index is not None else 0), torch.inference_mode():
        torch.neuron.synchronize()  # device memory is read outside the op queue
        if host is None:
            out, stats = kernel.run(_map(args, to_host), _map(kwargs, to_host))
        else:
            out, stats = host(*_map(args, to_host), **_map(kwargs, to_host)), timing()

        def to_device(o):
            if not isinstance(o, torch.Tensor):
                return o
            src = views.get(o.data_ptr())
            if src is not None and o.shape == src.shape:
                return src                      # the kernel returned (an alias of) an input
            with torch.inference_mode(False):  # a normal tensor: autograd tracks views of it
                d = torch.empty(o.shape, dtype=o.dtype, device=device)
            host_view(d).copy_(o)
            return d

        result = _map(out, to_device)
        cost, meta = stats_cost(stats)
        charge(f"nki::{kernel.__name__}", cost, device=device.index, meta=meta)
    return result


def stats_cost(stats: Any) -> tuple[Cost, dict]:
    """What one call of a kernel with these KernelStats costs the device (its latency plus one
    kernel launch, on its busiest engine) and the timeline entry's metadata."""
    busiest = max(stats.engine_busy_s, key=stats.engine_busy_s.get, default="tensor")
    bound = "compute" if busiest in ("tensor", "vector", "scalar", "gpsimd") else "memory"
    cost = Cost(stats.latency_s + launch_cost(), busiest, stats.flops, stats.hbm_bytes, bound)
    return cost, {"instructions": stats.instructions, "engine_busy_s": dict(stats.engine_busy_s),
                  "target": stats.target}
