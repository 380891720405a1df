// The eager hot path: every aten op without a kernel of its own runs here.
//
// A neuron tensor's bytes are host memory, so an op runs as the CPU kernel on zero-copy CPU
// aliases of its arguments; fresh results are re-tagged as device memory (adopted by the
// allocator) instead of copied; in-place and out= results map back to the caller's tensors. View
// ops run the CPU metadata kernel on the neuron tensor itself, so views share storage, version
// counter and _base exactly as on any device. Each op is also appended to the work log, and ops the
// NeuronCore cannot run (by op or by dtype) are counted, warned about once, or refused in strict
// mode.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/_unsafe_view_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/copy_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torchneuron {
using at::Tensor;
using c10::Device;
using c10::DeviceIndex;
using c10::DispatchKey;
using c10::DispatchKeySet;
using c10::IValue;
using torch::jit::Stack;

static const DispatchKeySet kCPUKeys(DispatchKey::CPU);
static const DispatchKeySet kNeuronKeys(DispatchKey::PrivateUse1);

// ---------------------------------------------------------------------------------------------
// Zero-copy CPU aliases and re-tagging
// ---------------------------------------------------------------------------------------------

// TensorImpl::device_opt_ is protected with no setter: reach it through a derived-class member
// pointer (legal for protected members).
struct ImplAccess : c10::TensorImpl {
  static std::optional<Device>& device_opt(c10::TensorImpl* t) { return t->*(&ImplAccess::device_opt_); }
};

static inline bool is_neuron(const Tensor& t) {
  return t.defined() && t.unsafeGetTensorImpl()->device_type() == kNeuron;
}
static inline c10::StorageImpl* storage_of(const Tensor& t) {
  return t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
}

static void release_storage_ref(void* ctx) { c10::raw::intrusive_ptr::decref(static_cast<c10::StorageImpl*>(ctx)); }

// A CPU-tagged, non-owning DataPtr over a neuron storage's bytes; it keeps the storage alive.
static inline c10::DataPtr cpu_data_of(c10::StorageImpl* st) {
  c10::raw::intrusive_ptr::incref(st);
  return c10::DataPtr(st->_mutable_data_ptr_no_checks().get(), st, &release_storage_ref, Device(c10::DeviceType::CPU));
}

// A CPU tensor over the same bytes. It gets a StorageImpl of its own: views made *inside* CPU
// kernels take their device from the storage, so sharing the neuron StorageImpl would give CPU
// kernels "neuron" intermediates. VIEW-constructed with key set {CPU}: no autograd, no version
// counter: the caller is below autograd.
static c10::Allocator* g_cpu_allocator = nullptr;

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

static Tensor cpu_alias(const Tensor& t) {
  c10::TensorImpl* src = t.unsafeGetTensorImpl();
  c10::StorageImpl* st = storage_of(t);
  check_extent(src, st);
  auto cst = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                   c10::SymInt(static_cast<int64_t>(st->nbytes())), cpu_data_of(st),
                                                   g_cpu_allocator, /*resizable=*/true);
  Tensor a = at::detail::make_tensor<c10::TensorImpl>(c10::TensorImpl::VIEW, c10::Storage(std::move(cst)), kCPUKeys,
                                                      src->dtype());
  c10::TensorImpl* ai = a.unsafeGetTensorImpl();
  ImplAccess::device_opt(ai) = Device(c10::DeviceType::CPU);
  ai->set_sizes_and_strides(src->sizes(), src->strides(), src->storage_offset());
  if (C10_UNLIKELY(src->is_conj())) ai->_set_conj(true);
  if (C10_UNLIKELY(src->is_neg())) ai->_set_neg(true);
  return a;
}
static inline Tensor maybe_alias(const Tensor& t) { return is_neuron(t) ? cpu_alias(t) : t; }

