"""Shared fixtures (the neuron device is registered by `import torch`, an entry point, or here)
and the order tests run in."""
import os

# `make test` runs two test processes on two cores: each compiles Inductor's C++ in process rather
# than through a pool of compile subprocesses of its own (~10% faster here). Set before torch loads
# Inductor's config.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# CI machines set CI, and PyTorch checks more under it (Inductor refuses implicit fallbacks for ops
# that have a decomposition; functorch raises on aliasing custom ops). Tests run that way everywhere,
# so a local run fails where CI would.
os.environ.setdefault("CI", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchneuron  # noqa: F401  (registers the device even with TORCH_DEVICE_BACKEND_AUTOLOAD=0)


@pytest.fixture
def neuron() -> torch.device:
    return torch.device("neuron")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests first: `make test` spreads test modules over two workers (pytest-xdist,
    `--dist loadscope`) in this order, so the long OpInfo gates start at once instead of
    leaving one worker busy at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
