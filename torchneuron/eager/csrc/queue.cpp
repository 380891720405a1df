// Adaptive eager mode's op queue, inside the boxed fallback (torchneuron.eager documents the mode).
//
// With the mode on, an aten op on neuron tensors that reaches the fallback on the thread that
// enabled the mode is queued instead of run: its outputs are allocated now (shaped as learnt for
// its argument signature) and handed back, so storage, views and autograd are eager's, and the
// work waits. Queueing costs about a microsecond, so fusion can pay for it. Per op:
//
// - the op's kind comes from Python once (torchneuron.eager.queue.queue_kind): queue a functional,
//   in-place or out= op; run an allocator now; flush, then run, anything else (random ops, host
//   reads, collectives, custom ops);
// - the first time an op is seen with an argument signature (dtypes, shapes, strides, non-float
//   arguments) it runs unqueued, and is queued with that signature later only if its meta kernel
//   predicts exactly the outputs the device made (an OutputPlan; an out= op, only if it leaves its
//   outputs' shapes alone);
// - view ops run now and are recorded (adaptive_note_view), so a fused program computes through
//   them; a second TensorImpl over a queued tensor with its geometry (autograd's shallow copies of
//   views, saved tensors) is recorded as an `alias` of it;
// - a tensor argument is a *local* (made by a queued op or a recorded view) or an *external*
//   input. A write to an external whose memory an earlier queued op read through another tensor,
//   or a read of queued memory through a tensor the queue cannot relate to a known one, flushes
//   first: a fused program never sees two inputs sharing memory one of which it writes.
//
// Flushing is queue_flush.cpp; queue.h holds what the two share.
#include "queue.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <c10/util/accumulate.h>

#include <algorithm>
#include <cstring>

