"""SimpleFSDP-style sharding (`torchneuron.distributed.simple_fsdp`) under torch.compile: the graphs
hold functional all-gathers and reduce-scatters, and training matches a single-process run."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.device_mesh import init_device_mesh

from .helpers import batch, data_parallel_reference, max_diff, mlp
from torchneuron.distributed.parallel import sharded_parameters, simple_fsdp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

STEPS = 2


def _train(model: torch.nn.Module, forward, rank: int, world: int) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": []}
    for step in range(STEPS):
        x, y = batch(step, rank, device="neuron")
        loss = F.mse_loss(forward(x), y)
        loss.backward()
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {name: p.grad.full_tensor().cpu() for name, p in sharded_parameters(model).items()}
            out["local_rows"] = sharded_parameters(model)["0.weight"].to_local().shape[0]
        optimizer.step()
        optimizer.zero_grad()
    return out


def _simple_fsdp_job() -> dict:
    dist.init_process_group("neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("neuron", (world,))
    graphs: list[list[str]] = []

    def record(gm: torch.fx.GraphModule, inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if "c10d_functional" in str(n.target)])
        return make_boxed_func(gm.forward)

    eager = simple_fsdp(mlp().to("neuron"), mesh)
    compiled = simple_fsdp(mlp().to("neuron"), mesh)
    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    out = {"eager": _train(eager, eager, rank, world),
           "compiled": _train(compiled, torch.compile(compiled, backend=backend), rank, world),
           "graphs": graphs}
    dist.destroy_process_group()
    return out


def test_simple_fsdp_eager_and_compiled_match_single_process(pool2):
    ranks = pool2.run(_simple_fsdp_job, timeout=200)
    reference = data_parallel_reference(len(ranks), STEPS)
    for rank, out in enumerate(ranks):
        for mode in ("eager", "compiled"):
            assert out[mode]["local_rows"] == 32 // len(ranks)
            assert out[mode]["losses"] == pytest.approx([v for r, v in reference["losses"] if r == rank], rel=1e-5)
            assert max_diff(out[mode]["grads"], reference["grads"]) < 1e-6
        forward, backward = out["graphs"][:2]
        assert forward.count("_c10d_functional.all_gather_into_tensor.default") == 6  # one per parameter
        assert backward.count("_c10d_functional.reduce_scatter_tensor.default") == 6
        assert forward.count("_c10d_functional.wait_tensor.default") == 6
