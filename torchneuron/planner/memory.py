"""The memory plan of one NeuronCore: what it holds at the step's peak, against its HBM share.

`MemoryPlan` is plain arithmetic over byte counts (so it can be checked by hand): the items
(parameters, gradients, optimizer state, activations, communication buffers), their total,
the usable capacity (the core's HBM share less the runtime's reserve), whether it fits, and,
when it does not, the largest item and what would make the plan fit:

- parameters, gradients and optimizer state shrink with more sharding: the factor F by which
  sharding must grow is what the shardable part must shrink by for the rest to fit;
- activations shrink with activation checkpointing (when off), with a smaller micro-batch or
  sequence, or with more tensor (sequence) parallelism;
- communication buffers shrink with smaller FSDP units.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

GIB = 1024 ** 3
SHARDABLE = ("parameters", "gradients", "optimizer state")


@dataclass
class MemoryPlan:
    """Bytes per NeuronCore at the step's peak (see the module docstring)."""

    items: dict[str, float]
    hbm_bytes: float                  # the core's HBM share
    reserved_fraction: float = 0.1
    checkpointing: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        return sum(self.items.values())

    @property
    def capacity(self) -> float:
        """Bytes the plan may use: the HBM share less the reserve."""
        return self.hbm_bytes * (1.0 - self.reserved_fraction)

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    @property
    def largest(self) -> tuple[str, float]:
        name = max(self.items, key=self.items.__getitem__)
        return name, self.items[name]

    def sharding_factor(self) -> float | None:
        """How many times more the parameters, gradients and optimizer state must be sharded
        for the plan to fit (None when the rest alone does not fit)."""
        shardable = sum(self.items.get(k, 0.0) for k in SHARDABLE)
        rest = self.total - shardable
        if rest >= self.capacity or shardable <= 0:
            return None
        return shardable / (self.capacity - rest)

    def advice(self) -> str:
        """What would make the plan fit, starting with its largest item."""
        name, _ = self.largest
        excess = self.total - self.capacity
        factor = self.sharding_factor()
        shard = (f"shard parameters, gradients and optimizer state {math.ceil(factor)}x more (raise --fsdp, or "
                 f"--tp / --pp)" if factor is not None else None)
        if name in SHARDABLE:
            return shard or "the activations alone exceed the core's memory: raise --tp or --pp"
        if name == "activations":
            steps = [] if self.checkpointing else ["turn on activation checkpointing (--checkpoint)"]
            steps.append(f"or cut activations by {excess / GIB:.1f} GiB: a smaller micro-batch or sequence, "
                         f"or more tensor parallelism (sequence parallelism splits them)")
            return " ".join(steps)
        return (f"communication buffers need {excess / GIB:.1f} GiB less: wrap smaller FSDP units"
                + (f", or {shard}" if shard else ""))

    def verdict(self) -> str:
        if self.fits:
            return (f"fits: {self.total / GIB:.2f} GiB of {self.capacity / GIB:.2f} GiB usable "
                    f"({100 * self.total / self.capacity:.0f}%)")
        name, size = self.largest
        return (f"does not fit: needs {self.total / GIB:.2f} GiB of {self.capacity / GIB:.2f} GiB usable; the largest "
                f"item is {name} ({size / GIB:.2f} GiB); to fit, {self.advice()}")

    def lines(self) -> list[str]:
        out = [f"  {name:<22} {size / GIB:>9.3f} GiB" for name, size in self.items.items()]
        out.append(f"  {'total':<22} {self.total / GIB:>9.3f} GiB of {self.hbm_bytes / GIB:.2f} GiB HBM per core "
                   f"({self.reserved_fraction:.0%} reserved)")
        out.append(f"  {self.verdict()}")
        out.extend(f"  note: {n}" for n in self.notes)
        return out
