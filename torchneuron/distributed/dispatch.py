"""Routes c10d's C++ collectives on neuron tensors to the Python process group.

A C++ caller of a `ProcessGroup` method that pybind's trampoline does not cover (in torch 2.13:
all_gather_single, reduce_scatter_single, reduce, gather, scatter, alltoall, allgather_coalesced,
recv_anysource, ...) goes through the dispatcher op `c10d::<name>_` of the tensors' device. This
module registers PrivateUse1 kernels for all those ops that unbox the process group and call the
`NeuronProcessGroup` method of the same collective, so no C++ path bypasses it. Installed once, when
the first neuron process group is created.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions, AllreduceCoalescedOptions, AllToAllOptions, GatherOptions, PythonCallbackWork, ReduceOptions,
    ReduceScatterOptions, ScatterOptions,
)

_library: torch.library.Library | None = None


def _group(boxed: Any):
    from torchneuron.distributed.process_group import NeuronProcessGroup

    group = dist.ProcessGroup.unbox(boxed)
    if not isinstance(group, NeuronProcessGroup):
        raise RuntimeError(f"a collective on neuron tensors reached process group {group.name()!r}, which cannot "
                           f"use neuron memory: create the group with backend 'neuron' (the default when the "
                           f"accelerator is neuron), e.g. init_process_group('neuron') or new_group(backend='neuron')")
    return group


def _options(options: Any, **fields: Any) -> Any:
    for name, value in fields.items():
        setattr(options, name, value)
    return options


def _reduce_op(op: Any) -> dist.ReduceOp:
    """A c10d ReduceOp from the op's TorchScript object (which exposes only its type, not a
    PREMUL_SUM factor)."""
    if isinstance(op, dist.ReduceOp):
        return op
    kind = dist.ReduceOp.RedOpType(op.op())
    if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
        raise ValueError("PREMUL_SUM reached the neuron backend without its factor; call the collective from "
                         "Python (torch.distributed.*) to use it")
    return dist.ReduceOp(kind)


def _call(boxed: Any, method: str, *args: Any) -> Any:
    """Runs the collective; returns a C++ Work whose wait() runs the Python Work's wait (and keeps
    the Python object alive, which a boxed Python Work alone would not)."""
    work = getattr(_group(boxed), method)(*args)
    return PythonCallbackWork(work.wait).boxed()


_KERNELS = {
    "allreduce_": lambda ts, pg, op, sparse, async_op=True, timeout=-1: (
        ts, _call(pg, "allreduce", ts, _options(dist.AllreduceOptions(), reduceOp=_reduce_op(op)))),
    "allreduce_coalesced_": lambda ts, pg, op, async_op=True, timeout=-1: _call(
        pg, "allreduce_coalesced", ts, _options(AllreduceCoalescedOptions(), reduceOp=_reduce_op(op))),
    "broadcast_": lambda ts, pg, root, root_tensor, async_op=True, timeout=-1: (
        ts, _call(pg, "broadcast", ts, _options(dist.BroadcastOptions(), rootRank=root, rootTensor=root_tensor))),
    "reduce_": lambda ts, pg, op, root, root_tensor, async_op=True, timeout=-1: _call(
        pg, "reduce", ts, _options(ReduceOptions(), reduceOp=_reduce_op(op), rootRank=root, rootTensor=root_tensor)),
    "allgather_": lambda outs, ins, pg, async_op=True, timeout=-1: (
        outs, _call(pg, "allgather", outs, ins, AllgatherOptions())),
    "_allgather_base_": lambda out, inp, pg, async_op=True, timeout=-1: (
        out, _call(pg, "all_gather_single", out, inp, AllgatherOptions())),
    "allgather_coalesced_": lambda outs, ins, pg, async_op=True: _call(
        pg, "allgather_coalesced", outs, ins, AllgatherOptions()),
    "allgather_into_tensor_coalesced_": lambda outs, ins, pg, async_op=True: _call(
        pg, "all_gather_single_coalesced", outs, ins, AllgatherOptions()),
    "gather_": lambda outs, ins, pg, root, async_op=True, timeout=-1: _call(
        pg, "gather", outs, ins, _options(GatherOptions(), rootRank=root)),
    "scatter_": lambda outs, ins, pg, root, async_op=True, timeout=-1: (
        outs, _call(pg, "scatter", outs, ins, _options(ScatterOptions(), rootRank=root))),
    "reduce_scatter_": lambda outs, ins, pg, op, async_op=True, timeout=-1: (
        outs, _call(pg, "reduce_scatter", outs, ins, _options(ReduceScatterOptions(), reduceOp=_reduce_op(op)))),
    "_reduce_scatter_base_": lambda out, inp, pg, op, async_op=True, timeout=-1: (
        out, _call(pg, "reduce_scatter_single", out, inp, _options(ReduceScatterOptions(), reduceOp=_reduce_op(op)))),
    "reduce_scatter_tensor_coalesced_": lambda outs, ins, pg, op, async_op=True, timeout=-1: _call(
        pg, "reduce_scatter_single_coalesced", outs, ins, _options(ReduceScatterOptions(), reduceOp=_reduce_op(op))),
    "alltoall_": lambda outs, ins, pg, async_op=True, timeout=-1: (
        outs, _call(pg, "alltoall", outs, ins, AllToAllOptions())),
    "alltoall_base_": lambda out, inp, pg, out_splits, in_splits, async_op=True, timeout=-1: _call(
        pg, "all_to_all_single", out, inp, list(out_splits), list(in_splits), AllToAllOptions()),
    "barrier": lambda tensor, pg, device_ids, async_op=True, timeout=-1: _call(pg, "barrier", None),
    "send": lambda ts, pg, dst, tag: _call(pg, "send", ts, dst, tag),
    "recv_": lambda ts, pg, src, tag: _call(pg, "recv", ts, src, tag),
    "recv_any_source_": lambda ts, pg, tag: _call(pg, "recv_anysource", ts, tag),
}


def install() -> None:
    """Registers the PrivateUse1 kernels of the c10d ops (idempotent)."""
    global _library
    if _library is not None:
        return
    library = torch.library.Library("c10d", "IMPL")
    with warnings.catch_warnings():  # each registration replaces c10d's own PrivateUse1 kernel, on purpose
        warnings.simplefilter("ignore")
        for name, kernel in _KERNELS.items():
            library.impl(name, kernel, "PrivateUse1")
    _library = library
