// Device memory of the software NeuronCore: a caching allocator over host memory with a capacity
// per device (the modeled HBM of a logical core), CUDA-style statistics, and out-of-memory errors
// that leave the process usable.
//
// Blocks are rounded to 512 bytes and kept in a per-device cache when freed; a request is served
// from the smallest cached block that fits without wasting more than a quarter of it (the most
// recently freed of that size). Memory that a
// CPU kernel allocated for an op's result is *adopted*: it is counted against the same capacity and
// statistics, and released to the host when the tensor dies (it never enters the cache).
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

namespace torchneuron {
using c10::CachingAllocator::Stat;
using c10::CachingDeviceAllocator::DeviceStats;

constexpr size_t kRound = 512;
constexpr size_t kAgg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
constexpr size_t kLargeBlock = 1 << 20;  // the CUDA allocator's small/large pool split

static size_t round_up(size_t n) { return n == 0 ? 0 : (n + kRound - 1) / kRound * kRound; }

static std::string format_bytes(size_t n) {
  std::ostringstream os;
  os.precision(2);
  os << std::fixed;
  if (n >= (size_t(1) << 30)) os << double(n) / double(size_t(1) << 30) << " GiB";
  else if (n >= (size_t(1) << 20)) os << double(n) / double(size_t(1) << 20) << " MiB";
  else os << double(n) / 1024.0 << " KiB";
  return os.str();
}

struct DeviceMemory {
  std::mutex mutex;
  size_t capacity = size_t(16) << 30;
  double fraction = 1.0;  // torch.neuron.set_per_process_memory_fraction: this process may reserve
                          // at most fraction * capacity (CUDA's per-process limit)
  std::multimap<size_t, void*> cache;  // free blocks by size
  size_t cached_bytes = 0;
  DeviceStats stats;

