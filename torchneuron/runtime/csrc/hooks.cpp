// The PrivateUse1 hooks of the software NeuronCore (at::PrivateUse1HooksInterface): what ATen asks a
// device backend outside the guard — availability, default and new generators, pinned memory,
// resizing a storage.
#include "device.h"

#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <c10/core/StorageImpl.h>
#include <algorithm>
#include <cstring>

namespace torchneuron {
using c10::Device;
using c10::DeviceIndex;

struct NeuronHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(DeviceIndex d) const override { set_current_device(d); }
  DeviceIndex getCurrentDevice() const override { return current_device(); }
  DeviceIndex exchangeDevice(DeviceIndex d) const override { return exchange_device(d); }
  DeviceIndex maybeExchangeDevice(DeviceIndex d) const override {
    return d < 0 ? current_device() : exchange_device(d);
  }
  const at::Generator& getDefaultGenerator(DeviceIndex i) const override { return default_generator(i); }
  at::Generator getNewGenerator(DeviceIndex i) const override { return new_generator(i); }
  Device getDeviceFromPtr(void*) const override { return Device(kNeuron, current_device()); }
  bool isPinnedPtr(const void* p) const override { return is_pinned_address(p); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return pinned_allocator(); }
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

static bool g_hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new NeuronHooks());
  return true;
}();

}  // namespace torchneuron
