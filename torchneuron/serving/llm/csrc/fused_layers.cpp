// The device kernels of vLLM's fused layers on the neuron platform (serving/llm/layers.py calls
// them): RMSNorm with and without the residual add, SiLU-and-mul, rotary embedding, the KV-cache
// write and a decode step's attention, the PrivateUse1 kernels of the `neuron_serving` ops
// kernels.py defines.
//
// Each call is one kernel: it computes on zero-copy host aliases of the device tensors with the
// arithmetic vLLM's CPU platform runs, then appends one work-log record that the device timeline
// prices like any op (hardware/model.py: the norms, SiLU and the KV-cache write by name). A
// decode step calls them once per layer each, so they are C++: a Python kernel cost ~30 us of
// host time a call, most of a tiny model's step.
//
// Rounding points (kernels.py explains why): RMSNorm normalises in float32, rounds to the input
// dtype, then multiplies by the weight in its dtype; SiLU-and-mul rounds the SiLU to the input
// dtype before the product. Rotary embedding and the KV-cache write are vLLM's own CPU kernels
// (`_C::rotary_embedding`, `_C::cpu_attn_reshape_and_cache`) run on the aliases. Decode attention
// is the NKI decode-attention kernel's host path, charged as `nki_kernels::decode_attention`
// (priced by the kernel's simulation, kernels/pricing.py).
#include "decode_attention.h"
#include "host_alias.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace torchneuron {
namespace {

c10::OperatorHandle serving_op(const char* name) {
  // one handle per op, looked up on first use (the schemas are defined from Python, kernels.py)
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Device memory is read directly below: run anything adaptive eager mode still queues first.
void ready() { adaptive_flush("a serving kernel reads device memory"); }

DeviceIndex device_index_of(const Tensor& t) { return is_neuron(t) ? t.device().index() : 0; }

// RMSNorm of float32 rows `summed` into `out` with vLLM-native's (and transformers') rounding
// points: normalise in float32, round to the weight's dtype, multiply by the weight, round to
// out's dtype. `summed` may be overwritten when `own_summed` (a temporary of the caller's).
// Fewer, in-place ATen calls than the Python expression, the same arithmetic element by element.
void normalise_into(Tensor& out, Tensor summed, bool own_summed, const Tensor& weight, double eps) {
  Tensor scale = summed.pow(2).mean({-1}, /*keepdim=*/true);
  scale.add_(eps).rsqrt_();
  Tensor normed = own_summed ? summed.mul_(scale) : summed * scale;
  if (weight.scalar_type() == out.scalar_type() && normed.scalar_type() != weight.scalar_type()) {
    at::mul_out(out, normed.to(weight.scalar_type()), weight);  // rounded once, into out
  } else {
    out.copy_((normed.to(weight.scalar_type()) * weight).to(out.scalar_type()));
  }
}

void rms_norm(Tensor& out, const Tensor& x, const Tensor& weight, double eps) {
  ready();
  {
    at::AutoDispatchBelowADInplaceOrView below;
    const Tensor hx = maybe_alias(x);
    Tensor ho = maybe_alias(out);
    const Tensor summed = hx.to(at::kFloat);
    normalise_into(ho, summed, /*own_summed=*/!summed.is_same(hx), maybe_alias(weight), eps);
  }
  static const c10::OperatorHandle op = serving_op("neuron_serving::rms_norm");
  record_kernel(op, {sig_of(x), sig_of(weight)}, {sig_of(out)}, device_index_of(x));
}

void fused_add_rms_norm(Tensor& x, Tensor& residual, const Tensor& weight, double eps) {
  ready();
  {
    at::AutoDispatchBelowADInplaceOrView below;
    Tensor hx = maybe_alias(x), hres = maybe_alias(residual);
    // both read as float32 (exact), the sum in float32: a new tensor
    const Tensor summed = at::add(hx.to(at::kFloat), hres.to(at::kFloat));
    hres.copy_(summed);  // the new residual, rounded to its dtype; the norm reads the float32 sum
    normalise_into(hx, summed, /*own_summed=*/true, maybe_alias(weight), eps);
  }
  // one pass: read x, residual and the weight, write the normalised x and the sum (the new
  // residual): the two writes as one signature of their bytes (a record holds four)
  const int64_t written = (x.nbytes() + residual.nbytes()) / x.element_size();
  static const c10::OperatorHandle op = serving_op("neuron_serving::fused_add_rms_norm");
  record_kernel(op, {sig_of(x), sig_of(residual), sig_of(weight)}, {sig_of_numel(x.scalar_type(), written)},
                device_index_of(x));
}

void silu_and_mul(Tensor& out, const Tensor& x) {
  ready();
  {
    at::AutoDispatchBelowADInplaceOrView below;
    const Tensor hx = maybe_alias(x);
    const int64_t half = hx.size(-1) / 2;
    Tensor ho = maybe_alias(out);
    at::mul_out(ho, at::silu(hx.narrow(-1, 0, half)), hx.narrow(-1, half, half));
  }
  static const c10::OperatorHandle op = serving_op("neuron_serving::silu_and_mul");
  record_kernel(op, {sig_of(x)}, {sig_of(out)}, device_index_of(x));
}

// Calls the CPU op `name` of vLLM's extension boxed with `args`, the schema's defaults for the rest.
void call_vllm_cpu_kernel(const char* name, Stack args) {
  const c10::OperatorHandle& handle = c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
  const auto& params = handle.schema().arguments();
  for (size_t i = args.size(); i < params.size(); ++i) {
    TORCH_CHECK(params[i].default_value().has_value(), "vLLM's ", name, " has an argument the neuron kernel does not "
                "pass (", params[i].name(), "): this vLLM is not the version torchneuron serves with (vllm-cpu 0.32)");
    args.push_back(*params[i].default_value());
  }
  at::AutoDispatchBelowADInplaceOrView below;
  handle.callBoxed(args);
}

void rotary_embedding(const Tensor& positions, Tensor& query, const std::optional<Tensor>& key, int64_t head_size,
                      const Tensor& cos_sin_cache, bool is_neox) {
  ready();
  const bool has_key = key.has_value() && key->defined();
  call_vllm_cpu_kernel("_C::rotary_embedding",
                       {maybe_alias(positions), maybe_alias(query), has_key ? IValue(maybe_alias(*key)) : IValue(),
                        head_size, maybe_alias(cos_sin_cache), is_neox});
  // reads the positions, their cos/sin rows and the query and key; writes the query and key
  const int64_t rotated = query.numel() + (has_key ? key->numel() : 0);
  const TensorSig heads = sig_of_numel(query.scalar_type(), rotated);
  static const c10::OperatorHandle op = serving_op("neuron_serving::rotary_embedding");
  const TensorSig rows = sig_of_numel(cos_sin_cache.scalar_type(), positions.numel() * cos_sin_cache.size(-1));
  record_kernel(op, {sig_of(positions), rows, heads}, {heads}, device_index_of(query));
}

void reshape_and_cache(const Tensor& key, const Tensor& value, Tensor& key_cache, Tensor& value_cache,
                       const Tensor& slot_mapping, c10::string_view isa) {
  ready();
  call_vllm_cpu_kernel("_C::cpu_attn_reshape_and_cache",
                       {maybe_alias(key), maybe_alias(value), maybe_alias(key_cache), maybe_alias(value_cache),
                        maybe_alias(slot_mapping), std::string(isa)});
  // priced by the rows written (model.py's reshape_and_cache): the new keys, values and slots read
  static const c10::OperatorHandle op = serving_op("neuron_serving::reshape_and_cache");
  record_kernel(op, {sig_of(key), sig_of(value), sig_of(slot_mapping)}, {sig_of(key_cache)}, device_index_of(key));
}

// A decode step's attention (every sequence `tokens` new tokens, the operands checked by
// kernels.py's _decode_refusal): query [B * T, Hq, d], kv_cache [blocks, Hkv, 2 * bs, d], the
// first B rows of seq_lens and block_table; the NKI kernel walks the table's first
// ceil(longest context / bs) columns. The result goes into output [B * T, Hq, d].
void decode_attention(const Tensor& query, const Tensor& kv_cache, Tensor& output, const Tensor& seq_lens,
                      const Tensor& block_table, int64_t tokens, double scale) {
  ready();
  const int64_t b = query.size(0) / tokens, bs = kv_cache.size(2) / 2;
  Tensor table;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    const Tensor lens = maybe_alias(seq_lens).narrow(0, 0, b);
    const int64_t longest = lens.max().item<int64_t>();
    table = maybe_alias(block_table).narrow(0, 0, b).narrow(1, 0, (longest + bs - 1) / bs);
    const Tensor q = maybe_alias(query).reshape({b, tokens, query.size(1), query.size(2)});
    const Tensor result = paged_decode_attention_host(q, maybe_alias(kv_cache), table, lens, scale);
    maybe_alias(output).copy_(result.view(output.sizes()));
  }
  static const c10::OperatorHandle op = serving_op("nki_kernels::decode_attention");
  // q as the kernel takes it: [B, T, Hq, d]
  const TensorSig q = sig_of_shape(query.scalar_type(), {b, tokens, query.size(1), query.size(2)});
  record_kernel(op, {q, sig_of(kv_cache), sig_of(table)}, {q}, device_index_of(query));
}

}  // namespace

TORCH_LIBRARY_IMPL(neuron_serving, PrivateUse1, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("reshape_and_cache", &reshape_and_cache);
  m.impl("decode_attention", &decode_attention);
}

}  // namespace torchneuron
