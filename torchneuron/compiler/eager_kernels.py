"""The kernel compiler of adaptive eager mode: a run of queued ops -> one fused program.

`compile_replay(replay, example_inputs, n_inputs)` traces the run's replay function
(torchneuron.eager.queue_fusion; its first `n_inputs` tensors are the run's inputs, the rest the output
buffers it writes) to an ATen graph in the compiler's core op set without mutations (mutations of
inputs and output buffers become copies at its end; views stay views: traced as view copies, a
program's `as_strided` views of values it mutated computed wrong results) and compiles it with
Inductor's per-graph compiler, so the device pipeline (passes, partition, fusion, kernel plan) and
code generation are the ones `torch.compile` uses, and the fused program charges its kernels to
the device timeline.
Unlike a `torch.compile` graph, a program rounds as the eager kernels do: it keeps whole, and calls
as the eager kernel, every op whose generated code would round differently (eager_numerics.py).
The result is called as `runner(list_of_tensors)`.

Floats that change from call to call (an optimizer's bias corrections, a scheduled learning rate)
are the program's arguments, not constants: `float_hints` gives their current values, the replay
takes them after the tensors, and the runner after the tensors too. They are traced as unbacked
symbolic floats (no value to trace with), so a program depending on a float's value (a branch on
it) fails to trace and is refused: it would be right only for the value it was traced with.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def compile_replay(replay: Callable[..., None], example_inputs: list[torch.Tensor],
                   n_inputs: int, float_hints: tuple[float, ...] = ()) -> Callable[[list], Any]:
    from torch._inductor import config as inductor_config
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import _disable_current_modes

    from torchneuron.compiler.registration import register_inductor
    from torchneuron.compiler.backend import INDUCTOR_PATCHES
    from torchneuron.compiler.decompositions import program_decompositions
    from torchneuron.compiler.eager_numerics import rounding_as_eager
    from torchneuron.runtime.worklog import worklog_paused

    register_inductor()
    # Tracing and compiling must not meet a dispatch mode (the flush compiling this has the queue off).
    # The run was queued below autograd: whatever the grad mode at the flush, its replay records
    # no autograd (an optimizer's in-place update of a leaf is legal there).
    # Fused pointwise chains round every intermediate to its dtype, as the ops did one by one:
    # adaptive eager promises plain eager's numerics (torch.compile keeps Inductor's upcasting).
    patches = {**INDUCTOR_PATCHES, "emulate_precision_casts": True}
    table = program_decompositions()  # keeps whole the ops a program calls as the eager kernel
    with _disable_current_modes(), worklog_paused(), inductor_config.patch(patches), torch.no_grad(), \
            rounding_as_eager():
        def program(*tensors: torch.Tensor) -> tuple:
            replay(*tensors)
            return ()  # Inductor compiles graphs returning a tuple; the results are the writes

        traced = functionalize(program, remove="mutations")
        if not float_hints:
            gm = make_fx(traced, decomposition_table=table, tracing_mode="fake")(*example_inputs)
            write_inputs_last(gm, n_inputs)
            # Compile against the trace's fake tensors: the compiled program must not keep the run's
            # buffers alive (adaptive eager reads liveness from reference counts).
            return _compile_program(gm)
        return _compile_with_float_arguments(traced, example_inputs, n_inputs, float_hints, table)


def _compile_program(gm: torch.fx.GraphModule) -> Callable[[list], Any]:
    """Inductor's compilation of a traced program, told the table it was traced with (Inductor
    refuses to call an op as the eager kernel when it knows a decomposition of it)."""
    from torchneuron.compiler.backend import compile_graph
    from torchneuron.compiler.decompositions import program_decompositions

    example_inputs = [node.meta["val"] for node in gm.graph.find_nodes(op="placeholder")]
    return compile_graph(gm, example_inputs, get_decomp_fn=program_decompositions)


def _compile_with_float_arguments(traced: Callable[..., tuple], example_inputs: list[torch.Tensor], n_inputs: int,
                                  float_hints: tuple[float, ...], table: dict) -> Callable[[list], Any]:
    """compile_replay's path for a program taking floats: traced with a symbolic float each."""
    from torch._guards import TracingContext, tracing
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    shape_env = ShapeEnv()
    fake_mode = FakeTensorMode(shape_env=shape_env, static_shapes=True)
    # Unbacked: no value to guess with, so anything depending on the value fails to trace (and
    # Inductor's C++ kernels take unbacked floats as arguments).
    floats = [shape_env.create_unbacked_symfloat() for _ in float_hints]
    shape_env.pending_fresh_unbacked_symbols.clear()  # inputs: bound by their placeholders, not by an op
    fakes = [fake_mode.from_tensor(t, static_shapes=True) for t in example_inputs]
    with fake_mode:
        gm = make_fx(traced, decomposition_table=table)(*fakes, *floats)
    write_inputs_last(gm, n_inputs)
    with tracing(TracingContext(fake_mode)):
        runner = _compile_program(gm)
    deferred = [a for asserts in shape_env.deferred_runtime_asserts.values() for a in asserts]
    assumptions = [str(g.expr) for g in shape_env.guards] + [str(a.expr) for a in deferred]
    if assumptions or shape_env.replacements:
        raise NotImplementedError(f"the fused program assumes values of its float arguments "
                                  f"({assumptions or shape_env.replacements})")
    return runner


