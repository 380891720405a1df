"""Tensor parallelism across neuron:0 and neuron:1 (vLLM's worker processes over the `neuron` c10d
backend): the same greedy tokens as transformers' generate."""
from __future__ import annotations

import pytest
import torch

from tests.serving.conftest import hf_greedy
from tests.serving.engine import in_process_llm

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]


def test_tp2_greedy_matches_hf_generate(tiny_model):
    from vllm import SamplingParams

    if torch.neuron.device_count() < 2:
        pytest.skip("needs two neuron devices (TORCHNEURON_DEVICE_COUNT=2)")
    model = tiny_model("llama", torch.float32)
    prompts = ["Hello, how are you", "The quick brown fox"]
    with in_process_llm(model, dtype="float32", tensor_parallel_size=2) as (llm, _):
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(model, prompts, 12, torch.float32)
