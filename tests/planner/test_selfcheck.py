"""Self-consistency: a configuration planned and run for real on this host's neuron ranks."""
import pytest

from torchneuron.planner.selfcheck import compare

from tests.planner.conftest import TINY


@pytest.mark.multiprocess
@pytest.mark.parametrize("mesh", [{"fsdp": 2}, {"tp": 2}])
def test_planned_step_matches_the_real_run(mesh):
    planned, measured = compare(dict(TINY), mesh, seq=32, ranks=2)
    assert measured > 0
    assert planned == pytest.approx(measured, rel=0.05)
