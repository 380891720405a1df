// The work log: what the device was asked to do, recorded cheaply on the hot path.
//
// Every op, copy, event record/wait and synchronisation appends one fixed-size WorkRecord (op id,
// device, stream, flags, tensor signatures). The Python device timeline drains the log lazily,
// prices each record with the performance model (cached by signature) and advances its stream
// clocks. When the log grows past a threshold it asks Python to drain it. While a profile records,
// a hook runs after each op/copy record (set_worklog_record_hook), inside the issuing call.
//
// Folding: while nobody watches the timeline record by record (no listener, no drain hook, no
// record hook; Python switches it), an op or copy record whose price Python already taught is not
// logged: its seconds and engine busy time are added to its stream's lane. The lanes go into the
// log as one kFolded record each before the next control record and when Python takes the log, so
// clocks, events and busy times come out as if every record had been priced: between two control
// records the drain charges each stream's work in bulk anyway. A decode step or training step that
// repeats its signatures then costs the drain a few records instead of hundreds.
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace torchneuron {

static std::atomic<bool> g_enabled{true};  // set from settings.timeline at load (python.cpp's configure)
static std::mutex g_log_mutex;
static std::vector<WorkRecord> g_log;
static int64_t g_pending_control = 0;  // event, wait and synchronisation records in g_log
static size_t g_drain_threshold = 1 << 15;
static std::atomic<WorkRecordHook> g_record_hook{nullptr};
thread_local bool tl_draining = false;  // inside a drain or a record hook: neither re-enters

bool worklog_enabled() { return g_enabled.load(std::memory_order_relaxed); }

// ---- folding (all under g_log_mutex) ----
constexpr int kRecordWords = sizeof(WorkRecord) / 8;
// the words outside a record's price key, as hardware/worklog.py's _NOT_KEY_WORDS
static_assert(offsetof(WorkRecord, device) == 8 && offsetof(WorkRecord, aux) == 32 &&
              offsetof(WorkRecord, host_seconds) == 40 && sizeof(WorkRecord) % 8 == 0);
constexpr int kNotKeyWords[] = {1, 4, 5};
constexpr size_t kPricesLimit = 1 << 16;

struct PriceKey {
  uint64_t w[kRecordWords];
  bool operator==(const PriceKey& o) const { return std::memcmp(w, o.w, sizeof(w)) == 0; }
};
struct PriceKeyHash {
  size_t operator()(const PriceKey& k) const {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (uint64_t x : k.w) h = (h ^ x) * 0x100000001b3ULL;
    return static_cast<size_t>(h ^ (h >> 29));
  }
};
struct Price {
  double seconds;
  int32_t engine;
};
struct Lane {  // one stream's folded work since the lanes last went into the log
  int32_t device, stream;
  int64_t count;
  double seconds;
  double busy[kFoldEngines];
};
static_assert(sizeof(Lane::busy) <= sizeof(WorkRecord::sigs));

static bool g_fold = false;
static std::unordered_map<PriceKey, Price, PriceKeyHash> g_prices;
static std::vector<Lane> g_lanes;

static PriceKey price_key(const WorkRecord& r) {
  PriceKey k;
  std::memcpy(k.w, &r, sizeof(r));
  for (int w : kNotKeyWords) k.w[w] = 0;
  return k;
}

static bool fold_locked(const WorkRecord& r) {
  if (!g_fold || g_prices.empty() || r.kind > static_cast<int32_t>(WorkKind::kCopy) || (r.flags & kFallback))
    return false;
  const auto it = g_prices.find(price_key(r));
  if (it == g_prices.end()) return false;
  Lane* lane = nullptr;
  for (Lane& l : g_lanes)
    if (l.device == r.device && l.stream == r.stream) lane = &l;
  if (lane == nullptr) {
    g_lanes.push_back(Lane{r.device, r.stream, 0, 0.0, {}});
    lane = &g_lanes.back();
  }
  lane->count += 1;
  lane->seconds += it->second.seconds;
  lane->busy[it->second.engine] += it->second.seconds;
  return true;
}

static void emit_lanes_locked() {
  for (const Lane& l : g_lanes) {
    WorkRecord r;
    std::memset(&r, 0, sizeof(r));
    r.kind = static_cast<int32_t>(WorkKind::kFolded);
    r.op_id = -1;
    r.device = l.device;
    r.stream = l.stream;
    r.aux = l.count;
    r.host_seconds = l.seconds;
    std::memcpy(static_cast<void*>(r.sigs), l.busy, sizeof(l.busy));
    g_log.push_back(r);
  }
  g_lanes.clear();
}

bool worklog_exchange_fold(bool on) {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  const bool was = g_fold;
  g_fold = on;
  return was;
}

void worklog_learn_price(const std::string& key, double seconds, int64_t engine) {
  TORCH_CHECK(key.size() == sizeof(WorkRecord), "a price key is a work record's ", sizeof(WorkRecord),
              " bytes, got ", key.size());
  if (engine < 0 || engine >= kFoldEngines) return;  // more engines than a folded record holds: not folded
  PriceKey k;
  std::memcpy(k.w, key.data(), sizeof(k.w));
  std::lock_guard<std::mutex> lock(g_log_mutex);
  if (g_prices.size() >= kPricesLimit) g_prices.clear();
  g_prices[k] = Price{seconds, static_cast<int32_t>(engine)};
}

void worklog_forget_prices() {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  emit_lanes_locked();  // folded at the old prices: they stay as they were charged
  g_prices.clear();
}

void fill_sig(TensorSig& s, const at::Tensor& t) {
  std::memset(&s, 0, sizeof(s));
  if (!t.defined()) {
    s.dtype = -1;
    return;
  }
  s.dtype = static_cast<int8_t>(t.scalar_type());
  const auto sizes = t.sizes();
  const int64_t nd = static_cast<int64_t>(sizes.size());
  s.ndim = static_cast<int8_t>(std::min<int64_t>(nd, 127));
  if (nd <= kSigDims) {
    for (int64_t i = 0; i < nd; ++i) s.sizes[i] = sizes[i];
  } else {  // keep the trailing dims (what the engines tile), fold the leading ones into the first
    int64_t lead = 1;
    for (int64_t i = 0; i <= nd - kSigDims; ++i) lead *= sizes[i];
    s.sizes[0] = lead;
    for (int64_t i = 1; i < kSigDims; ++i) s.sizes[i] = sizes[nd - kSigDims + i];
  }
}

void fill_sig_numel(TensorSig& s, c10::ScalarType dtype, int64_t numel) {
  std::memset(&s, 0, sizeof(s));
  s.dtype = static_cast<int8_t>(dtype);
  s.ndim = 1;
  s.sizes[0] = numel;
}

// Runs fn with tl_draining set, so work it issues neither drains nor calls the hook again.
template <typename Fn>
static void without_reentry(Fn&& fn) {
  tl_draining = true;
  try {
    fn();
  } catch (...) {
    tl_draining = false;
    throw;
  }
  tl_draining = false;
}

static void request_drain() {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("torchneuron::_worklog_full", "").typed<void()>();
  without_reentry([] { op.call(); });
}

void set_worklog_record_hook(WorkRecordHook hook) { g_record_hook.store(hook); }

void worklog_append(WorkRecord& r, c10::DeviceIndex device) {
  r.device = device;
  r.stream = static_cast<int32_t>(current_stream_id(device));
  const WorkRecordHook hook = g_record_hook.load(std::memory_order_relaxed);
  bool full;
  {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    if (hook == nullptr && fold_locked(r)) return;
    g_log.push_back(r);
    full = g_log.size() >= g_drain_threshold;
  }
  if (tl_draining) return;
  if (C10_UNLIKELY(hook != nullptr)) {
    without_reentry(hook);  // work the hook issues is logged, neither hooked nor drained
    std::lock_guard<std::mutex> lock(g_log_mutex);
    full = g_log.size() >= g_drain_threshold;
  }
  if (C10_UNLIKELY(full)) request_drain();
}

void worklog_control(WorkKind kind, c10::DeviceIndex device, c10::StreamId stream, int64_t aux) {
  if (!worklog_enabled()) return;
  WorkRecord r;
  std::memset(&r, 0, sizeof(r));
  r.kind = static_cast<int32_t>(kind);
  r.op_id = -1;
  r.device = device;
  r.stream = static_cast<int32_t>(stream);
  r.aux = aux;
  std::lock_guard<std::mutex> lock(g_log_mutex);
  emit_lanes_locked();  // the work folded so far comes before this record
  g_log.push_back(r);
  ++g_pending_control;
}

// Python side: take every record so far as raw bytes (a uint8 CPU tensor).
static at::Tensor worklog_drain() {
  std::vector<WorkRecord> taken;
  {
    std::lock_guard<std::mutex> lock(g_log_mutex);
    emit_lanes_locked();
    taken.swap(g_log);
    g_log.reserve(1024);
    g_pending_control = 0;
  }
  at::Tensor out = at::empty({static_cast<int64_t>(taken.size() * sizeof(WorkRecord))}, at::kByte);
  if (!taken.empty()) std::memcpy(out.data_ptr(), taken.data(), taken.size() * sizeof(WorkRecord));
  return out;
}
int64_t worklog_pending_count() {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  return static_cast<int64_t>(g_log.size() + g_lanes.size());
}
int64_t worklog_pending_control_count() {
  std::lock_guard<std::mutex> lock(g_log_mutex);
  return g_pending_control;
}
bool worklog_exchange_enabled(bool on) { return g_enabled.exchange(on); }
static void set_worklog_enabled(bool on) { g_enabled = on; }
static bool get_worklog_enabled() { return worklog_enabled(); }
static void set_worklog_threshold(int64_t n) { g_drain_threshold = static_cast<size_t>(std::max<int64_t>(n, 1)); }
static int64_t record_size() { return sizeof(WorkRecord); }
static int64_t worklog_threshold() { return static_cast<int64_t>(g_drain_threshold); }

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("worklog_drain() -> Tensor", &worklog_drain);
  m.def("worklog_pending() -> int", &worklog_pending_count);
  m.def("set_worklog_enabled(bool on) -> ()", &set_worklog_enabled);
  m.def("worklog_enabled() -> bool", &get_worklog_enabled);
  m.def("set_worklog_threshold(int n) -> ()", &set_worklog_threshold);
  m.def("worklog_record_size() -> int", &record_size);
  m.def("worklog_threshold() -> int", &worklog_threshold);
  // Implemented in Python (torchneuron.runtime.timeline_bridge): called from C++.
  m.def("_worklog_full() -> ()");
  m.def("_event_elapsed_ms(int start, int end) -> float");
  m.def("_fallback_policy(str name) -> int");
  m.def("_on_fallback(str name, str reason) -> ()");
}

}  // namespace torchneuron
