"""Shared fixtures for the NKI simulator tests."""
import numpy as np
import pytest
import torch  # noqa: F401  (import torch before torchneuron, as users do)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture
def substituting(monkeypatch):
    """A function of `enabled`: sets the compile-kernels switch and returns (backend, counts), a
    backend that runs only the neuron backend's kernel substitution on each captured graph (then
    the graph eagerly) and the list of its per-graph substitution counts."""
    def make(enabled: bool):
        from torchneuron.compiler import patterns

        monkeypatch.setenv("TORCHNEURON_COMPILE_ROPE_CE_KERNELS", "1" if enabled else "0")
        counts: list[dict[str, int]] = []

        def backend(gm, example_inputs):
            counts.append(patterns.substitute(gm))
            return gm.forward

        return backend, counts

    return make