namespace torchneuron::adaptive {

constexpr size_t kMaxQueue = 1024;
constexpr size_t kMinRepeat = 32;  // entries before a repeated first op counts as a new iteration

// Tags keep a signature self-delimiting (each variable-length item carries its length).
enum Tag : int64_t {
  kTagTensor = -(1LL << 60), kTagUndefined, kTagNone, kTagInt, kTagFloat, kTagBool, kTagString, kTagDevice,
  kTagList, kTagWrappedInt, kTagWrappedBool, kTagEntry, kTagViewEntry, kTagRef
};

// One op call's arguments, walked once: signature words, neuron tensors (with whether the op
// writes them), float values; `other` when an argument is something the queue does not model (a
// tensor on another device, a complex number, a symbolic size, a generator).
struct Scan {
  Words words;
  c10::SmallVector<Tensor, 8> tensors;
  c10::SmallVector<bool, 8> written;
  c10::SmallVector<double, 4> floats;
  bool other = false;
  void reset() {
    words.clear();
    tensors.clear();
    written.clear();
    floats.clear();
    other = false;
  }
};

void scan_value(const IValue& v, bool write, Scan& s) {
  Words& w = s.words;
  if (v.isTensor()) {
    const Tensor& t = v.toTensor();
    if (!t.defined()) {
      w.push_back(kTagUndefined);
      return;
    }
    const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
    if (impl->device_type() == kNeuron) {
      if (!impl->has_storage() || impl->layout() != c10::kStrided || impl->is_conj() || impl->is_neg()) {
        s.other = true;
        return;
      }
      w.push_back(kTagTensor);
      w.push_back(static_cast<int64_t>(impl->dtype().toScalarType()));
      w.push_back(impl->dim());
      for (int64_t x : impl->sizes()) w.push_back(x);
      for (int64_t x : impl->strides()) w.push_back(x);
      s.tensors.push_back(t);
      s.written.push_back(write);
      return;
    }
    if (impl->is_wrapped_number()) {  // a Python number passed where a Tensor goes (x * 2)
      switch (impl->dtype().toScalarType()) {
        case c10::kDouble:
          w.push_back(kTagFloat);
          s.floats.push_back(*static_cast<const double*>(t.const_data_ptr()));
          return;
        case c10::kLong:
          w.push_back(kTagWrappedInt);
          w.push_back(*static_cast<const int64_t*>(t.const_data_ptr()));
          return;
        case c10::kBool:
          w.push_back(kTagWrappedBool);
          w.push_back(*static_cast<const bool*>(t.const_data_ptr()));
          return;
        default:
          break;
      }
    }
    s.other = true;
  } else if (v.isNone()) {
    w.push_back(kTagNone);
  } else if (v.isInt()) {
    w.push_back(kTagInt);
    w.push_back(v.toInt());
  } else if (v.isDouble()) {
    w.push_back(kTagFloat);
    s.floats.push_back(v.toDouble());
  } else if (v.isBool()) {
    w.push_back(kTagBool);
    w.push_back(v.toBool());
  } else if (v.isList()) {
    const auto items = v.toListRef();
    w.push_back(kTagList);
    w.push_back(static_cast<int64_t>(items.size()));
    for (const IValue& e : items) scan_value(e, write, s);
  } else if (v.isString()) {
    w.push_back(kTagString);
    w.push_back(static_cast<int64_t>(std::hash<std::string_view>()(v.toStringView())));
  } else if (v.isDevice()) {
    const c10::Device d = v.toDevice();
    if (d.type() != kNeuron) s.other = true;
    w.push_back(kTagDevice);
    w.push_back(d.has_index() ? d.index() : -1);
  } else if (v.isSymInt()) {
    const auto value = v.toSymInt().maybe_as_int();
    if (!value) s.other = true;
    w.push_back(kTagInt);
    w.push_back(value.value_or(0));
  } else {
    s.other = true;
  }
}

Spec spec_of(const Tensor& t) {
  return Spec{c10::SmallVector<int64_t, 5>(t.sizes().begin(), t.sizes().end()),
              c10::SmallVector<int64_t, 5>(t.strides().begin(), t.strides().end()), t.scalar_type()};
}

// The returns at the end of `stack` as specs; nullopt if one is not a defined tensor (or list of them).
std::optional<std::vector<ReturnSpec>> return_specs(const Stack& stack, size_t n, bool want_neuron) {
  std::vector<ReturnSpec> out(n);
  auto ok = [&](const Tensor& t) { return t.defined() && (!want_neuron || t.device().type() == kNeuron); };
  for (size_t i = 0; i < n; ++i) {
    const IValue& v = stack[stack.size() - n + i];
    if (v.isTensor()) {
      if (!ok(v.toTensor())) return std::nullopt;
      out[i].specs.push_back(spec_of(v.toTensor()));
    } else if (v.isTensorList()) {
      out[i].is_list = true;
      for (const Tensor& t : v.toTensorList()) {
        if (!ok(t)) return std::nullopt;
        out[i].specs.push_back(spec_of(t));
      }
    } else {
      return std::nullopt;
    }
  }
  return out;
}

Tensor meta_like(const Tensor& t) {
  return at::empty_strided(t.sizes(), t.strides(), at::TensorOptions().dtype(t.scalar_type()).device(c10::kMeta));
}

IValue meta_value(const IValue& v) {
  if (v.isTensor()) {
    const Tensor& t = v.toTensor();
    return t.defined() && t.device().type() == kNeuron ? IValue(meta_like(t)) : v;
  }
  if (v.isTensorList()) {
    c10::List<Tensor> list;
    for (const Tensor& t : v.toTensorList()) list.push_back(t.device().type() == kNeuron ? meta_like(t) : t);
    return list;
  }
  if (v.isList()) {
    const auto list = v.toList();
    c10::impl::GenericList converted(list.elementType());
    for (const IValue& e : list) converted.push_back(meta_value(e));
    return converted;
  }
  return v;
}

// What the op's meta kernel predicts for these arguments (nullopt if it fails).
std::optional<std::vector<ReturnSpec>> meta_specs(const c10::OperatorHandle& op, const std::vector<IValue>& args) {
  try {
    Stack stack;
    stack.reserve(args.size());
    for (const IValue& v : args) stack.push_back(meta_value(v));
    op.callBoxed(&stack);
    return return_specs(stack, op.schema().returns().size(), false);
  } catch (const std::exception&) {
    return std::nullopt;
  }
}


std::deque<OpFacts> g_facts;
PyObject* g_queue_kind = nullptr;
PyObject* g_flush = nullptr;
std::unordered_map<Words, OutputPlan, WordsHash>& g_output_plans = *new std::unordered_map<Words, OutputPlan, WordsHash>();
std::atomic<bool> g_enabled{false};
std::atomic<bool> g_plan_cache{true};
std::thread::id g_owner;
thread_local bool tl_running = false;
// Never destroyed: they may hold device tensors, which must not be freed after the allocator at exit.
Queue& g_queue = *new Queue();
Scan& g_scan = *new Scan();
std::unordered_map<Words, FlushPlan, WordsHash>& g_flush_plans = *new std::unordered_map<Words, FlushPlan, WordsHash>();
int32_t g_alias_id = -1;
Stats g_stats;

// Drops a scan's tensor references when an op is done with (they would count as live users).
struct ScanScope {
  Scan& scan;
  ~ScanScope() { scan.tensors.clear(); }
};

void flush_for(const std::string& cause) { adaptive_flush(cause.c_str()); }

OpFacts& facts_of(const c10::OperatorHandle& op, int32_t id) {
  if (C10_UNLIKELY(static_cast<size_t>(id) >= g_facts.size())) g_facts.resize(id + 64);
  OpFacts& f = g_facts[id];
  if (C10_UNLIKELY(f.kind == kUnknown)) {
    f.handle = op;
    f.name = c10::toString(op.operator_name());
    for (const auto& arg : op.schema().arguments()) {  // upsampling's scale factors, say
      const std::string type = arg.real_type()->str();
      f.floats_shape_outputs |= type.find("float[]") != std::string::npos || arg.name().rfind("scale", 0) == 0;
    }
    if (!g_queue_kind) {
      f.kind = kSync;
      return f;
    }
    py::gil_scoped_acquire gil;
    PyObject* result = PyObject_CallFunction(g_queue_kind, "s", f.name.c_str());
    if (!result) rethrow_python_error();
    const long code = PyLong_AsLong(result);
    Py_DECREF(result);
    f.kind = static_cast<int8_t>(code & 7);
    f.random = code & kRandomBit;
  }
  return f;
}

inline bool same_geometry(const Tensor& a, const Tensor& b) {
  return a.scalar_type() == b.scalar_type() && a.sizes() == b.sizes() && a.strides() == b.strides() &&
         a.storage_offset() == b.storage_offset();
}

// Notes a tensor the queue made (an output buffer, a recorded view) as local value `ref`.
void track(const Tensor& t, int64_t ref) {
  Queue& q = g_queue;
  q.local[t.unsafeGetTensorImpl()] = ref;
  q.known[storage_of(t)].push_back(t);
}

// Notes that the queue writes `t`'s memory: later reads of it must come through a known tensor.
void mark_written(const Tensor& t) {
  Queue& q = g_queue;
  if (q.bases.emplace(storage_of(t), t).second) q.known[storage_of(t)].push_back(t);
}

// A tensor the queue knows with `t`'s memory and geometry (autograd hands out shallow copies of
// views, and saved tensors), or null.
const Tensor* twin_of(const Tensor& t) {
  auto it = g_queue.known.find(storage_of(t));
  if (it == g_queue.known.end()) return nullptr;
  for (const Tensor& k : it->second)
    if (k.unsafeGetTensorImpl() != t.unsafeGetTensorImpl() && same_geometry(k, t)) return &k;
  return nullptr;
}

// How the queue relates a tensor argument to the memory it queued work on.
enum class Relation {
  kQueued,     // made by a recorded op or view, or the tensor the queue knows its memory by
  kTwin,       // another TensorImpl with a queued tensor's memory and geometry (its twin is returned)
  kUnrelated,  // over queued memory, but neither: a fused program could not tell its reads apart
  kExternal,   // not over queued memory
};
// relate() of a tensor known not to be a queued output or view (ref_of has looked it up already).
std::pair<Relation, const Tensor*> relate_unrecorded(const Tensor& t) {
  Queue& q = g_queue;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  auto base = q.bases.find(storage_of(t));
  if (base == q.bases.end()) return {Relation::kExternal, nullptr};
  if (base->second.unsafeGetTensorImpl() == impl) return {Relation::kQueued, nullptr};
  const Tensor* twin = twin_of(t);
  return {twin ? Relation::kTwin : Relation::kUnrelated, twin};
}
std::pair<Relation, const Tensor*> relate(const Tensor& t) {
  if (g_queue.local.count(t.unsafeGetTensorImpl())) return {Relation::kQueued, nullptr};
  return relate_unrecorded(t);
}

// A tensor over queued memory that no recorded op or view made, unless it is the very tensor
// (another TensorImpl with the same geometry: an autograd-saved tensor, say); or a write to an
// external whose memory an earlier queued op read through another tensor. The queue must flush
// before this op: a fused program could not tell these reads from reads of the queued values.
bool aliasing_needs_flush(const Scan& s) {
  Queue& q = g_queue;
  for (size_t i = 0; i < s.tensors.size(); ++i) {
    const Relation relation = relate(s.tensors[i]).first;
    if (relation == Relation::kUnrelated) return true;
    if (relation == Relation::kExternal && s.written[i]) {
      auto use = q.reads.find(storage_of(s.tensors[i]));
      if (use != q.reads.end() && (use->second.shared || use->second.reader != s.tensors[i].unsafeGetTensorImpl()))
        return true;
    }
  }
  return false;
}

void append_words(Words& key, const Words& words) { key.insert(key.end(), words.begin(), words.end()); }

// The origin of a tensor argument of the op being queued: a local (recording an alias entry for
// another TensorImpl over a queued buffer with the buffer's geometry) or an external input.
int64_t ref_of(const Tensor& t) {
  Queue& q = g_queue;
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  auto found = q.local.find(impl);
  if (found != q.local.end()) return found->second;
  const auto [relation, twin] = relate_unrecorded(t);
  if (relation == Relation::kTwin) {
    Tensor base_tensor = *twin;
    const int64_t base_ref = ref_of(base_tensor);
    Entry alias;
    alias.op_id = g_alias_id;
    alias.kind = kView;
    alias.args.push_back(IValue(base_tensor));
    alias.tensors.push_back(base_tensor);
    alias.outs.push_back(t);
    alias.refs.push_back(base_ref);
    alias.first_float = static_cast<int32_t>(q.floats.size());
    const size_t position = q.entries.size();
    q.key.push_back(kTagViewEntry);
    q.key.push_back(g_alias_id);
    q.key.push_back(kTagRef);
    q.key.push_back(base_ref);
    q.entries.push_back(std::move(alias));
    track(t, local_ref(position, 0));
    return local_ref(position, 0);
  }
  auto [it, fresh] = q.externals.emplace(impl, static_cast<int64_t>(q.externals.size()));
  if (fresh) {
    StorageUse& use = q.reads[storage_of(t)];
    if (use.reader == nullptr) use.reader = impl;
    else if (use.reader != impl) use.shared = true;
  }
  return it->second;
}

Tensor allocate(const Spec& spec, c10::DeviceIndex index) {
  std::optional<c10::DeviceGuard> guard;  // the allocator serves the current device
  if (index != current_device()) guard.emplace(c10::Device(kNeuron, index));
  return at::detail::empty_strided_generic(spec.sizes, spec.strides, device_allocator(),
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), spec.dtype);
}

