"""Adaptive eager tests: one Inductor cache directory per session, and every test leaves the
process in plain eager mode."""
import os
import tempfile

import pytest

import torchneuron.eager

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="torchneuron-inductor-"))


@pytest.fixture(autouse=True)
def _eager_afterwards():
    yield
    torchneuron.eager.set_eager_mode("eager")


@pytest.fixture
def adaptive():
    """Adaptive eager mode for the test."""
    torchneuron.eager.set_eager_mode("adaptive")
    yield torchneuron.eager
    torchneuron.eager.set_eager_mode("eager")
