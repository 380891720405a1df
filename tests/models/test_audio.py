"""Whisper (log-mel features built in the test) trains and transcribes on neuron as on the CPU
(checks: zoo_checks.py). Its adaptive and compiled cases run with
`pytest tests/models/test_audio.py --zoo-full`."""
import pytest

pytest.importorskip("transformers")

from .zoo_checks import cases, check  # noqa: E402

SUBSETS = {"bf16": {"whisper": False}}


@pytest.mark.parametrize("name,mode", cases("audio", SUBSETS))
def test_trains_and_transcribes_as_on_cpu(name, mode, record_property):
    check(name, mode, record_property)
