// Streams and events of the software NeuronCore.
//
// Host execution is synchronous, so a stream never has pending work on the host: stream and event
// queries are true at once. Their *device* semantics (which stream an op went to, what waited on
// what, how long it took on Trainium) are kept in the work log and replayed by the Python device
// timeline, which is also what Event.elapsed_time reads.
#include "device.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <array>
#include <atomic>

namespace torchneuron {
using c10::Device;
using c10::DeviceIndex;
using c10::Stream;
using c10::StreamId;

constexpr StreamId kStreamPoolSize = 32;  // like CUDA's pool of 32 streams per device

thread_local std::array<StreamId, kMaxDevices> tl_stream{};  // all default streams
static std::array<std::atomic<StreamId>, kMaxDevices> g_next_pool_stream{};

StreamId current_stream_id(DeviceIndex index) { return tl_stream[resolve_device(index)]; }

Stream current_stream(DeviceIndex index) {
  DeviceIndex i = resolve_device(index);
  return Stream(Stream::UNSAFE, Device(kNeuron, i), tl_stream[i]);
}
Stream default_stream(DeviceIndex index) { return Stream(Stream::UNSAFE, Device(kNeuron, resolve_device(index)), 0); }
Stream pool_stream(DeviceIndex index) {
  DeviceIndex i = resolve_device(index);
  check_device_index(i);
  StreamId id = 1 + (g_next_pool_stream[i]++ % kStreamPoolSize);
  return Stream(Stream::UNSAFE, Device(kNeuron, i), id);
}
Stream exchange_stream(const Stream& s) {
  DeviceIndex i = s.device_index();
  check_device_index(i);
  Stream old(Stream::UNSAFE, Device(kNeuron, i), tl_stream[i]);
  tl_stream[i] = s.id();
  return old;
}

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

void record_event(void** event, const Stream& stream, const DeviceIndex device_index, const c10::EventFlag flag) {
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
void block_on_event(void* event, const Stream& stream) {
  auto* ev = static_cast<NeuronEvent*>(event);
  if (!ev || !ev->recorded) return;  // waiting on an unrecorded event is a no-op, as in CUDA
  flush_queued_work("stream or event: block");
  worklog_control(WorkKind::kEventWait, stream.device_index(), stream.id(), ev->id);
}
void destroy_event(void* event) noexcept { delete static_cast<NeuronEvent*>(event); }

void synchronize_stream(const Stream& s) {
  flush_queued_work("stream or event: synchronizeStream");
  worklog_control(WorkKind::kSyncStream, s.device_index(), s.id(), 0);
}
void synchronize_event(void* event) {
  auto* ev = static_cast<NeuronEvent*>(event);
  flush_queued_work("stream or event: synchronizeEvent");
  if (ev && ev->recorded) worklog_control(WorkKind::kSyncEvent, ev->device, 0, ev->id);
}
void synchronize_device(const DeviceIndex device_index) {
  flush_queued_work("stream or event: synchronizeDevice");
  worklog_control(WorkKind::kSyncDevice, resolve_device(device_index), 0, 0);
}

double event_elapsed_ms(void* start, void* end) {
  auto* a = static_cast<NeuronEvent*>(start);
  auto* b = static_cast<NeuronEvent*>(end);
  TORCH_CHECK(a && b && a->recorded && b->recorded, "Both events must be recorded before calculating elapsed time.");
  TORCH_CHECK(a->timing && b->timing,
              "Both events must be created with enable_timing=True to calculate elapsed time.");
  return python_elapsed_ms(a->id, b->id);
}

static int64_t current_stream_of(int64_t device) { return current_stream_id(static_cast<DeviceIndex>(device)); }

TORCH_LIBRARY_FRAGMENT(torchneuron, m) { m.def("current_stream_id(int device) -> int", &current_stream_of); }

}  // namespace torchneuron
