"""bfloat16 serving numerics: greedy tokens of the neuron platform equal those of vLLM's stock CPU
platform on the same model (the kernels round where the CPU platform's PyTorch-native RMSNorm and
SiLU-and-mul do; see kernels.py). Not transformers' generate: its attention (SDPA over the whole
sequence) rounds differently from paged attention in bf16, and greedy tokens part after a few steps.

Decode steps here run vLLM's paged-attention kernel, as on the CPU platform: the default decode
path, the NKI decode-attention kernel, multiplies V by softmax weights rounded to bf16 as the
Tensor engine takes them (tests/nki/test_decode_attention.py checks it against its reference), so
its greedy tokens may part from the CPU platform's after some steps."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.serving.engine import in_process_llm, kill_session

PROMPTS = ["Hello, how are you", "The quick brown fox", "Paged attention reads the KV cache",
           "0123456789 one two three"]
TOKENS = 24
_CPU_RUN = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], dtype="bfloat16", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=1 << 26,
              enforce_eager=True, seed=0)
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=int(sys.argv[3]),
                                                                ignore_eos=True), use_tqdm=False)
    print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
"""


def _cpu_platform_greedy(model: str) -> list[list[int]]:
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    # a session of its own, killed whole afterwards: the engine-core process vLLM starts must not outlive the run
    proc = subprocess.Popen([sys.executable, "-c", _CPU_RUN, model, json.dumps(PROMPTS), str(TOKENS)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        kill_session(proc)
    lines = [line for line in stdout.splitlines() if line.startswith("TOKENS ")]
    assert lines, f"vLLM's CPU platform run failed:\n{stderr[-3000:]}"
    return json.loads(lines[-1][len("TOKENS "):])


@pytest.mark.slow
def test_bf16_greedy_tokens_equal_vllm_cpu_platform(tiny_model, monkeypatch):
    from vllm import SamplingParams

    from torchneuron.serving.llm import kernels

    # the NKI decode kernel refuses caches not laid out for DECODE_ISA: decode falls back to vLLM's kernel
    monkeypatch.setattr(kernels, "DECODE_ISA", "none")

    model = tiny_model("llama", torch.bfloat16)
    with in_process_llm(model, dtype="bfloat16", enforce_eager=True) as (llm, _):
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
                            use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == _cpu_platform_greedy(model)
