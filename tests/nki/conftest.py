"""Shared fixtures for the NKI simulator tests."""
import numpy as np
import pytest
import torch  # noqa: F401  (import torch before torchneuron, as users do)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)
