// Devices, streams, events, generators and the PrivateUse1 hooks of the software NeuronCore.
//
// Host execution is synchronous, so a stream never has pending work on the host: stream and event
// queries are true at once. Their *device* semantics (which stream an op went to, what waited on
// what, how long it took on Trainium) are kept in the work log and replayed by the Python device
// timeline, which is also what Event.elapsed_time reads.
#include "neuron.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/csrc/utils/device_lazy_init.h>
#include <torch/library.h>
#include <array>
#include <atomic>
#include <cstdlib>
#include <mutex>
#include <map>
#include <vector>

namespace torchneuron {
using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
using c10::StreamId;

constexpr int kMaxDevices = 64;
constexpr StreamId kStreamPoolSize = 32;  // like CUDA's pool of 32 streams per device

// Set once by configure_device_count when the library loads (Python's settings.device_count).
static DeviceIndex g_device_count = 2;
thread_local DeviceIndex tl_device = 0;
thread_local std::array<StreamId, kMaxDevices> tl_stream{};  // all default streams
static std::array<std::atomic<StreamId>, kMaxDevices> g_next_pool_stream{};

DeviceIndex device_count() { return g_device_count; }

void configure_device_count(int64_t n) {
  TORCH_CHECK(n >= 1 && n <= kMaxDevices, "TORCHNEURON_DEVICE_COUNT must be from 1 to ", kMaxDevices, ", got ", n);
  g_device_count = static_cast<DeviceIndex>(n);
}
DeviceIndex current_device() { return tl_device; }

void check_device_index(DeviceIndex index) {
  // A RuntimeError, as CUDA raises for an ordinal past its devices.
  TORCH_CHECK(index >= 0 && index < g_device_count, "Invalid device index neuron:", int(index),
              ": device index is out of range, this process has ", int(g_device_count),
              " neuron device(s) (set TORCHNEURON_DEVICE_COUNT before importing torch to change it).");
}
static DeviceIndex resolve(DeviceIndex index) { return index < 0 ? tl_device : index; }

StreamId current_stream_id(DeviceIndex index) { return tl_stream[resolve(index)]; }

// ---------------------------------------------------------------------------------------------
// Events
// ---------------------------------------------------------------------------------------------
struct NeuronEvent {
  int64_t id;
  DeviceIndex device;
  bool timing;
  bool recorded = false;
};
static std::atomic<int64_t> g_next_event_id{1};

static double python_elapsed_ms(int64_t start_id, int64_t end_id) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("torchneuron::_event_elapsed_ms", "")
                       .typed<double(int64_t, int64_t)>();
  return op.call(start_id, end_id);
}

// Work queued by adaptive eager mode must reach the work log before an event or a
// synchronisation is logged, or it would be timed after them.
static void flush_queued_work(const char* cause) { adaptive_flush(cause); }