// A neuron tensor over neuron storage `st` with the geometry of `like`.
static Tensor neuron_tensor_over(const c10::Storage& st, const c10::TensorImpl* like) {
  Tensor t = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(st), kNeuronKeys, like->dtype());
  c10::TensorImpl* ti = t.unsafeGetTensorImpl();
  ti->set_sizes_and_strides(like->sizes(), like->strides(), like->storage_offset());
  if (like->is_conj()) ti->_set_conj(true);
  if (like->is_neg()) ti->_set_neg(true);
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
static Tensor to_device(Tensor o, DeviceIndex index) {
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
static void sync_back(const Tensor& a, const Tensor& t, c10::StorageImpl* ast) {
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

// ---------------------------------------------------------------------------------------------
// The op table: per operator, what the fallback needs to know (computed once)
// ---------------------------------------------------------------------------------------------
enum OpPolicy : int32_t {
  kPolicyHost = 1,         // the NeuronCore has no implementation: the op runs on the host CPU
  kPolicyImplicitRng = 2,  // the CPU kernel draws from the CPU default generator internally
  kPolicyMixedDevices = 4, // CPU tensor arguments are legitimate (index tensors, copies)
  kPolicyDataMovement = 8, // moves bytes only: no dtype makes it a host op
};
struct OpEntry {
  int32_t id = 0;
  bool classified = false;
  int32_t policy = 0;
  bool returns_view = false;
  c10::SmallVector<uint16_t, 2> generator_args;
  NormStatistics norm;  // layer and batch norm ops: their statistics as on CUDA (norms.cpp)
  std::string name;
  std::atomic<int64_t> host_runs{0};
  std::atomic<bool> warned_op{false};
  std::atomic<bool> warned_dtype{false};
};
static std::mutex g_ops_mutex;
static std::unordered_map<const void*, OpEntry*> g_op_index;
static std::vector<OpEntry*> g_ops;
static std::atomic<bool> g_strict{[] {
  const char* v = std::getenv("TORCHNEURON_STRICT");
  return v && v[0] == '1';
}()};

static bool schema_returns_view(const c10::FunctionSchema& schema) {
  for (const auto& r : schema.returns()) {
    const c10::AliasInfo* ai = r.alias_info();
    if (!ai) continue;
    if (!ai->beforeSets().empty() && !ai->isWrite()) return true;
    for (const auto& c : ai->containedTypes())
      if (!c.beforeSets().empty() && !c.isWrite()) return true;
  }
  return false;
}

static int32_t python_classify(const std::string& name, bool* ok) {
  static auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("torchneuron::_classify_op", "");
  if (!handle.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutograd)) {
    *ok = false;  // Python has not registered the policy yet (import in progress)
    return 0;
  }
  *ok = true;
  return static_cast<int32_t>(handle.typed<int64_t(c10::string_view)>().call(name));
}

static OpEntry& entry_of(const c10::OperatorHandle& op) {
  const void* key = &op.schema();
  OpEntry* e = nullptr;
  {
    std::lock_guard<std::mutex> lock(g_ops_mutex);
    auto it = g_op_index.find(key);
    if (C10_LIKELY(it != g_op_index.end())) {
      e = it->second;
    } else {
      e = new OpEntry();
      const auto& schema = op.schema();
      e->id = static_cast<int32_t>(g_ops.size());
      e->name = c10::toString(op.operator_name());
      e->returns_view = schema_returns_view(schema);
      e->norm = norm_statistics_of(e->name);
      const auto& args = schema.arguments();
      for (size_t i = 0; i < args.size(); ++i) {
        const auto& ty = args[i].type();
        if (ty->kind() == c10::TypeKind::OptionalType &&
            ty->castRaw<c10::OptionalType>()->getElementType()->kind() == c10::TypeKind::GeneratorType)
          e->generator_args.push_back(static_cast<uint16_t>(i));
      }
      g_ops.push_back(e);
      g_op_index.emplace(key, e);
    }
  }
  if (C10_UNLIKELY(!e->classified)) {
    bool ok = false;
    int32_t policy = python_classify(e->name, &ok);
    if (ok) {
      e->policy = policy;
      e->classified = true;
    }
  }
  return *e;
}

int32_t op_id_of(const c10::OperatorHandle& op) { return entry_of(op).id; }

static bool is_host_only_dtype(c10::ScalarType t) {
  return t == c10::kDouble || c10::isComplexType(t);  // no FP64 or complex in NeuronCore hardware
}

static void note_fallback(OpEntry& e, const char* reason_kind, const std::string& reason) {
  e.host_runs++;
  if (g_strict.load(std::memory_order_relaxed)) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, "neuron strict mode: ", e.name, " would fall back to the CPU (", reason,
                                "). Unset TORCHNEURON_STRICT (or call torchneuron.set_strict(False)) to allow "
                                "CPU fallback, or change the program to avoid this op/dtype on neuron.");
  }
  std::atomic<bool>& warned = reason_kind[0] == 'd' ? e.warned_dtype : e.warned_op;
  if (!warned.exchange(true)) {
    static auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("torchneuron::_on_fallback", "");
    if (handle.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutograd))
      handle.typed<void(c10::string_view, c10::string_view)>().call(e.name, reason);
  }
}

[[noreturn]] static void device_mismatch(Device a, Device b) {
  TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ", a, " and ", b,
              "!");
}

// Runs `fn` with the CPU default generator temporarily replaced by the neuron device's engine, for
// CPU kernels that draw random numbers without taking a generator argument.
template <class F>
static void with_device_rng(DeviceIndex index, F&& fn) {
  at::Generator engine = engine_of(std::nullopt, index);
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  c10::intrusive_ptr<c10::TensorImpl> saved;
  {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    saved = cpu.unsafeGetGeneratorImpl()->get_state();
    std::lock_guard<std::mutex> lock2(engine.mutex());
    cpu.unsafeGetGeneratorImpl()->set_state(*engine.unsafeGetGeneratorImpl()->get_state());
  }
  auto restore = [&] {
    std::lock_guard<std::mutex> lock(cpu.mutex());
    std::lock_guard<std::mutex> lock2(engine.mutex());
    engine.unsafeGetGeneratorImpl()->set_state(*cpu.unsafeGetGeneratorImpl()->get_state());
    cpu.unsafeGetGeneratorImpl()->set_state(*saved);
  };
  try {
    fn();
  } catch (...) {
    restore();
    throw;
  }
  restore();
}

