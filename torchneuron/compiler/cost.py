"""Modeled device cost of a kernel plan, from the hardware performance model.

A single-op kernel costs what the model charges that op in eager mode (`op_cost`). A fused
kernel keeps its intermediates on chip: its engines' work comes from its ops' compute (each
priced on a copy of the target with free memory traffic, so only engine time remains), issued
as the hardware issues a fused elementwise chain (engine_balance.py: casts ride on neighbouring
instructions, two scalar-operand ops share one instruction, a reduction rides on its producer,
and the passes spread over the Vector, Scalar and GpSimd engines that can run them); engines
overlap each other and the DMA, and HBM traffic is only what the kernel reads and writes at its
boundary:

    duration = max(busiest engine, boundary bytes / HBM bandwidth) + 2 DMA latencies

Every dispatched device kernel also pays the target's launch cost (`launch_cost`), so fewer,
larger kernels show up as modeled speedup. Host kernels (CPU fallbacks) cost the host round
trip of their operands, as in eager mode.
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache

from torchneuron.hardware.model import Cost, launch_cost, op_cost
from torchneuron.hardware.targets import Target, get_target
from torchneuron.compiler.engine_balance import engine_loads, passes_of
from torchneuron.compiler.plan import KernelSpec, OpSpec, TensorSpec


@lru_cache(maxsize=8)
def compute_only(target: Target) -> Target:
    """`target` with free, instant memory traffic: op_cost on it returns engine time only."""
    return dataclasses.replace(target, name=f"{target.name}/compute-only", hbm_bytes_per_s=math.inf,
                               dma_engine_bytes_per_s=math.inf, dma_fixed_latency_s=0.0,
                               dma_descriptor_overhead_s=0.0)


def _sigs(specs: tuple[TensorSpec, ...] | list[TensorSpec], bindings: dict[str, int]):
    return [(s.torch_dtype(), s.resolve(bindings)) for s in specs]


def _op(op: OpSpec, bindings: dict[str, int], target: Target, fallback: bool = False) -> Cost:
    return op_cost(op.op, _sigs(op.inputs, bindings), _sigs(op.outputs, bindings), target, fallback=fallback)


def kernel_cost(kernel: KernelSpec, bindings: dict[str, int] | None = None, target: Target | None = None) -> Cost:
    """Modeled cost of one kernel of a plan (launch included for device kernels)."""
    target = target or get_target()
    bindings = bindings or {}
    if kernel.placement == "host":
        costs = [_op(op, bindings, target, fallback=True) for op in kernel.ops]
        return Cost(sum(c.duration_s for c in costs), "host", 0.0, sum(c.bytes for c in costs),
                    costs[0].bound if costs else "latency", fallback=True)
    launch = launch_cost(target)
    if len(kernel.ops) == 1:
        cost = _op(kernel.ops[0], bindings, target)
        return dataclasses.replace(cost, duration_s=cost.duration_s + launch)
    fast = compute_only(target)
    priced = [(op.op, _sigs(op.inputs, bindings), _sigs(op.outputs, bindings), _op(op, bindings, fast))
              for op in kernel.ops]
    flops = sum(cost.flops for *_, cost in priced)
    fixed, passes = passes_of(priced, target)
    engines = {e: s for e, s in engine_loads(fixed, passes, target).items() if s > 0}
    moved = sum(t.nbytes(bindings) for t in kernel.reads) + sum(t.nbytes(bindings) for t in kernel.writes)
    memory_s = moved / min(target.hbm_bytes_per_s, target.dma_bytes_per_s)
    compute_s = max(engines.values(), default=0.0)
    fixed_s = 2 * target.dma_fixed_latency_s
    if fixed_s >= max(compute_s, memory_s):
        bound = "latency"
    else:
        bound = "compute" if compute_s >= memory_s else "memory"
    engine = max(engines, key=engines.__getitem__) if engines and compute_s >= memory_s else "dma"
    return Cost(max(compute_s, memory_s) + fixed_s + launch, engine, flops, float(moved), bound)


def plan_costs(kernels: list[KernelSpec], bindings: dict[str, int] | None = None,
               target: Target | None = None) -> list[Cost]:
    """Costs of a plan's kernels, in order."""
    return [kernel_cost(k, bindings, target) for k in kernels]


def eager_cost(kernels: list[KernelSpec], bindings: dict[str, int] | None = None,
               target: Target | None = None) -> float:
    """Seconds the same ops take as eager kernels (one op_cost and one launch each): the
    baseline a plan's modeled speedup is measured against."""
    target = target or get_target()
    total = 0.0
    launch = launch_cost(target)
    for kernel in kernels:
        for op in kernel.ops:
            cost = _op(op, bindings or {}, target, fallback=kernel.placement == "host")
            total += cost.duration_s + (0.0 if cost.fallback or cost.duration_s == 0 else launch)
    return total
