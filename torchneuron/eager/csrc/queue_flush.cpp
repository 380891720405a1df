// Adaptive eager mode: flushing the queue (recording is queue.cpp).
//
// A flush looks the whole queue up by its key (every op, signature and argument origin). A known
// key whose fused runs saw the same float arguments (learning rates are baked into programs) runs
// its cached FlushPlan: eager entries through the fallback, fused runs as one Python call each
// with the run's inputs and the outputs still alive. Any other queue goes to Python once
// (torchneuron.eager.queue.flush_records), which runs it, fusing where it pays, and returns the
// plan it followed; a final plan is cached. TORCHNEURON_ADAPTIVE_NO_PLAN_CACHE=1 sends every
// flush to Python (to tell a plan-cache bug from a fusion bug).
#include "queue.h"

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/csrc/utils/tensor_memoryformats.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <unordered_set>

namespace torchneuron::adaptive {
namespace {

// ---------------------------------------------------------------------------------------------
// Flushing
// ---------------------------------------------------------------------------------------------
void run_eagerly(Entry& e) {
  if (e.kind == kView) return;  // the view exists already; its base gets filled
  Stack stack(std::make_move_iterator(e.args.begin()), std::make_move_iterator(e.args.end()));
  run_op_now(*g_facts[e.op_id].handle, &stack);
  if (e.kind == kFunctional) {
    size_t j = 0;
    for (const IValue& v : stack) {
      if (v.isTensor()) {
        copy_device_bytes(e.outs[j++], v.toTensor());
      } else if (v.isTensorList()) {
        for (const Tensor& t : v.toTensorList()) copy_device_bytes(e.outs[j++], t);
      }
    }
  }
  g_stats.eager_ops++;
}

// The external inputs (first use order) and output buffers of entries [begin, end).
template <class Item, class GetTensors, class GetOuts>
void run_io(const std::vector<Item>& entries, int32_t begin, int32_t end, GetTensors tensors_of, GetOuts outs_of,
            std::vector<c10::TensorImpl*>* inputs, std::vector<c10::TensorImpl*>* outputs) {
  std::unordered_set<c10::TensorImpl*> produced, seen;
  for (int32_t i = begin; i < end; ++i) {
    for (c10::TensorImpl* t : tensors_of(entries[i]))
      if (!produced.count(t) && seen.insert(t).second) inputs->push_back(t);
    for (c10::TensorImpl* t : outs_of(entries[i])) {
      produced.insert(t);
      if (outputs && !entries[i].is_view()) outputs->push_back(t);
    }
  }
}

PyObject* wrap(const Tensor& t) { return THPVariable_Wrap(t); }

// Whether one C++ reference is all that holds `target`: a Python wrapper counts one reference of
// its own, held by nothing else when its Python refcount is the one the C++ side keeps.
template <class Target>
bool held_once(const Target* target, size_t use_count) {
  PyObject* wrapper = target->pyobj_slot()->load_pyobj();
  return wrapper ? use_count == 2 && Py_REFCNT(wrapper) == 1 : use_count == 1;
}

void call_fused(const Action& a, const std::vector<double>& floats, const std::vector<Tensor>& inputs,
                std::vector<Tensor>& outputs) {
  py::gil_scoped_acquire gil;
  // an output nobody can read any more (only this list holds it, nothing views its storage) is
  // an intermediate the program need not write
  std::vector<bool> mask(outputs.size());
  for (size_t i = 0; i < outputs.size(); ++i) {
    const c10::StorageImpl* storage = storage_of(outputs[i]);
    mask[i] = !(held_once(outputs[i].unsafeGetTensorImpl(), outputs[i].use_count()) &&
                held_once(storage, outputs[i].storage().use_count()));
  }
  PyObject* live_mask = PyTuple_New(static_cast<Py_ssize_t>(mask.size()));
  size_t n_live = 0;
  for (size_t i = 0; i < mask.size(); ++i) {
    PyObject* b = mask[i] ? Py_True : Py_False;
    Py_INCREF(b);
    PyTuple_SET_ITEM(live_mask, i, b);
    n_live += mask[i];
  }
  PyObject* tensors = PyList_New(static_cast<Py_ssize_t>(inputs.size() + n_live));
  size_t k = 0;
  for (const Tensor& t : inputs) PyList_SET_ITEM(tensors, k++, wrap(t));
  for (size_t i = 0; i < outputs.size(); ++i)
    if (mask[i]) PyList_SET_ITEM(tensors, k++, wrap(outputs[i]));
  outputs.clear();
  PyObject* values = PyTuple_New(static_cast<Py_ssize_t>(a.runtime_floats.size()));
  for (size_t i = 0; i < a.runtime_floats.size(); ++i)
    PyTuple_SET_ITEM(values, i, PyFloat_FromDouble(floats[a.float_begin + a.runtime_floats[i]]));
  PyObject* result = PyObject_CallFunctionObjArgs(a.fused, live_mask, tensors, values, nullptr);
  Py_DECREF(live_mask);
  Py_DECREF(tensors);
  Py_DECREF(values);
  if (!result) rethrow_python_error();
  Py_DECREF(result);
}

// The external inputs of entries [begin, end) in first-use order (by their recorded origins:
// external inputs of the queue, or outputs of entries before `begin`).
void run_inputs(const std::vector<Entry>& entries, int32_t begin, int32_t end, size_t n_externals,
                std::vector<Tensor>* inputs) {
  static std::vector<int32_t> seen_external;  // stamp per external index
  static int32_t stamp = 0;
  if (seen_external.size() < n_externals) seen_external.resize(n_externals, 0);
  if (++stamp == std::numeric_limits<int32_t>::max()) {
    std::fill(seen_external.begin(), seen_external.end(), 0);
    stamp = 1;
  }
  c10::SmallVector<int64_t, 16> earlier;  // outputs of earlier entries already taken
  const int64_t first_local = local_ref(begin, 0);
  for (int32_t i = begin; i < end; ++i) {
    const Entry& e = entries[i];
    for (size_t k = 0; k < e.refs.size(); ++k) {
      const int64_t ref = e.refs[k];
      if (ref < kLocalRef) {
        if (seen_external[ref] == stamp) continue;
        seen_external[ref] = stamp;
      } else if (ref < first_local) {
        if (std::find(earlier.begin(), earlier.end(), ref) != earlier.end()) continue;
        earlier.push_back(ref);
      } else {
        continue;  // made inside the run
      }
      inputs->push_back(e.tensors[k]);
    }
  }
}

void run_plan(const FlushPlan& plan, std::vector<Entry>& entries, const std::vector<double>& floats,
              size_t n_externals) {
  std::vector<Tensor> inputs, outputs;
  for (const Action& a : plan.actions) {
    if (!a.fused) {
      for (int32_t i = a.begin; i < a.end; ++i) run_eagerly(entries[i]);
      continue;
    }
    inputs.clear();
    outputs.clear();
    run_inputs(entries, a.begin, a.end, n_externals, &inputs);
    for (int32_t i = a.begin; i < a.end; ++i) {
      if (entries[i].kind != kView)
        for (Tensor& t : entries[i].outs) outputs.push_back(std::move(t));
      entries[i].release();
    }
    call_fused(a, floats, inputs, outputs);
  }
}

bool floats_match(const FlushPlan& plan, const std::vector<double>& floats) {
  for (const Action& a : plan.actions) {
    if (!a.fused || a.floats.empty()) continue;
    if (a.float_begin + a.floats.size() > floats.size()) return false;
    const double* now = floats.data() + a.float_begin;
    size_t next_runtime = 0;  // runtime_floats is sorted: the program takes those as arguments
    for (size_t i = 0; i < a.floats.size(); ++i) {
      if (next_runtime < a.runtime_floats.size() && a.runtime_floats[next_runtime] == static_cast<int32_t>(i)) {
        ++next_runtime;
        continue;
      }
      if (std::memcmp(&a.floats[i], now + i, sizeof(double)) != 0) return false;
    }
  }
  return true;
}

// ---- the Python path: records of the queue, and the plan Python followed ----
PyObject* argument_to_python(const IValue& v, const c10::Argument& arg) {
  if (v.isTensor()) {
    const Tensor& t = v.toTensor();
    if (t.defined() && t.unsafeGetTensorImpl()->is_wrapped_number()) {
      return torch::jit::toPyObject(IValue(t.item())).release().ptr();
    }
    return wrap(t);
  }
  if (v.isInt()) {
    c10::TypePtr type = arg.real_type();
    if (type->kind() == c10::TypeKind::OptionalType) type = type->castRaw<c10::OptionalType>()->getElementType();
    switch (type->kind()) {
      case c10::TypeKind::ScalarTypeType: {
        PyObject* d = reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<c10::ScalarType>(v.toInt())));
        Py_INCREF(d);
        return d;
      }
      case c10::TypeKind::LayoutType: {
        PyObject* l = reinterpret_cast<PyObject*>(torch::getTHPLayout(static_cast<c10::Layout>(v.toInt())));
        Py_INCREF(l);
        return l;
      }
      case c10::TypeKind::MemoryFormatType: {
        PyObject* m = torch::utils::getTHPMemoryFormat(static_cast<c10::MemoryFormat>(v.toInt()));
        Py_INCREF(m);
        return m;
      }
      default:
        break;
    }
  }
  return torch::jit::toPyObject(v).release().ptr();
}