// ---------------------------------------------------------------------------------------------
// The boxed fallback
// ---------------------------------------------------------------------------------------------
struct Alias {
  Tensor cpu, dev;
  c10::StorageImpl* storage;
};

static void run_on_device(const c10::OperatorHandle& op, OpEntry& entry, Stack* stack);

void neuron_fallback(const c10::OperatorHandle& op, DispatchKeySet, Stack* stack) {
  OpEntry& entry = entry_of(op);
  if (C10_UNLIKELY(adaptive_active())) {
    if (!entry.returns_view) {
      if (adaptive_enqueue(op, entry.id, stack)) return;
    } else {  // a view runs now; adaptive eager records it if it views queued memory
      const size_t nargs = op.schema().arguments().size();
      std::vector<IValue> args(stack->end() - nargs, stack->end());
      op.redispatchBoxed(kCPUKeys, stack);
      adaptive_note_view(op, entry.id, std::move(args), *stack, op.schema().returns().size());
      return;
    }
  }
  run_on_device(op, entry, stack);
}

// In-place view ops (squeeze_, t_, as_strided_, ...) change a tensor's geometry: adaptive eager's
// queued ops must run first (they were recorded against the old one). The CPU kernel then sets the
// geometry on the neuron TensorImpl itself, as for views.
static void neuron_inplace_view(const c10::OperatorHandle& op, DispatchKeySet, Stack* stack) {
  adaptive_flush("an in-place view op");
  op.redispatchBoxed(kCPUKeys, stack);
}

// The view kernels registered directly (no boxing on the hot path): the native view function, and
// the view noted for adaptive eager mode as the fallback notes the views it runs. _unsafe_view is
// among them: a view in all but its schema (autograd does not track it), recorded as one so fused
// programs compute through it (its composite kernel would alias without reaching the device).
struct DirectView {
  c10::OperatorHandle handle;
  int32_t id;
  explicit DirectView(const char* name)
      : handle(c10::Dispatcher::singleton().findSchemaOrThrow(name, "")), id(op_id_of(handle)) {}
};
static IValue as_ivalue(c10::IntArrayRef v) { return IValue(v.vec()); }
static IValue as_ivalue(std::optional<int64_t> v) { return v ? IValue(*v) : IValue(); }

template <const char* kName, auto kNative, class... Args>
static Tensor neuron_direct_view(const Tensor& self, Args... args) {
  Tensor out = kNative(self, args...);
  if (C10_UNLIKELY(adaptive_active())) {
    static const DirectView op(kName);
    std::vector<IValue> stack_args{IValue(self), as_ivalue(args)...};
    Stack results{IValue(out)};
    adaptive_note_view(op.handle, op.id, std::move(stack_args), results, 1);
  }
  return out;
}
static constexpr char kView[] = "aten::view", kAsStrided[] = "aten::as_strided",
                      kUnsafeView[] = "aten::_unsafe_view", kReshapeAlias[] = "aten::_reshape_alias";
using at::IntArrayRef;
static constexpr auto neuron_view = &neuron_direct_view<kView, &at::native::view, IntArrayRef>;
static constexpr auto neuron_as_strided = &neuron_direct_view<kAsStrided, &at::native::as_strided_tensorimpl,
                                                              IntArrayRef, IntArrayRef, std::optional<int64_t>>;
static constexpr auto neuron_unsafe_view = &neuron_direct_view<kUnsafeView, &at::native::_unsafe_view, IntArrayRef>;
static constexpr auto neuron_reshape_alias =
    &neuron_direct_view<kReshapeAlias, &at::native::_reshape_alias, IntArrayRef, IntArrayRef>;

void run_op_now(const c10::OperatorHandle& op, Stack* stack) { run_on_device(op, entry_of(op), stack); }

void copy_device_bytes(const Tensor& dst, const Tensor& src) {
  at::AutoDispatchBelowADInplaceOrView below;
  Tensor d = cpu_alias(dst);
  at::native::copy_(d, cpu_alias(src), false);
}

