// Shared declarations of the software NeuronCore's C++ runtime.
//
// The runtime owns the device primitives PyTorch needs in C++ (allocator, device guard, streams,
// events, generators, hooks) and the eager hot path (the boxed fallback that runs aten ops as CPU
// kernels over zero-copy CPU aliases). Everything that is not per-op work lives in Python.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/Allocator.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <cstdint>
#include <string>
#include <vector>

namespace torch {
class Library;
}  // namespace torch

namespace torchneuron {

constexpr c10::DeviceType kNeuron = c10::DeviceType::PrivateUse1;

// ---- devices (device.cpp) and streams (stream.cpp) ----
c10::DeviceIndex device_count();
// The number of devices, before any is used (python.cpp's configure, at load).
void configure_device_count(int64_t n);
c10::DeviceIndex current_device();
void check_device_index(c10::DeviceIndex index);
// Stream id of the calling thread's current stream on `index` (0 = the default stream).
c10::StreamId current_stream_id(c10::DeviceIndex index);

// ---- memory (allocator.cpp) ----
c10::Allocator* device_allocator();
// Take ownership of host memory produced by a CPU kernel as device memory of `index`: accounts it
// against the device's capacity (raising torch.OutOfMemoryError past it) and in the statistics.
c10::DataPtr adopt_host_memory(c10::DataPtr&& host, size_t nbytes, c10::DeviceIndex index);

// ---- the generator behind each device (generator.cpp) ----
// The CPU generator that actually produces a neuron generator's numbers (CPU kernels accept only
// CPU generators). `gen` may be undefined: the device's default generator is used.
at::Generator engine_of(const std::optional<at::Generator>& gen, c10::DeviceIndex index);

// ---- the work log read by the device timeline (worklog.cpp) ----
enum class WorkKind : int32_t {
  kOp = 0,          // an aten op run on the device (or on the host as a CPU fallback)
  kCopy = 1,        // a copy: flags say host->device, device->host or device->device
  kEventRecord = 2, // aux = event id
  kEventWait = 3,   // the stream waits for event aux
  kSyncDevice = 4,  // the host waited for the whole device
  kSyncStream = 5,  // the host waited for one stream
  kSyncEvent = 6,   // the host waited for event aux
  kFolded = 7,      // work of one stream whose prices were known, summed (worklog.cpp's folding):
                    // aux = records, host_seconds = their seconds, sigs = busy seconds per engine
};
enum WorkFlags : int32_t {
  kFallback = 1,    // the op has no NeuronCore implementation: it ran on the host
  kHostToDevice = 2,
  kDeviceToHost = 4,
  kDeviceToDevice = 8,
};
// ---- the fallback policy of an operator (fallback.cpp; Python's ops/policy.py classifies) ----
enum OpPolicy : int32_t {
  kPolicyHost = 1,         // the NeuronCore has no implementation: the op runs on the host CPU
  kPolicyImplicitRng = 2,  // the CPU kernel draws from the CPU default generator internally
  kPolicyMixedDevices = 4, // CPU tensor arguments are legitimate (index tensors, copies)
  kPolicyDataMovement = 8, // moves bytes only: no dtype makes it a host op
  kPolicyFp64Emulated = 16, // float64 elementwise arithmetic, emulated on the engines (no complex)
};

constexpr int kMaxSigs = 4;
constexpr int kSigDims = 4;
struct TensorSig {
  int8_t dtype;   // c10::ScalarType, -1 = none
  int8_t ndim;    // dimensions before collapsing leading ones into sizes[0]
  int8_t pad[6];
  int64_t sizes[kSigDims];
};
struct WorkRecord {
  int32_t kind;
  int32_t op_id;     // index into op_names(), -1 = none
  int32_t device;
  int32_t stream;
  int32_t flags;
  int32_t n_inputs;  // signatures [0, n_inputs) are inputs, the rest (up to n_sigs) outputs
  int32_t n_sigs;
  int32_t pad;
  int64_t aux;
  double host_seconds;  // wall time of a CPU fallback on the host (0 otherwise)
  TensorSig sigs[kMaxSigs];
};
static_assert(sizeof(WorkRecord) == 48 + kMaxSigs * 40, "WorkRecord layout is read by Python");

bool worklog_enabled();
// Turns recording on or off; returns whether it was on.
bool worklog_exchange_enabled(bool on);
// Records appended and not yet drained; of those, the control records (events, waits, syncs).
int64_t worklog_pending_count();
int64_t worklog_pending_control_count();
void fill_sig(TensorSig& s, const at::Tensor& t);
void fill_sig_numel(TensorSig& s, c10::ScalarType dtype, int64_t numel);
// Appends a record (already filled except device/stream) for the current stream of `device`.
void worklog_append(WorkRecord& r, c10::DeviceIndex device);
void worklog_control(WorkKind kind, c10::DeviceIndex device, c10::StreamId stream, int64_t aux);
// Called right after each op or copy record is appended, inside the call that issued it (the
// profiler's per-record hook: contexts.cpp's issuer contexts); nullptr: no hook.
using WorkRecordHook = void (*)();
void set_worklog_record_hook(WorkRecordHook hook);
// Folding (worklog.cpp): with it on and no record hook, an op or copy record whose price key
// Python has taught (worklog_learn_price) is summed into its stream's kFolded record instead of
// logged. Python turns it on only while nobody watches the timeline record by record.
bool worklog_exchange_fold(bool on);
// `key`: a record's bytes with its non-key words (device|stream, aux, host_seconds) zeroed;
// `engine` < kFoldEngines: the index of the engine it keeps busy, in Python's engine list.
void worklog_learn_price(const std::string& key, double seconds, int64_t engine);
void worklog_forget_prices();
constexpr int kFoldEngines = kMaxSigs * sizeof(TensorSig) / sizeof(double);

// Raises the pending Python exception through C++ (the Python bindings restore it, type included;
// python.cpp).
[[noreturn]] void rethrow_python_error();

// ---- ops (fallback.cpp) ----
int32_t op_id_of(const c10::OperatorHandle& op);
// Runs an op on the device now (the fallback's work, without the adaptive queue).
void run_op_now(const c10::OperatorHandle& op, std::vector<c10::IValue>* stack);
// Copies device bytes between two neuron tensors of one shape, off the work log (host_alias.cpp).
void copy_device_bytes(const at::Tensor& dst, const at::Tensor& src);
// Raises PyTorch's error for tensors of two devices in one op.
[[noreturn]] void device_mismatch(c10::Device a, c10::Device b);
// Registers the device's own kernels (kernels.cpp) in the PrivateUse1 library of aten.
void register_device_kernels(torch::Library& m);

// ---- adaptive eager mode's queue (queue.cpp) ----
// Whether ops reaching the fallback on this thread go through the queue now.
bool adaptive_active();
// Queues the op on `stack` (or runs it, having learnt how to queue it); false: the caller runs it
// (the queue flushed first if the op must see queued work done).
bool adaptive_enqueue(const c10::OperatorHandle& op, int32_t op_id, std::vector<c10::IValue>* stack);
// Records a view op that just ran (its `args`, and its results at the end of `results`) if it
// views queued memory, so fused programs compute through it.
void adaptive_note_view(const c10::OperatorHandle& op, int32_t op_id, std::vector<c10::IValue>&& args,
                        const std::vector<c10::IValue>& results, size_t n_results);
// Whether `t` is a tensor the queue made (an output of a queued op, or a recorded view of one).
bool adaptive_is_queued(const at::Tensor& t);
// Runs every queued op; a no-op with an empty queue, inside a flush, or off the queue's thread.
// `cause` names what needs the work done (counted for torchneuron.eager.stats).
void adaptive_flush(const char* cause = "flush()");

// ---- layer and batch norm statistics as on CUDA (norms.cpp) ----
// What the fallback adapts in a norm op's CPU kernel; `result_dtype_from` is empty for other ops.
struct NormStatistics {
  std::vector<int8_t> result_dtype_from;  // per result, the argument whose dtype it has (-1: as computed)
  int8_t data_arg = 0;                    // the argument holding the normalised data
  bool batch_norm_forward = false;
  bool always_eval = false;               // _native_batch_norm_legit_no_training
  std::vector<const char*> saved_statistics;  // backward ops: the arguments holding saved statistics
};
NormStatistics norm_statistics_of(const std::string& op_name);
// Runs the CPU kernel of a norm op (the dispatcher's `cpu_keys`) with CUDA's statistics: float32 for
// half-precision data, and eval-mode batch norm's; false (nothing run) when neither applies.
bool run_norm_as_cuda(const c10::OperatorHandle& op, const NormStatistics& norm, std::vector<c10::IValue>* stack,
                      c10::DispatchKeySet cpu_keys);

}  // namespace torchneuron
