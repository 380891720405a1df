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

Pipeline parallelism (pp > 1, pipeline.py): the first and the last pipeline rank are traced,
each running its stage(s) of L/pp layers under torch.distributed.pipelining's schedule (1F1B by
default) with micro-batches; the schedule's order of every rank's actions is replayed with the
traced actions' costs and topology-priced transfers, which gives the step, the bubble and the
p2p time. Depth extrapolation applies to the replayed pipeline.
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
from torchneuron.planner.pipeline import (
    PipelineResult, StageCosts, in_flight, is_multi_stage, replay as replay_pipeline, schedule_class, trimmed,
)
from torchneuron.planner.simulate import Replay, Totals, price, price_ranges
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
         batch_fn: Callable | None = None, sequence_parallel: bool = True, ranks: int | None = None,
         pp_schedule: str = "1f1b", virtual_stages: int = 1) -> TrainingPlan:
    """Plans one training step of `model` (a transformers config path or dict, or a model_fn
    building the module) on `nodes` nodes of `target`, sharded by `mesh` ({"tp", "fsdp", "pp",
    "dp"}), at `batch` sequences of `seq` tokens a step. `mode`: "eager", "adaptive" or
    "compiled". `ranks` uses only that many logical cores of the first node. With pp > 1,
    `pp_schedule` names the torch.distributed.pipelining schedule ("gpipe", "1f1b",
    "interleaved1f1b" with `virtual_stages` stages per rank). Returns the report (print it)."""
    started = time.perf_counter()
    assumptions = assumptions or Assumptions(micro_batch=micro_batch)
    node = instance(target)
    lnc = lnc if lnc is not None else DEFAULT_LNC[node.target]
    core = logical_target(node.target, lnc)
    if fp8:
        core.peak_flops(torch.float8_e4m3fn)  # raises, naming the target's dtypes, without FP8
    topology = Topology(node, core, nodes, assumptions, ranks)
    spec, per_rank, micro_batches = layout(topology.world_size, mesh or {}, batch, micro_batch)
    schedule_class(pp_schedule)  # an unknown schedule's error names the known ones
    virtual = virtual_stages if is_multi_stage(pp_schedule) else 1
    spec = ParallelSpec(spec.tp, spec.fsdp, spec.dp, spec.pp, checkpointing, sequence_parallel and spec.tp > 1,
                        pp_schedule.lower(), virtual)
    compute_dtype = parse_dtype(dtype)
    full_layers, total_params, hidden = _model_size(model, compute_dtype)
    if spec.pp > 1 and full_layers % (spec.pp * virtual):
        raise ValueError(f"{full_layers} decoder layers do not split into pp x virtual stages = {spec.pp * virtual} "
                         f"equal stages; choose degrees that divide the layer count")
    stage_layers = full_layers / spec.pp if full_layers else 0
    depths: tuple[int | None, ...] = (None,)
    trace_depths = tuple(d * virtual for d in TRACE_DEPTHS)
    if not callable(model) and full_layers > max(trace_depths) and stage_layers > max(trace_depths):
        depths = trace_depths
    stage_depth = (math.ceil(stage_layers) if spec.pp > 1 else None)
    traced = []
    for depth in depths:
        setup = StepSetup(model, spec, compute_dtype, micro_batch, seq, depth if depth is not None else stage_depth,
                          parallelize, batch_fn, micro_batches)
        if spec.pp == 1:
            with simulated_world(topology.world_size):
                trace = trace_step(setup)
            traced.append((trace, _replay(trace, mode, topology, micro_batches, fp8), _memory_items(trace), 0.0, 0.0))
        else:
            traced.append(_pipeline(setup, mode, topology, micro_batches, fp8))
    if len(traced) == 1:
        (trace, (step, micro, opt), items, bubble_s, p2p_s), factor = traced[0], 0.0
    else:
        (t1, r1, m1, b1, p1), (t2, r2, m2, b2, p2) = traced
        factor = (stage_layers - depths[0]) / (depths[1] - depths[0])
        trace = t2
        step, micro, opt = (a.scaled(b, factor) for a, b in zip(r1, r2))
        items = _lerp_dict(m1, m2, factor)
        bubble_s, p2p_s = b1 + factor * (b2 - b1), p1 + factor * (p2 - p1)
    memory = MemoryPlan(items, core.hbm_bytes, assumptions.hbm_reserved_fraction, checkpointing)
    if spec.pp > 1:
        memory.notes.append(f"pipeline: activations of the micro-batches the {spec.schedule} schedule keeps in flight "
                            f"on the stage that needs the most memory")
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


def _pipeline(setup: StepSetup, mode: str, topology: Topology, micro_batches: int,
              fp8: bool) -> tuple[StepTrace, tuple[Totals, Totals, Totals], dict[str, float], float, float]:
    """A pipeline-parallel step: the first and the last pipeline rank traced running their
    stages under the schedule, every rank's actions replayed (pipeline.py). Returns (a trace,
    (step, one steady micro-batch, the optimizer) totals, memory items, bubble s, p2p s)."""
    spec, target = setup.spec, topology.target
    stride = topology.world_size // spec.pp
    actions: dict = {}
    tail: dict[int, list] = {}
    optimizer: dict[int, list] = {}
    sends: dict[str, int] = {}
    memories: list[dict[str, float]] = []
    traces = []
    for pp_rank in sorted({0, spec.pp - 1}):
        with simulated_world(topology.world_size, pp_rank * stride):
            trace = trace_step(setup)
        run = trace.pipeline
        ranges = [(seg.start, seg.end) for seg in run.segments] + [(run.tail_start, len(trace.micro.events))]
        priced = price_ranges(trace.micro.events, ranges, mode, target, topology, fp8)
        for seg, items in zip(run.segments, priced):
            actions[(seg.kind, seg.stage, seg.micro_batch)] = trimmed(items)
        tail[pp_rank] = trimmed(priced[-1])
        optimizer[pp_rank] = price(trace.optimizer.events, mode, target, topology, fp8)
        for kind, nbytes in run.sends.items():
            sends.setdefault(kind, nbytes)
        order = trace.order(micro_batches)
        items = _memory_items(trace)
        items["activations"] *= in_flight(order, pp_rank) / run.in_flight
        memories.append(items)
        traces.append(trace)
    run = traces[0].pipeline
    sends.setdefault("B", sends.get("F", 0))   # a stage's input gradient has its input's shape
    costs = StageCosts(actions, tail, sends, run.micro_batches)

    def send_cost(kind: str, source: int, dest: int):
        ranks = (run.stage_to_rank[source] * stride, run.stage_to_rank[dest] * stride)
        return topology.collective("send", sends.get(kind, 0), ranks)[0]

    result: PipelineResult = replay_pipeline(order, costs, micro_batches, run.num_stages, run.stage_to_rank,
                                             send_cost, optimizer)
    critical = result.critical_rank if result.critical_rank in tail else 0
    micro = Replay()
    steady = 1 if run.micro_batches > 2 else 0
    for stage in sorted({s for _, s, _ in actions if run.stage_to_rank[s] == critical}):
        micro.run(actions.get(("F", stage, steady), []) + actions.get(("B", stage, steady), []))
    opt = Replay()
    opt.run(optimizer[critical])
    memory = max(memories, key=lambda m: sum(m.values()))
    return traces[-1], (result.totals, micro.finish(), opt.finish()), memory, result.bubble_s, result.p2p_s
