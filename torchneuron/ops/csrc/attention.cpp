// scaled_dot_product_attention on neuron, by PyTorch's contract for an out-of-tree device.
//
// SDPA asks a per-device choice function (ATen's `_fused_sdp_choice_stub`) which backend to use.
// PyTorch reserves one for backends like this one: `SDPBackend::overrideable`, which dispatches
// `_scaled_dot_product_fused_attention_overrideable` and, for autograd, its `_backward`. Neuron picks
// it for every dense 3-D/4-D attention unless the user allowed only the math backend
// (`sdpa_kernel(SDPBackend.MATH)`), and the device implements both ops here:
// - without dropout, as the NeuronCore's flash-attention kernel (NKI-lib's), which on this software
//   device is PyTorch's host flash kernel `_scaled_dot_product_flash_attention_for_cpu` (and its
//   backward) reaching the device fallback: queued in adaptive eager mode, kept whole by the
//   compiler and charged to the timeline as flash attention, exactly as the CPU would choose it;
// - with dropout, or where the CPU's math backend would run (3-D inputs, shapes the flash kernel does
//   not take, such as different value and query head sizes), as attention in device ops, in float32
//   for half-precision data like the CPU's math path.
//   The dropout mask comes from the device generator through a seed returned as `philox_seed`, so
//   the backward draws the same mask again.
// Grouped-query attention (fewer key/value heads than query heads, `enable_gqa=True`) repeats each
// key/value head for its group of query heads, and sums the group's gradients back.
#include "host_alias.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/SDPBackend.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/_fused_sdp_choice_native.h>
#include <ATen/ops/_safe_softmax.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace torchneuron {
namespace {

using at::SDPBackend;

bool is_attention_dtype(c10::ScalarType t) { return t == c10::kFloat || t == c10::kBFloat16 || t == c10::kHalf; }

// Whether the device's fused attention takes these inputs; the math backend gets the rest (and
// raises PyTorch's own errors for inputs no backend takes).
bool fused_accepts(const Tensor& q, const Tensor& k, const Tensor& v, const std::optional<Tensor>& mask,
                   bool enable_gqa) {
  const int64_t dim = q.dim();
  if ((dim != 3 && dim != 4) || k.dim() != dim || v.dim() != dim) return false;
  if (q.is_nested() || k.is_nested() || v.is_nested()) return false;
  if (q.layout() != c10::kStrided || k.layout() != c10::kStrided || v.layout() != c10::kStrided) return false;
  if (!is_attention_dtype(q.scalar_type()) || k.scalar_type() != q.scalar_type() ||
      v.scalar_type() != q.scalar_type())
    return false;
  // Sizes as SymInts: torch.compile traces this choice with symbolic shapes (comparisons guard).
  if (dim == 4 && (k.sym_size(0) != q.sym_size(0) || v.sym_size(0) != q.sym_size(0))) return false;
  const c10::SymInt hq = q.sym_size(-3), hk = k.sym_size(-3);
  if (v.sym_size(-3) != hk || k.sym_size(-2) != v.sym_size(-2) || k.sym_size(-1) != q.sym_size(-1)) return false;
  if (hq != hk && !(enable_gqa && hk > 0 && hq % hk == 0)) return false;
  if (q.sym_numel() == 0 || k.sym_numel() == 0 || v.sym_numel() == 0) return false;
  if (mask && mask->defined()) {
    if (mask->dim() > 4 || (mask->scalar_type() != c10::kBool && mask->scalar_type() != q.scalar_type()))
      return false;
  }
  return true;
}

int64_t neuron_sdp_choice(const Tensor& query, const Tensor& key, const Tensor& value,
                          const std::optional<Tensor>& attn_mask, double dropout_p, bool is_causal,
                          std::optional<double> scale, bool enable_gqa) {
  const auto& ctx = at::globalContext();
  // The device has one fused attention; it stands for every fused backend the user may select.
  const bool fused_enabled = ctx.userEnabledOverrideableSDP() || ctx.userEnabledFlashSDP() ||
                             ctx.userEnabledMemEfficientSDP() || ctx.userEnabledCuDNNSDP();
  // With dropout, math draws the keep-mask with the device generator exactly as the CPU draws it (same
  // seed, same mask); the fused kernel keeps dropout only for callers that disabled math.
  const bool math_for_dropout = dropout_p > 0 && ctx.userEnabledMathSDP();
  if (fused_enabled && !math_for_dropout && fused_accepts(query, key, value, attn_mask, enable_gqa))
    return static_cast<int64_t>(SDPBackend::overrideable);
  if (ctx.userEnabledMathSDP()) return static_cast<int64_t>(SDPBackend::math);
  return static_cast<int64_t>(SDPBackend::error);
}

// ---- the pieces both ops share ----

// The attention problem in 4-D ([B, H, L, E]), keys and values repeated per query head.
struct Problem {
  bool batched;  // the inputs were 4-D
  int64_t group;  // query heads per key/value head
  Tensor q, k, v;
  std::optional<Tensor> bias;  // additive, broadcastable to [B, H, L, S]
  double scale;
};

Tensor to_4d(const Tensor& t, bool batched) { return batched ? t : t.unsqueeze(0); }

std::optional<Tensor> additive_bias(const std::optional<Tensor>& mask, const Tensor& q, bool batched) {
  if (!mask || !mask->defined()) return std::nullopt;
  Tensor m = *mask;
  if (m.scalar_type() == c10::kBool) {  // True = attend (the composite converts; direct calls may not)
    m = at::zeros(m.sizes(), q.options()).masked_fill(m.logical_not(), -std::numeric_limits<double>::infinity());
  }
  if (!batched && m.dim() == 3) m = m.unsqueeze(0);
  return m;
}

Problem problem_of(const Tensor& query, const Tensor& key, const Tensor& value, const std::optional<Tensor>& mask,
                   std::optional<double> scale) {
  Problem p;
  p.batched = query.dim() == 4;
  p.q = to_4d(query, p.batched);
  Tensor k = to_4d(key, p.batched), v = to_4d(value, p.batched);
  TORCH_CHECK(k.size(1) > 0 && p.q.size(1) % k.size(1) == 0,
              "scaled_dot_product_attention on neuron: ", p.q.size(1), " query heads cannot be grouped over ",
              k.size(1), " key/value heads");
  p.group = p.q.size(1) / k.size(1);
  p.k = p.group > 1 ? k.repeat_interleave(p.group, 1) : k;
  p.v = p.group > 1 ? v.repeat_interleave(p.group, 1) : v;
  p.bias = additive_bias(mask, query, p.batched);
  p.scale = scale ? *scale : 1.0 / std::sqrt(static_cast<double>(query.size(-1)));
  return p;
}

// Whether the forward (and so the backward) runs as the flash kernel: exactly where the CPU's own
// choice, asked with the caller's tensors (3-D or 4-D, key/value heads not repeated), is flash. The
// CPU computes the rest with its math backend in float32 (3-D inputs, grouped heads), and so does
// this device: the two kernels' half-precision gradients differ by more than bf16's tolerance.
// The choice is asked with CPU aliases of the tensors (same geometry, no copy): some of its checks
// depend on the device (a mask whose last stride is not 1 is flash on the CPU, not on GPUs), and the
// answer must be the one the CPU gives for the same tensors, or the two devices run different kernels
// (T5's position-bias mask is such a tensor: its last stride is the head count).
bool runs_flash(const Tensor& query, const Tensor& key, const Tensor& value, const std::optional<Tensor>& mask,
                const Problem& p, double dropout_p, bool is_causal) {
  if (dropout_p > 0) return false;
  const bool grouped = query.size(-3) != key.size(-3);
  const std::optional<Tensor> host_mask =
      mask && mask->defined() ? std::optional<Tensor>(maybe_alias(*mask)) : std::nullopt;
  const int64_t choice = at::native::_fused_sdp_choice_cpp(maybe_alias(query), maybe_alias(key), maybe_alias(value),
                                                           host_mask, 0.0, is_causal, p.scale, grouped);
  return choice == static_cast<int64_t>(SDPBackend::flash_attention);
}

// Gradients of repeated key/value heads, summed back over each group.
Tensor sum_groups(const Tensor& grad, int64_t group) {
  if (group == 1) return grad;
  const auto s = grad.sizes();
  return grad.view({s[0], s[1] / group, group, s[2], s[3]}).sum(2);
}

Tensor from_4d(const Tensor& t, bool batched) { return batched ? t : t.squeeze(0); }

// `result` laid out as PyTorch's meta function lays out the output: dimensions in the order of the
// query's strides (what compiled graphs index it by).
Tensor with_layout_of(const Tensor& result, const Tensor& query) {
  std::vector<int64_t> order(query.dim());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return query.stride(a) > query.stride(b); });
  Tensor permuted = result.permute(order);
  if (permuted.is_contiguous()) return result;
  std::vector<int64_t> inverse(order.size());
  for (size_t i = 0; i < order.size(); ++i) inverse[order[i]] = static_cast<int64_t>(i);
  return permuted.contiguous().permute(inverse);
}

