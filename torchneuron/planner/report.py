"""The plan reports: what a planned training step or inference configuration would achieve.

`TrainingPlan` (from `plan()`) holds the step's figures and prints step time, tokens/s, MFU,
memory per NeuronCore, exposed communication, the bottlenecks and every assumption behind
them. `InferencePlan` (from `plan_inference()`) prints TTFT, TPOT and the KV-cache capacity.

MFU follows the usual convention: model FLOPs (`model_flops`) over the cluster's dense BF16
peak (FP8 with --fp8); HFU counts what the device actually executes, recomputation included,
from the traced work.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from torchneuron.hardware import Target

from torchneuron.planner.build import ParallelSpec
from torchneuron.planner.cluster import Assumptions, Instance
from torchneuron.planner.memory import MemoryPlan
from torchneuron.planner.simulate import Totals
from torchneuron.planner.topology import Topology


def seconds(value: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3f} {unit}"
    return f"{value * 1e9:.1f} ns"


def model_flops(params: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    """Training FLOPs of `tokens` tokens: 6 per parameter per token (forward 2, backward 4) plus
    causal self-attention's score and value matmuls, 6 * layers * seq * hidden per token (half
    of the 12 L s h of full attention)."""
    return 6.0 * params * tokens + 6.0 * layers * seq * hidden * tokens


@dataclass
class TrainingPlan:
    model: str
    target: Instance
    core: Target
    lnc: int
    nodes: int
    spec: ParallelSpec
    mode: str
    fp8: bool
    dtype: str
    global_batch: int
    seq: int
    micro_batch: int
    micro_batches: int
    totals: Totals
    micro: Totals
    optimizer: Totals
    memory: MemoryPlan
    total_params: int
    layers: int
    bubble_s: float
    p2p_s: float
    assumptions: Assumptions
    topology: Topology
    depths: tuple = ()
    planning_s: float = 0.0
    hidden: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- headline figures -------------------------------------------------------------------------
    @property
    def step_s(self) -> float:
        return self.totals.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.global_batch * self.seq / self.step_s if self.step_s > 0 else 0.0

    @property
    def peak_flops(self) -> float:
        """Dense peak of the whole cluster in the matmul dtype."""
        dtype = torch.float8_e4m3fn if self.fp8 else torch.bfloat16
        return self.core.peak_flops(dtype) * self.topology.world_size

    @property
    def hfu(self) -> float:
        """Device FLOPs (recomputation included) over the peak, per core."""
        per_core = self.peak_flops / self.topology.world_size
        return self.totals.flops / self.step_s / per_core if self.step_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs of the step over the cluster's peak (falls back to HFU without a config)."""
        if not self.total_params or not self.hidden:
            return self.hfu
        flops = model_flops(self.total_params, self.layers, self.hidden, self.seq, self.global_batch * self.seq)
        return flops / self.step_s / self.peak_flops if self.step_s > 0 else 0.0

    @property
    def exposed_comm_s(self) -> float:
        """Critical-path time the compute stream waited for communication (a pipeline's bubble,
        waiting for other stages' work, is not communication)."""
        return max(0.0, self.totals.exposed_comm_s - self.bubble_s)

    def bottlenecks(self, count: int = 5) -> list[str]:
        """The largest contributions to the step, in words."""
        step = self.step_s or 1.0
        out = []
        compute = sorted(((v[1], k, v[0]) for k, v in self.totals.by_name.items() if not k.startswith("c10d::")),
                         reverse=True)[:count]
        for time_s, name, n in compute:
            out.append(f"{name}: {seconds(time_s)} in {n:.0f} kernels ({100 * time_s / step:.1f}% of the step)")
        bound = self.totals.by_bound
        busy = sum(bound.values()) or 1.0
        out.append("compute stream: " + ", ".join(f"{k}-bound {100 * v / busy:.0f}%" for k, v in
                                                  sorted(bound.items(), key=lambda kv: -kv[1])))
        for group, time_s in sorted(self.totals.comm_by_group.items(), key=lambda kv: -kv[1]):
            out.append(f"collectives on {group.removeprefix('comm:')}: {seconds(time_s)} busy")
        if self.spec.pp > 1:
            out.append(f"pipeline bubble: {seconds(self.bubble_s)} ({100 * self.bubble_s / step:.1f}% of the step)")
        return out

    def __str__(self) -> str:
        s, t = self.spec, self.target
        lines = [
            f"plan: {self.model} on {self.nodes} x {t.name} ({self.topology.world_size} ranks = logical "
            f"NeuronCores, LNC={self.lnc}: {self.core.core_type})",
            f"  parallelism: tp={s.tp}{' (+sequence parallel)' if s.sequence_parallel else ''} fsdp={s.fsdp} "
            f"dp={s.dp}{' (ZeRO-1)' if s.fsdp == 1 and s.dp > 1 else ''} pp={s.pp}"
            f"{f' ({s.schedule}, torch.distributed.pipelining)' if s.pp > 1 else ''}; activation checkpointing {'on' if s.checkpointing else 'off'}",
            f"  batch: {self.global_batch} x {self.seq} tokens a step; {self.micro_batches} micro-batches of "
            f"{self.micro_batch} per rank; {self.dtype}{' with FP8 matmul peak' if self.fp8 else ''}; "
            f"mode {self.mode}",
            f"  step time {seconds(self.step_s)}  |  {self.tokens_per_s:,.0f} tokens/s  |  MFU {100 * self.mfu:.1f}% "
            f"(HFU {100 * self.hfu:.1f}%)",
            f"  compute {seconds(self.totals.compute_s)}, communication {seconds(self.totals.comm_s)} busy, "
            f"exposed communication {seconds(self.exposed_comm_s)} "
            f"({100 * self.exposed_comm_s / (self.step_s or 1):.1f}% of the step); {self.totals.kernels:,} kernels",
            "memory per NeuronCore:",
            *self.memory.lines(),
            "bottlenecks:",
            *(f"  {b}" for b in self.bottlenecks()),
            "assumptions:",
            *(f"  {a}" for a in self.assumptions.lines(t, self.core)),
            "  the performance model is first-principles (hardware/model.py), not fitted to any benchmark",
        ]
        if self.depths:
            lines.append(f"  decoder layers are identical: traced at depths {self.depths[0]} and {self.depths[1]}, "
                         f"every figure extrapolated linearly to {self.layers // s.pp} layers per stage")
        if s.pp > 1:
            lines.append(f"  pipeline: the first and the last stage traced under the {s.schedule} schedule; middle stages cost what the "
                         f"first does; transfers {seconds(self.p2p_s)} busy on the critical rank")
        lines.append(f"  (planned in {self.planning_s:.1f} s on this host)")
        return "\n".join(lines)


