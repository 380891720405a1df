"""Functional collectives inside a graph compiled by the neuron backend are charged as eager mode
charges them: by the c10d backend, on the group's communication stream, when they run. The plan
gives them no kernel of their own (they were once priced as Vector-engine elementwise work)."""
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from torchneuron.compiler.partition import COMM, partition
from torchneuron.distributed import free_port
from torchneuron.hardware import estimate

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def one_rank_group(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHNEURON_COMPILE_CACHE_DIR", str(tmp_path))
    dist.init_process_group("neuron", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def _reduce_then_scale(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    y = funcol.all_reduce(x @ w, "sum", dist.group.WORLD)
    return torch.relu(y) * 2


def test_functional_collectives_are_charged_by_the_backend_not_the_plan(one_rank_group):
    x, w = (torch.randn(128, 128, device="neuron") for _ in range(2))
    compiled = torch.compile(_reduce_then_scale, backend="neuron", fullgraph=True)
    expected = _reduce_then_scale(x, w)
    torch.testing.assert_close(compiled(x, w), expected)
    with estimate("trn2") as est:
        compiled(x, w)
        torch.neuron.synchronize()
    rows = {row.name: row for row in est.per_op}
    assert rows["c10d::all_reduce"].engine == "link"
    planned = [name for name in rows if "all_reduce" in name or "wait_tensor" in name]
    assert planned == ["c10d::all_reduce"], rows


def test_partition_places_functional_collectives_on_the_comm_stream():
    from torch.fx.experimental.proxy_tensor import make_fx

    def graph(x):
        return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", "0")) + 1

    gm = make_fx(graph, tracing_mode="fake", pre_dispatch=False)(torch.ones(4, device="neuron"))
    placements = partition(gm).placements
    collectives = {n.name: placements[n.name] for n in gm.graph.nodes
                   if n.op == "call_function" and "_c10d_functional" in str(n.target)}
    assert collectives and set(collectives.values()) == {COMM}
    assert "device" in placements.values()        # the add stays a device kernel
