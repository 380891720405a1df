// The profiler's issuer contexts: who issued each piece of device work while a profile records.
//
// A context is what the capture (torchneuron/profiler/capture.py) needs to attribute one unit of
// work: the stack_where() result of the issuing Python stack (interned), the autograd node running
// it (backward work) and the autograd sequence number linking it to its forward op, the host time
// (time.time_ns's clock) and the issuing thread (threading.get_ident's ident).
//
// While recording, the work log calls record_hook() right after it appends an op or copy record
// (worklog.cpp's set_worklog_record_hook), inside the call that issued it: the context is noted
// here, in C++, without a Python call per record (~0.5 us instead of ~4). Work charged from Python
// notes its context with context_record(frame). Records pair with their contexts in order:
// record_contexts(start, count) lists the contexts noted for records, so contexts of charged work, which
// interleave with them, are never paired with a record.
//
// Python API (_C): contexts_start(code_info, classify, module_type, on_context=None),
// contexts_stop(), context_record(frame) -> int, context_count() -> int,
// record_contexts(start, count) -> list[int], contexts_take() -> (where, node, seq, t_ns, thread).
// on_context(index), when given, is called after each context is noted (memory sampling).
#include <ATen/SequenceNumber.h>
#include <torch/csrc/autograd/function.h>

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "neuron.h"
#include "stack_where.h"

