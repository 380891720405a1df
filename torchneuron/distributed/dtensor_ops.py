"""DTensor's list ops on neuron: foreach and fused optimizer steps over parameters of any parallelism.

Optimizers, `clip_grad_norm_` and GradScaler group tensors by device and dtype only, so a model that is
partly tensor-parallel (a norm or a head left unsharded, FSDP2's ignored parameters, a pipeline stage)
hands one `torch._foreach_*` / `torch._fused_*` call a list that mixes DTensors and plain tensors, and
DTensor rejects it ("got mixed torch.Tensor and DTensor"). On CUDA that list only appears with
`foreach=True`; on neuron foreach is the default (as on CUDA), so the plain `torch.optim.SGD(...)` a
user writes broke. The handler installed here runs such a call as one call: each index whose tensors
are all plain becomes a replicated DTensor over the same memory (no copy, no communication: every op
in these lists works index by index, and a replicated index computes locally exactly what the plain op
computes), and those indices' outputs come back as plain tensors. Calls without the mix, and calls on
other devices, run DTensor's own dispatch unchanged.

It also gives DTensor the sharding rule it lacks for fused SGD and Adagrad and for `_foreach_copy_`
(all index-wise pointwise, like the fused Adam ops DTensor already covers), so `fused=True` and Rprop's
foreach step work on FSDP2 and TP parameters.

`install()` also installs DTensor's RNG tracker for neuron meshes (dtensor_random.py).
`install_when_loaded()` defers all of this until torch.distributed.tensor is imported (DTensor's import
costs seconds that DDP-only jobs need not pay).
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import threading
from typing import Any

import torch

_MODULE = "torch.distributed.tensor"
_POINTWISE = ("_fused_sgd_.default", "_fused_sgd_.tensor_lr", "_fused_sgd.default", "_fused_sgd.tensor_lr",
              "_fused_adagrad_.default", "_fused_adagrad_.tensor_lr", "_fused_adagrad.default",
              "_fused_adagrad.tensor_lr", "_foreach_copy_.default", "_foreach_copy.default")
_lock = threading.RLock()  # the handler steps aside while DTensor's own dispatch runs a call
_installed = False


def _list_ops() -> list[torch._ops.OpOverload]:
    """Every aten foreach and fused-optimizer overload that takes a list of tensors."""
    ops = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith(("aten::_foreach_", "aten::_fused_")):
            continue
        base, _, overload = name[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, base), overload or "default", None)
        if op is not None and any(str(a.type).startswith("List[Tensor") for a in op._schema.arguments):
            ops.append(op)
    return ops


def _tensor_lists(values: Any) -> list[list]:
    return [v for v in values if isinstance(v, (list, tuple)) and v and isinstance(v[0], torch.Tensor)]


def _run_default(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    from torch.distributed.tensor import DTensor

    handlers = DTensor._op_dispatcher._custom_op_handlers
    with _lock:
        mine = handlers.pop(op, None)
        try:
            return op(*args, **kwargs)
        finally:
            if mine is not None:
                handlers[op] = mine


def _mixed_list_handler(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    from torch.distributed.tensor import DTensor, Replicate

    lists = _tensor_lists([*args, *kwargs.values()])
    flat = [t for tensors in lists for t in tensors if isinstance(t, torch.Tensor)]
    first = next((t for t in flat if isinstance(t, DTensor)), None)
    if (first is None or all(isinstance(t, DTensor) for t in flat)
            or any(t.device.type != "neuron" for t in flat)):
        return _run_default(op, args, kwargs)
    length = len(lists[0])
    plain = {i for i in range(length)
             if not any(i < len(tensors) and isinstance(tensors[i], DTensor) for tensors in lists)}
    mesh = first.device_mesh
    placements = [Replicate()] * mesh.ndim

    list_ids = {id(tensors) for tensors in lists}

    def lift(value: Any) -> Any:
        if id(value) not in list_ids:
            return value
        return [DTensor.from_local(t, mesh, placements, run_check=False) if i in plain else t
                for i, t in enumerate(value)]

    result = _run_default(op, tuple(lift(a) for a in args), {k: lift(v) for k, v in kwargs.items()})
    return _lower(result, plain, length)


def _lower(result: Any, plain: set[int], length: int) -> Any:
    """Outputs at the plain indices back to plain tensors (they are replicated: their local value)."""
    from torch.distributed.tensor import DTensor

    if isinstance(result, (list, tuple)) and len(result) == length and all(
            isinstance(t, torch.Tensor) for t in result):
        return type(result)(t.to_local() if i in plain and isinstance(t, DTensor) else t
                            for i, t in enumerate(result))
    if isinstance(result, (list, tuple)):
        return type(result)(_lower(r, plain, length) for r in result)
    return result


def install() -> None:
    """Registers the mixed-list handler and the missing pointwise rules with DTensor, and the RNG
    tracker of neuron meshes (dtensor_random.py) (idempotent)."""
    global _installed
    if _installed:
        return
    from torchneuron.distributed import dtensor_random

    dtensor_random.install()
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._ops._pointwise_ops import _register_single_dim_pointwise

    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in _list_ops():
        handlers.setdefault(op, _mixed_list_handler)  # DTensor's own handlers (the AMP unscale one) stay
    for name in _POINTWISE:
        base, overload = name.split(".")
        _register_single_dim_pointwise(getattr(getattr(torch.ops.aten, base), overload))
    _installed = True


class _AfterImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Runs `install()` right after torch.distributed.tensor finishes importing (one shot)."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        self._loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self._loader.exec_module(module)
        install()


def install_when_loaded() -> None:
    """`install()` now if DTensor is loaded, else as soon as it is."""
    if _MODULE in sys.modules:
        install()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
