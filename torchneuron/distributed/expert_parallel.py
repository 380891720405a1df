"""Expert parallelism: a mixture-of-experts layer's experts split over the ranks of a group.

`ExpertParallelMoE(router, w_gate_up, w_down, group)` holds this rank's slice of the experts
(experts `rank * E/R ... (rank + 1) * E/R - 1` of E, over R ranks) and runs a routed SwiGLU
expert layer on the tokens of this rank:

1. route: top-k experts and their softmax weights per token (the router is a Linear);
2. dispatch: each (token, expert) pair is sent to the rank owning the expert with one
   `all_to_all_single` (split sizes exchanged first, a second small all-to-all);
3. compute: the received rows sorted by local expert, one `torch._grouped_mm` per projection
   (offsets from `bincount` of the local expert ids);
4. combine: the results return by the reverse all-to-all and are summed per token with the
   routing weights.

Both all-to-alls are differentiable (torch.distributed.nn.functional), so the backward sends the
gradients the same way. `moe_reference` is the same layer in one process over all experts, which
expert parallelism must reproduce.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.nn.functional import all_to_all_single

__all__ = ["ExpertParallelMoE", "moe_reference", "route"]


def route(router: nn.Module, x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k], their weights [T, k]): the top-k of the router's softmax, renormalised."""
    probs = F.softmax(router(x), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    return experts, (weights / weights.sum(-1, keepdim=True)).to(x.dtype)


def _experts_forward(rows: torch.Tensor, local_ids: torch.Tensor, w_gate_up: torch.Tensor,
                     w_down: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over `rows` whose expert (in this bank) is `local_ids`: grouped matmuls."""
    experts = w_gate_up.shape[0]
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids, minlength=experts)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    gate, up = torch._grouped_mm(rows[order], w_gate_up, offs).chunk(2, dim=-1)
    out = torch._grouped_mm(F.silu(gate) * up, w_down, offs)
    return torch.empty_like(out).index_copy(0, order, out)


def moe_reference(x: torch.Tensor, router: nn.Module, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                  top_k: int) -> torch.Tensor:
    """The MoE layer in one process, all experts local: x [T, H] -> [T, H]."""
    experts, weights = route(router, x, top_k)
    rows = x.repeat_interleave(top_k, dim=0)
    out = _experts_forward(rows, experts.reshape(-1), w_gate_up, w_down)
    return (out.view(-1, top_k, x.shape[-1]) * weights[..., None]).sum(1)


class ExpertParallelMoE(nn.Module):
    """A routed SwiGLU expert layer whose experts are split evenly over `group`'s ranks.

    router: Linear(H, E) (replicated); w_gate_up [E/R, H, 2I] and w_down [E/R, I, H]: this rank's
    experts (e.g. `full[rank * E/R:(rank + 1) * E/R]`)."""

    def __init__(self, router: nn.Module, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int,
                 group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group or dist.group.WORLD
        self.ranks = dist.get_world_size(self.group)
        self.router, self.top_k = router, top_k
        self.w_gate_up = nn.Parameter(w_gate_up)
        self.w_down = nn.Parameter(w_down)
        self.local_experts = w_gate_up.shape[0]
        if router.out_features != self.local_experts * self.ranks:
            raise ValueError(f"the router scores {router.out_features} experts, but {self.ranks} ranks x "
                             f"{self.local_experts} local experts = {self.local_experts * self.ranks}")

    def _exchange_counts(self, send: torch.Tensor) -> list[int]:
        received = torch.empty_like(send)
        dist.all_to_all_single(received, send, group=self.group)
        return received.tolist()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts, weights = route(self.router, x, self.top_k)
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)                      # pairs grouped by owning rank
        owner = flat[order] // self.local_experts
        send_counts = torch.bincount(owner, minlength=self.ranks)
        recv_counts = self._exchange_counts(send_counts)
        send_counts = send_counts.tolist()
        rows = x.repeat_interleave(self.top_k, dim=0)[order]
        received = all_to_all_single(rows.new_empty(sum(recv_counts), x.shape[-1]), rows, recv_counts, send_counts,
                                     group=self.group)
        local_ids = torch.empty(sum(recv_counts), dtype=flat.dtype, device=x.device)
        dist.all_to_all_single(local_ids, (flat[order] % self.local_experts).contiguous(), recv_counts,
                               send_counts, group=self.group)
        out = _experts_forward(received, local_ids, self.w_gate_up, self.w_down)
        back = all_to_all_single(rows.new_empty(rows.shape), out, send_counts, recv_counts, group=self.group)
        combined = torch.empty_like(back).index_copy(0, order, back)   # original (token, k) order
        return (combined.view(-1, self.top_k, x.shape[-1]) * weights[..., None]).sum(1)
