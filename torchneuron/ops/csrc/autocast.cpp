// Autocast on neuron: CUDA's cast policy, op for op.
//
// ATen publishes the policy lists CUDA uses (AT_FORALL_LOWER_PRECISION_FP, AT_FORALL_FP32, ...)
// and the KERNEL_PRIVATEUSEONE wrappers; registering them for AutocastPrivateUse1 gives
// torch.autocast("neuron") CUDA's behaviour. CUDA adds two things the lists leave out: its cuDNN
// convolutions (which neuron does not have) and the ops it bans, binary_cross_entropy, whose kernel
// refuses to run under autocast. Ops outside the lists fall through.
#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace torchneuron {
namespace {
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

// CUDA's message, word for word: code written for CUDA matches on it.
Tensor binary_cross_entropy_banned(const Tensor&, const Tensor&, const std::optional<Tensor>&, int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
              "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
              "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
              "safe to autocast.");
}

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define NEURON_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
  AT_FORALL_LOWER_PRECISION_FP(NEURON_LOWER_PRECISION_FP)
#define NEURON_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
  AT_FORALL_FP32(NEURON_FP32)
#define NEURON_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
  AT_FORALL_FP32_SET_OPT_DTYPE(NEURON_FP32_SET_OPT_DTYPE)
#define NEURON_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  AT_FORALL_PROMOTE(NEURON_PROMOTE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  m.impl("binary_cross_entropy", TORCH_FN(binary_cross_entropy_banned));
}

}  // namespace
}  // namespace torchneuron
