// Declarations shared by the device primitives of the runtime (device.cpp, stream.cpp, guard.cpp,
// generator.cpp, host_allocator.cpp, hooks.cpp): what PyTorch's device interfaces are implemented
// from. Code outside runtime/csrc uses neuron.h.
#pragma once
#include "neuron.h"

#include <ATen/core/Generator.h>
#include <c10/core/Allocator.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

namespace torchneuron {

constexpr int kMaxDevices = 64;

// ---- the current device of the calling thread (device.cpp) ----
// `index` < 0 names the current device.
c10::DeviceIndex resolve_device(c10::DeviceIndex index);
// Makes `index` current (checked); returns the device that was.
c10::DeviceIndex exchange_device(c10::DeviceIndex index);
void set_current_device(c10::DeviceIndex index);
void set_current_device_unchecked(c10::DeviceIndex index) noexcept;

// ---- streams and events (stream.cpp) ----
c10::Stream current_stream(c10::DeviceIndex index);
c10::Stream default_stream(c10::DeviceIndex index);
// The next stream of the device's pool, round robin, as CUDA hands out its pool of streams.
c10::Stream pool_stream(c10::DeviceIndex index);
// Makes `stream` current on its device; returns the stream that was.
c10::Stream exchange_stream(const c10::Stream& stream);
void synchronize_stream(const c10::Stream& stream);
void synchronize_device(c10::DeviceIndex index);
// An event is created at its first record (`*event` null) and logged on the recording stream.
void record_event(void** event, const c10::Stream& stream, c10::DeviceIndex device_index, c10::EventFlag flag);
void block_on_event(void* event, const c10::Stream& stream);
void synchronize_event(void* event);
void destroy_event(void* event) noexcept;
double event_elapsed_ms(void* start, void* end);

// ---- generators (generator.cpp) ----
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);

// ---- pinned host memory (host_allocator.cpp) ----
c10::Allocator* pinned_allocator();
bool is_pinned_address(const void* p);

}  // namespace torchneuron
