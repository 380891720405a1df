"""torchneuron: a native PyTorch backend for AWS Trainium-class accelerators.

`import torch` loads it through the `torch.backends` entry point; then `model.to("neuron")` is
all existing code needs. The device is a software NeuronCore: host memory with device semantics,
kernels run on the host, and every piece of work is charged to a device timeline by a performance
model of the chosen Trainium target (TORCHNEURON_TARGET=trn1|trn2|trn3).
"""
from __future__ import annotations


def _autoload() -> None:
    """Entry point of the `torch.backends` group: importing this module registers the device.

    Defined before anything imports torch: `import torchneuron` first imports torch, whose
    autoload then finds this (partially initialised) module and calls it.
    """


import torch  # noqa: E402

from torchneuron.runtime import register as _register_runtime  # noqa: E402

_register_runtime()  # the C++ library: allocator, guard, hooks, generators, the CPU fallback

from torchneuron.hardware import install as _install_hardware  # noqa: E402

_install_hardware()  # the work log priced on the device timeline, memory sized by the target

from torchneuron.ops import install as _install_ops  # noqa: E402

_install_ops()  # the CPU-fallback policy, host-side printing

from torchneuron import neuron_module as _neuron_module  # noqa: E402

torch._register_device_module("neuron", _neuron_module)  # torch.neuron

from torchneuron.distributed import register as _register_distributed  # noqa: E402

_register_distributed()  # the c10d backend "neuron" (torch.distributed is already imported by torch)

import torchneuron.profiler  # noqa: E402,F401  (torch.profiler records neuron device activity)

from torchneuron.compiler import register as _register_compiler  # noqa: E402

_register_compiler()  # torch.compile(backend="neuron"), found by name once Dynamo is imported

from torchneuron.kernels.pricing import install as _install_kernel_pricing  # noqa: E402

_install_kernel_pricing()  # attention ops are charged their NKI kernels' simulated latency

from torchneuron.kernels.pricing_rope_ce import install as _install_rope_ce_pricing  # noqa: E402

_install_rope_ce_pricing()  # so are the RoPE and linear cross-entropy ops

from torchneuron.kernels.pricing_norm_mlp import install as _install_norm_mlp_pricing  # noqa: E402

_install_norm_mlp_pricing()  # and the RMSNorm + projection and SwiGLU ops

from torchneuron.eager import configure_from_env as _configure_eager, set_eager_mode  # noqa: E402

_configure_eager()  # TORCHNEURON_EAGER_MODE=adaptive

from torchneuron.hardware import get_target, set_target  # noqa: E402
from torchneuron.ops.policy import fallback_counts, reset_fallback_counts, set_strict  # noqa: E402
from torchneuron.runtime.memory import set_capacity as set_memory_capacity  # noqa: E402

__version__ = "0.1.0"


__all__ = ["fallback_counts", "get_target", "reset_fallback_counts", "set_eager_mode", "set_memory_capacity",
           "set_strict", "set_target"]
