"""Small models and data shared by the parallelism tests; each test compares ranks with a
single-process reference built from these."""
import torch
import torch.nn as nn


def mlp(width: int = 32, depth: int = 3, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(16, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


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
