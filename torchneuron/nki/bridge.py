"""PyTorch bridge: NKI kernels on `neuron` tensors, as torch custom ops, with autograd.

Owns
- `call_on_device`: a `@nki.jit` kernel called with neuron tensors runs on zero-copy CPU
  views of their device memory; outputs land in new neuron tensors; the kernel's modeled
  latency (plus one kernel launch) is charged to the device timeline of that device;
- `nki_op`: registers a kernel as a `torch.library` custom op whose fake (meta)
  implementation is derived by a timing-only run of the kernel on shape placeholders, so
  the op works in eager mode, on CPU and neuron tensors, and under `torch.compile`;
- `register_autograd`: attaches a backward (typically calling a backward kernel's op).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch


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


def call_on_device(kernel: Any, args: tuple, kwargs: dict) -> Any:
    """Run `kernel` on neuron tensors: simulate on their host views, charge the device."""
    from torchneuron import runtime
    from torchneuron.hardware.model import Cost, launch_cost

    devices = {a.device for a in list(args) + list(kwargs.values()) if _is_neuron(a)}
    if len(devices) > 1:
        raise RuntimeError(f"NKI kernel {kernel.__name__} got tensors on several devices: {sorted(map(str, devices))}")
    device = devices.pop()
    views: dict[int, torch.Tensor] = {}

    def to_host(x):
        if _is_neuron(x):
            h = runtime.host_view(x)
            views[h.data_ptr()] = x
            return h
        if isinstance(x, torch.Tensor) and x.device.type != "cpu":
            raise RuntimeError(f"NKI kernel {kernel.__name__}: tensor on {x.device}; expected neuron")
        return x

    # host views are inference tensors: the kernel reads and writes them in inference mode
    with torch.neuron.device(device.index if device.index is not None else 0), torch.inference_mode():
        torch.neuron.synchronize()  # device memory is read outside the op queue
        out, stats = kernel.run(_map(args, to_host), _map(kwargs, to_host))

        def to_device(o):
            if not isinstance(o, torch.Tensor):
                return o
            src = views.get(o.data_ptr())
            if src is not None and o.shape == src.shape:
                return src                      # the kernel returned (an alias of) an input
            d = torch.empty(o.shape, dtype=o.dtype, device=device)
            runtime.host_view(d).copy_(o)
            return d

        result = _map(out, to_device)
        busiest = max(stats.engine_busy_s, key=stats.engine_busy_s.get, default="tensor")
        duration = stats.latency_s + launch_cost()
        bound = "compute" if busiest in ("tensor", "vector", "scalar", "gpsimd") else "memory"
        runtime.charge(f"nki::{kernel.__name__}", Cost(duration, busiest, stats.flops, stats.hbm_bytes, bound),
                       device=device.index, meta={"instructions": stats.instructions,
                                                  "engine_busy_s": dict(stats.engine_busy_s),
                                                  "target": stats.target})
    return result


# ---------------------------------------------------------------------------------- custom ops
def _annotation(param: inspect.Parameter) -> Any:
    d = param.default
    if d is inspect.Parameter.empty or d is None:
        return torch.Tensor
    if isinstance(d, bool):
        return bool
    if isinstance(d, int):
        return int
    if isinstance(d, float):
        return float
    return torch.Tensor


def nki_op(qualname: str, kernel: Any, *, num_outputs: int = 1, grid: Sequence[int] | None = None,
           arg_types: dict | None = None, mutates_args: Sequence[str] = ()) -> Any:
    """Register `kernel` as the torch custom op `qualname` ("namespace::name").

    Parameters without defaults are tensors; ones with int/float/bool defaults are scalars
    (override with `arg_types={"name": float}`). The op returns `num_outputs` tensors. Its
    fake implementation runs the kernel timing-only on shape placeholders to learn the
    output shapes and dtypes, so `torch.compile` can trace it. Returns the custom op
    (callable; also reachable as `torch.ops.<namespace>.<name>`).
    """
    from .jit import Kernel, jit
    from .typing import TensorType

    k = kernel if isinstance(kernel, Kernel) else jit(kernel)
    if grid:
        k = k[tuple(grid)]
    sig = inspect.signature(k.fn)
    params = []
    for p in sig.parameters.values():
        ann = (arg_types or {}).get(p.name) or _annotation(p)
        default = p.default if p.default is not inspect.Parameter.empty else inspect.Parameter.empty
        params.append(inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=default, annotation=ann))
    ret = torch.Tensor if num_outputs == 1 else tuple[tuple([torch.Tensor] * num_outputs)]

    def impl(*args, **kwargs):
        out = k(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        fixed = tuple(o.clone() if any(o is i for i in inputs) else o for o in outs)  # no aliasing
        return fixed[0] if num_outputs == 1 else fixed

    impl.__signature__ = inspect.Signature(params, return_annotation=ret)
    impl.__name__ = qualname.split("::")[-1]
    op = torch.library.custom_op(qualname, impl, mutates_args=tuple(mutates_args))

    def fake(*args, **kwargs):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        holders = [TensorType(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in args]
        kw = {n: (TensorType(tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v)
              for n, v in kwargs.items()}
        res, _ = k.run(tuple(holders), kw)
        res = res if isinstance(res, (tuple, list)) else (res,)
        outs = tuple(torch.empty(r.shape, dtype=_torch_dtype(r.dtype), device=device) for r in res)
        return outs[0] if num_outputs == 1 else outs

    op.register_fake(fake)
    op.kernel = k
    return op


def _torch_dtype(d: Any) -> torch.dtype:
    from .dtypes import to_torch
    return to_torch(d)


def register_autograd(op: Any, backward: Callable, setup_context: Callable | None = None) -> None:
    """Attach `backward(ctx, *grads)` to an op made by `nki_op`. Without `setup_context`,
    the inputs and output are saved on ctx (`ctx.inputs`, `ctx.output`)."""
    if setup_context is None:
        def setup_context(ctx, inputs, output):
            ctx.inputs = inputs
            ctx.output = output
    op.register_autograd(backward, setup_context=setup_context)