namespace torchneuron {
namespace {

struct WhereKey {  // identity of an interned stack_where() result (its objects are kept alive by it)
  PyObject* code;
  long line;
  PyObject* inner;
  PyObject* outer;
  bool optim;
  bool operator==(const WhereKey& o) const {
    return code == o.code && line == o.line && inner == o.inner && outer == o.outer && optim == o.optim;
  }
};
struct WhereKeyHash {
  size_t operator()(const WhereKey& k) const {
    size_t h = std::hash<void*>()(k.code);
    for (size_t v : {std::hash<long>()(k.line), std::hash<void*>()(k.inner), std::hash<void*>()(k.outer),
                     static_cast<size_t>(k.optim)})
      h = h * 1000003u ^ v;
    return h;
  }
};

struct Recorder {
  py::dict code_info;
  py::object classify, module_type, on_context;
  py::list wheres;  // interned stack_where() results
  std::unordered_map<WhereKey, int64_t, WhereKeyHash> where_ids;
  py::list node_names;  // interned autograd node names; node id 0 is "" (no node)
  std::unordered_map<std::string, int64_t> node_name_ids;
  // one entry per context
  std::vector<int64_t> where, node, seq, t_ns, thread;
  std::vector<int64_t> record_contexts;  // contexts noted by the work log's hook, in record order
  // the last frame walked, kept only while it is a torch/torchneuron frame (alive during a call that
  // issues many records: a foreach op, loss.backward()); never a user frame, whose locals must not
  // outlive it
  py::object last_frame;
  int last_lasti = -1;
  int64_t last_where = -1;
};

Recorder* g_recorder = nullptr;  // while recording (and until taken); used with the GIL held

int64_t intern_where(Recorder& r, py::tuple where) {
  const WhereKey key{where[0].ptr(), where[1].cast<long>(), where[2].ptr(), where[3].ptr(),
                     PyObject_IsTrue(where[4].ptr()) == 1};
  auto it = r.where_ids.find(key);
  if (it != r.where_ids.end()) return it->second;
  const int64_t id = static_cast<int64_t>(r.wheres.size());
  r.wheres.append(where);
  r.where_ids.emplace(key, id);
  return id;
}

bool is_user_code(Recorder& r, PyFrameObject* frame) {
  PyCodeObject* code = PyFrame_GetCode(frame);
  PyObject* info = code_class(reinterpret_cast<PyObject*>(code), r.code_info.ptr(), r.classify.ptr());
  Py_DECREF(code);
  if (!info) throw py::error_already_set();
  const bool user = PyTuple_Check(info) && PyTuple_GET_SIZE(info) == 2 && PyLong_AsLong(PyTuple_GET_ITEM(info, 0)) == kUser;
  Py_DECREF(info);
  return user;
}

int64_t where_of(Recorder& r, PyObject* frame) {
  PyFrameObject* f = frame ? reinterpret_cast<PyFrameObject*>(frame) : nullptr;
  const int lasti = f ? PyFrame_GetLasti(f) : -1;
  if (f && frame == r.last_frame.ptr() && lasti == r.last_lasti) return r.last_where;
  r.last_where = intern_where(r, stack_where(frame ? py::handle(frame) : py::none(), r.code_info, r.classify, r.module_type));
  const bool keep = f && !is_user_code(r, f);
  r.last_frame = keep ? py::reinterpret_borrow<py::object>(frame) : py::object();
  r.last_lasti = keep ? lasti : -1;
  return r.last_where;
}

int64_t node_name_id(Recorder& r, const std::string& name) {
  auto it = r.node_name_ids.find(name);
  if (it != r.node_name_ids.end()) return it->second;
  const int64_t id = static_cast<int64_t>(r.node_names.size());
  r.node_names.append(py::str(name));
  r.node_name_ids.emplace(name, id);
  return id;
}

// (node id, sequence number) of the work being issued now.
std::pair<int64_t, int64_t> autograd_position(Recorder& r) {
  const auto node = torch::autograd::get_current_node();
  if (!node) return {0, static_cast<int64_t>(at::sequence_number::peek()) - 1};  // the number the op's node got
  const uint64_t seq = node->sequence_nr();  // nodes outside the forward's numbering (AccumulateGrad): UINT64_MAX
  const int64_t seq_or_none = seq > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ? -1 : static_cast<int64_t>(seq);
  std::string name = node->name();  // C++ nodes may name their namespace (torch::autograd::AccumulateGrad)
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name.erase(0, colon + 2);
  return {node_name_id(r, name), seq_or_none};
}

int64_t note(Recorder& r, PyObject* frame) {
  const int64_t where = where_of(r, frame);
  const auto [node, seq] = autograd_position(r);
  r.where.push_back(where);
  r.node.push_back(node);
  r.seq.push_back(seq);
  r.t_ns.push_back(std::chrono::duration_cast<std::chrono::nanoseconds>(
                       std::chrono::system_clock::now().time_since_epoch()).count());
  r.thread.push_back(static_cast<int64_t>(PyThread_get_thread_ident()));
  const int64_t index = static_cast<int64_t>(r.where.size()) - 1;
  if (!r.on_context.is_none()) r.on_context(index);
  return index;
}

void record_hook() {
  py::gil_scoped_acquire gil;
  Recorder* r = g_recorder;
  if (!r) return;
  try {
    r->record_contexts.push_back(note(*r, reinterpret_cast<PyObject*>(PyEval_GetFrame())));
  } catch (py::error_already_set& e) {  // raised through the op that issued the record, type included
    e.restore();
    rethrow_python_error();
  }
}

Recorder& recorder() {
  if (!g_recorder) throw std::runtime_error("no neuron profile is recording contexts (contexts_start was not called)");
  return *g_recorder;
}

void contexts_start(py::dict code_info, py::object classify, py::object module_type, py::object on_context) {
  if (g_recorder) throw std::runtime_error("contexts are already being recorded (a neuron profile is running)");
  auto* r = new Recorder();
  r->code_info = code_info;
  r->classify = classify;
  r->module_type = module_type;
  r->on_context = on_context;
  r->node_names.append(py::str(""));
  g_recorder = r;
  set_worklog_record_hook(&record_hook);
}

void contexts_stop() { set_worklog_record_hook(nullptr); }

py::bytes column(const std::vector<int64_t>& values) {
  return py::bytes(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(int64_t));
}

// Ends recording; returns (where per context, node name per context, seq, t_ns, thread) with the
// number columns as native int64 bytes.
py::tuple contexts_take() {
  set_worklog_record_hook(nullptr);
  Recorder* r = g_recorder;
  if (!r) return py::make_tuple(py::list(), py::list(), py::bytes(), py::bytes(), py::bytes());
  g_recorder = nullptr;
  py::list where(r->where.size()), node(r->node.size());
  for (size_t i = 0; i < r->where.size(); ++i) {
    where[i] = r->wheres[r->where[i]];
    node[i] = r->node_names[r->node[i]];
  }
  py::tuple out = py::make_tuple(where, node, column(r->seq), column(r->t_ns), column(r->thread));
  delete r;
  return out;
}

}  // namespace

void bind_contexts(py::module_& m) {
  m.def("contexts_start", &contexts_start, "starts noting issuer contexts (see contexts.cpp)", py::arg("code_info"),
        py::arg("classify"), py::arg("module_type"), py::arg("on_context") = py::none());
  m.def("contexts_stop", &contexts_stop, "stops noting a context per work-log record");
  m.def("contexts_take", &contexts_take, "(where, node, seq, t_ns, thread) of every context; ends recording");
  m.def("context_record", [](py::handle frame) {
    if (!frame.is_none() && !PyFrame_Check(frame.ptr())) throw py::type_error("context_record: expected a frame or None");
    return note(recorder(), frame.is_none() ? nullptr : frame.ptr());
  }, "notes the context of work charged from Python; returns its index", py::arg("frame"));
  m.def("context_count", [] { return g_recorder ? static_cast<int64_t>(g_recorder->where.size()) : 0; });
  m.def("record_contexts", [](int64_t start, int64_t count) {
    const Recorder& r = recorder();
    const size_t from = static_cast<size_t>(std::max<int64_t>(start, 0));
    const size_t to = std::min(r.record_contexts.size(), from + static_cast<size_t>(std::max<int64_t>(count, 0)));
    py::list out;
    for (size_t i = from; i < to; ++i) out.append(r.record_contexts[i]);
    return out;
  }, "up to count of the contexts noted for work-log records, from the start-th on", py::arg("start"), py::arg("count"));
}

}  // namespace torchneuron
