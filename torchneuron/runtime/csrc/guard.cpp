// The device guard of the software NeuronCore: PyTorch's c10::impl::DeviceGuardImplInterface for
// PrivateUse1, over the current device (device.cpp) and the streams and events (stream.cpp).
#include "device.h"

#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace torchneuron {
using c10::Device;
using c10::DeviceIndex;
using c10::Stream;

struct NeuronGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNeuron; }
  Device exchangeDevice(Device d) const override { return Device(kNeuron, exchange_device(d.index())); }
  Device getDevice() const override { return Device(kNeuron, current_device()); }
  void setDevice(Device d) const override { set_current_device(d.index()); }
  void uncheckedSetDevice(Device d) const noexcept override { set_current_device_unchecked(d.index()); }
  Stream getStream(Device d) const override { return current_stream(d.index()); }
  Stream getDefaultStream(Device d) const override { return default_stream(d.index()); }
  Stream getNewStream(Device d, int /*priority*/) const override { return pool_stream(d.index()); }
  Stream getStreamFromGlobalPool(Device d, bool /*high_priority*/) const override { return pool_stream(d.index()); }
  Stream exchangeStream(Stream s) const override { return exchange_stream(s); }
  DeviceIndex deviceCount() const noexcept override { return device_count(); }

  void record(void** event, const Stream& stream, const DeviceIndex device_index,
              const c10::EventFlag flag) const override {
    record_event(event, stream, device_index, flag);
  }
  void block(void* event, const Stream& stream) const override { block_on_event(event, stream); }
  bool queryEvent(void* /*event*/) const override { return true; }  // host work is already done
  // torch.accelerator.get_device_capability: which dtypes tensors on the device can have and convert
  // between. Every one: device memory is host memory, and ops the NeuronCore cannot compute in a
  // dtype (float64, complex) run on the host (see ops/policy.py).
  c10::DeviceCapability getDeviceCapability(Device d) const override {
    check_device_index(resolve_device(d.index()));
    return c10::DeviceCapability();
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override { destroy_event(event); }
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream& s) const override { synchronize_stream(s); }
  void synchronizeEvent(void* event) const override { synchronize_event(event); }
  void synchronizeDevice(const DeviceIndex device_index) const override { synchronize_device(device_index); }
  void recordDataPtrOnStream(const c10::DataPtr&, const Stream&) const override {
    // Memory is released only after the host finished every op that used it (execution is
    // synchronous), so a block can never be reused while a stream still reads it.
  }
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    return event_elapsed_ms(start, end);
  }
};
C10_REGISTER_GUARD_IMPL(PrivateUse1, NeuronGuard);

}  // namespace torchneuron
