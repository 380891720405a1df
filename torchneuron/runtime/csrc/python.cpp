// The Python module of the runtime library (`torchneuron.runtime._C`): the few entry points that
// generated code calls often enough that going through the dispatcher's Python bindings costs
// more than the work itself.
//
// - empty_strided(size, stride, dtype, device=-1): an uninitialised tensor on a neuron device (the
//   current one by default), straight from the device allocator. Inductor's generated code
//   allocates its buffers with it (the CPU's equivalent is _dynamo.guards._empty_strided_cpu).
// - current_stream_id(device): the id of the calling thread's current stream on a device.
// - worklog_exchange_enabled(on) -> was_on, worklog_pending(), worklog_pending_control(): the
//   work log's switch, its size and its control records (events, waits, syncs) not yet drained;
//   a compiled graph pauses the log around its host code and charges its plan on every call.
// - worklog_fold(on), worklog_learn_price(key, seconds, engine), worklog_forget_prices(): the
//   folding of already-priced records (worklog.cpp), switched and taught by hardware/worklog.py.
// - signature(args, kwargs, float_marker): what adaptive eager mode keys an op call by, and where
//   its tensors are, walked in C++ (see signature() below).
// - contexts_start(...), context_record(frame), contexts_take(), ...: the profiler's issuer
//   contexts, the source line and modules of each record (contexts.cpp, stack_where.cpp).
#include "neuron.h"

#include <ATen/EmptyTensor.h>
#include <c10/core/DeviceGuard.h>
#include <torch/csrc/Dtype.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

namespace torchneuron {
namespace {

c10::SmallVector<int64_t, 6> int_tuple(PyObject* obj, const char* what) {
  if (!PyTuple_Check(obj)) {
    throw py::type_error(std::string("empty_strided: ") + what + " must be a tuple of ints");
  }
  const Py_ssize_t n = PyTuple_GET_SIZE(obj);
  c10::SmallVector<int64_t, 6> values(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    values[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, i));
    if (values[i] == -1 && PyErr_Occurred()) throw py::error_already_set();
  }
  return values;
}

at::Tensor empty_strided(py::handle size, py::handle stride, py::handle dtype, int64_t device) {
  if (!THPDtype_Check(dtype.ptr())) throw py::type_error("empty_strided: dtype must be a torch.dtype");
  const auto sizes = int_tuple(size.ptr(), "size");
  const auto strides = int_tuple(stride.ptr(), "stride");
  if (sizes.size() != strides.size()) throw py::value_error("empty_strided: size and stride differ in length");
  const auto scalar_type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
  std::optional<c10::DeviceGuard> guard;  // the allocator serves the current device
  if (device >= 0) {
    check_device_index(static_cast<c10::DeviceIndex>(device));
    guard.emplace(c10::Device(kNeuron, static_cast<c10::DeviceIndex>(device)));
  }
  return at::detail::empty_strided_generic(sizes, strides, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), scalar_type);
}

py::tuple int_array(c10::IntArrayRef values) {
  py::tuple result(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    PyTuple_SET_ITEM(result.ptr(), i, PyLong_FromLongLong(values[i]));
  }
  return result;
}

// One argument's signature: a tensor is (dtype, sizes, strides) and is appended to `tensors`; a
// list or tuple is the tuple of its items' signatures; a float is `marker` and its value is
// appended to `floats`; anything else is itself.
py::object argument_signature(py::handle value, py::list& tensors, py::list& floats, py::handle marker) {
  PyObject* obj = value.ptr();
  if (THPVariable_Check(obj)) {
    tensors.append(value);
    const at::Tensor& tensor = THPVariable_Unpack(obj);
    py::handle dtype(reinterpret_cast<PyObject*>(torch::getTHPDtype(tensor.scalar_type())));
    return py::make_tuple(dtype, int_array(tensor.sizes()), int_array(tensor.strides()));
  }
  if (PyTuple_Check(obj) || PyList_Check(obj)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
    py::tuple result(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      py::object item = argument_signature(PySequence_Fast_GET_ITEM(obj, i), tensors, floats, marker);
      PyTuple_SET_ITEM(result.ptr(), i, item.release().ptr());
    }
    return std::move(result);
  }
  if (PyFloat_CheckExact(obj)) {
    floats.append(value);
    return py::reinterpret_borrow<py::object>(marker);
  }
  return py::reinterpret_borrow<py::object>(value);
}

// Where an op call's tensors are, as signature() reports it.
enum Placement : int { kNoNeuron = 0, kMixed = 1, kAllNeuron = 2 };

