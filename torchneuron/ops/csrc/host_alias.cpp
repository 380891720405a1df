// Zero-copy CPU aliases and re-tagging (host_alias.h), and the same for Python code that must read
// device memory on the host (torchneuron::host_view) or hand host memory to the device
// (torchneuron::device_copy).
#include "host_alias.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/zeros.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <cstring>

namespace torchneuron {

// TensorImpl::device_opt_ is protected with no setter: reach it through a derived-class member
// pointer (legal for protected members).
struct ImplAccess : c10::TensorImpl {
  static std::optional<Device>& device_opt(c10::TensorImpl* t) { return t->*(&ImplAccess::device_opt_); }
};

static void release_storage_ref(void* ctx) { c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx)); }

// A CPU-tagged, non-owning DataPtr over a neuron storage's bytes; it keeps the storage alive.
static inline c10::DataPtr cpu_data_of(c10::StorageImpl* st) {
  c10::raw::intrusive_ptr::incref(st);
  return c10::DataPtr(st->_mutable_data_ptr_no_checks().get(), st, &release_storage_ref, Device(c10::DeviceType::CPU));
}

static c10::Allocator* const g_cpu_allocator = c10::GetCPUAllocator();

// A kernel must never read past a storage: a storage freed (resize_(0)) or shrunk under a tensor
// that still points into it is a user error, reported instead of reading stray host memory.
static void check_extent(const c10::TensorImpl* t, const c10::StorageImpl* st) {
  if (t->numel() == 0) return;
  int64_t last = t->storage_offset();
  const auto sizes = t->sizes();
  const auto strides = t->strides();
  for (size_t d = 0; d < sizes.size(); ++d) last += (sizes[d] - 1) * strides[d];
  const uint64_t need = static_cast<uint64_t>(last + 1) * t->itemsize();
  TORCH_CHECK(need <= st->nbytes(), "neuron: this tensor reads ", need, " bytes of a storage that now holds ",
              st->nbytes(), " (the storage was freed or resized after the tensor was made). Keep the storage "
              "alive, or re-create the tensor from data that still exists.");
}

// A CPU StorageImpl over neuron storage `st`'s bytes; it keeps `st` alive.
static c10::Storage cpu_storage_over(c10::StorageImpl* st, bool resizable) {
  return c10::Storage(c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                            c10::SymInt(static_cast<int64_t>(st->nbytes())),
                                                            cpu_data_of(st), g_cpu_allocator, resizable));
}

// Gives `dst` the sizes, strides, offset and conjugate/negative bits of `like`.
static void copy_geometry(c10::TensorImpl* dst, const c10::TensorImpl* like) {
  dst->set_sizes_and_strides(like->sizes(), like->strides(), like->storage_offset());
  if (C10_UNLIKELY(like->is_conj())) dst->_set_conj(true);
  if (C10_UNLIKELY(like->is_neg())) dst->_set_neg(true);
}

// A CPU tensor over the same bytes. It gets a StorageImpl of its own: views made *inside* CPU
// kernels take their device from the storage, so sharing the neuron StorageImpl would give CPU
// kernels "neuron" intermediates. VIEW-constructed with key set {CPU}: no autograd, no version
// counter: the caller is below autograd.
Tensor cpu_alias(const Tensor& t) {
  c10::TensorImpl* src = t.unsafeGetTensorImpl();
  c10::StorageImpl* st = storage_of(t);
  check_extent(src, st);
  Tensor a = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, cpu_storage_over(st, /*resizable=*/true),
                                                      kCPUKeys, src->dtype());
  c10::TensorImpl* ai = a.unsafeGetTensorImpl();
  ImplAccess::device_opt(ai) = Device(c10::DeviceType::CPU);
  copy_geometry(ai, src);
  return a;
}

// A neuron tensor over neuron storage `st` with the geometry of `like`.
Tensor neuron_tensor_over(const c10::Storage& st, const c10::TensorImpl* like) {
  Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(st), kNeuronKeys, like->dtype());
  copy_geometry(t.unsafeGetTensorImpl(), like);
  return t;
}

// Host memory a CPU kernel produced becomes device memory of `index` (accounted, no copy).
static void adopt_storage(c10::StorageImpl* st, DeviceIndex index) {
  c10::DataPtr host = st->set_data_ptr(c10::DataPtr());
  st->set_data_ptr_noswap(adopt_host_memory(std::move(host), st->nbytes(), index));
  st->set_allocator(device_allocator());  // later resizes allocate device memory
}

static Tensor copy_into_device(const Tensor& o, DeviceIndex index) {
  c10::DeviceGuard guard(Device(kNeuron, index));
  Tensor d = o.is_non_overlapping_and_dense()
                 ? at::detail::empty_strided_generic(o.sizes(), o.strides(), device_allocator(), kNeuronKeys,
                                                     o.scalar_type())
                 : at::detail::empty_generic(o.sizes(), device_allocator(), kNeuronKeys, o.scalar_type(), std::nullopt);
  at::AutoDispatchBelowADInplaceOrView below;
  cpu_alias(d).copy_(o);
  return d;
}

