"""Vision-language models of the zoo (Qwen2-VL, LLaVA, SigLIP; images are tensors built in the
test) train and infer on neuron as on the CPU (checks: zoo_checks.py). The cases SUBSETS omits run
with `pytest tests/models/test_vision_language.py --zoo-full`."""
import pytest

pytest.importorskip("transformers")

from .zoo_checks import cases, check  # noqa: E402

SUBSETS = {"bf16": {"qwen2_vl": False, "siglip": False}}


@pytest.mark.parametrize("name,mode", cases("vision-language", SUBSETS))
def test_trains_and_infers_as_on_cpu(name, mode, record_property):
    check(name, mode, record_property)