static void run_on_device(const c10::OperatorHandle& op, OpEntry& entry, Stack* stack) {
  if (entry.returns_view) {  // metadata only: run the CPU kernel on the neuron TensorImpl itself
    op.redispatchBoxed(kCPUKeys, stack);
    return;
  }
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const size_t nargs = args.size(), nrets = schema.returns().size();
  const size_t base = stack->size() - nargs;
  c10::SmallVector<Alias, 6> aliases;
  c10::SmallVector<uint16_t, 2> written;  // aliases the op may write or resize
  DeviceIndex index = -1;
  Device cpu_operand(c10::DeviceType::CPU);
  bool has_cpu_operand = false, host_dtype = false;
  const bool record = worklog_enabled();
  WorkRecord rec;
  int n_sigs = 0;
  if (record) {
    rec.kind = static_cast<int32_t>(WorkKind::kOp);
    rec.op_id = entry.id;
    rec.flags = 0;
    rec.aux = 0;
    rec.host_seconds = 0;
    rec.pad = 0;
  }

  auto take_device = [&](const Tensor& t) {
    const DeviceIndex i = t.device().index();
    if (index < 0) index = i;
    else if (C10_UNLIKELY(i != index)) device_mismatch(Device(kNeuron, index), Device(kNeuron, i));
  };
  auto note_operand = [&](const Tensor& t) {  // checks and signature of any tensor operand
    if (!t.defined()) return;
    if (is_neuron(t)) {
      host_dtype |= is_host_only_dtype(t.scalar_type());
    } else if (t.dim() != 0) {  // CPU scalars (and Python numbers) may join any op, as with CUDA
      has_cpu_operand = true;
      cpu_operand = t.device();
    }
  };
  auto alias_of = [&](const Tensor& t, bool write) -> Tensor {
    take_device(t);
    Tensor a = cpu_alias(t);
    if (write) written.push_back(static_cast<uint16_t>(aliases.size()));
    aliases.push_back({a, t, storage_of(a)});
    return a;
  };

  for (size_t i = 0; i < nargs; ++i) {
    IValue& v = (*stack)[base + i];
    const c10::AliasInfo* ainfo = args[i].alias_info();
    const bool write = ainfo && ainfo->isWrite();
    if (v.isTensor()) {
      const Tensor& t = v.toTensor();
      note_operand(t);
      // CPU scalars (wrapped Python numbers) are immediates of the instruction, not device operands
      if (record && n_sigs < kMaxSigs - 1 && is_neuron(t)) fill_sig(rec.sigs[n_sigs++], t);
      if (is_neuron(t)) {
        Tensor dev = std::move(v).toTensor();
        v = IValue(alias_of(dev, write));
      }
    } else if (v.isTensorList()) {
      auto list = v.toTensorList();
      bool any = false;
      int64_t numel = 0;
      c10::ScalarType dtype = c10::kFloat;
      for (const Tensor& t : list) {
        note_operand(t);
        any |= is_neuron(t);
        numel += t.numel();
        dtype = t.scalar_type();
      }
      if (record && n_sigs < kMaxSigs - 1 && list.size()) fill_sig_numel(rec.sigs[n_sigs++], dtype, numel);
      if (any) {
        c10::List<Tensor> converted;
        converted.reserve(list.size());
        for (const Tensor& t : list) converted.push_back(is_neuron(t) ? alias_of(t, write) : t);
        v = IValue(std::move(converted));
      }
    } else if (v.isList()) {  // Tensor?[] (index, index_put_): keep the element type for unboxing
      auto list = v.toList();
      bool any = false;
      for (const IValue& e : list) {
        if (e.isTensor() && is_neuron(e.toTensor())) {
          any = true;
          host_dtype |= is_host_only_dtype(e.toTensor().scalar_type());
        }
      }
      if (any) {
        c10::impl::GenericList converted(list.elementType());
        converted.reserve(list.size());
        for (const IValue& e : list)
          converted.push_back(e.isTensor() && is_neuron(e.toTensor()) ? IValue(alias_of(e.toTensor(), false)) : e);
        v = IValue(std::move(converted));
      }
    } else if (v.isDevice() && v.toDevice().type() == kNeuron) {
      const DeviceIndex i = v.toDevice().has_index() ? v.toDevice().index() : current_device();
      check_device_index(i);
      if (index < 0) index = i;
      v = IValue(Device(c10::DeviceType::CPU));
    }
  }
  if (index < 0) index = current_device();
  if (C10_UNLIKELY(has_cpu_operand) && !(entry.policy & kPolicyMixedDevices)) {
    device_mismatch(Device(kNeuron, index), cpu_operand);
  }
  for (uint16_t gi : entry.generator_args) {  // the device's generator drives CPU kernels
    IValue& v = (*stack)[base + gi];
    std::optional<at::Generator> g;
    if (!v.isNone()) g = v.toGenerator();
    v = IValue(engine_of(g, index));
  }
  const bool on_host = (entry.policy & kPolicyHost) || (host_dtype && !(entry.policy & kPolicyDataMovement));
  if (C10_UNLIKELY(on_host)) {
    if (entry.policy & kPolicyHost)
      note_fallback(entry, "op", "no NeuronCore implementation");
    else
      note_fallback(entry, "dtype", "float64/complex operands: the NeuronCore has no FP64 or complex hardware");
  }

  {
    at::AutoDispatchBelowADInplaceOrView below;  // we are the backend; aliases carry no autograd keys
    if (C10_UNLIKELY(on_host && record)) {
      auto t0 = std::chrono::steady_clock::now();
      if (entry.policy & kPolicyImplicitRng) with_device_rng(index, [&] { op.redispatchBoxed(kCPUKeys, stack); });
      else op.redispatchBoxed(kCPUKeys, stack);
      rec.host_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    } else if (C10_UNLIKELY(entry.policy & kPolicyImplicitRng)) {
      with_device_rng(index, [&] { op.redispatchBoxed(kCPUKeys, stack); });
    } else if (C10_LIKELY(entry.norm.result_dtype_from.empty()) || !run_norm_as_cuda(op, entry.norm, stack, kCPUKeys)) {
      op.redispatchBoxed(kCPUKeys, stack);
    }
  }

  for (uint16_t k : written) sync_back(aliases[k].cpu, aliases[k].dev, aliases[k].storage);

  auto map_out = [&](Tensor o) -> Tensor {
    if (!o.defined()) return o;
    c10::TensorImpl* oi = o.unsafeGetTensorImpl();
    for (auto& p : aliases)
      if (p.cpu.unsafeGetTensorImpl() == oi) return p.dev;  // in-place / out= returns its argument
    if (oi->has_storage()) {
      c10::StorageImpl* ost = oi->unsafe_storage().unsafeGetStorageImpl();
      for (auto& p : aliases)  // a new view of an input (e.g. _unsafe_view): view the neuron storage
        if (p.storage == ost) return neuron_tensor_over(p.dev.unsafeGetTensorImpl()->unsafe_storage(), oi);
    }
    return to_device(std::move(o), index);
  };
  const size_t rbase = stack->size() - nrets;
  int n_inputs = n_sigs;
  for (size_t i = 0; i < nrets; ++i) {
    IValue& v = (*stack)[rbase + i];
    if (v.isTensor()) {
      v = IValue(map_out(std::move(v).toTensor()));
      if (record && n_sigs < kMaxSigs) fill_sig(rec.sigs[n_sigs++], v.toTensor());
    } else if (v.isTensorList()) {
      auto list = std::move(v).toTensorList();
      c10::List<Tensor> converted;
      converted.reserve(list.size());
      int64_t numel = 0;
      c10::ScalarType dtype = c10::kFloat;
      for (const Tensor& t : list) {
        converted.push_back(map_out(t));
        if (t.defined()) {
          numel += t.numel();
          dtype = t.scalar_type();
        }
      }
      if (record && n_sigs < kMaxSigs && list.size()) fill_sig_numel(rec.sigs[n_sigs++], dtype, numel);
      v = IValue(std::move(converted));
    }
  }
  if (record) {
    if (on_host) rec.flags |= kFallback;
    rec.n_inputs = n_inputs;
    rec.n_sigs = n_sigs;
    for (int s = n_sigs; s < kMaxSigs; ++s) fill_sig(rec.sigs[s], Tensor());  // zeroed: records are hashed
    worklog_append(rec, index);
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels that have no CPU counterpart to fall back to
// ---------------------------------------------------------------------------------------------
// Appends one record for work done by a kernel of our own (not the fallback).
static void record_work(WorkKind kind, const c10::OperatorHandle& op, int32_t flags,
                        std::initializer_list<const Tensor*> inputs, std::initializer_list<const Tensor*> outputs,
                        DeviceIndex index) {
  WorkRecord rec;
  rec.kind = static_cast<int32_t>(kind);
  rec.op_id = op_id_of(op);
  rec.flags = flags;
  rec.aux = 0;
  rec.host_seconds = 0;
  rec.pad = 0;
  int n = 0;
  for (const Tensor* t : inputs)
    if (n < kMaxSigs - 1 && t->defined()) fill_sig(rec.sigs[n++], *t);
  rec.n_inputs = n;
  for (const Tensor* t : outputs)
    if (n < kMaxSigs && t->defined()) fill_sig(rec.sigs[n++], *t);
  rec.n_sigs = n;
  for (int k = n; k < kMaxSigs; ++k) fill_sig(rec.sigs[k], Tensor());  // zeroed: records are hashed
  worklog_append(rec, index);
}

static void record_copy(const Tensor& src, const Tensor& dst) {
  if (!worklog_enabled()) return;
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  const bool s = is_neuron(src), d = is_neuron(dst);
  const int32_t flags = s && d ? kDeviceToDevice : (d ? kHostToDevice : kDeviceToHost);
  record_work(WorkKind::kCopy, handle, flags, {&src}, {&dst}, d ? dst.device().index() : src.device().index());
}

static void check_copy_devices(const Tensor& src, const Tensor& dst) {
  if (is_neuron(src)) check_device_index(src.device().index());
  if (is_neuron(dst)) check_device_index(dst.device().index());
  auto other_ok = [](const Tensor& t) { return is_neuron(t) || t.device().is_cpu(); };
  TORCH_CHECK(other_ok(src) && other_ok(dst), "neuron can copy to and from the CPU only, got a copy from ",
              src.device(), " to ", dst.device(), "; move the tensor to the CPU first.");
}

Tensor& neuron_copy_(Tensor& self, const Tensor& src, bool non_blocking) {
  if (C10_UNLIKELY(adaptive_active())) {
    // A same-dtype device copy into memory the queue did not make (a fresh allocation, an input of
    // the queued work) waits in the queue like any op. Other copies flush first: fused programs
    // traced with copies into queued results, or converting copies, computed wrong values (a
    // Llama's attention mask; fft.hfft2 in the OpInfo sweep).
    if (is_neuron(self) && is_neuron(src) && self.scalar_type() == src.scalar_type() &&
        !c10::isComplexType(self.scalar_type()) && !adaptive_is_queued(self)) {
      static const c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
      static const int32_t id = op_id_of(handle);
      Stack stack{IValue(self), IValue(src), IValue(non_blocking)};
      if (adaptive_enqueue(handle, id, &stack)) return self;
    } else {
      adaptive_flush(is_neuron(self) && is_neuron(src) ? "copy_ into a queued result" : "copy_ to or from the host");
    }
  }
  check_copy_devices(src, self);
  {
    at::AutoDispatchBelowADInplaceOrView below;
    Tensor d = maybe_alias(self);
    at::native::copy_(d, maybe_alias(src), non_blocking);
  }
  record_copy(src, self);
  return self;
}
Tensor neuron_copy_from(const Tensor& self, const Tensor& dst, bool non_blocking) {
  Tensor d = dst;
  neuron_copy_(d, self, non_blocking);
  return dst;
}
Tensor neuron_copy_from_and_resize(const Tensor& self, const Tensor& dst) {
  if (dst.sizes() != self.sizes()) {
    at::AutoDispatchBelowADInplaceOrView below;
    dst.resize_(self.sizes());
  }
  Tensor d = dst;
  neuron_copy_(d, self, false);
  return dst;
}
Tensor& neuron_set_empty(Tensor& self) {
  adaptive_flush("set_");  // queued work must be done before this reads or writes device data
  c10::DeviceGuard guard(self.device());
  c10::Storage st(c10::Storage::use_byte_size_t(), 0, device_allocator(), true);
  std::vector<int64_t> size{0}, stride{};
  return self.set_(st, 0, size, stride);
}

static void record_op_on(const char* name, const char* overload, std::initializer_list<const Tensor*> ins,
                         std::initializer_list<const Tensor*> outs, DeviceIndex index) {
  if (!worklog_enabled()) return;
  record_work(WorkKind::kOp, c10::Dispatcher::singleton().findSchemaOrThrow(name, overload), 0, ins, outs, index);
}

static void check_same_neuron_device(std::initializer_list<const Tensor*> ts) {
  DeviceIndex index = -1;
  for (const Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!is_neuron(*t)) device_mismatch(Device(kNeuron, index < 0 ? 0 : index), t->device());
    if (index < 0) index = t->device().index();
    else if (t->device().index() != index) device_mismatch(Device(kNeuron, index), t->device());
  }
}

// PyTorch's fake tensors (torch.compile) give a backend's own convolution ("Overrideable")
// contiguous outputs and gradients, so the device returns them so, whatever layout the host kernel
// picked (channels_last for channels_last inputs): compiled code indexes them by those strides.
Tensor neuron_convolution(const Tensor& input, const Tensor& weight, const std::optional<Tensor>& bias,
                          c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
                          c10::IntArrayRef output_padding, int64_t groups) {
  adaptive_flush("convolution");  // queued work must be done before this reads or writes device data
  const Tensor undefined;
  const Tensor& b = bias.has_value() ? *bias : undefined;
  check_same_neuron_device({&input, &weight, &b});
  Tensor out;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    std::optional<Tensor> cb = b.defined() ? std::optional<Tensor>(cpu_alias(b)) : std::nullopt;
    out = to_device(at::convolution(cpu_alias(input), cpu_alias(weight), cb, stride, padding, dilation, transposed,
                                    output_padding, groups).contiguous(),
                    input.device().index());
  }
  record_op_on("aten::convolution_overrideable", "", {&input, &weight}, {&out}, input.device().index());
  return out;
}

