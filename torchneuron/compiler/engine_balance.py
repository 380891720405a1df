"""Which engine instructions a fused kernel's elementwise work becomes, and how they spread.

An eager kernel is one op, one pass of one engine over its tiles. A fused kernel keeps its
intermediates in SBUF, so its elementwise ops are issued the way NKI issues them (nki.isa docs):

- **casts ride on a neighbouring instruction.** Every Vector/Scalar/GpSimd instruction reads its
  operands in their own dtype and writes its result in the output tile's dtype (the ISA's `dtype=`
  of the output, FP8 included), and the PSUM evacuation of a matmul writes any dtype too. A dtype
  conversion next to such an instruction on the same tensor costs no pass of its own.
- **two scalar-operand ops make one instruction.** `tensor_scalar` computes
  `(data op0 operand0) op1 operand1` with "one operator [at] the same performance cost as two",
  so a chain such as `x * scale` then `clamp_min` is one pass.
- **a free-axis reduction of a scalar-operand op's result is part of that instruction**
  (`activation_reduce` on Scalar, `tensor_scalar_reduce` on Vector): amax is the `abs` pass's
  side output; the 128 partition partials combine in one GpSimd `tensor_partition_reduce`.
- **the engines run concurrently** ("these engines execute their own instruction sequences
  asynchronously in parallel", the Trainium/Inferentia2 NKI architecture guide), and each
  instruction form has a set of engines that can run it: `tensor_scalar` (and unary ops) on
  Vector, Scalar or GpSimd, `tensor_tensor` on Vector or GpSimd, transcendental `activation` on
  Scalar. A kernel streams many tiles, so each form's passes are split tile by tile among its
  engines so that they finish together (water-filling, most constrained forms first).

Per-pass times stay the performance model's (`hardware.model.op_cost`: one element per partition
lane per cycle at each engine's clock, plus the fixed instruction cost). Ops of other categories
(matmuls, norms, softmax, gathers, optimizers, float64 emulation) keep the engine the model gives
them. Ops are matched by their position in the kernel and their tensors' sizes (a plan records
no edges): a cast or chained op pairs with the nearest engine op on a tensor of the same size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from torchneuron.hardware.model import Cost
from torchneuron.hardware.targets import Target
from torchneuron.hardware.instructions import engine_seconds
from torchneuron.hardware.taxonomy import base_name, op_category

__all__ = ["ANY_ALU", "TENSOR_TENSOR", "Pass", "engine_loads", "passes_of"]

ANY_ALU = frozenset({"vector", "scalar", "gpsimd"})      # tensor_scalar, unary ops
TENSOR_TENSOR = frozenset({"vector", "gpsimd"})          # tensor_tensor
REDUCE_FUSED = frozenset({"vector", "scalar"})           # tensor_scalar_reduce / activation_reduce
_CASTS = frozenset({"convert_element_type", "_to_copy", "to", "copy", "_to_dtype", "type_as"})
_ELEMENTWISE = frozenset({"elementwise", "fill", "copy"})


@dataclass
class Pass:
    """One instruction pass of a fused kernel: `cycles` per partition lane, to be run by any of
    `engines` (each engine takes them at its own clock)."""

    cycles: float
    engines: frozenset[str]


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _largest(sigs: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> int:
    return max((_numel(shape) for _, shape in sigs), default=0)


def _form(op: str, ins: Sequence, outs: Sequence) -> str:
    """"cast", "scalar" (unary or scalar-operand), "tensor" (two full-size operands), "reduce",
    or "" (an op whose engine the model fixes)."""
    category = op_category(op)
    name = base_name(op)
    if category == "reduction" and ins and outs and _largest(outs) < _largest(ins):
        return "reduce"
    if category not in _ELEMENTWISE:
        return ""
    if category == "copy" and name not in _CASTS:
        return ""
    sigs = list(ins) + list(outs)
    if any(d == torch.float64 for d, _ in sigs):
        return ""  # emulated float64: integer routines on Vector (hardware.model), not one ALU op
    size = _largest(outs) or _largest(ins)
    if name in _CASTS and ins and outs and any(d != outs[0][0] for d, _ in ins):
        return "cast"
    if category == "copy":
        return ""
    if any(not (d.is_floating_point or d == torch.bool) for d, _ in sigs):
        return ""  # integer and bitwise ALU ops run on Vector only (nki.isa.tensor_scalar)
    full = sum(1 for _, shape in ins if _numel(shape) == size and size > 1)
    return "tensor" if full >= 2 else "scalar"


def passes_of(ops: Sequence[tuple[str, Sequence, Sequence, Cost]], target: Target) -> tuple[dict[str, float], list[Pass]]:
    """(fixed seconds per engine, movable passes) of a fused kernel's ops, in plan order.

    Each op comes as (aten name, input sigs, output sigs, its compute-only Cost on `target`)."""
    fixed: dict[str, float] = {}
    passes: list[Pass] = []
    forms = [_form(op, ins, outs) for op, ins, outs, _ in ops]
    sizes = [max(_largest(outs), _largest(ins)) for _, ins, outs, _ in ops]
    open_pair: dict[int, Pass] = {}   # tensor size -> a tensor_scalar pass with a free op slot
    last_scalar: dict[int, Pass] = {}  # tensor size -> the latest scalar-operand pass

    def neighbour(i: int, step: int) -> int | None:
        j = i + step
        while 0 <= j < len(ops):
            if forms[j] != "cast" and (forms[j] or ops[j][3].duration_s > 0):
                return j
            j += step
        return None

    for i, (op, ins, outs, cost) in enumerate(ops):
        if cost.duration_s <= 0:
            continue
        form, size = forms[i], sizes[i]
        cycles = cost.duration_s * target.clock_hz(cost.engine) if cost.engine in ANY_ALU else 0.0
        if not form or not cycles:
            fixed[cost.engine] = fixed.get(cost.engine, 0.0) + cost.duration_s
            continue
        if form == "cast":
            before, after = neighbour(i, -1), neighbour(i, 1)
            produced = before is not None and _largest(ops[before][2]) == size
            consumed = after is not None and forms[after] in ("scalar", "tensor", "reduce") and \
                _largest(ops[after][1]) == size
            if produced or consumed:
                continue  # written by its producer's instruction or read by its consumer's
            passes.append(Pass(cycles, ANY_ALU))
            continue
        if form == "reduce":
            producer = last_scalar.get(_largest(ins))
            if producer is not None:  # the producing pass accumulates the free-axis reduction
                producer.engines = producer.engines & REDUCE_FUSED
                last_scalar.pop(_largest(ins))
                open_pair.pop(_largest(ins), None)
                partition_s = engine_seconds(target, "gpsimd", 1, 1)
                fixed["gpsimd"] = fixed.get("gpsimd", 0.0) + partition_s
                continue
            fixed[cost.engine] = fixed.get(cost.engine, 0.0) + cost.duration_s
            continue
        if form == "scalar":
            if size in open_pair:  # the second operator of a tensor_scalar instruction
                last_scalar[size] = open_pair.pop(size)
                continue
            pass_ = Pass(cycles, ANY_ALU)
            passes.append(pass_)
            open_pair[size] = last_scalar[size] = pass_
            continue
        open_pair.pop(size, None)
        last_scalar.pop(size, None)
        passes.append(Pass(cycles, TENSOR_TENSOR))
    return fixed, passes


def engine_loads(fixed: dict[str, float], passes: Sequence[Pass], target: Target) -> dict[str, float]:
    """Busy seconds per engine once `passes` are spread over their engines on top of `fixed`:
    the passes of each engine set (the most constrained sets first) raise the least busy of
    their engines to one common level, each engine absorbing cycles at its own clock."""
    loads = dict(fixed)
    by_set: dict[frozenset[str], float] = {}
    for p in passes:
        by_set[p.engines] = by_set.get(p.engines, 0.0) + p.cycles
    for engines, cycles in sorted(by_set.items(), key=lambda kv: (len(kv[0]), sorted(kv[0]))):
        _fill(loads, sorted(engines), cycles, target)
    return loads


def _fill(loads: dict[str, float], engines: list[str], cycles: float, target: Target) -> None:
    """Raise the least loaded of `engines` to a common level L with sum((L - load) * clock) = cycles."""
    order = sorted(engines, key=lambda e: loads.get(e, 0.0))
    rate = 0.0      # cycles per second of the engines below the current level
    level = loads.get(order[0], 0.0)
    remaining = cycles
    for k, engine in enumerate(order):
        rate += target.clock_hz(engine)
        nxt = loads.get(order[k + 1], 0.0) if k + 1 < len(order) else math.inf
        room = (nxt - level) * rate
        if remaining <= room:
            level += remaining / rate
            break
        remaining -= room
        level = nxt
    for engine in order:
        loads[engine] = max(loads.get(engine, 0.0), level)
