// The host path of the NKI decode-attention kernel (decode_attention.cpp), for the serving layer's
// decode step (serving/llm/csrc/fused_layers.cpp) as for the `torchneuron::paged_decode_attention_host` op.
#pragma once
#include "neuron.h"

namespace torchneuron {

// Attention of q [B, T, Hq, d] (CPU) over a paged kv_cache [blocks, Hkv, 2 * bs, d] through
// block_table [B, W] with context_lens [B] or [B, 1], with the NKI kernel's numerics; a new
// [B, T, Hq, d] tensor.
at::Tensor paged_decode_attention_host(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                       const at::Tensor& context_lens, double scale);

}  // namespace torchneuron