std::tuple<Tensor, Tensor, Tensor> neuron_convolution_backward(
    const Tensor& grad_output, const Tensor& input, const Tensor& weight, c10::IntArrayRef stride,
    c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed, c10::IntArrayRef output_padding,
    int64_t groups, std::array<bool, 3> mask) {
  adaptive_flush("convolution_backward");  // queued work must be done before this reads or writes device data
  check_same_neuron_device({&grad_output, &input, &weight});
  const DeviceIndex index = input.device().index();
  std::tuple<Tensor, Tensor, Tensor> r;
  {
    at::AutoDispatchBelowADInplaceOrView below;
    std::vector<int64_t> bias_sizes{transposed ? weight.size(1) * groups : weight.size(0)};
    r = at::convolution_backward(cpu_alias(grad_output), cpu_alias(input), cpu_alias(weight),
                                 c10::IntArrayRef(bias_sizes), stride, padding, dilation, transposed, output_padding,
                                 groups, mask);
  }
  auto dev = [&](const Tensor& t) { return t.defined() ? to_device(t.contiguous(), index) : t; };
  std::tuple<Tensor, Tensor, Tensor> out{dev(std::get<0>(r)), dev(std::get<1>(r)), dev(std::get<2>(r))};
  record_op_on("aten::convolution_backward_overrideable", "", {&grad_output, &input, &weight},
               {&std::get<1>(out)}, index);
  return out;
}

