"""Compiler tests share one Inductor cache directory per session: compiled C++ kernels are
reused across tests, never across sessions (so timings and cache tests start cold)."""
import os
import tempfile

import pytest
import torch

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="torchneuron-inductor-"))


@pytest.fixture
def fresh_dynamo():
    """Forget every compiled frame before and after the test (for tests counting compilations)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