// kAllNeuron when every tensor is a plain Tensor or Parameter on a neuron device (none at all
// counts as kNoNeuron), kMixed when only some are.
int placement(const py::list& tensors) {
  static PyObject* parameter = py::module_::import("torch.nn").attr("Parameter").ptr();
  size_t neuron = 0;
  bool plain = true;
  for (auto item : tensors) {
    PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(item.ptr()));
    plain = plain && (type == THPVariableClass || type == parameter);
    neuron += THPVariable_Unpack(item.ptr()).device().type() == kNeuron;
  }
  if (neuron == 0) return kNoNeuron;
  return neuron == tensors.size() && plain ? kAllNeuron : kMixed;
}

// (signature of args, tuple of (name, signature) of kwargs or None), the tensors in order, the
// floats, and the tensors' Placement.
py::tuple signature(py::tuple args, py::dict kwargs, py::handle marker) {
  py::list tensors, floats;
  py::object positional = argument_signature(args, tensors, floats, marker);
  py::object keywords = py::none();
  if (!kwargs.empty()) {
    py::tuple items(kwargs.size());
    size_t i = 0;
    for (auto item : kwargs) {
      items[i++] = py::make_tuple(item.first, argument_signature(item.second, tensors, floats, marker));
    }
    keywords = std::move(items);
  }
  const int where = placement(tensors);
  return py::make_tuple(py::make_tuple(positional, keywords), tensors, floats, where);
}

}  // namespace
}  // namespace torchneuron

namespace torchneuron {
[[noreturn]] void rethrow_python_error() {
  python_error error;
  error.persist();
  throw error;
}

void bind_adaptive_queue(py::module_& m);  // queue.cpp
void bind_contexts(py::module_& m);        // contexts.cpp
void set_adaptive_plan_cache(bool on);     // queue.cpp
bool adaptive_plan_cache();                // queue.cpp
}

