"""Fixtures of the profiler tests: the profiler is installed, the target is trn2, and a helper
profiles a function with torch.profiler (CPU + PrivateUse1 activities)."""
import sys
import warnings
from typing import Callable

import pytest
from torch.profiler import ProfilerActivity, profile

import torchneuron.profiler as neuron_profiler
from torchneuron.hardware import targets

ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]


@pytest.fixture(autouse=True)
def _trn2():
    previous = targets.get_target()
    targets.set_target("trn2")
    yield
    targets.set_target(previous.name)


def here() -> int:
    """The caller's line number (to assert that events point at it)."""
    return sys._getframe(1).f_lineno


def run_profiled(fn: Callable[[], object], **kwargs) -> profile:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with profile(activities=ACTIVITIES, **kwargs) as prof:
            fn()
    return prof


@pytest.fixture
def profiled() -> Callable[..., profile]:
    assert neuron_profiler.installed()
    return run_profiled
