"""Distributed checkpointing (`torch.distributed.checkpoint`) of an FSDP2 model and its optimizer:
written by 4 neuron ranks, read back by 2 ranks with a different sharding, values unchanged."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard

from .helpers import batch, cpu_state, mlp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


def _sharded(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = mlp(seed=seed).to("neuron")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def _exp_avg(optimizer_state: dict) -> dict[str, torch.Tensor]:
    return {name: state["exp_avg"].full_tensor().cpu() for name, state in optimizer_state["state"].items()}


def _save_job(path: str) -> dict:
    dist.init_process_group("neuron")
    model, optimizer = _sharded(seed=0)
    x, y = batch(0, dist.get_rank(), device="neuron")
    F.mse_loss(model(x), y).backward()
    optimizer.step()
    model_state, optimizer_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    out = {"params": cpu_state(model), "exp_avg": _exp_avg(optimizer_state)}
    dist.destroy_process_group()
    return out


def _load_job(path: str) -> dict:
    dist.init_process_group("neuron")
    model, optimizer = _sharded(seed=1)  # different weights, to be overwritten
    x, y = batch(0, dist.get_rank(), device="neuron")
    F.mse_loss(model(x), y).backward()
    optimizer.step()  # creates optimizer state to load into
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    out = {"params": cpu_state(model), "exp_avg": _exp_avg(get_state_dict(model, optimizer)[1]),
           "local_rows": model[0].weight.to_local().shape[0]}
    dist.destroy_process_group()
    return out


def test_checkpoint_written_by_4_ranks_loads_on_2(pool4, pool2, tmp_path):
    path = str(tmp_path / "checkpoint")
    saved = pool4.run(_save_job, (path,), timeout=150)[0]
    loaded = pool2.run(_load_job, (path,), timeout=150)
    assert saved["params"]["0.weight"].shape == (32, 16)
    for out in loaded:
        assert out["local_rows"] == 16  # 32 rows over 2 ranks (they were written as 4 shards of 8)
        for name, value in saved["params"].items():
            assert torch.equal(out["params"][name], value), name
        for name, value in saved["exp_avg"].items():
            assert torch.equal(out["exp_avg"][name], value), name