// Tensor.record_stream: tells the allocator the block is used on `stream` (see recordStream).
void neuron_record_stream(Tensor& self, c10::Stream stream) {
  adaptive_flush("record_stream");  // queued work must be done before this reads or writes device data
  TORCH_CHECK(stream.device_type() == kNeuron, "record_stream expects a neuron stream, got one on ", stream.device());
  static_cast<c10::DeviceAllocator*>(device_allocator())->recordStream(self.storage().data_ptr(), stream);
}

// `param.data = neuron_tensor` (Module.to) swaps a tensor's metadata in place only when the two
// TensorImpls are "shallow-copy compatible"; c10 lists dense backends by name and PrivateUse1 is not
// among them, so without this Module.to("neuron") would replace parameters and untie shared ones
// (GPT-2's wte/lm_head). Dense strided CPU and neuron tensors are as compatible as CPU and CUDA.
bool neuron_has_compatible_shallow_copy_type(const Tensor& self, const Tensor& from) {
  auto dense_strided = [](const Tensor& t) {
    return t.layout() == c10::kStrided && (is_neuron(t) || t.device().is_cpu()) && !t.is_quantized() &&
           !t.is_nested();
  };
  return dense_strided(self) && dense_strided(from);
}

// resize_ and set_ swap a tensor's storage or change its geometry: their CPU kernel runs on the
// neuron TensorImpl itself. Queued ops were recorded against the old geometry, so they run first
// (soft_margin_loss's out= kernel resizes its output between queued ops), unless the resize
// changes nothing.
void neuron_resize_or_set(const c10::OperatorHandle& op, DispatchKeySet, Stack* stack) {
  static const c10::OperatorName resize("aten::resize_", "");
  const size_t base = stack->size() - op.schema().arguments().size();
  const bool same_size = op.operator_name() == resize && (*stack)[base + 2].isNone() &&
                         (*stack)[base].toTensor().sym_sizes().equals((*stack)[base + 1].toSymIntList().vec());
  if (!same_size) adaptive_flush("resize_ or set_ of a tensor");
  op.redispatchBoxed(kCPUKeys, stack);
}