// ---------------------------------------------------------------------------------------------
// Device guard
// ---------------------------------------------------------------------------------------------
struct NeuronGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }
  Device exchangeDevice(Device d) const override {
    check_device_index(d.index());
    Device old(kNeuron, tl_device);
    tl_device = d.index();
    return old;
  }
  Device getDevice() const override { return Device(kNeuron, tl_device); }
  void setDevice(Device d) const override {
    check_device_index(d.index());
    tl_device = d.index();
  }
  void uncheckedSetDevice(Device d) const noexcept override { tl_device = d.index(); }
  Stream getStream(Device d) const override {
    DeviceIndex i = resolve(d.index());
    return Stream(Stream::UNSAFE, Device(kNeuron, i), tl_stream[i]);
  }
  Stream getDefaultStream(Device d) const override {
    return Stream(Stream::UNSAFE, Device(kNeuron, resolve(d.index())), 0);
  }
  Stream getNewStream(Device d, int /*priority*/) const override {
    DeviceIndex i = resolve(d.index());
    check_device_index(i);
    StreamId id = 1 + (g_next_pool_stream[i]++ % kStreamPoolSize);
    return Stream(Stream::UNSAFE, Device(kNeuron, i), id);
  }
  Stream getStreamFromGlobalPool(Device d, bool /*high_priority*/) const override {
    return getNewStream(d, 0);
  }
  Stream exchangeStream(Stream s) const override {
    DeviceIndex i = s.device_index();
    check_device_index(i);
    Stream old(Stream::UNSAFE, Device(kNeuron, i), tl_stream[i]);
    tl_stream[i] = s.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return g_device_count; }

  void record(void** event, const Stream& stream, const DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    TORCH_CHECK(device_index == -1 || device_index == stream.device_index(),
                "Event device index ", int(device_index), " does not match the recording stream's device ",
                int(stream.device_index()), ".");
    auto* ev = static_cast<NeuronEvent*>(*event);
    if (!ev) {
      ev = new NeuronEvent{g_next_event_id++, stream.device_index(), flag == c10::EventFlag::BACKEND_DEFAULT};
      *event = ev;
    }
    TORCH_CHECK(ev->device == stream.device_index(), "Event was first recorded on neuron:", int(ev->device),
                " and cannot be recorded on a stream of neuron:", int(stream.device_index()), ".");
    flush_queued_work("stream or event: record");
    ev->recorded = true;
    worklog_control(WorkKind::kEventRecord, stream.device_index(), stream.id(), ev->id);
  }
  void block(void* event, const Stream& stream) const override {
    auto* ev = static_cast<NeuronEvent*>(event);
    if (!ev || !ev->recorded) return;  // waiting on an unrecorded event is a no-op, as in CUDA
    flush_queued_work("stream or event: block");
    worklog_control(WorkKind::kEventWait, stream.device_index(), stream.id(), ev->id);
  }
  bool queryEvent(void* /*event*/) const override { return true; }  // host work is already done
  // torch.accelerator.get_device_capability: which dtypes tensors on the device can have and convert
  // between. Every one: device memory is host memory, and ops the NeuronCore cannot compute in a
  // dtype (float64, complex) run on the host (see ops/policy.py).
  c10::DeviceCapability getDeviceCapability(Device d) const override {
    check_device_index(resolve(d.index()));
    return c10::DeviceCapability();
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override {
    delete static_cast<NeuronEvent*>(event);
  }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream& s) const override {
    flush_queued_work("stream or event: synchronizeStream");
    worklog_control(WorkKind::kSyncStream, s.device_index(), s.id(), 0);
  }
  void synchronizeEvent(void* event) const override {
    auto* ev = static_cast<NeuronEvent*>(event);
    flush_queued_work("stream or event: synchronizeEvent");
    if (ev && ev->recorded) worklog_control(WorkKind::kSyncEvent, ev->device, 0, ev->id);
  }
  void synchronizeDevice(const DeviceIndex device_index) const override {
    flush_queued_work("stream or event: synchronizeDevice");
    worklog_control(WorkKind::kSyncDevice, resolve(device_index), 0, 0);
  }
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {
    // Memory is released only after the host finished every op that used it (execution is
    // synchronous), so a block can never be reused while a stream still reads it.
  }
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    auto* a = static_cast<NeuronEvent*>(start);
    auto* b = static_cast<NeuronEvent*>(end);
    TORCH_CHECK(a && b && a->recorded && b->recorded,
                "Both events must be recorded before calculating elapsed time.");
    TORCH_CHECK(a->timing && b->timing,
                "Both events must be created with enable_timing=True to calculate elapsed time.");
    return python_elapsed_ms(a->id, b->id);
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuard);

