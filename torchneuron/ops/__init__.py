"""torchneuron.ops: aten registrations on the neuron device and the policies around them.

- policy.py: which ops the NeuronCore runs natively and which fall back to the host CPU;
- printing.py: printing a neuron tensor formats its values on the host;
- histogram.py, scaled_mm.py: device ops the CPU kernels lack (integer histc/bincount, grouped and
  block-scaled matmuls);
- int4_mm.py: tinygemm's int4 weight-only matmul (`_weight_int4pack_mm`) and its packing;
- conv_layout.py: convolutions on neuron pick the CPU's backend and memory format (channels-last kept);
- sync_batch_norm.py: the statistics ops SyncBatchNorm calls off the CPU, with CUDA's semantics;
- torchao_support.py: torchao's quantization configs accept modules on neuron.

`install()` (called when torchneuron is imported) connects them to the runtime.
"""
from __future__ import annotations

from torchneuron.ops import (conv_layout, histogram, int4_mm, policy, printing, scaled_mm, sync_batch_norm,
                             torchao_support)


def install() -> None:
    """Registers the fallback policy with the C++ fallback, host-side printing and the device ops."""
    policy.install()
    conv_layout.install()
    printing.install()
    histogram.install()
    scaled_mm.install()
    int4_mm.install()
    sync_batch_norm.install()
    torchao_support.install_when_imported()
