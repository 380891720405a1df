// The PrivateUse1 profiler stubs: what torch.autograd.profiler.profile(use_device="neuron") needs.
//
// That profiler (ProfilerState KINETO_PRIVATEUSE1_FALLBACK) records a device event when each op
// starts and ends and asks for the device time between them, as it does with CUDA events. Without
// registered stubs every op's callback fails ("PrivateUse1 used in profiler but not enabled") and
// the ops' CPU times come out negative. Here an event is a point on the calling thread's current
// stream of the device timeline (a kEventRecord in the work log, like torch.neuron.Event), and the
// elapsed time between two of them is the modeled device time in between, in microseconds.
// Profiler events use negative ids so they never meet the ids of torch.neuron.Event objects.
#include "neuron.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <torch/csrc/profiler/stubs/base.h>

#include <atomic>
#include <functional>
#include <memory>

namespace torchneuron {
namespace {

using torch::profiler::impl::ProfilerVoidEventStub;

struct ProfilerEvent {
  int64_t id;
};

std::atomic<int64_t> g_next_profiler_event{-1};

struct NeuronProfilerStubs final : torch::profiler::impl::ProfilerStubs {
  void record(c10::DeviceIndex* device, ProfilerVoidEventStub* event, int64_t* cpu_ns) const override {
    const c10::DeviceIndex index = current_device();
    if (device) *device = index;
    if (cpu_ns) *cpu_ns = c10::getTime();
    if (!event) return;
    auto* ev = new ProfilerEvent{g_next_profiler_event--};
    *event = std::shared_ptr<void>(ev, [](void* p) { delete static_cast<ProfilerEvent*>(p); });
    worklog_control(WorkKind::kEventRecord, index, current_stream_id(index), ev->id);
  }

  float elapsed(const ProfilerVoidEventStub* start, const ProfilerVoidEventStub* end) const override {
    if (!start || !end || !*start || !*end) return 0.0f;
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("torchneuron::_event_elapsed_ms", "")
                         .typed<double(int64_t, int64_t)>();
    try {
      const double ms = op.call(static_cast<const ProfilerEvent*>(start->get())->id,
                                static_cast<const ProfilerEvent*>(end->get())->id);
      return static_cast<float>(ms * 1000.0);
    } catch (const c10::Error& e) {  // device timeline off (TORCHNEURON_TIMELINE=0): no device time
      TORCH_WARN_ONCE("neuron profiler: no modeled device time: ", e.what_without_backtrace());
      return 0.0f;
    }
  }

  // Ranges and marks are the CPU-side annotations (NVTX on CUDA); record_function covers them here.
  void mark(const char* /*name*/) const override {}
  void rangePush(const char* /*name*/) const override {}
  void rangePop() const override {}

  void onEachDevice(std::function<void(int)> op) const override {
    const c10::DeviceIndex previous = current_device();
    for (c10::DeviceIndex i = 0; i < device_count(); ++i) {
      c10::impl::getDeviceGuardImpl(kNeuron)->setDevice(c10::Device(kNeuron, i));
      op(i);
    }
    c10::impl::getDeviceGuardImpl(kNeuron)->setDevice(c10::Device(kNeuron, previous));
  }

  void synchronize() const override {
    c10::impl::getDeviceGuardImpl(kNeuron)->synchronizeDevice(current_device());
  }

  bool enabled() const override { return true; }
};

struct Register {
  Register() {
    static NeuronProfilerStubs stubs;
    torch::profiler::impl::registerPrivateUse1Methods(&stubs);
  }
} g_register;

}  // namespace
}  // namespace torchneuron