// The dropout keep-mask of seed `seed`, drawn on the device by a generator of its own.
Tensor keep_mask(const Problem& p, double dropout_p, int64_t seed) {
  at::Generator gen = at::detail::getPrivateUse1Hooks().getNewGenerator(p.q.device().index());
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_current_seed(static_cast<uint64_t>(seed));
  }
  std::vector<int64_t> shape{p.q.size(0), p.q.size(1), p.q.size(2), p.k.size(2)};
  auto opmath = p.q.scalar_type() == c10::kDouble ? c10::kDouble : c10::kFloat;
  return at::empty(shape, p.q.options().dtype(opmath)).bernoulli_(1.0 - dropout_p, gen);
}

int64_t fresh_seed(c10::DeviceIndex index) {
  at::Generator engine = engine_of(std::nullopt, index);
  std::lock_guard<std::mutex> lock(engine.mutex());
  return static_cast<int64_t>(at::check_generator<at::CPUGeneratorImpl>(engine)->random64() & 0x7fffffffffffffffULL);
}

// Scores in the compute dtype (float32 for half-precision data): scale * q k^T, causal and additive masks.
Tensor scores_of(const Problem& p, bool is_causal, Tensor* qf, Tensor* kf) {
  const auto compute = p.q.scalar_type() == c10::kDouble ? c10::kDouble : c10::kFloat;
  *qf = p.q.to(compute);
  *kf = p.k.to(compute);
  Tensor scores = at::matmul(*qf, kf->transpose(-2, -1)).mul_(p.scale);
  if (is_causal) {
    Tensor allowed = at::ones({p.q.size(2), p.k.size(2)}, p.q.options().dtype(c10::kBool)).tril();
    scores.masked_fill_(allowed.logical_not(), -std::numeric_limits<double>::infinity());
  }
  if (p.bias) scores.add_(p.bias->to(compute));
  return scores;
}

