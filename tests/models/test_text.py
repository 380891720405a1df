"""Text models of the zoo (Llama, Qwen3, Gemma 3, Phi-3, GPT-OSS, DeepSeek-V3 with MLA) train and
generate on neuron as on the CPU (checks: zoo_checks.py). The cases SUBSETS omits run with
`pytest tests/models/test_text.py --zoo-full`."""
import pytest

pytest.importorskip("transformers")

from .zoo_checks import cases, check  # noqa: E402

# GPT-OSS compiled (transformers' MoE experts, now compiled through torchneuron::grouped_mm) takes
# ~10 min on a loaded 2-core host: it runs with --zoo-full; tests/compiler/test_patterns_moe.py
# covers the compiled experts in the default run.
SUBSETS = {"bf16": {"llama": False, "gemma3": False, "deepseek_v3": False}, "adaptive": {"qwen3": True},
           "compiled": {"llama": True, "qwen3": True}}


@pytest.mark.parametrize("name,mode", cases("text", SUBSETS))
def test_trains_and_generates_as_on_cpu(name, mode, record_property):
    check(name, mode, record_property)
