"""How each collective's data moves on the host: gloo over staged host buffers.

Every function takes the process group's gloo backend and the caller's tensors, runs the exchange to
completion and leaves the results in the tensors. Several tensors of one call travel as one buffer
(one gloo round trip): coalesced all-gathers as bytes, coalesced reduce-scatters in their common dtype.
Uneven all-gather and reduce-scatter lists are padded to the largest piece. Nothing here knows about
the device timeline or cross-rank checks (see process_group.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions, AllToAllOptions, GatherOptions, ReduceOptions, ReduceScatterOptions, ScatterOptions,
)

from torchneuron.distributed.host import ReduceSpec, Staged, finish_all, stage_all

Gloo = dist.ProcessGroup  # a ProcessGroupGloo backend


def _bytes(buffer: torch.Tensor) -> torch.Tensor:
    return buffer.view(torch.uint8)


def all_reduce(gloo: Gloo, tensors: list[torch.Tensor], spec: ReduceSpec) -> None:
    """All-reduces each tensor in place (several tensors of one dtype: one exchange)."""
    staged = stage_all(tensors, reduction=True)
    spec.scale_inputs(staged)
    opts = dist.AllreduceOptions()
    opts.reduceOp = spec.gloo_op
    if len(staged) == 1:
        gloo.allreduce([staged[0].buffer], opts).wait()
    else:
        flat = torch.cat([s.buffer for s in staged])
        gloo.allreduce([flat], opts).wait()
        for s, piece in zip(staged, flat.split([s.buffer.numel() for s in staged])):
            s.buffer.copy_(piece)
    spec.divide_outputs(staged)
    finish_all(staged)


def broadcast(gloo: Gloo, tensor: torch.Tensor, root: int) -> None:
    staged = Staged(tensor)
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    gloo.broadcast([staged.buffer], opts).wait()
    staged.finish()


def reduce(gloo: Gloo, tensor: torch.Tensor, root: int, spec: ReduceSpec, rank: int) -> None:
    """Reduces into `tensor` on `root`; other ranks' tensors are left unchanged."""
    staged = Staged(tensor, reduction=True, private=rank != root)
    spec.scale_inputs([staged])
    opts = ReduceOptions()
    opts.reduceOp, opts.rootRank = spec.gloo_op, root
    gloo.reduce([staged.buffer], opts).wait()
    if rank == root:
        spec.divide_outputs([staged])
        staged.finish()


def all_gather_single(gloo: Gloo, outputs: list[torch.Tensor], inputs: list[torch.Tensor], world: int) -> None:
    """outputs[i] receives every rank's inputs[i], rank-major (coalesced when several)."""
    outs, ins = stage_all(outputs), stage_all(inputs)
    if len(ins) == 1:
        gloo._allgather_base(_bytes(outs[0].buffer), _bytes(ins[0].buffer), AllgatherOptions()).wait()
    else:
        sizes = [_bytes(s.buffer).numel() for s in ins]
        gathered = torch.empty(world * sum(sizes), dtype=torch.uint8)
        gloo._allgather_base(gathered, torch.cat([_bytes(s.buffer) for s in ins]), AllgatherOptions()).wait()
        for out, piece in zip(outs, gathered.view(world, -1).split(sizes, dim=1)):
            _bytes(out.buffer).view(world, -1).copy_(piece)
    finish_all(outs)


def all_gather(gloo: Gloo, outputs: list[torch.Tensor], tensor: torch.Tensor, world: int) -> None:
    """outputs[j] receives rank j's `tensor` (sizes may differ by rank: padded to the largest)."""
    outs, staged = stage_all(outputs), Staged(tensor)
    sizes = [_bytes(s.buffer).numel() for s in outs]
    largest = max(sizes)
    mine = _bytes(staged.buffer)
    if mine.numel() != largest:
        mine = torch.cat([mine, mine.new_zeros(largest - mine.numel())])
    gathered = torch.empty(world * largest, dtype=torch.uint8)
    gloo._allgather_base(gathered, mine, AllgatherOptions()).wait()
    for out, row, size in zip(outs, gathered.view(world, largest), sizes):
        _bytes(out.buffer).copy_(row[:size])
    finish_all(outs)


