"""The device stage of the pipeline, run by Inductor on every post-autograd graph on neuron.

`NeuronGraphPass` is registered as the `neuron` device's custom post-grad pass (codegen.py),
so it runs inside Inductor after decomposition and autograd, before lowering, and its
`uuid()` is part of the key of Inductor's on-disk graph cache. It runs, in order:

1. passes.py: dead code, constant folding, layout and dtype normalisation;
2. partition.py: device / host-fallback / cpu placement of every op;
3. graph_fusion.py: grouping of device ops into kernels, and their HBM reads and writes;
4. host_stand_ins.lower_to_host: NKI-kernel ops become the host kernels they execute as
   (nki_host_paths.inline: NKI-lib's ops, their host paths' ATen ops);
5. for adaptive eager's programs (eager_numerics.py), ops whose generated code would round
   unlike the eager kernel are called as that kernel;

and stores the resulting `GraphPlan` in `gm.meta`, where the wrapper code generation embeds
it into the generated module. With TORCHNEURON_COMPILE_DUMP_DIR set, it writes the graph
before and after the passes, the partition, the plan and its modeled cost.
"""
from __future__ import annotations

import itertools
from typing import Any

import torch
from torch._inductor.custom_graph_pass import CustomGraphModulePass
from torch.fx import GraphModule

from torchneuron.compiler import artifacts, config, eager_numerics, flex_attention, host_stand_ins, nki_host_paths
from torchneuron.compiler.cost import eager_cost, plan_costs
from torchneuron.compiler.graph_fusion import build_kernels, fuse
from torchneuron.compiler.partition import partition
from torchneuron.compiler.passes import run_passes
from torchneuron.compiler.plan import PLAN_META_KEY, GraphPlan
from torchneuron.hardware.targets import get_target
from torchneuron.ops import policy

_counter = itertools.count()


def _graph_name() -> str:
    context = torch._guards.TracingContext.try_get()
    names = getattr(context, "aot_graph_name", None) if context is not None else None
    kind = str(names[-1]) if names else "graph"
    return f"graph_{next(_counter)}_{kind}"


def _device_index(gm: GraphModule) -> int:
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.device.type == "neuron":
            return val.device.index or 0
    return 0


def symbol_sources(gm: GraphModule) -> dict[str, tuple[int, int]]:
    """Where each size symbol of the graph can be read from its inputs: (input, dim) or (input, -1)."""
    sources: dict[str, tuple[int, int]] = {}
    for index, node in enumerate(gm.graph.find_nodes(op="placeholder")):
        val = node.meta.get("val")
        if isinstance(val, torch.SymInt) and val.node.expr.is_symbol:
            sources.setdefault(str(val.node.expr), (index, -1))
        elif isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
                    sources.setdefault(str(size.node.expr), (index, dim))
    return sources


def _plan_symbols(kernels: list) -> set[str]:
    """Names of the size symbols in the shapes of the kernels' tensors (integer sizes only)."""
    import sympy

    texts = {d for k in kernels for spec in (*k.reads, *k.writes, *(t for o in k.ops for t in (*o.inputs, *o.outputs)))
             for d in spec.shape if isinstance(d, str)}
    names: set[str] = set()
    for text in texts:
        try:
            names.update(str(s) for s in sympy.sympify(text).free_symbols)
        except (sympy.SympifyError, TypeError, ValueError):
            continue
    return names


def _shape_env(gm: GraphModule) -> Any:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        for v in (val if isinstance(val, (list, tuple)) else (val,)):
            sizes = v.shape if isinstance(v, torch.Tensor) else (v,)
            for size in sizes:
                if isinstance(size, torch.SymInt):
                    return size.node.shape_env
    return None


