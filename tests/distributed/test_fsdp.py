"""FSDP2 (`fully_shard`) on neuron ranks with bf16 parameters and fp32 gradient reduction: losses,
gradients and updated parameters equal a single-process run that computes in bf16 the same way."""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from .helpers import batch, cpu_grads, cpu_state, max_diff, mlp, sgd_reference

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(180)]

STEPS = 2
POLICY = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _fsdp_job(reshard_after_forward: bool) -> dict:
    dist.init_process_group("neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = mlp().to("neuron")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=POLICY, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=POLICY)
    first = model[0]
    out = {"sharded_dim0": first.weight.to_local().shape[0] * world == 32}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out["losses"] = []
    for step in range(STEPS):
        x, y = batch(step, rank, device="neuron")
        prediction = model(x)
        out.setdefault("sharded_after_forward", isinstance(first.weight, DTensor))
        loss = F.mse_loss(prediction.float(), y)
        loss.backward()
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = cpu_grads(model)
            out["grad_dtype"] = str(first.weight.grad.dtype)
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = cpu_state(model)
    dist.destroy_process_group()
    return out


def _reference(world: int) -> dict:
    """fp32 master weights; each rank's forward/backward on a bf16 copy; fp32 mean of the bf16 grads."""
    def set_grads(master: torch.nn.Module, step: int, losses: list) -> None:
        grads = [torch.zeros_like(p) for p in master.parameters()]
        for rank in range(world):
            low = copy.deepcopy(master).to(torch.bfloat16)
            x, y = batch(step, rank)
            loss = F.mse_loss(low(x.to(torch.bfloat16)).float(), y)
            loss.backward()
            losses.append((rank, loss.item()))
            for total, p in zip(grads, low.parameters()):
                total += p.grad.float()
        for p, total in zip(master.parameters(), grads):
            p.grad = total / world
    return sgd_reference(STEPS, set_grads)


@pytest.mark.parametrize("world,reshard_after_forward", [(2, True), (2, False), (4, True)],
                         ids=["2ranks_reshard", "2ranks_keep_unsharded", "4ranks_reshard"])
def test_fsdp2_mixed_precision_matches_single_process(request, world, reshard_after_forward):
    ranks = request.getfixturevalue(f"pool{world}").run(_fsdp_job, (reshard_after_forward,), timeout=150)
    reference = _reference(len(ranks))
    for rank, out in enumerate(ranks):
        assert out["sharded_dim0"]
        assert out["sharded_after_forward"] is reshard_after_forward
        assert out["grad_dtype"] == "torch.float32"  # reduced in fp32, kept with the fp32 shards
        assert out["losses"] == pytest.approx([loss for r, loss in reference["losses"] if r == rank], rel=1e-6)
        assert max_diff(out["grads"], reference["grads"]) < 1e-6
        assert max_diff(out["params"], reference["params"]) < 1e-6
