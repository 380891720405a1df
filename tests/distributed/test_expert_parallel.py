"""Expert parallelism over the neuron process group: two ranks, each with half the experts and its
own tokens, give the single-process MoE layer's outputs and gradients."""
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from torchneuron.distributed.expert_parallel import ExpertParallelMoE, moe_reference

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

H, I, E, TOP_K, TOKENS = 16, 24, 4, 2, 10


def _layer(seed: int = 0):
    torch.manual_seed(seed)
    router = nn.Linear(H, E, bias=False)
    return router, torch.randn(E, H, 2 * I) * 0.2, torch.randn(E, I, H) * 0.2


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(10 + rank))


def _ep_job() -> dict:
    dist.init_process_group("neuron")
    rank, ranks = dist.get_rank(), dist.get_world_size()
    router, w_gate_up, w_down = _layer()
    per = E // ranks
    layer = ExpertParallelMoE(router.to("neuron"), w_gate_up[rank * per:(rank + 1) * per].to("neuron"),
                              w_down[rank * per:(rank + 1) * per].to("neuron"), TOP_K)
    out = layer(_tokens(rank).to("neuron"))
    out.pow(2).sum().backward()
    router_grad = layer.router.weight.grad.clone()
    dist.all_reduce(router_grad)
    result = {"out": out.detach().cpu(), "w_gate_up": layer.w_gate_up.grad.cpu(), "w_down": layer.w_down.grad.cpu(),
              "router": router_grad.cpu(), "rank": rank, "per": per}
    dist.destroy_process_group()
    return result


def test_two_rank_expert_parallel_equals_one_process(pool2):
    router, w_gate_up, w_down = _layer()
    w_gate_up.requires_grad_(True)
    w_down.requires_grad_(True)
    x = torch.cat([_tokens(0), _tokens(1)])
    expected = moe_reference(x, router, w_gate_up, w_down, TOP_K)
    expected.pow(2).sum().backward()
    for out in pool2.run(_ep_job, timeout=150):
        rank, per = out["rank"], out["per"]
        mine = slice(rank * per, (rank + 1) * per)
        torch.testing.assert_close(out["out"], expected[rank * TOKENS:(rank + 1) * TOKENS].detach(),
                                   rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["w_gate_up"], w_gate_up.grad[mine], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out["w_down"], w_down.grad[mine], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(out["router"], router.weight.grad, rtol=1e-4, atol=1e-4)