// ---------------------------------------------------------------------------------------------
// Factories
// ---------------------------------------------------------------------------------------------
static DeviceIndex factory_device(std::optional<c10::Device> device) {
  DeviceIndex i = device && device->has_index() ? device->index() : current_device();
  check_device_index(i);
  return i;
}
Tensor neuron_empty(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                    std::optional<c10::Device> device, std::optional<bool>, std::optional<c10::MemoryFormat> mf) {
  TORCH_CHECK(!layout || *layout == c10::kStrided, "neuron supports strided tensors only, got layout ", *layout);
  c10::DeviceGuard guard(Device(kNeuron, factory_device(device)));
  return at::detail::empty_generic(size, device_allocator(), kNeuronKeys, c10::dtype_or_default(dtype), mf);
}
Tensor neuron_empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                            std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                            std::optional<bool>) {
  TORCH_CHECK(!layout || *layout == c10::kStrided, "neuron supports strided tensors only, got layout ", *layout);
  c10::DeviceGuard guard(Device(kNeuron, factory_device(device)));
  return at::detail::empty_strided_generic(size, stride, device_allocator(), kNeuronKeys, c10::dtype_or_default(dtype));
}

// ---------------------------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------------------------
static std::vector<std::unique_ptr<torch::Library>> g_libraries;
static torch::Library& library(const char* ns) {
  g_libraries.push_back(
      std::make_unique<torch::Library>(torch::Library::IMPL, ns, DispatchKey::PrivateUse1, __FILE__, __LINE__));
  return *g_libraries.back();
}

static int64_t g_direct_structured = 0;

