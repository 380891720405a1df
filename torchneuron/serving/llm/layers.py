"""vLLM's fused layers as single neuron kernels: RMSNorm (with and without the residual add),
rotary embedding and SiLU-and-mul, registered with `CustomOp.register_oot` so vLLM builds these
classes in place of its own on the neuron platform. vLLM's native versions are several small
elementwise kernels each; here each call is one kernel (kernels.py) on the device timeline.
Cases the kernels don't cover (a weightless norm, a variance over part of the hidden size, a
rotary call without keys) keep vLLM's native path.
"""
from __future__ import annotations

import torch
from vllm.model_executor.layers.activation import SiluAndMul
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


def register() -> None:
    """Registers the neuron layers with vLLM (idempotent; before the model is built)."""
    global _registered
    if _registered:
        return
    RMSNorm.register_oot(NeuronRMSNorm)
    SiluAndMul.register_oot(NeuronSiluAndMul)
    RotaryEmbedding.register_oot(NeuronRotaryEmbedding)
    _registered = True
