// The statistics layer and batch norm return on neuron: CUDA's contract, not the CPU kernels'.
//
// PyTorch's meta kernels (what torch.compile and adaptive eager mode trace with) follow CUDA for
// every device but the CPU, whose kernels differ twice:
// - half-precision (bfloat16/float16) data: the CPU rounds the saved mean and rstd/invstd to the
//   data's dtype; CUDA computes and keeps them in float32;
// - batch norm in eval mode: the CPU saves empty statistics; CUDA saves the running mean and
//   1 / sqrt(running var + eps) it normalised with, in the compute dtype.
// The device's fallback runs these ops' CPU kernels through `run_norm_as_cuda`, which adapts both,
// so compiled graphs and adaptive eager programs hold the tensors eager mode makes.
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
  } else if (name == "aten::native_batch_norm" || name == "aten::_native_batch_norm_legit" ||
             name == "aten::_native_batch_norm_legit.no_stats" || name == "aten::_batch_norm_with_update") {
    norm.result_dtype_from = {0, -1, -1, -1};  // (out, save_mean, save_invstd[, reserve])
    norm.batch_norm_forward = true;
  } else if (name == "aten::_native_batch_norm_legit_no_training") {
    norm.result_dtype_from = {0, -1, -1};
    norm.batch_norm_forward = true;
    norm.always_eval = true;
  } else if (name == "aten::native_batch_norm_backward" || name == "aten::batch_norm_backward") {
    norm.result_dtype_from = {1, 2, 2};    // grads of input, weight, bias (bias has weight's dtype)
    norm.data_arg = 1;
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

  c10::SmallVector<c10::ScalarType, 12> dtypes(nargs, c10::kFloat);
  c10::SmallVector<std::pair<at::Tensor, at::Tensor>, 2> running;  // (running statistic, its float32 copy)
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
  if (half) {  // float32 copies of the floating operands; running statistics are written back after
    for (size_t i = 0; i < nargs; ++i) {
      IValue& v = (*stack)[base + i];
      if (!v.isTensor() || !v.toTensor().defined() || !v.toTensor().is_floating_point()) continue;
      at::Tensor original = v.toTensor();
      dtypes[i] = original.scalar_type();
      at::Tensor copy = original.to(c10::kFloat);
      if (norm.batch_norm_forward && !eval && !copy.is_same(original) &&
          (args[i].name() == "running_mean" || args[i].name() == "running_var"))
        running.emplace_back(original, copy);
      v = IValue(std::move(copy));
    }
  }
  op.redispatchBoxed(cpu_keys, stack);
  for (auto& [statistic, copy] : running) statistic.copy_(copy);
  const size_t rbase = stack->size() - nrets;
  for (size_t r = 0; half && r < nrets && r < norm.result_dtype_from.size(); ++r) {
    IValue& v = (*stack)[rbase + r];
    const int8_t from = norm.result_dtype_from[r];
    if (from >= 0 && v.isTensor() && v.toTensor().defined()) v = IValue(v.toTensor().to(dtypes[from]));
  }
  if (eval && running_mean.defined() && running_var.defined() && nrets >= 3) {
    const c10::ScalarType compute = at::toOpMathType(data_dtype);
    (*stack)[rbase + 1] = IValue(running_mean.to(compute, /*non_blocking=*/false, /*copy=*/true));
    (*stack)[rbase + 2] = IValue(at::reciprocal(at::sqrt(at::add(running_var.to(compute), eps))));
  }
  return true;
}

}  // namespace torchneuron