  // Updates every statistic a live block contributes to: +1 when it is handed out, -1 when freed.
  void count_block(size_t block, size_t requested, bool handed_out) {
    auto apply = [handed_out](Stat& stat, size_t amount) {
      if (handed_out) stat.increase(amount);
      else stat.decrease(amount);
    };
    const size_t pool = block >= kLargeBlock ? 2 : 1;
    for (size_t kind : {kAgg, pool}) {
      apply(stats.allocation[kind], 1);
      apply(stats.allocated_bytes[kind], block);
    }
    apply(stats.active[kAgg], 1);
    apply(stats.active_bytes[kAgg], block);
    apply(stats.requested_bytes[kAgg], requested);
  }
  void count_alloc(size_t block, size_t requested) { count_block(block, requested, true); }
  void count_free(size_t block, size_t requested) { count_block(block, requested, false); }
  template <class F>
  void for_each_stat(F&& f) {  // every Stat this allocator maintains
    for (auto* array : {&stats.allocation, &stats.segment, &stats.active, &stats.allocated_bytes,
                        &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes})
      for (Stat& s : *array) f(s);
  }
  void reserve(size_t block) {
    stats.segment[kAgg].increase(1);
    stats.reserved_bytes[kAgg].increase(block);
    stats.num_device_alloc++;
  }
  void unreserve(size_t block) {
    stats.segment[kAgg].decrease(1);
    stats.reserved_bytes[kAgg].decrease(block);
    stats.num_device_free++;
  }
  size_t reserved() const { return static_cast<size_t>(stats.reserved_bytes[kAgg].current); }
  size_t allowed() const {  // the bytes this process may reserve: the capacity, or its fraction
    return fraction >= 1.0 ? capacity : static_cast<size_t>(fraction * static_cast<double>(capacity));
  }
  void release_cache() {  // caller holds the mutex
    for (auto& [size, ptr] : cache) {
      c10::free_cpu(ptr);
      unreserve(size);
    }
    cache.clear();
    cached_bytes = 0;
  }
  [[noreturn]] void out_of_memory(c10::DeviceIndex index, size_t requested) {
    stats.num_ooms++;
    const size_t in_use = static_cast<size_t>(stats.allocated_bytes[kAgg].current);
    const size_t free_bytes = capacity > reserved() ? capacity - reserved() : 0;
    std::ostringstream limit;
    if (fraction < 1.0)
      limit << " This process has a memory fraction set to " << fraction << " (" << format_bytes(allowed())
            << "; torch.neuron.set_per_process_memory_fraction raises it).";
    TORCH_CHECK_WITH(OutOfMemoryError, false, "NEURON out of memory. Tried to allocate ",
                     format_bytes(requested), ". neuron:", int(index), " has a total capacity of ",
                     format_bytes(capacity), " of which ", format_bytes(free_bytes), " is free.", limit.str(),
                     " Of the allocated memory ",
                     format_bytes(in_use), " is allocated by PyTorch, and ", format_bytes(reserved() - std::min(reserved(), in_use)),
                     " is reserved by PyTorch but unallocated. Free tensors you no longer need (del, then "
                     "torch.neuron.empty_cache()), use a smaller batch, or raise the modeled HBM capacity with "
                     "TORCHNEURON_MEMORY_CAPACITY (e.g. TORCHNEURON_MEMORY_CAPACITY=32GiB).");
  }
  // Makes room for `block` more reserved bytes or raises; caller holds the mutex.
  void ensure_room(c10::DeviceIndex index, size_t block, size_t requested) {
    if (reserved() + block <= allowed()) return;
    stats.num_alloc_retries++;
    release_cache();
    if (reserved() + block > allowed()) out_of_memory(index, requested);
  }
};

static std::vector<DeviceMemory>& memories() {
  static std::vector<DeviceMemory> m(device_count());
  return m;
}
static DeviceMemory& memory_of(c10::DeviceIndex index) {
  check_device_index(index);
  return memories()[index];
}

// Context of every DataPtr the allocator hands out.
struct Block {
  void* ptr;
  size_t size;       // rounded size charged to the device
  size_t requested;  // bytes asked for
  c10::DeviceIndex device;
  c10::DataPtr adopted;  // set when the memory came from a CPU kernel
};

static void free_block(void* ctx) {
  auto* b = static_cast<Block*>(ctx);
  DeviceMemory& m = memories()[b->device];
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.count_free(b->size, b->requested);
    if (b->adopted) {
      m.unreserve(b->size);
    } else if (b->ptr) {
      m.cache.emplace(b->size, b->ptr);
      m.cached_bytes += b->size;
    }
  }
  delete b;  // releases adopted host memory
}

struct NeuronAllocator final : c10::DeviceAllocator {
  c10::DataPtr allocate(size_t n) override {
    const c10::DeviceIndex index = current_device();
    DeviceMemory& m = memory_of(index);
    const size_t size = round_up(n);
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(m.mutex);
      if (size) {
        auto it = m.cache.lower_bound(size);
        if (it != m.cache.end() && it->first <= size + size / 4) {
          // Of the blocks of the best-fitting size, reuse the one freed last: like a host malloc,
          // it is likely still in the CPU caches (the oldest one is likely evicted).
          it = std::prev(m.cache.upper_bound(it->first));
          ptr = it->second;
          const size_t got = it->first;
          m.cached_bytes -= got;
          m.cache.erase(it);
          m.count_alloc(got, n);
          return {ptr, new Block{ptr, got, n, index, {}}, &free_block, c10::Device(kNeuron, index)};
        }
        m.ensure_room(index, size, n);
        try {
          ptr = c10::alloc_cpu(size);
        } catch (const c10::Error&) {  // the host itself ran out: free the cache and retry once
          m.release_cache();
          try {
            ptr = c10::alloc_cpu(size);
          } catch (const c10::Error&) {
            m.out_of_memory(index, n);
          }
        }
        m.reserve(size);
      }
      m.count_alloc(size, n);
    }
    return {ptr, new Block{ptr, size, n, index, {}}, &free_block, c10::Device(kNeuron, index)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }
  void copy_data(void* d, const void* s, size_t n) const override { std::memcpy(d, s, n); }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      DeviceMemory& m = memories()[i];
      std::lock_guard<std::mutex> lock(m.mutex);
      m.release_cache();
    }
  }
  void recordStream(const c10::DataPtr&, c10::Stream) override {
    // Host execution is synchronous: no stream can still be using a block when it is freed.
  }
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    DeviceMemory& m = memory_of(device);
    std::lock_guard<std::mutex> lock(m.mutex);
    DeviceStats s = m.stats;
    s.inactive_split_bytes[kAgg].current = 0;
    return s;
  }
  void resetAccumulatedStats(c10::DeviceIndex device) override {
    DeviceMemory& m = memory_of(device);
    std::lock_guard<std::mutex> lock(m.mutex);
    m.for_each_stat([](Stat& s) { s.reset_accumulated(); });
    m.stats.num_alloc_retries = 0;
    m.stats.num_ooms = 0;
    m.stats.num_device_alloc = 0;
    m.stats.num_device_free = 0;
  }
  void resetPeakStats(c10::DeviceIndex device) override {
    DeviceMemory& m = memory_of(device);
    std::lock_guard<std::mutex> lock(m.mutex);
    m.for_each_stat([](Stat& s) { s.reset_peak(); });
  }
  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    DeviceMemory& m = memory_of(device);
    std::lock_guard<std::mutex> lock(m.mutex);
    return {m.capacity > m.reserved() ? m.capacity - m.reserved() : 0, m.capacity};
  }
};

