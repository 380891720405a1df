// Recurrent cells on neuron: the fused LSTM and GRU cell ops PyTorch picks for every non-CPU device.
//
// ATen's recurrent modules (nn.LSTM, nn.GRU, LSTMCell, GRUCell, through at::lstm / at::gru and
// their cells) run the cell's pointwise part as one fused op on any device but the CPU:
// `_thnn_fused_lstm_cell` and `_thnn_fused_gru_cell`, whose only kernels are CUDA's, and whose
// autograd formulas call `_thnn_fused_lstm_cell_backward_impl` / `_thnn_fused_gru_cell_backward`.
// The fallback cannot run them (no CPU kernel), so neuron implements all four here as compositions
// of device ops, in the order the CPU's unfused cell computes (so values match the CPU), and with
// CUDA's workspace layout (what the backward ops read):
// - LSTM workspace [B, 4H]: the activated input, forget, cell and output gates;
// - GRU workspace [B, 5H]: reset gate, input gate, new gate, the hidden new-gate pre-activation
//   (with its bias), and hx.
// Autograd needs nothing more: the forward ops' derivative formulas are PyTorch's own.
#include "host_alias.h"

#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rsub.h>
#include <ATen/ops/sigmoid.h>
#include <ATen/ops/sub.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

namespace torchneuron {
namespace {

// The gates' pre-activations as the CPU's cell forms them: (hidden gates + hidden bias) + (input
// gates + input bias), the biases being what at::linear adds.
Tensor add_bias(const Tensor& gates, const std::optional<Tensor>& bias) {
  return bias && bias->defined() ? at::add(gates, *bias) : gates;
}

// d sigmoid(x) / dx from y = sigmoid(x) (and d tanh from y = tanh(x)).
Tensor sigmoid_grad_of(const Tensor& y) { return at::mul(y, at::rsub(y, 1)); }
Tensor tanh_grad_of(const Tensor& y) { return at::rsub(at::mul(y, y), 1); }

void check_gates(const Tensor& input_gates, const Tensor& hidden_gates, const Tensor& state, int64_t chunks,
                 const char* op) {
  TORCH_CHECK(input_gates.dim() == 2 && input_gates.sizes() == hidden_gates.sizes(), op,
              ": input_gates and hidden_gates must be 2-D tensors of one shape, got ", input_gates.sizes(), " and ",
              hidden_gates.sizes());
  TORCH_CHECK(state.dim() == 2 && input_gates.size(0) == state.size(0) &&
                  input_gates.size(1) == chunks * state.size(1),
              op, ": gates of shape ", input_gates.sizes(), " do not match a state of shape ", state.sizes(),
              " (expected [B, ", chunks, " * H] gates for a [B, H] state)");
}

std::tuple<Tensor, Tensor, Tensor> fused_lstm_cell(const Tensor& input_gates, const Tensor& hidden_gates,
                                                   const Tensor& cx, const std::optional<Tensor>& input_bias,
                                                   const std::optional<Tensor>& hidden_bias) {
  check_gates(input_gates, hidden_gates, cx, 4, "_thnn_fused_lstm_cell");
  const Tensor gates = at::add(add_bias(hidden_gates, hidden_bias), add_bias(input_gates, input_bias));
  auto chunks = gates.unsafe_chunk(4, 1);
  const Tensor i = at::sigmoid(chunks[0]), f = at::sigmoid(chunks[1]), g = at::tanh(chunks[2]),
               o = at::sigmoid(chunks[3]);
  const Tensor cy = at::add(at::mul(f, cx), at::mul(i, g));
  const Tensor hy = at::mul(o, at::tanh(cy));
  return {hy, cy, at::cat({i, f, g, o}, 1)};
}

std::tuple<Tensor, Tensor, Tensor> fused_lstm_cell_backward(const std::optional<Tensor>& grad_hy,
                                                            const std::optional<Tensor>& grad_cy, const Tensor& cx,
                                                            const Tensor& cy, const Tensor& workspace,
                                                            bool has_bias) {
  const bool has_hy = grad_hy && grad_hy->defined(), has_cy = grad_cy && grad_cy->defined();
  if (!has_hy && !has_cy) return {Tensor(), Tensor(), Tensor()};
  auto gates = workspace.unsafe_chunk(4, 1);
  const Tensor &i = gates[0], &f = gates[1], &g = gates[2], &o = gates[3];
  const Tensor tanh_cy = at::tanh(cy);
  Tensor grad_c;  // the gradient reaching the new cell state, from cy and through hy
  Tensor grad_o;
  if (has_hy) {
    grad_o = at::mul(at::mul(*grad_hy, tanh_cy), sigmoid_grad_of(o));
    Tensor through_hy = at::mul(at::mul(*grad_hy, o), tanh_grad_of(tanh_cy));
    grad_c = has_cy ? at::add(through_hy, *grad_cy) : through_hy;
  } else {
    grad_o = at::zeros_like(o);
    grad_c = *grad_cy;
  }
  const Tensor grad_i = at::mul(at::mul(grad_c, g), sigmoid_grad_of(i));
  const Tensor grad_f = at::mul(at::mul(grad_c, cx), sigmoid_grad_of(f));
  const Tensor grad_g = at::mul(at::mul(grad_c, i), tanh_grad_of(g));
  const Tensor grad_cx = at::mul(grad_c, f);
  Tensor grad_gates = at::cat({grad_i, grad_f, grad_g, grad_o}, 1);
  Tensor grad_bias = has_bias ? at::sum(grad_gates, {0}) : Tensor();
  return {grad_gates, grad_cx, grad_bias};
}

std::tuple<Tensor, Tensor> fused_gru_cell(const Tensor& input_gates, const Tensor& hidden_gates, const Tensor& hx,
                                          const std::optional<Tensor>& input_bias,
                                          const std::optional<Tensor>& hidden_bias) {
  check_gates(input_gates, hidden_gates, hx, 3, "_thnn_fused_gru_cell");
  auto in = add_bias(input_gates, input_bias).unsafe_chunk(3, 1);
  auto hid = add_bias(hidden_gates, hidden_bias).unsafe_chunk(3, 1);
  const Tensor reset = at::sigmoid(at::add(hid[0], in[0]));
  const Tensor update = at::sigmoid(at::add(hid[1], in[1]));
  const Tensor hidden_new = hid[2].contiguous();
  const Tensor fresh = at::tanh(at::add(in[2], at::mul(hidden_new, reset)));
  const Tensor hy = at::add(at::mul(at::sub(hx, fresh), update), fresh);
  return {hy, at::cat({reset, update, fresh, hidden_new, hx}, 1)};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> fused_gru_cell_backward(const Tensor& grad_hy,
                                                                           const Tensor& workspace, bool has_bias) {
  auto parts = workspace.unsafe_chunk(5, 1);
  const Tensor &reset = parts[0], &update = parts[1], &fresh = parts[2], &hidden_new = parts[3], &hx = parts[4];
  const Tensor grad_update = at::mul(at::mul(grad_hy, at::sub(hx, fresh)), sigmoid_grad_of(update));
  const Tensor grad_hx = at::mul(grad_hy, update);
  const Tensor grad_fresh = at::mul(at::mul(grad_hy, at::rsub(update, 1)), tanh_grad_of(fresh));
  const Tensor grad_hidden_new = at::mul(grad_fresh, reset);
  const Tensor grad_reset = at::mul(at::mul(grad_fresh, hidden_new), sigmoid_grad_of(reset));
  Tensor grad_input_gates = at::cat({grad_reset, grad_update, grad_fresh}, 1);
  Tensor grad_hidden_gates = at::cat({grad_reset, grad_update, grad_hidden_new}, 1);
  Tensor grad_input_bias = has_bias ? at::sum(grad_input_gates, {0}) : Tensor();
  Tensor grad_hidden_bias = has_bias ? at::sum(grad_hidden_gates, {0}) : Tensor();
  return {grad_input_gates, grad_hidden_gates, grad_hx, grad_input_bias, grad_hidden_bias};
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", TORCH_FN(fused_lstm_cell));
  m.impl("_thnn_fused_lstm_cell_backward_impl", TORCH_FN(fused_lstm_cell_backward));
  m.impl("_thnn_fused_gru_cell", TORCH_FN(fused_gru_cell));
  m.impl("_thnn_fused_gru_cell_backward", TORCH_FN(fused_gru_cell_backward));
}

}  // namespace
}  // namespace torchneuron