def reduce_scatter_single(gloo: Gloo, outputs: list[torch.Tensor], inputs: list[torch.Tensor], spec: ReduceSpec,
                          world: int) -> None:
    """outputs[i] receives this rank's chunk of the reduction of every rank's inputs[i] (coalesced)."""
    outs, ins = stage_all(outputs, reduction=True), stage_all(inputs, reduction=True, private=True)
    if len({s.buffer.dtype for s in ins}) > 1:
        raise TypeError("a coalesced reduce_scatter needs tensors of one dtype")
    if len(ins) == 1:
        source, target = ins[0].buffer, outs[0].buffer
    else:
        source = torch.cat([s.buffer.view(world, -1) for s in ins], dim=1).view(-1)
        target = torch.empty(source.numel() // world, dtype=source.dtype)
    spec.scale_inputs([_Plain(source)])
    opts = ReduceScatterOptions()
    opts.reduceOp = spec.gloo_op
    gloo._reduce_scatter_base(target, source, opts).wait()
    if len(ins) > 1:
        for out, piece in zip(outs, target.split([s.buffer.numel() for s in outs])):
            out.buffer.copy_(piece)
    spec.divide_outputs(outs)
    finish_all(outs)


def reduce_scatter(gloo: Gloo, output: torch.Tensor, inputs: list[torch.Tensor], spec: ReduceSpec, rank: int,
                   world: int) -> None:
    """`output` receives the reduction of every rank's inputs[rank] (sizes may differ by rank)."""
    ins = stage_all(inputs, reduction=True)
    largest = max(s.buffer.numel() for s in ins)
    source = torch.zeros(world, largest, dtype=ins[0].buffer.dtype)
    for row, s in zip(source, ins):
        row[:s.buffer.numel()].copy_(s.buffer)
    out = Staged(output, reduction=True)
    target = torch.empty(largest, dtype=source.dtype)
    spec.scale_inputs([_Plain(source)])
    opts = ReduceScatterOptions()
    opts.reduceOp = spec.gloo_op
    gloo._reduce_scatter_base(target, source.view(-1), opts).wait()
    out.buffer.copy_(target[:out.buffer.numel()])
    spec.divide_outputs([out])
    out.finish()


def all_to_all_single(gloo: Gloo, output: torch.Tensor, tensor: torch.Tensor, out_splits: list[int],
                      in_splits: list[int]) -> None:
    """Splits are in elements of the flattened tensors."""
    out, staged = Staged(output), Staged(tensor)
    gloo.alltoall_base(out.buffer, staged.buffer, [n * out.scale for n in out_splits],
                       [n * staged.scale for n in in_splits], AllToAllOptions()).wait()
    out.finish()


def all_to_all(gloo: Gloo, outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    outs, ins = stage_all(outputs), stage_all(inputs)
    out_sizes, in_sizes = [_bytes(s.buffer).numel() for s in outs], [_bytes(s.buffer).numel() for s in ins]
    received = torch.empty(sum(out_sizes), dtype=torch.uint8)
    gloo.alltoall_base(received, torch.cat([_bytes(s.buffer) for s in ins]), out_sizes, in_sizes,
                       AllToAllOptions()).wait()
    for out, piece in zip(outs, received.split(out_sizes)):
        _bytes(out.buffer).copy_(piece)
    finish_all(outs)


def gather(gloo: Gloo, outputs: list[torch.Tensor], tensor: torch.Tensor, root: int, rank: int) -> None:
    staged = Staged(tensor)
    outs = stage_all(outputs) if rank == root else []
    opts = GatherOptions()
    opts.rootRank = root
    gloo.gather([[_bytes(s.buffer) for s in outs]] if outs else [], [_bytes(staged.buffer)], opts).wait()
    finish_all(outs)


def scatter(gloo: Gloo, output: torch.Tensor, inputs: list[torch.Tensor], root: int, rank: int) -> None:
    out = Staged(output)
    ins = stage_all(inputs) if rank == root else []
    opts = ScatterOptions()
    opts.rootRank = root
    gloo.scatter([_bytes(out.buffer)], [[_bytes(s.buffer) for s in ins]] if ins else [], opts).wait()
    out.finish()


class _Plain:
    """A bare buffer where a ReduceSpec expects a Staged."""

    __slots__ = ("buffer",)

    def __init__(self, buffer: torch.Tensor):
        self.buffer = buffer
