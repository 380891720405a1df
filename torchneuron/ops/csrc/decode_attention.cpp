// The host path of the NKI decode-attention kernel (torchneuron/kernels/decode_attention.py):
// `torchneuron::paged_decode_attention_host`, one CPU kernel with the NKI kernel's numerics, so a
// serving decode step computes its attention in one call instead of a score/mask/softmax/PV chain
// of small torch ops (which cost the step more than vLLM's own attention kernel does on the CPU).
//
// Operands as the kernel takes them: q [B, T, Hq, d] (T new tokens per sequence, the last T of its
// context), kv_cache [blocks, Hkv, 2 * bs, d] (per block and KV head: the keys as a [d, bs] slab,
// K^T, then the values [bs, d]), block_table [B, W] and context_lens [B] or [B, 1] of any integer
// type. Numerics: scores and softmax statistics in fp32 from the input-dtype operands; the softmax
// numerators rounded to the input dtype before P V (the kernel's p tile enters the Tensor engine
// in it); P V accumulated in fp32 and the output rounded once. Token i of a sequence of length n
// sees keys [0, n - T + i].
#include "decode_attention.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

namespace torchneuron {
namespace {

// One token's attention for the `group` query heads sharing a KV head: q and out point at the
// group's first head ([group, d] rows), cache at the KV head's block 0. Each score sums over the
// head dimension in order; the loops run over a block's keys innermost (K^T rows are contiguous)
// and read each key and value once for the whole group.
// The build's -O2 leaves these loops scalar (GCC vectorises at -O2 only where no runtime alias
// check is needed); -O3 vectorises them, with an AVX2 clone where the CPU has it: ~3x faster here.
template <typename scalar_t>
__attribute__((optimize("O3"), target_clones("avx2", "default")))
void attend_group(const scalar_t* q, const scalar_t* cache, const int64_t* blocks, int64_t n_blocks, int64_t seen,
                  int64_t group, int64_t d, int64_t bs, int64_t block_stride, float scale, scalar_t* out,
                  std::vector<float>& scores, std::vector<float>& acc) {
  const int64_t keys = std::max<int64_t>(0, std::min(seen, n_blocks * bs));
  scores.assign(static_cast<size_t>(group * keys), 0.f);
  for (int64_t first = 0; first < keys; first += bs) {
    const int64_t width = std::min(bs, keys - first);
    const scalar_t* slab = cache + blocks[first / bs] * block_stride;  // K^T [d, bs]
    for (int64_t g = 0; g < group; ++g) {
      float* row = scores.data() + g * keys + first;
      const scalar_t* qg = q + g * d;
      for (int64_t j = 0; j < d; ++j) {
        const float qj = static_cast<float>(qg[j]);
        const scalar_t* k = slab + j * bs;
        for (int64_t pos = 0; pos < width; ++pos) row[pos] += qj * static_cast<float>(k[pos]);
      }
    }
  }
  acc.assign(static_cast<size_t>(group * d), 0.f);
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores.data() + g * keys;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t key = 0; key < keys; ++key) best = std::max(best, row[key]);
    float total = 0.f;
    for (int64_t key = 0; key < keys; ++key) {
      const float p = std::exp(scale * (row[key] - best));
      total += p;
      row[key] = static_cast<float>(static_cast<scalar_t>(p));  // the p tile in the input dtype
    }
    for (int64_t key = 0; key < keys; ++key) row[key] /= total;
  }
  for (int64_t key = 0; key < keys; ++key) {
    const scalar_t* v = cache + blocks[key / bs] * block_stride + bs * d + (key % bs) * d;
    for (int64_t g = 0; g < group; ++g) {
      const float w = scores[g * keys + key];
      float* a = acc.data() + g * d;
      for (int64_t j = 0; j < d; ++j) a[j] += w * static_cast<float>(v[j]);
    }
  }
  for (int64_t i = 0; i < group * d; ++i) out[i] = static_cast<scalar_t>(acc[i]);
}

}  // namespace

at::Tensor paged_decode_attention_host(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                                       const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(q.dim() == 4 && kv_cache.dim() == 4 && block_table.dim() == 2,
              "paged_decode_attention_host: q must be [B, T, Hq, d], kv_cache [blocks, Hkv, 2 * block_size, d] and "
              "block_table [B, W]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(),
              "paged_decode_attention_host: q and kv_cache must share a dtype, got ", q.scalar_type(), " and ",
              kv_cache.scalar_type());
  const int64_t b = q.size(0), t = q.size(1), hq = q.size(2), d = q.size(3);
  const int64_t hk = kv_cache.size(1), bs = kv_cache.size(2) / 2;
  TORCH_CHECK(kv_cache.size(3) == d && kv_cache.size(2) == 2 * bs && hk > 0 && hq % hk == 0,
              "paged_decode_attention_host: kv_cache [blocks, Hkv, 2 * block_size, d] must match q's head size ", d,
              " and divide its ", hq, " heads");
  TORCH_CHECK(block_table.size(0) == b && context_lens.numel() == b,
              "paged_decode_attention_host: block_table and context_lens need one row per sequence (", b, ")");
  const at::Tensor qc = q.contiguous(), cache = kv_cache.contiguous();
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor lens = context_lens.to(at::kLong).reshape({b}).contiguous();
  at::Tensor out = at::empty_like(qc);
  const int64_t group = hq / hk, width = table.size(1);
  const int64_t head_stride = 2 * bs * d, block_stride = hk * head_stride;
  const float s = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_host", [&] {
    const scalar_t* qp = qc.const_data_ptr<scalar_t>();
    const scalar_t* cp = cache.const_data_ptr<scalar_t>();
    const int64_t* tp = table.const_data_ptr<int64_t>();
    const int64_t* lp = lens.const_data_ptr<int64_t>();
    scalar_t* op = out.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, b * hk, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> scores, acc;
      for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t seq = unit / hk, kv_head = unit % hk;
        for (int64_t tok = 0; tok < t; ++tok) {
          const int64_t offset = ((seq * t + tok) * hq + kv_head * group) * d;
          attend_group(qp + offset, cp + kv_head * head_stride, tp + seq * width, width, lp[seq] - t + tok + 1, group,
                       d, bs, block_stride, s, op + offset, scores, acc);
        }
      }
    });
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("paged_decode_attention_host(Tensor q, Tensor kv_cache, Tensor block_table, Tensor context_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(torchneuron, CPU, m) { m.impl("paged_decode_attention_host", &paged_decode_attention_host); }

}  // namespace torchneuron
