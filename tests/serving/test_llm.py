"""vLLM's offline `LLM` on the neuron platform with a tiny random Llama (fp32): greedy tokens equal
transformers' generate on the CPU, and the engine features a user relies on (continuous batching,
chunked prefill, prefix caching, preemption, the sampling parameters) behave as vLLM specifies.
One engine for the module: the KV cache is kept small on purpose (12 blocks of 32 tokens), so a
full batch must preempt, and the token budget per step (64) makes long prompts prefill in chunks."""
from __future__ import annotations

import pytest
import torch

from tests.serving.conftest import hf_greedy
from tests.serving.engine import in_process_llm, metric

PROMPTS = ["Hello, how are you", "The quick brown fox", "Paged attention reads the KV cache",
           " ".join(["Trainium serves large language models with vLLM on the neuron device."] * 6)]  # > 64 tokens


@pytest.fixture(scope="module")
def engine(tiny_model):
    model = tiny_model("llama", torch.float32)
    with in_process_llm(model, dtype="float32", num_gpu_blocks_override=12, max_num_batched_tokens=64,
                        enable_prefix_caching=True) as (llm, timing_dir):
        yield llm, model, timing_dir


def _greedy(max_tokens: int, **kw):
    from vllm import SamplingParams

    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_greedy_matches_hf_generate(engine):
    llm, model, _ = engine
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _greedy(20))]
    assert [list(t) for t in tokens] == hf_greedy(model, PROMPTS, 20, torch.float32)


def test_decode_steps_run_the_nki_decode_attention_kernel(engine):
    import warnings

    from torchneuron.hardware import timeline as device_timeline

    llm, model, _ = engine
    entries = []
    device_timeline.add_listener(entries.append)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", UserWarning)  # no fallback from the NKI kernel
            out = llm.generate(PROMPTS[:2], _greedy(4))
        device_timeline.flush_pending()
    finally:
        device_timeline.remove_listener(entries.append)
    names = [e.name for e in entries]
    layers = 2  # tiny_models: num_hidden_layers
    assert names.count("nki_kernels::decode_attention") >= 3 * layers  # the 3 decode steps after the prefill
    assert all(len(o.outputs[0].token_ids) == 4 for o in out)


def test_full_batch_preempts_and_still_matches_each_request_alone(engine):
    llm, _, _ = engine
    prompts = [f"{i} one two three four five six seven eight nine ten {i}" for i in range(8)]
    alone = [llm.generate([p], _greedy(48))[0].outputs[0].token_ids for p in prompts[:2]]
    before = metric(llm, "vllm:num_preemptions")
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(48))]
    assert metric(llm, "vllm:num_preemptions") > before  # 8 x ~70 tokens need more than 12 x 32 slots
    assert [list(t) for t in together[:2]] == [list(t) for t in alone]


def test_prefix_cache_hits(engine):
    llm, _, _ = engine
    prefix = PROMPTS[3]
    before = metric(llm, "vllm:prefix_cache_hits")
    first = llm.generate([prefix + " first"], _greedy(4))[0]
    second = llm.generate([prefix + " second"], _greedy(4))[0]
    assert metric(llm, "vllm:prefix_cache_hits") - before >= 64  # whole blocks of the shared prefix
    assert second.num_cached_tokens >= 64 and first.outputs[0].token_ids


