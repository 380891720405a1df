"""Shared fixtures: the neuron device is registered by `import torch` (entry point) or here."""
import pytest
import torch

import torchneuron  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)


@pytest.fixture
def neuron() -> torch.device:
    return torch.device("neuron")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
