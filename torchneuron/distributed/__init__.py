"""torchneuron.distributed: the c10d backend `neuron`, and running PyTorch's parallelism on it.

`register()` (run when torchneuron is imported; `import torch` already imports torch.distributed, so it
costs only this package's import) makes `neuron` a c10d backend and the default one of the neuron
device: `init_process_group("neuron")`, or plain `init_process_group()` when the accelerator is neuron,
e.g. under `torchrun --nproc-per-node N`. The default group also makes `local_device()` current:
neuron:<LOCAL_RANK>, shared round-robin when the host has fewer logical cores than local ranks.

Collectives run over gloo on zero-copy host views of device memory and are charged to the device
timeline on a communication stream (overlap with compute shows in modeled time). DDP, FSDP2,
DTensor/tensor parallelism, pipelining, functional collectives and distributed checkpointing use the
backend unchanged; `simple_fsdp` adds SimpleFSDP-style sharding that torch.compile can trace.

Modules: process_group (the c10d interface), collectives (host data movement), host (host buffers,
reduce ops), checks (cross-rank agreement, clear errors), work (Work objects, device timeline),
dispatch (c10d C++ ops routed to Python), dtensor_ops (DTensor's foreach/fused optimizer ops over
lists mixing DTensors and plain tensors), dtensor_random (DTensor's random ops on neuron meshes), launch (local ranks, `spawn`, `RankPool`), parallel (helpers).
Environment: TORCHNEURON_DIST_CHECKS=0 skips the per-collective cross-rank check (one small all-gather);
TORCHNEURON_DIST_OVERLAP=0 charges collectives on the issuing stream (no modeled overlap).
"""
from __future__ import annotations

import atexit
import datetime
import warnings

import torch.distributed as dist

from torchneuron.distributed import dtensor_ops
from torchneuron.distributed.checks import CollectiveMismatchError
from torchneuron.distributed.launch import RankFailed, RankPool, free_port, local_device, select_local_device, spawn
from torchneuron.distributed.process_group import NeuronProcessGroup

_registered = False


def _create_process_group(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta):
    from torchneuron.distributed import dispatch

    dispatch.install()
    if not dist.is_initialized():  # the default group: put this rank on its device
        select_local_device()
        atexit.register(_release_at_exit)
    return NeuronProcessGroup(store, rank, size, timeout)


def _release_at_exit() -> None:
    """Destroys the neuron process groups a program left alive, while the interpreter still runs.

    Left to the interpreter's finalization, a gloo thread finishing a collective (an unwaited async
    one, say) drops the work's thread-local state, which holds Python objects; taking the GIL after
    finalization began ends that thread by a forced unwind through a noexcept destructor, and the
    process aborts ("terminate called without an active exception"). atexit runs before that, so the
    groups' threads finish and join here, as after `destroy_process_group()`."""
    if not dist.is_initialized() or dist.get_backend() != "neuron":
        return
    try:
        dist.destroy_process_group()
    except Exception as error:  # exiting anyway: say why the groups could not be released
        warnings.warn(f"torchneuron: destroying the neuron process groups at exit failed: {error}", stacklevel=1)


def register() -> None:
    """Registers the `neuron` c10d backend, default for neuron tensors (idempotent)."""
    global _registered
    if _registered or not dist.is_available():
        return
    dist.Backend.register_backend("neuron", _create_process_group, devices=["neuron", "cpu"])
    dtensor_ops.install_when_loaded()
    _registered = True


def __getattr__(name: str):
    if name in ("simple_fsdp", "sharded_parameters"):  # loads DTensor only when asked for
        from torchneuron.distributed import parallel

        return getattr(parallel, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CollectiveMismatchError", "NeuronProcessGroup", "RankFailed", "RankPool", "free_port", "local_device",
           "register", "select_local_device", "sharded_parameters", "simple_fsdp", "spawn"]