def test_sampling_parameters(engine):
    from vllm import SamplingParams

    llm, _, _ = engine
    prompt = [PROMPTS[0]]
    greedy = llm.generate(prompt, _greedy(12))[0].outputs[0].token_ids
    # top_k=1 and min_p=1 keep only the most likely token: greedy at any temperature
    assert llm.generate(prompt, SamplingParams(temperature=1.5, top_k=1, max_tokens=12, ignore_eos=True,
                                               seed=3))[0].outputs[0].token_ids == greedy
    assert llm.generate(prompt, SamplingParams(temperature=1.5, min_p=1.0, max_tokens=12, ignore_eos=True,
                                               seed=3))[0].outputs[0].token_ids == greedy
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=1234, ignore_eos=True)
    a, b = (llm.generate(prompt, seeded)[0].outputs[0].token_ids for _ in range(2))
    assert a == b and a != greedy  # a seed reproduces; sampling differs from greedy
    several = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=7, ignore_eos=True))[0]
    assert len(several.outputs) == 3 and all(len(o.token_ids) == 8 for o in several.outputs)
    assert len({tuple(o.token_ids) for o in several.outputs}) > 1
    # logprobs: the greedy token is the most likely of those returned
    out = llm.generate(prompt, _greedy(5, logprobs=3))[0].outputs[0]
    for token, logprobs in zip(out.token_ids, out.logprobs):
        assert len(logprobs) >= 3 and max(logprobs, key=lambda t: logprobs[t].logprob) == token
    # a stop string ends the text before it; a stop token id ends the tokens at it
    text = llm.generate(prompt, _greedy(12))[0].outputs[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    stopped = llm.generate(prompt, _greedy(12, stop=[stop]))[0].outputs[0]
    assert stop not in stopped.text and text.startswith(stopped.text) and stopped.finish_reason == "stop"
    by_token = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[greedy[3]]))[0]
    assert by_token.outputs[0].token_ids[-1] == greedy[3] and len(by_token.outputs[0].token_ids) <= 4


def test_modeled_time_is_recorded_per_request(engine):
    llm, _, timing_dir = engine
    from torchneuron.serving.llm.timing import TimingReader

    out = llm.generate(["Hello there, modeled time"], _greedy(6))[0]
    record = TimingReader(timing_dir).for_request(out.request_id)
    assert record is not None, f"no timing record for request {out.request_id}"
    assert record["output_tokens"] == 6 and record["target"] == "trn2"
    assert record["ttft_s"] > 0 and record["tpot_s"] > 0
    assert record["tpot_s"] < 1e-2  # a tiny model's decode step on trn2 is microseconds, not host time


def test_modeled_time_read_per_window_equals_per_step(engine, monkeypatch):
    """The clock is read once per window of identical decode steps: every request's record equals
    the one reading the clock at every step gives, with requests that finish at different steps,
    one stopped by a token, one arriving while another decodes (as a server's do) and windows cut
    by WINDOW_STEPS."""
    llm, _, timing_dir = engine
    from vllm import SamplingParams

    from torchneuron.serving.llm import timing

    prompts = ["Windows of decode steps", "A second request", "And a third one", "A late arrival"]
    stop_at = llm.generate(prompts[2:3], _greedy(12))[0].outputs[0].token_ids[6]
    params = [_greedy(5), _greedy(40), SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_at]),
              _greedy(9)]
    engine_ = llm.llm_engine

    def records(run: str) -> list[dict]:
        ids = [f"{run}-{i}" for i in range(len(prompts))]
        for i in range(3):
            engine_.add_request(ids[i], prompts[i], params[i])
        for _ in range(8):  # the batch decodes a while before the last request arrives
            engine_.step()
        engine_.add_request(ids[3], prompts[3], params[3])
        while engine_.has_unfinished_requests():
            engine_.step()
        reader = timing.TimingReader(timing_dir)
        return [reader.for_request(i) for i in ids]

    windowed = records("windowed")
    monkeypatch.setattr(timing, "WINDOW_STEPS", 1)
    per_step = records("per-step")
    assert [r["output_tokens"] for r in windowed] == [r["output_tokens"] for r in per_step] == [5, 40, 7, 9]
    for w, s in zip(windowed, per_step):
        assert w["ttft_s"] == pytest.approx(s["ttft_s"], rel=1e-9)
        assert w["decode_s"] == pytest.approx(s["decode_s"], rel=1e-9) and w["decode_s"] > 0
        assert w["steps"] == s["steps"]
