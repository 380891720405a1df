"""Serving throughput on the same tiny model: vLLM on the neuron plugin vs vLLM's stock CPU platform
vs sequential transformers `generate`, at 1, 8, 32 and 64 concurrent requests, in one run.

Each vLLM platform runs in a child process of its own (a process picks one platform), offline and
in-process (`LLM.generate` of N requests at once, 64 output tokens each, after a warm-up); both
eager (`enforce_eager`), so the difference is the device layer alone. Prints output tokens/s as
ratios (neuron / vLLM-CPU, neuron / sequential generate), and the modeled trn2 TPOT of the neuron
run at batch 1 and 32.

    python bench/serving.py [--tokens 64] [--concurrency 1 8 32 64]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

KV_CACHE_BYTES = 1 << 27  # 128 MiB: 64 sequences of 256 tokens of the tiny model fit many times over
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _prompts(n: int) -> list[str]:
    return [f"Request {i}: the quick brown fox jumps over the lazy dog" for i in range(n)]


def child(platform: str, model: str, tokens: int, concurrency: list[int]) -> None:
    """Runs in the child process: tokens/s per concurrency (and modeled TPOT on neuron)."""
    from vllm import LLM, SamplingParams

    timing_dir = os.environ.get("TORCHNEURON_SERVING_TIMING_DIR")
    # the same KV cache on both platforms (a share of memory means different sizes on each)
    llm = LLM(model, max_model_len=256, max_num_seqs=max(concurrency), kv_cache_memory_bytes=KV_CACHE_BYTES,
              enforce_eager=True, seed=0, dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(_prompts(2), params, use_tqdm=False)  # warm-up
    result = {"platform": platform, "tokens_per_s": {}, "tpot_s": {}}
    for n in concurrency:
        start = time.perf_counter()
        outs = llm.generate(_prompts(n), params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        result["tokens_per_s"][n] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
        result["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        if timing_dir:
            from torchneuron.serving.llm.timing import TimingReader

            reader = TimingReader(timing_dir)
            mine = [reader.for_request(o.request_id) for o in outs]
            decode = sum(r["decode_s"] for r in mine)
            result["tpot_s"][n] = decode / sum(r["output_tokens"] - 1 for r in mine)
    print("RESULT " + json.dumps(result), flush=True)


def run_child(platform: str, model: str, tokens: int, concurrency: list[int]) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    if platform == "cpu":
        env["VLLM_TARGET_DEVICE"] = "cpu"
    else:
        env["TORCHNEURON_SERVING_TIMING_DIR"] = tempfile.mkdtemp(prefix="bench-serving-")
        env["TORCHNEURON_TARGET"] = "trn2"
    cmd = [sys.executable, __file__, "--child", platform, "--model", model, "--tokens", str(tokens),
           "--concurrency", *map(str, concurrency)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[7:])
            result["tokens_per_s"] = {int(k): v for k, v in result["tokens_per_s"].items()}
            result["tpot_s"] = {int(k): v for k, v in result["tpot_s"].items()}
            return result
    raise RuntimeError(f"{platform} run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def hf_sequential(model: str, tokens: int, requests: int = 4) -> float:
    """Output tokens/s of transformers' generate, one request after another, on the CPU."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    prompts = _prompts(requests)
    hf.generate(tok(prompts[0], return_tensors="pt").input_ids, max_new_tokens=4, do_sample=False)  # warm-up
    start = time.perf_counter()
    produced = 0
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        out = hf.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        produced += out.shape[1] - ids.shape[1]
    return produced / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--child", choices=["neuron", "cpu"])
    parser.add_argument("--model")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.model, args.tokens, args.concurrency)
        return

    import torch

    from bench.machine import describe
    from tests.serving import tiny_models

    print("machine:", describe())
    model = tiny_models.build(tempfile.mkdtemp(prefix="bench-serving-model-"), "llama", torch.bfloat16)
    neuron = run_child("neuron", model, args.tokens, args.concurrency)
    cpu = run_child("cpu", model, args.tokens, args.concurrency)
    hf = hf_sequential(model, args.tokens)
    print(f"tiny Llama (hidden 64, 2 layers), {args.tokens} output tokens per request, eager, bf16")
    print(f"{'concurrent':>10} {'neuron/vLLM-CPU':>16} {'neuron/sequential generate':>27}")
    for n in args.concurrency:
        t = neuron["tokens_per_s"][n]
        print(f"{n:>10} {t / cpu['tokens_per_s'][n]:>15.2f}x {t / hf:>26.2f}x")
    same = sum(a == b for a, b in zip(neuron["tokens"], cpu["tokens"]))
    print(f"greedy tokens equal to vLLM-CPU's (bf16): {same} of {len(cpu['tokens'])} requests")
    for n in (1, 32):
        if n in neuron["tpot_s"]:
            print(f"modeled trn2 TPOT at batch {n}: {neuron['tpot_s'][n] * 1e6:.1f} us")


if __name__ == "__main__":
    main()
