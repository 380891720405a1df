"""The per-site choice between an NKI kernel and the generic compiled ops, by modeled price.

A substitution that is not a win at every size (RoPE, cross-entropy, SwiGLU, RMSNorm +
projections: patterns_rope_ce.py, patterns_norm_mlp.py) asks `kernel_chosen` at each site it
matched. Under TORCHNEURON_COMPILE_ROPE_CE_KERNELS=price (the default) both alternatives are
priced the way torch.compile would build them: traced by AOTAutograd over fake neuron tensors of
the site's operands (with Inductor's partitioner, so the backward is priced too when an operand
needs a gradient), then this compiler's passes, partition, fusion and plan cost (cost.py) on the
target modeled. The kernel is substituted when its plan is cheaper. `1` substitutes wherever the
kernel takes the operands, `0` never.

Each site is priced alone: a generic site's ops cannot fuse with the graph around it here, nor
can the kernel's (it never does). Prices are cached per (site kind, operand signatures,
constants, target).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any, Callable, Sequence

import torch
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx import GraphModule

from torchneuron import settings
from torchneuron.compiler.cost import plan_costs
from torchneuron.compiler.graph_fusion import build_kernels, fuse
from torchneuron.compiler.partition import partition
from torchneuron.compiler.passes import run_passes
from torchneuron.hardware.targets import get_target

# an operand's signature: (shape, dtype, requires_grad)
Signature = tuple[tuple[int, ...], torch.dtype, bool]


def mode() -> str:
    """'price' (substitute where the kernel is cheaper), 'on' (wherever it applies) or 'off'."""
    return settings.current().compile_rope_ce_kernels


def _plan_seconds(gm: GraphModule) -> float:
    """Modeled device time of one AOTAutograd graph as this compiler would plan it."""
    run_passes(gm)
    placements = partition(gm)
    kernels = build_kernels(fuse(gm, placements), placements, None)
    return sum(cost.duration_s for cost in plan_costs(kernels, {}, get_target()))


def traced_seconds(fn: Callable[..., Any], signatures: Sequence[Signature], constants: tuple = ()) -> float:
    """Modeled device time of `fn(*tensors, *constants)` compiled alone, forward plus (when an
    operand requires a gradient) backward, for neuron tensors of the given signatures: the joint
    graph traced to ATen as AOTAutograd traces it, split by Inductor's partitioner."""
    def forward(*tensors: torch.Tensor) -> list[torch.Tensor]:
        out = fn(*tensors, *constants)
        return [o for o in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(o, torch.Tensor)]

    with FakeTensorMode(), torch.enable_grad():
        primals = [torch.empty(shape, dtype=dtype, device="neuron", requires_grad=grad)
                   for shape, dtype, grad in signatures]
        trainable = [p for p in primals if p.requires_grad]
        outputs = forward(*primals)
        differentiable = [o for o in outputs if o.requires_grad]
        if not trainable or not differentiable:
            with torch.no_grad():
                return _plan_seconds(make_fx(forward, decomposition_table=_decompositions())(*primals))

        def joint(primals: list[torch.Tensor], tangents: list[torch.Tensor]):
            outs = forward(*primals)
            grads = torch.autograd.grad([o for o in outs if o.requires_grad], [p for p in primals if p.requires_grad],
                                        tangents, allow_unused=True)
            return outs, [g for g in grads if g is not None]

        tangents = [torch.empty_like(o) for o in differentiable]
        graph = make_fx(joint, decomposition_table=_decompositions())(primals, tangents)
    forward_graph, backward_graph = min_cut_rematerialization_partition(graph, [primals, tangents],
                                                                        num_fwd_outputs=len(outputs))
    return _plan_seconds(forward_graph) + _plan_seconds(backward_graph)


def _decompositions() -> dict:
    from torchneuron.compiler.decompositions import for_compile_fx
    return for_compile_fx()


@lru_cache(maxsize=512)
def _kernel_cheaper(kind: str, generic: Callable, kernel: Callable, signatures: tuple[Signature, ...],
                    constants: tuple, target: str) -> bool:
    return traced_seconds(kernel, signatures, constants) < traced_seconds(generic, signatures, constants)


def signature(tensor: torch.Tensor) -> Signature:
    return tuple(int(s) for s in tensor.shape), tensor.dtype, bool(tensor.requires_grad)


def kernel_chosen(kind: str, generic: Callable[..., Any], kernel: Callable[..., Any],
                  tensors: Sequence[torch.Tensor], constants: tuple = ()) -> bool:
    """Whether a matched site of `kind` becomes the kernel: `kernel(*tensors, *constants)`
    instead of `generic(*tensors, *constants)` (the site's computation as the model wrote it).
    `tensors` are the site's example values (fake tensors of Dynamo's graph)."""
    chosen = mode()
    if chosen != "price":
        return chosen == "on"
    return _kernel_cheaper(kind, generic, kernel, tuple(signature(t) for t in tensors), constants,
                           get_target().name)
