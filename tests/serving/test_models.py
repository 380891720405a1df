"""More architectures on the neuron platform: Qwen3 (with vLLM's ngram speculative decoding, which
must not change greedy tokens), Qwen2 (biased QKV projections), Mistral and Mixtral (MoE), each
greedy-equal to transformers' generate."""
from __future__ import annotations

import pytest
import torch

from tests.serving.conftest import hf_greedy
from tests.serving.engine import in_process_llm, metric

# Repetitive prompts give the ngram proposer matches to draft from.
PROMPTS = ["one two three one two three one two three one two", "Hello, how are you today? Hello, how are"]

CONFIGS = {
    "qwen3": dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                      "prompt_lookup_min": 1}),
    "mixtral": {},
    "qwen2": {},
    "mistral": {},
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def engine(request, tiny_model):
    model = tiny_model(request.param, torch.float32)
    with in_process_llm(model, dtype="float32", **CONFIGS[request.param]) as (llm, _):
        yield request.param, llm, model


def test_greedy_matches_hf_generate(engine):
    from vllm import SamplingParams

    kind, llm, model = engine
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(model, PROMPTS, 16, torch.float32)
    if kind == "qwen3":  # the drafts were really proposed and verified
        assert metric(llm, "vllm:spec_decode_num_draft_tokens") > 0
