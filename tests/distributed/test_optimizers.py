"""Every optimizer in torch.optim (for-loop, foreach and, where the CPU has one, fused) trains DDP, FSDP2
and tensor-parallel (DTensor) parameters on two neuron ranks exactly as one CPU process trains the
whole model. The tensor-parallel model keeps a LayerNorm and the head unsharded, so its parameter list
mixes DTensors and plain tensors, the case that broke foreach SGD (`_foreach_add_.List got mixed
torch.Tensor and DTensor`)."""
from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .helpers import batch, norm_mlp

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(300)]

STEPS = 2
ROWS = 4  # per rank

# (name, constructor kwargs); the for-loop, foreach and fused variants are added below
BASE: list[tuple[str, dict[str, Any]]] = [
    ("SGD", {"lr": 0.05}),
    ("SGD", {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("Adam", {"lr": 0.01, "amsgrad": True, "weight_decay": 0.01, "maximize": True}),
    ("AdamW", {"lr": 0.01}),
    ("Adamax", {"lr": 0.01}),
    ("NAdam", {"lr": 0.01, "decoupled_weight_decay": True, "weight_decay": 0.01}),
    ("RAdam", {"lr": 0.01}),
    ("Adagrad", {"lr": 0.05}),
    ("Adadelta", {"lr": 0.5}),
    ("Adafactor", {"lr": 0.01}),
    ("ASGD", {"lr": 0.05}),
    ("RMSprop", {"lr": 0.01, "momentum": 0.5, "centered": True}),
    ("Rprop", {"lr": 0.01}),
]
FUSED = {"SGD", "Adam", "AdamW", "Adagrad"}  # torch.optim classes with a fused CPU kernel


def configs() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for name, kwargs in BASE:
        out += [(name, {**kwargs, "foreach": False}), (name, {**kwargs, "foreach": True})]
        if name in FUSED:
            out.append((name, {**kwargs, "fused": True}))
    return out + [("LBFGS", {"lr": 0.5, "history_size": 3, "max_iter": 2}), ("Muon", {"lr": 0.02})]


def optimizer(name: str, kwargs: dict[str, Any], module: nn.Module) -> torch.optim.Optimizer:
    if name == "Muon":  # Muon updates matrices only; the rest goes to a second optimizer in real use
        params = [p for p in module.parameters() if p.dim() == 2]
        return torch.optim.Muon(params, **kwargs)
    return getattr(torch.optim, name)(module.parameters(), **kwargs)


def train(module: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    for x, y in batches:
        def closure() -> torch.Tensor:
            opt.zero_grad()
            loss = F.mse_loss(module(x), y)
            loss.backward()
            return loss

        opt.step(closure)


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu()
            for name, p in module.named_parameters()}


def _parallel(kind: str, module: nn.Module, device: str) -> nn.Module:
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(module)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    if kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in module:
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh)
        return fully_shard(module, mesh=mesh)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    return parallelize_module(module, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})


def _job(kind: str, cases: list[tuple[str, dict[str, Any]]], device: str = "neuron") -> dict[int, Any]:
    """Each case trained on this rank; the full parameters after STEPS steps, or the error."""
    import traceback

    dist.init_process_group("neuron" if device == "neuron" else "gloo")
    rank = dist.get_rank()
    shard = 0 if kind == "tp" else rank  # tensor-parallel ranks see the same data
    out: dict[int, Any] = {}
    for index, (name, kwargs) in enumerate(cases):
        module = norm_mlp().to(device)
        wrapped = _parallel(kind, module, device)
        try:
            opt = optimizer(name, kwargs, module)
            train(wrapped, opt, [tuple(t.to(device) for t in batch(s, shard, rows=ROWS)) for s in range(STEPS)])
            out[index] = full_params(module)
        except Exception:  # noqa: BLE001  (reported per case)
            out[index] = traceback.format_exc(limit=-4)
    dist.destroy_process_group()
    return out


def _reference(kind: str, name: str, kwargs: dict[str, Any], world: int) -> dict[str, torch.Tensor]:
    """One CPU process over every rank's data (data-parallel ranks' mean loss is the whole batch's)."""
    module = norm_mlp()
    shards = [0] if kind == "tp" else range(world)
    batches = [tuple(torch.cat(parts) for parts in zip(*(batch(s, r, rows=ROWS) for r in shards))) for s in range(STEPS)]
    train(module, optimizer(name, kwargs, module), batches)
    return full_params(module)


CASES = configs()
IDS = [f"{name}-" + "-".join(f"{k}={v}" for k, v in kwargs.items() if k != "lr") for name, kwargs in CASES]
# PyTorch's own DTensor gaps (CUDA and CPU/gloo fail the same way; checked below on CPU/gloo): Adafactor's
# in-place ops on its row/column norms, Rprop's boolean-mask assignment on a sharded gradient, LBFGS's
# torch.cat of a partly tensor-parallel model's flat gradients.
GAPS = {("fsdp2", "Adafactor"): "in-place operations that require placement changes",
        ("tp", "Adafactor"): "in-place operations that require placement changes",
        ("fsdp2", "Rprop"): "aten.index_put_.default: in-place operations",
        ("tp", "Rprop"): "aten.index_put_.default: in-place operations",
        ("tp", "LBFGS"): "aten.cat.default got mixed torch.Tensor and DTensor"}
# Muon orthogonalises in bf16, so sharded matmuls (summing in another order) land within bf16 rounding of
# one process, not within fp32's: these compare with the same parallel run on CPU/gloo instead
VERSUS_GLOO = {"Muon"}


def _cpu_variant(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The CPU/gloo run of a case: CPU's default (for-loop) step, as foreach lists mixing DTensors and
    plain tensors fail there before reaching the gap."""
    return {k: v for k, v in kwargs.items() if k != "foreach"}


@pytest.fixture(scope="module", params=["ddp", "fsdp2", "tp"])
def trained(request, pool2):
    kind = request.param
    on_gloo = [i for i, (name, _) in enumerate(CASES) if (kind, name) in GAPS or name in VERSUS_GLOO]
    neuron = pool2.run(_job, (kind, CASES), timeout=280)
    cases = [(CASES[i][0], _cpu_variant(CASES[i][1])) for i in on_gloo]
    gloo = pool2.run(_job, (kind, cases, "cpu"), timeout=280)[0] if on_gloo else {}
    return kind, neuron, {i: gloo[j] for j, i in enumerate(on_gloo)}


@pytest.mark.parametrize("case", range(len(CASES)), ids=IDS)
def test_optimizer_matches_one_process(trained, case):
    kind, ranks, gloo = trained
    name, kwargs = CASES[case]
    if (kind, name) in GAPS:  # fails on neuron as on CPU/gloo; once PyTorch fixes it, this fails
        message = GAPS[kind, name]
        assert isinstance(gloo[case], str) and message in gloo[case], f"{kind} {name} on CPU/gloo: {gloo[case]}"
        assert all(isinstance(got[case], str) and message in got[case] for got in ranks), ranks[0][case]
        return
    expected = gloo[case] if name in VERSUS_GLOO else _reference(kind, name, kwargs, len(ranks))
    for rank, got in enumerate(ranks):
        result = got[case]
        assert not isinstance(result, str), f"{kind} rank {rank}:\n{result}"
        for key, value in expected.items():
            torch.testing.assert_close(result[key], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"{kind} {key}: {m}")
