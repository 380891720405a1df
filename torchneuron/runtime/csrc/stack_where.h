// The profiler's stack walk (stack_where.cpp), shared with the context recorder (contexts.cpp).
#pragma once

#include <Python.h>
#include <torch/extension.h>

namespace torchneuron {

constexpr long kUser = 1;   // code classes of stack_where's code_info
constexpr long kOptim = 2;

// A new reference to (class, self_name) of a code object: code_info[id(code)] or classify(code).
PyObject* code_class(PyObject* code, PyObject* code_info, PyObject* classify);

// (user_code, line, inner module, outer module, in_optimizer) of the stack from `frame` outwards.
py::tuple stack_where(py::handle frame, py::dict code_info, py::handle classify, py::handle module_type);

}  // namespace torchneuron
