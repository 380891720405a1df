"""Rank pools shared by the multi-process tests: each rank imports torch once per session."""
import pytest

from torchneuron.distributed import RankPool


@pytest.fixture(scope="session")
def pool2():
    with RankPool(2) as pool:
        yield pool


@pytest.fixture(scope="session")
def pool4():
    with RankPool(4) as pool:
        yield pool
