"""The Dynamo backend `neuron`: the entry of the compiler pipeline.

`neuron_backend(gm, example_inputs)` receives each graph Dynamo captures and returns the
compiled callable. Stages, each its own module:

1. patterns.py: NKI kernel substitution on the captured graph (before autograd);
2. decompositions.py: the core op set AOTAutograd lowers the graph to, for inference or for
   forward and backward (Inductor's `compile_fx` drives AOTAutograd and its partitioner);
3. pipeline.py (run by Inductor on each post-autograd graph): passes.py, partition.py,
   graph_fusion.py, leaving the graph's kernel plan;
4. codegen.py: Inductor's C++ code generation for the device, with the plan embedded;
   program.py charges the plan to the device timeline when the graph runs; tiered.py runs the
   graph with ATen kernels while its C++ builds in the background;
5. cache.py: compiled graphs in memory and on disk; artifacts.py: the dump directory.

Only `mode="default"` exists: other modes warn once and compile as the default. `options`
are Inductor config patches. Dynamic shapes (`dynamic=True`, or automatic after a shape
change) are compiled symbolically. A failure raises `NeuronCompileError` naming the op and
the reason, or with TORCHNEURON_COMPILE_FALLBACK=eager warns and runs the graph eagerly.
"""
from __future__ import annotations

import copy
import re
import warnings
from typing import Any, Callable

import torch
from torch._dynamo.exc import RestartAnalysis, SkipFrame
from torch.fx import GraphModule

from torchneuron.compiler import artifacts, cache, config, patterns, tiered
from torchneuron.compiler.errors import NeuronCompileError
from torchneuron.runtime.worklog import worklog_paused

SUPPORTED_MODES = (None, "default")
INDUCTOR_PATCHES: dict[str, Any] = {
    "loop_reindexing_after_fusion": False,  # the pass only exempts the literal device "cpu"
    "fallback_random": True,                # random ops draw from the device generator, as eager
    # Inductor names the code generator of every device but cpu/mps/xpu/tpu after this option;
    # the neuron device uses the C++ one, and its kernels check for that name.
    "cuda_backend": "cpp",
    "freezing": False,
    "cpp_wrapper": False,
    # Dynamo's guards already check the sizes and strides of every graph input, so the generated
    # code does not re-check them (and host kernels' results against their meta) on every call.
    "size_asserts": False,
    "alignment_asserts": False,
    # The device's convolutions return contiguous results (what fake tensors predict for a
    # backend's own convolution): converting their inputs to channels_last would only add copies.
    "layout_optimization": False,
}
_warned_modes: set[str] = set()
_graph_ids = iter(range(1 << 62))


def _check_mode(mode: str | None) -> None:
    if mode in SUPPORTED_MODES or mode in _warned_modes:
        return
    _warned_modes.add(mode)
    warnings.warn(f"torch.compile(mode={mode!r}) is not supported by the neuron backend; compiling with "
                  "mode='default' instead.", UserWarning, stacklevel=3)


# Exceptions raised through a backend on purpose for Dynamo to handle (its `_call_user_compiler`
# re-raises them): a restart of the frame's analysis (e.g. AOTAutograd's tensorify pass asking to
# specialize a Python float) and a request to skip the frame. Wrapping them in NeuronCompileError,
# or falling back to eager on them, would turn Dynamo's control flow into a compile failure.
# (Inductor's own errors are ShortenTraceback too: those are failures, and are named as ours.)
_DYNAMO_CONTROL_FLOW: tuple[type[BaseException], ...] = (RestartAnalysis, SkipFrame)

_OP_IN_MESSAGE = re.compile(r"(?:target|op|operator)[:= ]+((?:aten|prims|torchneuron)[.:]+[\w.]+)")


def as_compile_error(error: BaseException, graph: str | None = None) -> NeuronCompileError:
    """The NeuronCompileError behind or for `error`, naming the failing op when it is known."""
    seen = error
    while seen is not None:
        if isinstance(seen, NeuronCompileError):
            return seen
        seen = seen.__cause__ or getattr(seen, "inner_exception", None)
    op = getattr(error, "target", None)
    match = _OP_IN_MESSAGE.search(str(error)) if op is None else None
    name = str(op) if op is not None else (match.group(1) if match else None)
    reason = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
    return NeuronCompileError(reason, op=name, graph=graph)


