"""Random number generation state of the neuron devices (torch.neuron.manual_seed, ...).

Each device's default generator drives an mt19937 engine like the CPU's, so the same seed gives
the same numbers on neuron as on the CPU.

Dynamo never traces these functions (it treats torch.cuda's the same way, as torch code): called
from a compiled region, as `torch.testing`'s freeze_rng_state does, they graph-break and run
eagerly. Tracing into them compiled `set_rng_state` inside no_dispatch() and failed.

A generator's state is host data, not a tensor computation: `set_rng_state` sets the real
generator from a real state tensor even while a FakeTensorMode is active (as when
torch.distributed.pipelining's `fork_rng` restores the state around a stage's start-up inside
the planner's fake world), where the mode would otherwise look for a fake kernel of the op.
"""
from __future__ import annotations

from typing import Any

import torch

from torchneuron.runtime.device import device_count, device_index
from torchneuron.runtime.extension import runtime_ops


def _as_int64(seed: int) -> int:
    """Seeds are 64-bit unsigned like the CPU generator's; the op schema carries them as int64."""
    seed = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    return seed - (1 << 64) if seed >= 1 << 63 else seed


@torch._disable_dynamo  # lazy: importing torchneuron must not import Dynamo
def manual_seed(seed: int, device: Any = None) -> None:
    runtime_ops().manual_seed(device_index(device), _as_int64(seed))


@torch._disable_dynamo
def manual_seed_all(seed: int) -> None:
    for index in range(device_count()):
        runtime_ops().manual_seed(index, _as_int64(seed))


@torch._disable_dynamo
def seed() -> None:
    runtime_ops().seed(device_index(None))


@torch._disable_dynamo
def seed_all() -> None:
    for index in range(device_count()):
        runtime_ops().seed(index)


@torch._disable_dynamo
def initial_seed() -> int:
    return int(runtime_ops().initial_seed(device_index(None))) & 0xFFFF_FFFF_FFFF_FFFF


@torch._disable_dynamo
def get_rng_state(device: Any = "neuron") -> torch.Tensor:
    return runtime_ops().get_rng_state(device_index(device))


def _set_state(index: int, state: torch.Tensor) -> None:
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    if is_fake(state):
        raise ValueError("set_rng_state needs a real state tensor (from get_rng_state), not a fake one")
    with unset_fake_temporarily():
        runtime_ops().set_rng_state(index, state.cpu())


@torch._disable_dynamo
def set_rng_state(new_state: torch.Tensor, device: Any = "neuron") -> None:
    _set_state(device_index(device), new_state)


@torch._disable_dynamo
def get_rng_state_all() -> list[torch.Tensor]:
    return [runtime_ops().get_rng_state(i) for i in range(device_count())]


@torch._disable_dynamo
def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    for index, state in enumerate(new_states):
        _set_state(index, state)
