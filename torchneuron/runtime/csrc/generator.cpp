// Generators of the software NeuronCore: a neuron generator is a device-tagged front of a CPU
// mt19937 engine, so a seed gives the same numbers as on the CPU and CPU kernels can consume it.
// Also the random state of each device's default generator, for torch.neuron.
#include "device.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/library.h>
#include <mutex>
#include <vector>

namespace torchneuron {
using c10::Device;
using c10::DeviceIndex;

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
    for (DeviceIndex i = 0; i < device_count(); ++i) v.push_back(at::make_generator<NeuronGenerator>(i));
    return v;
  }();
  return gens;
}

const at::Generator& default_generator(DeviceIndex index) {
  index = resolve_device(index);
  check_device_index(index);
  return default_generators()[index];
}

at::Generator new_generator(DeviceIndex index) {
  index = resolve_device(index);
  check_device_index(index);
  return at::make_generator<NeuronGenerator>(index);
}

at::Generator engine_of(const std::optional<at::Generator>& gen, DeviceIndex index) {
  if (gen.has_value() && gen->defined()) {
    if (gen->device().type() != kNeuron) return *gen;  // a CPU generator passed explicitly
    return static_cast<NeuronGenerator*>(gen->unsafeGetGeneratorImpl())->engine;
  }
  const auto& gens = default_generators();
  return static_cast<NeuronGenerator*>(gens.at(resolve_device(index)).unsafeGetGeneratorImpl())->engine;
}

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

TORCH_LIBRARY_FRAGMENT(torchneuron, m) {
  m.def("manual_seed(int device, int seed) -> ()", &manual_seed);
  m.def("seed(int device) -> int", &seed);
  m.def("initial_seed(int device) -> int", &initial_seed);
  m.def("get_rng_state(int device) -> Tensor", &get_rng_state);
  m.def("set_rng_state(int device, Tensor state) -> ()", torch::dispatch(c10::DispatchKey::CPU, &set_rng_state));
}

}  // namespace torchneuron
