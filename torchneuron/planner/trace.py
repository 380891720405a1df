"""Recording one rank's device work while the real training code runs on fake tensors.

`Tracer` is a TorchDispatchMode entered above FakeTensorMode. It sees every aten op on the
rank's *local* tensors (an op on DTensors is handed back to DTensor, which calls the local ops
it decomposes into) and every c10d collective, and records for each:

- ops: the OpOverload, its arguments (tensors replaced by `Ref`s, the tensor's identity), the
  (dtype, shape) of its tensor inputs and outputs, and meta copies of the outputs (what the
  compiler's fusion reads);
- collectives: the kind, the bytes (hardware.collective_cost's convention: the full buffer),
  the group's ranks, and the storages it reads and writes.

Only work on `neuron` tensors is recorded (CPU scalars such as an optimizer's step counter,
and the meta tensors DTensor's sharding propagation runs on, are not device work). The tracer
also keeps live bytes of the storages the traced ops allocate, by phase, for the memory plan.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from torchneuron.hardware.taxonomy import op_category

COLLECTIVES = {
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter", "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce", "broadcast_": "broadcast", "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all", "send": "send", "recv_": "recv", "barrier": "barrier",
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast",
}
_WAITS = {"wait_tensor"}


@dataclass(frozen=True)
class Ref:
    """A tensor argument of a recorded op: the id of the tensor object it was."""

    key: int


@dataclass
class OpEvent:
    func: Any                        # torch._ops.OpOverload
    name: str
    args: tuple
    kwargs: dict
    inputs: tuple                    # ((dtype, shape), ...) of tensor inputs
    outputs: tuple                   # ((dtype, shape), ...) of tensor outputs
    in_keys: tuple[int, ...]
    out_keys: tuple[int, ...]
    out_meta: Any                    # outputs as meta tensors (pytree of the op's result)
    reads: tuple[int, ...]           # storage keys read
    phase: str
    view: bool = False               # computes nothing (a view of an input)


@dataclass
class CollectiveEvent:
    kind: str
    nbytes: int
    ranks: tuple[int, ...]
    group: str
    reads: tuple[int, ...]
    writes: tuple[int, ...]
    phase: str
    functional: bool = False         # a functional collective (DTensor's): Dynamo traces it into a graph
    in_keys: tuple[int, ...] = ()    # ids of the tensors it reads and (functional) produces, as OpEvent's
    out_keys: tuple[int, ...] = ()


@dataclass
class Memory:
    """The peak of the traced region's *transient* allocations (those freed before it ends:
    activations, temporaries, communication buffers), by phase of allocation. Allocations
    that outlive the region (gradients) are the memory plan's own items, so they are left out."""

    peak_total: int = 0
    peak_by_phase: dict[str, int] = field(default_factory=dict)


_DECOMPOSED: dict[Any, Any] = {}


def _decomposed_on_device(func: Any) -> Any:
    """The dispatch key whose kernel the neuron device runs for `func` when that kernel is made of
    other ops (so the device works, and charges, op by op): a composite kernel the device has no
    kernel of its own to replace, or a Python kernel registered for PrivateUse1 (FSDP's copy-in
    ops). None when the device runs `func` itself."""
    if func in _DECOMPOSED:
        return _DECOMPOSED[func]
    if func.namespace in ("prim", "c10d", "_c10d_functional", "torchneuron", "profiler"):
        _DECOMPOSED[func] = None
        return None
    name = func.name()
    has = lambda key: torch._C._dispatch_has_kernel_for_dispatch_key(name, key)  # noqa: E731
    keys = torch._C.DispatchKey
    found = None
    if has("CompositeImplicitAutograd") and not has("PrivateUse1"):
        found = keys.CompositeImplicitAutograd   # reached here only through a subclass (DTensor)
    elif func.namespace != "aten" and has("PrivateUse1"):
        found = keys.PrivateUse1
    elif not has("PrivateUse1") and not torch._C._dispatch_has_kernel_for_any_dispatch_key(
            name, torch._C.DispatchKeySet(keys.PrivateUse1)) and func.namespace == "aten":
        if has("CompositeExplicitAutograd"):
            found = keys.CompositeExplicitAutograd
    _DECOMPOSED[func] = found
    return found


def _storage_key(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):
        return None


def _sig(t: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]]:
    return t.dtype, tuple(int(s) for s in t.shape)


def _meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
    return value