def unbacked_sources(gm: GraphModule, kernels: list, symbols: dict[str, tuple[int, int]]
                     ) -> tuple[dict[str, tuple[int, int]], dict[str, int]]:
    """The data-dependent sizes of a plan (size symbols of its tensors no input gives, such as
    nonzero's count): where a graph output shows each (output index, dim), and the value to
    price it at otherwise: its upper bound in the shape environment when that is a finite
    integer, else its lower bound (0 when it has none). Only integer sizes of tensors are looked
    at, and a symbol without a range is no error."""
    import sympy

    names = _plan_symbols(kernels) - set(symbols)
    if not names:
        return {}, {}
    env = _shape_env(gm)
    ranges = {str(k): v for k, v in getattr(env, "var_to_range", {}).items()} if env is not None else {}
    defaults: dict[str, int] = {}
    for name in sorted(names):
        value = 0
        bounds = ranges.get(name)
        if bounds is not None:
            if isinstance(bounds.upper, sympy.Integer):
                value = int(bounds.upper)
            elif isinstance(bounds.lower, sympy.Integer):
                value = max(0, int(bounds.lower))
        defaults[name] = value
    sources: dict[str, tuple[int, int]] = {}
    output = gm.graph.output_node().args[0] if gm.graph.find_nodes(op="output") else ()
    for index, node in enumerate(output if isinstance(output, (list, tuple)) else (output,)):
        val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if isinstance(val, torch.Tensor):
            for dim, size in enumerate(val.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_symbol and str(size.node.expr) in names:
                    sources.setdefault(str(size.node.expr), (index, dim))
        elif isinstance(val, torch.SymInt) and val.node.expr.is_symbol and str(val.node.expr) in names:
            sources.setdefault(str(val.node.expr), (index, -1))
    return sources, defaults


def cost_report(plan: GraphPlan, bindings: dict[str, int] | None = None) -> dict[str, Any]:
    """The plan's modeled cost on the current target, per kernel and against eager."""
    target = get_target()
    costs = plan_costs(plan.kernels, bindings, target)
    total = sum(c.duration_s for c in costs)
    baseline = eager_cost(plan.kernels, bindings, target)
    return {
        "target": target.name, "kernels": len(costs), "ops": sum(len(k.ops) for k in plan.kernels),
        "device_time_s": total, "eager_time_s": baseline, "modeled_speedup": baseline / total if total else None,
        "per_kernel": [{"name": k.name, "kind": k.kind, "ops": [o.op for o in k.ops], "time_s": c.duration_s,
                        "engine": c.engine, "bound": c.bound, "bytes": c.bytes, "flops": c.flops}
                       for k, c in zip(plan.kernels, costs)],
    }


class NeuronGraphPass(CustomGraphModulePass):
    """Runs the FX passes, partitioning and fusion on a post-grad graph; leaves a GraphPlan."""

    def __call__(self, gm: GraphModule) -> None:
        name = _graph_name()
        dumping = config.dump_dir() is not None
        if dumping:
            artifacts.write(name, "aten_before_passes.txt", gm.print_readable(print_output=False))
        rewrites = {"flex_attention_decomposed": flex_attention.decompose(gm), **run_passes(gm)}
        placements = partition(gm)
        kernels = build_kernels(fuse(gm, placements), placements, gm.meta.get(flex_attention.NKI_OPS_KEY))
        symbols = symbol_sources(gm)
        unbacked, defaults = unbacked_sources(gm, kernels, symbols)
        plan = GraphPlan(name, _device_index(gm), kernels, symbols, unbacked, defaults)
        gm.meta[PLAN_META_KEY] = plan
        rewrites["lowered_to_host_kernels"] = host_stand_ins.lower_to_host(gm)
        rewrites["nki_host_paths_inlined"] = nki_host_paths.inline(gm)
        if eager_numerics.active():  # an adaptive eager program: rounds as the eager kernels do
            rewrites["called_as_eager_kernels"] = eager_numerics.mark_eager_calls(gm)
        if dumping:
            artifacts.write(name, "aten_after_passes.txt", gm.print_readable(print_output=False))
            artifacts.write(name, "passes.json", rewrites)
            artifacts.write(name, "partition.json", placements.to_dict())
            artifacts.write(name, "kernels.json", [k.__dict__ for k in kernels])
            hints = {**defaults, **_size_hints(gm, symbols)}
            artifacts.write(name, "cost.json", cost_report(plan, hints))

    def uuid(self) -> Any:
        """Part of Inductor's cache keys: what changes the plan besides the graph itself."""
        return (f"torchneuron-pipeline-{config.VERSION}-{config.source_hash()}-{get_target().name}-strict={policy.is_strict()}"
                f"-eager-numerics={eager_numerics.active()}")


def _size_hints(gm: GraphModule, symbols: dict[str, tuple[int, int]]) -> dict[str, int]:
    placeholders = gm.graph.find_nodes(op="placeholder")
    hints = {}
    for symbol, (index, dim) in symbols.items():
        val = placeholders[index].meta.get("val")
        value = val if dim < 0 else val.shape[dim]
        hint = value.node.hint if isinstance(value, torch.SymInt) else value
        if hint is not None:
            hints[symbol] = int(hint)
    return hints