// (name, args, kwargs, outs, kind): outs per return (a tensor, or a list for Tensor[]), a view's [view]
py::object record_of(const Entry& e) {
  const OpFacts& f = g_facts[e.op_id];
  const auto& schema = f.handle->schema().arguments();
  py::list positional;
  py::dict keywords;
  for (size_t i = 0; i < e.args.size(); ++i) {
    py::object value = py::reinterpret_steal<py::object>(argument_to_python(e.args[i], schema[i]));
    if (schema[i].kwarg_only()) keywords[py::str(schema[i].name())] = value;
    else positional.append(value);
  }
  py::list outs;
  if (e.kind == kFunctional) {
    size_t j = 0;
    for (const ReturnSpec& r : e.plan->returns) {
      if (r.is_list) {
        py::list list;
        for (size_t k = 0; k < r.specs.size(); ++k) list.append(py::reinterpret_steal<py::object>(wrap(e.outs[j++])));
        outs.append(list);
      } else {
        outs.append(py::reinterpret_steal<py::object>(wrap(e.outs[j++])));
      }
    }
  } else if (e.kind == kView) {
    for (const Tensor& t : e.outs) outs.append(py::reinterpret_steal<py::object>(wrap(t)));
  }
  return py::make_tuple(f.name, py::tuple(positional), keywords, outs, static_cast<int>(e.kind));
}