static bool g_installed = [] {
  g_cpu_allocator = c10::GetCPUAllocator();
  library("_").fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
  auto& m = library("aten");
  m.impl("empty.memory_format", TORCH_FN(neuron_empty));
  m.impl("empty_strided", TORCH_FN(neuron_empty_strided));
  m.impl("view", TORCH_FN(neuron_view));
  m.impl("as_strided", TORCH_FN(neuron_as_strided));
  m.impl("_reshape_alias", TORCH_FN(neuron_reshape_alias));
  m.impl("_unsafe_view", TORCH_FN(neuron_unsafe_view));
  for (const char* n : {"resize_", "set_.source_Storage_storage_offset", "set_.source_Storage", "set_.source_Tensor"})
    m.impl(n, torch::CppFunction::makeFromBoxedFunction<&neuron_resize_or_set>());
  m.impl("set_", TORCH_FN(neuron_set_empty));
  m.impl("copy_", TORCH_FN(neuron_copy_));
  m.impl("record_stream", TORCH_FN(neuron_record_stream));
  m.impl("_has_compatible_shallow_copy_type", TORCH_FN(neuron_has_compatible_shallow_copy_type));
  m.impl("_copy_from", TORCH_FN(neuron_copy_from));
  m.impl("_copy_from_and_resize", TORCH_FN(neuron_copy_from_and_resize));
  m.impl("convolution_overrideable", TORCH_FN(neuron_convolution));
  m.impl("convolution_backward_overrideable", TORCH_FN(neuron_convolution_backward));

  // Structured functional/in-place ops reach a backend through a CompositeExplicitAutograd-
  // NonFunctional wrapper (meta function, allocation, then the .out kernel). Sending them straight
  // to the fallback runs the CPU functional kernel in one step, about half the overhead; the
  // fallback's own device check replaces the skipped meta check.
  auto& d = c10::Dispatcher::singleton();
  for (const auto& name : d.getAllOpNames()) {
    if (name.name.rfind("aten::", 0) != 0) continue;
    auto h = d.findOp(name);
    if (!h || h->hasKernelForDispatchKey(DispatchKey::PrivateUse1)) continue;
    if (h->hasTag(at::Tag::inplace_view)) {  // (squeeze_, as_strided_, ...: metadata, but see below)
      std::string s = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
      m.impl(s.c_str(), torch::CppFunction::makeFromBoxedFunction<&neuron_inplace_view>());
      continue;
    }
    // Foreach ops too: one device op over a list (one launch on the NeuronCore, one entry in
    // adaptive eager's queue), not a host loop of per-tensor ops through the dispatcher.
    // clone too: one op making a fresh tensor, not an allocation and a copy into it.
    // And ops with a CPU kernel of their own whose CompositeExplicitAutograd kernel would otherwise
    // win over the fallback on neuron (native_layer_norm, native_group_norm, addr, ...): a different
    // implementation rounds differently, and the device must give the CPU kernel's results.
    const bool foreach = name.name.rfind("aten::_foreach_", 0) == 0;
    const bool whole = foreach || name.name == "aten::clone";
    const bool has_cpu = h->hasKernelForDispatchKey(DispatchKey::CPU);
    const bool composite = h->hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutogradNonFunctional) ||
                           h->hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutograd);
    if (!whole && !(composite && has_cpu)) continue;
    std::string s = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    m.impl(s.c_str(), torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
    ++g_direct_structured;
  }
  // _copy_from is not in the Conjugate/Negative fallthrough lists; without these, copying a conj
  // view recurses (MathOpFallback -> clone -> copy_ -> _copy_from -> MathOpFallback ...).
  for (DispatchKey k : {DispatchKey::Conjugate, DispatchKey::Negative}) {
    g_libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, "aten", k, __FILE__, __LINE__));
    g_libraries.back()->impl("_copy_from", torch::CppFunction::makeFallthrough());
    g_libraries.back()->impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
  }
  return true;
}();

// ---- introspection for Python ----
static std::tuple<std::vector<std::string>, std::vector<int64_t>> host_fallback_counts() {
  std::vector<std::string> names;
  std::vector<int64_t> counts;
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  for (OpEntry* e : g_ops) {
    int64_t n = e->host_runs.load();
    if (n) {
      names.push_back(e->name);
      counts.push_back(n);
    }
  }
  return {names, counts};
}
static void reset_host_fallback_counts() {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  for (OpEntry* e : g_ops) e->host_runs = 0;
}
static std::vector<std::string> op_names(int64_t start) {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  std::vector<std::string> out;
  for (size_t i = static_cast<size_t>(std::max<int64_t>(start, 0)); i < g_ops.size(); ++i) out.push_back(g_ops[i]->name);
  return out;
}
static void set_strict(bool on) { g_strict = on; }
static bool strict() { return g_strict.load(); }
static void reclassify_ops() {
  std::lock_guard<std::mutex> lock(g_ops_mutex);
  for (OpEntry* e : g_ops) e->classified = false;
}
static int64_t direct_structured_ops() { return g_direct_structured; }

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
  auto cst = c10::make_intrusive<c10::StorageImpl>(c10::StorageImpl::use_byte_size_t(),
                                                   c10::SymInt(static_cast<int64_t>(st->nbytes())), cpu_data_of(st),
                                                   g_cpu_allocator, /*resizable=*/false);
  Tensor a = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(std::move(cst)), kCPUKeys, src->dtype());
  a.unsafeGetTensorImpl()->set_sizes_and_strides(src->sizes(), src->strides(), src->storage_offset());
  if (src->is_conj()) a.unsafeGetTensorImpl()->_set_conj(true);
  if (src->is_neg()) a.unsafeGetTensorImpl()->_set_neg(true);
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
  m.def("host_fallback_counts() -> (str[], int[])", &host_fallback_counts);
  m.def("reset_host_fallback_counts() -> ()", &reset_host_fallback_counts);
  m.def("op_names(int start) -> str[]", &op_names);
  m.def("set_strict(bool on) -> ()", &set_strict);
  m.def("strict() -> bool", &strict);
  m.def("reclassify_ops() -> ()", &reclassify_ops);
  m.def("direct_structured_ops() -> int", &direct_structured_ops);
}
TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("host_view(Tensor t) -> Tensor", torch::dispatch(DispatchKey::PrivateUse1, TORCH_FN(host_view)));
  m.def("device_copy(Tensor t, int device) -> Tensor", torch::dispatch(DispatchKey::CPU, TORCH_FN(device_view)));
}

}  // namespace torchneuron
