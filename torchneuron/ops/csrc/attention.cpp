// Which attention kernel `scaled_dot_product_attention` runs on neuron.
//
// SDPA asks a per-device choice function (ATen's `_fused_sdp_choice_stub`) which backend to use;
// a device without one gets the math path: a dozen separate ops forward and more backward,
// each a launch, with the scores materialised in HBM. The NeuronCore runs attention as one
// flash-attention kernel (NKI-lib's), so neuron picks the fused kernel under exactly the
// conditions CPU does (dtype, head size, dropout, mask shape, and the `sdpa_kernel` /
// `torch.backends` switches), and math otherwise. For a non-CUDA device the fused choice
// dispatches `_scaled_dot_product_flash_attention_for_cpu` and its backward: on neuron they
// reach the device's fallback like any op (queued in adaptive eager mode, kept whole by the
// compiler) and are charged to the timeline as flash attention.
#include <ATen/native/DispatchStub.h>
#include <ATen/native/transformers/attention.h>
#include <ATen/native/transformers/sdp_utils_cpp.h>
#include <ATen/ops/_fused_sdp_choice_native.h>

namespace torchneuron {
namespace {

int64_t neuron_sdp_choice(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                          const std::optional<at::Tensor>& attn_mask, double dropout_p, bool is_causal,
                          std::optional<double> scale, bool enable_gqa) {
  const int64_t cpu_choice =
      at::native::_fused_sdp_choice_cpp(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa);
  const bool flash = cpu_choice == static_cast<int64_t>(sdp::SDPBackend::flash_attention);
  return static_cast<int64_t>(flash ? sdp::SDPBackend::flash_attention : sdp::SDPBackend::math);
}

}  // namespace
}  // namespace torchneuron

namespace at::native {
REGISTER_PRIVATEUSE1_DISPATCH(_fused_sdp_choice_stub, &torchneuron::neuron_sdp_choice)
}  // namespace at::native
