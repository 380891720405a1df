"""torchao on neuron: the quantization configs whose hardware check asks the wrong device.

Two of torchao 0.18's configs check the *process* for a CUDA GPU, whatever device the weight is on,
so `quantize_` refuses a model on neuron although the NeuronCore runs their kernels:

- `Float8DynamicActivationFloat8WeightConfig` calls `torchao.float8.inference.
  _check_hardware_support`, which asserts an SM 8.9+ GPU, an MI300 or an XPU. The NeuronCore
  multiplies FP8 (trn2, trn3; trn1 as cFP8) and `torch._scaled_mm` runs on it with the three
  granularities that check knows (tensor-wise, row-wise, 1x128/128x128 blocks).
- `Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")` (tinygemm's format) asks
  `torch.cuda.get_device_capability()` for 8.0+; neuron runs tinygemm's `_convert_weight_to_int4pack`
  and `_weight_int4pack_mm` (ops/int4_mm.py). torchao 0.18's other int4 formats have no kernel
  off CUDA/XPU/NPU (plain and preshuffled: the `mslk` CUDA library; plain_int32: XPU and NPU
  ops), and none runs on the CPU; for them a module on neuron gets an error naming the format
  that works.

Everything else in torchao (Int8WeightOnlyConfig, IntxWeightOnlyConfig, the float8 training
recipes) works unchanged.

`install()` re-registers those configs' handlers through torchao's own registry
(`register_quantize_module_handler`): a module whose weight is on neuron runs torchao's handler
with the hardware check answered for the NeuronCore; every other module goes to torchao's
handler untouched. torchao's source is not modified. Installed when torchao's quantization API
is first imported (an import hook), or at once when it already is.

torchao's wheel also ships CUDA-only kernel libraries (`_C_mxfp8*.so`, `_C_cutlass_90a*.so`, linked
against libtorch_cuda). On a CPU build of torch they cannot load, and torchao logs a warning for each
at import, which transformers triggers on every model load: `quiet_cuda_library_warnings()` drops
exactly those records when torch has no CUDA; every other torchao message is kept.
"""
from __future__ import annotations

import contextlib
import importlib.abc
import logging
import re
import importlib.machinery
import sys
import threading
from typing import Any, Callable, ContextManager

import torch

_MODULE = "torchao.quantization.quant_api"
_lock = threading.Lock()
_installed = False


def _neuron_check(granularity: Any) -> None:
    """torchao's granularity validation, with the NeuronCore as the FP8 device."""
    from torchao.float8.inference import _granularity_is_a_1_128_w_128_128
    from torchao.quantization.granularity import PerRow, PerTensor

    kinds = {type(g) for g in granularity}
    if kinds <= {PerTensor} or kinds <= {PerRow} or _granularity_is_a_1_128_w_128_128(granularity):
        return
    raise ValueError(f"float8 dynamic quantization on neuron supports per-tensor, per-row and 1x128/128x128 "
                     f"granularities; got {granularity}")


def _on_neuron(module: Any, parameter_name: str) -> bool:
    weight = getattr(module, parameter_name, None)
    return getattr(weight, "device", None) is not None and weight.device.type == "neuron"


@contextlib.contextmanager
def _replaced(owner: Any, name: str, value: Any):
    """`owner.name` is `value` inside the block (under the lock: torchao looks it up at call time)."""
    with _lock:
        original = getattr(owner, name)
        setattr(owner, name, value)
        try:
            yield
        finally:
            setattr(owner, name, original)


def _float8_dynamic_on_neuron(config: Any) -> ContextManager:
    import torchao.quantization.quant_api as quant_api

    return _replaced(quant_api, "_check_hardware_support", _neuron_check)


def _int4_on_neuron(config: Any) -> ContextManager:
    from torchao.quantization.quantize_.workflows import Int4PackingFormat

    if config.int4_packing_format != Int4PackingFormat.TILE_PACKED_TO_4D:
        raise ValueError(
            f"Int4WeightOnlyConfig(int4_packing_format={str(config.int4_packing_format.value)!r}) has no kernel on "
            f"neuron (torchao 0.18 runs it only with CUDA's mslk library, or on XPU/NPU); use "
            f"Int4WeightOnlyConfig(int4_packing_format='tile_packed_to_4d'), tinygemm's format, which neuron runs")
    # torchao asks for tinygemm's tensor-core requirement (compute capability 8.0); the NeuronCore
    # runs `_weight_int4pack_mm` itself, so the requirement is answered as met.
    return _replaced(torch.cuda, "get_device_capability", lambda device=None: (8, 0))


def _register_neuron_handler(config_type: type, on_neuron: Callable[[Any], ContextManager]) -> None:
    """Routes modules on neuron through torchao's handler inside `on_neuron(config)`."""
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER, register_quantize_module_handler

    torchao_handler = _QUANTIZE_CONFIG_HANDLER[config_type]

    @register_quantize_module_handler(config_type)
    def transform(module, config, *, parameter_name: str = "weight"):
        if not _on_neuron(module, parameter_name):
            return torchao_handler(module, config, parameter_name=parameter_name)
        with on_neuron(config):
            return torchao_handler(module, config, parameter_name=parameter_name)


def install() -> None:
    """Registers the neuron-aware handlers of the configs above (idempotent)."""
    global _installed
    if _installed:
        return
    import torchao.quantization.quant_api as quant_api

    _register_neuron_handler(quant_api.Float8DynamicActivationFloat8WeightConfig, _float8_dynamic_on_neuron)
    _register_neuron_handler(quant_api.Int4WeightOnlyConfig, _int4_on_neuron)
    _installed = True


class _InstallAfterImport(importlib.abc.MetaPathFinder):
    """Runs `install()` right after torchao's quantization API module executes."""

    def find_spec(self, name, path, target=None):
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module):
            original(module)
            install()

        loader.exec_module = exec_module
        return spec


_CUDA_ONLY_LIBRARY = re.compile(r"Failed to load .*/torchao/_C_(mxfp8|cutlass)[^/]*\.so")


class _CudaOnlyLibraryFilter(logging.Filter):
    """Drops torchao's "Failed to load" records of its CUDA-only kernel libraries."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not _CUDA_ONLY_LIBRARY.match(record.getMessage())


def quiet_cuda_library_warnings() -> None:
    """On a torch built without CUDA, silence torchao's import warnings for its CUDA-only libraries."""
    if torch.version.cuda is not None:
        return
    torchao_logger = logging.getLogger("torchao")
    if not any(isinstance(f, _CudaOnlyLibraryFilter) for f in torchao_logger.filters):
        torchao_logger.addFilter(_CudaOnlyLibraryFilter())


def install_when_imported() -> None:
    """`install()` now if torchao's quantization API is loaded, else as soon as it is."""
    quiet_cuda_library_warnings()
    if _MODULE in sys.modules:
        install()
    elif not any(isinstance(f, _InstallAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())
