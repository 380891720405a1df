"""State-space models of the zoo (Mamba2, the Jamba hybrid, Falcon-Mamba) train and generate on
neuron as on the CPU (checks: zoo_checks.py). The cases SUBSETS omits run with
`pytest tests/models/test_state_space.py --zoo-full`."""
import pytest

pytest.importorskip("transformers")

from .zoo_checks import cases, check  # noqa: E402

SUBSETS = {"bf16": {"mamba2": False, "jamba": False}}


@pytest.mark.parametrize("name,mode", cases("state-space", SUBSETS))
def test_trains_and_generates_as_on_cpu(name, mode, record_property):
    check(name, mode, record_property)