namespace {
using torchneuron::TensorSig;
using torchneuron::WorkRecord;

// numpy's description of a struct: np.dtype({"names", "formats", "offsets", "itemsize"})
py::dict struct_dtype(py::list names, py::list formats, py::list offsets, size_t itemsize) {
  py::dict d;
  d["names"] = names;
  d["formats"] = formats;
  d["offsets"] = offsets;
  d["itemsize"] = itemsize;
  return d;
}

// The work record as Python reads it (runtime/worklog.py builds its numpy dtype from this).
py::dict work_record_dtype() {
  py::list sig_names, sig_formats, sig_offsets, names, formats, offsets;
  auto sig_field = [&](const char* name, py::object format, size_t offset) {
    sig_names.append(name); sig_formats.append(format); sig_offsets.append(offset);
  };
  auto field = [&](const char* name, py::object format, size_t offset) {
    names.append(name); formats.append(format); offsets.append(offset);
  };
  sig_field("dtype", py::str("i1"), offsetof(TensorSig, dtype));
  sig_field("ndim", py::str("i1"), offsetof(TensorSig, ndim));
  sig_field("pad", py::str("V" + std::to_string(sizeof(TensorSig::pad))), offsetof(TensorSig, pad));
  sig_field("sizes", py::make_tuple("<i8", py::make_tuple(torchneuron::kSigDims)), offsetof(TensorSig, sizes));
  py::dict sig = struct_dtype(sig_names, sig_formats, sig_offsets, sizeof(TensorSig));
  field("kind", py::str("<i4"), offsetof(WorkRecord, kind));
  field("op_id", py::str("<i4"), offsetof(WorkRecord, op_id));
  field("device", py::str("<i4"), offsetof(WorkRecord, device));
  field("stream", py::str("<i4"), offsetof(WorkRecord, stream));
  field("flags", py::str("<i4"), offsetof(WorkRecord, flags));
  field("n_inputs", py::str("<i4"), offsetof(WorkRecord, n_inputs));
  field("n_sigs", py::str("<i4"), offsetof(WorkRecord, n_sigs));
  field("pad", py::str("<i4"), offsetof(WorkRecord, pad));
  field("aux", py::str("<i8"), offsetof(WorkRecord, aux));
  field("host_seconds", py::str("<f8"), offsetof(WorkRecord, host_seconds));
  field("sigs", py::make_tuple(sig, py::make_tuple(torchneuron::kMaxSigs)), offsetof(WorkRecord, sigs));
  return struct_dtype(names, formats, offsets, sizeof(WorkRecord));
}

py::dict work_kinds() {
  using torchneuron::WorkKind;
  py::dict d;
  d["OP"] = static_cast<int>(WorkKind::kOp);
  d["COPY"] = static_cast<int>(WorkKind::kCopy);
  d["EVENT_RECORD"] = static_cast<int>(WorkKind::kEventRecord);
  d["EVENT_WAIT"] = static_cast<int>(WorkKind::kEventWait);
  d["SYNC_DEVICE"] = static_cast<int>(WorkKind::kSyncDevice);
  d["SYNC_STREAM"] = static_cast<int>(WorkKind::kSyncStream);
  d["SYNC_EVENT"] = static_cast<int>(WorkKind::kSyncEvent);
  d["FOLDED"] = static_cast<int>(WorkKind::kFolded);
  return d;
}

py::dict work_flags() {
  py::dict d;
  d["FALLBACK"] = static_cast<int>(torchneuron::kFallback);
  d["HOST_TO_DEVICE"] = static_cast<int>(torchneuron::kHostToDevice);
  d["DEVICE_TO_HOST"] = static_cast<int>(torchneuron::kDeviceToHost);
  d["DEVICE_TO_DEVICE"] = static_cast<int>(torchneuron::kDeviceToDevice);
  return d;
}

py::dict op_policy_bits() {
  py::dict d;
  d["HOST_ONLY"] = static_cast<int>(torchneuron::kPolicyHost);
  d["IMPLICIT_RNG"] = static_cast<int>(torchneuron::kPolicyImplicitRng);
  d["MIXED_DEVICES"] = static_cast<int>(torchneuron::kPolicyMixedDevices);
  d["DATA_MOVEMENT"] = static_cast<int>(torchneuron::kPolicyDataMovement);
  d["FP64_EMULATED"] = static_cast<int>(torchneuron::kPolicyFp64Emulated);
  return d;
}
}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchneuron's C++ runtime: fast entry points for generated code";
  m.def("configure", [](int64_t device_count, bool plan_cache) {
    torchneuron::configure_device_count(device_count);
    torchneuron::set_adaptive_plan_cache(plan_cache);
  }, "Settings the C++ runtime reads (torchneuron/settings.py), given once when the library loads",
        py::arg("device_count"), py::arg("plan_cache"));
  m.def("configuration", [] {
    py::dict d;
    d["device_count"] = static_cast<int64_t>(torchneuron::device_count());
    d["plan_cache"] = torchneuron::adaptive_plan_cache();
    return d;
  }, "What configure set (for tests and `torchneuron info`)");
  m.def("empty_strided", &torchneuron::empty_strided, "An uninitialised tensor on a neuron device",
        py::arg("size"), py::arg("stride"), py::arg("dtype"), py::arg("device") = -1);
  m.def("current_stream_id", [](int64_t device) {
    torchneuron::check_device_index(static_cast<c10::DeviceIndex>(device));
    return torchneuron::current_stream_id(static_cast<c10::DeviceIndex>(device));
  }, "The calling thread's current stream id on a neuron device");
  m.def("worklog_exchange_enabled", &torchneuron::worklog_exchange_enabled,
        "Turns recording of device work on or off; returns whether it was on", py::arg("on"));
  m.def("worklog_pending", &torchneuron::worklog_pending_count, "Records not yet drained");
  m.def("worklog_pending_control", &torchneuron::worklog_pending_control_count,
        "Event, wait and synchronisation records not yet drained");
  m.def("worklog_fold", &torchneuron::worklog_exchange_fold,
        "Turns folding of already-priced records on or off (worklog.cpp); returns whether it was on", py::arg("on"));
  m.def("worklog_learn_price", [](py::bytes key, double seconds, int64_t engine) {
    torchneuron::worklog_learn_price(std::string(key), seconds, engine);
  }, "Teaches folding a record's price: its key bytes, seconds, engine index", py::arg("key"), py::arg("seconds"),
        py::arg("engine"));
  m.def("worklog_forget_prices", &torchneuron::worklog_forget_prices, "Drops every taught price (a new target)");
  m.attr("FOLD_ENGINES") = torchneuron::kFoldEngines;
  m.def("signature", &torchneuron::signature,
        "(signature, tensors, floats, placement) of an op call's arguments; placement: 0 no neuron tensor, "
        "1 some, 2 all (and all plain Tensors or Parameters)");
  // Layouts and enums defined once, in C++: Python builds its dtypes and constants from these.
  m.attr("WORK_RECORD_DTYPE") = work_record_dtype();
  m.attr("WORK_KINDS") = work_kinds();
  m.attr("WORK_FLAGS") = work_flags();
  m.attr("MAX_SIGS") = torchneuron::kMaxSigs;
  m.attr("OP_POLICY") = op_policy_bits();
  torchneuron::bind_adaptive_queue(m);
  torchneuron::bind_contexts(m);
}
