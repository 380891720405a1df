"""`plan()`: a training run on a Trainium cluster, planned from one host.

Steps: lay the ranks out (nodes x chips x logical cores, cluster.py / topology.py); derive the
data-parallel degree and micro-batches from the global batch; in a simulated world (world.py)
run and trace one rank's step (step.py) on the real model code; price the trace in the chosen
mode and replay it with overlapping communication (simulate.py); add the pipeline schedule;
assemble the memory plan (memory.py) and the report (report.py).

Depth: a transformers decoder of L identical layers is traced at two small depths d1 < d2 and
every figure (times, FLOPs, bytes, memory) is extrapolated linearly to L (a layer adds the
same work and, in the steady state of FSDP's prefetching, the same critical-path time); the
report states it. A `model_fn` is traced whole.

Pipeline parallelism (pp > 1): the traced rank is a stage of L/pp layers (with the embedding
and the output layer: the slowest stage), running a 1F1B schedule: (m + pp - 1) micro-batch
slots of one forward and backward plus the activation and gradient transfers between stages,
then the optimizer; the bubble is (pp - 1) slots.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch

from torchneuron.planner.build import ModelSource, ParallelSpec, build_model, decoder_layers
from torchneuron.planner.cluster import DEFAULT_LNC, Assumptions, instance, logical_target
from torchneuron.planner.memory import MemoryPlan
from torchneuron.planner.report import TrainingPlan
from torchneuron.planner.simulate import Replay, Totals, price
from torchneuron.planner.step import StepSetup, StepTrace, trace_step
from torchneuron.planner.topology import Topology
from torchneuron.planner.world import simulated_world

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}
TRACE_DEPTHS = (2, 3)


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    found = DTYPES.get(dtype.lower())
    if found is None:
        raise ValueError(f"unknown dtype {dtype!r}; use one of bf16, fp16, fp32 (--fp8 for FP8 matmuls)")
    return found


def layout(ranks: int, mesh: dict[str, int], global_batch: int, micro_batch: int) -> tuple[ParallelSpec, int, int]:
    """(ParallelSpec, per-rank sequences a step, micro-batches) from the mesh degrees; dp is
    whatever of the world tp, pp and fsdp leave (replicas of the FSDP shards)."""
    tp, pp, fsdp = (int(mesh.get(k, 1)) for k in ("tp", "pp", "fsdp"))
    unknown = set(mesh) - {"tp", "pp", "fsdp", "dp"}
    if unknown:
        raise ValueError(f"unknown mesh dimension(s) {sorted(unknown)}; use tp, pp, fsdp, dp")
    if min(tp, pp, fsdp) < 1:
        raise ValueError(f"parallel degrees must be >= 1, got {mesh}")
    model_parallel = tp * pp * fsdp
    if ranks % model_parallel:
        raise ValueError(f"tp x pp x fsdp = {model_parallel} does not divide the {ranks} ranks (logical cores) of "
                         f"the cluster; choose degrees whose product divides it")
    dp = ranks // model_parallel
    if "dp" in mesh and int(mesh["dp"]) != dp:
        raise ValueError(f"dp={mesh['dp']} but {ranks} ranks / (tp x pp x fsdp = {model_parallel}) = {dp}")
    replicas = dp * fsdp
    if global_batch % replicas:
        raise ValueError(f"the global batch ({global_batch} sequences) does not divide among the {replicas} data-"
                         f"parallel ranks (dp x fsdp); use a multiple of {replicas}")
    per_rank = global_batch // replicas
    if per_rank % micro_batch:
        raise ValueError(f"{per_rank} sequences per rank a step do not divide into micro-batches of {micro_batch}")
    return ParallelSpec(tp=tp, fsdp=fsdp, dp=dp, pp=pp), per_rank, per_rank // micro_batch


def _replay(trace: StepTrace, mode: str, topology: Topology, micro_batches: int,
            fp8: bool = False) -> tuple[Totals, Totals, Totals]:
    """(whole step, one micro-batch, the optimizer) replayed."""
    target = topology.target
    micro = price(trace.micro.events, mode, target, topology, fp8)
    opt = price(trace.optimizer.events, mode, target, topology, fp8)
    results = []
    for repeats, with_opt in ((micro_batches, True), (1, False), (0, True)):
        replay = Replay()
        replay.run(micro, repeats)
        if with_opt:
            replay.run(opt)
        results.append(replay.finish())
    return tuple(results)


def _memory_items(trace: StepTrace) -> dict[str, float]:
    peak = trace.micro.memory
    traced_comm = peak.peak_by_phase.get("comm", 0)
    activations = peak.peak_total - traced_comm
    # FSDP keeps a layer's unsharded parameters (and the next one's, prefetched) in storages it
    # resizes rather than allocates: twice the largest all-gather
    gathers = [e.nbytes for e in trace.micro.events if getattr(e, "kind", "") == "all_gather"]
    comm = traced_comm + 2 * max(gathers, default=0)
    return {"parameters": float(trace.param_bytes), "gradients": float(trace.grad_bytes),
            "optimizer state": float(trace.optimizer_bytes), "activations": float(activations),
            "communication buffers": float(comm)}


def _lerp_dict(a: dict[str, float], b: dict[str, float], factor: float) -> dict[str, float]:
    return {k: a[k] + factor * (b[k] - a[k]) for k in a}


def plan(model: ModelSource, mesh: dict[str, int] | None = None, *, target: str = "trn2", nodes: int = 1,
         batch: int = 512, seq: int = 8192, dtype: str | torch.dtype = "bf16", mode: str = "eager",
         fp8: bool = False, checkpointing: bool = False, lnc: int | None = None, micro_batch: int = 1,
         assumptions: Assumptions | None = None, parallelize: Callable | None = None,
         batch_fn: Callable | None = None, sequence_parallel: bool = True, ranks: int | None = None) -> TrainingPlan:
    """Plans one training step of `model` (a transformers config path or dict, or a model_fn
    building the module) on `nodes` nodes of `target`, sharded by `mesh` ({"tp", "fsdp", "pp",
    "dp"}), at `batch` sequences of `seq` tokens a step. `mode`: "eager", "adaptive" or
    "compiled". `ranks` uses only that many logical cores of the first node. Returns the report
    (print it)."""
    started = time.perf_counter()
    assumptions = assumptions or Assumptions(micro_batch=micro_batch)
    node = instance(target)
    lnc = lnc if lnc is not None else DEFAULT_LNC[node.target]
    core = logical_target(node.target, lnc)
    if fp8:
        core.peak_flops(torch.float8_e4m3fn)  # raises, naming the target's dtypes, without FP8
    topology = Topology(node, core, nodes, assumptions, ranks)
    spec, per_rank, micro_batches = layout(topology.world_size, mesh or {}, batch, micro_batch)
    spec = ParallelSpec(spec.tp, spec.fsdp, spec.dp, spec.pp, checkpointing, sequence_parallel and spec.tp > 1)
    compute_dtype = parse_dtype(dtype)
    full_layers, total_params, hidden = _model_size(model, compute_dtype)
    stage_layers = full_layers / spec.pp if full_layers else 0
    depths: tuple[int | None, ...] = (None,)
    if not callable(model) and full_layers > max(TRACE_DEPTHS) and (full_layers / spec.pp) > max(TRACE_DEPTHS):
        depths = TRACE_DEPTHS
    traced = []
    with simulated_world(topology.world_size):
        for depth in depths:
            setup = StepSetup(model, spec, compute_dtype, micro_batch, seq,
                              depth if depth is not None else (math.ceil(stage_layers) if spec.pp > 1 else None),
                              parallelize, batch_fn)
            trace = trace_step(setup)
            traced.append((trace, _replay(trace, mode, topology, micro_batches, fp8), _memory_items(trace)))
    if len(traced) == 1:
        (trace, (step, micro, opt), items), factor = traced[0], 0.0
    else:
        (t1, r1, m1), (t2, r2, m2) = traced
        factor = (stage_layers - depths[0]) / (depths[1] - depths[0])
        trace = t2
        step, micro, opt = (a.scaled(b, factor) for a, b in zip(r1, r2))
        items = _lerp_dict(m1, m2, factor)
    bubble_s = 0.0
    p2p_s = 0.0
    if spec.pp > 1:
        step, bubble_s, p2p_s = _pipeline(step, micro, opt, spec, micro_batches, micro_batch * seq * hidden,
                                          topology, compute_dtype)
    memory = MemoryPlan(items, core.hbm_bytes, assumptions.hbm_reserved_fraction, checkpointing)
    if spec.pp > 1:
        memory.items["activations"] *= min(spec.pp, micro_batches)  # 1F1B: up to pp micro-batches in flight
        memory.notes.append(f"1F1B keeps up to {min(spec.pp, micro_batches)} micro-batches' activations on stage 0")
    if len(depths) > 1:
        memory.notes.append(f"traced at depths {depths[0]} and {depths[1]}, extrapolated to {stage_layers:g} layers")
    return TrainingPlan(
        model=str(model) if not callable(model) else getattr(model, "__name__", "model_fn"), target=node, core=core,
        lnc=lnc, nodes=nodes, spec=spec, mode=mode, fp8=fp8, dtype=str(compute_dtype).removeprefix("torch."),
        global_batch=batch, seq=seq, micro_batch=micro_batch, micro_batches=micro_batches, totals=step,
        micro=micro, optimizer=opt, memory=memory, total_params=total_params, layers=full_layers,
        bubble_s=bubble_s, p2p_s=p2p_s, assumptions=assumptions, topology=topology,
        depths=depths if len(depths) > 1 else (), planning_s=time.perf_counter() - started, hidden=hidden)


def _model_size(model: ModelSource, dtype: torch.dtype) -> tuple[int, int, int]:
    """(decoder layers, parameters, hidden size) of the full model, built on the meta device."""
    if callable(model):
        return 0, 0, 0
    from torch._subclasses.fake_tensor import FakeTensorMode

    with torch.device("meta"):
        built = build_model(model, dtype, FakeTensorMode(allow_non_fake_inputs=True))
    layers = decoder_layers(built)
    hidden = getattr(getattr(built, "config", None), "hidden_size", 0)
    return (len(layers) if layers is not None else 0), sum(p.numel() for p in built.parameters()), hidden


def _pipeline(step: Totals, micro: Totals, opt: Totals, spec: ParallelSpec, micro_batches: int,
              activation_numel: int, topology: Topology, dtype: torch.dtype) -> tuple[Totals, float, float]:
    """The 1F1B schedule of the traced stage: (step totals, bubble seconds, p2p seconds);
    `activation_numel`: elements of the hidden states one micro-batch hands to the next stage."""
    activation = activation_numel * dtype.itemsize // (spec.tp if spec.sequence_parallel else 1)
    stride = topology.world_size // spec.pp
    send, _ = topology.collective("send", activation, (0, stride))
    p2p = 2 * send.duration_s                        # the activation forward, its gradient back
    slot = micro.step_s + p2p
    slots = micro_batches + spec.pp - 1
    total = Totals(**{**vars(step)})
    total.step_s = slots * slot + opt.step_s
    total.comm_s = step.comm_s + micro_batches * p2p
    return total, (spec.pp - 1) * slot, micro_batches * p2p