void note_lane(c10::DeviceIndex index) {
  Queue& q = g_queue;
  const c10::StreamId id = current_stream_id(index);
  if (index == q.device && id == q.stream_id) return;
  flush_for("another stream or device");  // a queue holds the ops of one stream of one device
  q.device = index;
  q.stream_id = id;
  c10::impl::VirtualGuardImpl guard(kNeuron);
  q.stream = guard.getStream(c10::Device(kNeuron, index));
}

void enqueue(const c10::OperatorHandle& op, int32_t op_id, Kind kind, const OutputPlan* plan, Scan& s,
             Stack* stack) {
  Queue& q = g_queue;
  const c10::DeviceIndex index = s.tensors[0].device().index();
  const size_t nargs = op.schema().arguments().size();
  if (!plan->resize_to.empty()) {  // outputs get their shapes now, as the op would give them
    static const c10::OperatorHandle resize = c10::Dispatcher::singleton().findSchemaOrThrow("aten::resize_", "");
    size_t k = 0;
    for (size_t i = 0; i < s.tensors.size(); ++i) {
      if (!s.written[i]) continue;
      const Spec& spec = plan->resize_to[k++];
      Stack resize_args{IValue(s.tensors[i]), IValue(std::vector<int64_t>(spec.sizes.begin(), spec.sizes.end())), IValue()};
      run_op_now(resize, &resize_args);
    }
  }
  // origins first: they may record view entries, which come before this op
  c10::SmallVector<int64_t, 8> refs;
  for (const Tensor& t : s.tensors) refs.push_back(ref_of(t));
  Entry e;
  e.op_id = op_id;
  e.kind = kind;
  e.plan = plan;
  e.first_float = static_cast<int32_t>(q.floats.size());
  e.n_floats = static_cast<int32_t>(s.floats.size());
  q.floats.insert(q.floats.end(), s.floats.begin(), s.floats.end());
  q.key.push_back(kTagEntry);
  q.key.push_back(op_id);
  append_words(q.key, s.words);
  q.key.push_back(kTagRef);
  q.key.insert(q.key.end(), refs.begin(), refs.end());
  const size_t base = stack->size() - nargs;
  for (size_t i = base; i < stack->size(); ++i) e.args.push_back(std::move((*stack)[i]));
  e.refs.assign(refs.begin(), refs.end());
  stack->resize(base);
  e.tensors = std::move(s.tensors);
  const size_t position = q.entries.size();
  if (kind == kFunctional) {
    size_t j = 0;
    for (const ReturnSpec& r : plan->returns) {
      if (r.is_list) {
        c10::List<Tensor> list;
        for (const Spec& spec : r.specs) {
          Tensor out = allocate(spec, index);
          track(out, local_ref(position, j++));
          q.bases.emplace(storage_of(out), out);
          list.push_back(out);
          e.outs.push_back(std::move(out));
        }
        stack->emplace_back(std::move(list));
      } else {
        Tensor out = allocate(r.specs[0], index);
        track(out, local_ref(position, j++));
        q.bases.emplace(storage_of(out), out);
        stack->emplace_back(out);
        e.outs.push_back(std::move(out));
      }
    }
  } else {  // in place or out=: later reads of the memory it writes must come through it
    for (size_t i = 0; i < e.tensors.size(); ++i)
      if (s.written[i]) mark_written(e.tensors[i]);
    const auto& schema_args = op.schema().arguments();
    if (kind == kOut) {
      for (size_t i = 0; i < nargs; ++i)
        if (schema_args[i].is_out()) stack->push_back(e.args[i]);
    } else if (op.schema().returns().size() == 1) {
      stack->push_back(e.args[0]);
    }
  }
  q.entries.push_back(std::move(e));
  g_stats.queued++;
}