def _group_of(func: Any, args: tuple) -> Any:
    for a in reversed(args):
        if isinstance(a, str):  # functional collectives name their group last
            from torch.distributed.distributed_c10d import _resolve_process_group

            return _resolve_process_group(a)
        if isinstance(a, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(a)
            except RuntimeError:
                continue
    return None


class Tracer(TorchDispatchMode):
    """Records the device work of one rank (see the module docstring)."""

    def __init__(self, group_names: dict[tuple[int, ...], str] | None = None) -> None:
        super().__init__()
        self.group_names = group_names or {}
        self._decomposing: set = set()
        self.events: list[OpEvent | CollectiveEvent] = []
        self.phase = "forward"
        self.recording = True
        self.memory = Memory()
        self._storages: dict[int, list] = {}     # storage key -> [refcount, nbytes, phase, allocation]
        self._log: list[tuple[int, int]] = []      # (allocation, +/- bytes)
        self._phase_of: list[str] = []             # allocation -> phase
        self._ranks: dict[int, tuple[int, ...]] = {}

    # ---- storages and their liveness -----------------------------------------------------
    def _track(self, t: torch.Tensor, phase: str) -> None:
        key = _storage_key(t)
        if key is None:
            return
        entry = self._storages.get(key)
        if entry is None:
            entry = self._storages[key] = [0, t.untyped_storage().nbytes(), phase, len(self._phase_of)]
            self._phase_of.append(phase)
            self._log.append((entry[3], entry[1]))
        entry[0] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._storages.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] <= 0:
            del self._storages[key]
            self._log.append((entry[3], -entry[1]))

    def finish(self) -> None:
        """At the end of the traced region: the peak of the allocations freed inside it."""
        survivors = {entry[3] for entry in self._storages.values()}
        live: dict[str, int] = {}
        total = 0
        for allocation, delta in self._log:
            if allocation in survivors:
                continue
            phase = self._phase_of[allocation]
            live[phase] = live.get(phase, 0) + delta
            total += delta
            if total > self.memory.peak_total:
                self.memory.peak_total = total
                self.memory.peak_by_phase = dict(live)

    # ---- dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = pytree.tree_leaves((args, kwargs))
        if any(isinstance(a, DTensor) for a in flat):
            return NotImplemented  # DTensor runs the op as local ops, which come back here
        key = _decomposed_on_device(func)
        if key is not None and self.recording and func not in self._decomposing and any(
                isinstance(a, torch.Tensor) and a.device.type == "neuron" for a in flat):
            self._decomposing.add(func)
            try:
                with self:  # the kernel's own ops come back here, as the device's work log sees them
                    return func._op_dk(key, *args, **kwargs)
            finally:
                self._decomposing.discard(func)
        out = func(*args, **kwargs)
        if not self.recording:
            return out
        namespace = func.namespace
        if namespace == "prim":  # metadata queries (prim::device, ...)
            return out
        if namespace in ("c10d", "_c10d_functional"):
            self._collective(func, args, kwargs, flat, out)
            return out
        tensors_in = [a for a in flat if isinstance(a, torch.Tensor)]
        tensors_out = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not any(t.device.type == "neuron" for t in tensors_in + tensors_out):
            return out
        phase = "comm" if namespace == "fsdp" else self.phase  # FSDP's all-gather/reduce-scatter buffers
        for t in tensors_out:
            self._track(t, phase)
        name = func.name()
        self.events.append(OpEvent(
            func, name,
            pytree.tree_map(lambda a: Ref(id(a)) if isinstance(a, torch.Tensor) else a, args),
            pytree.tree_map(lambda a: Ref(id(a)) if isinstance(a, torch.Tensor) else a, kwargs),
            tuple(_sig(t) for t in tensors_in), tuple(_sig(t) for t in tensors_out),
            tuple(id(t) for t in tensors_in), tuple(id(t) for t in tensors_out),
            pytree.tree_map(_meta, out),
            tuple(k for k in map(_storage_key, tensors_in) if k is not None), self.phase,
            op_category(name) == "view"))
        return out

    def _collective(self, func, args, kwargs, flat, out) -> None:
        name = func._opname
        if name in _WAITS or name not in COLLECTIVES:
            return
        kind = COLLECTIVES[name]
        group = _group_of(func, args)
        ranks = self._group_ranks(group)
        tensors_in = [a for a in flat if isinstance(a, torch.Tensor)]
        tensors_out = [o for o in pytree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        nbytes = _collective_bytes(kind, name, tensors_in, tensors_out, len(ranks))
        for t in tensors_in + tensors_out:  # a buffer a collective moves is a communication buffer
            self._track(t, "comm")
            entry = self._storages.get(_storage_key(t))
            if entry is not None:
                self._phase_of[entry[3]] = "comm"
        writes = tensors_out if func.namespace == "_c10d_functional" else tensors_in
        label = self.group_names.get(ranks, f"group of {len(ranks)}")
        self.events.append(CollectiveEvent(
            kind, nbytes, ranks, label,
            tuple(k for k in map(_storage_key, tensors_in) if k is not None),
            tuple(k for k in map(_storage_key, writes) if k is not None), self.phase,
            func.namespace == "_c10d_functional", tuple(id(t) for t in tensors_in),
            tuple(id(t) for t in tensors_out) if func.namespace == "_c10d_functional" else ()))

    def _group_ranks(self, group: Any) -> tuple[int, ...]:
        if group is None:
            return (0,)
        key = id(group)
        ranks = self._ranks.get(key)
        if ranks is None:
            ranks = self._ranks[key] = tuple(dist.get_process_group_ranks(group))
        return ranks


def _collective_bytes(kind: str, name: str, ins: list[torch.Tensor], outs: list[torch.Tensor], group: int) -> int:
    """The full buffer of a collective (see hardware.collective_cost). c10d ops take their
    outputs as arguments too; a coalesced op's arguments are outputs then inputs."""
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    coalesced_full = nbytes(ins) * group // (group + 1)
    if kind == "all_gather":
        if name == "_allgather_base_":
            return nbytes(ins[:1])
        if name == "allgather_into_tensor_coalesced_":
            return coalesced_full
        if name.startswith("all_gather_into_tensor"):  # functional: input shard(s); output = shard * group
            return nbytes(outs)
        return nbytes(ins) - nbytes(ins[-1:])
    if kind == "reduce_scatter":
        if name == "_reduce_scatter_base_":
            return nbytes(ins[1:2])
        if name == "reduce_scatter_tensor_coalesced_":
            return coalesced_full
        if name.startswith("reduce_scatter_tensor"):
            return nbytes(ins)
        return nbytes(ins) - nbytes(ins[:1])
    if kind == "all_to_all":
        return nbytes(ins[1:2]) if name == "alltoall_base_" else nbytes(ins) // 2
    return nbytes(ins) if ins else nbytes(outs)
