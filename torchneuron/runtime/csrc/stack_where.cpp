// `_C.stack_where`: who issued a piece of device work, from the Python stack, walked in C++.
//
// The profiler's capture (torchneuron/profiler/capture.py) attributes every op it records to the
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
//
// set_worklog_record_hook(fn | None): while set, the work log calls fn(frame) right after each op or
// copy record is appended, with the GIL held and `frame` the innermost Python frame of the thread
// that issued the work (None outside Python). The profiler's capture notes its context there: a
// plain C call per record, no dispatcher op (which torch.profiler would record as an event too).
#include <Python.h>
#include <torch/csrc/Exceptions.h>
#include <torch/extension.h>

#include "neuron.h"

namespace torchneuron {
namespace {

constexpr long kUser = 1;
constexpr long kOptim = 2;

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

PyObject* g_record_fn = nullptr;  // strong reference while set; never released at exit

void call_record_fn() {
  py::gil_scoped_acquire gil;
  PyObject* fn = g_record_fn;
  if (!fn) return;
  PyFrameObject* frame = PyEval_GetFrame();  // borrowed
  PyObject* result = PyObject_CallOneArg(fn, frame ? reinterpret_cast<PyObject*>(frame) : Py_None);
  if (!result) {  // raised through the op that issued the record, type included
    python_error error;
    error.persist();
    throw error;
  }
  Py_DECREF(result);
}

void set_record_hook(py::object fn) {
  if (!fn.is_none() && !PyCallable_Check(fn.ptr())) throw py::type_error("set_worklog_record_hook: expected a callable or None");
  set_worklog_record_hook(nullptr);
  PyObject* old = g_record_fn;
  g_record_fn = fn.is_none() ? nullptr : fn.inc_ref().ptr();
  Py_XDECREF(old);
  if (g_record_fn) set_worklog_record_hook(&call_record_fn);
}

}  // namespace

void bind_stack_where(py::module_& m) {
  m.def("stack_where", &stack_where,
        "(user_code, line, inner module, outer module, in_optimizer) of a Python stack (the profiler's "
        "attribution; see stack_where.cpp)",
        py::arg("frame"), py::arg("code_info"), py::arg("classify"), py::arg("module_type"));
  m.def("set_worklog_record_hook", &set_record_hook,
        "fn(frame) is called after each op/copy record the work log appends (None: no hook; see stack_where.cpp)",
        py::arg("fn"));
}

}  // namespace torchneuron
