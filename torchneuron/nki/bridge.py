"""PyTorch bridge: NKI kernels on `neuron` tensors, as torch custom ops, with autograd.

Owns (running a kernel on neuron tensors is on_device.py's)
- `nki_op`: registers a kernel as a `torch.library` custom op whose fake (meta)
  implementation is derived by a timing-only run of the kernel on shape placeholders, so
  the op works in eager mode, on CPU and neuron tensors, and under `torch.compile`;
- `register_autograd`: attaches a backward (typically calling a backward kernel's op).
"""
from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from .. import settings
from .jit import Kernel, KernelStats, jit
from .on_device import call_on_device, has_neuron_tensors
from .typing import TensorType


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


def nki_op(qualname: str, kernel: Any, *, num_outputs: int = 1,
           grid: Sequence[int] | Callable[..., tuple] | None = None,
           arg_types: dict | None = None, mutates_args: Sequence[str] = (),
           host: Callable | None = None, priced_as: str | None = None) -> Any:
    """Register `kernel` as the torch custom op `qualname` ("namespace::name").

    Parameters without defaults are tensors; ones with int/float/bool defaults are scalars
    (override with `arg_types={"name": float}`). `grid` is a launch grid, or a function of
    the op's arguments that returns one (e.g. one program per head). `host` is a host
    implementation with the kernel's numerics: unless NKI_SIMULATOR=1 the op computes with it
    and, on neuron tensors, charges the kernel's timing-only latency (cached per signature),
    or with `priced_as` (an op name of the performance model) what the model charges that op,
    `hardware.model.op_cost(priced_as, input signatures)`: a kernel pricer registered for its
    category extends the kernel's timing-only runs to shapes too large to simulate whole
    (kernels/pricing.py). The op returns `num_outputs` tensors. Its
    fake implementation runs the kernel timing-only on shape placeholders to learn the
    output shapes and dtypes, so `torch.compile` can trace it. Returns the custom op
    (callable; also reachable as `torch.ops.<namespace>.<name>`).
    """
    k = kernel if isinstance(kernel, Kernel) else jit(kernel)
    if grid and not callable(grid):
        k = k[tuple(grid)]

    def launch(args: tuple) -> Kernel:
        return k[tuple(grid(*args))] if callable(grid) else k
    sig = inspect.signature(k.fn)
    params = []
    for p in sig.parameters.values():
        ann = (arg_types or {}).get(p.name) or _annotation(p)
        default = p.default if p.default is not inspect.Parameter.empty else inspect.Parameter.empty
        params.append(inspect.Parameter(p.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        default=default, annotation=ann))
    ret = torch.Tensor if num_outputs == 1 else tuple[tuple([torch.Tensor] * num_outputs)]

    def impl(*args, **kwargs):
        if host is not None and not settings.current().nki_simulator:
            if has_neuron_tensors(args, kwargs):
                timing = ((lambda: _priced(priced_as, args)) if priced_as else
                          (lambda: _timing(launch(args), args, kwargs)))
                out = call_on_device(launch(args), args, kwargs, host=host, timing=timing)
            else:
                out = host(*args, **kwargs)
        else:
            out = launch(args)(*args, **kwargs)
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
        res, _ = launch(args).run(tuple(holders), kw)
        res = res if isinstance(res, (tuple, list)) else (res,)
        outs = tuple(torch.empty(r.shape, dtype=_torch_dtype(r.dtype), device=device) for r in res)
        return outs[0] if num_outputs == 1 else outs

    op.register_fake(fake)
    op.kernel = k
    return op


_timings: dict = {}


def _signature(x: Any) -> Any:
    return (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x


def _timing(kernel: Kernel, args: tuple, kwargs: dict) -> Any:
    """KernelStats of a timing-only run on the arguments' shapes and dtypes (cached)."""
    key = (kernel.fn, kernel.grid, tuple(_signature(a) for a in args),
           tuple((k, _signature(v)) for k, v in sorted(kwargs.items())))
    stats = _timings.get(key)
    if stats is None:
        def holder(a):
            return TensorType(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
        _, stats = kernel.run(tuple(holder(a) for a in args), {k: holder(v) for k, v in kwargs.items()})
        if len(_timings) >= 1024:
            _timings.clear()
        _timings[key] = stats
    return stats


def _priced(op: str, args: tuple) -> KernelStats:
    """KernelStats of the performance model's price of `op` on the arguments' signatures."""
    return priced_stats(op, [(a.dtype, tuple(a.shape)) for a in args if isinstance(a, torch.Tensor)])


def priced_stats(op: str, sigs: list) -> KernelStats:
    """KernelStats of the performance model's price of `op` on these (dtype, shape) tensor
    signatures, in argument order (its output shaped as the first): what an op registered with
    `priced_as=op` is charged on neuron tensors."""
    from torchneuron.hardware import get_target, model
    cost = model.op_cost(op, sigs, sigs[:1])
    return KernelStats(target=get_target().name, latency_s=cost.duration_s, instructions=0,
                       engine_busy_s={cost.engine: cost.duration_s}, flops=cost.flops, hbm_bytes=cost.bytes)


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
