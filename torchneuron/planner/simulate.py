"""Pricing a recorded trace in one execution mode, and replaying it on a device timeline.

Pricing reuses the performance model as each mode's runtime uses it:

- eager: every op is one kernel, `hardware.op_cost` plus `hardware.launch_cost` (what the
  runtime's work log charges; ops without a NeuronCore implementation are host fallbacks
  priced as host round trips, views are free);
- adaptive: maximal runs of ops adaptive eager may fuse (`eager.op_kinds.FUSIBLE_CATEGORIES`, at
  least `eager.queue_fusion.MIN_OPS` of them) are compiled, the rest run eagerly; collectives and
  other synchronising ops end a run;
- compiled: graphs as torch.compile captures them. A collective issued from Python code Dynamo
  does not trace (FSDP2's hooks, which `torch._dynamo.config.skip_fsdp_hooks` leaves eager;
  ZeRO-1's c10d calls) ends a graph. A functional collective (`_c10d_functional`, what DTensor
  and so tensor and sequence parallelism issue) is traced into the graph, as Dynamo does: the
  ops around it stay one graph and fuse across it, the collective is issued where its input is
  ready and only the kernels reading its result wait for it (Inductor's wait at first use).

A run or graph is compiled by the compiler itself: the recorded ops become an FX graph whose
nodes carry meta values, which `compiler.partition`, `compiler.graph_fusion.fuse` and
`build_kernels` turn into kernels, priced by `compiler.cost.kernel_cost`. A tensor a later
op reads (or an input an op mutates) is a graph output, so it is written to HBM.

Each kernel waits for the collectives whose results its own ops read.

Replay: compute kernels run in order on stream 0 of a private `hardware.DeviceTimeline`;
each process group has its own communication stream. A collective starts when the compute
stream has issued it (its inputs are ready) and its stream is free; a kernel reading a
collective's result waits for its end (what `Work.wait`/`wait_tensor` do), so communication
overlaps compute exactly as far as the data dependencies allow.
"""
from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from torchneuron.compiler.cost import kernel_cost
from torchneuron.compiler.graph_fusion import build_kernels, fuse
from torchneuron.compiler.partition import partition
from torchneuron.compiler.plan import KernelSpec, OpSpec, TensorSpec
from torchneuron.eager.queue_fusion import MIN_OPS
from torchneuron.eager.op_kinds import FUSIBLE_CATEGORIES
from torchneuron.hardware import Cost, DeviceTimeline, Target, copy_cost, launch_cost, op_cost
from torchneuron.hardware.taxonomy import op_category
from torchneuron.ops import policy

from torchneuron.planner.topology import Topology
from torchneuron.planner.trace import CollectiveEvent, OpEvent, Ref

MODES = ("eager", "adaptive", "compiled")


@dataclass
class Item:
    """One unit of priced work: a kernel (stream "compute") or a collective (its group's stream)."""

    name: str
    cost: Cost
    stream: str
    reads: tuple[int, ...] = ()
    writes: tuple[int, ...] = ()
    algorithm: str = ""


@dataclass
class Totals:
    """What a replay adds up: time on the critical path, busy time per kind of work."""

    step_s: float = 0.0
    compute_s: float = 0.0
    comm_s: float = 0.0
    flops: float = 0.0
    kernels: int = 0
    by_name: dict[str, list[float]] = field(default_factory=dict)   # name -> [count, seconds, flops]
    by_bound: dict[str, float] = field(default_factory=dict)
    by_engine: dict[str, float] = field(default_factory=dict)
    comm_by_group: dict[str, float] = field(default_factory=dict)

    @property
    def exposed_comm_s(self) -> float:
        """Critical-path time the compute stream spent waiting for communication."""
        return max(0.0, self.step_s - self.compute_s)

    def scaled(self, other: "Totals", factor: float) -> "Totals":
        """self + factor * (other - self), field by field: the linear extrapolation in depth."""
        def lerp(a: float, b: float) -> float:
            return a + factor * (b - a)

        def lerp_dict(a: dict, b: dict) -> dict:
            out = {}
            for k in set(a) | set(b):
                va, vb = a.get(k), b.get(k)
                if isinstance(va, list) or isinstance(vb, list):
                    va, vb = va or [0.0] * 3, vb or [0.0] * 3
                    out[k] = [lerp(x, y) for x, y in zip(va, vb)]
                else:
                    out[k] = lerp(va or 0.0, vb or 0.0)
            return out

        return Totals(lerp(self.step_s, other.step_s), lerp(self.compute_s, other.compute_s),
                      lerp(self.comm_s, other.comm_s), lerp(self.flops, other.flops),
                      round(lerp(self.kernels, other.kernels)), lerp_dict(self.by_name, other.by_name),
                      lerp_dict(self.by_bound, other.by_bound), lerp_dict(self.by_engine, other.by_engine),
                      lerp_dict(self.comm_by_group, other.comm_by_group))