@dataclass
class InferencePlan:
    model: str
    target: Instance
    core: Target
    lnc: int
    tp: int
    batch: int
    context: int
    mode: str
    ttft_s: float
    tpot_s: float
    weight_bytes: float
    kv_bytes_per_token: float
    kv_capacity_tokens: int
    hbm_bytes: float
    assumptions: Assumptions
    planning_s: float = 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        return self.batch / self.tpot_s if self.tpot_s > 0 else 0.0

    def __str__(self) -> str:
        gib = 1024 ** 3
        lines = [
            f"inference plan: {self.model} on {self.tp} logical NeuronCores of {self.target.name} (LNC={self.lnc}), "
            f"tp={self.tp}, mode {self.mode}",
            f"  batch {self.batch}, context {self.context} tokens",
            f"  TTFT {seconds(self.ttft_s)} (prefill of {self.batch} x {self.context} tokens)",
            f"  TPOT {seconds(self.tpot_s)} (one decode step at context {self.context}); "
            f"{self.decode_tokens_per_s:,.0f} tokens/s across the batch",
            f"  weights {self.weight_bytes / gib:.2f} GiB per core; KV cache {self.kv_bytes_per_token / 1024:.1f} KiB "
            f"per token per core; capacity {self.kv_capacity_tokens:,} tokens "
            f"({self.hbm_bytes / gib:.1f} GiB HBM per core, {self.assumptions.hbm_reserved_fraction:.0%} reserved)",
            "assumptions:",
            *(f"  {a}" for a in self.assumptions.lines(self.target, self.core)),
            f"  (planned in {self.planning_s:.1f} s on this host)",
        ]
        return "\n".join(lines)
