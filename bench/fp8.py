"""FP8 and mixture-of-experts on the modeled NeuronCore, measured in one process.

Prints, with the machine line first:
1. the modeled device time of a transformer training step (tiny Llama, AdamW) in bf16 and with
   torchao's float8 training recipe (tensor-wise scales) on trn2 and trn3, and their ratio;
2. the modeled time of a mixture-of-experts layer (Mixtral's sparse block, forward + backward)
   with transformers' eager per-expert loop vs its grouped_mm experts, and their ratio;
3. the host wall time of the same fp8 step on neuron over CPU (median of per-round ratios),
   which measures the software NeuronCore's overhead, not Trainium.

    python bench/fp8.py [--dim 512] [--layers 2] [--tokens 512] [--rounds 3]
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
import transformers
from torchao.float8 import convert_to_float8_training

import torchneuron  # noqa: F401
from machine import describe
from torchneuron.hardware import estimate


def llama(dim: int, layers: int) -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=dim, intermediate_size=4 * dim,
                                      num_hidden_layers=layers, num_attention_heads=dim // 64,
                                      num_key_value_heads=dim // 64, max_position_embeddings=2048)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def make_step(model: torch.nn.Module, device: str, tokens: int):
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 1024, (2, tokens // 2), generator=torch.Generator().manual_seed(1)).to(device)

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def fp8(model: torch.nn.Module) -> torch.nn.Module:
    return convert_to_float8_training(model, module_filter_fn=lambda m, fqn: "lm_head" not in fqn)


def modeled(step, target: str) -> float:
    step()  # warm-up: optimizer state, first-call paths
    with estimate(target) as e:
        step()
    return e.device_time_s


def moe_layer(impl: str, dim: int, tokens: int):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=dim, intermediate_size=2 * dim, num_local_experts=8,
                                        num_experts_per_tok=2, experts_implementation=impl)
    block = transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock(config).to(torch.bfloat16)
    block = block.to("neuron")
    x = torch.randn(1, tokens, dim, dtype=torch.bfloat16).to("neuron").requires_grad_()

    def step() -> None:
        out = block(x)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()

    return step


def host_seconds(step) -> float:
    start = time.perf_counter()
    step()
    torch.neuron.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    print(describe())
    base = llama(args.dim, args.layers)
    print(f"\n1. training step, Llama dim {args.dim} x {args.layers} layers, {args.tokens} tokens (modeled device time)")
    for target in ("trn2", "trn3"):
        bf16 = modeled(make_step(copy.deepcopy(base), "neuron", args.tokens), target)
        f8 = modeled(make_step(fp8(copy.deepcopy(base)), "neuron", args.tokens), target)
        print(f"   {target}: bf16 {bf16 * 1e3:8.3f} ms   fp8 {f8 * 1e3:8.3f} ms   bf16/fp8 = {bf16 / f8:.2f}x")

    print(f"\n2. Mixtral MoE layer (8 experts, top-2, {args.tokens} tokens), forward + backward, trn2")
    loop = modeled(moe_layer("eager", args.dim, args.tokens), "trn2")
    grouped = modeled(moe_layer("grouped_mm", args.dim, args.tokens), "trn2")
    print(f"   eager loop {loop * 1e3:.3f} ms   grouped_mm {grouped * 1e3:.3f} ms   loop/grouped = {loop / grouped:.2f}x")

    print(f"\n3. host wall time of the fp8 step, neuron over cpu (median of {args.rounds} rounds, interleaved)")
    cpu_step = make_step(fp8(copy.deepcopy(base)), "cpu", args.tokens)
    neuron_step = make_step(fp8(copy.deepcopy(base)), "neuron", args.tokens)
    cpu_step(), neuron_step()  # warm-up
    ratios = [host_seconds(neuron_step) / host_seconds(cpu_step) for _ in range(args.rounds)]
    print(f"   neuron/cpu = {statistics.median(ratios):.2f}x")


if __name__ == "__main__":
    main()
