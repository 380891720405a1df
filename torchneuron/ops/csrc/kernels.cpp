// The device's own kernels: ops the boxed fallback cannot run as their CPU kernel (copies between
// host and device, set_ and resize_, convolution through the backend's "overrideable" ops,
// record_stream, shallow-copy compatibility) and the factories. Registered by fallback.cpp.
#include "host_alias.h"

#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/convolution.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/copy_native.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

namespace torchneuron {

// Appends one record of `kind` for work done by a kernel of our own (not the fallback): sigs
// [0, n_inputs) read, [n_inputs, n) written.
static void append_record(WorkKind kind, int32_t op_id, int32_t flags, const TensorSig* sigs, int n, int n_inputs,
                          DeviceIndex index) {
  WorkRecord rec;
  rec.kind = static_cast<int32_t>(kind);
  rec.op_id = op_id;
  rec.flags = flags;
  rec.aux = 0;
  rec.host_seconds = 0;
  rec.pad = 0;
  for (int k = 0; k < n; ++k) rec.sigs[k] = sigs[k];
  rec.n_inputs = n_inputs;
  rec.n_sigs = n;
  for (int k = n; k < kMaxSigs; ++k) fill_sig(rec.sigs[k], Tensor());  // zeroed: records are hashed
  worklog_append(rec, index);
}

static void record_work(WorkKind kind, const c10::OperatorHandle& op, int32_t flags,
                        std::initializer_list<const Tensor*> inputs, std::initializer_list<const Tensor*> outputs,
                        DeviceIndex index) {
  TensorSig sigs[kMaxSigs];
  int n = 0;
  for (const Tensor* t : inputs)
    if (n < kMaxSigs - 1 && t->defined()) fill_sig(sigs[n++], *t);
  const int n_inputs = n;
  for (const Tensor* t : outputs)
    if (n < kMaxSigs && t->defined()) fill_sig(sigs[n++], *t);
  append_record(kind, op_id_of(op), flags, sigs, n, n_inputs, index);
}

void record_kernel(const c10::OperatorHandle& op, std::initializer_list<TensorSig> reads,
                   std::initializer_list<TensorSig> writes, DeviceIndex index) {
  if (!worklog_enabled()) return;
  TORCH_INTERNAL_ASSERT(reads.size() + writes.size() <= kMaxSigs && writes.size() > 0,
                        "a work record holds at most ", kMaxSigs, " signatures, one of them written");
  TensorSig sigs[kMaxSigs];
  int n = 0;
  for (const TensorSig& s : reads) sigs[n++] = s;
  const int n_inputs = n;
  for (const TensorSig& s : writes) sigs[n++] = s;
  append_record(WorkKind::kOp, op_id_of(op), 0, sigs, n, n_inputs, index);
}

static void record_copy(const Tensor& src, const Tensor& dst) {
  if (!worklog_enabled()) return;
  static const auto handle = c10::Dispatcher::singleton().findSchemaOrThrow("aten::copy_", "");
  const bool s = is_neuron(src), d = is_neuron(dst);
  const int32_t flags = s && d ? kDeviceToDevice : (d ? kHostToDevice : kDeviceToHost);
  // As on CUDA, a copy between two devices runs on the source device's current stream, so events
  // there time it; a host copy runs on the neuron side's stream.
  record_work(WorkKind::kCopy, handle, flags, {&src}, {&dst}, s ? src.device().index() : dst.device().index());
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

// A convolution's results and gradients keep the layout the CPU kernel gives them (channels_last for
// channels_last inputs or weights, as on the CPU and on CUDA). Fake tensors (torch.compile) predict
// that layout too: ops/conv_layout.py answers the backend selection for neuron tensors with the CPU's.
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
                                    output_padding, groups),
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
  auto dev = [&](const Tensor& t) { return t.defined() ? to_device(t, index) : t; };
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

void register_device_kernels(torch::Library& m) {
  m.impl("empty.memory_format", TORCH_FN(neuron_empty));
  m.impl("empty_strided", TORCH_FN(neuron_empty_strided));
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
}

}  // namespace torchneuron
