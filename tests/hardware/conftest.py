"""Fixtures of the hardware tests: every test starts and ends on the environment's target."""
import pytest

from torchneuron.hardware import targets


@pytest.fixture(autouse=True)
def _restore_target():
    previous = targets.get_target()
    yield
    targets.set_target(previous.name)
