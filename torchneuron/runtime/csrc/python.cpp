// The Python module of the runtime library (`torchneuron.runtime._C`): the few entry points that
// generated code calls often enough that going through the dispatcher's Python bindings costs
// more than the work itself.
//
// empty_strided(size, stride, dtype): an uninitialised tensor on the current neuron device,
// straight from the device allocator (what Inductor's generated code allocates its buffers with;
// the CPU's equivalent is torch._C._dynamo.guards._empty_strided_cpu).
#include "neuron.h"

#include <ATen/EmptyTensor.h>
#include <torch/csrc/Dtype.h>
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

at::Tensor empty_strided(py::handle size, py::handle stride, py::handle dtype) {
  if (!THPDtype_Check(dtype.ptr())) throw py::type_error("empty_strided: dtype must be a torch.dtype");
  const auto sizes = int_tuple(size.ptr(), "size");
  const auto strides = int_tuple(stride.ptr(), "stride");
  if (sizes.size() != strides.size()) throw py::value_error("empty_strided: size and stride differ in length");
  const auto scalar_type = reinterpret_cast<THPDtype*>(dtype.ptr())->scalar_type;
  return at::detail::empty_strided_generic(sizes, strides, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), scalar_type);
}

}  // namespace
}  // namespace torchneuron

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchneuron's C++ runtime: fast entry points for generated code";
  m.def("empty_strided", &torchneuron::empty_strided, "An uninitialised tensor on the current neuron device");
}
