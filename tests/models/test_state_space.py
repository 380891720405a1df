"""State-space models of the zoo (Mamba2, the Jamba hybrid, Falcon-Mamba) train and generate on
neuron as on the CPU (checks: zoo_checks.py). The cases marked FULL run with
`pytest tests/models/test_state_space.py --zoo-full`."""
import pytest

pytest.importorskip("transformers")

from .zoo_checks import FULL, GROUPED_MM_FALLBACK, cases, check  # noqa: E402

SUBSETS = {"bf16": {"mamba2": False, "jamba": False, "falcon_mamba": FULL},
           "adaptive": {"mamba2": FULL, "jamba": FULL, "falcon_mamba": FULL},
           "compiled": {"mamba2": FULL, "jamba": FULL, "falcon_mamba": FULL}}
XFAILS = {("jamba", "compiled"): GROUPED_MM_FALLBACK}


@pytest.mark.parametrize("name,mode", cases("state-space", SUBSETS, XFAILS))
def test_trains_and_generates_as_on_cpu(name, mode, record_property):
    check(name, mode, record_property)