struct Shadow {  // what is left of an entry once Python holds it: identities, floats
  c10::SmallVector<c10::TensorImpl*, 4> tensors;
  c10::SmallVector<c10::TensorImpl*, 2> outs;
  bool view;
  int32_t first_float, n_floats;
  bool is_view() const { return view; }
};

void run_in_python(Words&& key, const std::vector<double>& floats, std::vector<Entry>& entries) {
  g_stats.plan_misses++;
  py::gil_scoped_acquire gil;
  std::vector<Shadow> shadows;
  shadows.reserve(entries.size());
  py::list records;
  for (Entry& e : entries) {
    Shadow s{{}, {}, e.kind == kView, e.first_float, e.n_floats};
    for (const Tensor& t : e.tensors) s.tensors.push_back(t.unsafeGetTensorImpl());
    for (const Tensor& t : e.outs) s.outs.push_back(t.unsafeGetTensorImpl());
    shadows.push_back(std::move(s));
    records.append(record_of(e));
    e.release();  // Python's references are the ones liveness should count
  }
  entries.clear();
  PyObject* result = PyObject_CallFunctionObjArgs(g_flush, records.ptr(), nullptr);
  if (!result) rethrow_python_error();
  py::tuple answer = py::reinterpret_steal<py::tuple>(result);
  if (!g_plan_cache || !answer[1].cast<bool>()) return;  // provisional: Python will decide differently next time
  FlushPlan plan;
  auto tensors_of = [](const Shadow& s) { return s.tensors; };
  auto outs_of = [](const Shadow& s) { return s.outs; };
  for (py::handle item : answer[0]) {
    py::tuple t = py::reinterpret_borrow<py::tuple>(item);
    Action a;
    a.begin = t[0].cast<int32_t>();
    a.end = t[1].cast<int32_t>();
    if (!t[2].is_none()) {
      // the plan is cached only if C++ finds the inputs and outputs Python's program takes
      std::vector<c10::TensorImpl*> inputs, outputs;
      run_io(shadows, a.begin, a.end, tensors_of, outs_of, &inputs, &outputs);
      auto same = [](py::handle list, const std::vector<c10::TensorImpl*>& impls) {
        if (py::len(list) != impls.size()) return false;
        size_t i = 0;
        for (py::handle x : list)
          if (THPVariable_Unpack(x.ptr()).unsafeGetTensorImpl() != impls[i++]) return false;
        return true;
      };
      if (!same(t[3], inputs) || !same(t[4], outputs)) return;
      a.fused = t[2].ptr();
      Py_INCREF(a.fused);  // plans live as long as the process
      const Shadow& first = shadows[a.begin];
      const Shadow& last = shadows[a.end - 1];
      a.float_begin = first.first_float;
      a.floats.assign(floats.begin() + first.first_float, floats.begin() + last.first_float + last.n_floats);
      if (py::len(t) > 5)
        for (py::handle i : t[5]) a.runtime_floats.push_back(i.cast<int32_t>());
    }
    plan.actions.push_back(std::move(a));
  }
  g_flush_plans[std::move(key)] = std::move(plan);
}

}  // namespace
}  // namespace torchneuron::adaptive