// The tensors an op writes, as (spec, data pointer): an out= op is queued only if it leaves them
// as they were (no resize).
using WrittenState = std::vector<std::pair<Spec, const void*>>;
WrittenState written_state(const Scan& s) {
  WrittenState state;
  for (size_t i = 0; i < s.tensors.size(); ++i)
    if (s.written[i]) state.emplace_back(spec_of(s.tensors[i]), s.tensors[i].const_data_ptr());
  return state;
}

void learn(const c10::OperatorHandle& op, Kind kind, const Words& key, const std::vector<IValue>& args,
           const Stack& stack, const WrittenState& before, const WrittenState& after, bool floats_may_shape) {
  OutputPlan plan;
  if (kind == kInplace) {
    plan.queueable = true;
  } else if (kind == kOut) {
    // an out= op leaving its outputs alone; or one resizing empty outputs to contiguous ones (the
    // out= variant a factory reaches the device as: arange), whose outputs are resized when queued
    plan.queueable = before == after;
    bool from_empty = !plan.queueable && !floats_may_shape && before.size() == after.size();
    for (size_t i = 0; from_empty && i < before.size(); ++i) {
      const Spec& b = before[i].first;
      const Spec& a = after[i].first;
      const auto contiguous = c10::contiguous_strides(a.sizes);
      from_empty = b.dtype == a.dtype && c10::multiply_integers(b.sizes) == 0 &&
                   std::equal(a.strides.begin(), a.strides.end(), contiguous.begin(), contiguous.end());
      if (from_empty) plan.resize_to.push_back(a);
    }
    plan.queueable = plan.queueable || from_empty;
    if (!plan.queueable) plan.resize_to.clear();
  } else {
    auto actual = return_specs(stack, op.schema().returns().size(), true);
    if (actual) {
      auto predicted = meta_specs(op, args);
      if (predicted && *predicted == *actual) {
        plan.queueable = true;
        plan.returns = std::move(*actual);
      }
    }
  }
  g_output_plans.emplace(key, std::move(plan));
}

}  // namespace torchneuron::adaptive

