// Zero-copy CPU aliases of neuron tensors, and CPU results re-tagged as device memory: how a host
// kernel works on device data with no copies (host_alias.cpp). A neuron tensor's bytes are host
// memory; the fallback and the device's own kernels hand CPU kernels aliases of them.
#pragma once
#include "neuron.h"

#include <c10/core/DispatchKeySet.h>

#include <algorithm>

namespace torchneuron {

// The names the runtime's op-level files (fallback, kernels, host aliases) share.
using at::Tensor;
using c10::Device;
using c10::DeviceIndex;
using c10::DispatchKey;
using c10::DispatchKeySet;
using c10::IValue;
using torch::jit::Stack;

inline const c10::DispatchKeySet kCPUKeys{c10::DispatchKey::CPU};
inline const c10::DispatchKeySet kNeuronKeys{c10::DispatchKey::PrivateUse1};

inline bool is_neuron(const at::Tensor& t) {
  return t.defined() && t.unsafeGetTensorImpl()->device_type() == kNeuron;
}
inline c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
}

// A CPU tensor over a neuron tensor's bytes (no autograd, no version counter: for code below
// autograd); it keeps the neuron storage alive.
at::Tensor cpu_alias(const at::Tensor& t);
inline at::Tensor maybe_alias(const at::Tensor& t) { return is_neuron(t) ? cpu_alias(t) : t; }
// A neuron tensor over neuron storage `st` with the geometry of `like`.
at::Tensor neuron_tensor_over(const c10::Storage& st, const c10::TensorImpl* like);
// A tensor returned by a CPU kernel -> a neuron tensor of device `index` over the same memory
// (copied only when something else sees that memory).
at::Tensor to_device(at::Tensor o, c10::DeviceIndex index);
// After a CPU kernel ran on alias `a` (storage `ast`) of neuron tensor `t` (out= / in-place), carries
// back what it may have changed: a reallocation (resize_), a storage swap (set_), the geometry.
void sync_back(const at::Tensor& a, const at::Tensor& t, c10::StorageImpl* ast);

// Appends one op record for work a kernel of our own did on device `index`'s current stream (a
// no-op with the work log off): the signatures of what it read, then of what it wrote (at most
// kMaxSigs in all, one written at least). kernels.cpp.
void record_kernel(const c10::OperatorHandle& op, std::initializer_list<TensorSig> reads,
                   std::initializer_list<TensorSig> writes, c10::DeviceIndex index);
inline TensorSig sig_of(const at::Tensor& t) {
  TensorSig s;
  fill_sig(s, t);
  return s;
}
// A flat signature of `numel` elements: several tensors of one dtype as one (their bytes add up).
inline TensorSig sig_of_numel(c10::ScalarType dtype, int64_t numel) {
  TensorSig s;
  fill_sig_numel(s, dtype, numel);
  return s;
}
// The signature of a tensor of `dtype` and `sizes` (at most kSigDims) that need not exist.
inline TensorSig sig_of_shape(c10::ScalarType dtype, c10::IntArrayRef sizes) {
  TORCH_INTERNAL_ASSERT(sizes.size() <= static_cast<size_t>(kSigDims));
  TensorSig s = sig_of_numel(dtype, 0);
  s.ndim = static_cast<int8_t>(sizes.size());
  std::copy(sizes.begin(), sizes.end(), s.sizes);
  return s;
}

}  // namespace torchneuron