# ---------------------------------------------------------------------------------------------
# tensor identities: Python ids are reused once a tensor dies, so each production of an id
# starts a new generation
# ---------------------------------------------------------------------------------------------

class _Names:
    def __init__(self) -> None:
        self.generation: dict[int, int] = {}

    def read(self, key: int) -> tuple[int, int]:
        return key, self.generation.get(key, 0)

    def produce(self, key: int, inputs: Iterable[int]) -> tuple[int, int]:
        if key not in inputs:  # an in-place op returns its input: the same tensor
            self.generation[key] = self.generation.get(key, 0) + 1
        return key, self.generation.get(key, 0)


def _resolve(events: list) -> list[tuple[tuple, tuple]]:
    """(input names, output names) of every event (a collective's outputs: a functional one's)."""
    names = _Names()
    resolved = []
    for event in events:
        ins = tuple(names.read(k) for k in event.in_keys)
        outs = tuple(names.produce(k, event.in_keys) for k in event.out_keys)
        resolved.append((ins, outs))
    return resolved


def _last_reads(resolved: list) -> dict[tuple, int]:
    last: dict[tuple, int] = {}
    for index, entry in enumerate(resolved):
        if entry is not None:
            for name in entry[0]:
                last[name] = index
    return last


# ---------------------------------------------------------------------------------------------
# pricing
# ---------------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn


def _fp8_inputs(name: str, inputs: tuple) -> tuple:
    """With FP8 training, matmuls read FP8 operands (and run at the target's FP8 rate)."""
    if op_category(name) != "matmul":
        return inputs
    return tuple((FP8, shape) if dtype.is_floating_point else (dtype, shape) for dtype, shape in inputs)


def _eager_item(event: OpEvent, target: Target, fp8: bool = False) -> Item:
    if event.view:
        return Item(event.name, Cost(0.0, "dma", 0.0, 0.0, "latency"), "compute", event.reads)
    if event.name == "aten::copy_" and event.inputs:  # a device copy: a DMA, as the work log charges it
        dtype, shape = event.inputs[0]
        return Item(event.name, copy_cost(math.prod(shape) * dtype.itemsize, "d2d", target), "compute", event.reads)
    fallback = not policy.runs_natively(event.name)
    inputs = _fp8_inputs(event.name, event.inputs) if fp8 else event.inputs
    cost = op_cost(event.name, inputs, event.outputs, target, fallback=fallback)
    if not cost.fallback:
        cost = Cost(cost.duration_s + launch_cost(target), cost.engine, cost.flops, cost.bytes, cost.bound)
    return Item(event.name, cost, "compute", event.reads)


def _fusible(event: OpEvent) -> bool:
    return event.view or op_category(event.name) in FUSIBLE_CATEGORIES


