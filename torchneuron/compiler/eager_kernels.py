"""The kernel compiler of adaptive eager mode: a run of queued ops -> one fused program.

`compile_replay(replay, example_inputs)` traces the run's replay function (torchneuron.eager
.fusion) to a functional ATen graph in the compiler's core op set (mutations of inputs and
output buffers become copies at its end) and compiles it with Inductor's per-graph compiler,
so the device pipeline (passes, partition, fusion, kernel plan) and code generation are the
ones `torch.compile` uses, and the fused program charges its kernels to the device timeline.
The result is called as `runner(list_of_tensors)`.
"""
from __future__ import annotations

from typing import Any, Callable

import torch


def compile_replay(replay: Callable[..., None], example_inputs: list[torch.Tensor]) -> Callable[[list], Any]:
    from torch._inductor import config as inductor_config
    from torch.func import functionalize
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils._python_dispatch import _disable_current_modes

    from torchneuron.compiler import register_inductor
    from torchneuron.compiler.backend import INDUCTOR_PATCHES, compile_graph
    from torchneuron.compiler.decompositions import core_decompositions
    from torchneuron.eager.recording import worklog_paused

    register_inductor()
    # Tracing and compiling must not meet the adaptive eager queue (or any other dispatch mode).
    with _disable_current_modes(), worklog_paused(), inductor_config.patch(INDUCTOR_PATCHES):
        def program(*tensors: torch.Tensor) -> tuple:
            replay(*tensors)
            return ()  # Inductor compiles graphs returning a tuple; the results are the writes

        gm = make_fx(functionalize(program, remove="mutations_and_views"), decomposition_table=core_decompositions(),
                     tracing_mode="fake")(*example_inputs)
        # Compile against the trace's fake tensors: the compiled program must not keep the run's
        # buffers alive (adaptive eager reads liveness from reference counts).
        fakes = [node.meta["val"] for node in gm.graph.find_nodes(op="placeholder")]
        return compile_graph(gm, fakes)
