"""The machines a plan runs on: Trainium instances, logical NeuronCores, and the assumptions.

This module owns `Instance` (one node: its chips, their torus, the node's EFA network),
`logical_target` (a hardware Target seen as one *logical* NeuronCore of LNC=1 or LNC=2) and
`Assumptions` (every figure the planner needs that shared/hardware.md does not publish, each
with its reason). The per-chip figures (NeuronLink bandwidth, HBM, cores) come from the
hardware Target (hardware/targets.py, which cites shared/hardware.md).

Logical NeuronCores (AWS Neuron "Logical NeuronCore configuration", NEURON_LOGICAL_NC_CONFIG):
on Trainium2 and Trainium3 one logical core is 2 physical NeuronCores by default (LNC=2, 4
logical cores a chip), or one (LNC=1, 8 a chip); Trainium1 has LNC=1 only. A rank is one
logical core. The LNC=2 core is modeled as one core with twice every engine's throughput and
twice the HBM share, DMA queues and links share: its two physical cores split each op evenly
(assumption: ideal split; fixed per-instruction costs stay those of one core, in seconds).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

from torchneuron.hardware import TARGETS, Target

GBIT = 1e9 / 8


@dataclass(frozen=True)
class Instance:
    """One node type: `chips` Trainium chips in a `torus` (rows, cols) over NeuronLink, and the
    node's EFA bandwidth to other nodes."""

    name: str
    target: str                 # hardware target of its chips
    chips: int
    torus: tuple[int, int]
    efa_bytes_per_s: float
    source: str                 # where the figures come from

    @property
    def torus_links(self) -> int:
        """Links per chip in the torus (4 in a 2-D torus of sides > 2)."""
        return sum(2 if side > 2 else (1 if side == 2 else 0) for side in self.torus)


INSTANCES: dict[str, Instance] = {
    # shared/hardware.md: trn2.48xlarge = 16 Trainium2 chips in a 4x4 torus. EFA: the AWS Trn2
    # instance page states 3.2 Tbps of EFAv3 per trn2.48xlarge (not in hardware.md).
    "trn2": Instance("trn2.48xlarge", "trn2", 16, (4, 4), 3200 * GBIT,
                     "hardware.md (16 chips, 4x4 torus); AWS EC2 Trn2 page (EFAv3 3.2 Tbps)"),
    # AWS Trn1 architecture page: trn1.32xlarge = 16 Trainium chips on NeuronLink-v2 in a 2-D
    # torus; the EC2 Trn1 page: 800 Gbps EFA (trn1n.32xlarge: 1600 Gbps).
    "trn1": Instance("trn1.32xlarge", "trn1", 16, (4, 4), 800 * GBIT,
                     "AWS Trn1 architecture page (16 chips, 2-D torus); AWS EC2 Trn1 page (EFA 800 Gbps)"),
    # No Trainium3 instance is described in hardware.md: assumed to be a trn2.48xlarge-shaped
    # node (16 chips, 4x4 torus of NeuronLink-v4) with the same 3.2 Tbps of EFA.
    "trn3": Instance("trn3 node (assumed trn2.48xlarge-shaped)", "trn3", 16, (4, 4), 3200 * GBIT,
                     "assumption: 16 Trainium3 chips, 4x4 torus, EFA 3.2 Tbps as trn2.48xlarge"),
}

DEFAULT_LNC = {"trn1": 1, "trn2": 2, "trn3": 2}


def instance(name: str) -> Instance:
    """The node type of target `name` ("trn1", "trn2", "trn3")."""
    found = INSTANCES.get(name.strip().lower())
    if found is None:
        raise ValueError(f"unknown target {name!r}; the planner knows {', '.join(INSTANCES)}")
    return found


