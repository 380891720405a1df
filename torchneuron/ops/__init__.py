"""torchneuron.ops: aten registrations on the neuron device and the policies around them.

- policy.py: which ops the NeuronCore runs natively and which fall back to the host CPU;
- printing.py: printing a neuron tensor formats its values on the host;
- histogram.py, scaled_mm.py: device ops the CPU kernels lack (integer histc/bincount, grouped and
  block-scaled matmuls).

`install()` (called when torchneuron is imported) connects both to the runtime.
"""
from __future__ import annotations

from torchneuron.ops import histogram, policy, printing, scaled_mm


def install() -> None:
    """Registers the fallback policy with the C++ fallback and the host-side tensor printing."""
    policy.install()
    printing.install()
    histogram.install()
    scaled_mm.install()