namespace torchneuron {
using namespace adaptive;

void set_adaptive_plan_cache(bool on) { g_plan_cache = on; }
bool adaptive_plan_cache() { return g_plan_cache.load(); }


// ---------------------------------------------------------------------------------------------
// The runtime's interface (neuron.h)
// ---------------------------------------------------------------------------------------------
bool adaptive_active() {
  return g_enabled.load(std::memory_order_relaxed) && !tl_running && std::this_thread::get_id() == g_owner;
}

bool adaptive_enqueue(const c10::OperatorHandle& op, int32_t op_id, Stack* stack) {
  OpFacts& f = facts_of(op, op_id);
  if (f.kind == kView || f.kind == kAllocate) return false;  // metadata, or fresh memory: run now
  Scan& s = g_scan;
  s.reset();
  ScanScope scope{s};
  s.words.push_back(op_id);
  const auto& schema_args = op.schema().arguments();
  const size_t nargs = schema_args.size();
  const size_t base = stack->size() - nargs;
  for (size_t i = 0; i < nargs; ++i) {
    const c10::AliasInfo* alias = schema_args[i].alias_info();
    scan_value((*stack)[base + i], alias && alias->isWrite(), s);
  }
  if (s.tensors.empty()) {  // a factory: reads no device data
    if (f.random) flush_for(f.name);
    return false;
  }
  if (f.kind == kSync || s.other || at::globalContext().deterministicAlgorithms()) {
    flush_for(f.kind == kSync ? f.name : s.other ? f.name + " (arguments)" : "deterministic algorithms");
    g_stats.unqueued++;
    return false;
  }
  note_lane(s.tensors[0].device().index());
  if (f.floats_shape_outputs) {  // then float values are part of the signature too
    for (double x : s.floats) {
      int64_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      s.words.push_back(bits);
    }
  }
  auto known = g_output_plans.find(s.words);
  if (known == g_output_plans.end()) {  // first seen with this signature: run now, and learn
    const Scan written = s;  // (running the op may queue nothing, but may reach this function again)
    flush_for("first sighting");
    std::vector<IValue> args(stack->end() - nargs, stack->end());
    const Words& key = written.words;
    const WrittenState before = written_state(written);
    run_op_now(op, stack);
    const bool floats_may_shape = !written.floats.empty() && !f.floats_shape_outputs;  // (arange's bounds)
    learn(op, static_cast<Kind>(f.kind), key, args, *stack, before, written_state(written), floats_may_shape);
    g_stats.unqueued++;
    return true;
  }
  if (!known->second.queueable) {
    flush_for(f.name + " (outputs)");
    g_stats.unqueued++;
    return false;
  }
  if (!g_queue.entries.empty() && aliasing_needs_flush(s)) flush_for(f.name + " (aliasing)");
  // A loop's next iteration starts with the op this queue started with: flushing there, not when
  // the queue is full, gives every iteration the same queue, which a cached plan replays.
  if (g_queue.entries.size() >= kMinRepeat && s.words == g_queue.first_op) flush_for("the queue's first op again");
  if (g_queue.first_op.empty()) g_queue.first_op = s.words;
  enqueue(op, op_id, static_cast<Kind>(f.kind), &known->second, s, stack);
  if (g_queue.entries.size() >= kMaxQueue) flush_for("full queue");
  return true;
}

bool adaptive_is_queued(const Tensor& t) {
  Queue& q = g_queue;
  auto it = q.local.find(t.unsafeGetTensorImpl());
  return it != q.local.end() && it->second >= kLocalRef;
}

void adaptive_note_view(const c10::OperatorHandle& op, int32_t op_id, std::vector<IValue>&& args,
                        const Stack& results, size_t n_results) {
  // Every view is recorded, of queued memory or not: a fused program then computes views of its
  // inputs itself, so a later write to an input is not a write to memory it read some other way.
  Queue& q = g_queue;
  static Scan& scan = *new Scan();
  Scan& s = scan;
  s.reset();
  ScanScope scope{s};
  for (size_t i = 0; i < args.size(); ++i) scan_value(args[i], false, s);
  if (s.other || s.tensors.empty()) return;
  for (const Tensor& t : s.tensors)  // over queued memory the queue cannot relate: ops on it flush
    if (relate(t).first == Relation::kUnrelated) return;
  facts_of(op, op_id);  // (its handle and name, for the Python side)
  c10::SmallVector<int64_t, 8> refs;
  for (const Tensor& t : s.tensors) refs.push_back(ref_of(t));
  Entry view;
  view.op_id = op_id;
  view.kind = kView;
  view.args.assign(std::make_move_iterator(args.begin()), std::make_move_iterator(args.end()));
  view.tensors = std::move(s.tensors);
  view.refs.assign(refs.begin(), refs.end());
  view.first_float = static_cast<int32_t>(q.floats.size());
  view.n_floats = static_cast<int32_t>(s.floats.size());
  q.floats.insert(q.floats.end(), s.floats.begin(), s.floats.end());
  const size_t position = q.entries.size();
  size_t j = 0;
  for (size_t i = results.size() - n_results; i < results.size(); ++i) {
    const IValue& v = results[i];
    if (v.isTensor()) {
      view.outs.push_back(v.toTensor());
    } else if (v.isTensorList()) {
      for (const Tensor& t : v.toTensorList()) view.outs.push_back(t);
    }
  }
  for (const Tensor& t : view.outs) track(t, local_ref(position, j++));
  q.key.push_back(kTagViewEntry);
  q.key.push_back(op_id);
  append_words(q.key, s.words);
  q.key.push_back(kTagRef);
  q.key.insert(q.key.end(), refs.begin(), refs.end());
  q.entries.push_back(std::move(view));
}

}  // namespace torchneuron
