"""The attention backend `NEURON_PAGED_ATTN`: paged attention over vLLM's block table on neuron.

vLLM's scheduler, block tables and metadata are the CPU backend's (same KV-cache layout:
[blocks, kv_heads, block_size, 2 * head_size], K and V halves of each block row); the two
device-side steps of every layer, writing the step's keys/values into their cache slots and
attending over each sequence's cached context, are neuron kernels (kernels.py): the KV-cache write
`neuron_serving::reshape_and_cache`; attention of a decode step through the NKI decode-attention
kernel `nki_kernels::decode_attention` (vLLM's cache layout and block table, charged the kernel's
simulated latency), of a step with prefill chunks through `neuron_serving::paged_attention`
(prefill chunks and decodes in one kernel, priced by the context it reads).
"""
from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionLayer, AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend, CPUAttentionBackendImpl, CPUAttentionMetadata, CPUAttentionMetadataBuilder,
)

from torchneuron.serving.llm import kernels
from torchneuron.serving.llm.kernels import ops
from torchneuron.serving.llm.platform import ATTENTION_BACKEND as NAME


def _rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """A [blocks, kv_heads, block_size, 2 * head_size] cache as [blocks, kv_heads, 2 * block_size,
    head_size]: each block's key rows, then its value rows."""
    blocks, kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(blocks, kv_heads, 2 * block_size, -1)


def _split(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V views of a [blocks, kv_heads, block_size, 2 * head_size] cache."""
    return _rows(kv_cache).chunk(2, dim=2)


class NeuronAttentionImpl(CPUAttentionBackendImpl):
    """Decoder self-attention through the neuron kernels; encoder attention types and quantized
    KV caches are refused at construction (the kernels implement neither)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"{NAME} runs decoder self-attention only, not {self.attn_type!r} attention.")
        if self.is_fp8_kv_cache:
            raise NotImplementedError(f"{NAME} has no FP8 KV cache: use --kv-cache-dtype auto.")

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: CPUAttentionMetadata | None, output: torch.Tensor,
                output_scale: torch.Tensor | None = None, output_block_scale: torch.Tensor | None = None,
                ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{NAME} has no fused output quantization.")
        if attn_metadata is None:  # a warm-up pass without a KV cache
            return output
        if attn_metadata.dynamic_causal is not None:
            raise NotImplementedError(f"{NAME} has no per-request causal mask.")
        n = attn_metadata.num_actual_tokens
        kernels.paged_attention(query[:n], _rows(kv_cache), output[:n], attn_metadata.query_start_loc,
                                attn_metadata.seq_lens, layer.isa, self.scale, attn_metadata.causal, self.alibi_slopes,
                                self.sliding_window, attn_metadata.block_table, float(self.logits_soft_cap),
                                attn_metadata.scheduler_metadata, self._sinks(),
                                step_memo=attn_metadata.__dict__.setdefault("_neuron_kernel_choice", {}))
        return output

    def _sinks(self) -> torch.Tensor | None:
        if self.sinks is not None and self.sinks.dtype not in (torch.bfloat16, torch.float32):
            self.sinks = self.sinks.to(torch.float32)  # the kernel reads sinks in bf16 or fp32
        return self.sinks

    def do_kv_cache_update(self, layer: torch.nn.Module, key: torch.Tensor, value: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key_cache, value_cache = _split(kv_cache)
        ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, layer.isa)


class NeuronAttentionBackend(CPUAttentionBackend):
    """vLLM's paged attention backend for the neuron device (decoder models)."""

    supported_kv_cache_dtypes = ["auto"]

    @staticmethod
    def get_name() -> str:
        return NAME

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @staticmethod
    def get_impl_cls() -> type[NeuronAttentionImpl]:
        return NeuronAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[CPUAttentionMetadataBuilder]:
        return CPUAttentionMetadataBuilder
