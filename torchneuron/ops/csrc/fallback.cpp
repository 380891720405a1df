// The eager hot path: every aten op without a kernel of its own runs here.
//
// A neuron tensor's bytes are host memory, so an op runs as the CPU kernel on zero-copy CPU
// aliases of its arguments; fresh results are re-tagged as device memory (adopted by the
// allocator) instead of copied; in-place and out= results map back to the caller's tensors
// (host_alias.h). Ops the fallback cannot run so have kernels of their own (kernels.cpp). View
// ops run the CPU metadata kernel on the neuron tensor itself, so views share storage, version
// counter and _base exactly as on any device. Each op is also appended to the work log, and ops the
// NeuronCore cannot run (by op or by dtype) are counted, warned about once, or refused in strict
// mode.
#include "host_alias.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/_unsafe_view_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace torchneuron {

// ---------------------------------------------------------------------------------------------
// The op table: per operator, what the fallback needs to know (computed once)
// ---------------------------------------------------------------------------------------------
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
static std::atomic<bool> g_strict{false};  // set from settings.strict at load (python.cpp's configure)

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

static int32_t python_fallback_policy(const std::string& name, bool* ok) {
  static auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("torchneuron::_fallback_policy", "");
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
    int32_t policy = python_fallback_policy(e->name, &ok);
    if (ok) {
      e->policy = policy;
      e->classified = true;
    }
  }
  return *e;
}

int32_t op_id_of(const c10::OperatorHandle& op) { return entry_of(op).id; }

// Whether any tensor argument of the op on the stack is complex (float64 alone can be emulated).
static bool has_complex_operand(const Stack& stack, size_t base, size_t nargs) {
  for (size_t i = base; i < base + nargs; ++i) {
    const IValue& v = stack[i];
    if (v.isTensor() && v.toTensor().defined() && c10::isComplexType(v.toTensor().scalar_type())) return true;
    if (v.isTensorList())
      for (const at::Tensor& t : v.toTensorList())
        if (t.defined() && c10::isComplexType(t.scalar_type())) return true;
  }
  return false;
}

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

