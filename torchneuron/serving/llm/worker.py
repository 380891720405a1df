"""The vLLM worker and model runner on `neuron:<local rank>`.

`NeuronWorker` is vLLM's GPU `Worker` with the device steps answered for neuron (as vLLM's XPU
worker does; not vLLM's `CPUWorker`, whose shared-memory module swaps torch's stream, event and
pinned-memory functions for CPU placeholders process-wide): put the process on its device, make
it the local rank for the `neuron` c10d backend, size the KV cache from the device allocator
(vLLM's profile run honours `gpu_memory_utilization` against the device's capacity), and refuse
at start a cache the host memory backing the software device cannot hold.

Profiling (`LLM.start_profile()`, the server's `/start_profile`) records the neuron device's
activity and writes a Neuron Explorer profile next to vLLM's trace (profiling.py).

`NeuronModelRunner` is vLLM's GPU model runner on the neuron device. The few places that name
`torch.cuda` streams and events (async copies for speculative decoding) see `torch.neuron`'s
while they run, and only then.
"""
from __future__ import annotations

import contextlib
import gc
import os
from typing import Any, Iterator

import psutil
import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.parallel_state import get_pp_group
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot, format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory
from vllm.v1.worker.worker_base import CompilationTimes

from torchneuron.serving.llm import platform, profiling, timing

logger = init_logger(__name__)

# Of the host memory available at start, the share one worker's KV cache may take.
HOST_SHARE = 0.5

_CUDA_NAMES = ("Stream", "Event", "current_stream", "default_stream", "stream", "set_stream")


@contextlib.contextmanager
def _neuron_streams() -> Iterator[None]:
    """torch.cuda's stream and event names mean torch.neuron's inside the block."""
    saved = {name: getattr(torch.cuda, name) for name in _CUDA_NAMES}
    try:
        for name in _CUDA_NAMES:
            setattr(torch.cuda, name, getattr(torch.neuron, name))
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)


class NeuronModelRunner(GPUModelRunner):
    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        with _neuron_streams():
            super().__init__(vllm_config, device)
        self.step_timer = timing.StepTimer(device, self.requests, self.max_model_len)

    def _copy_draft_token_ids_to_cpu(self, *args: Any, **kwargs: Any) -> None:
        with _neuron_streams():
            super()._copy_draft_token_ids_to_cpu(*args, **kwargs)

    def _copy_valid_sampled_token_count(self, *args: Any, **kwargs: Any) -> None:
        with _neuron_streams():
            super()._copy_valid_sampled_token_count(*args, **kwargs)

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self.step_timer.begin(scheduler_output)
        output = super().execute_model(scheduler_output, *args, **kwargs)
        if output is not None:  # nothing left to sample: the step ends here
            self.step_timer.end()
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        output = super().sample_tokens(*args, **kwargs)
        self.step_timer.end()
        return output


class NeuronWorker(Worker):
    def __init__(self, vllm_config: Any, local_rank: int, rank: int, distributed_init_method: str,
                 is_driver_worker: bool = False) -> None:
        # vLLM's GPU worker refuses at construction a profiler of a device it doesn't know: it is
        # checked here instead, and built on the first start_profile (see profile()).
        profiler_config = vllm_config.profiler_config
        profiling.check_config(profiler_config)
        vllm_config.profiler_config = profiling.disabled(profiler_config)
        try:
            super().__init__(vllm_config, local_rank, rank, distributed_init_method, is_driver_worker)
        finally:
            vllm_config.profiler_config = profiler_config
        self.profiler_config = profiler_config
        platform.install()  # this process builds the model: the neuron layers must be known here

    def init_device(self) -> None:
        if self.local_rank >= torch.neuron.device_count():
            raise RuntimeError(f"Worker local rank {self.local_rank} has no neuron device "
                               f"({torch.neuron.device_count()} on this host).")
        if hasattr(torch.cpu, "_init_amx"):
            torch.cpu._init_amx()  # the host kernels' AMX tiles need the OS's permission first
        self.device = torch.device("neuron", self.local_rank)
        torch.neuron.set_device(self.device)
        # vLLM does not set these; the neuron c10d backend puts the rank on neuron:<LOCAL_RANK>.
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        os.environ["LOCAL_WORLD_SIZE"] = str(self.parallel_config.world_size)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(self.vllm_config, self.rank, self.distributed_init_method,
                                            self.local_rank, current_platform.dist_backend)
        set_random_seed(self.model_config.seed)
        gc.collect()
        torch.accelerator.empty_cache()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
        self._init_workspace_and_model_runner()

    def _make_model_runner(self) -> NeuronModelRunner:
        return NeuronModelRunner(self.vllm_config, self.device)

    def profile(self, is_start: bool = True, profile_prefix: str | None = None, **kwargs: Any) -> None:
        if is_start and self.profiler is None and self.profiler_config.profiler is not None:
            self.profiler = profiling.NeuronTorchProfiler(self.profiler_config, worker_name="",
                                                          local_rank=self.local_rank)
        super().profile(is_start, profile_prefix, **kwargs)  # names the output, starts or stops it

    def _maybe_get_memory_pool_context(self, tag: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()  # no sleep-mode allocator on this device

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # Eager execution: nothing to compile or capture, and vLLM's GPU kernel warm-ups (which import
        # CUDA-only models) don't apply. Warm the sampler at its largest batch, as the GPU worker does.
        if get_pp_group().is_last_rank:
            max_reqs = min(self.scheduler_config.max_num_seqs, self.scheduler_config.max_num_batched_tokens)
            _, last_hidden = self.model_runner._dummy_run(num_tokens=max_reqs, skip_eplb=True,
                                                          cudagraph_runtime_mode=CUDAGraphMode.NONE)
            if not self.model_runner.is_pooling_model:
                self.model_runner._dummy_sampler_run(hidden_states=last_hidden)
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return CompilationTimes(language_model=self.compilation_config.compilation_time,
                                encoder=self.compilation_config.encoder_compilation_time)

    @torch.inference_mode()
    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        host = int(psutil.virtual_memory().available * HOST_SHARE)
        requested = self.cache_config.kv_cache_memory_bytes
        if requested and requested > self.init_snapshot.free_memory:
            raise ValueError(
                f"--kv-cache-memory-bytes {format_gib(requested)} GiB exceeds the free memory of {self.device} "
                f"({format_gib(self.init_snapshot.free_memory)} of {format_gib(self.init_snapshot.total_memory)} "
                "GiB); request less, or model a larger device with TORCHNEURON_MEMORY_CAPACITY.")
        if requested and requested > host:
            raise ValueError(
                f"--kv-cache-memory-bytes {format_gib(requested)} GiB does not fit the host memory that backs the "
                f"neuron device ({format_gib(host)} GiB usable by this worker); request less.")
        if available > host:
            logger.warning(
                "The KV cache gpu_memory_utilization=%.2f asks of the modeled device (%s GiB) exceeds the host "
                "memory backing it; using %s GiB. Set TORCHNEURON_MEMORY_CAPACITY, --gpu-memory-utilization or "
                "--kv-cache-memory-bytes to choose.", self.cache_config.gpu_memory_utilization,
                format_gib(available), format_gib(host))
            available = host
        return available
