"""torchneuron.nki: the Neuron Kernel Interface on the software NeuronCore.

Kernels written for AWS's NKI run unmodified: `language` (nl), `isa` (nisa), `typing` (nt),
`collectives` (ncc: all-reduce, all-gather, ... between the ranks of a launch), `jit`,
`simulate_kernel`, `simulate_ranks` (one kernel per rank, each with its own inputs),
`baremetal`, `benchmark`, `profile`. Each `nl`/`nisa` call runs vectorised on the host with the
target's numerics and is charged to its engine by the hardware model; a list scheduler over
the engines gives the kernel's modeled latency.

Existing kernels that `import neuronxcc.nki` (or `import nki`) can be pointed here with
`torchneuron.nki.install_import_alias()` or the environment variable TORCHNEURON_NKI_ALIAS=1.
"""
from __future__ import annotations

from torchneuron import settings as _settings

from . import collectives, compiler, isa, language, typing  # noqa: F401
from .alias import install_import_alias, uninstall_import_alias  # noqa: F401
from .errors import (CapacityError, CollectiveError, DTypeError, EngineRuleError, KernelError,  # noqa: F401
                     NKIError, OutOfBoundsError, PartitionDimError, ShapeError)
from .jit import (Kernel, KernelStats, baremetal, benchmark, jit, profile, simulate,  # noqa: F401
                  simulate_kernel, simulate_ranks)
from .tile import Tile  # noqa: F401

tensor = Tile  # `nki.tensor` type name used in annotations
dtype = object  # `nki.dtype`: annotations only; any dtype spelling of `nki.language` is one

__all__ = ["collectives", "isa", "language", "typing", "jit", "simulate_kernel", "simulate_ranks",
           "simulate", "baremetal", "benchmark", "profile", "install_import_alias",
           "uninstall_import_alias", "nki_op", "register_autograd", "Kernel", "KernelStats", "NKIError",
           "Tile"]


def __getattr__(name: str):
    if name in ("nki_op", "register_autograd"):
        from . import bridge
        return getattr(bridge, name)
    raise AttributeError(name)


if _settings.current().nki_alias:
    install_import_alias()
