"""torchao on neuron: the quantization configs whose hardware check asks the wrong device.

torchao 0.18's `Float8DynamicActivationFloat8WeightConfig` handler calls
`torchao.float8.inference._check_hardware_support`, which asserts that the *process* has an
SM 8.9+ CUDA GPU, an MI300 or an XPU, whatever device the weight is on; so `quantize_` refuses a
model on neuron although the NeuronCore multiplies FP8 (trn2, trn3; trn1 as cFP8) and
`torch._scaled_mm` runs on it (tensor-wise, row-wise and 1x128/128x128 block scales, the three
granularities that check knows). Everything else in torchao (Int8WeightOnlyConfig, the float8
training recipes, Int4WeightOnlyConfig's device-independent packings) works unchanged.

`install()` re-registers that config's handler through torchao's own registry
(`register_quantize_module_handler`): a module whose weight is on neuron runs torchao's handler
with the hardware check answered for the NeuronCore; every other module goes to torchao's
handler untouched. torchao's source is not modified. Installed when torchao's quantization API
is first imported (an import hook), or at once when it already is.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any

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


def install() -> None:
    """Registers the neuron-aware handler of Float8DynamicActivationFloat8WeightConfig (idempotent)."""
    global _installed
    if _installed:
        return
    import torchao.quantization.quant_api as quant_api
    from torchao.quantization.transform_module import _QUANTIZE_CONFIG_HANDLER, register_quantize_module_handler

    config_type = quant_api.Float8DynamicActivationFloat8WeightConfig
    torchao_handler = _QUANTIZE_CONFIG_HANDLER[config_type]

    @register_quantize_module_handler(config_type)
    def float8_dynamic_transform(module, config, *, parameter_name: str = "weight"):
        if not _on_neuron(module, parameter_name):
            return torchao_handler(module, config, parameter_name=parameter_name)
        with _lock:  # the check is looked up in quant_api's namespace at call time
            check = quant_api._check_hardware_support
            quant_api._check_hardware_support = _neuron_check
            try:
                return torchao_handler(module, config, parameter_name=parameter_name)
            finally:
                quant_api._check_hardware_support = check

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


def install_when_imported() -> None:
    """`install()` now if torchao's quantization API is loaded, else as soon as it is."""
    if _MODULE in sys.modules:
        install()
    elif not any(isinstance(f, _InstallAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _InstallAfterImport())