// ---------------------------------------------------------------------------------------------
// Generators: a neuron generator is a device-tagged front of a CPU mt19937 engine, so a seed gives
// the same numbers as on the CPU and CPU kernels can consume it.
// ---------------------------------------------------------------------------------------------
struct NeuronGenerator final : c10::GeneratorImpl {
  explicit NeuronGenerator(DeviceIndex index, uint64_t seed = c10::default_rng_seed_val)
      : c10::GeneratorImpl(Device(kNeuron, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        engine(at::make_generator<at::CPUGeneratorImpl>(seed)) {}
  mutable at::Generator engine;

  void set_current_seed(uint64_t seed) override { engine.set_current_seed(seed); }
  void set_offset(uint64_t offset) override { engine.set_offset(offset); }
  uint64_t get_offset() const override { return engine.get_offset(); }
  uint64_t current_seed() const override { return engine.current_seed(); }
  uint64_t seed() override { return engine.seed(); }
  void set_state(const c10::TensorImpl& new_state) override {
    std::lock_guard<std::mutex> lock(engine.mutex());
    engine.unsafeGetGeneratorImpl()->set_state(new_state);
  }
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    std::lock_guard<std::mutex> lock(engine.mutex());
    return engine.unsafeGetGeneratorImpl()->get_state();
  }
  NeuronGenerator* clone_impl() const override {
    auto* g = new NeuronGenerator(device().index());
    g->engine = engine.clone();
    return g;
  }
};

static const std::vector<at::Generator>& default_generators() {
  static std::vector<at::Generator> gens = [] {
    std::vector<at::Generator> v;
    for (DeviceIndex i = 0; i < g_device_count; ++i) v.push_back(at::make_generator<NeuronGenerator>(i));
    return v;
  }();
  return gens;
}

at::Generator engine_of(const std::optional<at::Generator>& gen, DeviceIndex index) {
  if (gen.has_value() && gen->defined()) {
    if (gen->device().type() != kNeuron) return *gen;  // a CPU generator passed explicitly
    return static_cast<NeuronGenerator*>(gen->unsafeGetGeneratorImpl())->engine;
  }
  const auto& gens = default_generators();
  return static_cast<NeuronGenerator*>(gens.at(resolve(index)).unsafeGetGeneratorImpl())->engine;
}

// ---------------------------------------------------------------------------------------------
// Pinned host memory: ordinary host memory that is remembered as pinned. It is also the device's
// host allocator (torch.accelerator.empty_host_cache and host-memory stats reach it): nothing is
// cached, and copies complete on the host before they return, so no block waits on a stream.
// ---------------------------------------------------------------------------------------------
// Blocks are kept by start address with their size: like cudaHostAlloc'ed memory, any address inside
// a block is pinned (a storage over a slice of a pinned one, a tensor set_() onto it).
static std::mutex g_pinned_mutex;
static std::map<const char*, size_t> g_pinned;
static void pinned_free(void* p) {
  {
    std::lock_guard<std::mutex> lock(g_pinned_mutex);
    g_pinned.erase(static_cast<const char*>(p));
  }
  c10::free_cpu(p);
}
static bool is_pinned_address(const void* p) {
  const char* c = static_cast<const char*>(p);
  std::lock_guard<std::mutex> lock(g_pinned_mutex);
  auto it = g_pinned.upper_bound(c);
  if (it == g_pinned.begin()) return false;
  --it;
  return c < it->first + it->second;
}
struct PinnedAllocator final : at::HostAllocator {
  c10::DataPtr allocate(size_t n) override {
    void* p = n ? c10::alloc_cpu(n) : nullptr;
    if (p) {
      std::lock_guard<std::mutex> lock(g_pinned_mutex);
      g_pinned.emplace(static_cast<const char*>(p), n);
    }
    return {p, p, &pinned_free, Device(c10::DeviceType::CPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &pinned_free; }
  void copy_data(void* d, const void* s, size_t n) const override { std::memcpy(d, s, n); }
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override { return {}; }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};
static PinnedAllocator g_pinned_allocator;
static const bool g_pinned_registered = [] {
  at::setHostAllocator(c10::DeviceType::PrivateUse1, &g_pinned_allocator);
  return true;
}();

// ---------------------------------------------------------------------------------------------
// PrivateUse1 hooks
// ---------------------------------------------------------------------------------------------
struct NeuronHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return g_device_count; }
  void setCurrentDevice(DeviceIndex d) const override {
    check_device_index(d);
    tl_device = d;
  }
  DeviceIndex getCurrentDevice() const override { return tl_device; }
  DeviceIndex exchangeDevice(DeviceIndex d) const override {
    check_device_index(d);
    DeviceIndex old = tl_device;
    tl_device = d;
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override {
    return d < 0 ? tl_device : exchangeDevice(d);
  }
  const at::Generator& getDefaultGenerator(DeviceIndex i) const override {
    i = resolve(i);
    check_device_index(i);
    return default_generators()[i];
  }
  at::Generator getNewGenerator(DeviceIndex i) const override {
    i = resolve(i);
    check_device_index(i);
    return at::make_generator<NeuronGenerator>(i);
  }
  Device getDeviceFromPtr(void*) const override { return Device(kNeuron, tl_device); }
  bool isPinnedPtr(const void* p) const override { return is_pinned_address(p); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_allocator; }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t new_bytes) const override {
    // Storage.resize_ on a neuron storage: reallocate from the device allocator and keep the bytes.
    c10::StorageImpl* st = storage.unsafeGetStorageImpl();
    c10::DataPtr fresh = device_allocator()->allocate(new_bytes);
    size_t keep = std::min(new_bytes, st->nbytes());
    if (keep) std::memcpy(fresh.get(), st->data(), keep);
    st->set_data_ptr_noswap(std::move(fresh));
    st->set_nbytes(new_bytes);
  }
};
// ---- random state of each device's default generator, for torch.neuron ----
static at::Generator default_engine(int64_t device) {
  check_device_index(static_cast<DeviceIndex>(device));
  return engine_of(std::nullopt, static_cast<DeviceIndex>(device));
}
static void manual_seed(int64_t device, int64_t seed) {
  at::Generator g = default_engine(device);
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_current_seed(static_cast<uint64_t>(seed));
}
static int64_t seed(int64_t device) {
  at::Generator g = default_engine(device);
  std::lock_guard<std::mutex> lock(g.mutex());
  return static_cast<int64_t>(g.seed());
}
static int64_t initial_seed(int64_t device) {
  at::Generator g = default_engine(device);
  return static_cast<int64_t>(g.current_seed());
}
static at::Tensor get_rng_state(int64_t device) {
  at::Generator g = default_engine(device);
  std::lock_guard<std::mutex> lock(g.mutex());
  return g.get_state();
}
static void set_rng_state(int64_t device, const at::Tensor& state) {
  at::Generator g = default_engine(device);
  std::lock_guard<std::mutex> lock(g.mutex());
  g.set_state(state);
}
static int64_t current_stream(int64_t device) { return current_stream_id(static_cast<DeviceIndex>(device)); }

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("manual_seed(int device, int seed) -> ()", &manual_seed);
  m.def("seed(int device) -> int", &seed);
  m.def("initial_seed(int device) -> int", &initial_seed);
  m.def("get_rng_state(int device) -> Tensor", &get_rng_state);
  m.def("set_rng_state(int device, Tensor state) -> ()", torch::dispatch(c10::DispatchKey::CPU, &set_rng_state));
  m.def("device_count() -> int", [] { return static_cast<int64_t>(g_device_count); });
  m.def("current_stream_id(int device) -> int", &current_stream);
  m.def("current_device() -> int", [] { return static_cast<int64_t>(tl_device); });
  // PyTorch calls torch.neuron._lazy_init again before the next use of the device from Python (a
  // child forked after its parent initialised the device: see runtime/device.py).
  m.def("require_device_init() -> ()",
        [] { torch::utils::set_requires_device_init(c10::DeviceType::PrivateUse1, true); });
  m.def("set_device(int device) -> ()", [](int64_t d) {
    check_device_index(static_cast<DeviceIndex>(d));
    tl_device = static_cast<DeviceIndex>(d);
  });
}

static bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new NeuronHooks());
  return true;
}();

}  // namespace torchneuron
