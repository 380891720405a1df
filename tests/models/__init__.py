"""Small models shared by test files: each test compares the neuron device (eager, adaptive eager
or compiled) with the CPU on the same model, built from the same seed."""
from __future__ import annotations

import torch
import torch.nn.functional as F


class GeluMLP(torch.nn.Module):
    """Linear -> GELU -> (LayerNorm) -> Linear."""

    def __init__(self, d_in: int = 16, hidden: int = 32, d_out: int = 4, norm: bool = True) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(d_in, hidden), torch.nn.Linear(hidden, d_out)
        self.norm = torch.nn.LayerNorm(hidden) if norm else torch.nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.norm(F.gelu(self.fc1(x))))
