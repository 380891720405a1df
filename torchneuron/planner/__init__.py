"""torchneuron.planner: plan a Trainium cluster run (training or serving) from one host, in seconds.

The layer above distributed/ and compiler/ (and below cli): the real model code and PyTorch's
real parallelism (FSDP2, tensor and sequence parallelism, activation checkpointing, ZeRO-1 data
parallelism, pipeline stages under a torch.distributed.pipelining schedule) run for one rank on fake tensors in a simulated world; the device work they issue
is priced by the hardware performance model, in the execution mode asked for, and replayed
with communication overlapping compute on a device timeline.

    from torchneuron.planner import plan
    print(plan("llama-8b.json", {"tp": 8, "fsdp": 16}, target="trn2", nodes=4, batch=512, seq=8192))

Modules: cluster (instances, logical cores, assumptions), topology (rank placement,
collective pricing), world (the simulated process group), build (fake full-size models,
parallelisation, ZeRO-1), trace (recording one rank's work), step (the traced training step),
pipeline (torch.distributed.pipelining stages and schedules, the replay of every pipeline rank),
simulate (pricing per mode, replay), memory (the memory plan), training (`plan`), inference
(`plan_inference`), report (the report objects), cli (`torchneuron plan`).
"""
from __future__ import annotations

from torchneuron.planner.cluster import INSTANCES, Assumptions, Instance, logical_target
from torchneuron.planner.inference import plan_inference
from torchneuron.planner.memory import MemoryPlan
from torchneuron.planner.report import InferencePlan, TrainingPlan
from torchneuron.planner.topology import Topology
from torchneuron.planner.training import plan

__all__ = ["INSTANCES", "Assumptions", "InferencePlan", "Instance", "MemoryPlan", "Topology", "TrainingPlan",
           "logical_target", "plan", "plan_inference"]