def _graph(indices: list[int], events: list, resolved: list, last_read: dict) -> tuple[fx.GraphModule, dict]:
    """The FX graph of the op events at `indices` (in order), with meta values, whose outputs are
    the tensors read after it or mutated by it; and each node's event index."""
    graph = fx.Graph()
    env: dict[tuple, fx.Node] = {}
    outputs: list[fx.Node] = []
    event_of: dict[str, int] = {}
    end = indices[-1] + 1
    for index in indices:
        event = events[index]
        ins, outs = resolved[index]
        by_key = dict(zip(event.in_keys, ins))
        sigs = dict(zip(event.in_keys, event.inputs))

        def arg(value: Any) -> Any:
            if not isinstance(value, Ref):
                return value
            name = by_key[value.key]
            node = env.get(name)
            if node is None:
                dtype, shape = sigs[value.key]
                node = env[name] = graph.placeholder(f"in_{len(env)}")
                node.meta["val"] = torch.empty(shape, dtype=dtype, device="meta")
            return node

        node = graph.call_function(event.func, pytree.tree_map(arg, event.args), pytree.tree_map(arg, event.kwargs))
        node.meta["val"] = event.out_meta
        event_of[node.name] = index
        results = [node] if not isinstance(event.out_meta, (tuple, list)) else []
        if not results:
            for i, value in enumerate(event.out_meta):
                if isinstance(value, torch.Tensor):
                    item = graph.call_function(operator.getitem, (node, i))
                    item.meta["val"] = value
                    results.append(item)
        for name, result in zip(outs, results):
            env[name] = result
            mutated = name in ins
            if (mutated or last_read.get(name, -1) >= end) and not event.view:
                outputs.append(result)
    graph.output(tuple(outputs))
    return fx.GraphModule(torch.nn.Module(), graph), event_of


def _fp8_kernel(kernel: KernelSpec) -> KernelSpec:
    ops = []
    for op in kernel.ops:
        if op_category(op.op) == "matmul":
            inputs = tuple(TensorSpec("float8_e4m3fn", t.shape) if t.torch_dtype().is_floating_point else t
                           for t in op.inputs)
            op = OpSpec(op.op, inputs, op.outputs)
        ops.append(op)
    return dataclasses.replace(kernel, ops=ops)


def _compiled_items(indices: list[int], events: list, resolved: list, last_read: dict, target: Target, fp8: bool,
                    collectives: list[tuple[int, Item]] = ()) -> list[Item]:
    """The kernels the compiler makes of the op events at `indices`, each reading the storages
    its own ops read; `collectives` (event index, item) traced into the same graph are issued
    before the first kernel made only of later ops (and a kernel reading one's result waits)."""
    gm, event_of = _graph(indices, events, resolved, last_read)
    placed = partition(gm, target)
    kernels = build_kernels(fuse(gm, placed, target), placed)
    pending = sorted(collectives, key=lambda c: c[0])
    items = []
    for kernel in kernels:
        own = [event_of[n] for n in kernel.nodes if n in event_of]
        while pending and own and pending[0][0] < min(own):
            items.append(pending.pop(0)[1])
        if fp8:
            kernel = _fp8_kernel(kernel)
        cost = kernel_cost(kernel, {}, target)
        reads = tuple(k for i in own for k in events[i].reads)
        items.append(Item(kernel.name.rsplit("_", 1)[0], cost, "compute", reads))
    items.extend(c[1] for c in pending)
    return items


def price(events: list, mode: str, target: Target, topology: Topology, fp8: bool = False,
          traced_collectives: bool = True) -> list[Item]:
    """The trace as priced work in `mode` ("eager", "adaptive", "compiled"); `fp8`: matmuls
    take FP8 operands; `traced_collectives=False` ends a compiled graph at every collective
    (what the planner did before; kept for comparison)."""
    return price_ranges(events, [(0, len(events))], mode, target, topology, fp8, traced_collectives)[0]


