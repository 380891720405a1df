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


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", [pytest.param("gpipe", marks=pytest.mark.slow), "1f1b"])
def test_planned_pipeline_matches_the_real_run(schedule):
    """Two stages of torch.distributed.pipelining over four micro-batches: the plan's replay of the
    schedule against the real backend, where the second stage waits for the first's activations."""
    planned, measured = compare(dict(TINY), {"pp": 2}, seq=32, ranks=2, micro_batches=4, schedule=schedule)
    assert measured > 0
    assert planned == pytest.approx(measured, rel=0.05)