// A tensor returned by a CPU kernel -> a neuron tensor over the same memory.
Tensor to_device(Tensor o, DeviceIndex index) {
  c10::TensorImpl* oi = o.unsafeGetTensorImpl();
  if (oi->device_type() == kNeuron) return o;
  TORCH_CHECK(oi->has_storage() && oi->layout() == c10::kStrided,
              "neuron: a CPU kernel returned a tensor without strided storage (layout ", oi->layout(),
              "); only strided tensors are supported on neuron.");
  if (oi->_is_zerotensor() || (oi->storage().data() == nullptr && oi->storage().nbytes() > 0)) {
    return copy_into_device(o._is_zerotensor() ? at::zeros(o.sizes(), o.options()) : o, index);
  }
  const c10::Storage& st = oi->unsafe_storage();
  if (st.device_type() != kNeuron) {
    if (st.use_count() != 1) return copy_into_device(o, index);  // someone else sees this memory
    adopt_storage(st.unsafeGetStorageImpl(), index);
  }
  const bool keys_match = oi->is_inference() == c10::InferenceMode::is_enabled();
  if (o.use_count() == 1 && keys_match && !oi->is_wrapped_number()) {
    ImplAccess::device_opt(oi) = Device(kNeuron, index);
    oi->_change_backend_component_keys(Device(kNeuron, index));
    return o;
  }
  return neuron_tensor_over(st, oi);
}

// After a CPU kernel ran on alias `a` (storage `ast`) of neuron tensor `t` (out= / in-place), carry
// back what it may have changed: a reallocation (resize_), a storage swap (set_), the geometry.
void sync_back(const Tensor& a, const Tensor& t, c10::StorageImpl* ast) {
  c10::TensorImpl* ai = a.unsafeGetTensorImpl();
  c10::TensorImpl* ti = t.unsafeGetTensorImpl();
  c10::StorageImpl* cur = ai->unsafe_storage().unsafeGetStorageImpl();
  c10::StorageImpl* tst = ti->unsafe_storage().unsafeGetStorageImpl();
  const DeviceIndex index = ti->device().index();
  if (C10_LIKELY(cur == ast)) {
    if (C10_UNLIKELY(cur->_mutable_data_ptr_no_checks().get() != tst->_mutable_data_ptr_no_checks().get() ||
                     cur->nbytes() != tst->nbytes())) {
      c10::DataPtr host = cur->set_data_ptr(c10::DataPtr());
      tst->set_data_ptr_noswap(adopt_host_memory(std::move(host), cur->nbytes(), index));
      tst->set_nbytes(cur->nbytes());
      cur->set_data_ptr_noswap(cpu_data_of(tst));
    }
  } else {
    c10::Storage st = ai->unsafe_storage();
    if (st.device_type() != kNeuron) {
      c10::DeviceGuard guard(Device(kNeuron, index));
      c10::Storage fresh(c10::Storage::use_byte_size_t(), st.nbytes(), device_allocator(), /*resizable=*/true);
      if (st.nbytes()) std::memcpy(fresh.mutable_data(), st.data(), st.nbytes());
      st = fresh;
    }
    ti->set_storage_keep_dtype(std::move(st));
  }
  if (ai->sizes() != ti->sizes() || ai->strides() != ti->strides() || ai->storage_offset() != ti->storage_offset()) {
    ti->set_sizes_and_strides(ai->sizes(), ai->strides(), ai->storage_offset());
  }
}

void copy_device_bytes(const Tensor& dst, const Tensor& src) {
  at::AutoDispatchBelowADInplaceOrView below;
  Tensor d = cpu_alias(dst);
  at::native::copy_(d, cpu_alias(src), false);
}

// A zero-copy CPU alias, for Python code that must read device memory on the host (collectives,
// NKI, serialisation); the alias keeps the device storage alive.
static Tensor host_view(const Tensor& t) {
  adaptive_flush("host_view");  // queued work must be done before this reads or writes device data
  TORCH_CHECK(is_neuron(t), "host_view expects a neuron tensor, got one on ", t.device());
  // Unlike the fallback's aliases, an ordinary CPU tensor (version counter, autograd keys) that
  // Python code can use anywhere, in place included.
  c10::TensorImpl* src = t.unsafeGetTensorImpl();
  c10::StorageImpl* st = storage_of(t);
  check_extent(src, st);
  Tensor a = at::detail::make_tensor<c10::TensorImpl>(cpu_storage_over(st, /*resizable=*/false), kCPUKeys,
                                                      src->dtype());
  copy_geometry(a.unsafeGetTensorImpl(), src);
  return a;
}
// The reverse: a neuron tensor over a CPU tensor's bytes (no copy; the memory becomes device memory
// of `device`, accounted by the allocator when nobody else holds it, copied otherwise).
static Tensor device_view(const Tensor& t, int64_t device) {
  TORCH_CHECK(t.device().is_cpu(), "device_view expects a CPU tensor, got one on ", t.device());
  check_device_index(static_cast<DeviceIndex>(device));
  return copy_into_device(t, static_cast<DeviceIndex>(device));
}

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("host_view(Tensor t) -> Tensor", torch::dispatch(DispatchKey::PrivateUse1, TORCH_FN(host_view)));
  m.def("device_copy(Tensor t, int device) -> Tensor", torch::dispatch(DispatchKey::CPU, TORCH_FN(device_view)));
}

}  // namespace torchneuron
