// Pinned host memory: ordinary host memory that is remembered as pinned. It is also the device's
// host allocator (torch.accelerator.empty_host_cache and host-memory stats reach it): nothing is
// cached, and copies complete on the host before they return, so no block waits on a stream.
#include "device.h"

#include <ATen/core/CachingHostAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <cstring>
#include <map>
#include <mutex>

namespace torchneuron {

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
bool is_pinned_address(const void* p) {
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
    return {p, p, &pinned_free, c10::Device(c10::DeviceType::CPU)};
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

c10::Allocator* pinned_allocator() { return &g_pinned_allocator; }

}  // namespace torchneuron