def _chained(failure: NeuronCompileError, error: BaseException) -> NeuronCompileError:
    """`failure`, caused by `error` unless it already has a cause (or is `error` itself)."""
    if failure is not error and failure.__cause__ is None:
        failure.__cause__ = error
    return failure


def compile_graph(gm: GraphModule, example_inputs: list[Any], **kwargs: Any) -> Any:
    """Inductor's per-graph compilation of a post-autograd graph (it runs pipeline.NeuronGraphPass),
    with failures named and the generated code written to the dump directory."""
    from torch._inductor.compile_fx import compile_fx_inner

    from torchneuron.compiler.plan import PLAN_META_KEY

    from torch._dynamo.utils import counters

    tier = tiered.AtenTier.of(gm) if tiered.enabled() else None
    hits = counters["inductor"]["fxgraph_cache_hit"]
    try:
        with tiered.offering(tier) as offer:
            compiled = compile_fx_inner(gm, example_inputs, **kwargs)
    except (NeuronCompileError, *_DYNAMO_CONTROL_FLOW):
        raise
    except Exception as error:
        raise _chained(as_compile_error(error), error) from None
    if offer.build is not None and offer.build.tier is not None and (
            counters["inductor"]["fxgraph_cache_hit"] > hits  # from the disk: only loading, no build
            or not offer.build.tier.set_output_strides(getattr(compiled, "output_strides", None))):
        offer.build.tier = None  # (or symbolic output strides) the first call waits for the build
    plan = gm.meta.get(PLAN_META_KEY)
    source = getattr(compiled, "source_code", None)
    if source and config.dump_dir():
        name = plan.name if plan is not None else f"cached_{getattr(compiled, '_fx_graph_cache_key', 'graph')}"
        artifacts.write(name, "generated_code.py", source)
    return compiled


def _compile(gm: GraphModule, example_inputs: list[Any], options: dict[str, Any]) -> Callable[..., Any]:
    from torch._functorch import config as functorch_config
    from torch._inductor.compile_fx import compile_fx

    from torchneuron.compiler.decompositions import for_compile_fx

    name = f"dynamo_graph_{next(_graph_ids)}"
    substituted = patterns.substitute(gm)
    patches = {**INDUCTOR_PATCHES, **options}
    aot_patches = {"force_non_lazy_backward_lowering": True}
    if config.dump_dir():
        artifacts.write(name, "dynamo_graph.txt", gm.print_readable(print_output=False))
        artifacts.write(name, "substitutions.json", substituted)
    # A graph served from the disk caches is never planned: while dumping, plan every graph anew
    # so that its directory holds all of its artifacts. A graph with float arguments may hit an
    # artifact compiled for another value of the float (cache.has_float_arguments).
    if config.dump_dir() or cache.has_float_arguments(gm):
        patches["fx_graph_cache"] = False
        aot_patches["enable_autograd_cache"] = False
    # Compilation runs ops on example inputs now and then; they are not the program's device work.
    with functorch_config.patch(**aot_patches), cache.on_disk(), worklog_paused():
        return compile_fx(gm, example_inputs, inner_compile=compile_graph, config_patches=patches,
                          decompositions=for_compile_fx())


def neuron_backend(gm: GraphModule, example_inputs: list[Any], *, mode: str | None = None,
                   options: dict[str, Any] | None = None) -> Callable[..., Any]:
    """Compiles one captured graph for the neuron device (the `torch.compile` backend)."""
    from torchneuron.compiler.registration import register_inductor

    register_inductor()
    _check_mode(mode)
    options = dict(options or {})
    key = None if config.dump_dir() else cache.graph_key(gm, example_inputs, options)  # (see _compile)
    compiled = cache.lookup(key)
    if compiled is not None:
        return compiled
    original = copy.deepcopy(gm) if config.fallback_to_eager() else None
    try:
        compiled = _compile(gm, example_inputs, options)
    except _DYNAMO_CONTROL_FLOW:
        raise
    except Exception as error:
        failure = _chained(as_compile_error(error), error)
        if original is None:
            raise failure from None
        warnings.warn(f"{failure} Running this graph eagerly (TORCHNEURON_COMPILE_FALLBACK=eager).",
                      UserWarning, stacklevel=2)
        return original.forward
    cache.store(key, compiled)
    return compiled