using ForwardResult = std::tuple<Tensor, Tensor, Tensor, Tensor, c10::SymInt, c10::SymInt, Tensor, Tensor, Tensor>;

ForwardResult fused_attention(const Tensor& query, const Tensor& key, const Tensor& value,
                              const std::optional<Tensor>& attn_bias, double dropout_p, bool is_causal,
                              bool return_debug_mask, std::optional<double> scale) {
  TORCH_CHECK(fused_accepts(query, key, value, attn_bias, true),
              "_scaled_dot_product_fused_attention_overrideable on neuron takes 3-D or 4-D float32/bfloat16/float16 "
              "query, key and value of one dtype with a bool or query-dtype mask; got query ", query.sizes(), " ",
              query.scalar_type(), ", key ", key.sizes(), ", value ", value.sizes(),
              ". Call torch.nn.functional.scaled_dot_product_attention, which picks the math backend for others.");
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "dropout_p must be in [0, 1), got ", dropout_p);
  const Problem p = problem_of(query, key, value, attn_bias, scale);
  const auto cpu_long = at::TensorOptions().dtype(c10::kLong);
  Tensor out, lse, debug;
  int64_t seed = 0;
  if (runs_flash(query, key, value, attn_bias, p, dropout_p, is_causal)) {
    std::tie(out, lse) = at::_scaled_dot_product_flash_attention_for_cpu(p.q, p.k, p.v, 0.0, is_causal, p.bias,
                                                                         p.scale);
  } else {
    Tensor qf, kf;
    const Tensor scores = scores_of(p, is_causal, &qf, &kf);
    Tensor probs = at::_safe_softmax(scores, -1);
    lse = at::logsumexp(scores, {-1}).to(c10::kFloat);
    if (dropout_p > 0) {
      seed = fresh_seed(query.device().index());
      const Tensor keep = keep_mask(p, dropout_p, seed);
      probs = probs.mul(keep).div_(1.0 - dropout_p);
      if (return_debug_mask) debug = keep.to(query.scalar_type());
    }
    out = at::matmul(probs, p.v.to(probs.scalar_type())).to(query.scalar_type());
  }
  out = with_layout_of(from_4d(out, p.batched), query);
  return {out, lse.contiguous(), Tensor(), Tensor(), c10::SymInt(p.q.size(2)), c10::SymInt(p.k.size(2)),
          at::scalar_tensor(seed, cpu_long), at::scalar_tensor(0, cpu_long), debug};
}

