// Devices of the software NeuronCore: how many there are and which one is current on each thread
// (what OpenReg's backend calls its device functions). The device guard (guard.cpp) and the hooks
// (hooks.cpp) are PyTorch's two ways in; torch.neuron reaches them through the ops below.
#include "device.h"

#include <torch/csrc/utils/device_lazy_init.h>
#include <torch/library.h>

namespace torchneuron {
using c10::DeviceIndex;

// Set once by configure_device_count when the library loads (Python's settings.device_count).
static DeviceIndex g_device_count = 2;
thread_local DeviceIndex tl_device = 0;

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
DeviceIndex resolve_device(DeviceIndex index) { return index < 0 ? tl_device : index; }

DeviceIndex exchange_device(DeviceIndex index) {
  check_device_index(index);
  DeviceIndex old = tl_device;
  tl_device = index;
  return old;
}
void set_current_device(DeviceIndex index) {
  check_device_index(index);
  tl_device = index;
}
void set_current_device_unchecked(DeviceIndex index) noexcept { tl_device = index; }

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("device_count() -> int", [] { return static_cast<int64_t>(g_device_count); });
  m.def("current_device() -> int", [] { return static_cast<int64_t>(tl_device); });
  // PyTorch calls torch.neuron._lazy_init again before the next use of the device from Python (a
  // child forked after its parent initialised the device: see runtime/device.py).
  m.def("require_device_init() -> ()",
        [] { torch::utils::set_requires_device_init(c10::DeviceType::PrivateUse1, true); });
  m.def("set_device(int device) -> ()", [](int64_t d) { set_current_device(static_cast<DeviceIndex>(d)); });
}

}  // namespace torchneuron