aten = torch.ops.aten
# Ops Inductor may turn into their source (its no-op removal) or that only re-view it: a value
# reached through them may be the input's memory itself.
_PASS_THROUGH = frozenset({aten.clone.default, aten.alias.default, aten._to_copy.default, aten.view.default,
                           aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
                           aten.permute.default, aten.t.default, aten.transpose.int, aten.squeeze.dim,
                           aten.unsqueeze.default, aten.slice.Tensor, aten.select.int, aten.as_strided.default})


def _sources(node: torch.fx.Node) -> set[torch.fx.Node]:
    """The placeholders whose memory `node`'s value may be, once no-op copies are removed."""
    while node.op == "call_function" and (node.target in _PASS_THROUGH or node.target is aten.copy.default):
        node = node.args[1] if node.target is aten.copy.default else node.args[0]
    return {node} if node.op == "placeholder" else set()


def write_inputs_last(gm: torch.fx.GraphModule, n_inputs: int) -> None:
    """Orders the graph's write-backs: the mutated inputs' after everything else.

    Inductor removes a clone of a graph input as a no-op unless the clone is a graph output, but
    here values leave through copies into buffers: `o = x.clone(); x.relu_()` becomes
    `copy_(x, relu(x)); copy_(o, x)` and `o` would read the mutated `x`. Buffers are fresh memory,
    so writing them before any input is always safe. A mutated input whose new value may be another
    mutated input's memory (a swap through clones) has no safe order: that raises, and the run is
    not fused."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    buffers = set(placeholders[n_inputs:])
    writes = [n for n in gm.graph.nodes
              if n.op == "call_function" and n.target is aten.copy_.default and n.args[0] in placeholders]
    input_writes = [n for n in writes if n.args[0] not in buffers]
    if not input_writes:
        return
    # Functionalization reads no input after writing it back, so the write-back can move to the
    # end (its value is computed before it); checked, as a wrong order would be silent.
    moving, already_written = set(input_writes), set()
    for node in gm.graph.nodes:
        if node in moving:
            already_written.add(node.args[0])
        elif already_written.intersection(node.all_input_nodes):
            raise NotImplementedError("a traced run reads an input after writing it back")
    output = next(iter(reversed(gm.graph.nodes)))
    for node in input_writes:
        output.prepend(node)
    written: set[torch.fx.Node] = set()
    for node in input_writes:
        if _sources(node.args[1]) & written:
            raise NotImplementedError("a fused run writing an input with another written input's old value "
                                      "(a swap through clones) has no safe write-back order")
        written.add(node.args[0])
    gm.recompile()