namespace torchneuron {
using namespace adaptive;

void adaptive_flush(const char* cause) {
  Queue& q = g_queue;
  if (q.entries.empty() || tl_running || std::this_thread::get_id() != g_owner) return;
  bool views_only = true;
  for (const Entry& e : q.entries) views_only = views_only && e.kind == kView;
  std::vector<Entry> entries = std::move(q.entries);
  Words key = std::move(q.key);
  std::vector<double> floats = std::move(q.floats);
  const size_t n_externals = q.externals.size();
  q.entries.clear();
  q.key.clear();
  q.floats.clear();
  q.clear_tracking();
  if (views_only) return;  // views exist already: there is no work to run
  g_stats.flush_causes[cause]++;
  g_stats.flushes++;
  RunningScope running;
  c10::impl::VirtualGuardImpl guard(kNeuron);
  const c10::Stream current = guard.getStream(c10::Device(kNeuron, q.device));
  const bool switch_stream = q.stream && current != *q.stream;
  if (switch_stream) guard.exchangeStream(*q.stream);  // run on the stream the ops were issued on
  try {
    at::AutoDispatchBelowADInplaceOrView below;  // the ops were queued below autograd
    auto plan = g_flush_plans.find(key);
    if (plan != g_flush_plans.end() && floats_match(plan->second, floats)) {
      g_stats.plan_hits++;
      run_plan(plan->second, entries, floats, n_externals);
    } else {
      run_in_python(std::move(key), floats, entries);
    }
  } catch (...) {
    if (switch_stream) guard.exchangeStream(current);
    throw;
  }
  if (switch_stream) guard.exchangeStream(current);
}

void bind_adaptive_queue(py::module_& m) {
  py::dict kinds;  // what queue_kind() answers (eager/queue.py builds its constants from these)
  kinds["SYNC"] = static_cast<int>(kSync);
  kinds["FUNCTIONAL"] = static_cast<int>(kFunctional);
  kinds["INPLACE"] = static_cast<int>(kInplace);
  kinds["ALLOCATE"] = static_cast<int>(kAllocate);
  kinds["VIEW"] = static_cast<int>(kView);
  kinds["OUT"] = static_cast<int>(kOut);
  kinds["RANDOM_BIT"] = kRandomBit;
  m.attr("QUEUE_KINDS") = kinds;
  m.def("adaptive_set_callbacks", [](py::object queue_kind, py::object flush) {
    Py_XDECREF(g_queue_kind);
    Py_XDECREF(g_flush);
    g_queue_kind = queue_kind.release().ptr();
    g_flush = flush.release().ptr();
  }, "queue_kind(op_name) -> kind, flush_records(records) -> (actions, final): adaptive eager mode's Python side");
  m.def("adaptive_enable", [](bool on) {
    if (!on) {
      adaptive_flush();
      g_enabled = false;
      return;
    }
    if (g_enabled && std::this_thread::get_id() != g_owner)
      throw std::runtime_error("adaptive eager mode is already on in another thread; turn it off there first");
    static bool resolved = [] {
      const c10::OperatorHandle handle = c10::Dispatcher::singleton().findSchemaOrThrow("aten::alias", "");
      g_alias_id = op_id_of(handle);
      facts_of(handle, g_alias_id);
      return true;
    }();
    (void)resolved;
    g_owner = std::this_thread::get_id();
    g_enabled = true;
  }, "Turns the queue on for the calling thread (off: flushes first)", py::arg("on"));
  m.def("adaptive_flush", [] {
    py::gil_scoped_release release;
    adaptive_flush();
  }, "Runs every queued op");
  m.def("adaptive_pending", [] { return g_queue.entries.size(); }, "Entries in the queue");
  m.def("adaptive_suspend", [](bool on) {
    const bool prior = tl_running;
    if (on) {
      py::gil_scoped_release release;
      adaptive_flush();
    }
    tl_running = on;
    return prior;
  }, "Flushes and lets ops on this thread run unqueued (True), or restores (False); returns the prior state",
        py::arg("on"));
  m.def("adaptive_forget_plans", [] {
    adaptive_flush("forget plans");  // queued entries point at their output plans
    g_flush_plans.clear();
    g_output_plans.clear();
  }, "Forgets every learnt output plan and flush plan");
  m.def("adaptive_stats", [] {
    return py::dict(py::arg("queued") = g_stats.queued, py::arg("unqueued") = g_stats.unqueued,
                    py::arg("flushes") = g_stats.flushes, py::arg("plan_hits") = g_stats.plan_hits,
                    py::arg("plan_misses") = g_stats.plan_misses, py::arg("eager_ops") = g_stats.eager_ops);
  }, "The queue's counters");
  m.def("adaptive_flush_causes", [] { return g_stats.flush_causes; },
        "How often each cause (an op's name, or a reason) flushed a non-empty queue");
}

}  // namespace torchneuron
