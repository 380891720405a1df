"""vLLM's fused layers as single neuron kernels: RMSNorm (with and without the residual add),
rotary embedding and SiLU-and-mul, registered with `CustomOp.register_oot` so vLLM builds these
classes in place of its own on the neuron platform. vLLM's native versions are several small
elementwise kernels each; here each call is one kernel (kernels.py) on the device timeline.
Cases the kernels don't cover (a weightless norm, a variance over part of the hidden size, a
rotary call without keys) keep vLLM's native path.

vLLM leaves the unquantized MoE experts to an out-of-tree platform ("OOT handles internally"):
`NeuronFusedMoEMethod` runs them per expert on the device (gather the expert's tokens, gate/up
matmul, SiLU-and-mul, down matmul, weighted scatter-add), grouping tokens by expert on the host
from the router's choices.
"""
from __future__ import annotations

import torch
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

from torchneuron.serving.llm.kernels import ops

_registered = False


class NeuronRMSNorm(RMSNorm):
    def forward_oot(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.variance_size_override is not None or not self.has_weight or x.device.type != "neuron":
            return self.forward_native(x, residual)
        x = x.contiguous()
        if residual is None:
            out = torch.empty_like(x)
            ops.rms_norm(out, x, self.weight.data, self.variance_epsilon)
            return out
        ops.fused_add_rms_norm(x, residual, self.weight.data, self.variance_epsilon)  # in place: both
        return x, residual


class NeuronSiluAndMul(SiluAndMul):
    def forward_oot(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "neuron":
            return self.forward_native(x)
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        ops.silu_and_mul(out, x.contiguous())
        return out


class NeuronRotaryEmbedding(RotaryEmbedding):
    def forward_oot(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor | None = None):
        if key is None or query.device.type != "neuron":
            return self.forward_native(positions, query, key)
        cos_sin_cache = self._match_cos_sin_cache_dtype(query)
        ops.rotary_embedding(positions, query, key, self.head_size, cos_sin_cache, self.is_neox_style)
        return query, key


class NeuronFusedMoEMethod(UnquantizedFusedMoEMethod):
    @property
    def is_monolithic(self) -> bool:
        return False  # routing runs in vLLM's router; the experts here

    def forward_oot(self, layer, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    shared_experts=None, shared_experts_input=None) -> torch.Tensor:
        if shared_experts is not None or layer.expert_map is not None or layer.apply_router_weight_on_input:
            raise NotImplementedError("The neuron MoE experts support neither shared experts, expert "
                                      "parallelism nor router weights applied to the input yet.")
        if str(getattr(layer.activation, "value", layer.activation)) != "silu":
            raise NotImplementedError(f"The neuron MoE experts run SiLU-gated experts, not {layer.activation}.")
        w13, w2 = layer.w13_weight, layer.w2_weight  # [experts, 2 * inter, hidden], [experts, hidden, inter]
        out = torch.zeros_like(x)
        choices = topk_ids.cpu()
        for expert in torch.unique(choices).tolist():
            tokens, slots = (choices == expert).nonzero(as_tuple=True)
            rows = tokens.to(x.device)
            h = x.index_select(0, rows) @ w13[expert].t()
            act = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
            ops.silu_and_mul(act, h)
            y = (act @ w2[expert].t()) * topk_weights[rows, slots.to(x.device)].unsqueeze(1).to(x.dtype)
            out.index_add_(0, rows, y)
        return out


def register() -> None:
    """Registers the neuron layers with vLLM (idempotent; before the model is built)."""
    global _registered
    if _registered:
        return
    RMSNorm.register_oot(NeuronRMSNorm)
    SiluAndMul.register_oot(NeuronSiluAndMul)
    RotaryEmbedding.register_oot(NeuronRotaryEmbedding)
    UnquantizedFusedMoEMethod.register_oot(NeuronFusedMoEMethod)
    _registered = True
