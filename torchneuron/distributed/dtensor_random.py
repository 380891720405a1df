"""DTensor's random ops on neuron meshes: sharded parameters initialised with `normal_`, `uniform_`, ...

DTensor coordinates the random ops of sharded tensors with an RNG tracker that assumes CUDA's
counter-based Philox generator: it reads the device's RNG state as 16 bytes (seed, offset) and moves
the offset to each shard's position in the full tensor's stream. A neuron generator is the CPU's
mt19937 engine (the same seed gives the same numbers as on the CPU), whose state is 5056 bytes with
no offset, so every random op on a DTensor of a neuron mesh failed in that tracker (an
AssertionError in `_PhiloxState.offset`), e.g. torchtitan's `init_weights` under FSDP2 or TP.

The tracker installed here keeps DTensor's contract with the engine the device has: ranks holding
the same shard draw the same numbers, different shards draw different ones, and afterwards every
rank's generator is in the same state. Each random op draws one 64-bit key from the generator (the
same on all ranks, whose generators agree), seeds the op's draws with (key, the shard's offset in
the full tensor) and leaves the generator advanced by that one draw. What Philox also gives, a
sharded tensor equal to the same op on one device, an mt19937 engine cannot give (its normal
samples come in blocks, not one per position), as on the CPU, where DTensor tracks nothing at all.
Meshes of other devices keep DTensor's tracker unchanged.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

_installed = False
_KEY_RANGE = 1 << 62
_SEED_MASK = (1 << 64) - 1


def _shard_seed(key: int, shard_offset: int) -> int:
    return (key * 0x9E3779B97F4A7C15 + shard_offset) & _SEED_MASK


def _tracker_class() -> type:
    from torch.distributed.tensor import _random

    class NeuronRNGTracker(_random.OffsetBasedRNGTracker):
        """DTensor's RNG tracker with neuron meshes drawing shard streams from the mt19937 engine."""

        @contextlib.contextmanager
        def _distribute_region(self, spec: Any, generator: torch.Generator | None = None) -> Iterator[None]:
            if self._device.type != "neuron":
                with super()._distribute_region(spec, generator):
                    yield
                return
            if not self.distribute_region_enabled:
                yield
                return
            get_state = generator.get_state if generator is not None else self._device_handle.get_rng_state
            set_state = generator.set_state if generator is not None else self._device_handle.set_rng_state
            stream = torch.Generator()
            stream.set_state(get_state().cpu())
            key = int(torch.randint(_KEY_RANGE, (), generator=stream))
            shard_offset, _ = self._compute_rng_offsets(spec)
            set_state(torch.Generator().manual_seed(_shard_seed(key, int(shard_offset))).get_state())
            try:
                yield
            finally:
                set_state(stream.get_state())

    return NeuronRNGTracker


def install() -> None:
    """Makes DTensor's default RNG tracker (`_random.OffsetBasedRNGTracker`, what DTensor constructs
    on the first random op of a mesh and in `manual_seed`) the neuron-aware subclass (idempotent)."""
    global _installed
    if _installed:
        return
    from torch.distributed.tensor import _random

    _random.OffsetBasedRNGTracker = _tracker_class()
    _installed = True
