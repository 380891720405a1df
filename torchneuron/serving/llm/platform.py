"""`NeuronPlatform`: what vLLM asks of a device, answered for `neuron` (PrivateUse1).

vLLM picks it through the `vllm.platform_plugins` entry point (see `torchneuron.serving.llm`),
then builds its engine from the answers: the worker and model runner (worker.py), the attention
backend (attention.py), the communicator for tensor parallelism (communicator.py) and the
configuration defaults below (eager execution, since the device's kernels are its eager ops;
vLLM's custom layers on, so the neuron ones replace them; no CUDA graphs; block size 128, a
multiple of the paged-attention kernel's 32).
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

_PACKAGE = "torchneuron.serving.llm"
ATTENTION_BACKEND = "NEURON_PAGED_ATTN"
_installed = False


def install() -> None:
    """Registers the neuron attention backend and layers with vLLM, in each process that builds a
    model or a config (idempotent). Not at import: this module is imported while vLLM itself is."""
    global _installed
    if _installed:
        return
    from vllm.v1.attention.backends.registry import register_backend

    from torchneuron.serving.llm import layers

    register_backend(ATTENTION_BACKEND, f"{_PACKAGE}.attention.NeuronAttentionBackend")
    layers.register()
    _installed = True


class NeuronPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "neuron"
    device_type: str = "neuron"
    dispatch_key: str = "PrivateUse1"
    dist_backend: str = "neuron"
    ray_device_key: str = "neuron_cores"
    device_control_env_var: str = "NEURON_RT_VISIBLE_CORES"
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"The neuron platform serves bfloat16, float16 or float32 models, not {dtype}; "
                             "pass --dtype bfloat16.")

    @classmethod
    def import_kernels(cls) -> None:
        # The neuron kernels compute with vLLM's CPU kernels on host views of device memory.
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.register_triton_kernel_overrides()  # no Triton here: vLLM's C++ stand-ins

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads: int | None = None) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError("The neuron platform has no MLA or sparse attention backend yet; "
                                      "serve a model with standard multi-head/grouped-query attention.")
        if selected_backend is not None and selected_backend.name != ATTENTION_BACKEND:
            logger.warning("Attention backend %s is not available on neuron; using %s.", selected_backend.name,
                           ATTENTION_BACKEND)
        return f"{_PACKAGE}.attention.NeuronAttentionBackend"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.neuron.get_device_name(device_id)

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        return f"neuron-{device_id}"

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.neuron.get_device_properties(device_id).total_memory

    @classmethod
    def get_device_capability(cls, device_id: int = 0):
        return None

    @classmethod
    def device_count(cls) -> int:
        return torch.neuron.device_count()

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.neuron.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.neuron.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        return torch.no_grad()

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # Device memory is host memory: staging buffers gain nothing from pinning (and torch's host
        # cache then has nothing of ours to free at exit).
        return False

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        torch.neuron.reset_peak_memory_stats(device)
        return float(torch.neuron.max_memory_allocated(device))

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return f"{_PACKAGE}.communicator.NeuronCommunicator"

    @classmethod
    def get_punica_wrapper(cls) -> str:
        return "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"

    @classmethod
    def opaque_attention_op(cls) -> bool:
        return True

    @classmethod
    def support_hybrid_kv_cache(cls) -> bool:
        return False

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return torch.neuron.get_device_properties(device_id).multi_processor_count

    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        from vllm.config import CompilationMode, CUDAGraphMode

        install()
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = f"{_PACKAGE}.worker.NeuronWorker"
        if parallel.world_size > torch.neuron.device_count():
            raise ValueError(
                f"tensor_parallel_size x pipeline_parallel_size = {parallel.world_size} needs that many neuron "
                f"devices, but this host has {torch.neuron.device_count()}; lower --tensor-parallel-size or "
                "choose a target with more NeuronCores (TORCHNEURON_TARGET).")
        if (os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "1"
                and parallel.distributed_executor_backend == "uni"):
            parallel.distributed_executor_backend = "mp"
        parallel.enable_dbo = False

        cache = vllm_config.cache_config
        if not cache.user_specified_block_size:
            cache.block_size = 128
        elif cache.block_size % 32:
            raise ValueError(f"--block-size {cache.block_size} is not a multiple of 32, which the neuron "
                             "paged-attention kernel needs.")

        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE  # the device runs eager ops; neuron kernels replace the layers
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        compilation.cudagraph_capture_sizes = []
        compilation.compile_sizes = []
        if "all" not in compilation.custom_ops:
            compilation.custom_ops = [op for op in compilation.custom_ops if op != "none"] + ["all"]

        vllm_config.scheduler_config.async_scheduling = False
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        if vllm_config.model_config is not None and vllm_config.model_config.use_mla:
            raise NotImplementedError("MLA models are not supported on the neuron platform yet.")
