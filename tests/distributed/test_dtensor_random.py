"""DTensor random ops on a neuron mesh (dtensor_random.py): sharded `normal_` no longer fails in
DTensor's Philox-offset tracker; shards differ, a replicated tensor is the same on every rank, and
every rank's generator ends in the same state."""
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.device_mesh import init_device_mesh


def _job() -> dict:
    dist.init_process_group("neuron")
    mesh = init_device_mesh("neuron", (dist.get_world_size(),))
    torch.manual_seed(0)
    sharded = distribute_tensor(torch.empty(8, 4, device="neuron"), mesh, [Shard(0)])
    sharded.normal_()
    replicated = distribute_tensor(torch.empty(6, device="neuron"), mesh, [Replicate()])
    replicated.uniform_()
    after = torch.rand(3, device="neuron")
    return {"shard": sharded.to_local().cpu(), "replicated": replicated.to_local().cpu(), "after": after.cpu()}


def test_sharded_random_init_on_neuron_mesh(pool2):
    rank0, rank1 = pool2.run(_job)
    assert not torch.equal(rank0["shard"], rank1["shard"])
    assert rank0["shard"].std() > 0.5
    torch.testing.assert_close(rank0["replicated"], rank1["replicated"], rtol=0, atol=0)
    torch.testing.assert_close(rank0["after"], rank1["after"], rtol=0, atol=0)
