// The statistics layer and batch norm return on neuron: CUDA's contract, the CPU's values.
//
// PyTorch's meta kernels (what torch.compile and adaptive eager mode trace with) follow CUDA for
// every device but the CPU, whose kernels differ twice:
// - half-precision (bfloat16/float16) data: the CPU keeps the saved mean and rstd/invstd in the
//   data's dtype; CUDA keeps them in float32;
// - batch norm in eval mode: the CPU saves empty statistics; CUDA saves the running mean and
//   1 / sqrt(running var + eps) it normalised with, in the compute dtype.
// The device's fallback runs these ops' CPU kernels through `run_norm_as_cuda`, which adapts both,
// so compiled graphs and adaptive eager programs hold the tensors eager mode makes. The values stay
// the CPU kernel's: half-precision data is normalised by the CPU kernel itself (batch norm, and so
// instance norm, normalises with its statistics rounded to the data's dtype; layer norm's backward
// reads them so rounded), and only the statistics' dtype changes: float32 out of the forward ops, and
// back to the dtype the CPU kernel saved them in when a backward op reads them (exact, as they hold
// values of that dtype).
#include "neuron.h"

#include <ATen/OpMathType.h>
#include <ATen/ops/add.h>
#include <ATen/ops/reciprocal.h>
#include <ATen/ops/sqrt.h>

namespace torchneuron {
using c10::IValue;
using Stack = std::vector<c10::IValue>;

NormStatistics norm_statistics_of(const std::string& name) {
  NormStatistics norm;
  if (name == "aten::native_layer_norm") {
    norm.result_dtype_from = {0, -1, -1};  // (out, mean, rstd)
  } else if (name == "aten::native_layer_norm_backward") {
    norm.result_dtype_from = {1, 5, 6};    // grads of input, weight, bias
    norm.data_arg = 1;
    norm.saved_statistics = {"mean", "rstd"};
  } else if (name == "aten::native_batch_norm" || name == "aten::_native_batch_norm_legit" ||
             name == "aten::_native_batch_norm_legit.no_stats" || name == "aten::_batch_norm_with_update") {
    norm.result_dtype_from = {0, -1, -1, -1};  // (out, save_mean, save_invstd[, reserve])
    norm.batch_norm_forward = true;
  } else if (name == "aten::_native_batch_norm_legit_no_training") {
    norm.result_dtype_from = {0, -1, -1};
    norm.batch_norm_forward = true;
    norm.always_eval = true;
  } else if (name == "aten::native_batch_norm_backward") {
    norm.result_dtype_from = {1, 2, 2};    // grads of input, weight, bias (bias has weight's dtype)
    norm.data_arg = 1;
    norm.saved_statistics = {"save_mean", "save_invstd"};
  } else if (name == "aten::batch_norm_backward") {
    norm.result_dtype_from = {1, 2, 2};
    norm.data_arg = 1;
    norm.saved_statistics = {"save_mean", "save_var"};
  }
  return norm;
}

static inline bool is_half_precision(c10::ScalarType t) { return t == c10::kBFloat16 || t == c10::kHalf; }

// The argument named `name` on the stack, or nullptr.
static IValue* argument(const c10::FunctionSchema& schema, Stack* stack, size_t base, const char* name) {
  for (size_t i = 0; i < schema.arguments().size(); ++i)
    if (schema.arguments()[i].name() == name) return &(*stack)[base + i];
  return nullptr;
}

bool run_norm_as_cuda(const c10::OperatorHandle& op, const NormStatistics& norm, Stack* stack,
                      c10::DispatchKeySet cpu_keys) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t nargs = args.size(), nrets = schema.returns().size();
  const size_t base = stack->size() - nargs;
  const IValue& data = (*stack)[base + norm.data_arg];
  if (!data.isTensor()) return false;
  const c10::ScalarType data_dtype = data.toTensor().scalar_type();
  const bool half = is_half_precision(data_dtype);
  bool eval = false;
  if (norm.batch_norm_forward) {
    IValue* training = argument(schema, stack, base, "training");
    eval = norm.always_eval || (training && training->isBool() && !training->toBool());
  }
  if (!half && !eval) return false;

  at::Tensor running_mean, running_var;
  double eps = 0;
  if (eval) {
    IValue* mean = argument(schema, stack, base, "running_mean");
    IValue* var = argument(schema, stack, base, "running_var");
    IValue* epsilon = argument(schema, stack, base, "eps");
    if (mean && mean->isTensor()) running_mean = mean->toTensor();
    if (var && var->isTensor()) running_var = var->toTensor();
    if (epsilon) eps = epsilon->toDouble();
  }
  if (half && !norm.saved_statistics.empty()) {  // float32 statistics -> the dtype the CPU kernel saves
    IValue* weight = argument(schema, stack, base, "weight");
    const c10::ScalarType saved = weight && weight->isTensor() && weight->toTensor().defined()
                                      ? weight->toTensor().scalar_type()
                                      : data_dtype;
    for (const char* name : norm.saved_statistics) {
      IValue* v = argument(schema, stack, base, name);
      if (v && v->isTensor() && v->toTensor().defined() && v->toTensor().scalar_type() != saved)
        *v = IValue(v->toTensor().to(saved));
    }
  }
  op.redispatchBoxed(cpu_keys, stack);
  const size_t rbase = stack->size() - nrets;
  for (size_t r = 0; half && r < nrets && r < norm.result_dtype_from.size(); ++r) {
    IValue& v = (*stack)[rbase + r];
    if (norm.result_dtype_from[r] < 0 && v.isTensor() && v.toTensor().defined() &&
        is_half_precision(v.toTensor().scalar_type()))
      v = IValue(v.toTensor().to(c10::kFloat));
  }
  if (eval && running_mean.defined() && running_var.defined() && nrets >= 3) {
    const c10::ScalarType compute = at::toOpMathType(data_dtype);
    (*stack)[rbase + 1] = IValue(running_mean.to(compute, /*non_blocking=*/false, /*copy=*/true));
    (*stack)[rbase + 2] = IValue(at::reciprocal(at::sqrt(at::add(running_var.to(compute), eps))));
  }
  return true;
}

}  // namespace torchneuron
