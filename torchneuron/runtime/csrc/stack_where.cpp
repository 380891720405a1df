// stack_where(): who issued a piece of device work, from the Python stack, walked in C++.
//
// The profiler's capture (torchneuron/profiler/capture.py, through contexts.cpp) attributes every op it records to the
// innermost user source line and the nn.Module chain around it. Walked in Python, a stack of ten
// frames costs ~5 us (each frame a few attribute reads and dict lookups), more than the op's own
// eager overhead; here it is a few hundred nanoseconds plus one locals snapshot per `forward` frame.
//
// stack_where(frame, code_info, classify, module_type) -> (user_code, line, inner, outer, optim)
// - code_info: dict id(code) -> (class, self_name): class 0 internal, 1 user, 2 torch.optim;
//   self_name is the name of the first argument of a `forward` function, else None. Codes not in
//   it are passed to classify(code), which returns that pair (and is expected to store it).
// - user_code/line: the innermost user frame's code and current line (None, 0 without one);
//   optim: a torch.optim frame lies below it; inner/outer: the innermost and outermost
//   `forward` frames whose first argument is an instance of module_type (None without one).
#include "stack_where.h"

namespace torchneuron {

// A new reference to (class, self_name) of a code object.
PyObject* code_class(PyObject* code, PyObject* code_info, PyObject* classify) {
  PyObject* key = PyLong_FromVoidPtr(code);
  if (!key) return nullptr;
  PyObject* info = PyDict_GetItemWithError(code_info, key);  // borrowed
  Py_DECREF(key);
  if (info) {
    Py_INCREF(info);
    return info;
  }
  if (PyErr_Occurred()) return nullptr;
  return PyObject_CallOneArg(classify, code);
}

py::tuple stack_where(py::handle frame, py::dict code_info, py::handle classify, py::handle module_type) {
  PyObject* user_code = nullptr;  // new references, kept until the result is built
  PyObject* inner = nullptr;
  PyObject* outer = nullptr;
  int line = 0;
  bool optim = false;
  auto fail = [&]() -> py::tuple {
    Py_XDECREF(user_code);
    Py_XDECREF(inner);
    Py_XDECREF(outer);
    throw py::error_already_set();
  };
  if (!frame.is_none() && !PyFrame_Check(frame.ptr())) throw py::type_error("stack_where: expected a frame or None");
  PyFrameObject* f = frame.is_none() ? nullptr : reinterpret_cast<PyFrameObject*>(frame.ptr());
  Py_XINCREF(f);
  while (f) {
    PyCodeObject* code = PyFrame_GetCode(f);
    PyObject* info = code_class(reinterpret_cast<PyObject*>(code), code_info.ptr(), classify.ptr());
    if (!info || !PyTuple_Check(info) || PyTuple_GET_SIZE(info) != 2) {
      if (info && !PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "stack_where: classify must return a pair");
      Py_XDECREF(info);
      Py_DECREF(code);
      Py_DECREF(f);
      return fail();
    }
    const long cls = PyLong_AsLong(PyTuple_GET_ITEM(info, 0));
    PyObject* self_name = PyTuple_GET_ITEM(info, 1);
    if (!user_code) {
      if (cls == kUser) {
        user_code = reinterpret_cast<PyObject*>(code);
        Py_INCREF(user_code);
        line = PyFrame_GetLineNumber(f);
      } else if (cls == kOptim) {
        optim = true;
      }
    }
    if (self_name != Py_None) {
      PyObject* locals = PyFrame_GetLocals(f);
      if (!locals) {
        Py_DECREF(info);
        Py_DECREF(code);
        Py_DECREF(f);
        return fail();
      }
      PyObject* self = PyMapping_Check(locals) ? PyObject_GetItem(locals, self_name) : nullptr;
      if (!self) PyErr_Clear();  // the argument was deleted: no module here
      if (self && PyObject_IsInstance(self, module_type.ptr()) == 1) {
        if (!inner) {
          inner = self;
          Py_INCREF(inner);
        }
        Py_XDECREF(outer);
        outer = self;
        Py_INCREF(outer);
      }
      PyErr_Clear();
      Py_XDECREF(self);
      Py_DECREF(locals);
    }
    Py_DECREF(info);
    Py_DECREF(code);
    PyFrameObject* back = PyFrame_GetBack(f);
    Py_DECREF(f);
    f = back;
  }
  auto steal = [](PyObject* obj) { return obj ? py::reinterpret_steal<py::object>(obj) : py::none(); };
  return py::make_tuple(steal(user_code), line, steal(inner), steal(outer), optim);
}

}  // namespace torchneuron
