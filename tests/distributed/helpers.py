"""Small models and data shared by the parallelism tests; each test compares ranks with a
single-process reference built from these."""
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F


def mlp(width: int = 32, depth: int = 3, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def norm_mlp(seed: int = 0) -> nn.Sequential:
    """Linear -> ReLU -> Linear -> LayerNorm -> Linear, 16 features in and 4 out."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def batch(step: int, rank: int, rows: int = 8, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of one rank at one step (deterministic, different per rank and step)."""
    generator = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(rows, 16, generator=generator)
    y = torch.randn(rows, 4, generator=generator)
    return x.to(device), y.to(device)


def cpu_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Full (unsharded) parameters on the CPU, DTensors gathered."""
    out = {}
    for name, param in module.named_parameters():
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = full.detach().float().cpu()
    return out


def cpu_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in module.named_parameters():
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        out[name] = grad.detach().float().cpu()
    return out


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest elementwise difference over matching entries (keys must match)."""
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


def sgd_reference(steps: int, set_grads: Callable[[nn.Module, int, list], None]) -> dict:
    """Single-process SGD (lr 0.1) of `mlp()`: each step, `set_grads(model, step, losses)` gives the
    parameters the gradients the parallel run must reach (appending `(rank, loss)` to `losses`).
    Returns the losses, the first step's gradients and the final parameters."""
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"losses": []}
    for step in range(steps):
        set_grads(model, step, out["losses"])
        if step == 0:
            out["grads"] = cpu_grads(model)
        optimizer.step()
        optimizer.zero_grad()
    out["params"] = cpu_state(model)
    return out


def data_parallel_reference(world: int, steps: int, accumulate: int = 1) -> dict:
    """What data-parallel training over `world` ranks must give (`sgd_reference`): every rank's
    batches (`accumulate` micro-batches a step), gradients averaged over the ranks."""
    def set_grads(model: nn.Module, step: int, losses: list) -> None:
        for micro in range(accumulate):
            for rank in range(world):
                x, y = batch(step * accumulate + micro, rank)
                loss = F.mse_loss(model(x), y) / accumulate
                (loss / world).backward()  # DDP averages gradients over ranks
                losses.append((rank, loss.item()))
    return sgd_reference(steps, set_grads)
