"""Tensor parallelism (colwise/rowwise with sequence parallel) on 2 ranks and FSDP2 + TP with DTensor
on a 2-D (dp x tp) mesh on 4 ranks, against single-process runs of the example's tiny Llama."""
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from .helpers import cpu_grads, max_diff
from torchneuron.examples.train_distributed import LlamaConfig, TinyLlama, batch, build, loss_fn

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

CFG = LlamaConfig()
ROWS = 2  # sequences per data-parallel rank


def _one_step(dp: int, tp: int, param_dtype: torch.dtype) -> dict:
    model, mesh = build(CFG, dp, tp, param_dtype)
    inputs, targets = batch(CFG, 0, mesh["dp"].get_local_rank(), ROWS)
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=mesh["dp"].get_group())
    wq = model.layers[0].attention.wq.weight
    return {"loss": mean.item(), "grads": cpu_grads(model), "wq_placements": [str(p) for p in wq.placements]}


def _tp_job() -> dict:
    dist.init_process_group("neuron")
    out = _one_step(1, dist.get_world_size(), torch.float32)
    dist.destroy_process_group()
    return out


def _two_d_job() -> dict:
    dist.init_process_group("neuron")
    out = {"fp32": _one_step(2, 2, torch.float32), "bf16": _one_step(2, 2, torch.bfloat16)}
    mesh = dist.device_mesh.init_device_mesh("neuron", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(3)
    a, b = torch.randn(8, 6), torch.randn(6, 4)
    da = distribute_tensor(a.to("neuron"), mesh, [Shard(0), Shard(1)])
    db = distribute_tensor(b.to("neuron"), mesh, [Replicate(), Shard(0)])
    product = (da @ db).redistribute(mesh, [Replicate(), Replicate()])
    out["dtensor"] = {"local_shape": list(da.to_local().shape), "product": product.to_local().cpu(),
                      "expected": a @ b}
    dist.destroy_process_group()
    return out


def _reference(dp: int) -> dict:
    torch.manual_seed(0)
    model = TinyLlama(CFG)
    pieces = [batch(CFG, 0, rank, ROWS) for rank in range(dp)]
    inputs, targets = (torch.cat([p[i].cpu() for p in pieces]) for i in (0, 1))
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    return {"loss": loss.item(), "grads": cpu_grads(model)}


def test_tensor_parallel_with_sequence_parallel_matches_single_process(pool2):
    reference = _reference(1)
    for out in pool2.run(_tp_job, timeout=150):
        assert out["wq_placements"] == ["S(0)"]  # colwise: output features split
        assert out["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert max_diff(out["grads"], reference["grads"]) < 1e-5


@pytest.fixture(scope="module")
def two_d(pool4):
    return pool4.run(_two_d_job, timeout=200)


def test_fsdp2_plus_tp_on_a_2d_mesh_matches_single_process(two_d):
    reference = _reference(2)
    for out in two_d:
        fp32, bf16 = out["fp32"], out["bf16"]
        assert fp32["wq_placements"] == ["_S(0, 2)", "S(0)"]  # FSDP shards (strided) the TP shard
        assert fp32["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert max_diff(fp32["grads"], reference["grads"]) < 1e-5
        assert bf16["loss"] == pytest.approx(reference["loss"], rel=2e-2)  # bf16 compute
        assert max_diff(bf16["grads"], reference["grads"]) < 5e-2


def test_dtensor_on_a_2d_mesh(two_d):
    for out in two_d:
        d = out["dtensor"]
        assert d["local_shape"] == [4, 3]
        torch.testing.assert_close(d["product"], d["expected"], rtol=1e-5, atol=1e-5)
