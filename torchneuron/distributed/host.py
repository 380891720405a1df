"""Host buffers for collectives: gloo reads and writes CPU tensors over the neuron tensors' bytes.

`host_tensor(t)` is an ordinary CPU tensor over a neuron tensor's memory (zero copy). `Staged` hands
gloo a flat, contiguous buffer of a dtype gloo supports, copying only when it must (a strided tensor,
or a dtype gloo lacks: reductions then compute in a wider dtype, pure data movement moves raw bytes),
and writes results back. `ReduceSpec` maps a c10d reduce op onto what gloo can do (AVG is a SUM
followed by a division, PREMUL_SUM a scaling followed by a SUM). Arithmetic done here runs on host
views and is not charged: on Trainium it happens on the collective engines at line rate.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchneuron.runtime import host_view

GLOO_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
                         torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128})
# Reductions over dtypes gloo lacks run in a dtype that holds every value exactly.
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64,
          torch.float8_e4m3fn: torch.float32, torch.float8_e5m2: torch.float32,
          torch.float8_e4m3fnuz: torch.float32, torch.float8_e5m2fnuz: torch.float32}


def host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """An ordinary CPU tensor over `tensor`'s bytes (itself when already on the CPU).

    Unlike `runtime.host_view` (an inference tensor: no in-place use outside inference mode), the
    result works in any CPU kernel, gloo's copies included. It keeps the device memory alive."""
    if tensor.device.type != "neuron":
        return tensor
    if tensor.numel() == 0:
        return torch.empty(tensor.shape, dtype=tensor.dtype)
    view = host_view(tensor)
    out = torch.empty(0, dtype=tensor.dtype)
    with torch.no_grad():
        out.set_(view.untyped_storage(), view.storage_offset(), view.size(), view.stride())
    return out


class Staged:
    """A flat gloo buffer for one tensor. `scale` is buffer elements per tensor element (the byte
    width when raw bytes are moved); `finish()` writes a received result back to the tensor."""

    __slots__ = ("host", "buffer", "copied", "scale")

    def __init__(self, tensor: torch.Tensor, *, reduction: bool = False, private: bool = False):
        host = host_tensor(tensor)
        dtype = host.dtype
        if dtype.is_complex and reduction:
            host = torch.view_as_real(host)
            dtype = host.dtype
        aliased = host.is_contiguous() and not private
        buffer = host.view(-1) if aliased else host.reshape(-1).clone()
        self.scale = 1
        if dtype not in GLOO_DTYPES and reduction:
            wider = _WIDER.get(dtype)
            if wider is None:
                raise TypeError(f"neuron collectives cannot reduce {dtype} tensors; cast them to a wider dtype first")
            buffer, aliased = buffer.to(wider), False
        elif dtype not in GLOO_DTYPES:
            buffer, self.scale = buffer.view(torch.uint8), dtype.itemsize
        self.host, self.buffer, self.copied = host, buffer, not aliased

    def finish(self) -> None:
        """Copies the buffer back into the tensor if gloo worked on a copy."""
        if not self.copied or self.host.numel() == 0:
            return
        buffer = self.buffer
        if buffer.dtype == torch.uint8 and self.host.dtype != torch.uint8:
            buffer = buffer.view(self.host.dtype)
        with torch.no_grad():
            self.host.copy_(buffer.view(self.host.shape))


def stage_all(tensors: list[torch.Tensor], *, reduction: bool = False, private: bool = False) -> list[Staged]:
    return [Staged(t, reduction=reduction, private=private) for t in tensors]


def finish_all(staged: list[Staged]) -> None:
    for s in staged:
        s.finish()


@dataclass(frozen=True)
class ReduceSpec:
    """How gloo computes a c10d reduce op: `gloo_op`, after multiplying inputs by `pre_scale`, then
    dividing the result by `post_divide`."""

    name: str
    gloo_op: dist.ReduceOp
    pre_scale: float | torch.Tensor | None = None
    post_divide: int | None = None

    def scale_inputs(self, staged: list[Staged]) -> None:
        if self.pre_scale is not None:
            for s in staged:
                s.buffer.mul_(self.pre_scale)

    def divide_outputs(self, staged: list[Staged]) -> None:
        if self.post_divide is not None:
            for s in staged:
                if s.buffer.is_floating_point() or s.buffer.is_complex():
                    s.buffer.div_(self.post_divide)
                else:
                    s.buffer.floor_divide_(self.post_divide)


_RED = dist.ReduceOp.RedOpType
_GLOO_OPS = {_RED.SUM: dist.ReduceOp.SUM, _RED.PRODUCT: dist.ReduceOp.PRODUCT, _RED.MIN: dist.ReduceOp.MIN,
             _RED.MAX: dist.ReduceOp.MAX, _RED.BAND: dist.ReduceOp.BAND, _RED.BOR: dist.ReduceOp.BOR,
             _RED.BXOR: dist.ReduceOp.BXOR}


def reduce_spec(op: dist.ReduceOp | _RED, group_size: int) -> ReduceSpec:
    """The ReduceSpec of a c10d ReduceOp (or its RedOpType)."""
    kind = op.op if isinstance(op, dist.ReduceOp) else op
    name = kind.name.lower()
    if kind in _GLOO_OPS:
        return ReduceSpec(name, _GLOO_OPS[kind])
    if kind == _RED.AVG:
        return ReduceSpec(name, dist.ReduceOp.SUM, post_divide=group_size)
    if kind == _RED.PREMUL_SUM:
        factor = op.factor if isinstance(op, dist.ReduceOp) else None
        if factor is None:
            raise ValueError("PREMUL_SUM needs a factor: build it with torch.distributed._make_nccl_premul_sum(f)")
        if isinstance(factor, torch.Tensor):
            factor = host_tensor(factor).item()
        return ReduceSpec(name, dist.ReduceOp.SUM, pre_scale=factor)
    raise ValueError(f"the neuron backend does not support reduce op {name}")


def reduce_code(op: dist.ReduceOp | _RED | None) -> int:
    """A small integer naming the reduce op (for cross-rank consistency checks)."""
    if op is None:
        return -1
    return int(op.op if isinstance(op, dist.ReduceOp) else op)