@lru_cache(maxsize=16)
def logical_target(name: str, lnc: int) -> Target:
    """The hardware Target of one logical NeuronCore of `name` at LNC=`lnc` (1 or 2)."""
    base = TARGETS.get(name)
    if base is None:
        raise ValueError(f"unknown target {name!r}; supported targets: {', '.join(TARGETS)}")
    if lnc == 1:
        return base
    if lnc != 2 or name == "trn1":
        allowed = "1" if name == "trn1" else "1 or 2"
        raise ValueError(f"LNC={lnc} is not a logical NeuronCore configuration of {name}; use LNC={allowed}")
    # Twice the clocks with twice the fixed cycles: the pair's throughput doubles while a fixed
    # cost stays the same number of seconds. Peak rates double with the Tensor-engine clock.
    flops = {f: 2 * getattr(base, f) for f in ("fp32_flops", "bf16_flops", "fp16_flops", "tf32_flops",
                                                 "fp8_e4m3_flops", "fp8_e5m2_flops", "vector_flops", "scalar_flops")}
    clocks = {f: 2 * getattr(base, f) for f in ("tensor_clock_ghz", "vector_clock_ghz", "scalar_clock_ghz",
                                                  "gpsimd_clock_ghz")}
    return dataclasses.replace(
        base, name=f"{name}.lnc2", core_type=f"2 x {base.core_type} (LNC=2)", cores_per_chip=base.cores_per_chip // 2,
        hbm_bytes=2 * base.hbm_bytes, hbm_bytes_per_s=2 * base.hbm_bytes_per_s, dma_engines=2 * base.dma_engines,
        instruction_fixed_cycles=2 * base.instruction_fixed_cycles, matmul_issue_cycles=2 * base.matmul_issue_cycles,
        **flops, **clocks)


@dataclass(frozen=True)
class Assumptions:
    """Figures the planner uses that AWS does not publish (or that hardware.md lacks), with the
    reason for each value. Every plan report lists them."""

    # EFA: the node's bandwidth is the instance's published figure; a collective across nodes
    # reaches a fraction of it (SRD/libfabric headers, the proxy thread's pipelining).
    efa_efficiency: float = 0.85
    efa_step_latency_s: float = 15e-6       # one hop of a ring across nodes: EFA SRD round trip
    # NeuronLink: the chip figure (hardware.md) is taken as the sum of its torus links, one
    # direction; a collective reaches this fraction of a link (framing, semaphores).
    neuronlink_efficiency: float = 0.9
    # Micro-batch size per rank when the plan does not give one.
    micro_batch: int = 1
    # Memory headroom the runtime keeps (allocator fragmentation, scratch, the Neuron runtime's
    # own buffers), as a fraction of the core's HBM share.
    hbm_reserved_fraction: float = 0.1

    def lines(self, node: Instance, target: Target) -> list[str]:
        """Human-readable statements of every assumption, for the report."""
        link = target.neuronlink_chip_bytes_per_s
        return [
            f"node {node.name}: {node.chips} chips, {node.torus[0]}x{node.torus[1]} torus ({node.source})",
            f"NeuronLink {link / 1e9:.0f} GB/s per chip (hardware.md), assumed the sum of {node.torus_links} "
            f"torus links of {link / node.torus_links / 1e9:.0f} GB/s; collectives reach "
            f"{self.neuronlink_efficiency:.0%} of a link",
            f"EFA {node.efa_bytes_per_s * 8 / 1e9:.0f} Gbps per node; collectives across nodes reach "
            f"{self.efa_efficiency:.0%} of it, {self.efa_step_latency_s * 1e6:.0f} us a ring step",
            f"intra-chip collectives: the device model's ring through HBM ({target.link_step_latency_s * 1e6:.1f} us "
            f"a step); inter-chip steps: the same link step latency",
            f"{self.hbm_reserved_fraction:.0%} of each core's HBM reserved for the runtime and fragmentation",
            "collectives of the other groups of a mesh dimension run at the same time (SPMD) and share "
            "each chip's links and each node's EFA evenly",
        ]