// Sums a gradient of the scores' shape to the bias's (broadcast) shape.
Tensor reduce_to(const Tensor& grad, c10::IntArrayRef shape) {
  const int64_t lead = grad.dim() - static_cast<int64_t>(shape.size());
  std::vector<int64_t> dims;
  for (int64_t i = 0; i < grad.dim(); ++i)
    if (i < lead || (shape[i - lead] == 1 && grad.size(i) != 1)) dims.push_back(i);
  Tensor g = dims.empty() ? grad : grad.sum(dims, /*keepdim=*/true);
  return lead > 0 ? g.reshape(shape) : g;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> fused_attention_backward(
    const Tensor& grad_out, const Tensor& query, const Tensor& key, const Tensor& value, const Tensor& attn_bias,
    std::array<bool, 4> grad_input_mask, const Tensor& out, const Tensor& logsumexp, const Tensor& cum_seq_q,
    const Tensor& cum_seq_k, c10::SymInt max_q, c10::SymInt max_k, double dropout_p, bool is_causal,
    const Tensor& philox_seed, const Tensor& philox_offset, std::optional<double> scale) {
  const std::optional<Tensor> bias = attn_bias.defined() ? std::optional<Tensor>(attn_bias) : std::nullopt;
  const Problem p = problem_of(query, key, value, bias, scale);
  const Tensor grad = to_4d(grad_out, p.batched);
  Tensor gq, gk, gv, gbias;
  if (runs_flash(query, key, value, bias, p, dropout_p, is_causal) && !grad_input_mask[3]) {
    std::tie(gq, gk, gv) = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad, p.q, p.k, p.v, to_4d(out, p.batched), logsumexp, 0.0, is_causal, p.bias, p.scale);
  } else {  // attention's gradient from the probabilities, recomputed (with the forward's dropout mask)
    Tensor qf, kf;
    const Tensor scores = scores_of(p, is_causal, &qf, &kf);
    const Tensor probs = at::_safe_softmax(scores, -1);
    const Tensor gf = grad.to(probs.scalar_type()), vf = p.v.to(probs.scalar_type());
    Tensor kept = probs;
    Tensor grad_probs = at::matmul(gf, vf.transpose(-2, -1));
    if (dropout_p > 0) {
      const Tensor keep = keep_mask(p, dropout_p, philox_seed.item<int64_t>()).div_(1.0 - dropout_p);
      kept = probs.mul(keep);
      grad_probs.mul_(keep);
    }
    gv = at::matmul(kept.transpose(-2, -1), gf);
    const Tensor grad_scores = probs.mul(grad_probs.sub(grad_probs.mul(probs).sum(-1, /*keepdim=*/true)));
    gq = at::matmul(grad_scores, kf).mul_(p.scale);
    gk = at::matmul(grad_scores.transpose(-2, -1), qf).mul_(p.scale);
    if (grad_input_mask[3] && p.bias) gbias = reduce_to(grad_scores, p.bias->sizes()).to(attn_bias.scalar_type());
  }
  // Each gradient in the layout of its input, as the meta function (empty_like) promises compiled graphs:
  // summed key/value groups and the recomputed path's matmuls come out contiguous otherwise.
  auto back = [&](const Tensor& g, const Tensor& like, int64_t group) {
    return with_layout_of(from_4d(sum_groups(g, group), p.batched).to(like.scalar_type()), like);
  };
  if (gbias.defined() && !p.batched && attn_bias.dim() == 3) gbias = gbias.squeeze(0);
  return {grad_input_mask[0] ? back(gq, query, 1) : Tensor(), grad_input_mask[1] ? back(gk, key, p.group) : Tensor(),
          grad_input_mask[2] ? back(gv, value, p.group) : Tensor(), gbias};
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  // The op behind torch._fused_sdp_choice asks the device's choice too (SDPA itself calls the stub).
  m.impl("_fused_sdp_choice", TORCH_FN(neuron_sdp_choice));
  m.impl("_scaled_dot_product_fused_attention_overrideable", TORCH_FN(fused_attention));
  m.impl("_scaled_dot_product_fused_attention_overrideable_backward", TORCH_FN(fused_attention_backward));
}

}  // namespace
}  // namespace torchneuron

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torchneuron::neuron_sdp_choice)
}  // namespace at::native
