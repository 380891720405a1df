"""Parallelism helpers that PyTorch itself does not ship.

`simple_fsdp(module, mesh)`: SimpleFSDP-style fully sharded data parallelism (as in torchtitan's
experiments): every parameter is stored as a DTensor sharded along dim 0 over `mesh`, and a
parametrization turns it into the full tensor at use: an all-gather in forward, and in backward a
reduce-scatter that averages the gradient over ranks. It is plain DTensor code, so torch.compile
traces it into functional collectives the compiler can schedule and overlap with compute.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.nn.utils import parametrize


class _Gathered(nn.Module):
    """The full parameter from its shard; the gradient flows back as an averaged reduce-scatter."""

    def forward(self, shard: DTensor) -> torch.Tensor:
        full = shard.redistribute(shard.device_mesh, [Replicate()])
        return full.to_local(grad_placements=[Partial("avg")])


def simple_fsdp(module: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Shards `module`'s parameters (in place) over the 1-D `mesh`; returns the module."""
    if mesh.ndim != 1:
        raise ValueError(f"simple_fsdp shards over a 1-D mesh, got {mesh.ndim}-D; pass the data-parallel submesh")
    gather = _Gathered()
    for owner in list(module.modules()):
        for name, param in list(owner.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param.detach(), mesh, [Shard(0)]), param.requires_grad)
            owner.register_parameter(name, sharded)
            parametrize.register_parametrization(owner, name, gather, unsafe=True)
    return module


def sharded_parameters(module: nn.Module) -> dict[str, DTensor]:
    """The sharded parameters of a `simple_fsdp` module by their plain names (for inspection)."""
    suffix = ".parametrizations."
    out = {}
    for name, param in module.named_parameters():
        if suffix in name and name.endswith(".original"):
            head, _, tail = name.partition(suffix)
            out[f"{head}.{tail.removesuffix('.original')}"] = param
    return out