static NeuronAllocator g_allocator;
REGISTER_ALLOCATOR(kNeuron, &g_allocator);

c10::Allocator* device_allocator() { return &g_allocator; }

c10::DataPtr adopt_host_memory(c10::DataPtr&& host, size_t nbytes, c10::DeviceIndex index) {
  DeviceMemory& m = memory_of(index);
  const size_t size = round_up(nbytes);
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.ensure_room(index, size, nbytes);
    m.reserve(size);
    m.count_alloc(size, nbytes);
  }
  void* ptr = host.get();
  return {ptr, new Block{ptr, size, nbytes, index, std::move(host)}, &free_block, c10::Device(kNeuron, index)};
}

// ---- configuration and introspection for Python ----
static void set_memory_capacity(int64_t device, int64_t bytes) {
  TORCH_CHECK(bytes > 0, "memory capacity must be positive, got ", bytes);
  DeviceMemory& m = memory_of(static_cast<c10::DeviceIndex>(device));
  std::lock_guard<std::mutex> lock(m.mutex);
  m.capacity = static_cast<size_t>(bytes);
}
static int64_t memory_capacity(int64_t device) {
  DeviceMemory& m = memory_of(static_cast<c10::DeviceIndex>(device));
  std::lock_guard<std::mutex> lock(m.mutex);
  return static_cast<int64_t>(m.capacity);
}
static void set_memory_fraction(int64_t device, double fraction) {
  TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0, "Invalid fraction value: ", fraction,
              ". Allowed range: 0~1 (a share of neuron:", device, "'s memory capacity)");
  DeviceMemory& m = memory_of(static_cast<c10::DeviceIndex>(device));
  std::lock_guard<std::mutex> lock(m.mutex);
  m.fraction = fraction;
}
static double memory_fraction(int64_t device) {
  DeviceMemory& m = memory_of(static_cast<c10::DeviceIndex>(device));
  std::lock_guard<std::mutex> lock(m.mutex);
  return m.fraction;
}
static int64_t cached_bytes(int64_t device) {
  DeviceMemory& m = memory_of(static_cast<c10::DeviceIndex>(device));
  std::lock_guard<std::mutex> lock(m.mutex);
  return static_cast<int64_t>(m.cached_bytes);
}

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("set_memory_capacity(int device, int nbytes) -> ()", &set_memory_capacity);
  m.def("memory_capacity(int device) -> int", &memory_capacity);
  m.def("cached_bytes(int device) -> int", &cached_bytes);
  m.def("set_memory_fraction(int device, float fraction) -> ()", &set_memory_fraction);
  m.def("memory_fraction(int device) -> float", &memory_fraction);
}

}  // namespace torchneuron
