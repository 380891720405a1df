"""The cache of compiled graphs, keyed by graph and input signature, in memory and on disk.

- In memory: Dynamo graph (its code) + the signature of its example inputs (dtype, shape,
  strides, device, requires_grad), grad mode, autocast state, compile options, strict mode
  and the current target -> the compiled callable. A graph captured again (another `torch.compile`
  of the same program, a reset of Dynamo) skips AOTAutograd and code generation entirely.
  Graphs with dynamic shapes or module attributes (get_attr) are not kept in memory.
- Graphs taking a Python float as an argument (`has_float_arguments`) are cached at neither
  level: under Dynamo's `specialize_float=False` such a float becomes a 0-d tensor input, and
  when AOTAutograd burns its value into an op's parameter (pow's exponent, a norm's eps,
  clamp's bound) the captured graph stays the same for every value, so a cached artifact would
  compute with an earlier call's float (pytorch/pytorch#197889; Inductor-CPU has the bug).
- On disk: AOTAutograd's and Inductor's caches, keyed by the same information plus the
  pipeline's version (pipeline.NeuronGraphPass.uuid), under TORCHNEURON_COMPILE_CACHE_DIR
  (default: Inductor's cache directory). The generated modules embed their kernel plan, so
  a later process reloads a graph without tracing autograd, planning or compiling C++.

`stats()` counts hits and misses of both levels.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from typing import Any, Callable, Iterator

import torch
from torch.fx import GraphModule

from torchneuron import settings
from torchneuron.compiler import config
from torchneuron.hardware.targets import get_target
from torchneuron.ops import policy

_memory: dict[str, Callable[..., Any]] = {}
_stats = {"memory_hits": 0, "memory_misses": 0}
MAX_ENTRIES = 256


def _input_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(map(str, value.shape)), tuple(map(str, value.stride())),
                str(value.device), value.requires_grad, value.is_leaf)
    if isinstance(value, torch.SymInt):
        return ("symint", str(value.node.expr))
    return (type(value).__name__, repr(value))


def _is_dynamic(example_inputs: list[Any]) -> bool:
    for value in example_inputs:
        if isinstance(value, torch.SymInt):
            return True
        if isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in value.shape):
            return True
    return False


def has_float_arguments(gm: GraphModule) -> bool:
    """True when Dynamo passes one of the graph's Python float arguments in as a tensor (the
    graph is the same for every value of that float: see the module docstring)."""
    return any(getattr(node.meta.get("grapharg"), "pass_arg_as_tensor", False)
               for node in gm.graph.find_nodes(op="placeholder"))


def graph_key(gm: GraphModule, example_inputs: list[Any], options: dict[str, Any]) -> str | None:
    """The memory-cache key of a Dynamo graph, or None when it must not be cached in memory."""
    if _is_dynamic(example_inputs) or any(n.op == "get_attr" for n in gm.graph.nodes) or has_float_arguments(gm):
        return None
    code = "\n".join(line for line in gm.code.splitlines() if not line.strip().startswith("#"))
    parts = [config.VERSION, get_target().name, str(policy.is_strict()), code, repr(sorted(options.items())),
             repr([_input_signature(v) for v in example_inputs]), str(torch.is_grad_enabled()),
             str(torch.is_autocast_enabled("neuron") if hasattr(torch, "is_autocast_enabled") else False),
             f"rope-ce-kernels={settings.current().compile_rope_ce_kernels}"]  # (what patterns substitutes)
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def lookup(key: str | None) -> Callable[..., Any] | None:
    if key is None:
        return None
    compiled = _memory.get(key)
    _stats["memory_hits" if compiled is not None else "memory_misses"] += 1
    return compiled


def store(key: str | None, compiled: Callable[..., Any]) -> None:
    if key is None:
        return
    if len(_memory) >= MAX_ENTRIES:
        _memory.pop(next(iter(_memory)))
    _memory[key] = compiled


def clear() -> None:
    """Forgets the in-memory entries (the disk caches stay)."""
    _memory.clear()


def stats() -> dict[str, int]:
    """Hits and misses: in memory, and of the on-disk AOTAutograd and Inductor graph caches."""
    from torch._dynamo.utils import counters

    result = dict(_stats)
    result["disk_graph_hits"] = int(counters["inductor"]["fxgraph_cache_hit"])
    result["disk_graph_misses"] = int(counters["inductor"]["fxgraph_cache_miss"])
    result["disk_autograd_hits"] = int(counters["aot_autograd"]["autograd_cache_hit"])
    result["disk_autograd_misses"] = int(counters["aot_autograd"]["autograd_cache_miss"])
    return result


@contextlib.contextmanager
def on_disk() -> Iterator[None]:
    """Directs Inductor's and AOTAutograd's on-disk caches to TORCHNEURON_COMPILE_CACHE_DIR."""
    directory = config.cache_dir()
    if directory is None:
        yield
        return
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(directory)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
