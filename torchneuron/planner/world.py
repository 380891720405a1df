"""A simulated world: one process standing for every rank of a cluster.

`simulated_world(world_size, rank)` makes this process one rank (0 unless asked) of a `world_size`-rank job whose
process groups are PyTorch's `FakeProcessGroup` (as torch.testing's fake_pg does, with its
`FakeStore`) under the c10d backend name `planner`, registered for the neuron device: DeviceMesh,
FSDP2, tensor parallelism and functional collectives all work, every collective completes at
once and leaves correctly shaped results (on fake tensors nothing else is observable). What a
collective *costs* is the planner's business (topology.py), seen by the trace (trace.py).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

BACKEND = "planner"
_registered = False


class _FakeStore(dist.Store):
    """A store nobody else reads: FakeProcessGroup never exchanges anything."""

    def __init__(self) -> None:
        super().__init__()
        self._data: dict[str, bytes] = {}

    def set(self, key: str, value) -> None:
        self._data[key] = value if isinstance(value, bytes) else str(value).encode()

    def get(self, key: str) -> bytes:
        return self._data.get(key, b"")


def _create(store: dist.Store, rank: int, size: int, timeout) -> dist.ProcessGroup:
    return FakeProcessGroup._create_internal(rank, size)


def _register() -> None:
    global _registered
    if not _registered:
        dist.Backend.register_backend(BACKEND, _create, devices=["neuron", "cpu"])
        _registered = True


@contextmanager
def simulated_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Rank `rank` of `world_size` fake ranks for the duration of the block (a pipeline plan traces
    the rank of its last stage too)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size} ranks")
    if dist.is_initialized():
        raise RuntimeError("planning needs its own simulated world, but a process group is already initialised "
                           "in this process: plan from a process without one (e.g. before init_process_group)")
    _register()
    _forget_sharding_decisions()
    dist.init_process_group(BACKEND, store=_FakeStore(), rank=rank, world_size=world_size)
    previous = torch.neuron.current_device()
    torch.neuron.set_device(0)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_sharding_decisions()
        torch.neuron.set_device(previous)


def _forget_sharding_decisions() -> None:
    """Empty DTensor's sharding-propagation and redistribution caches (C++ fast path and Python).

    A DeviceMesh compares equal to another of the same layout, device and dimension names
    whatever process groups it holds, so a cached decision made in an earlier simulated world
    (which returns that world's meshes in its redistribution specs) would be reused in the next
    one, and its collectives would name the earlier world's groups, long destroyed."""
    from torch.distributed.tensor import DTensor, _redistribute

    torch._C._clear_DTensor_sharding_propagator_cache()
    propagator = DTensor._op_dispatcher.sharding_propagator
    propagator.propagate_op_sharding.cache_clear()
    propagator._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()     # redistribution plans, keyed by DTensorSpec too
    _redistribute.clear_redistribute_planner_cache()


def mesh(shape: dict[str, int]) -> DeviceMesh:
    """A neuron DeviceMesh of the named dimensions (outermost first) over the whole world."""
    names = tuple(shape)
    return init_device_mesh("neuron", tuple(shape[n] for n in names), mesh_dim_names=names)