[[noreturn]] void device_mismatch(Device a, Device b) {
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

// A neuron generator passed to an op on host tensors (torch.randn(..., device="cpu",
// generator=neuron_gen), or normal_ on a CPU tensor): the generator alone routed the op here.
// Code written for Neuron draws its noise on the host with the device's generator (diffusers'
// randn_tensor does), so the op runs on the CPU, its numbers from the device generator's stream
// (the same numbers the device would have drawn), and its results stay on the host. Returns false
// when a neuron tensor or device takes part: then the op is device work as usual.
static bool run_host_op_with_device_generator(const c10::OperatorHandle& op, OpEntry& entry, Stack* stack) {
  const size_t nargs = op.schema().arguments().size();
  const size_t base = stack->size() - nargs;
  for (size_t i = 0; i < nargs; ++i) {
    const IValue& v = (*stack)[base + i];
    if (v.isTensor() && is_neuron(v.toTensor())) return false;
    if (v.isDevice() && v.toDevice().type() == kNeuron) return false;
    if (v.isTensorList())
      for (const Tensor& t : v.toTensorList())
        if (is_neuron(t)) return false;
  }
  bool device_generator = false;
  for (uint16_t gi : entry.generator_args) {
    IValue& v = (*stack)[base + gi];
    if (v.isNone() || v.toGenerator().device().type() != kNeuron) continue;
    const at::Generator g = v.toGenerator();
    v = IValue(engine_of(g, g.device().index()));
    device_generator = true;
  }
  if (!device_generator) return false;
  at::AutoDispatchBelowADInplaceOrView below;
  op.redispatchBoxed(kCPUKeys, stack);
  return true;
}

void neuron_fallback(const c10::OperatorHandle& op, DispatchKeySet, Stack* stack) {
  OpEntry& entry = entry_of(op);
  if (C10_UNLIKELY(!entry.generator_args.empty()) && run_host_op_with_device_generator(op, entry, stack)) return;
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

// ---------------------------------------------------------------------------------------------
// Running an op on the device, in named steps (run_on_device at the end calls them in order)
// ---------------------------------------------------------------------------------------------
// One op call on its way through the steps: what each step finds out and a later one uses. The
// steps are inlined into run_on_device, so the call is one function on the hot path, as before.
struct DeviceCall {
  DeviceCall(const c10::OperatorHandle& op, OpEntry& entry, Stack* stack)
      : op(op), entry(entry), stack(stack), args(op.schema().arguments()), nargs(args.size()),
        nrets(op.schema().returns().size()), base(stack->size() - nargs), record(worklog_enabled()) {}
  const c10::OperatorHandle& op;
  OpEntry& entry;
  Stack* stack;
  const std::vector<c10::Argument>& args;
  const size_t nargs, nrets, base;           // the arguments are (*stack)[base, base + nargs)
  const bool record;                         // the work log is on: the call leaves a record
  c10::SmallVector<Alias, 6> aliases;        // the CPU alias of each neuron tensor argument
  c10::SmallVector<uint16_t, 2> written;     // aliases the op may write or resize
  DeviceIndex index = -1;                    // the device the op runs on
  Device cpu_operand{c10::DeviceType::CPU};  // a CPU tensor operand's device (for the error)
  bool has_cpu_operand = false;              // a CPU tensor (not a 0-d scalar) among the operands
  bool host_dtype = false;                   // a float64 or complex neuron operand
  bool on_host = false;                      // the op runs as a host fallback
  WorkRecord rec;                            // filled only when `record`
  int n_sigs = 0, n_inputs = 0;
};

// Step 1: the work record's fields that do not depend on the operands.
C10_ALWAYS_INLINE static void begin_record(DeviceCall& c) {
  if (!c.record) return;
  c.rec.kind = static_cast<int32_t>(WorkKind::kOp);
  c.rec.op_id = c.entry.id;
  c.rec.flags = 0;
  c.rec.aux = 0;
  c.rec.host_seconds = 0;
  c.rec.pad = 0;
}

// ---- step 2's pieces: the operands, their devices and their CPU aliases ----
C10_ALWAYS_INLINE static void take_device(DeviceCall& c, const Tensor& t) {
  const DeviceIndex i = t.device().index();
  if (c.index < 0) c.index = i;
  else if (C10_UNLIKELY(i != c.index)) device_mismatch(Device(kNeuron, c.index), Device(kNeuron, i));
}
C10_ALWAYS_INLINE static void note_operand(DeviceCall& c, const Tensor& t) {  // any tensor operand
  if (!t.defined()) return;
  if (is_neuron(t)) {
    c.host_dtype |= is_host_only_dtype(t.scalar_type());
  } else if (t.dim() != 0) {  // CPU scalars (and Python numbers) may join any op, as with CUDA
    c.has_cpu_operand = true;
    c.cpu_operand = t.device();
  }
}
C10_ALWAYS_INLINE static Tensor alias_of(DeviceCall& c, const Tensor& t, bool write) {
  take_device(c, t);
  Tensor a = cpu_alias(t);
  if (write) c.written.push_back(static_cast<uint16_t>(c.aliases.size()));
  c.aliases.push_back({a, t, storage_of(a)});
  return a;
}
C10_ALWAYS_INLINE static void alias_tensor(DeviceCall& c, IValue& v, bool write) {
  const Tensor& t = v.toTensor();
  note_operand(c, t);
  // CPU scalars (wrapped Python numbers) are immediates of the instruction, not device operands
  if (c.record && c.n_sigs < kMaxSigs - 1 && is_neuron(t)) fill_sig(c.rec.sigs[c.n_sigs++], t);
  if (is_neuron(t)) {
    Tensor dev = std::move(v).toTensor();
    v = IValue(alias_of(c, dev, write));
  }
}
C10_ALWAYS_INLINE static void alias_tensor_list(DeviceCall& c, IValue& v, bool write) {
  auto list = v.toTensorList();
  bool any = false;
  int64_t numel = 0;
  c10::ScalarType dtype = c10::kFloat;
  for (const Tensor& t : list) {
    note_operand(c, t);
    any |= is_neuron(t);
    numel += t.numel();
    dtype = t.scalar_type();
  }
  if (c.record && c.n_sigs < kMaxSigs - 1 && list.size()) fill_sig_numel(c.rec.sigs[c.n_sigs++], dtype, numel);
  if (any) {
    c10::List<Tensor> converted;
    converted.reserve(list.size());
    for (const Tensor& t : list) converted.push_back(is_neuron(t) ? alias_of(c, t, write) : t);
    v = IValue(std::move(converted));
  }
}
// Tensor?[] (index, index_put_): the converted list keeps the element type, for unboxing.
C10_ALWAYS_INLINE static void alias_optional_tensor_list(DeviceCall& c, IValue& v) {
  auto list = v.toList();
  bool any = false;
  for (const IValue& e : list) {
    if (e.isTensor() && is_neuron(e.toTensor())) {
      any = true;
      c.host_dtype |= is_host_only_dtype(e.toTensor().scalar_type());
    }
  }
  if (any) {
    c10::impl::GenericList converted(list.elementType());
    converted.reserve(list.size());
    for (const IValue& e : list)
      converted.push_back(e.isTensor() && is_neuron(e.toTensor()) ? IValue(alias_of(c, e.toTensor(), false)) : e);
    v = IValue(std::move(converted));
  }
}
// A device argument (a factory's device=neuron:1): the op runs there, its CPU kernel gets the CPU.
C10_ALWAYS_INLINE static void take_device_argument(DeviceCall& c, IValue& v) {
  const DeviceIndex i = v.toDevice().has_index() ? v.toDevice().index() : current_device();
  check_device_index(i);
  if (c.index < 0) c.index = i;
  v = IValue(Device(c10::DeviceType::CPU));
}

// Step 2: each neuron tensor argument replaced by its CPU alias (noting the signatures of the
// inputs, their devices, CPU operands and host-only dtypes), a neuron device argument by the CPU.
C10_ALWAYS_INLINE static void alias_arguments(DeviceCall& c) {
  for (size_t i = 0; i < c.nargs; ++i) {
    IValue& v = (*c.stack)[c.base + i];
    const c10::AliasInfo* ainfo = c.args[i].alias_info();
    const bool write = ainfo && ainfo->isWrite();
    if (v.isTensor()) alias_tensor(c, v, write);
    else if (v.isTensorList()) alias_tensor_list(c, v, write);
    else if (v.isList()) alias_optional_tensor_list(c, v);
    else if (v.isDevice() && v.toDevice().type() == kNeuron) take_device_argument(c, v);
  }
}

// Step 3: the device the op runs on (the current one if no operand names one); CPU tensor
// operands are an error unless the op's policy allows mixed devices.
C10_ALWAYS_INLINE static void check_devices(DeviceCall& c) {
  if (c.index < 0) c.index = current_device();
  if (C10_UNLIKELY(c.has_cpu_operand) && !(c.entry.policy & kPolicyMixedDevices)) {
    device_mismatch(Device(kNeuron, c.index), c.cpu_operand);
  }
}

// Step 4: generator arguments (given or not) become the CPU engine of the device's generator.
C10_ALWAYS_INLINE static void bind_generators(DeviceCall& c) {
  for (uint16_t gi : c.entry.generator_args) {
    IValue& v = (*c.stack)[c.base + gi];
    std::optional<at::Generator> g;
    if (!v.isNone()) g = v.toGenerator();
    v = IValue(engine_of(g, c.index));
  }
}

// Step 5: the fallback policy: the op runs on the host if the NeuronCore has no implementation
// of it or cannot compute its dtype (float64 arithmetic is emulated, complex is not); a host
// run is counted, warned about once, or refused in strict mode.
C10_ALWAYS_INLINE static void apply_policy(DeviceCall& c) {
  const int32_t policy = c.entry.policy;
  c.on_host = (policy & kPolicyHost) ||
              (c.host_dtype && !(policy & kPolicyDataMovement) &&
               !((policy & kPolicyFp64Emulated) && !has_complex_operand(*c.stack, c.base, c.nargs)));
  if (C10_UNLIKELY(c.on_host)) {
    if (policy & kPolicyHost)
      note_fallback(c.entry, "op", "no NeuronCore implementation");
    else
      note_fallback(c.entry, "dtype", "float64/complex operands: the NeuronCore has no FP64 or complex hardware");
  }
}

// Step 6: the CPU kernel on the aliases: timed when it is a host fallback the work log records,
// with the device's generator as the CPU default one for ops drawing implicitly, and through
// CUDA's statistics for norm ops (norms.cpp).
C10_ALWAYS_INLINE static void execute(DeviceCall& c) {
  at::AutoDispatchBelowADInplaceOrView below;  // we are the backend; aliases carry no autograd keys
  const c10::OperatorHandle& op = c.op;
  Stack* stack = c.stack;
  if (C10_UNLIKELY(c.on_host && c.record)) {
    auto t0 = std::chrono::steady_clock::now();
    if (c.entry.policy & kPolicyImplicitRng) with_device_rng(c.index, [&] { op.redispatchBoxed(kCPUKeys, stack); });
    else op.redispatchBoxed(kCPUKeys, stack);
    c.rec.host_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  } else if (C10_UNLIKELY(c.entry.policy & kPolicyImplicitRng)) {
    with_device_rng(c.index, [&] { op.redispatchBoxed(kCPUKeys, stack); });
  } else if (C10_LIKELY(c.entry.norm.result_dtype_from.empty()) || !run_norm_as_cuda(op, c.entry.norm, stack, kCPUKeys)) {
    op.redispatchBoxed(kCPUKeys, stack);
  }
}

// Step 7: what the kernel changed in written aliases (a resize, a set_, the geometry) carried
// back to their neuron tensors.
C10_ALWAYS_INLINE static void carry_back_writes(DeviceCall& c) {
  for (uint16_t k : c.written) sync_back(c.aliases[k].cpu, c.aliases[k].dev, c.aliases[k].storage);
}

// ---- step 8's pieces: results as device tensors ----
C10_ALWAYS_INLINE static Tensor device_result(DeviceCall& c, Tensor o) {
  if (!o.defined()) return o;
  c10::TensorImpl* oi = o.unsafeGetTensorImpl();
  for (auto& p : c.aliases)
    if (p.cpu.unsafeGetTensorImpl() == oi) return p.dev;  // in-place / out= returns its argument
  if (oi->has_storage()) {
    c10::StorageImpl* ost = oi->unsafe_storage().unsafeGetStorageImpl();
    for (auto& p : c.aliases)  // a new view of an input (e.g. _unsafe_view): view the neuron storage
      if (p.storage == ost) return neuron_tensor_over(p.dev.unsafeGetTensorImpl()->unsafe_storage(), oi);
  }
  return to_device(std::move(o), c.index);
}
C10_ALWAYS_INLINE static void map_result_list(DeviceCall& c, IValue& v) {
  auto list = std::move(v).toTensorList();
  c10::List<Tensor> converted;
  converted.reserve(list.size());
  int64_t numel = 0;
  c10::ScalarType dtype = c10::kFloat;
  for (const Tensor& t : list) {
    converted.push_back(device_result(c, t));
    if (t.defined()) {
      numel += t.numel();
      dtype = t.scalar_type();
    }
  }
  if (c.record && c.n_sigs < kMaxSigs && list.size()) fill_sig_numel(c.rec.sigs[c.n_sigs++], dtype, numel);
  v = IValue(std::move(converted));
}

// Step 8: each result returned as the caller's tensor (in-place, out=), a view of a neuron
// storage, or fresh host memory adopted as device memory; their signatures end the record's.
C10_ALWAYS_INLINE static void map_results(DeviceCall& c) {
  const size_t rbase = c.stack->size() - c.nrets;
  c.n_inputs = c.n_sigs;
  for (size_t i = 0; i < c.nrets; ++i) {
    IValue& v = (*c.stack)[rbase + i];
    if (v.isTensor()) {
      v = IValue(device_result(c, std::move(v).toTensor()));
      if (c.record && c.n_sigs < kMaxSigs) fill_sig(c.rec.sigs[c.n_sigs++], v.toTensor());
    } else if (v.isTensorList()) {
      map_result_list(c, v);
    }
  }
}

// Step 9: the op's record appended to the work log.
C10_ALWAYS_INLINE static void finish_record(DeviceCall& c) {
  if (!c.record) return;
  if (c.on_host) c.rec.flags |= kFallback;
  c.rec.n_inputs = c.n_inputs;
  c.rec.n_sigs = c.n_sigs;
  for (int s = c.n_sigs; s < kMaxSigs; ++s) fill_sig(c.rec.sigs[s], Tensor());  // zeroed: records are hashed
  worklog_append(c.rec, c.index);
}

static void run_on_device(const c10::OperatorHandle& op, OpEntry& entry, Stack* stack) {
  if (entry.returns_view) {  // metadata only: run the CPU kernel on the neuron TensorImpl itself
    op.redispatchBoxed(kCPUKeys, stack);
    return;
  }
  DeviceCall call(op, entry, stack);
  begin_record(call);
  alias_arguments(call);
  check_devices(call);
  bind_generators(call);
  apply_policy(call);
  execute(call);
  carry_back_writes(call);
  map_results(call);
  finish_record(call);
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

// The aten base names ("aten::mode") with a CPU kernel in some overload.
static std::unordered_set<std::string> names_with_cpu_kernels(const std::vector<c10::OperatorName>& names) {
  std::unordered_set<std::string> out;
  auto& d = c10::Dispatcher::singleton();
  for (const auto& name : names) {
    auto h = d.findOp(name);
    if (h && h->hasKernelForDispatchKey(DispatchKey::CPU)) out.insert(name.name);
  }
  return out;
}

// An out= overload served by a composite kernel only (generated, or hand-written as mode.values,
// median.out, sort.values) of an op that has CPU kernels. On neuron tensors the composite kernel runs
// device-generic code that may refuse the device ("mode only supports CPU, CUDA and XPU device
// type") or take another path than the CPU's; through the fallback it runs on CPU aliases, as on the
// CPU, and resizes out= tensors by the CPU's rules.
static bool is_composite_out_of_cpu_op(const c10::OperatorHandle& h, const std::unordered_set<std::string>& cpu_ops) {
  if (h.hasKernelForDispatchKey(DispatchKey::CPU) || !cpu_ops.count(h.operator_name().name)) return false;
  if (!h.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutograd) &&
      !h.hasKernelForDispatchKey(DispatchKey::CompositeExplicitAutogradNonFunctional))
    return false;
  for (const auto& a : h.schema().arguments())
    if (a.is_out()) return true;
  return false;
}

static bool g_installed = [] {
  library("_").fallback(torch::CppFunction::makeFromBoxedFunction<&neuron_fallback>());
  auto& m = library("aten");
  m.impl("view", TORCH_FN(neuron_view));
  m.impl("as_strided", TORCH_FN(neuron_as_strided));
  m.impl("_reshape_alias", TORCH_FN(neuron_reshape_alias));
  m.impl("_unsafe_view", TORCH_FN(neuron_unsafe_view));
  register_device_kernels(m);

  // Structured functional/in-place ops reach a backend through a CompositeExplicitAutograd-
  // NonFunctional wrapper (meta function, allocation, then the .out kernel). Sending them straight
  // to the fallback runs the CPU functional kernel in one step, about half the overhead; the
  // fallback's own device check replaces the skipped meta check.
  auto& d = c10::Dispatcher::singleton();
  const std::vector<c10::OperatorName> all_ops = d.getAllOpNames();
  const std::unordered_set<std::string> cpu_ops = names_with_cpu_kernels(all_ops);
  for (const auto& name : all_ops) {
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
    if (!whole && !(composite && has_cpu) && !is_composite_out_of_cpu_op(*h, cpu_ops)) continue;
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

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("host_fallback_counts() -> (str[], int[])", &host_fallback_counts);
  m.def("reset_host_fallback_counts() -> ()", &reset_host_fallback_counts);
  m.def("op_names(int start) -> str[]", &op_names);
  m.def("set_strict(bool on) -> ()", &set_strict);
  m.def("strict() -> bool", &strict);
  m.def("reclassify_ops() -> ()", &reclassify_ops);
  m.def("direct_structured_ops() -> int", &direct_structured_ops);
}

}  // namespace torchneuron