def price_ranges(events: list, ranges: list[tuple[int, int]], mode: str, target: Target, topology: Topology,
                 fp8: bool = False, traced_collectives: bool = True) -> list[list[Item]]:
    """`price` of each events[start:end] of `ranges` (the actions of a pipeline schedule's run): a
    compiled graph never spans two ranges, and what a range produces for a later one (the
    activations a forward saves for its backward) is that graph's output, written to HBM."""
    if mode not in MODES:
        raise ValueError(f"unknown execution mode {mode!r}; expected one of {', '.join(MODES)}")
    resolved = _resolve(events)
    last_read = _last_reads(resolved) if mode != "eager" else {}
    return [_price_range(events, resolved, last_read, lo, hi, mode, target, topology, fp8, traced_collectives)
            for lo, hi in ranges]


def _price_range(events: list, resolved: list, last_read: dict, lo: int, hi: int, mode: str, target: Target,
                 topology: Topology, fp8: bool, traced_collectives: bool) -> list[Item]:
    items: list[Item] = []
    run: list[int] = []                       # indices of the open run's op events
    inside: list[tuple[int, Item]] = []       # functional collectives traced into the open graph

    def close_run() -> None:
        nonlocal run, inside
        if not run:
            return
        computing = [i for i in run if not events[i].view]
        if mode == "adaptive" and len(computing) < MIN_OPS:
            items.extend(_eager_item(events[i], target, fp8) for i in run)
        else:
            items.extend(_compiled_items(run, events, resolved, last_read, target, fp8, inside))
        run, inside = [], []

    for index in range(lo, hi):
        event = events[index]
        if isinstance(event, CollectiveEvent):
            cost, algorithm = topology.collective(event.kind, event.nbytes, event.ranks)
            item = Item(f"c10d::{event.kind}", cost, f"comm:{event.group}", event.reads, event.writes, algorithm)
            if mode == "compiled" and traced_collectives and event.functional and run:
                inside.append((index, item))
                continue
            close_run()
            items.append(item)
            continue
        if mode == "eager":
            items.append(_eager_item(event, target, fp8))
            continue
        if mode == "adaptive" and not _fusible(event):
            close_run()
            items.append(_eager_item(event, target, fp8))
            continue
        run.append(index)
    close_run()
    return items


# ---------------------------------------------------------------------------------------------
# replay
# ---------------------------------------------------------------------------------------------

class Replay:
    """Priced items on a private device timeline (no listener sees them)."""

    def __init__(self) -> None:
        self.timeline = DeviceTimeline(0)
        self.streams: dict[str, int] = {"compute": 0}
        self.ready: dict[int, float] = {}
        self.totals = Totals()

    def run(self, items: list[Item], repeat: int = 1) -> None:
        for _ in range(repeat):
            for item in items:
                self._one(item)

    def run_one(self, item: Item) -> float:
        """Runs one item; returns the time it ends."""
        return self._one(item)

    def _one(self, item: Item) -> float:
        timeline, totals, cost = self.timeline, self.totals, item.cost
        stream = self.streams.setdefault(item.stream, len(self.streams))
        ready = max((self.ready.get(k, 0.0) for k in item.reads), default=0.0)
        if stream != 0:  # issued once the compute stream got there
            ready = max(ready, timeline.now(0))
        if ready:
            timeline.wait_until(stream, ready)
        end = timeline.advance(stream, cost.duration_s, {cost.engine: cost.duration_s}, 1)
        row = totals.by_name.setdefault(item.name, [0, 0.0, 0.0])
        row[0] += 1
        row[1] += cost.duration_s
        row[2] += cost.flops
        if stream == 0:
            totals.compute_s += cost.duration_s
            totals.flops += cost.flops
            totals.kernels += 1 if cost.duration_s > 0 else 0
            totals.by_bound[cost.bound] = totals.by_bound.get(cost.bound, 0.0) + cost.duration_s
            totals.by_engine[cost.engine] = totals.by_engine.get(cost.engine, 0.0) + cost.duration_s
        else:
            totals.comm_s += cost.duration_s
            totals.comm_by_group[item.stream] = totals.comm_by_group.get(item.stream, 0.0) + cost.duration_s
            for key in item.writes:
                self.ready[key] = end
        return end

    def finish(self) -> Totals:
        self.totals.step_s = self.timeline.synchronize()
        return self.totals
