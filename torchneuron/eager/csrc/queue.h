// Adaptive eager mode's op queue: what recording (queue.cpp) and flushing (queue_flush.cpp) share.
// The mode itself is described in queue.cpp.
#pragma once
#include "neuron.h"

#include <ATen/core/stack.h>
#include <c10/util/SmallVector.h>
#include <c10/util/flat_hash_map.h>
#include <torch/extension.h>

#include <atomic>
#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace torchneuron::adaptive {

using at::Tensor;
using c10::IValue;
using torch::jit::Stack;

// ---- op kinds (from Python, once per operator) ----
enum Kind : int8_t {
  kUnknown = -1, kSync = 0, kFunctional = 1, kInplace = 2, kAllocate = 3, kView = 4,
  kOut = 5,  // an out= variant writing only its out arguments (functional ops reach the device so too)
};
constexpr int kRandomBit = 8;

struct OpFacts {
  int8_t kind = kUnknown;
  bool random = false;
  std::optional<c10::OperatorHandle> handle;
  std::string name;
  bool floats_shape_outputs = false;  // a float argument may decide its outputs' shapes (scale factors)
};
extern std::deque<OpFacts> g_facts;  // by op id (fallback.cpp's op table); a deque: references stay valid as it grows

extern PyObject* g_queue_kind;  // queue_kind(name) -> kind | random bit
extern PyObject* g_flush;     // flush_records(records) -> (actions, final)

OpFacts& facts_of(const c10::OperatorHandle& op, int32_t id);

// ---- signatures and output plans ----
using Words = std::vector<int64_t>;
struct WordsHash {
  size_t operator()(const Words& w) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : w) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};

struct Spec {
  c10::SmallVector<int64_t, 5> sizes, strides;
  c10::ScalarType dtype;
  bool operator==(const Spec& o) const { return dtype == o.dtype && sizes == o.sizes && strides == o.strides; }
};
struct ReturnSpec {
  bool is_list = false;
  std::vector<Spec> specs;
  bool operator==(const ReturnSpec& o) const { return is_list == o.is_list && specs == o.specs; }
};
struct OutputPlan {
  bool queueable = false;
  std::vector<ReturnSpec> returns;  // functional ops only
  std::vector<Spec> resize_to;      // out= ops writing empty outputs: their outputs' shapes (resized when queued)
};
// by op id + argument signature (never destroyed, like every table here that outlives Python)
extern std::unordered_map<Words, OutputPlan, WordsHash>& g_output_plans;


// ---- the queue ----
struct Entry {
  int32_t op_id = -1;
  Kind kind = kFunctional;             // kFunctional, kInplace, kOut, or kView (a recorded view, run already)
  const OutputPlan* plan = nullptr;    // kFunctional
  c10::SmallVector<IValue, 6> args;
  c10::SmallVector<Tensor, 4> tensors;  // the tensor arguments in order (a view's: its base)
  c10::SmallVector<Tensor, 2> outs;     // output buffers, flattened (a view's: the view)
  c10::SmallVector<int64_t, 4> refs;    // where each tensor argument comes from (local_ref or external index)
  int32_t first_float = 0, n_floats = 0;
  void release() {
    args.clear();
    tensors.clear();
    outs.clear();
    refs.clear();
  }
};

constexpr int64_t kLocalRef = 1LL << 48;
inline int64_t local_ref(size_t position, size_t j) { return kLocalRef + static_cast<int64_t>(position) * 65536 + j; }

struct StorageUse {
  c10::TensorImpl* reader = nullptr;  // the first external tensor read over this storage
  bool shared = false;                // read through more than one tensor
};

template <class K, class V>
using FlatMap = ska::flat_hash_map<K, V>;  // open addressing: no allocation per element once warm

struct Queue {
  std::vector<Entry> entries;
  Words first_op;            // the first queued op's signature: when it comes again, the queue flushes
  Words key;                 // every entry's op, signature and argument origins
  std::vector<double> floats;
  FlatMap<c10::TensorImpl*, int64_t> local;        // queued outputs and views -> ref
  FlatMap<c10::StorageImpl*, Tensor> bases;        // storage -> the tensor views of it go through
  FlatMap<c10::TensorImpl*, int64_t> externals;    // external input -> index
  FlatMap<c10::StorageImpl*, StorageUse> reads;    // storages of external inputs
  FlatMap<c10::StorageImpl*, c10::SmallVector<Tensor, 2>> known;  // storage -> the queue's tensors over it
  c10::DeviceIndex device = -1;
  c10::StreamId stream_id = 0;
  std::optional<c10::Stream> stream;

  void clear_tracking() {
    first_op.clear();
    local.clear();
    bases.clear();
    externals.clear();
    reads.clear();
    known.clear();
  }
};

struct Action {
  int32_t begin = 0, end = 0;
  PyObject* fused = nullptr;  // fused(mask, tensors, float_values); null: run the entries eagerly
  int32_t float_begin = 0;
  std::vector<double> floats;          // the float arguments the program was compiled with
  std::vector<int32_t> runtime_floats;  // those (indices into floats) it takes as arguments instead
};
struct FlushPlan {
  std::vector<Action> actions;
};

extern std::atomic<bool> g_enabled;
// false: every flush goes to Python, no plan is cached (settings.adaptive_no_plan_cache, set at load)
extern std::atomic<bool> g_plan_cache;
extern std::thread::id g_owner;                 // the thread the mode is on for
extern thread_local bool tl_running;            // inside a flush or a suspended region: ops run unqueued
extern Queue& g_queue;
extern std::unordered_map<Words, FlushPlan, WordsHash>& g_flush_plans;  // by queue key
extern int32_t g_alias_id;                      // aten::alias: an identity view, for a second TensorImpl of a queued tensor

struct Stats {
  int64_t queued = 0, unqueued = 0, flushes = 0, plan_hits = 0, plan_misses = 0, eager_ops = 0;
  std::unordered_map<std::string, int64_t> flush_causes;  // what made the queue flush (op name, or why)
};
extern Stats g_stats;

inline c10::StorageImpl* storage_of(const Tensor& t) {
  return t.unsafeGetTensorImpl()->unsafe_storage().unsafeGetStorageImpl();
}

struct RunningScope {
  bool prior;
  RunningScope() : prior(tl_running) { tl_running = true; }
  ~RunningScope() { tl_running = prior; }
};

// Flushes a non-empty queue, noting the cause.
void flush_for(const std::string& cause);

}  // namespace torchneuron::adaptive
